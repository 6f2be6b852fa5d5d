"""/v1/fine_tuning/jobs: create, poll, cancel, and read events, metrics and checkpoints."""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Annotated, Literal

import orjson
from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import Response, StreamingResponse
from sqlalchemy import Connection, Row
from sqlalchemy.orm import Session

from fusetune.api import admission, idempotency
from fusetune.api.checkpoint_archive import archive_response, iter_archive_bytes, plan_stored_archive
from fusetune.api.deps import QueueDep, ReadsDep, SessionDep, SettingsDep, StorageDep, TenantDep
from fusetune.api.errors import ApiError, not_found
from fusetune.api.job_object import to_schema
from fusetune.api.routes.files import presigned_redirect
from fusetune.api.schemas import (
    CheckpointList,
    CheckpointObject,
    EstimateObject,
    EventList,
    JobCreate,
    JobList,
    JobObject,
    MetricList,
    api_event_level,
)
from fusetune.catalog import (
    checkpoint_model_name,
)
from fusetune.db import queries
from fusetune.db.models import Checkpoint, Job, JobStatus
from fusetune.storage import ArchiveDownload, StorageError

router = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["fine-tuning"])

# A metrics page: a plot's worth by default, and a bound on what one request reads and serialises.
DEFAULT_METRIC_POINTS = 1000
MAX_METRIC_POINTS = 10_000
JobStatusName = Literal["validating_files", "queued", "running", "succeeded", "failed", "cancelled", "paused"]


def _job_schema(session: Session, job: Job) -> JobObject:
    return to_schema(job, queries.attempts_of_jobs(session, [job.id])[job.id])


@router.post("", response_model=JobObject | EstimateObject)
def create_job(
    body: JobCreate,
    session: SessionDep,
    settings: SettingsDep,
    storage: StorageDep,
    tenant: TenantDep,
    queue: QueueDep,
    idempotency_key: Annotated[str | None, Header(alias=idempotency.HEADER)] = None,
) -> JobObject | EstimateObject:
    key = idempotency.check_key(idempotency_key)
    request_hash = idempotency.body_hash(body.model_dump(mode="json"))
    earlier = idempotency.replayed_object_id(session, tenant, "jobs", key, request_hash)
    if earlier is not None:
        return _job_schema(session, _get_job(session, earlier, tenant))
    admitted = admission.admit(session, settings, storage, tenant, queue, body, key, request_hash)
    return admitted if isinstance(admitted, EstimateObject) else to_schema(admitted)


@router.get("", response_model=JobList)
def list_jobs(
    request: Request,
    session: SessionDep,
    tenant: TenantDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    status: Annotated[JobStatusName | None, Query(description="Only jobs in this status")] = None,
    model: Annotated[str | None, Query(max_length=255, description="Only jobs of this model")] = None,
) -> JobList:
    """``metadata[key]=value`` query parameters keep only jobs carrying all those pairs."""
    metadata = {
        name[len("metadata[") : -1]: value
        for name, value in request.query_params.multi_items()
        if name.startswith("metadata[") and name.endswith("]")
    }
    # An unknown cursor would otherwise read as no cursor and answer the first page again, as if it were the next.
    if after is not None and queries.get_job(session, after, tenant) is None:
        raise not_found("fine-tuning job", after, param="after")
    rows, has_more = queries.list_jobs(
        session, tenant, after=after, limit=limit, metadata=metadata, status=status, model=model
    )
    attempts = queries.attempts_of_jobs(session, [job.id for job in rows])
    return JobList(data=[to_schema(job, attempts[job.id]) for job in rows], has_more=has_more)


def _get_job(session: Session, job_id: str, tenant: str) -> Job:
    job = queries.get_job(session, job_id, tenant)
    if job is None:
        raise not_found("fine-tuning job", job_id, param="fine_tuning_job_id")
    return job


def _job_row(connection: Connection, job_id: str, tenant: str) -> Row:
    job = queries.job_row(connection, job_id, tenant)
    if job is None:
        raise not_found("fine-tuning job", job_id, param="fine_tuning_job_id")
    return job


def _check_job(connection: Connection, job_id: str, tenant: str) -> None:
    if not queries.is_tenants_job(connection, job_id, tenant):
        raise not_found("fine-tuning job", job_id, param="fine_tuning_job_id")


def _stored_json(text: str | None) -> orjson.Fragment | None:
    return None if text is None else orjson.Fragment(text)


def _json_response(body: dict) -> Response:
    """A polled list route's body (the shape of its response_model), serialised directly: stored JSON columns go
    out as the text stored, never decoded and re-encoded; that and building a model per row were most of these
    routes' CPU time (tests check the bodies against the models)."""
    return Response(orjson.dumps(body), media_type="application/json")


