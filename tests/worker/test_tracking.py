"""Tracking to W&B (offline, read back from the files wandb writes) and to a real MLflow server (read back
through MLflow's client), and trackers that fail without failing anything."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fusetune.worker.train.config import TrainConfig
from fusetune.worker.train.tracking import JOB_ID_TAG, Tracker, TrackingReporter, with_trackers
from tests.services import free_port, mlflow_server
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

    def metric(self, step, values):
        self.metrics.append((step, values))

    def checkpoint(self, step, path, metrics): ...
    def checkpoints_deleted(self, paths): ...
    def best_checkpoint(self, path): ...
    def resolved(self, plan): ...
    def stop_request(self):
        return None

    def close(self):
        self.closed = True


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory):
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as uri:
        yield uri


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


def test_a_run_reaches_wandb_offline_and_a_real_mlflow_server(tmp_path, mlflow_uri):
    from mlflow.tracking import MlflowClient

    config = _config(tmp_path, [
        {"type": "wandb", "wandb": {"project": "digits", "name": "first try", "tags": ["ci", "tiny"]}},
        {"type": "mlflow", "mlflow": {"tracking_uri": mlflow_uri, "experiment_name": "digits",
                                      "tags": {"team": "ml"}}},
    ])  # fmt: skip
    inner = RecordingReporter()
    reporter = with_trackers(inner, config, is_main_process=True)
    assert isinstance(reporter, TrackingReporter)
    _run(reporter)
    assert inner.closed and [step for step, _ in inner.metrics] == [1, 2, 3]  # the job's own record is whole
    where = {e["data"]["tracker"]: e["data"] for e in inner.events if e["data"].get("event") == "tracking"}
    assert set(where) == {"wandb", "mlflow"}, inner.events
    assert not [e for e in inner.events if e["level"] != "info"], inner.events

    # W&B: offline (no key here), in the job's run folder, named by a path relative to the runs directory.
    wandb = where["wandb"]
    assert wandb["mode"] == "offline" and wandb["path"].startswith("ftjob-tracking1/wandb/offline-run-")
    run = read_offline_run(tmp_path / "runs" / wandb["path"])
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

    # MLflow: one run, tagged with the job, with its parameters, every step, the events and its status.
    client = MlflowClient(tracking_uri=mlflow_uri)
    experiment = client.get_experiment_by_name("digits")
    (found,) = client.search_runs([experiment.experiment_id], f"tags.`{JOB_ID_TAG}` = 'ftjob-tracking1'")
    assert found.info.run_name == "ftjob-tracking1" and found.info.status == "FINISHED"
    assert found.data.tags["team"] == "ml" and where["mlflow"]["run_id"] == found.info.run_id
    assert where["mlflow"]["url"].startswith(mlflow_uri)
    params = found.data.params
    assert (
        params["n_epochs"] == "2"
        and params["run.precision"] == "fp32"
        and params["method.type"] == "supervised"
    )
    history = client.get_metric_history(found.info.run_id, "train_loss")
    assert [(m.step, m.value) for m in history] == [(1, 2.0), (2, 1.0), (3, 2.0 / 3)]
    assert [m.step for m in client.get_metric_history(found.info.run_id, "valid_loss")] == [3]
    artifact = Path(client.download_artifacts(found.info.run_id, "fusetune_events.jsonl", str(tmp_path)))
    logged = [json.loads(line) for line in artifact.read_text().splitlines()]
    assert logged[-1]["data"] == {"event": "finished"}

    # The same job, resumed (a pause, a retry): the same MLflow run goes on; a stopped attempt is KILLED.
    inner = RecordingReporter()
    _run(with_trackers(inner, config, is_main_process=True), steps=4, outcome_event="stopped")
    runs = client.search_runs([experiment.experiment_id], f"tags.`{JOB_ID_TAG}` = 'ftjob-tracking1'")
    assert [r.info.run_id for r in runs] == [found.info.run_id] and runs[0].info.status == "KILLED"
    assert len(client.get_metric_history(found.info.run_id, "train_loss")) == 7


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
