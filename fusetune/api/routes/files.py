"""/v1/files: upload, list, retrieve, delete and read training files."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import PurePath
from typing import Annotated

from fastapi import APIRouter, Form, Header, UploadFile
from fastapi.responses import FileResponse
from sqlalchemy.exc import IntegrityError

from fusetune.api import idempotency
from fusetune.api.deps import SessionDep, SettingsDep, TenantDep
from fusetune.api.errors import ApiError, not_found
from fusetune.api.file_validation import validate_chat_jsonl
from fusetune.api.schemas import FileDeleted, FileList, FileObject
from fusetune.db import queries
from fusetune.db.models import File, Job, new_id

router = APIRouter(prefix="/v1/files", tags=["files"])

PURPOSES = ("fine-tune",)
_COPY_CHUNK_BYTES = 1024 * 1024


def to_schema(row: File) -> FileObject:
    return FileObject(
        id=row.id,
        bytes=row.bytes,
        created_at=row.created_at,
        filename=row.filename,
        purpose=row.purpose,
        example_count=row.example_count,
        token_estimate=row.token_estimate,
        method=row.method,
    )


@router.post("", response_model=FileObject)
def create_file(
    file: UploadFile,
    purpose: Annotated[str, Form()],
    session: SessionDep,
    settings: SettingsDep,
    tenant: TenantDep,
    idempotency_key: Annotated[str | None, Header(alias=idempotency.HEADER)] = None,
) -> FileObject:
    if purpose not in PURPOSES:
        raise ApiError(
            400, f"purpose must be one of {', '.join(PURPOSES)} (got '{purpose}').", param="purpose"
        )
    filename = PurePath(file.filename or "upload.jsonl").name[:255]
    if not filename.endswith(".jsonl"):
        raise ApiError(
            400, f"Training files must be JSON Lines with a .jsonl name (got '{filename}').", param="file"
        )
    settings.ensure_dirs()
    file_id = new_id("file-")
    storage_name = f"{file_id}.jsonl"
    # Write beside the final place and rename only once valid, so a rejected upload leaves nothing behind.
    handle, temp_path = tempfile.mkstemp(dir=settings.files_dir, prefix=".upload-", suffix=".part")
    try:
        size = 0
        digest = hashlib.sha256(f"{purpose}\0{filename}\0".encode())
        with os.fdopen(handle, "wb") as out:
            while chunk := file.file.read(_COPY_CHUNK_BYTES):
                size += len(chunk)
                digest.update(chunk)
                if size > settings.max_upload_bytes:
                    raise ApiError(
                        413,
                        f"File is larger than the limit of {settings.max_upload_bytes} bytes.",
                        param="file",
                    )
                out.write(chunk)
        key = idempotency.check_key(idempotency_key)
        earlier = idempotency.replayed_object_id(session, tenant, "files", key, digest.hexdigest())
        if earlier is not None:
            return to_schema(_get(session, earlier, tenant))
        with open(temp_path, "rb") as stream:
            report = validate_chat_jsonl(stream)
        if report.errors:
            raise ApiError(
                400,
                f"Invalid training file '{filename}': {report.summary()}",
                param="file",
                code="invalid_file",
            )
        row = File(
            id=file_id,
            tenant=tenant,
            filename=filename,
            purpose=purpose,
            bytes=size,
            storage_name=storage_name,
            example_count=report.example_count,
            token_estimate=report.token_estimate,
            method=report.method,
        )
        session.add(row)
        idempotency.remember(session, tenant, "files", key, digest.hexdigest(), file_id)
        os.replace(temp_path, settings.files_dir / storage_name)
        try:
            session.commit()
        except IntegrityError:
            # A concurrent request with the same Idempotency-Key won: answer with its file.
            session.rollback()
            (settings.files_dir / storage_name).unlink(missing_ok=True)
            earlier = idempotency.replayed_object_id(session, tenant, "files", key, digest.hexdigest())
            if earlier is None:
                raise
            return to_schema(_get(session, earlier, tenant))
        except Exception:
            (settings.files_dir / storage_name).unlink(missing_ok=True)
            raise
    finally:
        if os.path.exists(temp_path):
            os.unlink(temp_path)
    return to_schema(row)


@router.get("", response_model=FileList)
def list_files(session: SessionDep, tenant: TenantDep, purpose: str | None = None) -> FileList:
    return FileList(data=[to_schema(row) for row in queries.list_files(session, tenant, purpose)])


def _get(session, file_id: str, tenant: str) -> File:
    row = queries.get_file(session, file_id, tenant)
    if row is None:
        raise not_found("file", file_id, param="file_id")
    return row


@router.get("/{file_id}", response_model=FileObject)
def retrieve_file(file_id: str, session: SessionDep, tenant: TenantDep) -> FileObject:
    return to_schema(_get(session, file_id, tenant))


@router.delete("/{file_id}", response_model=FileDeleted)
def delete_file(file_id: str, session: SessionDep, settings: SettingsDep, tenant: TenantDep) -> FileDeleted:
    row = _get(session, file_id, tenant)
    in_use = session.query(Job.id).filter(
        (Job.training_file_id == file_id) | (Job.validation_file_id == file_id)
    )
    if in_use.first() is not None:
        raise ApiError(
            400, f"File '{file_id}' is used by a fine-tuning job and cannot be deleted.", param="file_id"
        )
    session.delete(row)
    session.commit()
    (settings.files_dir / row.storage_name).unlink(missing_ok=True)
    return FileDeleted(id=file_id)


@router.get("/{file_id}/content")
def file_content(file_id: str, session: SessionDep, settings: SettingsDep, tenant: TenantDep) -> FileResponse:
    row = _get(session, file_id, tenant)
    return FileResponse(
        settings.files_dir / row.storage_name, media_type="application/jsonl", filename=row.filename
    )
