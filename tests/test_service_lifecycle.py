"""Stopping ``fusetune serve`` stops everything it started, whatever stops it, and loses no job.

One run stops `serve` with each signal in turn (SIGTERM, SIGINT, SIGHUP, SIGKILL), each time while a job trains
and another waits queued behind it, waits for every process of the service to exit, and starts `serve` again on
the same data directory: the job in training was handed over with a checkpoint and resumes from it, the queued
one is untouched. Gated on events only (a metric row, a process's exit, a job's status or event);
pytest-timeout bounds them.
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
# 8 steps an epoch, 100 epochs: each job is mid-run at every stop however fast the machine (a hand-over request
# reaches the trainer within about two seconds), and is cancelled once it has resumed at the end.
TRAIN_LINES, BATCH_SIZE, LONG_EPOCHS = 64, 8, 100
# A terminal's Ctrl-C, a supervisor's stop, a hang-up, and the kill that leaves serve no chance to act.
STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGKILL)
HANDED_OVER = re.compile(r"Worker \S+ is stopping: training handed over with the checkpoint of step (\d+)")
STARTED = "Fine-tuning job started on worker"


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


def _create_job(service, file_id: str) -> str:
    response = service.client.post("/v1/fine_tuning/jobs", json={
        "model": MODEL, "training_file": file_id, "seed": 0,
        "hyperparameters": {"n_epochs": LONG_EPOCHS, "batch_size": BATCH_SIZE, "n_gpus": 1}})  # fmt: skip
    assert response.status_code == 200, response.text
    return response.json()["id"]


def _status(service, job_id: str) -> str:
    return service.client.get(f"/v1/fine_tuning/jobs/{job_id}").json()["status"]


def _attempt_ended(service, job_id: str) -> bool:
    return service.client.get(f"/v1/fine_tuning/jobs/{job_id}").json()["attempts"][-1]["ended_at"] is not None


def _messages(service, job_id: str) -> list[str]:
    events = service.client.get(f"/v1/fine_tuning/jobs/{job_id}/events", params={"limit": 1000}).json()
    return [event["message"] for event in reversed(events["data"])]


def _handed_over_steps(service, job_id: str) -> list[int]:
    return [int(match.group(1)) for m in _messages(service, job_id) if (match := HANDED_OVER.match(m))]


def _wait_for_training(service, trained_to: dict[str, int]) -> str:
    """The job that trains now: the one with a step beyond the checkpoint it was last handed over with (its
    earlier attempts recorded none, each having stopped at its checkpoint)."""
    while True:
        for job_id, step in trained_to.items():
            params = {"min_step": step + 1}
            if service.client.get(f"/v1/fine_tuning/jobs/{job_id}/metrics", params=params).json()["data"]:
                return job_id
        time.sleep(0.1)


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


def test_serve_stopped_by_each_signal_mid_job_with_one_queued_loses_no_job(tmp_path, tiny_model):
    data_dir, train = _install(tmp_path, tiny_model)
    trained_to: dict[str, int] = {}  # each job's step when it was last handed over (0: never trained)
    stopped_in_training: list[str] = []
    for signum in (*STOPS, None):
        with running_service(data_dir) as service:
            if not trained_to:
                file_id = service.upload(train).json()["id"]
                trained_to = {_create_job(service, file_id): 0 for _ in range(2)}
            if stopped_in_training:  # the last stop's hand-over, read now that the API is up again
                handed = _handed_over_steps(service, stopped_in_training[-1])
                assert len(handed) == stopped_in_training.count(stopped_in_training[-1]), handed
                trained_to[stopped_in_training[-1]] = handed[-1]
            if signum is not None:
                training = _wait_for_training(service, trained_to)
                (waiting,) = set(trained_to) - {training}
                assert _status(service, waiting) == "queued"
                assert len(service_pids(data_dir)) >= 4  # serve, the worker, torchrun, a rank
                _kill_and_wait(service, signum)
                stopped_in_training.append(training)
                continue
            # The job that trains again resumes from the checkpoint it was last handed over with; the other, queued
            # still, is cancelled there (its start would cost CI time and show nothing the resumes above do not).
            last_trained = _wait_for_training(service, trained_to)
            (still_queued,) = set(trained_to) - {last_trained}
            assert _status(service, still_queued) == "queued"
            assert service.client.post(f"/v1/fine_tuning/jobs/{still_queued}/cancel").status_code == 200
            if trained_to[last_trained]:
                resumed = f"Resumed from the checkpoint of step {trained_to[last_trained]}"
                assert resumed in _messages(service, last_trained)
            assert service.client.post(f"/v1/fine_tuning/jobs/{last_trained}/cancel").status_code == 200
            while not _attempt_ended(service, last_trained):  # the worker has stopped the trainer
                time.sleep(0.1)
            jobs = {
                job_id: service.client.get(f"/v1/fine_tuning/jobs/{job_id}").json() for job_id in trained_to
            }
            messages = {job_id: _messages(service, job_id) for job_id in jobs}

    # Each stop handed the job in training over and left the queued one alone (no attempt of its own).
    assert len(stopped_in_training) == len(STOPS)
    for job_id, job in jobs.items():
        stops = stopped_in_training.count(job_id)
        # The hand-overs are no faults: they use up none of the job's retries.
        causes = [(attempt["cause"], attempt["fault"]) for attempt in job["attempts"]]
        ended = [("cancelled", False)] if job_id == last_trained else []
        assert causes == [("handed_over", False)] * stops + ended, job
        # Handed over with a checkpoint at once, not left for its lease to lapse, and resumed from it: one
        # trainer at a time, each start after the previous attempt's hand-over.
        assert not any("stopped renewing its lease" in m for m in messages[job_id]), messages[job_id]
        timeline = [STARTED if m.startswith(STARTED) else m for m in messages[job_id] if m.startswith(STARTED)
                    or HANDED_OVER.match(m) or m.startswith("Resumed from the checkpoint of step")]  # fmt: skip
        handed = [m for m in timeline if HANDED_OVER.match(m)]
        assert len(handed) == stops, messages[job_id]
        expected = [STARTED] if stops or job_id == last_trained else []
        for message in handed:
            step = HANDED_OVER.match(message).group(1)
            expected += [message, STARTED, f"Resumed from the checkpoint of step {step}"]
        if job_id != last_trained and stops:  # cancelled in the queue after its last hand-over
            expected = expected[:-2]
        assert timeline == expected, messages[job_id]


def test_serve_stops_its_idle_worker(tmp_path):
    with running_service(tmp_path / "data") as service:
        while len(service_pids(service.settings.data_dir)) < 2:  # the worker has started
            time.sleep(0.05)
        _kill_and_wait(service, signal.SIGHUP)
