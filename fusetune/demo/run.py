"""The demo: a real fine-tune through the HTTP API of a freshly started embedded service, and what it taught.

Every step goes through the service a user would run: ``fusetune serve`` (API + worker + SQLite + a broker on
SQLite), the bundled dataset uploaded over HTTP, a job created, polled and its checkpoint downloaded. The base
model and the downloaded checkpoint, each loaded with ``from_pretrained``, answer the same held-out prompts
(`fusetune.demo.task`), and the two sets of answers are printed side by side with their accuracies. Last, the
service itself answers one of those prompts with the fine-tuned model (a chat completion, POST /v1/chat/completions
over the same HTTP client as every other step: the demo needs no client library, so it makes the call wherever the
service runs, the image included).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from fusetune.config import Settings
from fusetune.demo import task

DEMO_MODEL = task.BUNDLED_MODEL
# Rows of the side-by-side table; the accuracies count every held-out prompt.
SHOWN_ANSWERS = 8
# The worker serves chat again once its job's training process ended, a moment after the job reads succeeded;
# until then the API answers 503. The chat call asks again every CHAT_RETRY_S until CHAT_WAIT_S have passed.
CHAT_RETRY_S = 0.5
CHAT_WAIT_S = 120.0
SERVING_NOT_YET = ("no_serving_worker", "worker_training")
console = Console()


# Plain records of what the demo saw: alike in shape to frozen records elsewhere, with nothing to share.
@dataclass(frozen=True)
class ChatReply:
    """One held-out prompt asked of the fine-tuned model through POST /v1/chat/completions."""

    prompt: str
    reply: str
    expected: str


@dataclass(frozen=True)
class DemoResult:
    job: dict
    base: task.Answers
    fine_tuned: task.Answers | None  # None when the job did not succeed
    chat: ChatReply | None = None  # None when the job did not succeed


def _start_server(settings: Settings, port: int) -> subprocess.Popen:
    env = {
        **os.environ,
        **settings.subprocess_env(),
        "FUSETUNE_PORT": str(port),
        "FUSETUNE_HOST": "127.0.0.1",
    }
    log = open(settings.data_dir / "server.log", "ab")  # noqa: SIM115 - lives as long as the server
    return subprocess.Popen(
        [sys.executable, "-m", "fusetune.cli", "serve"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _stop_server(server: subprocess.Popen) -> None:
    if server.poll() is not None:
        return
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)


def _wait_healthy(client: httpx.Client, server: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError("the server exited during start; see server.log in the data directory")
        try:
            if client.get("/healthz").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the server did not answer /healthz in time")


def _check(response: httpx.Response) -> dict:
    if response.status_code >= 400:
        raise RuntimeError(
            f"{response.request.method} {response.request.url.path} -> {response.status_code}: "
            f"{response.text}"
        )
    return response.json()


def _upload(client: httpx.Client, path: Path) -> dict:
    with open(path, "rb") as handle:
        return _check(
            client.post("/v1/files", files={"file": (path.name, handle)}, data={"purpose": "fine-tune"})
        )


def _poll(client: httpx.Client, job_id: str) -> dict:
    """Follow the job until it ends, printing its messages and its latest step; no time limit (a job that
    runs long shows its progress, and Ctrl-C stops the demo)."""
    seen_events: set[str] = set()
    with console.status("queued") as status:
        while True:
            job = _check(client.get(f"/v1/fine_tuning/jobs/{job_id}"))
            events = _check(client.get(f"/v1/fine_tuning/jobs/{job_id}/events",
                                       params={"limit": 100, "type": "message"}))["data"]  # fmt: skip
            for event in reversed(events):
                if event["id"] not in seen_events:
                    seen_events.add(event["id"])
                    console.log(event["message"])
            metrics = _check(client.get(f"/v1/fine_tuning/jobs/{job_id}/metrics"))["data"]
            line = f"{job['status']}"
            if metrics:
                last = metrics[-1]
                line += f"  step {last['step']}  loss {last['train_loss']:.4f}"
                tokens_per_s = last["values"].get("tokens_per_second")
                if tokens_per_s:
                    line += f"  {tokens_per_s:,.0f} tokens/s"
            status.update(line)
            if job["status"] in ("succeeded", "failed", "cancelled"):
                return job
            time.sleep(1.0)


def _metrics_table(metrics: list[dict]) -> Table:
    table = Table(title="training metrics (every few steps, and every evaluation of the held-out file)")
    for column in ("step", "train loss", "valid loss", "valid token acc", "lr", "tokens/s"):
        table.add_column(column, justify="right")
    stride = max(1, len(metrics) // 8)
    shown = {0, len(metrics) - 1} | {i for i, point in enumerate(metrics) if point["step"] % stride == 0}
    shown |= {i for i, point in enumerate(metrics) if "valid_loss" in point["values"]}
    for i in sorted(shown):
        point, values = metrics[i], metrics[i]["values"]
        valid = "valid_loss" in values
        table.add_row(
            str(point["step"]),
            f"{point['train_loss']:.4f}",
            f"{values['valid_loss']:.4f}" if valid else "",
            f"{values['valid_mean_token_accuracy']:.1%}" if valid else "",
            f"{values.get('learning_rate', 0):.2e}",
            f"{values.get('tokens_per_second', 0):,.0f}",
        )
    return table


def _download(client: httpx.Client, job_id: str, checkpoint: dict, target: Path) -> Path:
    """The checkpoint's archive, unpacked in `target`; returns the model folder."""
    url = f"/v1/fine_tuning/jobs/{job_id}/checkpoints/{checkpoint['id']}/content"
    archive = target / "checkpoint.tar"
    with client.stream("GET", url) as response, open(archive, "wb") as out:
        if response.status_code != 200:
            raise RuntimeError(f"checkpoint download failed: {response.status_code} {response.read()!r}")
        for chunk in response.iter_bytes():
            out.write(chunk)
    with tarfile.open(archive) as tar:
        tar.extractall(target, filter="data")
    (folder,) = [p for p in target.iterdir() if p.is_dir()]
    return folder


