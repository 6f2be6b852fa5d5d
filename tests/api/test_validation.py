"""Bad input gets a 4xx in the one error shape, and nothing is half-created.

These run the real app in-process with the real queue (a Celery app on an SQLite broker) and a migrated
SQLite database; no worker consumes the queue here, so jobs stay queued.
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from fusetune.api.app import create_app
from fusetune.catalog import fine_tuned_model_name
from fusetune.config import Settings
from fusetune.db import queries
from fusetune.db.migrate import upgrade
from fusetune.db.models import DEFAULT_TENANT, File, Job, JobStatus
from fusetune.db.session import make_engine, make_session_factory
from tests.api.conftest import AUTH

GOOD_LINE = json.dumps(
    {"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]}
)


def _count(settings: Settings, model) -> int:
    engine = make_engine(settings.database_url)
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(model)).scalar_one()


def _assert_error_shape(response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    return error


def _upload(client, text: str, name: str = "train.jsonl"):
    return client.post("/v1/files", files={"file": (name, text.encode())}, data={"purpose": "fine-tune"})


def test_good_upload_is_stored_with_counts(client, settings):
    response = _upload(client, "\n".join([GOOD_LINE] * 3) + "\n")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("file-") and body["object"] == "file"
    assert body["example_count"] == 3 and body["bytes"] > 0
    assert client.get(f"/v1/files/{body['id']}/content").text.count("\n") == 3
    assert len(list(settings.files_dir.iterdir())) == 1


def test_broken_line_three_names_the_line_and_stores_nothing(client, settings):
    lines = [GOOD_LINE, GOOD_LINE, '{"messages": [{"role": "user", "content": "hi"}', GOOD_LINE]
    error = _assert_error_shape(_upload(client, "\n".join(lines)), 400, "file")
    assert "line 3" in error["message"] and "not valid JSON" in error["message"]
    assert "line 1" not in error["message"] and "line 4" not in error["message"]
    assert list(settings.files_dir.iterdir()) == []
    assert _count(settings, File) == 0


def test_all_bad_lines_are_reported_with_their_numbers(client):
    lines = [GOOD_LINE, '{"messages": [{"role": "robot", "content": "x"}]}', "[1, 2]",
             json.dumps({"messages": [{"role": "user", "content": "only a question"}]})]  # fmt: skip
    error = _assert_error_shape(_upload(client, "\n".join(lines)), 400, "file")
    for expected in (
        "line 2: messages[0].role",
        "line 3: expected a JSON object",
        "line 4: needs at least one assistant",
    ):
        assert expected in error["message"]


def test_non_jsonl_and_bad_purpose_are_refused(client, settings):
    _assert_error_shape(_upload(client, GOOD_LINE, name="train.csv"), 400, "file")
    response = client.post(
        "/v1/files", files={"file": ("t.jsonl", GOOD_LINE.encode())}, data={"purpose": "chat"}
    )
    _assert_error_shape(response, 400, "purpose")
    assert list(settings.files_dir.iterdir()) == []


def test_non_multipart_upload_is_a_400_naming_the_missing_field(client):
    error = _assert_error_shape(client.post("/v1/files", json={"file": "x", "purpose": "fine-tune"}), 400)
    assert error["param"] in ("file", "purpose")


def test_upload_over_the_size_limit_is_a_413(tmp_path):
    settings = Settings(data_dir=tmp_path / "small", max_upload_bytes=100)
    settings.ensure_dirs()
    upgrade(settings.database_url)
    with TestClient(create_app(settings), headers=AUTH) as client:
        _assert_error_shape(_upload(client, "\n".join([GOOD_LINE] * 5)), 413, "file")
    assert list(settings.files_dir.iterdir()) == []


@pytest.fixture
def training_file(client) -> str:
    return _upload(client, "\n".join([GOOD_LINE] * 4)).json()["id"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"training_file": "file-x"}, "model"),
        ({"model": "tiny"}, "training_file"),
        (
            {"model": "tiny", "training_file": "TRAIN", "hyperparameters": {"n_epochs": 0}},
            "hyperparameters.n_epochs",
        ),
        (
            {"model": "tiny", "training_file": "TRAIN", "hyperparameters": {"n_epochs": -2}},
            "hyperparameters.n_epochs",
        ),
        (
            {"model": "tiny", "training_file": "TRAIN", "hyperparameters": {"batch_size": 0}},
            "hyperparameters.batch_size",
        ),
        (
            {"model": "tiny", "training_file": "TRAIN", "hyperparameters": {"learning_rate_multiplier": -1}},
            "hyperparameters.learning_rate_multiplier",
        ),
        (
            {"model": "tiny", "training_file": "TRAIN", "hyperparameters": {"n_epoch": 2}},
            "hyperparameters.n_epoch",
        ),
        ({"model": "tiny", "training_file": "TRAIN", "suffix": "../../etc"}, "suffix"),
    ],
)
def test_invalid_job_requests_are_400_and_create_nothing(client, settings, training_file, body, param):
    body = {k: (training_file if v == "TRAIN" else v) for k, v in body.items()}
    _assert_error_shape(client.post("/v1/fine_tuning/jobs", json=body), 400, param)
    assert _count(settings, Job) == 0


def test_unknown_file_and_model_are_400_with_what_is_available(client, settings, training_file):
    error = _assert_error_shape(client.post("/v1/fine_tuning/jobs", json={"model": "tiny", "training_file": "file-nope"}),
                                400, "training_file")  # fmt: skip
    assert error["code"] == "file_not_found"
    for model in ("missing-model", "/etc", "../models/tiny", "tiny/../../x"):
        error = _assert_error_shape(
            client.post("/v1/fine_tuning/jobs", json={"model": model, "training_file": training_file}),
            400,
            "model",
        )
        assert "tiny" in error["message"]
    assert _count(settings, Job) == 0


def test_job_lifecycle_routes_and_not_found(client, training_file):
    response = client.post(
        "/v1/fine_tuning/jobs",
        json={
            "model": "tiny",
            "training_file": training_file,
            "hyperparameters": {"n_epochs": 2},
            "metadata": {"team": "a"},
        },
    )
    assert response.status_code == 200, response.text
    job = response.json()
    assert job["id"].startswith("ftjob-") and job["status"] == "queued"
    assert job["hyperparameters"]["n_epochs"] == 2 and job["method"]["type"] == "supervised"
    events = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events").json()
    assert events["data"][0]["id"].startswith("ftevent-")
    assert client.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel").json()["status"] == "cancelled"
    error = _assert_error_shape(client.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel"), 400)
    assert error["code"] == "invalid_state"
    _assert_error_shape(client.get("/v1/fine_tuning/jobs/ftjob-missing"), 404)
    _assert_error_shape(client.get("/v1/files/file-missing"), 404)
    _assert_error_shape(client.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints/ftckpt_x/content"), 404)


def test_prompt_completion_text_and_tool_lines_are_accepted(client):
    lines = [
        json.dumps({"prompt": "2 + 2 =", "completion": " 4"}),
        json.dumps({"text": "plain text to continue"}),
        json.dumps({"messages": [{"role": "user", "content": "weather?"},
                                 {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                  "function": {"name": "weather", "arguments": "{}"}}]},
                                 {"role": "tool", "content": "sunny"},
                                 {"role": "assistant", "content": "Sunny.", "weight": 1}]}),
    ]  # fmt: skip
    response = _upload(client, "\n".join(lines))
    assert response.status_code == 200, response.text
    assert response.json()["example_count"] == 3
    error = _assert_error_shape(_upload(client, json.dumps({"prompt": "x", "completion": 5})), 400, "file")
    assert "line 1: 'prompt' and 'completion' must both be strings" in error["message"]


def test_an_unknown_after_cursor_is_a_404_naming_it(client, training_file):
    job = client.post("/v1/fine_tuning/jobs", json={"model": "tiny", "training_file": training_file}).json()
    assert client.get("/v1/fine_tuning/jobs", params={"after": job["id"]}).json()["data"] == []
    error = _assert_error_shape(
        client.get("/v1/fine_tuning/jobs", params={"after": "ftjob-nope"}), 404, "after"
    )
    assert "ftjob-nope" in error["message"]


def test_a_checkpoint_of_a_fine_tuned_model_is_a_model_and_unknown_models_list_fine_tuned_ones(
    client, settings, training_file
):
    source = client.post(
        "/v1/fine_tuning/jobs", json={"model": "tiny", "training_file": training_file}
    ).json()
    fine_tuned = fine_tuned_model_name("tiny", DEFAULT_TENANT, None, source["id"])
    with make_session_factory(make_engine(settings.database_url))() as session:
        job = session.get(Job, source["id"])
        job.status, job.fine_tuned_model = JobStatus.SUCCEEDED, fine_tuned
        for step in (8, 16):
            queries.add_checkpoint(session, job.id, step, f"{job.id}/checkpoint-{step}", {})
        session.commit()
    checkpoints = client.get(f"/v1/fine_tuning/jobs/{source['id']}/checkpoints").json()["data"]
    named = {c["fine_tuned_model_checkpoint"]: c["step_number"] for c in checkpoints}
    assert named == {f"{fine_tuned}:ckpt-step-16": 16, f"{fine_tuned}:ckpt-step-8": 8}
    response = client.post(
        "/v1/fine_tuning/jobs", json={"model": f"{fine_tuned}:ckpt-step-8", "training_file": training_file}
    )
    assert response.status_code == 200, response.text
    assert response.json()["model"] == f"{fine_tuned}:ckpt-step-8"
    # The worker trains from that checkpoint's weights, a fine-tuned model from its newest.
    with make_session_factory(make_engine(settings.database_url))() as session:
        for model, step in ((f"{fine_tuned}:ckpt-step-8", 8), (fine_tuned, 16)):
            assert queries.checkpoint_of_model(session, model, DEFAULT_TENANT).step == step
        assert queries.checkpoint_of_model(session, f"{fine_tuned}:ckpt-step-8", "another") is None
    for model in (f"{fine_tuned}:ckpt-step-9", "missing-model"):
        body = {"model": model, "training_file": training_file}
        error = _assert_error_shape(client.post("/v1/fine_tuning/jobs", json=body), 400, "model")
        assert error["code"] == "model_not_found"
        assert "Base models on this server: tiny." in error["message"] and fine_tuned in error["message"]


def test_an_example_over_the_byte_limit_is_refused_naming_the_line_and_the_limit(tmp_path):
    settings = Settings(data_dir=tmp_path / "small", max_example_bytes=200)
    settings.ensure_dirs()
    upgrade(settings.database_url)
    long = json.dumps(
        {"messages": [{"role": "user", "content": "x" * 300}, {"role": "assistant", "content": "4"}]}
    )
    with TestClient(create_app(settings), headers=AUTH) as client:
        error = _assert_error_shape(_upload(client, "\n".join([GOOD_LINE, long, GOOD_LINE])), 400, "file")
    assert f"line 2: the example is {len(long):,} bytes, over the limit of 200 bytes" in error["message"]
    assert "FUSETUNE_MAX_EXAMPLE_BYTES" in error["message"]
    assert "line 1" not in error["message"] and "line 3" not in error["message"]
    assert list(settings.files_dir.iterdir()) == []
