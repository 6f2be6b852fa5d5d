"""The worker side of the job queue: the Celery app with the training task, and the reaper beside it."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading

from celery import Celery
from celery.platforms import EX_OK, close_open_fds
from celery.signals import worker_ready, worker_shutdown, worker_shutting_down
from celery.worker import state as celery_state

from fusetune import capacity
from fusetune.config import Settings
from fusetune.db import queries
from fusetune.queue import (
    JOBS_QUEUE,
    RUN_EVAL_TASK,
    RUN_JOB_TASK,
    JobQueue,
    declare_jobs_queue,
    make_celery_app,
)
from fusetune.serving.server import ServingServer
from fusetune.worker.evals import EvalRunner, reap_lost_eval_runs
from fusetune.worker.lifecycle import stop_with_parent
from fusetune.worker.tasks import JobRunner, reap_lapsed_jobs

log = logging.getLogger(__name__)


def make_worker_app(settings: Settings, restart: threading.Event | None = None) -> Celery:
    """The worker's Celery app. SIGTERM and SIGINT hand a job in training back to the queue with a checkpoint and
    stop the worker; SIGHUP does the same, then sets `restart` (see `run_worker`)."""
    app = make_celery_app(settings)
    queue = JobQueue(app)
    runner = JobRunner(settings, requeue=queue.enqueue)
    serving: list[ServingServer] = []  # the chat completions server, once the worker is ready

    # Eval runs sample through the chat completions engine once it started (its models stay warm for both).
    evals = EvalRunner(settings, runner.session_factory, runner.storage, runner.locations, runner.worker_name,
                       lambda: serving[0].engine if serving else None)  # fmt: skip

    @app.task(name=RUN_JOB_TASK)
    def run_job(job_id: str) -> str:
        return runner.run(job_id)

    @app.task(name=RUN_EVAL_TASK)
    def run_eval(run_id: str) -> str:
        return evals.run(run_id)

    def beat() -> None:
        """The worker's heartbeat row (what it advertises), then, when it is idle, what waits and could start here
        now (a limit raised, a lost wake-up; a job's end wakes the waiting at once)."""
        url, token = (serving[0].url, serving[0].token) if serving else (None, None)
        with runner.session_factory() as session:
            queries.record_worker(session, runner.worker_name, runner.gpus, url, token)
            session.commit()
        if runner.training is None and not runner.stopping.is_set():
            capacity.release_waiting_jobs(settings, runner.session_factory, queue.enqueue, runner.gpus)

    def start_serving() -> None:
        """The chat completions server; its engine, which imports torch, is built at the first request (LazyEngine).
        Training takes the worker's devices: the server unloads its models and refuses requests while a job
        trains here."""
        try:
            server = ServingServer(settings, runner.locations).start()
        except OSError:
            log.exception("could not start the chat completions server; this worker serves none")
            return
        runner.before_training, runner.after_training = server.engine.pause, server.engine.resume
        if runner.training is not None:  # a job claimed while the server started
            server.engine.pause()
        serving.append(server)

    def reap_forever() -> None:
        if settings.serving:
            start_serving()  # before the first heartbeat, which advertises it
        while True:
            try:
                requeued = reap_lapsed_jobs(settings, runner.session_factory, queue.enqueue)
                if requeued:
                    log.warning("requeued jobs whose worker stopped renewing its lease: %s", requeued)
                requeued = reap_lost_eval_runs(settings, runner.session_factory, queue.enqueue_eval_run)
                if requeued:
                    log.warning("requeued eval runs whose worker stopped beating: %s", requeued)
                beat()
            except Exception:  # a database hiccup must not end the reaper
                log.exception("reaper pass failed")
            threading.Event().wait(settings.reaper_interval_s)

    @worker_ready.connect(weak=False)
    def _start_reaper(**_kwargs) -> None:
        threading.Thread(target=reap_forever, name="fusetune-reaper", daemon=True).start()

    # Celery's warm shutdown (SIGTERM, SIGINT) waits for the running task, which would be the whole training run:
    # the runner hands the job back to the queue with a checkpoint instead, and the task returns.
    @worker_shutting_down.connect(weak=False)
    def _hand_over(**_kwargs) -> None:
        runner.stopping.set()
        if restart is not None:
            restart.clear()  # a SIGTERM or SIGINT after a SIGHUP: stop, as asked last

    def _hand_over_and_restart(is_terminal: bool) -> None:
        """SIGHUP. Celery's own restarts the worker once the task in hand returns, which is at the end of the
        training run, and then runs again what `sys.argv` says, which is not `python -m fusetune.cli`. Here the
        job is handed over as on SIGTERM, the worker stops as on SIGTERM, and `run_worker` starts it again. A
        worker on a terminal that hung up stops without a restart (Celery restarts only one detached from a
        terminal: it would go on in the background of a closed one)."""
        runner.stopping.set()
        if restart is not None and not is_terminal:
            restart.set()
        celery_state.should_stop = EX_OK  # Celery's warm stop, as its SIGTERM handler sets it

    class Worker(app.Worker):
        def install_platform_tweaks(self, worker) -> None:
            super().install_platform_tweaks(worker)  # Celery's signal handlers, SIGHUP's among them
            signal.signal(signal.SIGHUP, lambda _signum, _frame: _hand_over_and_restart(self._isatty))

    app.Worker = Worker

    @worker_shutdown.connect(weak=False)
    def _unregister(**_kwargs) -> None:
        for server in serving:
            server.stop()
        with runner.session_factory() as session:
            queries.remove_worker(session, runner.worker_name)
            session.commit()

    return app


def run_worker(settings: Settings, loglevel: str = "INFO", parent_pid: int | None = None) -> None:
    """Blocks, consuming jobs one at a time (a worker owns its GPUs for the whole job). With `parent_pid`, the
    worker stops as on SIGTERM when that process exits. After a SIGHUP the process runs its command line again
    (the same pid: a supervisor sees no exit), with the code and settings as they are now."""
    if parent_pid is not None:
        stop_with_parent(parent_pid)
    restart = threading.Event()
    app = make_worker_app(settings, restart)
    declare_jobs_queue(app)  # before the consumer declares it, which would exit on a lost race
    app.worker_main(
        [
            "worker",
            "--pool=solo",
            "--concurrency=1",
            f"--queues={JOBS_QUEUE}",
            f"--loglevel={loglevel}",
            f"--hostname=fusetune-{os.getpid()}@{socket.gethostname()}",
            "--without-gossip",
            "--without-mingle",
        ]
    )
    if restart.is_set():
        log.warning("restarting the worker (SIGHUP)")
        _run_again()


def _run_again() -> None:
    """Replaces this process with its own command line, `python -m fusetune.cli worker ...` or the `fusetune`
    script alike (sys.orig_argv holds the interpreter's options, which sys.argv has lost)."""
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        if stream is not None:
            stream.flush()
    close_open_fds([sys.__stdin__, sys.__stdout__, sys.__stderr__])
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
