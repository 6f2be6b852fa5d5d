"""Where rank 0 sends events, per-step metrics and checkpoints: SQL for service jobs, stdout otherwise.

Other ranks get a `NullReporter`, so the trainer calls one object the same way on every rank. Rank 0's reporter
may be wrapped in a `tracking.TrackingReporter`, which also sends the run to W&B or MLflow.
"""

from __future__ import annotations

import json
import math
import sys
import time
from enum import StrEnum
from typing import Any, Protocol, TextIO


class StopRequest(StrEnum):
    """What the job's status asks of a running trainer (the larger value wins when ranks disagree)."""

    PAUSE = "pause"  # save a checkpoint with training state at the step boundary, then exit
    HANDOVER = "handover"  # the same, for a worker that is stopping: it gives the job back to the queue
    CANCEL = "cancel"  # exit at once


# A trainer goes on while its job is `running`. `paused` (set by the API) asks for a checkpoint on the way out,
# from which the job resumes later; any other status (cancelled, a final status, or queued again by a reaper
# that gave the job to another worker) and a job row that is gone stop it at once.
RUNNING_STATUS = "running"
PAUSED_STATUS = "paused"

# The trainer asks for the job's status after every step; the SQL reporter reads it at most this often. A
# step boundary comes at least every few seconds on a GPU, so a cancel is seen within about a second of the
# step that follows it, and the read (one indexed primary-key lookup) costs nothing measurable per step.
STATUS_POLL_INTERVAL_S = 1.0

# A worker that is being stopped (SIGTERM, its `serve` gone) asks its trainer for a hand-over through the job's
# row (`handover_requested_at`): the job is not paused for its user, only moved, so its status stays `running`;
# the row, not a file in the run's folder, because rank 0 may run on a node that does not see the worker's disk.


class Reporter(Protocol):
    def event(
        self, message: str, *, level: str = "info", type: str = "message", data: dict[str, Any] | None = None
    ) -> None: ...

    def metric(
        self, step: int, values: dict[str, float], rank_memory: list[dict[str, Any]] | None = None
    ) -> None:
        """`rank_memory`: each rank's memory peaks of the step, with its node and host (metrics.rank_memory)."""

    def checkpoint(self, step: int, path: str, metrics: dict[str, float]) -> None: ...

    def checkpoints_deleted(self, paths: list[str]) -> None: ...

    def best_checkpoint(self, path: str) -> None:
        """The checkpoint at `path` is the run's best (early stopping ended the run on it)."""

    def resolved(self, plan: dict[str, Any]) -> None:
        """What this run resolved at its start (precision, kernels, micro-batch, distribution): the job reports it."""

    def stop_request(self) -> StopRequest | None: ...

    def close(self) -> None: ...


class NullReporter:
    def event(self, message: str, *, level: str = "info", type: str = "message", data=None) -> None:
        pass

    def metric(
        self, step: int, values: dict[str, float], rank_memory: list[dict[str, Any]] | None = None
    ) -> None:
        pass

    def checkpoint(self, step: int, path: str, metrics: dict[str, float]) -> None:
        pass

    def checkpoints_deleted(self, paths: list[str]) -> None:
        pass

    def best_checkpoint(self, path: str) -> None:
        pass

    def resolved(self, plan: dict[str, Any]) -> None:
        pass

    def stop_request(self) -> StopRequest | None:
        return None

    def close(self) -> None:
        pass


