"""A job's admission: what create_job decides before the job exists, in the order it decides it.

The route parses the request, asks `admit`, and renders what it returns. Admission checks the files, the model
and the grader, resolves the specification ("auto" decided once, so the job row says what will run), asks the
planner's one `plan_run` with the configured GPU memory (the worker asks it again with what is free), checks the
data as the trainer will read it and that some worker can ever run the job, then inserts the job with its
idempotency record and enqueues it only after the commit.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from fusetune import capacity
from fusetune.api import idempotency
from fusetune.api.data_check import check_job_data, refuse_if_the_data_fails
from fusetune.api.errors import ApiError
from fusetune.api.file_validation import TRAINING_PURPOSE
from fusetune.api.grader_check import check_job_grader
from fusetune.api.schemas import DataCheckObject, EstimateObject, JobCreate
from fusetune.catalog import (
    adapter_module_paths,
    base_model_location,
    list_base_models,
    split_checkpoint_model_name,
)
from fusetune.config import Settings
from fusetune.db import queries
from fusetune.db.models import File, Job, JobStatus, new_id
from fusetune.spec.estimate import DataCounts, ModelShape
from fusetune.spec.hyperparameters import SpecError
from fusetune.spec.job import JobSpec
from fusetune.spec.methods import DEFAULT_METHOD, METHODS, reads_the_same_files
from fusetune.spec.planner import CheckpointSaving, PlanError, free_disk_bytes, plan_run
from fusetune.storage import Storage, StorageError


def admit(
    session: Session,
    settings: Settings,
    storage: Storage,
    tenant: str,
    queue,
    body: JobCreate,
    key: str | None,
    request_hash: str,
) -> Job | EstimateObject:
    """Admits a job request: its inputs checked, "auto" resolved, its plan estimated, its data checked, then the
    job inserted (idempotently) and enqueued after the commit; a dry run returns its estimate instead. Raises
    ApiError for a request that cannot run, naming the field."""
    training = _check_inputs(session, settings, tenant, body)
    spec = _resolve_spec(body, training, settings)
    _refuse_unknown_lora_targets(settings, body, spec)
    validation = queries.get_file(session, body.validation_file, tenant) if body.validation_file else None
    check_job_grader(settings, storage, tenant, spec, training, validation)
    estimate = _estimate(session, settings, storage, tenant, body.model, training, spec)
    if body.dry_run:
        if estimate is None:
            raise ApiError(
                400,
                f"No estimate for model '{body.model}': no config.json with its shape was found.",
                param="model",
            )
        return estimate.model_copy(
            update={"data_check": _data_check(session, settings, storage, tenant, body, training, spec)}
        )
    _refuse_if_too_large(estimate)
    _refuse_if_it_can_never_run(session, settings, tenant, spec)
    refuse_if_the_data_fails(_data_check(session, settings, storage, tenant, body, training, spec))
    waiting = capacity.NO_WORKER if capacity.no_worker_up(settings, session) else None
    job, created = _insert_job(session, tenant, body, spec, key, request_hash, waiting)
    if created:
        _enqueue(session, queue, job)
    return job


def _check_model(session: Session, settings: Settings, tenant: str, model: str) -> None:
    if base_model_location(settings, model) is not None:
        return
    if queries.has_fine_tuned_model(session, model, tenant):
        return
    if split_checkpoint_model_name(model) and queries.checkpoint_of_model(session, model, tenant) is not None:
        return
    available = (
        ", ".join(list_base_models(settings))
        or "none (put Hugging Face model folders in the models directory)"
    )
    fine_tuned = [name for name, _ in queries.fine_tuned_models(session, tenant)]
    yours = (
        f" Your fine-tuned models (and their checkpoints, as <model>:ckpt-step-<n>): {', '.join(fine_tuned)}."
        if fine_tuned
        else ""
    )
    raise ApiError(
        400,
        f"Model '{model}' is not available. Base models on this server: {available}.{yours}",
        param="model",
        code="model_not_found",
    )


def _model_config(
    session: Session, settings: Settings, storage: Storage, tenant: str, model: str
) -> dict | None:
    """The model's config.json: a base model's from its folder, a fine-tuned model's from its newest checkpoint
    in the store (the API host holds no checkpoint when the store is remote)."""
    location = base_model_location(settings, model)
    if location is not None:
        path = Path(location) / "config.json"
        raw = path.read_bytes() if path.is_file() else None
    else:
        checkpoint = queries.checkpoint_of_model(session, model, tenant)
        try:
            raw = (
                storage.read_checkpoint_bytes(tenant, checkpoint.storage_path, "config.json")
                if checkpoint is not None
                else None
            )
        except StorageError as error:
            raise ApiError(503, f"The checkpoint store failed: {error}", code="storage_error") from error
    if raw is None:
        return None
    try:
        config = json.loads(raw)
    except ValueError:
        return None
    return config if isinstance(config, dict) else None


def _estimate(
    session: Session,
    settings: Settings,
    storage: Storage,
    tenant: str,
    model: str,
    training: File,
    spec: JobSpec,
) -> EstimateObject | None:
    config = _model_config(session, settings, storage, tenant, model)
    if config is None:
        return None
    try:
        shape = ModelShape.from_config_dict(config)
    except (KeyError, ValueError, TypeError):
        return None
    data = DataCounts(example_count=training.example_count, token_estimate=training.token_estimate)
    measured = queries.median_tokens_per_second(session, model)
    # The memory plan for the GPU the job would land on: FUSETUNE_GPU_MEMORY_BYTES (workers advertise their GPU
    # count, not its memory); the worker plans again from the memory free when the job starts.
    capacity = settings.gpu_memory_bytes
    # The data directory holds the runs' checkpoints (the worker's, when they share a host; a worker checks its
    # own again before it trains).
    saving = CheckpointSaving(
        settings.keep_last_checkpoints, settings.checkpoint_every_steps, settings.checkpoint_every_epoch,
        settings.checkpoint_every_minutes, free_disk_bytes(settings.data_dir),
    )  # fmt: skip
    try:
        decided = plan_run(shape, spec, data, capacity, saving, measured_tokens_per_second=measured)
    except PlanError as exc:
        raise ApiError(400, str(exc), param=exc.field) from exc
    planned, disk = decided.planned, decided.disk
    estimate = planned.estimate.as_dict()
    return EstimateObject(
        model=model,
        gpu_memory_bytes=capacity,
        fits=planned.fits,
        plan_description=planned.plan.describe(),
        alternatives=[a.as_dict() for a in planned.alternatives] or None,
        remedies={a.change: a.peak_memory_bytes_per_gpu for a in planned.alternatives} or None,
        refusal=None if decided.refusal is None else decided.refusal.message,
        checkpoint_bytes=disk.checkpoint_bytes,
        checkpoints_on_disk=disk.checkpoints_on_disk,
        checkpoint_disk_bytes=disk.needed_bytes,
        disk_free_bytes=disk.free_bytes,
        disk_fits=disk.fits,
        **estimate,
    )


# ---- create_job's steps, in the order it takes them ---------------------------------------------------------


def _check_inputs(session: Session, settings: Settings, tenant: str, body: JobCreate) -> File:
    """The files and the model exist for this tenant; returns the training file."""
    training = queries.get_file(session, body.training_file, tenant)
    if training is None:
        raise ApiError(
            400,
            f"Training file '{body.training_file}' does not exist.",
            param="training_file",
            code="file_not_found",
        )
    validation = queries.get_file(session, body.validation_file, tenant) if body.validation_file else None
    if body.validation_file is not None and validation is None:
        raise ApiError(
            400,
            f"Validation file '{body.validation_file}' does not exist.",
            param="validation_file",
            code="file_not_found",
        )
    _check_model(session, settings, tenant, body.model)
    method_type = body.method.type if body.method is not None else DEFAULT_METHOD
    for param, file in (("training_file", training), ("validation_file", validation)):
        # Before the method's check: a job's results CSV has no line format, only the default method's name.
        if file is not None and file.purpose != TRAINING_PURPOSE:
            line_format = METHODS[method_type].example_format.name
            raise ApiError(
                400,
                f"File '{file.id}' ({file.filename}) has purpose '{file.purpose}': a {param} must be a training "
                f"file of purpose '{TRAINING_PURPOSE}', uploaded with {line_format} examples for the job's "
                f"method '{method_type}'.",
                param=param,
                code="invalid_file_purpose",
            )
        if file is not None and not reads_the_same_files(file.method, method_type):
            raise ApiError(
                400,
                f"File '{file.id}' holds {file.method} examples, but the job's method.type is '{method_type}'.",
                param=param,
                code="invalid_file_method",
            )
    return training


def _resolve_spec(body: JobCreate, training: File, settings: Settings) -> JobSpec:
    """ "auto" is resolved once, here, so the job row says exactly what will run."""
    try:
        spec = JobSpec.from_request(
            body.method, body.hyperparameters, training.example_count, settings.base_learning_rate
        )
    except SpecError as exc:
        raise ApiError(400, str(exc), param=exc.field) from exc
    if spec.hyperparameters.early_stopping is not None and body.validation_file is None:
        raise ApiError(400, "hyperparameters.early_stopping needs a validation_file: it stops on the validation "
                       "loss.", param="hyperparameters.early_stopping")  # fmt: skip
    return spec


def _refuse_unknown_lora_targets(settings: Settings, body: JobCreate, spec: JobSpec) -> None:
    """A LoRA target that names no module of the model would fail the job in the trainer; refused here when the
    model's safetensors are in the models directory (adapter_module_paths), listing the names it has."""
    lora = spec.hyperparameters.lora
    location = base_model_location(settings, body.model)
    if lora is None or location is None or not Path(location).is_dir():
        return
    paths = adapter_module_paths(Path(location))
    unmatched = lora.unmatched_targets(paths) if paths is not None else []
    if unmatched:
        given_in = (
            "hyperparameters"
            if body.hyperparameters is not None
            else f"method.{body.method.type}.hyperparameters"
        )
        names = sorted({path.rpartition(".")[2] for path in paths})
        raise ApiError(
            400,
            f"lora.target_modules {unmatched} name no module of model '{body.model}'. Its modules that take an "
            f'adapter: {", ".join(names)}; or "all-linear" for every linear layer but the output head.',
            param=f"{given_in}.lora.target_modules",
            code="invalid_lora_target_modules",
        )


