"""Checkpoint downloads: a tar of a checkpoint folder, streamed straight from its files, with HTTP Range.

The files come from the storage layer (a local folder or an object store's checkpoint, read by byte range), so
the archive is the same bytes whichever holds the checkpoint. The archive is never written to disk (a copy would double the checkpoint's footprint and hold back the first
byte until all of it was written). Its bytes are a function of the folder's file names, sizes, permission bits
and modification times alone: members in sorted order, no directory entries, blank owners. So a Range
request that resumes a download gets exactly the bytes the first request would have sent, and two requests
for the same variant always describe the same archive. The layout is what Python's ``tarfile`` writes for
these members (PAX format, the end-of-archive blocks, padding to a whole record), so any tar reader opens it.

The ETag is computed from the same inputs; a client resuming with ``If-Range`` gets the whole archive again,
not a splice of two, if the folder changed in between.
"""

from __future__ import annotations

import hashlib
import re
import tarfile
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from fastapi.responses import JSONResponse, Response, StreamingResponse

from fusetune.api.errors import error_body
from fusetune.storage import LocalStorage, StoredFile, read_file_range

__all__ = [
    "CheckpointArchive",
    "archive_response",
    "iter_archive_bytes",
    "plan_archive",
    "plan_stored_archive",
]

# Bytes [first, last) of one file of the checkpoint, given its path relative to the checkpoint folder.
RangeReader = Callable[[str, int, int], Iterator[bytes]]

_TAR_FORMAT = tarfile.PAX_FORMAT
_TAR_ENCODING = "utf-8"
_TAR_ERRORS = "surrogateescape"
_SINGLE_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


@dataclass(frozen=True)
class _FileContent:
    relative: str
    size: int
    read: RangeReader


@dataclass(frozen=True)
class CheckpointArchive:
    """The byte layout of one archive: header and padding bytes, and the file contents between them."""

    pieces: tuple[bytes | _FileContent, ...]
    size: int
    etag: str
    member_names: tuple[str, ...]


def plan_archive(folder: Path, *, excluded_top_level: Collection[str] = ()) -> CheckpointArchive:
    """The archive of a local `folder` (members named `<folder name>/<relative path>`), leaving out the
    top-level entries named in `excluded_top_level`."""
    files = LocalStorage.folder_files(folder, excluded_top_level)
    return plan_stored_archive(
        folder.name,
        files,
        lambda relative, first, last: read_file_range(
            folder / relative, first, last, f"{folder.name}/{relative}"
        ),
    )


def plan_stored_archive(name: str, files: Sequence[StoredFile], read: RangeReader) -> CheckpointArchive:
    """The archive of a checkpoint's `files` (sorted by path), members named `<name>/<path>`."""
    pieces: list[bytes | _FileContent] = []
    names: list[str] = []
    fingerprint = hashlib.sha256()
    offset = 0
    for entry in files:
        info = tarfile.TarInfo(f"{name}/{entry.path}")
        info.size = entry.size
        info.mtime = entry.mtime_ns // 1_000_000_000
        info.mode = entry.mode
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        header = info.tobuf(_TAR_FORMAT, _TAR_ENCODING, _TAR_ERRORS)
        padding = -info.size % tarfile.BLOCKSIZE
        pieces += [header, _FileContent(entry.path, info.size, read), b"\0" * padding]
        offset += len(header) + info.size + padding
        names.append(info.name)
        fingerprint.update(f"{info.name}\0{info.size}\0{entry.mtime_ns}\0{info.mode}\n".encode())
    # The end-of-archive marker (two zero blocks), then zeros up to a whole record, as tarfile closes a file.
    trailer = 2 * tarfile.BLOCKSIZE
    trailer += -(offset + trailer) % tarfile.RECORDSIZE
    pieces.append(b"\0" * trailer)
    return CheckpointArchive(
        pieces=tuple(pieces),
        size=offset + trailer,
        etag=f'"{fingerprint.hexdigest()[:32]}"',
        member_names=tuple(names),
    )


def iter_archive_bytes(archive: CheckpointArchive, start: int, end: int) -> Iterator[bytes]:
    """Bytes [start, end) of the archive, read from the files as they are needed."""
    piece_start = 0
    for piece in archive.pieces:
        piece_size = len(piece) if isinstance(piece, bytes) else piece.size
        piece_end = piece_start + piece_size
        if piece_end > start and piece_start < end:
            first, last = max(start, piece_start) - piece_start, min(end, piece_end) - piece_start
            if isinstance(piece, bytes):
                yield piece[first:last]
            else:
                yield from _checked_length(piece, piece.read(piece.relative, first, last), last - first)
        if piece_end >= end:
            return
        piece_start = piece_end


def _checked_length(piece: _FileContent, chunks: Iterator[bytes], expected: int) -> Iterator[bytes]:
    sent = 0
    for chunk in chunks:
        sent += len(chunk)
        yield chunk
    if sent != expected:
        # Sending anything else would hand the client a corrupt archive that looks whole.
        raise RuntimeError(f"{piece.relative} became shorter while it was being sent")


def _requested_range(range_header: str | None, size: int) -> tuple[int, int] | None:
    """[start, end) of a single `bytes=` range, or None when there is none to honour (no header, several
    ranges, another unit, a malformed value: RFC 9110 lets a server answer those with the whole content).
    Raises ValueError for a well-formed range that lies outside the archive."""
    if range_header is None:
        return None
    match = _SINGLE_RANGE.fullmatch(range_header.strip())
    if match is None or match.group(1) == match.group(2) == "":
        return None
    first, last = match.group(1), match.group(2)
    if first == "":  # the last N bytes
        suffix = int(last)
        if suffix == 0:
            raise ValueError("a suffix range of 0 bytes")
        return max(0, size - suffix), size
    start = int(first)
    if last != "" and int(last) < start:
        return None  # not a valid range, so ignored
    if start >= size:
        raise ValueError(f"the range starts at byte {start}")
    return start, size if last == "" else min(size, int(last) + 1)


def archive_response(
    archive: CheckpointArchive, filename: str, range_header: str | None, if_range_header: str | None
) -> Response:
    """200 with the whole archive, 206 with one requested range, or 416 for a range outside it."""
    headers = {
        "Accept-Ranges": "bytes",
        "ETag": archive.etag,
        "Content-Disposition": f'attachment; filename="{filename}"',
    }
    # If-Range names the version the client holds part of; only the same (strong) ETag may resume it.
    if if_range_header is not None and if_range_header.strip() != archive.etag:
        range_header = None
    try:
        requested = _requested_range(range_header, archive.size)
    except ValueError as error:
        message = f"Range not satisfiable: {error}, but the archive has {archive.size} bytes."
        return JSONResponse(
            error_body(416, message, "Range", "range_not_satisfiable"),
            status_code=416,
            headers={"Content-Range": f"bytes */{archive.size}"},
        )
    start, end = requested if requested is not None else (0, archive.size)
    headers["Content-Length"] = str(end - start)
    status = 200
    if requested is not None:
        status = 206
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{archive.size}"
    return StreamingResponse(
        iter_archive_bytes(archive, start, end),
        status_code=status,
        media_type="application/x-tar",
        headers=headers,
    )
