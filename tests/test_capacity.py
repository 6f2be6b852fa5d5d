"""Capacity and quotas (fusetune/capacity.py): a job starts only on a worker it fits and within its tenant's
limits, waits with its reason otherwise and starts when a slot frees; the API refuses only what can never run."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
from fastapi.testclient import TestClient

from fusetune import capacity
from fusetune.api.app import create_app
from fusetune.config import Settings
from fusetune.db import queries
from fusetune.db.migrate import upgrade
from fusetune.db.models import File, Job, JobStatus
from fusetune.db.session import make_engine, make_session_factory
from fusetune.worker.tasks import JobRunner, Outcome
from tests.services import postgres_database

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
