"""Fused linear + cross-entropy against its float64 reference.

On CPU the cross-entropy kernel runs under TRITON_INTERPRET=1 at small shapes (T <= 32, H = 48,
V = 777: not a multiple of the interpreter's 512-column block), with a tiny ``logits_chunk_bytes`` so
that every test walks several token chunks. Tests marked gpu run real shapes and Inductor.
"""

from __future__ import annotations

import pytest
import torch

from fusetune.kernels import cross_entropy as ce_module
from fusetune.kernels import fused_linear_cross_entropy as flce_module
from fusetune.kernels.fused_linear_cross_entropy import (
    FusedLinearCrossEntropyLoss,
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_chunk_rows,
    fused_linear_cross_entropy_chunk_sizes,
    fused_linear_cross_entropy_reference,
)
from tests.kernels.mutation import mutated_kernel

# Gradients are matmul outputs: their error scales with the operands, not with each element, so the
# absolute part of the tolerance is relative to the largest reference magnitude of that tensor:
# assert_close(actual, expected, atol=atol * max|expected|, rtol=rtol).
# float32: float32 matmuls and kernel against float64, ~1e-7 of the largest value.
# bfloat16: the logits chunk is bfloat16, so logits of magnitude ~4 carry an error of up to 2**-8 * 4,
#   which moves softmax probabilities (and every gradient) by up to ~1.6% (rtol); grad_weight is
#   accumulated in bfloat16 across chunks, each chunk rounding the running sum by up to 2**-9 of its
#   size: over the ~15 chunks of the GPU tests ~sqrt(15) * 2**-9 ~ 4e-3 of the largest value (measured
#   on H100: 1.9e-3; on CPU, 4 chunks: 1.2e-4).
TOLERANCES = {
    torch.float32: (1e-6, 1e-5),
    torch.bfloat16: (4e-3, 2e-2),
}
VOCAB = 777
HIDDEN = 48


def chunk_bytes(rows: int, dtype: torch.dtype) -> int:
    return rows * VOCAB * torch.empty((), dtype=dtype).element_size()


def make_inputs(n_tokens, dtype, device, *, ignored_every=4, bias=False, logit_scale=1.0, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n_tokens, HIDDEN, generator=generator) * logit_scale
    weight = torch.randn(VOCAB, HIDDEN, generator=generator) / HIDDEN**0.5
    labels = torch.randint(0, VOCAB, (n_tokens,), generator=generator)
    if ignored_every:
        labels[1::ignored_every] = -100
    bias_tensor = torch.randn(VOCAB, generator=generator) * 0.1 if bias else None
    to = dict(dtype=dtype, device=device)
    return (
        hidden.to(**to),
        weight.to(**to),
        labels.to(device),
        bias_tensor.to(**to) if bias_tensor is not None else None,
    )


def run(fn, hidden, weight, labels, bias, upstream, *, dtype=None, **options):
    """Loss (and accuracy) and gradients of hidden, weight and bias under ``fn``."""
    leaves = [
        t.detach().to(dtype or t.dtype).requires_grad_() if t is not None else None
        for t in (hidden, weight, bias)
    ]
    out = fn(leaves[0], leaves[1], labels, leaves[2], **options)
    loss, accuracy = out if isinstance(out, tuple) else (out, None)
    upstream = upstream if upstream is not None else torch.ones_like(loss)
    loss.backward(upstream.to(loss.dtype))
    grads = [t.grad if t is not None else None for t in leaves]
    return loss.detach(), accuracy, grads


def assert_close_scaled(actual, expected, dtype):
    atol, rtol = TOLERANCES[dtype]
    expected = expected.double()
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual.double(), expected, atol=atol * max(scale, 1e-30), rtol=rtol)


def assert_matches_reference(hidden, weight, labels, bias=None, upstream=None, **options):
    dtype = hidden.dtype
    loss, accuracy, grads = run(fused_linear_cross_entropy, hidden, weight, labels, bias, upstream, **options)
    ref_loss, ref_accuracy, ref_grads = run(
        fused_linear_cross_entropy_reference,
        hidden,
        weight,
        labels,
        bias,
        upstream,
        dtype=torch.float64,
        **options,
    )
    assert loss.dtype == torch.float32 and torch.isfinite(loss).all()
    assert_close_scaled(loss, ref_loss, dtype)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        if ref_grad is None:
            assert grad is None
            continue
        assert grad.dtype == dtype and torch.isfinite(grad).all()
        assert_close_scaled(grad, ref_grad, dtype)
    if accuracy is not None:
        torch.testing.assert_close(accuracy.double(), ref_accuracy, atol=0.0, rtol=0.0)


