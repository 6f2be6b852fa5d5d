"""AdamW for bf16 weights and optimizer state, with stochastic rounding: fp32-master quality at 8 bytes/param.

Plain bf16 AdamW loses small updates: a weight keeps 8 significant bits, so an update under about 2^-9 of the
weight rounds back to the old value every step, and at fine-tuning learning rates most updates are that small.
Stochastic rounding keeps them on average: the fp32 result x lying between the bf16 neighbours lo < x < hi is
stored as hi with probability (x - lo) / (hi - lo), else as lo, so E[stored] = x and the small updates add up
over steps as they do on fp32 master weights. The moments get the same treatment: with beta2 = 0.999 the second
moment moves by 0.1% a step, under bf16's half ulp, so a round-to-nearest exp_avg_sq would stop following the
gradient.

One kernel launch updates every tensor of a parameter group (per dtype combination and step count, which a
group normally has one of), through a table of addresses; per element, in fp32:

    g      = grad * grad_scale                       (grad_scale: the clipping factor, a device scalar;
                                                      NaN leaves parameters and state as they are)
    m      = m * beta1 + g * (1 - beta1)
    v      = v * beta2 + (g * g) * (1 - beta2)
    denom  = sqrt(v) * (1 / sqrt(1 - beta2^step)) + eps
    p      = p * (1 - lr * weight_decay) - (m / denom) * (lr / (1 - beta1^step))

then p, m and v are stored: bf16 ones rounded stochastically, fp32 ones as they are. Every operation is one
IEEE fp32 operation (division and square root correctly rounded, no fused multiply-add), so the pure-PyTorch
`adamw_step_reference` gives the same bits. The update uses m and v before they are rounded for storage.

The random bits come from (seed, step, element index) through an integer hash written identically in Triton and
in torch: r1 = mix(index_lo ^ mix(index_hi ^ key(seed, step))), r2 = mix(r1 ^ SALT), with mix a 32-bit
xorshift-multiply finaliser; the weight uses the low 16 bits of r1, exp_avg its high 16, exp_avg_sq the low
16 of r2. The index counts a parameter's elements from its start in the group's concatenation (group order), so
the bits do not depend on how the kernel is blocked, and every data-parallel rank draws the same ones. Rounding
is then `(bits(x) + r16) >> 16` on the fp32 bit pattern (NaN kept quiet): exact values are left unchanged.

For a parameter whose block maxima the optimizer keeps (`keep_block_maxima`), each block also writes the largest
magnitude it stored: the fp8 mode's weight scales, read from a few thousand maxima instead of the whole weight.

fp32 parameters (LoRA adapters, say) get plain fp32 AdamW with fp32 state, no rounding. FSDP2 parameters
(DTensors) are updated through their local shards; their state is kept as DTensors of the same placement, so
the distributed checkpoint helpers see the usual AdamW state (`step`, `exp_avg`, `exp_avg_sq`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import astuple, dataclass
from typing import Any, NamedTuple, Required, TypedDict, Unpack

import torch
import triton
import triton.language as tl

from fusetune.kernels._interpreter import interpreted
from fusetune.kernels.host_state import HostState

__all__ = [
    "AdamWHyperparameters",
    "AdamWLaunchSettings",
    "AdamWStepOptions",
    "FusedAdamW",
    "adamw_launch_settings",
    "adamw_state_bytes_per_parameter",
    "adamw_step_reference",
    "block_maxima_reference",
    "gradient_clipping_scale",
    "stochastic_rounding_key",
]

_MASK32 = 0xFFFFFFFF
# Multipliers of the 32-bit finaliser (a xorshift-multiply hash of low measured bias). Both are below 2^31, so
# the torch reference can multiply a 32-bit value by them in int64 without overflow and mask the product.
_MIX_MULTIPLIER_1 = 0x21F0AAAD
_MIX_MULTIPLIER_2 = 0x735A2D97
# Second hash of an element, for exp_avg_sq's bits (the golden-ratio constant, any odd constant would do).
_SALT = 0x9E3779B9
# Columns of the per-launch address table (int64): param, grad, exp_avg, exp_avg_sq addresses, numel, element
# offset of the tensor in the group, first block of the tensor in the launch, and the address of the tensor's
# block maxima (0: none kept).
_TABLE_COLUMNS = 8
# The widest load or store of one thread: a kernel whose tensors all start at a multiple of it moves its whole
# blocks in vectors of this size.
VECTOR_BYTES = 16
_SUPPORTED_PARAM_DTYPES = (torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class AdamWLaunchSettings:
    """Elements per program and warps of the AdamW kernel (one program per block of one tensor)."""

    block_size: int
    num_warps: int


def adamw_launch_settings() -> AdamWLaunchSettings:
    """The kernel's launch settings.

    GPU: one H200, `benchmarks/kernels/optimizer.py --sweep` with whole blocks moved in 16-byte vectors
    (h200-kernels.md, sections optimizer-sweep-vectors and optimizer-8b-sweep-vectors, 2026-11-28): 8192 elements
    with 16 warps (16 elements a thread, two vectors of each tensor) was the fastest of nine settings at both
    sizes. Llama-3.2-1B's 1.236e9 bf16 parameters in 146 tensors: 7.02 ms, against 7.44-7.81 for the 2048 with 8
    warps used before and 6.99 for torch's fused AdamW without stochastic rounding; Llama-3.1-8B's 8.03e9 in 291
    tensors: 41.2 ms against 44.4-44.6, and 42.6 for torch's (floor: 26.6 ms, 14 bytes a parameter at the
    copy bandwidth). Before the vectors (2-byte loads), 2048 with 8 warps had been the best on an H100, and the
    8B step took 50.7 ms (optimizer-8b-before-vectors). The address table (a dependent load of the block's
    tensor, then of its row, before the data) cost about 1.2 of 9.0 ms at 1B then; a flat buffer would need the
    parameters and gradients to live in one allocation, which the model and FSDP own, so the table stays.
    Interpreter: a small block, so CPU tests at a few thousand elements walk several blocks per tensor.
    """
    if interpreted():
        return AdamWLaunchSettings(block_size=512, num_warps=4)
    return AdamWLaunchSettings(block_size=8192, num_warps=16)


# ------------------------------------------------------------------------------------------------------------
# Random bits, shared by the kernel and the reference
# ------------------------------------------------------------------------------------------------------------


def _mix32(value: int) -> int:
    value &= _MASK32
    value ^= value >> 16
    value = (value * _MIX_MULTIPLIER_1) & _MASK32
    value ^= value >> 15
    value = (value * _MIX_MULTIPLIER_2) & _MASK32
    value ^= value >> 15
    return value


def stochastic_rounding_key(seed: int, step: int) -> int:
    """The 32-bit key of one optimizer step: a hash of the seed (any non-negative int, 64 bits used) and step."""
    if seed < 0:
        raise ValueError(f"FusedAdamW: seed must be a non-negative integer, got {seed}")
    seed_key = _mix32((seed & _MASK32) ^ _mix32((seed >> 32) & _MASK32))
    return _mix32(seed_key ^ (step & _MASK32))


def _mix32_reference(values: torch.Tensor) -> torch.Tensor:
    """`_mix32` on an int64 tensor of values in [0, 2^32): products stay under 2^63, masked back to 32 bits."""
    values = values ^ (values >> 16)
    values = (values * _MIX_MULTIPLIER_1) & _MASK32
    values = values ^ (values >> 15)
    values = (values * _MIX_MULTIPLIER_2) & _MASK32
    return values ^ (values >> 15)


def _random_bits_reference(element_index: torch.Tensor, key: int) -> tuple[torch.Tensor, torch.Tensor]:
    low = element_index & _MASK32
    high = element_index >> 32
    first = _mix32_reference(low ^ _mix32_reference(high ^ key))
    second = _mix32_reference(first ^ _SALT)
    return first, second


def _round_stochastic_reference(value: torch.Tensor, random16: torch.Tensor) -> torch.Tensor:
    """fp32 `value` to bf16, up with probability (value - lo) / (hi - lo), given 16 random bits per element."""
    bits = value.view(torch.int32).to(torch.int64) & _MASK32
    bits = torch.where(torch.isnan(value), bits | 0x400000, bits + random16)
    upper = (bits >> 16) & 0xFFFF
    return torch.where(upper >= 0x8000, upper - 0x10000, upper).to(torch.int16).view(torch.bfloat16)


# ------------------------------------------------------------------------------------------------------------
# Triton kernel
# ------------------------------------------------------------------------------------------------------------


@triton.jit
def _mix32_kernel(value):
    value ^= value >> 16
    value *= 0x21F0AAAD
    value ^= value >> 15
    value *= 0x735A2D97
    value ^= value >> 15
    return value


@triton.jit
def _round_stochastic(value, random16):
    """fp32 -> bf16 by adding 16 random bits below the kept ones; a NaN is made quiet instead (as in
    round_to_dtype), so the addition cannot carry its payload into an inf or wrap it to zero."""
    bits = value.to(tl.uint32, bitcast=True)
    bits = tl.where(value != value, bits | 0x400000, bits + random16)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _adamw_update(grad, exp_avg, exp_avg_sq, param, constants):
    """The update of the module docstring on fp32 values, both optimizers' (the 8-bit one after decoding its
    moments): the new exp_avg, exp_avg_sq, sqrt(exp_avg_sq) (the 8-bit state stores it) and parameter.
    `constants`: the step's _StepConstants as a tuple, in the order of its fields (launch_over_table's)."""
    (beta1, one_minus_beta1, beta2, one_minus_beta2, inv_sqrt_bias_correction2, eps, weight_decay_factor,
     step_size) = constants  # fmt: skip
    exp_avg = exp_avg * beta1 + grad * one_minus_beta1
    exp_avg_sq = exp_avg_sq * beta2 + (grad * grad) * one_minus_beta2
    root = tl.sqrt_rn(exp_avg_sq)
    denom = root * inv_sqrt_bias_correction2 + eps
    param = param * weight_decay_factor - tl.div_rn(exp_avg, denom) * step_size
    return exp_avg, exp_avg_sq, root, param


@triton.jit
def _random_bits(index, step_key):
    """Two 32-bit random words per element from its index in the group and the step's key, both optimizers'
    stochastic rounding bits (_random_bits_reference draws the same)."""
    key = step_key.to(tl.uint32, bitcast=True)
    high_key = _mix32_kernel((index >> 32).to(tl.uint32) ^ key)
    first = _mix32_kernel(index.to(tl.uint32) ^ high_key)
    second = _mix32_kernel(first ^ 0x9E3779B9)  # _SALT
    return first, second


@triton.jit
def _table_row(
    table_ptr, program_tensor_ptr, param_proto_ptr, grad_proto_ptr, TABLE_COLUMNS: tl.constexpr,
    ALIGNED: tl.constexpr,
):  # fmt: skip
    """Both optimizers' kernels: this program's index, its tensor's row of launch_over_table's table, and the
    tensor's param and grad pointers, typed as the *_proto ones (every tensor of a launch has their dtypes)
    and, if ALIGNED, marked multiples of 16 bytes here: the mark is lost on a pointer a helper returns."""
    pid = tl.program_id(0)
    tensor = tl.load(program_tensor_ptr + pid).to(tl.int64)
    row = table_ptr + tensor * TABLE_COLUMNS
    param_ptr = tl.load(row + 0).to(tl.pointer_type(param_proto_ptr.dtype.element_ty))
    grad_ptr = tl.load(row + 1).to(tl.pointer_type(grad_proto_ptr.dtype.element_ty))
    if ALIGNED:
        param_ptr = tl.multiple_of(param_ptr, 16)
        grad_ptr = tl.multiple_of(grad_ptr, 16)
    return pid, row, param_ptr, grad_ptr


@triton.jit
def _grad_scale_or_skip(grad_scale_ptr, numel, HAS_GRAD_SCALE: tl.constexpr):
    """Both optimizers' kernels: the gradients' scale (1.0 without one) and the number of elements to update,
    0 when the scale is NaN."""
    grad_scale = 1.0
    if HAS_GRAD_SCALE:
        grad_scale = tl.load(grad_scale_ptr)
        # A NaN scale is the caller's non-finite guard: the step then reads and writes nothing.
        numel = tl.where(grad_scale == grad_scale, numel, 0)
    return grad_scale, numel


@triton.jit
def _adamw_block(
    param_ptr,
    grad_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    offsets,
    mask,
    group_offset,
    grad_scale,
    constants,
    step_key,
    HAS_GRAD_SCALE: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK_MAX: tl.constexpr,
):
    """The update of the module docstring over `offsets` of one tensor, in place; `mask` is read only if MASKED
    (a whole block of aligned tensors goes without it, so that its loads and stores are 16-byte vectors).
    Returns the largest magnitude of the stored parameters (0 where masked) if BLOCK_MAX, else 0."""
    param_dtype = param_ptr.dtype.element_ty
    state_dtype = exp_avg_ptr.dtype.element_ty
    if MASKED:
        grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0, eviction_policy="evict_first")
        exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        param = tl.load(param_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    else:
        grad = tl.load(grad_ptr + offsets, eviction_policy="evict_first")
        exp_avg = tl.load(exp_avg_ptr + offsets).to(tl.float32)
        exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets).to(tl.float32)
        param = tl.load(param_ptr + offsets).to(tl.float32)
    grad = grad.to(tl.float32)
    if HAS_GRAD_SCALE:
        grad = grad * grad_scale

    exp_avg, exp_avg_sq, _, param = _adamw_update(grad, exp_avg, exp_avg_sq, param, constants)

    if param_dtype == tl.bfloat16 or state_dtype == tl.bfloat16:
        first, second = _random_bits(group_offset + offsets, step_key)
    if param_dtype == tl.bfloat16:
        param_out = _round_stochastic(param, first & 0xFFFF)
    else:
        param_out = param
    if state_dtype == tl.bfloat16:
        exp_avg_out = _round_stochastic(exp_avg, first >> 16)
        exp_avg_sq_out = _round_stochastic(exp_avg_sq, second & 0xFFFF)
    else:
        exp_avg_out = exp_avg
        exp_avg_sq_out = exp_avg_sq
    if MASKED:
        tl.store(param_ptr + offsets, param_out, mask=mask)
        tl.store(exp_avg_ptr + offsets, exp_avg_out, mask=mask)
        tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq_out, mask=mask)
    else:
        tl.store(param_ptr + offsets, param_out)
        tl.store(exp_avg_ptr + offsets, exp_avg_out)
        tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq_out)
    block_max = 0.0
    if BLOCK_MAX:
        magnitude = tl.abs(param_out.to(tl.float32))
        if MASKED:
            magnitude = tl.where(mask, magnitude, 0.0)
        block_max = tl.max(magnitude, axis=0)
    return block_max


@triton.jit(do_not_specialize=["step_key"])
def _adamw_kernel(
    table_ptr,
    block_tensor_ptr,
    param_proto_ptr,
    grad_proto_ptr,
    state_proto_ptr,
    grad_scale_ptr,
    constants,
    step_key,
    HAS_GRAD_SCALE: tl.constexpr,
    ALIGNED: tl.constexpr,
    KEEPS_MAXIMA: tl.constexpr,
    TABLE_COLUMNS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One block of one tensor of the group: the update of the module docstring, in place.

    The *_proto pointers are the first tensor's, passed only for their element types (every tensor of a
    launch has the same ones); addresses come from the table row of the block's tensor. ALIGNED: every address
    of the table is a multiple of 16 bytes, which the compiler cannot know of an address it loads, so it is
    told; with it, and without a mask, a thread's elements move as 16-byte vectors instead of one load or store
    each (at 8B parameters the kernel took 52 ms of an H200 step, about half the copy bandwidth, with 2-byte
    loads). KEEPS_MAXIMA: some tensor of the launch keeps its block maxima; without, no block reduces its
    magnitudes (a bf16-sr job's launches).
    """
    state_dtype = state_proto_ptr.dtype.element_ty
    pid, row, param_ptr, grad_ptr = _table_row(
        table_ptr, block_tensor_ptr, param_proto_ptr, grad_proto_ptr, TABLE_COLUMNS, ALIGNED
    )
    exp_avg_ptr = tl.load(row + 2).to(tl.pointer_type(state_dtype))
    exp_avg_sq_ptr = tl.load(row + 3).to(tl.pointer_type(state_dtype))
    numel = tl.load(row + 4)
    group_offset = tl.load(row + 5)
    first_block = tl.load(row + 6)
    block_maxima = tl.load(row + 7)
    if ALIGNED:
        exp_avg_ptr = tl.multiple_of(exp_avg_ptr, 16)
        exp_avg_sq_ptr = tl.multiple_of(exp_avg_sq_ptr, 16)

    grad_scale, numel = _grad_scale_or_skip(grad_scale_ptr, numel, HAS_GRAD_SCALE)
    start = (pid - first_block) * BLOCK
    offsets = start + tl.arange(0, BLOCK)
    mask = offsets < numel
    if ALIGNED and start + BLOCK <= numel:
        block_max = _adamw_block(
            param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, offsets, mask, group_offset, grad_scale, constants,
            step_key, HAS_GRAD_SCALE=HAS_GRAD_SCALE, MASKED=False, BLOCK_MAX=KEEPS_MAXIMA,
        )  # fmt: skip
    else:
        block_max = _adamw_block(
            param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, offsets, mask, group_offset, grad_scale, constants,
            step_key, HAS_GRAD_SCALE=HAS_GRAD_SCALE, MASKED=True, BLOCK_MAX=KEEPS_MAXIMA,
        )  # fmt: skip
    # The block's largest stored magnitude, where the tensor keeps them (float8's weight scales: what its casts
    # would otherwise read the whole weight for). A skipped step (numel 0) wrote nothing and leaves them as well.
    if KEEPS_MAXIMA:
        if block_maxima != 0 and start < numel:
            tl.store(block_maxima.to(tl.pointer_type(tl.float32)) + (pid - first_block), block_max)