class ConsoleReporter:
    """Prints one JSON object per line: `{"kind": "event" | "metric" | "checkpoint", ...}`."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream

    def _print(self, record: dict[str, Any]) -> None:
        stream = self._stream or sys.stdout
        stream.write(json.dumps(record) + "\n")
        stream.flush()

    def event(self, message: str, *, level: str = "info", type: str = "message", data=None) -> None:
        self._print({"kind": "event", "level": level, "type": type, "message": message, "data": data or {}})

    def metric(
        self, step: int, values: dict[str, float], rank_memory: list[dict[str, Any]] | None = None
    ) -> None:
        record: dict[str, Any] = {"kind": "metric", "step": step, "values": values}
        if rank_memory is not None:
            record["rank_memory"] = rank_memory
        self._print(record)

    def checkpoint(self, step: int, path: str, metrics: dict[str, float]) -> None:
        self._print({"kind": "checkpoint", "step": step, "path": path, "metrics": metrics})

    def checkpoints_deleted(self, paths: list[str]) -> None:
        self._print({"kind": "checkpoints_deleted", "paths": paths})

    def best_checkpoint(self, path: str) -> None:
        self._print({"kind": "best_checkpoint", "path": path})

    def resolved(self, plan: dict[str, Any]) -> None:
        pass  # the `started` event printed before it holds the same values

    def stop_request(self) -> StopRequest | None:
        return None

    def close(self) -> None:
        pass


def parse_console_records(text: str) -> list[dict[str, Any]]:
    """The records a `ConsoleReporter` printed, from a log that may hold other lines (torchrun, warnings)."""
    records = []
    for line in text.splitlines():
        start = line.find('{"kind": ')
        if start < 0:
            continue
        try:
            records.append(json.loads(line[start:]))
        except json.JSONDecodeError:
            continue
    return records


class SqlReporter:
    """Writes through `fusetune.db.queries`, committing after each call.

    A failed write is rolled back and logged to stderr rather than raised: losing one metric row is better than
    losing hours of training to a database hiccup.
    """

    def __init__(
        self,
        database_url: str,
        job_id: str,
        status_poll_interval_s: float = STATUS_POLL_INTERVAL_S,
    ) -> None:
        from fusetune.db.session import make_engine, make_session_factory

        self._engine = make_engine(database_url)
        self._session = make_session_factory(self._engine)()
        self._job_id = job_id
        self._status_poll_interval_s = status_poll_interval_s
        self._last_status_poll = float("-inf")
        self._stop: StopRequest | None = None

    def _write(self, what: str, call) -> None:
        from sqlalchemy.exc import SQLAlchemyError

        try:
            call(self._session)
            self._session.commit()
        except SQLAlchemyError as exc:
            self._session.rollback()
            print(f"fusetune trainer: could not record {what} for job {self._job_id}: {exc}", file=sys.stderr)

    def event(self, message: str, *, level: str = "info", type: str = "message", data=None) -> None:
        from fusetune.db import queries

        self._write(
            "an event",
            lambda s: queries.add_event(s, self._job_id, message, level=level, type=type, data=data),
        )

    def metric(
        self, step: int, values: dict[str, float], rank_memory: list[dict[str, Any]] | None = None
    ) -> None:
        from fusetune.db import queries

        def write(session) -> None:
            queries.add_metric(session, self._job_id, step, values, rank_memory)
            # The job object's trained_tokens and estimated_finish follow the run (OpenAI's fields).
            tokens, eta_s = values.get("trained_tokens"), values.get("eta_s")
            finish = int(time.time() + eta_s) if eta_s is not None and math.isfinite(eta_s) else None
            queries.set_job_progress(session, self._job_id, None if tokens is None else int(tokens), finish)

        self._write(f"metrics of step {step}", write)

    def checkpoint(self, step: int, path: str, metrics: dict[str, float]) -> None:
        from fusetune.db import queries

        self._write(
            f"the checkpoint of step {step}",
            lambda s: queries.add_checkpoint(s, self._job_id, step, path, metrics),
        )

    def best_checkpoint(self, path: str) -> None:
        from fusetune.db import queries

        self._write("the best checkpoint", lambda s: queries.mark_best_checkpoint(s, self._job_id, path))

    def checkpoints_deleted(self, paths: list[str]) -> None:
        from fusetune.db import queries

        self._write(
            f"the deletion of {len(paths)} checkpoint(s)",
            lambda s: queries.delete_checkpoints(s, self._job_id, paths),
        )

    def resolved(self, plan: dict[str, Any]) -> None:
        from fusetune.db import queries

        self._write("what the run resolved", lambda s: queries.set_job_resolved(s, self._job_id, plan))

    def stop_request(self) -> StopRequest | None:
        """What the job's status asks for; reads it at most once per `status_poll_interval_s`. A cancel is
        final; a pause may still turn into a cancel."""
        from sqlalchemy.exc import SQLAlchemyError

        from fusetune.db import queries

        now = time.monotonic()
        if self._stop == StopRequest.CANCEL or now - self._last_status_poll < self._status_poll_interval_s:
            return self._stop
        self._last_status_poll = now
        try:
            status, handover = queries.get_job_stop_state(self._session, self._job_id)
            self._session.commit()  # end the read transaction so the next poll sees new rows
        except SQLAlchemyError as exc:
            self._session.rollback()
            print(
                f"fusetune trainer: could not read the status of job {self._job_id}: {exc}", file=sys.stderr
            )
            return self._stop
        if status == PAUSED_STATUS:
            self._stop = StopRequest.PAUSE
        elif status != RUNNING_STATUS:
            self._stop = StopRequest.CANCEL
        if handover and self._stop != StopRequest.CANCEL:
            self._stop = StopRequest.HANDOVER
        return self._stop

    def close(self) -> None:
        self._session.close()
        self._engine.dispose()


def make_reporter(database_url: str | None, job_id: str | None, is_main_process: bool) -> Reporter:
    if not is_main_process:
        return NullReporter()
    if database_url is None:
        return ConsoleReporter()
    if job_id is None:
        raise ValueError("a job_id is needed to report to a database")
    return SqlReporter(database_url, job_id)
