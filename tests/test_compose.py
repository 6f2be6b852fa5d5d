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
    assert {"postgres", "redis", "minio", "minio-bucket", "migrate", "api", "worker"} <= set(services)
    env = services["api"]["environment"]
    assert env["FUSETUNE_DATABASE_URL"].startswith("postgresql+psycopg://")
    assert env["FUSETUNE_BROKER_URL"].startswith("redis://")
    # The same settings everywhere; the API adds how many processes it runs.
    assert services["worker"]["environment"] == services["migrate"]["environment"]
    assert env == {**services["worker"]["environment"], "FUSETUNE_API_PROCESSES": "2"}
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia"
    # Files and checkpoints go to the object store; no volume is mounted by more than one service.
    assert (
        env["FUSETUNE_STORAGE_URL"].startswith("s3://")
        and env["FUSETUNE_STORAGE_ENDPOINT"] == "http://minio:9000"
    )
    mounted = [volume.split(":")[0] for service in services.values() for volume in service.get("volumes", [])]
    assert len(mounted) == len(set(mounted)), mounted
    # The bucket the settings name is the one the setup service creates, with MinIO's credentials.
    bucket = env["FUSETUNE_STORAGE_URL"].removeprefix("s3://").split("/")[0]
    assert f"store/{bucket}" in services["minio-bucket"]["entrypoint"][-1]
    minio = services["minio"]["environment"]
    assert (minio["MINIO_ROOT_USER"], minio["MINIO_ROOT_PASSWORD"]) == (
        env["FUSETUNE_STORAGE_ACCESS_KEY_ID"], env["FUSETUNE_STORAGE_SECRET_ACCESS_KEY"])  # fmt: skip
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
