"""Every files, fine-tuning, graders, models, chat completions and evals operation, success and error, against
OpenAI's OpenAPI description (tests/api/openai_conformance.py; the exceptions are listed there with their
reasons). In-process app, no worker: the finished job's events, checkpoints and model are written as the worker
writes them; chat completions go to a worker's chat completions server started in the test on the bundled tiny
model; an eval run is run by the worker's eval runner on an engine that answers from a table."""

from __future__ import annotations

import json

import pytest

from fusetune.catalog import fine_tuned_model_name
from fusetune.db import queries
from fusetune.db.models import DEFAULT_TENANT, EvalRun, Job, JobStatus
from fusetune.db.session import make_engine, make_session_factory
from fusetune.demo.assets import build_tiny_model
from fusetune.serving.errors import ServingError
from fusetune.serving.server import ServingServer
from fusetune.storage import open_storage
from fusetune.worker.evals import EvalRunner
from fusetune.worker.locations import ModelLocations
from tests.api import openai_conformance
from tests.api.openai_conformance import Recorder

GOOD_LINE = json.dumps(
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
)
EXACT = {"type": "string_check", "name": "exact", "operation": "eq",
         "input": "{{ sample.output_text }}", "reference": "{{ item.answer }}"}  # fmt: skip


@pytest.fixture
def recorded(client) -> Recorder:
    """The client's own recorder (tests/api/conftest.py), read here before the test ends."""
    (recorder,) = [hook for hook in client.event_hooks["response"] if isinstance(hook, Recorder)]
    return recorder


def _upload(client, name: str = "train.jsonl", text: str = GOOD_LINE + "\n"):
    return client.post("/v1/files", files={"file": (name, text.encode())}, data={"purpose": "fine-tune"})


def _session(settings):
    return make_session_factory(make_engine(settings.database_url))()


def _finish(settings, job_id: str) -> str:
    """The job succeeded as the worker records it: its events (a cut example's warning among them), three
    checkpoints and its model."""
    model = fine_tuned_model_name("tiny", DEFAULT_TENANT, None, job_id)
    with _session(settings) as session:
        job = session.get(Job, job_id)
        job.status, job.fine_tuned_model, job.finished_at, job.trained_tokens = (
            JobStatus.SUCCEEDED,
            model,
            2,
            9,
        )
        queries.add_event(session, job_id, "Example 3 was cut to max_seq_length", level="warning")
        queries.add_event(session, job_id, "Training started", data=None)
        for step in (1, 2, 3):
            queries.add_metric(session, job_id, step, {"train_loss": 1.0 / step})
            queries.add_checkpoint(session, job_id, step, f"{job_id}/checkpoint-{step}", {"step": step})
        session.commit()
    return model


