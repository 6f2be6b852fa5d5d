"""LayerNorm kernels against the pure-PyTorch reference (fp32 inside, rounded at the end like torch's own)
and against torch.nn.LayerNorm as a drop-in. Outputs and every gradient are checked with TOLERANCES."""

import contextlib
import math

import pytest
import torch

from fusetune.kernels import _norm_row_tiles as norm_row_tiles_module
from fusetune.kernels import _norm_utils as norm_utils_module
from fusetune.kernels import _norm_wide_rows as norm_wide_rows_module
from fusetune.kernels import layer_norm as layer_norm_module
from fusetune.kernels._norm_utils import NormLaunchSettings, force_column_block
from fusetune.kernels.layer_norm import FusedLayerNorm, layer_norm, layer_norm_reference
from tests.kernels.mutation import mutated_kernel

# (atol, rtol) per dtype. The kernel and the reference both compute in fp32 and round once at the end, so they
# differ by about one unit in the last place of the dtype (bf16: 2^-7 = 0.0078, fp16: 2^-10).
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-3, 1e-2),
    torch.float16: (1e-3, 2e-3),
}
DTYPES = list(TOLERANCES)
# torch's own LayerNorm backward in bf16 (on the CPU) accumulates in low precision: measured against float64
# at the drop-in test's size its dw/db were up to 0.04 off (ours 0.03, one bf16 rounding of values up to 8).
TORCH_BACKWARD_TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (5e-2, 2e-2),
}


def _assert_matches(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, table=TOLERANCES, summed_rows: int = 1
) -> None:
    """assert_close at the dtype's tolerance; `summed_rows`: the values are sums over that many rows, whose
    fp32 rounding error grows like sqrt(rows) (seen on the GPU: 1.3e-5 in a 1024-row fp32 weight gradient)."""
    atol, rtol = table[dtype]
    torch.testing.assert_close(
        actual.float(), expected.float(), atol=atol * math.sqrt(summed_rows), rtol=rtol
    )