def _answer_with_checkpoint(
    client: httpx.Client, job_id: str, checkpoint: dict, chats: list[dict]
) -> task.Answers:
    """Download the checkpoint, load it with `from_pretrained` and answer `chats`; the download is removed after."""
    with tempfile.TemporaryDirectory(prefix="fusetune-demo-") as target:
        folder = _download(client, job_id, checkpoint, Path(target))
        console.print(f"downloaded checkpoint step {checkpoint['step_number']} and loaded it")
        return task.answer_held_out(folder, chats)


def _score(answers: task.Answers) -> str:
    return f"{answers.correct}/{len(answers.expected)} ({answers.accuracy:.0%})"


def _shown(answer: str) -> str:
    # A random model's reply can be any bytes; repr keeps it on one line, and it is cut to the column.
    text = repr(answer)
    return text if len(text) <= 18 else text[:17] + "…"


def _comparison_table(chats: list[dict], base: task.Answers, fine_tuned: task.Answers) -> Table:
    table = Table(
        title=f"the same held-out prompts, before and after (first {SHOWN_ANSWERS} of {len(chats)})"
    )
    table.add_column(f'"{task.QUESTION_PREFIX}…"')
    table.add_column("expected", justify="right")
    table.add_column("base model", justify="right")
    table.add_column("fine-tuned", justify="right")
    for i, chat in enumerate(chats[:SHOWN_ANSWERS]):
        marks = ["[green]✓" if run.answers[i] == run.expected[i] else "[red]✗" for run in (base, fine_tuned)]
        words = task.question(chat).removeprefix(task.QUESTION_PREFIX)
        base_answer, tuned_answer = _shown(base.answers[i]), _shown(fine_tuned.answers[i])
        table.add_row(words, base.expected[i], f"{base_answer} {marks[0]}", f"{tuned_answer} {marks[1]}")
    table.add_section()
    table.add_row(f"accuracy on all {len(chats)}", "", _score(base), _score(fine_tuned), style="bold")
    return table


def _chat_with_fine_tuned(client: httpx.Client, model: str, chat: dict) -> ChatReply:
    """`chat`'s question asked of `model` through POST /v1/chat/completions of the service `client` speaks to,
    greedily: the request and reply any OpenAI client sends and reads (tests/api/test_chat_completions.py makes
    the same call through the openai SDK)."""
    body = {
        "model": model,
        "messages": chat["messages"][:-1],
        "temperature": 0,
        "max_completion_tokens": task.DIGITS_PER_PROMPT + 3,
    }
    deadline = time.monotonic() + CHAT_WAIT_S
    while True:
        response = client.post("/v1/chat/completions", json=body, timeout=None)
        code = response.json().get("error", {}).get("code") if response.status_code == 503 else None
        if code not in SERVING_NOT_YET or time.monotonic() >= deadline:
            break
        time.sleep(CHAT_RETRY_S)
    completion = _check(response)
    reply = (completion["choices"][0]["message"]["content"] or "").strip()
    return ChatReply(prompt=task.question(chat), reply=reply, expected=task.expected_answer(chat))


def _print_chat(model: str, chat: ChatReply) -> None:
    mark = "[green]✓" if chat.reply == chat.expected else "[red]✗"
    console.print(f"[bold]one chat completion[/bold] (POST /v1/chat/completions, model {model}, temperature 0)",
                  soft_wrap=True)  # fmt: skip
    console.print(f"  prompt    {chat.prompt}")
    console.print(f"  reply     {_shown(chat.reply)} {mark}")
    console.print(f"  expected  {chat.expected}")


