"""The demo's task (fusetune/demo/task.py): its bundled files, and that the demo's job, at full size and through
the real service (``fusetune serve``, its worker, a 2-process torchrun on CPU), teaches the base model to answer
held-out prompts it could not answer before."""

from __future__ import annotations

import json

import httpx
import pytest
from typer.testing import CliRunner

from fusetune.cli import app
from fusetune.demo import run, task
from fusetune.demo.run import DEMO_MODEL, fine_tune_and_compare
from tests.services import running_service


def test_bundled_files_match_the_generator(tmp_path):
    train, held_out = task.write_bundled_files(tmp_path)
    assert train.read_bytes() == task.TRAIN_FILE.read_bytes()
    assert held_out.read_bytes() == task.HELD_OUT_FILE.read_bytes()


def test_held_out_prompts_are_not_in_the_training_file():
    train = [task.question(chat) for chat in task.read_examples(task.TRAIN_FILE)]
    held_out = [task.question(chat) for chat in task.read_examples(task.HELD_OUT_FILE)]
    assert len(set(train)) == len(train) == task.TRAIN_EXAMPLES
    assert len(set(held_out)) == len(held_out) == task.HELD_OUT_EXAMPLES
    assert not set(train) & set(held_out)


def test_examples_spell_the_answer():
    chat = task.example([2, 9, 1, 4])
    assert task.question(chat) == "Write in digits: two nine one four"
    assert task.expected_answer(chat) == "2914"


def test_base_model_is_rebuilt_only_for_another_task(tmp_path):
    folder, built = task.ensure_base_model(tmp_path / DEMO_MODEL)
    assert built and (folder / "config.json").exists()
    assert task.ensure_base_model(folder) == (folder, False)
    # A folder an older demo built (another task's tokenizer) has no marker, or another task's.
    (folder / task.TASK_MARKER_FILE).write_text("arithmetic\n")
    assert task.ensure_base_model(folder) == (folder, True)


def test_demo_command_offers_keep_serving():
    result = CliRunner().invoke(app, ["demo", "--help"])
    assert result.exit_code == 0 and "--keep-serving" in result.output


def _completion(content: str) -> dict:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "ft",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content, "refusal": None},
                         "finish_reason": "stop", "logprobs": None}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}}  # fmt: skip


def _unavailable(code: str) -> httpx.Response:
    error = {"message": "later", "type": "server_error", "param": None, "code": code}
    return httpx.Response(503, json={"error": error})


def test_the_demos_chat_call_waits_for_the_worker_to_serve_again(monkeypatch):
    """The demo's chat completion is a plain POST over its HTTP client (no openai package needed, so it runs in
    the image too); the 503s of the moment the worker has not yet served again after training are asked again."""
    monkeypatch.setattr(run, "CHAT_RETRY_S", 0)
    first = task.read_examples(task.HELD_OUT_FILE)[0]
    answers = [_unavailable("no_serving_worker"), _unavailable("worker_training"),
               httpx.Response(200, json=_completion(f" {task.expected_answer(first)}\n"))]  # fmt: skip
    bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/chat/completions"
        bodies.append(json.loads(request.content))
        return answers[len(bodies) - 1]

    with httpx.Client(base_url="http://service", transport=httpx.MockTransport(handler)) as client:
        reply = run._chat_with_fine_tuned(client, "ft:tiny", first)
    assert reply == run.ChatReply(
        task.question(first), task.expected_answer(first), task.expected_answer(first)
    )
    assert len(bodies) == 3 and bodies[0]["messages"] == first["messages"][:-1]
    assert bodies[0]["model"] == "ft:tiny" and bodies[0]["temperature"] == 0
    # Another failure is not asked again, and the wait ends at CHAT_WAIT_S: both raise with the service's answer.
    monkeypatch.setattr(run, "CHAT_WAIT_S", 0)
    for answer in (
        _unavailable("no_serving_worker"),
        httpx.Response(404, json={"error": {"code": "model_not_found"}}),
    ):
        with httpx.Client(
            base_url="http://service", transport=httpx.MockTransport(lambda _, a=answer: a)
        ) as client:
            with pytest.raises(RuntimeError, match=str(answer.status_code)):
                run._chat_with_fine_tuned(client, "ft:tiny", first)


@pytest.mark.slow
def test_demo_job_teaches_the_task(tmp_path, capsys):
    """The demo's job as `make demo` submits it; it ends when the job does, however long that takes. Its last
    word is the service's: the fine-tuned model answers a held-out prompt through POST /v1/chat/completions."""
    data_dir = tmp_path / "data"
    model_dir, _ = task.ensure_base_model(data_dir / "models" / DEMO_MODEL)
    with running_service(data_dir) as service:
        result = fine_tune_and_compare(service.client, model_dir, n_gpus=2)
    assert result.job["status"] == "succeeded", result.job
    assert result.base.accuracy <= 0.1, result.base
    assert result.fine_tuned is not None and result.fine_tuned.accuracy >= 0.9, result.fine_tuned
    # Greedy, the fine-tuned model gets the held-out prompts right: the chat reply is the expected number.
    first = task.read_examples(task.HELD_OUT_FILE)[0]
    assert result.chat is not None and result.chat.prompt == task.question(first), result.chat
    assert result.chat.reply == result.chat.expected == task.expected_answer(first), result.chat
    printed = capsys.readouterr().out
    assert f"model {result.job['fine_tuned_model']}" in printed, printed[-2000:]
    assert f"reply     '{result.chat.expected}' ✓" in printed, printed[-2000:]
    assert f"expected  {result.chat.expected}" in printed, printed[-2000:]


def test_the_downloaded_checkpoint_leaves_nothing_in_the_temp_directory(tmp_path, monkeypatch):
    """Each demo run left its 2.7 MB download, a `fusetune-demo-*` folder, in the temp directory."""
    import io
    import tarfile
    import tempfile

    import httpx

    from fusetune.demo import run

    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w") as tar:
        config = b'{"model_type": "llama"}'
        info = tarfile.TarInfo("checkpoint-step-8/config.json")
        info.size = len(config)
        tar.addfile(info, io.BytesIO(config))
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=archive.getvalue()))
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    loaded = []

    def answer(folder, chats):
        loaded.append((folder / "config.json").read_bytes())
        return task.Answers(answers=["1"], expected=["1"])

    monkeypatch.setattr(task, "answer_held_out", answer)
    with httpx.Client(base_url="http://server", transport=transport) as client:
        answers = run._answer_with_checkpoint(client, "ftjob-1", {"id": "ckpt-1", "step_number": 8}, [])
    assert answers.correct == 1 and loaded == [config]
    assert list(temp.iterdir()) == []
