"""Early stopping (the job's `early_stopping`): end training once the validation loss has not improved by
`min_delta` for `patience` evaluations in a row, with the checkpoint of the best evaluation as the job's model.

The loop tells it each evaluation's validation loss (`observe`). An evaluation that improves on the best gets
a checkpoint of its own if its step has none, and the checkpointer never prunes that one. When the patience
runs out the loop stops at the next step boundary and `end_on_best` makes the best checkpoint the run's final
one: the checkpoints after it (resume points of a run that is now over) are removed, the best is marked, and an
event says why training stopped. The job then succeeds as any other.

Its state (the best loss and step, the evaluations since) is part of the training state a checkpoint carries, so
a paused or resumed run counts on where it stopped.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from fusetune.spec.hyperparameters import EarlyStoppingSpec
from fusetune.worker.train.checkpoints import layout
from fusetune.worker.train.checkpoints.checkpointer import Checkpointer
from fusetune.worker.train.reporter import Reporter

# The key of its state in a checkpoint's resume state.
RESUME_EARLY_STOPPING = "early_stopping"


class EarlyStopping:
    """Does nothing when the job did not ask for it (`spec` None)."""

    def __init__(self, spec: EarlyStoppingSpec | None, checkpoints: Checkpointer, reporter: Reporter) -> None:
        self.spec = spec
        self.checkpoints = checkpoints
        self.reporter = reporter
        self.best_loss = math.inf
        self.best_step: int | None = None
        self.evaluations_without_improvement = 0
        self.stopped = False

    def observe(self, step: int, valid_loss: float | None) -> bool:
        """Counts one evaluation; True when it is the best so far (its step then needs a checkpoint, see
        `best_saved`). Sets `stopped` when the patience has run out."""
        if self.spec is None or valid_loss is None or self.stopped:
            return False
        if valid_loss < self.best_loss - self.spec.min_delta:
            self.best_loss, self.best_step = valid_loss, step
            self.evaluations_without_improvement = 0
            return True
        self.evaluations_without_improvement += 1
        if self.evaluations_without_improvement >= self.spec.patience:
            self.stopped = True
            self.reporter.event(
                f"Early stopping at step {step}: the validation loss has not improved on {self.best_loss:.4f} "
                f"(step {self.best_step}) by more than {self.spec.min_delta:g} in {self.spec.patience} "
                f"evaluation(s); the checkpoint of step {self.best_step} is the fine-tuned model",
                data={"event": "early_stopped", "step": step, "best_step": self.best_step,
                      "best_valid_loss": self.best_loss, "patience": self.spec.patience,
                      "min_delta": self.spec.min_delta},
            )  # fmt: skip
        return False

    def best_saved(self) -> None:
        """The best step's checkpoint is written: keep it whatever keep_last_checkpoints says."""
        assert self.best_step is not None
        self.checkpoints.keep = layout.checkpoint_path(self.checkpoints.config.output_dir, self.best_step)

    def end_on_best(self) -> Path:
        """After the loop stopped early: the best checkpoint, now the run's last (rank 0 removes the newer ones
        and reports the best); returns its folder."""
        assert self.stopped and self.best_step is not None
        output_dir = self.checkpoints.config.output_dir
        best = layout.checkpoint_path(output_dir, self.best_step)
        if self.checkpoints.dist.is_main:
            newer = [path for step, path in layout.list_checkpoints(output_dir) if step > self.best_step]
            if newer:
                self.reporter.checkpoints_deleted([self.checkpoints.reported_path(path) for path in newer])
            for path in newer:
                layout.delete_checkpoint(path)
            self.reporter.best_checkpoint(self.checkpoints.reported_path(best))
        return best

    def state_dict(self) -> dict[str, Any]:
        return {
            "best_loss": self.best_loss,
            "best_step": self.best_step,
            "evaluations_without_improvement": self.evaluations_without_improvement,
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if not state:
            return
        self.best_loss, self.best_step = state["best_loss"], state["best_step"]
        self.evaluations_without_improvement = state["evaluations_without_improvement"]
        if self.spec is not None and self.best_step is not None:
            self.best_saved()
        # A run paused at the very step its patience ran out ends at once when it resumes.
        self.stopped = self.spec is not None and self.evaluations_without_improvement >= self.spec.patience
