"""skip_small_gradients of the fused linear cross-entropy against its float64 reference.

The inputs are peaked like a trained model's logits (mean entropy 1.7-1.9 nats) and built from ternary
{-1, 0, 1} hidden states and weights, so every logit is a small integer, exact in bfloat16: the exact
mode's error is then only the rounding of dlogits and of the outputs (measured tolerance ratio 0.2-0.3
of TOLERANCES[bfloat16], see assert_close_scaled), which leaves room to see the error of skipping. On
these inputs (float64 emulation, T=32, V=777) skipping below 2**-12 uses 0.5-0.7 of the tolerance,
below 2**-10 1.1-1.2 and below 2**-8 3-4: the tolerance catches a threshold 4x too high.
"""

from __future__ import annotations

import pytest
import torch

from fusetune.kernels import cross_entropy as ce_module
from fusetune.kernels import fused_linear_cross_entropy as flce_module
from fusetune.kernels.fused_linear_cross_entropy import (
    DEFAULT_SKIP_THRESHOLD,
    FusedLinearCrossEntropyLoss,
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_reference,
)
from tests.kernels.mutation import mutated_kernel
from tests.kernels.test_fused_linear_cross_entropy import assert_close_scaled, chunk_bytes, run

HIDDEN = 48
VOCAB = 777


def peaked_inputs(n_tokens, dtype, device, *, hidden_size=HIDDEN, vocab=VOCAB, density=0.75, seed=0,
                  ignored_every=4, bias=False):  # fmt: skip
    """Ternary hidden [T, H] and weight [V, H] (each entry +-1 with probability ``density``): integer
    logits of standard deviation ~sqrt(H) * density."""
    generator = torch.Generator().manual_seed(seed)

    def ternary(*shape):
        signs = torch.randint(0, 2, shape, generator=generator) * 2.0 - 1.0
        return torch.where(torch.rand(shape, generator=generator) < density, signs, 0.0)

    hidden, weight = ternary(n_tokens, hidden_size), ternary(vocab, hidden_size)
    labels = torch.randint(0, vocab, (n_tokens,), generator=generator)
    if ignored_every:
        labels[1::ignored_every] = -100
    # Bias in quarters: logits stay exact in bfloat16.
    bias_tensor = torch.randint(-4, 5, (vocab,), generator=generator) / 4.0 if bias else None
    to = dict(dtype=dtype, device=device)
    return (hidden.to(**to), weight.to(**to), labels.to(device),
            bias_tensor.to(**to) if bias_tensor is not None else None)  # fmt: skip


def mean_entropy(hidden, weight, labels, softcap=None):
    logits = hidden.double() @ weight.double().t()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    probs = torch.softmax(logits, dim=-1)[labels != -100]
    return -(probs * probs.clamp_min(1e-300).log()).sum(-1).mean().item()


def assert_skip_matches_reference(hidden, weight, labels, bias=None, upstream=None, **options):
    """Loss and every gradient within the bfloat16 tolerance of the float64 reference, whatever the
    input dtype (skipping is exact to bfloat16's tolerance, not float32's)."""
    options = {"skip_small_gradients": True, **options}
    loss, accuracy, grads = run(fused_linear_cross_entropy, hidden, weight, labels, bias, upstream, **options)
    ref_loss, ref_accuracy, ref_grads = run(
        fused_linear_cross_entropy_reference, hidden, weight, labels, bias, upstream, dtype=torch.float64,
        **options,
    )  # fmt: skip
    assert torch.isfinite(loss).all()
    assert_close_scaled(loss, ref_loss, torch.bfloat16)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        if ref_grad is None:
            assert grad is None
            continue
        assert grad.dtype == hidden.dtype and torch.isfinite(grad).all()
        assert_close_scaled(grad, ref_grad, torch.bfloat16)
    if accuracy is not None:
        torch.testing.assert_close(accuracy.double(), ref_accuracy, atol=0.0, rtol=0.0)


@pytest.fixture
def kept_fraction(monkeypatch):
    """Records the fraction of gradient entries each chunk keeps."""
    fractions: list[float] = []
    original = flce_module._live_gradient_entries

    def recording(grad, scale, threshold, counts, count_columns):
        row_starts, cols, values = original(grad, scale, threshold, counts, count_columns)
        fractions.append(cols.numel() / grad.numel())
        return row_starts, cols, values

    monkeypatch.setattr(flce_module, "_live_gradient_entries", recording)
    return fractions


CASES = [
    # (dtype, options, ignored_every, bias)
    (torch.bfloat16, {"reduction": "mean"}, 4, False),
    (torch.bfloat16, {"reduction": "sum", "softcap": 20.0, "z_loss_scale": 1e-3}, 3, True),
    (torch.bfloat16, {"reduction": "none", "return_accuracy": True}, 4, True),
    (torch.bfloat16, {"reduction": "mean", "num_items_in_batch": "tensor", "accumulate_dw_in_fp32": True}, 5,
     False),
    (torch.float32, {"reduction": "sum", "num_items_in_batch": 37}, 0, False),
]  # fmt: skip


