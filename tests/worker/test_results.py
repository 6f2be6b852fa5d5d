"""The results file's columns, and a running job's trained_tokens and estimated_finish from its reporter."""

from __future__ import annotations

import csv
import io
import time

import torch

from fusetune.config import Settings
from fusetune.db import queries
from fusetune.db.models import JobStatus
from fusetune.worker.results import LOOP_METRICS, OPENAI_COLUMNS, results_csv
from fusetune.worker.train.metrics import StepMeter, StepStats
from fusetune.worker.train.reporter import SqlReporter
from tests.worker.job_database import database_with_one_job


def _rows(text: bytes) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(text.decode())))


def test_supervised_results_have_openais_columns_and_validation_only_where_evaluated():
    rows = [
        (1, {"train_loss": 2.5, "train_mean_token_accuracy": 0.25, "learning_rate": 1e-3, "tokens_per_second": 9.0}),
        (2, {"train_loss": 2.0, "train_mean_token_accuracy": 0.5, "valid_loss": 2.25,
             "valid_mean_token_accuracy": 0.375, "eta_s": 3.0, "grad_norm": None}),
    ]  # fmt: skip
    text = results_csv(rows)
    assert text.decode().splitlines()[0] == ",".join(OPENAI_COLUMNS)
    assert _rows(text) == [
        {"step": "1", "train_loss": "2.5", "train_mean_token_accuracy": "0.25", "valid_loss": "",
         "valid_mean_token_accuracy": ""},
        {"step": "2", "train_loss": "2.0", "train_mean_token_accuracy": "0.5", "valid_loss": "2.25",
         "valid_mean_token_accuracy": "0.375"},
    ]  # fmt: skip


def test_a_preference_job_adds_its_reward_metrics_after_openais_columns():
    rows = [
        (1, {"train_loss": 0.69, "reward_accuracy": 0.0, "reward_margin": 0.0, "mfu": 0.1}),
        (2, {"train_loss": 0.5, "reward_accuracy": 0.75, "reward_margin": 0.5, "valid_loss": 0.6,
             "valid_reward_accuracy": 0.5, "valid_reward_margin": 0.25, "train_mean_token_accuracy": float("nan")}),
    ]  # fmt: skip
    parsed = _rows(results_csv(rows))
    assert list(parsed[0]) == [*OPENAI_COLUMNS, "reward_accuracy", "reward_margin", "valid_reward_accuracy",
                               "valid_reward_margin"]  # fmt: skip
    assert parsed[1]["valid_reward_accuracy"] == "0.5" and parsed[1]["train_mean_token_accuracy"] == ""
    assert parsed[0]["valid_reward_margin"] == ""


def test_the_loops_own_metrics_are_left_out_of_the_results():
    """Every name StepMeter reports besides train_loss is one of LOOP_METRICS: a new loop metric must be named
    there, or it would become a column of every job's results file."""
    model = torch.nn.Linear(4, 4)
    meter = StepMeter(model, world_size=1, steps_per_epoch=4, total_steps=8, peak_flops=1e12)
    stats = StepStats(losses=torch.tensor([1.0]), metric_names=(), grad_norm=torch.tensor(1.0),
                      counts=torch.tensor([4, 4, 4, 4]), learning_rate=1e-3, attended_length=4.0)  # fmt: skip
    values = meter.step_values(stats.read(), stats, 0.5, (1.0, 2.0), step=1, trained_tokens=4)
    assert set(values) - {"train_loss"} == LOOP_METRICS
    values["valid_loss"] = 0.5  # the loop adds the step's evaluation to the same values
    assert meter.checkpoint_metrics(1) == {"step": 1.0, "train_loss": 1.0, "valid_loss": 0.5,
                                           "full_valid_loss": 0.5}  # fmt: skip


def test_a_running_jobs_trained_tokens_and_estimated_finish_follow_its_steps(tmp_path):
    settings = Settings(data_dir=tmp_path)
    sessions = database_with_one_job(settings, "ftjob-r", JobStatus.RUNNING, model="m")
    reporter = SqlReporter(settings.database_url, "ftjob-r")
    before = int(time.time())
    reporter.metric(1, {"train_loss": 1.0, "trained_tokens": 512, "eta_s": 120.0})
    with sessions() as session:
        job = queries.get_job(session, "ftjob-r")
        assert job.trained_tokens == 512 and before + 120 <= job.estimated_finish <= int(time.time()) + 120
        queries.finish_job(session, "ftjob-r", JobStatus.CANCELLED)
        session.commit()
    reporter.metric(2, {"train_loss": 1.0, "trained_tokens": 1024, "eta_s": 60.0})  # a step after the cancel
    with sessions() as session:
        assert queries.get_job(session, "ftjob-r").trained_tokens == 512  # a finished job keeps its numbers
    reporter.close()
