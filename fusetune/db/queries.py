"""The few queries the service needs. Callers own the transaction: nothing here commits."""

from __future__ import annotations

import hashlib
import math
import secrets
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Row, Text, bindparam, cast, delete, func, select, update
from sqlalchemy.orm import Session, aliased

from fusetune.catalog import split_checkpoint_model_name
from fusetune.db.models import (
    ApiKey,
    AttemptEnd,
    Checkpoint,
    Eval,
    EvalRun,
    EvalRunOutputItem,
    File,
    IdempotentRequest,
    Job,
    JobAttempt,
    JobEvent,
    JobMetric,
    JobStatus,
    TenantLimit,
    Worker,
    now_s,
)


def get_file(session: Session, file_id: str, tenant: str) -> File | None:
    return session.scalar(select(File).where(File.id == file_id, File.tenant == tenant))


def page_files(
    session: Session,
    tenant: str,
    *,
    purpose: str | None = None,
    after: File | None = None,
    limit: int,
    order: str = "desc",
) -> tuple[list[File], bool]:
    """The tenant's files by creation time, newest first ("desc", ties by id) or oldest first ("asc", the exact
    reverse), only of ``purpose`` when given, after the file ``after``; (page, has_more)."""
    query = select(File).where(File.tenant == tenant)
    if purpose:
        query = query.where(File.purpose == purpose)
    if order == "desc":
        query = query.order_by(File.created_at.desc(), File.id)
        if after is not None:
            query = query.where(
                (File.created_at < after.created_at)
                | ((File.created_at == after.created_at) & (File.id > after.id))
            )
    else:
        query = query.order_by(File.created_at, File.id.desc())
        if after is not None:
            query = query.where(
                (File.created_at > after.created_at)
                | ((File.created_at == after.created_at) & (File.id < after.id))
            )
    rows = list(session.scalars(query.limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def file_in_use(session: Session, file_id: str) -> bool:
    """Whether a job trains or validates on the file."""
    query = select(Job.id).where((Job.training_file_id == file_id) | (Job.validation_file_id == file_id))
    return session.scalar(query.limit(1)) is not None


def delete_file(session: Session, file: File) -> None:
    """Forgets the file's row; the caller deletes the stored bytes after its commit."""
    session.execute(update(Job).where(Job.result_file_id == file.id).values(result_file_id=None))
    session.delete(file)


def get_job(session: Session, job_id: str, tenant: str | None = None) -> Job | None:
    query = select(Job).where(Job.id == job_id)
    if tenant is not None:
        query = query.where(Job.tenant == tenant)
    return session.scalar(query)


def get_job_status(session: Session, job_id: str) -> str | None:
    return session.scalar(select(Job.status).where(Job.id == job_id))


def get_job_stop_state(session: Session, job_id: str) -> tuple[str | None, bool]:
    """The job's status and whether its worker asked for a hand-over: what a running trainer polls."""
    row = session.execute(select(Job.status, Job.handover_requested_at).where(Job.id == job_id)).one_or_none()
    return (None, False) if row is None else (row[0], row[1] is not None)


def request_handover(session: Session, job_id: str, worker: str) -> bool:
    """Asks the trainer of the running job that `worker` holds to hand it over; False if it holds none."""
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status == JobStatus.RUNNING, Job.worker == worker)
        .values(handover_requested_at=now_s())
    )
    return result.rowcount == 1


def has_fine_tuned_model(session: Session, model: str, tenant: str) -> bool:
    """Whether one of the tenant's succeeded jobs produced the model."""
    query = select(Job.id).where(
        Job.fine_tuned_model == model,
        Job.tenant == tenant,
        Job.status == JobStatus.SUCCEEDED,
        Job.model_deleted_at.is_(None),
    )
    return session.scalar(query) is not None


def job_of_fine_tuned_model(session: Session, model: str, tenant: str) -> Job | None:
    """The tenant's job named as the model's source, whatever its status."""
    return session.scalar(select(Job).where(Job.fine_tuned_model == model, Job.tenant == tenant))


def checkpoint_of_model(session: Session, model: str, tenant: str) -> Checkpoint | None:
    """The checkpoint holding the weights of one of the tenant's models: for a checkpoint's model name
    (`<fine-tuned model>:ckpt-step-<n>`, as the checkpoints list names it) that checkpoint of a succeeded job; for
    a fine-tuned model, its newest checkpoint; else None."""
    named = split_checkpoint_model_name(model)
    if named is not None:
        fine_tuned, step = named
        query = (
            select(Checkpoint)
            .join(Job)
            .where(Job.fine_tuned_model == fine_tuned, Job.tenant == tenant, Checkpoint.step == step)
            .where(Job.status == JobStatus.SUCCEEDED, Job.model_deleted_at.is_(None))
        )
        return session.scalar(query.limit(1))
    source = job_of_fine_tuned_model(session, model, tenant)
    if source is not None and source.model_deleted_at is not None:
        return None
    checkpoints = list_checkpoints(session, source.id) if source is not None else []
    return checkpoints[0] if checkpoints else None


