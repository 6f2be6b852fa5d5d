"""Idempotency-Key on POST: the same key and body return the first response's object, never a second one."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from sqlalchemy.orm import Session

from fusetune.api.errors import ApiError
from fusetune.db import queries
from fusetune.db.models import IdempotentRequest

HEADER = "Idempotency-Key"
MAX_KEY_LENGTH = 255


def body_hash(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def check_key(key: str | None) -> str | None:
    if key is not None and not 1 <= len(key) <= MAX_KEY_LENGTH:
        raise ApiError(400, f"{HEADER} must be 1 to {MAX_KEY_LENGTH} characters.", param=HEADER)
    return key


def replayed_object_id(
    session: Session, tenant: str, route: str, key: str | None, request_hash: str
) -> str | None:
    """The id of the object made by an earlier request with this key, or None for a new key."""
    if key is None:
        return None
    earlier = queries.find_idempotent_request(session, tenant, route, key)
    if earlier is None:
        return None
    if earlier.request_hash != request_hash:
        raise ApiError(400, f"{HEADER} '{key}' was already used with a different request.", param=HEADER,
                       code="idempotency_key_reused")  # fmt: skip
    return earlier.object_id


def remember(
    session: Session, tenant: str, route: str, key: str | None, request_hash: str, object_id: str
) -> None:
    """Recorded in the same transaction as the object, so a lost race fails on the unique key and rolls back."""
    if key is not None:
        session.add(IdempotentRequest(tenant=tenant, route=route, key=key, request_hash=request_hash,
                                      object_id=object_id))  # fmt: skip
