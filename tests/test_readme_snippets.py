"""The README's first session: its SDK, curl and command-line snippets, taken from the README itself, run against
``fusetune serve`` on a fresh data directory (no model put there: the server offers the bundled one), and the
settings they fine-tune with are the demo's, which teach the tiny model its task.

What the test changes in a snippet, and only that: the server's address (a free port, not 8000), the
executables (this interpreter instead of ``.venv/bin/...``), the ids the README writes as ``file-...``,
``ftjob-...`` and ``ftckpt_...``, and for curl and the command line the training file, cut to its first 64
examples so that their job is 8 steps.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from fusetune.demo import task
from tests.services import running_service, start_worker, stop_process

ROOT = Path(__file__).resolve().parents[1]
README_URL = "http://127.0.0.1:8000"
README_TRAINING_FILE = "fusetune/demo/data/digits.jsonl"
SMALL_FILE_EXAMPLES = 64


def _blocks() -> dict[str, str]:
    """The API section's snippets: the SDK's, curl's and the command line's."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Using the API\n") :]
    blocks = re.findall(r"```(?:python|bash)\n(.*?)```", section, re.DOTALL)
    return {
        "sdk": next(block for block in blocks if "from openai import OpenAI" in block),
        "curl": next(block for block in blocks if block.startswith("H='Authorization")),
        "cli": next(block for block in blocks if "fusetune files upload" in block),
    }


def _commands(block: str) -> list[str]:
    """A bash block's commands: continuation lines joined, a quote open over lines kept whole, comment lines
    left out."""
    commands, pending = [], ""
    for line in block.replace("\\\n", " ").splitlines():
        pending += ("\n" if pending else "") + line
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # an unclosed quote: the command goes on
            continue
        if words:
            commands.append(pending)
        pending = ""
    return commands


def _sdk_hyperparameters(block: str) -> dict:
    call = next(
        node
        for node in ast.walk(ast.parse(block))
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("fine_tuning.jobs.create")
    )
    return ast.literal_eval(next(k.value for k in call.keywords if k.arg == "hyperparameters"))


def _cli_hyperparameters(command: str) -> dict:
    words = shlex.split(command.split("$(", 1)[1].rstrip(")"))
    flags = {word: words[i + 1] for i, word in enumerate(words[:-1]) if word.startswith("--")}
    return {
        "n_epochs": int(flags["--n-epochs"]),
        "batch_size": int(flags["--batch-size"]),
        "learning_rate": float(flags["--learning-rate"]),
        **json.loads(flags["--hyperparameters"]),
    }


def test_every_snippet_fine_tunes_with_the_demos_settings():
    """The defaults (learning rate 1e-4) barely move the tiny model (loss 5.61 -> 4.88 in 3 epochs); the
    demo's settings teach it the task (tests/test_demo.py), so the README's jobs use them."""
    blocks = _blocks()
    assert _sdk_hyperparameters(blocks["sdk"]) == task.JOB_HYPERPARAMETERS
    create = next(c for c in _commands(blocks["curl"]) if "-d '" in c)
    body = json.loads(create.split("-d '", 1)[1].rstrip("'"))
    assert body["model"] == task.BUNDLED_MODEL
    assert body["hyperparameters"] == task.JOB_HYPERPARAMETERS
    cli_create = next(c for c in _commands(blocks["cli"]) if c.startswith("JOB=$("))
    assert _cli_hyperparameters(cli_create) == task.JOB_HYPERPARAMETERS
    for block in blocks.values():
        assert README_TRAINING_FILE in block and (ROOT / README_TRAINING_FILE).is_file()


def _run(command: str, cwd: Path, env: dict[str, str], shell: str = "bash") -> subprocess.CompletedProcess:
    result = subprocess.run([shell, "-e", "-c", command], cwd=cwd, env=env, capture_output=True, text=True)
    assert result.returncode == 0, f"{command}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