@pytest.mark.parametrize(
    ("dtype", "options", "ignored_every", "bias"),
    CASES,
    ids=[
        f"{str(d)[6:]}-{o['reduction']}-{'+'.join(k for k in o if k != 'reduction') or 'plain'}-ign{i}-bias{int(b)}"
        for d, o, i, b in CASES
    ],
)
def test_skip_matches_reference(device, kept_fraction, dtype, options, ignored_every, bias):
    hidden, weight, labels, bias_tensor = peaked_inputs(
        32, dtype, device, ignored_every=ignored_every, bias=bias
    )
    assert 1.4 < mean_entropy(hidden, weight, labels) < 2.2
    options = dict(options)
    if options.get("num_items_in_batch") == "tensor":
        options["num_items_in_batch"] = torch.tensor(41, device=device)
    upstream = (torch.randn(32) if options["reduction"] == "none" else torch.tensor(2.5)).to(device)
    assert_skip_matches_reference(
        hidden, weight, labels, bias_tensor, upstream, logits_chunk_bytes=chunk_bytes(8, dtype), **options
    )
    # Several chunks, each skipping most entries (a token keeps ~50 of 777 at 2**-12).
    assert len(kept_fraction) >= 3
    assert all(0.0 < fraction < 0.2 for fraction in kept_fraction), kept_fraction


@pytest.mark.parametrize("dw_gather", [("rows",), ("dot", 32, 32, 128, 4)], ids=["rows", "row-groups"])
def test_skip_dw_by_either_gather_kernel(device, monkeypatch, dw_gather):
    """dW from the kept entries through the per-row gather (the default) and the tensor-core kernel over
    groups of vocabulary rows (selectable with DW_GATHER, timed by benchmarks/kernels/loss_skip.py)."""
    monkeypatch.setattr(flce_module, "DW_GATHER", dw_gather)
    hidden, weight, labels, _ = peaked_inputs(32, torch.bfloat16, device, ignored_every=4)
    assert_skip_matches_reference(
        hidden, weight, labels, None, torch.tensor(2.5).to(device), reduction="mean",
        logits_chunk_bytes=chunk_bytes(8, torch.bfloat16),
    )  # fmt: skip


def test_skip_module_single_token_and_leading_dims(device):
    hidden, weight, labels, _ = peaked_inputs(12, torch.bfloat16, device, ignored_every=5)
    module = FusedLinearCrossEntropyLoss(skip_small_gradients=True)
    loss = module(hidden.view(3, 4, HIDDEN), weight, labels.view(3, 4))
    assert_close_scaled(loss, fused_linear_cross_entropy_reference(hidden.double(), weight.double(), labels),
                        torch.bfloat16)  # fmt: skip
    assert_skip_matches_reference(hidden.view(3, 4, HIDDEN), weight, labels.view(3, 4))
    assert_skip_matches_reference(hidden[:1], weight, labels[:1].clamp_min(0), return_accuracy=True)


def test_skip_all_ignored_gives_zero_gradients(device):
    hidden, weight, _, bias = peaked_inputs(6, torch.bfloat16, device, bias=True)
    labels = torch.full((6,), -100, device=device)
    loss, _, grads = run(fused_linear_cross_entropy, hidden, weight, labels, bias, None,
                         skip_small_gradients=True)  # fmt: skip
    assert torch.equal(loss, torch.zeros_like(loss))
    for grad in grads:
        assert torch.equal(grad, torch.zeros_like(grad))


def test_skip_ignored_tokens_never_reach_a_gather(device):
    # NaN hidden rows at ignored positions would poison dW if the dW gather read them.
    hidden, weight, labels, _ = peaked_inputs(16, torch.bfloat16, device)
    ignored = labels == -100
    poisoned = hidden.masked_fill(ignored[:, None], float("nan"))
    options = {"skip_small_gradients": True, "logits_chunk_bytes": chunk_bytes(8, torch.bfloat16)}
    loss, _, (grad_hidden, grad_weight, _) = run(
        fused_linear_cross_entropy, poisoned, weight, labels, None, None, **options
    )
    ref_loss, _, (ref_grad_hidden, ref_grad_weight, _) = run(
        fused_linear_cross_entropy_reference, hidden, weight, labels, None, None, dtype=torch.float64
    )
    assert_close_scaled(loss, ref_loss, torch.bfloat16)
    assert_close_scaled(grad_weight, ref_grad_weight, torch.bfloat16)
    assert_close_scaled(grad_hidden, ref_grad_hidden, torch.bfloat16)
    assert torch.equal(grad_hidden[ignored], torch.zeros_like(grad_hidden[ignored]))


def test_skip_refuses_label_smoothing_and_bad_thresholds(device):
    hidden, weight, labels, _ = peaked_inputs(4, torch.float32, device)
    with pytest.raises(ValueError, match="label_smoothing"):
        fused_linear_cross_entropy(hidden, weight, labels, skip_small_gradients=True, label_smoothing=0.1)
    with pytest.raises(ValueError, match="label_smoothing"):
        FusedLinearCrossEntropyLoss(label_smoothing=0.1, skip_small_gradients=True)
    for threshold in (0.0, -1.0, 1.0):
        with pytest.raises(ValueError, match="skip_threshold"):
            fused_linear_cross_entropy(hidden, weight, labels, skip_small_gradients=True,
                                       skip_threshold=threshold)  # fmt: skip
    # Smoothing without skipping, and a threshold without skipping, are untouched.
    fused_linear_cross_entropy(hidden, weight, labels, label_smoothing=0.1, skip_threshold=0.0)


