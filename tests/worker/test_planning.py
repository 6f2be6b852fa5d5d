"""The run's memory plan on the worker: the whole plan decided before the model loads (the GPU's free memory and
the disk's free space are arguments), and the started event that names it."""

import dataclasses
import math

import pytest
import torch

from fusetune.demo import assets
from fusetune.spec.estimate import DataCounts, ModelShape, checkpoint_bytes, estimate_job
from fusetune.spec.hyperparameters import JobHyperparameters
from fusetune.spec.job import JobSpec
from fusetune.spec.plan import MemoryPlan
from fusetune.spec.planner import PLANNABLE_FRACTION
from fusetune.worker.train.checkpoints import layout
from fusetune.worker.train.checkpoints.state import (
    RESUME_RUN,
    RUN_MEMORY_PLAN,
    RUN_PRECISION,
    read_resume_state,
    write_training_state,
)
from fusetune.worker.train.config import TrainConfig
from fusetune.worker.train.distributed import DistInfo
from fusetune.worker.train.outcome import ErrorCode, TrainingFailure
from fusetune.worker.train.planning import free_gpu_memory_bytes, plan_training
from fusetune.worker.train.reporter import NullReporter
from fusetune.worker.train.trainer import Trainer

PLAN_FIELDS = (
    "micro_batch_size", "recompute_layers", "offload_layers", "precision", "optimizer_in_backward",
    "optimizer_state_on_host",
)  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return assets.build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _config(model_dir, tmp_path, **overrides) -> TrainConfig:
    fields = dict(model_path=str(model_dir), training_file="t.jsonl", output_dir=str(tmp_path / "run"),
                  batch_size=8, max_seq_length=128, precision="bf16-sr")  # fmt: skip
    return TrainConfig(**{**fields, **overrides})


def _peak(model_dir, plan: MemoryPlan, rows: int = 100, **hyperparameters) -> int:
    shape = ModelShape.from_config_file(model_dir / "config.json")
    job = JobSpec(
        hyperparameters=JobHyperparameters(**{"batch_size": 8, "max_seq_length": 128, **hyperparameters})
    )
    data = DataCounts(example_count=64, token_estimate=64 * rows, padded_length=rows)
    return estimate_job(shape, job, data, plan=plan).peak_memory_bytes_per_gpu


def _room(peak: int) -> int:
    """The free memory in which an estimated `peak` just fits (the planner keeps a margin)."""
    return math.ceil(peak / PLANNABLE_FRACTION)


def test_the_whole_plan_is_decided_for_the_free_memory(model_dir, tmp_path):
    lengths = [100] * 64
    roomy = plan_training(_config(model_dir, tmp_path), 1, lengths, 1, 2**40, on_gpu=True, free_disk=2**50)
    assert roomy.plan == MemoryPlan(8, 0, 0, "bf16-sr", False)
    assert {name: getattr(roomy.config, name) for name in PLAN_FIELDS} == roomy.plan.as_dict()
    assert roomy.config.gradient_checkpointing is False and roomy.estimate is not None
    # Room for micro-batches of 4 but not 8 (recomputing is ruled out): 4, the rest by accumulation.
    pinned = _config(model_dir, tmp_path, recompute_layers=0, optimizer_in_backward=False)
    four = _room(_peak(model_dir, MemoryPlan(4, 0, 0, "bf16-sr", False), recompute_layers=0))
    tight = plan_training(pinned, 1, lengths, 1, four, on_gpu=True, free_disk=2**50)
    assert tight.plan.micro_batch_size == 4 and tight.config.micro_batch_size == 4
    assert tight.estimate.peak_memory_bytes_per_gpu <= four
    # Two GPUs: 4 sequences each, so 4 is the most.
    assert (
        plan_training(_config(model_dir, tmp_path), 2, lengths, 1, 2**40, True, 2**50).plan.micro_batch_size
        == 4
    )
    # A micro-batch pads to the data's longest row: longer rows need more memory.
    longer = plan_training(pinned, 1, [128] * 64, 1, four, on_gpu=True, free_disk=2**50)
    assert longer.plan.micro_batch_size < 4
    # gradient_checkpointing is every layer recomputed, and says so again in the config the trainer gets.
    every = plan_training(
        _config(model_dir, tmp_path, gradient_checkpointing=True), 1, lengths, 1, 2**40, True, 2**50
    )
    assert every.config.recompute_layers == 2 and every.config.gradient_checkpointing is True


def test_a_run_that_fits_no_plan_or_no_disk_stops_before_the_model_loads(model_dir, tmp_path):
    config = _config(model_dir, tmp_path)
    with pytest.raises(TrainingFailure) as refused:
        plan_training(config, 1, [100] * 64, 1, 2**20, on_gpu=True, free_disk=2**50)
    assert refused.value.code == ErrorCode.OUT_OF_MEMORY
    assert "even with its smallest plan" in refused.value.message
    # Three checkpoints (the two kept and the next) of the tiny model do not fit one checkpoint's space.
    shape = ModelShape.from_config_file(model_dir / "config.json")
    one = checkpoint_bytes(shape, JobSpec(), "bf16-sr")
    with pytest.raises(TrainingFailure) as no_disk:
        plan_training(config, 1, [100] * 64, 1, 2**40, on_gpu=True, free_disk=one)
    assert no_disk.value.code == ErrorCode.STORAGE_ERROR
    assert "3 checkpoints" in no_disk.value.message and "free" in no_disk.value.message
    # A run that checkpoints only at its end (one epoch, no schedule by steps or minutes) writes one.
    final_only = _config(model_dir, tmp_path, n_epochs=1, checkpoint_every_minutes=None)
    assert (
        plan_training(final_only, 1, [100] * 64, 1, 2**40, on_gpu=True, free_disk=one).disk.needed_bytes
        == one
    )
    # A pin the model cannot run.
    with pytest.raises(TrainingFailure) as bad_pin:
        plan_training(_config(model_dir, tmp_path, recompute_layers=3), 1, [100] * 64, 1, 2**40, True, 2**50)
    assert bad_pin.value.code == ErrorCode.TRAINER_ERROR and "recompute_layers" in bad_pin.value.message


