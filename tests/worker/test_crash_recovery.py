"""kill -9 of a worker mid-training: its training processes die with it, another worker picks the job up
again (real Redis broker, real worker processes, 2-process gloo training), and exactly one set of final
checkpoints comes out; after the allowed attempts the job fails with a clear code."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from fusetune.demo.assets import TRAIN_FILE, build_tiny_model
from tests.services import redis_server, running_service, start_worker, stop_process

pytestmark = pytest.mark.slow
MODEL = "tiny-llama"
NO_EMBEDDED_WORKER = {"FUSETUNE_EMBEDDED_WORKER": "false"}


def _training_pids(marker: str) -> list[int]:
    """Every process whose command line names this job's run directory (torchrun and its ranks)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _wait_until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.3)
    raise TimeoutError(what)


@pytest.fixture
def setup(tmp_path):
    data_dir = tmp_path / "data"
    build_tiny_model(data_dir / "models" / MODEL)
    train = tmp_path / "train.jsonl"
    train.write_text("".join(TRAIN_FILE.read_text().splitlines(keepends=True)[:256]))
    return data_dir, train


def _start_job(service, train: Path, n_epochs: int) -> str:
    file_id = service.upload(train).json()["id"]
    response = service.client.post("/v1/fine_tuning/jobs", json={
        "model": MODEL, "training_file": file_id, "seed": 0,
        "hyperparameters": {"n_epochs": n_epochs, "batch_size": 16, "learning_rate": 3e-3, "n_gpus": 2}})  # fmt: skip
    assert response.status_code == 200, response.text
    return response.json()["id"]


def _kill_worker_mid_training(service, worker, job_id: str, total_steps: int) -> None:
    def reported_steps() -> int:
        return len(service.client.get(f"/v1/fine_tuning/jobs/{job_id}/metrics").json()["data"])

    _wait_until(lambda: reported_steps() >= 3, 180, "training never reported 3 steps")
    marker = str(service.settings.runs_dir / job_id)
    pids = _training_pids(marker)
    assert len(pids) >= 3  # torchrun and two ranks
    # Frozen where they stand, the training processes cannot reach the end of the run before the kill,
    # however fast the machine; SIGKILL still ends a stopped process.
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    assert reported_steps() < total_steps
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()
    # No orphan keeps training: a second copy must never run beside the retry.
    _wait_until(
        lambda: not _training_pids(marker),
        20,
        f"training processes outlived the worker: {_training_pids(marker)}",
    )


def test_killed_worker_job_is_recovered_by_another_worker(setup, tmp_path):
    data_dir, train = setup
    with (
        redis_server(tmp_path) as broker_url,
        running_service(
            data_dir, extra_env=NO_EMBEDDED_WORKER, broker_url=broker_url, lease_s=6, reaper_interval_s=1
        ) as service,
    ):
        first = start_worker(service.settings, tmp_path / "worker-a.log")
        job_id = _start_job(service, train, n_epochs=4)
        try:
            _kill_worker_mid_training(service, first, job_id, total_steps=4 * 256 // 16)
            second = start_worker(service.settings, tmp_path / "worker-b.log")
            try:
                job = service.wait_for_job(job_id, timeout_s=300)
            finally:
                stop_process(second)
        finally:
            stop_process(first)
        assert job["status"] == "succeeded", job
        messages = [e["message"] for e in service.client.get(f"/v1/fine_tuning/jobs/{job_id}/events",
                                                              params={"limit": 1000}).json()["data"]]  # fmt: skip
        assert any("stopped renewing its lease" in m for m in messages)
        assert any("(attempt 2)" in m for m in messages)
        checkpoints = service.client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints").json()["data"]
        final_step = 4 * 256 // 16
        assert [c["step_number"] for c in checkpoints].count(final_step) == 1


def test_job_fails_clearly_after_the_allowed_attempts(setup, tmp_path):
    data_dir, train = setup
    with (
        redis_server(tmp_path) as broker_url,
        running_service(
            data_dir,
            extra_env=NO_EMBEDDED_WORKER,
            broker_url=broker_url,
            lease_s=6,
            reaper_interval_s=1,
            max_attempts=1,
        ) as service,
    ):
        first = start_worker(service.settings, tmp_path / "worker-a.log")
        job_id = _start_job(service, train, n_epochs=100)  # never finishes: it fails at the kill
        try:
            _kill_worker_mid_training(service, first, job_id, total_steps=100 * 256 // 16)
            second = start_worker(service.settings, tmp_path / "worker-b.log")
            try:
                job = service.wait_for_job(job_id, timeout_s=120)
            finally:
                stop_process(second)
        finally:
            stop_process(first)
        assert job["status"] == "failed" and job["error"]["code"] == "worker_lost", job
