"""Gated activations ``act(a) * b`` (SwiGLU: silu, GeGLU: gelu tanh or exact) and the gated MLP modules.

The forward computes the activation in fp32 and rounds the product once. The backward recomputes the
activation from the saved ``a`` and writes the two input gradients over the saved ``a`` and ``b`` buffers, so
a gated MLP keeps nothing beyond the two projection outputs. Writing over them is done only when ``a`` and
``b`` are intermediates of the autograd graph (not leaves) that do not share memory; their version counters
are bumped afterwards, so any other user that saved them for its own backward fails loudly instead of reading
gradients. Under ``torch.compile`` the product is left to Inductor, which fuses it as these kernels do and
plans the memory (see ``_gated_activation``).

``FusedSwiGLUMLP`` / ``FusedGeGLUMLP`` replace transformers' LlamaMLP / GemmaMLP. Their forward and backward run
as one autograd node that saves only x, the weights, and the gate and up projections (the product
``act(gate) * up`` that down_proj needs for its weight gradient is recomputed). Backward, in order:

    grad_hidden = grad_out @ W_down                        (the only new [tokens, intermediate] buffer)
    one kernel: gate <- d gate, up <- d up, grad_hidden <- act(gate) * up
    dW_down = grad_out^T @ hidden;  hidden is then freed
    dx = d gate @ W_gate (+)= d up @ W_up;  dW_gate = d gate^T @ x;  dW_up = d up^T @ x
    (gate and up are freed as soon as their last product is queued)

so the peak of a forward+backward holds three [tokens, intermediate] buffers where a plain autograd graph holds
four or more.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

import fusetune.kernels.rms_norm as _rms_norm
from fusetune.kernels._interpreter import interpreted, round_to_dtype
from fusetune.kernels._tensors import storage_overlaps

__all__ = [
    "FusedGeGLUMLP",
    "FusedSwiGLUMLP",
    "GatedLaunchSettings",
    "add_rms_norm_gated_mlp",
    "gated_mlp",
    "gated_activation",
    "gated_launch_settings",
    "geglu",
    "geglu_reference",
    "swiglu",
    "swiglu_reference",
]

# Activation codes shared by the Python side and the kernels.
_SILU, _GELU_TANH, _GELU_ERF = 0, 1, 2
_ACTIVATION_CODES = {"silu": _SILU, "gelu_tanh": _GELU_TANH, "gelu": _GELU_ERF}


# ----------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _activation_and_slope(a, ACTIVATION: tl.constexpr):
    """act(a) and act'(a) in fp32."""
    if ACTIVATION == 0:
        # silu(a) = a * sigmoid(a);  silu'(a) = sigmoid(a) * (1 + a * (1 - sigmoid(a)))
        sig = tl.sigmoid(a)
        act = a * sig
        slope = sig * (1.0 + a * (1.0 - sig))
    elif ACTIVATION == 1:
        # gelu_tanh(a) = a/2 * (1 + tanh(u)),  u = sqrt(2/pi) * (a + 0.044715 a^3)
        # slope = (1 + tanh(u))/2 + a/2 * (1 - tanh(u)^2) * sqrt(2/pi) * (1 + 3 * 0.044715 a^2)
        u = 0.7978845608028654 * (a + 0.044715 * a * a * a)
        tanh_u = 2.0 * tl.sigmoid(2.0 * u) - 1.0
        act = 0.5 * a * (1.0 + tanh_u)
        slope = 0.5 * (1.0 + tanh_u) + 0.5 * a * (1.0 - tanh_u * tanh_u) * 0.7978845608028654 * (
            1.0 + 0.134145 * a * a
        )
    else:
        # gelu(a) = a * Phi(a);  gelu'(a) = Phi(a) + a * phi(a)  (Phi, phi: standard normal cdf and pdf)
        cdf = 0.5 * (1.0 + tl.erf(a * 0.7071067811865476))
        act = a * cdf
        slope = cdf + a * tl.exp(-0.5 * a * a) * 0.3989422804014327
    return act, slope


