"""Reads: the polled routes' database work, inline on SQLite and in a worker thread on other databases."""

from __future__ import annotations

import asyncio
import sqlite3
import threading

import pytest
from fastapi.testclient import TestClient

from fusetune.api.app import create_app
from fusetune.api.deps import Reads
from fusetune.api.schemas import EventList, MetricList
from fusetune.config import Settings
from fusetune.db import queries
from fusetune.db.migrate import upgrade
from fusetune.db.models import File, Job, JobStatus
from fusetune.db.session import make_engine, make_session_factory

JOB_ID = "ftjob-reads"
RANK_MEMORY = [
    {"rank": rank, "node": 0, "host": "gpu-host-0", "peak_memory_allocated_bytes": 1e9 + rank,
     "peak_memory_reserved_bytes": 2e9 + rank}
    for rank in (0, 1)
]  # fmt: skip


@pytest.fixture
def settings(tmp_path) -> Settings:
    settings = Settings(data_dir=tmp_path / "data")
    settings.ensure_dirs()
    upgrade(settings.database_url)
    with make_session_factory(make_engine(settings.database_url))() as session:
        session.add(File(id="file-reads", tenant="acme", filename="t.jsonl", purpose="fine-tune", bytes=1,
                         storage_name="t.jsonl"))  # fmt: skip
        session.add(Job(id=JOB_ID, tenant="acme", model="tiny", training_file_id="file-reads",
                        status=JobStatus.RUNNING, hyperparameters={"n_epochs": 1}))  # fmt: skip
        session.flush()
        # Step 1 as a run of two ranks reports it, with each rank's memory; 2 and 3 as older runs did, without.
        queries.add_metric(session, JOB_ID, 1, {"train_loss": 1.0, "grad_norm": float("nan")}, RANK_MEMORY)
        for step in (2, 3):
            queries.add_metric(session, JOB_ID, step, {"train_loss": 1.0 / step, "grad_norm": float("nan")})
        session.commit()
    return settings


def _key(settings: Settings, tenant: str) -> str:
    with make_session_factory(make_engine(settings.database_url))() as session:
        _, plaintext = queries.create_api_key(session, tenant)
        session.commit()
    return plaintext


def _thread_of_read(reads: Reads) -> tuple[int, int]:
    async def main() -> tuple[int, int]:
        return threading.get_ident(), await reads(lambda connection: threading.get_ident())

    return asyncio.run(main())


def test_sqlite_reads_run_on_the_event_loop_and_others_in_a_worker_thread(settings):
    engine = make_engine(settings.database_url)
    loop_thread, read_thread = _thread_of_read(Reads.for_engine(engine))
    assert read_thread == loop_thread
    loop_thread, read_thread = _thread_of_read(Reads(engine, inline=False))
    assert read_thread != loop_thread


def test_an_inline_read_does_not_wait_for_a_writer(settings):
    """The premise of reading on the event loop: in WAL mode a reader sees the last commit while another
    connection holds the write lock. Without WAL this read would fail with 'database is locked'."""
    engine = make_engine(settings.database_url)
    reads = Reads.for_engine(engine)
    writer = sqlite3.connect(settings.database_url.removeprefix("sqlite:///"), isolation_level=None)
    try:
        writer.execute("BEGIN EXCLUSIVE")
        writer.execute("UPDATE jobs SET status = 'cancelled' WHERE id = ?", (JOB_ID,))
        status = asyncio.run(reads(lambda connection: queries.get_job_status(connection, JOB_ID)))
        assert status == JobStatus.RUNNING  # the committed state, not the writer's
    finally:
        writer.execute("ROLLBACK")
        writer.close()


def test_inline_reads_share_a_connection_that_sees_each_new_commit(settings):
    engine = make_engine(settings.database_url)
    reads = Reads.for_engine(engine)
    connections = []

    def status(connection):
        connections.append(connection)
        return queries.get_job_status(connection, JOB_ID)

    assert asyncio.run(reads(status)) == JobStatus.RUNNING
    writer = sqlite3.connect(settings.database_url.removeprefix("sqlite:///"))
    with writer:
        writer.execute("UPDATE jobs SET status = 'cancelled' WHERE id = ?", (JOB_ID,))
    writer.close()
    assert asyncio.run(reads(status)) == JobStatus.CANCELLED
    assert connections[0] is connections[1]
    # No read transaction left open between requests (it would pin an old snapshot and hold back checkpoints).
    assert not connections[0].connection.dbapi_connection.in_transaction
    reads.close()


@pytest.mark.parametrize("inline", [True, False])
def test_polled_routes_answer_the_owner_and_nobody_else(settings, inline):
    app = create_app(settings)
    app.state.reads = Reads(app.state.engine, inline=inline)
    owner = TestClient(app, headers={"Authorization": f"Bearer {_key(settings, 'acme')}"})
    stranger = TestClient(app, headers={"Authorization": f"Bearer {_key(settings, 'other')}"})
    base = f"/v1/fine_tuning/jobs/{JOB_ID}"
    assert owner.get(base).json()["status"] == JobStatus.RUNNING
    assert [p["step"] for p in owner.get(f"{base}/metrics").json()["data"]] == [1, 2, 3]
    assert [p["step"] for p in owner.get(f"{base}/metrics", params={"min_step": 2}).json()["data"]] == [2, 3]
    first_page = MetricList.model_validate_json(owner.get(f"{base}/metrics", params={"limit": 2}).content)
    assert first_page.data[0].values == {"train_loss": 1.0, "grad_norm": None}
    assert [rank.model_dump() for rank in first_page.data[0].rank_memory] == RANK_MEMORY
    assert first_page.data[1].rank_memory is None
    first_page = first_page.model_dump()
    assert first_page == owner.get(f"{base}/metrics", params={"limit": 2}).json()
    assert [p["step"] for p in first_page["data"]] == [1, 2] and first_page["has_more"]
    last_page = owner.get(f"{base}/metrics", params={"limit": 2, "min_step": 3, "max_step": 3}).json()
    assert [p["step"] for p in last_page["data"]] == [3] and not last_page["has_more"]
    too_far = owner.get(f"{base}/metrics", params={"max_step": 2**63})
    assert too_far.status_code == 400 and too_far.json()["error"]["param"] == "max_step"
    newest = owner.get(f"{base}/events", params={"limit": 1}).json()["data"][0]["id"]
    after = owner.get(f"{base}/events", params={"after": newest}).json()
    assert [e["data"]["step"] for e in after["data"]] == [2, 1] and not after["has_more"]
    events = owner.get(f"{base}/events", params={"limit": 2}).json()
    assert EventList.model_validate(events).model_dump() == events
    assert events["has_more"] and [e["data"]["step"] for e in events["data"]] == [3, 2]
    for path in (base, f"{base}/events", f"{base}/metrics"):
        response = stranger.get(path)
        assert response.status_code == 404, path
        assert response.json()["error"]["param"] == "fine_tuning_job_id"
    assert TestClient(app, headers={"Authorization": "Bearer sk-wrong"}).get(base).status_code == 401
