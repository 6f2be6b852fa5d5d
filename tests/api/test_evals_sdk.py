"""One eval through the unmodified `openai` SDK against a running service (`fusetune serve`: the API and its
worker): the demo's held-out digits, graded by an exact string check, run on the bundled tiny model and on a model
fine-tuned from it on the demo's training file. The fine-tuned model passes more items than its base.

OpenAI's vendored spec subset (tests/data/openai_openapi) holds no eval schemas, so the fields are checked here,
besides what the SDK's own types parse.
"""

from __future__ import annotations

import json
import time

import openai
import pytest

from fusetune.demo import task
from fusetune.demo.run import DEMO_MODEL
from tests.services import running_service

pytestmark = pytest.mark.slow
FINISHED = ("completed", "failed", "canceled")
CRITERION = {
    "type": "string_check",
    "name": "exact number",
    "input": "{{ sample.output_text }}",
    "reference": "{{ item.answer }}",
    "operation": "eq",
}


def _eval_file() -> bytes:
    chats = task.read_examples(task.HELD_OUT_FILE)
    lines = [{"item": {"question": task.question(c), "answer": task.expected_answer(c)}} for c in chats]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def _wait(client: openai.OpenAI, eval_id: str, run_id: str):
    """The run once it ends (the worker takes it after the job before it in the queue)."""
    while (run := client.evals.runs.retrieve(run_id, eval_id=eval_id)).status not in FINISHED:
        time.sleep(0.5)
    return run


def test_the_fine_tuned_model_passes_more_of_the_eval_than_its_base(tmp_path):
    data_dir = tmp_path / "data"
    task.ensure_base_model(data_dir / "models" / DEMO_MODEL)
    with running_service(data_dir) as service:
        client = openai.OpenAI(base_url=f"{service.base_url}/v1", api_key=service.api_key, max_retries=0)
        with open(task.TRAIN_FILE, "rb") as handle:
            training = client.files.create(file=handle, purpose="fine-tune")
        # One epoch of the demo's settings (64 steps): enough to move the model from none right to most.
        job = client.fine_tuning.jobs.create(
            model=DEMO_MODEL,
            training_file=training.id,
            hyperparameters={**task.JOB_HYPERPARAMETERS, "n_epochs": 1},
        )
        items = client.files.create(file=("digits_eval.jsonl", _eval_file()), purpose="evals")
        assert items.purpose == "evals"
        evaluation = client.evals.create(
            name="digits",
            data_source_config={
                "type": "custom",
                "item_schema": {
                    "type": "object",
                    "properties": {"question": {"type": "string"}, "answer": {"type": "string"}},
                    "required": ["question", "answer"],
                },
            },
            testing_criteria=[CRITERION],
        )
        assert evaluation.object == "eval" and evaluation.id.startswith("eval_")
        assert evaluation.data_source_config.type == "custom"
        assert evaluation.data_source_config.schema_["properties"]["item"]["required"] == [
            "question",
            "answer",
        ]
        assert evaluation.testing_criteria[0].name == "exact number"

        def run_on(model: str):
            return client.evals.runs.create(
                evaluation.id,
                name=model,
                data_source={
                    "type": "completions",
                    "model": model,
                    "source": {"type": "file_id", "id": items.id},
                    "input_messages": {
                        "type": "template",
                        "template": [{"role": "user", "content": "{{ item.question }}"}],
                    },
                    "sampling_params": {"temperature": 0, "max_completion_tokens": 8, "seed": 1},
                },
            )

        base_run = run_on(DEMO_MODEL)
        assert base_run.object == "eval.run" and base_run.status in ("queued", "in_progress")
        # Bounded only against a hung job: on a quiet 2-core machine it ends in about a minute.
        finished = service.wait_for_job(job.id, timeout_s=1800)
        assert finished["status"] == "succeeded", finished
        tuned_run = run_on(finished["fine_tuned_model"])

        base, tuned = _wait(client, evaluation.id, base_run.id), _wait(client, evaluation.id, tuned_run.id)
        for run in (base, tuned):
            assert run.status == "completed", run.error
            counts = run.result_counts
            assert counts.total == 64 and counts.errored == 0
            assert counts.passed + counts.failed == 64
            [criterion] = run.per_testing_criteria_results
            assert criterion.testing_criteria == "exact number"
            assert (criterion.passed, criterion.failed) == (counts.passed, counts.failed)
            assert run.per_model_usage[0].invocation_count == 64
        assert tuned.model == finished["fine_tuned_model"] and base.model == DEMO_MODEL
        assert tuned.result_counts.passed > base.result_counts.passed, (
            base.result_counts,
            tuned.result_counts,
        )

        page = client.evals.runs.output_items.list(tuned.id, eval_id=evaluation.id, limit=100)
        output = list(page)
        assert [o.datasource_item_id for o in output] == list(range(64))
        for o in output:
            assert o.object == "eval.run.output_item" and o.run_id == tuned.id and o.eval_id == evaluation.id
            answer = o.sample.output[0].content
            assert o.sample.input[0].content == o.datasource_item["question"]
            assert o.results[0].passed == (answer == o.datasource_item["answer"])
            assert o.status == ("pass" if o.results[0].passed else "fail")
        assert sum(o.status == "pass" for o in output) == tuned.result_counts.passed
        runs = client.evals.runs.list(evaluation.id)
        assert [r.id for r in runs] == [base.id, tuned.id]
