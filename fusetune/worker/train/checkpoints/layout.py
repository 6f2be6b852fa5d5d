"""Checkpoint folders: `output_dir/checkpoints/step-<n>/`, in Hugging Face format plus the state to resume from.

A checkpoint folder holds
- the weights, loadable with `from_pretrained(path)`: full weights and config for a full fine-tune; for LoRA the
  adapter (`adapter_model.safetensors` + `adapter_config.json`), or, with merged weights requested, the merged
  full weights at the top and the adapter in `adapter/` (transformers would otherwise apply the adapter a
  second time on top of the merged weights);
- the tokenizer, and `fusetune_trainer_state.json` (step, epoch, metrics) for people and tools;
- `training_state/`: the optimizer (a full, unsharded state dict keyed by parameter name, so a run may resume
  under another world size or DDP/FSDP choice), and `resume.pt`: the LR scheduler, the data position, the
  trained-token count, every rank's RNG states and the training method's state (see state.py).

A checkpoint is written under a temporary name and renamed when complete, so a directory named `step-<n>` is
always a whole checkpoint, even after a crash mid-save.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CHECKPOINTS_DIRNAME = "checkpoints"
CHECKPOINT_PREFIX = "step-"
INCOMPLETE_SUFFIX = ".incomplete"
TRAINER_STATE_FILENAME = "fusetune_trainer_state.json"
ADAPTER_DIRNAME = "adapter"
ADAPTER_CONFIG_FILENAME = "adapter_config.json"
ADAPTER_WEIGHTS_FILENAME = "adapter_model.safetensors"
HF_CONFIG_FILENAME = "config.json"
TRAINING_STATE_DIRNAME = "training_state"
OPTIMIZER_FILENAME = "optimizer.pt"
RESUME_STATE_FILENAME = "resume.pt"

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


def is_adapter_checkpoint(path: str | Path) -> bool:
    """A folder holding a LoRA adapter without full weights beside it (a LoRA job's checkpoint)."""
    path = Path(path)
    return (path / ADAPTER_CONFIG_FILENAME).is_file() and not (path / HF_CONFIG_FILENAME).is_file()


def adapter_base_model_name(path: str | Path) -> str | None:
    """The base model an adapter checkpoint names (`base_model_name_or_path`): the public name of the model the
    job trained (a checkpoint written before public names, a path); None for a folder that is no adapter
    checkpoint."""
    if not is_adapter_checkpoint(path):
        return None
    adapter_config = json.loads((Path(path) / ADAPTER_CONFIG_FILENAME).read_text(encoding="utf-8"))
    return adapter_config["base_model_name_or_path"]


def training_state_dir(checkpoint: Path) -> Path:
    return checkpoint / TRAINING_STATE_DIRNAME


def has_training_state(checkpoint: Path) -> bool:
    return (training_state_dir(checkpoint) / RESUME_STATE_FILENAME).is_file()


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


def stale_checkpoints(output_dir: str | Path, keep_last: int) -> list[Path]:
    """All but the newest `keep_last` checkpoints."""
    return [path for _, path in list_checkpoints(output_dir)[:-keep_last]]


def delete_checkpoint(checkpoint: Path) -> None:
    shutil.rmtree(checkpoint, ignore_errors=True)
