"""Early stopping: the counting on its own, and a real trainer that stops, keeps its best checkpoint as its
final one (through pruning and a pause), and reports OpenAI's checkpoint metrics."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fusetune.demo import assets
from fusetune.spec.hyperparameters import EarlyStoppingSpec
from fusetune.worker.train.checkpoints import layout
from fusetune.worker.train.config import TrainConfig
from fusetune.worker.train.distributed import DistInfo
from fusetune.worker.train.early_stopping import EarlyStopping
from fusetune.worker.train.outcome import JobStopped
from fusetune.worker.train.reporter import NullReporter, StopRequest
from fusetune.worker.train.trainer import Trainer

ONE_CPU_RANK = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


class Recorder(NullReporter):
    def __init__(self, pause_at_check: int | None = None):
        self.events, self.metrics, self.checkpoints, self.deleted, self.best = [], [], [], [], []
        self._pause_at_check, self._checks = pause_at_check, 0

    def event(self, message, *, level="info", type="message", data=None):
        self.events.append((message, data or {}))

    def metric(self, step, values, rank_memory=None):
        self.metrics.append((step, values))

    def checkpoint(self, step, path, metrics):
        self.checkpoints.append((step, path, metrics))

    def checkpoints_deleted(self, paths):
        self.deleted.extend(paths)

    def best_checkpoint(self, path):
        self.best.append(path)

    def stop_request(self):
        self._checks += 1
        return StopRequest.PAUSE if self._pause_at_check == self._checks else None


def _stopper(patience: int, min_delta: float = 0.0, reporter=None) -> EarlyStopping:
    checkpoints = SimpleNamespace(keep=None, config=SimpleNamespace(output_dir="/run"))
    return EarlyStopping(EarlyStoppingSpec(patience=patience, min_delta=min_delta), checkpoints,
                         reporter or NullReporter())  # fmt: skip


def test_patience_counts_evaluations_without_an_improvement_larger_than_min_delta():
    stopper = _stopper(patience=2, min_delta=0.1)
    assert stopper.observe(1, 2.0)  # the first evaluation is the best so far
    assert not stopper.observe(2, 1.95)  # better, but not by more than min_delta
    assert stopper.observe(3, 1.8)  # better by more: the count starts again
    assert not stopper.observe(4, 1.8) and not stopper.stopped  # equal is no improvement: one
    assert not stopper.observe(5, 3.0) and stopper.stopped  # two in a row
    assert (stopper.best_step, stopper.best_loss) == (3, 1.8)
    assert not stopper.observe(6, 0.1)  # nothing counts once stopped

    # The state a checkpoint carries continues the count in a resumed run.
    resumed = _stopper(patience=2, min_delta=0.1)
    stopper = _stopper(patience=2, min_delta=0.1)
    stopper.observe(1, 2.0), stopper.observe(2, 2.5)
    resumed.load_state_dict(json.loads(json.dumps(stopper.state_dict())))
    assert resumed.checkpoints.keep == Path("/run/checkpoints/step-1")  # its best is never pruned
    assert not resumed.observe(3, 2.2) and resumed.stopped
    again = _stopper(patience=2, min_delta=0.1)
    again.load_state_dict(resumed.state_dict())  # paused at the step it stopped: it stays stopped
    assert again.stopped and again.best_step == 1

    off = EarlyStopping(None, SimpleNamespace(), NullReporter())
    assert not any(off.observe(step, 1.0 / step) for step in range(1, 10)) and not off.stopped
    assert not _stopper(patience=1).observe(1, None)  # a method without a validation loss


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return assets.build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    train = assets.write_demo_dataset(folder / "train.jsonl", n_examples=48, seed=5)
    valid = assets.write_demo_dataset(folder / "valid.jsonl", n_examples=8, seed=6)
    return train, valid


def _config(model_dir, data, output_dir: Path, **overrides) -> TrainConfig:
    train, valid = data
    return TrainConfig(**{
        "model_path": str(model_dir), "training_file": str(train), "validation_file": str(valid),
        "output_dir": str(output_dir), "checkpoint_paths_relative_to": str(output_dir.parent), "n_epochs": 2,
        "batch_size": 8, "learning_rate": 3e-3, "max_seq_length": 128, "eval_every_steps": 1,
        "checkpoint_every_steps": 1, "keep_last_checkpoints": 1, **overrides,
    })  # fmt: skip


def test_a_run_stops_early_and_ends_on_its_best_checkpoint(model_dir, data, tmp_path):
    # No evaluation after the first can improve by 100: the run stops after two more, at step 3 of 12.
    output = tmp_path / "run"
    reporter = Recorder()
    config = _config(model_dir, data, output, early_stopping={"patience": 2, "min_delta": 100.0})
    result = Trainer(config, ONE_CPU_RANK, reporter).train()
    assert result.steps == 3 and [step for step, _ in reporter.metrics] == [1, 2, 3]
    # Step 1's checkpoint survived keep_last_checkpoints=1; those after it are gone: it is the model.
    assert result.final_checkpoint == str(layout.checkpoint_path(output, 1))
    assert [step for step, _ in layout.list_checkpoints(output)] == [1]
    assert sorted(reporter.deleted) == ["run/checkpoints/step-2", "run/checkpoints/step-3"]
    assert reporter.best == ["run/checkpoints/step-1"]
    (why,) = [data for _, data in reporter.events if data.get("event") == "early_stopped"]
    assert (why["step"], why["best_step"], why["patience"]) == (3, 1, 2)
    assert why["best_valid_loss"] == reporter.metrics[0][1]["valid_loss"]

    # OpenAI's checkpoint metrics: the step, its training loss, the whole validation file's numbers twice.
    step, _, metrics = reporter.checkpoints[0]
    values = reporter.metrics[0][1]
    assert step == 1 and metrics["step"] == 1.0 and metrics["train_loss"] == values["train_loss"]
    assert metrics["full_valid_loss"] == metrics["valid_loss"] == values["valid_loss"]
    assert metrics["full_valid_mean_token_accuracy"] == values["valid_mean_token_accuracy"]
    assert metrics["train_mean_token_accuracy"] == values["train_mean_token_accuracy"]
    assert 0 <= values["train_mean_token_accuracy"] <= 1
    assert 0 < values["trained_tokens"] < reporter.metrics[-1][1]["trained_tokens"] == result.trained_tokens


def test_a_paused_run_counts_on_from_where_it_stopped(model_dir, data, tmp_path):
    output = tmp_path / "run"
    config = _config(model_dir, data, output, early_stopping={"patience": 2, "min_delta": 100.0})
    with pytest.raises(JobStopped):
        Trainer(config, ONE_CPU_RANK, Recorder(pause_at_check=2)).train()  # paused after step 2
    reporter = Recorder()
    result = Trainer(config, ONE_CPU_RANK, reporter).train()
    # Had it forgotten step 1's loss and the evaluation since, step 3 would be a new best and it would go on.
    assert result.steps == 3 and [step for step, _ in reporter.metrics] == [3]
    assert result.final_checkpoint == str(layout.checkpoint_path(output, 1))
    assert not math.isinf(json.loads((output / "checkpoints/step-1" / layout.TRAINER_STATE_FILENAME).read_text())
                          [layout.STATE_METRICS]["full_valid_loss"])  # fmt: skip
