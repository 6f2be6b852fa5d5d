"""Checkpoints in Hugging Face format: `output_dir/checkpoints/step-<n>/` holds safetensors weights, the config
and the tokenizer, so `from_pretrained(path)` loads it, plus a small JSON of the step and its metrics.

A checkpoint is written under a temporary name and renamed when complete, so a directory named `step-<n>` is
always a whole checkpoint, even after a crash mid-save.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

CHECKPOINTS_DIRNAME = "checkpoints"
CHECKPOINT_PREFIX = "step-"
INCOMPLETE_SUFFIX = ".incomplete"
TRAINER_STATE_FILENAME = "fusetune_trainer_state.json"

# Keys of TRAINER_STATE_FILENAME.
STATE_STEP = "step"
STATE_EPOCH = "epoch"
STATE_METRICS = "metrics"


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


def save_checkpoint(
    model: torch.nn.Module,
    tokenizer,
    output_dir: str | Path,
    step: int,
    epoch: float,
    metrics: dict[str, float],
) -> Path:
    """Save an (unwrapped) model and its tokenizer as the checkpoint of `step`; call on rank 0 only."""
    final = checkpoint_path(output_dir, step)
    staging = final.with_name(final.name + INCOMPLETE_SUFFIX)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    model.save_pretrained(staging)  # transformers 5 writes safetensors only
    tokenizer.save_pretrained(staging)
    state: dict[str, Any] = {STATE_STEP: step, STATE_EPOCH: epoch, STATE_METRICS: metrics}
    (staging / TRAINER_STATE_FILENAME).write_text(json.dumps(state, indent=2), encoding="utf-8")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)
    return final


def prune_checkpoints(output_dir: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` checkpoints; returns what was deleted."""
    removed = []
    for _, path in list_checkpoints(output_dir)[:-keep_last]:
        shutil.rmtree(path)
        removed.append(path)
    return removed
