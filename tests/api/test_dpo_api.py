"""DPO through the API, in-process: preference files are checked line by line and say which method they fit,
and a job's method must match its files (the run itself: tests/api/test_openai_sdk.py)."""

from __future__ import annotations

import json

import pytest

from fusetune.demo.assets import PREFERENCE_FILE
from tests.api.test_validation import GOOD_LINE, _assert_error_shape, _upload

PAIR = json.loads(PREFERENCE_FILE.read_text().splitlines()[0])


def _line(**change) -> str:
    return json.dumps({**PAIR, **change})


@pytest.fixture
def pairs_file(client) -> str:
    response = _upload(client, "\n".join(PREFERENCE_FILE.read_text().splitlines()[:8]))
    assert response.status_code == 200, response.text
    assert response.json()["method"] == "dpo" and response.json()["example_count"] == 8
    return response.json()["id"]


def test_a_chat_file_fits_supervised(client):
    assert _upload(client, GOOD_LINE).json()["method"] == "supervised"


def test_bad_preference_lines_are_named(client):
    assistant_last = {"messages": [*PAIR["input"]["messages"], {"role": "assistant", "content": "1"}]}
    lines = [
        _line(),
        _line(input=assistant_last),
        _line(non_preferred_output=PAIR["preferred_output"]),
        _line(preferred_output=[*PAIR["preferred_output"], *PAIR["preferred_output"]]),
        GOOD_LINE,
    ]
    error = _assert_error_shape(_upload(client, "\n".join(lines)), 400, "file")
    message = error["message"]
    assert "line 2: the last input message must not be the assistant's" in message
    assert "line 3: 'preferred_output' and 'non_preferred_output' are the same" in message
    assert "line 4: 'preferred_output' must be a list of exactly one assistant message (got 2)" in message
    assert "line 5: a supervised example in a file of dpo examples" in message
    assert "line 1" not in message


def test_a_dpo_job_reports_its_method_and_beta(client, pairs_file):
    response = client.post(
        "/v1/fine_tuning/jobs",
        json={"model": "tiny", "training_file": pairs_file,
              "method": {"type": "dpo", "dpo": {"hyperparameters": {"beta": "auto", "n_epochs": 2}}}},
    )  # fmt: skip
    assert response.status_code == 200, response.text
    method = response.json()["method"]
    assert method["type"] == "dpo"
    assert method["dpo"]["hyperparameters"] == {
        "n_epochs": 2, "batch_size": 8, "learning_rate_multiplier": 1.0,
        "beta": 0.1, "loss_type": "sigmoid", "sft_weight": 0.0,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("method", "file", "param"),
    [
        ({"type": "dpo"}, "chat", "training_file"),
        ({"type": "supervised"}, "pairs", "training_file"),
        (
            {"type": "dpo", "dpo": {"hyperparameters": {"beta": 3}}},
            "pairs",
            "method.dpo.hyperparameters.beta",
        ),
        ({"type": "dpo", "dpo": {"hyperparameters": {"packing": True}}}, "pairs", "hyperparameters.packing"),
        ({"type": "supervised", "dpo": {}}, "pairs", "method"),
    ],
)
def test_a_job_whose_method_does_not_fit_is_refused(client, pairs_file, method, file, param):
    training = pairs_file if file == "pairs" else _upload(client, GOOD_LINE).json()["id"]
    response = client.post(
        "/v1/fine_tuning/jobs", json={"model": "tiny", "training_file": training, "method": method}
    )
    _assert_error_shape(response, 400, param)