CASES = [
    # (dtype, options, ignored_every, bias)
    (torch.float32, {"reduction": "mean"}, 0, False),
    (torch.bfloat16, {"reduction": "mean"}, 4, False),
    (torch.float32, {"reduction": "sum", "softcap": 4.0, "z_loss_scale": 1e-3}, 4, True),
    (torch.bfloat16, {"reduction": "none", "label_smoothing": 0.1, "return_accuracy": True}, 3, False),
    (torch.float32, {"reduction": "mean", "num_items_in_batch": 37, "accumulate_dw_in_fp32": True}, 5, False),
    (
        torch.bfloat16,
        {"reduction": "sum", "num_items_in_batch": "tensor", "accumulate_dw_in_fp32": True},
        4,
        True,
    ),
    (torch.float32, {"reduction": "none", "softcap": 4.0, "return_accuracy": True}, 4, True),
]


# Chunk rows: 8 makes four chunks, whose ignored tokens are dropped before the matmuls; None (the default
# budget) one chunk, which runs the ignored tokens and counts the valid ones on the device.
@pytest.mark.parametrize("chunk_rows", [8, None], ids=["chunks", "one-chunk"])
@pytest.mark.parametrize(
    ("dtype", "options", "ignored_every", "bias"),
    CASES,
    ids=[
        f"{str(d)[6:]}-{o['reduction']}-{'+'.join(k for k in o if k != 'reduction') or 'plain'}-ign{i}-bias{int(b)}"
        for d, o, i, b in CASES
    ],
)
def test_matches_reference(device, dtype, options, ignored_every, bias, chunk_rows):
    hidden, weight, labels, bias_tensor = make_inputs(
        32, dtype, device, ignored_every=ignored_every, bias=bias
    )
    options = dict(options)
    if options.get("num_items_in_batch") == "tensor":
        options["num_items_in_batch"] = torch.tensor(41, device=device)
    upstream = (torch.randn(32) if options["reduction"] == "none" else torch.tensor(2.5)).to(device)
    budget = chunk_bytes(chunk_rows, dtype) if chunk_rows is not None else None
    assert_matches_reference(
        hidden, weight, labels, bias_tensor, upstream, logits_chunk_bytes=budget, **options
    )


def test_one_chunk_never_waits_for_the_device(device, monkeypatch):
    # Reading the count of valid tokens on the host waits for the device; a call of one chunk must not.
    hidden, weight, labels, _ = make_inputs(16, torch.float32, device)

    def fail(count):
        raise AssertionError("the host waited for the count of valid tokens")

    monkeypatch.setattr(flce_module, "_count_on_host", fail)
    for options in ({"reduction": "mean", "return_accuracy": True}, {"num_items_in_batch": torch.tensor(9)}):
        assert_matches_reference(hidden, weight, labels, **options)
    with pytest.raises(AssertionError, match="waited for the count"):
        fused_linear_cross_entropy(hidden, weight, labels, logits_chunk_bytes=chunk_bytes(8, torch.float32))


def test_held_logits_width():
    # [V, rows] logits held in dW's [V, H] memory: rows of whole 16 bytes where H allows.
    assert flce_module._held_logits_width(12, 48) == 16
    assert flce_module._held_logits_width(48, 48) == 48
    assert flce_module._held_logits_width(47, 47) == 47  # 48 would not fit


def assert_weight_gradient_over_its_logits(write_weight_gradient, device, width, bounce_rows):
    """dW = logits_t @ h through ``write_weight_gradient``, with logits_t at the start of dW's own memory."""
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(width, HIDDEN, generator=generator).to(device)
    logits_t = torch.randn(VOCAB, width, generator=generator).to(device)
    expected = logits_t.double() @ hidden.double()
    grad_weight = torch.full((VOCAB, HIDDEN), float("nan"), device=device)
    held = flce_module._transposed_logits_in(grad_weight, width, width)
    held.copy_(logits_t)
    bounce = torch.empty(bounce_rows * HIDDEN, device=device)
    write_weight_gradient(grad_weight, held, hidden, bounce)
    assert_close_scaled(grad_weight, expected, torch.float32)


