"""Schemathesis against /openapi.json: no request the schema allows (or breaks) gets a 5xx, and every error
has the one error shape. Bounded examples per operation so CI stays fast."""

from __future__ import annotations

import tempfile
from pathlib import Path

import schemathesis
from hypothesis import HealthCheck, settings

from fusetune.api.app import create_app
from fusetune.config import Settings
from fusetune.db.migrate import upgrade

# Schemathesis collects one test per operation from a schema it loads at import, so the app is built here,
# on a fresh data directory of its own.
_ROOT = Path(tempfile.mkdtemp(prefix="fusetune-fuzz-"))
SETTINGS = Settings(data_dir=_ROOT / "data")
SETTINGS.ensure_dirs()
upgrade(SETTINGS.database_url)
(SETTINGS.models_dir / "tiny").mkdir(exist_ok=True)
(SETTINGS.models_dir / "tiny" / "config.json").write_text("{}")
schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(SETTINGS))


@schema.parametrize()
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors_and_one_error_shape(case):
    response = case.call(headers={"Authorization": f"Bearer {SETTINGS.dev_api_key}"})
    assert response.status_code < 500, (case.method, case.path, response.status_code, response.text)
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