@triton.jit
def _gated_forward_kernel(
    a_ptr,
    b_ptr,
    out_ptr,
    n_cols,
    n_col_blocks,
    stride_a_row,
    stride_b_row,
    stride_out_row,
    ACTIVATION: tl.constexpr,
    BLOCK: tl.constexpr,
    SOFTWARE_BF16_ROUNDING: tl.constexpr,
):
    """out = act(a) * b, over [rows, n_cols] with unit column stride. Grid: rows * n_col_blocks programs."""
    pid = tl.program_id(0).to(tl.int64)
    row = pid // n_col_blocks
    cols = (pid % n_col_blocks) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    a = tl.load(a_ptr + row * stride_a_row + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + row * stride_b_row + cols, mask=mask, other=0.0).to(tl.float32)
    act, _ = _activation_and_slope(a, ACTIVATION)
    tl.store(
        out_ptr + row * stride_out_row + cols,
        round_to_dtype(act * b, out_ptr.dtype.element_ty, SOFTWARE_BF16_ROUNDING),
        mask=mask,
    )


@triton.jit
def _gated_backward_kernel(
    grad_ptr,
    a_ptr,
    b_ptr,
    grad_a_ptr,
    grad_b_ptr,
    hidden_ptr,
    n_cols,
    n_col_blocks,
    stride_grad_row,
    stride_a_row,
    stride_b_row,
    stride_grad_a_row,
    stride_grad_b_row,
    stride_hidden_row,
    ACTIVATION: tl.constexpr,
    STORE_HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    SOFTWARE_BF16_ROUNDING: tl.constexpr,
):
    """For out = act(a) * b and incoming g = d loss / d out:

        d a = g * b * act'(a)
        d b = g * act(a)
        hidden = act(a) * b            (only with STORE_HIDDEN: the forward product, recomputed)

    act(a) and act'(a) are recomputed from a. grad_a/grad_b may be a/b themselves and hidden may be grad:
    every element is read before it is written, by the same program.
    """
    # The forward kernel's row and column setup on purpose: four lines each kernel keeps in view, its own mask
    # the one tests/kernels/test_swiglu.py mutates.
    pid = tl.program_id(0).to(tl.int64)
    row = pid // n_col_blocks
    cols = (pid % n_col_blocks) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    grad = tl.load(grad_ptr + row * stride_grad_row + cols, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + row * stride_a_row + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + row * stride_b_row + cols, mask=mask, other=0.0).to(tl.float32)
    act, slope = _activation_and_slope(a, ACTIVATION)
    tl.store(
        grad_a_ptr + row * stride_grad_a_row + cols,
        round_to_dtype(grad * b * slope, grad_a_ptr.dtype.element_ty, SOFTWARE_BF16_ROUNDING),
        mask=mask,
    )
    tl.store(
        grad_b_ptr + row * stride_grad_b_row + cols,
        round_to_dtype(grad * act, grad_b_ptr.dtype.element_ty, SOFTWARE_BF16_ROUNDING),
        mask=mask,
    )
    if STORE_HIDDEN:
        tl.store(
            hidden_ptr + row * stride_hidden_row + cols,
            round_to_dtype(act * b, hidden_ptr.dtype.element_ty, SOFTWARE_BF16_ROUNDING),
            mask=mask,
        )


# ----------------------------------------------------------------------------------------------------------
# Launch settings and launchers
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GatedLaunchSettings:
    block: int
    num_warps: int