@pytest.mark.parametrize(("width", "bounce_rows"), [(16, 129), (40, 129), (48, 129), (48, 1000), (1, 1)])
def test_weight_gradient_over_its_transposed_logits(device, width, bounce_rows):
    # Rows clear of the unread logits in one matmul, the others through the bounce buffer (all of them when
    # the width is H), any buffer size.
    assert_weight_gradient_over_its_logits(
        flce_module._weight_gradient_over_its_transposed_logits, device, width, bounce_rows
    )


# (tokens, dtype, options, ignored_every, bias) against an 8-row budget, H = 48: all tokens (ignored ones too,
# with no wait for the valid count) held in dW's memory, 12 of them in rows of 16 entries (dW mostly in one
# matmul per range clear of its logits), 33 in rows of 40, 48 in rows of H (each dW row through the bounce
# buffer). 64 tokens do not fit: chunks, after a wait.
ALIASED_CASES = [
    (12, torch.float32, {"reduction": "mean", "softcap": 4.0, "return_accuracy": True}, 4, True),
    (
        12,
        torch.bfloat16,
        {"reduction": "sum", "num_items_in_batch": "tensor", "z_loss_scale": 1e-3},
        4,
        False,
    ),
    (48, torch.float32, {"reduction": "none", "label_smoothing": 0.1}, 5, True),
    (12, torch.float32, {"reduction": "mean"}, 0, False),
    (48, torch.float32, {"reduction": "mean", "return_accuracy": True}, 4, True),
    (48, torch.bfloat16, {"reduction": "none", "softcap": 4.0}, 5, False),
    (33, torch.float32, {"reduction": "sum", "label_smoothing": 0.1, "z_loss_scale": 1e-3}, 0, True),
    (64, torch.float32, {"reduction": "mean"}, 4, False),
]


@pytest.mark.parametrize(("n_tokens", "dtype", "options", "ignored_every", "bias"), ALIASED_CASES)
def test_logits_held_in_the_weight_gradient_match_reference(
    device, monkeypatch, n_tokens, dtype, options, ignored_every, bias
):
    hidden, weight, labels, bias_tensor = make_inputs(
        n_tokens, dtype, device, ignored_every=ignored_every, bias=bias
    )
    options = dict(options)
    if options.get("num_items_in_batch") == "tensor":
        options["num_items_in_batch"] = torch.tensor(11, device=device)
    upstream = (torch.randn(n_tokens) if options["reduction"] == "none" else torch.tensor(1.5)).to(device)
    calls = []
    for name in ("_weight_gradient_over_its_transposed_logits", "_count_on_host"):
        real = getattr(flce_module, name)
        monkeypatch.setattr(
            flce_module, name, lambda *args, name=name, real=real: calls.append(name) or real(*args)
        )
    assert_matches_reference(
        hidden, weight, labels, bias_tensor, upstream, logits_chunk_bytes=chunk_bytes(8, dtype), **options
    )
    held = "_weight_gradient_over_its_transposed_logits" in calls
    assert held == (n_tokens <= HIDDEN), "the logits were held in the weight gradient only if they fit"
    # Waits for the valid count: the pass with gradients only when its tokens do not fit; the loss-only
    # forward of "none" (no dW to hold its logits) always, as any call of several chunks.
    waits = (options["reduction"] == "none") + (n_tokens > HIDDEN)
    assert calls.count("_count_on_host") == waits


def _one_matmul(grad_weight, logits_t, hidden, bounce):
    torch.mm(logits_t, hidden, out=grad_weight)


def _no_bounce(grad_weight, logits_t, hidden, bounce):
    for top in range(grad_weight.shape[0], 0, -64):
        low = max(0, top - 64)
        torch.mm(logits_t[low:top], hidden, out=grad_weight[low:top])


def _matmul_by_column_panels(a, b, *, out, panel=16):
    """out = a @ b as a tiled matmul may run it: column panel by column panel, each output row written as soon
    as it is computed and ``a`` read again for every panel. Whether a real matmul whose ``out`` overlaps
    ``a`` reads a row before another tile writes over it depends on the order its tiles run in (at the
    test's sizes cuBLAS happens to read everything first; a CPU BLAS that packs ``a`` first does too); this
    order shows every such overlap."""
    for start in range(0, b.shape[1], panel):
        for row in range(a.shape[0]):
            out[row, start : start + panel] = a[row] @ b[:, start : start + panel]
    return out