def test_every_operation_answers_as_the_spec_declares(client, settings, recorded):
    # files
    files = [_upload(client, f"train-{n}.jsonl").json()["id"] for n in range(3)]
    _upload(client, "notes.txt")  # 400
    client.get("/v1/files")
    client.get("/v1/files", params={"limit": 1, "order": "asc", "purpose": "fine-tune"})
    client.get(f"/v1/files/{files[0]}")
    client.get("/v1/files/file-missing")  # 404
    client.delete(f"/v1/files/{files[2]}")
    # graders
    client.post("/v1/fine_tuning/alpha/graders/validate", json={"grader": EXACT})
    client.post("/v1/fine_tuning/alpha/graders/validate", json={"grader": {**EXACT, "operation": "?"}})
    run = {"grader": EXACT, "model_sample": "2914", "item": {"answer": "2914"}}
    client.post("/v1/fine_tuning/alpha/graders/run", json=run)
    # jobs
    job = client.post("/v1/fine_tuning/jobs", json={"model": "tiny", "training_file": files[0]}).json()
    client.post("/v1/fine_tuning/jobs", json={"model": "tiny", "training_file": files[0], "dry_run": True})
    client.post("/v1/fine_tuning/jobs", json={"model": "no-such-model", "training_file": files[0]})  # 400
    other = client.post("/v1/fine_tuning/jobs", json={"model": "tiny", "training_file": files[1]}).json()
    client.post(
        "/v1/fine_tuning/jobs", json={"model": "tiny", "training_file": files[1], "n_epochs": 2}
    )  # 400
    client.get("/v1/fine_tuning/jobs", params={"limit": 1})
    client.get(f"/v1/fine_tuning/jobs/{job['id']}")
    client.get("/v1/fine_tuning/jobs/ftjob-missing")  # 404
    client.post(f"/v1/fine_tuning/jobs/{other['id']}/cancel")
    client.post(f"/v1/fine_tuning/jobs/{other['id']}/cancel")  # 400: already cancelled
    client.post(f"/v1/fine_tuning/jobs/{other['id']}/pause")  # 400
    client.post(f"/v1/fine_tuning/jobs/{other['id']}/resume")  # 400
    model = _finish(settings, job["id"])
    client.get(f"/v1/fine_tuning/jobs/{job['id']}")
    client.get(f"/v1/fine_tuning/jobs/{job['id']}/events")
    client.get(f"/v1/fine_tuning/jobs/{job['id']}/events", params={"limit": 2})
    client.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints")
    client.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints", params={"limit": 1})
    client.get("/v1/fine_tuning/jobs/ftjob-missing/checkpoints")  # 404
    # models
    client.get("/v1/models")
    client.get("/v1/models/tiny")
    client.get(f"/v1/models/{model}")
    client.get("/v1/models/no-such-model")  # 404
    client.delete("/v1/models/tiny")  # 403: a base model
    client.delete(f"/v1/models/{model}")
    client.delete(f"/v1/models/{model}")  # 404: gone

    assert recorded.problems() == [], "\n".join(recorded.problems())
    statuses = {r.status for r in recorded.records}
    assert {200, 400, 404} <= statuses
    exercised = {r.operation for r in recorded.records}
    served_elsewhere = {"GET /files/{file_id}/content"}  # not JSON; tests/api/test_openai_sdk.py reads it
    pausable = {  # a job pauses and resumes only while a worker trains it (tests/api/test_service_features.py)
        "POST /fine_tuning/jobs/{fine_tuning_job_id}/pause",
        "POST /fine_tuning/jobs/{fine_tuning_job_id}/resume",
    }
    declared = {
        operation
        for operation in openai_conformance.declared_operations()
        if not operation.split()[1].startswith(("/chat/", "/evals"))  # the tests below
    }
    assert declared - served_elsewhere - exercised == set()
    assert {
        r.operation for r in recorded.records if r.status == 200
    } >= declared - served_elsewhere - pausable


CHAT_MODEL = "tiny-llama"
HELLO = [{"role": "user", "content": "Write in digits: two nine"}]


@pytest.fixture
def chat_model(settings) -> str:
    """The bundled tiny model (real weights and tokenizer) as a base model of the service."""
    build_tiny_model(settings.models_dir / CHAT_MODEL)
    return CHAT_MODEL


@pytest.fixture
def serving(settings, chat_model):
    """A worker's chat completions server, advertised in the worker's row as the worker's heartbeat does."""
    session_factory = make_session_factory(make_engine(settings.database_url))
    locations = ModelLocations(settings, session_factory, open_storage(settings))
    server = ServingServer(settings, locations).start()
    with session_factory() as session:
        queries.record_worker(session, "conformance-worker", 0, server.url, server.token)
        session.commit()
    yield server
    server.stop()


def test_chat_completions_answer_as_the_spec_declares(client, chat_model, recorded, request):
    chat = "/v1/chat/completions"
    body = {"model": chat_model, "messages": HELLO, "seed": 5, "max_completion_tokens": 3}
    unserved = client.post(chat, json=body)  # no worker serves yet
    assert unserved.status_code == 503 and unserved.json()["error"]["code"] == "no_serving_worker"
    request.getfixturevalue("serving")
    completion = client.post(chat, json=body)
    assert completion.status_code == 200, completion.text
    client.post(chat, json={**body, "n": 2, "stop": ["\n"], "temperature": 0.5, "top_p": 0.9})
    streamed = client.post(chat, json={**body, "stream": True})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    with_usage = client.post(chat, json={**body, "stream": True, "stream_options": {"include_usage": True}})
    client.post(chat, json={**body, "model": "no-such-model"})  # 404
    client.post(chat, json={**body, "temperature": 3})  # 400
    client.post(chat, json={**body, "logprobs": True})  # 400: not served

    assert recorded.problems() == [], "\n".join(recorded.problems())
    streams = [r for r in recorded.records if r.media_type == openai_conformance.EVENT_STREAM]
    assert [r.status for r in streams] == [200, 200] and streams[1].body[-1] == openai_conformance.DONE
    # The events are checked, not skipped: a role chunk, content, the finish, the usage chunk, [DONE].
    assert len(streams[1].body) >= 4 and streams[1].body[-2]["usage"]["completion_tokens"] <= 3
    assert with_usage.status_code == 200
    assert {r.status for r in recorded.records} == {200, 400, 404, 503}
    assert {r.operation for r in recorded.records} == {"POST /chat/completions"}
    assert "POST /chat/completions" in openai_conformance.declared_operations()
    assert not {o for o in openai_conformance.declared_operations() if o.split()[1].startswith("/chat/")} - {
        "POST /chat/completions"
    }