def fine_tuned_models(session: Session, tenant: str) -> list[tuple[str, int | None]]:
    """The tenant's fine-tuned models, as (name, finished_at), oldest first."""
    query = (
        select(Job.fine_tuned_model, Job.finished_at)
        .where(Job.tenant == tenant, Job.status == JobStatus.SUCCEEDED, Job.fine_tuned_model.is_not(None))
        .where(Job.model_deleted_at.is_(None))
        .order_by(Job.finished_at)
    )
    return [(name, finished_at) for name, finished_at in session.execute(query)]


def unfinished_jobs_from_model(session: Session, model: str, tenant: str) -> list[str]:
    """Ids of the tenant's jobs not yet finished that train from the model or one of its checkpoints."""
    query = select(Job.id).where(
        Job.tenant == tenant,
        Job.status.not_in(JobStatus.FINISHED),
        (Job.model == model) | Job.model.startswith(f"{model}:ckpt-step-", autoescape=True),
    )
    return list(session.scalars(query))


def delete_fine_tuned_model(session: Session, job: Job) -> None:
    """Marks the job's model deleted and forgets its checkpoints; the caller deletes the stored run after its
    commit."""
    job.model_deleted_at = now_s()
    session.execute(delete(Checkpoint).where(Checkpoint.job_id == job.id))


def change_job_status(session: Session, job_id: str, allowed_from: tuple[str, ...], to: str) -> bool:
    """allowed_from -> to in one statement (a final status also sets finished_at), so a worker's concurrent
    change cannot be overwritten; False when the job is no longer in one of allowed_from."""
    values: dict[str, Any] = {"status": to}
    if to in JobStatus.FINISHED:
        values["finished_at"] = now_s()
    result = session.execute(
        update(Job).where(Job.id == job_id, Job.status.in_(allowed_from)).values(**values)
    )
    return result.rowcount == 1


def job_counts_by_status(session: Session) -> dict[str, int]:
    """Every tenant's jobs, counted by status; a status no job is in is absent."""
    return dict(session.execute(select(Job.status, func.count()).group_by(Job.status)).all())


def latest_metric_values_of_running_jobs(session: Session) -> dict[str, dict[str, Any]]:
    """Every tenant's running jobs: each one's newest metric values (the highest step), by job id; a job that
    has reported none is absent."""
    running = list(session.scalars(select(Job.id).where(Job.status == JobStatus.RUNNING)))
    latest: dict[str, dict[str, Any]] = {}
    for job_id in running:
        values = session.scalar(
            select(JobMetric.values)
            .where(JobMetric.job_id == job_id)
            .order_by(JobMetric.step.desc())
            .limit(1)
        )
        if values is not None:
            latest[job_id] = values
    return latest


def list_jobs(
    session: Session,
    tenant: str,
    *,
    after: str | None = None,
    limit: int = 20,
    metadata: dict[str, str] | None = None,
    status: str | None = None,
    model: str | None = None,
) -> tuple[list[Job], bool]:
    """Newest first, cursor after a job id, optionally only jobs in one status, of one model and whose metadata
    has every given pair."""
    query = select(Job).where(Job.tenant == tenant).order_by(Job.created_at.desc(), Job.id.desc())
    if status is not None:
        query = query.where(Job.status == status)
    if model is not None:
        query = query.where(Job.model == model)
    if after is not None:
        cursor = get_job(session, after, tenant)
        if cursor is not None:
            query = query.where(
                (Job.created_at < cursor.created_at)
                | ((Job.created_at == cursor.created_at) & (Job.id < cursor.id))
            )
    if not metadata:
        rows = list(session.scalars(query.limit(limit + 1)))
        return rows[:limit], len(rows) > limit
    # JSON containment differs between SQLite and PostgreSQL; one tenant's jobs are few enough to filter here.
    page: list[Job] = []
    for job in session.scalars(query):
        if all((job.user_metadata or {}).get(k) == v for k, v in metadata.items()):
            if len(page) == limit:
                return page, True
            page.append(job)
    return page, False


