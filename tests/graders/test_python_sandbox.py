"""Python graders in the sandbox: hostile graders are stopped or refused, each costs only its own sample (a score
of 0 and an error), and the rest of the batch is graded. One batch holds them all, graded in parallel.

The grader's behaviour is chosen by the item, so one grader serves every case; the harmless cases (reading the
standard library, writing in its scratch directory, starting a thread) show that the refusals come from the
sandbox's rules, not from a sandbox too broken to run anything.
"""

from __future__ import annotations

import math

import pytest

from fusetune.config import Settings
from fusetune.graders import Sample, check_grader, grade, grade_many, sandbox
from fusetune.spec.graders import parse_grader
from fusetune.spec.hyperparameters import SpecError
from tests.services import skip_or_fail

HOSTILE = """
import os, socket, threading, json

def grade(sample, item):
    attack = item["attack"]
    if attack == "none":
        return 1.0 if sample["output_text"] == item["answer"] else 0.0
    if attack == "stdlib":
        return float(len(json.dumps({"read": "the standard library"})) > 0)
    if attack == "scratch":
        with open("notes.txt", "w") as handle:
            handle.write("a grader may write here")
        return float(open("notes.txt").read() == "a grader may write here")
    if attack == "thread":
        box = []
        worker = threading.Thread(target=lambda: box.append(0.5))
        worker.start()
        worker.join()
        return box[0]
    if attack == "loop":
        while True:
            pass
    if attack == "memory":
        hoard = []
        while True:
            hoard.append(bytearray(64 * 1024 * 1024))
    if attack == "fork":
        return 1.0 if os.fork() else 0.0
    if attack == "passwd":
        return float(len(open("/etc/passwd").read()))
    if attack == "data_dir":
        return float(len(os.listdir(item["data_dir"])))
    if attack == "socket":
        socket.create_connection(("127.0.0.1", item["port"]), timeout=1)
        return 1.0
    if attack == "kill":
        os.kill(item["pid"], 9)
        return 1.0
    raise ValueError("unknown attack " + attack)
"""


def _sandbox_runs_here() -> None:
    """A machine whose kernel refuses the sandbox's namespaces (a container without them, for one) cannot run
    python graders at all, and the service says so at creation (tests/graders/test_grader_endpoints.py): these
    tests skip there, and fail in CI, where the sandbox must run."""
    if (missing := sandbox.unavailable()) is not None:
        skip_or_fail(f"the sandbox cannot run on this machine: {missing}")


@pytest.fixture(scope="module")
def settings(tmp_path_factory) -> Settings:
    data_dir = tmp_path_factory.mktemp("sandbox") / "data"
    data_dir.mkdir()
    (data_dir / "secret.jsonl").write_text('{"tenant": "someone else"}\n')
    _sandbox_runs_here()
    # A small memory limit, so the hoarding grader meets it at once; a short timeout, the looping one's cost.
    return Settings(data_dir=data_dir, python_graders=True, python_grader_timeout_s=2,
                    python_grader_memory_bytes=256 * 1024 * 1024, python_grader_processes=2)  # fmt: skip


def test_hostile_graders_are_stopped_and_grading_goes_on(settings, tmp_path):
    import os
    import socket

    listener = socket.create_server(("127.0.0.1", 0))  # a real port the socket grader would reach unsandboxed
    port = listener.getsockname()[1]
    grader = parse_grader({"type": "python", "name": "hostile", "source": HOSTILE})
    cases = {
        "none": "right", "stdlib": None, "scratch": None, "thread": None, "loop": None, "memory": None,
        "fork": None, "passwd": None, "data_dir": None, "socket": None, "kill": None,
    }  # fmt: skip
    items = [{"attack": attack, "answer": "42", "data_dir": str(settings.data_dir), "port": port,
              "pid": os.getpid()} for attack in cases]  # fmt: skip
    samples = [Sample.from_text("42") for _ in cases]
    try:
        results = dict(zip(cases, grade_many(grader, samples, items, settings), strict=True))
    finally:
        listener.close()
    for harmless, score in (("none", 1.0), ("stdlib", 1.0), ("scratch", 1.0), ("thread", 0.5)):
        assert results[harmless].score == score and results[harmless].error is None, results[harmless]
    stopped = {
        "loop": "timed out after 2 s",
        "fork": "PermissionError",
        "passwd": "Permission denied: '/etc/passwd'",
        "data_dir": "Permission denied",
        "socket": "PermissionError",
        "kill": "PermissionError",
    }
    for attack, error in stopped.items():
        assert results[attack].score == 0.0 and error in results[attack].error, (attack, results[attack])
    # The hoarder meets the memory limit (a MemoryError or the kernel's kill), well before its time is up.
    assert results["memory"].score == 0.0 and "memory" in results["memory"].error, results["memory"]
    assert results["loop"].error_type == "python_grader_server_error"
    assert results["fork"].error_type == "python_grader_runtime_error"


def test_the_sandbox_reports_its_protections():
    _sandbox_runs_here()
    applied = " ".join(sandbox.protections())
    assert "network namespace" in applied and "landlock" in applied


def test_a_grader_that_raises_or_returns_no_number_scores_zero(settings):
    source = "def grade(sample, item):\n    return {'bad': item['kind']}[0]\n"
    result = grade(parse_grader({"type": "python", "name": "p", "source": source}), sample="x", item={"kind": 1},
                   settings=settings)  # fmt: skip
    assert result.score == 0.0 and result.error.startswith("KeyError") and "line 2" in result.error
    for value in ("float('nan')", "'0.5'", "True"):
        source = f"def grade(sample, item):\n    return {value}\n"
        result = grade(parse_grader({"type": "python", "name": "p", "source": source}), sample="x", item={},
                       settings=settings)  # fmt: skip
        assert result.score == 0.0 and "not a finite number" in result.error


def test_python_graders_are_off_unless_the_server_enables_them(tmp_path):
    grader = parse_grader(
        {"type": "python", "name": "p", "source": "def grade(sample, item):\n    return 1\n"}
    )
    off = Settings(data_dir=tmp_path)
    with pytest.raises(SpecError, match="FUSETUNE_PYTHON_GRADERS") as refused:
        check_grader(grader, off)
    assert refused.value.field == "grader.type"
    result = grade(grader, sample="x", item={}, settings=off)
    assert result.score == 0.0 and "off" in result.error
    assert not math.isnan(result.score)
