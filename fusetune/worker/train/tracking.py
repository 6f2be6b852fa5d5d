"""Tracking: rank 0 also sends the run to Weights & Biases and MLflow (the job's `integrations`,
fusetune/spec/integrations.py, and the server's FUSETUNE_MLFLOW_TRACKING_URI).

`TrackingReporter` wraps the run's reporter: everything still goes to SQL as before, and each tracker also gets
the configuration (the hyperparameters at the start, then what the `started` event resolved), every step's
metrics, and the run's events (at its end, as a table or a JSON Lines artifact), and ends with the run's outcome.
A tracker is a guest: one that cannot start, or fails later, is switched off and its error becomes a warning
event of the job; it never fails or stops the training.

- W&B, through `wandb`: online when the worker has a W&B key (WANDB_API_KEY or its netrc) and a route to W&B's
  host, else offline into `<run folder>/wandb/offline-run-*` (`wandb sync` uploads it later). The run's id is
  the job's, so a paused and resumed job continues one run.
- MLflow, through its client: the experiment (default "fusetune") is created when missing; the run, tagged
  with the job id, is found again when the job resumes.

Where each run is (its URL, or the offline folder relative to the runs directory) is an event of the job.
"""

from __future__ import annotations

import json
import math
import netrc
import os
import socket
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fusetune.spec.hyperparameters import TrainingHyperparameters
from fusetune.spec.integrations import MlflowSettings, WandbSettings
from fusetune.worker.train.config import TrainConfig
from fusetune.worker.train.reporter import Reporter, StopRequest

DEFAULT_MLFLOW_EXPERIMENT = "fusetune"
# How long one request to a tracking server may take, and how often it is retried: a server that does not
# answer costs the run seconds, not the minutes of MLflow's own defaults.
MLFLOW_REQUEST_TIMEOUT_S = 10
MLFLOW_REQUEST_RETRIES = 1
# MLflow refuses a parameter value longer than this (its server's limit): a longer one is cut. One log_batch
# request takes at most this many parameters and metrics.
MLFLOW_PARAM_CHARS = 6000
MLFLOW_BATCH_PARAMS = 100
MLFLOW_BATCH_METRICS = 1000
# How long the check for a route to W&B waits before the run is logged offline.
WANDB_ROUTE_TIMEOUT_S = 3.0
WANDB_DEFAULT_HOST = "https://api.wandb.ai"
JOB_ID_TAG = "fusetune.job_id"


class Tracker(ABC):
    name: str  # for events: "W&B", "MLflow"

    @abstractmethod
    def start(self, config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Opens the run with the job's configuration; returns the event that says where it is (its message
        and data)."""

    @abstractmethod
    def log_config(self, values: dict[str, Any]) -> None:
        """More configuration: what the run resolved at its start."""

    @abstractmethod
    def log_metrics(self, step: int, values: dict[str, float]) -> None: ...

    @abstractmethod
    def finish(self, outcome: str, events: list[dict[str, Any]]) -> None:
        """`outcome`: finished, stopped (paused, cancelled, handed over) or failed; `events`: the run's events."""


def flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"lora": {"r": 8}} -> {"lora.r": 8}; lists and None as text."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = (
                value if isinstance(value, str | int | float | bool) else json.dumps(value)
            )
    return flat


def finite_numbers(values: dict[str, Any]) -> dict[str, float]:
    return {
        name: float(value)
        for name, value in values.items()
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    }


