"""Capacity and quotas (fusetune/capacity.py): a job starts only on a worker it fits and within its tenant's
limits, waits with its reason otherwise and starts when a slot frees; the API refuses only what can never run."""

from __future__ import annotations

import functools
import os
import re
import signal
import time
from contextlib import nullcontext
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text

from fusetune import capacity
from fusetune.api.app import create_app
from fusetune.config import Settings
from fusetune.db import queries
from fusetune.db.migrate import upgrade
from fusetune.db.models import File, Job, JobStatus
from fusetune.db.session import make_engine, make_session_factory
from fusetune.demo.assets import TRAIN_FILE, build_tiny_model
from fusetune.worker.tasks import JobRunner, Outcome
from tests.services import postgres_database, redis_server, running_service, start_worker, stop_process

LINE = b'{"messages": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]}\n'


def _settings(tmp_path, **overrides) -> Settings:
    settings = Settings(data_dir=tmp_path / "data", **overrides)
    settings.ensure_dirs()
    upgrade(settings.database_url)
    return settings


def _done(job: Job) -> Outcome:
    return Outcome(JobStatus.SUCCEEDED, {"trained_tokens": 1, "fine_tuned_model": f"ft:{job.id}"}, "done")


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_two_tenants_with_a_limit_of_one_job_each(tmp_path, database):
    with postgres_database() if database == "postgresql" else nullcontext(None) as url:
        _two_tenants_with_a_limit_of_one_job_each(tmp_path, url)


def _two_tenants_with_a_limit_of_one_job_each(tmp_path, database_url: str | None) -> None:
    overrides = {"database_url": database_url} if database_url else {}
    settings = _settings(tmp_path, tenant_max_running_jobs=1, **overrides)
    sessions = make_session_factory(make_engine(settings.database_url))
    with sessions() as session:
        session.add(File(id="file-a", filename="t.jsonl", purpose="fine-tune", bytes=1, storage_name="t"))
        for created_at, (job_id, tenant) in enumerate((("a1", "a"), ("a2", "a"), ("b1", "b"))):
            session.add(Job(id=job_id, tenant=tenant, model="tiny", training_file_id="file-a",
                            status=JobStatus.QUEUED, created_at=created_at))  # fmt: skip
        session.commit()
    sent: list[str] = []
    first, second = JobRunner(settings, sent.append), JobRunner(settings, sent.append)
    first.worker_name, second.worker_name = "worker-1", "worker-2"
    second._train = _done
    seen = {}

    def train_a1(job: Job) -> Outcome:
        # While a1 trains on the first worker, the second is handed a2 (tenant a's second job) and b1.
        seen["a2"] = second.run("a2")
        with sessions() as session:
            seen["a2 waits"] = queries.get_job(session, "a2").waiting_reason
        seen["b1"] = second.run("b1")
        seen["sent while a1 runs"] = list(sent)
        return _done(job)

    first._train = train_a1
    assert first.run("a1") == JobStatus.SUCCEEDED
    assert seen["a2"] == "skipped" and seen["b1"] == JobStatus.SUCCEEDED
    assert seen["a2 waits"] == "waiting for a slot: tenant 'a' has 1 job(s) running, its limit is 1"
    # b1's end freed tenant b's slot, not a's: a2 was sent only when a1 ended.
    assert seen["sent while a1 runs"] == [] and sent == ["a2"]
    assert second.run("a2") == JobStatus.SUCCEEDED
    with sessions() as session:
        assert queries.get_job(session, "a2").waiting_reason is None
        events, _ = queries.list_events(session, "a2")
    waiting = [e.message for e in events if e.message.startswith("Waiting:")]
    assert waiting == ["Waiting: waiting for a slot: tenant 'a' has 1 job(s) running, its limit is 1."]


