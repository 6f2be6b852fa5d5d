"""round_to_dtype: the kernels' float32 -> storage conversion gives the GPU's round-to-nearest-even bits, also
under the Triton interpreter (whose own bfloat16 conversion truncates)."""

import importlib.util
import inspect

import pytest
import torch
import triton
import triton.language as tl

from fusetune.kernels._interpreter import interpreted, round_to_dtype


@triton.jit
def _convert_kernel(x_ptr, out_ptr, n_elements, BLOCK: tl.constexpr, SOFTWARE_BF16_ROUNDING: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    tl.store(
        out_ptr + offsets, round_to_dtype(x, out_ptr.dtype.element_ty, SOFTWARE_BF16_ROUNDING), mask=mask
    )


def _convert(
    x: torch.Tensor, dtype: torch.dtype, software_bf16_rounding: bool, kernel=_convert_kernel
) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    block = 128
    kernel[(triton.cdiv(x.numel(), block),)](
        x, out, x.numel(), BLOCK=block, SOFTWARE_BF16_ROUNDING=software_bf16_rounding
    )
    return out


def _edge_cases(device: str) -> torch.Tensor:
    """float32 values whose bfloat16 rounding is easy to get wrong, then random ones of every magnitude."""
    bit_patterns = [
        0x3F808000,  # 1 + 2^-8: a tie, rounds down to the even 1.0
        0x3F818000,  # a tie whose lower neighbour is odd: rounds up
        0x3F808001,  # just above a tie: up
        0x3F807FFF,  # just below a tie: down
        0xBF818000,  # a negative tie
        0x7F7FFFFF,  # the largest float32: rounds up to inf
        0x7F7F7FFF,  # stays the largest bfloat16
        0x00008000,  # subnormal tie
        0x00018000,  # subnormal tie, odd neighbour
        0x80000000,  # -0.0
        0x7F800000,  # inf
        0xFF800000,  # -inf
        0x7FC00000,  # the usual NaN
        0x7F800001,  # a NaN whose payload is all in the dropped bits (naive rounding turns it into inf)
        0xFFFFFFFF,  # a NaN that naive rounding wraps around to 0
    ]
    special = torch.tensor(bit_patterns, dtype=torch.int64).to(torch.int32).view(torch.float32)
    generator = torch.Generator().manual_seed(0)
    exponents = torch.randint(-60, 60, (600,), generator=generator).float()
    random = torch.randn(600, generator=generator) * torch.exp2(exponents)
    return torch.cat([special, random]).to(device)


def _assert_same_values(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal bit for bit, except that any NaN matches any NaN."""
    nan = expected.isnan()
    assert torch.equal(actual.isnan(), nan)
    bits = torch.int16 if expected.element_size() == 2 else torch.int32
    assert torch.equal(actual[~nan].view(bits), expected[~nan].view(bits))


# numpy's float32 -> float16 cast in the CPU interpreter warns on the values that become inf.
@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_rounds_to_nearest_even_like_torch(dtype, device):
    """As the kernels call it: software rounding under the interpreter, the hardware conversion on a GPU."""
    x = _edge_cases(device)
    _assert_same_values(_convert(x, dtype, interpreted()), x.to(dtype))


def test_software_rounding_rounds_to_nearest_even_on_any_device(device):
    """The integer rounding itself, also where the hardware would not need it."""
    x = _edge_cases(device)
    _assert_same_values(_convert(x, torch.bfloat16, True), x.to(torch.bfloat16))


def test_without_software_rounding_the_interpreter_truncates(device):
    """The interpreter's own conversion fails the same comparison, so the tests above can fail."""
    if not interpreted():
        pytest.skip("on the GPU the hardware conversion already rounds to nearest even")
    x = _edge_cases(device)
    with pytest.raises(AssertionError):
        _assert_same_values(_convert(x, torch.bfloat16, False), x.to(torch.bfloat16))


def _mutant_kernel(old: str, new: str, tmp_path):
    """The conversion kernel with a copy of round_to_dtype that has one source edit, as a fresh module."""
    helper = inspect.getsource(round_to_dtype.fn)
    assert helper.count(old) == 1, f"mutation target not found exactly once: {old!r}"
    source = helper.replace(old, new) + "\n\n" + inspect.getsource(_convert_kernel.fn)
    path = tmp_path / "round_to_dtype_mutant.py"
    path.write_text("import triton\nimport triton.language as tl\n\n\n" + source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._convert_kernel


@pytest.mark.parametrize(
    ("old", "new"),
    [
        pytest.param("bits + 0x7FFF + ((bits >> 16) & 1)", "bits + 0x8000", id="ties-round-away-from-zero"),
        pytest.param("bits + 0x7FFF + ((bits >> 16) & 1)", "bits", id="truncates"),
        pytest.param("bits | 0x400000", "bits", id="nan-payload-dropped"),
        pytest.param("(bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)", "(bits >> 16).to(tl.uint16)"
                     ".to(tl.float16, bitcast=True).to(tl.bfloat16)", id="reads-the-bits-as-float16"),
    ],
)  # fmt: skip
def test_mutated_helper_fails(old, new, tmp_path, device):
    kernel = _mutant_kernel(old, new, tmp_path)
    x = _edge_cases(device)
    with pytest.raises(AssertionError):
        _assert_same_values(_convert(x, torch.bfloat16, True, kernel), x.to(torch.bfloat16))
