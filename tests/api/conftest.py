"""The app in-process on a fresh data directory with one base model ("tiny"), called with the dev key."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from fusetune.api.app import create_app
from fusetune.config import Settings
from fusetune.db.migrate import upgrade

AUTH = {"Authorization": f"Bearer {Settings().dev_api_key}"}


@pytest.fixture
def settings(tmp_path) -> Settings:
    settings = Settings(data_dir=tmp_path / "data")
    settings.ensure_dirs()
    upgrade(settings.database_url)
    model = settings.models_dir / "tiny"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return settings


@pytest.fixture
def client(settings) -> TestClient:
    with TestClient(create_app(settings), headers=AUTH) as client:
        yield client
