"""LayerNorm as Triton kernels: y = (x - mean) * rstd * w + b over the last dim, rstd = 1 / sqrt(var + eps).

Statistics and the affine step run in fp32 and the result is rounded to x's dtype, as torch's LayerNorm does
(also with fp32 parameters on bf16 activations). Weight and bias are each optional.

`inplace_backward=True` lets the backward write dx into the incoming gradient's buffer, under the conditions
spelled out in rms_norm.py: dy contiguous with x's shape and dtype, and nothing else needing dy afterwards
(which only the caller can promise). Off by default, and not used under torch.compile.
"""

import math

import torch
import triton
import triton.language as tl
from torch import nn

from fusetune.kernels._interpreter import store_rounded
from fusetune.kernels._norm_row_tiles import launch_norm_backward
from fusetune.kernels._norm_utils import (
    NormLaunchSettings,
    dx_buffer,
    forward_launcher,
    forward_rows,
    forward_tile_rows,
)

__all__ = ["FusedLayerNorm", "layer_norm", "layer_norm_reference"]


# ------------------------------------------------------------------------------------------------------------
# Triton kernels
# ------------------------------------------------------------------------------------------------------------


@triton.jit
def _scale_shift_and_store(
    y,
    weight_ptr,
    bias_ptr,
    y_rows,
    cols,
    col_mask,
    mask,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SOFTWARE_BF16_ROUNDING: tl.constexpr,
):
    """Stores `y * weight + bias` of the normalised rows `y` (fp32) for the columns `cols`, in y's dtype: the
    end of the forward both ways, a row held whole or walked block by block (inlined where it is called)."""
    if HAS_WEIGHT:
        w = tl.load(weight_ptr + cols, mask=col_mask, other=0.0, eviction_policy="evict_last")
        y = y * w.to(tl.float32)[None, :]
    if HAS_BIAS:
        b = tl.load(bias_ptr + cols, mask=col_mask, other=0.0, eviction_policy="evict_last")
        y = y + b.to(tl.float32)[None, :]
    store_rounded(y_rows + cols[None, :], y, mask, SOFTWARE_BF16_ROUNDING)


