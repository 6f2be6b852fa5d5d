"""Helpers shared by the benchmark scripts: device ceilings, versions, result files.

Nothing here imports CUDA state at import time, so the scripts answer `--help` on machines without a GPU.
"""

from __future__ import annotations

import datetime as _dt
import gc
import importlib.metadata
import json
import os
import re
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
MIB = 2**20
GIB = 2**30


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
    return os.environ.get("FUSETUNE_GIT_SHA", "unknown")


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


def measure_ceilings(copy_bytes: int = 2 * GIB, matmul_size: int = 8192) -> dict[str, float]:
    """Measured device ceilings: device-to-device copy bandwidth and bf16 matmul rate.

    The copy counts bytes read plus bytes written. Both use random data (zeros run faster on some parts).
    """
    copy_gbps = _copy_rate_gbps(copy_bytes)
    matmul_tflops = _matmul_rate_tflops(matmul_size)
    free_device_memory()
    return {"copy_GBps": round(copy_gbps, 1), "bf16_matmul_TFLOPs": round(matmul_tflops, 1)}


def _copy_rate_gbps(copy_bytes: int) -> float:
    import torch
    from triton.testing import do_bench

    source = torch.empty(copy_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    destination = torch.empty_like(source)
    copy_ms = do_bench(lambda: destination.copy_(source), warmup=200, rep=500, return_mode="median")
    return 2 * copy_bytes / (copy_ms * 1e-3) / 1e9


def _matmul_rate_tflops(size: int) -> float:
    import torch
    from triton.testing import do_bench

    a = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    # A long warm-up lets the clocks settle before timing.
    matmul_ms = do_bench(lambda: a @ b, warmup=500, rep=1000, return_mode="median")
    return 2 * size**3 / (matmul_ms * 1e-3) / 1e12


def load_results(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    with path.open() as handle:
        return json.load(handle)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(path.suffix + ".tmp")
    with temporary.open("w") as handle:
        json.dump(payload, handle, indent=1)
        handle.write("\n")
    temporary.replace(path)


def write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


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
