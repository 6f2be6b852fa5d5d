"""The job queue between the API and the workers: a Celery app on the configured broker.

Messages carry a job id and nothing else; the job's truth lives in SQL. Both sides build the app from the
same Settings with this one function, so the broker options cannot drift apart.
"""

from __future__ import annotations

from celery import Celery

from fusetune.config import Settings

RUN_JOB_TASK = "fusetune.run_job"
JOBS_QUEUE = "fusetune.jobs"


def make_celery_app(settings: Settings) -> Celery:
    settings.ensure_dirs()
    app = Celery("fusetune", broker=settings.broker_url)
    app.conf.update(
        task_default_queue=JOBS_QUEUE,
        task_ignore_result=True,
        # A job is acknowledged only when its task returns, and requeued if the worker process dies, so a
        # killed worker's job is picked up again; the atomic claim in SQL keeps redeliveries harmless.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_concurrency=1,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )
    if settings.broker_url.startswith(("redis://", "rediss://")):
        # Longer than any training run, so Redis does not redeliver a message whose job is still training.
        app.conf.broker_transport_options = {"visibility_timeout": 7 * 24 * 3600}
    return app


class JobQueue:
    """What the API uses to hand a committed job to the workers."""

    def __init__(self, celery_app: Celery):
        self._celery = celery_app

    def enqueue(self, job_id: str) -> None:
        self._celery.send_task(RUN_JOB_TASK, args=[job_id], queue=JOBS_QUEUE)
