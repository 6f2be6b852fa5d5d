"""What the kernels do differently under the Triton interpreter, so CPU tests see the GPU's numbers.

The interpreter (``TRITON_INTERPRET=1``, set by the tests on machines without a GPU) runs the kernels on CPU
tensors with numpy, and its float32 -> bfloat16 conversion truncates where the GPU rounds to nearest even.
Kernels that store bfloat16 take a ``SOFTWARE_BF16_ROUNDING: tl.constexpr`` set to ``interpreted()`` and
convert through ``round_to_dtype``, which then rounds in integer arithmetic first. On the GPU the flag is
False and the helper is a plain ``.to(dtype)``: the branch is resolved at compile time and costs nothing.
"""

import os

import triton
import triton.language as tl

__all__ = ["interpreted", "round_to_dtype"]


def interpreted() -> bool:
    """True when Triton runs the kernels in its CPU interpreter rather than compiling them for a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


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