# The routes clients poll while a job trains are async and read through ReadsDep (prebuilt Core queries, inline on
# SQLite): no trip to a worker thread, no ORM objects.
@router.get("/{job_id}", response_model=JobObject)
async def retrieve_job(job_id: str, reads: ReadsDep, tenant: TenantDep) -> JobObject:
    return await reads(
        lambda connection: to_schema(
            _job_row(connection, job_id, tenant), queries.job_attempts(connection, job_id)
        )
    )


def _transition(
    session: Session, job: Job, allowed_from: tuple[str, ...], to: str, verb: str, event: str
) -> Job:
    if not queries.change_job_status(session, job.id, allowed_from, to):
        session.rollback()
        session.refresh(job)
        # 400, not 409: clients retry 409s, and retrying cannot make the change valid.
        raise ApiError(400, f"Job '{job.id}' is {job.status} and cannot be {verb}.", param="fine_tuning_job_id",
                       code="invalid_state")  # fmt: skip
    queries.add_event(session, job.id, event)
    session.commit()
    session.refresh(job)
    return job


@router.post("/{job_id}/cancel", response_model=JobObject)
def cancel_job(job_id: str, session: SessionDep, tenant: TenantDep) -> JobObject:
    job = _get_job(session, job_id, tenant)
    # A worker watching a running job sees the new status and stops its processes.
    allowed = (JobStatus.VALIDATING_FILES, JobStatus.QUEUED, JobStatus.RUNNING, JobStatus.PAUSED)
    return _job_schema(
        session,
        _transition(session, job, allowed, JobStatus.CANCELLED, "cancelled", "Job cancelled by the user"),
    )


@router.post("/{job_id}/pause", response_model=JobObject)
def pause_job(job_id: str, session: SessionDep, tenant: TenantDep) -> JobObject:
    job = _get_job(session, job_id, tenant)
    # The worker stops the training processes, which frees the GPUs; resume queues the job again.
    allowed = (JobStatus.QUEUED, JobStatus.RUNNING)
    job = _transition(session, job, allowed, JobStatus.PAUSED, "paused", "Job paused by the user")
    return _job_schema(session, job)


@router.post("/{job_id}/resume", response_model=JobObject)
def resume_job(job_id: str, session: SessionDep, tenant: TenantDep, queue: QueueDep) -> JobObject:
    job = _get_job(session, job_id, tenant)
    job = _transition(
        session, job, (JobStatus.PAUSED,), JobStatus.QUEUED, "resumed", "Job resumed by the user"
    )
    queue.enqueue(job.id)
    return _job_schema(session, job)


@router.get("/{job_id}/events", response_model=EventList)
async def list_events(
    job_id: str,
    reads: ReadsDep,
    tenant: TenantDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
    type: Annotated[
        Literal["message", "metrics"] | None,
        Query(description='Only events of this type ("metrics" events mirror the per-step metrics)'),
    ] = None,
) -> Response:
    def read(connection: Connection) -> Response:
        _check_job(connection, job_id, tenant)
        rows, has_more = queries.list_events(connection, job_id, after=after, limit=limit, type=type)
        events = [
            {"id": id_, "object": "fine_tuning.job.event", "created_at": created_at,
             "level": api_event_level(level), "message": message, "type": type_,
             "data": _stored_json(data_json) if data_json not in (None, "null") else {}}
            for id_, created_at, level, message, type_, data_json in rows
        ]  # fmt: skip
        return _json_response({"object": "list", "data": events, "has_more": has_more})

    return await reads(read)


@router.get("/{job_id}/metrics", response_model=MetricList)
async def list_metrics(
    job_id: str,
    reads: ReadsDep,
    tenant: TenantDep,
    min_step: Annotated[int | None, Query(ge=0, le=queries.MAX_STEP)] = None,
    max_step: Annotated[int | None, Query(ge=0, le=queries.MAX_STEP)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_METRIC_POINTS)] = DEFAULT_METRIC_POINTS,
) -> Response:
    """Steps in [min_step, max_step], oldest first, at most ``limit``; when ``has_more``, the next page starts at
    ``min_step`` = the last step returned + 1."""

    def read(connection: Connection) -> Response:
        _check_job(connection, job_id, tenant)
        rows, has_more = queries.list_metrics(
            connection, job_id, min_step=min_step, max_step=max_step, limit=limit
        )
        points = [
            {
                "step": step,
                "created_at": created_at,
                "train_loss": train_loss,
                "values": _stored_json(values_json),
                "rank_memory": _stored_json(rank_memory_json),
            }
            for step, created_at, train_loss, values_json, rank_memory_json in rows
        ]
        return _json_response({"object": "list", "job_id": job_id, "data": points, "has_more": has_more})

    return await reads(read)