def test_a_job_waits_for_a_worker_large_enough_and_is_sent_by_one(tmp_path):
    settings = _settings(tmp_path)
    sessions = make_session_factory(make_engine(settings.database_url))
    with sessions() as session:
        session.add(File(id="file-a", filename="t.jsonl", purpose="fine-tune", bytes=1, storage_name="t"))
        session.add(Job(id="big", model="tiny", training_file_id="file-a", status=JobStatus.QUEUED, n_gpus=4))
        session.commit()
        assert not capacity.claim_or_park(settings, session, "big", "small-worker", worker_gpus=2)
        session.commit()
        assert queries.get_job(session, "big").waiting_reason == "waiting for a worker with at least 4 GPUs"
    sent: list[str] = []
    assert capacity.release_waiting_jobs(settings, sessions, sent.append, worker_gpus=2) == []
    assert capacity.release_waiting_jobs(settings, sessions, sent.append, worker_gpus=8) == ["big"] == sent


@pytest.fixture
def client(tmp_path):
    settings = _settings(tmp_path, tenant_max_gpus=4)
    (settings.models_dir / "tiny").mkdir()
    (settings.models_dir / "tiny" / "config.json").write_text("{}")
    with TestClient(
        create_app(settings), headers={"Authorization": f"Bearer {settings.dev_api_key}"}
    ) as client:
        client.app_settings = settings
        yield client


def _create(client, file_id: str, n_gpus: int):
    return client.post("/v1/fine_tuning/jobs", json={"model": "tiny", "training_file": file_id,
                                                     "hyperparameters": {"n_gpus": n_gpus}})  # fmt: skip


def test_creation_refuses_what_no_worker_or_limit_allows_and_queues_without_a_worker(client):
    file_id = client.post(
        "/v1/files", files={"file": ("t.jsonl", LINE)}, data={"purpose": "fine-tune"}
    ).json()["id"]
    # No worker up yet: the job is queued, and says why it waits.
    waiting = _create(client, file_id, 1).json()
    assert waiting["status"] == "queued" and waiting["status_details"] == capacity.NO_WORKER
    events = client.get(f"/v1/fine_tuning/jobs/{waiting['id']}/events").json()["data"]
    assert events[0]["message"] == f"Waiting: {capacity.NO_WORKER}."
    # The tenant may never use more than its 4 GPUs, whatever the workers.
    refused = _create(client, file_id, 5)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "hyperparameters.n_gpus"
    assert "at most 4 GPUs" in refused.json()["error"]["message"]
    with make_session_factory(make_engine(client.app_settings.database_url))() as session:
        queries.record_worker(session, "worker-1", gpus=2)
        session.commit()
    refused = _create(client, file_id, 3)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "insufficient_capacity"
    assert (
        refused.json()["error"]["message"] == "n_gpus is 3, but the largest worker has 2: ask for at most 2."
    )
    fits = _create(client, file_id, 2).json()
    assert fits["status"] == "queued" and fits["status_details"] is None


def test_the_operator_sets_and_resets_a_tenants_limits(tmp_path):
    from typer.testing import CliRunner

    from fusetune.cli import app as cli

    settings = _settings(tmp_path, tenant_max_running_jobs=3)
    runner, data_dir = CliRunner(), ["--data-dir", str(settings.data_dir)]
    result = runner.invoke(
        cli, ["tenants", "limit", "acme", "--max-running-jobs", "1", "--max-gpus", "2", *data_dir]
    )
    assert result.exit_code == 0, result.output
    assert runner.invoke(cli, ["tenants", "limits", *data_dir]).output == "acme\t1\t2\n"
    sessions = make_session_factory(make_engine(settings.database_url))
    with sessions() as session:
        assert capacity.tenant_limits(settings, session, "acme") == capacity.TenantLimits(1, 2)
        assert capacity.tenant_limits(settings, session, "other") == capacity.TenantLimits(3, None)
    assert runner.invoke(cli, ["tenants", "limit", "acme", "--reset", *data_dir]).exit_code == 0
    with sessions() as session:
        assert capacity.tenant_limits(settings, session, "acme") == capacity.TenantLimits(3, None)
    assert runner.invoke(cli, ["tenants", "limit", "a/b", *data_dir]).exit_code == 2


# ---- two real worker processes against one server ------------------------------------------------------------

MODEL = "tiny-llama"
TRAIN_LINES, BATCH_SIZE, LONG_EPOCHS = 64, 8, 100  # 8 steps an epoch: no job here ends before it is cancelled


