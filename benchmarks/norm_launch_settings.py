"""Launch settings of the RMSNorm kernels at wide rows, each kernel timed alone with CUDA events (no autograd,
no host overhead in the number): the measurement behind the wide-row settings in fusetune/kernels/_norm_utils.py.

    PYTHONPATH=. python3 benchmarks/norm_launch_settings.py      # on a GPU; one line per shape and setting
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from fusetune.kernels import rms_norm  # noqa: E402
from fusetune.kernels._norm_utils import NormLaunchSettings, norm_launch_settings  # noqa: E402

SHAPES = ((16384, 16384), (65536, 16384), (16384, 32768), (32768, 32768), (65536, 8192))
# (block_n, rows_per_tile, num_warps, programs_per_sm)
BACKWARD_SETTINGS = ((8192, 1, 16, 1), (8192, 1, 16, 2), (4096, 1, 8, 2), (4096, 1, 8, 4), (2048, 1, 4, 4),
                     (2048, 1, 4, 8), (2048, 2, 8, 2), (1024, 4, 8, 2), (4096, 1, 16, 2))  # fmt: skip
# (block_n, rows_per_tile, num_warps)
FORWARD_SETTINGS = ((16384, 1, 16), (16384, 1, 32), (8192, 1, 16), (8192, 1, 8), (4096, 1, 8), (4096, 2, 8),
                    (2048, 4, 8))  # fmt: skip


def median_ms(fn: Callable[[], object], reps: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def sweep_shape(rows: int, cols: int) -> None:
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    dx = torch.empty_like(x)
    weight = torch.randn(cols, device="cuda", dtype=torch.bfloat16)
    _, _, rstd = rms_norm._launch_forward(x, None, weight, 1e-6, 0.0, "llama")
    print(f"T={rows} H={cols}: default backward {norm_launch_settings(cols, backward=True)}, "
          f"forward {norm_launch_settings(cols, backward=False)}")  # fmt: skip

    def backward(settings: NormLaunchSettings | None) -> float:
        return median_ms(
            lambda: rms_norm._launch_backward(dy, x, weight, rstd, None, 0.0, "llama", dx, settings=settings)
        )

    def forward(settings: NormLaunchSettings) -> float:
        return median_ms(
            lambda: rms_norm._launch_forward(x, None, weight, 1e-6, 0.0, "llama", settings=settings)
        )

    for block_n, rows_per_tile, warps, per_sm in BACKWARD_SETTINGS:
        if block_n < cols:
            settings = NormLaunchSettings(block_n, rows_per_tile, warps, per_sm)
            print(f"  bwd {settings}: {backward(settings):.3f} ms")
    print(f"  bwd default: {backward(None):.3f} ms")
    for block_n, rows_per_tile, warps in FORWARD_SETTINGS:
        if block_n <= cols:
            settings = NormLaunchSettings(block_n, rows_per_tile, warps, programs_per_sm=1)
            print(f"  fwd {settings}: {forward(settings):.3f} ms")


def main() -> int:
    for rows, cols in SHAPES:
        sweep_shape(rows, cols)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
