"""ORM models: the state of the service. The schema itself is created only by Alembic migrations."""

from __future__ import annotations

import secrets
import time
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

DEFAULT_TENANT = "default"


def now_s() -> int:
    return int(time.time())


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


# Alike in shape to spec/evals.RunStatus on purpose: OpenAI's eval runs have their own vocabulary ("canceled",
# "in_progress"), so each API's statuses stay a class of their own.
class JobStatus:
    """The job statuses of the OpenAI fine-tuning API, plus ``paused``."""

    VALIDATING_FILES = "validating_files"
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    PAUSED = "paused"
    FINISHED = frozenset({SUCCEEDED, FAILED, CANCELLED})


class File(Base):
    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(64), primary_key=True, default=lambda: new_id("file-"))
    tenant: Mapped[str] = mapped_column(String(64), default=DEFAULT_TENANT, index=True)
    filename: Mapped[str] = mapped_column(String(255))
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int] = mapped_column(BigInteger)
    # Relative to Settings.files_dir, never a user-chosen path.
    storage_name: Mapped[str] = mapped_column(String(255))
    example_count: Mapped[int] = mapped_column(Integer, default=0)
    token_estimate: Mapped[int] = mapped_column(BigInteger, default=0)
    # The training method whose line format the file is in (fusetune.worker.train.methods).
    method: Mapped[str] = mapped_column(String(32), default="supervised", server_default="supervised")
    created_at: Mapped[int] = mapped_column(BigInteger, default=now_s)


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(64), primary_key=True, default=lambda: new_id("ftjob-"))
    tenant: Mapped[str] = mapped_column(String(64), default=DEFAULT_TENANT, index=True)
    model: Mapped[str] = mapped_column(String(255))
    training_file_id: Mapped[str] = mapped_column(ForeignKey("files.id"))
    validation_file_id: Mapped[str | None] = mapped_column(ForeignKey("files.id"), nullable=True)
    status: Mapped[str] = mapped_column(String(32), default=JobStatus.QUEUED, index=True)
    hyperparameters: Mapped[dict[str, Any]] = mapped_column(default=dict)
    seed: Mapped[int] = mapped_column(Integer, default=0)
    suffix: Mapped[str | None] = mapped_column(String(64), nullable=True)
    user_metadata: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now_s)
    started_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    finished_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    fine_tuned_model: Mapped[str | None] = mapped_column(String(255), nullable=True)
    trained_tokens: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # Which worker holds the job and how often it was started (each start is a JobAttempt row): crash recovery
    # and the "no two copies" rule.
    worker: Mapped[str | None] = mapped_column(String(255), nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # The worker renews this while it trains the job; a lapsed lease means the worker died (see the reaper).
    lease_expires_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # What the latest start ran with, as its trainer resolved it (the `started` event's precision, kernels,
    # micro-batch, distribution; fusetune.worker.train.metrics.RESOLVED_KEYS); None until a trainer started.
    resolved: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # The processes (GPUs) the job trains on, as its hyperparameters say: what capacity and quotas count.
    n_gpus: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    # Why a queued job is not training yet (no worker, none large enough, its tenant's limit); None otherwise.
    # A job parked for its tenant's limit or a worker's size has no message in the queue: a worker sends one
    # when the job can start (fusetune.worker.capacity).
    waiting_reason: Mapped[str | None] = mapped_column(String(255), nullable=True)
    # The job's `integrations` as it asked for them (fusetune/spec/integrations.py).
    integrations: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)
    # The results file (a File of purpose fine-tune-results: its per-step CSV), written when the job succeeds.
    result_file_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # When a running job should end, from its trainer's measured step time (updated with every step).
    estimated_finish: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # When the owner deleted the job's fine-tuned model (DELETE /v1/models/{model}): from then on the model is
    # neither listed nor usable, and its checkpoints are gone; the job keeps its record and fine_tuned_model.
    model_deleted_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # When the worker that holds the running job, being stopped, asked its trainer to hand the job over (save a
    # checkpoint, then exit; the job goes back to the queue). In the row, as a pause is, so that the trainer's
    # rank 0 reads it on whichever node it runs; cleared when a worker claims the job again.
    handover_requested_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)

    events: Mapped[list[JobEvent]] = relationship(back_populates="job", cascade="all, delete-orphan")
    checkpoints: Mapped[list[Checkpoint]] = relationship(back_populates="job", cascade="all, delete-orphan")


