"""Backward of RMSNorm and LayerNorm for rows that fit in registers (rows wider than that take
_norm_wide_rows.py): one persistent kernel, each program walking row tiles pid, pid + P, pid + 2P, ...

Both norms share the same form. With xhat = (x - mean) * rstd (mean = 0 for RMSNorm, CENTERED off), the weight
as the forward applied it w_eff = offset + w (RMSNorm's llama mode: rounded to the weight's dtype first, as
HF's ``(offset + weight)`` is), g = dy * w_eff (g = dy without a weight) and n the row width, per row:

    dx = rstd * (g - mean(g) - xhat * mean(g * xhat))     (RMSNorm: no mean(g) term), + d_residual
    dw = sum over rows of dy * xhat   (RMSNorm llama mode: xhat rounded to the input dtype first, since that
                                       rounded value is what multiplied w)
    db = sum over rows of dy

The rounding of xhat in llama mode has zero derivative almost everywhere and is passed straight through, as
autograd does. For RMSNorm's fused add the normalised row is the new residual h = x + residual, and the
gradient reaching both x and residual is dh = dx_from_norm + d_new_residual (HAS_D_RESIDUAL). Masked columns
load dy = 0, so g and every product with it vanish there without a select. Each program accumulates dw and db
over its rows in fp32 and stores one row of dw_partial / db_partial [P, n]; the launcher sums the P rows.

`launch_norm_backward` is the entry both norms call: it hands rows wider than registers hold to
_norm_wide_rows.py, with the effective weight computed once on the host for its two kernels.
"""

import torch
import triton
import triton.language as tl

from fusetune.kernels._interpreter import interpreted, launchable, round_to_dtype
from fusetune.kernels._norm_utils import (
    BackwardRows,
    NormLaunchSettings,
    as_rows,
    load_normalized_tile,
    norm_launch_settings,
    partial_sum_buffers,
    persistent_grid_size,
    store_dx_and_accumulate,
    store_partial_sums,
    summed_partials,
)
from fusetune.kernels._norm_wide_rows import launch_wide_row_backward

__all__ = ["launch_norm_backward"]


@triton.jit
def _effective_weight(w, offset, CAST_BEFORE_WEIGHT: tl.constexpr, SOFTWARE_BF16_ROUNDING: tl.constexpr):
    """offset + w in fp32; in llama mode rounded to the weight dtype first, as HF's `(offset + weight)` is."""
    w_eff = w.to(tl.float32) + offset
    if CAST_BEFORE_WEIGHT:
        w_eff = round_to_dtype(w_eff, w.dtype, SOFTWARE_BF16_ROUNDING).to(tl.float32)
    return w_eff


