"""The learning-rate schedule: a linear warmup, then a cosine or linear decay towards zero."""

from __future__ import annotations

import math

import torch

from fusetune.worker.train.config import TrainConfig


def lr_factor(step: int, warmup_steps: int, total_steps: int, schedule: str) -> float:
    """Multiplier of the peak learning rate for optimizer step `step` (0-based): a linear warmup that reaches
    the peak at the last warmup step, then a cosine or linear decay towards zero over the remaining steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0 - progress


def schedule_lengths(config: TrainConfig, training_rows: int) -> tuple[int, int, int]:
    """(steps per epoch, total steps, warmup steps) of a run over `training_rows` rows."""
    steps_per_epoch = math.ceil(training_rows / config.batch_size)
    total_steps = steps_per_epoch * config.n_epochs
    if config.max_steps is not None:
        total_steps = min(total_steps, config.max_steps)
    return steps_per_epoch, total_steps, math.ceil(config.warmup_ratio * total_steps)


def build_scheduler(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, schedule: str
) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup_steps, total_steps, schedule)
    )