def _processes_of(run_dir: Path) -> set[int]:
    """The job's torchrun and ranks: every process whose command line names its run directory."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(run_dir) in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    pids.add(int(entry.name))
            except OSError:
                continue
    return pids


def _freeze(run_dir: Path) -> set[int]:
    """SIGSTOP for the job's training processes, once it trains: the job stays running, as its tenant's limit
    counts it, without taking the CPU the other job trains on, however long the test takes."""
    pids = _processes_of(run_dir)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    return pids


def _until(predicate):
    """Polls until `predicate` holds (a row, an event, a status); pytest-timeout bounds it."""
    while not (value := predicate()):
        time.sleep(0.1)
    return value


@pytest.mark.slow
def test_two_worker_processes_hold_each_tenant_to_its_limit(tmp_path):
    """Two `fusetune worker` processes (one advertising 1 GPU, one 2) beside one API, on PostgreSQL and Redis as
    a deployment with several workers runs, every tenant limited to one job in training. Tenant a's second job
    waits with its reason while its first trains, though a worker is free, and starts only once the first ends;
    tenant b's job trains beside a's on the other worker. A SIGHUP to b's worker hands b's job over with a
    checkpoint and restarts the worker in place, which resumes the job from that checkpoint."""
    data_dir = tmp_path / "data"
    build_tiny_model(data_dir / "models" / MODEL)
    train = tmp_path / "train.jsonl"
    train.write_text("".join(TRAIN_FILE.read_text().splitlines(keepends=True)[:TRAIN_LINES]))
    with redis_server(tmp_path) as broker_url, postgres_database() as database_url:
        database = create_engine(database_url)
        # A lease longer than the test: a trainer frozen within a write to its job's row holds up the lease's
        # renewal until it is let go, and that must not pass for a lost worker.
        common = {"database_url": database_url, "broker_url": broker_url, "tenant_max_running_jobs": 1,
                  "lease_s": 3600}  # fmt: skip
        api_env = {"FUSETUNE_EMBEDDED_WORKER": "false"}
        with running_service(data_dir, extra_env=api_env, **common) as service:
            workers = [
                start_worker(
                    Settings(data_dir=data_dir, worker_gpus=gpus, **common), tmp_path / f"w{gpus}.log"
                )
                for gpus in (1, 2)
            ]
            try:
                with make_session_factory(make_engine(database_url))() as session:
                    keys = {tenant: queries.create_api_key(session, tenant)[1] for tenant in ("a", "b")}
                    session.commit()
                clients = {
                    tenant: httpx.Client(base_url=service.base_url, timeout=60,
                                         headers={"Authorization": f"Bearer {key}"})
                    for tenant, key in keys.items()
                }  # fmt: skip
                _two_tenants_on_two_workers(service, clients, database, workers, train)
            finally:
                for worker in workers:
                    stop_process(worker)
        database.dispose()


def _two_tenants_on_two_workers(service, clients, database, workers, train) -> None:
    def job(tenant: str, job_id: str) -> dict:
        return clients[tenant].get(f"/v1/fine_tuning/jobs/{job_id}").json()

    def messages(tenant: str, job_id: str) -> list[str]:
        events = clients[tenant].get(f"/v1/fine_tuning/jobs/{job_id}/events", params={"limit": 1000}).json()
        return [event["message"] for event in reversed(events["data"])]

    def create(tenant: str, **hyperparameters) -> httpx.Response:
        with open(train, "rb") as handle:
            file_id = clients[tenant].post("/v1/files", files={"file": ("t.jsonl", handle)},
                                           data={"purpose": "fine-tune"}).json()["id"]  # fmt: skip
        return clients[tenant].post("/v1/fine_tuning/jobs", json={"model": MODEL, "training_file": file_id,
            "seed": 0, "hyperparameters": {"n_epochs": LONG_EPOCHS, "batch_size": BATCH_SIZE, **hyperparameters}})  # fmt: skip

    with database.connect() as connection:
        _until(lambda: connection.execute(text("SELECT count(*) FROM workers")).scalar() == 2)
    # The largest worker up has 2 GPUs: a job asking for 4 is refused at creation, naming what fits.
    refused = create("a", n_gpus=4)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "insufficient_capacity", (
        refused.text
    )
    assert "the largest worker has 2: ask for at most 2" in refused.json()["error"]["message"]

    def trains(tenant: str, job_id: str) -> bool:
        return bool(clients[tenant].get(f"/v1/fine_tuning/jobs/{job_id}/metrics").json()["data"])

    a1 = create("a", n_gpus=1).json()["id"]
    _until(lambda: job("a", a1)["status"] == "running")
    a2 = create("a", n_gpus=1).json()["id"]
    waiting = "waiting for a slot: tenant 'a' has 1 job(s) running, its limit is 1"
    # The free worker took a2's message and left the job queued, with the reason.
    assert _until(lambda: (body := job("a", a2))["status_details"] and body)["status_details"] == waiting
    b1 = create("b", n_gpus=1).json()["id"]
    _until(functools.partial(trains, "a", a1))
    frozen = _freeze(service.settings.runs_dir / a1)
    _until(functools.partial(trains, "b", b1))
    started = re.compile(r"Fine-tuning job started on worker \S+:(\d+) \(attempt")
    (a1_worker,) = [int(m.group(1)) for m in map(started.match, messages("a", a1)) if m]
    (b1_worker,) = [int(m.group(1)) for m in map(started.match, messages("b", b1)) if m]
    assert a1_worker != b1_worker and {a1_worker, b1_worker} == {w.pid for w in workers}

    # SIGHUP to b1's worker: b1 goes back with a checkpoint, the worker restarts in place and resumes it.
    os.kill(b1_worker, signal.SIGHUP)
    handed = _until(lambda: [m for m in messages("b", b1) if "training handed over with the checkpoint" in m])
    step = re.search(r"checkpoint of step (\d+)", handed[0]).group(1)
    _until(lambda: f"Resumed from the checkpoint of step {step}" in messages("b", b1))
    assert all(worker.poll() is None for worker in workers)  # restarted in place: the process never exited
    assert [int(m.group(1)) for m in map(started.match, messages("b", b1)) if m] == [b1_worker] * 2
    assert job("a", a2)["status_details"] == waiting and job("a", a1)["status"] == "running"

    # a1 ends: a2 starts.
    for pid in frozen:
        os.kill(pid, signal.SIGCONT)
    for tenant, job_id in (("b", b1), ("a", a1)):
        assert clients[tenant].post(f"/v1/fine_tuning/jobs/{job_id}/cancel").status_code == 200
    _until(lambda: job("a", a2)["status"] == "running")
    assert clients["a"].post(f"/v1/fine_tuning/jobs/{a2}/cancel").status_code == 200

    def ended(tenant: str, job_id: str) -> bool:
        body = job(tenant, job_id)
        return body["status"] == "cancelled" and body["attempts"][-1]["ended_at"] is not None

    for tenant, job_id in (("b", b1), ("a", a1), ("a", a2)):
        _until(functools.partial(ended, tenant, job_id))

    with database.connect() as connection:
        events = connection.execute(text("SELECT job_id, message FROM job_events ORDER BY seq")).all()
    order = [(job_id, message) for job_id, message in events]

    def first(job_id: str, prefix: str) -> int:
        return next(i for i, (j, m) in enumerate(order) if j == job_id and m.startswith(prefix))

    a1_cancelled = first(a1, "Job cancelled by the user")
    # Tenant a had one job in training at a time: a2 waited from a1's start to its cancellation.
    assert first(a1, "Fine-tuning job started") < first(a2, f"Waiting: {waiting}") < a1_cancelled
    assert first(a2, "Fine-tuning job started") > a1_cancelled
    # Tenant b's job trained beside a1, on the other worker.
    assert first(a1, "Fine-tuning job started") < first(b1, "Fine-tuning job started") < a1_cancelled
    causes = [(attempt["cause"], attempt["fault"]) for attempt in job("b", b1)["attempts"]]
    assert causes == [("handed_over", False), ("cancelled", False)]
    for tenant, job_id in (("b", b1), ("a", a1), ("a", a2)):
        assert not any("stopped renewing its lease" in m for m in messages(tenant, job_id))
