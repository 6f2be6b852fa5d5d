"""docker-compose.yml starts the same components, with the same commands, as the tests start by hand."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fusetune.config import Settings

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"


def test_compose_services_and_commands():
    spec = yaml.safe_load(COMPOSE.read_text())
    services = spec["services"]
    # What a plain `docker compose up` starts; the rest is behind a profile.
    default = {name for name, service in services.items() if "profiles" not in service}
    assert default == {"postgres", "redis", "minio", "minio-bucket", "migrate", "api", "worker"}
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
    for name in ("migrate", "api", "worker", "worker-ray"):
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


def test_the_ray_profile_is_a_cluster_of_the_image_that_a_worker_submits_to():
    """`docker compose --profile ray up --scale worker=0` (README, "One job on several nodes: Ray"): a head and a
    GPU node started with the README's `ray start` commands, every node with the services' settings (each stages
    runs into its own data directory and reads its own models), and `worker`'s twin with FUSETUNE_RAY_ADDRESS at
    the head's Job Submission API."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    ray_services = {name for name, service in services.items() if "profiles" in service}
    assert ray_services == {"ray-head", "ray-worker", "worker-ray"}
    assert all(services[name]["profiles"] == ["ray"] for name in ray_services)
    shared = services["migrate"]["environment"]
    head, node, worker = services["ray-head"], services["ray-worker"], services["worker-ray"]
    assert head["command"] == ["ray", "start", "--head", "--dashboard-host=0.0.0.0", "--block"]
    assert node["command"] == ["ray", "start", "--address=ray-head:6379", "--block"]
    assert head["environment"] == node["environment"] == shared
    assert shared["FUSETUNE_STORAGE_URL"].startswith("s3://")  # nodes stage from the store, sharing no disk
    assert shared["FUSETUNE_DATA_DIR"] and {"/models"} == {
        volume.split(":")[1] for volume in node["volumes"]
    } == {shared["FUSETUNE_MODELS_DIR"]}
    # GPUs on the node that trains; none on the head, so Ray places no rank there.
    assert node["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
    assert "deploy" not in head
    assert node["depends_on"]["ray-head"]["condition"] == "service_healthy"
    assert worker["depends_on"]["ray-worker"]["condition"] == "service_healthy"
    # The worker of the profile is `worker` with the cluster's address and its own serving name.
    plain = services["worker"]
    assert worker["command"] == plain["command"]
    assert worker["environment"] == {
        **plain["environment"],
        "FUSETUNE_RAY_ADDRESS": "http://ray-head:8265",
        "FUSETUNE_SERVING_PUBLIC_HOST": "worker-ray",
    }
    settings = Settings(**{k.removeprefix("FUSETUNE_").lower(): v for k, v in worker["environment"].items()})
    assert settings.ray_address == "http://ray-head:8265"
    assert "ports" not in head and "ports" not in node and "ports" not in worker
    # The image installs requirements-service.lock, which must have Ray for these commands.
    assert re.search(r"^ray==", (ROOT / "requirements-service.lock").read_text(), re.MULTILINE)
    # The README gives these commands and the way to start the profile.
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("### One job on several nodes: Ray") :]
    section = section[: section.index("\n## ")]
    assert "docker compose --profile ray up --scale worker=0" in section
    assert "ray start --head --dashboard-host=0.0.0.0" in section
    assert "ray start --address=<head>:6379" in section


def test_the_ray_commands_are_ones_ray_start_accepts():
    """The image's `ray start` (the same Ray as requirements.lock's) parses the nodes' arguments: a misspelt
    option would stop the container at once."""
    pytest.importorskip("ray")
    from ray.scripts.scripts import start

    services = yaml.safe_load(COMPOSE.read_text())["services"]
    for name in ("ray-head", "ray-worker"):
        command = services[name]["command"]
        assert command[:2] == ["ray", "start"]
        context = start.make_context("start", list(command[2:]))
        assert context.params["block"] is True
    head = start.make_context("start", services["ray-head"]["command"][2:]).params
    assert head["head"] and head["dashboard_host"] == "0.0.0.0"
    assert (
        start.make_context("start", services["ray-worker"]["command"][2:]).params["address"]
        == "ray-head:6379"
    )
    with pytest.raises(Exception, match="No such option"):
        start.make_context("start", ["--head", "--dashbord-host=0.0.0.0"])
