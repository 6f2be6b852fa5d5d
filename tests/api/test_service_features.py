"""API keys and tenants, idempotency, job-list filters, the streaming size limit and Prometheus metrics."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from fusetune.api.app import create_app
from fusetune.config import Settings
from fusetune.db import queries
from fusetune.db.migrate import upgrade
from fusetune.db.session import make_engine, make_session_factory

LINE = json.dumps(
    {"messages": [{"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": "2"}]}
)
TRAINING = ("train.jsonl", ("\n".join([LINE] * 4)).encode())


@pytest.fixture
def settings(tmp_path) -> Settings:
    settings = Settings(data_dir=tmp_path / "data", max_upload_bytes=4096)
    settings.ensure_dirs()
    upgrade(settings.database_url)
    (settings.models_dir / "tiny").mkdir()
    (settings.models_dir / "tiny" / "config.json").write_text("{}")
    return settings


def _key(settings: Settings, tenant: str) -> str:
    with make_session_factory(make_engine(settings.database_url))() as session:
        _, plaintext = queries.create_api_key(session, tenant, "test")
        session.commit()
    return plaintext


@pytest.fixture
def app(settings):
    return create_app(settings)


def _client(app, key: str | None) -> TestClient:
    return TestClient(app, headers={"Authorization": f"Bearer {key}"} if key else {})


def _job(client: TestClient, file_id: str, **extra):
    return client.post("/v1/fine_tuning/jobs", json={"model": "tiny", "training_file": file_id, **extra})


def test_missing_or_wrong_key_is_401(app):
    for client in (_client(app, None), _client(app, "sk-wrong")):
        response = client.get("/v1/files")
        assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"


def test_revoked_key_stops_working(app, settings):
    key = _key(settings, "acme")
    client = _client(app, key)
    assert client.get("/v1/files").status_code == 200
    with make_session_factory(make_engine(settings.database_url))() as session:
        (row,) = [k for k in queries.list_api_keys(session) if k.tenant == "acme"]
        assert row.key_hash != key and len(row.key_hash) == 64  # only a hash is stored
        assert queries.revoke_api_key(session, row.id)
        session.commit()
    assert client.get("/v1/files").status_code == 401


def test_tenants_cannot_see_each_others_anything(app, settings):
    alice, bob = _client(app, _key(settings, "alice")), _client(app, _key(settings, "bob"))
    file_id = alice.post("/v1/files", files={"file": TRAINING}, data={"purpose": "fine-tune"}).json()["id"]
    job_id = _job(alice, file_id).json()["id"]
    for path in (f"/v1/files/{file_id}", f"/v1/files/{file_id}/content", f"/v1/fine_tuning/jobs/{job_id}",
                 f"/v1/fine_tuning/jobs/{job_id}/events", f"/v1/fine_tuning/jobs/{job_id}/checkpoints",
                 f"/v1/fine_tuning/jobs/{job_id}/metrics"):  # fmt: skip
        assert bob.get(path).status_code == 404, path
        assert alice.get(path).status_code == 200, path
    assert bob.post(f"/v1/fine_tuning/jobs/{job_id}/cancel").status_code == 404
    assert bob.delete(f"/v1/files/{file_id}").status_code == 404
    assert bob.get("/v1/files").json()["data"] == [] and bob.get("/v1/fine_tuning/jobs").json()["data"] == []
    # Bob cannot train on Alice's file either.
    assert _job(bob, file_id).json()["error"]["param"] == "training_file"


def test_idempotency_key_returns_the_same_objects(app, settings):
    client = _client(app, settings.dev_api_key)
    first = client.post("/v1/files", files={"file": TRAINING}, data={"purpose": "fine-tune"},
                        headers={"Idempotency-Key": "upload-1"})  # fmt: skip
    again = client.post("/v1/files", files={"file": TRAINING}, data={"purpose": "fine-tune"},
                        headers={"Idempotency-Key": "upload-1"})  # fmt: skip
    assert first.status_code == again.status_code == 200 and first.json()["id"] == again.json()["id"]
    assert len(client.get("/v1/files").json()["data"]) == 1
    file_id = first.json()["id"]
    job_a = client.post("/v1/fine_tuning/jobs", json={"model": "tiny", "training_file": file_id},
                        headers={"Idempotency-Key": "job-1"})  # fmt: skip
    job_b = client.post("/v1/fine_tuning/jobs", json={"model": "tiny", "training_file": file_id},
                        headers={"Idempotency-Key": "job-1"})  # fmt: skip
    assert job_a.json()["id"] == job_b.json()["id"]
    assert len(client.get("/v1/fine_tuning/jobs").json()["data"]) == 1
    reused = client.post("/v1/fine_tuning/jobs", json={"model": "tiny", "training_file": file_id, "seed": 3},
                         headers={"Idempotency-Key": "job-1"})  # fmt: skip
    assert reused.status_code == 400 and reused.json()["error"]["code"] == "idempotency_key_reused"


def test_job_list_pagination_and_metadata_filter(app, settings):
    client = _client(app, settings.dev_api_key)
    file_id = client.post("/v1/files", files={"file": TRAINING}, data={"purpose": "fine-tune"}).json()["id"]
    ids = [_job(client, file_id, metadata={"team": "a" if i % 2 else "b"}).json()["id"] for i in range(5)]
    page = client.get("/v1/fine_tuning/jobs", params={"limit": 2}).json()
    assert page["has_more"] and len(page["data"]) == 2
    rest = client.get("/v1/fine_tuning/jobs", params={"limit": 10, "after": page["data"][-1]["id"]}).json()
    seen = [j["id"] for j in page["data"] + rest["data"]]
    assert sorted(seen) == sorted(ids) and len(set(seen)) == 5 and not rest["has_more"]
    team_a = client.get("/v1/fine_tuning/jobs", params={"metadata[team]": "a"}).json()["data"]
    assert {j["id"] for j in team_a} == {ids[1], ids[3]}


def test_body_over_the_limit_is_413_before_it_is_read(app, settings):
    client = _client(app, settings.dev_api_key)
    oversized = ("big.jsonl", b"x" * (settings.max_upload_bytes + 128 * 1024))
    response = client.post("/v1/files", files={"file": oversized}, data={"purpose": "fine-tune"})
    assert response.status_code == 413 and response.json()["error"]["param"] == "file"

    def chunked():  # no Content-Length: the limit applies as the body streams in
        for _ in range(200):
            yield b"y" * 1024

    response = client.post(
        "/v1/files", content=chunked(), headers={"Content-Type": "multipart/form-data; boundary=x"}
    )
    assert response.status_code == 413
    assert list(settings.files_dir.iterdir()) == []


def test_prometheus_metrics(app, settings):
    client = _client(app, settings.dev_api_key)
    file_id = client.post("/v1/files", files={"file": TRAINING}, data={"purpose": "fine-tune"}).json()["id"]
    _job(client, file_id)
    client.get("/v1/fine_tuning/jobs/ftjob-missing")
    text = client.get("/metrics").text
    assert 'fusetune_jobs{status="queued"} 1.0' in text and "fusetune_queue_depth 1.0" in text
    assert 'route="/v1/fine_tuning/jobs/{job_id}",status="404"' in text
    assert client.get("/docs").status_code == 200 and client.get("/openapi.json").status_code == 200


def _running_job_with_throughput(client: TestClient, settings: Settings) -> str:
    file_id = client.post("/v1/files", files={"file": TRAINING}, data={"purpose": "fine-tune"}).json()["id"]
    job_id = _job(client, file_id).json()["id"]
    with make_session_factory(make_engine(settings.database_url))() as session:
        assert queries.change_job_status(session, job_id, ("queued",), "running")
        queries.add_metric(session, job_id, 1, {"tokens_per_second": 1234.0})
        session.commit()
    return job_id


def test_open_metrics_name_no_job(app, settings):
    job_id = _running_job_with_throughput(_client(app, settings.dev_api_key), settings)
    text = _client(app, None).get("/metrics").text
    assert job_id not in text and "fusetune_job_tokens_per_second" not in text
    assert "fusetune_tokens_per_second 1234.0" in text and 'fusetune_jobs{status="running"} 1.0' in text


def test_metrics_key_guards_metrics_and_shows_each_job(settings):
    settings.metrics_key = "metrics-secret"
    app = create_app(settings)
    job_id = _running_job_with_throughput(_client(app, settings.dev_api_key), settings)
    for key in (None, settings.dev_api_key, "metrics-wrong", "métrics"):
        headers = {"Authorization": f"Bearer {key}".encode()} if key else {}
        response = _client(app, None).get("/metrics", headers=headers)
        assert response.status_code == 401 and job_id not in response.text, key
    text = _client(app, "metrics-secret").get("/metrics").text
    assert f'fusetune_job_tokens_per_second{{job_id="{job_id}"}} 1234.0' in text
    assert "fusetune_tokens_per_second 1234.0" in text
    # A tenant's key is no metrics key, and the metrics key is no tenant's key.
    assert _client(app, "metrics-secret").get("/v1/fine_tuning/jobs").status_code == 401


def test_bodies_over_the_limit_are_counted_as_413(app, settings):
    client = _client(app, settings.dev_api_key)
    oversized = ("big.jsonl", b"x" * (settings.max_upload_bytes + 128 * 1024))
    response = client.post("/v1/files", files={"file": oversized}, data={"purpose": "fine-tune"})
    assert response.status_code == 413

    def chunked():
        for _ in range(200):
            yield b"y" * 1024

    response = client.post(
        "/v1/files", content=chunked(), headers={"Content-Type": "multipart/form-data; boundary=x"}
    )
    assert response.status_code == 413
    text = client.get("/metrics").text
    assert 'fusetune_http_requests_total{method="POST",route="/v1/files",status="413"} 2.0' in text
    assert 'status="400"' not in text


LLAMA_1B = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True}  # fmt: skip


def test_dry_run_estimates_and_creates_nothing(tmp_path):
    settings = Settings(data_dir=tmp_path / "est", gpu_memory_bytes=80 * 2**30)
    settings.ensure_dirs()
    upgrade(settings.database_url)
    (settings.models_dir / "llama-1b").mkdir()
    (settings.models_dir / "llama-1b" / "config.json").write_text(json.dumps(LLAMA_1B))
    client = _client(create_app(settings), settings.dev_api_key)
    file_id = client.post("/v1/files", files={"file": TRAINING}, data={"purpose": "fine-tune"}).json()["id"]
    body = {
        "model": "llama-1b",
        "training_file": file_id,
        "hyperparameters": {"n_epochs": 2, "batch_size": 4},
    }
    estimate = client.post("/v1/fine_tuning/jobs", json={**body, "dry_run": True}).json()
    assert estimate["object"] == "fine_tuning.job.estimate"
    # Llama-3.2-1B has 1.236e9 parameters (tied embeddings).
    assert abs(estimate["parameters"] - 1.2358e9) / 1.2358e9 < 0.01
    # bf16-sr, the GPU default: bf16 weight and gradient and two bf16 AdamW moments
    assert estimate["memory_breakdown"]["weights_grads_optimizer"] == 8 * estimate["parameters"]
    assert estimate["fits"] is True and estimate["steps"] == 2 and estimate["training_tokens"] > 0
    assert estimate["micro_batch_size"] == 4 and estimate["remedies"] is None
    assert client.get("/v1/fine_tuning/jobs").json()["data"] == []

    tight = Settings(data_dir=tmp_path / "est", gpu_memory_bytes=5 * 2**30)
    client = _client(create_app(tight), tight.dev_api_key)
    too_large = client.post("/v1/fine_tuning/jobs", json={**body, "dry_run": True}).json()
    # Even bf16 weights with the 8-bit AdamW state in host memory and only the gradients in flight (6.0 GiB) exceed
    # 5 GiB; four GPUs under FSDP or LoRA would fit.
    assert too_large["fits"] is False and too_large["plan"]["precision"] == "bf16-sr-8bit"
    assert too_large["plan"]["optimizer_state_on_host"] is True
    assert set(too_large["remedies"]) == {"n_gpus 4 and distributed fsdp", "LoRA (r=16)"}
    refused = client.post("/v1/fine_tuning/jobs", json=body)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "job_too_large"
    assert "even with its smallest plan" in refused.json()["error"]["message"]
    assert "LoRA (r=16) (micro-batch 4" in refused.json()["error"]["message"]
    assert client.get("/v1/fine_tuning/jobs").json()["data"] == []
