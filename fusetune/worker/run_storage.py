"""What a worker does with the store around one training run, so that it needs no disk shared with any other
host: copy the job's inputs to local scratch, restore the checkpoints SQL has recorded (a retry on another
worker resumes from the newest), and afterwards remove from the store what the run left unrecorded.

With local storage (one host) every step is a no-op or hands back the file in place.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from fusetune.db import queries
from fusetune.db.models import Job, JobStatus
from fusetune.storage import Storage

INPUTS_DIRNAME = "inputs"
# The trainer's checkpoint folders (fusetune.worker.train.checkpoint.CHECKPOINTS_DIRNAME).
CHECKPOINTS_DIRNAME = "checkpoints"
# Names the tenant to the trainer processes, whose checkpoint uploads go under that tenant's prefix.
TENANT_ENV = "FUSETUNE_JOB_TENANT"


def stage_input(storage: Storage, tenant: str, storage_name: str, run_dir: Path) -> Path:
    """A local path of one of the job's files: in place (local storage) or copied into the run's scratch."""
    return storage.fetch_file(tenant, storage_name, run_dir / INPUTS_DIRNAME)


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
    return storage.restore_checkpoint(tenant, storage_path, target, excluded_top_level=("training_state",))


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


def clear_scratch(storage: Storage, run_dir: Path) -> None:
    """With a remote store the local copies are scratch: the store holds what the next run needs."""
    if storage.remote:
        for name in (INPUTS_DIRNAME, CHECKPOINTS_DIRNAME):
            shutil.rmtree(run_dir / name, ignore_errors=True)
