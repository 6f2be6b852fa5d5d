"""RMSNorm and fused residual-add + RMSNorm as Triton kernels.

    y = x * rstd * (offset + w),   rstd = 1 / sqrt(mean(x^2) + eps)

Two casting modes mirror the Hugging Face classes exactly:

- "llama" (LlamaRMSNorm): rstd and the normalised row in fp32, the normalised row cast to the input dtype,
  then multiplied by the weight; the result has the promoted dtype of input and weight (fp32 weights on bf16
  activations give an fp32 output, as in HF).
- "gemma" (GemmaRMSNorm, offset 1.0): everything in fp32, `(x * rstd) * (offset + w.float())`, cast to the
  input dtype at the end.

`add_rms_norm(x, residual, ...)` returns `(rms_norm(x + residual), x + residual)` from one pass over memory,
and its backward adds the gradient of the new residual stream (arriving from later layers) to the gradient
through the norm in the same pass.

In-place backward: with `inplace_backward=True` the backward writes dx into the buffer of the incoming
gradient dy instead of allocating one. That is only done when dy is contiguous, has the shape and dtype of
the input, and the caller guarantees that nothing else needs dy once the norm's backward has run. Only the
caller can know: autograd hands the *same* gradient tensor to both inputs of an addition, so a norm whose
output is added to another tensor (Gemma-2/3 post-norms: `residual + post_norm(h)`) must not use it, while a
norm feeding only matmuls (the pre-norms of Llama-style layers, the final norm) can. It is off by default.
Under torch.compile the functional backward op is traced instead, and the compiler plans the buffers.
"""

import torch
import triton
import triton.language as tl
from torch import nn

from fusetune.kernels._interpreter import round_to_dtype, store_rounded
from fusetune.kernels._norm_row_tiles import _effective_weight, launch_norm_backward
from fusetune.kernels._norm_utils import (
    NormLaunchSettings,
    as_rows,
    check_casting_mode,
    dx_buffer,
    forward_launcher,
    forward_rows,
    forward_tile_rows,
)

__all__ = [
    "FusedRMSNorm",
    "add_rms_norm",
    "add_rms_norm_reference",
    "rms_norm",
    "rms_norm_reference",
]


# ------------------------------------------------------------------------------------------------------------
# Triton kernels
# ------------------------------------------------------------------------------------------------------------


@triton.jit
def _scale_by_weight(
    xhat,
    w,
    offset,
    INPUT_DTYPE: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr,
    SOFTWARE_BF16_ROUNDING: tl.constexpr,
):
    """Apply the affine weight to an fp32 normalised tile in the chosen casting mode (fp32 result)."""
    w_eff = _effective_weight(w, offset, CAST_BEFORE_WEIGHT, SOFTWARE_BF16_ROUNDING)
    if CAST_BEFORE_WEIGHT:
        # llama: the normalised row is rounded to the input dtype before the weight multiplies it
        xhat = round_to_dtype(xhat, INPUT_DTYPE, SOFTWARE_BF16_ROUNDING).to(tl.float32)
    return xhat * w_eff


