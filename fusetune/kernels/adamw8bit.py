"""AdamW with 8-bit moments and bf16 weights: FusedAdamW's stochastically rounded update at about 2 bytes of
optimizer state per parameter instead of 4.

exp_avg (m) and exp_avg_sq (v) are kept blockwise quantized, as in 8-bit Adam: each block of `block_size`
consecutive elements of a tensor (256 by default; blocks restart at every tensor) keeps one fp32 scale, the
largest magnitude in the block, and one 8-bit code per element for its value relative to that. One kernel
launch per parameter group (per dtype combination and step count, as FusedAdamW) reads codes and scales,
dequantizes, takes the AdamW step of the weights and requantizes the new moments with fresh scales; per
element, in fp32:

    g      = grad * grad_scale                     (the clipping factor, a device scalar; NaN skips the step)
    m      = decode_signed(m_code) * m_scale
    r      = decode(r_code) * r_scale;  v = r * r  (the stored quantity is r = sqrt(v), see below)
    m      = m * beta1 + g * (1 - beta1)
    v      = v * beta2 + (g * g) * (1 - beta2)
    r      = sqrt(v)
    denom  = r * (1 / sqrt(1 - beta2^step)) + eps
    p      = p * (1 - lr * weight_decay) - (m / denom) * (lr / (1 - beta1^step))
    m_scale, r_scale = the largest |m|, r of the block
    m_code = encode(|m| / m_scale) and m's sign;  r_code = encode(r / r_scale)

The step uses m and v before they are requantized, as FusedAdamW's uses them before rounding (so the first
step's weights are FusedAdamW's with fp32 state, bit for bit). Every operation is one IEEE fp32 operation
(division and square root correctly rounded, no fused multiply-add), so the pure-PyTorch
`adamw8bit_step_reference` gives the kernel's bits. An optimizer has no backward: its math is the update above.

The code, and why (the quality test is tests/kernels/test_adamw_quality.py's 8-bit case; its numbers there):
- sqrt(v) rather than v. v = E[g^2] spans twice the binades of the gradients, and r is what the step divides
  by. Plain blockwise int8 of v itself rounds the v of many elements to 0 while their m is not, those steps
  divide by eps, and fine-tuning blows up: the quality test's worse variant.
- A small float relative to the block's scale, not evenly spaced levels: 4 exponent bits (16 binades below
  1.0, the top code being 1.0 exactly, so the block's largest element is stored without error; below 2^-14
  evenly spaced down to 0), 3 mantissa bits and a sign for m, 4 mantissa bits for r (a step of 3-6% of r).
  m and r of an element sit at about the same depth below their blocks' largest (|m| is about r or less), so
  both get the same range. In the quality test's small model evenly spaced codes of sqrt(v) did as well
  (measured once, within 0.2% of fp32, as this code); the 16 binades are for the larger spread of gradients
  within a block of a large model (outlier features), where 255 even levels of r reach only 2^-8.
- Codes rounded stochastically, from the same (seed, step, element) bits as the weights. With beta2 = 0.999,
  r moves by about 0.05% a step, far below half a code's step, so a code rounded to nearest stops following
  the gradient: it can jump up with a spike but never fall relative to its block's largest.
  tests/kernels/test_adamw8bit.py drops half of each block's gradients 4x: stochastic codes follow (0.997 of
  the exact sqrt(v)), nearest ones stay 1.21x too high. (In the quality test nearest codes came out 0.5% worse
  than these at lr 1e-4: a difference under its 1% margin, measured once.)
- One scale per 256-element block: 8 bytes per 256 parameters, so that an outlier raises the scale of its own
  block only. (In the small model one scale per tensor did as well: measured once.)

Encoding a value y in [0, 1] is FusedAdamW's rounding on a shorter mantissa: add random bits below the kept
ones of y's fp32 bit pattern and shift them off (a carry into the exponent is the correct rounding up); a
value below 2^-14 is first offset by 2^-14, rounded the same way, and the offset taken off again as one code.

Random bits: FusedAdamW's (adamw.py's docstring), drawn from (seed, step, the element's index in its group);
the weight uses the low 16 bits of the first hash, m's code its high 16, r's code the low 16 of the second.
The same seed and inputs give the same weights and state whatever the blocking, on every data-parallel rank.

fp32 parameters get the same 8-bit moments and an fp32 weight, stored as computed.

FSDP2 parameters (DTensors sharded on dim 0 over a 1-D mesh) are updated through their local shards, each
quantized in blocks of its own: blocks restart at every shard, as at every tensor, and a shard's tail block is
masked like any tensor's, so a rank keeps the codes of its shard's elements and the scales of its shard's
blocks only. The state is kept as DTensors, so that torch's distributed state-dict helpers gather and split it:
the codes shaped and placed like the parameter; the scales as a (world size, blocks of the largest shard)
tensor sharded on dim 0, one row per rank (a smaller shard's row ends in unused zeros). The blocks differ from
one process's (a block that straddles two shards there is two blocks here), so the same run on another number
of ranks rounds its moments differently: the curves agree within the codes' quantization step, not bit for bit.
A checkpoint's scales are those of its world size's shards, the (world size, blocks) shape says which, and the
parameter's shape and the number of blocks say the block size (two block sizes give the same number of blocks
only when each holds a whole shard, where their blocks are the same). `load_state_dict` loads a state saved in
this optimizer's layout as it is, and converts one saved in another (another number of ranks, unsharded or
sharded, another block size): each element's moments are decoded against its block's scale in the saved layout
(codes x scale, the full tensor's fp32 values) and encoded again in this layout's blocks, per shard under FSDP2,
per tensor unsharded, with fresh scales. Those codes are rounded to nearest, not stochastically: the conversion
happens once per resume, so the bias that keeps nearest codes from following a falling gradient (above) has no
steps to build up in, and its error is at most half a code step of the new block (the step's own rounding leaves
up to one). What cannot be converted is refused naming both: a state of a parameter of another shape, or
scales that no sharding and block size of this parameter give.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Unpack

import torch
import triton
import triton.language as tl

from fusetune.kernels._interpreter import interpreted
from fusetune.kernels.adamw import (
    AdamWHyperparameters,
    AdamWStepOptions,
    FusedOptimizerState,
    KernelLaunch,
    LaunchMember,
    _adamw_update,
    _div_rn,
    _grad_scale_or_skip,
    _local,
    _random_bits,
    _reference_steps,
    _round_stochastic,
    _table_row,
)

__all__ = [
    "AdamW8bitLaunchSettings",
    "FusedAdamW8bit",
    "adamw8bit_launch_settings",
    "adamw8bit_state_bytes_per_parameter",
    "adamw8bit_step_reference",
    "adamw8bit_zero_state",
    "dequantize_moments",
]

DEFAULT_BLOCK_SIZE = 256
# Mantissa bits of the two codes (both have 4 exponent bits): m's code keeps its eighth bit for the sign.
EXP_AVG_MANTISSA_BITS = 3
EXP_AVG_SQ_MANTISSA_BITS = 4
# The smallest normal value of the codes, 2^-14: 4 exponent bits below 1.0, the lowest kept for subnormals.
_MIN_NORMAL = 2.0**-14
# fp32 exponent of the codes' 2^0 minus their exponent bias (127 - 15): subtracted from the shifted fp32 bits.
_EXPONENT_OFFSET = 112
_SIGN_BIT = 0x80
# Columns of the per-launch address table (int64): param, grad, exp_avg codes and scales, exp_avg_sq codes and
# scales, numel, element offset of the tensor in the group, first program of the tensor in the launch.
_TABLE_COLUMNS = 9
_SUPPORTED_PARAM_DTYPES = (torch.bfloat16, torch.float32)
_STATE_KEYS = ("exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales")


@dataclass(frozen=True)
class AdamW8bitLaunchSettings:
    """Elements per program (a multiple of the quantization block) and warps of the 8-bit AdamW kernel."""

    elements_per_program: int
    num_warps: int


def adamw8bit_launch_settings(block_size: int = DEFAULT_BLOCK_SIZE) -> AdamW8bitLaunchSettings:
    """The kernel's launch settings for quantization blocks of `block_size` elements.

    GPU: one quantization block per program, 2 warps. The kernel does about a hundred fp32 operations per element
    (three correctly rounded divisions among them), and small programs keep more of them in flight: at the
    Llama-3.1-8B parameter set one block per program with 2 warps took 3.3x less time than 2048 elements with 8
    warps, and every larger program measured slower (benchmarks/results/h200-kernels.json, sections
    optimizer-8bit-sweep and optimizer-8b-sweep: `python3 -m benchmarks.kernels.optimizer --sweep-8bit`).
    Loads and stores stay masked and element-wide: the unmasked 16-byte vectors that made adamw.py's kernel 11%
    faster at 8B made this one slower there, 52.6 -> 58.2 ms (h200-kernels.md, optimizer-8b-before-vectors and
    optimizer-8b-vectors): its time goes to arithmetic, not to memory instructions.
    Interpreter: 512 elements, so CPU tests at a few thousand elements walk several programs per tensor.
    """
    if interpreted():
        return AdamW8bitLaunchSettings(elements_per_program=max(512, block_size), num_warps=8)
    return AdamW8bitLaunchSettings(elements_per_program=block_size, num_warps=2)


# ------------------------------------------------------------------------------------------------------------
# Codes: Triton
# ------------------------------------------------------------------------------------------------------------


@triton.jit
def _encode(value, random16, MANTISSA_BITS: tl.constexpr):
    """Code (uint32, below 2^(4 + MANTISSA_BITS)) of an fp32 `value` in [0, 1], rounded up with probability
    equal to its position between the two nearest codes' values, given 16 random bits."""
    small = value < 6.103515625e-05  # 2^-14, the smallest normal code value
    shifted = tl.where(small, value + 6.103515625e-05, value)
    bits = shifted.to(tl.uint32, bitcast=True)
    code = ((bits + (random16 << (7 - MANTISSA_BITS))) >> (23 - MANTISSA_BITS)) - (112 << MANTISSA_BITS)
    return tl.where(small, code - (1 << MANTISSA_BITS), code)