def test_a_stream_is_checked_event_by_event(recorded):
    """The stream check itself: a chunk the spec rejects is reported with its event's number, and so is a
    stream cut before `data: [DONE]`."""
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}]}  # fmt: skip
    text = (
        "data: " + json.dumps(chunk) + "\n\n" + "data: " + json.dumps({**chunk, "object": "chunk"}) + "\n\n"
    )
    events = openai_conformance._parse_events(text + "data: [DONE]\n\n")
    record = openai_conformance.Recorded("POST", "/v1/chat/completions", "/chat/completions", 200, events,
                                         openai_conformance.EVENT_STREAM)  # fmt: skip
    (problem,) = openai_conformance.problems(record)
    assert "event 1: at ['object']" in problem
    cut = openai_conformance.Recorded("POST", "/v1/chat/completions", "/chat/completions", 200, events[:1],
                                      openai_conformance.EVENT_STREAM)  # fmt: skip
    assert openai_conformance.problems(cut) == [
        "POST /v1/chat/completions -> 200: the stream does not end with data: [DONE]"
    ]


class TableEngine:
    """Answers an eval's prompt from a table at once, as the serving engine's events; refuses any other prompt
    (that item is errored, not the run)."""

    ANSWERS = {"Write in digits: one": "1", "Write in digits: two": "3"}

    def submit(self, key, load, body, emit):
        prompt = body.messages[-1].content
        if prompt not in self.ANSWERS:
            raise ServingError(400, f"The messages are too long for {key}.", "messages")
        emit(("delta", 0, self.ANSWERS[prompt]))
        emit(("finish", 0, "stop"))
        emit(("usage", 5, 1))
        return type("Handle", (), {"cancelled": type("Set", (), {"set": lambda self: None})()})()


def test_evals_answer_as_the_spec_declares(client, settings, recorded):
    items = [{"question": q, "answer": a} for q, a in
             (("Write in digits: one", "1"), ("Write in digits: two", "2"), ("Write in digits: ten", "10"))]  # fmt: skip
    content = "".join(json.dumps({"item": item}) + "\n" for item in items)
    file_id = client.post(
        "/v1/files", files={"file": ("items.jsonl", content.encode())}, data={"purpose": "evals"}
    ).json()["id"]
    schema = {"type": "object", "properties": {"question": {"type": "string"}, "answer": {"type": "string"}},
              "required": ["question", "answer"]}  # fmt: skip
    created = client.post("/v1/evals", json={
        "name": "digits", "metadata": {"team": "a"},
        "data_source_config": {"type": "custom", "item_schema": schema, "include_sample_schema": True},
        "testing_criteria": [EXACT, {**EXACT, "name": "has it", "operation": "like"}],
    })  # fmt: skip
    assert created.status_code == 201, created.text
    eval_id = created.json()["id"]
    client.post("/v1/evals", json={"data_source_config": {"type": "custom", "item_schema": schema},
                                   "testing_criteria": [{**EXACT, "operation": "?"}]})  # 400  # fmt: skip
    client.get("/v1/evals")
    client.get("/v1/evals", params={"limit": 1, "order": "desc"})
    client.get(f"/v1/evals/{eval_id}")
    client.get("/v1/evals/eval_missing")  # 404
    client.post(f"/v1/evals/{eval_id}", json={"name": "digits, renamed"})
    runs = f"/v1/evals/{eval_id}/runs"
    template = {"type": "template", "template": [
        {"role": "developer", "content": "Answer with digits only."},
        {"role": "user", "content": "{{ item.question }}"},
    ]}  # fmt: skip
    source = {"type": "completions", "model": "tiny", "source": {"type": "file_id", "id": file_id},
              "input_messages": template, "sampling_params": {"temperature": 0, "max_completion_tokens": 4}}  # fmt: skip
    run = client.post(runs, json={"name": "tiny", "data_source": source})
    assert run.status_code == 201, run.text
    run_id = run.json()["id"]
    client.post(runs, json={"data_source": {**source, "model": "no-such-model"}})  # 400
    client.get(runs)  # queued
    # The worker's runner: every item sampled on the table engine, graded, written as the worker writes them.
    session_factory = make_session_factory(make_engine(settings.database_url))
    storage = open_storage(settings)
    locations = ModelLocations(settings, session_factory, storage)
    engine = TableEngine()
    runner = EvalRunner(settings, session_factory, storage, locations, "conformance-worker", lambda: engine)
    assert runner.run(run_id) == "completed"
    finished = client.get(f"{runs}/{run_id}").json()
    assert finished["result_counts"] == {"total": 3, "passed": 1, "failed": 1, "errored": 1}
    client.get(runs, params={"limit": 1, "status": "completed"})
    outputs = client.get(f"{runs}/{run_id}/output_items").json()["data"]
    assert [o["status"] for o in outputs] == ["pass", "fail", "error"]
    client.get(f"{runs}/{run_id}/output_items", params={"status": "fail", "limit": 1})
    client.get(f"{runs}/{run_id}/output_items", params={"status": "pass", "after": outputs[0]["id"]})  # empty
    for output in outputs:
        client.get(f"{runs}/{run_id}/output_items/{output['id']}")
    client.get(f"{runs}/{run_id}/output_items/outputitem_missing")  # 404
    client.get(f"{runs}/evalrun_missing")  # 404
    # A run that failed (its model gone before the worker ran it) carries its error.
    failing = client.post(runs, json={"data_source": source}).json()["id"]
    runner.locations = type("Nowhere", (), {"location_of": lambda self, model, tenant: None})()
    assert runner.run(failing) == "failed"
    assert client.get(f"{runs}/{failing}").json()["error"]["code"]
    canceled = client.post(runs, json={"data_source": source}).json()["id"]
    assert client.post(f"{runs}/{canceled}").json()["status"] == "canceled"
    client.delete(f"{runs}/{canceled}")
    client.delete(f"{runs}/{canceled}")  # 404
    client.delete(f"/v1/evals/{eval_id}")
    client.delete(f"/v1/evals/{eval_id}")  # 404
    client.get(runs)  # 404: the eval is gone
    with session_factory() as session:
        assert session.get(EvalRun, run_id) is None  # its runs went with it

    assert recorded.problems() == [], "\n".join(recorded.problems())
    assert {r.status for r in recorded.records if r.operation.split()[1].startswith("/evals")} == {
        200, 201, 400, 404
    }  # fmt: skip
    evals_operations = {
        o for o in openai_conformance.declared_operations() if o.split()[1].startswith("/evals")
    }
    assert len(evals_operations) == 12  # every one fusetune serves
    succeeded = {r.operation for r in recorded.records if r.status in (200, 201)}
    assert evals_operations - succeeded == set()