def claim_job(
    session: Session,
    job_id: str,
    worker: str,
    lease_s: int,
    *,
    max_running_jobs: int | None = None,
    max_gpus: int | None = None,
) -> bool:
    """queued -> running in one statement, so two workers given the same message cannot both win; the winner
    opens the job's next attempt. With limits, only while the job's tenant stays within them, checked in the
    same statement (and, on PostgreSQL, under a lock per tenant), so two workers cannot both take its last slot."""
    now = now_s()
    conditions = [Job.id == job_id, Job.status == JobStatus.QUEUED]
    if max_running_jobs is not None or max_gpus is not None:
        tenant = session.scalar(select(Job.tenant).where(Job.id == job_id))
        if session.get_bind().dialect.name == "postgresql":
            session.execute(select(func.pg_advisory_xact_lock(func.hashtext(tenant))))
        running = aliased(Job)
        of_tenant = (running.tenant == tenant, running.status == JobStatus.RUNNING)
        if max_running_jobs is not None:
            conditions.append(select(func.count()).where(*of_tenant).scalar_subquery() < max_running_jobs)
        if max_gpus is not None:
            used = select(func.coalesce(func.sum(running.n_gpus), 0)).where(*of_tenant).scalar_subquery()
            conditions.append(used + Job.n_gpus <= max_gpus)
    result = session.execute(
        update(Job)
        .where(*conditions)
        .values(status=JobStatus.RUNNING, started_at=now, worker=worker, attempts=Job.attempts + 1,
                lease_expires_at=now + lease_s, waiting_reason=None, handover_requested_at=None)
    )  # fmt: skip
    if result.rowcount != 1:
        return False
    number = session.scalar(select(Job.attempts).where(Job.id == job_id))
    session.add(JobAttempt(job_id=job_id, number=number, worker=worker, started_at=now))
    return True


def tenant_usage(session: Session, tenant: str) -> tuple[int, int]:
    """The tenant's running jobs and the GPUs they train on."""
    query = select(func.count(), func.coalesce(func.sum(Job.n_gpus), 0)).where(
        Job.tenant == tenant, Job.status == JobStatus.RUNNING
    )
    jobs, gpus = session.execute(query).one()
    return int(jobs), int(gpus)


def park_job(session: Session, job_id: str, reason: str) -> bool:
    """Records why the queued job waits; True when that is a new reason (worth an event), False when the job
    already waited for it or is no longer queued."""
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status == JobStatus.QUEUED)
        .where((Job.waiting_reason.is_(None)) | (Job.waiting_reason != reason))
        .values(waiting_reason=reason)
    )
    return result.rowcount == 1


def waiting_jobs(session: Session) -> list[Job]:
    """Queued jobs that wait for something (a worker, a larger one, their tenant's limit), oldest first."""
    query = select(Job).where(Job.status == JobStatus.QUEUED, Job.waiting_reason.is_not(None))
    return list(session.scalars(query.order_by(Job.created_at, Job.id)))


def record_worker(
    session: Session, name: str, gpus: int, serving_url: str | None = None, serving_token: str | None = None
) -> None:
    """A worker's start or heartbeat: its row, written anew."""
    now = now_s()
    worker = session.get(Worker, name)
    if worker is None:
        worker = Worker(name=name, started_at=now)
        session.add(worker)
    worker.gpus, worker.heartbeat_at = gpus, now
    worker.serving_url, worker.serving_token = serving_url, serving_token


def serving_workers(connection: Connection, alive_since: int) -> list[tuple[str, str, bool]]:
    """(serving URL, token, training now) of each worker up that serves chat completions: the idle ones first,
    then the most recently beating."""
    training = select(Job.id).where(Job.worker == Worker.name, Job.status == JobStatus.RUNNING).exists()
    query = (
        select(Worker.serving_url, Worker.serving_token, training)
        .where(Worker.heartbeat_at >= alive_since, Worker.serving_url.is_not(None))
        .order_by(training, Worker.heartbeat_at.desc())
    )
    return [(url, token, bool(busy)) for url, token, busy in connection.execute(query)]


def callable_fine_tuned_model(connection: Connection, model: str, tenant: str) -> bool:
    """Whether the model is one of the tenant's fine-tuned models, or a checkpoint of one
    (`<model>:ckpt-step-<n>`), that is not deleted: what its chat completions may call."""
    query = select(Job.id).where(
        Job.tenant == tenant, Job.status == JobStatus.SUCCEEDED, Job.model_deleted_at.is_(None)
    )
    named = split_checkpoint_model_name(model)
    if named is None:
        query = query.where(Job.fine_tuned_model == model)
    else:
        query = query.join(Checkpoint).where(Job.fine_tuned_model == named[0], Checkpoint.step == named[1])
    return connection.execute(query.limit(1)).first() is not None


def remove_worker(session: Session, name: str) -> None:
    session.execute(delete(Worker).where(Worker.name == name))


def largest_worker_gpus(session: Session, alive_since: int) -> int | None:
    """The most GPUs a worker that beat since `alive_since` has; None when no worker is up."""
    return session.scalar(select(func.max(Worker.gpus)).where(Worker.heartbeat_at >= alive_since))


def get_tenant_limit(session: Session, tenant: str) -> TenantLimit | None:
    return session.get(TenantLimit, tenant)


def set_tenant_limit(
    session: Session, tenant: str, max_running_jobs: int | None, max_gpus: int | None
) -> TenantLimit:
    row = session.get(TenantLimit, tenant)
    if row is None:
        row = TenantLimit(tenant=tenant)
        session.add(row)
    row.max_running_jobs, row.max_gpus = max_running_jobs, max_gpus
    return row


def delete_tenant_limit(session: Session, tenant: str) -> None:
    session.execute(delete(TenantLimit).where(TenantLimit.tenant == tenant))


