"""The run's memory plan, chosen before the model loads: micro-batch, recomputed and offloaded layers, precision,
and where the optimizer steps.

The trainer calls `plan_training` once its data is loaded, with the memory free on the tightest of the job's GPUs
(None on a CPU, where nothing is planned against a memory size: the plan is the job's pins and the trainer's
defaults, through the same path). `fusetune.spec.planner.plan_run` (which the API's admission asks too, with the
configured memory) picks the fastest plan that fits, from the
model's config.json, the data's longest row and the job's pins; the trainer then runs with a config whose every
plan field is decided (`TrainConfig.recompute_layers`, `offload_layers`, `optimizer_in_backward`, `precision`,
`micro_batch_size`, and `gradient_checkpointing` true exactly when every layer recomputes). A job that fits no
plan stops here with the plans that would fit; one whose checkpoints cannot fit the run's disk stops here too,
before it trains for hours.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fusetune.spec.estimate import DataCounts, Estimate, ModelShape, default_micro_batch_size
from fusetune.spec.hyperparameters import JobHyperparameters
from fusetune.spec.job import JobSpec
from fusetune.spec.plan import MemoryPlan
from fusetune.spec.planner import (
    CheckpointDisk,
    CheckpointSaving,
    PlanError,
    free_disk_bytes,
    plan_run,
)
from fusetune.spec.precision import AUTO, auto_precisions, mode_for
from fusetune.worker.train.checkpoints.layout import list_checkpoints
from fusetune.worker.train.checkpoints.state import RUN_PRECISION, read_optimizer_state
from fusetune.worker.train.config import TrainConfig
from fusetune.worker.train.distributed import all_reduce
from fusetune.worker.train.outcome import ErrorCode, TrainingFailure


def free_gpu_memory_bytes(device: torch.device, cap_bytes: int | None = None) -> int | None:
    """Memory free on the tightest of the job's GPUs (every rank must choose the same plan); None on a CPU.

    `cap_bytes`: the memory the run may use on each GPU. The process is capped there (its allocations beyond it
    fail as on a card of that size) and what it may still allocate counts as free where that is less."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    if cap_bytes is not None:
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), device)
        free = min(free, cap_bytes - torch.cuda.memory_reserved(device))
    return int(all_reduce(torch.tensor([free], device=device), op=torch.distributed.ReduceOp.MIN).item())


@dataclass(frozen=True)
class RunPlan:
    """A run's plan and the config that carries it, with the estimate it was chosen by (None when the model's
    shape could not be read)."""

    config: TrainConfig
    plan: MemoryPlan
    estimate: Estimate | None
    memory_bytes: int | None
    reason: str
    disk: CheckpointDisk | None

    def event_data(self) -> dict[str, Any]:
        """What the `started` event says of the plan."""
        estimate = self.estimate
        return {
            "memory_plan": self.plan.as_dict(),
            "memory_plan_description": self.plan.describe(),
            "memory_plan_reason": self.reason,
            "memory_plan_estimate": None
            if estimate is None
            else {
                "peak_memory_bytes_per_gpu": estimate.peak_memory_bytes_per_gpu,
                "memory_breakdown": estimate.memory_breakdown,
                "host_activation_bytes": estimate.host_activation_bytes,
                "host_optimizer_state_bytes": estimate.host_optimizer_state_bytes,
                "gpu_memory_bytes": self.memory_bytes,
            },
            "checkpoint_disk_bytes": None if self.disk is None else self.disk.needed_bytes,
        }

    def summary(self) -> str:
        text = f"memory plan: {self.plan.describe()}"
        if self.estimate is not None:
            text += f", about {self.estimate.peak_memory_bytes_per_gpu / 2**30:.1f} GiB per GPU"
        return text


def _model_shape(model_path: str) -> ModelShape | None:
    try:
        return ModelShape.from_config_file(Path(model_path) / "config.json")
    except (OSError, KeyError, ValueError, TypeError):
        return None


def resumed_precision(checkpoint: Path, saved_run: dict[str, Any]) -> str:
    """The precision "auto" ran with before `checkpoint`, as its run description (`saved_run`) records it: the
    optimizer state of one mode must not be loaded into another's."""
    recorded = saved_run.get(RUN_PRECISION)
    return recorded if recorded is not None else guessed_precision(checkpoint)


