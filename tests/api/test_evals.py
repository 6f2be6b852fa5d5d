"""The Evals API's checks and tenancy, in-process (no worker runs the runs): what a bad eval or run is refused
with (400 naming the field), an eval data file's lines, another tenant's eval as a 404, and the objects' fields."""

from __future__ import annotations

import io
import json

import pytest

from fusetune.db import queries
from fusetune.db.session import make_engine, make_session_factory

ITEM_SCHEMA = {"type": "object", "properties": {"question": {"type": "string"}, "answer": {"type": "string"}}}
CRITERION = {"type": "string_check", "name": "exact", "input": "{{ sample.output_text }}",
             "reference": "{{ item.answer }}", "operation": "eq"}  # fmt: skip
TEMPLATE = {"type": "template", "template": [{"role": "user", "content": "{{ item.question }}"}]}


def _eval(client, **changes) -> dict:
    body = {"name": "digits", "data_source_config": {"type": "custom", "item_schema": ITEM_SCHEMA},
            "testing_criteria": [CRITERION], **changes}  # fmt: skip
    return client.post("/v1/evals", json=body)


def _upload(client, lines: list, purpose: str = "evals"):
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    return client.post(
        "/v1/files", files={"file": ("items.jsonl", io.BytesIO(content))}, data={"purpose": purpose}
    )


def _run_body(file_id: str, model: str = "tiny", input_messages: dict = TEMPLATE) -> dict:
    source = {"type": "file_id", "id": file_id}
    return {"data_source": {"type": "completions", "model": model, "source": source,
                            "input_messages": input_messages}}  # fmt: skip


@pytest.fixture
def eval_and_file(client) -> tuple[str, str]:
    created = _eval(client)
    assert created.status_code == 201, created.text
    upload = _upload(client, [{"item": {"question": "Write in digits: one", "answer": "1"}}])
    assert upload.status_code == 200, upload.text
    return created.json()["id"], upload.json()["id"]


def _error(response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_an_eval_and_a_run_are_created_listed_and_deleted(client, eval_and_file):
    eval_id, file_id = eval_and_file
    evaluation = client.get(f"/v1/evals/{eval_id}").json()
    assert evaluation["object"] == "eval" and evaluation["name"] == "digits"
    assert evaluation["data_source_config"]["schema"]["properties"]["item"] == ITEM_SCHEMA
    assert evaluation["testing_criteria"] == [CRITERION]
    run = client.post(f"/v1/evals/{eval_id}/runs", json=_run_body(file_id)).json()
    assert run["object"] == "eval.run" and run["status"] == "queued" and run["model"] == "tiny"
    assert run["result_counts"] == {"total": 0, "passed": 0, "failed": 0, "errored": 0}
    assert client.get(f"/v1/evals/{eval_id}/runs").json()["data"][0]["id"] == run["id"]
    assert client.get(f"/v1/evals/{eval_id}/runs/{run['id']}/output_items").json()["data"] == []
    canceled = client.post(f"/v1/evals/{eval_id}/runs/{run['id']}").json()
    assert canceled["status"] == "canceled"
    assert [e["id"] for e in client.get("/v1/evals").json()["data"]] == [eval_id]
    assert client.delete(f"/v1/evals/{eval_id}").json() == {"object": "eval.deleted", "deleted": True,
                                                             "eval_id": eval_id}  # fmt: skip
    assert _error(client.get(f"/v1/evals/{eval_id}/runs/{run['id']}"), 404)["code"] == "eval_run_not_found"


@pytest.mark.parametrize(
    ("criterion", "param"),
    [
        ({**CRITERION, "operation": "equals"}, "testing_criteria.0.operation"),
        ({**CRITERION, "reference": "{{ item.expected }}"}, "testing_criteria.0"),
        ({**CRITERION, "type": "text_similarity", "evaluation_metric": "bleu", "pass_threshold": 0.5},
         "testing_criteria.0.operation"),
        ({k: v for k, v in CRITERION.items() if k != "operation"} | {"type": "text_similarity",
          "evaluation_metric": "bleu"}, "testing_criteria.0.pass_threshold"),
        ({**CRITERION, "type": "python", "source": "def grade(sample, item):\n    return 1\n"},
         "testing_criteria.0.input"),
    ],
)  # fmt: skip
def test_a_bad_criterion_is_a_400_naming_its_field(client, criterion, param):
    error = _error(_eval(client, testing_criteria=[{k: v for k, v in criterion.items() if v is not None}]))
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"


def test_a_python_criterion_is_refused_where_python_graders_are_off(client):
    criterion = {"type": "python", "name": "p", "source": "def grade(sample, item):\n    return 1\n"}
    error = _error(_eval(client, testing_criteria=[criterion]))
    assert error["param"] == "testing_criteria.0.type" and "FUSETUNE_PYTHON_GRADERS" in error["message"]


def test_a_bad_run_is_a_400_naming_its_field(client, eval_and_file):
    eval_id, file_id = eval_and_file
    runs = f"/v1/evals/{eval_id}/runs"
    error = _error(client.post(runs, json=_run_body(file_id, model="no-such-model")))
    assert error["param"] == "data_source.model" and "no-such-model" in error["message"]
    error = _error(client.post(runs, json=_run_body("file-nope")))
    assert error["param"] == "data_source.source.id"
    training = _upload(
        client,
        [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}],
        "fine-tune",
    )
    error = _error(client.post(runs, json=_run_body(training.json()["id"])))
    assert error["param"] == "data_source.source.id" and "purpose" in error["message"]
    missing = {"type": "template", "template": [{"role": "user", "content": "{{ item.prompt }}"}]}
    error = _error(client.post(runs, json=_run_body(file_id, input_messages=missing)))
    assert (
        error["param"] == "data_source.input_messages.template.0.content" and "'prompt'" in error["message"]
    )
    sample = {"type": "template", "template": [{"role": "user", "content": "{{ sample.output_text }}"}]}
    error = _error(client.post(runs, json=_run_body(file_id, input_messages=sample)))
    assert error["param"] == "data_source.input_messages.template.0.content"
    reference = {"type": "item_reference", "item_reference": "item.messages"}
    error = _error(client.post(runs, json=_run_body(file_id, input_messages=reference)))
    assert error["param"] == "data_source.input_messages.item_reference"
    error = _error(client.post(runs, json={"data_source": {**_run_body(file_id)["data_source"],
                                                           "sampling_params": {"temperature": 3}}}))  # fmt: skip
    assert error["param"] == "data_source.sampling_params.temperature"


