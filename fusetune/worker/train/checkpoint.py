"""Checkpoints: `output_dir/checkpoints/step-<n>/`, in Hugging Face format plus the state to resume from.

A checkpoint folder holds
- the weights, loadable with `from_pretrained(path)`: full weights and config for a full fine-tune; for LoRA the
  adapter (`adapter_model.safetensors` + `adapter_config.json`), or, with merged weights requested, the merged
  full weights at the top and the adapter in `adapter/` (transformers would otherwise apply the adapter a
  second time on top of the merged weights);
- the tokenizer, and `fusetune_trainer_state.json` (step, epoch, metrics) for people and tools;
- `training_state/`: the optimizer (a full, unsharded state dict keyed by parameter name, so a run may resume
  under another world size or DDP/FSDP choice), and `resume.pt`: the LR scheduler, the data position, the
  trained-token count, every rank's RNG states and the training method's state (assembled in state.py).

A checkpoint is written under a temporary name and renamed when complete, so a directory named `step-<n>` is
always a whole checkpoint, even after a crash mid-save.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

CHECKPOINTS_DIRNAME = "checkpoints"
CHECKPOINT_PREFIX = "step-"
INCOMPLETE_SUFFIX = ".incomplete"
TRAINER_STATE_FILENAME = "fusetune_trainer_state.json"
ADAPTER_DIRNAME = "adapter"
TRAINING_STATE_DIRNAME = "training_state"
OPTIMIZER_FILENAME = "optimizer.pt"
RESUME_STATE_FILENAME = "resume.pt"

# Keys of TRAINER_STATE_FILENAME.
STATE_STEP = "step"
STATE_EPOCH = "epoch"
STATE_METRICS = "metrics"

# Keys of RESUME_STATE_FILENAME.
RESUME_STEP = "step"
RESUME_EPOCH_INDEX = "epoch_index"  # the epoch the next step belongs to (0-based)
RESUME_BATCH_INDEX = "batch_index"  # the next global batch of that epoch's shuffled order
RESUME_TRAINED_TOKENS = "trained_tokens"
RESUME_TRAIN_LOSS = "train_loss"  # of the last step before the checkpoint
RESUME_SCHEDULER = "scheduler"
RESUME_RNG = "rng"  # one entry per rank
RESUME_RUN = "run"  # what must match for the data position to mean the same (see state.check_resumable)
RESUME_METHOD = "method"  # the training method's own state
RESUME_FORMAT = "format"  # absent in the first format (see state.read_resume_state)


class CheckpointSchedule:
    """When a run saves a resumable checkpoint before its final one, so that a crash loses at most the steps since
    then: every `every_steps` steps, at the end of every epoch, and once `every_s` seconds have passed since the
    last save (or the schedule's start). Any of the three may be off (None / False).

    `clock` is injectable for tests. Each rank keeps its own schedule; the trainer saves when any rank's is due
    (the save is collective) and then tells every rank's schedule.
    """

    def __init__(
        self,
        every_steps: int | None = None,
        every_epoch: bool = False,
        every_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.every_steps = every_steps
        self.every_epoch = every_epoch
        self.every_s = every_s
        self.clock = clock
        self.last_save_s = clock()

    @classmethod
    def from_config(cls, config: Any, clock: Callable[[], float] = time.monotonic) -> CheckpointSchedule:
        """From a TrainConfig's `checkpoint_every_steps`, `checkpoint_every_epoch`, `checkpoint_every_minutes`."""
        minutes = config.checkpoint_every_minutes
        every_s = minutes * 60 if minutes is not None else None
        return cls(config.checkpoint_every_steps, config.checkpoint_every_epoch, every_s, clock)

    def due(self, step: int, epoch_done: bool) -> bool:
        """Whether to save after optimizer step `step` (1-based), which ended an epoch if `epoch_done`."""
        return (
            (self.every_steps is not None and step % self.every_steps == 0)
            or (self.every_epoch and epoch_done)
            or (self.every_s is not None and self.clock() - self.last_save_s >= self.every_s)
        )

    def saved(self) -> None:
        """A checkpoint was just saved: the time-based interval starts again."""
        self.last_save_s = self.clock()


def checkpoints_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINTS_DIRNAME


def checkpoint_path(output_dir: str | Path, step: int) -> Path:
    return checkpoints_root(output_dir) / f"{CHECKPOINT_PREFIX}{step}"


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first."""
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        suffix = path.name.removeprefix(CHECKPOINT_PREFIX)
        if path.is_dir() and path.name.startswith(CHECKPOINT_PREFIX) and suffix.isdigit():
            found.append((int(suffix), path))
    return sorted(found)


def has_training_state(checkpoint: Path) -> bool:
    return (checkpoint / TRAINING_STATE_DIRNAME / RESUME_STATE_FILENAME).is_file()


def latest_resumable(output_dir: str | Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint that holds training state, if any."""
    resumable = [(step, path) for step, path in list_checkpoints(output_dir) if has_training_state(path)]
    return resumable[-1] if resumable else None


def adapter_dir(checkpoint: Path) -> Path:
    """Where a LoRA checkpoint keeps its adapter."""
    nested = checkpoint / ADAPTER_DIRNAME
    return nested if nested.is_dir() else checkpoint


def remove_incomplete(output_dir: str | Path) -> None:
    """Delete what a save cut short left behind (call on one rank, before training)."""
    root = checkpoints_root(output_dir)
    if root.is_dir():
        for path in root.glob(f"{CHECKPOINT_PREFIX}*{INCOMPLETE_SUFFIX}"):
            shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def staged_checkpoint(output_dir: str | Path, step: int) -> Iterator[Path]:
    """Yields an empty staging folder to write the checkpoint of `step` into; renames it to `step-<n>` when
    the block completes. A failed block leaves only the staging folder, which the next save replaces."""
    final = checkpoint_path(output_dir, step)
    staging = final.with_name(final.name + INCOMPLETE_SUFFIX)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    yield staging
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)


