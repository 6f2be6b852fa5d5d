"""A failed job's error and events name no server path; the worker's log keeps the whole message."""

from __future__ import annotations

import logging

from fusetune.config import Settings
from fusetune.db import queries
from fusetune.db.models import JobStatus
from fusetune.worker.redact import without_paths
from fusetune.worker.tasks import JobRunner, Outcome
from tests.worker.job_database import database_with_one_job


def test_paths_are_cut_to_their_last_part():
    assert (
        without_paths("denied: '/srv/ft/runs/ftjob-1/step-9.incomplete'") == "denied: '…/step-9.incomplete'"
    )
    assert without_paths('File "/opt/venv/lib/torch/x.py", line 3') == 'File "…/x.py", line 3'
    assert without_paths("upload to s3://bucket/tenant/ftjob-1/step-9 failed") == "upload to …/step-9 failed"
    # Not paths: ratios, a relative path, a web address.
    for text in ("step 3/4", "data/train.jsonl", "see https://example.com/a/b"):
        assert without_paths(text) == text


def test_a_failed_jobs_error_and_event_name_no_server_path(tmp_path, caplog):
    settings = Settings(data_dir=tmp_path / "data")
    sessions = database_with_one_job(settings, "ftjob-a")
    runner = JobRunner(settings, requeue=lambda job_id: None)
    with sessions() as session:
        assert queries.claim_job(session, "ftjob-a", runner.worker_name, settings.lease_s)
        session.commit()
        job = queries.get_job(session, "ftjob-a")
    path = str(settings.runs_dir / "ftjob-a" / "checkpoints" / "step-1700.incomplete")
    message = f"writing the checkpoint of step 1700 failed: [Errno 13] Permission denied: '{path}'"
    error = {"code": "storage_error", "message": message}
    with caplog.at_level(logging.WARNING, logger="fusetune.worker.tasks"):
        runner._record(
            job, Outcome(JobStatus.FAILED, {"error": error}, f"Training failed: {message}", "error")
        )
    with sessions() as session:
        failed = queries.get_job(session, "ftjob-a")
        events, _ = queries.list_events(session, "ftjob-a")
    assert failed.error == {
        "code": "storage_error",
        "message": message.replace(path, "…/step-1700.incomplete"),
    }
    assert not any(str(tmp_path) in event.message for event in events)
    assert any("ftjob-a" in record.getMessage() and path in record.getMessage() for record in caplog.records)
