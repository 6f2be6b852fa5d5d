"""docker-compose.yml starts the same components, with the same commands, as the tests start by hand."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fusetune.config import Settings

COMPOSE = Path(__file__).resolve().parents[1] / "docker-compose.yml"


def test_compose_services_and_commands():
    spec = yaml.safe_load(COMPOSE.read_text())
    services = spec["services"]
    assert {"postgres", "redis", "minio", "minio-bucket", "migrate", "api", "worker"} <= set(services)
    env = services["api"]["environment"]
    assert env["FUSETUNE_DATABASE_URL"].startswith("postgresql+psycopg://")
    assert env["FUSETUNE_BROKER_URL"].startswith("redis://")
    # The same settings everywhere; the API adds how many processes it runs, the worker its serving server.
    shared = services["migrate"]["environment"]
    worker_env = services["worker"]["environment"]
    assert env == {**shared, "FUSETUNE_API_PROCESSES": "2"}
    assert worker_env == {
        **shared,
        **{k: v for k, v in worker_env.items() if k.startswith("FUSETUNE_SERVING_")},
    }
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


def test_the_worker_serves_chat_completions_to_the_api():
    """The worker's chat completions server listens on every interface of its container at a fixed port, and
    advertises an address the API's container reaches: the worker's service name on the compose network, the
    port not published to the host."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    env = services["worker"]["environment"]
    settings = Settings(**{key.removeprefix("FUSETUNE_").lower(): value for key, value in env.items()})
    assert settings.serving and settings.serving_host == "0.0.0.0" and settings.serving_port > 0
    assert settings.serving_public_host == "worker" and "worker" in services
    assert str(settings.serving_port) in services["worker"]["expose"]
    assert "ports" not in services["worker"]


@pytest.mark.skipif(
    shutil.which("docker-compose") is None, reason="docker-compose (Debian package) not installed"
)
def test_compose_file_parses_with_docker_compose():
    result = subprocess.run(
        ["docker-compose", "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
