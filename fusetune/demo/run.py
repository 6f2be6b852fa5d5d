"""The demo: a real fine-tune through the HTTP API of a freshly started embedded service.

Every step goes through the service a user would run: ``fusetune serve`` (API + worker + SQLite + a broker on
SQLite), the bundled dataset uploaded over HTTP, a job created, polled and its checkpoint downloaded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from fusetune.config import Settings
from fusetune.demo.assets import SYSTEM_PROMPT, TRAIN_FILE, VALID_FILE, build_tiny_model

DEMO_MODEL = "tiny-llama"
console = Console()


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
    seen_events: set[str] = set()
    with console.status("queued") as status:
        while True:
            job = _check(client.get(f"/v1/fine_tuning/jobs/{job_id}"))
            events = _check(client.get(f"/v1/fine_tuning/jobs/{job_id}/events", params={"limit": 100}))[
                "data"
            ]
            for event in reversed(events):
                if event["id"] not in seen_events:
                    seen_events.add(event["id"])
                    if event["type"] == "message":
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
    table = Table(title="training metrics (per step)")
    for column in ("step", "train loss", "lr", "tokens/s", "peak mem (MB)"):
        table.add_column(column, justify="right")
    stride = max(1, len(metrics) // 15)
    for point in metrics[::stride] + ([metrics[-1]] if (len(metrics) - 1) % stride else []):
        values = point["values"]
        table.add_row(
            str(point["step"]),
            f"{point['train_loss']:.4f}",
            f"{values.get('learning_rate', 0):.2e}",
            f"{values.get('tokens_per_second', 0):,.0f}",
            f"{values.get('peak_memory_allocated_bytes', 0) / 2**20:,.1f}",
        )
    return table


def _download_and_load(client: httpx.Client, job_id: str, checkpoint: dict) -> Path:
    target = Path(tempfile.mkdtemp(prefix="fusetune-demo-"))
    url = f"/v1/fine_tuning/jobs/{job_id}/checkpoints/{checkpoint['id']}/content"
    archive = target / "checkpoint.tar"
    with client.stream("GET", url) as response, open(archive, "wb") as out:
        if response.status_code != 200:
            raise RuntimeError(f"checkpoint download failed: {response.status_code} {response.read()!r}")
        for chunk in response.iter_bytes():
            out.write(chunk)
    with tarfile.open(archive) as tar:
        tar.extractall(target, filter="data")
    folders = [p for p in target.iterdir() if p.is_dir()]
    return folders[0]


def _sample(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    console.print(
        f"loaded the fine-tuned checkpoint with from_pretrained: {type(model).__name__}, "
        f"{sum(p.numel() for p in model.parameters()):,} parameters"
    )
    for question in ("What is 12 + 30?", "What is 75 - 41?"):
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
        inputs = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        output = model.generate(**inputs, max_new_tokens=6, do_sample=False)
        answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        console.print(f"  {question} -> {answer.strip()!r}")


def run_demo(settings: Settings, port: int = 8765, n_gpus: int = 2, n_epochs: int = 3) -> int:
    model_dir = settings.models_dir / DEMO_MODEL
    if not (model_dir / "config.json").exists():
        build_tiny_model(model_dir)
        console.print(f"built the demo base model (random weights, local tokenizer) in {model_dir}")
    server = _start_server(settings, port)
    try:
        auth = {"Authorization": f"Bearer {settings.dev_api_key}"}
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60, headers=auth) as client:
            _wait_healthy(client, server)
            console.print(f"service up at http://127.0.0.1:{port} (data in {settings.data_dir})")
            training, validation = _upload(client, TRAIN_FILE), _upload(client, VALID_FILE)
            console.print(
                f"uploaded {training['id']} ({training['example_count']} examples) and {validation['id']}"
            )
            job = _check(client.post("/v1/fine_tuning/jobs", json={
                "model": DEMO_MODEL, "training_file": training["id"], "validation_file": validation["id"],
                "suffix": "demo", "seed": 0,
                "hyperparameters": {"n_epochs": n_epochs, "batch_size": 16, "learning_rate": 3e-3,
                                    "warmup_ratio": 0.05, "n_gpus": n_gpus},
            }))  # fmt: skip
            console.print(f"created {job['id']} ({job['status']})")
            job = _poll(client, job["id"])
            if job["status"] != "succeeded":
                console.print(f"[red]job {job['status']}: {job.get('error')}")
                return 1
            metrics = _check(client.get(f"/v1/fine_tuning/jobs/{job['id']}/metrics"))["data"]
            console.print(_metrics_table(metrics))
            first, last = metrics[0]["train_loss"], metrics[-1]["train_loss"]
            console.print(
                f"train loss {first:.3f} -> {last:.3f}; trained tokens {job['trained_tokens']:,}; "
                f"model {job['fine_tuned_model']}"
            )
            checkpoints = _check(client.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints"))["data"]
            folder = _download_and_load(client, job["id"], checkpoints[0])
            console.print(f"downloaded checkpoint step {checkpoints[0]['step_number']} to {folder}")
            _sample(folder)
            return 0
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
