"""The reaper requeues a job whose worker stopped renewing its lease, and its event names that worker."""

from __future__ import annotations

from fusetune.config import Settings
from fusetune.db import queries
from fusetune.db.models import Job, JobStatus
from fusetune.worker.tasks import reap_lapsed_jobs
from tests.worker.test_train_trainer import make_job_database


def test_a_lapsed_job_is_requeued_naming_its_lost_worker(tmp_path):
    _, sessions, job_id = make_job_database(tmp_path)
    with sessions() as session:
        job = session.get(Job, job_id)
        job.status = JobStatus.QUEUED
        assert queries.claim_job(session, job_id, "node-7:4242", lease_s=60)
        job.lease_expires_at = 1
        session.commit()
    requeued: list[str] = []
    assert reap_lapsed_jobs(Settings(data_dir=tmp_path, max_attempts=3), sessions, requeued.append) == [
        job_id
    ]
    assert requeued == [job_id]
    with sessions() as session:
        job = session.get(Job, job_id)
        assert (job.status, job.worker, job.lease_expires_at) == (JobStatus.QUEUED, None, None)
        messages = [event.message for event in queries.list_events(session, job_id)[0]]
    assert messages == [
        "Worker node-7:4242 stopped renewing its lease; job requeued (fault 1 of the 3 a job may have)."
    ]