@triton.jit
def _decode(code, MANTISSA_BITS: tl.constexpr):
    """fp32 value in [0, 1] of a code of `_encode` (exact)."""
    normal = code >= (1 << MANTISSA_BITS)
    lifted = tl.where(normal, code, code + (1 << MANTISSA_BITS))
    value = ((lifted + (112 << MANTISSA_BITS)) << (23 - MANTISSA_BITS)).to(tl.float32, bitcast=True)
    return tl.where(normal, value, value - 6.103515625e-05)


# ------------------------------------------------------------------------------------------------------------
# Triton kernel
# ------------------------------------------------------------------------------------------------------------


# Its leading arguments are _adamw_kernel's on purpose: launch_over_table passes both kernels the same ones.
@triton.jit(do_not_specialize=["step_key"])
def _adamw8bit_kernel(
    table_ptr,
    program_tensor_ptr,
    param_proto_ptr,
    grad_proto_ptr,
    grad_scale_ptr,
    constants,
    step_key,
    HAS_GRAD_SCALE: tl.constexpr,
    TABLE_COLUMNS: tl.constexpr,
    QUANT_BLOCK: tl.constexpr,
    BLOCKS_PER_PROGRAM: tl.constexpr,
    M_MANTISSA_BITS: tl.constexpr,
    R_MANTISSA_BITS: tl.constexpr,
):
    """BLOCKS_PER_PROGRAM quantization blocks of one tensor of the group: the update of the module docstring,
    in place. The *_proto pointers are the first tensor's, passed only for their element types."""
    param_dtype = param_proto_ptr.dtype.element_ty
    pid, row, param_ptr, grad_ptr = _table_row(
        table_ptr, program_tensor_ptr, param_proto_ptr, grad_proto_ptr, TABLE_COLUMNS, ALIGNED=False
    )
    m_codes_ptr = tl.load(row + 2).to(tl.pointer_type(tl.uint8))
    m_scales_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    r_codes_ptr = tl.load(row + 4).to(tl.pointer_type(tl.uint8))
    r_scales_ptr = tl.load(row + 5).to(tl.pointer_type(tl.float32))
    numel = tl.load(row + 6)
    group_offset = tl.load(row + 7)
    first_program = tl.load(row + 8)

    grad_scale, numel = _grad_scale_or_skip(grad_scale_ptr, numel, HAS_GRAD_SCALE)
    blocks = (pid - first_program) * BLOCKS_PER_PROGRAM + tl.arange(0, BLOCKS_PER_PROGRAM)
    offsets = blocks[:, None] * QUANT_BLOCK + tl.arange(0, QUANT_BLOCK)[None, :]
    mask = offsets < numel
    block_mask = blocks * QUANT_BLOCK < numel

    grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    if HAS_GRAD_SCALE:
        grad = grad * grad_scale
    m_code = tl.load(m_codes_ptr + offsets, mask=mask, other=0).to(tl.uint32)
    r_code = tl.load(r_codes_ptr + offsets, mask=mask, other=0).to(tl.uint32)
    m_scale = tl.load(m_scales_ptr + blocks, mask=block_mask, other=0.0)
    r_scale = tl.load(r_scales_ptr + blocks, mask=block_mask, other=0.0)
    param = tl.load(param_ptr + offsets, mask=mask, other=0.0).to(tl.float32)

    m_magnitude = _decode(m_code & 0x7F, M_MANTISSA_BITS) * m_scale[:, None]
    exp_avg = tl.where(m_code >= 0x80, -m_magnitude, m_magnitude)
    root = _decode(r_code, R_MANTISSA_BITS) * r_scale[:, None]
    exp_avg_sq = root * root

    exp_avg, exp_avg_sq, root, param = _adamw_update(grad, exp_avg, exp_avg_sq, param, constants)

    first, second = _random_bits(group_offset + offsets, step_key)
    if param_dtype == tl.bfloat16:
        tl.store(param_ptr + offsets, _round_stochastic(param, first & 0xFFFF), mask=mask)
    else:
        tl.store(param_ptr + offsets, param, mask=mask)

    # Masked lanes hold m = v = 0, so they do not enter the maxima.
    new_m_scale = tl.max(tl.abs(exp_avg), axis=1)
    new_r_scale = tl.max(root, axis=1)
    m_ratio = tl.div_rn(tl.abs(exp_avg), tl.where(new_m_scale > 0, new_m_scale, 1.0)[:, None])
    r_ratio = tl.div_rn(root, tl.where(new_r_scale > 0, new_r_scale, 1.0)[:, None])
    m_code = _encode(m_ratio, first >> 16, M_MANTISSA_BITS)
    m_code = tl.where(exp_avg < 0, m_code | 0x80, m_code)
    r_code = _encode(r_ratio, second & 0xFFFF, R_MANTISSA_BITS)
    tl.store(m_codes_ptr + offsets, m_code.to(tl.uint8), mask=mask)
    tl.store(r_codes_ptr + offsets, r_code.to(tl.uint8), mask=mask)
    tl.store(m_scales_ptr + blocks, new_m_scale, mask=block_mask)
    tl.store(r_scales_ptr + blocks, new_r_scale, mask=block_mask)


