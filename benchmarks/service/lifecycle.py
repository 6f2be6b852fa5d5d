"""What each way a service stops costs a job: measured on this machine with the demo's tiny model on the CPU.

For each case it starts `fusetune serve` on a fresh data directory, starts one job (epochs of 8 steps, a
resumable checkpoint at every epoch's end, the service's default), waits for its 3rd step, then:

- `serve-sigterm`, `serve-sigint`, `serve-sighup`, `serve-sigkill`: stops `serve` with the signal, times until
  every process of the service has exited, starts `serve` again and times until the job trains again;
- `worker-sigkill`: kills the embedded worker alone (a crash), and times until the job trains again, which waits
  for its lease to lapse (FUSETUNE_LEASE_S) and a reaper pass;
- `worker-sighup`: SIGHUP to the worker alone (what a standalone `fusetune worker` does with it too: hand the job
  over, start again in the same process), and times until the job trains again;
- `pause`: pauses the job, waits until it is paused, resumes it and times until it trains again.

"Steps lost" is the last step reported before the stop minus the step the job resumed from (0: the stop saved a
checkpoint at the step it was on). Prints one line per case.

    python -m benchmarks.service.lifecycle                    # every case
    python -m benchmarks.service.lifecycle --cases pause,serve-sigterm
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import tempfile
import time
from pathlib import Path

from benchmarks.service.jobs import Service

SERVE_STOPS = {"serve-sigterm": signal.SIGTERM, "serve-sigint": signal.SIGINT, "serve-sighup": signal.SIGHUP,
               "serve-sigkill": signal.SIGKILL}  # fmt: skip
CASES = (*SERVE_STOPS, "worker-sigkill", "worker-sighup", "pause")
MODEL = "tiny-llama"
# 8 steps an epoch, and epochs enough that no job ends before its stop, however fast the machine.
TRAIN_LINES, BATCH_SIZE, EPOCHS = 64, 8, 50


def _service_pids(data_dir: Path) -> set[int]:
    marker = f"FUSETUNE_DATA_DIR={data_dir}".encode()
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    pids.add(int(entry.name))
            except OSError:
                continue
    return pids - {os.getpid()}


def _metrics(service: Service, job_id: str) -> list[dict]:
    url = f"/v1/fine_tuning/jobs/{job_id}/metrics"
    return service.check(service.client.get(url, params={"limit": 10000}))["data"]


def _steps(service: Service, job_id: str) -> list[int]:
    return [point["step"] for point in _metrics(service, job_id)]


def _wait(condition, interval_s: float = 0.1):
    while not (value := condition()):
        time.sleep(interval_s)
    return value


def _messages(service: Service, job_id: str) -> list[str]:
    url = f"/v1/fine_tuning/jobs/{job_id}/events"
    return [e["message"] for e in service.check(service.client.get(url, params={"limit": 1000}))["data"]]


def _resumed_from(service: Service, job_id: str) -> int:
    """The step of the checkpoint the job resumed from; 0 when it started over (no checkpoint yet)."""
    resumed = [
        re.match(r"Resumed from the checkpoint of step (\d+)", message)
        for message in _messages(service, job_id)
    ]
    return next((int(match.group(1)) for match in resumed if match), 0)


def _trains_again(service: Service, job_id: str, since_s: float) -> None:
    """Until the job reports a step in a later second than `since_s` (time.time()): trained after the stop."""
    _wait(lambda: any(point["created_at"] > int(since_s) for point in _metrics(service, job_id)))


def run_case(case: str, workdir: Path) -> str:
    from fusetune.demo.assets import TRAIN_FILE, build_tiny_model

    data_dir = workdir / case
    build_tiny_model(data_dir / "models" / MODEL)
    train = workdir / "train.jsonl"
    train.write_text("".join(TRAIN_FILE.read_text().splitlines(keepends=True)[:TRAIN_LINES]))
    service = Service(data_dir)
    try:
        file_id = service.check(
            service.client.post("/v1/files", files={"file": (train.name, train.read_bytes())},
                                data={"purpose": "fine-tune"})
        )["id"]  # fmt: skip
        job_id = service.check(service.client.post("/v1/fine_tuning/jobs", json={
            "model": MODEL, "training_file": file_id, "seed": 0,
            "hyperparameters": {"n_epochs": EPOCHS, "batch_size": BATCH_SIZE, "n_gpus": 1}}))["id"]  # fmt: skip
        _wait(lambda: len(_steps(service, job_id)) >= 3)
        if case.startswith("serve-"):
            before = _service_pids(data_dir)
            stop = time.monotonic()
            os.killpg(service.process.pid, SERVE_STOPS[case])
            service.process.wait()
            _wait(lambda: not (before & _service_pids(data_dir)), 0.02)
            stopped_s = time.monotonic() - stop
            last = max(_steps_from_db(data_dir, job_id))
            service.client.close()
            service.log.close()
            restart, restart_s = time.monotonic(), time.time()
            service = Service(data_dir)
            _trains_again(service, job_id, restart_s)
            again_s = time.monotonic() - restart
            lost = last - _resumed_from(service, job_id)
            return (f"{case}: every process gone {stopped_s:.1f} s after the signal; steps lost {lost}; training "
                    f"again {again_s:.1f} s after serve was started again")  # fmt: skip
        if case.startswith("worker-"):
            (worker,) = [pid for pid in _service_pids(data_dir) if b"worker" in Path(f"/proc/{pid}/cmdline").read_bytes()
                         and b"fusetune.cli" in Path(f"/proc/{pid}/cmdline").read_bytes()]  # fmt: skip
            kill, kill_s = time.monotonic(), time.time()
            os.kill(worker, signal.SIGKILL if case == "worker-sigkill" else signal.SIGHUP)
            if case == "worker-sighup":
                # The trainer goes on to its next step and saves it: the attempt's steps are all in once the job
                # is handed over, and a later step is the next attempt's.
                _wait(lambda: "training handed over" in " ".join(_messages(service, job_id)))
                last = max(_steps(service, job_id))
                _wait(lambda: max(_steps(service, job_id)) > last)
            else:
                last = max(_steps(service, job_id))
                _trains_again(service, job_id, kill_s)
            again_s = time.monotonic() - kill
            lost = last - _resumed_from(service, job_id)
            return f"{case}: steps lost {lost}; training again {again_s:.1f} s after the signal"
        # pause
        service.check(service.client.post(f"/v1/fine_tuning/jobs/{job_id}/pause"))
        _wait(lambda: "paused at step" in " ".join(
            e["message"] for e in service.check(service.client.get(f"/v1/fine_tuning/jobs/{job_id}/events",
                                                                    params={"limit": 1000}))["data"]))  # fmt: skip
        last = max(_steps(service, job_id))
        resume, resume_s = time.monotonic(), time.time()
        service.check(service.client.post(f"/v1/fine_tuning/jobs/{job_id}/resume"))
        _trains_again(service, job_id, resume_s)
        again_s = time.monotonic() - resume
        lost = last - _resumed_from(service, job_id)
        return f"{case}: steps lost {lost}; training again {again_s:.1f} s after the resume"
    finally:
        service.close()


def _steps_from_db(data_dir: Path, job_id: str) -> list[int]:
    """The job's reported steps while the API is down: from its SQLite file."""
    import sqlite3

    with sqlite3.connect(data_dir / "fusetune.db") as connection:
        return [
            row[0] for row in connection.execute("SELECT step FROM job_metrics WHERE job_id = ?", (job_id,))
        ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fusetune-lifecycle-") as workdir:
        for case in filter(None, args.cases.split(",")):
            if case not in CASES:
                raise SystemExit(f"unknown case {case!r}; one of {', '.join(CASES)}")
            print(run_case(case, Path(workdir)), flush=True)


if __name__ == "__main__":
    main()
