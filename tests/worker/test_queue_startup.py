"""Start-up of the job queue on the default SQLite broker, and of the worker `fusetune serve` runs beside the API.

kombu's SQLAlchemy transport creates a queue's row by a select and then an insert, so a worker starting while
the API publishes its first job could both insert it; the loser got an IntegrityError, and a worker that lost
exited at start, leaving every job queued. The lost race is forced here rather than raced for.
"""

from __future__ import annotations

import sqlite3
import sys
import time

import pytest
from kombu.transport import sqlalchemy as kombu_sqlalchemy
from sqlalchemy.exc import IntegrityError

from fusetune.cli import EmbeddedWorker
from fusetune.config import Settings
from fusetune.queue import JOBS_QUEUE, declare_jobs_queue, make_celery_app


def _lose_the_first_race(monkeypatch) -> list[str]:
    """The first queue creation fails as it does when another process inserted the row first."""
    calls: list[str] = []
    original = kombu_sqlalchemy.Channel._get_or_create

    def get_or_create(channel, queue):
        calls.append(queue)
        if len(calls) == 1:
            raise IntegrityError("INSERT INTO kombu_queue", {}, Exception("UNIQUE constraint failed"))
        return original(channel, queue)

    monkeypatch.setattr(kombu_sqlalchemy.Channel, "_get_or_create", get_or_create)
    return calls


def _queue_rows(settings: Settings) -> list[tuple[str]]:
    with sqlite3.connect(settings.data_dir / "broker.db") as connection:
        return connection.execute("SELECT name FROM kombu_queue").fetchall()


def test_a_lost_race_to_create_the_queue_is_retried(tmp_path, monkeypatch):
    settings = Settings(data_dir=tmp_path, database_url=f"sqlite:///{tmp_path / 'db.sqlite'}")
    app = make_celery_app(settings)
    calls = _lose_the_first_race(monkeypatch)
    declare_jobs_queue(app)
    assert len(calls) >= 2
    assert _queue_rows(settings) == [(JOBS_QUEUE,)]
    declare_jobs_queue(app)  # again: the row exists, nothing fails
    assert _queue_rows(settings) == [(JOBS_QUEUE,)]


def test_without_the_retry_the_lost_race_fails(tmp_path, monkeypatch):
    """What a worker or the API met before the retry: the same forced loss with a single attempt raises."""
    settings = Settings(data_dir=tmp_path, database_url=f"sqlite:///{tmp_path / 'db.sqlite'}")
    _lose_the_first_race(monkeypatch)
    with pytest.raises(IntegrityError):
        declare_jobs_queue(make_celery_app(settings), attempts=1)


def test_the_embedded_worker_is_started_again_when_it_exits(tmp_path):
    """A stand-in worker that records each start and exits at once is started again, and stop() ends it."""
    starts = tmp_path / "starts"
    command = [sys.executable, "-c", f"open({str(starts)!r}, 'a').write('start\\n'); raise SystemExit(3)"]
    worker = EmbeddedWorker(command, env={}, first_delay_s=0.01)
    worker.start()
    try:
        deadline = time.monotonic() + 120  # a bound for a stuck supervisor, not a speed assumption
        while not (starts.exists() and len(starts.read_text().splitlines()) >= 3):
            assert time.monotonic() < deadline, "the worker was not started again"
            time.sleep(0.05)
    finally:
        worker.stop()
    count = len(starts.read_text().splitlines())
    time.sleep(0.2)
    assert len(starts.read_text().splitlines()) == count  # stopped: no start after stop()
