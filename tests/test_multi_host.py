"""Several hosts, simulated: one API and two workers, each with a private data directory (no path shared among
them); PostgreSQL, Redis and an S3 server (moto's) shared. Two jobs submitted together train on both workers;
the worker of one is killed (-9) after its first checkpoint, and the other worker resumes that job from the
checkpoint in the store, ending on the same weights as the uninterrupted job. Every checkpoint downloads
through the API; deleting a file deletes its object; the store holds exactly the recorded checkpoints."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import signal
import tarfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load
from sqlalchemy import create_engine, text

from fusetune.config import Settings
from fusetune.demo.assets import TRAIN_FILE, build_tiny_model
from fusetune.worker.train.checkpoints import layout as ckpt
from tests.services import (
    moto_s3_server,
    postgres_database,
    redis_server,
    running_service,
    start_worker,
    stop_process,
)
from tests.worker.test_crash_recovery import _training_pids, _wait_until

pytestmark = pytest.mark.slow
MODEL = "tiny-llama"
TRAIN_LINES = 32
BATCH_SIZE = 8
STEPS = 2 * TRAIN_LINES // BATCH_SIZE  # 2 epochs
PREFIX = "cluster"


def _host(root: Path, name: str, tiny_model: Path) -> Path:
    """A host's own data directory with its own copy of the base model."""
    data_dir = root / name
    shutil.copytree(tiny_model, data_dir / "models" / MODEL)
    return data_dir


def _events(service, job_id: str) -> list[str]:
    params = {"limit": 1000}
    return [
        e["message"]
        for e in service.client.get(f"/v1/fine_tuning/jobs/{job_id}/events", params=params).json()["data"]
    ]


def _worker_pid(service, job_id: str) -> int:
    started = [m for m in _events(service, job_id) if m.startswith("Fine-tuning job started on worker")]
    return int(re.search(r":(\d+) \(attempt", started[-1]).group(1))


def _final_weights(service, job_id: str) -> dict[str, torch.Tensor]:
    checkpoints = service.client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints").json()["data"]
    final = next(c for c in checkpoints if c["step_number"] == STEPS)
    archive = service.client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints/{final['id']}/content").content
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("model.safetensors"))
        return load(tar.extractfile(member).read())


def _saved_locally(workers: dict, job_id: str) -> bool:
    """A whole checkpoint of the job is in its folder on either worker (it may be uploading still)."""
    return any(ckpt.list_checkpoints(settings.runs_dir / job_id) for settings, _ in workers.values())


def _recorded_steps(database, job_id: str) -> list[int]:
    with database.connect() as connection:
        rows = connection.execute(text("SELECT step FROM checkpoints WHERE job_id = :job"), {"job": job_id})
        return [step for (step,) in rows]