def _refuse_if_too_large(estimate: EstimateObject | None) -> None:
    """No memory plan fits the GPU, or the checkpoints do not fit the disk: refused, saying what would fit."""
    if estimate is not None and estimate.refusal is not None:
        code = "job_too_large" if estimate.fits is False else "insufficient_disk"
        raise ApiError(400, estimate.refusal, param="hyperparameters", code=code)


def _data_check(
    session: Session,
    settings: Settings,
    storage: Storage,
    tenant: str,
    body: JobCreate,
    training: File,
    spec: JobSpec,
) -> DataCheckObject:
    """The job's files tokenized and masked as the trainer will (fusetune/api/data_check.py)."""
    files = [("training_file", training)]
    if body.validation_file is not None:
        files.append(("validation_file", queries.get_file(session, body.validation_file, tenant)))
    return check_job_data(settings, storage, tenant, body.model, spec, files)


def _refuse_if_it_can_never_run(session: Session, settings: Settings, tenant: str, spec: JobSpec) -> None:
    problem = capacity.creation_problem(settings, session, tenant, spec.hyperparameters.n_gpus)
    if problem is not None:
        raise ApiError(400, problem, param="hyperparameters.n_gpus", code="insufficient_capacity")


def _insert_job(
    session: Session,
    tenant: str,
    body: JobCreate,
    spec: JobSpec,
    key: str | None,
    request_hash: str,
    waiting_reason: str | None = None,
) -> tuple[Job, bool]:
    """Adds and commits the job, its first event and the idempotency record: (the job, True), or (the earlier
    job, False) when a concurrent request with the same Idempotency-Key committed first."""
    job = Job(
        id=new_id("ftjob-"),
        tenant=tenant,
        model=body.model,
        training_file_id=body.training_file,
        validation_file_id=body.validation_file,
        status=JobStatus.QUEUED,
        hyperparameters=spec.to_row(),
        seed=body.seed if body.seed is not None else int.from_bytes(os.urandom(4), "little") % (2**31),
        suffix=body.suffix,
        user_metadata=body.metadata,
        integrations=[i.model_dump(mode="json", exclude_none=True) for i in body.integrations]
        if body.integrations
        else None,
        n_gpus=spec.hyperparameters.n_gpus,
        waiting_reason=waiting_reason,
    )
    session.add(job)
    session.flush()
    queries.add_event(session, job.id, f"Created fine-tuning job: {job.id}")
    if waiting_reason is not None:
        queries.add_event(session, job.id, f"Waiting: {waiting_reason}.",
                          data={"event": "waiting", "reason": waiting_reason})  # fmt: skip
    idempotency.remember(session, tenant, "jobs", key, request_hash, job.id)
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        earlier = idempotency.replayed_object_id(session, tenant, "jobs", key, request_hash)
        if earlier is None:
            raise
        return queries.get_job(session, earlier, tenant), False
    return job, True


def _enqueue(session: Session, queue, job: Job) -> None:
    """Only after the commit: a worker that receives the id must find the row. A broker that cannot be reached
    fails the job, so that it does not sit queued for ever."""
    try:
        queue.enqueue(job.id)
    except Exception as exc:
        queries.finish_job_from(
            session,
            job.id,
            JobStatus.QUEUED,
            JobStatus.FAILED,
            error={"code": "queue_unavailable", "message": f"Could not reach the broker: {exc}"},
        )
        session.commit()
        raise ApiError(
            503, "The job queue is unavailable; the job was not started.", code="queue_unavailable"
        ) from exc
