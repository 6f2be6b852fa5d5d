"""Runs the HTTP API: uvicorn in this process, or in several processes that share the port.

Several processes each bind their own socket to the port with SO_REUSEPORT, and the kernel spreads new
connections over them by a hash of the connection. With one socket shared by all (uvicorn's ``workers``), whichever
process woke first accepted a burst of connections: 50 pollers that connected at once split unevenly, and the
clients of the busier process waited longer (p99 124 ms against p50 33 ms, 2 processes on the 2-core machine).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys

import uvicorn

from fusetune.config import Settings

# No access log: Prometheus counts requests per route, and a log line per poll costs CPU the API needs.
UVICORN_OPTIONS = {"log_level": "info", "access_log": False}
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def run_api(settings: Settings) -> None:
    """Serve until interrupted (SIGINT/SIGTERM), with ``settings.api_processes`` processes."""
    # The service's own log lines (an unexpected error's request id and traceback) beside uvicorn's.
    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)
    if settings.api_processes == 1:
        from fusetune.api.app import create_app

        uvicorn.run(create_app(settings), host=settings.host, port=settings.port, **UVICORN_OPTIONS)
        return
    # Each process builds its app from the environment; request metrics go through files (see create_app).
    metrics_dir = settings.data_dir / "prometheus"
    shutil.rmtree(metrics_dir, ignore_errors=True)
    metrics_dir.mkdir(parents=True)
    os.environ.update(settings.subprocess_env(), PROMETHEUS_MULTIPROC_DIR=str(metrics_dir))
    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(target=_serve_one, args=(settings.host, settings.port), name=f"fusetune-api-{i}")
        for i in range(settings.api_processes)
    ]
    for process in processes:
        process.start()

    def stop(signum, _frame):
        for process in processes:
            if process.is_alive():
                os.kill(process.pid, signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    # The API is up only while all its processes are: when one exits, stop the others and exit with its code,
    # so that whatever supervises the service restarts it whole.
    sentinels = {process.sentinel: process for process in processes}
    ended = sentinels[multiprocessing.connection.wait(list(sentinels))[0]]
    stop(signal.SIGTERM, None)
    for process in processes:
        process.join()
    if ended.exitcode:
        sys.exit(ended.exitcode)


def _serve_one(host: str, port: int) -> None:
    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    config = uvicorn.Config("fusetune.api.app:create_app", factory=True, **UVICORN_OPTIONS)
    uvicorn.Server(config).run(sockets=[sock])