class AttemptEnd:
    """How an attempt ended (``JobAttempt.cause``). Only faults count against ``Settings.max_attempts``: a pause,
    a cancel, or a worker that stopped and handed its job back (``handed_over``) use up nothing."""

    SUCCEEDED = JobStatus.SUCCEEDED
    FAILED = JobStatus.FAILED
    CANCELLED = JobStatus.CANCELLED
    PAUSED = JobStatus.PAUSED
    HANDED_OVER = "handed_over"
    WORKER_LOST = "worker_lost"  # its worker stopped renewing the lease: killed, frozen, cut off
    CRASHED = "crashed"  # the training processes died without a diagnosis
    FAULTS = frozenset({WORKER_LOST, CRASHED})


class JobAttempt(Base):
    """One start of a job by a worker, from its claim to how it ended (``cause``, None while it runs)."""

    __tablename__ = "job_attempts"
    __table_args__ = (UniqueConstraint("job_id", "number", name="uq_job_attempts_job_number"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    number: Mapped[int] = mapped_column(Integer)  # 1, 2, ...: the job's `attempts` when it was claimed
    worker: Mapped[str] = mapped_column(String(255))
    started_at: Mapped[int] = mapped_column(BigInteger, default=now_s)
    ended_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    cause: Mapped[str | None] = mapped_column(String(32), nullable=True)


class JobEvent(Base):
    __tablename__ = "job_events"
    __table_args__ = (Index("ix_job_events_job_seq", "job_id", "seq"),)

    # A monotonic sequence orders events that share a created_at second.
    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True, default=lambda: new_id("ftevent-"))
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    created_at: Mapped[int] = mapped_column(BigInteger, default=now_s)
    level: Mapped[str] = mapped_column(String(16), default="info")
    type: Mapped[str] = mapped_column(String(16), default="message")
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)

    job: Mapped[Job] = relationship(back_populates="events")


class JobMetric(Base):
    __tablename__ = "job_metrics"
    __table_args__ = (UniqueConstraint("job_id", "step", name="uq_job_metrics_job_step"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now_s)
    train_loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    # Everything else the trainer reports (learning rate, tokens/s, memory, MFU, ...), by name.
    values: Mapped[dict[str, Any]] = mapped_column(default=dict)
    # Each rank's memory peaks of the step, with its node and host; values holds their maximum. None: a step
    # reported before they were kept.
    rank_memory: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)


class Checkpoint(Base):
    __tablename__ = "checkpoints"

    id: Mapped[str] = mapped_column(String(64), primary_key=True, default=lambda: new_id("ftckpt_"))
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    # Relative to Settings.runs_dir.
    storage_path: Mapped[str] = mapped_column(String(1024))
    metrics: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now_s)
    # The checkpoint of the best evaluation of a job that stopped early (its fine-tuned model).
    best: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())

    job: Mapped[Job] = relationship(back_populates="checkpoints")


class Worker(Base):
    """A worker that is up: written when it starts and on every reaper pass (its heartbeat), deleted when it
    stops. What it advertises decides which jobs it takes and which the API accepts."""

    __tablename__ = "workers"

    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    # GPUs, or CPU cores on a host without one (training processes it can run at once).
    gpus: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[int] = mapped_column(BigInteger, default=now_s)
    heartbeat_at: Mapped[int] = mapped_column(BigInteger, default=now_s)
    # Its chat completions server (fusetune.serving), which the API forwards requests to with this Bearer token;
    # None: the worker serves no chat completions.
    serving_url: Mapped[str | None] = mapped_column(String(255), nullable=True)
    serving_token: Mapped[str | None] = mapped_column(String(64), nullable=True)


class TenantLimit(Base):
    """The operator's limits for one tenant (`fusetune tenants limit`); None: the settings' default."""

    __tablename__ = "tenant_limits"

    tenant: Mapped[str] = mapped_column(String(64), primary_key=True)
    max_running_jobs: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_gpus: Mapped[int | None] = mapped_column(Integer, nullable=True)


