"""Tiles of the float8 gated-MLP backward's two kernels (fusetune/kernels/float8_gated.py), each kernel's GPU
time alone: the measurement behind MAXIMA_TILE and BACKWARD_TILE there.

Every tile is timed by the profiler's kernel durations (mean of several calls, L2 flushed before each, the flush
not counted); the maxima launch's `amax` over its per-tile rows is counted with it. GB/s counts the bytes each
kernel must move: three bf16 inputs read, and for the backward five float8 outputs written.

    python3 -m benchmarks.kernels.float8_gated_launch_settings [--shapes 16384x8192:silu] [--json F]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from benchmarks.harness import L2_FLUSH_BYTES, flushed_device_ms, write_json
from fusetune.kernels import float8_gated
from fusetune.kernels.float8_gated import BACKWARD_TILE, MAXIMA_TILE, Tile

# tokens x intermediate and the activation: Llama-3.2-1B, Qwen2.5-1.5B and Gemma-2-2B at 8 x 2,048 tokens,
# Llama-3.1-8B at 1 x 4,096.
SHAPES = ("16384x8192:silu", "16384x8960:silu", "16384x9216:gelu_tanh", "4096x14336:silu")


def candidates() -> Iterator[Tile]:
    """Tiles of 2k-16k elements, sides 32-128, 4-16 warps (16 or 32 elements a thread)."""
    for rows in (32, 64, 128):
        for cols in (32, 64, 128):
            elements = rows * cols
            for warps in (4, 8, 16):
                if elements >= 2048 and elements // (32 * warps) in (16, 32):
                    yield Tile(rows, cols, warps)


def sweep_shape(tokens: int, intermediate: int, activation: str, flush: torch.Tensor) -> list[dict]:
    torch.manual_seed(0)
    grad, gate, up = (
        torch.randn(tokens, intermediate, device="cuda", dtype=torch.bfloat16) for _ in range(3)
    )
    scales = torch.tensor([448.0, 57344.0, 57344.0], device="cuda")
    elements = tokens * intermediate
    kernels = {
        "maxima": (
            MAXIMA_TILE,
            3 * 2 * elements,
            lambda tile: float8_gated._launch_maxima(grad, gate, up, activation, traced=False, tile=tile),
        ),
        "backward": (
            BACKWARD_TILE,
            3 * 2 * elements + 5 * elements,
            lambda tile: float8_gated._launch_backward(
                grad,
                gate,
                up,
                activation,
                scales,
                torch.float8_e4m3fn,
                torch.float8_e5m2,
                traced=False,
                tile=tile,
            ),
        ),
    }
    rows = []
    for kernel, (default, moved, launch) in kernels.items():
        timed = []
        for tile in [default, *[t for t in candidates() if t != default]]:
            try:
                ms = flushed_device_ms(lambda tile=tile, launch=launch: launch(tile), flush)
            except Exception as error:  # noqa: BLE001 - a tile the compiler rejects is reported, not fatal
                print(f"  {kernel} {tokens}x{intermediate} {_text(tile)}: {type(error).__name__}")
                continue
            timed.append((ms, tile))
        default_ms = timed[0][0]
        best_ms, best = min(timed, key=lambda item: item[0])
        row = {"kernel": kernel, "tokens": tokens, "intermediate": intermediate, "activation": activation,
               "default": _text(default), "default_ms": round(default_ms, 4),
               "default_gb_s": round(moved / default_ms / 1e6), "best": _text(best), "best_ms": round(best_ms, 4),
               "best_gb_s": round(moved / best_ms / 1e6),
               "fastest": [(round(ms, 4), _text(t)) for ms, t in sorted(timed)[:6]]}  # fmt: skip
        print(f"{kernel:8} {tokens:6}x{intermediate:<6} {activation:9} default {_text(default):11} {default_ms:.4f} ms "
              f"({row['default_gb_s']} GB/s)  best {_text(best):11} {best_ms:.4f} ms ({row['best_gb_s']} GB/s, "
              f"{default_ms / best_ms:.2f}x)", flush=True)  # fmt: skip
        rows.append(row)
    return rows


def _text(tile: Tile) -> str:
    return f"{tile.rows}x{tile.cols} w{tile.warps}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="TOKENSxINTERMEDIATE:ACTIVATION,...")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    rows = []
    for shape in args.shapes.split(","):
        size, activation = shape.split(":")
        tokens, intermediate = (int(v) for v in size.split("x"))
        rows += sweep_shape(tokens, intermediate, activation, flush)
        torch.cuda.empty_cache()
    if args.json:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
