"""Attempts are counted for faults only: pauses and a stopping worker's hand-over use up none of max_attempts, a
lost worker and a crashed trainer each use one; the job object lists every attempt with its cause."""

from __future__ import annotations

from fastapi.testclient import TestClient

from fusetune.api.app import create_app
from fusetune.config import Settings
from fusetune.db import queries
from fusetune.db.models import Job, JobStatus
from fusetune.worker.tasks import JobRunner, Outcome, reap_lapsed_jobs
from tests.worker.job_database import database_with_one_job


def test_pauses_and_hand_overs_use_up_no_attempts(tmp_path):
    settings = Settings(data_dir=tmp_path / "data", max_attempts=2)
    sessions = database_with_one_job(settings, "ftjob-a")
    requeued: list[str] = []
    runner = JobRunner(settings, requeue=requeued.append)

    def claim() -> Job:
        with sessions() as session:
            assert queries.claim_job(session, "ftjob-a", runner.worker_name, settings.lease_s)
            session.commit()
            return queries.get_job(session, "ftjob-a")

    # Attempt 1: paused by its user, and resumed before its worker saw the pause (the job is queued again).
    job = claim()
    with sessions() as session:
        assert queries.change_job_status(session, job.id, (JobStatus.RUNNING,), JobStatus.PAUSED)
        assert queries.change_job_status(session, job.id, (JobStatus.PAUSED,), JobStatus.QUEUED)
        session.commit()
    assert runner._record(job, Outcome(JobStatus.QUEUED, {}, "stopped: the job was queued")) == "queued"
    # Attempt 2: its worker was stopped and handed it over.
    job = claim()
    assert runner._record(job, Outcome(JobStatus.QUEUED, {}, "handed over", handed_over=True)) == "queued"
    # Attempt 3: its worker vanished; the first fault of the two allowed, so the job goes back to the queue.
    job = claim()
    with sessions() as session:
        session.get(Job, job.id).lease_expires_at = 1
        session.commit()
    assert reap_lapsed_jobs(settings, sessions, requeued.append) == [job.id]
    # Attempt 4: the trainer crashed; the second fault fails the job.
    job = claim()
    crash = Outcome(JobStatus.FAILED, {"error": {"code": "trainer_crashed", "message": "exit 1"}}, "exit 1",
                    "error", retryable=True)  # fmt: skip
    assert runner._record(job, crash) == JobStatus.FAILED
    assert requeued == [job.id] * 2

    with TestClient(
        create_app(settings), headers={"Authorization": f"Bearer {settings.dev_api_key}"}
    ) as client:
        body = client.get(f"/v1/fine_tuning/jobs/{job.id}").json()
    assert body["status"] == "failed"
    assert body["error"]["message"] == "exit 1 (gave up after 2 faults)"
    assert [(a["number"], a["cause"], a["fault"]) for a in body["attempts"]] == [
        (1, "paused", False), (2, "handed_over", False), (3, "worker_lost", True), (4, "crashed", True),
    ]  # fmt: skip
    assert all(a["ended_at"] >= a["started_at"] for a in body["attempts"])
    assert body["training_seconds"] == sum(a["ended_at"] - a["started_at"] for a in body["attempts"])
