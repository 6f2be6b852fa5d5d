"""The harness every benchmark script runs on: versions, device ceilings, one subprocess per implementation,
the results files and the command-line options they share.

Results: one JSON file per topic and GPU, `benchmarks/results/<gpu-slug>-<topic>.json`, holding one section per
benchmark (`{"topic": ..., "sections": {name: payload}}`). A script writes its own section and keeps the
others; `python -m benchmarks.summary` renders each file's markdown twin and SUMMARY.md from the JSON.

Nothing here touches CUDA at import time, so the scripts answer `--help` on machines without a GPU.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime as _dt
import gc
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
# The questions the benchmarks answer; each is a folder of scripts and one results file per GPU.
TOPICS = ("kernels", "step", "service", "scaling", "quality", "families")
MIB = 2**20
GIB = 2**30
# A buffer rewritten before a timed call to empty L2: larger than an H100's or H200's 50 MB, as do_bench's.
L2_FLUSH_BYTES = 256 * MIB


# ---------------------------------------------------------------------------------------------------------
# Versions and the device.


def gpu_slug(device_name: str) -> str:
    """Short lower-case name for result files: 'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA H200' -> 'h200'."""
    for token in re.split(r"[\s_-]+", device_name):
        # A model number is one or two letters followed by digits (H100, A100, L40, GB200).
        if re.fullmatch(r"[A-Za-z]{1,2}\d{2,4}[A-Za-z]?", token):
            return token.lower()
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    return slug or "unknown-device"


def utc_date() -> str:
    return _dt.datetime.now(_dt.UTC).date().isoformat()


def package_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def fusetune_git_sha(repo_root: Path = REPO_ROOT) -> str:
    """The commit the benchmark ran on: FUSETUNE_GIT_SHA when set (a copy of the tree on another machine may
    carry stale git metadata), else git's HEAD."""
    if os.environ.get("FUSETUNE_GIT_SHA"):
        return os.environ["FUSETUNE_GIT_SHA"]
    try:
        sha = subprocess.run(
            ["git", "-C", str(repo_root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        if sha:
            dirty = subprocess.run(
                ["git", "-C", str(repo_root), "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def collect_versions() -> dict[str, str | None]:
    import torch

    triton_version = package_version("triton")
    if triton_version is None:
        try:
            import triton

            triton_version = triton.__version__
        except ImportError:
            triton_version = None
    return {
        "torch": torch.__version__,
        "triton": triton_version,
        "transformers": package_version("transformers"),
        "liger_kernel": package_version("liger-kernel") or package_version("liger_kernel"),
        "fusetune": fusetune_git_sha(),
        "cuda": torch.version.cuda,
    }


def free_device_memory() -> None:
    """Drop every cached block so that one implementation's leftovers never count against the next."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def profile_kernels(
    fn: Callable[[], Any],
    top: int | None = 8,
    reps: int = 1,
    before_each: Callable[[], Any] | None = None,
    exclude: str | None = None,
) -> list[tuple[str, float, int]]:
    """(kernel name, total ms, launches) over `reps` calls of fn, from the profiler's kernel durations,
    largest first (the `top` largest, or all with None).

    `before_each` runs ahead of every call (an L2 flush, say); kernels whose name contains `exclude` (the
    flush's own) are left out. The durations are the GPU's work alone: no launch overhead is in them.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            if before_each is not None:
                before_each()
            fn()
        torch.cuda.synchronize()
    totals: dict[str, list] = {}
    for event in prof.events():
        if getattr(event.device_type, "name", "") != "CUDA" or (exclude and exclude in event.name):
            continue
        micros = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)
        entry = totals.setdefault(event.name[:90], [0.0, 0])
        entry[0] += micros / 1e3
        entry[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])
    if top is not None:
        ranked = ranked[:top]
    return [(name, round(ms, 4), calls) for name, (ms, calls) in ranked]


def flushed_device_ms(fn: Callable[[], Any], flush: Any, calls: int = 10) -> float:
    """Mean ms of GPU work in one call of fn, from the profiler's kernel durations, with `flush` (a device
    buffer larger than L2) rewritten before each call and its own kernel not counted."""
    kernels = profile_kernels(fn, top=None, reps=calls, before_each=flush.bitwise_not_, exclude="bitwise_not")
    return sum(ms for _name, ms, _launches in kernels) / calls


def measure_ceilings(copy_bytes: int = 2 * GIB, matmul_size: int = 8192) -> dict[str, float]:
    """Measured device ceilings: device-to-device copy bandwidth and bf16 matmul rate.

    The copy counts bytes read plus bytes written. Both use random data (zeros run faster on some parts).
    """
    copy_gbps = copy_rate_gbps(copy_bytes)
    matmul_tflops = matmul_rate_tflops(matmul_size)
    free_device_memory()
    return {"copy_GBps": round(copy_gbps, 1), "bf16_matmul_TFLOPs": round(matmul_tflops, 1)}


def copy_rate_gbps(copy_bytes: int, warmup_ms: int = 200, rep_ms: int = 500) -> float:
    """Device-to-device copy rate, bytes read plus bytes written, in GB/s."""
    import torch
    from triton.testing import do_bench

    source = torch.empty(copy_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    destination = torch.empty_like(source)
    copy_ms = do_bench(lambda: destination.copy_(source), warmup=warmup_ms, rep=rep_ms, return_mode="median")
    return 2 * copy_bytes / (copy_ms * 1e-3) / 1e9


def matmul_rate_tflops(size: int) -> float:
    import torch
    from triton.testing import do_bench

    a = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    # A long warm-up lets the clocks settle before timing.
    matmul_ms = do_bench(lambda: a @ b, warmup=500, rep=1000, return_mode="median")
    return 2 * size**3 / (matmul_ms * 1e-3) / 1e12


def run_meta(gpu: str, ceilings: dict[str, float] | None = None) -> dict[str, Any]:
    """What every results section starts with: the device, the date, the versions and the ceilings."""
    return {"gpu": gpu, "date": utc_date(), "versions": collect_versions(), "ceilings": ceilings}


def device_info() -> dict[str, Any]:
    """The GPU's name, its measured ceilings and the versions: what every results section starts with."""
    import torch

    return {
        "gpu": torch.cuda.get_device_name(),
        "ceilings": measure_ceilings(),
        "versions": collect_versions(),
    }


def measured_meta(cpu_name: str | None = None, timeout_s: float = 300) -> dict[str, Any] | None:
    """run_meta of this machine: on a GPU from a fresh process (so that the parent never holds a CUDA context
    while models train), else of `cpu_name` without ceilings; None, said why, when the GPU cannot be read."""
    if cpu_name is not None:
        return run_meta(cpu_name)
    print("Measuring ceilings ...", flush=True)
    run = run_worker(__spec__.name, ["--device-info"], timeout_s)
    if not run.results:
        print(f"could not read the device: {run.failure}", file=sys.stderr)
        return None
    info = run.results[-1]
    return {
        "gpu": info["gpu"],
        "date": utc_date(),
        "versions": info["versions"],
        "ceilings": info["ceilings"],
    }


# ---------------------------------------------------------------------------------------------------------
# One subprocess per implementation: a fault (a sticky CUDA error, an OOM, a monkey-patch) costs only the
# rows of that process. The worker reports each result as a marked line of JSON on its stdout.

RESULT_MARKER = "BENCHMARK_RESULT "


def report(result: dict[str, Any]) -> None:
    """Hand one result (a row) from a worker to the parent process."""
    print(RESULT_MARKER + json.dumps(result), flush=True)


@dataclass
class WorkerRun:
    results: list[dict[str, Any]]
    returncode: int | None
    timed_out: bool
    timeout_s: float | None
    stderr: str
    output_tail: str  # the last lines of the worker's stdout that were not results

    @property
    def failure(self) -> str | None:
        """Why the worker did not finish cleanly, in one line; None when it did."""
        if self.timed_out:
            last = f"; last output: {self.output_tail[-300:]}" if self.output_tail.strip() else ""
            return f"ran past its {self.timeout_s:.0f} s limit and was stopped{last}"
        stderr_tail = " | ".join(self.stderr.strip().splitlines()[-3:])
        if self.returncode:
            outcome = "" if self.results else " and no result"
            return f"exited with code {self.returncode}{outcome}: {stderr_tail}"
        if not self.results:
            return f"exited with no result: {stderr_tail or self.output_tail[-300:]}"
        return None


def child_env(cpu: bool = False) -> dict[str, str]:
    """The environment of a worker: this checkout importable, output unbuffered, no hub downloads; with `cpu`,
    no GPU and one thread per process."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(REPO_ROOT)) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("HF_HUB_OFFLINE", "1")
    if cpu:
        env["OMP_NUM_THREADS"] = "1"
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def exit_on_sigterm() -> None:
    """Make SIGTERM (what `timeout` sends) raise SystemExit in this process, so that `finally` blocks run and
    stop what it started in sessions of their own (workers, servers), which would otherwise outlive it; on a
    GPU machine an orphan keeps its memory from the runs after it. Python's default ends the process without
    unwinding. Only the main thread can set a handler; elsewhere this does nothing."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_system_exit)


def run_worker(
    module: str, arguments: list[str], timeout_s: float | None, nproc: int | None = None, cpu: bool = False
) -> WorkerRun:
    """`python -m module arguments` in a fresh process (under torchrun with `nproc` processes), from the
    repository root; its results are collected, its other output echoed as it comes. A worker past
    `timeout_s` is stopped with its whole process group, and so is one whose caller is stopped by SIGTERM
    (`exit_on_sigterm`). Its stderr's end goes to ours when it failed or reported an error."""
    exit_on_sigterm()
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc else []
    process = subprocess.Popen(
        [sys.executable, *launcher, "-m", module, *arguments],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(cpu),
        cwd=REPO_ROOT,
        start_new_session=True,
    )
    stderr_parts: list[str] = []
    drain = threading.Thread(target=lambda: stderr_parts.append(process.stderr.read()), daemon=True)
    drain.start()
    timed_out = threading.Event()

    def stop() -> None:
        timed_out.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)

    timer = threading.Timer(timeout_s, stop) if timeout_s else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    results: list[dict[str, Any]] = []
    tail: collections.deque[str] = collections.deque(maxlen=20)
    try:
        for line in process.stdout:
            if line.startswith(RESULT_MARKER):
                with contextlib.suppress(json.JSONDecodeError):  # a line cut short by a kill
                    results.append(json.loads(line[len(RESULT_MARKER) :]))
            else:
                print(line, end="", flush=True)
                tail.append(line)
        returncode = process.wait()
    except BaseException:
        stop()
        raise
    finally:
        if timer is not None:
            timer.cancel()
    drain.join(timeout=10)
    run = WorkerRun(results, returncode, timed_out.is_set(), timeout_s, "".join(stderr_parts), "".join(tail))
    if run.failure or any(row.get("error") and not row.get("skipped") for row in results):
        sys.stderr.write(run.stderr[-4000:])
    return run


def run_as_worker(
    measure: Callable[[dict[str, Any]], dict[str, Any]],
    spec_json: str,
    failed_row: Callable[[dict[str, Any], BaseException], dict[str, Any]],
) -> int:
    """The worker's side of run_worker: report `measure(spec)`; an exception becomes `failed_row(spec, error)`
    with the error's text, so that the parent records it and goes on with the next implementation."""
    spec = json.loads(spec_json)
    try:
        row = measure(spec)
    except Exception as error:  # noqa: BLE001 - every failure becomes the row's error
        traceback.print_exc()
        oom = "OOM: " if type(error).__name__ == "OutOfMemoryError" else ""
        row = {**failed_row(spec, error), "error": oom + short_error(error, 400)}
    report(row)
    return 0


def measure_shapes(
    module: str,
    args: argparse.Namespace,
    benchmark: Benchmark,
    shapes: Iterable[tuple],
    impls: Iterable[str],
    measure: Callable[..., dict[str, Any]],
    render: Callable[[dict[str, Any]], str],
) -> int:
    """A kernel benchmark's run (`python3 -m module`) on this process's GPU: `measure(*shape, impl)` for every shape (its name first)
    and implementation, an implementation that refuses a shape recorded as that row's error; then the results
    file and its markdown. Returns the exit status (2 without a GPU)."""
    import torch

    if not torch.cuda.is_available():
        print(f"{benchmark.name} measures GPU kernels; no CUDA device here", file=sys.stderr)
        return 2
    rows = []
    impls = list(impls)
    for shape in shapes:
        for impl in impls:
            try:
                rows.append(measure(*shape, impl))
            except Exception as error:  # noqa: BLE001 - a back end that refuses a shape is a row's error
                rows.append({"shape": shape[0], "impl": impl, "error": short_error(error, 200)})
            print(rows[-1], flush=True)
            torch.cuda.empty_cache()
    device_name = torch.cuda.get_device_name(0)
    command = (
        f"python3 -m {sys.modules['__main__'].__spec__.name}" if sys.modules["__main__"].__spec__ else ""
    )
    payload = {**run_meta(device_name), "command": command, "rows": rows}
    benchmark.save(args, results_slug(args, device_name), payload, render)
    return 0


def shape_rows_markdown(payload: dict[str, Any], title: str, columns: Iterable[tuple[str, str]]) -> str:
    """The markdown of a measure_shapes results file: the title with the GPU and the date, the command, and one
    row per shape and implementation with `columns` (header, the row's key) between them and the row's error."""
    columns = list(columns)
    table = [[row["shape"], row["impl"], *(row.get(key) for _, key in columns), row.get("error") or ""]
             for row in payload["rows"]]  # fmt: skip
    return "\n".join([
        f"# {title} — {payload['gpu']}, {payload['date']}", "", f"`{payload['command']}`", "",
        markdown_table(["shape", "impl", *(header for header, _ in columns), "error"], table), "",
    ])  # fmt: skip


def run_rows_in_workers(
    module: str,
    specs: Iterable[dict[str, Any]],
    identity: Callable[[dict[str, Any]], dict[str, Any]],
    *,
    args: argparse.Namespace,
    benchmark: Benchmark,
    slug: str,
    device_name: str,
    render: Callable[[dict[str, Any]], str],
    timeout_s: float | None,
) -> dict[str, Any]:
    """Each spec's row measured by `python -m module --_worker SPEC` in a fresh process (see run_as_worker),
    after the rows of an earlier run when the run merges; a worker that reports nothing gives the row
    `identity(spec)` with its failure as the error. The results file is rewritten after every row, so that a
    run stopped midway keeps what it measured; at the end the section's markdown is printed. Returns the
    payload written."""
    previous = benchmark.previous(args, slug)
    rows = list(previous["rows"]) if previous else []
    payload: dict[str, Any] = {}
    for spec in specs:
        print(f"row {spec.get('variant', '')} ...", flush=True)
        run = run_worker(module, ["--_worker", json.dumps(spec)], timeout_s=timeout_s)
        row = run.results[-1] if run.results else {**identity(spec), "error": short_error(run.failure, 600)}
        print(f"  {json.dumps({k: v for k, v in row.items() if k != 'profile'})}", flush=True)
        rows.append(row)
        payload = {
            **run_meta(device_name),
            "command": f"python3 -m {module} " + " ".join(sys.argv[1:]),
            "rows": rows,
        }
        benchmark.write(args.out, slug, payload, getattr(args, "section", None))
    benchmark.save(args, slug, payload, render)
    return payload


# ---------------------------------------------------------------------------------------------------------
# Results files.


@dataclass(frozen=True)
class Benchmark:
    """What a script writes: its `name` (the default section, and the key of its renderer in
    benchmarks.summary) in the results file of its `topic`."""

    name: str
    topic: str

    def path(self, out_dir: Path, slug: str) -> Path:
        return results_path(out_dir, slug, self.topic)

    def previous(self, args: argparse.Namespace, slug: str) -> dict[str, Any] | None:
        """The section an earlier run wrote, for a run that merges: `--merge-from FILE`, else with `--merge`
        the results file this run writes."""
        if getattr(args, "merge_from", None):
            return read_section(args.merge_from, args.section)
        if getattr(args, "merge", False):
            return read_section(self.path(args.out, slug), args.section)
        return None

    def save(
        self, args: argparse.Namespace, slug: str, payload: dict[str, Any], render: Callable[[dict], str]
    ) -> Path:
        """Print the section's markdown and write it to the results file in `args.out`."""
        print(render(payload))
        path = self.write(args.out, slug, payload, getattr(args, "section", None))
        print(f"wrote the section {getattr(args, 'section', self.name)!r} of {path}", flush=True)
        return path

    def write(self, out_dir: Path, slug: str, payload: dict[str, Any], section: str | None = None) -> Path:
        """Replace this benchmark's section of the results file; the file's other sections stay."""
        path = self.path(out_dir, slug)
        content = load_json(path) or {"topic": self.topic, "sections": {}}
        content["sections"][section or self.name] = {"benchmark": self.name, **payload}
        write_json(path, content)
        return path


def results_path(out_dir: Path, slug: str, topic: str) -> Path:
    return out_dir / f"{slug}-{topic}.json"


def read_section(path: Path, section: str) -> dict[str, Any] | None:
    """One section of a results file; a file of a single benchmark (as written before the topic files) is
    taken whole."""
    content = load_json(path)
    if isinstance(content, dict) and "sections" in content:
        return content["sections"].get(section)
    return content


def load_json(path: Path) -> Any:
    if not path.exists():
        return None
    with path.open() as handle:
        return json.load(handle)


def write_json(path: Path, payload: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(path.suffix + ".tmp")
    with temporary.open("w") as handle:
        json.dump(payload, handle, indent=1)
        handle.write("\n")
    temporary.replace(path)


# ---------------------------------------------------------------------------------------------------------
# Command-line options the scripts share.


def add_results_arguments(
    parser: argparse.ArgumentParser, benchmark: Benchmark, merge: str | None = None
) -> None:
    """--out, --gpu-slug and --section; with `merge` (what a merge keeps, in words) --merge and --merge-from."""
    parser.add_argument(
        "--out",
        type=Path,
        default=RESULTS_DIR,
        help=f"folder of the results file <gpu-slug>-{benchmark.topic}.json",
    )
    parser.add_argument(
        "--gpu-slug", default=None, help="file-name prefix; default from the device name (h100)"
    )
    parser.add_argument(
        "--section",
        default=benchmark.name,
        help="the section of the results file this run writes (a variant kept beside the default one)",
    )
    if merge:
        parser.add_argument(
            "--merge", action="store_true", help=f"keep {merge} in the results file's section"
        )
        parser.add_argument(
            "--merge-from",
            type=Path,
            default=None,
            help="like --merge, but take the earlier section from this file (for a run whose --out starts empty)",
        )


def results_slug(args: argparse.Namespace, device_name: str, on_gpu: bool = True) -> str:
    return args.gpu_slug or (gpu_slug(device_name) if on_gpu else "cpu")


def smoke_out(args: argparse.Namespace, prefix: str) -> None:
    """A smoke run's numbers mean nothing: unless --out is given, they go to a temporary folder."""
    if args.out == RESULTS_DIR:
        args.out = Path(tempfile.mkdtemp(prefix=prefix))


def comma_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def choices(parser: argparse.ArgumentParser, flag: str, text: str, known: Iterable[str]) -> list[str]:
    """A comma-separated option's values, each one of `known` (else the parser exits naming them)."""
    chosen, known = comma_list(text), list(known)
    unknown = [value for value in chosen if value not in known]
    if unknown:
        parser.error(f"{flag}: unknown {unknown}; choose from {', '.join(known)}")
    return chosen


# ---------------------------------------------------------------------------------------------------------
# Text.


def markdown_table(header: list[str], rows: Iterable[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        lines.append("| " + " | ".join(format_cell(cell) for cell in row) + " |")
    return "\n".join(lines)


def format_cell(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        if abs(value) >= 0.1:
            return f"{value:.3f}"
        return f"{value:.4f}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def short_error(error: BaseException | str, limit: int = 300) -> str:
    """One line that says what failed: the exception type and the start of its message."""
    if isinstance(error, BaseException):
        first_line = (str(error).strip().splitlines() or [""])[0]
        text = f"{type(error).__name__}: {first_line}"
    else:
        text = error
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---- the head of an e2e or scaling section (benchmarks/step/e2e.py, benchmarks/scaling/gpus.py)

MFU_FORMULA = (
    "mfu = tokens_per_s * flops_per_token / peak, flops_per_token = 6*N + 12*L*(n_heads*head_dim)*S "
    "(forward + backward; N = parameters that take part in matmuls: all parameters, minus the input "
    "embedding table unless it is tied to the lm_head; attention term as in the PaLM paper, not halved for "
    "the causal mask; S = the row length, or the document length when rows are packed), peak = the bf16 "
    "matmul rate measured at the start of the run (8192^3)"
)


def results_header(meta: dict[str, Any], method: str) -> dict[str, Any]:
    """How an e2e or scaling section starts: the run's meta, its method and the MFU's formula and peak."""
    return {
        **meta,
        "method": method,
        "mfu_formula": MFU_FORMULA,
        "mfu_peak_TFLOPs": (meta["ceilings"] or {}).get("bf16_matmul_TFLOPs"),
    }


if __name__ == "__main__":
    if sys.argv[1:] == ["--device-info"]:
        report(device_info())
        sys.exit(0)
    sys.exit("usage: python -m benchmarks.harness --device-info")
