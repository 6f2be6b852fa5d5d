"""Real processes for service tests: the fusetune server, redis-server, a PostgreSQL database."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from fusetune.config import Settings

REQUIRE_SERVICES = os.environ.get("FUSETUNE_TEST_REQUIRE_SERVICES") == "1"
TERMINAL = ("succeeded", "failed", "cancelled")


def skip_or_fail(reason: str) -> None:
    """Locally a missing server skips its tests; in CI (.ci/run) it is a failure."""
    if REQUIRE_SERVICES:
        pytest.fail(reason)
    pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@contextmanager
def redis_server(workdir: Path) -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        skip_or_fail("redis-server is not installed (.ci/run installs it)")
    port = free_port()
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                time.sleep(0.1)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        _stop(process)


@contextmanager
def postgres_database() -> Iterator[str]:
    """A fresh database on the server named by FUSETUNE_TEST_POSTGRES_URL, dropped afterwards."""
    admin_url = os.environ.get("FUSETUNE_TEST_POSTGRES_URL")
    if not admin_url:
        skip_or_fail("FUSETUNE_TEST_POSTGRES_URL is not set (.ci/run starts PostgreSQL and sets it)")
    from sqlalchemy import create_engine, text

    name = f"fusetune_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    base, _, _ = admin_url.rpartition("/")
    try:
        yield f"{base}/{name}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    bucket: str

    def storage_env(self, prefix: str = "fusetune") -> dict[str, str]:
        """The settings that point a fusetune process at this server's bucket."""
        return {
            "FUSETUNE_STORAGE_URL": f"s3://{self.bucket}/{prefix}",
            "FUSETUNE_STORAGE_ENDPOINT": self.endpoint,
            "FUSETUNE_STORAGE_ACCESS_KEY_ID": MOTO_KEY,
            "FUSETUNE_STORAGE_SECRET_ACCESS_KEY": MOTO_KEY,
        }

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=MOTO_KEY, aws_secret_access_key=MOTO_KEY)  # fmt: skip

    def keys(self, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return sorted(item["Key"] for page in pages for item in page.get("Contents", []))


MOTO_KEY = "fusetune-test"


@contextmanager
def moto_s3_server(workdir: Path, bucket: str | None = "fusetune-test", **env: str) -> Iterator[S3Server]:
    """moto's standalone S3 server (real HTTP, real signatures) on a free port, with `bucket` created."""
    try:
        import moto.server  # noqa: F401
    except ImportError:
        skip_or_fail("moto[server] is not installed (the dev extra installs it)")
    port = free_port()
    log = open(workdir / f"moto-{port}.log", "ab")  # noqa: SIM115 - handed to the child
    process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                               env={**os.environ, **env})  # fmt: skip
    server = S3Server(f"http://127.0.0.1:{port}", bucket or "")
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{server.endpoint}/moto-api/", timeout=1)
                break
            except httpx.TransportError as error:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        "moto's server did not start: " + (workdir / f"moto-{port}.log").read_text()
                    ) from error
                time.sleep(0.2)
        if bucket:
            server.client().create_bucket(Bucket=bucket)
        yield server
    finally:
        _stop(process)
        log.close()


@contextmanager
def mlflow_server(workdir: Path) -> Iterator[str]:
    """A real ``mlflow server`` (mlflow-skinny's, on SQLite, artifacts proxied to a folder) on a free loopback
    port; yields its tracking URI."""
    try:
        import mlflow  # noqa: F401
    except ImportError:
        skip_or_fail("mlflow-skinny is not installed (the dev extra installs it)")
    port = free_port()
    log = open(workdir / f"mlflow-{port}.log", "ab")  # noqa: SIM115 - handed to the child
    process = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{workdir / 'mlflow.db'}",
         "--artifacts-destination", str(workdir / "mlflow-artifacts")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=workdir,
    )  # fmt: skip
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{uri}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    "mlflow server did not start: " + (workdir / f"mlflow-{port}.log").read_text()
                )
            time.sleep(0.2)
        yield uri
    finally:
        _stop(process)
        log.close()


