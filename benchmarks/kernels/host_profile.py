"""Where the host's time goes in one fwd+bwd of a kernel benchmark case: the CPU side of launch overhead.

ops.py reports, per implementation, the wall time, the GPU's own kernel time (device_ms) and the host time
to issue a call. Where the wall time exceeds the GPU time the host is the bottleneck; this script says why:
for each case it times the host per call (no synchronisation between calls; the GPU work of these cases is
shorter than their host work, so the queue never fills and the average is the host's issue time) and prints
cProfile's functions with the most own time over the same calls.

    python3 -m benchmarks.kernels.host_profile --cases rope:fusetune,rope:liger --calls 300
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

from benchmarks.harness import write_json
from benchmarks.kernels.ops import Case, CudaTimer, Env, build_workload, main_shapes, run_backward

DEFAULT_CASES = (
    "rope:fusetune,rope:liger,add_rms_norm:fusetune,add_rms_norm:liger,rms_norm:fusetune,rms_norm:liger"
)


def profile_case(op: str, impl: str, calls: int, top: int) -> dict:
    import torch

    case = Case(op, main_shapes(op, tiny=False)[0], impl, "main")
    workload = build_workload(case, Env(device="cuda", dtype=torch.bfloat16))

    def fwd_bwd():
        return run_backward(workload, workload.forward())

    for _ in range(10):
        fwd_bwd()
    timer = CudaTimer()
    forward_us = timer.host_time(workload.forward, calls) * 1e3
    total_us = timer.host_time(fwd_bwd, calls) * 1e3
    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    profiler.enable()
    for _ in range(calls):
        fwd_bwd()
    profiler.disable()
    torch.cuda.synchronize()
    stream = io.StringIO()
    stats = pstats.Stats(profiler, stream=stream).sort_stats("tottime")
    stats.print_stats(top)
    lines = [line for line in stream.getvalue().splitlines() if line.strip()]
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    return {"op": op, "impl": impl, "forward_us": round(forward_us, 1), "fwd_bwd_us": round(total_us, 1),
            "profile": lines[start:]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=DEFAULT_CASES, help="op:impl,... (main shapes of ops.py)")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--top", type=int, default=22)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    results = []
    for item in args.cases.split(","):
        op, impl = item.split(":")
        result = profile_case(op, impl, args.calls, args.top)
        results.append(result)
        print(
            f"== {op} {impl}: host us per call: forward {result['forward_us']}, fwd+bwd {result['fwd_bwd_us']}"
        )
        for line in result["profile"]:
            print("   " + line[:170])
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
