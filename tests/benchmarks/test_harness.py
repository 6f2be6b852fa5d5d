"""The harness's subprocess per implementation: results are collected from a worker, a crash or a hang becomes
a failure in one line, and the worker side turns an exception into the row's error."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from benchmarks import harness


@pytest.fixture
def worker_module(tmp_path, monkeypatch):
    """A module run as a worker: its behaviour is chosen by its first argument."""
    package = tmp_path / "harness_test_worker"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "worker.py").write_text(
        textwrap.dedent(
            """
            import os, sys, time
            from benchmarks import harness

            mode = sys.argv[1]
            print("progress line")
            harness.report({"row": 1})
            if mode == "crash":
                print("a traceback", file=sys.stderr)
                sys.exit(3)
            if mode == "hang":
                time.sleep(60)
            if mode == "hang-after-pid":
                with open(sys.argv[2], "w") as pid_file:
                    pid_file.write(str(os.getpid()))
                time.sleep(600)
            if mode == "raise":
                sys.exit(harness.run_as_worker(lambda spec: 1 / 0, '{"model": "m"}', lambda spec, e: spec))
            harness.report({"row": 2})
            """
        )
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return "harness_test_worker.worker"


def test_results_are_collected_and_other_output_passed_on(worker_module, capsys):
    run = harness.run_worker(worker_module, ["ok"], timeout_s=60)
    assert run.results == [{"row": 1}, {"row": 2}] and run.failure is None
    assert "progress line" in capsys.readouterr().out


def test_a_crash_keeps_the_results_before_it_and_says_why(worker_module):
    run = harness.run_worker(worker_module, ["crash"], timeout_s=60)
    assert run.results == [{"row": 1}]
    assert run.failure == "exited with code 3: a traceback"


def test_a_worker_past_its_limit_is_stopped(worker_module):
    run = harness.run_worker(worker_module, ["hang"], timeout_s=3)
    assert run.timed_out and run.results == [{"row": 1}]
    assert run.failure.startswith("ran past its 3 s limit and was stopped; last output: progress line")


def test_a_caller_stopped_by_sigterm_stops_its_worker(worker_module, tmp_path):
    """`timeout` stops a benchmark with SIGTERM; its worker, in a session of its own, must not live on (on a GPU
    machine it kept its memory from the next benchmark of the call)."""
    pid_file = tmp_path / "worker.pid"
    caller = subprocess.Popen(
        [sys.executable, "-c", "import sys; from benchmarks import harness; "
         f"harness.run_worker({worker_module!r}, ['hang-after-pid', {str(pid_file)!r}], timeout_s=600)"],
        env={**os.environ, "PYTHONPATH": f"{os.environ['PYTHONPATH']}:{harness.REPO_ROOT}"},
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        while not (pid_file.exists() and pid_file.read_text()):
            assert caller.poll() is None, "the caller exited before its worker started"
            time.sleep(0.05)
        worker = int(pid_file.read_text())
        caller.send_signal(signal.SIGTERM)
        assert caller.wait(timeout=60) == 128 + signal.SIGTERM
        # The worker was killed with its process group before the caller exited: it is gone, not a zombie of
        # ours (its parent was the caller, now gone, so init reaps it).
        deadline = time.monotonic() + 60
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(worker)
    finally:
        caller.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_an_exception_in_the_worker_becomes_the_rows_error(worker_module):
    run = harness.run_worker(worker_module, ["raise"], timeout_s=60)
    assert run.results[-1] == {"model": "m", "error": "ZeroDivisionError: division by zero"}
    assert run.failure is None


def test_a_worker_finds_this_checkout_after_the_callers_path(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/tmp/site")
    assert harness.child_env()["PYTHONPATH"] == f"/tmp/site:{harness.REPO_ROOT}"
    assert harness.child_env(cpu=True)["CUDA_VISIBLE_DEVICES"] == ""


def test_the_e2e_fp8_row_runs_the_fp8_modes_recipe():
    from benchmarks.step import e2e
    from fusetune.worker.train import float8

    assert e2e.FLOAT8_IMPLS["fusetune+fp8"] == float8.RECIPE
    assert set(e2e.FLOAT8_IMPLS.values()) <= set(float8.RECIPES)
    assert set(e2e.FLOAT8_COMPILE_MODES) <= set(e2e.FLOAT8_IMPLS) <= set(e2e.IMPLS)
    assert set(e2e.FLOAT8_MEMORY_BUDGETS) <= set(e2e.FLOAT8_IMPLS)
    assert e2e.parse_args(["--fp8-memory-budget", "0.97"]).fp8_memory_budget == 0.97
    for bad in ("0", "1.5"):
        with pytest.raises(SystemExit):
            e2e.parse_args(["--fp8-memory-budget", bad])