@triton.jit
def _row_tiles_backward_kernel(
    dy_ptr,
    dy_row_stride,
    x_ptr,
    x_row_stride,
    weight_ptr,
    mean_ptr,
    rstd_ptr,
    d_residual_ptr,
    d_residual_row_stride,
    dx_ptr,
    dx_row_stride,
    dw_partial_ptr,
    db_partial_ptr,
    n_rows,
    n_cols,
    offset,
    CENTERED: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_D_RESIDUAL: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    SOFTWARE_BF16_ROUNDING: tl.constexpr,
):
    """dx of every row tile of this program, and its dw / db partial sums (see the module docstring)."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    n_row_tiles = tl.cdiv(n_rows, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    if HAS_WEIGHT:
        w = tl.load(weight_ptr + cols, mask=col_mask, other=0.0)
        w_eff = _effective_weight(w, offset, CAST_BEFORE_WEIGHT, SOFTWARE_BF16_ROUNDING)
    else:
        w_eff = tl.full([BLOCK_N], 1.0, dtype=tl.float32)  # unused: g = dy
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for tile in tl.range(pid, n_row_tiles, num_programs, num_stages=NUM_STAGES):
        rows = tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        rows64 = rows.to(tl.int64)
        mask = row_mask[:, None] & col_mask[None, :]
        dy, xhat, g, rstd = load_normalized_tile(
            dy_ptr, dy_row_stride, x_ptr, x_row_stride, w_eff, mean_ptr, rstd_ptr, rows, rows64, row_mask, cols,
            mask, HAS_WEIGHT, CENTERED,
        )  # fmt: skip
        mean_g_xhat = tl.sum(g * xhat, axis=1) / n_cols
        if CENTERED:
            mean_g = tl.sum(g, axis=1) / n_cols
            dx = (g - mean_g[:, None] - xhat * mean_g_xhat[:, None]) * rstd[:, None]
        else:
            dx = (g - xhat * mean_g_xhat[:, None]) * rstd[:, None]
        dw_acc, db_acc = store_dx_and_accumulate(
            dx, dy, xhat, rows64, cols, mask, x_ptr, d_residual_ptr, d_residual_row_stride, dx_ptr,
            dx_row_stride, dw_acc, db_acc, HAS_WEIGHT, HAS_BIAS, HAS_D_RESIDUAL, CAST_BEFORE_WEIGHT,
            SOFTWARE_BF16_ROUNDING,
        )  # fmt: skip
    store_partial_sums(
        dw_partial_ptr, db_partial_ptr, pid, cols, col_mask, n_cols, dw_acc, db_acc, HAS_WEIGHT, HAS_BIAS
    )


def launch_row_tile_backward(
    rows: BackwardRows,
    weight: torch.Tensor | None,
    settings: NormLaunchSettings,
    *,
    has_bias: bool = False,
    offset: float = 0.0,
    cast_before_weight: bool = False,
    traced: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The kernel over `rows`; returns (dw, db) in fp32, each None when absent.

    `weight`: the norm's weight as stored (the kernel adds `offset` and, with `cast_before_weight`, rounds as
    the forward did). `traced`: the launch goes through wrap_triton, for the torch.library ops that
    torch.compile traces.
    """
    dy_rows, x_rows, mean, rstd, d_residual_rows, dx_rows = rows
    n_rows, n_cols = x_rows.shape
    device = x_rows.device
    n_row_tiles = -(-n_rows // settings.rows_per_tile)
    num_programs = persistent_grid_size(n_row_tiles, settings, device)
    dw_partial, db_partial = partial_sum_buffers(num_programs, n_cols, weight is not None, has_bias, device)
    kernel = launchable(_row_tiles_backward_kernel, traced)
    placeholder = rstd  # for pointers a configuration does not use
    d_residual = d_residual_rows if d_residual_rows is not None else dy_rows
    kernel[(num_programs,)](
        dy_rows, dy_rows.stride(0), x_rows, x_rows.stride(0),
        weight if weight is not None else placeholder, mean if mean is not None else placeholder, rstd,
        d_residual, d_residual.stride(0), dx_rows, dx_rows.stride(0),
        dw_partial if dw_partial is not None else placeholder,
        db_partial if db_partial is not None else placeholder,
        n_rows, n_cols, offset,
        CENTERED=mean is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=has_bias,
        HAS_D_RESIDUAL=d_residual_rows is not None, CAST_BEFORE_WEIGHT=cast_before_weight,
        BLOCK_ROWS=settings.rows_per_tile, BLOCK_N=settings.block_n, NUM_STAGES=settings.num_stages,
        SOFTWARE_BF16_ROUNDING=interpreted(), num_warps=settings.num_warps,
    )  # fmt: skip
    return summed_partials(dw_partial, db_partial)


def launch_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    d_residual: torch.Tensor | None,
    dx: torch.Tensor,
    settings: NormLaunchSettings | None = None,
    *,
    has_bias: bool = False,
    offset: float = 0.0,
    cast_before_weight: bool = False,
    traced: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Backward of either norm over [..., n] tensors, writing dx (which may be dy itself): the row-tile kernel,
    or the wide-row kernels where `settings` loop over columns. Returns (dw, db) in fp32, each None when absent.
    The tensors as :class:`BackwardRows` says, over [..., n]; the options as for
    :func:`launch_row_tile_backward`."""
    n_cols = x.shape[-1]
    d_residual_rows = as_rows(d_residual, n_cols) if d_residual is not None else None
    rows = BackwardRows(
        as_rows(dy, n_cols), as_rows(x, n_cols), mean, rstd, d_residual_rows, dx.view(-1, n_cols)
    )
    if rows.x.shape[0] == 0:  # no rows: zero sums, no launch
        zeros = torch.zeros(n_cols, dtype=torch.float32, device=x.device)
        return (zeros if weight is not None else None), (zeros.clone() if has_bias else None)
    if settings is None:
        settings = norm_launch_settings(n_cols, backward=True)
    if not settings.loop_columns(n_cols):
        return launch_row_tile_backward(
            rows, weight, settings, has_bias=has_bias, offset=offset, cast_before_weight=cast_before_weight,
            traced=traced,
        )  # fmt: skip
    w_eff = None
    if weight is not None:
        # offset + w as the forward applied it (_effective_weight): rounded to the weight dtype in llama mode
        w_eff = weight.float()
        if offset:
            w_eff = w_eff + offset
        if cast_before_weight:
            w_eff = w_eff.to(weight.dtype).float()
    return launch_wide_row_backward(
        rows, w_eff, settings, has_bias=has_bias, round_xhat_for_dw=cast_before_weight, traced=traced
    )