def test_two_workers_share_only_the_store_and_a_killed_job_resumes_on_the_other(tmp_path):
    tiny_model = build_tiny_model(tmp_path / "built" / MODEL)
    train = tmp_path / "train.jsonl"
    train.write_text("".join(TRAIN_FILE.read_text().splitlines(keepends=True)[:TRAIN_LINES]))
    with (
        moto_s3_server(tmp_path) as s3,
        redis_server(tmp_path) as broker_url,
        postgres_database() as database_url,
    ):
        database = create_engine(database_url)
        common = {
            "database_url": database_url,
            "broker_url": broker_url,
            "lease_s": 6,
            "reaper_interval_s": 1,
        }
        storage_env = s3.storage_env(PREFIX)
        api_env = {**storage_env, "FUSETUNE_EMBEDDED_WORKER": "false"}
        with running_service(_host(tmp_path, "api", tiny_model), extra_env=api_env, **common) as service:
            workers = {}
            for name in ("worker-a", "worker-b"):
                settings = Settings(
                    data_dir=_host(tmp_path, name, tiny_model), checkpoint_every_steps=2, **common
                )
                settings.ensure_dirs()
                workers[name] = (settings, start_worker(settings, tmp_path / f"{name}.log", storage_env))
            try:
                file_id = service.upload(train).json()["id"]
                spare = service.upload(train).json()["id"]
                job_ids = []
                for _ in range(2):
                    response = service.client.post("/v1/fine_tuning/jobs", json={
                        "model": MODEL, "training_file": file_id, "seed": 0,
                        "hyperparameters": {"n_epochs": 2, "batch_size": BATCH_SIZE, "learning_rate": 3e-3, "n_gpus": 1}})  # fmt: skip
                    assert response.status_code == 200, response.text
                    job_ids.append(response.json()["id"])
                reference, victim = job_ids

                # Freeze the victim's trainer within milliseconds of its first recorded checkpoint (so it is
                # whole in the store), with six steps and three checkpoints still to go, then kill its worker:
                # frozen, the trainer cannot reach the end of the run before the kill, however fast the machine.
                # Its processes are found while they load (the job id is in their command line on any host). The
                # checkpoint row, read from PostgreSQL (the one place that records it), is polled closely only
                # once the checkpoint's folder is in place on the worker, so the polling does not slow the start.
                _wait_until(lambda: len(_training_pids(f"/{victim}/")) >= 2, 300,
                            "the victim's training processes never started", interval_s=0.05)  # fmt: skip
                _wait_until(lambda: _saved_locally(workers, victim), 300, "no checkpoint was saved",
                            interval_s=0.01)  # fmt: skip
                _wait_until(lambda: _recorded_steps(database, victim), 60, "no checkpoint was recorded",
                            interval_s=0.005)  # fmt: skip
                # Found again now: a process seen while the job started may have been a short-lived helper of its
                # start (gone by now), and a rank may have started after that first look; one may also end
                # between the look and the signal.
                for pid in _training_pids(f"/{victim}/"):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGSTOP)
                saved_step = max(_recorded_steps(database, victim))
                assert saved_step < STEPS
                victim_pid = _worker_pid(service, victim)
                victim_worker = next(name for name, (_, p) in workers.items() if p.pid == victim_pid)
                os.kill(victim_pid, signal.SIGKILL)
                workers[victim_worker][1].wait()
                _wait_until(
                    lambda: not _training_pids(f"/{victim}/"), 20, "training processes outlived their worker"
                )

                jobs = {job_id: service.wait_for_job(job_id, timeout_s=300) for job_id in job_ids}
            finally:
                for _, process in workers.values():
                    stop_process(process)
                database.dispose()
            assert all(job["status"] == "succeeded" for job in jobs.values()), jobs
            first_workers = {
                re.search(r"on worker (\S+) \(attempt 1\)", m).group(1)
                for j in job_ids
                for m in _events(service, j)
                if "(attempt 1)" in m
            }
            assert len(first_workers) == 2, first_workers  # the two jobs started on the two workers
            victim_events = _events(service, victim)
            assert any("stopped renewing its lease" in m for m in victim_events)
            assert f"Resumed from the checkpoint of step {saved_step}" in victim_events, victim_events
            resumed_weights = _final_weights(service, victim)
            for name, tensor in _final_weights(service, reference).items():
                torch.testing.assert_close(resumed_weights[name], tensor, rtol=0, atol=1e-7, msg=name)

            # Every recorded checkpoint downloads through the API, and the store holds exactly those.
            recorded = set()
            for job_id in job_ids:
                for checkpoint in service.client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints").json()[
                    "data"
                ]:
                    url = f"/v1/fine_tuning/jobs/{job_id}/checkpoints/{checkpoint['id']}/content"
                    with tarfile.open(fileobj=io.BytesIO(service.client.get(url).content)) as tar:
                        assert any(n.endswith("config.json") for n in tar.getnames())
                    recorded.add(f"{job_id}/checkpoints/step-{checkpoint['step_number']}")
            stored = {
                "/".join(key.split("/")[4:7])
                for key in s3.keys(f"{PREFIX}/tenants/default/runs/")
                if key.endswith("fusetune-manifest.json")
            }
            assert stored == recorded

            assert service.client.delete(f"/v1/files/{spare}").status_code == 200
            # (Beside the jobs' results files, .csv.)
            uploads = [key for key in s3.keys(f"{PREFIX}/tenants/default/files/") if key.endswith(".jsonl")]
            assert uploads == [f"{PREFIX}/tenants/default/files/{file_id}.jsonl"]

        # Nothing crossed between the hosts' directories: the API kept no file, the surviving worker no scratch
        # (the killed one left its scratch behind, as a lost host would).
        assert not any((tmp_path / "api" / "files").iterdir()) and not any(
            (tmp_path / "api" / "runs").iterdir()
        )
        (survivor,) = set(workers) - {victim_worker}
        assert not list((tmp_path / survivor / "runs").glob("*/checkpoints/*"))