@pytest.mark.parametrize("mutant", [_one_matmul, _no_bounce], ids=["one-matmul", "no-bounce"])
@pytest.mark.parametrize("width", [16, 40, 48])
def test_mutant_writing_the_weight_gradient_over_its_logits_fails(monkeypatch, mutant, width):
    # Writing dW's rows before the logits under them are read (at once, or block by block from the last
    # without the bounce buffer) corrupts it, with matmuls that write as they go (the real function passes).
    monkeypatch.setattr(torch, "mm", _matmul_by_column_panels)
    write = flce_module._weight_gradient_over_its_transposed_logits
    assert_weight_gradient_over_its_logits(write, "cpu", width, bounce_rows=129)
    with pytest.raises(AssertionError, match="not close"):
        assert_weight_gradient_over_its_logits(mutant, "cpu", width, bounce_rows=129)


def test_loss_can_be_divided_in_place(device):
    # Trainers divide the loss in place (gradient accumulation); autograd forbids that on a view.
    hidden, weight, labels, _ = make_inputs(16, torch.float32, device)
    hidden.requires_grad_()
    loss = fused_linear_cross_entropy(hidden, weight, labels)
    loss /= 4.0
    (grad,) = torch.autograd.grad([loss], [hidden])
    ref_hidden = hidden.detach().double().requires_grad_()
    ref = fused_linear_cross_entropy_reference(ref_hidden, weight.double(), labels)
    (ref_grad,) = torch.autograd.grad([ref / 4.0], [ref_hidden])
    assert_close_scaled(grad, ref_grad, torch.float32)


def test_column_major_hidden_gets_its_gradient_scaled(device):
    # Its gradient is laid out like it, not as rows with contiguous columns: scaled by a plain multiply.
    hidden, weight, labels, _ = make_inputs(16, torch.float32, device)
    column_major = hidden.t().contiguous().t()
    assert not column_major.is_contiguous()
    assert_matches_reference(column_major, weight, labels, None, torch.tensor(2.5, device=device))


def test_single_token(device):
    hidden, weight, labels, _ = make_inputs(1, torch.float32, device, ignored_every=0)
    assert_matches_reference(hidden, weight, labels, reduction="mean", return_accuracy=True)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_all_ignored_gives_zero_loss_and_gradients(device, reduction):
    hidden, weight, _, bias = make_inputs(6, torch.float32, device, bias=True)
    labels = torch.full((6,), -100, device=device)
    loss, accuracy, grads = run(
        fused_linear_cross_entropy,
        hidden,
        weight,
        labels,
        bias,
        None,
        reduction=reduction,
        return_accuracy=True,
    )
    assert torch.equal(loss, torch.zeros_like(loss))
    assert torch.equal(accuracy, torch.zeros_like(accuracy))
    for grad in grads:
        assert torch.equal(grad, torch.zeros_like(grad))


def test_huge_logits_do_not_overflow(device):
    # Integer-valued operands make the float32 logits exact (|logit| <= 2**17, multiples of 256), so
    # the comparison measures the kernel rather than the rounding of a matmul of 1e4-sized numbers.
    generator = torch.Generator().manual_seed(5)
    hidden = (torch.randint(-4, 5, (16, HIDDEN), generator=generator) * 256.0).to(device)
    weight = torch.randint(-2, 3, (VOCAB, HIDDEN), generator=generator).to(device, torch.float32)
    labels = torch.randint(0, VOCAB, (16,), generator=generator).to(device)
    labels[::4] = -100
    logits = hidden @ weight.t()
    assert logits.abs().max() > 1e4
    assert_matches_reference(
        hidden,
        weight,
        labels,
        reduction="sum",
        z_loss_scale=1e-4,
        logits_chunk_bytes=chunk_bytes(8, torch.float32),
    )


def test_ignored_tokens_of_several_chunks_never_reach_a_matmul(device):
    # NaN hidden rows at ignored positions would poison dW (0 * NaN) if they entered any matmul. 96 tokens:
    # several chunks, too many to hold in dW's memory (where all tokens would run).
    hidden, weight, labels, _ = make_inputs(96, torch.float32, device)
    ignored = labels == -100
    poisoned = hidden.masked_fill(ignored[:, None], float("nan"))
    loss, _, (grad_hidden, grad_weight, _) = run(
        fused_linear_cross_entropy,
        poisoned,
        weight,
        labels,
        None,
        None,
        logits_chunk_bytes=chunk_bytes(8, hidden.dtype),
    )
    ref_loss, _, (ref_grad_hidden, ref_grad_weight, _) = run(
        fused_linear_cross_entropy_reference, hidden, weight, labels, None, None, dtype=torch.float64
    )
    assert_close_scaled(loss, ref_loss, torch.float32)
    assert_close_scaled(grad_weight, ref_grad_weight, torch.float32)
    assert_close_scaled(grad_hidden, ref_grad_hidden, torch.float32)
    assert torch.equal(grad_hidden[ignored], torch.zeros_like(grad_hidden[ignored]))


