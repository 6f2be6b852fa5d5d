"""RMSNorm and fused add + RMSNorm kernels against their pure-PyTorch references and the HF classes.

Every comparison runs the kernel and the reference on the same inputs (the reference rounds where the HF
classes round and otherwise computes in fp32, gradients included) and checks the output and every gradient
with the TOLERANCES of the test dtype: the two differ by the order of fp32 sums and the final rounding.
Against the HF classes themselves, whose low-precision backward rounds after every step, gradients are held to
HF_BACKWARD_TOLERANCES instead.
"""

import contextlib
import math

import pytest
import torch

from fusetune.kernels import _norm_row_tiles as norm_row_tiles_module
from fusetune.kernels import _norm_utils as norm_utils_module
from fusetune.kernels import _norm_wide_rows as norm_wide_rows_module
from fusetune.kernels import rms_norm as rms_norm_module
from fusetune.kernels._norm_utils import NormLaunchSettings, force_column_block
from fusetune.kernels.rms_norm import (
    FusedRMSNorm,
    add_rms_norm,
    add_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
)
from tests.kernels.mutation import mutated_kernel

# (atol, rtol) per dtype. rtol is about one unit in the last place of the dtype (bf16 keeps 8 significant
# bits: 2^-7 = 0.0078; fp16 11: 2^-10), for a final rounding that fp32 sums in another order can flip.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-3, 1e-2),
    torch.float16: (1e-3, 2e-3),
}
# HF's own backward in bf16/fp16 rounds every intermediate gradient, so it is a few units in the last place
# away from the exact gradient; its weight gradient (a sum over rows) more so.
HF_BACKWARD_TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (4e-3, 4e-3),
}
DTYPES = list(TOLERANCES)
MODES = [("llama", 0.0), ("gemma", 1.0)]


def _assert_matches(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, table=TOLERANCES, summed_rows: int = 1
) -> None:
    """assert_close at the dtype's tolerance; `summed_rows`: the values are sums over that many rows, whose
    fp32 rounding error grows like sqrt(rows) (seen on the GPU: 1.3e-5 in a 1024-row fp32 weight gradient)."""
    atol, rtol = table[dtype]
    torch.testing.assert_close(
        actual.float(), expected.float(), atol=atol * math.sqrt(summed_rows), rtol=rtol
    )