def list_tenant_limits(session: Session) -> list[TenantLimit]:
    return list(session.scalars(select(TenantLimit).order_by(TenantLimit.tenant)))


def end_attempt(session: Session, job_id: str, number: int, cause: str) -> bool:
    """Closes the job's attempt `number` with how it ended; False if it was closed already (the reaper and the
    worker that held the job may both get there: the first one's cause stands)."""
    result = session.execute(
        update(JobAttempt)
        .where(JobAttempt.job_id == job_id, JobAttempt.number == number, JobAttempt.ended_at.is_(None))
        .values(ended_at=now_s(), cause=cause)
    )
    return result.rowcount == 1


def fault_count(session: Session, job_id: str) -> int:
    """The job's attempts that ended in a fault (a lost worker, a crash): what max_attempts bounds."""
    query = select(func.count()).where(JobAttempt.job_id == job_id, JobAttempt.cause.in_(AttemptEnd.FAULTS))
    return session.scalar(query) or 0


def attempts_of_jobs(session: Session, job_ids: list[str]) -> dict[str, list[JobAttempt]]:
    """Each job's attempts, oldest first (a job never started has none)."""
    found: dict[str, list[JobAttempt]] = {job_id: [] for job_id in job_ids}
    query = select(JobAttempt).where(JobAttempt.job_id.in_(job_ids)).order_by(JobAttempt.number)
    for attempt in session.scalars(query):
        found[attempt.job_id].append(attempt)
    return found


def set_job_resolved(session: Session, job_id: str, resolved: dict[str, Any]) -> None:
    """Records what the job's trainer resolved at its start (see Job.resolved)."""
    session.execute(update(Job).where(Job.id == job_id).values(resolved=resolved))


def renew_lease(session: Session, job_id: str, worker: str, lease_s: int) -> bool:
    """Extends the lease of a job this worker is training; False if the job is no longer this worker's."""
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.worker == worker, Job.status == JobStatus.RUNNING)
        .values(lease_expires_at=now_s() + lease_s)
    )
    return result.rowcount == 1


def lapsed_jobs(session: Session) -> list[Job]:
    """Running jobs whose worker stopped renewing the lease: it died, or lost the database."""
    query = select(Job).where(Job.status == JobStatus.RUNNING, Job.lease_expires_at < now_s())
    return list(session.scalars(query))


def requeue_job(
    session: Session, job_id: str, from_status: str = JobStatus.RUNNING, worker: str | None = None
) -> bool:
    """Back to queued, for another attempt. With `worker`, only if that worker still holds the job."""
    query = update(Job).where(Job.id == job_id, Job.status == from_status)
    if worker is not None:
        query = query.where(Job.worker == worker)
    result = session.execute(query.values(status=JobStatus.QUEUED, worker=None, lease_expires_at=None))
    return result.rowcount == 1


def finish_job(session: Session, job_id: str, status: str, **fields: Any) -> bool:
    """running -> a final status; does nothing if the job already left running (e.g. it was cancelled)."""
    return finish_job_from(session, job_id, JobStatus.RUNNING, status, **fields)


def add_event(
    session: Session,
    job_id: str,
    message: str,
    *,
    level: str = "info",
    type: str = "message",
    data: dict[str, Any] | None = None,
) -> JobEvent:
    event = JobEvent(job_id=job_id, message=message, level=level, type=type, data=data)
    session.add(event)
    return event


def add_metric(
    session: Session,
    job_id: str,
    step: int,
    values: dict[str, Any],
    rank_memory: list[dict[str, Any]] | None = None,
) -> JobMetric:
    """One row per (job, step); a step reported again (a resumed run) replaces the earlier values."""
    metric = session.scalar(select(JobMetric).where(JobMetric.job_id == job_id, JobMetric.step == step))
    if metric is None:
        metric = JobMetric(job_id=job_id, step=step)
        session.add(metric)
    # JSON has no NaN or infinity (PostgreSQL refuses them, and the metrics route sends the stored text as is).
    values = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in values.items()}
    metric.train_loss = values.get("train_loss")
    metric.values = values
    metric.rank_memory = rank_memory
    metric.created_at = now_s()
    # Clients of the OpenAI API read training progress from "metrics" events; they mirror the metric row.
    data = {"step": step, **{k: v for k, v in values.items() if isinstance(v, int | float)}}
    if "peak_memory_allocated_bytes" in values:
        data["peak_memory_bytes"] = values["peak_memory_allocated_bytes"]
    loss = values.get("train_loss")
    message = f"Step {step}: training loss={loss:.4f}" if isinstance(loss, int | float) else f"Step {step}"
    add_event(session, job_id, message, type="metrics", data=data)
    return metric


def set_job_progress(
    session: Session, job_id: str, trained_tokens: int | None, estimated_finish: int | None
) -> None:
    """A running job's tokens trained so far and when it should end (its trainer's step times)."""
    session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status == JobStatus.RUNNING)
        .values(trained_tokens=trained_tokens, estimated_finish=estimated_finish)
    )


