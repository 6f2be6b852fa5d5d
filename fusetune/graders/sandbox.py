"""Python graders, run sandboxed: the service's side of fusetune/graders/sandbox_runner.py.

A batch of samples is spread over up to `python_grader_processes` runners (the CPU cores by default). Each
runner is a fresh `python -I` started with an empty environment in a scratch directory of its own; it shuts
itself in (namespaces, Landlock; see sandbox_runner.py) before it reads a sample, then grades its share one at a
time, each in a forked child with the server's limits, and kills a child that passes its time. A runner that
dies takes only its current sample with it: that sample scores 0 with the error, and a new runner takes the rest.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from fusetune.config import Settings

RUNNER = Path(__file__).with_name("sandbox_runner.py")
# How long the parent waits for a runner to answer beyond the sample's own limit (the runner kills the sample at
# the limit; this is for a runner that is itself stuck).
RUNNER_GRACE_S = 10.0
# Its threads are told so by these, the only variables the grader's environment holds: numpy and friends
# would otherwise start a thread per core, and a sample's threads share its limits.
THREAD_VARIABLES = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}


@dataclass(frozen=True)
class PythonResult:
    score: float = 0.0
    error: str | None = None
    raised: bool = False  # the grader's own exception (a runtime error), not a limit or a crash


def read_paths() -> list[str]:
    """What a python grader may read: the Python installation (the standard library and installed packages)
    and the system's shared libraries, nothing else."""
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    paths = {
        entry
        for entry in sys.path
        if entry and os.path.isdir(entry) and any(Path(entry).is_relative_to(root) for root in roots)
    }
    paths |= {
        path for path in ("/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/local/lib") if os.path.isdir(path)
    }
    return sorted(paths)


class _Runner:
    """One sandboxed runner process and its scratch directory."""

    def __init__(self, source: str, settings: Settings, probe: bool = False):
        self.scratch = tempfile.mkdtemp(prefix="fusetune-grader-")
        self.timeout_s = settings.python_grader_timeout_s
        config = {
            "source": source,
            "scratch": self.scratch,
            "timeout_s": settings.python_grader_timeout_s,
            "memory_bytes": settings.python_grader_memory_bytes,
            "file_bytes": settings.python_grader_file_bytes,
            "read_paths": [path for path in read_paths() if not settings.data_dir.is_relative_to(path)],
            "probe": probe,
        }
        self.process = subprocess.Popen(
            [sys.executable, "-I", str(RUNNER)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            cwd=self.scratch, env=dict(THREAD_VARIABLES), start_new_session=True, text=True, bufsize=1,
        )  # fmt: skip
        self.process.stdin.write(json.dumps(config) + "\n")
        self.process.stdin.flush()
        self.ready = self._reply(RUNNER_GRACE_S * 3)

    def _reply(self, timeout_s: float) -> dict[str, Any] | None:
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.process.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not line or not line[0]:
            return None
        try:
            return json.loads(line[0])
        except ValueError:
            return None

    def grade(self, sample: dict[str, Any], item: dict[str, Any]) -> PythonResult:
        try:
            self.process.stdin.write(json.dumps({"sample": sample, "item": item}) + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            return PythonResult(error="the sandbox stopped before this sample")
        reply = self._reply(self.timeout_s + RUNNER_GRACE_S)
        if reply is None:
            self.close()  # stuck or gone: the next sample gets a new runner
            return PythonResult(error="the sandbox stopped while grading this sample")
        if "score" in reply:
            return PythonResult(float(reply["score"]))
        return PythonResult(error=str(reply.get("error")), raised=bool(reply.get("raised")))

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass
        shutil.rmtree(self.scratch, ignore_errors=True)


@cache
def _probe() -> tuple[str | None, tuple[str, ...]]:
    runner = _Runner("def grade(sample, item):\n    return 0\n", Settings(), probe=True)
    try:
        reply = runner.ready or {"unavailable": "the sandbox did not start"}
    finally:
        runner.close()
    return reply.get("unavailable"), tuple(reply.get("protections", ()))


def unavailable() -> str | None:
    """Why python graders cannot run sandboxed on this machine (a kernel without user namespaces or Landlock),
    or None when they can. Checked once per process."""
    return _probe()[0]


def protections() -> tuple[str, ...]:
    """What the sandbox applies on this machine, as its runner reported it."""
    return _probe()[1]


def run_python_grader(
    source: str, requests: Sequence[tuple[dict[str, Any], dict[str, Any]]], settings: Settings
) -> list[PythonResult]:
    """`grade(sample, item)` of `source` for each (sample, item), sandboxed, the samples spread over runners."""
    results: list[PythonResult | None] = [None] * len(requests)
    if not requests:
        return []
    workers = min(settings.python_grader_processes or os.cpu_count() or 1, len(requests))
    pending = iter(range(len(requests)))
    lock = threading.Lock()

    def work() -> None:
        runner: _Runner | None = None
        try:
            while True:
                with lock:
                    index = next(pending, None)
                if index is None:
                    return
                if runner is None or runner.process.poll() is not None:
                    if runner is not None:
                        runner.close()
                    runner = _Runner(source, settings)
                if runner.ready is None or "unavailable" in runner.ready:
                    why = (runner.ready or {}).get("unavailable", "the sandbox did not start")
                    results[index] = PythonResult(error=f"python graders cannot run sandboxed here: {why}")
                    continue
                results[index] = runner.grade(*requests[index])
        finally:
            if runner is not None:
                runner.close()

    threads = [threading.Thread(target=work, daemon=True) for _ in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [result or PythonResult(error="not graded") for result in results]
