"""round_to_dtype: the kernels' float32 -> storage conversion gives the GPU's round-to-nearest-even bits, also
under the Triton interpreter (whose own bfloat16 conversion truncates)."""

import importlib.util
import inspect

import pytest
import torch
import triton
import triton.language as tl

from fusetune.kernels._interpreter import interpreted, round_to_dtype, round_to_float8


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


# ----------------------------------------------------------------------------------------------------------
# round_to_float8: the float8 casts of fusetune.kernels.float8_gated
# ----------------------------------------------------------------------------------------------------------

FLOAT8_FORMATS = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}


@triton.jit
def _float8_kernel(
    x_ptr, out_ptr, n_elements, DTYPE: tl.constexpr, LARGEST: tl.constexpr, BLOCK: tl.constexpr,
    SOFTWARE_ROUNDING: tl.constexpr,
):  # fmt: skip
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    x = tl.minimum(tl.maximum(tl.load(x_ptr + offsets, mask=mask, other=0.0), -LARGEST), LARGEST)
    tl.store(out_ptr + offsets, round_to_float8(x, DTYPE, SOFTWARE_ROUNDING), mask=mask)


def _to_float8(x: torch.Tensor, dtype: torch.dtype, software: bool, kernel=_float8_kernel) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    largest = torch.finfo(dtype).max
    kernel[(triton.cdiv(x.numel(), 128),)](
        x, out, x.numel(), DTYPE=FLOAT8_FORMATS[dtype], LARGEST=largest, BLOCK=128, SOFTWARE_ROUNDING=software
    )
    return out


def _float8_cases(dtype: torch.dtype, device: str) -> torch.Tensor:
    """Ties and edges of the float8 format's grid (normal and subnormal), then random values of every
    magnitude, as float32."""
    mantissa_bits, smallest_normal_exponent = (3, -6) if dtype == torch.float8_e4m3fn else (2, -14)
    step = 2.0**-mantissa_bits
    subnormal_step = 2.0 ** (smallest_normal_exponent - mantissa_bits)
    special = [
        1 + step / 2,  # a tie: down to the even 1.0
        1 + 3 * step / 2,  # a tie with an odd lower neighbour: up
        -(1 + 3 * step / 2),
        1 + step / 2 + 2**-20,  # just above a tie: up
        subnormal_step / 2,  # a subnormal tie: down to 0
        3 * subnormal_step / 2,  # a subnormal tie, odd lower neighbour: up
        2.0**smallest_normal_exponent * (1 - 2**-12),  # just under the smallest normal: rounds up to it
        2.0**smallest_normal_exponent,
        torch.finfo(dtype).max,
        torch.finfo(dtype).max * (1 - 2**-10),
        float("inf"),  # clamped to the largest finite value, as torchao clamps
        -float("inf"),
        0.0,
        -0.0,
        1e-30,
    ]
    generator = torch.Generator().manual_seed(0)
    exponents = torch.randint(-24, 18, (2000,), generator=generator).float()
    random = torch.randn(2000, generator=generator) * torch.exp2(exponents)
    return torch.cat([torch.tensor(special, dtype=torch.float32), random]).to(device)


def _torch_float8(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    largest = torch.finfo(dtype).max
    return x.clamp(-largest, largest).to(dtype)


@pytest.mark.parametrize("dtype", list(FLOAT8_FORMATS), ids=str)
@pytest.mark.parametrize("software", [True, False], ids=["software", "as-called"])
def test_float8_rounding_is_torchs_bit_for_bit(dtype, software, device):
    """Software rounding anywhere; as the kernels call it (hardware on a GPU), where it is not the interpreter."""
    if not software and interpreted():
        pytest.skip("the interpreter's own float8 conversion does not round to nearest even (the test below)")
    x = _float8_cases(dtype, device)
    expected = _torch_float8(x, dtype)
    assert torch.equal(_to_float8(x, dtype, software).view(torch.uint8), expected.view(torch.uint8))


def test_the_interpreters_own_float8_conversion_fails_the_comparison(device):
    if not interpreted():
        pytest.skip("on the GPU the hardware conversion rounds to nearest even")
    x = _float8_cases(torch.float8_e4m3fn, device)
    actual = _to_float8(x, torch.float8_e4m3fn, False).view(torch.uint8)
    assert not torch.equal(actual, _torch_float8(x, torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize(
    ("old", "new"),
    [
        pytest.param("((1 << (dropped - 1)) - 1) + ((magnitude_bits >> dropped) & 1)", "(1 << (dropped - 1))",
                     id="ties-round-away-from-zero"),
        pytest.param("((1 << (dropped - 1)) - 1) + ((magnitude_bits >> dropped) & 1)", "0", id="truncates"),
        pytest.param("(magnitude * subnormal_steps + 8388608.0) - 8388608.0", "magnitude * subnormal_steps",
                     id="subnormals-truncated"),
        pytest.param("code = tl.where(magnitude < smallest_normal, steps.to(tl.uint32), normal)", "code = normal",
                     id="no-subnormal-path"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("dtype", list(FLOAT8_FORMATS), ids=str)
def test_a_mutated_float8_rounding_fails(old, new, dtype, tmp_path, device):
    from tests.kernels.mutation import mutated_kernel

    kernel = mutated_kernel(_float8_kernel, old, new, tmp_path)
    x = _float8_cases(dtype, device)
    actual = _to_float8(x, dtype, True, kernel).view(torch.uint8)
    assert not torch.equal(actual, _torch_float8(x, dtype).view(torch.uint8))
