"""When a run saves a resumable checkpoint before its final one."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


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
