"""The app in-process on a fresh data directory with one base model ("tiny"), called with the dev key."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from fusetune.api.app import create_app
from fusetune.config import Settings
from fusetune.db.migrate import upgrade
from tests.api.openai_conformance import Recorder

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
    """Every JSON body it receives from an operation of OpenAI's spec is checked against that operation's
    schema when the test ends (tests/api/openai_conformance.py)."""
    recorder = Recorder()
    with TestClient(create_app(settings), headers=AUTH) as client:
        client.event_hooks["response"].append(recorder)
        yield client
    problems = recorder.problems()
    assert not problems, "bodies that OpenAI's spec rejects:\n" + "\n".join(problems)
