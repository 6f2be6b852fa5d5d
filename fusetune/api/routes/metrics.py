"""/metrics for Prometheus: request counts and latency, jobs by status, queue depth, training throughput."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from fusetune.db import queries
from fusetune.db.models import JobStatus

router = APIRouter(tags=["observability"])

ALL_STATUSES = (JobStatus.VALIDATING_FILES, JobStatus.QUEUED, JobStatus.RUNNING, JobStatus.PAUSED,
                JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)  # fmt: skip


class JobStateCollector:
    """Read from SQL at scrape time, so every API replica reports the same truth."""

    def __init__(self, session_factory):
        self.session_factory = session_factory

    def collect(self):
        with self.session_factory() as session:
            counts = queries.job_counts_by_status(session)
            latest = queries.latest_metric_values_of_running_jobs(session)
        throughput = {
            job_id: float(values.get("tokens_per_second", 0.0)) for job_id, values in latest.items()
        }
        jobs = GaugeMetricFamily("fusetune_jobs", "Fine-tuning jobs by status", labels=["status"])
        for status in ALL_STATUSES:
            jobs.add_metric([status], counts.get(status, 0))
        yield jobs
        yield GaugeMetricFamily(
            "fusetune_queue_depth", "Jobs waiting for a worker", value=counts.get("queued", 0)
        )
        tokens = GaugeMetricFamily(
            "fusetune_job_tokens_per_second", "Latest training throughput", labels=["job_id"]
        )
        for job_id, value in throughput.items():
            tokens.add_metric([job_id], value)
        yield tokens


def install_state_collector(registry: CollectorRegistry, session_factory) -> None:
    registry.register(JobStateCollector(session_factory))


@router.get("/metrics", include_in_schema=False)
def prometheus_metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.metrics_registry), media_type=CONTENT_TYPE_LATEST)
