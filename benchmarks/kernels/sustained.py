"""fwd+bwd of each implementation of an op timed in its own steady power state, with the clocks it ran at.

Under sustained matmul load an H100 reaches its 700 W cap within about a second and the SM clock then
falls from 1,980 MHz to 1,170-1,700 MHz (nvidia-smi's clock-event reason 0x4, SW power cap; H100,
2026-11-27), so a matmul-bound call's time depends on what ran before it. ops.py times each
implementation for about a second after the previous one: whichever follows an idle spell or a light
implementation takes part of its samples at the full clock. Calling the implementations in turn does not
cure it either: each call then runs in the power state its predecessor left (measured on H100 at the fused
linear loss's main shape, one call of six implementations a round in rotating order: fusetune 36.6 ms and
fusetune+compile, the same kernels, 40.3). Here each implementation first runs back to back for
``--settle-s`` seconds, so that the clocks reach the state its own load holds them at, and is then timed
over ``--calls`` calls (L2 flushed before each, CUDA events); all implementations in order and then in
reverse order, so that drift shows as a difference between the two passes. The SM clock, power draw and
clock-event reasons are sampled through the timed calls (nvidia-smi) and reported with each: under the
cap a call's time follows the energy it spends, its memory traffic included, not only its kernels'
durations at the full clock.

    python3 -m benchmarks.kernels.sustained                                   # the main shapes
    python3 -m benchmarks.kernels.sustained --ops fused_linear_cross_entropy \\
        --shape T=8192,H=1536,V=256000,softcap=30 --shape T=4096,H=2048,V=151936 --merge
    python3 -m benchmarks.kernels.sustained --device cpu --ops cross_entropy --impls hf,fusetune

Writes the section "sustained" of ``<gpu>-kernels.json``: rows in the format of ops.py's, plus ``ms_p10`` /
``ms_p90``, each pass's median and the clocks of the timed calls.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

from benchmarks import harness
from benchmarks.harness import GIB, markdown_table, short_error
from benchmarks.kernels.ops import (
    OP_IMPLS,
    OPS,
    Case,
    Env,
    Unavailable,
    build_workload,
    error_rows,
    estimated_bytes,
    main_shapes,
    measured_row,
    run_backward,
)

RESULTS = harness.Benchmark("sustained", topic="kernels")

DEFAULT_OPS = ("fused_linear_cross_entropy", "swiglu_mlp", "cross_entropy")
# nvidia-smi's clock-event bit for the software power cap.
POWER_CAP_REASON = 0x4
SAMPLE_PERIOD_MS = 100


class ClockSampler:
    """nvidia-smi sampling the SM clock, power draw and clock-event reasons every SAMPLE_PERIOD_MS in the
    background; no samples where nvidia-smi is missing (the CPU smoke test)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float, float, int]] = []  # (time, SM MHz, watts, reasons)
        self._process: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> ClockSampler:
        executable = shutil.which("nvidia-smi")
        if executable is None:
            return self
        query = "clocks.sm,power.draw,clocks_event_reasons.active"
        self._process = subprocess.Popen(
            [executable, f"--query-gpu={query}", "--format=csv,noheader,nounits", f"-lms={SAMPLE_PERIOD_MS}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            fields = [field.strip() for field in line.split(",")]
            with contextlib.suppress(ValueError, IndexError):
                self.samples.append((time.time(), float(fields[0]), float(fields[1]), int(fields[2], 16)))

    def __exit__(self, *exc_info: Any) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(timeout=10)
        if self._reader is not None:
            self._reader.join(timeout=10)

    def summary(self, start: float, end: float) -> dict[str, float] | None:
        """The SM clock and power draw between two times, and the share of samples at the power cap."""
        inside = [sample for sample in self.samples if start <= sample[0] <= end]
        if not inside:
            return None
        clocks = [sample[1] for sample in inside]
        return {
            "samples": len(inside),
            "sm_mhz_median": statistics.median(clocks),
            "sm_mhz_min": min(clocks),
            "sm_mhz_max": max(clocks),
            "power_w_median": statistics.median(sample[2] for sample in inside),
            "power_capped_share": round(sum(bool(s[3] & POWER_CAP_REASON) for s in inside) / len(inside), 3),
        }


def parse_shape(text: str) -> dict[str, float | int]:
    """'T=8192,H=1536,V=256000,softcap=30' -> {'T': 8192, 'H': 1536, 'V': 256000, 'softcap': 30}."""
    shape: dict[str, float | int] = {}
    for item in text.split(","):
        key, separator, value = item.partition("=")
        if not separator or not key.strip():
            raise argparse.ArgumentTypeError(f"--shape {text!r}: expected KEY=VALUE pairs, got {item!r}")
        try:
            number = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--shape {text!r}: {key.strip()} is not a number") from None
        shape[key.strip()] = int(number) if number.is_integer() else number
    return shape


def _percentile(sorted_values: list[float], fraction: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(fraction * len(sorted_values)))]


def timed_in_steady_state(
    fn: Any, calls: int, settle_s: float, device: str
) -> tuple[list[float], float, float]:
    """(ms of each call, wall time the timed calls began, ended) after ``settle_s`` of back-to-back calls."""
    import torch

    if device != "cuda":
        samples = []
        for _ in range(calls):
            started = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - started) * 1e3)
        return samples, 0.0, 0.0
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    settle_until = time.time() + settle_s
    while time.time() < settle_until:
        flush.zero_()
        fn()
        torch.cuda.synchronize()  # the host waits each call, so the settling time is the device's
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)
    ]
    began = time.time()
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events], began, time.time()


