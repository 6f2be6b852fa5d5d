"""Launch settings of the RMSNorm and LayerNorm kernels, each kernel's GPU time alone: the measurement behind
the settings in fusetune/kernels/_norm_utils.py.

Every setting is timed by the profiler's kernel durations (mean of several calls, L2 flushed before each, the
flush not counted), so the host's launch overhead, which exceeds these kernels' GPU time at many shapes, is
not in the numbers. The backward's dW reduction (`sum(0)` of the partial rows) is counted with it.

    python3 -m benchmarks.kernels.norm_launch_settings [--ops rms_norm,layer_norm] [--shapes 16384x4096]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import triton

from benchmarks.harness import L2_FLUSH_BYTES, flushed_device_ms, write_json
from fusetune.kernels import layer_norm, rms_norm
from fusetune.kernels._norm_utils import NormLaunchSettings, norm_launch_settings

SHAPES = ((16384, 4096), (65536, 1024), (16384, 1024), (16384, 16384), (65536, 16384), (16384, 32768))
LOOPED_BACKWARD = ((2048, 2, 8, 2), (1024, 4, 8, 4), (2048, 4, 8, 2), (1024, 8, 8, 2), (4096, 2, 8, 2), (2048, 4, 8, 4),
                   (512, 8, 8, 4), (4096, 1, 8, 4), (4096, 4, 16, 2))  # fmt: skip
LARGEST_REGISTER_ROW = 16384


def backward_candidates(cols: int) -> Iterator[NormLaunchSettings]:
    """Tiles of 1k-16k elements holding whole rows, 4-32 values per thread, 1-4 programs per SM; for rows
    wider than the largest register row, the column-looping settings."""
    block = triton.next_power_of_2(cols)
    if block > LARGEST_REGISTER_ROW:
        for block_n, rows, warps, per_sm in LOOPED_BACKWARD:
            yield NormLaunchSettings(block_n, rows, warps, per_sm)
        return
    rows = 1
    while rows * block <= LARGEST_REGISTER_ROW:
        tile = rows * block
        if tile >= 1024:
            for warps in sorted({max(1, min(32, tile // (32 * per_thread))) for per_thread in (32, 16, 8)}):
                for per_sm in (1, 2, 4):
                    if warps * per_sm <= 32:
                        yield NormLaunchSettings(block, rows, warps, per_sm)
        rows *= 2


def forward_candidates(cols: int) -> Iterator[NormLaunchSettings]:
    block = min(triton.next_power_of_2(cols), LARGEST_REGISTER_ROW)
    rows = 1
    while rows * block <= LARGEST_REGISTER_ROW:
        tile = rows * block
        if tile >= 1024:
            for warps in sorted({max(1, min(32, tile // (32 * per_thread))) for per_thread in (32, 16, 8)}):
                yield NormLaunchSettings(block, rows, warps, programs_per_sm=1)
        rows *= 2


def launchers(op: str, x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor):
    """(forward(settings), backward(settings)) of one op on fixed inputs."""
    dx = torch.empty_like(x)
    if op == "rms_norm":
        _, _, rstd = rms_norm._launch_forward(x, None, weight, 1e-6, 0.0, "llama")

        def forward(settings):
            return rms_norm._launch_forward(x, None, weight, 1e-6, 0.0, "llama", settings=settings)

        def backward(settings):
            return rms_norm._launch_backward(dy, x, weight, rstd, None, 0.0, "llama", dx, settings=settings)

        return forward, backward
    _, mean, rstd = layer_norm._launch_forward(x, weight, bias, 1e-5)

    def forward(settings):
        return layer_norm._launch_forward(x, weight, bias, 1e-5, settings=settings)

    def backward(settings):
        return layer_norm._launch_backward(dy, x, weight, True, mean, rstd, dx, settings=settings)

    return forward, backward


def sweep_shape(
    op: str, rows: int, cols: int, directions: list[str], flush: torch.Tensor, stages: list[int] | None = None
) -> list[dict]:
    torch.manual_seed(0)
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    weight = 1 + 0.1 * torch.randn(cols, device="cuda", dtype=torch.bfloat16)
    bias = 0.1 * torch.randn(cols, device="cuda", dtype=torch.bfloat16)
    forward, backward = launchers(op, x, dy, weight, bias)
    results = []
    for direction in directions:
        run = backward if direction == "bwd" else forward
        default = norm_launch_settings(cols, backward=direction == "bwd")
        candidates = backward_candidates(cols) if direction == "bwd" else forward_candidates(cols)
        if stages and direction == "bwd":
            # only the default setting, at each software-pipelining depth of the backward's row loop
            candidates = [dataclasses.replace(default, num_stages=n) for n in stages]
        timed = []
        for settings in [default, *[c for c in candidates if c != default]]:
            try:
                ms = flushed_device_ms(lambda settings=settings, run=run: run(settings), flush)
            except Exception as error:  # noqa: BLE001 - a setting the compiler rejects is reported, not fatal
                print(f"  {op} {direction} T={rows} H={cols} {settings}: {type(error).__name__}")
                continue
            timed.append((ms, settings))
        best_ms, best = min(timed, key=lambda item: item[0])
        default_ms = timed[0][0]
        row = {"op": op, "dir": direction, "T": rows, "H": cols, "default_ms": round(default_ms, 4),
               "default": _text(default), "best_ms": round(best_ms, 4), "best": _text(best),
               "all": sorted((round(ms, 4), _text(s)) for ms, s in timed)[:6]}  # fmt: skip
        print(f"{op:10} {direction} T={rows:6} H={cols:6}  default {_text(default):22} {default_ms:.4f} ms   "
              f"best {_text(best):22} {best_ms:.4f} ms  ({default_ms / best_ms:.2f}x)", flush=True)  # fmt: skip
        results.append(row)
    return results


def _text(settings: NormLaunchSettings) -> str:
    stages = f" s{settings.num_stages}" if settings.num_stages != 1 else ""
    return f"{settings.block_n}x{settings.rows_per_tile} w{settings.num_warps} p{settings.programs_per_sm}{stages}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default="rms_norm,layer_norm")
    parser.add_argument("--shapes", default=",".join(f"{t}x{h}" for t, h in SHAPES), help="TxH,...")
    parser.add_argument("--directions", default="bwd,fwd")
    parser.add_argument(
        "--stages", default="", help="e.g. 1,2,3: time only the default backward at these pipelining depths"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    rows = []
    for shape in args.shapes.split(","):
        tokens, hidden = (int(v) for v in shape.split("x"))
        for op in args.ops.split(","):
            stages = [int(n) for n in args.stages.split(",") if n.strip()]
            rows += sweep_shape(op, tokens, hidden, args.directions.split(","), flush, stages)
            torch.cuda.empty_cache()
    if args.json:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
