"""One rank's process: build the reporter, train, and leave the outcome file the worker reads (rank 0)."""

from __future__ import annotations

import time
import traceback
from pathlib import Path

import torch

from fusetune.worker.train.config import TrainConfig
from fusetune.worker.train.distributed import barrier, init_distributed, shutdown
from fusetune.worker.train.outcome import (
    ERROR_FILENAME,
    EXIT_FAILED,
    EXIT_STOPPED,
    OUT_OF_MEMORY_HINT,
    OUTCOME_FILENAMES,
    ErrorCode,
    JobStopped,
    TrainingFailure,
    write_error,
    write_result,
    write_stopped,
)
from fusetune.worker.train.reporter import Reporter, make_reporter
from fusetune.worker.train.tracking import with_trackers
from fusetune.worker.train.trainer import Trainer

# How long ranks other than 0 wait, after a known failure, for rank 0 to write error.json before they exit:
# torchrun tears down the whole group as soon as one process exits with an error.
ERROR_FILE_WAIT_S = 10.0


def _wait_for_error_file(output_dir: str) -> None:
    deadline = time.monotonic() + ERROR_FILE_WAIT_S
    while time.monotonic() < deadline and not (Path(output_dir) / ERROR_FILENAME).exists():
        time.sleep(0.1)


def run(config: TrainConfig) -> int:
    """Train as one rank of the job; returns the process exit status. Rank 0 writes the outcome file."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    dist_info = init_distributed()
    output_dir = Path(config.output_dir)
    if dist_info.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        for stale in OUTCOME_FILENAMES:
            (output_dir / stale).unlink(missing_ok=True)
    barrier()

    reporter: Reporter | None = None
    failure: tuple[ErrorCode, str] | None = None
    try:
        reporter = make_reporter(config.database_url, config.job_id, dist_info.is_main)
        reporter = with_trackers(reporter, config, dist_info.is_main)  # W&B, MLflow: rank 0 only
        result = Trainer(config, dist_info, reporter).train()
        if dist_info.is_main:
            write_result(output_dir, result)
    except JobStopped as stopped:
        if dist_info.is_main:
            write_stopped(output_dir, stopped)
        if reporter is not None:
            reporter.event(str(stopped), level="warning", data={"event": "stopped", "reason": stopped.reason})
        shutdown()
        return EXIT_STOPPED
    except TrainingFailure as exc:
        failure = (exc.code, exc.message)
    except torch.OutOfMemoryError as exc:
        traceback.print_exc()
        failure = (
            ErrorCode.OUT_OF_MEMORY,
            f"out of memory: {str(exc).splitlines()[0]}. {OUT_OF_MEMORY_HINT}",
        )
    except Exception as exc:
        traceback.print_exc()
        failure = (ErrorCode.TRAINER_ERROR, f"{type(exc).__name__}: {exc}")
    finally:
        if reporter is not None:
            reporter.close()

    if failure is not None:
        code, message = failure
        print(f"fusetune trainer (rank {dist_info.rank}) failed [{code}]: {message}", flush=True)
        if dist_info.is_main:
            write_error(output_dir, code, message)
        else:
            _wait_for_error_file(config.output_dir)
        return EXIT_FAILED
    shutdown()
    return 0