@triton.jit
def _layer_norm_fwd_kernel(
    x_ptr,
    x_row_stride,
    weight_ptr,
    bias_ptr,
    y_ptr,
    y_row_stride,
    mean_ptr,
    rstd_ptr,
    n_rows,
    n_cols,
    eps,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LOOP_COLUMNS: tl.constexpr,
    SOFTWARE_BF16_ROUNDING: tl.constexpr,
):
    """Forward of LayerNorm over a tile of BLOCK_ROWS rows; saves mean and rstd (fp32) per row.

    Rows wider than BLOCK_N are reduced block by block: each block's mean and sum of squared deviations are
    exact within the block and merged into the running ones (Chan et al.), so the variance never comes from
    the cancelling E[x^2] - E[x]^2.
    """
    rows, row_mask, rows64, cols = forward_tile_rows(n_rows, BLOCK_ROWS, BLOCK_N)
    x_rows = x_ptr + rows64[:, None] * x_row_stride
    y_rows = y_ptr + rows64[:, None] * y_row_stride

    if not LOOP_COLUMNS:
        col_mask = cols < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
        x = x.to(tl.float32)
        mean = tl.sum(x, axis=1) / n_cols
        centred = tl.where(col_mask[None, :], x - mean[:, None], 0.0)
        rstd = tl.rsqrt(tl.sum(centred * centred, axis=1) / n_cols + eps)
        y = centred * rstd[:, None]
        _scale_shift_and_store(
            y, weight_ptr, bias_ptr, y_rows, cols, col_mask, mask, HAS_WEIGHT, HAS_BIAS, SOFTWARE_BF16_ROUNDING
        )  # fmt: skip
    else:
        mean = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        m2 = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            col_mask = c < n_cols
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(x_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
            seen = start * 1.0  # columns merged so far, as fp32
            block_count = tl.minimum(n_cols - start, BLOCK_N).to(tl.float32)
            block_mean = tl.sum(x, axis=1) / block_count
            deviation = tl.where(col_mask[None, :], x - block_mean[:, None], 0.0)
            block_m2 = tl.sum(deviation * deviation, axis=1)
            total = seen + block_count
            delta = block_mean - mean
            mean += delta * (block_count / total)
            m2 += block_m2 + delta * delta * (seen * block_count / total)
        rstd = tl.rsqrt(m2 / n_cols + eps)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            col_mask = c < n_cols
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(x_rows + c[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
            y = (x.to(tl.float32) - mean[:, None]) * rstd[:, None]
            _scale_shift_and_store(
                y, weight_ptr, bias_ptr, y_rows, c, col_mask, mask, HAS_WEIGHT, HAS_BIAS, SOFTWARE_BF16_ROUNDING
            )  # fmt: skip
    tl.store(mean_ptr + rows, mean, mask=row_mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


# ------------------------------------------------------------------------------------------------------------
# Launchers
# ------------------------------------------------------------------------------------------------------------


def _launch_forward(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    settings: NormLaunchSettings | None = None,
    traced: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the forward kernel; returns (y, mean, rstd), the statistics fp32 [rows].

    `traced`: called from the torch.library op, so the launch goes through wrap_triton for the compiler.
    """
    x_rows, settings = forward_rows(x, settings)
    n_rows, n_cols = x_rows.shape
    y = x.new_empty(x.shape)
    y_rows = y.view(-1, n_cols)
    mean = x.new_empty(n_rows, dtype=torch.float32)
    rstd = x.new_empty(n_rows, dtype=torch.float32)
    if n_rows == 0:
        return y, mean, rstd
    forward_launcher(_layer_norm_fwd_kernel, settings, n_rows, traced)(
        x_rows,
        x_rows.stride(0),
        weight if weight is not None else x_rows,
        bias if bias is not None else x_rows,
        y_rows,
        y_rows.stride(0),
        mean,
        rstd,
        n_rows,
        n_cols,
        eps,
        HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None,
        **settings.forward_launch_arguments(n_cols),
    )
    return y, mean, rstd


def _launch_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    has_bias: bool,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    dx: torch.Tensor,
    settings: NormLaunchSettings | None = None,
    traced: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Run the backward kernel, writing dx (which may be dy itself); returns (dw, db), each fp32 or None."""
    return launch_norm_backward(
        dy, x, weight, mean, rstd, None, dx, settings, has_bias=has_bias, traced=traced
    )


# ------------------------------------------------------------------------------------------------------------
# torch.library ops, which torch.compile(fullgraph=True) traces through. Eager calls skip the op dispatch and
# launch directly: the dispatcher costs more CPU time per call than the kernels take on the GPU at 16k x 4k.
# ------------------------------------------------------------------------------------------------------------


@torch.library.triton_op("fusetune::layer_norm_fwd", mutates_args=())
def _layer_norm_fwd_op(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _launch_forward(x, weight, bias, eps, traced=True)


# Arguments alike in shape to the backward launchers' on purpose: a torch.library op declares its own typed schema.
@torch.library.triton_op("fusetune::layer_norm_bwd", mutates_args=())
def _layer_norm_bwd_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx = x.new_empty(x.shape)
    dw, db = _launch_backward(dy, x, weight, bias is not None, mean, rstd, dx, traced=True)
    # ops cannot return None: an empty tensor stands for a missing parameter
    dw = dw.to(weight.dtype) if weight is not None else x.new_empty(0)
    db = db.to(bias.dtype) if bias is not None else x.new_empty(0)
    return dx, dw, db


class LayerNormFunction(torch.autograd.Function):
    """Autograd for layer_norm: saves x and the fp32 mean and rstd [rows]."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, inplace_backward):
        if torch.compiler.is_compiling():
            y, mean, rstd = torch.ops.fusetune.layer_norm_fwd(x, weight, bias, eps)
        else:
            y, mean, rstd = _launch_forward(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.inplace_backward = inplace_backward
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        if torch.compiler.is_compiling():
            # functional under the compiler, which plans the buffers itself
            dx, dw, db = torch.ops.fusetune.layer_norm_bwd(dy, x, weight, bias, mean, rstd)
        else:
            dx = dx_buffer(dy, x, ctx.inplace_backward)
            dw, db = _launch_backward(dy, x, weight, bias is not None, mean, rstd, dx)
            dw = dw.to(weight.dtype) if weight is not None else None
            db = db.to(bias.dtype) if bias is not None else None
        return dx, dw if weight is not None else None, db if bias is not None else None, None, None


# ------------------------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------------------------


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    inplace_backward: bool = False,
) -> torch.Tensor:
    """LayerNorm over the last dim, computed in fp32 and returned in x's dtype (as torch's LayerNorm)."""
    if not x.is_floating_point():
        raise TypeError(f"layer_norm: x must be a floating-point tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("layer_norm: x must have at least one dimension (the normalised one)")
    for name, parameter in (("weight", weight), ("bias", bias)):
        if parameter is not None and parameter.shape != (x.shape[-1],):
            raise ValueError(
                f"layer_norm: {name} must have shape ({x.shape[-1]},) (x's last dim), "
                f"got {tuple(parameter.shape)}"
            )
    return LayerNormFunction.apply(x, weight, bias, float(eps), inplace_backward)


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float = 1e-5
) -> torch.Tensor:
    """Pure-PyTorch LayerNorm in fp32 (gradients included), rounded to x's dtype at the end."""
    x32 = x.to(torch.float32)
    centred = x32 - x32.mean(-1, keepdim=True)
    y = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(torch.float32)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


class FusedLayerNorm(nn.Module):
    """Drop-in for torch.nn.LayerNorm: the same constructor, parameters and state_dict keys."""

    def __init__(
        self,
        normalized_shape: int | tuple[int, ...] | list[int] | torch.Size,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        inplace_backward: bool = False,
    ) -> None:
        super().__init__()
        if isinstance(normalized_shape, int):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.inplace_backward = inplace_backward
        factory = {"device": device, "dtype": dtype}
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape, **factory))
        else:
            self.register_parameter("weight", None)
        if elementwise_affine and bias:
            self.bias = nn.Parameter(torch.empty(self.normalized_shape, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n_dims = len(self.normalized_shape)
        if tuple(x.shape[x.dim() - n_dims :]) != self.normalized_shape:
            raise ValueError(
                f"FusedLayerNorm: input's trailing dims {tuple(x.shape[x.dim() - n_dims :])} do not match "
                f"normalized_shape {self.normalized_shape}"
            )
        width = math.prod(self.normalized_shape)
        # normalising over several trailing dims is normalising over their flattening
        flat = x.reshape(*x.shape[: x.dim() - n_dims], width) if n_dims != 1 else x
        weight = self.weight.reshape(width) if self.weight is not None else None
        bias = self.bias.reshape(width) if self.bias is not None else None
        y = layer_norm(flat, weight, bias, self.eps, self.inplace_backward)
        return y.reshape(x.shape) if n_dims != 1 else y

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