@triton.jit
def _weigh_and_store(
    xhat,
    weight_ptr,
    y_rows,
    cols,
    n_cols,
    mask,
    offset,
    INPUT_DTYPE: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr,
    SOFTWARE_BF16_ROUNDING: tl.constexpr,
):
    """Stores the normalised rows `xhat` (fp32) of the columns `cols`, times the weight if there is one, in y's
    dtype: the end of the forward both ways, a row held whole or walked block by block (inlined where called)."""
    if HAS_WEIGHT:
        w = tl.load(weight_ptr + cols, mask=cols < n_cols, other=0.0, eviction_policy="evict_last")
        y = _scale_by_weight(
            xhat, w[None, :], offset, INPUT_DTYPE, CAST_BEFORE_WEIGHT, SOFTWARE_BF16_ROUNDING
        )
    else:
        y = xhat
    store_rounded(y_rows + cols[None, :], y, mask, SOFTWARE_BF16_ROUNDING)


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr,
    x_row_stride,
    residual_ptr,
    residual_row_stride,
    new_residual_ptr,
    new_residual_row_stride,
    weight_ptr,
    y_ptr,
    y_row_stride,
    rstd_ptr,
    n_rows,
    n_cols,
    eps,
    offset,
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LOOP_COLUMNS: tl.constexpr,
    SOFTWARE_BF16_ROUNDING: tl.constexpr,
):
    """Forward of (add +) RMSNorm over a tile of BLOCK_ROWS rows.

    With HAS_RESIDUAL the normalised row is h = round(x + residual), which is also stored as the new residual.
    Saves rstd (fp32, one per row) for the backward.
    """
    input_dtype = x_ptr.dtype.element_ty
    rows, row_mask, rows64, cols = forward_tile_rows(n_rows, BLOCK_ROWS, BLOCK_N)
    x_rows = x_ptr + rows64[:, None] * x_row_stride
    y_rows = y_ptr + rows64[:, None] * y_row_stride
    residual_rows = residual_ptr + rows64[:, None] * residual_row_stride
    new_residual_rows = new_residual_ptr + rows64[:, None] * new_residual_row_stride

    if not LOOP_COLUMNS:
        mask = row_mask[:, None] & (cols[None, :] < n_cols)
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
        x = x.to(tl.float32)
        if HAS_RESIDUAL:
            residual = tl.load(
                residual_rows + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_first"
            )
            h = round_to_dtype(x + residual.to(tl.float32), input_dtype, SOFTWARE_BF16_ROUNDING)
            tl.store(new_residual_rows + cols[None, :], h, mask=mask)
            x = h.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)
        xhat = x * rstd[:, None]
        _weigh_and_store(
            xhat, weight_ptr, y_rows, cols, n_cols, mask, offset, input_dtype,
            HAS_WEIGHT, CAST_BEFORE_WEIGHT, SOFTWARE_BF16_ROUNDING,
        )  # fmt: skip
    else:
        # Pass 1: sum of squares (and the new residual); pass 2 re-reads the row, now in L2, and normalises.
        sum_sq = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            mask = row_mask[:, None] & (c[None, :] < n_cols)
            x = tl.load(x_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                residual = tl.load(residual_rows + c[None, :], mask=mask, other=0.0)
                h = round_to_dtype(x + residual.to(tl.float32), input_dtype, SOFTWARE_BF16_ROUNDING)
                tl.store(new_residual_rows + c[None, :], h, mask=mask)
                x = h.to(tl.float32)
            sum_sq += tl.sum(x * x, axis=1)
        rstd = tl.rsqrt(sum_sq / n_cols + eps)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)
        if HAS_RESIDUAL:
            # the new residual written above is read back by other threads of this program
            tl.debug_barrier()
            source_rows = new_residual_rows
        else:
            source_rows = x_rows
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            mask = row_mask[:, None] & (c[None, :] < n_cols)
            x = tl.load(source_rows + c[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
            xhat = x.to(tl.float32) * rstd[:, None]
            _weigh_and_store(
                xhat, weight_ptr, y_rows, c, n_cols, mask, offset, input_dtype,
                HAS_WEIGHT, CAST_BEFORE_WEIGHT, SOFTWARE_BF16_ROUNDING,
            )  # fmt: skip


# ------------------------------------------------------------------------------------------------------------
# Launchers
# ------------------------------------------------------------------------------------------------------------


def _output_dtype(x: torch.Tensor, weight: torch.Tensor | None, casting_mode: str) -> torch.dtype:
    if weight is not None and casting_mode == "llama":
        return torch.promote_types(x.dtype, weight.dtype)
    return x.dtype


def _launch_forward(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
    offset: float,
    casting_mode: str,
    settings: NormLaunchSettings | None = None,
    traced: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Run the forward kernel; returns (y, new_residual or None, rstd [rows] fp32).

    `traced`: called from the torch.library op, so the launch goes through wrap_triton for the compiler.
    """
    x_rows, settings = forward_rows(x, settings)
    n_rows, n_cols = x_rows.shape
    y = x.new_empty(x.shape, dtype=_output_dtype(x, weight, casting_mode))
    y_rows = y.view(-1, n_cols)
    rstd = x.new_empty(n_rows, dtype=torch.float32)
    if residual is not None:
        residual_rows = as_rows(residual, n_cols)
        new_residual = x.new_empty(x.shape)
        new_residual_rows = new_residual.view(-1, n_cols)
    else:
        residual_rows = new_residual_rows = x_rows  # unused by the kernel
        new_residual = None
    if n_rows == 0:
        return y, new_residual, rstd
    forward_launcher(_rms_norm_fwd_kernel, settings, n_rows, traced)(
        x_rows,
        x_rows.stride(0),
        residual_rows,
        residual_rows.stride(0),
        new_residual_rows,
        new_residual_rows.stride(0),
        weight if weight is not None else x_rows,
        y_rows,
        y_rows.stride(0),
        rstd,
        n_rows,
        n_cols,
        eps,
        offset,
        HAS_RESIDUAL=residual is not None,
        HAS_WEIGHT=weight is not None,
        CAST_BEFORE_WEIGHT=casting_mode == "llama",
        **settings.forward_launch_arguments(n_cols),
    )
    return y, new_residual, rstd


def _launch_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    d_residual: torch.Tensor | None,
    offset: float,
    casting_mode: str,
    dx: torch.Tensor,
    settings: NormLaunchSettings | None = None,
    traced: bool = False,
) -> torch.Tensor | None:
    """Run the backward kernel, writing dx (which may be dy itself); returns dw or None."""
    dw, _ = launch_norm_backward(
        dy, x, weight, None, rstd, d_residual, dx, settings, offset=offset,
        cast_before_weight=casting_mode == "llama", traced=traced,
    )  # fmt: skip
    return dw.to(weight.dtype) if weight is not None else None


# ------------------------------------------------------------------------------------------------------------
# torch.library ops, which torch.compile(fullgraph=True) traces through. Eager calls skip the op dispatch and
# launch directly: the dispatcher costs more CPU time per call than the kernels take on the GPU at 16k x 4k.
# ------------------------------------------------------------------------------------------------------------


@torch.library.triton_op("fusetune::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd_op(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, casting_mode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    y, _, rstd = _launch_forward(x, None, weight, eps, offset, casting_mode, traced=True)
    return y, rstd


@torch.library.triton_op("fusetune::add_rms_norm_fwd", mutates_args=())
def _add_rms_norm_fwd_op(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    offset: float,
    casting_mode: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, new_residual, rstd = _launch_forward(x, residual, weight, eps, offset, casting_mode, traced=True)
    assert new_residual is not None
    return y, new_residual, rstd


# _launch_backward's arguments again on purpose: a torch.library op declares its own typed schema.
@torch.library.triton_op("fusetune::rms_norm_bwd", mutates_args=())
def _rms_norm_bwd_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    d_residual: torch.Tensor | None,
    offset: float,
    casting_mode: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    dx = x.new_empty(x.shape)
    dw = _launch_backward(dy, x, weight, rstd, d_residual, offset, casting_mode, dx, traced=True)
    # ops cannot return None: an empty tensor stands for "no weight"
    return dx, dw if dw is not None else x.new_empty(0)


# _forward and _backward take the launchers' arguments on purpose: each calls the op under the compiler and the
# launcher in eager code.
def _forward(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
    offset: float,
    casting_mode: str,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    if not torch.compiler.is_compiling():
        return _launch_forward(x, residual, weight, eps, offset, casting_mode)
    if residual is None:
        y, rstd = torch.ops.fusetune.rms_norm_fwd(x, weight, eps, offset, casting_mode)
        return y, None, rstd
    return torch.ops.fusetune.add_rms_norm_fwd(x, residual, weight, eps, offset, casting_mode)


def _backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    d_residual: torch.Tensor | None,
    offset: float,
    casting_mode: str,
    inplace_backward: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if torch.compiler.is_compiling():
        # functional under the compiler, which plans the buffers itself
        dx, dw = torch.ops.fusetune.rms_norm_bwd(dy, x, weight, rstd, d_residual, offset, casting_mode)
        return dx, dw if weight is not None else None
    # The in-place condition of the module docstring (dx_buffer); `inplace_backward` is the caller's promise.
    dx = dx_buffer(dy, x, inplace_backward)
    return dx, _launch_backward(dy, x, weight, rstd, d_residual, offset, casting_mode, dx)


class RMSNormFunction(torch.autograd.Function):
    """Autograd for rms_norm: saves x and the fp32 rstd [rows]; the backward kernel recomputes xhat."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset, casting_mode, inplace_backward):
        y, _, rstd = _forward(x, None, weight, eps, offset, casting_mode)
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset = offset
        ctx.casting_mode = casting_mode
        ctx.inplace_backward = inplace_backward
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = _backward(dy, x, weight, rstd, None, ctx.offset, ctx.casting_mode, ctx.inplace_backward)
        return dx, dw, None, None, None, None


class AddRMSNormFunction(torch.autograd.Function):
    """Autograd for add_rms_norm: saves the new residual h (an output anyway) and rstd."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, offset, casting_mode, inplace_backward):
        y, new_residual, rstd = _forward(x, residual, weight, eps, offset, casting_mode)
        ctx.save_for_backward(new_residual, weight, rstd)
        ctx.offset = offset
        ctx.casting_mode = casting_mode
        ctx.inplace_backward = inplace_backward
        return y, new_residual

    @staticmethod
    def backward(ctx, dy, d_new_residual):
        new_residual, weight, rstd = ctx.saved_tensors
        dh, dw = _backward(
            dy, new_residual, weight, rstd, d_new_residual, ctx.offset, ctx.casting_mode, ctx.inplace_backward
        )
        # h = x + residual: both inputs receive dh
        return dh, dh, dw, None, None, None, None


# ------------------------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------------------------


def _check_arguments(x: torch.Tensor, weight: torch.Tensor | None, offset: float, casting_mode: str) -> None:
    check_casting_mode(casting_mode)
    if not x.is_floating_point():
        raise TypeError(f"rms_norm: x must be a floating-point tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("rms_norm: x must have at least one dimension (the hidden size)")
    if weight is None:
        if offset != 0.0:
            raise ValueError(
                "rms_norm: offset is added to the weight, so it needs a weight (got weight=None)"
            )
    elif weight.shape != (x.shape[-1],):
        raise ValueError(
            f"rms_norm: weight must have shape ({x.shape[-1]},) (x's last dim), got {tuple(weight.shape)}"
        )


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting_mode: str = "llama",
    inplace_backward: bool = False,
) -> torch.Tensor:
    """RMSNorm over the last dim: x * rsqrt(mean(x^2) + eps) * (offset + weight).

    `casting_mode` "llama" matches HF LlamaRMSNorm (output dtype promoted from x and weight), "gemma" matches
    HF GemmaRMSNorm (fp32 throughout, output in x's dtype; use offset=1.0). `inplace_backward`: see the module
    docstring for when dx may overwrite the incoming gradient.
    """
    _check_arguments(x, weight, offset, casting_mode)
    return RMSNormFunction.apply(x, weight, float(eps), float(offset), casting_mode, inplace_backward)


# rms_norm's arguments and the residual on purpose: the same norm with the residual add fused in front of it.
def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting_mode: str = "llama",
    inplace_backward: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass; the sum is rounded to x's dtype before the norm."""
    _check_arguments(x, weight, offset, casting_mode)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            "add_rms_norm: residual must match x in shape and dtype, got "
            f"{tuple(residual.shape)} {residual.dtype} for x {tuple(x.shape)} {x.dtype}"
        )
    return AddRMSNormFunction.apply(
        x, residual, weight, float(eps), float(offset), casting_mode, inplace_backward
    )


# Mirrors rms_norm argument for argument on purpose: tests call both with the same arguments.
def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting_mode: str = "llama",
    input_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Pure-PyTorch RMSNorm with the forward values of the HF classes, differentiable by autograd.

    The forward rounds exactly where LlamaRMSNorm / GemmaRMSNorm round. The backward runs in fp32 up to the
    inputs: the llama-mode rounding of the normalised row is applied as `a + (round(a) - a).detach()` (the
    same value, a straight-through gradient), and the weight product is done in fp32 on the rounded operands
    (the same value as HF's product in the low-precision dtype). So on bf16/fp16 inputs its gradients carry
    only the final rounding to the input dtype, which makes it a sharp reference for the kernels.

    `input_dtype` (default x.dtype) is the dtype the row stands for when x is an fp32 stand-in for it.
    """
    check_casting_mode(casting_mode)
    input_dtype = input_dtype or x.dtype
    x32 = x.to(torch.float32)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if casting_mode == "gemma":
        if weight is not None:
            normed = normed * (offset + weight.float())
        return normed.to(input_dtype)
    normed = normed + (normed.to(input_dtype).to(torch.float32) - normed).detach()
    if weight is None:
        return normed.to(input_dtype)
    output_dtype = torch.promote_types(input_dtype, weight.dtype)
    return ((offset + weight).to(torch.float32) * normed).to(output_dtype)


# Mirrors add_rms_norm argument for argument on purpose: tests call both with the same arguments.
def add_rms_norm_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting_mode: str = "llama",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-PyTorch add + RMSNorm: `new_residual = x + residual` in x's dtype, then rms_norm_reference.

    The sum is formed in fp32 and rounded once (the value of the low-precision add); the norm reads it through
    a straight-through rounding so the gradient from the norm and the one of the new residual meet in fp32.
    """
    sum32 = x.to(torch.float32) + residual.to(torch.float32)
    new_residual = sum32.to(x.dtype)
    norm_input = sum32 + (new_residual.to(torch.float32) - sum32).detach()
    normed = rms_norm_reference(norm_input, weight, eps, offset, casting_mode, input_dtype=x.dtype)
    return normed, new_residual


class FusedRMSNorm(nn.Module):
    """Drop-in for HF LlamaRMSNorm (defaults) and GemmaRMSNorm (offset=1.0, casting_mode="gemma",
    init_ones=False): same `weight` parameter and state_dict, same outputs and output dtypes."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        offset: float = 0.0,
        casting_mode: str = "llama",
        init_ones: bool = True,
        inplace_backward: bool = False,
    ) -> None:
        super().__init__()
        check_casting_mode(casting_mode)
        self.weight = nn.Parameter(torch.ones(hidden_size) if init_ones else torch.zeros(hidden_size))
        self.variance_epsilon = eps
        self.offset = offset
        self.casting_mode = casting_mode
        self.inplace_backward = inplace_backward

    @property
    def eps(self) -> float:
        """GemmaRMSNorm's name for variance_epsilon."""
        return self.variance_epsilon

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(
            hidden_states,
            self.weight,
            self.variance_epsilon,
            self.offset,
            self.casting_mode,
            self.inplace_backward,
        )

    def forward_with_residual(
        self, hidden_states: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(hidden_states + residual), hidden_states + residual) through the fused kernel."""
        return add_rms_norm(
            hidden_states,
            residual,
            self.weight,
            self.variance_epsilon,
            self.offset,
            self.casting_mode,
            self.inplace_backward,
        )

    def extra_repr(self) -> str:
        return (
            f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, offset={self.offset}, "
            f"casting_mode={self.casting_mode!r}"
        )