class Service:
    """A running ``fusetune serve`` (API + embedded worker) and an HTTP client for it."""

    def __init__(self, settings: Settings, process: subprocess.Popen, port: int):
        self.settings = settings
        self.process = process
        self.base_url = f"http://127.0.0.1:{port}"
        self.api_key = settings.dev_api_key
        self.client = httpx.Client(
            base_url=self.base_url, timeout=60, headers={"Authorization": f"Bearer {self.api_key}"}
        )

    def upload(self, path: Path) -> httpx.Response:
        with open(path, "rb") as handle:
            return self.client.post(
                "/v1/files", files={"file": (path.name, handle)}, data={"purpose": "fine-tune"}
            )

    def wait_for_job(self, job_id: str, timeout_s: float = 300) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            job = self.client.get(f"/v1/fine_tuning/jobs/{job_id}").json()
            if job["status"] in TERMINAL:
                return job
            time.sleep(0.5)
        log = (self.settings.data_dir / "server.log").read_text(errors="replace")[-4000:]
        raise TimeoutError(f"job {job_id} did not finish in {timeout_s} s; server log tail:\n{log}")


def service_env(settings: Settings, extra_env: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, **settings.subprocess_env(), **(extra_env or {})}


@contextmanager
def running_service(
    data_dir: Path, extra_env: dict[str, str] | None = None, **settings_overrides: str
) -> Iterator[Service]:
    """``fusetune serve`` on a free port; ``extra_env`` reaches the server and its embedded worker. Tests put
    their own models in place, so the bundled one is built only when ``bundled_model="true"`` asks for it."""
    port = free_port()
    settings = Settings(data_dir=data_dir, port=port, **{"bundled_model": "false", **settings_overrides})
    settings.ensure_dirs()
    env = {**service_env(settings, extra_env), "FUSETUNE_PORT": str(port), "FUSETUNE_HOST": "127.0.0.1",
           "FUSETUNE_BUNDLED_MODEL": str(settings.bundled_model).lower()}  # fmt: skip
    log = open(data_dir / "server.log", "ab")
    process = subprocess.Popen([sys.executable, "-m", "fusetune.cli", "serve"], env=env, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    service = Service(settings, process, port)
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    "server exited:\n" + (data_dir / "server.log").read_text(errors="replace")[-4000:]
                )
            try:
                if service.client.get("/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("server did not start")
            time.sleep(0.3)
        yield service
    finally:
        service.client.close()
        _stop(process)
        log.close()


def start_worker(
    settings: Settings, log_path: Path, extra_env: dict[str, str] | None = None
) -> subprocess.Popen:
    """A standalone ``fusetune worker`` process (as docker-compose runs it), in a session of its own."""
    log = open(log_path, "ab")  # noqa: SIM115 - handed to the child
    return subprocess.Popen([sys.executable, "-m", "fusetune.cli", "worker"], env=service_env(settings, extra_env),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def stop_process(process: subprocess.Popen) -> None:
    _stop(process)


class StoreOutage:
    """An HTTP proxy in front of an S3 server that forwards every request until the first one `fails_after`
    accepts has been answered, and from then on is unreachable: it drops open connections and stops listening,
    so the client sees refused connections, as when the store's host goes away. The outage is set off by a
    request the client makes, not by a clock, so the test controls what reached the store before it."""

    def __init__(self, upstream: str, fails_after):
        import http.server
        import threading

        self.upstream = upstream
        self.fails_after = fails_after
        self.down = threading.Event()
        self.forwarded: list[tuple[str, str]] = []
        self._http = httpx.Client(base_url=upstream, timeout=60)
        outage = self

        class Forward(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _forward(self) -> None:
                if outage.down.is_set():
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                hop_by_hop = {"connection", "keep-alive", "transfer-encoding", "content-length"}
                headers = {k: v for k, v in self.headers.items() if k.lower() not in hop_by_hop}
                answer = outage._http.request(self.command, self.path, headers=headers, content=body)
                self.send_response(answer.status_code)
                for name, value in answer.headers.items():
                    if name.lower() not in hop_by_hop:
                        self.send_header(name, value)
                self.send_header("Content-Length", answer.headers.get("content-length", "0")
                                 if self.command == "HEAD" else str(len(answer.content)))  # fmt: skip
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(answer.content)
                self.wfile.flush()
                outage.forwarded.append((self.command, self.path))
                if outage.fails_after(self.command, self.path):
                    outage.down.set()
                    self.close_connection = True
                    # shutdown() waits for the serving loop, which runs in another thread than this handler.
                    threading.Thread(target=outage._stop_listening).start()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Forward)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _stop_listening(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def close(self) -> None:
        if not self.down.is_set():
            self.down.set()
            self._stop_listening()
        self._http.close()
