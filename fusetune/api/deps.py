"""FastAPI dependencies: settings, a session per request, the caller's tenant, the job queue."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from fusetune.api.errors import ApiError
from fusetune.config import Settings
from fusetune.db import queries
from fusetune.db.models import DEFAULT_TENANT
from fusetune.queue import JobQueue


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_session(request: Request) -> Iterator[Session]:
    # The request handler owns the transaction: it commits; anything it leaves uncommitted is rolled back.
    with request.app.state.session_factory() as session:
        yield session


def get_tenant(request: Request, session: Annotated[Session, Depends(get_session)]) -> str:
    """The tenant of the caller's Bearer key; every object a request touches must belong to it."""
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise ApiError(401, "Missing API key: send 'Authorization: Bearer <key>'.", code="missing_api_key")
    key = key.strip()
    settings: Settings = request.app.state.settings
    if settings.dev_api_key and secrets.compare_digest(key, settings.dev_api_key):
        return DEFAULT_TENANT
    tenant = queries.tenant_for_api_key(session, key)
    if tenant is None:
        raise ApiError(401, "Invalid or revoked API key.", code="invalid_api_key")
    return tenant


def get_queue(request: Request) -> JobQueue:
    return request.app.state.queue


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session)]
TenantDep = Annotated[str, Depends(get_tenant)]
QueueDep = Annotated[JobQueue, Depends(get_queue)]