# ------------------------------------------------------------------------------------------------------------
# Reference
# ------------------------------------------------------------------------------------------------------------


def _encode_reference(value: torch.Tensor, random16: torch.Tensor, mantissa_bits: int) -> torch.Tensor:
    """`_encode` in torch: int64 codes of fp32 values in [0, 1], given 16 random bits per element (int64)."""
    small = value < _MIN_NORMAL
    shifted = torch.where(small, value + _MIN_NORMAL, value)
    bits = shifted.view(torch.int32).to(torch.int64)
    code = ((bits + (random16 << (7 - mantissa_bits))) >> (23 - mantissa_bits)) - (
        _EXPONENT_OFFSET << mantissa_bits
    )
    return torch.where(small, code - (1 << mantissa_bits), code)


def _decode_reference(code: torch.Tensor, mantissa_bits: int) -> torch.Tensor:
    """`_decode` in torch: the fp32 value of int64 codes."""
    normal = code >= (1 << mantissa_bits)
    lifted = torch.where(normal, code, code + (1 << mantissa_bits))
    bits = (lifted + (_EXPONENT_OFFSET << mantissa_bits)) << (23 - mantissa_bits)
    value = bits.to(torch.int32).view(torch.float32)
    return torch.where(normal, value, value - _MIN_NORMAL)


