"""Running one fine-tuning job: claim it in SQL, train it in a torchrun process group, record the outcome.

The job row is the truth. A message for a job that is not ``queued`` (a redelivery, a cancelled job) does
nothing, and the worker, not the trainer, owns every status transition of the job.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fusetune import capacity
from fusetune.catalog import fine_tuned_model_name
from fusetune.config import Settings
from fusetune.db import queries
from fusetune.db.models import AttemptEnd, Job, JobStatus
from fusetune.db.session import make_engine, make_session_factory
from fusetune.spec.job import JobSpec
from fusetune.storage import StorageError, open_storage
from fusetune.worker import ray_engine, results, run_storage
from fusetune.worker.lifecycle import detect_gpus
from fusetune.worker.locations import ModelLocations
from fusetune.worker.redact import without_paths
from fusetune.worker.train.checkpoints import store as checkpoint_store
from fusetune.worker.train.config import TrainConfig
from fusetune.worker.train.outcome import (
    ERROR_FILENAME,
    RESULT_FILENAME,
    STOPPED_FILENAME,
    ErrorCode,
    read_error,
    read_result,
    read_stopped,
)
from fusetune.worker.train.process import prepare_training_process

log = logging.getLogger(__name__)

TRAIN_LOG_FILE = "train.log"
CONFIG_FILE = run_storage.CONFIG_FILENAME
LOG_TAIL_LINES = 20
WATCH_INTERVAL_S = 1.0
# The trainer's stopped.json reason, and _watch's answer, when a stopping worker gave its job back.
HANDED_OVER = "handed_over"


@dataclass
class Outcome:
    status: str
    fields: dict
    message: str
    level: str = "info"
    # A crash without a diagnosis (killed process, lost node) may succeed on another attempt; a known error
    # (bad model, out of memory, non-finite loss) would only fail again.
    retryable: bool = False
    # The worker is stopping and gives the job back to the queue: no fault of the job's.
    handed_over: bool = False


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, errors="replace") as handle:
            return "".join(deque(handle, maxlen=lines)).strip()
    except OSError:
        return ""


class JobRunner:
    def __init__(self, settings: Settings, requeue: Callable[[str], None]):
        self.settings = settings
        self.requeue = requeue
        self.session_factory = make_session_factory(make_engine(settings.database_url))
        self.worker_name = f"{socket.gethostname()}:{os.getpid()}"
        self.storage = open_storage(settings)
        self.locations = ModelLocations(settings, self.session_factory, self.storage)
        # Set when the worker is asked to stop: a job in training is handed back to the queue with a checkpoint.
        self.stopping = threading.Event()
        # What this worker advertises and takes jobs up to (fusetune.capacity).
        # With a Ray cluster, the jobs this worker hands over may use the whole cluster.
        self.gpus = settings.worker_gpus or (
            ray_engine.cluster_gpus(settings) if settings.ray_address else detect_gpus()
        )
        # The job this worker trains, if any: only an idle worker sends waiting jobs a message on its heartbeat
        # (a busy one could not take them, and would fill the queue with copies while they wait).
        self.training: str | None = None
        # Called before a claimed job's training starts and after it ends: the worker's chat completions
        # server gives the GPUs back to training and takes them again (fusetune.serving).
        self.before_training: Callable[[], None] = lambda: None
        self.after_training: Callable[[], None] = lambda: None

    # ---- public --------------------------------------------------------------------------------------------

    def run(self, job_id: str) -> str:
        if self.stopping.is_set():
            # A message that reached a stopping worker goes back for the next one, the job untouched.
            self.requeue(job_id)
            return "skipped"
        with self.session_factory() as session:
            if not capacity.claim_or_park(self.settings, session, job_id, self.worker_name, self.gpus):
                session.commit()  # a job that cannot start yet keeps the reason it waits
                log.info(
                    "job %s is not started (status %s); nothing to do",
                    job_id,
                    queries.get_job_status(session, job_id),
                )
                return "skipped"
            job = queries.get_job(session, job_id)
            queries.add_event(
                session,
                job_id,
                f"Fine-tuning job started on worker {self.worker_name} (attempt {job.attempts})",
            )
            session.commit()
        self.training = job_id
        try:
            self.before_training()
            outcome = self._train(job)
        except StorageError as exc:
            log.exception("job %s: the store failed", job_id)
            outcome = Outcome(
                JobStatus.FAILED,
                {"error": {"code": ErrorCode.STORAGE_ERROR.value, "message": str(exc)}},
                f"Job failed: the store failed: {exc}",
                "error",
            )
        except Exception as exc:  # the worker must survive anything one job does
            log.exception("job %s failed in the worker", job_id)
            outcome = Outcome(
                JobStatus.FAILED,
                {"error": {"code": "worker_error", "message": str(exc)}},
                f"Job failed in the worker: {exc}",
                "error",
            )
        try:
            status = self._record(job, outcome)
        finally:
            self.training = None
            self.after_training()
        # The job's slot and GPUs are free again: what waited for them may start.
        capacity.release_waiting_jobs(self.settings, self.session_factory, self.requeue, self.gpus)
        return status

    def _record(self, job: Job, outcome: Outcome) -> str:
        if outcome.level != "info":
            log.warning("job %s: %s", job.id, outcome.message)  # the whole of it, for the operator
        # The tenant reads the outcome in the job's error and events: no server path in either.
        outcome.message = without_paths(outcome.message)
        if outcome.fields.get("error"):
            outcome.fields["error"]["message"] = without_paths(outcome.fields["error"]["message"])
        with self.session_factory() as session:
            if outcome.handed_over and queries.requeue_job(session, job.id, worker=self.worker_name):
                queries.end_attempt(session, job.id, job.attempts, AttemptEnd.HANDED_OVER)
                queries.add_event(session, job.id, f"{outcome.message}; the job is back in the queue.",
                                  level="warning")  # fmt: skip
                session.commit()
                self.requeue(job.id)
                return JobStatus.QUEUED
            # Whatever else ended the attempt; a pause or cancel keeps the status the user gave the job. A job found
            # queued again was paused and resumed before this worker saw the pause (or the reaper, which closed
            # the attempt itself, gave it away).
            cause = AttemptEnd.CRASHED if outcome.retryable else outcome.status
            queries.end_attempt(session, job.id, job.attempts,
                                AttemptEnd.PAUSED if cause == JobStatus.QUEUED else cause)  # fmt: skip
            faults = queries.fault_count(session, job.id)
            if outcome.retryable and faults < self.settings.max_attempts:
                if queries.requeue_job(session, job.id, worker=self.worker_name):
                    queries.add_event(session, job.id, f"{outcome.message}\nRetrying: fault {faults} of the "
                                      f"{self.settings.max_attempts} a job may have.", level="warning")  # fmt: skip
                    session.commit()
                    self.requeue(job.id)
                    return JobStatus.QUEUED
            if outcome.retryable:
                outcome.fields["error"]["message"] += f" (gave up after {faults} faults)"
            if queries.finish_job(session, job.id, outcome.status, **outcome.fields):
                queries.add_event(session, job.id, outcome.message, level=outcome.level)
                if outcome.status == JobStatus.SUCCEEDED:
                    self._record_results_file(session, job)
            elif outcome.status != JobStatus.SUCCEEDED:
                queries.add_event(session, job.id, outcome.message, level=outcome.level)
            session.commit()
        return outcome.status

    def _record_results_file(self, session, job: Job) -> None:
        """The succeeded job's per-step CSV as a file; a store that fails costs the file, not the job."""
        try:
            results.record_results_file(session, self.storage, job)
        except StorageError:
            log.warning("job %s: could not store its results file", job.id, exc_info=True)

    # ---- steps -----------------------------------------------------------------------------------------------

    def _model_location(self, job: Job) -> str | None:
        return self._location_of(job.model, job.tenant)

    def _location_of(self, model: str, tenant: str) -> str | None:
        return self.locations.location_of(model, tenant)

    def _adapter_base_models(self, tenant: str, location: str) -> dict[str, str]:
        return self.locations.adapter_base_models(tenant, location)

    def _write_config(self, job: Job, run_dir: Path, model_location: str) -> Path:
        with self.session_factory() as session:
            inputs = run_storage.RunInputs.of_job(session, job)
        spec = JobSpec.from_row(job.hyperparameters)
        config = TrainConfig(
            **spec.hyperparameters.training_fields(),
            method=spec.method,
            job_id=job.id,
            database_url=self.settings.database_url,
            integrations=job.integrations or [],
            mlflow_tracking_uri=self.settings.mlflow_tracking_uri or None,
            model_name=job.model,
            seed=job.seed,
            checkpoint_every_steps=self.settings.checkpoint_every_steps or None,
            checkpoint_every_epoch=self.settings.checkpoint_every_epoch,
            checkpoint_every_minutes=self.settings.checkpoint_every_minutes or None,
            keep_last_checkpoints=self.settings.keep_last_checkpoints,
            gpu_memory_bytes=self.settings.gpu_memory_bytes,
            **run_storage.local_paths(inputs, self.settings, self.storage, self.locations, model_location),
        )
        return config.write(run_dir / CONFIG_FILE)

    def _launch_command(self, config_path: Path, nproc: int) -> list[str]:
        return [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "fusetune.worker.train", "--config", str(config_path),
        ]  # fmt: skip

    def _train(self, job: Job) -> Outcome:
        run_dir = self.settings.runs_dir / job.id
        run_dir.mkdir(parents=True, exist_ok=True)
        for stale in (RESULT_FILENAME, ERROR_FILENAME, STOPPED_FILENAME):
            (run_dir / stale).unlink(missing_ok=True)
        model_location = self._model_location(job)
        if model_location is None:
            return Outcome(
                JobStatus.FAILED,
                {
                    "error": {
                        "code": "model_not_found",
                        "message": f"Model '{job.model}' is not on this server.",
                    }
                },
                f"Model '{job.model}' is not on this server.",
                "error",
            )
        config_path = self._write_config(job, run_dir, model_location)
        # With a remote store a Ray job's nodes stage the run themselves, each on its own disk (ray_engine.py).
        staged_on_nodes = bool(self.settings.ray_address) and self.storage.remote
        if not staged_on_nodes:
            # A retry on this host or any other resumes from the newest checkpoint SQL records.
            checkpoint_store.restore_checkpoints(
                self.storage, self.session_factory, job, self.settings.runs_dir
            )
        nproc = JobSpec.from_row(job.hyperparameters).hyperparameters.n_gpus
        if self.stopping.is_set():
            message = f"Worker {self.worker_name} is stopping: the job goes back before its training started"
            return Outcome(JobStatus.QUEUED, {}, message, handed_over=True)
        job_env = {
            **self.settings.subprocess_env(),
            "PYTHONUNBUFFERED": "1",
            checkpoint_store.TENANT_ENV: job.tenant,
        }
        env = {**os.environ, **job_env}
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        log_path = run_dir / TRAIN_LOG_FILE
        if self.settings.ray_address:
            # The job trains on the Ray cluster, one torchrun per node; the watch below is the same.
            trainer_args = ["-m", "fusetune.worker.train", "--config", str(config_path)]
            staged_config_json = config_path.read_text() if staged_on_nodes else None
            process = ray_engine.submit(
                self.settings, job.id, job.attempts, nproc, trainer_args, job_env, run_dir, log_path,
                staged_config_json,
            )  # fmt: skip
            with self.session_factory() as session:
                queries.add_event(session, job.id, process.describe())
                session.commit()
            stopped_for = self._watch(job.id, process)
        else:
            with open(log_path, "ab") as log_file:
                # A session of its own, so cancel can signal torchrun and every rank it started, and nothing else.
                process = subprocess.Popen(
                    self._launch_command(config_path, nproc), stdout=log_file, stderr=subprocess.STDOUT,
                    env=env, cwd=run_dir, start_new_session=True,
                    preexec_fn=functools.partial(prepare_training_process, self.settings.training_niceness),
                )  # fmt: skip
                stopped_for = self._watch(job.id, process)
        try:
            checkpoint_store.remove_unrecorded_checkpoints(
                self.storage, self.session_factory, job, self.worker_name
            )
        except StorageError:
            # Tidying only: the objects stay until a later run of the job or the tenant's deletion removes them,
            # and the trainer's own outcome (a store that failed mid-run is its storage_error) is what counts.
            log.warning(
                "job %s: could not remove unrecorded checkpoints from the store", job.id, exc_info=True
            )
        run_storage.clear_scratch(self.storage, run_dir)
        if stopped_for == HANDED_OVER:
            return Outcome(JobStatus.QUEUED, {}, f"Worker {self.worker_name} stopped training without a new "
                           "checkpoint (the trainer did not save one in time)", handed_over=True)  # fmt: skip
        if stopped_for is not None:
            # The job already left `running` (cancelled or paused by the user); finish_job will leave it so.
            return Outcome(stopped_for, {}, f"Training processes stopped: the job was {stopped_for}")
        if isinstance(process, ray_engine.RayJob) and process.node_lost:
            message = (
                f"A node of the Ray cluster was lost mid-run. Last lines of the job's log:\n{_tail(log_path)}"
            )
            error = {"code": "node_lost", "message": message}
            return Outcome(JobStatus.FAILED, {"error": error}, message, "error", retryable=True)
        if staged_on_nodes:
            run_storage.fetch_outcome(self.storage, job.tenant, job.id, job.attempts, run_dir)
        return self._read_outcome(job, run_dir, process.returncode, log_path)

    def _watch(self, job_id: str, process: subprocess.Popen | ray_engine.RayJob) -> str | None:
        """Waits for the trainer, renewing the job's lease. If the job leaves `running` meanwhile (cancel,
        pause) or stops being this worker's, stops the processes and returns the job's new status; returns
        None when the trainer exited by itself. When the worker is stopping, asks the trainer for a hand-over
        (a checkpoint, then exit) and returns HANDED_OVER if it has not exited within handover_grace_s."""
        renew_every_s = self.settings.lease_s / 3
        last_renewal = time.monotonic()
        handover_deadline = None
        while True:
            if self.stopping.is_set() and handover_deadline is None:
                with self.session_factory() as session:
                    queries.request_handover(session, job_id, self.worker_name)
                    session.commit()
                handover_deadline = time.monotonic() + self.settings.handover_grace_s
            elif handover_deadline is not None and time.monotonic() > handover_deadline:
                self._stop(process)
                return HANDED_OVER
            try:
                process.wait(timeout=WATCH_INTERVAL_S)
                return None
            except subprocess.TimeoutExpired:
                pass
            with self.session_factory() as session:
                status = queries.get_job_status(session, job_id)
                still_ours = status == JobStatus.RUNNING
                if still_ours and time.monotonic() - last_renewal >= renew_every_s:
                    still_ours = queries.renew_lease(session, job_id, self.worker_name, self.settings.lease_s)
                    session.commit()
                    last_renewal = time.monotonic()
            if not still_ours:
                # A paused trainer saves a resumable checkpoint and exits by itself; give it time to.
                self._stop(
                    process, exit_grace_s=self.settings.pause_grace_s if status == JobStatus.PAUSED else 0
                )
                return status if status != JobStatus.RUNNING else JobStatus.QUEUED

    def _stop(self, process: subprocess.Popen | ray_engine.RayJob, exit_grace_s: float = 0) -> None:
        try:
            process.wait(timeout=exit_grace_s)
            return
        except subprocess.TimeoutExpired:
            pass
        if isinstance(process, ray_engine.RayJob):
            process.stop()  # the driver stops every node's torchrun, as the signals below stop the local one
            return
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + self.settings.terminate_grace_s
        while process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()

    def _read_outcome(self, job: Job, run_dir: Path, returncode: int, log_path: Path) -> Outcome:
        result = read_result(run_dir) if returncode == 0 else None
        if result is not None:
            name = fine_tuned_model_name(job.model, job.tenant, job.suffix, job.id)
            fields = {"trained_tokens": result.trained_tokens, "fine_tuned_model": name}
            return Outcome(JobStatus.SUCCEEDED, fields, f"Fine-tuning job successfully completed: {name}")
        stopped = read_stopped(run_dir)
        if stopped is not None and stopped.get("reason") == HANDED_OVER:
            step = stopped.get("step")
            message = f"Worker {self.worker_name} is stopping: training handed over with the checkpoint of step {step}"
            return Outcome(JobStatus.QUEUED, {}, message, handed_over=True)
        if stopped is not None:
            # The trainer saw the pause or cancel before the worker did; the job row already says so.
            reason = str(stopped.get("reason", JobStatus.CANCELLED))
            return Outcome(
                reason, {}, f"Training stopped at step {stopped.get('step')}: the job was {reason}"
            )
        error = read_error(run_dir)
        if error is not None:
            error = {
                "code": str(error.get("code", "trainer_error")),
                "message": str(error.get("message", "")),
            }
            return Outcome(
                JobStatus.FAILED, {"error": error}, f"Training failed: {error['message']}", "error"
            )
        tail = _tail(log_path)
        message = f"The training process exited with code {returncode}. Last lines of its log:\n{tail}"
        error = {"code": "trainer_crashed", "message": message}
        return Outcome(JobStatus.FAILED, {"error": error}, message, "error", retryable=True)