class ApiKey(Base):
    """A Bearer key of one tenant. Only a SHA-256 of the key is stored; the key is shown once, at creation."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(64), primary_key=True, default=lambda: new_id("key-"))
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    name: Mapped[str] = mapped_column(String(128), default="")
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now_s)
    revoked_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class IdempotentRequest(Base):
    """The response to a POST sent with an Idempotency-Key, replayed when the same key and body come again."""

    __tablename__ = "idempotent_requests"
    __table_args__ = (
        UniqueConstraint("tenant", "route", "key", name="uq_idempotent_requests_tenant_route_key"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant: Mapped[str] = mapped_column(String(64))
    route: Mapped[str] = mapped_column(String(64))
    key: Mapped[str] = mapped_column(String(255))
    request_hash: Mapped[str] = mapped_column(String(64))
    object_id: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[int] = mapped_column(BigInteger, default=now_s)


class Eval(Base):
    """An eval (OpenAI's Evals API): the item schema and the testing criteria, as the request gave them."""

    __tablename__ = "evals"

    id: Mapped[str] = mapped_column(String(64), primary_key=True, default=lambda: new_id("eval_"))
    tenant: Mapped[str] = mapped_column(String(64), default=DEFAULT_TENANT, index=True)
    name: Mapped[str] = mapped_column(String(256), default="")
    # The `custom` data source config as created (fusetune.spec.evals.CustomDataSourceConfig).
    data_source_config: Mapped[dict[str, Any]] = mapped_column(default=dict)
    testing_criteria: Mapped[list[Any]] = mapped_column(default=list)
    user_metadata: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now_s)


class EvalRun(Base):
    """One run of an eval: a model sampled over a data source, each sample graded by every criterion. A worker
    runs it (fusetune.worker.evals) and writes the counts when it ends."""

    __tablename__ = "eval_runs"

    id: Mapped[str] = mapped_column(String(64), primary_key=True, default=lambda: new_id("evalrun_"))
    eval_id: Mapped[str] = mapped_column(ForeignKey("evals.id", ondelete="CASCADE"), index=True)
    tenant: Mapped[str] = mapped_column(String(64), default=DEFAULT_TENANT, index=True)
    name: Mapped[str] = mapped_column(String(256), default="")
    model: Mapped[str] = mapped_column(String(255), index=True)
    status: Mapped[str] = mapped_column(String(32), default="queued")
    # The `completions` data source as requested (fusetune.spec.evals.CompletionsDataSource).
    data_source: Mapped[dict[str, Any]] = mapped_column(default=dict)
    user_metadata: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # total, passed, failed, errored; and [{testing_criteria, passed, failed}]: written when the run ends.
    result_counts: Mapped[dict[str, Any]] = mapped_column(default=dict)
    per_testing_criteria_results: Mapped[list[Any]] = mapped_column(default=list)
    per_model_usage: Mapped[list[Any]] = mapped_column(default=list)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    worker: Mapped[str | None] = mapped_column(String(255), nullable=True)
    # Claims so far, and when the last one was made: a run whose worker stopped beating is requeued until
    # max_attempts claims, then failed (fusetune.worker.evals.reap_lost_eval_runs), as a job is.
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    started_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now_s)
    finished_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class EvalRunOutputItem(Base):
    """One item of a run: the item, the sample the model gave, and each criterion's result."""

    __tablename__ = "eval_run_output_items"
    __table_args__ = (Index("ix_eval_run_output_items_run_item", "run_id", "datasource_item_id"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True, default=lambda: new_id("outputitem_"))
    run_id: Mapped[str] = mapped_column(ForeignKey("eval_runs.id", ondelete="CASCADE"))
    datasource_item_id: Mapped[int] = mapped_column(Integer)
    datasource_item: Mapped[dict[str, Any]] = mapped_column(default=dict)
    # "pass" when every criterion passed, "fail" otherwise, "error" when sampling or grading failed.
    status: Mapped[str] = mapped_column(String(16))
    sample: Mapped[dict[str, Any]] = mapped_column(default=dict)
    results: Mapped[list[Any]] = mapped_column(default=list)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now_s)