def mark_best_checkpoint(session: Session, job_id: str, storage_path: str) -> None:
    """The job's checkpoint at `storage_path` is its best; no other is."""
    session.execute(
        update(Checkpoint)
        .where(Checkpoint.job_id == job_id)
        .values(best=Checkpoint.storage_path == storage_path)
    )


def metric_rows(session: Session, job_id: str) -> list[tuple[int, dict[str, Any]]]:
    """Every step of the job with its values, oldest first (the results file)."""
    query = (
        select(JobMetric.step, JobMetric.values).where(JobMetric.job_id == job_id).order_by(JobMetric.step)
    )
    return [(step, values or {}) for step, values in session.execute(query)]


def add_result_file(session: Session, job_id: str, file: File) -> None:
    """Records the job's results file (added with the same transaction)."""
    session.add(file)
    session.flush()
    session.execute(update(Job).where(Job.id == job_id).values(result_file_id=file.id))


def add_checkpoint(
    session: Session, job_id: str, step: int, path: str, metrics: dict[str, Any]
) -> Checkpoint:
    checkpoint = Checkpoint(job_id=job_id, step=step, storage_path=path, metrics=dict(metrics))
    session.add(checkpoint)
    return checkpoint


def list_checkpoints(session: Session, job_id: str) -> list[Checkpoint]:
    query = select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step.desc())
    return list(session.scalars(query))


def page_checkpoints(
    session: Session, job_id: str, *, after: Checkpoint | None = None, limit: int
) -> tuple[list[Checkpoint], bool]:
    """The job's checkpoints newest first (by step), after the checkpoint ``after``; (page, has_more)."""
    query = (
        select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step.desc(), Checkpoint.id)
    )
    if after is not None:
        query = query.where(
            (Checkpoint.step < after.step) | ((Checkpoint.step == after.step) & (Checkpoint.id > after.id))
        )
    rows = list(session.scalars(query.limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def get_checkpoint(session: Session, checkpoint_id: str, tenant: str) -> Checkpoint | None:
    query = select(Checkpoint).join(Job).where(Checkpoint.id == checkpoint_id, Job.tenant == tenant)
    return session.scalar(query)


def finish_job_from(session: Session, job_id: str, from_status: str, status: str, **fields: Any) -> bool:
    """from_status -> a final status, only if the job is still in from_status."""
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status == from_status)
        .values(status=status, finished_at=now_s(), **fields)
    )
    return result.rowcount == 1


def hash_api_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_api_key(session: Session, tenant: str, name: str = "") -> tuple[ApiKey, str]:
    """Returns the row and the plaintext key, which is not stored and cannot be shown again."""
    plaintext = f"sk-ft-{secrets.token_urlsafe(32)}"
    row = ApiKey(tenant=tenant, name=name, key_hash=hash_api_key(plaintext))
    session.add(row)
    return row, plaintext


def tenant_for_api_key(connection: Connection | Session, key: str) -> str | None:
    return connection.scalar(_TENANT_OF_KEY, {"key_hash": hash_api_key(key)})


def revoke_api_key(session: Session, key_id: str) -> bool:
    result = session.execute(
        update(ApiKey).where(ApiKey.id == key_id, ApiKey.revoked_at.is_(None)).values(revoked_at=now_s())
    )
    return result.rowcount == 1


def list_api_keys(session: Session) -> list[ApiKey]:
    return list(session.scalars(select(ApiKey).order_by(ApiKey.created_at)))


def find_idempotent_request(session: Session, tenant: str, route: str, key: str) -> IdempotentRequest | None:
    return session.scalar(
        select(IdempotentRequest).where(
            IdempotentRequest.tenant == tenant, IdempotentRequest.route == route, IdempotentRequest.key == key
        )
    )


def median_tokens_per_second(session: Session, model: str, recent_jobs: int = 5) -> float | None:
    """This server's measured training throughput for a model: the median over its recent finished jobs."""
    job_ids = list(session.scalars(
        select(Job.id).where(Job.model == model, Job.status == JobStatus.SUCCEEDED)
        .order_by(Job.finished_at.desc()).limit(recent_jobs)
    ))  # fmt: skip
    if not job_ids:
        return None
    values = sorted(
        float(v["tokens_per_second"])
        for v in session.scalars(select(JobMetric.values).where(JobMetric.job_id.in_(job_ids)))
        if isinstance(v, dict) and v.get("tokens_per_second")
    )
    return values[len(values) // 2] if values else None


def delete_checkpoints(session: Session, job_id: str, storage_paths: list[str]) -> int:
    """Forgets checkpoints whose folders were pruned (keep-last-K), so none is listed or served again."""
    if not storage_paths:
        return 0
    rows = session.scalars(
        select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.storage_path.in_(storage_paths))
    )
    count = 0
    for row in rows:
        session.delete(row)
        count += 1
    return count


