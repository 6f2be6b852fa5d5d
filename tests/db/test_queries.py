"""The query functions the routes call, on a migrated SQLite database: what each returns and changes."""

from __future__ import annotations

import pytest

from fusetune.db import queries
from fusetune.db.migrate import upgrade
from fusetune.db.models import File, Job, JobMetric, JobStatus
from fusetune.db.session import make_engine, make_session_factory


@pytest.fixture
def session(tmp_path):
    url = f"sqlite:///{tmp_path / 'q.db'}"
    upgrade(url)
    engine = make_engine(url)
    with make_session_factory(engine)() as session:
        yield session
    engine.dispose()


def _file(session, file_id: str, tenant: str = "a") -> File:
    row = File(id=file_id, tenant=tenant, filename="t.jsonl", purpose="fine-tune", bytes=1, storage_name="t")
    session.add(row)
    return row


def _job(session, job_id: str, status: str, tenant: str = "a", **fields) -> Job:
    job = Job(id=job_id, tenant=tenant, model="tiny", training_file_id="file-t", status=status, **fields)
    session.add(job)
    return job


def test_fine_tuned_models_of_the_tenant(session):
    _file(session, "file-t")
    _job(session, "j1", JobStatus.SUCCEEDED, fine_tuned_model="tiny:ft-late", finished_at=20)
    _job(session, "j2", JobStatus.SUCCEEDED, fine_tuned_model="tiny:ft-early", finished_at=10)
    _job(session, "j3", JobStatus.FAILED, fine_tuned_model="tiny:ft-failed", finished_at=5)
    _job(session, "j4", JobStatus.SUCCEEDED, tenant="b", fine_tuned_model="tiny:ft-other", finished_at=1)
    session.flush()
    assert queries.fine_tuned_models(session, "a") == [("tiny:ft-early", 10), ("tiny:ft-late", 20)]
    assert queries.has_fine_tuned_model(session, "tiny:ft-late", "a")
    assert not queries.has_fine_tuned_model(session, "tiny:ft-failed", "a")
    assert not queries.has_fine_tuned_model(session, "tiny:ft-other", "a")
    # The source job is found whatever its status, and only among the tenant's.
    assert queries.job_of_fine_tuned_model(session, "tiny:ft-failed", "a").id == "j3"
    assert queries.job_of_fine_tuned_model(session, "tiny:ft-other", "a") is None


def test_change_job_status_only_from_the_allowed_statuses(session):
    _file(session, "file-t")
    job = _job(session, "j1", JobStatus.RUNNING)
    session.flush()
    assert queries.change_job_status(session, "j1", (JobStatus.QUEUED, JobStatus.RUNNING), JobStatus.PAUSED)
    session.refresh(job)
    assert job.status == JobStatus.PAUSED and job.finished_at is None
    assert not queries.change_job_status(session, "j1", (JobStatus.RUNNING,), JobStatus.CANCELLED)
    assert queries.change_job_status(session, "j1", (JobStatus.PAUSED,), JobStatus.CANCELLED)
    session.refresh(job)
    assert job.status == JobStatus.CANCELLED and job.finished_at is not None


def test_job_counts_and_the_running_jobs_latest_metrics(session):
    _file(session, "file-t")
    _job(session, "running", JobStatus.RUNNING)
    _job(session, "running-silent", JobStatus.RUNNING, tenant="b")
    _job(session, "done", JobStatus.SUCCEEDED)
    _job(session, "queued", JobStatus.QUEUED)
    session.flush()
    session.add_all([
        JobMetric(job_id="running", step=2, values={"tokens_per_second": 200.0}),
        JobMetric(job_id="running", step=1, values={"tokens_per_second": 100.0}),
        JobMetric(job_id="done", step=1, values={"tokens_per_second": 50.0}),
    ])  # fmt: skip
    session.flush()
    assert queries.job_counts_by_status(session) == {"running": 2, "succeeded": 1, "queued": 1}
    assert queries.latest_metric_values_of_running_jobs(session) == {"running": {"tokens_per_second": 200.0}}


def test_a_file_in_use_and_deleting_one(session):
    used, validation, free = _file(session, "file-t"), _file(session, "file-v"), _file(session, "file-free")
    _job(session, "j1", JobStatus.QUEUED, validation_file_id="file-v")
    session.flush()
    assert queries.file_in_use(session, used.id) and queries.file_in_use(session, validation.id)
    assert not queries.file_in_use(session, free.id)
    queries.delete_file(session, free)
    session.flush()
    assert queries.get_file(session, "file-free", "a") is None