def reap_lapsed_jobs(settings: Settings, session_factory, requeue: Callable[[str], None]) -> list[str]:
    """Requeues running jobs whose worker stopped renewing the lease (killed, frozen, cut off from the
    database), or fails them once they have had max_attempts faults. Any worker may run this."""
    requeued = []
    with session_factory() as session:
        for job in queries.lapsed_jobs(session):
            lost_worker = job.worker  # the requeue clears the row's worker, and the loaded job's with it
            queries.end_attempt(session, job.id, job.attempts, AttemptEnd.WORKER_LOST)
            faults = queries.fault_count(session, job.id)
            if faults < settings.max_attempts:
                if queries.requeue_job(session, job.id, worker=lost_worker):
                    queries.add_event(session, job.id, f"Worker {lost_worker} stopped renewing its lease; job "
                                      f"requeued (fault {faults} of the {settings.max_attempts} a job may have).",
                                      level="warning")  # fmt: skip
                    session.commit()
                    requeue(job.id)
                    requeued.append(job.id)
                else:
                    session.rollback()  # the job moved on meanwhile; its attempt is not this reaper's to close
            else:
                error = {"code": "worker_lost", "message": f"The job's worker stopped responding; giving up after "
                         f"{faults} faults (a lost worker or a crashed trainer each count; pauses do not)."}  # fmt: skip
                if queries.finish_job(session, job.id, JobStatus.FAILED, error=error):
                    queries.add_event(session, job.id, error["message"], level="error")
                session.commit()
    return requeued
