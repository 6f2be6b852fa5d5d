"""docker-compose.yml starts the same components, with the same commands, as the tests start by hand."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

COMPOSE = Path(__file__).resolve().parents[1] / "docker-compose.yml"


def test_compose_services_and_commands():
    spec = yaml.safe_load(COMPOSE.read_text())
    services = spec["services"]
    assert {"postgres", "redis", "migrate", "api", "worker"} <= set(services)
    env = services["api"]["environment"]
    assert env["FUSETUNE_DATABASE_URL"].startswith("postgresql+psycopg://")
    assert env["FUSETUNE_BROKER_URL"].startswith("redis://")
    # The same settings everywhere; the API adds how many processes it runs.
    assert services["worker"]["environment"] == services["migrate"]["environment"]
    assert env == {**services["worker"]["environment"], "FUSETUNE_API_PROCESSES": "2"}
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia"
    # api and worker share the data volume (uploads, runs, checkpoints).
    assert "data:/data" in services["api"]["volumes"] and "data:/data" in services["worker"]["volumes"]
    for name in ("migrate", "api", "worker"):
        command = services[name]["command"]
        assert command[0] == "fusetune"
        result = subprocess.run(
            [sys.executable, "-m", "fusetune.cli", *command[1:2], "--help"], capture_output=True
        )
        assert result.returncode == 0, result.stderr


@pytest.mark.skipif(
    shutil.which("docker-compose") is None, reason="docker-compose (Debian package) not installed"
)
def test_compose_file_parses_with_docker_compose():
    result = subprocess.run(
        ["docker-compose", "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