def write_trainer_state(directory: Path, step: int, epoch: float, metrics: dict[str, float]) -> None:
    state: dict[str, Any] = {STATE_STEP: step, STATE_EPOCH: epoch, STATE_METRICS: metrics}
    (directory / TRAINER_STATE_FILENAME).write_text(json.dumps(state, indent=2), encoding="utf-8")


def write_training_state(
    directory: Path, optimizer_state: dict[str, Any], resume_state: dict[str, Any]
) -> None:
    state_dir = directory / TRAINING_STATE_DIRNAME
    state_dir.mkdir()
    torch.save(optimizer_state, state_dir / OPTIMIZER_FILENAME)
    # Written last: its presence is what marks the training state as whole.
    torch.save(resume_state, state_dir / RESUME_STATE_FILENAME)


def read_resume_state(checkpoint: Path) -> dict[str, Any]:
    return torch.load(checkpoint / TRAINING_STATE_DIRNAME / RESUME_STATE_FILENAME, weights_only=True)


def read_optimizer_state(checkpoint: Path) -> dict[str, Any]:
    # mmap: each rank touches only the pages of the tensors it keeps (its shard, under FSDP).
    return torch.load(
        checkpoint / TRAINING_STATE_DIRNAME / OPTIMIZER_FILENAME,
        weights_only=True,
        mmap=True,
        map_location="cpu",
    )


def stale_checkpoints(output_dir: str | Path, keep_last: int) -> list[Path]:
    """All but the newest `keep_last` checkpoints."""
    return [path for _, path in list_checkpoints(output_dir)[:-keep_last]]


def delete_checkpoint(checkpoint: Path) -> None:
    shutil.rmtree(checkpoint, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ RNG state


def capture_rng_state(device: torch.device) -> dict[str, Any]:
    """This process's random number generators (numpy's too: libraries may draw from it)."""
    import numpy as np

    _, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng_state(state: dict[str, Any], device: torch.device) -> None:
    import numpy as np

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            numpy_state["keys"].numpy().astype(np.uint32),
            numpy_state["position"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