def measure_shape(
    op: str,
    shape: dict,
    impls: list[str],
    env: Env,
    options: argparse.Namespace,
    ceilings: dict | None,
    sampler: ClockSampler,
) -> list[dict]:
    """Rows for one op and shape: every implementation built at once (those that do not fit beside the
    others skipped, largest first), then timed in order and again in reverse order."""
    import torch

    device = options.device
    cases = [Case(op, shape, impl, "sustained") for impl in impls if impl in OP_IMPLS[op]]
    rows: list[dict] = []
    if device == "cuda":
        free, _total = torch.cuda.mem_get_info()
        while cases and sum(estimated_bytes(case) for case in cases) > 0.85 * free:
            largest = max(cases, key=estimated_bytes)
            cases.remove(largest)
            rows += error_rows(
                largest, f"does not fit beside the others ({free / GIB:.1f} GiB free)", ceilings, True
            )
    calls: dict[str, Any] = {}
    for case in cases:
        try:
            workload = build_workload(case, env)
        except Unavailable as reason:
            rows += error_rows(case, str(reason), ceilings, skipped=True)
            continue

        def fwd_bwd(workload=workload):
            return run_backward(workload, workload.forward())

        try:
            fwd_bwd()  # compiles Triton kernels and torch.compile graphs before any timing
        except Exception as error:  # noqa: BLE001 - a failing implementation becomes its row's error
            rows += error_rows(case, short_error(error), ceilings)
            continue
        calls[case.impl] = (case, fwd_bwd)
    passes: dict[str, list[tuple[list[float], float, float]]] = {impl: [] for impl in calls}
    for order in (list(calls), list(reversed(calls))):
        for impl in order:
            passes[impl].append(
                timed_in_steady_state(calls[impl][1], options.calls, options.settle_s, device)
            )
    for impl, timed in passes.items():
        samples = sorted(ms for pass_samples, _began, _ended in timed for ms in pass_samples)
        row = measured_row(calls[impl][0], "fwd+bwd", statistics.median(samples), ceilings)
        row["ms_p10"] = round(_percentile(samples, 0.1), 4)
        row["ms_p90"] = round(_percentile(samples, 0.9), 4)
        row["ms_by_pass"] = [round(statistics.median(pass_samples), 4) for pass_samples, _b, _e in timed]
        row["calls"] = len(samples)
        clocks = [sampler.summary(began, ended) for _samples, began, ended in timed]
        clocks = [summary for summary in clocks if summary]
        if clocks:
            row["clocks"] = {
                "sm_mhz_median": statistics.median(summary["sm_mhz_median"] for summary in clocks),
                "power_w_median": statistics.median(summary["power_w_median"] for summary in clocks),
                "power_capped_share": round(
                    statistics.mean(summary["power_capped_share"] for summary in clocks), 3
                ),
            }
        rows.append(row)
    return rows


