"""What the kernels do differently under the Triton interpreter, so CPU tests see the GPU's numbers.

The interpreter (``TRITON_INTERPRET=1``, set by the tests on machines without a GPU) runs the kernels on CPU
tensors with numpy, and its float32 -> bfloat16 conversion truncates where the GPU rounds to nearest even.
Kernels that store bfloat16 take a ``SOFTWARE_BF16_ROUNDING: tl.constexpr`` set to ``interpreted()`` and
convert through ``round_to_dtype``, which then rounds in integer arithmetic first. On the GPU the flag is
False and the helper is a plain ``.to(dtype)``: the branch is resolved at compile time and costs nothing.
"""

import os

import torch
import triton
import triton.language as tl

__all__ = ["interpreted", "launchable", "round_to_dtype", "round_to_float8", "store_rounded"]


def interpreted() -> bool:
    """True when Triton runs the kernels in its CPU interpreter rather than compiling them for a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def launchable(kernel, traced: bool):
    """`kernel` ready to launch from a torch.library op (`traced`: through wrap_triton, so that torch.compile
    traces the launch) or from eager code (as is). Under the interpreter nothing is compiled (torch.compile of a
    triton_op fails there), and torch 2.11 with Triton 3.6 (the GPU image's) refuses to wrap an interpreted
    kernel ("wrap_triton only works on functions annotated with triton.jit"), so it is launched as is."""
    return torch.library.wrap_triton(kernel) if traced and not interpreted() else kernel


@triton.jit
def round_to_dtype(value, dtype: tl.constexpr, SOFTWARE_BF16_ROUNDING: tl.constexpr):
    """float32 `value` converted to `dtype`, rounding to nearest even also under the interpreter.

    Adding 0x7FFF plus the lowest kept bit to the float32 bits and dropping the low 16 rounds the upper half
    to nearest even (a carry into the exponent is the correct rounding up, to inf included). A NaN is made
    quiet instead, so that its upper half is still a NaN: its payload may lie all in the dropped bits, and
    the addition could carry it into an inf or wrap it around to zero. The upper half is then reinterpreted
    as bfloat16 rather than converted, because the interpreter's conversion also mangles subnormals.
    """
    if SOFTWARE_BF16_ROUNDING and dtype == tl.bfloat16:
        bits = value.to(tl.uint32, bitcast=True)
        rounded = bits + 0x7FFF + ((bits >> 16) & 1)
        bits = tl.where(value != value, bits | 0x400000, rounded)
        converted = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        converted = value.to(dtype)
    return converted


@triton.jit
def store_rounded(pointers, value, mask, SOFTWARE_BF16_ROUNDING: tl.constexpr):
    """Stores float32 `value` at `pointers` in their element type, converted by round_to_dtype."""
    tl.store(pointers, round_to_dtype(value, pointers.dtype.element_ty, SOFTWARE_BF16_ROUNDING), mask=mask)


@triton.jit
def round_to_float8(value, dtype: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr):
    """float32 `value`, already clamped to the float8 format's finite range, converted to `dtype` (float8e4nv:
    e4m3fn, or float8e5: e5m2) rounding to nearest even, as the GPU's conversion and torch's do; the
    interpreter's conversion does not.

    SOFTWARE_ROUNDING builds the bits in integer arithmetic: a normal number keeps 3 (e4m3) or 2 (e5m2) of its
    23 mantissa bits, rounded as in round_to_dtype, and its exponent is rebiased (127 to 7, or to 15) by one
    subtraction, a carry from the rounding included; below the smallest normal (2^-6, or 2^-14) the format's
    step is fixed (2^-9, or 2^-16), and adding then subtracting 2^23 rounds the count of steps to an even
    integer. A NaN becomes the format's NaN."""
    if SOFTWARE_ROUNDING:
        if dtype == tl.float8e4nv:
            dropped: tl.constexpr = 20
            rebias: tl.constexpr = (127 - 7) << 3
            smallest_normal: tl.constexpr = 0.015625
            subnormal_steps: tl.constexpr = 512.0
        else:
            dropped: tl.constexpr = 21
            rebias: tl.constexpr = (127 - 15) << 2
            smallest_normal: tl.constexpr = 6.103515625e-05
            subnormal_steps: tl.constexpr = 65536.0
        bits = value.to(tl.uint32, bitcast=True)
        sign = (bits >> 24) & 0x80
        magnitude_bits = bits & 0x7FFFFFFF
        magnitude = magnitude_bits.to(tl.float32, bitcast=True)
        normal = (magnitude_bits + ((1 << (dropped - 1)) - 1) + ((magnitude_bits >> dropped) & 1)) >> dropped
        normal = normal - rebias
        steps = (magnitude * subnormal_steps + 8388608.0) - 8388608.0
        code = tl.where(magnitude < smallest_normal, steps.to(tl.uint32), normal)
        code = tl.where(value != value, 0x7F, code) | sign
        converted = code.to(tl.uint8).to(dtype, bitcast=True)
    else:
        converted = value.to(dtype)
    return converted