def gated_launch_settings(n_cols: int) -> GatedLaunchSettings:
    """Elements per program and warps for the elementwise kernels.

    H100, T=8192, I=14336, bf16 (.scratch/bench_rope_swiglu.py, 2026-11-22), fwd / bwd (with the recomputed
    product) medians: block 1024 warps 8: 0.235 / 0.474 ms (3.00 / 2.98 TB/s, about the 3.01 TB/s copy
    ceiling); 1024/4: 0.311 / 0.474; 2048/4: 0.237 / 0.477; 2048/8: 0.292 / 0.474; 4096/8: 0.287 / 0.476;
    8192/16: 0.235 / 0.482.
    """
    block = min(1024, triton.next_power_of_2(max(n_cols, 16)))
    return GatedLaunchSettings(block=block, num_warps=8 if block >= 1024 else 4)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D [rows, cols] view (a copy only when the layout cannot be viewed so) with unit column stride."""
    rows = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    if rows.shape[-1] > 1 and rows.stride(-1) != 1:
        rows = rows.contiguous()
    return rows


def _row_geometry(*tensors: torch.Tensor) -> tuple[int, int, list[int]]:
    """(rows, cols, row strides); one flat row when every tensor is contiguous, so no block straddles rows."""
    n_rows, n_cols = tensors[0].shape
    if all(t.is_contiguous() for t in tensors):
        return 1, n_rows * n_cols, [0] * len(tensors)
    return n_rows, n_cols, [t.stride(0) for t in tensors]


def _launch_gated_forward(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, activation: str) -> None:
    """a, b, out: [rows, cols] with unit column stride."""
    if a.numel() == 0:
        return
    n_rows, n_cols, strides = _row_geometry(a, b, out)
    settings = gated_launch_settings(n_cols)
    n_col_blocks = triton.cdiv(n_cols, settings.block)
    _gated_forward_kernel[(n_rows * n_col_blocks,)](
        a, b, out, n_cols, n_col_blocks, *strides,
        ACTIVATION=_ACTIVATION_CODES[activation], BLOCK=settings.block, SOFTWARE_BF16_ROUNDING=interpreted(),
        num_warps=settings.num_warps,
    )  # fmt: skip


def _launch_gated_backward(
    grad: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    grad_a: torch.Tensor,
    grad_b: torch.Tensor,
    hidden: torch.Tensor | None,
    activation: str,
) -> None:
    """All [rows, cols] with unit column stride; grad_a/grad_b may be a/b and hidden may be grad (in place)."""
    if a.numel() == 0:
        return
    hidden_arg = grad if hidden is None else hidden
    n_rows, n_cols, strides = _row_geometry(grad, a, b, grad_a, grad_b, hidden_arg)
    settings = gated_launch_settings(n_cols)
    n_col_blocks = triton.cdiv(n_cols, settings.block)
    _gated_backward_kernel[(n_rows * n_col_blocks,)](
        grad, a, b, grad_a, grad_b, hidden_arg, n_cols, n_col_blocks, *strides,
        ACTIVATION=_ACTIVATION_CODES[activation], STORE_HIDDEN=hidden is not None,
        BLOCK=settings.block, SOFTWARE_BF16_ROUNDING=interpreted(), num_warps=settings.num_warps,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# Eager path: gradients written over the saved inputs
# ----------------------------------------------------------------------------------------------------------


def _has_internal_overlap(t: torch.Tensor) -> bool:
    extent = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape, strict=True) if n > 1):
        if stride < extent:
            return True
        extent += (size - 1) * stride
    return False


def _may_overwrite(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the backward may write d a, d b over a, b: both autograd intermediates, disjoint, no aliasing."""
    return (
        a.grad_fn is not None
        and b.grad_fn is not None
        and not _has_internal_overlap(a)
        and not _has_internal_overlap(b)
        and not storage_overlaps(a, b)
    )


class _GatedActivation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, activation):
        out = torch.empty(a.shape, dtype=a.dtype, device=a.device)
        _launch_gated_forward(_as_rows(a), _as_rows(b), out.view(-1, a.shape[-1]), activation)
        ctx.save_for_backward(a, b)
        ctx.activation = activation
        ctx.overwrite_inputs = _may_overwrite(a, b)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        a, b = ctx.saved_tensors
        grad_rows, a_rows, b_rows = _as_rows(grad_out), _as_rows(a), _as_rows(b)
        if ctx.overwrite_inputs:
            grad_a, grad_b = a_rows, b_rows
        else:
            grad_a, grad_b = torch.empty_like(a_rows), torch.empty_like(b_rows)
        _launch_gated_backward(grad_rows, a_rows, b_rows, grad_a, grad_b, None, ctx.activation)
        if ctx.overwrite_inputs:
            # a and b now hold gradients: make any later unpack of them by another node fail loudly.
            torch.autograd.graph.increment_version(a)
            torch.autograd.graph.increment_version(b)
        return grad_a.reshape(a.shape), grad_b.reshape(b.shape), None


