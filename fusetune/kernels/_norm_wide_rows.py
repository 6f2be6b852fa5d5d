"""Backward of RMSNorm and LayerNorm for rows wider than the register-resident kernel holds
(_norm_row_tiles.py): two streaming kernels instead of one program looping over a row twice.

Both norms share the same form. With xhat = (x - mean) * rstd (mean = 0 for RMSNorm), g = dy * w_eff (the
weight as the forward applied it, fp32; g = dy without a weight) and n the row width:

    dx = rstd * (g - mean(g) - xhat * mean(g * xhat))     (RMSNorm: no mean(g) term), + d_residual
    dw = sum over rows of dy * xhat   (RMSNorm llama mode: xhat rounded to the input dtype first)
    db = sum over rows of dy

1. `_row_terms_kernel`, one program per row: mean(g * xhat) and mean(g), reading dy and x once.
2. `_columns_kernel`, a grid of (column blocks, row groups): each program walks its row tiles in one column
   block, writes dx and keeps that block's dw / db partial sums in registers, stored once at the end as one
   row of a [row groups, n] fp32 buffer that the launcher sums.

That reads dy and x twice and writes dx once, all at streaming speed. The single-kernel alternative, a
program looping twice over its rows' column blocks, measured slower on H100 (bf16, GPU time alone,
2026-11-26: RMSNorm backward at 16384 x 32768 2.75 ms, the copy floor of its 3 tensors 1.07): its second
pass over rows far wider than the L2's share of a program read HBM again anyway, and its dw partial sums,
too many for registers, were read and written in global memory once per row tile.
"""

import functools

import torch
import triton
import triton.language as tl

from fusetune.kernels._interpreter import interpreted, launchable
from fusetune.kernels._norm_utils import (
    BackwardRows,
    NormLaunchSettings,
    load_normalized_tile,
    multiprocessor_count,
    partial_sum_buffers,
    store_dx_and_accumulate,
    store_partial_sums,
    summed_partials,
)

__all__ = ["launch_wide_row_backward"]