def test_a_model_without_a_readable_config_runs_its_pins_and_the_defaults(tmp_path):
    config = _config(tmp_path, tmp_path, precision="auto", recompute_layers=1, gradient_checkpointing=True)
    planned = plan_training(config, 1, [100] * 8, 1, 2**40, on_gpu=False, free_disk=0)
    assert planned.estimate is None and planned.plan == MemoryPlan(8, 1, 0, "fp32", False)
    assert {name: getattr(planned.config, name) for name in PLAN_FIELDS} == planned.plan.as_dict()


class _RecordingReporter(NullReporter):
    def __init__(self):
        self.events = []

    def event(self, message, *, level="info", type="message", data=None):
        self.events.append((message, data or {}))


class _TrainerWithMemory(Trainer):
    """A CPU trainer that plans against a given memory size, as a GPU's would."""

    memory_bytes: int | None = None

    def _plan_memory_bytes(self) -> int | None:
        return self.memory_bytes


def test_the_started_event_names_the_plan_that_runs(model_dir, tmp_path):
    train_file = assets.write_demo_dataset(tmp_path / "train.jsonl", n_examples=16, seed=3)
    config = TrainConfig(model_path=str(model_dir), training_file=str(train_file), output_dir=str(tmp_path / "run"),
                         n_epochs=1, batch_size=8, max_seq_length=64, max_steps=1, precision="auto",
                         recompute_layers=0, offload_layers=0, optimizer_in_backward=False)  # fmt: skip
    cpu = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    # A memory size that holds micro-batches of 2 but not 4 of this data: the CPU plans against it.
    reporter = _RecordingReporter()
    _TrainerWithMemory.memory_bytes = None
    unplanned = _TrainerWithMemory(config, cpu, reporter)
    assert unplanned.run_plan.plan.micro_batch_size == 8
    longest = max(unplanned.row_lengths)
    two = _room(
        _peak(
            model_dir, MemoryPlan(2, 0, 0, "fp32", False), rows=longest, max_seq_length=64, precision="fp32"
        )
    )
    _TrainerWithMemory.memory_bytes = two
    trainer = _TrainerWithMemory(config, cpu, reporter)
    plan = trainer.run_plan.plan
    assert plan == MemoryPlan(2, 0, 0, "fp32", False)
    # The trainer runs with every part of the plan decided.
    assert {name: getattr(trainer.config, name) for name in PLAN_FIELDS} == dataclasses.asdict(plan)
    assert (trainer.micro_batch_size, trainer.grad_accum_steps) == (2, 4)
    trainer.train()
    message, started = next((m, d) for m, d in reporter.events if d.get("event") == "started")
    assert f"memory plan: {plan.describe()}" in message
    assert started["memory_plan"] == plan.as_dict() and started["memory_plan_description"] == plan.describe()
    assert started["memory_plan_estimate"]["peak_memory_bytes_per_gpu"] <= two
    assert started["memory_plan_estimate"]["gpu_memory_bytes"] == two
    assert started["micro_batch_size"] == 2 and "fits" in started["memory_plan_reason"]
    # The checkpoint records what ran: the resolved precision and the memory plan.
    saved_run = read_resume_state(layout.checkpoint_path(config.output_dir, 1))[RESUME_RUN]
    assert saved_run[RUN_PRECISION] == "fp32" and saved_run[RUN_MEMORY_PLAN] == plan.as_dict()


def _checkpoint_with_8bit_state(path):
    """A checkpoint folder whose optimizer state is stored as uint8 codes (the 8-bit state's)."""
    path.mkdir(parents=True)
    state = {"state": {0: {"exp_avg": torch.zeros(4, dtype=torch.uint8)}}, "param_groups": []}
    write_training_state(path, state, {})
    return path


def test_a_resumed_auto_run_keeps_the_precision_its_checkpoint_records(model_dir, tmp_path):
    """ "auto" on resume is what the checkpoint's run description records, not a guess from the optimizer
    state; a checkpoint written before that record still resumes, by the guess."""
    checkpoint = _checkpoint_with_8bit_state(tmp_path / "checkpoint")
    config, lengths = _config(model_dir, tmp_path, precision="auto"), [100] * 64

    def resumed(saved_run):
        return plan_training(config, 1, lengths, 1, 2**40, True, 2**50, checkpoint, saved_run).plan.precision

    # The record wins over the state's dtype (here made to disagree with it).
    assert resumed({RUN_PRECISION: "bf16-sr", RUN_MEMORY_PLAN: {}}) == "bf16-sr"
    # An older checkpoint, without the record: the uint8 state reads as the 8-bit mode.
    assert resumed({}) == "bf16-sr-8bit"
    # Without a checkpoint, roomy memory plans the default.
    assert plan_training(config, 1, lengths, 1, 2**40, True, 2**50).plan.precision == "bf16-sr"


@pytest.mark.gpu
def test_a_memory_cap_caps_the_process_and_what_the_plan_sees_as_free():
    device = torch.device("cuda", 0)
    cap = torch.cuda.memory_reserved(device) + 2**30
    try:
        assert free_gpu_memory_bytes(device, cap) <= 2**30
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2 * 2**30, dtype=torch.uint8, device=device)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
