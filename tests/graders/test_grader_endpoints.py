"""The grader endpoints through the unmodified `openai` SDK against a real server (`fusetune serve`, python
graders on): `client.fine_tuning.alpha.graders.run(...)` and `.validate(...)` parse what the server answers."""

from __future__ import annotations

import openai
import pytest

from fusetune.graders import sandbox
from tests.services import running_service, skip_or_fail

pytestmark = pytest.mark.slow

EXACT = {"type": "string_check", "name": "exact", "operation": "eq",
         "input": "{{ sample.output_text }}", "reference": "{{ item.answer }}"}  # fmt: skip


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("graders") / "data"
    data_dir.mkdir()
    # No worker: grading needs none. Python graders on, with a short limit for the one that loops.
    with running_service(data_dir, extra_env={"FUSETUNE_EMBEDDED_WORKER": "false"}, python_graders="true",
                         python_grader_timeout_s="2") as service:  # fmt: skip
        yield openai.OpenAI(base_url=f"{service.base_url}/v1", api_key=service.api_key, max_retries=0)


def test_run_string_check(client):
    graders = client.fine_tuning.alpha.graders
    right = graders.run(grader=EXACT, model_sample="1777", item={"answer": "1777"})
    assert right.reward == 1.0 and right.sub_rewards == {"exact": 1.0}
    assert right.metadata.name == "exact" and right.metadata.type == "string_check"
    assert right.metadata.scores == {"exact": 1.0} and right.metadata.execution_time >= 0
    assert not right.metadata.errors.invalid_variable_error and not right.metadata.errors.other_error
    wrong = graders.run(grader=EXACT, model_sample="1778", item={"answer": "1777"})
    assert wrong.reward == 0.0
    missing = graders.run(grader=EXACT, model_sample="1777", item={"solution": "1777"})
    assert missing.reward == 0.0 and missing.metadata.errors.invalid_variable_error


def test_run_multi_and_python(client):
    graders = client.fine_tuning.alpha.graders
    multi = {"type": "multi", "name": "both", "calculate_output": "0.25 * exact + 0.75 * close",
             "graders": {"exact": EXACT, "close": {"type": "text_similarity", "name": "close",
                         "input": "{{ sample.output_text }}", "reference": "{{ item.answer }}",
                         "evaluation_metric": "fuzzy_match"}}}  # fmt: skip
    result = graders.run(grader=multi, model_sample="1777", item={"answer": "1777"})
    assert result.reward == 1.0 and result.sub_rewards == {"exact": 1.0, "close": 1.0}
    if (
        missing := sandbox.unavailable()
    ) is not None:  # python graders need it (tests/graders/test_python_sandbox.py)
        skip_or_fail(f"the sandbox cannot run on this machine: {missing}")
    digits = {"type": "python", "name": "digits",
              "source": "def grade(sample, item):\n    return float(sample['output_text'].isdigit())\n"}  # fmt: skip
    assert graders.run(grader=digits, model_sample="2914").reward == 1.0
    loops = {**digits, "source": "def grade(sample, item):\n    while True:\n        pass\n"}
    stopped = graders.run(grader=loops, model_sample="2914")
    assert stopped.reward == 0.0 and stopped.metadata.errors.python_grader_server_error
    assert "timed out after 2 s" in stopped.metadata.errors.python_grader_server_error_type
    raises = {**digits, "source": "def grade(sample, item):\n    return 1 / 0\n"}
    failed = graders.run(grader=raises, model_sample="2914")
    assert failed.metadata.errors.python_grader_runtime_error
    assert "ZeroDivisionError" in failed.metadata.errors.python_grader_runtime_error_details


def test_validate(client):
    graders = client.fine_tuning.alpha.graders
    assert graders.validate(grader=EXACT).grader.name == "exact"
    with pytest.raises(openai.BadRequestError) as refused:
        graders.validate(grader={**EXACT, "operation": "equals"})
    assert refused.value.body["param"] == "grader.operation"
    with pytest.raises(openai.BadRequestError) as refused:
        graders.validate(grader={"type": "text_similarity", "name": "c", "input": "a", "reference": "b",
                                 "evaluation_metric": "cosine"})  # fmt: skip
    assert refused.value.body["param"] == "grader.evaluation_metric" and "embedding" in refused.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        graders.validate(grader={"type": "score_model", "name": "judge", "model": "gpt-4o",
                                 "input": [{"role": "user", "content": "Grade {{ sample.output_text }}"}]})  # fmt: skip
    assert refused.value.body["param"] == "grader.type" and "not available" in refused.value.message