@triton.jit
def _row_terms_kernel(
    dy_ptr,
    dy_row_stride,
    x_ptr,
    x_row_stride,
    w_eff_ptr,
    mean_ptr,
    rstd_ptr,
    terms_ptr,
    n_rows,
    n_cols,
    HAS_WEIGHT: tl.constexpr,
    CENTERED: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """terms[0, row] = mean(g * xhat) and, CENTERED (LayerNorm), terms[1, row] = mean(g)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    rstd = tl.load(rstd_ptr + row)
    if CENTERED:
        mean = tl.load(mean_ptr + row)
    sum_g_x = tl.zeros([BLOCK_N], dtype=tl.float32)
    sum_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        col_mask = c < n_cols
        g = tl.load(dy_ptr + row * dy_row_stride + c, mask=col_mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + row * x_row_stride + c, mask=col_mask, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            g = g * tl.load(w_eff_ptr + c, mask=col_mask, other=0.0)
        if CENTERED:
            x = x - mean  # masked columns have g = 0, so their nonzero x - mean adds nothing
            sum_g += g
        sum_g_x += g * x
    tl.store(terms_ptr + row, tl.sum(sum_g_x, axis=0) * rstd / n_cols)
    if CENTERED:
        tl.store(terms_ptr + n_rows + row, tl.sum(sum_g, axis=0) / n_cols)


# _row_terms_kernel's leading arguments on purpose: the second pass reads the same rows and the terms it wrote.
@triton.jit
def _columns_kernel(
    dy_ptr,
    dy_row_stride,
    x_ptr,
    x_row_stride,
    w_eff_ptr,
    mean_ptr,
    rstd_ptr,
    terms_ptr,
    d_residual_ptr,
    d_residual_row_stride,
    dx_ptr,
    dx_row_stride,
    dw_partial_ptr,
    db_partial_ptr,
    n_rows,
    n_cols,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_D_RESIDUAL: tl.constexpr,
    CENTERED: tl.constexpr,
    ROUND_XHAT_FOR_DW: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SOFTWARE_BF16_ROUNDING: tl.constexpr,
):
    """dx of every row tile g, g + G, ... in column block b = program_id(0), g = program_id(1), and this
    program's dw / db partial sums of that block, stored to row g of the partial buffers."""
    group = tl.program_id(1)
    n_groups = tl.num_programs(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    if HAS_WEIGHT:
        w_eff = tl.load(w_eff_ptr + cols, mask=col_mask, other=0.0)
    else:
        w_eff = tl.full([BLOCK_N], 1.0, dtype=tl.float32)  # unused: g = dy
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    # The row-tile walk of _row_tiles_backward_kernel on purpose: its steps are _norm_utils' shared @triton.jit
    # helpers, and only the glue between them stands in both kernels.
    for tile in range(group, tl.cdiv(n_rows, BLOCK_ROWS), n_groups):
        rows = tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        rows64 = rows.to(tl.int64)
        mask = row_mask[:, None] & col_mask[None, :]
        dy, xhat, g, rstd = load_normalized_tile(
            dy_ptr, dy_row_stride, x_ptr, x_row_stride, w_eff, mean_ptr, rstd_ptr, rows, rows64, row_mask, cols,
            mask, HAS_WEIGHT, CENTERED,
        )  # fmt: skip
        mean_g_xhat = tl.load(terms_ptr + rows, mask=row_mask, other=0.0)
        inner = g - xhat * mean_g_xhat[:, None]
        if CENTERED:
            inner -= tl.load(terms_ptr + n_rows + rows, mask=row_mask, other=0.0)[:, None]
        dx = inner * rstd[:, None]
        dw_acc, db_acc = store_dx_and_accumulate(
            dx, dy, xhat, rows64, cols, mask, x_ptr, d_residual_ptr, d_residual_row_stride, dx_ptr,
            dx_row_stride, dw_acc, db_acc, HAS_WEIGHT, HAS_BIAS, HAS_D_RESIDUAL, ROUND_XHAT_FOR_DW,
            SOFTWARE_BF16_ROUNDING,
        )  # fmt: skip
    store_partial_sums(
        dw_partial_ptr, db_partial_ptr, group, cols, col_mask, n_cols, dw_acc, db_acc, HAS_WEIGHT, HAS_BIAS
    )


def launch_wide_row_backward(
    rows: BackwardRows,
    w_eff: torch.Tensor | None,
    settings: NormLaunchSettings,
    has_bias: bool = False,
    round_xhat_for_dw: bool = False,
    traced: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The two kernels over `rows`; returns (dw, db) in fp32, each None when absent.

    `w_eff`: the weight as the forward applied it, fp32 [n] (RMSNorm's offset added, rounded in llama mode).
    `settings`: the column block of both kernels, the rows of a tile of the second, its warps, and programs
    per SM (how many row groups share a column block). `traced`: launches go through wrap_triton, for the
    torch.library ops that torch.compile traces.
    """
    dy_rows, x_rows, mean, rstd, d_residual_rows, dx_rows = rows
    n_rows, n_cols = x_rows.shape
    device = x_rows.device
    centered = mean is not None
    block_n = settings.block_n
    n_col_blocks = -(-n_cols // block_n)
    n_row_tiles = -(-n_rows // settings.rows_per_tile)
    groups = max(
        1, min(n_row_tiles, -(-settings.programs_per_sm * multiprocessor_count(device) // n_col_blocks))
    )
    dw_partial, db_partial = partial_sum_buffers(groups, n_cols, w_eff is not None, has_bias, device)
    terms = torch.empty((2 if centered else 1, n_rows), dtype=torch.float32, device=device)
    wrap = functools.partial(launchable, traced=traced)
    placeholder = rstd  # for pointers a configuration does not use
    wrap(_row_terms_kernel)[(n_rows,)](
        dy_rows, dy_rows.stride(0), x_rows, x_rows.stride(0),
        w_eff if w_eff is not None else placeholder, mean if centered else placeholder, rstd, terms,
        n_rows, n_cols,
        HAS_WEIGHT=w_eff is not None, CENTERED=centered, BLOCK_N=block_n, num_warps=settings.num_warps,
    )  # fmt: skip
    d_residual = d_residual_rows if d_residual_rows is not None else dy_rows
    wrap(_columns_kernel)[(n_col_blocks, groups)](
        dy_rows, dy_rows.stride(0), x_rows, x_rows.stride(0),
        w_eff if w_eff is not None else placeholder, mean if centered else placeholder, rstd, terms,
        d_residual, d_residual.stride(0), dx_rows, dx_rows.stride(0),
        dw_partial if dw_partial is not None else placeholder,
        db_partial if db_partial is not None else placeholder,
        n_rows, n_cols,
        HAS_WEIGHT=w_eff is not None, HAS_BIAS=has_bias, HAS_D_RESIDUAL=d_residual_rows is not None,
        CENTERED=centered, ROUND_XHAT_FOR_DW=round_xhat_for_dw, BLOCK_ROWS=settings.rows_per_tile,
        BLOCK_N=block_n, SOFTWARE_BF16_ROUNDING=interpreted(), num_warps=settings.num_warps,
    )  # fmt: skip
    return summed_partials(dw_partial, db_partial)