@pytest.mark.slow
def test_readme_snippets_work_on_a_fresh_data_directory(tmp_path):
    blocks = _blocks()
    small_file = tmp_path / "digits_small.jsonl"
    lines = (ROOT / README_TRAINING_FILE).read_text().splitlines(keepends=True)
    small_file.write_text("".join(lines[:SMALL_FILE_EXAMPLES]))
    fusetune = f"{shlex.quote(sys.executable)} -m fusetune.cli"
    data_dir = tmp_path / "data"
    # No worker while the SDK's and curl's snippets run: their jobs stay queued, so the SDK's pause, resume and
    # cancel, issued straight after the create, act on a queued job however fast the machine trains. The
    # command line's job, which follows to the end, gets a worker (started as docker-compose starts one).
    no_worker = {"FUSETUNE_EMBEDDED_WORKER": "false"}
    with running_service(data_dir, extra_env=no_worker, bundled_model="true") as service:
        api = service.client
        env = {**os.environ, "FUSETUNE_BASE_URL": f"{service.base_url}/v1"}
        env.pop("FUSETUNE_API_KEY", None)
        env.pop("OPENAI_API_KEY", None)

        # The server offers the bundled model, built at its start in the models directory.
        assert task.BUNDLED_MODEL in [model["id"] for model in api.get("/v1/models").json()["data"]]
        assert (service.settings.models_dir / task.BUNDLED_MODEL / "config.json").is_file()

        # The SDK's snippet as written, from the checkout (its training file's path is relative to it).
        sdk = blocks["sdk"].replace(README_URL, service.base_url)
        subprocess.run([sys.executable, "-c", sdk], cwd=ROOT, env=env, check=True)
        (sdk_job,) = api.get("/v1/fine_tuning/jobs").json()["data"]
        assert sdk_job["status"] == "cancelled" and sdk_job["model"] == task.BUNDLED_MODEL

        # curl: upload and create; this job is cancelled at once, the command line's job below trains.
        curl = [c.replace(README_URL, service.base_url).replace(README_TRAINING_FILE, str(small_file))
                for c in _commands(blocks["curl"])]  # fmt: skip
        header, upload, create, metrics, download = curl
        uploaded = json.loads(_run(f"{header}; {upload}", tmp_path, env).stdout)
        assert uploaded["example_count"] == SMALL_FILE_EXAMPLES
        created = json.loads(
            _run(f"{header}; {create.replace('file-...', uploaded['id'])}", tmp_path, env).stdout
        )
        assert created["hyperparameters"]["learning_rate"] == task.JOB_HYPERPARAMETERS["learning_rate"]
        assert api.post(f"/v1/fine_tuning/jobs/{created['id']}/cancel").status_code == 200

        # The command line's snippet, whole: upload, create, list, follow to the end, create and cancel another.
        cli = (
            blocks["cli"]
            .replace(".venv/bin/fusetune", fusetune)
            .replace(README_TRAINING_FILE, str(small_file))
        )
        worker = start_worker(service.settings, tmp_path / "worker.log")
        try:
            result = _run(cli, tmp_path, env)
        finally:
            stop_process(worker)
        jobs = {job["id"]: job for job in api.get("/v1/fine_tuning/jobs").json()["data"]}
        followed = next(job for job in jobs.values() if job["status"] == "succeeded")
        assert f"{followed['id']} succeeded: {followed['fine_tuned_model']}" in result.stdout
        assert followed["fine_tuned_model"].startswith(f"ft:{task.BUNDLED_MODEL}:")
        # `jobs list`, run while the job may be queued, running or, on a fast machine, done
        assert re.search(
            rf"^{followed['id']}\t(queued|running|succeeded)\t{task.BUNDLED_MODEL}\t", result.stdout, re.M
        )
        assert "loss" in result.stderr and "tokens/s" in result.stderr  # the progress bar
        other = max(jobs.values(), key=lambda job: job["created_at"])
        assert f"{other['id']}\tcancelled" in result.stdout and jobs[other["id"]]["status"] == "cancelled"

        # The job learns: the demo's settings move the loss within its 8 steps.
        points = api.get(f"/v1/fine_tuning/jobs/{followed['id']}/metrics").json()["data"]
        assert len(points) == 2 * SMALL_FILE_EXAMPLES // task.JOB_HYPERPARAMETERS["batch_size"]
        assert points[-1]["train_loss"] < 0.8 * points[0]["train_loss"], points

        # curl's metrics and download lines, for the job that trained.
        checkpoint = api.get(f"/v1/fine_tuning/jobs/{followed['id']}/checkpoints").json()["data"][0]
        metrics = metrics.replace("ftjob-...", followed["id"])
        assert json.loads(_run(f"{header}; {metrics}", tmp_path, env).stdout)["object"] == "list"
        download = download.replace("ftjob-...", followed["id"]).replace("ftckpt_...", checkpoint["id"])
        _run(f"{header}; {download}", tmp_path, env)
        with tarfile.open(tmp_path / "content") as archive:
            assert any(name.endswith("/config.json") for name in archive.getnames())
