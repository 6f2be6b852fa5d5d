"""The command line's HTTP client (fusetune/client.py) and the `files` and `jobs` commands over it, against a
scripted API (httpx's MockTransport): what `jobs follow` shows and how it ends. tests/test_readme_snippets.py
runs the same commands against a real server."""

from __future__ import annotations

import json

import httpx
import pytest
from typer.testing import CliRunner

from fusetune import client
from fusetune.cli import app

JOB_ID = "ftjob-abc"


class ScriptedApi:
    """A job that is queued, then runs two steps of four, then ends as `final`; each retrieve is one poll."""

    def __init__(self, final: dict):
        self.polls = 0
        self.final = final
        self.requests: list[httpx.Request] = []

    def _job(self) -> dict:
        status = ["queued", "running", "running"][self.polls - 1] if self.polls <= 3 else None
        job = {
            "id": JOB_ID,
            "status": status,
            "model": "tiny-llama",
            "created_at": 0,
            "fine_tuned_model": None,
        }
        return job if status else {**job, **self.final}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path = request.url.path
        assert request.headers["authorization"] == "Bearer sk-test"
        if path == f"/v1/fine_tuning/jobs/{JOB_ID}":
            self.polls += 1
            return httpx.Response(200, json=self._job())
        if path.endswith("/events"):
            events = []
            if self.polls >= 2:
                events.append({"id": "e2", "message": "Training started: 4 steps",
                               "data": {"event": "started", "total_steps": 4}})  # fmt: skip
            events.append({"id": "e1", "message": "Job queued", "data": None})
            return httpx.Response(200, json={"data": events})  # newest first
        if path.endswith("/metrics"):
            min_step = int(request.url.params.get("min_step", 0))
            steps = {1: [], 2: [1], 3: [1, 2]}.get(self.polls, [1, 2, 3, 4])
            points = [{"step": step, "train_loss": 5.0 - step,
                       "values": {"tokens_per_second": 100.0 * step, "eta_s": 10.0 * (4 - step)}}
                      for step in steps if step >= min_step]  # fmt: skip
            return httpx.Response(200, json={"data": points, "has_more": False})
        if path == "/v1/files":
            return httpx.Response(200, json={"id": "file-1", "filename": "train.jsonl", "example_count": 3})
        if path == "/v1/fine_tuning/jobs" and request.method == "POST":
            body = json.loads(request.content)
            if body["model"] == "nope":
                return httpx.Response(400, json={"error": {"message": "Model 'nope' is not available."}})
            return httpx.Response(200, json={"id": JOB_ID, "status": "queued", **body})
        raise AssertionError(f"unexpected request {request.method} {request.url}")


def _client(api: ScriptedApi) -> client.Client:
    return client.Client("http://server/v1", "sk-test", transport=httpx.MockTransport(api))


def test_follow_reports_steps_loss_tokens_per_second_and_time_left_until_the_job_ends():
    api = ScriptedApi({"status": "succeeded", "fine_tuned_model": "ft:tiny-llama:default::ftjob-abc"})
    with _client(api) as http:
        seen = list(http.follow(JOB_ID, poll_s=0))
    progress = [p for p, _ in seen]
    assert [p.job["status"] for p in progress] == ["queued", "running", "running", "succeeded"]
    assert [p.step for p in progress] == [None, 1, 2, 4]
    assert [p.total_steps for p in progress] == [None, 4, 4, 4]
    assert (
        progress[2].train_loss == 3.0 and progress[2].tokens_per_second == 200.0 and progress[2].eta_s == 20.0
    )
    assert progress[-1].finished and not progress[2].finished
    # Each message once, oldest first; metrics asked from the step after the last one seen.
    assert [[e["message"] for e in events] for _, events in seen] == [
        ["Job queued"],
        ["Training started: 4 steps"],
        [],
        [],
    ]
    metric_requests = [r.url.params.get("min_step") for r in api.requests if r.url.path.endswith("/metrics")]
    assert metric_requests == ["0", "0", "2", "3"]


def test_eta_falls_back_to_the_step_time_when_the_trainer_gave_none():
    point = {"step": 3, "train_loss": 1.0, "values": {"step_time_s": 2.0}}
    assert client._progress({"status": "running"}, point, total_steps=10).eta_s == 14.0
    assert client._progress({"status": "running"}, point, total_steps=None).eta_s is None