def stop_unstarted_jobs(session: Session, tenant: str) -> int:
    """Cancels the tenant's jobs that no worker holds (queued, validating), so none starts from here on: a
    worker claims only a queued job, in one statement (claim_job)."""
    result = session.execute(
        update(Job)
        .where(Job.tenant == tenant, Job.status.in_((JobStatus.QUEUED, JobStatus.VALIDATING_FILES)))
        .values(status=JobStatus.CANCELLED, finished_at=now_s())
    )
    return result.rowcount


def running_job_ids(session: Session, tenant: str) -> list[str]:
    return list(session.scalars(select(Job.id).where(Job.tenant == tenant, Job.status == JobStatus.RUNNING)))


@dataclass(frozen=True)
class TenantRows:
    """What delete_tenant_rows removed, with what the caller needs to delete the stored files afterwards."""

    file_storage_names: list[str]
    job_ids: list[str]
    checkpoint_storage_paths: list[str]
    api_keys: int


def delete_tenant_rows(session: Session, tenant: str) -> TenantRows:
    """Every row of the tenant: files, jobs with their events, metrics and checkpoints, idempotency records and
    API keys."""
    job_ids = list(session.scalars(select(Job.id).where(Job.tenant == tenant)))
    checkpoint_paths = list(
        session.scalars(select(Checkpoint.storage_path).where(Checkpoint.job_id.in_(job_ids)))
    )
    file_names = list(session.scalars(select(File.storage_name).where(File.tenant == tenant)))
    for model in (JobMetric, JobEvent, Checkpoint, JobAttempt):
        session.execute(delete(model).where(model.job_id.in_(job_ids)))
    session.execute(delete(Job).where(Job.tenant == tenant))
    session.execute(delete(File).where(File.tenant == tenant))
    session.execute(delete(IdempotentRequest).where(IdempotentRequest.tenant == tenant))
    keys = session.execute(delete(ApiKey).where(ApiKey.tenant == tenant)).rowcount
    return TenantRows(file_names, job_ids, checkpoint_paths, keys)


# ---- Reads the polled routes make on every request -------------------------------------------------------------
# Clients poll a training job's status, events and metrics many times a second between them, and these reads were
# most of the API's CPU time. So they are built once, with bind parameters (executing a prebuilt statement reuses
# its memoized cache key and compiled SQL, where building one per request repeated that work), run on a bare
# connection rather than a Session, and return Core rows (attributes named as the columns), not ORM objects.

_TENANT_OF_KEY = select(ApiKey.tenant).where(
    ApiKey.key_hash == bindparam("key_hash"), ApiKey.revoked_at.is_(None)
)
_JOB_OF_TENANT = select(*Job.__table__.c).where(
    Job.id == bindparam("job_id"), Job.tenant == bindparam("tenant")
)
_JOB_ID_OF_TENANT = select(Job.id).where(Job.id == bindparam("job_id"), Job.tenant == bindparam("tenant"))
# ``data_json`` (like ``values_json`` below): the stored JSON text, which the routes pass through undecoded.
_EVENTS = select(
    JobEvent.id,
    JobEvent.created_at,
    JobEvent.level,
    JobEvent.message,
    JobEvent.type,
    cast(JobEvent.data, Text).label("data_json"),
).where(JobEvent.job_id == bindparam("job_id"))
_EVENTS_NEWEST = _EVENTS.order_by(JobEvent.seq.desc()).limit(bindparam("limit"))
_EVENTS_BEFORE = (
    _EVENTS.where(JobEvent.seq < bindparam("before_seq"))
    .order_by(JobEvent.seq.desc())
    .limit(bindparam("limit"))
)
# The same, of one event type only (the dashboard's event log leaves out the per-step "metrics" events).
_EVENTS_OF_TYPE = _EVENTS.where(JobEvent.type == bindparam("type"))
_EVENTS_OF_TYPE_NEWEST = _EVENTS_OF_TYPE.order_by(JobEvent.seq.desc()).limit(bindparam("limit"))
_EVENTS_OF_TYPE_BEFORE = (
    _EVENTS_OF_TYPE.where(JobEvent.seq < bindparam("before_seq"))
    .order_by(JobEvent.seq.desc())
    .limit(bindparam("limit"))
)
_ATTEMPTS = (
    select(JobAttempt.number, JobAttempt.started_at, JobAttempt.ended_at, JobAttempt.cause)
    .where(JobAttempt.job_id == bindparam("job_id"))
    .order_by(JobAttempt.number)
)
_EVENT_SEQ = select(JobEvent.seq).where(
    JobEvent.id == bindparam("event_id"), JobEvent.job_id == bindparam("job_id")
)
_METRICS = (
    select(
        JobMetric.step,
        JobMetric.created_at,
        JobMetric.train_loss,
        cast(JobMetric.values, Text).label("values_json"),
        cast(JobMetric.rank_memory, Text).label("rank_memory_json"),
    )
    .where(JobMetric.job_id == bindparam("job_id"), JobMetric.step.between(bindparam("lo"), bindparam("hi")))
    .order_by(JobMetric.step)
    .limit(bindparam("limit"))
)
# Steps are 32-bit INTEGER columns: the widest range a step filter can ask for.
MAX_STEP = 2**31 - 1


