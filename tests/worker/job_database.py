"""A migrated database holding one job and its training file: what the worker-side tests of one job start from."""

from __future__ import annotations

from sqlalchemy.orm import sessionmaker

from fusetune.config import Settings
from fusetune.db.migrate import upgrade
from fusetune.db.models import File, Job, JobStatus
from fusetune.db.session import make_engine, make_session_factory


def database_with_one_job(
    settings: Settings, job_id: str, status: str = JobStatus.QUEUED, model: str = "tiny"
) -> sessionmaker:
    """`settings`' directories made and its database migrated, holding the job `job_id` of `model` in `status`
    and its training file (`file-` and the job id's last part); returns the database's session factory."""
    settings.ensure_dirs()
    upgrade(settings.database_url)
    sessions = make_session_factory(make_engine(settings.database_url))
    file_id = "file-" + job_id.split("-")[-1]
    with sessions() as session:
        session.add(File(id=file_id, filename="t.jsonl", purpose="fine-tune", bytes=1, storage_name="t"))
        session.add(Job(id=job_id, model=model, training_file_id=file_id, status=status))
        session.commit()
    return sessions
