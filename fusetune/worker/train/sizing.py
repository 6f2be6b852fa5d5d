"""Micro-batches sized to the GPU: the largest that the memory model says fits the memory free at start.

Used when a job leaves `micro_batch_size` unset on a GPU: the trainer asks `fusetune.estimate.fit_micro_batch`
with the model's shape, the loaded data's longest row and the memory free on the tightest GPU of the job, and
takes the largest divisor of its per-GPU batch that fits (gradient accumulation covers the rest of the batch).
A job that does not fit even at micro-batch 1 stops here, before the model loads, with its estimate and the
changes that would make it fit.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fusetune.estimate import ModelShape, fit_micro_batch
from fusetune.worker.train.config import TrainConfig
from fusetune.worker.train.distributed import all_reduce
from fusetune.worker.train.outcome import ErrorCode, TrainingFailure


def free_memory_bytes(device: torch.device) -> int:
    """Memory free on the tightest of the job's GPUs (every rank must choose the same micro-batch)."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(all_reduce(torch.tensor([free], device=device), op=torch.distributed.ReduceOp.MIN).item())


def fitting_micro_batch(
    config: TrainConfig,
    world_size: int,
    free_bytes: int,
    row_lengths: list[int],
    rows_per_example: int,
    has_reference_pass: bool,
) -> int | None:
    """Sequences per micro-batch on each GPU; None when the model's shape cannot be read (the config's own
    default applies then). Raises TrainingFailure(out_of_memory) when not even one fits."""
    try:
        shape = ModelShape.from_config_file(Path(config.model_path) / "config.json")
    except (OSError, KeyError, ValueError, TypeError):
        return None
    fit = fit_micro_batch(
        shape,
        free_bytes,
        example_count=len(row_lengths),
        token_estimate=sum(row_lengths),
        n_epochs=config.n_epochs,
        batch_size=config.batch_size,
        max_seq_length=config.max_seq_length,
        n_gpus=world_size,
        fused_kernels=config.kernels,
        lora=config.lora.model_dump() if config.lora is not None else None,
        gradient_checkpointing=config.gradient_checkpointing,
        distributed=config.distributed,
        precision=config.precision,
        rows_per_example=rows_per_example,
        reference_pass=has_reference_pass,
        padded_length=max(row_lengths, default=1) // rows_per_example,
    )
    if not fit.fits:
        raise TrainingFailure(ErrorCode.OUT_OF_MEMORY, fit.refusal(free_bytes))
    return fit.estimate.micro_batch_size
