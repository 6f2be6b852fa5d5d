"""Micro-batches sized to the GPU: the largest that the memory model says fits the memory free at start.

Used when a job leaves `micro_batch_size` unset on a GPU: the trainer asks `fusetune.spec.estimate.fit_micro_batch`
with the model's shape, the loaded data's longest row and the memory free on the tightest GPU of the job, and
takes the largest divisor of its per-GPU batch that fits (gradient accumulation covers the rest of the batch).
A job that does not fit even at micro-batch 1 stops here, before the model loads, with its estimate and the
changes that would make it fit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fusetune.spec.estimate import DataCounts, ModelShape, fit_micro_batch
from fusetune.spec.hyperparameters import JobHyperparameters
from fusetune.spec.job import JobSpec
from fusetune.worker.train.config import TrainConfig
from fusetune.worker.train.distributed import DistInfo, all_reduce
from fusetune.worker.train.outcome import ErrorCode, TrainingFailure


def free_memory_bytes(device: torch.device) -> int:
    """Memory free on the tightest of the job's GPUs (every rank must choose the same micro-batch)."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(all_reduce(torch.tensor([free], device=device), op=torch.distributed.ReduceOp.MIN).item())


def fitting_micro_batch(
    config: TrainConfig, world_size: int, free_bytes: int, row_lengths: list[int], rows_per_example: int
) -> int | None:
    """Sequences per micro-batch on each GPU; None when the model's shape cannot be read (the config's own
    default applies then). Raises TrainingFailure(out_of_memory) when not even one fits."""
    try:
        shape = ModelShape.from_config_file(Path(config.model_path) / "config.json")
    except (OSError, KeyError, ValueError, TypeError):
        return None
    # The run as a job of `world_size` GPUs (the config was validated when it was written).
    hyperparameters = JobHyperparameters.model_construct(**config.training_fields(), n_gpus=world_size)
    job = JobSpec.model_construct(method=config.method, hyperparameters=hyperparameters)
    data = DataCounts(
        example_count=len(row_lengths),
        token_estimate=sum(row_lengths),
        padded_length=max(row_lengths, default=1) // rows_per_example,
    )
    fit = fit_micro_batch(shape, free_bytes, job, data)
    if not fit.fits:
        raise TrainingFailure(ErrorCode.OUT_OF_MEMORY, fit.refusal(free_bytes))
    return fit.estimate.micro_batch_size


def micro_batches_for_the_gpu(
    config: TrainConfig, dist: DistInfo, method: Any, row_lengths: list[int]
) -> tuple[int, int, str] | None:
    """(micro-batch size, micro-batches per rank per step, why) sized to the memory free on the job's GPUs."""
    free = free_memory_bytes(dist.device)
    micro = fitting_micro_batch(config, dist.world_size, free, row_lengths, method.rows_per_example)
    if micro is None:
        return None
    accumulation = config.batch_size // (micro * dist.world_size)
    return micro, accumulation, f"the largest that fits the {free / 2**30:.1f} GiB free at start"