def test_an_eval_file_holds_item_lines(client):
    error = _error(_upload(client, [{"question": "q"}]))
    assert error["param"] == "file" and "line 1" in error["message"] and '"item"' in error["message"]
    error = _error(_upload(client, [{"item": {"q": 1}}, {"item": {"q": 2}, "label": 1}]))
    assert "line 2" in error["message"] and "label" in error["message"]
    good = _upload(client, [{"item": {"q": 1}}, {"item": {"q": 2}, "sample": {"output_text": "x"}}])
    assert good.status_code == 200 and good.json()["purpose"] == "evals"


def test_another_tenants_eval_is_a_404(client, settings, eval_and_file):
    eval_id, file_id = eval_and_file
    run_id = client.post(f"/v1/evals/{eval_id}/runs", json=_run_body(file_id)).json()["id"]
    with make_session_factory(make_engine(settings.database_url))() as session:
        _, other_key = queries.create_api_key(session, "other")
        session.commit()
    other = {"Authorization": f"Bearer {other_key}"}
    for path in (f"/v1/evals/{eval_id}", f"/v1/evals/{eval_id}/runs", f"/v1/evals/{eval_id}/runs/{run_id}",
                 f"/v1/evals/{eval_id}/runs/{run_id}/output_items"):  # fmt: skip
        assert client.get(path, headers=other).status_code == 404, path
    assert client.delete(f"/v1/evals/{eval_id}", headers=other).status_code == 404
    assert client.post(f"/v1/evals/{eval_id}/runs", json=_run_body(file_id), headers=other).status_code == 404
    assert client.get("/v1/evals", headers=other).json()["data"] == []
    # Its own eval cannot read this tenant's file.
    own = _eval(client, name="theirs").json()["id"]  # the default tenant's, to compare
    theirs = client.post("/v1/evals", json={"data_source_config": {"type": "custom", "item_schema": ITEM_SCHEMA},
                                            "testing_criteria": [CRITERION]}, headers=other).json()["id"]  # fmt: skip
    assert own != theirs
    error = _error(client.post(f"/v1/evals/{theirs}/runs", json=_run_body(file_id), headers=other))
    assert error["param"] == "data_source.source.id"


def test_a_jobs_eval_runs_are_the_runs_of_its_model(client, settings, eval_and_file):
    from fusetune.db.models import DEFAULT_TENANT, EvalRun, Job, JobStatus

    eval_id, file_id = eval_and_file
    training = _upload(client, [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant",
                                                                                  "content": "b"}]}], "fine-tune")  # fmt: skip
    with make_session_factory(make_engine(settings.database_url))() as session:
        job = Job(tenant=DEFAULT_TENANT, model="tiny", training_file_id=training.json()["id"],
                  status=JobStatus.SUCCEEDED, fine_tuned_model="ft:tiny:default::abc")  # fmt: skip
        session.add(job)
        for model in ("ft:tiny:default::abc", "tiny"):
            session.add(EvalRun(eval_id=eval_id, tenant=DEFAULT_TENANT, model=model, status="completed",
                                data_source={}, result_counts={"total": 1, "passed": 1}))  # fmt: skip
        _, other_key = queries.create_api_key(session, "other")
        session.commit()
        job_id = job.id
    runs = client.get(f"/v1/fine_tuning/jobs/{job_id}/eval_runs").json()["data"]
    assert [run["model"] for run in runs] == ["ft:tiny:default::abc"]
    assert runs[0]["result_counts"] == {"total": 1, "passed": 1, "failed": 0, "errored": 0}
    other = {"Authorization": f"Bearer {other_key}"}
    assert client.get(f"/v1/fine_tuning/jobs/{job_id}/eval_runs", headers=other).status_code == 404
