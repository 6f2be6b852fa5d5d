"""/metrics for Prometheus: request counts and latency, jobs by status, queue depth, training throughput.

Open, it shows only totals. With a metrics key set (FUSETUNE_METRICS_KEY) it asks for that key and adds the
series that name tenants' jobs: a job id tells who trains, and is no business of another tenant's.
"""

from __future__ import annotations

import secrets

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from fusetune.api.errors import ApiError
from fusetune.db import queries
from fusetune.db.models import JobStatus

router = APIRouter(tags=["observability"])

ALL_STATUSES = (JobStatus.VALIDATING_FILES, JobStatus.QUEUED, JobStatus.RUNNING, JobStatus.PAUSED,
                JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)  # fmt: skip


def _throughput_by_job(session_factory) -> dict[str, float]:
    with session_factory() as session:
        latest = queries.latest_metric_values_of_running_jobs(session)
    return {job_id: float(values.get("tokens_per_second", 0.0)) for job_id, values in latest.items()}


class JobStateCollector:
    """Read from SQL at scrape time, so every API replica reports the same truth. Totals only: nothing here
    names a tenant or a job."""

    def __init__(self, session_factory):
        self.session_factory = session_factory

    def collect(self):
        with self.session_factory() as session:
            counts = queries.job_counts_by_status(session)
        jobs = GaugeMetricFamily("fusetune_jobs", "Fine-tuning jobs by status", labels=["status"])
        for status in ALL_STATUSES:
            jobs.add_metric([status], counts.get(status, 0))
        yield jobs
        yield GaugeMetricFamily(
            "fusetune_queue_depth", "Jobs waiting for a worker", value=counts.get("queued", 0)
        )
        yield GaugeMetricFamily(
            "fusetune_tokens_per_second",
            "Latest training throughput summed over the running jobs",
            value=sum(_throughput_by_job(self.session_factory).values()),
        )


class JobThroughputCollector:
    """Each running job's latest throughput, labelled by job id: shown only to a scrape with the metrics key."""

    def __init__(self, session_factory):
        self.session_factory = session_factory

    def collect(self):
        tokens = GaugeMetricFamily(
            "fusetune_job_tokens_per_second", "Latest training throughput", labels=["job_id"]
        )
        for job_id, value in _throughput_by_job(self.session_factory).items():
            tokens.add_metric([job_id], value)
        yield tokens


def install_state_collector(registry: CollectorRegistry, session_factory) -> CollectorRegistry:
    """Registers the totals in `registry`; returns a registry of the per-job series, kept apart from it."""
    registry.register(JobStateCollector(session_factory))
    per_job = CollectorRegistry()
    per_job.register(JobThroughputCollector(session_factory))
    return per_job


def _has_metrics_key(request: Request) -> bool:
    """Whether the scrape may see per-job series: a 401 when a metrics key is set and not presented."""
    metrics_key = request.app.state.settings.metrics_key
    if not metrics_key:
        return False
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), metrics_key.encode()):
        raise ApiError(401, "/metrics needs the metrics key (FUSETUNE_METRICS_KEY): send "
                       "'Authorization: Bearer <metrics key>'.", code="invalid_metrics_key")  # fmt: skip
    return True


@router.get("/metrics", include_in_schema=False)
def prometheus_metrics(request: Request) -> Response:
    per_job = _has_metrics_key(request)
    body = generate_latest(request.app.state.metrics_registry)
    if per_job:
        body += generate_latest(request.app.state.job_metrics_registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
