"""A run's local scratch, so that a worker needs no disk shared with any other host: the job's inputs copied
in before the run, and the scratch cleared after it. Checkpoints in the store are the checkpoints package's
(`fusetune.worker.train.checkpoints.store`).

With local storage (one host) every step is a no-op or hands back the file in place.

**On a Ray cluster's nodes.** A run's config names its inputs by this host's paths. `local_paths` is the one
place that answers "where are this run's inputs here?", from what the run reads as the store and the catalog
name it (`RunInputs`): the worker calls it with its own settings for a run on its host, and with a remote store
each node of a Ray job calls it with the node's (`stage_on_node`, from fusetune/worker/ray_driver.py), so that
no node reads the worker's disk. The rest of the config (what the worker decided) travels as it is. The outcome
files that rank 0 writes on its node go back the same way, through the store (`publish_outcome` on the node,
`fetch_outcome` on the worker), as a folder published like a checkpoint: manifest last, so the worker never
reads half of one.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusetune.config import Settings
from fusetune.db import queries
from fusetune.db.models import Job
from fusetune.db.session import make_engine, make_session_factory
from fusetune.storage import Storage, open_storage
from fusetune.worker.locations import ModelLocations
from fusetune.worker.train.checkpoints import store as checkpoint_store
from fusetune.worker.train.checkpoints.layout import checkpoints_root
from fusetune.worker.train.config import TrainConfig
from fusetune.worker.train.outcome import OUTCOME_FILENAMES

INPUTS_DIRNAME = "inputs"
CONFIG_FILENAME = "train_config.json"
# Where rank 0's node gathers the outcome files to publish them, in its run folder.
OUTCOME_DIRNAME = "outcome"


class StagingError(RuntimeError):
    """A node cannot find what the run reads; the message names what is missing and where it was looked for."""


@dataclass(frozen=True)
class RunInputs:
    """What a run reads, by the names the store and the catalog give it rather than one host's paths."""

    job_id: str
    tenant: str
    model: str  # the job's model: a base model's name (each host has its own copy) or a fine-tuned model's
    training_file: str  # storage names of the tenant's files
    validation_file: str | None

    @classmethod
    def of_job(cls, session, job: Job) -> RunInputs:
        training = queries.get_file(session, job.training_file_id, job.tenant)
        validation = (
            queries.get_file(session, job.validation_file_id, job.tenant) if job.validation_file_id else None
        )
        return cls(
            job.id,
            job.tenant,
            job.model,
            training.storage_name,
            validation.storage_name if validation else None,
        )


def stage_input(storage: Storage, tenant: str, storage_name: str, run_dir: Path) -> Path:
    """A local path of one of the job's files: in place (local storage) or copied into the run's scratch."""
    return storage.fetch_file(tenant, storage_name, run_dir / INPUTS_DIRNAME)


def local_paths(
    inputs: RunInputs, settings: Settings, storage: Storage, locations: ModelLocations, model_location: str
) -> dict[str, Any]:
    """The TrainConfig fields that are paths on this host (`settings`'): the model and the bases its LoRA
    checkpoints name, the job's files (fetched when the store is remote), and the run's folder."""
    run_dir = settings.runs_dir / inputs.job_id
    validation_file = None
    if inputs.validation_file is not None:
        validation_file = str(stage_input(storage, inputs.tenant, inputs.validation_file, run_dir))
    return {
        "model_path": model_location,
        "adapter_base_models": locations.adapter_base_models(inputs.tenant, model_location),
        "training_file": str(stage_input(storage, inputs.tenant, inputs.training_file, run_dir)),
        "validation_file": validation_file,
        "output_dir": str(run_dir),
        "checkpoint_paths_relative_to": str(settings.runs_dir),
    }


def stage_on_node(config: TrainConfig) -> Path:
    """On a node of a Ray job, before its torchrun: fetches what its ranks read (the job's files, a fine-tuned
    base model, the checkpoints SQL records, to resume from the newest) into the node's own data directory, and
    writes the worker's `config` there with this node's paths. Returns the config's path on the node.

    The node's settings are its environment's: the worker leaves FUSETUNE_DATA_DIR and FUSETUNE_MODELS_DIR out
    of the job's, so each node has its own (set where its `ray start` runs), as each worker host does; the store
    and the database are the job's."""
    settings = Settings()
    storage = open_storage(settings)
    engine = make_engine(settings.database_url)
    try:
        session_factory = make_session_factory(engine)
        with session_factory() as session:
            job = queries.get_job(session, config.job_id)
            inputs = RunInputs.of_job(session, job)
        locations = ModelLocations(settings, session_factory, storage)
        model_location = locations.location_of(inputs.model, inputs.tenant)
        if model_location is None:
            raise StagingError(
                f"Model '{inputs.model}' is not on this node (FUSETUNE_MODELS_DIR={settings.models_dir})"
            )
        checkpoint_store.restore_checkpoints(storage, session_factory, job, settings.runs_dir)
        local = config.model_copy(update=local_paths(inputs, settings, storage, locations, model_location))
    finally:
        engine.dispose()
    return local.write(settings.runs_dir / inputs.job_id / CONFIG_FILENAME)


def outcome_storage_path(job_id: str, attempt: int) -> str:
    # Apart from checkpoints/, which the worker's clean-up lists; one per attempt, so that none reads another's.
    return f"{job_id}/outcomes/attempt-{attempt}"


def publish_outcome(storage: Storage, tenant: str, job_id: str, attempt: int, run_dir: Path) -> None:
    """On rank 0's node, once its torchrun has ended: the outcome files rank 0 wrote, to the store."""
    folder = run_dir / OUTCOME_DIRNAME
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for name in OUTCOME_FILENAMES:
        if (run_dir / name).is_file():
            shutil.copy2(run_dir / name, folder / name)
    storage.publish_checkpoint(tenant, outcome_storage_path(job_id, attempt), folder)


def finish_on_node(run_dir: Path, tenant: str, job_id: str, attempt: int, publishes_outcome: bool) -> None:
    """On a node of a Ray job, once its torchrun has ended: rank 0's node publishes the outcome files, and
    every node clears its scratch (the store holds what a next attempt needs)."""
    storage = open_storage(Settings())
    if publishes_outcome:
        publish_outcome(storage, tenant, job_id, attempt, run_dir)
    clear_scratch(storage, run_dir)


def fetch_outcome(storage: Storage, tenant: str, job_id: str, attempt: int, run_dir: Path) -> None:
    """On the worker, once the Ray job has ended: the outcome files its rank 0 published, into `run_dir`, where
    the worker reads them as it does a local run's; nothing when none were published (a node lost first)."""
    storage_path = outcome_storage_path(job_id, attempt)
    if storage.checkpoint_files(tenant, storage_path) is None:
        return
    folder = storage.restore_checkpoint(tenant, storage_path, run_dir / OUTCOME_DIRNAME)
    for path in folder.iterdir():
        path.replace(run_dir / path.name)
    folder.rmdir()
    storage.delete_checkpoints(tenant, [storage_path])


def clear_scratch(storage: Storage, run_dir: Path) -> None:
    """With a remote store the local copies are scratch: the store holds what the next run needs."""
    if storage.remote:
        for path in (run_dir / INPUTS_DIRNAME, checkpoints_root(run_dir), run_dir / OUTCOME_DIRNAME):
            shutil.rmtree(path, ignore_errors=True)
