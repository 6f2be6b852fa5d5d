"""Checkpoints in the object store (FUSETUNE_STORAGE_URL), so that a worker needs no disk shared with any other
host. SQL records a checkpoint only once the store holds all of it:

- the trainer publishes each complete checkpoint folder (uploads it, manifest last) before the reporter records
  it; a failed upload (after the client's retries) fails the job with the code `storage_error`, and the
  checkpoints recorded before stay recorded and whole;
- before a run the worker restores the checkpoints SQL records into the local run folder (a retry on another
  worker resumes from the newest), and after it removes from the store what the run left unrecorded.

With local storage (one host) each of these is a no-op or hands back the folder in place: the folder the trainer
renamed into place is the checkpoint.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from fusetune.config import Settings
from fusetune.db import queries
from fusetune.db.models import Job, JobStatus
from fusetune.storage import Storage, StorageError, open_storage
from fusetune.worker.train.checkpoints.layout import TRAINING_STATE_DIRNAME
from fusetune.worker.train.outcome import ErrorCode, TrainingFailure

# Names the tenant to the trainer processes, whose checkpoint uploads go under that tenant's prefix.
TENANT_ENV = "FUSETUNE_JOB_TENANT"


# ---------------------------------------------------------------------------------------- in the trainer


@functools.cache
def _storage() -> Storage:
    # The worker hands its settings to the trainer through the environment (Settings.subprocess_env).
    return open_storage(Settings())


def publish_checkpoint(folder: Path, storage_path: str) -> None:
    """Makes the complete checkpoint `folder` whole in the store under `storage_path` (rank 0, before SQL
    records it)."""
    storage = _storage()
    if not storage.remote:
        return
    try:
        storage.publish_checkpoint(os.environ[TENANT_ENV], storage_path, folder)
    except StorageError as error:
        raise TrainingFailure(
            ErrorCode.STORAGE_ERROR, f"uploading the checkpoint {storage_path} to the store failed: {error}"
        ) from error


# ------------------------------------------------------------------------------ in the worker, around a run


def restore_checkpoints(storage: Storage, session_factory, job: Job, runs_dir: Path) -> list[str]:
    """Brings every checkpoint SQL records for the job into the local run folder (those not there already),
    so the trainer resumes from the newest and prunes the old ones as if it had saved them itself."""
    if not storage.remote:
        return []
    with session_factory() as session:
        recorded = [checkpoint.storage_path for checkpoint in queries.list_checkpoints(session, job.id)]
    restored = []
    for storage_path in recorded:
        target = runs_dir / storage_path
        if not target.is_dir():
            storage.restore_checkpoint(job.tenant, storage_path, target)
            restored.append(storage_path)
    return restored


def restore_model(storage: Storage, tenant: str, storage_path: str, runs_dir: Path) -> Path:
    """A fine-tuned checkpoint used as a base model: its weights (not its training state) in local scratch."""
    target = runs_dir / storage_path
    if storage.remote and target.is_dir():
        return target
    return storage.restore_checkpoint(
        tenant, storage_path, target, excluded_top_level=(TRAINING_STATE_DIRNAME,)
    )


def remove_unrecorded_checkpoints(storage: Storage, session_factory, job: Job, worker_name: str) -> list[str]:
    """Deletes the job's checkpoint objects that SQL does not record: those the trainer pruned (their rows
    went first), and those a crash cut short before they were recorded. Run after the trainer exits, and not
    when another worker holds the job meanwhile (its upload in progress is unrecorded too)."""
    if not storage.remote:
        return []
    with session_factory() as session:
        current = queries.get_job(session, job.id)
        if current is None or (current.status == JobStatus.RUNNING and current.worker != worker_name):
            return []
        recorded = {checkpoint.storage_path for checkpoint in queries.list_checkpoints(session, job.id)}
    stale = sorted(storage.list_checkpoint_paths(job.tenant, job.id) - recorded)
    storage.delete_checkpoints(job.tenant, stale)
    return stale
