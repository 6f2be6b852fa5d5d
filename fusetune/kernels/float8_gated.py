"""The gated activation's backward with the float8 casts of its outputs fused in, for an MLP whose three
matmuls run in float8 with one scale per tensor (the fp8 precision mode's tensorwise recipe).

For out = down(act(gate) * up), the backward reads the saved gate and up and the incoming gradient
g = d loss / d (act(gate) * up), and its float8 matmuls need:

    hidden^T  in e4m3, [intermediate, tokens]: down's weight gradient (g_out^T @ hidden takes hidden
              column-major)
    d gate, d up  in e5m2, each twice: [tokens, intermediate] for the input gradient (d @ W) and transposed,
              [intermediate, tokens], for the weight gradient (d^T @ x)

with d gate = g * up * act'(gate), d up = g * act(gate), hidden = act(gate) * up. One scale per tensor needs the
tensor's largest magnitude before any element is cast, so one kernel reduces the two gradients' maxima (computing
them, writing nothing) and a second computes them again and writes the five float8 tensors; hidden's scale is
the forward's, whose cast saw the same values.

Why a kernel of our own: under torch.compile, Inductor fused the same casts but, for GeGLU, wrote d gate once in
fp32 and once more as |d gate| in bf16 to reduce its maximum separately, 0.84 GB at the Gemma-2-2B shape and
8 x 2,048 tokens, live at the step's memory peak (h200-step.md, e2e-fp8-gemma-backward-peak): the float8 mode
then held more than the bf16 one. Here the step holds g, the saved gate and up, and the five float8 outputs: the
backward's rise over what the forward left fell from 1.44 to 0.95 GB (e2e-fp8-gemma-mlp-node), and per layer
these two kernels took 0.28 and 0.62 ms on an H200 (3.3 and 2.7 TB/s, at 64 x 64 tiles; the tiles below are
faster) where Inductor's four took 1.57.

The values are bit for bit torchao's tensorwise cast of the bf16 gated backward's gradients
(`fusetune.kernels.swiglu`, computed in fp32 and rounded once): each is rounded to the input dtype, multiplied
by its scale in fp32, clamped to the format's range and rounded to nearest even.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fusetune.kernels._interpreter import interpreted, launchable, round_to_dtype, round_to_float8
from fusetune.kernels.swiglu import _ACTIVATION_CODES, _activation_and_slope

__all__ = ["gated_float8_backward", "gated_float8_gradient_maxima"]


class Tile(NamedTuple):
    """One program's tile, tokens x intermediate columns, and its warps."""

    rows: int
    cols: int
    warps: int


# From benchmarks/kernels/float8_gated_launch_settings.py on an H200 (2026-11-28), at the MLPs of Llama-3.2-1B,
# Qwen2.5-1.5B, Gemma-2-2B (16,384 tokens) and Llama-3.1-8B (4,096): the tile whose slowest shape lost least to
# that shape's best. The backward at 32 x 64 reached 3.3-3.6 TB/s (64 x 64: 2.7-3.1), within 0.8% of the best
# tile at the first three shapes and the best at 8B; the maxima at 64 x 128, 8 warps, 3.3-3.7 TB/s, within 3.6%.
MAXIMA_TILE = Tile(64, 128, 8)
BACKWARD_TILE = Tile(32, 64, 4)
_FLOAT8_TYPES = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}