def test_the_recorder_finds_what_the_spec_rejects(client, recorded):
    """The check itself: a body the spec rejects is reported, naming the field."""
    client.get("/v1/models")
    (record,) = recorded.records
    wrong = openai_conformance.Recorded(
        record.method, record.path, record.template, 200, {**record.body, "data": [{"id": 1}]}
    )
    assert any("['data', 0]" in line for line in openai_conformance.problems(wrong))
    error = openai_conformance.Recorded("GET", "/v1/models/x", "/models/{model}", 404, {"error": {}})
    assert any("'message' is a required property" in line for line in openai_conformance.problems(error))
    paused = {"object": "fine_tuning.job", "status": "paused"}
    paused_job = openai_conformance.Recorded("POST", "/v1/fine_tuning/jobs/j/pause",
                                             "/fine_tuning/jobs/{fine_tuning_job_id}/pause", 200, paused)  # fmt: skip
    assert not any("paused" in line for line in openai_conformance.problems(paused_job))
    # A success answered with another status than the operation declares (creating an eval: 201).
    created = openai_conformance.Recorded("POST", "/v1/evals", "/evals", 200, {})
    assert openai_conformance.problems(created) == ["POST /v1/evals -> 200: the spec declares 201 for this "
                                                    "operation's success"]  # fmt: skip


