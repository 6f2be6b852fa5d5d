"""Launch settings and tensor plumbing shared by the normalisation kernels (rms_norm.py, layer_norm.py).

Both ops normalise each row of a [rows, hidden] view and share the same two kernel shapes:

- forward: one program per tile of `rows_per_tile` rows; when the row fits the register-resident block the
  whole row lives in registers, otherwise the kernel loops over column blocks twice (statistics, then output;
  the second read of a row hits L2).
- backward, one kernel for both norms (_norm_row_tiles.py): a persistent grid of about `programs_per_sm`
  programs per SM walks the row tiles; each program keeps its share of dW (and dB) in fp32 registers and
  writes it once to a [programs, hidden] fp32 buffer that one small `sum(0)` reduces. Rows wider than the
  register-resident block take the two streaming kernels of _norm_wide_rows.py instead (row terms, then column
  blocks), with the same `sum(0)` at the end.
"""

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from fusetune.kernels._interpreter import interpreted, launchable, round_to_dtype
from fusetune.kernels._tensors import multiprocessor_count as device_multiprocessor_count

# Largest row held in registers, in elements, forward and backward (the kernels compute in fp32, so this does
# not depend on the input dtype); wider rows loop over column blocks. H100, bf16, each kernel's GPU time alone
# (benchmarks/kernels/norm_launch_settings.py, profiler durations, 2026-11-26): at 16384 columns the backward holding
# the row with 16 warps took 0.654 ms at 16384 rows against 1.031 for the loop over 8192-column blocks
# (65536 rows: 2.64 against 4.07; LayerNorm 0.94 against 1.26 and 3.63 against 5.02); 32 warps 0.78 (their
# 64-register cap spills). The forward's 16384-column row: LayerNorm 0.364 ms with 16 warps against 0.504 with
# 32, RMSNorm 0.359 either way.
MAX_REGISTER_BLOCK_N = 16384
MAX_REGISTER_ROW_WARPS = 16
# Rows wider than that. Backward (_norm_wide_rows.py): column blocks of 2048 in both kernels, tiles of 4 rows
# in the second, 8 warps, 4 programs per SM. H100, bf16, GPU time alone, 2026-11-26, RMSNorm / LayerNorm
# ms: 16384 x 32768 1.83 / 1.83 (the single looping kernel before: 2.75 / 3.65; copy floor 1.07), 4096 x
# 32768 0.477 / 0.484, 65536 x 32768 7.22 / 7.27, 16384 x 20480 1.15 / 1.20: each within 2% of the best of the
# 9 settings tried there (benchmarks/kernels/norm_launch_settings.py).
# Forward: 16384-column blocks with 32 warps (0.78 against 1.02 ms at 16384 x 32768).
WIDE_ROW_BACKWARD = (2048, 4, 8, 4)  # block_n, rows_per_tile (second kernel), num_warps, programs_per_sm
WIDE_ROW_FORWARD = (16384, 1, 32, 1)

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

    def forward_grid(self, n_rows: int) -> tuple[int]:
        """One forward program per tile of rows."""
        return ((n_rows + self.rows_per_tile - 1) // self.rows_per_tile,)

    def forward_launch_arguments(self, n_cols: int) -> dict[str, Any]:
        """The tiling and launch arguments every norm's forward kernel takes from these settings."""
        return {
            "BLOCK_ROWS": self.rows_per_tile,
            "BLOCK_N": self.block_n,
            "LOOP_COLUMNS": self.loop_columns(n_cols),
            "SOFTWARE_BF16_ROUNDING": interpreted(),
            "num_warps": self.num_warps,
        }


def dx_buffer(dy: torch.Tensor, x: torch.Tensor, inplace_backward: bool) -> torch.Tensor:
    """Where a norm's eager backward writes dx: over dy itself when the caller promised dy is not needed after
    (`inplace_backward`) and dy has x's contiguous layout and dtype, else a new tensor."""
    if inplace_backward and dy.is_contiguous() and dy.dtype == x.dtype and dy.shape == x.shape:
        return dy
    return x.new_empty(x.shape)


@contextlib.contextmanager
def force_column_block(block_n: int) -> Iterator[None]:
    """Cap the column block at `block_n` (a power of two) inside the block.

    Lets tests reach the wide-row paths of the kernels (the column-looping forward, the two-kernel backward) at
    small hidden sizes (the interpreter is too slow for a 65536-wide row) and lets benchmarks compare paths.
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
    """Launch settings for a row-wise normalisation of width `n_cols` (cached: this runs on every call)."""
    return _norm_launch_settings(n_cols, backward, _column_block_limit)


@functools.lru_cache(maxsize=1024)
def _norm_launch_settings(n_cols: int, backward: bool, column_block_limit: int | None) -> NormLaunchSettings:
    """Launch settings for a row-wise normalisation of width `n_cols`.

    H100, bf16, each kernel's GPU time alone (benchmarks/kernels/norm_launch_settings.py, profiler durations,
    2026-11-26): at 16384 x 4096 the backward's 1 row x 4096 with 8 warps and 2 programs per SM took 0.157 ms
    (floor 0.134) and the best of 17 settings 0.148; at 65536 x 1024 the default 2 rows x 1024, 4 warps, 4 per
    SM was the best of 35 (0.155 ms), at 16384 x 1024 within 1% of it; the forward at 1024 and 4096 columns
    was within 1% of the best of 8-14 settings, at 1.04x the copy floor. Launch overhead is larger than these
    kernels' GPU time, so wall-clock sweeps (an earlier one, 2026-11-22) could only rule settings out.
    """
    block_n = triton.next_power_of_2(n_cols)
    if block_n > MAX_REGISTER_BLOCK_N and column_block_limit is None:
        return NormLaunchSettings(*(WIDE_ROW_BACKWARD if backward else WIDE_ROW_FORWARD))
    block_n = min(block_n, MAX_REGISTER_BLOCK_N)
    if column_block_limit is not None:
        block_n = min(block_n, column_block_limit)
    # Narrow rows share a tile of at least 2048 elements, so each program moves a few KB per step.
    rows_per_tile = max(1, min(64, 2048 // block_n))
    tile_elements = rows_per_tile * block_n
    # About 16 values per thread and tensor up to 8192 columns (16-byte accesses, few enough registers for the
    # backward: 2048 -> 4 warps, 4096 -> 8, 8192 -> 16), 32 at 16384 (16 warps: module constants).
    num_warps = max(1, min(MAX_REGISTER_ROW_WARPS, tile_elements // 512))
    # The persistent backward should fit in one wave. The sm_90 compiler gives it ~96 registers a thread at
    # 2048 elements and 4 warps (5 programs fit an SM), ~108 at 4096 and 8 warps (2 fit), ~112 at 8192 and
    # 16 warps (1 fits).
    programs_per_sm = max(1, min(8, 8192 // tile_elements))
    # The backward's row loop pipelined 3 deep (the next tiles' loads issued before this one's math): H100 GPU
    # time, 2026-11-26, RMSNorm / LayerNorm 1.03-1.06x faster at 1024-4096 columns and 1.12 / 1.13x at 8192
    # (16384 x 8192: 0.316 -> 0.283 ms); at 16384 columns, whose row already fills the registers, no gain.
    num_stages = 3 if backward and block_n <= 8192 else 1
    return NormLaunchSettings(
        block_n=block_n,
        rows_per_tile=rows_per_tile,
        num_warps=num_warps,
        programs_per_sm=programs_per_sm,
        num_stages=num_stages,
    )


def multiprocessor_count(device: torch.device) -> int:
    """SMs of a CUDA device; _INTERPRETER_SM_COUNT for CPU tensors run by the Triton interpreter."""
    return device_multiprocessor_count(device, _INTERPRETER_SM_COUNT)


# Rows a persistent backward program should walk at least, when there are few rows: each program writes one
# fp32 row of partial dW sums that a reduction reads back, 8 bytes a column against 6 per column and row of
# dy, x and dx, so with fewer rows the partial sums rival the data. H100, GPU time, 2026-11-26: T=1024,
# H=2048 0.0199 ms with 4 programs per SM (2 rows each) against 0.0154 with 1; T=1024, H=1024 0.0154 / 0.0122.
MIN_ROWS_PER_PROGRAM = 8


def persistent_grid_size(n_row_tiles: int, settings: NormLaunchSettings, device: torch.device) -> int:
    """Programs of a persistent backward: a few per SM, never more than there are row tiles, and with few
    rows no more than one per SM or per MIN_ROWS_PER_PROGRAM rows, whichever is more."""
    sm_count = multiprocessor_count(device)
    by_rows = max(sm_count, n_row_tiles * settings.rows_per_tile // MIN_ROWS_PER_PROGRAM)
    return max(1, min(n_row_tiles, settings.programs_per_sm * sm_count, by_rows))


def as_rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """View `t` as [rows, n_cols] with unit column stride (copying only when the layout demands it)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    rows = t.reshape(-1, n_cols)
    if n_cols > 1 and rows.stride(1) != 1:
        rows = rows.contiguous()
    return rows


