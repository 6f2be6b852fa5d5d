"""Tracking to W&B (offline, read back from the files wandb writes), which MLflow server a job reports to, and
trackers that fail without failing anything. A job tracked to a real MLflow server through the service:
tests/test_tracking_and_results.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fusetune.worker.train.config import TrainConfig
from fusetune.worker.train.tracking import (
    MlflowTracker,
    Tracker,
    TrackingReporter,
    trackers_of,
    with_trackers,
)
from tests.services import free_port
from tests.wandb_files import read_offline_run

pytestmark = pytest.mark.slow


class RecordingReporter:
    """The run's own reporter (SQL in the service): what reached it."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.metrics: list[tuple[int, dict]] = []
        self.closed = False

    def event(self, message, *, level="info", type="message", data=None):
        self.events.append({"message": message, "level": level, "data": data or {}})

    def metric(self, step, values, rank_memory=None):
        self.metrics.append((step, values))

    def checkpoint(self, step, path, metrics): ...
    def checkpoints_deleted(self, paths): ...
    def best_checkpoint(self, path): ...
    def resolved(self, plan): ...
    def stop_request(self):
        return None

    def close(self):
        self.closed = True


def _config(tmp_path: Path, integrations: list, **fields) -> TrainConfig:
    return TrainConfig(
        job_id="ftjob-tracking1", model_path=str(tmp_path / "tiny-llama"), training_file="t.jsonl",
        output_dir=str(tmp_path / "runs" / "ftjob-tracking1"), checkpoint_paths_relative_to=str(tmp_path / "runs"),
        database_url="postgresql://user:secret@db/fusetune", n_epochs=2, integrations=integrations, **fields,
    )  # fmt: skip


def _run(reporter, steps: int = 3, outcome_event: str = "finished") -> None:
    """What a trainer reports over a short run."""
    reporter.event("Training started", data={"event": "started", "precision": "fp32", "world_size": 1})
    for step in range(1, steps + 1):
        values = {"train_loss": 2.0 / step, "learning_rate": 1e-3, "tokens_per_second": 100.0 * step}
        if step == steps:
            values.update(valid_loss=1.5, valid_mean_token_accuracy=0.25)
        reporter.metric(step, values)
    reporter.event(f"Evaluation at step {steps}", data={"event": "eval", "step": steps})
    reporter.event(
        "Training finished" if outcome_event == "finished" else "stopped", data={"event": outcome_event}
    )
    reporter.close()


def test_a_run_reaches_wandb_offline_with_its_config_steps_and_events(tmp_path):
    config = _config(tmp_path, [{"type": "wandb", "wandb": {"project": "digits", "name": "first try",
                                                            "tags": ["ci", "tiny"]}}])  # fmt: skip
    inner = RecordingReporter()
    reporter = with_trackers(inner, config, is_main_process=True)
    assert isinstance(reporter, TrackingReporter)
    _run(reporter)
    assert inner.closed and [step for step, _ in inner.metrics] == [1, 2, 3]  # the job's own record is whole
    (where,) = [e["data"] for e in inner.events if e["data"].get("event") == "tracking"]
    assert not [e for e in inner.events if e["level"] != "info"], inner.events
    # Offline (no key here), in the job's run folder, named by a path relative to the runs directory.
    assert where["mode"] == "offline" and where["path"].startswith("ftjob-tracking1/wandb/offline-run-")
    run = read_offline_run(tmp_path / "runs" / where["path"])
    assert (run.run_id, run.project, run.name, run.tags) == (
        "ftjob-tracking1",
        "digits",
        "first try",
        ["ci", "tiny"],
    )
    assert run.config["n_epochs"] == 2 and run.config["model"] == "tiny-llama"
    assert run.config["run"]["precision"] == "fp32"  # what the started event resolved
    assert "secret" not in json.dumps(run.config)  # no database address, no server path
    steps = {h["_step"]: h for h in run.history if "train_loss" in h}
    assert sorted(steps) == [1, 2, 3] and steps[2]["train_loss"] == 1.0 and steps[3]["valid_loss"] == 1.5
    events = run.table("events")
    assert events["columns"] == ["created_at", "level", "message", "data"]
    assert [row[2] for row in events["data"]][-2:] == ["Evaluation at step 3", "Training finished"]
    assert run.exit_code == 0


def test_the_servers_mlflow_setting_tracks_every_job_and_a_job_may_name_its_own_server(tmp_path):
    assert [type(t).__name__ for t in trackers_of(_config(tmp_path, []))] == []
    (server,) = trackers_of(_config(tmp_path, [], mlflow_tracking_uri="http://mlflow.internal:5000"))
    assert isinstance(server, MlflowTracker) and server.tracking_uri == "http://mlflow.internal:5000"
    own = {"type": "mlflow", "mlflow": {"tracking_uri": "https://mlflow.example", "experiment_name": "x"}}
    (job,) = trackers_of(_config(tmp_path, [own], mlflow_tracking_uri="http://mlflow.internal:5000"))
    assert job.tracking_uri == "https://mlflow.example" and job.settings.experiment_name == "x"
    (named,) = trackers_of(_config(tmp_path, [{"type": "mlflow", "mlflow": {"experiment_name": "y"}}],
                                   mlflow_tracking_uri="http://mlflow.internal:5000"))  # fmt: skip
    assert named.tracking_uri == "http://mlflow.internal:5000" and named.settings.experiment_name == "y"


def test_other_ranks_and_jobs_without_integrations_track_nothing(tmp_path):
    inner = RecordingReporter()
    config = _config(tmp_path, [{"type": "wandb", "wandb": {"project": "p"}}])
    assert with_trackers(inner, config, is_main_process=False) is inner
    assert with_trackers(inner, _config(tmp_path, []), is_main_process=True) is inner
    assert not (tmp_path / "runs").exists()


class _FailsOnStep(Tracker):
    name = "Flaky"

    def __init__(self, step: int):
        self.failing_step, self.logged = step, []

    def start(self, config):
        return "Flaky run", {"event": "tracking"}

    def log_config(self, values): ...

    def log_metrics(self, step, values):
        if step == self.failing_step:
            raise ConnectionError("the tracking server went away")
        self.logged.append(step)

    def finish(self, outcome, events):
        raise AssertionError("a tracker that failed is not asked again")


def test_a_tracker_that_fails_or_is_unreachable_never_fails_the_run(tmp_path):
    # Nothing listens on this port: MLflow cannot start its run.
    unreachable = f"http://127.0.0.1:{free_port()}"
    config = _config(tmp_path, [{"type": "mlflow", "mlflow": {"tracking_uri": unreachable}}])
    inner = RecordingReporter()
    reporter = with_trackers(inner, config, is_main_process=True)
    _run(reporter)
    (warning,) = [e for e in inner.events if e["level"] == "warning"]
    assert warning["message"].startswith("MLflow tracking stopped (starting the run failed: ")
    assert warning["data"]["event"] == "tracking_error" and [s for s, _ in inner.metrics] == [1, 2, 3]

    flaky = _FailsOnStep(2)
    inner = RecordingReporter()
    _run(TrackingReporter(inner, [flaky], config={}))
    assert flaky.logged == [1] and [s for s, _ in inner.metrics] == [1, 2, 3] and inner.closed
    (warning,) = [e for e in inner.events if e["level"] == "warning"]
    assert "logging step 2 failed: ConnectionError: the tracking server went away" in warning["message"]