def _per_element(block_values: torch.Tensor, shape: torch.Size, block_size: int) -> torch.Tensor:
    """Each element's block value (blocks of `block_size` consecutive elements of the flattened tensor)."""
    numel = shape.numel()
    return block_values.repeat_interleave(block_size)[:numel].view(shape)


def _block_max(values: torch.Tensor, block_size: int) -> torch.Tensor:
    """The largest of each block of `values` (non-negative), zero-padded to whole blocks."""
    flat = values.flatten()
    padded = torch.nn.functional.pad(flat, (0, -flat.numel() % block_size))
    return padded.view(-1, block_size).amax(dim=1)


def dequantize_moments(
    state: dict[str, torch.Tensor], block_size: int = DEFAULT_BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """(exp_avg, exp_avg_sq) in fp32 from one parameter's FusedAdamW8bit state: what the next step reads."""
    m_code = state["exp_avg_codes"].to(torch.int64)
    r_code = state["exp_avg_sq_codes"].to(torch.int64)
    shape = m_code.shape
    magnitude = _decode_reference(m_code & 0x7F, EXP_AVG_MANTISSA_BITS) * _per_element(
        state["exp_avg_scales"], shape, block_size
    )
    exp_avg = torch.where(m_code >= _SIGN_BIT, -magnitude, magnitude)
    root = _decode_reference(r_code, EXP_AVG_SQ_MANTISSA_BITS) * _per_element(
        state["exp_avg_sq_scales"], shape, block_size
    )
    return exp_avg, root * root


def _quantize_reference(
    values: torch.Tensor, random16: torch.Tensor | int, mantissa_bits: int, block_size: int, signed: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 codes and fp32 block scales of fp32 `values` (the kernel's requantization; `random16` an int
    gives every element the same bits, as _NEAREST does)."""
    magnitude = values.abs()
    scales = _block_max(magnitude, block_size)
    divisor = _per_element(torch.where(scales > 0, scales, 1.0), values.shape, block_size)
    code = _encode_reference(_div_rn(magnitude, divisor), random16, mantissa_bits)
    if signed:
        code = torch.where(values < 0, code | _SIGN_BIT, code)
    return code.to(torch.uint8), scales


def adamw8bit_step_reference(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    states: Sequence[dict[str, torch.Tensor]],
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    **options: Unpack[AdamWStepOptions],
) -> None:
    """One 8-bit AdamW step in pure PyTorch, in place, bit for bit the kernel's (the module docstring's math):
    adamw_step_reference's step on the decoded moments, which are then encoded again.

    `states[i]` holds parameter i's `exp_avg_codes`, `exp_avg_scales`, `exp_avg_sq_codes` and
    `exp_avg_sq_scales` (zeros before the first step: `adamw8bit_zero_state`), replaced by the new ones.
    `options`: adamw_step_reference's (`step` and `lr`, then `betas`, `eps`, `weight_decay`, `seed`,
    `grad_scale` and `element_offsets`, back to back by default as FusedAdamW8bit lays out a group).
    """
    decoded = (dequantize_moments(state, block_size) for state in states)
    for index, new in enumerate(_reference_steps(params, grads, decoded, **options)):
        m_codes, m_scales = _quantize_reference(
            new.exp_avg, new.first_bits >> 16, EXP_AVG_MANTISSA_BITS, block_size, signed=True
        )
        r_codes, r_scales = _quantize_reference(
            new.root, new.second_bits & 0xFFFF, EXP_AVG_SQ_MANTISSA_BITS, block_size, signed=False
        )
        state = states[index]
        state["exp_avg_codes"].copy_(m_codes)
        state["exp_avg_scales"].copy_(m_scales)
        state["exp_avg_sq_codes"].copy_(r_codes)
        state["exp_avg_sq_scales"].copy_(r_scales)


def adamw8bit_zero_state(
    param: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE
) -> dict[str, torch.Tensor]:
    """Zero moments for `param`: codes shaped like it (uint8), one fp32 scale per block of its elements."""
    blocks = triton.cdiv(param.numel(), block_size)
    codes = {"dtype": torch.uint8, "memory_format": torch.contiguous_format}
    return {
        "exp_avg_codes": torch.zeros_like(param, **codes),
        "exp_avg_scales": torch.zeros(blocks, dtype=torch.float32, device=param.device),
        "exp_avg_sq_codes": torch.zeros_like(param, **codes),
        "exp_avg_sq_scales": torch.zeros(blocks, dtype=torch.float32, device=param.device),
    }


def adamw8bit_state_bytes_per_parameter(block_size: int = DEFAULT_BLOCK_SIZE) -> float:
    """Bytes of FusedAdamW8bit state per parameter: two 1-byte codes and two fp32 scales per block (2.03125 at
    the default 256-element blocks; FusedAdamW's bf16 state takes 4)."""
    return 2 + 2 * 4 / block_size


def _check_sharding(param: torch.Tensor, index: int, state_on_host: bool) -> None:
    """Refuse a DTensor parameter whose shards the 8-bit state cannot follow: only FSDP2's (dim 0 over a
    1-D mesh), and not with the state in host memory (FSDP2 already shards it over the GPUs)."""
    from torch.distributed.tensor import Shard

    if state_on_host:
        raise TypeError(
            f"FusedAdamW8bit: parameter {index} of its group is an FSDP2 DTensor; state_on_host keeps whole "
            "tensors in host memory, FSDP2 already shards the state over the GPUs"
        )
    if param.device_mesh.ndim != 1 or tuple(param.placements) != (Shard(0),):
        raise TypeError(
            f"FusedAdamW8bit: parameter {index} of its group is a DTensor placed {tuple(param.placements)} on "
            f"a {param.device_mesh.ndim}-D mesh; the 8-bit state follows FSDP2's sharding only (Shard(0) on "
            "a 1-D mesh)"
        )


def _shard_bounds(shape: torch.Size, world_size: int) -> list[tuple[int, int]]:
    """The [start, end) elements of each rank's shard of a tensor of `shape` sharded on dim 0 over `world_size`
    ranks: torch.chunk's split, which FSDP2 and DTensor use, gives the leading ranks ceil(rows / world size)
    rows each, the last ones what is left (possibly nothing). A 0-d tensor is one row."""
    rows = shape[0] if len(shape) else 1
    row_numel = shape.numel() // rows if rows else 0
    rows_per_shard = triton.cdiv(rows, world_size)
    return [
        (min(rank * rows_per_shard, rows) * row_numel, min((rank + 1) * rows_per_shard, rows) * row_numel)
        for rank in range(world_size)
    ]


@dataclass(frozen=True)
class _QuantizationLayout:
    """Where a parameter's quantization blocks lie: `block_size` elements each, from the first element of each
    of `world_size` FSDP2 shards (the module docstring's layout), or of the whole tensor when `world_size` is
    None (an unsharded optimizer)."""

    world_size: int | None
    block_size: int

    def shards(self, shape: torch.Size) -> list[tuple[int, int]]:
        """The [start, end) elements of each run of blocks: each rank's shard, or the whole tensor."""
        if self.world_size is None:
            return [(0, shape.numel())]
        return _shard_bounds(shape, self.world_size)

    def scales_shape(self, shape: torch.Size) -> tuple[int, ...]:
        """The (global) shape of the scales: one per block, or one row per rank of the largest shard's."""
        if self.world_size is None:
            return (triton.cdiv(shape.numel(), self.block_size),)
        largest = max(end - start for start, end in self.shards(shape))
        return (self.world_size, triton.cdiv(largest, self.block_size))

    def describe(self) -> str:
        where = "unsharded" if self.world_size is None else f"sharded over {self.world_size} FSDP2 ranks"
        return f"{where}, blocks of {self.block_size}"


def _layout_of(param: torch.Tensor, block_size: int) -> _QuantizationLayout:
    """The layout an optimizer of `block_size` keeps `param`'s state in."""
    return _QuantizationLayout(param.device_mesh.size() if hasattr(param, "to_local") else None, block_size)


def _scales_shape(param: torch.Tensor, block_size: int) -> tuple[int, ...]:
    """The (global) shape of a parameter's scales: one per block, or one row per rank under FSDP2."""
    return _layout_of(param, block_size).scales_shape(param.shape)


def _sharded(local: torch.Tensor, param: torch.Tensor, global_shape: tuple[int, ...]) -> torch.Tensor:
    """`local` as this rank's part of a DTensor of `global_shape`, sharded on dim 0 over `param`'s mesh."""
    from torch.distributed.tensor import DTensor, Shard

    stride = torch.empty(global_shape, device="meta").stride()
    return DTensor.from_local(
        local, param.device_mesh, [Shard(0)], run_check=False, shape=torch.Size(global_shape), stride=stride
    )


def _sharded_zero_state(param: torch.Tensor, block_size: int) -> dict[str, torch.Tensor]:
    """Zero moments of an FSDP2 parameter (the module docstring's layout): codes a uint8 DTensor placed like
    it, scales a (world size, blocks of the largest shard) DTensor, one row per rank."""
    local = _local(param)
    shape = _scales_shape(param, block_size)
    codes = {"dtype": torch.uint8, "memory_format": torch.contiguous_format}

    def scales() -> torch.Tensor:
        return _sharded(torch.zeros((1, shape[1]), dtype=torch.float32, device=local.device), param, shape)

    return {
        "exp_avg_codes": _sharded(torch.zeros_like(local, **codes), param, tuple(param.shape)),
        "exp_avg_scales": scales(),
        "exp_avg_sq_codes": _sharded(torch.zeros_like(local, **codes), param, tuple(param.shape)),
        "exp_avg_sq_scales": scales(),
    }


# ------------------------------------------------------------------------------------------------------------
# Conversion of a state saved in another layout (the module docstring's last paragraph)
# ------------------------------------------------------------------------------------------------------------

# The block sizes FusedAdamW8bit takes (powers of two from 32 to 4096): those a saved state may have used.
_BLOCK_SIZES = tuple(2**exponent for exponent in range(5, 13))
# 16 "random" bits at half their range: the codes' rounding becomes round to nearest (ties up).
_NEAREST = 0x8000


def _saved_layout(
    shape: torch.Size, scales_shape: tuple[int, ...], preferred_block_size: int
) -> _QuantizationLayout | None:
    """The layout whose scales a parameter of `shape` has in `scales_shape`, or None if no layout gives it.
    Where several block sizes do (each block then holds a whole shard), their blocks are the same; the
    preferred one is taken."""
    if len(scales_shape) == 1:
        world_size = None
    elif len(scales_shape) == 2 and scales_shape[0] >= 1:
        world_size = scales_shape[0]
    else:
        return None
    for block_size in (preferred_block_size, *_BLOCK_SIZES):
        layout = _QuantizationLayout(world_size, block_size)
        if layout.scales_shape(shape) == scales_shape:
            return layout
    return None


def _element_range(param: torch.Tensor) -> tuple[int, int]:
    """The [start, end) elements of the whole tensor that this rank keeps of `param`: its shard's, or all."""
    if not hasattr(param, "to_local"):
        return 0, param.numel()
    return _shard_bounds(param.shape, param.device_mesh.size())[param.device_mesh.get_local_rank()]


def _saved_elements(saved: torch.Tensor, param: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Elements [start, end) of a saved tensor shaped like `param`, flat: the local part of a DTensor placed
    like `param` (torch's full-state-dict loader splits the saved tensor so), else cut from the whole one."""
    if hasattr(saved, "to_local"):
        if (
            hasattr(param, "to_local")
            and saved.device_mesh == param.device_mesh
            and tuple(saved.placements) == tuple(param.placements)
        ):
            return saved.to_local().reshape(-1)
        saved = saved.full_tensor()
    return saved.reshape(-1)[start:end]


def _saved_element_scales(
    scales: torch.Tensor, layout: _QuantizationLayout, shape: torch.Size, start: int, end: int
) -> torch.Tensor:
    """The fp32 scale of each element [start, end) of a tensor of `shape`: its block's in `layout`, whose
    scales are `scales` (the whole (shards, blocks) tensor, or (1, blocks) unsharded)."""
    pieces = []
    for shard, (shard_start, shard_end) in enumerate(layout.shards(shape)):
        first, last = max(shard_start, start), min(shard_end, end)
        if first >= last:
            continue
        first_block = (first - shard_start) // layout.block_size
        end_block = triton.cdiv(last - shard_start, layout.block_size)
        per_element = scales[shard, first_block:end_block].repeat_interleave(layout.block_size)
        skipped = first - shard_start - first_block * layout.block_size
        pieces.append(per_element[skipped : skipped + last - first])
    if not pieces:
        return torch.zeros(0, dtype=torch.float32, device=scales.device)
    return torch.cat(pieces)


def _decoded(codes: torch.Tensor, scales: torch.Tensor, mantissa_bits: int, signed: bool) -> torch.Tensor:
    """fp32 values of uint8 `codes` against their elements' `scales` (codes x scale, the sign bit for m)."""
    code = codes.to(torch.int64)
    magnitude = _decode_reference(code & 0x7F if signed else code, mantissa_bits) * scales
    return torch.where(code >= _SIGN_BIT, -magnitude, magnitude) if signed else magnitude


def _requantized(
    param: torch.Tensor, saved: dict[str, torch.Tensor], there: _QuantizationLayout, here: _QuantizationLayout
) -> dict[str, torch.Tensor]:
    """`param`'s saved codes and scales, laid out in `there`, decoded and encoded again (rounded to nearest)
    in `here`: this rank's part, as _new_state keeps it. Collective under FSDP2 (every rank gathers the saved
    scales whole: a rank's elements may lie in blocks another rank's row holds)."""
    shape = param.shape
    start, end = _element_range(param)
    moments = {}
    for name, mantissa_bits, signed in (
        ("exp_avg", EXP_AVG_MANTISSA_BITS, True),
        ("exp_avg_sq", EXP_AVG_SQ_MANTISSA_BITS, False),
    ):
        scales = saved[f"{name}_scales"]
        scales = (scales.full_tensor() if hasattr(scales, "to_local") else scales).to(torch.float32)
        codes = _saved_elements(saved[f"{name}_codes"], param, start, end)
        element_scales = _saved_element_scales(
            scales.reshape(len(there.shards(shape)), -1), there, shape, start, end
        )
        values = _decoded(codes, element_scales.to(codes.device), mantissa_bits, signed)
        new_codes, new_scales = _quantize_reference(values, _NEAREST, mantissa_bits, here.block_size, signed)
        if here.world_size is None:
            moments[f"{name}_codes"] = new_codes.view(shape)
            moments[f"{name}_scales"] = new_scales
        else:
            local_shape = param.to_local().shape
            scales_shape = here.scales_shape(shape)
            row = torch.zeros((1, scales_shape[1]), dtype=torch.float32, device=new_scales.device)
            row[0, : new_scales.numel()] = new_scales
            moments[f"{name}_codes"] = _sharded(new_codes.view(local_shape), param, tuple(shape))
            moments[f"{name}_scales"] = _sharded(row, param, scales_shape)
    return moments


# ------------------------------------------------------------------------------------------------------------
# Optimizer
# ------------------------------------------------------------------------------------------------------------


class FusedAdamW8bit(FusedOptimizerState):
    """AdamW with blockwise 8-bit moments; one Triton launch per parameter group; bf16 weights and the codes
    rounded stochastically.

    `seed` fixes the rounding bits: the same seed, inputs and step count give the same weights and state.
    `block_size` (a power of two, 32 to 4096) is the quantization block; it is part of the state's layout, so a
    checkpoint loads only into an optimizer with the same one. `step(grad_scale=t)` multiplies every gradient by
    the one-element device tensor `t` (`gradient_clipping_scale`'s clipping factor) inside the kernel; a NaN `t`
    leaves weights and state as they are. The state per parameter is `step` (a float32 CPU scalar, as
    torch.optim.AdamW's) and the `exp_avg_codes` / `exp_avg_scales` / `exp_avg_sq_codes` / `exp_avg_sq_scales`
    tensors (`dequantize_moments` turns them into fp32 moments). `state_on_host`: those tensors live in host
    memory and each parameter's are staged on the device for its update (fusetune/kernels/host_state.py): the
    same results, the state's GPU memory down to one parameter's, a copy in and out per step.
    """

    state_names = _STATE_KEYS

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        **hyperparameters: Unpack[AdamWHyperparameters],
    ) -> None:
        if not (32 <= block_size <= 4096 and block_size & (block_size - 1) == 0):
            raise ValueError(
                f"FusedAdamW8bit: block_size must be a power of two from 32 to 4096, got {block_size}"
            )
        self.block_size = block_size
        super().__init__(params, **hyperparameters)
        for group in self.param_groups:
            for index, param in enumerate(group["params"]):
                if param.dtype not in _SUPPORTED_PARAM_DTYPES:
                    raise TypeError(
                        f"FusedAdamW8bit: parameters must be bfloat16 or float32, got {param.dtype}"
                    )
                if hasattr(param, "to_local"):
                    _check_sharding(param, index, self.host_state is not None)

    def _launch_settings(self) -> AdamW8bitLaunchSettings:
        settings = adamw8bit_launch_settings(self.block_size)
        if settings.elements_per_program % self.block_size:
            raise ValueError(
                f"FusedAdamW8bit: elements_per_program ({settings.elements_per_program}) must be a multiple of "
                f"block_size ({self.block_size})"
            )
        return settings

    def _new_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        if hasattr(param, "to_local"):
            zeros = _sharded_zero_state(param, self.block_size)
        else:
            zeros = adamw8bit_zero_state(param, self.block_size)
        return {"step": torch.tensor(0.0, dtype=torch.float32), **zeros}

    def _kernel_launch(
        self, members: Sequence[LaunchMember], settings: AdamW8bitLaunchSettings
    ) -> KernelLaunch:
        """`_adamw8bit_kernel`, on the masked path (adamw8bit_launch_settings says why)."""
        states = [state for _, _, _, state, _ in members]
        return KernelLaunch(
            _adamw8bit_kernel,
            [[_local(state[name]).data_ptr() for name in _STATE_KEYS] for state in states],
            elements_per_program=settings.elements_per_program,
            num_warps=settings.num_warps,
            constexprs={
                "TABLE_COLUMNS": _TABLE_COLUMNS,
                "QUANT_BLOCK": self.block_size,
                "BLOCKS_PER_PROGRAM": settings.elements_per_program // self.block_size,
                "M_MANTISSA_BITS": EXP_AVG_MANTISSA_BITS,
                "R_MANTISSA_BITS": EXP_AVG_SQ_MANTISSA_BITS,
            },
        )

    def _saved_in_this_layout(
        self, param_id: int, param: torch.Tensor, saved: dict[str, Any]
    ) -> dict[str, Any]:
        """The saved state as it is when its scales are of this optimizer's layout (this block size, this
        parameter's sharding: a DTensor's shape is its global one); else converted from the layout its scales'
        shape says (the module docstring's last paragraph), or refused if none does."""
        here = _layout_of(param, self.block_size)
        shape = param.shape
        scales_shape = tuple(saved["exp_avg_scales"].shape)
        if scales_shape == here.scales_shape(shape) and tuple(saved["exp_avg_codes"].shape) == tuple(shape):
            return saved
        prefix = f"FusedAdamW8bit: the saved state of parameter {param_id}"
        codes_shape = tuple(saved["exp_avg_codes"].shape)
        if codes_shape != tuple(shape) or tuple(saved["exp_avg_sq_codes"].shape) != tuple(shape):
            raise ValueError(
                f"{prefix} has codes shaped {codes_shape}, and this parameter is shaped {tuple(shape)}: a state "
                "of another parameter cannot be converted (a checkpoint of another model, or of its parameters "
                "in another order?)"
            )
        there = _saved_layout(shape, scales_shape, self.block_size)
        if there is None or tuple(saved["exp_avg_sq_scales"].shape) != scales_shape:
            raise ValueError(
                f"{prefix} has scales shaped {scales_shape} (exp_avg) and "
                f"{tuple(saved['exp_avg_sq_scales'].shape)} (exp_avg_sq), which no sharding and block size "
                f"(32 to 4096) of a parameter shaped {tuple(shape)} give: it cannot be converted to this "
                f"run's layout ({here.describe()})"
            )
        return {**saved, **_requantized(param, saved, there, here)}

    def _loaded(self, param: torch.Tensor, saved: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Codes and scales as saved, exactly (uint8 and fp32)."""
        return saved.to(device=device, copy=True).contiguous()