class WandbTracker(Tracker):
    name = "W&B"

    def __init__(self, settings: WandbSettings, config: TrainConfig) -> None:
        self.settings = settings
        self.config = config
        self.run: Any = None

    def start(self, config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        import wandb

        mode = wandb_mode()
        self.run = wandb.init(
            project=self.settings.project,
            entity=self.settings.entity,
            name=self.settings.name or self.config.job_id,
            tags=self.settings.tags,
            id=self.config.job_id,
            resume="allow" if self.config.job_id else None,
            dir=self.config.output_dir,
            mode=mode,
            config=config,
            # Its own console capture and system statistics would be a second copy of the train log and the
            # memory metrics, and git is not the job's.
            settings=wandb.Settings(console="off", x_disable_stats=True, disable_git=True, save_code=False,
                                    silent=True),
        )  # fmt: skip
        data = {"event": "tracking", "tracker": "wandb", "run_id": self.run.id, "mode": mode}
        if mode == "offline":
            folder = reported_path(Path(self.run.dir).parent, self.config)
            data["path"] = folder
            message = (f"W&B run {self.run.id} is logged offline (no W&B key or no route to W&B) in {folder}; "
                       "`wandb sync` uploads it")  # fmt: skip
        else:
            data["url"] = self.run.url
            message = f"W&B run {self.run.id}: {self.run.url}"
        return message, data

    def log_config(self, values: dict[str, Any]) -> None:
        self.run.config.update({"run": values}, allow_val_change=True)

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        self.run.log(finite_numbers(values), step=step)

    def finish(self, outcome: str, events: list[dict[str, Any]]) -> None:
        import wandb

        if events:
            columns = ["created_at", "level", "message", "data"]
            rows = [[e["created_at"], e["level"], e["message"], json.dumps(e["data"])] for e in events]
            self.run.log({"events": wandb.Table(columns=columns, data=rows)})
        self.run.finish(exit_code=0 if outcome in ("finished", "stopped") else 1)
        # finish() can return before wandb's service has written the whole run to disk; its teardown waits.
        wandb.teardown()


def wandb_mode() -> str:
    """online with a key and a route to W&B's host; offline otherwise (or as WANDB_MODE says)."""
    if os.environ.get("WANDB_MODE") in ("online", "offline"):
        return os.environ["WANDB_MODE"]
    url = urlsplit(os.environ.get("WANDB_BASE_URL") or WANDB_DEFAULT_HOST)
    host = url.hostname or ""
    if not os.environ.get("WANDB_API_KEY") and not _netrc_has(host):
        return "offline"
    try:
        socket.create_connection((host, url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=WANDB_ROUTE_TIMEOUT_S).close()  # fmt: skip
    except OSError:
        return "offline"
    return "online"


def _netrc_has(host: str) -> bool:
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class MlflowTracker(Tracker):
    name = "MLflow"

    def __init__(self, settings: MlflowSettings, tracking_uri: str, config: TrainConfig) -> None:
        self.settings = settings
        self.tracking_uri = tracking_uri
        self.config = config
        self.client: Any = None
        self.run_id: str | None = None

    def start(self, config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(MLFLOW_REQUEST_TIMEOUT_S))
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(MLFLOW_REQUEST_RETRIES))
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        name = self.settings.experiment_name or DEFAULT_MLFLOW_EXPERIMENT
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self._create_experiment(name)
        found = (
            self.client.search_runs(
                [experiment_id], f"tags.`{JOB_ID_TAG}` = '{self.config.job_id}'", max_results=1
            )  # fmt: skip
            if self.config.job_id
            else []
        )
        if found:  # the same job, resumed: one run
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            tags = {
                **(self.settings.tags or {}),
                **({JOB_ID_TAG: self.config.job_id} if self.config.job_id else {}),
            }
            run = self.client.create_run(experiment_id, run_name=self.settings.run_name or self.config.job_id,
                                         tags=tags)  # fmt: skip
            self.run_id = run.info.run_id
            self._log_params({key: str(value) for key, value in flatten(config).items()})
        url = f"{self.tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{self.run_id}"
        data = {"event": "tracking", "tracker": "mlflow", "run_id": self.run_id,
                "experiment_id": experiment_id, "url": url}  # fmt: skip
        return f"MLflow run {self.run_id}: {url}", data

    def _create_experiment(self, name: str) -> str:
        try:
            return self.client.create_experiment(name)
        except Exception:
            experiment = self.client.get_experiment_by_name(name)  # another job created it meanwhile
            if experiment is None:
                raise
            return experiment.experiment_id

    def log_config(self, values: dict[str, Any]) -> None:
        # Parameters cannot change once logged: what the run resolved goes under run.*; a resumed run's are there.
        logged = self.client.get_run(self.run_id).data.params
        self._log_params({f"run.{k}": str(v) for k, v in flatten(values).items() if f"run.{k}" not in logged})

    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(key, value[:MLFLOW_PARAM_CHARS]) for key, value in params.items()]
        for start in range(0, len(items), MLFLOW_BATCH_PARAMS):
            self.client.log_batch(self.run_id, params=items[start : start + MLFLOW_BATCH_PARAMS])

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        metrics = [Metric(name, value, now_ms, step) for name, value in finite_numbers(values).items()]
        for start in range(0, len(metrics), MLFLOW_BATCH_METRICS):
            self.client.log_batch(self.run_id, metrics=metrics[start : start + MLFLOW_BATCH_METRICS])

    def finish(self, outcome: str, events: list[dict[str, Any]]) -> None:
        if events:
            lines = "".join(json.dumps(event) + "\n" for event in events)
            self.client.log_text(self.run_id, lines, "fusetune_events.jsonl")
        status = {"finished": "FINISHED", "stopped": "KILLED"}.get(outcome, "FAILED")
        self.client.set_terminated(self.run_id, status=status)


