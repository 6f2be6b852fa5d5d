"""The whole path a user takes, every part a real process: ``fusetune serve`` (API + Celery worker), a
2-process torchrun (gloo) training job on CPU, the checkpoint downloaded over HTTP and loaded back.

Run against the embedded default (SQLite + a broker on SQLite) and against Redis + PostgreSQL.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from fusetune.demo.assets import TRAIN_FILE, VALID_FILE, build_tiny_model
from tests.services import postgres_database, redis_server, running_service

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / MODEL)


def _install_model(data_dir: Path, tiny_model: Path) -> None:
    models = data_dir / "models"
    models.mkdir(parents=True, exist_ok=True)
    (models / MODEL).symlink_to(tiny_model, target_is_directory=True)


def _subset(path: Path, lines: int, target: Path) -> Path:
    target.write_text("".join(path.read_text().splitlines(keepends=True)[:lines]))
    return target


def _fine_tune_and_check(service, tmp_path: Path, n_gpus: int = 2) -> dict:
    training = service.upload(_subset(TRAIN_FILE, 256, tmp_path / "train.jsonl"))
    assert training.status_code == 200, training.text
    validation = service.upload(_subset(VALID_FILE, 32, tmp_path / "valid.jsonl"))
    response = service.client.post("/v1/fine_tuning/jobs", json={
        "model": MODEL, "training_file": training.json()["id"], "validation_file": validation.json()["id"],
        "seed": 0, "suffix": "e2e",
        "hyperparameters": {"n_epochs": 3, "batch_size": 16, "learning_rate": 3e-3, "n_gpus": n_gpus},
    })  # fmt: skip
    assert response.status_code == 200, response.text
    job = service.wait_for_job(response.json()["id"])
    assert job["status"] == "succeeded", job
    assert job["trained_tokens"] > 0 and job["fine_tuned_model"].startswith(f"ft:{MODEL}:")
    # The job object reports what ran ("auto" precision made concrete, kernels off where they cannot apply).
    resolved, hyperparameters = job["resolved"], job["hyperparameters"]
    assert resolved["world_size"] == n_gpus and resolved["micro_batch_size"] >= 1
    assert hyperparameters["precision"] == resolved["precision"] != "auto"
    assert hyperparameters["kernels"] == resolved["kernels"]

    metrics = service.client.get(f"/v1/fine_tuning/jobs/{job['id']}/metrics").json()["data"]
    assert len(metrics) == 3 * 256 // 16
    losses = [m["train_loss"] for m in metrics]
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5, losses
    for key in (
        "learning_rate",
        "tokens_per_second",
        "tokens_per_second_per_device",
        "peak_memory_allocated_bytes",
    ):
        assert key in metrics[-1]["values"], key

    messages = [e["message"] for e in service.client.get(f"/v1/fine_tuning/jobs/{job['id']}/events",
                                                          params={"limit": 100}).json()["data"]]  # fmt: skip
    assert any("started" in m.lower() for m in messages) and any("completed" in m for m in messages)

    checkpoints = service.client.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints").json()["data"]
    assert checkpoints and checkpoints[0]["id"].startswith("ftckpt_")
    url = f"/v1/fine_tuning/jobs/{job['id']}/checkpoints/{checkpoints[0]['id']}/content"
    with service.client.stream("GET", url) as download:
        assert download.status_code == 200
        archive = b"".join(download.iter_bytes())
    partial = service.client.get(url, headers={"Range": "bytes=100-199"})
    assert partial.status_code == 206 and partial.content == archive[100:200]
    with_state = service.client.get(url, params={"include_training_state": "true"})
    resumed = service.client.get(
        url, params={"include_training_state": "true"}, headers={"Range": "bytes=1000-"}
    )
    assert resumed.status_code == 206 and with_state.content[:1000] + resumed.content == with_state.content
    with tarfile.open(fileobj=io.BytesIO(with_state.content)) as tar:
        state_members = [name for name in tar.getnames() if "/training_state/" in name]
    assert state_members and len(with_state.content) > len(archive)

    target = tmp_path / "downloaded"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        assert not [name for name in tar.getnames() if "/training_state/" in name]
        tar.extractall(target, filter="data")
    (folder,) = [p for p in target.iterdir() if p.is_dir()]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert model.config.model_type == "llama" and tokenizer.chat_template
    return job


def test_embedded_service_fine_tunes_over_http(tmp_path, tiny_model):
    data_dir = tmp_path / "data"
    _install_model(data_dir, tiny_model)
    with running_service(data_dir) as service:
        _fine_tune_and_check(service, tmp_path)


def test_redis_broker_and_postgres_database(tmp_path, tiny_model):
    data_dir = tmp_path / "data"
    _install_model(data_dir, tiny_model)
    with redis_server(tmp_path) as broker_url, postgres_database() as database_url:
        with running_service(data_dir, broker_url=broker_url, database_url=database_url) as service:
            assert service.settings.database_url.startswith("postgresql")
            _fine_tune_and_check(service, tmp_path)


def test_broken_model_fails_clearly_and_worker_takes_the_next_job(tmp_path, tiny_model):
    data_dir = tmp_path / "data"
    _install_model(data_dir, tiny_model)
    broken = data_dir / "models" / "broken-model"
    broken.mkdir()
    # A folder that looks like a model (config.json) but has neither weights nor a tokenizer.
    (broken / "config.json").write_text('{"model_type": "llama"}')
    with running_service(data_dir) as service:
        training = service.upload(_subset(TRAIN_FILE, 32, tmp_path / "train.jsonl")).json()["id"]
        bad = service.client.post(
            "/v1/fine_tuning/jobs", json={"model": "broken-model", "training_file": training}
        )
        assert bad.status_code == 200, bad.text
        failed = service.wait_for_job(bad.json()["id"])
        assert failed["status"] == "failed"
        assert failed["error"]["code"] == "model_not_found" and "broken-model" in failed["error"]["message"]

        good = service.client.post("/v1/fine_tuning/jobs", json={
            "model": MODEL, "training_file": training, "hyperparameters": {"n_epochs": 1, "batch_size": 8}})  # fmt: skip
        assert service.wait_for_job(good.json()["id"])["status"] == "succeeded"
