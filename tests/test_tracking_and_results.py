"""What a user watches and trusts, through a running service and the unmodified `openai` SDK: a job tracked to
W&B (offline, its files read back) and to a real `mlflow server` (read back through MLflow's client), its
results file, checkpoint metrics and trained tokens, and early stopping (a running job's estimated finish:
tests/api/test_dashboard.py's running job and tests/worker/test_results.py).

One test holds the MLflow server and the service, so that each starts once (CI's two pytest workers would each
start a module's fixtures). Every wait is on the job's own status, rows or events."""

from __future__ import annotations

import csv
import io
import json
import time
from pathlib import Path

import openai
import pytest

from fusetune.demo.assets import TRAIN_FILE, VALID_FILE, build_tiny_model
from fusetune.worker.results import OPENAI_COLUMNS
from fusetune.worker.train.config import TrainConfig
from fusetune.worker.train.tracking import JOB_ID_TAG, with_trackers
from tests.services import mlflow_server, running_service
from tests.wandb_files import read_offline_run

pytestmark = pytest.mark.slow
MODEL = "tiny-llama"


def _lines(path: Path, count: int) -> bytes:
    return "".join(path.read_text().splitlines(keepends=True)[:count]).encode()


def _wait(client: openai.OpenAI, job_id: str) -> openai.types.fine_tuning.FineTuningJob:
    while (job := client.fine_tuning.jobs.retrieve(job_id)).status not in (
        "succeeded",
        "failed",
        "cancelled",
    ):
        time.sleep(0.3)
    return job