def _make(shape, dtype, device, layout="contiguous", scale=1.0, shift=0.0, seed=0):
    """A tensor of `shape`; layout "strided_rows" pads each row, "transposed" makes the last dim strided."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    if layout == "contiguous":
        return (torch.randn(shape, generator=generator) * scale + shift).to(device=device, dtype=dtype)
    if layout == "strided_rows":
        base = torch.randn(*shape[:-1], shape[-1] + 7, generator=generator) * scale + shift
        return base.to(device=device, dtype=dtype)[..., : shape[-1]]
    if layout == "transposed":
        base = torch.randn(*shape[:-2], shape[-1], shape[-2], generator=generator) * scale + shift
        return base.to(device=device, dtype=dtype).transpose(-1, -2)
    raise ValueError(layout)


def _leaf(t):
    return t.detach().clone().requires_grad_(True) if t is not None else None


def _parameters(hidden, dtype, device, affine="weight+bias"):
    generator = torch.Generator(device="cpu").manual_seed(1)
    weight = (torch.randn(hidden, generator=generator) * 0.5 + 1.0).to(device=device, dtype=dtype)
    bias = (torch.randn(hidden, generator=generator) * 0.5).to(device=device, dtype=dtype)
    if affine == "weight+bias":
        return weight, bias
    if affine == "weight":
        return weight, None
    return None, None


def _check(x, weight, bias, dy, dtype, eps=1e-5, **kwargs):
    """Kernel vs reference on the same inputs: output, dx, dw and db."""
    x_k, w_k, b_k = _leaf(x), _leaf(weight), _leaf(bias)
    x_r, w_r, b_r = _leaf(x), _leaf(weight), _leaf(bias)
    y = layer_norm(x_k, w_k, b_k, eps, **kwargs)
    y.backward(dy.clone())
    y_ref = layer_norm_reference(x_r, w_r, b_r, eps)
    y_ref.backward(dy.clone())
    assert y.dtype == x.dtype and y.shape == x.shape
    _assert_matches(y, y_ref, dtype)
    _assert_matches(x_k.grad, x_r.grad, dtype)
    assert x_k.grad.dtype == x.dtype
    for mine, theirs, parameter in ((w_k, w_r, weight), (b_k, b_r, bias)):
        if parameter is not None:
            assert mine.grad.dtype == parameter.dtype
            _assert_matches(mine.grad, theirs.grad, dtype, summed_rows=x.numel() // x.shape[-1])
    return y, x_k.grad, w_k.grad if w_k is not None else None, b_k.grad if b_k is not None else None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (3, 5), (2, 4095), (2, 3, 40)])
def test_layer_norm_matches_reference(device, dtype, shape):
    x = _make(shape, dtype, device, scale=2.0, shift=0.5)
    dy = _make(shape, dtype, device, seed=2)
    _check(x, *_parameters(shape[-1], dtype, device), dy, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", ["weight", "none"])
def test_layer_norm_partial_affine(device, dtype, affine):
    for shape in [(3, 5), (2, 3, 40)]:
        x, dy = _make(shape, dtype, device), _make(shape, dtype, device, seed=2)
        _check(x, *_parameters(shape[-1], dtype, device, affine), dy, dtype)


def test_layer_norm_bias_without_weight(device):
    x, dy = _make((4, 24), torch.float32, device), _make((4, 24), torch.float32, device, seed=2)
    _, bias = _parameters(24, torch.float32, device)
    _check(x, None, bias, dy, torch.float32)


def test_layer_norm_fp32_parameters_on_bf16_input(device):
    x, dy = _make((3, 96), torch.bfloat16, device), _make((3, 96), torch.bfloat16, device, seed=2)
    _check(x, *_parameters(96, torch.float32, device), dy, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["strided_rows", "transposed"])
def test_layer_norm_non_contiguous_input(device, dtype, layout):
    x = _make((2, 6, 48), dtype, device, layout=layout)
    dy = _make((2, 6, 48), dtype, device, layout=layout, seed=2)
    assert not x.is_contiguous()
    _check(x, *_parameters(48, dtype, device), dy, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_column_loop(device, dtype):
    """Rows wider than the column block take the looping kernels (forced at a small hidden size)."""
    x, dy = _make((5, 300), dtype, device, shift=1.0), _make((5, 300), dtype, device, seed=2)
    with force_column_block(64):
        _check(x, *_parameters(300, dtype, device), dy, dtype)
        _check(x, None, None, dy, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_wide_rows_column_loop(device, dtype):
    x, dy = _make((2, 8192), dtype, device), _make((2, 8192), dtype, device, seed=2)
    with force_column_block(2048):
        _check(x, *_parameters(8192, dtype, device), dy, dtype)


@pytest.mark.parametrize("block", [None, 32])
def test_layer_norm_large_mean(device, block):
    """Rows far from zero (mean 300, std 1), against a float64 reference.

    In fp32 the mean itself is only known to half a unit in the last place of 300 (1.5e-5), so any fp32
    LayerNorm is that far off; a variance from the cancelling E[x^2] - E[x]^2 would be off by ~1e-2.
    """
    tolerance = {"atol": 1e-4, "rtol": 1e-4}
    x, dy = (
        _make((4, 200), torch.float32, device, shift=300.0),
        _make((4, 200), torch.float32, device, seed=2),
    )
    weight, bias = _parameters(200, torch.float32, device)
    x_k = _leaf(x)
    with force_column_block(block) if block else contextlib.nullcontext():
        y = layer_norm(x_k, weight, bias)
        y.backward(dy)
    x64 = _leaf(x.double())
    y64 = layer_norm_reference(x64, weight.double(), bias.double())
    y64.backward(dy.double())
    torch.testing.assert_close(y.double(), y64, **tolerance)
    torch.testing.assert_close(x_k.grad.double(), x64.grad, **tolerance)
    # the one-pass variance fails the same check
    x32 = x.float()
    variance_one_pass = x32.pow(2).mean(-1, keepdim=True) - x32.mean(-1, keepdim=True).pow(2)
    y_one_pass = (x32 - x32.mean(-1, keepdim=True)) * torch.rsqrt(variance_one_pass + 1e-5) * weight + bias
    with pytest.raises(AssertionError):
        torch.testing.assert_close(y_one_pass.double(), y64, **tolerance)


def test_layer_norm_rejects_bad_parameters(device):
    x = torch.randn(2, 8, device=device)
    with pytest.raises(ValueError, match="bias must have shape"):
        layer_norm(x, torch.ones(8, device=device), torch.zeros(9, device=device))


@pytest.mark.parametrize("block", [None, 16], ids=["whole-rows", "wide-rows"])
def test_library_ops_match_the_eager_path(device, block):
    """The torch.library ops (what torch.compile traces) give what the eager path gives."""
    with force_column_block(block) if block else contextlib.nullcontext():
        dtype = torch.bfloat16
        x, dy = _make((3, 40), dtype, device), _make((3, 40), dtype, device, seed=2)
        weight, bias = _parameters(40, dtype, device)
        y, mean, rstd = torch.ops.fusetune.layer_norm_fwd(x, weight, bias, 1e-5)
        assert torch.equal(y, layer_norm(x, weight, bias))
        dx, dw, db = torch.ops.fusetune.layer_norm_bwd(dy, x, weight, bias, mean, rstd)
        x_k, w_k, b_k = _leaf(x), _leaf(weight), _leaf(bias)
        layer_norm(x_k, w_k, b_k).backward(dy)
        assert torch.equal(dx, x_k.grad) and torch.equal(dw, w_k.grad) and torch.equal(db, b_k.grad)
        _, dw_none, db_none = torch.ops.fusetune.layer_norm_bwd(dy, x, None, None, mean, rstd)
        assert dw_none.numel() == 0 and db_none.numel() == 0


@pytest.mark.parametrize("block", [None, 16], ids=["whole-rows", "wide-rows"])
def test_inplace_backward_writes_dx_into_dy(device, block):
    with force_column_block(block) if block else contextlib.nullcontext():
        dtype = torch.bfloat16
        x, dy = _make((3, 64), dtype, device), _make((3, 64), dtype, device, seed=2)
        incoming = dy.clone()
        x_k = _leaf(x)
        weight, bias = _parameters(64, dtype, device)
        layer_norm(x_k, weight, bias, inplace_backward=True).backward(incoming)
        assert torch.equal(incoming, x_k.grad) and not torch.equal(incoming, dy)
        x_r = _leaf(x)
        layer_norm_reference(x_r, weight, bias).backward(dy.clone())
        _assert_matches(x_k.grad, x_r.grad, dtype)
        # off by default: the incoming gradient is left alone
        incoming = dy.clone()
        layer_norm(_leaf(x), weight, bias).backward(incoming)
        assert torch.equal(incoming, dy)


@pytest.mark.parametrize(
    "normalized_shape,bias,elementwise_affine",
    [(96, True, True), (96, False, True), (96, True, False), ((4, 24), True, True)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_drop_in_for_torch_layer_norm(device, normalized_shape, bias, elementwise_affine, dtype):
    torch_ln = torch.nn.LayerNorm(
        normalized_shape, eps=1e-6, elementwise_affine=elementwise_affine, bias=bias
    )
    ours = FusedLayerNorm(normalized_shape, eps=1e-6, elementwise_affine=elementwise_affine, bias=bias)
    assert ours.state_dict().keys() == torch_ln.state_dict().keys()
    with torch.no_grad():
        for parameter in torch_ln.parameters():
            parameter.normal_(0.5, 0.5)
    torch_ln = torch_ln.to(device=device, dtype=dtype)
    ours = ours.to(device=device, dtype=dtype)
    ours.load_state_dict(torch_ln.state_dict())
    shape = (2, 5, *((normalized_shape,) if isinstance(normalized_shape, int) else normalized_shape))
    x, dy = _make(shape, dtype, device, shift=0.3), _make(shape, dtype, device, seed=2)
    x_t, x_o = _leaf(x), _leaf(x)
    y_t, y_o = torch_ln(x_t), ours(x_o)
    assert y_o.dtype == y_t.dtype and y_o.shape == y_t.shape
    _assert_matches(y_o, y_t, dtype)
    y_t.backward(dy.clone())
    y_o.backward(dy.clone())
    _assert_matches(x_o.grad, x_t.grad, dtype, TORCH_BACKWARD_TOLERANCES)
    for mine, theirs in zip(ours.parameters(), torch_ln.parameters(), strict=True):
        _assert_matches(mine.grad, theirs.grad, dtype, TORCH_BACKWARD_TOLERANCES, summed_rows=10)


# ------------------------------------------------------------------------------------------------------------
# The comparisons catch broken kernels
# ------------------------------------------------------------------------------------------------------------


class _FirstBlockOnly(NormLaunchSettings):
    """Settings whose kernel never loops over column blocks: it sees only the first block_n columns."""

    def loop_columns(self, n_cols: int) -> bool:
        return False


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_that_drops_columns_fails_the_comparison(device, dtype, monkeypatch):
    def broken_settings(n_cols: int, backward: bool) -> NormLaunchSettings:
        return _FirstBlockOnly(block_n=16, rows_per_tile=1, num_warps=1, programs_per_sm=1)

    x, dy = _make((3, 40), dtype, device), _make((3, 40), dtype, device, seed=2)
    weight, bias = _parameters(40, dtype, device)
    _check(x, weight, bias, dy, dtype)
    # The forward takes its settings through _norm_utils.forward_rows (the backward through its own import).
    monkeypatch.setattr(norm_utils_module, "norm_launch_settings", broken_settings)
    with pytest.raises(AssertionError):
        _check(x, weight, bias, dy, dtype)


KERNEL_MUTATIONS = [
    # (kernel, source before, source after, occurrences, column block forced or None)
    pytest.param(
        "_layer_norm_fwd_kernel",
        "centred = tl.where(col_mask[None, :], x - mean[:, None], 0.0)",
        "centred = x - mean[:, None]",
        1,
        None,
        id="fwd-padding-in-variance",
    ),
    pytest.param(
        "_layer_norm_fwd_kernel",
        "m2 += block_m2 + delta * delta * (seen * block_count / total)",
        "m2 += block_m2",
        1,
        16,
        id="fwd-block-merge-term-dropped",
    ),
    pytest.param(
        "_row_tiles_backward_kernel",
        "dx = (g - mean_g[:, None] - xhat * mean_g_xhat[:, None]) * rstd[:, None]",
        "dx = (g - xhat * mean_g_xhat[:, None]) * rstd[:, None]",
        1,
        None,
        id="bwd-mean-term-dropped",
    ),
    pytest.param(
        "_row_tiles_backward_kernel",
        "db_acc += tl.sum(dy, axis=0)",
        "db_acc += tl.sum(dy * xhat, axis=0)",
        1,
        None,
        id="bwd-db-wrong",
    ),
]


# The two kernels of rows wider than registers hold (_norm_wide_rows.py), reached with a forced column block.
WIDE_ROW_MUTATIONS = [
    pytest.param(
        "_columns_kernel", "inner -= tl.load(terms_ptr + n_rows + rows", "inner += tl.load(terms_ptr + n_rows + rows",
        id="mean-term-sign-flip",
    ),
    pytest.param("_row_terms_kernel", "x = x - mean  #", "x = x  #", id="row-term-uncentred"),
    pytest.param(
        "_columns_kernel", "db_acc += tl.sum(dy, axis=0)", "db_acc += tl.sum(dy * xhat, axis=0)", id="db-wrong"
    ),
    pytest.param(
        "_columns_kernel", "xhat = (x - mean[:, None]) * rstd[:, None]", "xhat = x * rstd[:, None]",
        id="xhat-uncentred",
    ),
]  # fmt: skip


@pytest.mark.parametrize("kernel_name,old,new", WIDE_ROW_MUTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mutated_wide_row_kernel_fails_the_comparison(
    device, dtype, kernel_name, old, new, tmp_path, monkeypatch
):
    """The wide-row backward with one source edit, run at 40 columns in blocks of 16, must fail the check."""
    x, dy = _make((5, 40), dtype, device, shift=0.5), _make((5, 40), dtype, device, seed=2)
    weight, bias = _parameters(40, dtype, device)

    def run_check():
        with force_column_block(16):
            _check(x, weight, bias, dy, dtype)

    run_check()
    kernel = getattr(norm_wide_rows_module, kernel_name)
    monkeypatch.setattr(norm_wide_rows_module, kernel_name, mutated_kernel(kernel, old, new, tmp_path))
    with pytest.raises(AssertionError):
        run_check()


@pytest.mark.parametrize("kernel_name,old,new,count,block", KERNEL_MUTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mutated_kernel_fails_the_comparison(
    device, dtype, kernel_name, old, new, count, block, tmp_path, monkeypatch
):
    """The real kernel with one source edit must fail the same check that the unedited kernel passes."""
    x, dy = _make((3, 40), dtype, device, shift=0.5), _make((3, 40), dtype, device, seed=2)
    weight, bias = _parameters(40, dtype, device)

    def run_check():
        with force_column_block(block) if block else contextlib.nullcontext():
            _check(x, weight, bias, dy, dtype)

    run_check()
    # The backward kernel is the one both norms share.
    module = norm_row_tiles_module if kernel_name == "_row_tiles_backward_kernel" else layer_norm_module
    kernel = getattr(module, kernel_name)
    monkeypatch.setattr(module, kernel_name, mutated_kernel(kernel, old, new, tmp_path, count=count))
    with pytest.raises(AssertionError):
        run_check()


def _assert_fails(actual, expected, dtype):
    with pytest.raises(AssertionError):
        _assert_matches(actual, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mutated_references_fail_against_the_kernel(device, dtype):
    """Each deliberately wrong variant of the math, compared with the kernel at TOLERANCES, must fail: a
    kernel with that bug would equal the variant, and so fail its comparison with the right reference."""
    hidden = 5
    x, dy = _make((4, hidden), dtype, device, shift=0.5), _make((4, hidden), dtype, device, seed=2)
    weight, bias = _parameters(hidden, dtype, device)
    y, dx, dw, db = _check(x, weight, bias, dy, dtype)
    x32, w32, b32, dy32 = x.float(), weight.float(), bias.float(), dy.float()
    mean = x32.mean(-1, keepdim=True)
    rstd = torch.rsqrt((x32 - mean).pow(2).mean(-1, keepdim=True) + 1e-5)
    xhat = (x32 - mean) * rstd
    g = dy32 * w32

    # the mean not subtracted (an RMSNorm)
    _assert_fails(y, x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5) * w32 + b32, dtype)
    # the variance divided by n - 1
    rstd_unbiased = torch.rsqrt((x32 - mean).pow(2).sum(-1, keepdim=True) / (hidden - 1) + 1e-5)
    _assert_fails(y, (x32 - mean) * rstd_unbiased * w32 + b32, dtype)
    # the mean(g) term of dx forgotten
    _assert_fails(dx, rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True)), dtype)
    # sign flip of the projection term
    _assert_fails(dx, rstd * (g - g.mean(-1, keepdim=True) + xhat * (g * xhat).mean(-1, keepdim=True)), dtype)
    # dw without xhat, db over the wrong axis
    _assert_fails(dw, dy32.sum(0), dtype)
    _assert_fails(db, dy32.sum(0)[torch.arange(hidden - 1, -1, -1)], dtype)


# ------------------------------------------------------------------------------------------------------------
# GPU only: large shapes and torch.compile
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 65536), (3, 32768), (5, 12288), (1024, 4096), (257, 1000)])
def test_large_shapes(device, dtype, shape):
    x, dy = _make(shape, dtype, device, shift=0.5), _make(shape, dtype, device, seed=2)
    _check(x, *_parameters(shape[-1], dtype, device), dy, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("inplace_backward", [False, True])
def test_compiled_fullgraph_matches_eager(device, inplace_backward):
    torch.manual_seed(0)
    dtype = torch.bfloat16
    model = torch.nn.Sequential(
        FusedLayerNorm(256, inplace_backward=inplace_backward),
        torch.nn.Linear(256, 256, bias=False),
        FusedLayerNorm(256, bias=False),
    ).to(device=device, dtype=dtype)
    with torch.no_grad():
        for module in (model[0], model[2]):
            module.weight.normal_(1.0, 0.3)
        model[0].bias.normal_(0.0, 0.3)
    x = torch.randn(4, 33, 256, device=device, dtype=dtype)
    dy = torch.randn(4, 33, 256, device=device, dtype=dtype)

    def run(module):
        model.zero_grad(set_to_none=True)
        xs = _leaf(x)
        out = module(xs)
        out.backward(dy.clone())
        return [out, xs.grad], [p.grad for p in model.parameters()]

    torch._dynamo.reset()
    eager_values, eager_param_grads = run(model)
    compiled_values, compiled_param_grads = run(torch.compile(model, fullgraph=True))
    for got, want in zip(compiled_values, eager_values, strict=True):
        _assert_matches(got, want, dtype)
    # The parameter gradients are bf16 sums over the 4 * 33 rows of products as large as 160, so eager and
    # compiled (whose Linear backward rounds in another order) may land one bf16 step apart: 43.25 against
    # 43.5 seen on the H100, where the float64 value was 43.30. What must hold is that the compiled model is
    # as accurate as the eager one: both against the same model in float64.
    reference = torch.nn.Sequential(
        torch.nn.LayerNorm(256), torch.nn.Linear(256, 256, bias=False), torch.nn.LayerNorm(256, bias=False)
    ).to(device=device, dtype=torch.float64)
    reference.load_state_dict({name: value.double() for name, value in model.state_dict().items()})
    reference(_leaf(x.double())).backward(dy.double())
    for name, eager, compiled, exact in zip(
        [n for n, _ in model.named_parameters()],
        eager_param_grads,
        compiled_param_grads,
        [p.grad for p in reference.parameters()],
        strict=True,
    ):
        eager_error = (eager.double() - exact).abs().max().item()
        compiled_error = (compiled.double() - exact).abs().max().item()
        # one bf16 step of the largest gradient is the unit both errors are made of
        step = exact.abs().max().item() * 2.0**-8
        assert compiled_error <= eager_error + step, (name, compiled_error, eager_error, step)