def _checkpoint_schema(job: Job, checkpoint: Checkpoint) -> CheckpointObject:
    return CheckpointObject(
        id=checkpoint.id,
        created_at=checkpoint.created_at,
        fine_tuned_model_checkpoint=checkpoint_model_name(job.fine_tuned_model or job.model, checkpoint.step),
        fine_tuning_job_id=job.id,
        metrics=checkpoint.metrics,
        step_number=checkpoint.step,
        best=checkpoint.best,
    )


@router.get("/{job_id}/checkpoints", response_model=CheckpointList)
def list_checkpoints(
    job_id: str,
    session: SessionDep,
    tenant: TenantDep,
    after: Annotated[str | None, Query(description="The last checkpoint id of the previous page")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 10,
) -> CheckpointList:
    """Newest first (by step), as OpenAI pages them."""
    job = _get_job(session, job_id, tenant)
    cursor = None
    if after is not None:
        # An unknown cursor would otherwise read as no cursor and answer the first page again.
        cursor = queries.get_checkpoint(session, after, tenant)
        if cursor is None or cursor.job_id != job.id:
            raise not_found("checkpoint", after, param="after")
    rows, has_more = queries.page_checkpoints(session, job.id, after=cursor, limit=limit)
    data = [_checkpoint_schema(job, c) for c in rows]
    return CheckpointList(
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
        has_more=has_more,
    )


# The checkpoint folder's optimizer, scheduler and RNG state (the worker's
# fusetune.worker.train.checkpoint.TRAINING_STATE_DIRNAME; the API does not import the worker). Only a run
# resuming inside the service needs it, and it is about twice the size of the weights.
TRAINING_STATE_DIRNAME = "training_state"


@router.get(
    "/{job_id}/checkpoints/{checkpoint_id}/content",
    response_class=StreamingResponse,
    responses={
        200: {"content": {"application/x-tar": {}}, "description": "The checkpoint folder as a tar."},
        206: {"content": {"application/x-tar": {}}, "description": "One byte range of that tar."},
        307: {"description": "A presigned URL of that tar in the object store (when configured)."},
        416: {"description": "The Range lies outside the archive."},
    },
)
def download_checkpoint(
    job_id: str,
    checkpoint_id: str,
    session: SessionDep,
    storage: StorageDep,
    tenant: TenantDep,
    include_training_state: Annotated[
        bool,
        Query(
            description="Also include training_state/ (optimizer, scheduler and RNG state: only needed to "
            "resume training; about twice the size of the weights)."
        ),
    ] = False,
    range_header: Annotated[str | None, Header(alias="Range")] = None,
    if_range: Annotated[str | None, Header(alias="If-Range")] = None,
) -> Response:
    """The checkpoint as a tar, streamed from its files; answers single-range HTTP Range requests, so an
    interrupted download can be resumed (the archive is the same bytes on every request)."""
    job = _get_job(session, job_id, tenant)
    checkpoint = queries.get_checkpoint(session, checkpoint_id, tenant)
    if checkpoint is None or checkpoint.job_id != job.id:
        raise not_found("checkpoint", checkpoint_id, param="checkpoint_id")
    excluded = () if include_training_state else (TRAINING_STATE_DIRNAME,)
    storage_path = checkpoint.storage_path
    try:
        files = storage.checkpoint_files(tenant, storage_path, excluded)
    except StorageError as error:
        raise ApiError(503, f"The checkpoint store failed: {error}", code="storage_error") from error
    if files is None:
        raise not_found("checkpoint", checkpoint.id, param="checkpoint_id")
    archive = plan_stored_archive(
        PurePosixPath(storage_path).name,
        files,
        lambda relative, first, last: storage.read_checkpoint_file(
            tenant, storage_path, relative, first, last
        ),
    )
    variant = "-with-training-state" if include_training_state else ""
    filename = f"{job.id}-step-{checkpoint.step}{variant}.tar"
    try:
        url = storage.checkpoint_archive_url(
            tenant,
            storage_path,
            ArchiveDownload(
                archive.etag, archive.size, lambda: iter_archive_bytes(archive, 0, archive.size), filename
            ),
        )
    except StorageError as error:
        raise ApiError(503, f"The checkpoint store failed: {error}", code="storage_error") from error
    if url is not None:
        return presigned_redirect(url)
    return archive_response(archive, filename, range_header, if_range)