# --------------------------------------------------------------------------------------------------
# The forward's launch preparation and tile rows, shared by rms_norm.py and layer_norm.py
# --------------------------------------------------------------------------------------------------


def forward_rows(
    x: torch.Tensor, settings: NormLaunchSettings | None
) -> tuple[torch.Tensor, NormLaunchSettings]:
    """A norm forward's input as [rows, n] (`as_rows`), and its launch settings: those given, else the
    forward's for that width."""
    n_cols = x.shape[-1]
    if settings is None:
        settings = norm_launch_settings(n_cols, backward=False)
    return as_rows(x, n_cols), settings


def forward_launcher(kernel: Any, settings: NormLaunchSettings, n_rows: int, traced: bool) -> Any:
    """A norm's forward `kernel`, `launchable` as `traced` says, over one program per tile of `n_rows` rows."""
    return launchable(kernel, traced)[settings.forward_grid(n_rows)]


@triton.jit
def forward_tile_rows(n_rows, BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The rows of this forward program's tile, which of them exist, the rows as int64 (for offsets that may
    pass 2**31) and the columns of the first block. A jit function: inlined into each kernel, it costs nothing."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    return rows, rows < n_rows, rows.to(tl.int64), tl.arange(0, BLOCK_N)


class BackwardRows(NamedTuple):
    """A norm backward's tensors as [rows, n] views (at least one row) with unit column stride, as
    launch_norm_backward hands them to either backward launcher. dx may be dy itself: each element is read
    before it is written, by the same program."""

    dy: torch.Tensor
    x: torch.Tensor
    mean: torch.Tensor | None  # LayerNorm's row means, None for RMSNorm
    rstd: torch.Tensor
    d_residual: torch.Tensor | None
    dx: torch.Tensor