def job_row(connection: Connection | Session, job_id: str, tenant: str) -> Row | None:
    """The tenant's job as a row (the columns of ``jobs``), or None."""
    return connection.execute(_JOB_OF_TENANT, {"job_id": job_id, "tenant": tenant}).first()


def job_attempts(connection: Connection | Session, job_id: str) -> list[Row]:
    """The job's attempts as rows (number, started_at, ended_at, cause), oldest first."""
    return connection.execute(_ATTEMPTS, {"job_id": job_id}).all()


def is_tenants_job(connection: Connection | Session, job_id: str, tenant: str) -> bool:
    """Whether the job exists and is the tenant's (the events and metrics routes need no more of it)."""
    return connection.scalar(_JOB_ID_OF_TENANT, {"job_id": job_id, "tenant": tenant}) is not None


def list_events(
    connection: Connection | Session,
    job_id: str,
    *,
    after: str | None = None,
    limit: int = 20,
    type: str | None = None,
) -> tuple[list[Row], bool]:
    """Newest first, after the event ``after`` when it is one of the job's (else from the newest), only of
    ``type`` when given, as rows (id, created_at, level, message, type, data_json); (page, has_more)."""
    params = {"job_id": job_id, "limit": limit + 1}
    newest, before = _EVENTS_NEWEST, _EVENTS_BEFORE
    if type is not None:
        params["type"] = type
        newest, before = _EVENTS_OF_TYPE_NEWEST, _EVENTS_OF_TYPE_BEFORE
    cursor_seq = None
    if after is not None:
        cursor_seq = connection.scalar(_EVENT_SEQ, {"event_id": after, "job_id": job_id})
    if cursor_seq is None:
        rows = connection.execute(newest, params).all()
    else:
        rows = connection.execute(before, {**params, "before_seq": cursor_seq}).all()
    return rows[:limit], len(rows) > limit


def list_metrics(
    connection: Connection | Session,
    job_id: str,
    *,
    min_step: int | None = None,
    max_step: int | None = None,
    limit: int = 1000,
) -> tuple[list[Row], bool]:
    """Oldest step first within [min_step, max_step], as rows (step, created_at, train_loss, values_json,
    rank_memory_json);
    (page, has_more). The next page starts at the last step + 1."""
    params = {"job_id": job_id, "lo": min_step or 0, "hi": MAX_STEP if max_step is None else max_step,
              "limit": limit + 1}  # fmt: skip
    rows = connection.execute(_METRICS, params).all()
    return rows[:limit], len(rows) > limit


# ---- evals (OpenAI's Evals API) ----------------------------------------------------------------------------------


