"""A fine-tuning job as the API shows it: the OpenAI job object, plus what fusetune adds (attempts, what ran)."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Row

from fusetune.api.schemas import JobAttemptObject, JobError, JobObject
from fusetune.db.models import AttemptEnd, Job, JobStatus, now_s
from fusetune.spec.methods import method_in_request_shape


def to_schema(job: Job | Row, attempts: Sequence = ()) -> JobObject:
    """The API object of a job, from its ORM object or its row (same attribute names), with its attempts (ORM
    objects or rows of job_attempts)."""
    hyper = dict(job.hyperparameters)
    resolved = job.resolved
    if resolved:
        # What ran, once a trainer started: "auto" made concrete, kernels a CPU run could not apply turned off,
        # every part of the memory plan decided.
        hyper.update({key: resolved[key] for key in ("precision", "kernels") if key in resolved})
        hyper.update(resolved.get("memory_plan") or {})
    method = hyper.pop("method", None)
    shared = {k: hyper[k] for k in ("n_epochs", "batch_size", "learning_rate_multiplier") if k in hyper}
    return JobObject(
        id=job.id,
        created_at=job.created_at,
        error=JobError(**job.error) if job.error else None,
        fine_tuned_model=job.fine_tuned_model,
        finished_at=job.finished_at,
        started_at=job.started_at,
        hyperparameters=hyper,
        method=method_in_request_shape(method, shared),
        model=job.model,
        organization_id=job.tenant,
        result_files=[job.result_file_id] if job.result_file_id else [],
        seed=job.seed,
        status=job.status,
        trained_tokens=job.trained_tokens,
        estimated_finish=job.estimated_finish if job.status == JobStatus.RUNNING else None,
        integrations=job.integrations,
        training_file=job.training_file_id,
        validation_file=job.validation_file_id,
        metadata=job.user_metadata,
        user_provided_suffix=job.suffix,
        attempts=[
            JobAttemptObject(
                number=a.number,
                started_at=a.started_at,
                ended_at=a.ended_at,
                cause=a.cause,
                fault=a.cause in AttemptEnd.FAULTS,
            )
            for a in attempts
        ],
        training_seconds=_training_seconds(attempts),
        resolved=resolved,
        status_details=job.waiting_reason if job.status == JobStatus.QUEUED else None,
    )


def _training_seconds(attempts: Sequence) -> int | None:
    """Time trained over all attempts (an attempt still open counts until now); None before the first."""
    if not attempts:
        return None
    now = now_s()
    return sum((now if a.ended_at is None else a.ended_at) - a.started_at for a in attempts)