def test_a_job_is_tracked_to_wandb_and_mlflow_and_reports_openais_fields(tmp_path):
    from mlflow.tracking import MlflowClient

    data_dir = tmp_path / "data"
    build_tiny_model(data_dir / "models" / MODEL)
    with (
        mlflow_server(tmp_path) as mlflow_uri,
        running_service(data_dir, extra_env={"FUSETUNE_MLFLOW_TRACKING_URI": mlflow_uri}) as service,
    ):
        client = openai.OpenAI(base_url=f"{service.base_url}/v1", api_key=service.api_key, max_retries=0)
        training = client.files.create(file=("train.jsonl", _lines(TRAIN_FILE, 64)), purpose="fine-tune")
        validation = client.files.create(file=("valid.jsonl", _lines(VALID_FILE, 8)), purpose="fine-tune")

        # Two processes, tracked to W&B by the job and to MLflow at the server's FUSETUNE_MLFLOW_TRACKING_URI (the
        # job names only its experiment), evaluated every 4 steps; no evaluation after the first can improve by 100, so early
        # stopping ends it at step 8 of 16 on step 4's checkpoint.
        job = client.fine_tuning.jobs.create(
            model=MODEL, training_file=training.id, validation_file=validation.id, seed=2,
            integrations=[
                {"type": "wandb", "wandb": {"project": "digits", "name": "sdk run", "tags": ["ci"]}},
                {"type": "mlflow", "mlflow": {"experiment_name": "digits", "tags": {"suite": "sdk"}}},
            ],
            method={"type": "supervised", "supervised": {"hyperparameters": {
                "n_epochs": 2, "batch_size": 8, "learning_rate_multiplier": 20, "n_gpus": 2, "eval_every_steps": 4,
                "early_stopping": {"patience": 1, "min_delta": 100.0}}}},
        )  # fmt: skip
        assert [i.type for i in job.integrations] == ["wandb", "mlflow"]
        done = _wait(client, job.id)
        assert done.status == "succeeded", done.error
        assert done.estimated_finish is None  # only while it runs

        metrics = service.client.get(f"/v1/fine_tuning/jobs/{job.id}/metrics").json()["data"]
        assert [m["step"] for m in metrics] == list(range(1, 9))
        assert done.trained_tokens == metrics[-1]["values"]["trained_tokens"] > 0
        events = list(client.fine_tuning.jobs.list_events(job.id, limit=100))
        (stopped,) = [e.data for e in events if (e.data or {}).get("event") == "early_stopped"]
        assert (stopped["step"], stopped["best_step"]) == (8, 4)

        # The results file: a CSV file object with OpenAI's columns, one row per step.
        (result_id,) = done.result_files
        assert client.files.retrieve(result_id).purpose == "fine-tune-results"
        rows = list(csv.DictReader(io.StringIO(client.files.content(result_id).text)))
        assert list(rows[0]) == list(OPENAI_COLUMNS)
        assert [int(r["step"]) for r in rows] == list(range(1, 9))
        assert [float(r["train_loss"]) for r in rows] == [m["train_loss"] for m in metrics]
        assert [r["step"] for r in rows if r["valid_loss"]] == ["4", "8"]
        assert all(0 <= float(r["train_mean_token_accuracy"]) <= 1 for r in rows)

        # The best checkpoint is the job's model, marked, with OpenAI's metrics over the whole validation file.
        (checkpoint,) = client.fine_tuning.jobs.checkpoints.list(job.id).data
        step_4 = metrics[3]["values"]
        assert checkpoint.step_number == 4 and checkpoint.model_extra["best"] is True
        assert checkpoint.metrics.step == 4 and checkpoint.metrics.train_loss == metrics[3]["train_loss"]
        assert checkpoint.metrics.full_valid_loss == checkpoint.metrics.valid_loss == step_4["valid_loss"]
        assert checkpoint.metrics.full_valid_mean_token_accuracy == step_4["valid_mean_token_accuracy"]
        assert checkpoint.metrics.train_mean_token_accuracy == step_4["train_mean_token_accuracy"]

        # W&B: one offline run (rank 0 only) in the job's run folder, every step, the job's configuration.
        (wandb_event,) = [e.data for e in events if (e.data or {}).get("tracker") == "wandb"]
        (folder,) = (service.settings.runs_dir / job.id / "wandb").glob("offline-run-*")
        assert wandb_event["path"] == f"{job.id}/wandb/{folder.name}"
        run = read_offline_run(folder)
        assert (run.run_id, run.project, run.name, run.tags) == (job.id, "digits", "sdk run", ["ci"])
        assert run.config["early_stopping"] == {"patience": 1, "min_delta": 100.0}
        assert run.config["run"]["world_size"] == 2
        history = {h["_step"]: h["train_loss"] for h in run.history if "train_loss" in h}
        assert history == {m["step"]: m["train_loss"] for m in metrics}

        # MLflow: one run of the job in its experiment, every step once, its events, FINISHED.
        mlflow = MlflowClient(tracking_uri=mlflow_uri)
        experiment = mlflow.get_experiment_by_name("digits")
        (found,) = mlflow.search_runs([experiment.experiment_id], f"tags.`{JOB_ID_TAG}` = '{job.id}'")
        assert found.info.status == "FINISHED" and found.data.tags["suite"] == "sdk"
        assert found.data.params["eval_every_steps"] == "4" and found.data.params["run.world_size"] == "2"
        losses = mlflow.get_metric_history(found.info.run_id, "train_loss")
        assert [(m.step, m.value) for m in losses] == [(m["step"], m["train_loss"]) for m in metrics]
        assert [m.step for m in mlflow.get_metric_history(found.info.run_id, "valid_loss")] == [4, 8]
        logged = Path(mlflow.download_artifacts(found.info.run_id, "fusetune_events.jsonl", str(tmp_path)))
        assert any(json.loads(line)["data"].get("event") == "early_stopped" for line in logged.open())

        # A job that resumes (a pause, a retry) continues its one MLflow run; a stopped attempt ends KILLED.
        config = TrainConfig(job_id="ftjob-resumed", model_path="tiny-llama", training_file="t.jsonl",
                             output_dir=str(tmp_path / "resumed"), mlflow_tracking_uri=mlflow_uri)  # fmt: skip
        default = None
        for attempt, (outcome, steps) in enumerate((("stopped", (1, 2)), ("finished", (3,)))):
            reporter = with_trackers(_Quiet(), config, is_main_process=True)
            for step in steps:
                reporter.metric(step, {"train_loss": 1.0 / step})
            reporter.event(outcome, data={"event": outcome})
            reporter.close()
            default = default or mlflow.get_experiment_by_name("fusetune")
            (resumed,) = mlflow.search_runs([default.experiment_id], f"tags.`{JOB_ID_TAG}` = 'ftjob-resumed'")
            assert resumed.info.status == ("KILLED", "FINISHED")[attempt]
        assert [m.step for m in mlflow.get_metric_history(resumed.info.run_id, "train_loss")] == [1, 2, 3]


class _Quiet:
    """A reporter that keeps nothing (the service's SQL reporter is not needed to reach MLflow)."""

    def event(self, *args, **kwargs): ...
    def metric(self, step, values, rank_memory=None): ...
    def close(self): ...