def test_tied_embedding_gradient_accumulates(device):
    hidden, weight, labels, _ = make_inputs(12, torch.float32, device, ignored_every=5)
    input_ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(3)).to(device)
    noise = hidden * 0.5

    def model(fn, table, dtype):
        table = table.detach().to(dtype).requires_grad_()
        states = torch.nn.functional.embedding(input_ids, table) * 2.0 + noise.to(dtype)
        loss = fn(states, table, labels, logits_chunk_bytes=chunk_bytes(4, dtype))
        loss.backward()
        return loss.detach(), table.grad

    loss, grad = model(fused_linear_cross_entropy, weight, torch.float32)
    ref_loss, ref_grad = model(fused_linear_cross_entropy_reference, weight, torch.float64)
    assert_close_scaled(loss, ref_loss, torch.float32)
    assert_close_scaled(grad, ref_grad, torch.float32)


def test_module_and_no_grad_path(device):
    hidden, weight, labels, bias = make_inputs(16, torch.float32, device, bias=True)
    module = FusedLinearCrossEntropyLoss(softcap=5.0, return_accuracy=True)
    with torch.no_grad():
        loss, accuracy = module(hidden, weight, labels, bias)
    ref_loss, ref_accuracy = fused_linear_cross_entropy_reference(
        hidden.double(), weight.double(), labels, bias.double(), softcap=5.0, return_accuracy=True
    )
    assert_close_scaled(loss, ref_loss, torch.float32)
    torch.testing.assert_close(accuracy.double(), ref_accuracy, atol=0.0, rtol=0.0)


def test_leading_dims(device):
    hidden, weight, labels, _ = make_inputs(12, torch.float32, device)
    assert_matches_reference(hidden.view(3, 4, HIDDEN), weight, labels.view(3, 4), reduction="mean")


def test_chunk_rows_choice():
    bf16 = torch.bfloat16
    mib = 2**20

    def chunk_mib(rows, vocab):
        return rows * vocab * 2 / mib

    # Default: Liger-Kernel's chunk (256 rows, 62.6 MiB here) + 252 MiB allows 1286 rows: 7 balanced
    # chunks of 1171 rows in 128-row units: the largest 1280 (1280 + 6 x 1152).
    assert fused_linear_cross_entropy_chunk_rows(8192, 4096, 128256, bf16) == 1280
    assert chunk_mib(1280, 128256) <= chunk_mib(256, 128256) + 252
    # 997 rows fit at V=151936: 5 chunks of 820 rows in 128-row units, 2 x 896 + 3 x 768.
    assert fused_linear_cross_entropy_chunk_rows(4096, 4096, 151936, bf16) == 896
    # Liger's chunk is only 32 rows at T=1024, but the budget still holds the whole batch in one chunk.
    assert fused_linear_cross_entropy_chunk_rows(1024, 4096, 128256, bf16) == 1024
    # 512 Liger rows + 252 MiB allow 1544 rows: 11 chunks of 1490, rounded up to 1536.
    rows = fused_linear_cross_entropy_chunk_rows(16384, 2048, 128256, bf16)
    assert rows == 1536 and chunk_mib(rows, 128256) <= chunk_mib(512, 128256) + 252
    # With ignored tokens the gathered hidden rows and their dh count against the same budget.
    with_gather = fused_linear_cross_entropy_chunk_rows(8192, 4096, 128256, bf16, rows_to_chunk=8000)
    assert with_gather * (128256 + 2 * 4096) * 2 <= chunk_mib(256, 128256) * mib + 252 * mib
    assert fused_linear_cross_entropy_chunk_rows(40, 64, 1000, torch.float32) == 40
    # One chunk is exactly the rows to process, never rounded up past them.
    assert fused_linear_cross_entropy_chunk_rows(777, 896, 151936, bf16, rows_to_chunk=690) == 690
    assert fused_linear_cross_entropy_chunk_rows(1, 4096, 128256, bf16) == 1
    # An explicit budget is honoured: 4186 rows fit in 1 GiB, so 2 chunks of 4096.
    assert fused_linear_cross_entropy_chunk_rows(8192, 4096, 128256, bf16, 2**30) == 4096
    # 8 rows fit: 13 chunks of 7.7 rows, 8 each; below 128 rows no rounding.
    assert fused_linear_cross_entropy_chunk_rows(100, 64, 1000, torch.float32, 8 * 4000) == 8
    assert fused_linear_cross_entropy_chunk_rows(90, 64, 1000, torch.float32, 60 * 4000) == 45


