"""Training a job on a Ray cluster, when FUSETUNE_RAY_ADDRESS names one.

**What goes to Ray.** Every job, when the setting is set: one path to test and to reason about, and a job that
fits one node runs there as one torchrun, the same process group as on the worker's host (the cost is Ray's job
start, seconds, against minutes of training). Unset, nothing here runs and jobs train on the worker's host.

**How.** One torchrun per node on a Ray placement group (one bundle per node, STRICT_SPREAD, each bundle the
node's GPUs, or CPUs on a cluster without GPUs, for its ranks), started by a small driver
(fusetune/worker/ray_driver.py), not Ray Train's TorchTrainer. The reasons: it reuses today's trainer
unchanged, the same `python -m fusetune.worker.train` under torchrun with the same rendezvous, environment,
exit codes and teardown of a node's ranks when one fails; the worker reads the same outcome files; and it adds
no Ray Train dependency (`ray[default]`, for the Job Submission API and the dashboard that serves it, is all).

**The worker's side.** The Celery worker stays where it is and hands the job to the cluster through Ray's Job
Submission API (HTTP to the head's dashboard): `submit` sends the driver as the entrypoint, with the job's
environment as the runtime environment's variables; `RayJob` answers the calls the worker's watch loop makes of
a local torchrun (`wait`, `poll`, `returncode`) from the Ray job's status, streams the job's logs into the run's
train.log (where a local torchrun's output goes, and whose tail a crash reports), and stops it with `stop_job`
on cancel, pause and hand-over. The outcome is then read as for a local run: exit status 0 and result.json,
or the trainer's error.json, or a crash, which is retryable through the job's attempts.

**Without a shared disk.** With the files and checkpoints in the S3-compatible store (FUSETUNE_STORAGE_URL),
no node reads the worker's disk: the worker sends the run's config itself (in the job's environment, as it
decided it), and each node stages the run from the store into its own data directory before its torchrun
starts (fusetune/worker/run_storage.py: the job's files, a fine-tuned base model, the recorded checkpoints to
resume from; a base model from the node's own models folder, as each worker host has its own). Rank 0 publishes
its checkpoints to the store as on one host, and rank 0's node publishes the outcome files there once its
torchrun ends, which the worker fetches into the run's folder before it reads them. Staging on each node, not
once by the worker into the store, keeps one path: what the worker does for a run on its own host is what each
node does for its ranks, the same function (`run_storage.local_paths`) with the node's settings. The nodes still
reach the job's database, as the trainer's reporter always does. With local storage nothing changes: the nodes
read the worker's paths, so they must see its data_dir (one host, as in most tests, or a shared disk).

A stopping worker's hand-over request is in the job's row, as a pause is, so the trainer's rank 0 sees it on
whichever node it runs: it saves a checkpoint to the store and exits, and the job resumes from that checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
import subprocess
import threading
import time
from pathlib import Path

from fusetune import ray_cluster
from fusetune.config import Settings

log = logging.getLogger(__name__)

# How often the job's status is read while the worker waits on it.
POLL_S = 1.0
# How long, after the Ray job ended, its log stream may take to deliver its last lines.
LOG_DRAIN_S = 30.0
# Ray's job supervisor gives a stopped job's driver this long after SIGTERM before SIGKILL: the driver's
# terminate_grace_s for the nodes' torchruns, plus time to reach the actors.
STOP_MARGIN_S = 10.0
# The run's config, as JSON, in the driver's environment when each node stages the run from the store.
STAGED_CONFIG_ENV = "FUSETUNE_RAY_STAGED_CONFIG"
# What a node has of its own when it stages the run (its data directory and models), not the worker's.
NODE_OWN_ENV = ("FUSETUNE_DATA_DIR", "FUSETUNE_MODELS_DIR")
# The driver's exit status when a node (its actor) was lost under the job: EX_TEMPFAIL, which neither torchrun
# nor the trainer uses. The surviving ranks fail on a collective and rank 0 may write error.json meanwhile, but
# the job is retried through its attempts, from its last checkpoint, as a crash on one host is.
NODE_LOST_EXIT = 75


def cluster_gpus(settings: Settings) -> int:
    """What a worker that hands its jobs to the cluster advertises: all the cluster's GPUs (or CPUs)."""
    try:
        return sum(ray_cluster.read_cluster(settings.ray_address).slots_per_node)
    except Exception as exc:
        raise RuntimeError(
            f"FUSETUNE_RAY_ADDRESS={settings.ray_address}: could not read the Ray cluster's nodes: {exc}"
        ) from exc