def fine_tune_and_compare(
    client: httpx.Client, base_model_dir: Path, n_gpus: int = 2, n_epochs: int | None = None
) -> DemoResult:
    """Answer the held-out prompts with the base model, fine-tune it on the task through the API `client`
    speaks to, download the checkpoint and answer the same prompts with it. `base_model_dir` is the folder
    of the service's model `DEMO_MODEL`."""
    held_out = task.read_examples(task.HELD_OUT_FILE)
    base = task.answer_held_out(base_model_dir, held_out)
    console.print(f"before fine-tuning, the base model answers {_score(base)} held-out prompts correctly")

    training, validation = _upload(client, task.TRAIN_FILE), _upload(client, task.HELD_OUT_FILE)
    console.print(f"uploaded {training['id']} ({training['example_count']} examples) and {validation['id']} "
                  f"({validation['example_count']} held-out examples, the validation file)")  # fmt: skip
    hyperparameters = {**task.JOB_HYPERPARAMETERS, "n_gpus": n_gpus}
    if n_epochs is not None:
        hyperparameters["n_epochs"] = n_epochs
    job = _check(client.post("/v1/fine_tuning/jobs", json={
        "model": DEMO_MODEL, "training_file": training["id"], "validation_file": validation["id"],
        "suffix": "demo", "seed": 0, "hyperparameters": hyperparameters,
    }))  # fmt: skip
    console.print(f"created {job['id']} ({job['status']})")
    job = _poll(client, job["id"])
    if job["status"] != "succeeded":
        console.print(f"[red]job {job['status']}: {job.get('error')}")
        return DemoResult(job=job, base=base, fine_tuned=None)

    metrics = _check(client.get(f"/v1/fine_tuning/jobs/{job['id']}/metrics"))["data"]
    console.print(_metrics_table(metrics))
    console.print(
        f"train loss {metrics[0]['train_loss']:.3f} -> {metrics[-1]['train_loss']:.3f}; trained tokens "
        f"{job['trained_tokens']:,}; model {job['fine_tuned_model']}"
    )
    checkpoints = _check(client.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints"))["data"]
    fine_tuned = _answer_with_checkpoint(client, job["id"], checkpoints[0], held_out)
    console.print(_comparison_table(held_out, base, fine_tuned))
    # The table's first prompt again, answered by the service itself: the fine-tuned model as any client calls it.
    chat = _chat_with_fine_tuned(client, job["fine_tuned_model"], held_out[0])
    _print_chat(job["fine_tuned_model"], chat)
    return DemoResult(job=job, base=base, fine_tuned=fine_tuned, chat=chat)


def _print_next_steps(base_url: str, api_key: str, job_id: str, data_dir: Path, keep_serving: bool) -> None:
    console.print()
    console.print("[bold]where to look next")
    console.print(f"  job id     {job_id}")
    console.print(f"  dashboard  {base_url}/ui/#/jobs/{job_id}  (API key: {api_key})", soft_wrap=True)
    console.print(f"  curl       curl -H 'Authorization: Bearer {api_key}' "
                  f"{base_url}/v1/fine_tuning/jobs/{job_id}/metrics", soft_wrap=True)  # fmt: skip
    console.print(f"  openai     OpenAI(base_url='{base_url}/v1', api_key='{api_key}').fine_tuning.jobs"
                  f".list_events('{job_id}', extra_query={{'type': 'metrics'}})", soft_wrap=True)  # fmt: skip
    if keep_serving:
        console.print(f"the service keeps running at {base_url}; Ctrl-C stops it")
    else:
        console.print(
            "the service stops now: `fusetune demo --keep-serving` leaves it up, and "
            f"`fusetune serve --data-dir {data_dir} --port {base_url.rsplit(':', 1)[1]}` serves this job again",
            soft_wrap=True,
        )


def _interrupt(signum: int, _frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def run_demo(
    settings: Settings,
    port: int = 8765,
    n_gpus: int = 2,
    n_epochs: int | None = None,
    keep_serving: bool = False,
) -> int:
    """The demo from start to end; returns the process exit status (0 when the job succeeded)."""
    model_dir, built = task.ensure_base_model(settings.models_dir / DEMO_MODEL)
    if built:
        console.print(f"built the demo base model (random weights, local tokenizer) in {model_dir}")
    server = _start_server(settings, port)
    base_url = f"http://127.0.0.1:{port}"
    # The server runs in a session of its own (a terminal's Ctrl-C reaches the demo alone), so the demo stops
    # it on the way out; a kill or a closed terminal takes that way too instead of leaving the server behind.
    previous_handlers = {
        signum: signal.signal(signum, _interrupt) for signum in (signal.SIGTERM, signal.SIGHUP)
    }
    try:
        auth = {"Authorization": f"Bearer {settings.dev_api_key}"}
        with httpx.Client(base_url=base_url, timeout=60, headers=auth) as client:
            _wait_healthy(client, server)
            console.print(f"service up at {base_url} (data in {settings.data_dir})")
            result = fine_tune_and_compare(client, model_dir, n_gpus=n_gpus, n_epochs=n_epochs)
        _print_next_steps(base_url, settings.dev_api_key, result.job["id"], settings.data_dir, keep_serving)
        if keep_serving:
            try:
                server.wait()
                console.print(f"[red]the service exited; see {settings.data_dir / 'server.log'}")
            except KeyboardInterrupt:
                console.print("stopping the service")
        return 0 if result.fine_tuned is not None else 1
    finally:
        _stop_server(server)
        for signum, handler in previous_handlers.items():
            signal.signal(signum, handler)