def test_chunk_sizes_are_whole_units_and_never_a_sliver():
    bf16 = torch.bfloat16
    # 1286 rows fit: 7 chunks of 1170 rows, in 128-row units: 1152 each and the remaining unit on the first.
    assert fused_linear_cross_entropy_chunk_sizes(8192, 4096, 128256, bf16) == [1280] + [1152] * 6
    # 997 rows fit at V=151936: 10 chunks, not 9 x 896 + 128.
    assert fused_linear_cross_entropy_chunk_sizes(8192, 2048, 151936, bf16) == [896] * 4 + [768] * 6
    # A budget of 2048 rows or more takes 512-row units: at T=65536, H=4096, V=151936 2877 rows fit, so
    # 24 chunks of 2560 and 2 of 2048, where 128-row units gave 24 of 2688-2816.
    assert fused_linear_cross_entropy_chunk_sizes(65536, 4096, 151936, bf16) == [2560] * 24 + [2048] * 2
    # Below one 128-row unit a chunk: plain balanced sizes.
    assert fused_linear_cross_entropy_chunk_sizes(100, 64, 1000, torch.float32, 8 * 4000) == [8] * 9 + [7] * 4
    for tokens, hidden, vocab, rows_to_chunk in [(8192, 4096, 256000, 8192), (65536, 2048, 151936, 60001),
                                                 (4097, 1536, 32000, 3000), (16384, 896, 151936, 16383),
                                                 (65536, 2048, 128256, 50001)]:  # fmt: skip
        sizes = fused_linear_cross_entropy_chunk_sizes(
            tokens, hidden, vocab, bf16, rows_to_chunk=rows_to_chunk
        )
        most = fused_linear_cross_entropy_chunk_rows(tokens, hidden, vocab, bf16, rows_to_chunk=rows_to_chunk)
        assert sum(sizes) == rows_to_chunk and max(sizes) == most
        unit = 512 if most >= 2048 else 128
        assert all(size % unit == 0 for size in sizes[:-1])
        assert max(sizes) - min(sizes) < 2 * unit