def check_casting_mode(casting_mode: str) -> None:
    if casting_mode not in ("llama", "gemma"):
        raise ValueError(f"casting_mode must be 'llama' or 'gemma', got {casting_mode!r}")


# --------------------------------------------------------------------------------------------------
# The backward's tile tail and partial sums, shared by _norm_row_tiles.py and _norm_wide_rows.py
# --------------------------------------------------------------------------------------------------


@triton.jit
def load_normalized_tile(
    dy_ptr,
    dy_row_stride,
    x_ptr,
    x_row_stride,
    w_eff,
    mean_ptr,
    rstd_ptr,
    rows,
    rows64,
    row_mask,
    cols,
    mask,
    HAS_WEIGHT: tl.constexpr,
    CENTERED: tl.constexpr,
):
    """A [rows, columns] tile's dy (fp32), xhat = (x - mean) * rstd (mean = 0 without CENTERED), g = dy *
    w_eff (dy without a weight) and the rows' rstd; masked entries load 0."""
    dy = tl.load(dy_ptr + rows64[:, None] * dy_row_stride + cols[None, :], mask=mask, other=0.0).to(
        tl.float32
    )
    x = tl.load(x_ptr + rows64[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
    if CENTERED:
        mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
        xhat = (x - mean[:, None]) * rstd[:, None]
    else:
        xhat = x * rstd[:, None]
    if HAS_WEIGHT:
        g = dy * w_eff[None, :]
    else:
        g = dy
    return dy, xhat, g, rstd


@triton.jit
def store_dx_and_accumulate(
    dx,
    dy,
    xhat,
    rows64,
    cols,
    mask,
    x_ptr,
    d_residual_ptr,
    d_residual_row_stride,
    dx_ptr,
    dx_row_stride,
    dw_acc,
    db_acc,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_D_RESIDUAL: tl.constexpr,
    ROUND_XHAT_FOR_DW: tl.constexpr,
    SOFTWARE_BF16_ROUNDING: tl.constexpr,
):
    """Stores a [rows, columns] tile of dx (plus d_residual) and returns (dw_acc, db_acc) with the tile's
    column sums added: dy * xhat (xhat rounded to x's dtype first with ROUND_XHAT_FOR_DW, since that rounded
    value is what multiplied the weight) and dy."""
    if HAS_D_RESIDUAL:
        d_residual = tl.load(
            d_residual_ptr + rows64[:, None] * d_residual_row_stride + cols[None, :], mask=mask, other=0.0
        )
        dx += d_residual.to(tl.float32)
    tl.store(
        dx_ptr + rows64[:, None] * dx_row_stride + cols[None, :],
        round_to_dtype(dx, dx_ptr.dtype.element_ty, SOFTWARE_BF16_ROUNDING),
        mask=mask,
    )
    if HAS_WEIGHT:
        if ROUND_XHAT_FOR_DW:
            xhat = round_to_dtype(xhat, x_ptr.dtype.element_ty, SOFTWARE_BF16_ROUNDING).to(tl.float32)
        dw_acc += tl.sum(dy * xhat, axis=0)
    if HAS_BIAS:
        db_acc += tl.sum(dy, axis=0)
    return dw_acc, db_acc


@triton.jit
def store_partial_sums(
    dw_partial_ptr,
    db_partial_ptr,
    slot,
    cols,
    col_mask,
    n_cols,
    dw_acc,
    db_acc,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """A program's dw / db sums over its rows, as row ``slot`` of the [slots, n] fp32 partial buffers."""
    if HAS_WEIGHT:
        tl.store(dw_partial_ptr + slot.to(tl.int64) * n_cols + cols, dw_acc, mask=col_mask)
    if HAS_BIAS:
        tl.store(db_partial_ptr + slot.to(tl.int64) * n_cols + cols, db_acc, mask=col_mask)


def partial_sum_buffers(
    slots: int, n_cols: int, has_weight: bool, has_bias: bool, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The [slots, n] fp32 buffers :func:`store_partial_sums` writes (None for an absent weight or bias)."""

    def buffer(present: bool) -> torch.Tensor | None:
        return torch.empty((slots, n_cols), dtype=torch.float32, device=device) if present else None

    return buffer(has_weight), buffer(has_bias)


def summed_partials(*partials: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Each partial buffer summed over its slots (None stays None)."""
    return tuple(partial.sum(0) if partial is not None else None for partial in partials)