def render_markdown(payload: dict[str, Any]) -> str:
    versions = ", ".join(f"{key} {value}" for key, value in payload["versions"].items() if value)
    lines = [
        f"# Sustained fwd+bwd: {payload['gpu']}, {payload['date']}",
        "",
        f"Versions: {versions}.",
        "",
        "Method: benchmarks/kernels/sustained.py. Every implementation of an op is built at once; each runs back to "
        "back for a few seconds (its own steady power state), then a number of calls are timed between CUDA "
        "events (L2 flushed before each; both given under each table); all implementations in order, then "
        "again in reverse order. `median ms` is over both passes' calls, `pass 1` / `pass 2` each pass's "
        "median. A merged file's tables may come from different runs: each names its fusetune commit. "
        "Clocks: nvidia-smi samples during the timed calls, medians of the two passes: SM clock, power "
        "draw, and the share of samples with the SW power cap among the clock-event reasons.",
        "",
    ]
    for group in payload["groups"]:
        shape = ", ".join(f"{key}={value}" for key, value in group["shape"].items())
        lines += [f"## {group['op']}: {shape}", ""]
        rows = [row for row in payload["rows"] if row["op"] == group["op"] and row["shape"] == group["shape"]]
        by_impl = {row["impl"]: row.get("ms") for row in rows}
        compile_ms, liger_ms = by_impl.get("compile"), by_impl.get("liger")
        table = []
        for row in rows:
            if "ms" not in row:
                table.append([row["impl"], *([None] * 10), row.get("error")])
                continue
            clocks = row.get("clocks") or {}
            table.append(
                [
                    row["impl"],
                    row["ms"],
                    *row["ms_by_pass"],
                    row["ms_p10"],
                    row["ms_p90"],
                    clocks.get("sm_mhz_median"),
                    clocks.get("power_w_median"),
                    f"{clocks['power_capped_share']:.0%}" if clocks else None,
                    round(row["ms"] / compile_ms, 3) if compile_ms else None,
                    round(row["ms"] / liger_ms, 3) if liger_ms else None,
                    "",
                ]
            )
        header = ["impl", "median ms", "pass 1", "pass 2", "p10", "p90", "SM MHz", "power W", "capped"]
        lines += [markdown_table([*header, "÷ compile", "÷ liger", "note"], table), ""]
        timed = [row["calls"] // 2 for row in rows if "calls" in row]
        if timed:
            settle_s = group.get("settle_s", payload["settle_s"])
            version = group.get("fusetune", payload["versions"].get("fusetune"))
            lines += [
                f"Settled {settle_s} s, then {max(timed)} timed calls per pass; fusetune {version}.",
                "",
            ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--ops", default=",".join(DEFAULT_OPS), help=f"comma-separated subset of: {', '.join(OPS)}"
    )
    parser.add_argument("--impls", default="hf,compile,liger,cce,fusetune,fusetune+compile")
    parser.add_argument(
        "--shape",
        action="append",
        type=parse_shape,
        default=None,
        help="KEY=VALUE,... (repeatable): these shapes instead of each op's main shape",
    )
    parser.add_argument("--calls", type=int, default=20, help="timed calls of each implementation per pass")
    parser.add_argument(
        "--settle-s", type=float, default=3.0, help="seconds of back-to-back calls before each timing"
    )
    harness.add_results_arguments(
        parser, RESULTS, merge="the groups (op and shape) this run does not measure"
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu smoke-tests the script at tiny shapes under TRITON_INTERPRET=1 (numbers mean nothing; "
        "writes to a temporary folder unless --out is given)",
    )
    args = parser.parse_args(argv)
    args.ops = harness.choices(parser, "--ops", args.ops, OPS)
    args.impls = harness.comma_list(args.impls)
    if args.calls < 1:
        parser.error("--calls must be at least 1")
    if args.settle_s < 0:
        parser.error("--settle-s must not be negative")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        harness.smoke_out(args, "fusetune-sustained-cpu-")
    import torch

    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("no CUDA device: run on a GPU machine, or pass --device cpu to smoke-test", file=sys.stderr)
            return 2
        gpu_name, ceilings = torch.cuda.get_device_name(), harness.measure_ceilings()
    else:
        gpu_name, ceilings = "cpu (smoke test, TRITON_INTERPRET=1)", None
    slug = harness.results_slug(args, gpu_name, on_gpu=args.device == "cuda")
    payload: dict[str, Any] = {
        **harness.run_meta(gpu_name, ceilings),
        "settle_s": args.settle_s,
        "calls": args.calls,
        "rows": [],
        "groups": [],
    }
    env = Env(device=args.device, dtype=torch.bfloat16)
    with ClockSampler() as sampler:
        for op in args.ops:
            for shape in args.shape or main_shapes(op, tiny=args.device == "cpu"):
                rows = measure_shape(op, shape, args.impls, env, args, ceilings, sampler)
                payload["rows"] += rows
                payload["groups"].append(
                    {
                        "op": op,
                        "shape": shape,
                        "settle_s": args.settle_s,
                        "fusetune": payload["versions"]["fusetune"],
                    }
                )
                for row in rows:
                    measured = row.get("ms", row.get("error"))
                    print(
                        f"{op} {shape} {row['impl']}: {measured} {row.get('ms_by_pass', '')} {row.get('clocks', '')}"
                    )
                if args.device == "cuda":
                    torch._dynamo.reset()
                harness.free_device_memory()
    previous = RESULTS.previous(args, slug)
    if previous:
        measured = {(group["op"], json.dumps(group["shape"], sort_keys=True)) for group in payload["groups"]}

        def kept(item: dict) -> bool:
            return (item["op"], json.dumps(item["shape"], sort_keys=True)) not in measured

        payload["groups"] = [group for group in previous["groups"] if kept(group)] + payload["groups"]
        payload["rows"] = [row for row in previous["rows"] if kept(row)] + payload["rows"]
    RESULTS.save(args, slug, payload, render_markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