# The logits buffer's padded row width at VOCAB (777, odd on purpose).
ALIGNED_VOCAB = -(-VOCAB // flce_module.LOGITS_ROW_ALIGNMENT) * flce_module.LOGITS_ROW_ALIGNMENT


def test_logits_rows_are_aligned_at_an_odd_vocabulary(device, monkeypatch):
    """Every chunk's logits reach the matmuls and the cross-entropy kernel as a [C, V] view whose rows start
    at multiples of LOGITS_ROW_ALIGNMENT elements (cuBLAS's unaligned kernels are several times slower), and
    the loss and gradients stay the reference's."""
    strides: list[int] = []
    real_launch = flce_module.launch_cross_entropy_forward

    def launch(logits, *args, **kwargs):
        assert logits.shape[1] == VOCAB
        strides.append(logits.stride(0))
        return real_launch(logits, *args, **kwargs)

    monkeypatch.setattr(flce_module, "launch_cross_entropy_forward", launch)
    hidden, weight, labels, _ = make_inputs(40, torch.float32, device, ignored_every=0)
    assert_matches_reference(hidden, weight, labels, reduction="mean")
    assert strides and all(stride == ALIGNED_VOCAB for stride in strides), strides


def test_chunk_that_does_not_fit_is_cut_to_half_the_free_memory(device, monkeypatch):
    """The chunk is sized without asking the device; when its allocation fails, the free memory is asked
    once and the chunks shrink to half of it, with the same loss and gradients."""
    import fusetune.kernels.fused_linear_cross_entropy as flce_module

    hidden, weight, labels, _ = make_inputs(40, torch.float32, device, ignored_every=0)
    row_bytes = VOCAB * 4
    allocated_rows: list[int] = []
    real_empty = torch.empty

    def empty(*args, **kwargs):
        shape = args[0] if args and isinstance(args[0], tuple) else None
        if shape is not None and len(shape) == 2 and shape[1] == ALIGNED_VOCAB:
            allocated_rows.append(shape[0])
            if shape[0] > 16:
                raise torch.OutOfMemoryError("the chunk does not fit")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(flce_module.torch, "empty", empty)
    monkeypatch.setattr(flce_module.torch.cuda, "mem_get_info", lambda device=None: (33 * row_bytes, 0))
    assert_matches_reference(hidden, weight, labels, reduction="mean")
    # 40 rows refused; 16 rows (half of 33 rows' bytes) in three balanced chunks of 14.
    assert allocated_rows == [40, 14]
    assert (
        fused_linear_cross_entropy_chunk_rows(40, HIDDEN, VOCAB, torch.float32, free_bytes=33 * row_bytes)
        == 14
    )


def test_rejects_bad_arguments():
    hidden, weight, labels, _ = make_inputs(4, torch.float32, "cpu")
    with pytest.raises(ValueError, match="dtype"):
        fused_linear_cross_entropy(hidden, weight.double(), labels)
    with pytest.raises(ValueError, match="labels"):
        fused_linear_cross_entropy(hidden, weight, labels[:3])
    with pytest.raises(ValueError, match="num_items_in_batch"):
        fused_linear_cross_entropy(hidden, weight, labels, num_items_in_batch=0)


# --- mutation tests ---------------------------------------------------------------------------------


# (kernel whose source is mutated, tokens): 16 tokens are held in dW's memory (the kernel over [V, N]
# logits, whose helper _entry_gradient has the anchor: a copy of the kernel with the mutated helper, since a
# compiled kernel keeps the helper it was built with), 80 run in chunks (the row kernel).
SOFTCAP_MUTANTS = [("_cross_entropy_columns_kernel", 16), ("_cross_entropy_forward_kernel", 80)]


@pytest.mark.parametrize(("kernel", "n_tokens"), SOFTCAP_MUTANTS, ids=["held", "chunks"])
def test_mutant_without_softcap_derivative_fails(device, tmp_path, monkeypatch, kernel, n_tokens):
    mutant = mutated_kernel(
        getattr(ce_module, kernel), "g = g * (1.0 - t * t)", "g = g * 1.0", tmp_path, "no_softcap_grad"
    )
    hidden, weight, labels, _ = make_inputs(n_tokens, torch.float32, device, logit_scale=3.0)
    options = {"reduction": "sum", "softcap": 4.0, "logits_chunk_bytes": chunk_bytes(8, torch.float32)}
    assert_matches_reference(hidden, weight, labels, **options)  # the real kernel passes
    monkeypatch.setattr(ce_module, kernel, mutant)
    with pytest.raises(AssertionError, match="not close"):
        assert_matches_reference(hidden, weight, labels, **options)


# --- compile ---------------------------------------------------------------------------------------


def test_traces_with_fullgraph_aot_eager(device):
    hidden, weight, labels, _ = make_inputs(16, torch.float32, device)
    options = {
        "num_items_in_batch": torch.tensor(9, device=device),
        "logits_chunk_bytes": chunk_bytes(8, torch.float32),
    }
    expected_loss, _, expected_grads = run(
        fused_linear_cross_entropy, hidden, weight, labels, None, None, **options
    )
    compiled = torch.compile(fused_linear_cross_entropy, fullgraph=True, backend="aot_eager")
    loss, _, grads = run(compiled, hidden, weight, labels, None, None, **options)
    torch.testing.assert_close(loss, expected_loss, atol=0.0, rtol=0.0)
    for grad, expected in zip(grads[:2], expected_grads[:2], strict=True):
        torch.testing.assert_close(grad, expected, atol=0.0, rtol=0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compiled_inductor_fullgraph_matches_eager(reduction):
    hidden, weight, labels, bias = make_inputs(512, torch.bfloat16, "cuda", bias=True)
    upstream = torch.randn(512, device="cuda") if reduction == "none" else torch.tensor(0.5, device="cuda")
    options = {
        "reduction": reduction,
        "softcap": 30.0,
        "logits_chunk_bytes": chunk_bytes(128, torch.bfloat16),
    }
    expected_loss, _, expected_grads = run(
        fused_linear_cross_entropy, hidden, weight, labels, bias, upstream, **options
    )
    compiled = torch.compile(fused_linear_cross_entropy, fullgraph=True)
    loss, _, grads = run(compiled, hidden, weight, labels, bias, upstream, **options)
    torch.testing.assert_close(loss, expected_loss, atol=0.0, rtol=0.0)
    for grad, expected in zip(grads, expected_grads, strict=True):
        assert_close_scaled(grad, expected, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("n_tokens", "hidden_size", "vocab", "options"),
    [
        (2048, 2048, 128256, {"reduction": "mean"}),
        (1024, 1024, 262144, {"reduction": "sum", "softcap": 30.0, "num_items_in_batch": 700}),
        (777, 896, 151936, {"reduction": "none", "accumulate_dw_in_fp32": True}),
        (1024, 4096, 151936, {"reduction": "mean", "return_accuracy": True}),
        (2048, 2048, 128256, {"reduction": "sum", "logits_chunk_bytes": 256 * 128256 * 2}),
        (1000, 1024, 256000, {"reduction": "mean", "softcap": 30.0, "logits_chunk_bytes": 256 * 256000 * 2}),
    ],
    ids=[
        "llama3",
        "gemma2-softcap",
        "qwen-none",
        "qwen-logits-in-dw",
        "all-in-dw-bounced",
        "in-dw-width-1000",
    ],
)
def test_real_shapes_on_gpu(n_tokens, hidden_size, vocab, options):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(n_tokens, hidden_size, generator=generator).to("cuda", torch.bfloat16)
    weight = (torch.randn(vocab, hidden_size, generator=generator) / hidden_size**0.5).to(
        "cuda", torch.bfloat16
    )
    labels = torch.randint(0, vocab, (n_tokens,), generator=generator).to("cuda")
    labels[::9] = -100
    upstream = torch.randn(n_tokens, device="cuda") if options["reduction"] == "none" else None
    # Default chunking: 2 and 3 chunks at the first two shapes (bf16 dW summed across them), 1 at the third,
    # one held in dW's memory at the fourth (two chunks otherwise). Then all tokens held in dW's memory in
    # rows of H (each dW row through the bounce buffer), and in rows of 1000 of H=1024.
    assert_matches_reference(hidden, weight, labels, None, upstream, **options)


@pytest.mark.gpu
@pytest.mark.parametrize("num_items", [None, "tensor"])
def test_one_chunk_runs_without_synchronising_on_gpu(num_items):
    # torch raises on any host synchronisation in "error" mode (a nonzero, an .item(), a blocking copy).
    hidden, weight, labels, _ = make_inputs(256, torch.bfloat16, "cuda")
    hidden.requires_grad_()
    weight.requires_grad_()
    count = torch.tensor(200.0, device="cuda") if num_items == "tensor" else None

    def fwd_bwd():
        loss, accuracy = fused_linear_cross_entropy(
            hidden, weight, labels, num_items_in_batch=count, return_accuracy=True
        )
        torch.autograd.grad([loss], [hidden, weight])
        return loss, accuracy

    fwd_bwd()  # kernels compiled and loaded first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, accuracy = fwd_bwd()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss) and 0.0 <= float(accuracy) <= 1.0


@pytest.mark.parametrize(("n_rows", "vocab_size"), [(3, 777), (2, 64), (1, 65)])
def test_logits_buffer_padding_is_zero(device, n_rows, vocab_size):
    # A matmul may read a row's padding past V (oneDNN's AMX kernels load K in whole tiles): with the
    # allocator's NaN (the poisoning fixture) left there, 0 * NaN made whole rows of dh NaN.
    view = flce_module._logits_buffer(n_rows, vocab_size, torch.bfloat16, torch.device(device))
    width = view.stride(0)
    whole = view.as_strided((n_rows, width), (width, 1))
    assert width % flce_module.LOGITS_ROW_ALIGNMENT == 0 and view.shape == (n_rows, vocab_size)
    assert torch.count_nonzero(whole[:, vocab_size:]).item() == 0


def test_held_logits_padding_is_zero(device):
    # The same for the [V, rows] logits held in dW's memory, whose rows are padded to the held width.
    grad_weight = torch.full((VOCAB, HIDDEN), float("nan"), device=device)
    width = flce_module._held_logits_width(12, HIDDEN)
    held = flce_module._transposed_logits_in(grad_weight, 12, width)
    assert width == 16 and held.shape == (VOCAB, 12)
    padding = grad_weight.view(-1)[: VOCAB * width].view(VOCAB, width)[:, 12:]
    assert torch.count_nonzero(padding).item() == 0
