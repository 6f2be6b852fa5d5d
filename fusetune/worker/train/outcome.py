"""How a training run tells the worker how it ended: `result.json` on success, `error.json` on a known failure,
`stopped.json` when it stopped because the job was paused or cancelled.

Rank 0 writes exactly one of the three into the job's output directory; the worker reads it after torchrun
exits and owns every job status transition. (torchrun turns a rank's exit status into its own 1 whenever a
rank exits non-zero, so the file, not the exit status, is what tells a stop from a crash.) Light on imports so
the worker can use it without torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

RESULT_FILENAME = "result.json"
ERROR_FILENAME = "error.json"
STOPPED_FILENAME = "stopped.json"
OUTCOME_FILENAMES = (RESULT_FILENAME, ERROR_FILENAME, STOPPED_FILENAME)

# Exit status of the trainer: 0 with result.json, FAILED with error.json, STOPPED when the job was cancelled or
# paused (after a pause, the checkpoint of the step it stopped at holds everything needed to resume).
EXIT_FAILED = 1
EXIT_STOPPED = 3


class ErrorCode(StrEnum):
    MODEL_NOT_FOUND = "model_not_found"
    INVALID_TRAINING_FILE = "invalid_training_file"
    OUT_OF_MEMORY = "out_of_memory"
    NON_FINITE_LOSS = "non_finite_loss"
    TRAINER_ERROR = "trainer_error"
    # The grader failed on most completions of a step (a python grader that raises, a variable lines lack).
    GRADER_ERROR = "grader_error"
    # The object store failed after the client's retries (an upload, or staging the job's inputs).
    STORAGE_ERROR = "storage_error"


OUT_OF_MEMORY_HINT = "Try a smaller micro_batch_size or max_seq_length, turn on gradient_checkpointing, or train LoRA adapters."


class TrainingFailure(Exception):
    """A failure the user can act on; its code and message end up in `error.json`."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class JobStopped(Exception):
    """The job was cancelled or paused while training; the run ends without a result."""

    def __init__(self, reason: str, message: str, step: int, checkpoint: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason  # "cancelled", "paused" or "handed_over" (its worker is stopping)
        self.step = step
        self.checkpoint = checkpoint  # where a paused run resumes from


@dataclass(frozen=True)
class TrainResult:
    trained_tokens: int
    final_checkpoint: str
    steps: int
    final_train_loss: float


def _write_json_atomically(path: Path, payload: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2), encoding="utf-8")
    os.replace(tmp, path)
    return path


def write_result(output_dir: str | Path, result: TrainResult) -> Path:
    return _write_json_atomically(Path(output_dir) / RESULT_FILENAME, asdict(result))


def write_error(output_dir: str | Path, code: ErrorCode | str, message: str) -> Path:
    return _write_json_atomically(Path(output_dir) / ERROR_FILENAME, {"code": str(code), "message": message})


def write_stopped(output_dir: str | Path, stopped: JobStopped) -> Path:
    payload = {"reason": stopped.reason, "step": stopped.step, "checkpoint": stopped.checkpoint}
    return _write_json_atomically(Path(output_dir) / STOPPED_FILENAME, payload)


def read_result(output_dir: str | Path) -> TrainResult | None:
    path = Path(output_dir) / RESULT_FILENAME
    if not path.is_file():
        return None
    return TrainResult(**json.loads(path.read_text(encoding="utf-8")))


def read_error(output_dir: str | Path) -> dict[str, str] | None:
    """`{"code", "message"}` of a failed run, or None when the trainer wrote no error."""
    path = Path(output_dir) / ERROR_FILENAME
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def read_stopped(output_dir: str | Path) -> dict[str, Any] | None:
    """`{"reason": "paused" | "cancelled" | "handed_over", "step", "checkpoint"}` of a run stopped by its job's
    status or its worker's hand-over, or None."""
    path = Path(output_dir) / STOPPED_FILENAME
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))
