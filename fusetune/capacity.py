"""Capacity and quotas: which jobs a worker may start, and which the API may accept.

Workers advertise their GPUs (the `workers` table: a row written at start and on every reaper pass). A job
starts only on a worker it fits and while its tenant stays within the operator's limits (running jobs, GPUs):
`claim_or_park` checks both and claims in one statement, or records why the job waits (`waiting_reason`, shown
as the job's status_details, with an event when the reason is new). A job that waits for its tenant's limit or
a larger worker has no message in the queue any more; `release_waiting_jobs`, run by a worker when one of its
jobs ends and on every reaper pass while it is idle, sends one for each that could start now. The API refuses,
at creation, only what can never run: more GPUs than the largest worker up (with FUSETUNE_RAY_ADDRESS, than the
Ray cluster's nodes hold: fusetune/ray_cluster.py), or than the tenant may ever use.

Imported by the API and the worker alike (like fusetune/spec): SQL through fusetune.db, nothing of either.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.orm import Session

from fusetune import ray_cluster
from fusetune.config import Settings
from fusetune.db import queries
from fusetune.db.models import Job, JobStatus, now_s

log = logging.getLogger(__name__)

NO_WORKER = "no worker has registered yet; the job starts when one does"


@dataclass(frozen=True)
class TenantLimits:
    max_running_jobs: int | None
    max_gpus: int | None


def tenant_limits(settings: Settings, session: Session, tenant: str) -> TenantLimits:
    """The tenant's own limits where the operator set them (`fusetune tenants limit`), else the settings'."""
    row = queries.get_tenant_limit(session, tenant)
    return TenantLimits(
        max_running_jobs=settings.tenant_max_running_jobs if row is None else row.max_running_jobs,
        max_gpus=settings.tenant_max_gpus if row is None else row.max_gpus,
    )


def workers_alive_since(settings: Settings) -> int:
    """A worker whose last heartbeat is older than this is taken for gone: it beats every reaper pass."""
    return now_s() - int(max(settings.lease_s, 3 * settings.reaper_interval_s))


def waiting_reason(session: Session, job: Job, limits: TenantLimits, worker_gpus: int) -> str | None:
    """Why `job` cannot start on a worker with `worker_gpus` now, or None when it can."""
    if job.n_gpus > worker_gpus:
        return f"waiting for a worker with at least {job.n_gpus} GPUs"
    running_jobs, running_gpus = queries.tenant_usage(session, job.tenant)
    if limits.max_running_jobs is not None and running_jobs >= limits.max_running_jobs:
        return (
            f"waiting for a slot: tenant '{job.tenant}' has {running_jobs} job(s) running, its limit is "
            f"{limits.max_running_jobs}"
        )
    if limits.max_gpus is not None and running_gpus + job.n_gpus > limits.max_gpus:
        return (
            f"waiting for GPUs: tenant '{job.tenant}' has {running_gpus} of its {limits.max_gpus} GPUs in use "
            f"and the job needs {job.n_gpus}"
        )
    return None


def claim_or_park(settings: Settings, session: Session, job_id: str, worker: str, worker_gpus: int) -> bool:
    """Claims the queued job for `worker` if it fits the worker and its tenant's limits; otherwise records why
    it waits. The caller commits either way."""
    job = queries.get_job(session, job_id)
    if job is None or job.status != JobStatus.QUEUED:
        return False
    limits = tenant_limits(settings, session, job.tenant)
    reason = waiting_reason(session, job, limits, worker_gpus)
    if reason is None:
        if queries.claim_job(session, job_id, worker, settings.lease_s, max_running_jobs=limits.max_running_jobs,
                             max_gpus=limits.max_gpus):  # fmt: skip
            return True
        session.refresh(job)
        if job.status != JobStatus.QUEUED:
            return False
        # Another worker took the tenant's last slot between the check and the claim.
        reason = waiting_reason(session, job, limits, worker_gpus) or "waiting for a slot"
    if queries.park_job(session, job_id, reason):
        queries.add_event(session, job_id, f"Waiting: {reason}.", data={"event": "waiting", "reason": reason})
    return False


def release_waiting_jobs(
    settings: Settings, session_factory, requeue: Callable[[str], None], worker_gpus: int
) -> list[str]:
    """Sends a message for every waiting job that a worker with `worker_gpus` could start now, oldest first,
    counting each one against its tenant's limits as if it had started. A job that another worker claims first
    finds its message stale (the claim is atomic); one that still cannot start waits again."""
    released = []
    with session_factory() as session:
        usage: dict[str, tuple[int, int]] = {}
        for job in queries.waiting_jobs(session):
            if job.n_gpus > worker_gpus:
                continue
            limits = tenant_limits(settings, session, job.tenant)
            jobs, gpus = usage.get(job.tenant) or queries.tenant_usage(session, job.tenant)
            if limits.max_running_jobs is not None and jobs >= limits.max_running_jobs:
                continue
            if limits.max_gpus is not None and gpus + job.n_gpus > limits.max_gpus:
                continue
            usage[job.tenant] = (jobs + 1, gpus + job.n_gpus)
            released.append(job.id)
    for job_id in released:
        requeue(job_id)
    return released


def creation_problem(settings: Settings, session: Session, tenant: str, n_gpus: int) -> str | None:
    """Why a job of `n_gpus` can never run, to refuse it at creation; None when it may wait or start."""
    limits = tenant_limits(settings, session, tenant)
    if limits.max_gpus is not None and n_gpus > limits.max_gpus:
        return f"n_gpus is {n_gpus}, but tenant '{tenant}' may use at most {limits.max_gpus} GPUs at once."
    if settings.ray_address:
        # The jobs run on the cluster, not on the workers' hosts: the cluster's nodes are what a job must fit.
        return ray_cluster_problem(settings.ray_address, n_gpus)
    largest = queries.largest_worker_gpus(session, workers_alive_since(settings))
    if largest is not None and n_gpus > largest:
        return f"n_gpus is {n_gpus}, but the largest worker has {largest}: ask for at most {largest}."
    return None


def ray_cluster_problem(address: str, n_gpus: int) -> str | None:
    """Why the Ray cluster at `address` can never hold a job of `n_gpus` ranks, or None. A cluster that cannot be
    read now refuses nothing: the job waits for it as it would for a worker."""
    try:
        ray_cluster.plan_nodes(n_gpus, ray_cluster.read_cluster(address))
    except ray_cluster.ClusterTooSmall as exc:
        return str(exc)
    except Exception:
        log.warning("could not read the Ray cluster at %s; the job is accepted", address, exc_info=True)
    return None


def no_worker_up(settings: Settings, session: Session) -> bool:
    return queries.largest_worker_gpus(session, workers_alive_since(settings)) is None