def _check_pair(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(f"a and b must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"a and b must have the same dtype, got {a.dtype} and {b.dtype}")
    if a.dim() == 0:
        raise ValueError("a and b must have at least one dimension")


def _gated_activation(a: torch.Tensor, b: torch.Tensor, activation: str) -> torch.Tensor:
    _check_pair(a, b)
    if torch.compiler.is_compiling():
        # Left to Inductor, which fuses the product and its backward into one kernel each and plans the MLP's
        # buffers with its neighbours. Through registered ops running these kernels instead (H100, T=8192,
        # I=14336, benchmarks/kernels/ops.py fusetune+compile against compile, 2026-11-27): the GPU time of
        # these kernels in eager mode and of Inductor's (the swiglu rows' device_ms in
        # benchmarks/results/h100-kernels.json, section ops), but the MLP held 1,296 MB, above the peak of
        # the swiglu_mlp fusetune+compile row there, the op's backward returning both gradients where
        # Inductor's overwrites the incoming one; an op writing over a copy of it matched the memory but paid
        # that copy (0.773 ms) where the gradient is the caller's.
        return _TORCH_ACTIVATIONS[activation](a) * b
    return _GatedActivation.apply(a, b, activation)


def gated_activation(a: torch.Tensor, b: torch.Tensor, activation: str) -> torch.Tensor:
    """act(a) * b for `activation` "silu", "gelu_tanh" or "gelu": these kernels eagerly, torch's ops (which
    Inductor fuses) under torch.compile and on traced tensors (the fake or functional tensors with which the
    compiler runs an autograd function it keeps whole, as the fp8 mode's MLP node)."""
    if activation not in _ACTIVATION_CODES:
        raise ValueError(f"activation must be one of {', '.join(_ACTIVATION_CODES)}, got {activation!r}")
    if type(a) is not torch.Tensor:
        _check_pair(a, b)
        return _TORCH_ACTIVATIONS[activation](a) * b
    return _gated_activation(a, b, activation)


_TORCH_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
}


def _gelu_activation(approximate: str) -> str:
    if approximate == "tanh":
        return "gelu_tanh"
    if approximate == "none":
        return "gelu"
    raise ValueError(f'approximate must be "tanh" or "none", got {approximate!r}')


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """silu(a) * b. The backward overwrites a and b with their gradients when they are graph intermediates."""
    return _gated_activation(a, b, "silu")


def geglu(a: torch.Tensor, b: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """gelu(a) * b with gelu's ``approximate`` ("tanh" or "none"); same in-place backward as swiglu."""
    return _gated_activation(a, b, _gelu_activation(approximate))


def swiglu_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pure PyTorch in fp32, cast back to a's dtype."""
    return (F.silu(a.float()) * b.float()).to(a.dtype)


def geglu_reference(a: torch.Tensor, b: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """Pure PyTorch in fp32, cast back to a's dtype."""
    _gelu_activation(approximate)
    return (F.gelu(a.float(), approximate=approximate) * b.float()).to(a.dtype)


# ----------------------------------------------------------------------------------------------------------
# Whole-MLP autograd nodes (eager)
# ----------------------------------------------------------------------------------------------------------


def _release_storage(t: torch.Tensor) -> None:
    # The saved-tensor slot keeps its tensor alive until the whole backward returns; freeing the storage
    # lets the next products reuse the memory. The tensor is private to this node (never returned).
    t.untyped_storage().resize_(0)


def _gate_up_halves(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n_cols = gate_up.shape[-1] // 2
    return gate_up[:, :n_cols], gate_up[:, n_cols:]


def _project_gate_up(
    x_rows: torch.Tensor,
    gate_weight: torch.Tensor,
    gate_bias: torch.Tensor | None,
    up_weight: torch.Tensor | None,
    up_bias: torch.Tensor | None,
) -> tuple[torch.Tensor, ...]:
    """The projection buffers the backward keeps: (gate, up), or (gate_up,) when up_weight is None and
    gate_weight is a fused [gate; up] projection (Phi-3's gate_up_proj), whose output halves are gate and up."""
    if up_weight is None:
        return (F.linear(x_rows, gate_weight, gate_bias),)
    return F.linear(x_rows, gate_weight, gate_bias), F.linear(x_rows, up_weight, up_bias)


# gated_mlp's arguments on purpose: the autograd Functions pass theirs through to this on [rows, hidden].
def _gated_mlp_rows_forward(
    x_rows: torch.Tensor,
    gate_weight: torch.Tensor,
    gate_bias: torch.Tensor | None,
    up_weight: torch.Tensor | None,
    up_bias: torch.Tensor | None,
    down_weight: torch.Tensor,
    down_bias: torch.Tensor | None,
    activation: str,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """down(act(gate) * up) over [rows, hidden]; returns the output rows and the projection buffers to save
    (the product itself is freed here and recomputed by the backward)."""
    buffers = _project_gate_up(x_rows, gate_weight, gate_bias, up_weight, up_bias)
    gate, up = buffers if len(buffers) == 2 else _gate_up_halves(buffers[0])
    hidden = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    _launch_gated_forward(gate, up, hidden, activation)
    return F.linear(hidden, down_weight, down_bias), buffers


def _gated_mlp_rows_backward(
    grad_rows: torch.Tensor,
    x_rows: torch.Tensor | Callable[[], torch.Tensor],
    buffers: tuple[torch.Tensor, ...],
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor | None,
    down_weight: torch.Tensor,
    activation: str,
    needs: tuple[bool, ...],
) -> tuple[torch.Tensor | None, ...]:
    """Gradients (x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias) of
    _gated_mlp_rows_forward, in the order of the module docstring; `needs` flags them in that order.

    The projection buffers are overwritten with their gradients and then freed. `x_rows` may be a function
    that rebuilds the input (a recomputed norm output): it is called only once grad_hidden is freed, so the
    rebuilt rows never sit beside it.
    """
    need_x, need_gate_w, need_gate_b, need_up_w, need_up_b, need_down_w, need_down_b = needs
    fused_gate_up = len(buffers) == 1
    gate, up = _gate_up_halves(buffers[0]) if fused_gate_up else buffers

    grad_hidden = torch.mm(grad_rows, down_weight)
    # gate <- d gate, up <- d up, grad_hidden <- act(gate) * up (the forward product, for dW_down).
    _launch_gated_backward(grad_hidden, gate, up, gate, up, grad_hidden if need_down_w else None, activation)
    grad_down_weight = torch.mm(grad_rows.t(), grad_hidden) if need_down_w else None
    grad_down_bias = grad_rows.sum(0) if need_down_b else None
    del grad_hidden
    if callable(x_rows):
        x_rows = x_rows() if (need_gate_w or need_up_w) else None

    grad_up_weight = grad_up_bias = None
    if fused_gate_up:
        (grad_gate_up,) = buffers
        grad_x_rows = torch.mm(grad_gate_up, gate_weight) if need_x else None
        grad_gate_weight = torch.mm(grad_gate_up.t(), x_rows) if need_gate_w else None
        grad_gate_bias = grad_gate_up.sum(0) if need_gate_b else None
        del gate, up, grad_gate_up
        _release_storage(buffers[0])
        return grad_x_rows, grad_gate_weight, grad_gate_bias, None, None, grad_down_weight, grad_down_bias

    grad_x_rows = torch.mm(gate, gate_weight) if need_x else None
    grad_gate_weight = torch.mm(gate.t(), x_rows) if need_gate_w else None
    grad_gate_bias = gate.sum(0) if need_gate_b else None
    del gate
    _release_storage(buffers[0])
    if need_x:
        grad_x_rows.addmm_(up, up_weight)
    grad_up_weight = torch.mm(up.t(), x_rows) if need_up_w else None
    grad_up_bias = up.sum(0) if need_up_b else None
    del up
    _release_storage(buffers[1])
    return (
        grad_x_rows,
        grad_gate_weight,
        grad_gate_bias,
        grad_up_weight,
        grad_up_bias,
        grad_down_weight,
        grad_down_bias,
    )


def _refuse_second_backward(ctx) -> None:
    if ctx.consumed:
        raise RuntimeError(
            "the fused gated MLP overwrites its saved activations in the backward; a second backward "
            "through the same graph (retain_graph=True) is not supported"
        )
    ctx.consumed = True


class _GatedMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias, activation):
        x_rows = x.reshape(-1, x.shape[-1])
        out_rows, buffers = _gated_mlp_rows_forward(
            x_rows, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias, activation
        )
        ctx.save_for_backward(x, gate_weight, up_weight, down_weight, *buffers)
        ctx.activation = activation
        ctx.consumed = False
        return out_rows.view(*x.shape[:-1], out_rows.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        _refuse_second_backward(ctx)
        x, gate_weight, up_weight, down_weight, *buffers = ctx.saved_tensors
        grads = _gated_mlp_rows_backward(
            grad_out.reshape(-1, grad_out.shape[-1]),
            x.reshape(-1, x.shape[-1]),
            tuple(buffers),
            gate_weight,
            up_weight,
            down_weight,
            ctx.activation,
            ctx.needs_input_grad[:7],
        )
        grad_x = grads[0].view(x.shape) if grads[0] is not None else None
        return (grad_x, *grads[1:], None)


@dataclass(frozen=True)
class _AddNormSettings:
    eps: float
    offset: float
    casting_mode: str
    activation: str


class _AddRMSNormGatedMLPFunction(torch.autograd.Function):
    """h = branch + residual;  out = down(act(gate(n)) * up(n)),  n = rms_norm(h).

    Saves h (the new residual stream, an output anyway), rstd, gate and up: neither the norm output n nor
    the product. The backward rebuilds n from h once the MLP's grad_hidden is freed, then

        dn = d gate @ W_gate + d up @ W_up;   dh = rms_norm backward(dn) + d h_out   (one kernel, in place)

    and both branch and residual receive dh.
    """

    @staticmethod
    def forward(
        ctx,
        branch,
        residual,
        norm_weight,
        gate_weight,
        gate_bias,
        up_weight,
        up_bias,
        down_weight,
        down_bias,
        settings,
    ):
        normed, new_residual, rstd = _rms_norm._launch_forward(
            branch, residual, norm_weight, settings.eps, settings.offset, settings.casting_mode
        )
        n_cols = branch.shape[-1]
        out_rows, buffers = _gated_mlp_rows_forward(
            normed.view(-1, n_cols),
            gate_weight,
            gate_bias,
            up_weight,
            up_bias,
            down_weight,
            down_bias,
            settings.activation,
        )
        del normed  # rebuilt by the backward
        ctx.save_for_backward(new_residual, norm_weight, rstd, gate_weight, up_weight, down_weight, *buffers)
        ctx.settings = settings
        ctx.consumed = False
        return out_rows.view(*branch.shape[:-1], out_rows.shape[-1]), new_residual

    @staticmethod
    def backward(ctx, grad_out, grad_new_residual):
        _refuse_second_backward(ctx)
        new_residual, norm_weight, rstd, gate_weight, up_weight, down_weight, *buffers = ctx.saved_tensors
        settings = ctx.settings
        n_cols = new_residual.shape[-1]

        def rebuild_normed() -> torch.Tensor:
            # The forward kernel on the stored (already rounded) h: the same rows bit for bit.
            normed, _, _ = _rms_norm._launch_forward(
                new_residual, None, norm_weight, settings.eps, settings.offset, settings.casting_mode
            )
            return normed.view(-1, n_cols)

        needs = ctx.needs_input_grad
        grads = _gated_mlp_rows_backward(
            grad_out.reshape(-1, grad_out.shape[-1]),
            rebuild_normed,
            tuple(buffers),
            gate_weight,
            up_weight,
            down_weight,
            settings.activation,
            (True, *needs[3:9]),
        )
        grad_normed = grads[0]
        grad_h, grad_norm_weight = _rms_norm._backward(
            grad_normed,
            new_residual.view(-1, n_cols),
            norm_weight,
            rstd,
            grad_new_residual,
            settings.offset,
            settings.casting_mode,
            inplace_backward=True,  # grad_normed is this node's own buffer
        )
        grad_h = grad_h.view(new_residual.shape)
        return (grad_h, grad_h, grad_norm_weight if needs[2] else None, *grads[1:], None)


def _check_mlp_weights(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor | None,
    down_weight: torch.Tensor,
    activation: str,
) -> None:
    if activation not in _ACTIVATION_CODES:
        raise ValueError(f"activation must be one of {sorted(_ACTIVATION_CODES)}, got {activation!r}")
    intermediate = gate_weight.shape[0] if up_weight is not None else gate_weight.shape[0] // 2
    expected = {
        "gate_weight": (intermediate * (1 if up_weight is not None else 2), x.shape[-1]),
        "up_weight": (intermediate, x.shape[-1]) if up_weight is not None else None,
        "down_weight": (down_weight.shape[0], intermediate),
    }
    actual = {"gate_weight": gate_weight, "up_weight": up_weight, "down_weight": down_weight}
    for name, shape in expected.items():
        if shape is not None and tuple(actual[name].shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(actual[name].shape)}")
    if up_weight is None and gate_weight.shape[0] % 2:
        raise ValueError(f"a fused gate_up weight needs an even number of rows, got {gate_weight.shape[0]}")


def gated_mlp(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    gate_bias: torch.Tensor | None,
    up_weight: torch.Tensor | None,
    up_bias: torch.Tensor | None,
    down_weight: torch.Tensor,
    down_bias: torch.Tensor | None,
    activation: str = "silu",
) -> torch.Tensor:
    """down_proj(act(gate_proj(x)) * up_proj(x)) as one autograd node (eager only) that saves x, gate and
    up. With up_weight None, gate_weight (and gate_bias) is a fused [gate; up] projection. `activation`:
    "silu", "gelu_tanh" or "gelu". One backward only (no retain_graph)."""
    _check_mlp_weights(x, gate_weight, up_weight, down_weight, activation)
    return _GatedMLPFunction.apply(
        x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias, activation
    )


def add_rms_norm_gated_mlp(
    branch: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    gate_weight: torch.Tensor,
    gate_bias: torch.Tensor | None,
    up_weight: torch.Tensor | None,
    up_bias: torch.Tensor | None,
    down_weight: torch.Tensor,
    down_bias: torch.Tensor | None,
    *,
    eps: float,
    offset: float = 0.0,
    casting_mode: str = "llama",
    activation: str = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gated_mlp(rms_norm(branch + residual)), branch + residual) as one autograd node (eager only) that
    keeps neither the norm output nor the product for the backward. Norm arguments as in
    `fusetune.kernels.rms_norm.add_rms_norm`; MLP arguments as in `gated_mlp`."""
    if branch.shape != residual.shape or branch.dtype != residual.dtype:
        raise ValueError(
            "add_rms_norm_gated_mlp: residual must match branch in shape and dtype, got "
            f"{tuple(residual.shape)} {residual.dtype} for branch {tuple(branch.shape)} {branch.dtype}"
        )
    if norm_weight.shape != (branch.shape[-1],):
        raise ValueError(f"norm_weight must have shape ({branch.shape[-1]},), got {tuple(norm_weight.shape)}")
    _check_mlp_weights(branch, gate_weight, up_weight, down_weight, activation)
    settings = _AddNormSettings(float(eps), float(offset), casting_mode, activation)
    return _AddRMSNormGatedMLPFunction.apply(
        branch, residual, norm_weight, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias,
        settings,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------------------------------------


def _is_plain_linear(module: nn.Module) -> bool:
    """An nn.Linear whose forward is exactly F.linear on plain tensors (no adapters, hooks or sharded params)."""
    if type(module) is not nn.Linear or module._forward_hooks or module._forward_pre_hooks:
        return False
    params = [module.weight] if module.bias is None else [module.weight, module.bias]
    return all(type(p.data) is torch.Tensor for p in params)


def _global_module_hooks_present() -> bool:
    from torch.nn.modules import module as module_internals

    return bool(module_internals._global_forward_hooks or module_internals._global_forward_pre_hooks)


class _GatedMLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)) with the state_dict keys of transformers' gated MLPs."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, activation: str) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.activation = activation

    def _fusable(self, x: torch.Tensor) -> bool:
        projections = (self.gate_proj, self.up_proj, self.down_proj)
        if torch.compiler.is_compiling() or not all(_is_plain_linear(m) for m in projections):
            return False
        if _global_module_hooks_present() or torch.is_autocast_enabled(x.device.type):
            return False
        tensors = [x] + [p for m in projections for p in m.parameters()]
        return all(t.dtype == x.dtype and t.device == x.device for t in tensors)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fusable(x):
            return _GatedMLPFunction.apply(
                x,
                self.gate_proj.weight,
                self.gate_proj.bias,
                self.up_proj.weight,
                self.up_proj.bias,
                self.down_proj.weight,
                self.down_proj.bias,
                self.activation,
            )
        # Adapters (e.g. LoRA-wrapped projections), hooks, autocast, mixed dtypes, torch.compile: call the
        # projections as modules and fuse only the activation.
        return self.down_proj(_gated_activation(self.gate_proj(x), self.up_proj(x), self.activation))


class _ConfiguredGatedMLP(_GatedMLP):
    """A _GatedMLP sized as a transformers config's MLP (`intermediate_size` overriding the config's, as a
    model's shared experts do), keeping the config as transformers' MLPs keep theirs."""

    def __init__(self, config, intermediate_size: int | None, activation: str) -> None:
        super().__init__(
            config.hidden_size,
            config.intermediate_size if intermediate_size is None else intermediate_size,
            bool(getattr(config, "mlp_bias", False)),
            activation,
        )
        self.config = config


class FusedSwiGLUMLP(_ConfiguredGatedMLP):
    """Drop-in for transformers' LlamaMLP (and the same MLP of Mistral, Qwen2/3, ...)."""

    def __init__(self, config, intermediate_size: int | None = None) -> None:
        hidden_act = getattr(config, "hidden_act", "silu")
        if hidden_act not in ("silu", "swish"):
            raise ValueError(
                f"FusedSwiGLUMLP needs config.hidden_act 'silu' (or 'swish'), got {hidden_act!r}"
            )
        super().__init__(config, intermediate_size, "silu")


_GELU_NAMES = {
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu_python_tanh": "gelu_tanh",
    "gelu": "gelu",
    "gelu_python": "gelu",
}


class FusedGeGLUMLP(_ConfiguredGatedMLP):
    """Drop-in for transformers' GemmaMLP / Gemma2MLP / Gemma3MLP.

    The activation comes from ``config.hidden_activation`` (Gemma 2 and later) or else ``config.hidden_act``
    (Gemma 1, whose config already maps the legacy "gelu" to the tanh form): tanh-approximate names
    ("gelu_pytorch_tanh", "gelu_new", ...) use the tanh form, "gelu" the exact erf form.
    """

    def __init__(self, config, intermediate_size: int | None = None) -> None:
        name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if name not in _GELU_NAMES:
            raise ValueError(
                f"FusedGeGLUMLP needs a gelu activation ({', '.join(sorted(_GELU_NAMES))}), got {name!r}"
            )
        super().__init__(config, intermediate_size, _GELU_NAMES[name])