def reported_path(path: Path, config: TrainConfig) -> str:
    """A path as the job's events name it: relative to the runs directory, as checkpoints are."""
    base = config.checkpoint_paths_relative_to
    return os.path.relpath(path, base) if base else str(path)


def run_config(config: TrainConfig) -> dict[str, Any]:
    """What a tracker records of the job at its start: its hyperparameters and method, seed, job and model
    (by its folder's name; no path or database address of the server)."""
    fields = set(TrainingHyperparameters.model_fields) | {"method", "seed"}
    return {
        **config.model_dump(mode="json", include=fields),
        "job_id": config.job_id,
        "model": Path(config.model_path).name,
    }


def trackers_of(config: TrainConfig) -> list[Tracker]:
    trackers: list[Tracker] = []
    mlflow_settings: MlflowSettings | None = None
    for integration in config.integrations:
        if integration.type == "wandb":
            trackers.append(WandbTracker(integration.wandb, config))
        else:
            mlflow_settings = integration.mlflow
    tracking_uri = (mlflow_settings.tracking_uri if mlflow_settings else None) or config.mlflow_tracking_uri
    if tracking_uri:
        trackers.append(MlflowTracker(mlflow_settings or MlflowSettings(), tracking_uri, config))
    return trackers


class TrackingReporter:
    """The run's reporter that also tells its trackers; every call still goes to `inner` first."""

    def __init__(self, inner: Reporter, trackers: list[Tracker], config: dict[str, Any]) -> None:
        self.inner = inner
        self.trackers: list[Tracker] = []
        self.events: list[dict[str, Any]] = []
        self.outcome = "failed"  # until the run's `finished` or `stopped` event says otherwise
        for tracker in trackers:
            started = self._guard(
                tracker, "starting the run", lambda t=tracker: t.start(config), enabled=False
            )
            if started is not None:
                self.trackers.append(tracker)
                message, data = started
                self.inner.event(message, data=data)

    def _guard(self, tracker: Tracker, what: str, call, enabled: bool = True) -> Any:
        """`call()`, or None when it raised: the tracker is then switched off and the job told why."""
        try:
            return call()
        except Exception as exc:  # a tracker never fails the job, whatever its library raises
            if enabled:
                self.trackers.remove(tracker)
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:500]
            self.inner.event(
                f"{tracker.name} tracking stopped ({what} failed: {error}); training goes on without it",
                level="warning",
                data={"event": "tracking_error", "tracker": tracker.name, "error": error},
            )
            return None

    def _each(self, what: str, call) -> None:
        for tracker in list(self.trackers):
            self._guard(tracker, what, lambda t=tracker: call(t))

    def event(
        self, message: str, *, level: str = "info", type: str = "message", data: dict[str, Any] | None = None
    ) -> None:
        self.inner.event(message, level=level, type=type, data=data)
        self.events.append({"created_at": int(time.time()), "level": level, "message": message,
                            "data": data or {}})  # fmt: skip
        kind = (data or {}).get("event")
        if kind == "started":
            self._each("logging the configuration", lambda t: t.log_config(data))
        elif kind == "finished":
            self.outcome = "finished"
        elif kind == "stopped":
            self.outcome = "stopped"

    def metric(
        self, step: int, values: dict[str, float], rank_memory: list[dict[str, Any]] | None = None
    ) -> None:
        self.inner.metric(step, values, rank_memory)
        self._each(f"logging step {step}", lambda t: t.log_metrics(step, values))

    def checkpoint(self, step: int, path: str, metrics: dict[str, float]) -> None:
        self.inner.checkpoint(step, path, metrics)

    def checkpoints_deleted(self, paths: list[str]) -> None:
        self.inner.checkpoints_deleted(paths)

    def best_checkpoint(self, path: str) -> None:
        self.inner.best_checkpoint(path)

    def resolved(self, plan: dict[str, Any]) -> None:
        self.inner.resolved(plan)

    def stop_request(self) -> StopRequest | None:
        return self.inner.stop_request()

    def close(self) -> None:
        self._each("ending the run", lambda t: t.finish(self.outcome, self.events))
        self.inner.close()


def with_trackers(reporter: Reporter, config: TrainConfig, is_main_process: bool) -> Reporter:
    """Rank 0's reporter, wrapped when the job has anything to track to; other ranks report nothing."""
    trackers = trackers_of(config) if is_main_process else []
    return TrackingReporter(reporter, trackers, run_config(config)) if trackers else reporter
