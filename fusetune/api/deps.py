"""FastAPI dependencies: settings, a session per request, the caller's tenant, the job queue."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from fusetune.config import Settings
from fusetune.db.models import DEFAULT_TENANT
from fusetune.queue import JobQueue


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_session(request: Request) -> Iterator[Session]:
    # The request handler owns the transaction: it commits; anything it leaves uncommitted is rolled back.
    with request.app.state.session_factory() as session:
        yield session


def get_tenant(request: Request) -> str:
    return DEFAULT_TENANT


def get_queue(request: Request) -> JobQueue:
    return request.app.state.queue


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session)]
TenantDep = Annotated[str, Depends(get_tenant)]
QueueDep = Annotated[JobQueue, Depends(get_queue)]
