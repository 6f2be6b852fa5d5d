"""kill -9 of a worker mid-training: its training processes die with it, another worker picks the job up
again (real Redis broker, real worker processes, 2-process gloo training) and resumes it from the last
checkpoint saved before the kill (the service saves one at every epoch end by default), ending on exactly the
weights of a run that was never killed; after the allowed attempts the job fails with a clear code."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fusetune.demo.assets import TRAIN_FILE, build_tiny_model
from fusetune.worker.train.checkpoints import layout as ckpt
from tests.services import redis_server, running_service, start_worker, stop_process

pytestmark = pytest.mark.slow
MODEL = "tiny-llama"
NO_EMBEDDED_WORKER = {"FUSETUNE_EMBEDDED_WORKER": "false"}
TRAIN_LINES = 128
BATCH_SIZE = 16
STEPS_PER_EPOCH = TRAIN_LINES // BATCH_SIZE


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


def _wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.3):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(what)


@pytest.fixture
def setup(tmp_path):
    data_dir = tmp_path / "data"
    build_tiny_model(data_dir / "models" / MODEL)
    train = tmp_path / "train.jsonl"
    train.write_text("".join(TRAIN_FILE.read_text().splitlines(keepends=True)[:TRAIN_LINES]))
    return data_dir, train


def _start_job(service, train: Path, n_epochs: int) -> str:
    file_id = service.upload(train).json()["id"]
    response = service.client.post("/v1/fine_tuning/jobs", json={
        "model": MODEL, "training_file": file_id, "seed": 0,
        "hyperparameters": {"n_epochs": n_epochs, "batch_size": BATCH_SIZE, "learning_rate": 3e-3, "n_gpus": 2}})  # fmt: skip
    assert response.status_code == 200, response.text
    return response.json()["id"]


def _kill_worker_mid_training(
    service, worker, job_id: str, total_steps: int, at_first_checkpoint: bool = False
) -> None:
    """Freezes the job's training processes, after 3 reported steps or, with `at_first_checkpoint`, as soon as
    its first checkpoint is whole on disk, then kills the worker with SIGKILL."""

    def reported_steps() -> int:
        return len(service.client.get(f"/v1/fine_tuning/jobs/{job_id}/metrics").json()["data"])

    run_dir = service.settings.runs_dir / job_id
    marker = str(run_dir)
    if at_first_checkpoint:
        # The processes are found while the ranks still load, so that the freeze follows the checkpoint within
        # milliseconds of it, with three epochs left to train.
        pids = _wait_until(lambda: (found if len(found := _training_pids(marker)) >= 3 else None), 300,
                           "the training processes never started", interval_s=0.05)  # fmt: skip
        _wait_until(lambda: ckpt.list_checkpoints(run_dir), 300, "no checkpoint was saved", interval_s=0.005)
    else:
        _wait_until(lambda: reported_steps() >= 3, 180, "training never reported 3 steps")
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


def _messages(service, job_id: str) -> list[str]:
    events = service.client.get(f"/v1/fine_tuning/jobs/{job_id}/events", params={"limit": 1000}).json()[
        "data"
    ]
    return [event["message"] for event in reversed(events)]  # oldest first


def _checkpoint_steps(service, job_id: str) -> list[int]:
    checkpoints = service.client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints").json()["data"]
    return [checkpoint["step_number"] for checkpoint in checkpoints]


def test_killed_worker_job_is_recovered_by_another_worker(setup, tmp_path):
    data_dir, train = setup
    n_epochs = 4
    final_step = n_epochs * STEPS_PER_EPOCH
    with (
        redis_server(tmp_path) as broker_url,
        running_service(
            data_dir, extra_env=NO_EMBEDDED_WORKER, broker_url=broker_url, lease_s=6, reaper_interval_s=1
        ) as service,
    ):
        first = start_worker(service.settings, tmp_path / "worker-a.log")
        job_id = _start_job(service, train, n_epochs=n_epochs)
        run_dir = service.settings.runs_dir / job_id
        try:
            # The kill comes once a checkpoint is saved (the first epoch's end), with epochs still to train.
            _kill_worker_mid_training(
                service, first, job_id, total_steps=final_step, at_first_checkpoint=True
            )
            # What the training processes had saved when they froze: the newest whole checkpoint on disk.
            saved_step, _ = ckpt.latest_resumable(run_dir)
            assert saved_step < final_step and saved_step % STEPS_PER_EPOCH == 0
            second = start_worker(service.settings, tmp_path / "worker-b.log")
            try:
                job = service.wait_for_job(job_id, timeout_s=300)
                # The same job never killed, trained by the same worker afterwards.
                reference_id = _start_job(service, train, n_epochs=n_epochs)
                reference = service.wait_for_job(reference_id, timeout_s=300)
            finally:
                stop_process(second)
        finally:
            stop_process(first)
        assert job["status"] == "succeeded", job
        assert reference["status"] == "succeeded", reference
        messages = _messages(service, job_id)
        started = [re.search(r"started on worker (\S+) \(attempt (\d)\)", m) for m in messages]
        (lost_worker, _), (_, second_attempt) = [match.groups() for match in started if match]
        assert second_attempt == "2"
        assert any(m.startswith(f"Worker {lost_worker} stopped renewing its lease") for m in messages), (
            messages
        )
        resumed = [m for m in messages if m.startswith("Resumed from the checkpoint")]
        assert resumed == [f"Resumed from the checkpoint of step {saved_step}"], resumed
        # The last two checkpoints are kept, on disk and as rows.
        assert _checkpoint_steps(service, job_id) == [final_step, final_step - STEPS_PER_EPOCH]
        assert [step for step, _ in ckpt.list_checkpoints(run_dir)] == [
            final_step - STEPS_PER_EPOCH,
            final_step,
        ]

    # Fp32 on CPU with the same seed is deterministic: resuming lost nothing and repeated nothing.
    weights = load_file(ckpt.checkpoint_path(run_dir, final_step) / "model.safetensors")
    reference_dir = service.settings.runs_dir / reference_id
    reference_weights = load_file(ckpt.checkpoint_path(reference_dir, final_step) / "model.safetensors")
    assert weights.keys() == reference_weights.keys()
    for name, tensor in reference_weights.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=0, msg=name)


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
            _kill_worker_mid_training(service, first, job_id, total_steps=100 * STEPS_PER_EPOCH)
            second = start_worker(service.settings, tmp_path / "worker-b.log")
            try:
                job = service.wait_for_job(job_id, timeout_s=120)
            finally:
                stop_process(second)
        finally:
            stop_process(first)
        assert job["status"] == "failed" and job["error"]["code"] == "worker_lost", job