def guessed_precision(checkpoint: Path) -> str:
    """For a checkpoint written before its run description recorded the precision: of what "auto" may become on
    a GPU, the mode whose optimizer state is stored as uint8 codes when it is, else the default (the file is
    memory-mapped: only the first tensors are read)."""
    state = read_optimizer_state(checkpoint).get("state", {})
    quantized = any(
        isinstance(value, torch.Tensor) and value.dtype == torch.uint8
        for parameter_state in state.values()
        for value in parameter_state.values()
    )
    choices = auto_precisions(on_gpu=True)
    return next(name for name in choices if (mode_for(name).optimizer_state_dtype == "uint8") == quantized)


def plan_training(
    config: TrainConfig,
    world_size: int,
    row_lengths: list[int],
    rows_per_example: int,
    memory_bytes: int | None,
    on_gpu: bool,
    free_disk: int | None = None,
    resumed_checkpoint: Path | None = None,
    resumed_run: dict[str, Any] | None = None,
) -> RunPlan:
    """The run's plan on `world_size` processes of `memory_bytes` each (None: not planned against a size),
    and its config with every plan field decided; `free_disk`: the free bytes of the run's disk (read from it
    when None). A run that resumes `resumed_checkpoint` keeps the precision
    its run description `resumed_run` records (its optimizer state was saved in it). Raises TrainingFailure: out_of_memory when no plan fits, storage_error
    when the checkpoints cannot fit `free_disk` bytes, trainer_error for a pin the model cannot run."""
    if resumed_checkpoint is not None and on_gpu and config.precision == AUTO:
        precision = resumed_precision(resumed_checkpoint, resumed_run or {})
        config = config.model_copy(update={"precision": precision})
    # The run as a job of `world_size` GPUs (the config was validated when it was written).
    hyperparameters = JobHyperparameters.model_construct(**config.training_fields(), n_gpus=world_size)
    job = JobSpec.model_construct(method=config.method, hyperparameters=hyperparameters)
    shape = _model_shape(config.model_path)
    if shape is None:
        # No shape, no estimate: the job's pins and the trainer's defaults (gradient_checkpointing as set).
        per_gpu = max(1, config.batch_size // world_size)
        plan = MemoryPlan(
            micro_batch_size=config.micro_batch_size
            or default_micro_batch_size(per_gpu, config.max_seq_length),
            recompute_layers=config.recompute_layers or 0,
            offload_layers=config.offload_layers or 0,
            precision=mode_for(config.precision, on_gpu).name,
            optimizer_in_backward=bool(config.optimizer_in_backward),
            optimizer_state_on_host=bool(config.optimizer_state_on_host),
        )
        resolved = config.model_copy(update=plan.as_dict())
        return RunPlan(
            resolved, plan, None, memory_bytes, "the job's settings (no config.json to plan from)", None
        )
    data = DataCounts(
        example_count=len(row_lengths),
        token_estimate=sum(row_lengths),
        padded_length=max(row_lengths, default=1) // rows_per_example,
    )
    if free_disk is None:
        free_disk = free_disk_bytes(config.output_dir)
    saving = CheckpointSaving(
        config.keep_last_checkpoints, config.checkpoint_every_steps, config.checkpoint_every_epoch,
        config.checkpoint_every_minutes, free_disk, len(list_checkpoints(config.output_dir)),
    )  # fmt: skip
    try:
        decided = plan_run(shape, job, data, memory_bytes, saving, on_gpu=on_gpu)
    except PlanError as exc:
        raise TrainingFailure(ErrorCode.TRAINER_ERROR, str(exc)) from exc
    if decided.refusal is not None:
        code = ErrorCode.OUT_OF_MEMORY if decided.refusal.kind == "memory" else ErrorCode.STORAGE_ERROR
        raise TrainingFailure(code, decided.refusal.message)
    plan = decided.plan
    resolved = config.model_copy(
        update={**plan.as_dict(), "gradient_checkpointing": plan.recompute_layers >= shape.num_layers}
    )
    reason = (
        f"the fastest plan that fits the {memory_bytes / 2**30:.1f} GiB free at start"
        if memory_bytes is not None
        else "the job's settings and the defaults (no GPU memory to plan against)"
    )
    return RunPlan(resolved, plan, decided.planned.estimate, memory_bytes, reason, decided.disk)
