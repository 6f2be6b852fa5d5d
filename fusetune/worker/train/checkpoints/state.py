"""The training state a checkpoint holds beside the weights, how it is written and read back, and where a run
resumes from.

`training_state/resume.pt` holds the learning-rate schedule, the data position with the step and token counts
(`TrainingProgress`), every rank's RNG states, what the run's data position depends on, and the training
method's own state; `training_state/optimizer.pt` the optimizer's. Format 1 of `resume.pt`, written before the
training method had state of its own, lacks the method's entries and reads as a supervised run; a format newer
than this code reads is refused by name.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fusetune.spec.plan import MemoryPlan
from fusetune.worker.train.checkpoints import layout
from fusetune.worker.train.config import TrainConfig
from fusetune.worker.train.distributed import DistInfo, broadcast_object
from fusetune.worker.train.outcome import ErrorCode, TrainingFailure

# The format of resume.pt this code writes, and the newest it reads.
CURRENT_RESUME_FORMAT = 2

# Keys of resume.pt.
RESUME_STEP = "step"
RESUME_EPOCH_INDEX = "epoch_index"  # the epoch the next step belongs to (0-based)
RESUME_BATCH_INDEX = "batch_index"  # the next global batch of that epoch's shuffled order
RESUME_TRAINED_TOKENS = "trained_tokens"
RESUME_TRAIN_LOSS = "train_loss"  # of the last step before the checkpoint
# Its gradient norm, which the optimizer step inside the backward clips the next step by (absent: not kept yet).
RESUME_GRAD_NORM = "grad_norm"
RESUME_SCHEDULER = "scheduler"
RESUME_RNG = "rng"  # one entry per rank
RESUME_RUN = "run"  # what must match for the data position to mean the same (see check_resumable)
RESUME_METHOD = "method"  # the training method's own state
RESUME_FORMAT = "format"  # absent in the first format (see read_resume_state)

# Keys of the run description (RESUME_RUN) that record what the run ran with: the precision "auto" resolved to
# (the optimizer state's dtype follows it) and the memory plan. A resume reads the precision back; they are not
# compared (a resumed run plans again for the memory free now). Absent in checkpoints written before them.
RUN_PRECISION = "precision"
RUN_MEMORY_PLAN = "memory_plan"
RECORDED_RUN_KEYS = (RUN_PRECISION, RUN_MEMORY_PLAN)


@dataclass
class TrainingProgress:
    """Where the run is: optimizer steps done, the (epoch, global batch of its shuffled order) of the next step,
    input tokens trained on, and the loss of the last step."""

    step: int = 0
    epoch_index: int = 0
    batch_index: int = 0
    trained_tokens: int = 0
    last_train_loss: float = field(default=float("nan"))
    last_grad_norm: float = field(default=float("nan"))

    def advance(
        self,
        epoch: int,
        batch_index: int,
        epoch_done: bool,
        tokens: int,
        train_loss: float,
        grad_norm: float = float("nan"),
    ) -> None:
        self.step += 1
        self.trained_tokens += tokens
        self.last_train_loss = train_loss
        self.last_grad_norm = grad_norm
        self.epoch_index, self.batch_index = (epoch + 1, 0) if epoch_done else (epoch, batch_index + 1)

    def state_dict(self) -> dict[str, Any]:
        return {
            RESUME_STEP: self.step,
            RESUME_EPOCH_INDEX: self.epoch_index,
            RESUME_BATCH_INDEX: self.batch_index,
            RESUME_TRAINED_TOKENS: self.trained_tokens,
            RESUME_TRAIN_LOSS: self.last_train_loss,
            RESUME_GRAD_NORM: self.last_grad_norm,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state[RESUME_STEP]
        self.epoch_index = state[RESUME_EPOCH_INDEX]
        self.batch_index = state[RESUME_BATCH_INDEX]
        self.trained_tokens = state[RESUME_TRAINED_TOKENS]
        self.last_train_loss = state[RESUME_TRAIN_LOSS]
        self.last_grad_norm = state.get(RESUME_GRAD_NORM, float("nan"))


def find_resume_point(config: TrainConfig, dist_info: DistInfo) -> tuple[int, Path] | None:
    """The (step, folder) of the newest checkpoint to resume from, the same on every rank whatever each sees of
    a shared folder (rank 0 looks, after removing what an interrupted save left); None to start afresh."""
    resume_from = None
    if dist_info.is_main:
        layout.remove_incomplete(config.output_dir)
        resume_from = layout.latest_resumable(config.output_dir) if config.resume else None
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
        RESUME_FORMAT: CURRENT_RESUME_FORMAT,
        **progress.state_dict(),
        RESUME_SCHEDULER: scheduler.state_dict(),
        RESUME_RNG: rng_states,
        RESUME_RUN: run_description,
        RESUME_METHOD: method_state,
    }


def write_training_state(
    directory: Path, optimizer_state: dict[str, Any], resume_state: dict[str, Any]
) -> None:
    state_dir = layout.training_state_dir(directory)
    state_dir.mkdir()
    torch.save(optimizer_state, state_dir / layout.OPTIMIZER_FILENAME)
    # Written last: its presence is what marks the training state as whole.
    torch.save(resume_state, state_dir / layout.RESUME_STATE_FILENAME)


def read_resume_state(checkpoint: Path) -> dict[str, Any]:
    """`resume.pt` of `checkpoint` in the current format; raises TrainingFailure, saying why, for one this code
    cannot read."""
    state = torch.load(
        layout.training_state_dir(checkpoint) / layout.RESUME_STATE_FILENAME, weights_only=True
    )
    written_format = state.get(RESUME_FORMAT, 1)
    if written_format > CURRENT_RESUME_FORMAT:
        raise TrainingFailure(
            ErrorCode.TRAINER_ERROR,
            f"cannot resume from checkpoint {checkpoint}: its training state has format {written_format}, "
            f"newer than the {CURRENT_RESUME_FORMAT} this trainer reads; resume with the version that wrote it "
            "or set resume to false",
        )
    if written_format == 1:
        # Written before training methods: every run was supervised, and the method had no state.
        state[RESUME_RUN] = {"method": "supervised", **state[RESUME_RUN]}
        state[RESUME_METHOD] = {}
    return state


def read_optimizer_state(checkpoint: Path) -> dict[str, Any]:
    # mmap: each rank touches only the pages of the tensors it keeps (its shard, under FSDP).
    return torch.load(
        layout.training_state_dir(checkpoint) / layout.OPTIMIZER_FILENAME,
        weights_only=True,
        mmap=True,
        map_location="cpu",
    )


def run_description(config: TrainConfig, training_rows: int, plan: MemoryPlan) -> dict[str, Any]:
    """What a checkpoint's data position depends on (a run may resume from it only if all of it matches), and
    what the run ran with (`RECORDED_RUN_KEYS`: the resolved precision, `plan`)."""
    return {
        "method": config.method.type,
        "training_rows": training_rows,
        "batch_size": config.batch_size,
        "seed": config.seed,
        "max_seq_length": config.max_seq_length,
        "packing": config.packing,
        "lora": config.lora is not None,
        RUN_PRECISION: plan.precision,
        RUN_MEMORY_PLAN: plan.as_dict(),
    }


def check_resumable(saved_run: dict[str, Any], current_run: dict[str, Any], checkpoint: Path) -> None:
    differences = [
        f"{key}={saved_run.get(key)!r} there, {value!r} now"
        for key, value in current_run.items()
        if key not in RECORDED_RUN_KEYS and saved_run.get(key) != value
    ]
    if differences:
        raise TrainingFailure(
            ErrorCode.TRAINER_ERROR,
            f"cannot resume from checkpoint {checkpoint}: its run differs ({'; '.join(differences)}); start "
            "a new job or set resume to false",
        )


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