# --- mutation tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("factor", [16.0, 4.0])
def test_mutant_skipping_entries_above_the_threshold_fails(device, tmp_path, monkeypatch, factor):
    # A mask that also skips entries up to `factor` times above the threshold (2**-8 and 2**-10 instead
    # of 2**-12) must fail the same comparison that the real mask passes. The judge is shared by the
    # counting (cross-entropy) kernel and the collecting kernel: both run with the mutated judge, as copies
    # of themselves (a compiled kernel keeps the helper it was built with, so replacing the helper alone
    # changes nothing on the GPU).
    old, new = "tl.abs(g) > limit", f"tl.abs(g) > {factor} * limit"
    counting = mutated_kernel(
        ce_module._cross_entropy_forward_kernel, old, new, tmp_path, f"count_{factor:g}"
    )
    collecting = mutated_kernel(flce_module._collect_live_kernel, old, new, tmp_path, f"collect_{factor:g}")
    hidden, weight, labels, _ = peaked_inputs(32, torch.bfloat16, device)
    options = {"reduction": "mean", "logits_chunk_bytes": chunk_bytes(8, torch.bfloat16)}
    assert DEFAULT_SKIP_THRESHOLD == 2.0**-12
    assert_skip_matches_reference(hidden, weight, labels, **options)  # the real mask passes
    monkeypatch.setattr(ce_module, "_cross_entropy_forward_kernel", counting)
    monkeypatch.setattr(flce_module, "_collect_live_kernel", collecting)
    with pytest.raises(AssertionError, match="not close"):
        assert_skip_matches_reference(hidden, weight, labels, **options)


def test_mutant_gather_dropping_last_entry_fails(device, tmp_path, monkeypatch):
    # An off-by-one in the entry loop (the last kept entry of each row dropped) must fail.
    mutant = mutated_kernel(
        flce_module._gather_rows_product_kernel, "live = entries < end", "live = entries < end - 1", tmp_path,
        "gather_off_by_one",
    )  # fmt: skip
    hidden, weight, labels, _ = peaked_inputs(16, torch.bfloat16, device)
    assert_skip_matches_reference(hidden, weight, labels)
    monkeypatch.setattr(flce_module, "_gather_rows_product_kernel", mutant)
    with pytest.raises(AssertionError, match="not close"):
        assert_skip_matches_reference(hidden, weight, labels)


# --- GPU ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("n_tokens", "hidden_size", "vocab", "density", "options"),
    [
        (1024, 2048, 128256, 0.15, {"reduction": "mean"}),
        # No softcap here: a softcap of 30 over these integer logits gives an entropy of 5-7 nats at this
        # vocabulary, where skipping at 2**-12 drops too much mass (its softcap is tested on CPU, peaked).
        (777, 1024, 151936, 0.2, {"reduction": "none", "z_loss_scale": 1e-4}),
        (1500, 896, 32000, 0.25, {"reduction": "sum", "num_items_in_batch": 900, "z_loss_scale": 1e-4}),
    ],
    ids=["llama3", "qwen-none-zloss", "v32k-sum"],
)
def test_skip_real_shapes_on_gpu(kept_fraction, n_tokens, hidden_size, vocab, density, options):
    hidden, weight, labels, _ = peaked_inputs(
        n_tokens, torch.bfloat16, "cuda", hidden_size=hidden_size, vocab=vocab, density=density,
        ignored_every=9,
    )  # fmt: skip
    assert 1.0 < mean_entropy(hidden, weight, labels, options.get("softcap")) < 3.0
    upstream = torch.randn(n_tokens, device="cuda") if options["reduction"] == "none" else None
    assert_skip_matches_reference(hidden, weight, labels, None, upstream, **options)
    assert all(fraction < 0.01 for fraction in kept_fraction)


@pytest.mark.gpu
def test_skip_compiled_inductor_fullgraph_matches_eager():
    hidden, weight, labels, bias = peaked_inputs(512, torch.bfloat16, "cuda", bias=True)
    options = {
        "skip_small_gradients": True,
        "softcap": 30.0,
        "logits_chunk_bytes": chunk_bytes(128, torch.bfloat16),
    }
    expected_loss, _, expected_grads = run(
        fused_linear_cross_entropy, hidden, weight, labels, bias, None, **options
    )
    compiled = torch.compile(fused_linear_cross_entropy, fullgraph=True)
    loss, _, grads = run(compiled, hidden, weight, labels, bias, None, **options)
    torch.testing.assert_close(loss, expected_loss, atol=0.0, rtol=0.0)
    for grad, expected in zip(grads, expected_grads, strict=True):
        assert_close_scaled(grad, expected, torch.bfloat16)
