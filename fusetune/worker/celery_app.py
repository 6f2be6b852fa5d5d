"""The worker side of the job queue: the Celery app with the training task registered on it."""

from __future__ import annotations

import socket

from celery import Celery

from fusetune.config import Settings
from fusetune.queue import JOBS_QUEUE, RUN_JOB_TASK, make_celery_app
from fusetune.worker.tasks import JobRunner


def make_worker_app(settings: Settings) -> Celery:
    app = make_celery_app(settings)
    runner = JobRunner(settings)

    @app.task(name=RUN_JOB_TASK)
    def run_job(job_id: str) -> str:
        return runner.run(job_id)

    return app


def run_worker(settings: Settings, loglevel: str = "INFO") -> None:
    """Blocks, consuming jobs one at a time (a worker owns its GPUs for the whole job)."""
    app = make_worker_app(settings)
    app.worker_main(
        [
            "worker",
            "--pool=solo",
            "--concurrency=1",
            f"--queues={JOBS_QUEUE}",
            f"--loglevel={loglevel}",
            f"--hostname=fusetune@{socket.gethostname()}",
            "--without-gossip",
            "--without-mingle",
        ]
    )