def _page_by_creation(session: Session, query, model, after, limit: int, order: str) -> tuple[list, bool]:
    """A page of `query`'s rows of `model` by creation time ("asc" or "desc", ties by id), after the row `after`."""
    if order == "desc":
        query = query.order_by(model.created_at.desc(), model.id.desc())
        if after is not None:
            query = query.where(
                (model.created_at < after.created_at)
                | ((model.created_at == after.created_at) & (model.id < after.id))
            )
    else:
        query = query.order_by(model.created_at, model.id)
        if after is not None:
            query = query.where(
                (model.created_at > after.created_at)
                | ((model.created_at == after.created_at) & (model.id > after.id))
            )
    rows = list(session.scalars(query.limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def get_eval(session: Session, eval_id: str, tenant: str) -> Eval | None:
    return session.scalar(select(Eval).where(Eval.id == eval_id, Eval.tenant == tenant))


def page_evals(
    session: Session, tenant: str, *, after: Eval | None, limit: int, order: str
) -> tuple[list[Eval], bool]:
    return _page_by_creation(session, select(Eval).where(Eval.tenant == tenant), Eval, after, limit, order)


def delete_eval(session: Session, evaluation: Eval) -> None:
    """The eval, its runs and their output items (deleted here, not left to the database's cascade, which
    SQLite applies only with its foreign keys on)."""
    run_ids = select(EvalRun.id).where(EvalRun.eval_id == evaluation.id)
    session.execute(delete(EvalRunOutputItem).where(EvalRunOutputItem.run_id.in_(run_ids)))
    session.execute(delete(EvalRun).where(EvalRun.eval_id == evaluation.id))
    session.delete(evaluation)


def get_eval_run(session: Session, run_id: str, tenant: str, eval_id: str | None = None) -> EvalRun | None:
    query = select(EvalRun).where(EvalRun.id == run_id, EvalRun.tenant == tenant)
    if eval_id is not None:
        query = query.where(EvalRun.eval_id == eval_id)
    return session.scalar(query)


def page_eval_runs(
    session: Session, eval_id: str, *, status: str | None, after: EvalRun | None, limit: int, order: str
) -> tuple[list[EvalRun], bool]:
    query = select(EvalRun).where(EvalRun.eval_id == eval_id)
    if status:
        query = query.where(EvalRun.status == status)
    return _page_by_creation(session, query, EvalRun, after, limit, order)


def eval_runs_of_model(session: Session, model: str, tenant: str, limit: int = 20) -> list[EvalRun]:
    """The tenant's newest runs that sampled `model` (the dashboard shows them beside the job that made it)."""
    query = (
        select(EvalRun)
        .where(EvalRun.model == model, EvalRun.tenant == tenant)
        .order_by(EvalRun.created_at.desc(), EvalRun.id.desc())
        .limit(limit)
    )
    return list(session.scalars(query))


def claim_eval_run(session: Session, run_id: str, worker: str) -> EvalRun | None:
    """The run, now in_progress on `worker` (one more attempt), if it was queued; None for a redelivered or
    canceled run."""
    claimed = session.execute(
        update(EvalRun)
        .where(EvalRun.id == run_id, EvalRun.status == "queued")
        .values(status="in_progress", worker=worker, attempts=EvalRun.attempts + 1, started_at=now_s())
    ).rowcount
    return session.get(EvalRun, run_id) if claimed else None


def finish_eval_run(
    session: Session, run_id: str, status: str, worker: str | None = None, **fields: Any
) -> bool:
    """Ends an in_progress run (not one canceled meanwhile) with `status` and `fields`; with `worker`, only while
    that worker holds it (not one the reaper gave to another after this worker was taken for lost)."""
    query = update(EvalRun).where(EvalRun.id == run_id, EvalRun.status == "in_progress")
    if worker is not None:
        query = query.where(EvalRun.worker == worker)
    return bool(session.execute(query.values(status=status, finished_at=now_s(), **fields)).rowcount)


def eval_run_held_by(session: Session, run_id: str, worker: str) -> bool:
    """Whether the run is in progress on `worker` (not canceled, deleted, or requeued since it claimed it)."""
    query = select(EvalRun.id).where(
        EvalRun.id == run_id, EvalRun.status == "in_progress", EvalRun.worker == worker
    )
    return session.scalar(query) is not None


def lost_eval_runs(session: Session, alive_since: int) -> list[EvalRun]:
    """In-progress runs whose worker has not beaten since `alive_since` (it died, froze, or lost the database;
    a worker's row goes when it stops). A run claimed since then is left alone: its worker may not have
    written its first heartbeat yet."""
    beating = select(Worker.name).where(Worker.name == EvalRun.worker, Worker.heartbeat_at >= alive_since)
    query = select(EvalRun).where(
        EvalRun.status == "in_progress", EvalRun.started_at < alive_since, ~beating.exists()
    )
    return list(session.scalars(query))


def requeue_eval_run(session: Session, run_id: str, worker: str | None) -> bool:
    """Back to queued for another attempt, if `worker` still holds it; the output items a lost attempt wrote
    (before it could record the run's end) go, so that the next attempt writes them once."""
    query = update(EvalRun).where(
        EvalRun.id == run_id, EvalRun.status == "in_progress", EvalRun.worker == worker
    )
    if not session.execute(query.values(status="queued", worker=None, started_at=None)).rowcount:
        return False
    session.execute(delete(EvalRunOutputItem).where(EvalRunOutputItem.run_id == run_id))
    return True


def cancel_eval_run(session: Session, run: EvalRun) -> bool:
    return bool(
        session.execute(
            update(EvalRun)
            .where(EvalRun.id == run.id, EvalRun.status.in_(("queued", "in_progress")))
            .values(status="canceled", finished_at=now_s())
        ).rowcount
    )


def eval_run_status(session: Session, run_id: str) -> str | None:
    return session.scalar(select(EvalRun.status).where(EvalRun.id == run_id))


def delete_eval_run(session: Session, run: EvalRun) -> None:
    session.execute(delete(EvalRunOutputItem).where(EvalRunOutputItem.run_id == run.id))
    session.delete(run)


def get_output_item(session: Session, run_id: str, item_id: str) -> EvalRunOutputItem | None:
    return session.scalar(
        select(EvalRunOutputItem).where(EvalRunOutputItem.run_id == run_id, EvalRunOutputItem.id == item_id)
    )


def page_output_items(
    session: Session,
    run_id: str,
    *,
    status: str | None,
    after: EvalRunOutputItem | None,
    limit: int,
    order: str,
) -> tuple[list[EvalRunOutputItem], bool]:
    """A run's output items by their item's position in the data source ("asc") or from the last ("desc")."""
    query = select(EvalRunOutputItem).where(EvalRunOutputItem.run_id == run_id)
    if status:
        query = query.where(EvalRunOutputItem.status == status)
    position = EvalRunOutputItem.datasource_item_id
    if order == "desc":
        query = query.order_by(position.desc())
        if after is not None:
            query = query.where(position < after.datasource_item_id)
    else:
        query = query.order_by(position)
        if after is not None:
            query = query.where(position > after.datasource_item_id)
    rows = list(session.scalars(query.limit(limit + 1)))
    return rows[:limit], len(rows) > limit