# ------------------------------------------------------------------------------------------------------------
# Step constants, launcher and reference
# ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _StepConstants:
    """The scalars of one step, as Python floats that both the kernel and the reference round to fp32. The
    kernels take them as one tuple in the order of these fields, which _adamw_update unpacks."""

    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    inv_sqrt_bias_correction2: float
    eps: float
    weight_decay_factor: float
    step_size: float

    @classmethod
    def of(
        cls, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float
    ) -> _StepConstants:
        if step < 1:
            raise ValueError(f"AdamW: step counts from 1, got {step}")
        return cls(
            beta1=beta1,
            one_minus_beta1=1.0 - beta1,
            beta2=beta2,
            one_minus_beta2=1.0 - beta2,
            inv_sqrt_bias_correction2=1.0 / (1.0 - beta2**step) ** 0.5,
            eps=eps,
            weight_decay_factor=1.0 - lr * weight_decay,
            step_size=lr / (1.0 - beta1**step),
        )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor that holds `tensor`'s local elements: an FSDP2 DTensor's local shard, or the tensor
    itself; either unwrapped from a subclass that wraps one plain tensor of its shape and dtype (torchao's
    weight for FSDP2's float8 all-gather). The kernels address memory through `data_ptr()`, which such a
    wrapper reports as 0: a step through it wrote to address 0."""
    if hasattr(tensor, "to_local"):
        tensor = tensor.to_local()
    while type(tensor) not in (torch.Tensor, torch.nn.Parameter) and hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        inner = [
            getattr(tensor, name)
            for name in names
            if getattr(tensor, name).shape == tensor.shape and getattr(tensor, name).dtype == tensor.dtype
        ]
        if len(inner) != 1:
            raise TypeError(
                f"{type(tensor).__name__} does not wrap one tensor of its shape whose memory a kernel can write"
            )
        tensor = inner[0]
    return tensor


@functools.lru_cache(maxsize=64)
def _block_map(numels: tuple[int, ...], block_size: int, device: torch.device) -> tuple[torch.Tensor, tuple]:
    """The tensor of each block (int32, on the device) and each tensor's first block; cached per layout."""
    blocks = [triton.cdiv(numel, block_size) for numel in numels]
    first_blocks = [0]
    for count in blocks[:-1]:
        first_blocks.append(first_blocks[-1] + count)
    block_tensor = torch.repeat_interleave(
        torch.arange(len(numels), dtype=torch.int32), torch.tensor(blocks, dtype=torch.int64)
    )
    return block_tensor.to(device), tuple(first_blocks)


@dataclass(frozen=True)
class KernelLaunch:
    """What an optimizer brings to launch_over_table: its kernel and launch settings, each tensor's
    `state_addresses` (the table's columns after param and grad), the state tensors whose element types the
    kernel reads (`state_prototypes`), columns after the shared ones (`trailing_columns`), whether the kernel
    is told that every address is a multiple of VECTOR_BYTES (`tells_alignment`, its ALIGNED), and the
    kernel's own `constexprs`."""

    kernel: Any
    state_addresses: Sequence[Sequence[int]]
    elements_per_program: int
    num_warps: int
    constexprs: dict[str, Any]
    state_prototypes: Sequence[torch.Tensor] = ()
    trailing_columns: Sequence[Sequence[int]] | None = None
    tells_alignment: bool = False


def launch_over_table(
    launch: KernelLaunch,
    members: Sequence[LaunchMember],
    constants: _StepConstants,
    step_key: int,
    grad_scale: torch.Tensor | None,
    *,
    owner: str,
) -> None:
    """One launch of an AdamW kernel over the local, contiguous tensors of `members`, which share their dtypes
    and step and which it finds through a table of addresses: the launch both fused optimizers share.

    Row of a tensor (int64): param and grad addresses, its state addresses, numel, element offset in the
    group, first program of the tensor in the launch, then its trailing columns. The kernel receives the
    table, the tensor of each program, the first param, grad and state prototypes (for their element types),
    the grad scale (the table in its place when there is none), the step's constants as one tuple, the signed
    step key, HAS_GRAD_SCALE, ALIGNED if the launch tells alignment, then its constexprs. `owner` names the
    optimizer in errors.
    """
    _, params, grads, _, element_offsets = zip(*members, strict=True)
    state_addresses, trailing_columns = launch.state_addresses, launch.trailing_columns
    constexprs = dict(launch.constexprs)
    device = params[0].device
    numels = tuple(p.numel() for p in params)
    program_tensor, first_programs = _block_map(numels, launch.elements_per_program, device)
    if trailing_columns is None:
        trailing_columns = [()] * len(params)
    rows = [
        [p.data_ptr(), g.data_ptr(), *state, n, offset, first, *trailing]
        for p, g, state, n, offset, first, trailing in zip(
            params,
            grads,
            state_addresses,
            numels,
            element_offsets,
            first_programs,
            trailing_columns,
            strict=True,
        )
    ]
    if launch.tells_alignment:
        address_columns = 2 + len(state_addresses[0])
        constexprs["ALIGNED"] = all(
            address % VECTOR_BYTES == 0 for row in rows for address in row[:address_columns]
        )
    table = torch.tensor(rows, dtype=torch.int64)
    if device.type != "cpu":
        # Grad addresses change every step (zero_grad(set_to_none=True)), so the table is sent each time; from
        # pinned memory the copy is queued without waiting for the GPU.
        table = table.pin_memory().to(device, non_blocking=True)
    if grad_scale is not None:
        if grad_scale.numel() != 1 or grad_scale.device != device:
            raise ValueError(
                f"{owner}: grad_scale must be one element on {device}, got shape "
                f"{tuple(grad_scale.shape)} on {grad_scale.device}"
            )
        grad_scale = grad_scale.to(torch.float32)
    step_key_signed = step_key - (1 << 32) if step_key >= 1 << 31 else step_key
    launch.kernel[(program_tensor.numel(),)](
        table,
        program_tensor,
        params[0],
        grads[0],
        *launch.state_prototypes,
        grad_scale if grad_scale is not None else table,
        astuple(constants),
        step_key_signed,
        HAS_GRAD_SCALE=grad_scale is not None,
        **constexprs,
        num_warps=launch.num_warps,
        # Fused multiply-adds would round differently from the reference's separate operations.
        enable_fp_fusion=False,
    )


class AdamWStepOptions(TypedDict, total=False):
    """The keywords of both step references besides their tensors (defaults and meaning: _reference_steps)."""

    step: Required[int]
    lr: Required[float]
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    seed: int
    grad_scale: torch.Tensor | None
    element_offsets: Sequence[int] | None


class _ReferenceUpdate(NamedTuple):
    """One tensor's new fp32 moments (and sqrt(exp_avg_sq)) and its two random words, for its state."""

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    root: torch.Tensor
    first_bits: torch.Tensor
    second_bits: torch.Tensor


def _reference_steps(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    moments: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    step: int,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    seed: int = 0,
    grad_scale: torch.Tensor | None = None,
    element_offsets: Sequence[int] | None = None,
) -> Iterator[_ReferenceUpdate]:
    """Both references' step, tensor by tensor, in place: the module docstring's update from each tensor's
    (exp_avg, exp_avg_sq) in `moments`, its parameter stored (bf16 rounded stochastically from the (seed,
    step, element index) bits, fp32 as computed), then its new moments yielded for the caller to store.
    Nothing when `grad_scale` is NaN (the non-finite guard). `step` is the step being taken (1 for the first);
    `element_offsets` are where each tensor starts in the group's element count (default: the tensors back to
    back, as the optimizers lay out a group)."""
    constants = _StepConstants.of(step, lr, betas[0], betas[1], eps, weight_decay)
    if grad_scale is not None and bool(torch.isnan(grad_scale).any()):
        return
    if element_offsets is None:
        element_offsets = _back_to_back_offsets(params)
    key = stochastic_rounding_key(seed, step)
    for param, grad, (exp_avg, exp_avg_sq), offset in zip(
        params, grads, moments, element_offsets, strict=True
    ):
        g = grad.to(torch.float32)
        if grad_scale is not None:
            g = g * grad_scale.to(torch.float32)
        m = exp_avg.to(torch.float32) * constants.beta1 + g * constants.one_minus_beta1
        v = exp_avg_sq.to(torch.float32) * constants.beta2 + (g * g) * constants.one_minus_beta2
        root = _sqrt_rn(v)
        denom = root * constants.inv_sqrt_bias_correction2 + constants.eps
        p = param.to(torch.float32) * constants.weight_decay_factor - _div_rn(m, denom) * constants.step_size
        index = offset + torch.arange(param.numel(), dtype=torch.int64, device=param.device)
        first, second = _random_bits_reference(index.view(param.shape), key)
        if param.dtype == torch.bfloat16:
            param.copy_(_round_stochastic_reference(p, first & 0xFFFF))
        else:
            param.copy_(p)
        yield _ReferenceUpdate(m, v, root, first, second)


def adamw_step_reference(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    **options: Unpack[AdamWStepOptions],
) -> None:
    """One AdamW step in pure PyTorch, in place, bit for bit the kernel's (the module docstring's math).

    `options`: `step` (the step being taken, 1 for the first) and `lr`, then `betas`, `eps`, `weight_decay`,
    `seed`, `grad_scale` and `element_offsets` (_reference_steps has their defaults). bf16 tensors are rounded
    stochastically from the (seed, step, element index) bits, fp32 ones stored as computed.
    """
    updates = _reference_steps(params, grads, zip(exp_avgs, exp_avg_sqs, strict=True), **options)
    for index, new in enumerate(updates):
        exp_avg, exp_avg_sq = exp_avgs[index], exp_avg_sqs[index]
        if exp_avg.dtype == torch.bfloat16:
            exp_avg.copy_(_round_stochastic_reference(new.exp_avg, new.first_bits >> 16))
            exp_avg_sq.copy_(_round_stochastic_reference(new.exp_avg_sq, new.second_bits & 0xFFFF))
        else:
            exp_avg.copy_(new.exp_avg)
            exp_avg_sq.copy_(new.exp_avg_sq)


def block_maxima_reference(tensor: torch.Tensor, block_size: int) -> torch.Tensor:
    """The largest magnitude in each `block_size` block of `tensor`'s elements (the last block may be shorter),
    as fp32: what the kernel writes for a tensor whose block maxima FusedAdamW keeps."""
    flat = tensor.detach().reshape(-1).abs().to(torch.float32)
    padded = torch.nn.functional.pad(flat, (0, (-flat.numel()) % block_size))
    return padded.view(-1, block_size).amax(dim=1)


def _sqrt_rn(value: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root. torch's own fp32 sqrt on CPU is not (it differed from the correctly
    rounded result in 17% of random inputs with torch 2.14 on AVX-512); computed in float64 and rounded once
    it is, since float64 has more than twice float32's precision."""
    return torch.sqrt(value.to(torch.float64)).to(torch.float32)


def _div_rn(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 division (float64 then one rounding, for the same reason as _sqrt_rn)."""
    return (numerator.to(torch.float64) / denominator.to(torch.float64)).to(torch.float32)


class AdamWHyperparameters(TypedDict, total=False):
    """The keywords both fused optimizers take besides their own (defaults: FusedOptimizerState's)."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    seed: int
    state_on_host: bool


# (param, its local tensor, contiguous local grad, state, element offset in the group): one tensor of a launch.
LaunchMember = tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any], int]


class FusedOptimizerState(torch.optim.Optimizer):
    """What the fused AdamW optimizers share: the hyperparameters and their checks, the step (which parameters,
    grouped into launches by dtypes and step count, the step's constants and random key, staging through host
    memory) and the state's life (made at a parameter's first step, kept in host memory when `host_state` does,
    loaded from a checkpoint). A subclass names its state tensors (`state_names`) and brings its launch settings,
    its new state, its `_launch` and how a saved state tensor is checked and loaded."""

    host_state: HostState | None
    # The state tensors of a parameter besides `step`; the first one's dtype is part of a launch's key.
    state_names: tuple[str, ...]

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        seed: int = 0,
        state_on_host: bool = False,
    ) -> None:
        name = type(self).__name__
        if not 0.0 <= lr:
            raise ValueError(f"{name}: lr must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"{name}: betas must lie in [0, 1), got {betas}")
        if not 0.0 <= eps:
            raise ValueError(f"{name}: eps must be >= 0, got {eps}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"{name}: weight_decay must be >= 0, got {weight_decay}")
        stochastic_rounding_key(seed, 0)  # validates the seed
        self.seed = seed
        self.host_state = HostState(self.state_names) if state_on_host else None
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    def _launch_settings(self) -> Any:
        raise NotImplementedError

    def _new_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _launch(
        self,
        members: Sequence[LaunchMember],
        constants: _StepConstants,
        step_key: int,
        grad_scale: torch.Tensor | None,
        settings: Any,
    ) -> None:
        """One kernel launch over `members` (non-empty, one dtype combination, device and step)."""
        launch = self._kernel_launch(members, settings)
        launch_over_table(launch, members, constants, step_key, grad_scale, owner=type(self).__name__)

    def _kernel_launch(self, members: Sequence[LaunchMember], settings: Any) -> KernelLaunch:
        """The subclass's kernel, launch settings and table columns for a launch over `members`."""
        raise NotImplementedError

    def _saved_in_this_layout(
        self, param_id: int, param: torch.Tensor, saved: dict[str, Any]
    ) -> dict[str, Any]:
        """`param`'s saved state as this optimizer lays it out (before anything is loaded): the saved dict itself
        when its layout is this one's, converted when it can be, refused when it cannot."""
        return saved

    def _loaded(self, param: torch.Tensor, saved: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A copy of one saved state tensor of `param`, on `device`, as this optimizer keeps it."""
        raise NotImplementedError

    @torch.no_grad()
    def step(  # type: ignore[override]
        self,
        closure=None,
        grad_scale: torch.Tensor | None = None,
        params: Sequence[torch.Tensor] | None = None,
    ):
        """One AdamW step of every parameter that has a gradient, or of `params` only; `grad_scale` multiplies
        the gradients."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        name = type(self).__name__
        settings = self._launch_settings()
        for group, members in parameters_to_update(self, params):
            lr = group["lr"]
            if isinstance(lr, torch.Tensor):
                raise TypeError(f"{name}: lr must be a Python float (a tensor would be read back every step)")
            beta1, beta2 = group["betas"]
            # (dtypes, device, step) -> tensors of one launch; offsets count every parameter of the group, so
            # the random bits of a parameter do not depend on which others have gradients this step.
            launches: dict[tuple, list[LaunchMember]] = {}
            for index, param, start in members:
                local_param = _local(param)
                grad = _local(param.grad)
                if grad.is_sparse:
                    raise RuntimeError(f"{name}: parameter {index} of its group has a sparse gradient")
                if not local_param.is_contiguous():
                    raise ValueError(f"{name}: parameter {index} of its group is not contiguous")
                state = self._state_of(param)
                state["step"] += 1
                step = int(state["step"].item())
                state_dtype = state[self.state_names[0]].dtype
                key = (local_param.dtype, grad.dtype, state_dtype, local_param.device, step)
                launches.setdefault(key, []).append((param, local_param, grad.contiguous(), state, start))
            for (_, _, _, device, step), members in launches.items():
                if device.type == "cpu" and not interpreted():
                    raise RuntimeError(
                        f"{name}: CPU tensors need the Triton interpreter (TRITON_INTERPRET=1); "
                        "use torch.optim.AdamW on CPU"
                    )
                members = [m for m in members if m[1].numel() > 0]
                if not members:
                    continue
                constants = _StepConstants.of(step, lr, beta1, beta2, group["eps"], group["weight_decay"])
                rounding_key = stochastic_rounding_key(self.seed, step)
                if self.host_state is None:
                    self._launch(members, constants, rounding_key, grad_scale, settings)
                    continue
                # One parameter at a time through the device buffers (the same offsets, so the same bits).
                for param, local_param, grad, state, start in members:
                    staged = self.host_state.stage(state, device)
                    self._launch(
                        [(param, local_param, grad, {**state, **staged}, start)], constants, rounding_key,
                        grad_scale, settings,
                    )  # fmt: skip
                    self.host_state.unstage(state, staged)
        return loss

    def _state_of(self, param: torch.Tensor) -> dict[str, Any]:
        """`param`'s state, made when it has none."""
        state = self.state[param]
        if not state:
            state.update(self._new_state(param))
            if self.host_state is not None:
                self.host_state.keep(state)
        return state

    def initialize_state(self) -> None:
        """Every parameter's state without a step: what a checkpoint is loaded over. (torch's distributed
        state-dict loader would otherwise step the optimizer on zero gradients of every parameter at once, as much
        memory again as the weights.)"""
        for group in self.param_groups:
            for param in group["params"]:
                self._state_of(param)

    def state_dict(self) -> dict[str, Any]:
        if self.host_state is not None:
            self.host_state.synchronize()  # the last step's copies back to host memory
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict: each parameter's saved state put in this optimizer's layout by the subclass's
        `_saved_in_this_layout` (FusedAdamW8bit requantizes a state saved on another sharding), then each state
        tensor copied from it by the subclass's `_loaded`.

        torch.optim.Optimizer casts floating state to the parameter's dtype on load, which would round an fp32
        state of bf16 parameters to bf16, or turn codes and fp32 scales into bf16; the state tensors are made
        again from the saved originals here. With the state in host memory, torch loads the groups alone (its
        load would put every state tensor on its parameter's device at once) and the saved tensors go to host
        memory one parameter at a time.
        """
        name = type(self).__name__
        saved_ids = [param_id for group in state_dict["param_groups"] for param_id in group["params"]]
        params = [param for group in self.param_groups for param in group["params"]]
        # Not strict: torch's load refuses groups of other sizes, with its own message.
        saved_states = []
        converted: dict[Any, dict[str, Any]] = {}
        for param_id, param in zip(saved_ids, params, strict=False):
            saved = state_dict["state"].get(param_id)
            if not saved:
                continue
            missing = [state_name for state_name in self.state_names if state_name not in saved]
            if missing:
                raise KeyError(
                    f"{name}: the saved state of parameter {param_id} has no {missing} (a checkpoint of "
                    "another optimizer?)"
                )
            in_this_layout = self._saved_in_this_layout(param_id, param, saved)
            if in_this_layout is not saved:
                converted[param_id] = in_this_layout
            saved_states.append((param, in_this_layout))
        if converted:
            state_dict = {**state_dict, "state": {**state_dict["state"], **converted}}
        super().load_state_dict(state_dict if self.host_state is None else {**state_dict, "state": {}})
        for param, saved in saved_states:
            state = self.state[param]
            device = param.device if self.host_state is None else torch.device("cpu")
            for state_name in self.state_names:
                state[state_name] = self._loaded(param, saved[state_name], device)
            state["step"] = torch.as_tensor(saved["step"], dtype=torch.float32).detach().clone().cpu()
            if self.host_state is not None:
                self.host_state.keep(state)


def parameters_to_update(
    optimizer: torch.optim.Optimizer, only: Sequence[torch.Tensor] | None
) -> list[tuple[dict[str, Any], list[tuple[int, torch.Tensor, int]]]]:
    """(group, [(index in the group, parameter, element offset in the group)]) of the parameters a step updates:
    every one with a gradient, or only those of `only` (the optimizer step inside the backward updates one
    parameter as soon as its gradient is complete). Offsets count every parameter of the group, so a
    parameter's random bits are the same whichever others are updated with it; with `only` they come from a
    table built once, so that stepping one parameter does not walk all the others."""
    if only is None:
        walked = []
        for group in optimizer.param_groups:
            members, offset = [], 0
            for index, param in enumerate(group["params"]):
                start, offset = offset, offset + _local(param).numel()
                if param.grad is not None:
                    members.append((index, param, start))
            walked.append((group, members))
        return walked
    table = getattr(optimizer, "_element_offsets", None)
    if table is None or len(table) != sum(len(g["params"]) for g in optimizer.param_groups):
        table = {}
        for group_index, group in enumerate(optimizer.param_groups):
            offset = 0
            for index, param in enumerate(group["params"]):
                table[id(param)] = (group_index, index, offset)
                offset += _local(param).numel()
        optimizer._element_offsets = table  # type: ignore[attr-defined]
    by_group: dict[int, list[tuple[int, torch.Tensor, int]]] = {}
    for param in only:
        group_index, index, start = table[id(param)]
        by_group.setdefault(group_index, []).append((index, param, start))
    return [(optimizer.param_groups[g], members) for g, members in by_group.items()]


def _back_to_back_offsets(tensors: Iterable[torch.Tensor]) -> list[int]:
    offsets, total = [], 0
    for tensor in tensors:
        offsets.append(total)
        total += tensor.numel()
    return offsets


def adamw_state_bytes_per_parameter(param_dtype: torch.dtype, state_dtype: torch.dtype | None = None) -> int:
    """Bytes of FusedAdamW state (exp_avg + exp_avg_sq) per parameter of `param_dtype`: 4 for bf16 parameters
    with the default bf16 state, 8 for fp32 parameters or an fp32 `state_dtype`."""
    return 2 * torch.empty((), dtype=_state_dtype(param_dtype, state_dtype)).element_size()


def gradient_clipping_scale(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor clip_grad_norm_ multiplies gradients by, min(1, max_norm / (norm + 1e-6)), left on the device
    for FusedAdamW.step(grad_scale=...) instead of a separate pass over the gradients. A non-finite norm gives
    NaN, which makes the step change nothing (the trainer then fails the job when it reads the loss)."""
    norm = total_norm.to(torch.float32)
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    return torch.where(torch.isfinite(norm), scale, torch.full_like(scale, float("nan")))


def _state_dtype(param_dtype: torch.dtype, state_dtype: torch.dtype | None) -> torch.dtype:
    if param_dtype not in _SUPPORTED_PARAM_DTYPES:
        raise TypeError(f"FusedAdamW: parameters must be bfloat16 or float32, got {param_dtype}")
    if param_dtype == torch.float32:
        return torch.float32
    return state_dtype or torch.bfloat16


# ------------------------------------------------------------------------------------------------------------
# Optimizer
# ------------------------------------------------------------------------------------------------------------


class FusedAdamW(FusedOptimizerState):
    """AdamW whose step is one Triton launch per parameter group, bf16 weights and state stochastically rounded.

    `state_dtype` is the dtype of exp_avg / exp_avg_sq for bf16 parameters: bf16 (default, rounded
    stochastically) or float32; fp32 parameters always keep fp32 state. `seed` fixes the rounding bits, so two
    runs with the same seed, inputs and step count give the same weights. `step(grad_scale=t)` multiplies every
    gradient by the one-element device tensor `t` (the clipping factor of `gradient_clipping_scale`) inside
    the kernel, with no host synchronisation. The state has torch.optim.AdamW's keys (`step` a float32 CPU
    scalar per parameter, `exp_avg`, `exp_avg_sq`), so checkpoints and the distributed state-dict helpers
    treat it like AdamW's. `state_on_host`: the moments live in host memory and each parameter's are staged on
    the device for its update (fusetune/kernels/host_state.py; not for FSDP2's DTensors): the same results, the
    state's GPU memory down to one parameter's, a copy in and out per step.
    """

    state_names = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        *,
        state_dtype: torch.dtype = torch.bfloat16,
        **hyperparameters: Unpack[AdamWHyperparameters],
    ) -> None:
        if state_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(
                f"FusedAdamW: state_dtype must be torch.bfloat16 or torch.float32, got {state_dtype}"
            )
        self.state_dtype = state_dtype
        self.block_maxima: dict[torch.Tensor, torch.Tensor] = {}
        super().__init__(params, **hyperparameters)
        for group in self.param_groups:
            for index, param in enumerate(group["params"]):
                _state_dtype(param.dtype, state_dtype)  # refuses fp16 and others now, not at the first step
                if self.host_state is not None and hasattr(param, "to_local"):
                    raise TypeError(
                        f"FusedAdamW: parameter {index} of its group is an FSDP2 DTensor; state_on_host keeps "
                        "whole tensors in host memory, FSDP2 already shards the state over the GPUs"
                    )

    @torch.no_grad()
    def keep_block_maxima(self, params: Iterable[torch.Tensor]) -> dict[torch.Tensor, torch.Tensor]:
        """For each of `params` (this optimizer's), an fp32 buffer of the largest magnitude in each block of its
        elements (the kernel's blocks; an FSDP2 parameter's: its local shard's), computed now and rewritten by
        every step from the values it stores, so that the largest magnitude of the whole tensor is a max over a
        few thousand values instead of a pass over its elements. Valid as long as this optimizer is what changes
        the parameters (the trainer keeps them once its weights are loaded, a resumed checkpoint's included)."""
        owned = {param for group in self.param_groups for param in group["params"]}
        block_size = adamw_launch_settings().block_size
        for param in params:
            if param not in owned:
                raise ValueError("FusedAdamW: block maxima are kept for this optimizer's parameters")
            self.block_maxima[param] = block_maxima_reference(_local(param), block_size)
        return self.block_maxima

    def _launch_settings(self) -> AdamWLaunchSettings:
        return adamw_launch_settings()

    def _new_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        dtype = _state_dtype(param.dtype, self.state_dtype)
        return {
            "step": torch.tensor(0.0, dtype=torch.float32),
            "exp_avg": _zeros_like_param(param, dtype),
            "exp_avg_sq": _zeros_like_param(param, dtype),
        }

    def _kernel_launch(self, members: Sequence[LaunchMember], settings: AdamWLaunchSettings) -> KernelLaunch:
        """`_adamw_kernel`; a tensor whose block maxima are kept gets them rewritten."""
        params, _, _, states, _ = zip(*members, strict=True)
        exp_avgs = [_local(state["exp_avg"]) for state in states]
        maxima = [self.block_maxima.get(param) for param in params]
        return KernelLaunch(
            _adamw_kernel,
            [
                (m.data_ptr(), _local(s["exp_avg_sq"]).data_ptr())
                for m, s in zip(exp_avgs, states, strict=True)
            ],
            elements_per_program=settings.block_size,
            num_warps=settings.num_warps,
            constexprs={
                "KEEPS_MAXIMA": any(b is not None for b in maxima),
                "TABLE_COLUMNS": _TABLE_COLUMNS,
                "BLOCK": settings.block_size,
            },
            state_prototypes=(exp_avgs[0],),
            trailing_columns=[(0 if b is None else b.data_ptr(),) for b in maxima],
            tells_alignment=True,
        )

    def _loaded(self, param: torch.Tensor, saved: torch.Tensor, device: torch.device) -> torch.Tensor:
        """exp_avg / exp_avg_sq in this optimizer's state dtype (a torch.optim.AdamW checkpoint's included)."""
        return saved.to(device=device, dtype=_state_dtype(param.dtype, self.state_dtype), copy=True)


def _zeros_like_param(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Zeros shaped like the parameter's local tensor; a DTensor of the same placement for a DTensor."""
    local = torch.zeros_like(_local(param), dtype=dtype, memory_format=torch.contiguous_format)
    if not hasattr(param, "to_local"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )
