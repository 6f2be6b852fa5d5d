"""Stopping ``fusetune serve`` stops everything it started, whatever stops it, and loses no job.

A case kills `serve` while a job trains (and another waits queued behind it), waits for every process of the
service to exit, starts `serve` again on the same data directory and waits for the jobs. Gated on events only (a
metric row, a process's exit, a job's status); pytest-timeout bounds them.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from fusetune.demo.assets import TRAIN_FILE, build_tiny_model
from tests.services import running_service

pytestmark = pytest.mark.slow
MODEL = "tiny-llama"
# 4 steps an epoch. The job in training has epochs enough to be mid-run at its stop however fast the machine (the
# hand-over request reaches the trainer within about two seconds), and is cancelled once it has resumed; the
# queued one trains one epoch to the end.
TRAIN_LINES, BATCH_SIZE, LONG_EPOCHS = 32, 8, 50


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / MODEL)


def service_pids(data_dir: Path) -> set[int]:
    """Every process started for this data directory: `serve`, its worker, torchrun and the ranks all carry it
    in their environment."""
    marker = f"FUSETUNE_DATA_DIR={data_dir}".encode()
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    pids.add(int(entry.name))
            except OSError:
                continue
    return pids


def wait_for_exit(pids: set[int]) -> None:
    """Until every pid's /proc entry is gone (or a zombie): bounded by pytest-timeout, not a deadline."""
    for pid in pids:
        while True:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                break
            if state == "Z":
                break
            time.sleep(0.05)


def _create_job(service, file_id: str, n_epochs: int = 1) -> str:
    response = service.client.post("/v1/fine_tuning/jobs", json={
        "model": MODEL, "training_file": file_id, "seed": 0,
        "hyperparameters": {"n_epochs": n_epochs, "batch_size": BATCH_SIZE, "n_gpus": 1}})  # fmt: skip
    assert response.status_code == 200, response.text
    return response.json()["id"]


def _wait_for_first_step(service, job_id: str) -> None:
    while not service.client.get(f"/v1/fine_tuning/jobs/{job_id}/metrics").json()["data"]:
        time.sleep(0.1)


def _messages(service, job_id: str) -> list[str]:
    events = service.client.get(f"/v1/fine_tuning/jobs/{job_id}/events", params={"limit": 1000}).json()
    return [event["message"] for event in reversed(events["data"])]


def _install(tmp_path: Path, tiny_model: Path) -> tuple[Path, Path]:
    data_dir = tmp_path / "data"
    (data_dir / "models").mkdir(parents=True)
    (data_dir / "models" / MODEL).symlink_to(tiny_model, target_is_directory=True)
    train = tmp_path / "train.jsonl"
    train.write_text("".join(TRAIN_FILE.read_text().splitlines(keepends=True)[:TRAIN_LINES]))
    return data_dir, train


def _kill_and_wait(service, signum: int) -> None:
    """Signals serve as a terminal or a supervisor does (its process group: the worker has a session of its
    own), then waits for every process of the service to exit and checks that none is left."""
    before = service_pids(service.settings.data_dir)
    os.killpg(service.process.pid, signum)
    service.process.wait()
    wait_for_exit(before)
    assert not service_pids(service.settings.data_dir), "a process of the service outlived serve"


# Training cases are the expensive ones (about a minute each on 2 cores): the two ways serve ends, each with a job
# in training; the queued job rides along with one of them. SIGINT and SIGHUP reach the worker the same way as
# SIGTERM (serve stops it), which the idle case below checks for each.
@pytest.mark.parametrize(
    ("signum", "with_queued_job"),
    [(signal.SIGTERM, True), (signal.SIGKILL, False)],
    ids=["SIGTERM-running-and-queued", "SIGKILL-running"],
)
def test_serve_stopped_mid_job_hands_it_over_and_loses_none(tmp_path, tiny_model, signum, with_queued_job):
    data_dir, train = _install(tmp_path, tiny_model)
    with running_service(data_dir) as service:
        file_id = service.upload(train).json()["id"]
        running = _create_job(service, file_id, n_epochs=LONG_EPOCHS)
        _wait_for_first_step(service, running)
        queued = _create_job(service, file_id) if with_queued_job else None
        assert len(service_pids(data_dir)) >= 4  # serve, the worker, torchrun, a rank
        _kill_and_wait(service, signum)

    with running_service(data_dir) as service:
        while not any(
            m.startswith("Resumed from the checkpoint of step") for m in _messages(service, running)
        ):
            time.sleep(0.2)
        assert service.client.post(f"/v1/fine_tuning/jobs/{running}/cancel").status_code == 200
        if queued is not None:
            job = service.wait_for_job(queued)
            assert job["status"] == "succeeded", job
        job = service.wait_for_job(running)
        messages = _messages(service, running)
    # The hand-over is no fault: it uses up none of the job's retries.
    assert job["attempts"][0]["cause"] == "handed_over" and not job["attempts"][0]["fault"], job
    # The job was handed over with a checkpoint at once, not left for its lease to lapse, and resumed from it.
    handed = [m for m in messages if re.match(r"Worker \S+ is stopping: training handed over", m)]
    assert len(handed) == 1, messages
    assert not any("stopped renewing its lease" in m for m in messages), messages
    step = re.search(r"the checkpoint of step (\d+)", handed[0]).group(1)
    assert f"Resumed from the checkpoint of step {step}" in messages, messages
    # One trainer at a time: two starts, the second after the hand-over.
    starts = [i for i, m in enumerate(messages) if m.startswith("Fine-tuning job started on worker")]
    assert len(starts) == 2 and starts[0] < messages.index(handed[0]) < starts[1], messages


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP], ids=["SIGINT", "SIGHUP"])
def test_serve_stops_its_worker_on(tmp_path, signum):
    with running_service(tmp_path / "data") as service:
        while len(service_pids(service.settings.data_dir)) < 2:  # the worker has started
            time.sleep(0.05)
        _kill_and_wait(service, signum)