class RayJob:
    """A submitted Ray job, seen through the calls the worker makes of a local torchrun process."""

    def __init__(self, client, submission_id: str, plan: ray_cluster.NodePlan, log_path: Path):
        self.client = client
        self.submission_id = submission_id
        self.plan = plan
        self.log_path = log_path
        self.returncode: int | None = None
        self.status_message = ""
        self._log_thread = threading.Thread(
            target=self._stream_logs, name=f"logs-{submission_id}", daemon=True
        )
        self._log_thread.start()

    def describe(self) -> str:
        return (
            f"Submitted to the Ray cluster as Ray job {self.submission_id}: {self.plan.nnodes} node(s) x "
            f"{self.plan.nproc_per_node} rank(s) ({self.plan.unit})"
        )

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        from ray.job_submission import JobStatus

        info = self.client.get_job_info(self.submission_id)
        if not info.status.is_terminal():
            return None
        self._log_thread.join(LOG_DRAIN_S)
        # Ray's message repeats the log's last lines after its first, which the stream has already written.
        self.status_message = (info.message or "").split("\n", 1)[0]
        if info.status == JobStatus.SUCCEEDED:
            returncode = 0
        elif info.status == JobStatus.STOPPED:
            returncode = -15  # as a local torchrun stopped with SIGTERM
        else:
            # No exit code: the driver never ran (a runtime environment that failed, a node lost under it).
            returncode = info.driver_exit_code if info.driver_exit_code not in (None, 0) else 1
        if info.status != JobStatus.SUCCEEDED and self.status_message:
            with open(self.log_path, "a", errors="replace") as log_file:
                log_file.write(f"Ray job {self.submission_id} {info.status.value}: {self.status_message}\n")
        self.returncode = returncode
        return returncode

    @property
    def node_lost(self) -> bool:
        return self.returncode == NODE_LOST_EXIT

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.submission_id, timeout)
            time.sleep(POLL_S if deadline is None else max(0.0, min(POLL_S, deadline - time.monotonic())))
        return self.returncode

    def stop(self) -> None:
        """Ray's stop_job: SIGTERM to the driver, which stops every node's torchrun before it exits. Returns
        once the Ray job has ended."""
        if self.poll() is not None:
            return
        self.client.stop_job(self.submission_id)
        self.wait()

    def _stream_logs(self) -> None:
        async def stream() -> None:
            with open(self.log_path, "a", errors="replace") as log_file:
                async for chunk in self.client.tail_job_logs(self.submission_id):
                    log_file.write(chunk)
                    log_file.flush()

        try:
            asyncio.run(stream())
        except Exception:  # the job goes on; its log is what is lost
            log.warning("Ray job %s: its log stream broke", self.submission_id, exc_info=True)


def submit(
    settings: Settings,
    job_id: str,
    attempt: int,
    n_ranks: int,
    trainer_args: list[str],
    job_env: dict[str, str],
    run_dir: Path,
    log_path: Path,
    staged_config_json: str | None = None,
) -> RayJob:
    """Submits one attempt of the job to the cluster: ray_driver as the entrypoint, the job's environment as
    its runtime environment's variables. `staged_config_json`: the run's config, which each node then stages
    from the store (see the module's docstring); None: the nodes read the worker's paths. Raises
    ClusterTooSmall when the cluster cannot hold it now."""
    from ray.job_submission import JobSubmissionClient

    plan = ray_cluster.plan_nodes(n_ranks, ray_cluster.read_cluster(settings.ray_address))
    client = JobSubmissionClient(settings.ray_address)
    entrypoint = [
        settings.ray_python, "-m", "fusetune.worker.ray_driver", f"--nnodes={plan.nnodes}",
        f"--nproc-per-node={plan.nproc_per_node}", f"--unit={plan.unit}", f"--cwd={run_dir}",
        f"--terminate-grace-s={settings.terminate_grace_s}", f"--attempt={attempt}",
        *(["--stage-from-store"] if staged_config_json is not None else []), "--", *trainer_args,
    ]  # fmt: skip
    if staged_config_json is not None:
        job_env = {
            **{name: value for name, value in job_env.items() if name not in NODE_OWN_ENV},
            STAGED_CONFIG_ENV: staged_config_json,
        }
    env_vars = {
        **job_env,
        "RAY_JOB_STOP_WAIT_TIME_S": str(int(settings.terminate_grace_s + STOP_MARGIN_S)),
        # Every rank's lines in the log as they were printed: Ray would fold lines that repeat across processes.
        "RAY_DEDUP_LOGS": "0",
    }
    # One submission id per attempt: a retry is a new Ray job, and a redelivered message cannot submit twice.
    submission_id = client.submit_job(
        entrypoint=shlex.join(entrypoint),
        submission_id=f"fusetune-{job_id}-{attempt}",
        runtime_env={"env_vars": env_vars},
        metadata={"fusetune_job": job_id, "attempt": str(attempt)},
    )
    return RayJob(client, submission_id, plan, log_path)
