"""Fused cross-entropy against its float64 reference (and the reference against torch).

On CPU the real Triton kernels run under TRITON_INTERPRET=1 (set by tests/conftest.py) at small
shapes; the vocabularies used (600-1000, plus 5) walk two 512-column blocks with a ragged tail there.
Tests marked gpu run real shapes and torch.compile with Inductor.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fusetune.kernels import cross_entropy as ce_module
from fusetune.kernels.cross_entropy import FusedCrossEntropyLoss, cross_entropy, cross_entropy_reference
from tests.kernels.mutation import mutated_kernel

# Gradients come back in the logits' dtype (computed in float32, rounded to nearest once in the forward
# and once more when the backward scales by a non-unit upstream gradient); losses are float32.
# float32: float32 arithmetic against float64 is ~1e-7 relative.
# bfloat16 / float16: two roundings of half an ulp (2**-9 resp. 2**-11) each, with a factor of 2 of
#   margin; below 6e-5 float16 is subnormal with a fixed spacing of 2**-24 (6e-8), hence its absolute part.
TOLERANCES = {
    torch.float32: (1e-6, 1e-5),
    torch.bfloat16: (1e-6, 8e-3),
    torch.float16: (2.5e-7, 2e-3),
}
LOSS_TOLERANCE = TOLERANCES[torch.float32]


def make_inputs(n_rows, vocab, dtype, device, *, scale=3.0, ignored_every=5, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n_rows, vocab, generator=generator) * scale).to(dtype).to(device)
    labels = torch.randint(0, vocab, (n_rows,), generator=generator)
    if ignored_every:
        labels[::ignored_every] = -100
    return logits, labels.to(device)


def run_kernel(logits, labels, upstream=None, **options):
    """Loss (and accuracy) and d(sum(upstream * loss))/dlogits through the fused kernel."""
    x = logits.detach().clone().requires_grad_()
    out = cross_entropy(x, labels, **options)
    loss, accuracy = out if isinstance(out, tuple) else (out, None)
    loss.backward(upstream if upstream is not None else torch.ones_like(loss))
    return loss.detach(), accuracy, x.grad


def run_reference(logits, labels, upstream=None, **options):
    x = logits.detach().to(torch.float64).requires_grad_()
    options = {k: (v.to(torch.float64) if torch.is_tensor(v) else v) for k, v in options.items()}
    out = cross_entropy_reference(x, labels, **options)
    loss, accuracy = out if isinstance(out, tuple) else (out, None)
    loss.backward(upstream.to(torch.float64) if upstream is not None else torch.ones_like(loss))
    return loss.detach(), accuracy, x.grad


def assert_matches_reference(logits, labels, upstream=None, **options):
    loss, accuracy, grad = run_kernel(logits, labels, upstream, **options)
    ref_loss, ref_accuracy, ref_grad = run_reference(logits, labels, upstream, **options)
    assert loss.dtype == torch.float32
    assert grad.dtype == logits.dtype
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
    atol, rtol = LOSS_TOLERANCE
    torch.testing.assert_close(loss.double(), ref_loss, atol=atol, rtol=rtol)
    atol, rtol = TOLERANCES[logits.dtype]
    torch.testing.assert_close(grad.double(), ref_grad, atol=atol, rtol=rtol)
    if accuracy is not None:
        torch.testing.assert_close(accuracy.double(), ref_accuracy, atol=0.0, rtol=0.0)


CASES = [
    # (dtype, reduction, options)
    (torch.float32, "mean", {}),
    (torch.bfloat16, "mean", {}),
    (torch.float16, "sum", {}),
    (torch.float32, "sum", {"softcap": 4.0, "z_loss_scale": 1e-3}),
    (torch.bfloat16, "none", {"softcap": 4.0, "z_loss_scale": 1e-3, "return_accuracy": True}),
    (torch.float32, "mean", {"label_smoothing": 0.1, "weight": "random", "return_accuracy": True}),
    (torch.bfloat16, "sum", {"label_smoothing": 0.2}),
    (torch.float32, "none", {"weight": "random", "softcap": 10.0}),
]


@pytest.mark.parametrize(
    ("dtype", "reduction", "options"),
    CASES,
    ids=[f"{str(d)[6:]}-{r}-{'+'.join(o) or 'plain'}" for d, r, o in CASES],
)
def test_matches_reference(device, dtype, reduction, options):
    vocab = 1000
    logits, labels = make_inputs(16, vocab, dtype, device)
    options = dict(options)
    if options.get("weight") == "random":
        options["weight"] = (torch.rand(vocab, generator=torch.Generator().manual_seed(1)) + 0.5).to(device)
    # A non-unit upstream gradient: the backward must scale, not assume loss.backward().
    upstream = (torch.randn(16) if reduction == "none" else torch.tensor(2.5)).to(device)
    assert_matches_reference(logits, labels, upstream, reduction=reduction, **options)


def test_reference_agrees_with_torch():
    logits, labels = make_inputs(24, 50, torch.float64, "cpu")
    weight = torch.rand(50, dtype=torch.float64) + 0.5
    for reduction in ("mean", "sum", "none"):
        for kwargs in (
            {},
            {"weight": weight},
            {"label_smoothing": 0.15},
            {"weight": weight, "label_smoothing": 0.15},
        ):
            ours = cross_entropy_reference(logits, labels, reduction=reduction, **kwargs)
            theirs = F.cross_entropy(logits, labels, reduction=reduction, **kwargs)
            torch.testing.assert_close(ours, theirs)


def test_single_row_tiny_vocab(device):
    logits, labels = make_inputs(1, 5, torch.float32, device, ignored_every=0)
    assert_matches_reference(logits, labels, reduction="mean", return_accuracy=True)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_gives_zero_loss_and_gradient(device, reduction):
    logits, _ = make_inputs(6, 600, torch.float32, device)
    labels = torch.full((6,), -100, device=device)
    loss, accuracy, grad = run_kernel(logits, labels, reduction=reduction, return_accuracy=True)
    assert torch.equal(loss, torch.zeros_like(loss))
    assert torch.equal(accuracy, torch.zeros_like(accuracy))
    assert torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("options", [{}, {"softcap": 30.0, "z_loss_scale": 1e-4}], ids=["plain", "softcap+z"])
def test_huge_logits_do_not_overflow(device, options):
    logits, labels = make_inputs(8, 700, torch.float32, device, scale=1e4)
    assert_matches_reference(logits, labels, reduction="sum", **options)


def test_inplace_backward_writes_gradient_into_logits(device):
    logits, labels = make_inputs(8, 700, torch.bfloat16, device)
    _, _, expected_grad = run_kernel(logits, labels, softcap=5.0)
    buffer = logits.clone().requires_grad_()
    loss = cross_entropy(buffer, labels, softcap=5.0, inplace_backward=True)
    loss.backward()
    torch.testing.assert_close(buffer.grad, expected_grad, atol=0.0, rtol=0.0)
    assert buffer.grad.data_ptr() == buffer.data_ptr()  # no [N, V] buffer besides the logits


def test_leading_dims_and_strided_rows(device):
    wide, labels = make_inputs(12, 900, torch.float32, device)
    logits = wide[:, :700].reshape(3, 4, 700)  # rows 900 apart: the kernel takes the row stride
    labels = (labels % 700).reshape(3, 4)
    labels[0, 1] = -100
    upstream = torch.randn(3, 4).to(device)
    assert_matches_reference(logits, labels, upstream, reduction="none", return_accuracy=True)


def test_module_matches_functional(device):
    logits, labels = make_inputs(8, 600, torch.float32, device)
    module = FusedCrossEntropyLoss(label_smoothing=0.1, z_loss_scale=1e-4)
    torch.testing.assert_close(
        module(logits, labels), cross_entropy(logits, labels, label_smoothing=0.1, z_loss_scale=1e-4)
    )


def test_no_grad_path_computes_loss_only(device):
    logits, labels = make_inputs(8, 600, torch.float32, device)
    with torch.no_grad():
        loss = cross_entropy(logits, labels, label_smoothing=0.1)
    expected = cross_entropy_reference(logits.double(), labels, label_smoothing=0.1)
    torch.testing.assert_close(loss.double(), expected, atol=LOSS_TOLERANCE[0], rtol=LOSS_TOLERANCE[1])


def test_rejects_bad_arguments():
    logits = torch.randn(4, 10)
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(logits, torch.zeros(4, dtype=torch.long), reduction="avg")
    with pytest.raises(ValueError, match="labels"):
        cross_entropy(logits, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="softcap"):
        cross_entropy(logits, torch.zeros(4, dtype=torch.long), softcap=0.0)


# --- mutation tests: the comparisons above must catch a broken kernel -------------------------------


def test_mutant_without_softcap_derivative_fails(device, tmp_path, monkeypatch):
    mutant = mutated_kernel(
        ce_module._cross_entropy_forward_kernel,
        "g = g * (1.0 - t * t)",
        "g = g * 1.0",
        tmp_path,
        "no_softcap_grad",
    )
    logits, labels = make_inputs(8, 700, torch.float32, device)
    assert_matches_reference(logits, labels, reduction="sum", softcap=4.0)  # the real kernel passes
    monkeypatch.setattr(ce_module, "_cross_entropy_forward_kernel", mutant)
    with pytest.raises(AssertionError, match="not close"):
        assert_matches_reference(logits, labels, reduction="sum", softcap=4.0)


def test_mutant_with_off_by_one_column_mask_fails(device, tmp_path, monkeypatch):
    # The first sweep forgets the last vocabulary column.
    old = "                mask = cols < n_cols\n                x = ahead1.to(tl.float32)"
    mutant = mutated_kernel(
        ce_module._cross_entropy_forward_kernel, old, old.replace("cols < n_cols", "cols < n_cols - 1"),
        tmp_path, "off_by_one",
    )  # fmt: skip
    logits, labels = make_inputs(8, 700, torch.float32, device)
    logits[:, -1] += 3.0  # make the forgotten column matter
    assert_matches_reference(logits, labels, reduction="sum", softcap=4.0)
    monkeypatch.setattr(ce_module, "_cross_entropy_forward_kernel", mutant)
    with pytest.raises(AssertionError, match="not close"):
        assert_matches_reference(logits, labels, reduction="sum", softcap=4.0)


def test_mutant_counting_ignored_tokens_in_mean_fails(device, tmp_path, monkeypatch):
    mutant = mutated_kernel(
        ce_module._cross_entropy_stats_kernel, "valid = labels != ignore_index", "valid = labels == labels",
        tmp_path, "ignore_mask",
    )  # fmt: skip
    logits, labels = make_inputs(10, 600, torch.float32, device)
    assert_matches_reference(logits, labels, reduction="mean")
    monkeypatch.setattr(ce_module, "_cross_entropy_stats_kernel", mutant)
    with pytest.raises(AssertionError, match="not close"):
        assert_matches_reference(logits, labels, reduction="mean")


# --- compile ---------------------------------------------------------------------------------------


def assert_same_loss_from_another_build(actual, expected):
    """Losses of the loss-only and the gradient-writing builds of one kernel source. Bitwise equal under the
    interpreter; on the GPU Triton fuses multiply-adds (enable_fp_fusion) differently in each build, so they
    differ by up to 2 float32 ulps (H100, 2026-11-27: and by none with TRITON_DEFAULT_FP_FUSION=0): allowed
    4 ulps there."""
    if actual.is_cuda:
        torch.testing.assert_close(actual, expected, atol=0.0, rtol=4 * 2.0**-23)
    else:
        torch.testing.assert_close(actual, expected, atol=0.0, rtol=0.0)


def test_traces_with_fullgraph_aot_eager(device):
    """Dynamo + AOTAutograd trace through the custom ops with no graph break (CPU-safe backend)."""
    logits, labels = make_inputs(8, 600, torch.float32, device)
    expected_loss, _, expected_grad = run_kernel(logits, labels, softcap=5.0)
    compiled = torch.compile(
        lambda x, y: cross_entropy(x, y, softcap=5.0, inplace_backward=True),
        fullgraph=True,
        backend="aot_eager",
    )
    x = logits.clone().requires_grad_()
    loss = compiled(x, labels)
    loss.backward()
    assert_same_loss_from_another_build(loss, expected_loss)  # compiled: the forward computes the loss only
    torch.testing.assert_close(x.grad, expected_grad, atol=0.0, rtol=0.0)


@pytest.mark.parametrize(
    ("reduction", "options"),
    [("mean", {"softcap": 5.0, "z_loss_scale": 1e-3}), ("none", {"label_smoothing": 0.1}), ("sum", {})],
)
def test_compiled_backward_recomputes_the_scaled_gradient(device, reduction, options):
    """Under torch.compile the backward recomputes the gradient with the upstream gradient in the kernel's
    scale: against the float64 reference with an upstream that is not 1 (per token for "none")."""
    logits, labels = make_inputs(8, 600, torch.float32, device)
    upstream = torch.randn(8) if reduction == "none" else torch.tensor(0.37)
    upstream = upstream.to(device)
    compiled = torch.compile(
        lambda x, y: cross_entropy(x, y, reduction=reduction, inplace_backward=True, **options),
        fullgraph=True,
        backend="aot_eager",
    )
    x = logits.clone().requires_grad_()
    loss = compiled(x, labels)
    loss.backward(upstream)
    assert torch.equal(x.detach(), logits), "nothing is overwritten under torch.compile"
    ref_loss, _, ref_grad = run_reference(logits, labels, upstream, reduction=reduction, **options)
    atol, rtol = LOSS_TOLERANCE
    torch.testing.assert_close(loss.double(), ref_loss, atol=atol, rtol=rtol)
    atol, rtol = TOLERANCES[torch.float32]
    torch.testing.assert_close(x.grad.double(), ref_grad, atol=atol, rtol=rtol)


# --- logits laid out [V, N] (launch_cross_entropy_columns, the fused linear loss's chunk held in dW) -----

COLUMN_CASES = [
    (torch.float32, {}),
    (torch.bfloat16, {"softcap": 4.0, "z_loss_scale": 1e-3}),
    (torch.float32, {"label_smoothing": 0.1, "return_accuracy": True}),
    (torch.bfloat16, {"softcap": 10.0, "return_accuracy": True}),
]


def run_columns(logits, labels, scale, *, width, return_accuracy=False, **options):
    """Per-token losses, the [N, V] gradient of sum(scale * loss) and correctness through the kernels over
    the logits stored [V, width] (width >= N, NaN between), gradient in place; checks the padding is kept."""
    n_tokens, vocab = logits.shape
    store = torch.full((vocab, width), float("nan"), dtype=logits.dtype, device=logits.device)
    logits_t = store[:, :n_tokens]
    logits_t.copy_(logits.t())
    loss = torch.empty(n_tokens, device=logits.device)
    correct = torch.empty(n_tokens, device=logits.device) if return_accuracy else None
    ce_module.launch_cross_entropy_columns(
        logits_t, labels, loss_out=loss, grad_out=logits_t, grad_scale=scale, correct_out=correct, **options
    )
    assert torch.isnan(store[:, n_tokens:]).all()
    return loss, logits_t.t(), correct


def assert_columns_match_reference(logits, labels, *, width, **options):
    scale = torch.rand(logits.shape[0], generator=torch.Generator().manual_seed(2)).to(logits.device)
    loss, grad, correct = run_columns(logits, labels, scale, width=width, **options)
    x = logits.detach().double().requires_grad_()
    out = cross_entropy_reference(x, labels, reduction="none", **options)
    ref_loss, ref_correct = out if isinstance(out, tuple) else (out, None)
    (ref_grad,) = torch.autograd.grad([(ref_loss * scale.double()).sum()], [x])
    atol, rtol = LOSS_TOLERANCE
    torch.testing.assert_close(loss.double(), ref_loss, atol=atol, rtol=rtol)
    atol, rtol = TOLERANCES[logits.dtype]
    torch.testing.assert_close(grad.double(), ref_grad, atol=atol, rtol=rtol)
    if ref_correct is not None:
        torch.testing.assert_close(correct.double(), ref_correct, atol=0.0, rtol=0.0)


@pytest.mark.parametrize(("dtype", "options"), COLUMN_CASES, ids=[str(i) for i in range(len(COLUMN_CASES))])
def test_columns_match_reference(device, dtype, options):
    # 40 tokens: groups of 16 with a ragged last; V=1000: two splits of one 512-row block, the last ragged.
    logits, labels = make_inputs(40, 1000, dtype, device)
    assert_columns_match_reference(logits, labels, width=48, **options)


def test_columns_without_gradient_give_the_same_loss(device):
    logits, labels = make_inputs(20, 1000, torch.float32, device)
    scale = torch.ones(1, device=device)
    expected, _, expected_correct = run_columns(logits, labels, scale, width=20, return_accuracy=True)
    logits_t = logits.t().contiguous()
    loss, correct = torch.empty(20, device=device), torch.empty(20, device=device)
    ce_module.launch_cross_entropy_columns(
        logits_t, labels, loss_out=loss, grad_out=None, grad_scale=scale, correct_out=correct
    )
    assert_same_loss_from_another_build(loss, expected)
    assert torch.equal(correct, expected_correct)
    assert torch.equal(logits_t, logits.t())


def test_mutant_combining_unscaled_split_sums_fails(device, tmp_path, monkeypatch):
    # Each split's sum of exponentials is relative to its own max: summing them as they are is wrong.
    mutant = mutated_kernel(
        ce_module._cross_entropy_columns_kernel,
        "row_sum = tl.sum(split_sum * tl.exp2((split_max - row_max[None, :]) * LOG2E), axis=0)",
        "row_sum = tl.sum(split_sum, axis=0)",
        tmp_path,
        "unscaled_splits",
    )
    logits, labels = make_inputs(40, 1000, torch.float32, device)
    assert_columns_match_reference(logits, labels, width=40)
    monkeypatch.setattr(ce_module, "_cross_entropy_columns_kernel", mutant)
    with pytest.raises(AssertionError, match="not close"):
        assert_columns_match_reference(logits, labels, width=40)


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compiled_inductor_fullgraph_matches_reference(reduction):
    # Against the float64 reference, as the eager kernel is: the compiled forward runs the kernel without
    # the gradient (the backward recomputes it), a build whose per-token losses may differ from the eager
    # one's in the last bit.
    logits, labels = make_inputs(256, 32000, torch.bfloat16, "cuda")
    upstream = torch.randn(256, device="cuda") if reduction == "none" else torch.tensor(0.5, device="cuda")
    options = {"reduction": reduction, "softcap": 30.0, "z_loss_scale": 1e-4, "return_accuracy": True}
    expected_loss, expected_accuracy, expected_grad = run_reference(logits, labels, upstream, **options)
    compiled = torch.compile(
        lambda x, y: cross_entropy(x, y, inplace_backward=True, **options), fullgraph=True
    )
    x = logits.clone().requires_grad_()
    loss, accuracy = compiled(x, labels)
    loss.backward(upstream)
    atol, rtol = LOSS_TOLERANCE
    torch.testing.assert_close(loss.double(), expected_loss, atol=atol, rtol=rtol)
    torch.testing.assert_close(accuracy.double(), expected_accuracy, atol=0.0, rtol=0.0)
    atol, rtol = TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(x.grad.double(), expected_grad, atol=atol, rtol=rtol)


# --- real shapes on the GPU ------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("n_rows", "vocab", "dtype", "options"),
    [
        (2048, 128256, torch.bfloat16, {"reduction": "mean", "return_accuracy": True}),
        (
            1024,
            32000,
            torch.float32,
            {"reduction": "sum", "label_smoothing": 0.1, "z_loss_scale": 1e-4, "return_accuracy": True},
        ),
        (512, 262144, torch.bfloat16, {"reduction": "none", "softcap": 30.0}),
        (1, 151936, torch.float16, {"reduction": "mean"}),
    ],
    ids=["llama3-bf16", "llama2-fp32-smooth", "gemma2-softcap", "one-row-fp16"],
)
def test_real_shapes_on_gpu(n_rows, vocab, dtype, options):
    logits, labels = make_inputs(n_rows, vocab, dtype, "cuda", ignored_every=7 if n_rows > 1 else 0)
    upstream = torch.randn(n_rows, device="cuda") if options["reduction"] == "none" else None
    assert_matches_reference(logits, labels, upstream, **options)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("n_tokens", "vocab", "options"),
    [(1000, 128256, {"return_accuracy": True}), (2048, 256000, {"softcap": 30.0, "z_loss_scale": 1e-4})],
)
def test_columns_real_shapes_on_gpu(n_tokens, vocab, options):
    logits, labels = make_inputs(n_tokens, vocab, torch.bfloat16, "cuda", ignored_every=7)
    assert_columns_match_reference(logits, labels, width=n_tokens + 8, **options)


@pytest.mark.gpu
def test_huge_logits_bf16_on_gpu():
    logits, labels = make_inputs(512, 128256, torch.bfloat16, "cuda", scale=1e4)
    assert_matches_reference(logits, labels, reduction="mean", z_loss_scale=1e-4)
