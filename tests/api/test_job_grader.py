"""A reinforcement job's grader is checked when the job is created, as `/graders/validate` checks it (one function
answers both), and tried on the first lines of the job's files: a grader this server cannot run, a malformed
template, or a template naming a field the lines lack is a 400 in OpenAI's error shape naming the field, and no
job is created. In-process app, real queue, no worker (see test_validation.py)."""

from __future__ import annotations

import json

import pytest

from fusetune.db.models import Job
from tests.api.test_validation import _assert_error_shape, _count, _upload

EXACT = {"type": "string_check", "name": "exact", "operation": "eq",
         "input": "{{ sample.output_text }}", "reference": "{{ item.answer }}"}  # fmt: skip
PROMPT = [{"role": "user", "content": "Write in digits: two nine one four"}]
GRADER = "method.reinforcement.grader"


def _prompts(*items: dict) -> str:
    return "".join(json.dumps({"messages": PROMPT, **item}) + "\n" for item in items)


@pytest.fixture
def prompts_file(client) -> str:
    response = _upload(
        client, _prompts({"answer": "2914"}, {"answer": "3"}, {"answer": "17"}), "prompts.jsonl"
    )
    assert response.status_code == 200, response.text
    assert response.json()["method"] == "reinforcement"
    return response.json()["id"]


def _create(client, training_file: str, grader: dict, **body):
    return client.post("/v1/fine_tuning/jobs", json={
        "model": "tiny", "training_file": training_file,
        "method": {"type": "reinforcement", "reinforcement": {"grader": grader}}, **body,
    })  # fmt: skip


def test_a_good_grader_creates_the_job(client, settings, prompts_file):
    response = _create(client, prompts_file, EXACT)
    assert response.status_code == 200, response.text
    assert _count(settings, Job) == 1


COSINE = {"type": "text_similarity", "name": "close", "input": "{{ sample.output_text }}",
          "reference": "{{ item.answer }}", "evaluation_metric": "cosine"}  # fmt: skip
MODEL_INPUT = [{"role": "user", "content": "Grade {{ sample.output_text }} against {{ item.answer }}"}]
PYTHON = {"type": "python", "name": "digits", "source": "def grade(sample, item):\n    return 1.0\n"}


@pytest.mark.parametrize(
    ("grader", "param", "words"),
    [
        (PYTHON, f"{GRADER}.type", "FUSETUNE_PYTHON_GRADERS"),
        (
            {"type": "score_model", "name": "judge", "model": "gpt-4o", "input": MODEL_INPUT},
            f"{GRADER}.type",
            "not available",
        ),
        (
            {
                "type": "label_model",
                "name": "judge",
                "model": "gpt-4o",
                "input": MODEL_INPUT,
                "labels": ["ok", "no"],
                "passing_labels": ["ok"],
            },
            f"{GRADER}.type",
            "not available",
        ),
        (COSINE, f"{GRADER}.evaluation_metric", "embedding"),
        (
            {
                "type": "multi",
                "name": "both",
                "calculate_output": "exact + close",
                "graders": {"exact": EXACT, "close": COSINE},
            },
            f"{GRADER}.graders.close.evaluation_metric",
            "embedding",
        ),
    ],
    ids=["python-off", "score_model", "label_model", "cosine", "cosine-in-multi"],
)
def test_a_grader_this_server_cannot_run_is_refused_as_validate_refuses_it(
    client, settings, prompts_file, grader, param, words
):
    error = _assert_error_shape(_create(client, prompts_file, grader), 400, param)
    assert error["code"] == "unsupported_grader" and words in error["message"]
    # The same answer as /graders/validate's, under the job's field.
    validated = _assert_error_shape(
        client.post("/v1/fine_tuning/alpha/graders/validate", json={"grader": grader}), 400
    )
    assert validated["param"] == param.replace(GRADER, "grader")
    assert validated["message"].split(": ", 1)[1] == error["message"].split(": ", 1)[1]
    # A dry run says so too, rather than an estimate of a job that would score 0 throughout.
    _assert_error_shape(_create(client, prompts_file, grader, dry_run=True), 400, param)
    assert _count(settings, Job) == 0


@pytest.mark.parametrize("field", ["input", "reference"])
def test_an_unclosed_template_is_refused_by_validate_and_job_creation(client, settings, prompts_file, field):
    grader = {**EXACT, field: "{{ sample.output_text "}
    error = _assert_error_shape(_create(client, prompts_file, grader), 400, f"{GRADER}.{field}")
    assert "no closing }}" in error["message"] and "column 0" in error["message"]
    validated = _assert_error_shape(
        client.post("/v1/fine_tuning/alpha/graders/validate", json={"grader": grader}), 400, f"grader.{field}"
    )
    assert "no closing }}" in validated["message"]
    assert _count(settings, Job) == 0


def test_a_template_naming_a_field_the_lines_lack_is_refused_naming_the_field_and_the_line(
    client, settings, prompts_file
):
    grader = {**EXACT, "reference": "{{ item.nonexistent }}"}
    # /graders/validate sees no file: the grader itself is fine.
    assert client.post("/v1/fine_tuning/alpha/graders/validate", json={"grader": grader}).status_code == 200
    error = _assert_error_shape(_create(client, prompts_file, grader), 400, f"{GRADER}.reference")
    assert error["code"] == "invalid_grader_variable"
    assert "'nonexistent'" in error["message"] and "line 1 of training_file" in error["message"]
    assert prompts_file in error["message"]
    _assert_error_shape(_create(client, prompts_file, grader, dry_run=True), 400, f"{GRADER}.reference")
    # Inside a multi grader, the sub-grader's field.
    multi = {"type": "multi", "name": "both", "calculate_output": "exact + wrong",
             "graders": {"exact": EXACT, "wrong": {**EXACT, "name": "wrong", "input": "{{ item.answer.value }}"}}}  # fmt: skip
    error = _assert_error_shape(_create(client, prompts_file, multi), 400, f"{GRADER}.graders.wrong.input")
    assert "line 1" in error["message"]
    assert _count(settings, Job) == 0


def test_the_first_line_that_lacks_the_field_is_named_in_either_file(client, settings, prompts_file):
    partly = _upload(client, _prompts({"answer": "1"}, {"answer": "2"}, {"solution": "3"}), "partly.jsonl")
    error = _assert_error_shape(_create(client, partly.json()["id"], EXACT), 400, f"{GRADER}.reference")
    assert "line 3 of training_file" in error["message"]
    error = _assert_error_shape(
        _create(client, prompts_file, EXACT, validation_file=partly.json()["id"]), 400, f"{GRADER}.reference"
    )
    assert "line 3 of validation_file" in error["message"]
    assert _count(settings, Job) == 0
