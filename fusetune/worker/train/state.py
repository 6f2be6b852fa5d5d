"""The parts of a run's training state that are not the model or the optimizer, each with its own state dict,
and how `resume.pt` is assembled from the parts and read back.

`resume.pt` (see checkpoint.py) holds the learning-rate schedule, the data position with the step and token
counts (`TrainingProgress`), every rank's RNG states, what the run's data position depends on, and the
training method's own state. Format 1, written before the training method had state of its own, lacks the
method's entries and reads as a supervised run; a format newer than this code reads is refused by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fusetune.worker.train import checkpoint as ckpt
from fusetune.worker.train.outcome import ErrorCode, TrainingFailure

RESUME_FORMAT = 2


def lr_factor(step: int, warmup_steps: int, total_steps: int, schedule: str) -> float:
    """Multiplier of the peak learning rate for optimizer step `step` (0-based): a linear warmup that reaches
    the peak at the last warmup step, then a cosine or linear decay towards zero over the remaining steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0 - progress


def build_scheduler(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, schedule: str
) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup_steps, total_steps, schedule)
    )


@dataclass
class TrainingProgress:
    """Where the run is: optimizer steps done, the (epoch, global batch of its shuffled order) of the next step,
    input tokens trained on, and the loss of the last step."""

    step: int = 0
    epoch_index: int = 0
    batch_index: int = 0
    trained_tokens: int = 0
    last_train_loss: float = field(default=float("nan"))

    def advance(self, epoch: int, batch_index: int, epoch_done: bool, tokens: int, train_loss: float) -> None:
        self.step += 1
        self.trained_tokens += tokens
        self.last_train_loss = train_loss
        self.epoch_index, self.batch_index = (epoch + 1, 0) if epoch_done else (epoch, batch_index + 1)

    def state_dict(self) -> dict[str, Any]:
        return {
            ckpt.RESUME_STEP: self.step,
            ckpt.RESUME_EPOCH_INDEX: self.epoch_index,
            ckpt.RESUME_BATCH_INDEX: self.batch_index,
            ckpt.RESUME_TRAINED_TOKENS: self.trained_tokens,
            ckpt.RESUME_TRAIN_LOSS: self.last_train_loss,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state[ckpt.RESUME_STEP]
        self.epoch_index = state[ckpt.RESUME_EPOCH_INDEX]
        self.batch_index = state[ckpt.RESUME_BATCH_INDEX]
        self.trained_tokens = state[ckpt.RESUME_TRAINED_TOKENS]
        self.last_train_loss = state[ckpt.RESUME_TRAIN_LOSS]


def resume_state(
    progress: TrainingProgress,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    rng_states: list[dict[str, Any]],
    run_description: dict[str, Any],
    method_state: dict[str, Any],
) -> dict[str, Any]:
    """What `resume.pt` holds, from each part's state dict."""
    return {
        ckpt.RESUME_FORMAT: RESUME_FORMAT,
        **progress.state_dict(),
        ckpt.RESUME_SCHEDULER: scheduler.state_dict(),
        ckpt.RESUME_RNG: rng_states,
        ckpt.RESUME_RUN: run_description,
        ckpt.RESUME_METHOD: method_state,
    }


def read_resume_state(checkpoint: Path) -> dict[str, Any]:
    """`resume.pt` of `checkpoint` in the current format; raises TrainingFailure, saying why, for one this code
    cannot read."""
    state = ckpt.read_resume_state(checkpoint)
    written_format = state.get(ckpt.RESUME_FORMAT, 1)
    if written_format > RESUME_FORMAT:
        raise TrainingFailure(
            ErrorCode.TRAINER_ERROR,
            f"cannot resume from checkpoint {checkpoint}: its training state has format {written_format}, "
            f"newer than the {RESUME_FORMAT} this trainer reads; resume with the version that wrote it or set "
            "resume to false",
        )
    if written_format == 1:
        # Written before training methods: every run was supervised, and the method had no state.
        state[ckpt.RESUME_RUN] = {"method": "supervised", **state[ckpt.RESUME_RUN]}
        state[ckpt.RESUME_METHOD] = {}
    return state


def check_resumable(saved_run: dict[str, Any], current_run: dict[str, Any], checkpoint: Path) -> None:
    differences = [
        f"{key}={saved_run.get(key)!r} there, {value!r} now"
        for key, value in current_run.items()
        if saved_run.get(key) != value
    ]
    if differences:
        raise TrainingFailure(
            ErrorCode.TRAINER_ERROR,
            f"cannot resume from checkpoint {checkpoint}: its run differs ({'; '.join(differences)}); start "
            "a new job or set resume to false",
        )
