"""Where uploaded files and checkpoints live: the local data directory (the embedded default) or an
S3-compatible object store (``FUSETUNE_STORAGE_URL=s3://bucket/prefix``), so that the API and workers on
several hosts share no disk.

Both implementations answer the same questions in the service's own terms (a tenant's file, a job's
checkpoint), so the routes and the worker never build paths or keys themselves. In the object store:

    <prefix>/tenants/<tenant>/files/<file id>.jsonl
    <prefix>/tenants/<tenant>/runs/<job id>/checkpoints/step-<n>/<file>
    <prefix>/tenants/<tenant>/runs/<job id>/checkpoints/step-<n>/fusetune-manifest.json
    <prefix>/tenants/<tenant>/runs/<job id>/checkpoints/step-<n>/fusetune-archive-<etag>.tar  (presigned only)

Tenants are apart by key prefix (and by the API's checks before anything is read). The tenant is escaped with
percent-encoding and every other segment is a server-made name checked against a strict pattern, so no user
input reaches a key unescaped. A checkpoint is uploaded file by file (multipart above one part, each part with
a SHA-256 checksum the store verifies), then its manifest (names, sizes, modes, times and SHA-256s); the worker
records the checkpoint in SQL only after that, so a reader never sees half a checkpoint.

With FUSETUNE_STORAGE_PRESIGNED_DOWNLOADS the API answers a download with a presigned URL of the object (signed
by the client library with the store's credentials, valid FUSETUNE_STORAGE_PRESIGNED_EXPIRY_S). A checkpoint is
downloaded as one tar, which the store does not hold until someone asks: the first such request writes the
archive (the same bytes the API streams) beside the checkpoint's files, and every later one is only redirected.

The client is obstore (Rust's object_store): it streams uploads from iterators, reads byte ranges and retries
failed requests itself. benchmarks/service/object_store_clients.py times it against boto3 on moto's server.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlparse

from fusetune.config import Settings

MANIFEST_FILENAME = "fusetune-manifest.json"
# A checkpoint's tar, written for presigned downloads; named by the archive's ETag (one object per variant).
ARCHIVE_OBJECT_PREFIX = "fusetune-archive-"
_READ_CHUNK_BYTES = 1 << 20
# One path segment the server made itself: a file or job id, "checkpoints", "step-12", a checkpoint's file name.
_SAFE_SEGMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


class StorageError(Exception):
    """The store failed (after the client's retries) or holds something other than what SQL says."""


def read_file_range(path: Path, first: int, last: int, name: str) -> Iterator[bytes]:
    """Bytes [first, last) of a local file in chunks; `name` says which file in the error if it shrank."""
    with path.open("rb") as handle:
        handle.seek(first)
        remaining = last - first
        while remaining:
            chunk = handle.read(min(remaining, _READ_CHUNK_BYTES))
            if not chunk:
                # Sending anything else would hand the client a corrupt archive that looks whole.
                raise StorageError(f"{name} became shorter while it was being sent")
            remaining -= len(chunk)
            yield chunk


class StorageConfigError(StorageError):
    """The storage settings do not work; the message names the setting to fix."""


@dataclass(frozen=True)
class StoredFile:
    """One file of a checkpoint, as its manifest describes it."""

    path: str  # relative to the checkpoint folder, with "/" separators
    size: int
    mode: int
    mtime_ns: int
    sha256: str


@dataclass(frozen=True)
class ArchiveDownload:
    """A checkpoint's tar as a download offers it: the `size` bytes that `content()` yields, identified by
    `etag` (the same bytes on every request), saved under `download_name`."""

    etag: str
    size: int
    content: Callable[[], Iterable[bytes]]
    download_name: str


def _checked_relative(path: str) -> str:
    segments = path.split("/")
    for segment in segments:
        if not _SAFE_SEGMENT.fullmatch(segment) or segment in (".", ".."):
            raise StorageError(f"refusing the storage path {path!r}: segment {segment!r} is not a plain name")
    return path


def tenant_prefix(tenant: str) -> str:
    # quote() with no safe characters: "/" and ".." in a tenant name cannot leave its prefix.
    return f"tenants/{quote(tenant, safe='')}"


def file_key(tenant: str, storage_name: str) -> str:
    return f"{tenant_prefix(tenant)}/files/{_checked_relative(storage_name)}"


def run_key(tenant: str, storage_path: str) -> str:
    """The key of a checkpoint folder (its storage_path is relative to the runs directory)."""
    return f"{tenant_prefix(tenant)}/runs/{_checked_relative(storage_path)}"


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_READ_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _checkpoint_files(folder: Path, excluded_top_level: Iterable[str] = ()) -> list[tuple[str, Path]]:
    excluded = set(excluded_top_level)
    found = []
    for path in folder.rglob("*"):
        relative = path.relative_to(folder)
        # Links are left out: they could point outside the checkpoint.
        if relative.parts[0] in excluded or not path.is_file() or path.is_symlink():
            continue
        found.append((relative.as_posix(), path))
    return sorted(found, key=lambda item: item[0].split("/"))


class FileWriter:
    """Receives an upload chunk by chunk; nothing is visible under the final name until `commit()`, and
    leaving the `with` block without it discards what was written."""

    def write(self, chunk: bytes) -> None:
        raise NotImplementedError

    def commit(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> FileWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.abort()


class Storage:
    """The operations the service needs; see LocalStorage and ObjectStorage."""

    remote: bool = False

    def check(self) -> None:
        """Raises StorageConfigError if the store cannot be used with these settings."""

    # files
    def file_writer(self, tenant: str, storage_name: str, download_name: str | None = None) -> FileWriter:
        """`download_name`: the file name a presigned download offers the client (Content-Disposition)."""
        raise NotImplementedError

    def iter_file(self, tenant: str, storage_name: str) -> Iterator[bytes]:
        raise NotImplementedError

    def fetch_file(self, tenant: str, storage_name: str, scratch: Path) -> Path:
        """A local path holding the file: the file itself, or a copy made in `scratch`."""
        raise NotImplementedError

    def delete_file(self, tenant: str, storage_name: str) -> None:
        raise NotImplementedError

    def file_download_url(self, tenant: str, storage_name: str) -> str | None:
        """A presigned URL of the file when the settings ask for presigned downloads; None: stream it."""
        return None

    # checkpoints
    def publish_checkpoint(self, tenant: str, storage_path: str, folder: Path) -> None:
        """Makes a complete local checkpoint folder readable by every host (uploads it, manifest last)."""

    def checkpoint_files(
        self, tenant: str, storage_path: str, excluded_top_level: Iterable[str] = ()
    ) -> list[StoredFile] | None:
        """The checkpoint's files (sorted by path), or None if it is not there."""
        raise NotImplementedError

    def read_checkpoint_file(
        self, tenant: str, storage_path: str, relative: str, first: int, last: int
    ) -> Iterator[bytes]:
        """Bytes [first, last) of one file of a checkpoint."""
        raise NotImplementedError

    def read_checkpoint_bytes(self, tenant: str, storage_path: str, relative: str) -> bytes | None:
        """The whole content of one small file of a checkpoint (its config.json), or None if it has none."""
        raise NotImplementedError

    def checkpoint_archive_url(self, tenant: str, storage_path: str, archive: ArchiveDownload) -> str | None:
        """A presigned URL of the checkpoint's archive, written to the store first if it is not there; None:
        stream the archive."""
        return None

    def restore_checkpoint(
        self, tenant: str, storage_path: str, target: Path, excluded_top_level: Iterable[str] = ()
    ) -> Path:
        """A local folder with the checkpoint: `target` (filled from the store when remote, checksums checked),
        or the checkpoint's own folder when local."""
        raise NotImplementedError

    def delete_checkpoints(self, tenant: str, storage_paths: Iterable[str]) -> None:
        raise NotImplementedError

    def delete_run(self, tenant: str, job_id: str) -> None:
        """Every object of one job's run (its checkpoints), whatever SQL still says."""
        raise NotImplementedError

    def list_checkpoint_paths(self, tenant: str, job_id: str) -> set[str]:
        """storage_paths of the job's checkpoints present in the store, complete or not."""
        return set()

    def delete_tenant(self, tenant: str) -> None:
        raise NotImplementedError


# ------------------------------------------------------------------------------------------------- local


class _LocalFileWriter(FileWriter):
    def __init__(self, final: Path):
        self.final = final
        handle, temp = tempfile.mkstemp(dir=final.parent, prefix=".upload-", suffix=".part")
        self.temp = Path(temp)
        self.out = os.fdopen(handle, "wb")
        self.committed = False

    def write(self, chunk: bytes) -> None:
        self.out.write(chunk)

    def commit(self) -> None:
        self.out.close()
        os.replace(self.temp, self.final)
        self.committed = True

    def abort(self) -> None:
        if not self.committed:
            self.out.close()
            self.temp.unlink(missing_ok=True)


class LocalStorage(Storage):
    """Everything under the data directory, as fusetune has always kept it (files/, runs/)."""

    def __init__(self, settings: Settings):
        self.files_dir = settings.files_dir
        self.runs_dir = settings.runs_dir

    def _checkpoint_dir(self, storage_path: str) -> Path | None:
        runs = self.runs_dir.resolve()
        path = (runs / _checked_relative(storage_path)).resolve()
        return path if path.is_relative_to(runs) and path.is_dir() else None

    def file_writer(self, tenant: str, storage_name: str, download_name: str | None = None) -> FileWriter:
        self.files_dir.mkdir(parents=True, exist_ok=True)
        return _LocalFileWriter(self.files_dir / _checked_relative(storage_name))

    def iter_file(self, tenant: str, storage_name: str) -> Iterator[bytes]:
        with (self.files_dir / _checked_relative(storage_name)).open("rb") as handle:
            while chunk := handle.read(_READ_CHUNK_BYTES):
                yield chunk

    def fetch_file(self, tenant: str, storage_name: str, scratch: Path) -> Path:
        return self.files_dir / _checked_relative(storage_name)

    def delete_file(self, tenant: str, storage_name: str) -> None:
        (self.files_dir / _checked_relative(storage_name)).unlink(missing_ok=True)

    def checkpoint_files(
        self, tenant: str, storage_path: str, excluded_top_level: Iterable[str] = ()
    ) -> list[StoredFile] | None:
        folder = self._checkpoint_dir(storage_path)
        return None if folder is None else self.folder_files(folder, excluded_top_level)

    @staticmethod
    def folder_files(folder: Path, excluded_top_level: Iterable[str] = ()) -> list[StoredFile]:
        files = []
        for relative, path in _checkpoint_files(folder, excluded_top_level):
            status = path.stat()
            # The local archive needs no checksum: the ETag is made of names, sizes, modes and times.
            files.append(
                StoredFile(relative, status.st_size, stat.S_IMODE(status.st_mode), status.st_mtime_ns, "")
            )
        return files

    def read_checkpoint_file(
        self, tenant: str, storage_path: str, relative: str, first: int, last: int
    ) -> Iterator[bytes]:
        folder = self._checkpoint_dir(storage_path)
        if folder is None:
            raise StorageError(f"checkpoint {storage_path} is gone")
        yield from read_file_range(
            folder / _checked_relative(relative), first, last, f"{storage_path}/{relative}"
        )

    def read_checkpoint_bytes(self, tenant: str, storage_path: str, relative: str) -> bytes | None:
        folder = self._checkpoint_dir(storage_path)
        path = None if folder is None else folder / _checked_relative(relative)
        return path.read_bytes() if path is not None and path.is_file() else None

    def restore_checkpoint(
        self, tenant: str, storage_path: str, target: Path, excluded_top_level: Iterable[str] = ()
    ) -> Path:
        folder = self._checkpoint_dir(storage_path)
        if folder is None:
            raise StorageError(f"checkpoint {storage_path} is not in {self.runs_dir}")
        return folder

    def delete_checkpoints(self, tenant: str, storage_paths: Iterable[str]) -> None:
        for storage_path in storage_paths:
            folder = self._checkpoint_dir(storage_path)
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)

    def delete_run(self, tenant: str, job_id: str) -> None:
        shutil.rmtree(self.runs_dir / _checked_relative(job_id), ignore_errors=True)

    def delete_tenant(self, tenant: str) -> None:
        """Local files carry no tenant in their path; the caller deletes them one by one from SQL."""


# ------------------------------------------------------------------------------------------------ object


def parse_storage_url(url: str) -> tuple[str, str]:
    """(bucket, prefix) of `s3://bucket/prefix`; raises StorageConfigError naming FUSETUNE_STORAGE_URL."""
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise StorageConfigError(
            f"FUSETUNE_STORAGE_URL must be empty (the local data directory) or s3://bucket/prefix (got {url!r})"
        )
    prefix = parsed.path.strip("/")
    if prefix and any(not _SAFE_SEGMENT.fullmatch(part) for part in prefix.split("/")):
        raise StorageConfigError(f"FUSETUNE_STORAGE_URL: the prefix {prefix!r} must be plain path segments")
    return parsed.netloc, prefix


def _describe_failure(error: Exception, settings: Settings, bucket: str) -> str:
    text = str(error)
    if "NoSuchBucket" in text:
        return f"the bucket '{bucket}' of FUSETUNE_STORAGE_URL ({settings.storage_url}) does not exist"
    if any(code in text for code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403")):
        return (
            "the store refused the credentials (FUSETUNE_STORAGE_ACCESS_KEY_ID / "
            f"FUSETUNE_STORAGE_SECRET_ACCESS_KEY) for bucket '{bucket}'"
        )
    if "error sending request" in text or "connect" in text.lower() or "dns" in text.lower():
        endpoint = settings.storage_endpoint or "the region's AWS endpoint"
        return f"the endpoint {endpoint} (FUSETUNE_STORAGE_ENDPOINT) is unreachable"
    return f"the store at FUSETUNE_STORAGE_URL={settings.storage_url} failed: {text.splitlines()[0]}"


class _ObjectFileWriter(FileWriter):
    """Streams an upload into a multipart upload that a background thread feeds to the store; it is
    completed only after commit(), and aborted otherwise, so a refused upload leaves no object behind."""

    _COMMIT = object()
    _ABORT = object()

    def __init__(self, storage: ObjectStorage, key: str, attributes: dict[str, str] | None = None):
        self.storage = storage
        self.key = key
        self.attributes = attributes
        # Bounded: the request thread waits for the store instead of buffering the file in memory.
        self.chunks: queue.Queue = queue.Queue(maxsize=4)
        self.error: BaseException | None = None
        self.finished = False
        self.thread = threading.Thread(target=self._upload, name="fusetune-upload", daemon=True)
        self.thread.start()

    def _chunks(self) -> Iterator[bytes]:
        while True:
            item = self.chunks.get()
            if item is self._COMMIT:
                return
            if item is self._ABORT:
                # Raising inside the iterator makes obstore abort the multipart upload.
                raise StorageError("upload abandoned")
            yield item

    def _upload(self) -> None:
        try:
            self.storage._put(self.key, self._chunks(), self.attributes)
        except BaseException as error:  # reported to the request thread
            self.error = error
            # Unblock a writer waiting on a full queue.
            while True:
                try:
                    self.chunks.get_nowait()
                except queue.Empty:
                    break

    def _send(self, item: object) -> None:
        while self.thread.is_alive():
            try:
                self.chunks.put(item, timeout=0.5)
                return
            except queue.Full:
                continue
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise StorageError(
                _describe_failure(self.error, self.storage.settings, self.storage.bucket)
            ) from (self.error)

    def write(self, chunk: bytes) -> None:
        self._raise_if_failed()
        self._send(chunk)

    def commit(self) -> None:
        self._send(self._COMMIT)
        self.thread.join()
        self.finished = True
        self._raise_if_failed()

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            if self.thread.is_alive():
                self._send(self._ABORT)
            self.thread.join()


class ObjectStorage(Storage):
    remote = True

    def __init__(self, settings: Settings):
        self.settings = settings
        self.bucket, self.prefix = parse_storage_url(settings.storage_url)
        self.store = self._client(settings.storage_endpoint)
        # Signing makes no request; a URL for clients names the endpoint they reach (behind a proxy, say).
        public = settings.storage_public_endpoint
        self.signer = self._client(public) if public and public != settings.storage_endpoint else self.store

    def _client(self, endpoint: str) -> Any:
        from obstore.store import S3Store

        settings = self.settings
        options: dict[str, Any] = {"region": settings.storage_region}
        if endpoint:
            options["endpoint"] = endpoint
        if settings.storage_access_key_id:
            options["access_key_id"] = settings.storage_access_key_id
            options["secret_access_key"] = settings.storage_secret_access_key
        return S3Store(
            self.bucket,
            prefix=self.prefix or None,
            # Every part and whole object carries a SHA-256 the store checks on arrival.
            checksum_algorithm="sha256",
            client_options={
                "allow_http": endpoint.startswith("http://"),
                "connect_timeout": timedelta(seconds=settings.storage_connect_timeout_s),
            },
            retry_config={
                "max_retries": settings.storage_max_retries,
                "retry_timeout": timedelta(seconds=settings.storage_retry_timeout_s),
                "backoff": {
                    "init_backoff": timedelta(milliseconds=100),
                    "max_backoff": timedelta(seconds=15),
                    "base": 2,
                },
            },  # fmt: skip
            **options,
        )

    # ---- primitives

    def _failure(self, error: Exception) -> StorageError:
        return StorageError(_describe_failure(error, self.settings, self.bucket))

    def _put(self, key: str, source: Any, attributes: dict[str, str] | None = None) -> None:
        import obstore

        obstore.put(
            self.store, key, source, chunk_size=self.settings.storage_part_bytes, max_concurrency=4,
            attributes=attributes,
        )  # fmt: skip

    def _presigned_url(self, key: str) -> str:
        import obstore

        expires_in = timedelta(seconds=self.settings.storage_presigned_expiry_s)
        try:
            return obstore.sign(self.signer, "GET", key, expires_in)
        except Exception as error:  # no credentials to sign with
            raise self._failure(error) from error

    def _size(self, key: str) -> int | None:
        import obstore
        from obstore.exceptions import NotFoundError

        try:
            return obstore.head(self.store, key)["size"]
        except (NotFoundError, FileNotFoundError):
            return None
        except Exception as error:
            raise self._failure(error) from error

    def _list(self, prefix: str) -> list[dict]:
        import obstore

        try:
            return [meta for batch in obstore.list(self.store, prefix=prefix) for meta in batch]
        except Exception as error:
            raise self._failure(error) from error

    def _delete_prefix(self, prefix: str) -> None:
        import obstore

        keys = [meta["path"] for meta in self._list(prefix)]
        # Batches: S3's DeleteObjects takes up to 1000 keys.
        for start in range(0, len(keys), 1000):
            try:
                obstore.delete(self.store, keys[start : start + 1000])
            except Exception as error:
                raise self._failure(error) from error

    def _read(self, key: str, first: int, last: int) -> Iterator[bytes]:
        import obstore

        if first >= last:
            return
        try:
            result = obstore.get(self.store, key, options={"range": (first, last)})
            for chunk in result.stream(min_chunk_size=_READ_CHUNK_BYTES):
                yield bytes(chunk)
        except Exception as error:
            raise self._failure(error) from error

    def _download(self, key: str, target: Path, sha256: str | None = None) -> None:
        import obstore

        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".part")
        digest = hashlib.sha256()
        try:
            with partial.open("wb") as out:
                for chunk in obstore.get(self.store, key).stream(min_chunk_size=_READ_CHUNK_BYTES):
                    digest.update(chunk)
                    out.write(chunk)
        except Exception as error:
            partial.unlink(missing_ok=True)
            raise self._failure(error) from error
        if sha256 is not None and digest.hexdigest() != sha256:
            partial.unlink(missing_ok=True)
            raise StorageError(f"{key}: SHA-256 {digest.hexdigest()} differs from the manifest's {sha256}")
        os.replace(partial, target)

    # ---- Storage

    def check(self) -> None:
        import obstore

        # One listing call shows all three failures: a missing bucket, refused credentials, no endpoint.
        try:
            next(iter(obstore.list(self.store, prefix="tenants", chunk_size=1)), None)
        except Exception as error:
            raise StorageConfigError(_describe_failure(error, self.settings, self.bucket)) from error

    def file_writer(self, tenant: str, storage_name: str, download_name: str | None = None) -> FileWriter:
        attributes = None
        if download_name is not None:
            attributes = {"Content-Type": "application/jsonl",
                          "Content-Disposition": _attachment(download_name)}  # fmt: skip
        return _ObjectFileWriter(self, file_key(tenant, storage_name), attributes)

    def iter_file(self, tenant: str, storage_name: str) -> Iterator[bytes]:
        import obstore

        try:
            result = obstore.get(self.store, file_key(tenant, storage_name))
            for chunk in result.stream(min_chunk_size=_READ_CHUNK_BYTES):
                yield bytes(chunk)
        except Exception as error:
            raise self._failure(error) from error

    def fetch_file(self, tenant: str, storage_name: str, scratch: Path) -> Path:
        target = scratch / _checked_relative(storage_name)
        self._download(file_key(tenant, storage_name), target)
        return target

    def delete_file(self, tenant: str, storage_name: str) -> None:
        import obstore

        try:
            obstore.delete(self.store, file_key(tenant, storage_name))
        except Exception as error:
            raise self._failure(error) from error

    def file_download_url(self, tenant: str, storage_name: str) -> str | None:
        if not self.settings.storage_presigned_downloads:
            return None
        return self._presigned_url(file_key(tenant, storage_name))

    def publish_checkpoint(self, tenant: str, storage_path: str, folder: Path) -> None:
        key = run_key(tenant, storage_path)
        manifest = []
        for relative, path in _checkpoint_files(folder):
            status = path.stat()
            manifest.append(
                StoredFile(relative, status.st_size, stat.S_IMODE(status.st_mode), status.st_mtime_ns,
                           _sha256_file(path))
            )  # fmt: skip
            try:
                with path.open("rb") as handle:
                    self._put(f"{key}/{_checked_relative(relative)}", handle)
            except Exception as error:
                raise self._failure(error) from error
        body = json.dumps({"files": [asdict(entry) for entry in manifest]}, indent=1).encode()
        try:
            self._put(f"{key}/{MANIFEST_FILENAME}", body)
        except Exception as error:
            raise self._failure(error) from error

    def _manifest(self, tenant: str, storage_path: str) -> list[StoredFile] | None:
        import obstore
        from obstore.exceptions import NotFoundError

        try:
            raw = obstore.get(self.store, f"{run_key(tenant, storage_path)}/{MANIFEST_FILENAME}").bytes()
        except (NotFoundError, FileNotFoundError):  # obstore raises the latter for a missing key
            return None
        except Exception as error:
            raise self._failure(error) from error
        return [StoredFile(**entry) for entry in json.loads(bytes(raw))["files"]]

    def checkpoint_files(
        self, tenant: str, storage_path: str, excluded_top_level: Iterable[str] = ()
    ) -> list[StoredFile] | None:
        files = self._manifest(tenant, storage_path)
        if files is None:
            return None
        excluded = set(excluded_top_level)
        return [entry for entry in files if entry.path.split("/")[0] not in excluded]

    def read_checkpoint_file(
        self, tenant: str, storage_path: str, relative: str, first: int, last: int
    ) -> Iterator[bytes]:
        return self._read(f"{run_key(tenant, storage_path)}/{_checked_relative(relative)}", first, last)

    def read_checkpoint_bytes(self, tenant: str, storage_path: str, relative: str) -> bytes | None:
        import obstore
        from obstore.exceptions import NotFoundError

        # Only what the manifest lists: an object of a checkpoint still uploading is not part of it yet.
        files = self.checkpoint_files(tenant, storage_path)
        if files is None or relative not in {entry.path for entry in files}:
            return None
        key = f"{run_key(tenant, storage_path)}/{_checked_relative(relative)}"
        try:
            return bytes(obstore.get(self.store, key).bytes())
        except (NotFoundError, FileNotFoundError):
            return None
        except Exception as error:
            raise self._failure(error) from error

    def restore_checkpoint(
        self, tenant: str, storage_path: str, target: Path, excluded_top_level: Iterable[str] = ()
    ) -> Path:
        files = self.checkpoint_files(tenant, storage_path, excluded_top_level)
        if files is None:
            raise StorageError(f"checkpoint {storage_path} has no manifest in the store")
        key = run_key(tenant, storage_path)
        # Filled beside the final name and renamed when whole, like the trainer's own saves.
        staging = target.with_name(target.name + ".incomplete")
        shutil.rmtree(staging, ignore_errors=True)
        for entry in files:
            local = staging / entry.path
            self._download(f"{key}/{entry.path}", local, entry.sha256)
            os.chmod(local, entry.mode)
            os.utime(local, ns=(entry.mtime_ns, entry.mtime_ns))
        staging.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
        return target

    # Overrides Storage's: an object store can presign where a disk cannot.
    def checkpoint_archive_url(self, tenant: str, storage_path: str, archive: ArchiveDownload) -> str | None:
        if not self.settings.storage_presigned_downloads:
            return None
        name = _checked_relative(ARCHIVE_OBJECT_PREFIX + archive.etag.strip('"') + ".tar")
        key = f"{run_key(tenant, storage_path)}/{name}"
        # Named by its ETag (the members' names, sizes, modes and times; a recorded checkpoint never changes), so
        # an archive already there at the full size is this one. Two first requests at once write the same
        # bytes; either upload is the object.
        if self._size(key) != archive.size:
            attributes = {
                "Content-Type": "application/x-tar",
                "Content-Disposition": _attachment(archive.download_name),
            }
            # Fed from this thread: the archive's bytes are themselves read from the store, which obstore cannot
            # do from inside its own upload of an iterator.
            with _ObjectFileWriter(self, key, attributes) as writer:
                for chunk in archive.content():
                    writer.write(chunk)
                writer.commit()
        return self._presigned_url(key)

    def delete_checkpoints(self, tenant: str, storage_paths: Iterable[str]) -> None:
        for storage_path in storage_paths:
            self._delete_prefix(run_key(tenant, storage_path) + "/")

    def delete_run(self, tenant: str, job_id: str) -> None:
        self._delete_prefix(run_key(tenant, job_id) + "/")

    def list_checkpoint_paths(self, tenant: str, job_id: str) -> set[str]:
        runs = f"{tenant_prefix(tenant)}/runs/"
        found = set()
        for meta in self._list(run_key(tenant, job_id) + "/checkpoints/"):
            relative = meta["path"].removeprefix(f"{self.prefix}/" if self.prefix else "").removeprefix(runs)
            found.add("/".join(relative.split("/")[:3]))  # <job>/checkpoints/step-<n>
        return found

    def delete_tenant(self, tenant: str) -> None:
        self._delete_prefix(tenant_prefix(tenant) + "/")


def _attachment(filename: str) -> str:
    return f"attachment; filename*=utf-8''{quote(filename)}"


def open_storage(settings: Settings) -> Storage:
    """The storage the settings name (no network calls; `check()` makes one)."""
    if not settings.storage_url:
        return LocalStorage(settings)
    return ObjectStorage(settings)
