"""Per-sequence log-probabilities (fused linear cross-entropy, reduction "none", summed per row) against the
float64 reference: values and the gradients of hidden and weight under a per-row upstream gradient.

On CPU the kernel runs under TRITON_INTERPRET=1 at small shapes (V = 777, not a multiple of the interpreter's
block; a tiny logits chunk so every test walks several chunks).
"""

from __future__ import annotations

import pytest
import torch

from fusetune.kernels.sequence_log_probs import (
    sequence_log_probs,
    sequence_log_probs_from_logits,
    sequence_log_probs_reference,
)

# Row sums of up to T per-token log-probs, and their gradients, against float64; atol is relative to the largest
# reference magnitude. The arithmetic is the fused linear cross-entropy's with reduction "none" (the derivation
# is beside its TOLERANCES): float32 ~1e-7 relative per token; bfloat16, logits rounded to 2**-8 of their
# size (~4), which moves each log-probability and gradient by up to ~1.6% (rtol 2e-2) and a bfloat16 dW
# accumulated over the chunks by a few 2**-9 of its largest value (atol 4e-3).
TOLERANCES = {torch.float32: (1e-6, 1e-5), torch.bfloat16: (4e-3, 2e-2)}
VOCAB, HIDDEN = 777, 48


def make_inputs(batch, length, dtype, device, *, masked_rows=(), seed=0, bias=False):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, length, HIDDEN, generator=generator)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator) / HIDDEN**0.5
    labels = torch.randint(0, VOCAB, (batch, length), generator=generator)
    labels[:, ::3] = -100  # the prompt-like positions that carry no loss
    for row in masked_rows:
        labels[row] = -100
    bias_tensor = torch.randn(VOCAB, generator=generator) * 0.1 if bias else None
    to = dict(dtype=dtype, device=device)
    return (
        hidden.to(**to),
        weight.to(**to),
        labels.to(device),
        bias_tensor.to(**to) if bias else None,
    )


def close(actual, expected, dtype):
    atol, rtol = TOLERANCES[dtype]
    expected = expected.double()
    scale = expected.abs().max().item() or 1.0
    torch.testing.assert_close(actual.double(), expected, atol=atol * scale, rtol=rtol)


def values_and_grads(function, hidden, weight, labels, upstream, **options):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    out = function(h, w, labels, **options)
    (out.double() * upstream).sum().backward()
    return out.detach(), h.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("batch", "length", "masked_rows"), [(1, 1, ()), (3, 7, (1,)), (4, 9, ()), (2, 5, (0, 1))]
)
def test_matches_float64_reference(device, dtype, batch, length, masked_rows):
    hidden, weight, labels, _ = make_inputs(batch, length, dtype, device, masked_rows=masked_rows)
    if batch == 1 and length == 1:
        labels[0, 0] = 5  # a single token, trained
    upstream = torch.randn(batch, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(device)
    chunk = 4 * VOCAB * torch.empty((), dtype=dtype).element_size()
    got = values_and_grads(sequence_log_probs, hidden, weight, labels, upstream, logits_chunk_bytes=chunk)
    want = values_and_grads(sequence_log_probs_reference, hidden, weight, labels, upstream)
    assert got[0].dtype == torch.float32 and got[0].shape == (batch,)
    for actual, expected in zip(got, want, strict=True):
        close(actual, expected, dtype)
    for row in masked_rows:  # a fully masked row: log-probability 0, no gradient into its tokens
        assert got[0][row].item() == 0.0
        assert torch.count_nonzero(got[1][row]).item() == 0


def test_bias_softcap_and_non_contiguous_hidden(device):
    hidden, weight, labels, bias = make_inputs(3, 6, torch.float32, device, bias=True, seed=2)
    hidden = hidden.transpose(0, 1).contiguous().transpose(0, 1)  # same values, non-contiguous
    assert not hidden.is_contiguous()
    got = sequence_log_probs(hidden, weight, labels, bias, softcap=3.0)
    want = sequence_log_probs_reference(hidden, weight, labels, bias, softcap=3.0)
    close(got, want, torch.float32)


def test_logits_path_matches_reference(device):
    hidden, weight, labels, _ = make_inputs(3, 8, torch.float32, device, masked_rows=(2,), seed=3)
    upstream = torch.randn(3, dtype=torch.float64).to(device)

    def from_logits(h, w, y):
        return sequence_log_probs_from_logits(h @ w.T, y)

    got = values_and_grads(from_logits, hidden, weight, labels, upstream)
    want = values_and_grads(sequence_log_probs_reference, hidden, weight, labels, upstream)
    for actual, expected in zip(got, want, strict=True):
        close(actual, expected, torch.float32)


def test_tolerance_catches_an_off_by_one_label_shift(device):
    """The comparison above would fail for a sequence sum taken against labels one position off, or with
    the ignored tokens counted: the tolerance is far below what either mistake changes."""
    hidden, weight, labels, _ = make_inputs(3, 7, torch.float32, device, seed=4)
    want = sequence_log_probs_reference(hidden, weight, labels)
    shifted = torch.roll(labels, 1, dims=1)
    with pytest.raises(AssertionError):
        close(sequence_log_probs(hidden, weight, shifted), want, torch.float32)
    unmasked = labels.masked_fill(labels == -100, 0)
    with pytest.raises(AssertionError):
        close(sequence_log_probs(hidden, weight, unmasked), want, torch.float32)


def test_shape_mismatch_is_refused(device):
    hidden, weight, labels, _ = make_inputs(2, 5, torch.float32, device)
    with pytest.raises(ValueError, match="labels"):
        sequence_log_probs(hidden, weight, labels[:, :4])