@pytest.fixture
def scripted(monkeypatch):
    def install(final: dict) -> ScriptedApi:
        api = ScriptedApi(final)
        real = client.Client
        monkeypatch.setattr(
            client, "Client", lambda url, key: real(url, key, transport=httpx.MockTransport(api))
        )
        return api

    monkeypatch.setenv("FUSETUNE_API_KEY", "sk-test")
    monkeypatch.setenv("FUSETUNE_BASE_URL", "http://server/v1")
    return install


def test_jobs_follow_prints_the_fine_tuned_model_and_exits_0_when_the_job_succeeded(scripted):
    scripted({"status": "succeeded", "fine_tuned_model": "ft:tiny-llama:default::ftjob-abc"})
    result = CliRunner().invoke(app, ["jobs", "follow", JOB_ID, "--poll-s", "0.1"])
    assert result.exit_code == 0, result.output
    assert f"{JOB_ID} succeeded: ft:tiny-llama:default::ftjob-abc" in result.output
    assert "Training started: 4 steps" in result.output and "loss" in result.output


def test_jobs_follow_exits_1_with_the_error_when_the_job_failed(scripted):
    scripted({"status": "failed", "error": {"code": "trainer_error", "message": "out of memory"}})
    result = CliRunner().invoke(app, ["jobs", "follow", JOB_ID, "--poll-s", "0.1"])
    assert result.exit_code == 1
    assert f"{JOB_ID} failed: out of memory" in result.output


def test_files_upload_and_jobs_create_print_the_ids_and_send_the_flags(scripted, tmp_path):
    api = scripted({"status": "succeeded"})
    training = tmp_path / "train.jsonl"
    training.write_text('{"messages": []}\n')
    upload = CliRunner().invoke(app, ["files", "upload", str(training), "--purpose", "fine-tune"])
    assert upload.exit_code == 0 and upload.stdout.strip().endswith("file-1")
    create = CliRunner().invoke(app, ["jobs", "create", "--model", "tiny-llama", "--training-file", "file-1",
                                      "--n-epochs", "2", "--learning-rate", "3e-3",
                                      "--hyperparameters", '{"warmup_ratio": 0.05}'])  # fmt: skip
    assert create.exit_code == 0, create.output
    assert create.stdout.strip().endswith(JOB_ID)
    body = json.loads(api.requests[-1].content)
    assert body == {"model": "tiny-llama", "training_file": "file-1",
                    "hyperparameters": {"warmup_ratio": 0.05, "n_epochs": 2, "learning_rate": 3e-3}}  # fmt: skip


def test_a_refused_request_ends_the_command_with_the_servers_message(scripted):
    scripted({"status": "succeeded"})
    result = CliRunner().invoke(app, ["jobs", "create", "--model", "nope", "--training-file", "file-1"])
    assert result.exit_code == 1
    assert "the server answered 400: Model 'nope' is not available." in result.output


def test_without_a_key_the_command_says_how_to_give_one(monkeypatch):
    monkeypatch.delenv("FUSETUNE_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    result = CliRunner().invoke(app, ["jobs", "list"])
    assert result.exit_code == 2 and "FUSETUNE_API_KEY" in result.output


def test_the_base_url_and_key_default_from_the_environment(monkeypatch):
    monkeypatch.delenv("FUSETUNE_BASE_URL", raising=False)
    monkeypatch.delenv("FUSETUNE_API_KEY", raising=False)
    monkeypatch.setenv("OPENAI_BASE_URL", "http://openai-style/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai")
    assert (client.default_base_url(), client.default_api_key()) == ("http://openai-style/v1", "sk-openai")
    monkeypatch.setenv("FUSETUNE_BASE_URL", "http://fusetune/v1")
    monkeypatch.setenv("FUSETUNE_API_KEY", "sk-fusetune")
    assert (client.default_base_url(), client.default_api_key()) == ("http://fusetune/v1", "sk-fusetune")
    monkeypatch.delenv("FUSETUNE_BASE_URL")
    monkeypatch.delenv("OPENAI_BASE_URL")
    assert client.default_base_url() == "http://127.0.0.1:8000/v1"
