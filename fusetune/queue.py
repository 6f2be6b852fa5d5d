"""The job queue between the API and the workers: a Celery app on the configured broker.

Messages carry a job id and nothing else; the job's truth lives in SQL. Both sides build the app from the
same Settings with this one function, so the broker options cannot drift apart.
"""

from __future__ import annotations

import time

from celery import Celery
from sqlalchemy.exc import SQLAlchemyError

from fusetune.config import Settings

RUN_JOB_TASK = "fusetune.run_job"
# An eval run goes to the same queue as jobs: a worker samples it with the devices it would train with.
RUN_EVAL_TASK = "fusetune.run_eval"
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
        self._declared = False

    def enqueue(self, job_id: str) -> None:
        if not self._declared:  # an API process without `fusetune serve` before it may race a worker
            declare_jobs_queue(self._celery)
            self._declared = True
        self._celery.send_task(RUN_JOB_TASK, args=[job_id], queue=JOBS_QUEUE)

    def enqueue_eval_run(self, run_id: str) -> None:
        if not self._declared:
            declare_jobs_queue(self._celery)
            self._declared = True
        self._celery.send_task(RUN_EVAL_TASK, args=[run_id], queue=JOBS_QUEUE)


def declare_jobs_queue(celery_app: Celery, attempts: int = 5) -> None:
    """Create the jobs queue on an SQLAlchemy broker (the default, SQLite in data_dir) now, once.

    kombu's SQLAlchemy transport creates a queue's row on first use by a select and then an insert, atomic
    between threads but not between processes: when a starting worker declares its queue while the API
    publishes its first job (both find no row, both insert), the loser gets an IntegrityError. For the API
    that fails the job (queue_unavailable); for the worker it is an "Unrecoverable error" at start and it
    exits, leaving every job queued for ever. A worker calls this before it consumes and the API before its
    first enqueue; a try that loses the race is retried and then finds the row. Other brokers declare queues
    idempotently and are left alone.
    """
    if not str(celery_app.conf.broker_url).startswith("sqla+"):
        return
    for attempt in range(attempts):
        try:
            with celery_app.connection_for_write() as connection:
                celery_app.amqp.queues[JOBS_QUEUE](connection.default_channel).declare()
            return
        except SQLAlchemyError:
            if attempt == attempts - 1:
                raise
            time.sleep(0.1 * (attempt + 1))
