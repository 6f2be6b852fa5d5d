"""A stopping worker's hand-over request goes through the job's row, where the trainer's rank 0 reads it on any
node (as it reads a pause); only the worker that holds the running job can make it, and a new claim clears it."""

from __future__ import annotations

from fusetune.config import Settings
from fusetune.db import queries
from fusetune.db.migrate import upgrade
from fusetune.db.models import File, Job, JobStatus
from fusetune.db.session import make_engine, make_session_factory
from fusetune.worker.train.reporter import SqlReporter, StopRequest


def test_the_holding_workers_request_reaches_the_trainer_and_a_new_claim_clears_it(tmp_path):
    settings = Settings(data_dir=tmp_path)
    settings.ensure_dirs()
    upgrade(settings.database_url)
    sessions = make_session_factory(make_engine(settings.database_url))
    with sessions() as session:
        session.add(File(id="file-h", filename="t.jsonl", purpose="fine-tune", bytes=1, storage_name="t"))
        session.add(Job(id="ftjob-h", model="m", training_file_id="file-h", status=JobStatus.QUEUED))
        session.commit()
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