def _make(shape, dtype, device, layout="contiguous", scale=1.0, seed=0):
    """A tensor of `shape`; layout "strided_rows" pads each row, "transposed" makes the last dim strided."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    if layout == "contiguous":
        base = torch.randn(shape, generator=generator) * scale
        return base.to(device=device, dtype=dtype)
    if layout == "strided_rows":
        base = torch.randn(*shape[:-1], shape[-1] + 7, generator=generator) * scale
        return base.to(device=device, dtype=dtype)[..., : shape[-1]]
    if layout == "transposed":
        base = torch.randn(*shape[:-2], shape[-1], shape[-2], generator=generator) * scale
        return base.to(device=device, dtype=dtype).transpose(-1, -2)
    raise ValueError(layout)


def _weight(hidden, dtype, device, seed=1):
    # Around the values trained norms hold (Llama ~1, Gemma ~0 before the +1), with spread so dw matters.
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(hidden, generator=generator) * 0.5 + 1.0).to(device=device, dtype=dtype)


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _check_rms_norm(x, weight, dy, eps, offset, mode, dtype, **kwargs):
    """Kernel vs reference on (x, weight): output, dx and dw."""
    x_k, x_r = _leaf(x), _leaf(x)
    w_k = _leaf(weight) if weight is not None else None
    w_r = _leaf(weight) if weight is not None else None
    y = rms_norm(x_k, w_k, eps, offset, mode, **kwargs)
    y.backward(dy.clone())
    y_ref = rms_norm_reference(x_r, w_r, eps, offset, mode)
    y_ref.backward(dy.clone())
    expected_dtype = (
        torch.promote_types(x.dtype, weight.dtype) if (weight is not None and mode == "llama") else x.dtype
    )
    assert y.dtype == y_ref.dtype == expected_dtype
    assert y.shape == x.shape
    _assert_matches(y, y_ref, dtype)
    _assert_matches(x_k.grad, x_r.grad, dtype)
    assert x_k.grad.dtype == x.dtype
    if weight is not None:
        assert w_k.grad.dtype == weight.dtype
        _assert_matches(w_k.grad, w_r.grad, dtype, summed_rows=x.numel() // x.shape[-1])
    return y, x_k.grad, w_k.grad if weight is not None else None


SHAPES = [(1, 64), (3, 5), (2, 4095), (2, 3, 40)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode,offset", MODES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_matches_reference(device, dtype, mode, offset, shape):
    x = _make(shape, dtype, device)
    dy = _make(shape, dtype, device, seed=2)
    _check_rms_norm(x, _weight(shape[-1], dtype, device), dy, 1e-6, offset, mode, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5), (2, 3, 40)])
def test_rms_norm_without_weight(device, dtype, shape):
    x = _make(shape, dtype, device)
    dy = _make(shape, dtype, device, seed=2)
    for mode in ("llama", "gemma"):
        _check_rms_norm(x, None, dy, 1e-5, 0.0, mode, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["strided_rows", "transposed"])
def test_rms_norm_non_contiguous_input(device, dtype, layout):
    x = _make((2, 6, 48), dtype, device, layout=layout)
    assert not x.is_contiguous()
    dy = _make((2, 6, 48), dtype, device, layout=layout, seed=2)
    _check_rms_norm(x, _weight(48, dtype, device), dy, 1e-6, 0.0, "llama", dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode,offset", MODES)
def test_rms_norm_column_loop(device, dtype, mode, offset):
    """Rows wider than the column block take the looping kernels (forced at a small hidden size)."""
    x = _make((5, 300), dtype, device)
    dy = _make((5, 300), dtype, device, seed=2)
    with force_column_block(64):
        _check_rms_norm(x, _weight(300, dtype, device), dy, 1e-6, offset, mode, dtype)
        _check_rms_norm(x, None, dy, 1e-6, 0.0, mode, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_wide_rows_column_loop(device, dtype):
    """A couple of 8192-wide rows through the looping kernels with 2048-column blocks."""
    x = _make((2, 8192), dtype, device)
    dy = _make((2, 8192), dtype, device, seed=2)
    with force_column_block(2048):
        _check_rms_norm(x, _weight(8192, dtype, device), dy, 1e-6, 0.0, "llama", dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_eps_matters_for_small_inputs(device, dtype):
    """Rows with mean(x^2) ~ eps: the result depends on eps, so a kernel that dropped it would fail."""
    x = _make((4, 96), dtype, device, scale=1e-3)
    dy = _make((4, 96), dtype, device, seed=2)
    _check_rms_norm(x, _weight(96, dtype, device), dy, 1e-6, 0.0, "llama", dtype)


def test_rms_norm_empty_input(device):
    x = torch.empty(0, 32, device=device, requires_grad=True)
    w = torch.ones(32, device=device, requires_grad=True)
    y = rms_norm(x, w)
    y.sum().backward()
    assert y.shape == (0, 32)
    assert torch.equal(w.grad, torch.zeros_like(w))


def test_rms_norm_rejects_bad_arguments(device):
    x = torch.randn(2, 8, device=device)
    with pytest.raises(ValueError, match="casting_mode"):
        rms_norm(x, torch.ones(8, device=device), casting_mode="t5")
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm(x, torch.ones(7, device=device))
    with pytest.raises(ValueError, match="needs a weight"):
        rms_norm(x, None, offset=1.0)
    with pytest.raises(ValueError, match="residual must match"):
        add_rms_norm(x, x[:1], torch.ones(8, device=device))


# ------------------------------------------------------------------------------------------------------------
# Fused residual add + RMSNorm
# ------------------------------------------------------------------------------------------------------------


def _check_add_rms_norm(x, residual, weight, dy, d_new_residual, offset, mode, dtype, **kwargs):
    x_k, r_k, w_k = _leaf(x), _leaf(residual), _leaf(weight)
    x_r, r_r, w_r = _leaf(x), _leaf(residual), _leaf(weight)
    y, new_residual = add_rms_norm(x_k, r_k, w_k, 1e-6, offset, mode, **kwargs)
    torch.autograd.backward([y, new_residual], [dy.clone(), d_new_residual.clone()])
    y_ref, new_residual_ref = add_rms_norm_reference(x_r, r_r, w_r, 1e-6, offset, mode)
    torch.autograd.backward([y_ref, new_residual_ref], [dy.clone(), d_new_residual.clone()])
    assert new_residual.dtype == x.dtype and y.dtype == y_ref.dtype
    _assert_matches(new_residual, new_residual_ref, dtype)
    _assert_matches(y, y_ref, dtype)
    _assert_matches(x_k.grad, x_r.grad, dtype)
    _assert_matches(r_k.grad, r_r.grad, dtype)
    _assert_matches(w_k.grad, w_r.grad, dtype, summed_rows=x.numel() // x.shape[-1])
    return y, new_residual, x_k.grad, r_k.grad, w_k.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode,offset", MODES)
@pytest.mark.parametrize("shape", [(1, 64), (3, 5), (2, 4095), (2, 3, 40)])
def test_add_rms_norm_matches_reference(device, dtype, mode, offset, shape):
    x, residual = _make(shape, dtype, device), _make(shape, dtype, device, seed=3)
    dy, d_new_residual = _make(shape, dtype, device, seed=4), _make(shape, dtype, device, seed=5)
    _check_add_rms_norm(
        x, residual, _weight(shape[-1], dtype, device), dy, d_new_residual, offset, mode, dtype
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_column_loop(device, dtype):
    shape = (3, 200)
    x, residual = _make(shape, dtype, device), _make(shape, dtype, device, seed=3)
    dy, d_new_residual = _make(shape, dtype, device, seed=4), _make(shape, dtype, device, seed=5)
    with force_column_block(64):
        _check_add_rms_norm(x, residual, _weight(200, dtype, device), dy, d_new_residual, 0.0, "llama", dtype)


def test_add_rms_norm_non_contiguous(device):
    dtype = torch.bfloat16
    x = _make((4, 48), dtype, device, layout="transposed")
    residual = _make((4, 48), dtype, device, layout="strided_rows", seed=3)
    dy, d_new_residual = _make((4, 48), dtype, device, seed=4), _make((4, 48), dtype, device, seed=5)
    _check_add_rms_norm(x, residual, _weight(48, dtype, device), dy, d_new_residual, 1.0, "gemma", dtype)


@pytest.mark.parametrize("block", [None, 16], ids=["whole-rows", "wide-rows"])
def test_library_ops_match_the_eager_path(device, block):
    """The torch.library ops (what torch.compile traces) give what the eager path gives."""
    with force_column_block(block) if block else contextlib.nullcontext():
        dtype = torch.bfloat16
        x, residual, dy = (_make((3, 40), dtype, device, seed=seed) for seed in (0, 3, 2))
        d_new_residual = _make((3, 40), dtype, device, seed=5)
        weight = _weight(40, dtype, device)
        y, rstd = torch.ops.fusetune.rms_norm_fwd(x, weight, 1e-6, 0.0, "llama")
        assert torch.equal(y, rms_norm(x, weight))
        y_add, new_residual, rstd_add = torch.ops.fusetune.add_rms_norm_fwd(
            x, residual, weight, 1e-6, 1.0, "gemma"
        )
        y_add_eager, new_residual_eager = add_rms_norm(x, residual, weight, offset=1.0, casting_mode="gemma")
        assert torch.equal(y_add, y_add_eager) and torch.equal(new_residual, new_residual_eager)
        dx, dw = torch.ops.fusetune.rms_norm_bwd(
            dy, new_residual, weight, rstd_add, d_new_residual, 1.0, "gemma"
        )
        x_k, r_k, w_k = _leaf(x), _leaf(residual), _leaf(weight)
        outputs = add_rms_norm(x_k, r_k, w_k, offset=1.0, casting_mode="gemma")
        torch.autograd.backward(outputs, [dy, d_new_residual])
        assert torch.equal(dx, x_k.grad) and torch.equal(dx, r_k.grad) and torch.equal(dw, w_k.grad)
        _, dw_none = torch.ops.fusetune.rms_norm_bwd(dy, x, None, rstd, None, 0.0, "llama")
        assert dw_none.numel() == 0


# ------------------------------------------------------------------------------------------------------------
# In-place backward
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block", [None, 16], ids=["whole-rows", "wide-rows"])
def test_inplace_backward_writes_dx_into_dy(device, block):
    with force_column_block(block) if block else contextlib.nullcontext():
        dtype = torch.bfloat16
        x, dy = _make((3, 64), dtype, device), _make((3, 64), dtype, device, seed=2)
        weight = _weight(64, dtype, device)
        x_k, w_k = _leaf(x), _leaf(weight)
        incoming = dy.clone()
        rms_norm(x_k, w_k, inplace_backward=True).backward(incoming)
        # the incoming gradient's buffer now holds dx (x.grad itself is a copy: AccumulateGrad cannot steal a
        # buffer the test still references)
        assert torch.equal(incoming, x_k.grad)
        assert not torch.equal(incoming, dy)
        x_r, w_r = _leaf(x), _leaf(weight)
        rms_norm_reference(x_r, w_r).backward(dy.clone())
        _assert_matches(x_k.grad, x_r.grad, dtype)
        _assert_matches(w_k.grad, w_r.grad, dtype, summed_rows=3)


def test_inplace_backward_fused_add(device):
    dtype = torch.float16
    shape = (2, 3, 40)
    x, residual = _make(shape, dtype, device), _make(shape, dtype, device, seed=3)
    dy, d_new_residual = _make(shape, dtype, device, seed=4), _make(shape, dtype, device, seed=5)
    _check_add_rms_norm(
        x,
        residual,
        _weight(40, dtype, device),
        dy,
        d_new_residual,
        0.0,
        "llama",
        dtype,
        inplace_backward=True,
    )


@pytest.mark.parametrize("why", ["off", "non_contiguous", "other_dtype"])
def test_backward_leaves_dy_alone_unless_allowed(device, why):
    dtype = torch.bfloat16
    x = _make((3, 64), dtype, device)
    weight = _weight(64, dtype if why != "other_dtype" else torch.float32, device)
    dy = _make((3, 64), torch.float32 if why == "other_dtype" else dtype, device, seed=2)
    if why == "non_contiguous":
        dy = _make((3, 64), dtype, device, layout="transposed", seed=2)
    incoming = dy.clone()
    x_k, w_k = _leaf(x), _leaf(weight)
    rms_norm(x_k, w_k, inplace_backward=why != "off").backward(incoming)
    assert torch.equal(incoming, dy)
    x_r, w_r = _leaf(x), _leaf(weight)
    rms_norm_reference(x_r, w_r).backward(dy.clone())
    _assert_matches(x_k.grad, x_r.grad, dtype)


def test_inplace_backward_inside_a_network(device):
    """A pre-norm feeding linear layers (the safe pattern): gradients equal the out-of-place ones."""
    torch.manual_seed(0)
    x = torch.randn(6, 32, device=device)
    norm = FusedRMSNorm(32).to(device)
    q, k = torch.nn.Linear(32, 16).to(device), torch.nn.Linear(32, 16).to(device)
    grads = []
    for inplace in (False, True):
        norm.inplace_backward = inplace
        norm.zero_grad(set_to_none=True)
        x_k = _leaf(x)
        h = norm(x_k)
        (q(h) * k(h)).sum().backward()
        grads.append((x_k.grad, norm.weight.grad))
    _assert_matches(grads[1][0], grads[0][0], torch.float32)
    _assert_matches(grads[1][1], grads[0][1], torch.float32)


# ------------------------------------------------------------------------------------------------------------
# Drop-in for the Hugging Face classes
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "family,input_dtype,param_dtype",
    [
        ("llama", torch.bfloat16, torch.bfloat16),
        ("llama", torch.bfloat16, torch.float32),  # fp32 weights: HF returns fp32
        ("llama", torch.float16, torch.float16),
        ("llama", torch.float32, torch.float32),
        ("gemma", torch.bfloat16, torch.bfloat16),
        ("gemma", torch.bfloat16, torch.float32),
        ("gemma", torch.float32, torch.float32),
    ],
)
def test_matches_hf_rms_norm(device, family, input_dtype, param_dtype):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hidden = 96
    if family == "llama":
        hf = LlamaRMSNorm(hidden, eps=1e-5)
        ours = FusedRMSNorm(hidden, eps=1e-5)
    else:
        hf = GemmaRMSNorm(hidden, eps=1e-6)
        ours = FusedRMSNorm(hidden, eps=1e-6, offset=1.0, casting_mode="gemma", init_ones=False)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(hidden) * 0.3 + (1.0 if family == "llama" else 0.0))
    hf = hf.to(device=device, dtype=param_dtype)
    ours = ours.to(device=device, dtype=param_dtype)
    ours.load_state_dict(hf.state_dict())  # strict: the same keys and shapes
    assert ours.variance_epsilon == (hf.variance_epsilon if family == "llama" else hf.eps)

    x = _make((2, 5, hidden), input_dtype, device)
    dy_dtype = hf(x).dtype
    dy = _make((2, 5, hidden), dy_dtype, device, seed=2)
    x_hf, x_ours = _leaf(x), _leaf(x)
    y_hf, y_ours = hf(x_hf), ours(x_ours)
    assert y_ours.dtype == y_hf.dtype
    _assert_matches(y_ours, y_hf, input_dtype)
    y_hf.backward(dy.clone())
    y_ours.backward(dy.clone())
    _assert_matches(x_ours.grad, x_hf.grad, input_dtype, HF_BACKWARD_TOLERANCES)
    _assert_matches(ours.weight.grad, hf.weight.grad, input_dtype, HF_BACKWARD_TOLERANCES, summed_rows=10)


# ------------------------------------------------------------------------------------------------------------
# The comparisons catch broken kernels
# ------------------------------------------------------------------------------------------------------------


class _FirstBlockOnly(NormLaunchSettings):
    """Settings whose kernel never loops over column blocks: it sees only the first block_n columns."""

    def loop_columns(self, n_cols: int) -> bool:
        return False


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_that_drops_columns_fails_the_comparison(device, dtype, monkeypatch):
    """Run the real kernels with a dropped column loop (a masked-off row tail) and check the test trips."""

    def broken_settings(n_cols: int, backward: bool) -> NormLaunchSettings:
        return _FirstBlockOnly(block_n=16, rows_per_tile=1, num_warps=1, programs_per_sm=1)

    x, dy = _make((3, 40), dtype, device), _make((3, 40), dtype, device, seed=2)
    weight = _weight(40, dtype, device)
    _check_rms_norm(x, weight, dy, 1e-6, 0.0, "llama", dtype)  # the same check passes on the real settings
    # The forward takes its settings through _norm_utils.forward_rows (the backward through its own import).
    monkeypatch.setattr(norm_utils_module, "norm_launch_settings", broken_settings)
    with pytest.raises(AssertionError):
        _check_rms_norm(x, weight, dy, 1e-6, 0.0, "llama", dtype)


KERNEL_MUTATIONS = [
    # (kernel, source before, source after, occurrences, the check that must catch it)
    pytest.param(
        "_rms_norm_fwd_kernel",
        "mask = row_mask[:, None] & (cols[None, :] < n_cols)",
        "mask = row_mask[:, None] & (cols[None, :] < n_cols - 1)",
        1,
        "plain",
        id="fwd-column-mask-off-by-one",
    ),
    pytest.param(
        "_rms_norm_fwd_kernel",
        "tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)",
        "tl.rsqrt(tl.sum(x * x, axis=1) / n_cols)",
        1,
        "small",
        id="fwd-eps-dropped",
    ),
    pytest.param(
        "_row_tiles_backward_kernel",
        "dx = (g - xhat * mean_g_xhat[:, None]) * rstd[:, None]",
        "dx = (g + xhat * mean_g_xhat[:, None]) * rstd[:, None]",
        1,
        "plain",
        id="bwd-sign-flip",
    ),
    pytest.param(
        "_row_tiles_backward_kernel",
        "dw_acc += tl.sum(dy * xhat, axis=0)",
        "dw_acc += tl.sum(dy, axis=0)",
        1,
        "plain",
        id="bwd-dw-without-xhat",
    ),
    pytest.param(
        "_row_tiles_backward_kernel",
        "dx += d_residual.to(tl.float32)",
        "dx += 0.5 * d_residual.to(tl.float32)",
        1,
        "add",
        id="bwd-residual-gradient-halved",
    ),
]

# The two kernels of rows wider than registers hold (_norm_wide_rows.py), reached with a forced column block.
WIDE_ROW_MUTATIONS = [
    pytest.param(
        "_columns_kernel", "inner = g - xhat * mean_g_xhat[:, None]", "inner = g + xhat * mean_g_xhat[:, None]",
        "plain", id="dx-sign-flip",
    ),
    pytest.param("_row_terms_kernel", "sum_g_x += g * x", "sum_g_x += x", "plain", id="row-term-without-g"),
    pytest.param(
        "_row_terms_kernel", "for start in range(0, n_cols, BLOCK_N):",
        "for start in range(0, n_cols - BLOCK_N, BLOCK_N):", "plain", id="row-term-last-block-dropped",
    ),
    pytest.param(
        "_columns_kernel", "dw_acc += tl.sum(dy * xhat, axis=0)", "dw_acc += tl.sum(dy, axis=0)", "plain",
        id="dw-without-xhat",
    ),
    pytest.param(
        "_columns_kernel", "dx += d_residual.to(tl.float32)", "dx += 0.5 * d_residual.to(tl.float32)", "add",
        id="residual-gradient-halved",
    ),
]  # fmt: skip


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the eps-less mutant divides by zero on padding rows
@pytest.mark.parametrize("kernel_name,old,new,count,check", KERNEL_MUTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mutated_kernel_fails_the_comparison(
    device, dtype, kernel_name, old, new, count, check, tmp_path, monkeypatch
):
    """The real kernel with one source edit (a sign, a mask bound, a dropped term) must fail the same check
    that the unedited kernel passes."""
    shape = (3, 40)
    x, dy = (
        _make(shape, dtype, device, scale=1e-3 if check == "small" else 1.0),
        _make(shape, dtype, device, seed=2),
    )
    weight = _weight(40, dtype, device)
    residual, d_new_residual = _make(shape, dtype, device, seed=3), _make(shape, dtype, device, seed=5)

    def run_check():
        if check == "add":
            _check_add_rms_norm(x, residual, weight, dy, d_new_residual, 0.0, "llama", dtype)
        else:
            _check_rms_norm(x, weight, dy, 1e-6, 0.0, "llama", dtype)

    run_check()
    # The backward kernel is the one both norms share.
    module = norm_row_tiles_module if kernel_name == "_row_tiles_backward_kernel" else rms_norm_module
    kernel = getattr(module, kernel_name)
    monkeypatch.setattr(module, kernel_name, mutated_kernel(kernel, old, new, tmp_path, count=count))
    with pytest.raises(AssertionError):
        run_check()


@pytest.mark.parametrize("kernel_name,old,new,check", WIDE_ROW_MUTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mutated_wide_row_kernel_fails_the_comparison(
    device, dtype, kernel_name, old, new, check, tmp_path, monkeypatch
):
    """The same for the wide-row backward, run at 40 columns in blocks of 16 (the last block partial)."""
    shape = (5, 40)
    x, dy = _make(shape, dtype, device), _make(shape, dtype, device, seed=2)
    weight = _weight(40, dtype, device)
    residual, d_new_residual = _make(shape, dtype, device, seed=3), _make(shape, dtype, device, seed=5)

    def run_check():
        with force_column_block(16):
            if check == "add":
                _check_add_rms_norm(x, residual, weight, dy, d_new_residual, 0.0, "llama", dtype)
            else:
                _check_rms_norm(x, weight, dy, 1e-6, 0.0, "llama", dtype)

    run_check()
    kernel = getattr(norm_wide_rows_module, kernel_name)
    monkeypatch.setattr(norm_wide_rows_module, kernel_name, mutated_kernel(kernel, old, new, tmp_path))
    with pytest.raises(AssertionError):
        run_check()


def _assert_fails(actual, expected, dtype):
    with pytest.raises(AssertionError):
        _assert_matches(actual, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mutated_references_fail_against_the_kernel(device, dtype):
    """Each deliberately wrong variant of the math, compared with the kernel at TOLERANCES, must fail.

    A kernel with that bug would equal the wrong variant, so the test comparing it with the right reference
    would fail the same way.
    """
    hidden = 5  # narrow rows make an off-by-one in the row reduction visible even in bf16
    x, dy = _make((4, hidden), dtype, device), _make((4, hidden), dtype, device, seed=2)
    weight = _weight(hidden, dtype, device)
    y, dx, dw = _check_rms_norm(x, weight, dy, 1e-6, 0.0, "llama", dtype)
    x32, w32, dy32 = x.float(), weight.float(), dy.float()

    # sign flip of the projection term in dx
    xhat = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
    g = dy32 * w32
    dx_flipped = rstd * (g + xhat * (g * xhat).mean(-1, keepdim=True))
    _assert_fails(dx, dx_flipped, dtype)

    # the last column dropped from the sum of squares (an off-by-one mask)
    rstd_short = torch.rsqrt(x32[:, :-1].pow(2).sum(-1, keepdim=True) / hidden + 1e-6)
    _assert_fails(y, x32 * rstd_short * w32, dtype)

    # the weight gradient from dy alone (xhat forgotten)
    _assert_fails(dw, dy32.sum(0), dtype)

    # Gemma's offset ignored
    y_gemma = rms_norm(x, weight * 0.1, offset=1.0, casting_mode="gemma")
    _assert_fails(y_gemma, rms_norm_reference(x32, w32 * 0.1, casting_mode="gemma"), dtype)

    # eps ignored, on rows whose mean square is comparable to eps
    small = _make((4, 64), dtype, device, scale=1e-3)
    y_small = rms_norm(small, None, eps=1e-6)
    _assert_matches(y_small, rms_norm_reference(small, None, eps=1e-6), dtype)
    _assert_fails(y_small, rms_norm_reference(small, None, eps=0.0), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_without_residual_gradient_fails(device, dtype):
    """Forgetting d_new_residual in the fused backward (d_x = d_from_norm only) must fail the comparison."""
    shape = (3, 40)
    x, residual = _make(shape, dtype, device), _make(shape, dtype, device, seed=3)
    dy, d_new_residual = _make(shape, dtype, device, seed=4), _make(shape, dtype, device, seed=5)
    _, _, dx, _, _ = _check_add_rms_norm(
        x, residual, _weight(40, dtype, device), dy, d_new_residual, 0.0, "llama", dtype
    )
    h = _leaf(x + residual)
    rms_norm_reference(h, _weight(40, dtype, device)).backward(dy.clone())
    _assert_fails(dx, h.grad, dtype)


# ------------------------------------------------------------------------------------------------------------
# GPU only: large shapes and torch.compile
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 65536), (3, 32768), (5, 12288), (1024, 4096), (257, 1000)])
@pytest.mark.parametrize("mode,offset", MODES)
def test_large_shapes(device, dtype, shape, mode, offset):
    x = _make(shape, dtype, device)
    dy = _make(shape, dtype, device, seed=2)
    _check_rms_norm(x, _weight(shape[-1], dtype, device), dy, 1e-6, offset, mode, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(4, 65536), (2048, 4096)])
def test_large_shapes_fused_add(device, dtype, shape):
    x, residual = _make(shape, dtype, device), _make(shape, dtype, device, seed=3)
    dy, d_new_residual = _make(shape, dtype, device, seed=4), _make(shape, dtype, device, seed=5)
    _check_add_rms_norm(
        x,
        residual,
        _weight(shape[-1], dtype, device),
        dy,
        d_new_residual,
        0.0,
        "llama",
        dtype,
        inplace_backward=True,
    )


class _Block(torch.nn.Module):
    def __init__(self, hidden: int, inplace_backward: bool) -> None:
        super().__init__()
        self.input_norm = FusedRMSNorm(hidden, inplace_backward=inplace_backward)
        self.post_norm = FusedRMSNorm(hidden, offset=1.0, casting_mode="gemma", init_ones=False)
        self.proj = torch.nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.input_norm(x))
        normed, new_residual = self.post_norm.forward_with_residual(h, residual)
        return normed + rms_norm(new_residual, None)


@pytest.mark.gpu
@pytest.mark.parametrize("inplace_backward", [False, True])
def test_compiled_fullgraph_matches_eager(device, inplace_backward):
    torch.manual_seed(0)
    dtype = torch.bfloat16
    block = _Block(256, inplace_backward).to(device=device, dtype=dtype)
    with torch.no_grad():
        block.post_norm.weight.normal_(0.0, 0.3)
    x = torch.randn(4, 33, 256, device=device, dtype=dtype)
    residual = torch.randn(4, 33, 256, device=device, dtype=dtype)
    dy = torch.randn(4, 33, 256, device=device, dtype=dtype)

    def run(module):
        module.zero_grad(set_to_none=True)
        xs, rs = _leaf(x), _leaf(residual)
        out = module(xs, rs)
        out.backward(dy.clone())
        return [out, xs.grad, rs.grad], [p.grad for p in block.parameters()]

    torch._dynamo.reset()
    eager_values, eager_param_grads = run(block)
    compiled_values, compiled_param_grads = run(torch.compile(block, fullgraph=True))
    for got, want in zip(compiled_values, eager_values, strict=True):
        _assert_matches(got, want, dtype)
    # every parameter gradient is a sum over the 4 * 33 rows
    for got, want in zip(compiled_param_grads, eager_param_grads, strict=True):
        _assert_matches(got, want, dtype, summed_rows=4 * 33)
