"""A stopping worker's hand-over request goes through the job's row, where the trainer's rank 0 reads it on any
node (as it reads a pause); only the worker that holds the running job can make it, and a new claim clears it."""

from __future__ import annotations

from fusetune.config import Settings
from fusetune.db import queries
from fusetune.db.models import JobStatus
from fusetune.worker.train.reporter import SqlReporter, StopRequest
from tests.worker.job_database import database_with_one_job


def test_the_holding_workers_request_reaches_the_trainer_and_a_new_claim_clears_it(tmp_path):
    settings = Settings(data_dir=tmp_path)
    sessions = database_with_one_job(settings, "ftjob-h", model="m")
    with sessions() as session:
        assert queries.claim_job(session, "ftjob-h", "worker-a", lease_s=60)
        session.commit()
    reporter = SqlReporter(settings.database_url, "ftjob-h", status_poll_interval_s=0.0)
    try:
        assert reporter.stop_request() is None
        with sessions() as session:
            assert not queries.request_handover(session, "ftjob-h", "worker-b")  # not the one that holds it
            session.commit()
        assert reporter.stop_request() is None
        with sessions() as session:
            assert queries.request_handover(session, "ftjob-h", "worker-a")
            session.commit()
        assert reporter.stop_request() == StopRequest.HANDOVER
    finally:
        reporter.close()
    with sessions() as session:
        queries.finish_job(session, "ftjob-h", JobStatus.QUEUED)  # handed back to the queue
        session.commit()
        assert queries.claim_job(session, "ftjob-h", "worker-b", lease_s=60)
        session.commit()
        assert queries.get_job_stop_state(session, "ftjob-h") == (JobStatus.RUNNING, False)
