"""Launch settings and tensor plumbing shared by the normalisation kernels (rms_norm.py, layer_norm.py).

Both ops normalise each row of a [rows, hidden] view and share the same two kernel shapes:

- forward: one program per tile of `rows_per_tile` rows; when the row fits the register-resident block the
  whole row lives in registers, otherwise the kernel loops over column blocks twice (statistics, then output;
  the second read of a row hits L2).
- backward: a persistent grid of about `programs_per_sm` programs per SM walks the row tiles; each program
  keeps its share of dW (and dB) in fp32 registers and writes it once to a [programs, hidden] fp32 buffer that
  one small `sum(0)` reduces. Above the register-resident block the partial sums live in that buffer and are
  updated per row tile instead.
"""

import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Largest row held in registers, in elements (the kernels compute in fp32, so this does not depend on the
# input dtype). Above it the kernels loop over column blocks of LOOPED_BLOCK_N.
# Measured on an H100 (see the tuning comment in norm_launch_settings).
MAX_REGISTER_BLOCK_N_FORWARD = 16384
MAX_REGISTER_BLOCK_N_BACKWARD = 8192
LOOPED_BLOCK_N = 4096

# Programs the interpreter runs when there is no GPU: small, so CPU tests still walk several row tiles per
# persistent program and reduce several partial dW rows.
_INTERPRETER_SM_COUNT = 2

_column_block_limit: int | None = None


@dataclass(frozen=True)
class NormLaunchSettings:
    """How one normalisation kernel is launched for a given hidden size."""

    block_n: int  # columns per tile, a power of two
    rows_per_tile: int  # rows per tile, a power of two
    num_warps: int
    programs_per_sm: int  # backward only: size of the persistent grid per SM
    num_stages: int = 1  # backward only: software-pipelining depth of the row loop

    def loop_columns(self, n_cols: int) -> bool:
        """True when a row is wider than one tile, so the kernel must loop over column blocks."""
        return self.block_n < n_cols


@contextlib.contextmanager
def force_column_block(block_n: int) -> Iterator[None]:
    """Cap the column block at `block_n` (a power of two) inside the block.

    Lets tests reach the column-looping path of the kernels at small hidden sizes (the interpreter is too slow
    for a 65536-wide row) and lets benchmarks compare the two paths at one size.
    """
    if block_n < 1 or block_n & (block_n - 1):
        raise ValueError(f"force_column_block: block_n must be a power of two, got {block_n}")
    global _column_block_limit
    previous = _column_block_limit
    _column_block_limit = block_n
    try:
        yield
    finally:
        _column_block_limit = previous


def norm_launch_settings(n_cols: int, backward: bool) -> NormLaunchSettings:
    """Launch settings for a row-wise normalisation of width `n_cols`.

    Chosen from timings on an H100 (torch 2.11, triton 3.6) of fwd and fwd+bwd at T=16384 and a sweep of
    hidden sizes; the numbers are quoted beside each constant.
    """
    max_register_block = MAX_REGISTER_BLOCK_N_BACKWARD if backward else MAX_REGISTER_BLOCK_N_FORWARD
    block_n = triton.next_power_of_2(n_cols)
    if block_n > max_register_block:
        block_n = LOOPED_BLOCK_N
    if _column_block_limit is not None:
        block_n = min(block_n, _column_block_limit)
    # Narrow rows share a tile so each program still moves a few KB per step.
    target_tile_elements = 4096 if backward else 2048
    rows_per_tile = max(1, min(64, target_tile_elements // block_n))
    tile_elements = rows_per_tile * block_n
    # About 16 fp32 values per thread and tensor: wide enough for 16-byte accesses, few enough to stay in
    # registers next to the other tensors of the backward.
    num_warps = max(1, min(16, tile_elements // 512))
    # The persistent backward must fit in one wave: at 4096 elements and 8 warps it needs ~108 registers a
    # thread (2 programs per SM), at 8192 and 16 warps ~112 (1 per SM), per the sm_90 compiler's report.
    programs_per_sm = 2 if tile_elements <= 4096 else 1
    return NormLaunchSettings(
        block_n=block_n, rows_per_tile=rows_per_tile, num_warps=num_warps, programs_per_sm=programs_per_sm
    )


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def multiprocessor_count(device: torch.device) -> int:
    """SMs of a CUDA device; a small stand-in for CPU tensors run by the Triton interpreter."""
    if device.type != "cuda":
        return _INTERPRETER_SM_COUNT
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index)


def persistent_grid_size(n_row_tiles: int, settings: NormLaunchSettings, device: torch.device) -> int:
    """Programs of a persistent backward: a few per SM, never more than there are row tiles."""
    return max(1, min(n_row_tiles, settings.programs_per_sm * multiprocessor_count(device)))


def as_rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """View `t` as [rows, n_cols] with unit column stride (copying only when the layout demands it)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    rows = t.reshape(-1, n_cols)
    if n_cols > 1 and rows.stride(1) != 1:
        rows = rows.contiguous()
    return rows


def check_casting_mode(casting_mode: str) -> None:
    if casting_mode not in ("llama", "gemma"):
        raise ValueError(f"casting_mode must be 'llama' or 'gemma', got {casting_mode!r}")


def software_bf16_rounding() -> bool:
    """True under the Triton interpreter, whose fp32 -> bf16 conversion truncates instead of rounding to
    nearest even as the GPU does; the kernels then round in integer arithmetic first to match the GPU."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def round_to(x, dtype: tl.constexpr, SOFTWARE_BF16_ROUNDING: tl.constexpr):
    """x (fp32) converted to `dtype` with round-to-nearest-even, also under the interpreter."""
    if SOFTWARE_BF16_ROUNDING and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        x = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    return x.to(dtype)