@triton.jit
def _tile(n_rows, n_cols, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """(rows, cols, mask) of this program's tile of a [n_rows, n_cols] array."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    return rows, cols, (rows[:, None] < n_rows) & (cols[None, :] < n_cols)


@triton.jit
def _gated_gradients(
    grad_ptr, gate_ptr, up_ptr, offsets, mask, ACTIVATION: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr
):  # fmt: skip
    """(d gate, d up, hidden) at `offsets` of the contiguous inputs, each rounded to the inputs' dtype (as the
    bf16 backward stores it) and held in fp32. The kernels compute the addresses they store to themselves:
    Inductor, which reads a kernel's stores to learn which arguments it writes, takes an address that comes
    back from a call given the input pointers for one of them, and would copy those inputs before each launch."""
    dtype = gate_ptr.dtype.element_ty
    grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    act, slope = _activation_and_slope(gate, ACTIVATION)
    d_gate = round_to_dtype(grad * up * slope, dtype, SOFTWARE_ROUNDING).to(tl.float32)
    d_up = round_to_dtype(grad * act, dtype, SOFTWARE_ROUNDING).to(tl.float32)
    hidden = round_to_dtype(act * up, dtype, SOFTWARE_ROUNDING).to(tl.float32)
    return d_gate, d_up, hidden


@triton.jit
def _gated_gradient_maxima_kernel(
    grad_ptr, gate_ptr, up_ptr, maxima_ptr, n_rows, n_cols, ACTIVATION: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr,
):  # fmt: skip
    """The largest |d gate| and |d up| of this program's tile, at maxima[program, 0 and 1] (padding reads 0,
    whose gradients are 0)."""
    rows, cols, mask = _tile(n_rows, n_cols, BLOCK_ROWS, BLOCK_COLS)
    offsets = rows[:, None] * n_cols + cols[None, :]
    d_gate, d_up, _ = _gated_gradients(
        grad_ptr, gate_ptr, up_ptr, offsets, mask, ACTIVATION, SOFTWARE_ROUNDING
    )
    program = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    tl.store(maxima_ptr + 2 * program, tl.max(tl.max(tl.abs(d_gate), axis=1), axis=0))
    tl.store(maxima_ptr + 2 * program + 1, tl.max(tl.max(tl.abs(d_up), axis=1), axis=0))


@triton.jit
def _scaled_float8(value, scale, dtype: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr):
    """torchao's cast: value * scale in fp32, clamped to the format's largest finite magnitude, rounded."""
    if dtype == tl.float8e4nv:
        largest: tl.constexpr = 448.0
    else:
        largest: tl.constexpr = 57344.0
    scaled = tl.minimum(tl.maximum(value * scale, -largest), largest)
    return round_to_float8(scaled, dtype, SOFTWARE_ROUNDING)


@triton.jit
def _gated_float8_backward_kernel(
    grad_ptr, gate_ptr, up_ptr, scales_ptr, hidden_t_ptr, d_gate_ptr, d_gate_t_ptr, d_up_ptr, d_up_t_ptr,
    n_rows, n_cols, ACTIVATION: tl.constexpr, HIDDEN_DTYPE: tl.constexpr, GRAD_DTYPE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr,
):  # fmt: skip
    """This tile of hidden^T, d gate, d gate^T, d up and d up^T in float8; scales = [hidden, d gate, d up]."""
    rows, cols, mask = _tile(n_rows, n_cols, BLOCK_ROWS, BLOCK_COLS)
    offsets = rows[:, None] * n_cols + cols[None, :]
    d_gate, d_up, hidden = _gated_gradients(
        grad_ptr, gate_ptr, up_ptr, offsets, mask, ACTIVATION, SOFTWARE_ROUNDING
    )
    hidden8 = _scaled_float8(hidden, tl.load(scales_ptr), HIDDEN_DTYPE, SOFTWARE_ROUNDING)
    d_gate8 = _scaled_float8(d_gate, tl.load(scales_ptr + 1), GRAD_DTYPE, SOFTWARE_ROUNDING)
    d_up8 = _scaled_float8(d_up, tl.load(scales_ptr + 2), GRAD_DTYPE, SOFTWARE_ROUNDING)
    transposed = cols[None, :] * n_rows + rows[:, None]
    tl.store(d_gate_ptr + offsets, d_gate8, mask=mask)
    tl.store(d_up_ptr + offsets, d_up8, mask=mask)
    tl.store(hidden_t_ptr + transposed, hidden8, mask=mask)
    tl.store(d_gate_t_ptr + transposed, d_gate8, mask=mask)
    tl.store(d_up_t_ptr + transposed, d_up8, mask=mask)


def _grid(rows: int, cols: int, tile: Tile) -> tuple[int, int]:
    return triton.cdiv(rows, tile.rows), triton.cdiv(cols, tile.cols)


def _check(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str) -> None:
    if not (grad.shape == gate.shape == up.shape) or gate.dim() != 2:
        raise ValueError(
            f"grad, gate and up must be one [tokens, intermediate] shape, got {tuple(grad.shape)}, "
            f"{tuple(gate.shape)} and {tuple(up.shape)}"
        )
    if not (grad.dtype == gate.dtype == up.dtype):
        raise ValueError(
            f"grad, gate and up must share a dtype, got {grad.dtype}, {gate.dtype} and {up.dtype}"
        )
    if activation not in _ACTIVATION_CODES:
        raise ValueError(f"activation must be one of {', '.join(_ACTIVATION_CODES)}, got {activation!r}")


def _launch_maxima(grad, gate, up, activation: str, traced: bool, tile: Tile = MAXIMA_TILE) -> torch.Tensor:
    rows, cols = gate.shape
    if not gate.numel():  # no elements: every magnitude of nothing is 0 (amax over no tiles would raise)
        return torch.zeros(2, dtype=torch.float32, device=gate.device)
    grid = _grid(rows, cols, tile)
    # Each program writes its own row, so nothing is filled first.
    partial = torch.empty(grid[0] * grid[1], 2, dtype=torch.float32, device=gate.device)
    kernel = launchable(_gated_gradient_maxima_kernel, traced)
    kernel[grid](
        grad, gate, up, partial, rows, cols, ACTIVATION=_ACTIVATION_CODES[activation],
        BLOCK_ROWS=tile.rows, BLOCK_COLS=tile.cols, SOFTWARE_ROUNDING=interpreted(), num_warps=tile.warps,
    )  # fmt: skip
    return partial.amax(dim=0)


def _launch_backward(
    grad, gate, up, activation: str, scales: torch.Tensor, hidden_dtype, grad_dtype, traced: bool,
    tile: Tile = BACKWARD_TILE,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    rows, cols = gate.shape
    hidden_t = torch.empty(cols, rows, dtype=hidden_dtype, device=gate.device)
    d_gate, d_up = (torch.empty(rows, cols, dtype=grad_dtype, device=gate.device) for _ in range(2))
    d_gate_t, d_up_t = (torch.empty(cols, rows, dtype=grad_dtype, device=gate.device) for _ in range(2))
    kernel = launchable(_gated_float8_backward_kernel, traced)
    if gate.numel():
        kernel[_grid(rows, cols, tile)](
            grad, gate, up, scales, hidden_t, d_gate, d_gate_t, d_up, d_up_t, rows, cols,
            ACTIVATION=_ACTIVATION_CODES[activation], HIDDEN_DTYPE=_FLOAT8_TYPES[hidden_dtype],
            GRAD_DTYPE=_FLOAT8_TYPES[grad_dtype], BLOCK_ROWS=tile.rows, BLOCK_COLS=tile.cols,
            SOFTWARE_ROUNDING=interpreted(), num_warps=tile.warps,
        )  # fmt: skip
    return hidden_t, d_gate, d_gate_t, d_up, d_up_t


# torch.library ops, which torch.compile traces through (the fp8 mode compiles each decoder layer); eager calls
# launch directly. The compiler runs the fp8 mode's MLP node whole on traced tensors (fake or functional ones,
# of another type than torch.Tensor), which take the ops as well: a launch needs real memory.


def _traced(tensor: torch.Tensor) -> bool:
    return torch.compiler.is_compiling() or type(tensor) is not torch.Tensor


@torch.library.triton_op("fusetune::gated_float8_gradient_maxima", mutates_args=())
def _gradient_maxima_op(
    grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str
) -> torch.Tensor:
    return _launch_maxima(grad, gate, up, activation, traced=True)


@torch.library.triton_op("fusetune::gated_float8_backward", mutates_args=())
def _backward_op(
    grad: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    scales: torch.Tensor,
    hidden_dtype: torch.dtype,
    grad_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _launch_backward(grad, gate, up, activation, scales, hidden_dtype, grad_dtype, traced=True)


def gated_float8_gradient_maxima(
    grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str
) -> torch.Tensor:
    """[max |d gate|, max |d up|] (fp32, on the device) of the gated activation `act(gate) * up` with incoming
    gradient `grad`, all [tokens, intermediate]; activation: "silu", "gelu_tanh" or "gelu"."""
    _check(grad, gate, up, activation)
    grad, gate, up = grad.contiguous(), gate.contiguous(), up.contiguous()
    if _traced(gate):
        return torch.ops.fusetune.gated_float8_gradient_maxima(grad, gate, up, activation)
    return _launch_maxima(grad, gate, up, activation, traced=False)


def gated_float8_backward(
    grad: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    scales: torch.Tensor,
    hidden_dtype: torch.dtype = torch.float8_e4m3fn,
    grad_dtype: torch.dtype = torch.float8_e5m2,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden^T, d gate, d gate^T, d up, d up^T) in float8 (the module docstring), with `scales` = [hidden's,
    d gate's, d up's] (fp32, on the device: torchao's 448 / amax or 57344 / amax)."""
    _check(grad, gate, up, activation)
    if scales.shape != (3,) or scales.dtype != torch.float32:
        raise ValueError(f"scales must be 3 float32 values, got {tuple(scales.shape)} {scales.dtype}")
    for name, dtype in (("hidden_dtype", hidden_dtype), ("grad_dtype", grad_dtype)):
        if dtype not in _FLOAT8_TYPES:
            raise ValueError(f"{name} must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    grad, gate, up = grad.contiguous(), gate.contiguous(), up.contiguous()
    if _traced(gate):
        return torch.ops.fusetune.gated_float8_backward(
            grad, gate, up, activation, scales, hidden_dtype, grad_dtype
        )
    return _launch_backward(grad, gate, up, activation, scales, hidden_dtype, grad_dtype, traced=False)
