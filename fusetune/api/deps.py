"""FastAPI dependencies: settings, a session per request, read-only database work, the caller's tenant, the queue.

FastAPI runs a plain ``def`` dependency in a worker thread (a yield dependency twice: to enter and to exit), and
each trip costs more than these dependencies do themselves, so the ones that do no I/O are ``async def``.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Callable
from typing import Annotated, TypeVar

from fastapi import Depends, Request
from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from fusetune.api.errors import ApiError
from fusetune.config import Settings
from fusetune.db import queries
from fusetune.db.models import DEFAULT_TENANT
from fusetune.queue import JobQueue
from fusetune.storage import Storage

T = TypeVar("T")


class Reads:
    """Runs a request's read-only database work on a connection of its own (Core rows, no ORM Session).

    On SQLite (the embedded default, in WAL mode) a read is answered from the last committed snapshot without
    waiting on writers, so it runs inline on the event loop. In a worker thread it cost twice as much: the
    sqlite3 module releases the GIL at every row and each time has to win it back from the busy event loop
    (3.1 vs 7.3 ms of CPU per polled request, 50 concurrent requests, on the 2-core CPU machine). A network
    database makes a read wait on the network, so there it goes to a worker thread. Nothing given to this may
    write: a write can wait on SQLite's lock for the whole busy timeout.
    """

    def __init__(self, engine: Engine, inline: bool):
        self._engine = engine
        self.inline = inline
        # Inline reads all run on the event loop's thread, one at a time, so they share one connection in
        # autocommit mode: each SELECT reads the latest commit and leaves no transaction open, and no request
        # pays for a pool checkout and the ROLLBACK of its return (7% of a polled request's CPU time).
        self._inline_connection: Connection | None = None

    @classmethod
    def for_engine(cls, engine: Engine) -> Reads:
        return cls(engine, inline=engine.dialect.name == "sqlite")

    async def __call__(self, work: Callable[[Connection], T]) -> T:
        if self.inline:
            return self._run_inline(work)
        return await run_in_threadpool(self._run, work)

    def _run(self, work: Callable[[Connection], T]) -> T:
        with self._engine.connect() as connection:
            return work(connection)

    def _run_inline(self, work: Callable[[Connection], T]) -> T:
        if self._inline_connection is None:
            self._inline_connection = self._engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        try:
            return work(self._inline_connection)
        except DBAPIError:
            # A broken connection is not reused; the next read opens a new one.
            self.close()
            raise

    def close(self) -> None:
        if self._inline_connection is not None:
            self._inline_connection.close()
            self._inline_connection = None


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_session(request: Request) -> AsyncIterator[Session]:
    # The request handler owns the transaction: it commits; anything it leaves uncommitted is rolled back.
    # Building a Session does no I/O: it connects on first use, in the handler's worker thread.
    session: Session = request.app.state.session_factory()
    try:
        yield session
    finally:
        # Closing hands the connection back to the pool with a ROLLBACK, which may wait on the database.
        await run_in_threadpool(session.close)


async def get_reads(request: Request) -> Reads:
    return request.app.state.reads


async def get_tenant(request: Request) -> str:
    """The tenant of the caller's Bearer key; every object a request touches must belong to it."""
    headers = request.headers.getlist("authorization")
    if len(headers) > 1:
        # Proxies and servers disagree on which of two wins: refuse rather than guess.
        raise ApiError(400, f"The request has {len(headers)} Authorization headers; send one.",
                       param="Authorization", code="duplicate_header")  # fmt: skip
    header = headers[0] if headers else ""
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise ApiError(401, "Missing API key: send 'Authorization: Bearer <key>'.", code="missing_api_key")
    key = key.strip()
    settings: Settings = request.app.state.settings
    if settings.dev_api_key and secrets.compare_digest(key, settings.dev_api_key):
        return DEFAULT_TENANT
    # Looked up on every request, not cached, so that a revoked key stops working at once.
    reads: Reads = request.app.state.reads
    tenant = await reads(lambda connection: queries.tenant_for_api_key(connection, key))
    if tenant is None:
        raise ApiError(401, "Invalid or revoked API key.", code="invalid_api_key")
    return tenant


async def get_queue(request: Request) -> JobQueue:
    return request.app.state.queue


async def get_storage(request: Request) -> Storage:
    return request.app.state.storage


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session)]
ReadsDep = Annotated[Reads, Depends(get_reads)]
TenantDep = Annotated[str, Depends(get_tenant)]
QueueDep = Annotated[JobQueue, Depends(get_queue)]
StorageDep = Annotated[Storage, Depends(get_storage)]
