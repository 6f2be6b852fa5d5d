"""/v1/files: upload, list, retrieve, delete and read training files."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import PurePath
from typing import Annotated, BinaryIO, Literal
from urllib.parse import quote

from fastapi import APIRouter, Depends, Form, Header, Query, Request, UploadFile
from fastapi.responses import RedirectResponse, Response, StreamingResponse
from sqlalchemy.exc import IntegrityError

from fusetune.api import idempotency
from fusetune.api.deps import SessionDep, SettingsDep, StorageDep, TenantDep
from fusetune.api.errors import MAX_FILENAME_CHARS, ApiError, not_found
from fusetune.api.file_validation import TRAINING_PURPOSE, validate_chat_jsonl, validate_eval_jsonl
from fusetune.api.schemas import FileDeleted, FileList, FileObject
from fusetune.db import queries
from fusetune.db.models import File, new_id
from fusetune.spec.evals import EVALS_PURPOSE
from fusetune.storage import FileWriter, StorageError

router = APIRouter(prefix="/v1/files", tags=["files"])

# Training examples, or eval items (`{"item": {...}}`, read by eval runs), each checked by its own validator.
PURPOSES = (TRAINING_PURPOSE, EVALS_PURPOSE)
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


class _UploadLines:
    """The upload, line by line, for the validator; every chunk read on the way is counted against the size
    limit (413 as soon as it is crossed), hashed for Idempotency-Key and passed on to the store, so the file is
    checked and stored in one pass without being held in memory."""

    def __init__(self, source: BinaryIO, writer: FileWriter, limit: int, digest):
        self.source = source
        self.writer = writer
        self.limit = limit
        self.digest = digest
        self.size = 0

    def _chunks(self) -> Iterator[bytes]:
        while chunk := self.source.read(_COPY_CHUNK_BYTES):
            self.size += len(chunk)
            if self.size > self.limit:
                raise ApiError(413, f"File is larger than the limit of {self.limit} bytes.", param="file")
            self.digest.update(chunk)
            self.writer.write(chunk)
            yield chunk

    def __iter__(self) -> Iterator[bytes]:
        partial: list[bytes] = []
        for chunk in self._chunks():
            start = 0
            while (end := chunk.find(b"\n", start)) != -1:
                yield b"".join([*partial, chunk[start : end + 1]])
                partial.clear()
                start = end + 1
            if start < len(chunk):
                partial.append(chunk[start:])
        if partial:
            yield b"".join(partial)


def _storage_failed(error: StorageError) -> ApiError:
    return ApiError(503, f"The file store failed: {error}", code="storage_error")


# Form parts of an upload that may come once: a second one used to win silently.
SINGLE_FORM_PARTS = ("file", "purpose")


async def _single_form_parts(request: Request) -> None:
    # Parsed once: FastAPI reads the same, cached, form for the route's parameters.
    form = await request.form()
    for name in SINGLE_FORM_PARTS:
        count = len(form.getlist(name))
        if count > 1:
            raise ApiError(400, f"The form has {count} '{name}' parts; send one.", param=name,
                           code="duplicate_form_part")  # fmt: skip


def _check_filename(name: str) -> None:
    # NUL, newlines and other control characters would be stored and echoed back in listings and downloads.
    bad = next((c for c in name if ord(c) < 32 or 127 <= ord(c) < 160), None)
    if bad is not None:
        raise ApiError(400, f"The file's name has a control character (U+{ord(bad):04X}); rename the file.",
                       param="file", code="invalid_filename")  # fmt: skip


@router.post("", response_model=FileObject, dependencies=[Depends(_single_form_parts)])
def create_file(
    file: UploadFile,
    purpose: Annotated[str, Form()],
    session: SessionDep,
    storage: StorageDep,
    settings: SettingsDep,
    tenant: TenantDep,
    idempotency_key: Annotated[str | None, Header(alias=idempotency.HEADER)] = None,
) -> FileObject:
    if purpose not in PURPOSES:
        raise ApiError(
            400, f"purpose must be one of {', '.join(PURPOSES)} (got '{purpose}').", param="purpose"
        )
    _check_filename(file.filename or "")
    filename = PurePath(file.filename or "upload.jsonl").name
    if len(filename) > MAX_FILENAME_CHARS:
        raise ApiError(400, f"The file's name is {len(filename):,} characters, over the limit of "
                       f"{MAX_FILENAME_CHARS}; rename the file.", param="file", code="invalid_filename")  # fmt: skip
    if not filename.endswith(".jsonl"):
        raise ApiError(
            400, f"Training files must be JSON Lines with a .jsonl name (got '{filename}').", param="file"
        )
    key = idempotency.check_key(idempotency_key)
    file_id = new_id("file-")
    storage_name = f"{file_id}.jsonl"
    digest = hashlib.sha256(f"{purpose}\0{filename}\0".encode())
    try:
        # The writer publishes the file only on commit(); leaving the block without it discards what was
        # written (a temporary file beside the final one, or an aborted multipart upload).
        with storage.file_writer(tenant, storage_name, download_name=filename) as writer:
            upload = _UploadLines(file.file, writer, settings.max_upload_bytes, digest)
            validate = validate_eval_jsonl if purpose == EVALS_PURPOSE else validate_chat_jsonl
            report = validate(upload, settings.max_example_bytes)
            earlier = idempotency.replayed_object_id(session, tenant, "files", key, digest.hexdigest())
            if earlier is not None:
                return to_schema(_get(session, earlier, tenant))
            if report.errors:
                raise ApiError(
                    400,
                    f"Invalid {'eval data' if purpose == EVALS_PURPOSE else 'training'} file '{filename}': "
                    f"{report.summary()}",
                    param="file",
                    code="invalid_file",
                )
            row = File(
                id=file_id,
                tenant=tenant,
                filename=filename,
                purpose=purpose,
                bytes=upload.size,
                storage_name=storage_name,
                example_count=report.example_count,
                token_estimate=report.token_estimate,
                method=report.method,
            )
            session.add(row)
            idempotency.remember(session, tenant, "files", key, digest.hexdigest(), file_id)
            writer.commit()
    except StorageError as error:
        raise _storage_failed(error) from error
    try:
        session.commit()
    except IntegrityError:
        # A concurrent request with the same Idempotency-Key won: answer with its file.
        session.rollback()
        storage.delete_file(tenant, storage_name)
        earlier = idempotency.replayed_object_id(session, tenant, "files", key, digest.hexdigest())
        if earlier is None:
            raise
        return to_schema(_get(session, earlier, tenant))
    except Exception:
        storage.delete_file(tenant, storage_name)
        raise
    return to_schema(row)


# OpenAI's bounds and default of a page of files.
MAX_FILES_PER_PAGE = 10_000


@router.get("", response_model=FileList)
def list_files(
    session: SessionDep,
    tenant: TenantDep,
    purpose: Annotated[str | None, Query(description="Only files of this purpose")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_FILES_PER_PAGE)] = MAX_FILES_PER_PAGE,
    after: Annotated[str | None, Query(description="The last file id of the previous page")] = None,
    order: Annotated[Literal["asc", "desc"], Query(description="By creation time")] = "desc",
) -> FileList:
    cursor = None
    if after is not None:
        # An unknown cursor would otherwise read as no cursor and answer the first page again.
        cursor = queries.get_file(session, after, tenant)
        if cursor is None:
            raise not_found("file", after, param="after")
    rows, has_more = queries.page_files(
        session, tenant, purpose=purpose, after=cursor, limit=limit, order=order
    )
    data = [to_schema(row) for row in rows]
    return FileList(
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
        has_more=has_more,
    )


def _get(session, file_id: str, tenant: str) -> File:
    row = queries.get_file(session, file_id, tenant)
    if row is None:
        raise not_found("file", file_id, param="file_id")
    return row


@router.get("/{file_id}", response_model=FileObject)
def retrieve_file(file_id: str, session: SessionDep, tenant: TenantDep) -> FileObject:
    return to_schema(_get(session, file_id, tenant))


@router.delete("/{file_id}", response_model=FileDeleted)
def delete_file(file_id: str, session: SessionDep, storage: StorageDep, tenant: TenantDep) -> FileDeleted:
    row = _get(session, file_id, tenant)
    if queries.file_in_use(session, file_id):
        raise ApiError(
            400, f"File '{file_id}' is used by a fine-tuning job and cannot be deleted.", param="file_id"
        )
    queries.delete_file(session, row)
    session.commit()
    # After the commit: a failed delete leaves an object no row names (harmless), never a row without its file.
    try:
        storage.delete_file(tenant, row.storage_name)
    except StorageError as error:
        raise _storage_failed(error) from error
    return FileDeleted(id=file_id)


def presigned_redirect(url: str) -> RedirectResponse:
    """307: the client repeats the same GET (with its Range header) at the store; the URL expires, so the answer
    is not to be cached."""
    return RedirectResponse(url, status_code=307, headers={"Cache-Control": "no-store"})


@router.get(
    "/{file_id}/content",
    response_class=StreamingResponse,
    responses={307: {"description": "A presigned URL of the file in the object store (when configured)."}},
)
def file_content(file_id: str, session: SessionDep, storage: StorageDep, tenant: TenantDep) -> Response:
    row = _get(session, file_id, tenant)  # the tenant's file, checked before any URL is signed
    try:
        url = storage.file_download_url(tenant, row.storage_name)
    except StorageError as error:
        raise _storage_failed(error) from error
    if url is not None:
        return presigned_redirect(url)
    return StreamingResponse(
        storage.iter_file(tenant, row.storage_name),
        media_type="text/csv" if row.filename.endswith(".csv") else "application/jsonl",  # results files
        headers={
            "Content-Length": str(row.bytes),
            "Content-Disposition": f"attachment; filename*=utf-8''{quote(row.filename)}",
        },
    )
