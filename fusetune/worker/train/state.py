"""The parts of a run's training state that are not the model or the optimizer, each with its own state dict,
and how `resume.pt` is assembled from the parts and read back.

`resume.pt` (see checkpoint.py) holds the learning-rate schedule, the data position with the step and token
counts (`TrainingProgress`), every rank's RNG states, what the run's data position depends on, and the
training method's own state. Format 1, written before the training method had state of its own, lacks the
method's entries and reads as a supervised run; a format newer than this code reads is refused by name.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from fusetune.worker.train import checkpoint as ckpt
from fusetune.worker.train import lora
from fusetune.worker.train.checkpoint_store import publish_checkpoint
from fusetune.worker.train.config import TrainConfig
from fusetune.worker.train.distributed import DistInfo, all_gather_object, barrier, broadcast_object
from fusetune.worker.train.outcome import ErrorCode, TrainingFailure
from fusetune.worker.train.reporter import Reporter

RESUME_FORMAT = 2
# Gathered state dicts: whole tensors, on the CPU, on rank 0 only (other ranks get empty dicts).
FULL_STATE_ON_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)
# Loading: every rank reads the whole optimizer state and keeps its part (its shard under FSDP).
FULL_STATE_ON_EVERY_RANK = StateDictOptions(full_state_dict=True)


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


def find_resume_point(config: TrainConfig, dist_info: DistInfo) -> tuple[int, Path] | None:
    """The (step, folder) of the newest checkpoint to resume from, the same on every rank whatever each sees of
    a shared folder (rank 0 looks, after removing what an interrupted save left); None to start afresh."""
    resume_from = None
    if dist_info.is_main:
        ckpt.remove_incomplete(config.output_dir)
        resume_from = ckpt.latest_resumable(config.output_dir) if config.resume else None
    return broadcast_object(resume_from)


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


def run_description(config: TrainConfig, training_rows: int) -> dict[str, Any]:
    """What a checkpoint's data position depends on; a run may resume from it only if all of it matches."""
    return {
        "method": config.method.type,
        "training_rows": training_rows,
        "batch_size": config.batch_size,
        "seed": config.seed,
        "max_seq_length": config.max_seq_length,
        "packing": config.packing,
        "lora": config.lora is not None,
    }


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


class Checkpointer:
    """Writes a run's checkpoints (weights, tokenizer, the optimizer's and every other part's state), reports
    and prunes them, and reads the optimizer's state back."""

    def __init__(self, config: TrainConfig, dist_info: DistInfo, reporter: Reporter) -> None:
        self.config = config
        self.dist = dist_info
        self.reporter = reporter

    def reported_path(self, path: Path) -> str:
        base = self.config.checkpoint_paths_relative_to
        return os.path.relpath(path, base) if base else str(path)

    def save(
        self,
        step: int,
        epoch: float,
        metrics: dict[str, float],
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        tokenizer: Any,
        training_state: Callable[[list[dict[str, Any]]], dict[str, Any]],
    ) -> Path:
        """Collective (every rank calls it); `training_state(every rank's RNG states)` is resume.pt's content.
        Returns the checkpoint's folder."""
        config = self.config
        # Adapter-only checkpoints gather only the trained parameters; merged weights need the frozen ones too.
        adapter_only = config.lora is not None and not config.merge_lora_on_save
        model_state = get_model_state_dict(
            model,
            options=StateDictOptions(
                full_state_dict=True, cpu_offload=True, ignore_frozen_params=adapter_only
            ),
        )
        optimizer_state = get_optimizer_state_dict(model, optimizer, options=FULL_STATE_ON_RANK0)
        rng_states = all_gather_object(ckpt.capture_rng_state(self.dist.device))
        path = ckpt.checkpoint_path(config.output_dir, step)
        if self.dist.is_main:
            with ckpt.staged_checkpoint(config.output_dir, step) as staging:
                self._write_weights(model, staging, model_state)
                tokenizer.save_pretrained(staging)
                ckpt.write_trainer_state(staging, step, epoch, metrics)
                ckpt.write_training_state(staging, optimizer_state, training_state(rng_states))
            reported_path = self.reported_path(path)
            publish_checkpoint(path, reported_path)  # to the object store, if any, before SQL records it
            self.reporter.checkpoint(step, reported_path, metrics)
            self.reporter.event(
                f"Saved checkpoint at step {step}",
                data={"event": "checkpoint_saved", "step": step, "path": reported_path},
            )
            self._prune()
        barrier()
        return path

    def _write_weights(self, model: torch.nn.Module, directory: Path, model_state: dict[str, Any]) -> None:
        if self.config.lora is None:
            model.save_pretrained(directory, state_dict=without_tied_copies(model, model_state))
        elif self.config.merge_lora_on_save:
            lora.save_merged(model, model_state, directory)
            lora.save_adapter(model, model_state, directory / ckpt.ADAPTER_DIRNAME)
        else:
            lora.save_adapter(model, model_state, directory)

    def _prune(self) -> None:
        """Keep the newest `keep_last_checkpoints`; the reporter forgets the others before their files go, so
        the API never lists a checkpoint whose folder is gone."""
        stale = ckpt.stale_checkpoints(self.config.output_dir, self.config.keep_last_checkpoints)
        if stale:
            self.reporter.checkpoints_deleted([self.reported_path(path) for path in stale])
        for path in stale:
            ckpt.delete_checkpoint(path)

    def restore_optimizer(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint: Path
    ) -> None:
        set_optimizer_state_dict(
            model, optimizer, ckpt.read_optimizer_state(checkpoint), options=FULL_STATE_ON_EVERY_RANK
        )


def without_tied_copies(model: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """`state` without the second name of a tied parameter (a tied lm_head's weight).

    A full state dict offloaded to the CPU holds a separate copy under each name of a shared parameter, and not
    every transformers version drops the tied one on save; kept, it adds the whole embedding table (0.5 GB at
    the Llama-3.2-1B shape) to every checkpoint. Loading re-ties it from the config, as for any checkpoint.
    """
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    copies = {alias for aliases in names.values() for alias in aliases[1:]}
    return {key: value for key, value in state.items() if key not in copies}