def test_files_page_with_limit_after_order_and_purpose(client, recorded):
    ids = [_upload(client, f"train-{n}.jsonl").json()["id"] for n in range(3)]
    newest_first = [f["id"] for f in client.get("/v1/files").json()["data"]]
    assert sorted(newest_first) == sorted(ids)
    first = client.get("/v1/files", params={"limit": 2}).json()
    assert [f["id"] for f in first["data"]] == newest_first[:2] and first["has_more"] is True
    assert (first["first_id"], first["last_id"]) == (newest_first[0], newest_first[1])
    rest = client.get("/v1/files", params={"limit": 2, "after": first["last_id"]}).json()
    assert [f["id"] for f in rest["data"]] == newest_first[2:] and rest["has_more"] is False
    oldest_first = client.get("/v1/files", params={"order": "asc"}).json()
    assert [f["id"] for f in oldest_first["data"]] == newest_first[::-1]
    after = client.get("/v1/files", params={"order": "asc", "after": newest_first[-1]}).json()
    assert [f["id"] for f in after["data"]] == newest_first[-2::-1]
    empty = client.get("/v1/files", params={"purpose": "batch"}).json()
    assert empty["data"] == [] and empty["first_id"] is None and empty["has_more"] is False
    missing = client.get("/v1/files", params={"after": "file-nope"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "after"
    assert "status_details" not in first["data"][0]
    assert recorded.problems() == []


def test_checkpoints_page_with_limit_and_after(client, settings, recorded):
    file_id = _upload(client).json()["id"]
    job_id = client.post("/v1/fine_tuning/jobs", json={"model": "tiny", "training_file": file_id}).json()[
        "id"
    ]
    _finish(settings, job_id)
    path = f"/v1/fine_tuning/jobs/{job_id}/checkpoints"
    first = client.get(path, params={"limit": 2}).json()
    assert [c["step_number"] for c in first["data"]] == [3, 2] and first["has_more"] is True
    rest = client.get(path, params={"limit": 2, "after": first["last_id"]}).json()
    assert [c["step_number"] for c in rest["data"]] == [1] and rest["has_more"] is False
    assert rest["first_id"] == rest["last_id"] == rest["data"][0]["id"]
    missing = client.get(path, params={"after": "ftckpt_nope"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "after"
    assert recorded.problems() == []


def test_events_use_openai_levels_and_give_an_object_for_no_data(client, settings, recorded):
    file_id = _upload(client).json()["id"]
    job_id = client.post("/v1/fine_tuning/jobs", json={"model": "tiny", "training_file": file_id}).json()[
        "id"
    ]
    _finish(settings, job_id)  # stores the worker's "warning"
    events = client.get(f"/v1/fine_tuning/jobs/{job_id}/events", params={"limit": 100}).json()["data"]
    levels = {e["message"]: e["level"] for e in events}
    assert levels["Example 3 was cut to max_seq_length"] == "warn"
    assert set(levels.values()) <= {"info", "warn", "error"}
    assert all(isinstance(e["data"], dict) for e in events)
    assert {e["message"]: e["data"] for e in events}["Training started"] == {}
    assert recorded.problems() == []


def test_deleting_a_fine_tuned_model(client, settings, recorded):
    file_id = _upload(client).json()["id"]
    job_id = client.post("/v1/fine_tuning/jobs", json={"model": "tiny", "training_file": file_id}).json()[
        "id"
    ]
    model = _finish(settings, job_id)
    run = settings.runs_dir / job_id / "checkpoint-3"
    run.mkdir(parents=True)
    (run / "model.safetensors").write_bytes(b"weights")
    # Not while a job trains from it (or from one of its checkpoints).
    child = client.post(
        "/v1/fine_tuning/jobs", json={"model": f"{model}:ckpt-step-2", "training_file": file_id}
    )
    assert child.status_code == 200, child.text
    refused = client.delete(f"/v1/models/{model}")
    assert refused.status_code == 400 and child.json()["id"] in refused.json()["error"]["message"]
    client.post(f"/v1/fine_tuning/jobs/{child.json()['id']}/cancel")
    # Another tenant's key finds no such model; a base model is not deleted.
    with _session(settings) as session:
        _, other_key = queries.create_api_key(session, "other")
        session.commit()
    other = client.delete(f"/v1/models/{model}", headers={"Authorization": f"Bearer {other_key}"})
    assert other.status_code == 404
    assert client.delete("/v1/models/tiny").status_code == 403
    deleted = client.delete(f"/v1/models/{model}")
    assert deleted.status_code == 200 and deleted.json() == {"id": model, "object": "model", "deleted": True}
    assert model not in [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert client.get(f"/v1/models/{model}").status_code == 404
    assert client.delete(f"/v1/models/{model}").status_code == 404
    for base in (model, f"{model}:ckpt-step-2"):
        again = client.post("/v1/fine_tuning/jobs", json={"model": base, "training_file": file_id})
        assert again.status_code == 400 and again.json()["error"]["code"] == "model_not_found"
    # The job keeps its record; its checkpoints, stored and listed, are gone.
    job = client.get(f"/v1/fine_tuning/jobs/{job_id}").json()
    assert job["status"] == "succeeded" and job["fine_tuned_model"] == model
    assert client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints").json()["data"] == []
    assert not run.exists()
    assert recorded.problems() == []
