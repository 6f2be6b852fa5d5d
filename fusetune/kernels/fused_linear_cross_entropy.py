"""Linear projection + cross-entropy without ever holding the [T, V] logits.

``loss = cross_entropy(hidden [T, H] @ weight[V, H]^T (+ bias), labels)`` computed chunk by chunk over
the tokens: for each chunk of C valid tokens

    logits_c  = h_c @ W^T (+ b)                       one [C, V] buffer, reused for every chunk
    (loss_c, dlogits_c) = cross-entropy kernel          gradient written in place into that buffer
    dh_c      = dlogits_c @ W                           written straight into grad_hidden
    dW       += dlogits_c^T @ h_c                       accumulated in weight's dtype, or in float32
    db       += column sums of dlogits_c

Tokens labelled ``ignore_index`` get loss 0 and gradient 0. When the tokens take several chunks, they are
dropped before any matmul (their rows are gathered away first, after one wait for the device); a call run
as one chunk (or held in dW's memory, below) runs them and never waits. Gradients are computed during the
forward for reductions "mean" and "sum", so the backward only scales them by the upstream gradient (skipped
on the device when it is 1). For ``reduction="none"`` the upstream gradient is a per-token vector that must weigh each token before
the sum over tokens in dW, so the forward computes only the losses and the backward recomputes the
logits chunk by chunk with the per-token weights folded into the cross-entropy kernel (one extra
[T, H] x [H, V] matmul: 79 ms instead of 63 ms on H100 at T=8192, H=4096, V=128256).

With ``skip_small_gradients`` the two backward matmuls run only over the entries of dlogits that matter:
an entry is skipped when ``|dlogits_tj| <= skip_threshold * |c_t|`` (``c_t`` the token's gradient scale,
so for a non-label entry without softcap or z-loss, when the softmax probability p_tj <= skip_threshold).
The kept entries (row-sorted coordinates, per chunk) feed two gather kernels instead of dense matmuls:

    dh_t  = sum over kept j of dlogits_tj * W_j            (per token: its few kept vocabulary rows)
    dW_j  = sum over kept t of dlogits_tj * h_t            (per vocabulary row, over all chunks at once)

On peaked logits (a trained model's) a token keeps tens of entries out of the vocabulary, scattered
over it, so whole [token-block x vocab-block] tiles are rarely all below the threshold (at a mean entropy
of 2 nats and 2**-12, 128x128 tiles are all live) while the entries are >99.9% skippable: hence entries,
not tiles. The logits matmul and the cross-entropy pass stay dense (the log-sum-exp needs every logit).
dW is summed once in float32 over all chunks and rounded once, so ``accumulate_dw_in_fp32`` changes
nothing there. Label smoothing puts gradient on every vocabulary entry and is refused in this mode.

Memory: beyond the gradients themselves (grad_hidden [T, H], grad_weight [V, H], plus a float32 copy
of grad_weight with ``accumulate_dw_in_fp32``) only the [C, V] chunk, see
:func:`fused_linear_cross_entropy_chunk_rows`. When the budget makes several chunks but the [T, V] logits
are no larger than dW (T <= H: short calls, as T=1024-4096 at H=4096) and dW is computed, they are one chunk
held in dW's own memory, which nothing needs before that chunk's dW matmul: laid out [V, T] (``W @ h^T``;
the cross-entropy kernels over columns, :func:`~fusetune.kernels.cross_entropy.launch_cross_entropy_columns`),
so that dW's row v depends only on logits row v, which lies at or before it in memory (see
:func:`_weight_gradient_over_its_transposed_logits`). One pass of the three matmuls, as with the whole
logits, and no dW re-read per chunk, within the chunks' memory; all tokens run and nothing waits. Measured
on H100 against the chunks (benchmarks/kernels/loss_launch_settings.py, fwd+bwd ms, one run): T=4096, H=4096,
V=256000 with softcap 30, 43.5 -> 39.2; V=151936 24.9 -> 23.9. Holding the first H tokens so when T > H, the
rest in chunks, measured within +-3% of the chunks alone at V=128256-256000 and 4-9% slower at T=4096,
H=1536-2048, V=128256-151936 (a copy of dW through the buffer, its width being H, and cross-entropy
kernels 1.1-1.4x slower over columns than over rows, against the dW re-reads saved): not done.
"""

from __future__ import annotations

import inspect
import itertools

import torch
import triton
import triton.language as tl
from torch import Tensor, nn

from fusetune.kernels._interpreter import interpreted, round_to_dtype
from fusetune.kernels.cross_entropy import (
    _check_reduction,
    cross_entropy_reference,
    is_live_gradient,
    launch_cross_entropy_columns,
    launch_cross_entropy_forward,
    launch_scale_rows_,
    live_count_columns,
    loss_result,
)

__all__ = [
    "DEFAULT_SKIP_THRESHOLD",
    "FusedLinearCrossEntropyLoss",
    "fused_linear_cross_entropy",
    "fused_linear_cross_entropy_chunk_rows",
    "fused_linear_cross_entropy_chunk_sizes",
    "fused_linear_cross_entropy_reference",
]

# Liger-Kernel's chunk: ceil(T / ceil(V / H)) rows rounded up to a power of two. By default a chunk (with the
# gathered hidden rows and their dh when tokens are ignored) may use this much more than that chunk's bytes:
# the extra memory stays within 256 MiB of Liger-Kernel's, with 4 MiB left for the loop's per-token buffers.
DEFAULT_EXTRA_CHUNK_BYTES = 252 * 2**20
# Chunks are balanced (the last is not a sliver), and their rows a multiple of this when the budget allows.
# cuBLAS's Hopper kernels take 128- to 320-row tiles: measured on H100 (benchmarks/kernels/loss_launch_settings.py
# --parts gemms), chunks of 832 rows (13 x 64) cost 6.1 us a row at H=4096, V=151936 where 768 and 896
# cost 5.5 and 5.6 (the logits matmul and dh alike), and the same at every H and V of the sweep. Where the
# budget holds chunks of _LARGE_CHUNK_ROWS or more, 512-row units: measured on H100, each variant in its own
# steady power state (benchmarks/kernels/loss_launch_settings.py --parts chunk-rows --shapes ..., at e29d48b,
# 2026-11-27), fwd+bwd ms with 128 / 512 / 2048-row units / Liger-Kernel: T=65536, H=2048, V=128256 167.9 /
# 164.3 / 163.4 / 164.2; T=65536, H=4096, V=151936 384.8 / 377.3 / 378.8 / 381.6; T=65536, H=4096, V=256000,
# softcap 30 653.2 / 648.5 / 648.7 / 658.9 (every chunk of 1024 rows: 172.9 / 388.2 / 665.6); a scratch run
# of the same method, T=65536, H=4096, V=128256: 318.0 / 311.3 / 317.8 / 318.0. Below that size the 512
# unit costs chunks (do_bench, 2026-11-27, 128 / 256 / 512: T=8192, H=4096 39.6 / 39.8 / 40.1 with 8 chunks
# of 1024 instead of 7; T=16384, H=1536, V=256000 77.2 / 80.1 / 80.6 with 32 chunks of 512 instead of 27),
# though T=16384, H=4096 measured 82.4 / 80.4 / 80.2: not taken there.
_CHUNK_ROW_ALIGNMENT = 128
_LARGE_CHUNK_ROW_ALIGNMENT = 512
_LARGE_CHUNK_ROWS = 2048
# Default of ``skip_threshold``: 16 times below bfloat16's resolution at 1 (2**-8), because the skipped
# entries add up over the vocabulary: at a mean entropy of 2 nats the skipped probability mass per token
# is 7% at 2**-8 and 1.6% at 2**-12 (random peaked logits, V=128256), while a token keeps 16 and 71 entries.
DEFAULT_SKIP_THRESHOLD = 2.0**-12


def fused_linear_cross_entropy_chunk_rows(*args, **kwargs) -> int:
    """Rows of the [C, V] logits buffer: the largest chunk of :func:`fused_linear_cross_entropy_chunk_sizes`,
    which takes the same arguments."""
    return max(fused_linear_cross_entropy_chunk_sizes(*args, **kwargs))


def fused_linear_cross_entropy_chunk_sizes(
    n_tokens: int,
    hidden_size: int,
    vocab_size: int,
    logits_dtype: torch.dtype,
    logits_chunk_bytes: int | None = None,
    *,
    rows_to_chunk: int | None = None,
    free_bytes: int | None = None,
) -> list[int]:
    """Rows of each chunk of logits, in order: the one place the chunking is chosen.

    The budget for the [C, V] chunk is ``logits_chunk_bytes``, or by default the bytes of Liger-Kernel's
    chunk at this shape plus :data:`DEFAULT_EXTRA_CHUNK_BYTES`, less the chunk's gathered [C, H] hidden
    rows and their dh when ``rows_to_chunk`` (the valid tokens; default ``n_tokens``) < ``n_tokens``;
    never more than half of ``free_bytes`` when given (the loop passes the device's free memory only after
    an allocation of the chunk failed: asking the allocator for its cached bytes on every call cost
    0.32 ms of host time on H200, a fifth of the whole call at T=1024, V=32000). The rows are then cut into
    the fewest chunks that fit, of balanced sizes in whole 128-row units where the rows allow (cuBLAS's Hopper
    tiles; 512-row units where 2048 rows or more fit, see _LARGE_CHUNK_ROWS; the remainder spread a unit at
    a time, the last chunk taking what is under a unit), so that no
    chunk is a sliver: a chunk under ~470 rows (2 x matmul rate / memory bandwidth on H100) makes the dW
    GEMM, K = its rows, read and write all of dW at a memory-bound pace, and before this rule T=8192 at
    V=151936 ran as 9 x 896 + 128 rows.

    Larger chunks are faster because dW += dlogits_c^T @ h_c (K = C) reads and writes all of dW, 4*V*H
    bytes, once per chunk, and each chunk re-reads W twice. Measured on H100, bf16, fwd+bwd through
    torch.autograd.grad, peak extra memory including the returned gradients (1066 MB here), one run
    (benchmarks/kernels/loss_launch_settings.py, 2026-11-25; matmul floor 35.7 ms; do_bench takes only 2-3
    samples of a 40 ms call, so +-1 ms), T=8192, H=4096, V=128256:
        torch.compile      37.9 ms, 3070 MB          Liger-Kernel 0.8.5   64.5 ms, 1129 MB
        256 rows (Liger's chunk, the earlier default)                    63.3 ms, 1129 MB
        1216 rows (default: 7 chunks, 6 x 1216 + 896)                     42.7 ms, 1364 MB
        1024 rows  43.5 ms, 1317 MB;  1536 rows  43.1 ms, 1411 MB
        2048 rows  39.0 ms, 1567 MB;  4096 rows  40.8 ms, 2068 MB
    (these with a variant of the cross-entropy kernel 0.6 ms slower per 8192 rows than the one used now).
    Profile of the default: per 1216-row chunk the three matmuls take 1.73 (h @ W^T), 1.64 (dh) and
    1.83 ms (dW, beta = 1), near the matmul rate; the 896-row last chunk's take 4.6 ms (cuBLAS picks
    split-K and smaller tiles); the cross-entropy kernel 0.34 ms per chunk; and about 4 ms of the measured
    time is not in any kernel of the profile. At other shapes the default against torch.compile and
    Liger-Kernel: the fused_linear_cross_entropy sweep rows of benchmarks/results/h100-kernels.json (section
    ops). The earlier default, Liger-Kernel's chunk, took in the run of the table above:
        T=1024,  H=4096, V=128256   15.5 ms      T=16384, H=4096, V=128256   93.2 ms
        T=8192,  H=4096, V=32000    11.2 ms      T=8192,  H=4096, V=151936   74.3 ms
        T=8192,  H=4096, V=256000, softcap 30   129.5 ms
        T=16384, H=1536, V=128256   53.7 ms      T=65536, H=4096, V=128256  329.4 ms
    Where the budget leaves small chunks against a large vocabulary (T > H, H = 1536-2048, V = 151936-256000)
    the chunks' dW matmuls bound the call. H100 at T=8192, H=1536, V=256000, softcap 30 (16 chunks of 512;
    kernel durations after 3 s of calls, mean of 5, 2026-11-27): torch.compile 35.1 ms, its three matmuls
    26.3 (dW 8.7) and its cross-entropy 8.7; this loop 39.7, its matmuls 33.8 (dW 14.5: 15 of K = 512 that
    read and write all 786 MB of dW, 0.92 ms each), its cross-entropy 5.7. Nsight Compute counts 54.8 GB
    read and 19.8 GB written per call. At T=4096, H=2048, V=151936 (5 chunks): 12.1 against 13.0 ms, dW
    4.2 ms in 5 matmuls against torch.compile's 3.3 in one.
    """
    itemsize = logits_dtype.itemsize
    row_bytes = max(1, vocab_size * itemsize)
    rows_to_chunk = n_tokens if rows_to_chunk is None else rows_to_chunk
    if logits_chunk_bytes is None:
        budget = _default_chunk_budget_bytes(n_tokens, hidden_size, vocab_size, itemsize)
        gathered_row_bytes = 2 * hidden_size * itemsize if rows_to_chunk < n_tokens else 0
        budget_rows = budget // (row_bytes + gathered_row_bytes)
    else:
        budget_rows = int(logits_chunk_bytes) // row_bytes
    if free_bytes is not None:
        budget_rows = min(budget_rows, free_bytes // 2 // row_bytes)
    return _balanced_chunk_sizes(rows_to_chunk, max(1, budget_rows))


def _default_chunk_budget_bytes(n_tokens: int, hidden_size: int, vocab_size: int, itemsize: int) -> int:
    """Liger-Kernel's chunk at this shape plus :data:`DEFAULT_EXTRA_CHUNK_BYTES`."""
    liger_rows = triton.next_power_of_2(triton.cdiv(n_tokens, triton.cdiv(vocab_size, hidden_size)))
    return min(liger_rows, n_tokens) * vocab_size * itemsize + DEFAULT_EXTRA_CHUNK_BYTES


def _balanced_chunk_sizes(rows_to_chunk: int, max_rows: int) -> list[int]:
    """The fewest chunks of at most ``max_rows`` rows, each a whole number of units (_CHUNK_ROW_ALIGNMENT
    rows, or _LARGE_CHUNK_ROW_ALIGNMENT when ``max_rows`` >= _LARGE_CHUNK_ROWS) but the last (which also takes
    the remainder under a unit), their sizes differing by at most one unit."""
    n_chunks = triton.cdiv(rows_to_chunk, max_rows)
    if n_chunks <= 1:
        return [int(max(1, rows_to_chunk))]
    unit = _LARGE_CHUNK_ROW_ALIGNMENT if max_rows >= _LARGE_CHUNK_ROWS else _CHUNK_ROW_ALIGNMENT
    while True:
        base = rows_to_chunk // n_chunks // unit * unit
        if base == 0:  # chunks under one unit: plain balanced sizes
            size, larger = divmod(rows_to_chunk, n_chunks)
            return [size + 1] * larger + [size] * (n_chunks - larger)
        extra_units, remainder = divmod(rows_to_chunk - n_chunks * base, unit)
        sizes = [base + unit] * extra_units + [base] * (n_chunks - extra_units)
        sizes[-1] += remainder
        if max(sizes) <= max_rows:
            return sizes
        n_chunks += 1


def _count_on_host(count: Tensor) -> int:
    """The value of a device scalar, through a copy to pinned memory and an event. The host waits as long as
    in torch.nonzero (for everything queued before), but then has only the indices' kernel to launch
    (_true_indices), where torch.nonzero's own host work after its wait left the device idle (0.14 ms of
    gaps in a profile on H100)."""
    if count.device.type != "cuda":
        return int(count)
    on_host = torch.empty((), dtype=count.dtype, pin_memory=True)
    on_host.copy_(count, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    ready.synchronize()
    return int(on_host)


def _true_indices(mask: Tensor, n_true: int) -> Tensor:
    """Indices of the ``n_true`` True entries of a 1-d mask, with no further synchronisation."""
    if hasattr(torch, "nonzero_static"):
        return torch.nonzero_static(mask, size=n_true).squeeze(1)
    return torch.nonzero(mask).squeeze(1)


def _gradient_scale(reduction: str, num_items: float | Tensor | None, valid_count: Tensor) -> Tensor:
    """1 / the loss's denominator as a float32 [1] device tensor (0 for a zero ``num_items``), computed on the
    device from the counts that live there (the valid tokens, ``num_items`` as a tensor), never read."""
    device = valid_count.device
    if reduction == "none" or (reduction == "sum" and num_items is None):
        return torch.ones(1, dtype=torch.float32, device=device)
    if num_items is None:  # "mean": with no valid token every row's gradient is 0 whatever the scale
        return valid_count.to(torch.float32).reshape(1).clamp_(min=1.0).reciprocal_()
    if isinstance(num_items, Tensor):
        count = num_items.to(device=device, dtype=torch.float32).reshape(1)
        return torch.where(count != 0.0, count.reciprocal(), 0.0)
    return torch.full((1,), 1.0 / float(num_items), dtype=torch.float32, device=device)


def _held_logits_width(n_rows: int, hidden_size: int) -> int:
    """Row width of the [V, n_rows] logits held at the start of the [V, H] weight gradient's memory
    (n_rows <= H): a multiple of 8 (rows of whole 16 bytes, which cuBLAS's fast kernels need) where H allows."""
    width = triton.cdiv(n_rows, 8) * 8
    return width if width <= hidden_size else n_rows


def _transposed_logits_in(grad_weight: Tensor, n_rows: int, width: int) -> Tensor:
    """The [V, n_rows] view, rows ``width`` apart, at the start of the contiguous ``grad_weight``'s memory.
    Its padding columns (width - n_rows of each row) are zeroed: dW = logits_t @ h reduces over them, and a CPU
    matmul may read a tile past K (see LOGITS_ROW_ALIGNMENT)."""
    vocab_size = grad_weight.shape[0]
    rows = grad_weight.view(-1)[: vocab_size * width].view(vocab_size, width)
    if width > n_rows:
        rows[:, n_rows:].zero_()
    return rows[:, :n_rows]


def _bounce_elements(n_tokens: int, weight: Tensor, logits_chunk_bytes: int | None) -> int:
    """Elements of the buffer through which :func:`_weight_gradient_over_its_transposed_logits` writes the
    rows of dW that overlap their own logits: the chunks' budget (no chunk buffer is allocated then)."""
    vocab_size, hidden_size = weight.shape
    itemsize = weight.element_size()
    if logits_chunk_bytes is None:
        logits_chunk_bytes = _default_chunk_budget_bytes(n_tokens, hidden_size, vocab_size, itemsize)
    return max(hidden_size, min(vocab_size * hidden_size, logits_chunk_bytes // itemsize))


def _weight_gradient_over_its_transposed_logits(
    grad_weight: Tensor, logits_t: Tensor, hidden: Tensor, bounce: Tensor
) -> None:
    """grad_weight = logits_t @ hidden, where ``logits_t`` [V, C] (rows ``w`` apart, w <= H) lies at the start
    of grad_weight's memory: dW's row v depends on logits row v only, and lies at or after it in memory.

    Vocabulary rows from the last: while rows [0, top) of the logits are unread (their first top * w
    elements), dW's rows from ceil(top * w / H) up lie clear of them and take one matmul; rows that lie
    over their own logits (all of them when w = H) are computed into ``bounce`` (a flat buffer, at least
    H elements) and copied into place, a buffer-full at a time, which overwrites only logits already read.
    """
    vocab_size, hidden_size = grad_weight.shape
    width = logits_t.stride(0)
    bounce_rows = min(vocab_size, bounce.numel() // hidden_size)
    top = vocab_size
    while top > 0:
        clear_from = -(-top * width // hidden_size)
        if top > bounce_rows and top - clear_from >= bounce_rows:
            torch.mm(logits_t[clear_from:top], hidden, out=grad_weight[clear_from:top])
            top = clear_from
            continue
        low = max(0, top - bounce_rows)
        out = bounce[: (top - low) * hidden_size].view(top - low, hidden_size)
        torch.mm(logits_t[low:top], hidden, out=out)
        grad_weight[low:top].copy_(out)
        top = low


# The logits buffer's rows start every LOGITS_ROW_ALIGNMENT elements, whatever the vocabulary size. With an odd
# vocabulary the rows of a dense [C, V] buffer are misaligned, and cuBLAS then runs the three matmuls that read
# or write it (h @ W^T, dh, dW) with its slow unaligned kernels (cutlass `align1`), and the cross-entropy
# kernel's row loads go unaligned too. H100, Granite-3.3-2B shape (V = 49,159), 4 x 2048 tokens
# (benchmarks/step/e2e.py --profile, 2026-11-27): those matmuls took 42 ms of a 314 ms step and the
# cross-entropy kernel 7.9 ms (1.4 at OLMo-2's V = 100,352, a multiple of 64).
# Every kernel and matmul sees the [C, V] view, whose row stride is the padded width, and none of them uses the
# padding columns; but a CPU matmul may still *read* them. oneDNN's bf16 kernels for AVX-512-BF16 and AMX
# multiply bf16 values in pairs along the reduction (and AMX loads it in tiles), so with dh = dlogits @ W, where
# K = V, an odd V has them read past V into the padding, times a zero they put in W's place. A NaN or an
# infinity the allocator's previous owner left there then makes 0 * NaN whole rows of NaN in dh: the bf16 tests
# failed so on an Intel Xeon with amx_bf16 (issue 55: in some runs, and rows 0-15 NaN after a NaN-filled
# tensor was freed), never on AVX2 CPUs; on an H200, cuBLAS with NaN in the padding gave no NaN
# (2026-12-01, one call). So the padding is zeroed once per buffer: n_rows * (width - V) < 64 * n_rows elements.
LOGITS_ROW_ALIGNMENT = 64


def _logits_buffer(n_rows: int, vocab_size: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """An [n_rows, vocab_size] view, uninitialised, whose rows are LOGITS_ROW_ALIGNMENT-aligned; the padding
    columns past vocab_size are zero."""
    width = triton.cdiv(vocab_size, LOGITS_ROW_ALIGNMENT) * LOGITS_ROW_ALIGNMENT
    buffer = torch.empty((n_rows, width), dtype=dtype, device=device)
    if width > vocab_size:
        buffer[:, vocab_size:].zero_()
    return buffer[:, :vocab_size]


def _per_token(rows: Tensor, valid_rows: Tensor | None, n_tokens: int) -> Tensor:
    """Per-token values from the rows that ran: 0 at the tokens that were dropped."""
    if valid_rows is None:
        return rows
    out = rows.new_zeros(n_tokens)
    return out.index_copy_(0, valid_rows, rows)


def _addmm_float32_(accumulator: Tensor, a: Tensor, b: Tensor) -> None:
    """accumulator (float32) += a @ b for low-precision a, b, without a float32 copy of the product."""
    if accumulator.device.type == "cuda":
        try:
            torch.addmm(accumulator, a, b, out_dtype=torch.float32, out=accumulator)
            return
        except (TypeError, RuntimeError, NotImplementedError):  # torch without the out_dtype overload
            pass
    accumulator.addmm_(a.to(torch.float32), b.to(torch.float32))


# --------------------------------------------------------------------------------------------------
# Skipping small gradient entries (skip_small_gradients)
# --------------------------------------------------------------------------------------------------


@triton.jit
def _collect_live_kernel(
    grad_ptr,
    grad_row_stride,
    scale_ptr,
    scale_row_stride,
    block_starts_ptr,
    cols_out_ptr,
    values_out_ptr,
    n_cols,
    count_columns,
    threshold,
    BLOCK: tl.constexpr,
):
    """Program (r, b) writes the kept entries (column, value) of row r's columns [b * count_columns,
    (b + 1) * count_columns), in column order, from block_starts[r * n_blocks + b] on.

    block_starts comes from the counts the cross-entropy kernel took per (row, block of count_columns) with
    the same judge on the same stored values, so every block of every row is collected in parallel and the
    rows still come out in column order; the stores are bounded by the next block's start, so no block
    can write into another's."""
    row = tl.cast(tl.program_id(0), tl.int64)
    block = tl.program_id(1)
    slot = row * tl.num_programs(1) + block
    limit = threshold * tl.abs(tl.load(scale_ptr + row * scale_row_stride).to(tl.float32))
    lanes = tl.arange(0, BLOCK)
    position = tl.load(block_starts_ptr + slot)
    block_end = tl.load(block_starts_ptr + slot + 1)
    first_col = block * count_columns
    last_col = tl.minimum(first_col + count_columns, n_cols)
    for first in range(first_col, last_col, BLOCK):
        cols = first + lanes
        in_block = cols < last_col
        raw = tl.load(grad_ptr + row * grad_row_stride + cols, mask=in_block, other=0.0)
        live = is_live_gradient(raw.to(tl.float32), limit) & in_block
        n_live = tl.sum(live.to(tl.int32), axis=0)
        if n_live > 0:
            slots = position + tl.cumsum(live.to(tl.int32), axis=0) - 1
            kept = live & (slots < block_end)
            tl.store(cols_out_ptr + slots, cols, mask=kept)
            tl.store(values_out_ptr + slots, raw, mask=kept)
        position += n_live


@triton.jit
def _gather_rows_product_kernel(
    row_starts_ptr,
    entry_index_ptr,
    entry_value_ptr,
    dense_ptr,
    dense_row_stride,
    out_ptr,
    out_row_stride,
    n_cols,
    BLOCK_E: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SOFTWARE_BF16_ROUNDING: tl.constexpr,
):
    """out[r, :] = sum over e in [row_starts[r], row_starts[r + 1]) of value[e] * dense[index[e], :].

    The sparse-times-dense product of both backward matmuls: with r a token and index a vocabulary row
    it is dh = dlogits @ W, with r a vocabulary row and index a token it is dW = dlogits^T @ h. Sums in
    float32 in entry order (deterministic), one rounding to out's dtype; a row without entries gets 0.
    """
    row = tl.cast(tl.program_id(0), tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_row = cols < n_cols
    start = tl.load(row_starts_ptr + row)
    end = tl.load(row_starts_ptr + row + 1)
    entry_lanes = tl.arange(0, BLOCK_E)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for first in range(start, end, BLOCK_E):
        entries = first + entry_lanes
        live = entries < end
        index = tl.load(entry_index_ptr + entries, mask=live, other=0).to(tl.int64)
        value = tl.load(entry_value_ptr + entries, mask=live, other=0.0).to(tl.float32)
        dense = tl.load(
            dense_ptr + index[:, None] * dense_row_stride + cols[None, :],
            mask=live[:, None] & in_row[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(value[:, None] * dense, axis=0)
    tl.store(
        out_ptr + row * out_row_stride + cols,
        round_to_dtype(acc, out_ptr.dtype.element_ty, SOFTWARE_BF16_ROUNDING),
        mask=in_row,
    )


@triton.jit
def _gather_row_groups_dot_kernel(
    row_starts_ptr,
    entry_row_ptr,
    entry_index_ptr,
    entry_value_ptr,
    dense_ptr,
    dense_row_stride,
    out_ptr,
    out_row_stride,
    n_rows,
    n_cols,
    ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_IN_FLOAT32: tl.constexpr,
):
    """The product of _gather_rows_product_kernel for ROWS consecutive output rows at once, for sparse
    rows with few entries each (dW: a vocabulary row keeps a few tokens' entries). Their entries are
    contiguous (entry_row: each entry's output row, ascending), so one loop walks them all and a tensor-core
    product [ROWS, BLOCK_E] x [BLOCK_E, BLOCK_N] routes each entry's dense row to its output row: the
    [ROWS, BLOCK_E] operand holds an entry's value in its own row's line and zeros elsewhere. Products of
    bfloat16 values are exact in the float32 accumulator, as in the row kernel; one rounding to out's dtype.
    DOT_IN_FLOAT32 (the CPU interpreter, whose dot does not take bfloat16) multiplies float32 copies, exactly.
    """
    first_row = tl.program_id(0) * ROWS
    rows = first_row + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_row = cols < n_cols
    start = tl.load(row_starts_ptr + first_row)
    end = tl.load(row_starts_ptr + tl.minimum(first_row + ROWS, n_rows))
    entry_lanes = tl.arange(0, BLOCK_E)
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for first in range(start, end, BLOCK_E):
        entries = first + entry_lanes
        live = entries < end
        owner = tl.load(entry_row_ptr + entries, mask=live, other=-1)
        index = tl.load(entry_index_ptr + entries, mask=live, other=0).to(tl.int64)
        value = tl.load(entry_value_ptr + entries, mask=live, other=0.0)
        dense = tl.load(
            dense_ptr + index[:, None] * dense_row_stride + cols[None, :],
            mask=live[:, None] & in_row[None, :],
            other=0.0,
        )
        routed = tl.where(owner[None, :] == rows[:, None], value[None, :], 0.0)
        if DOT_IN_FLOAT32:
            acc = tl.dot(routed.to(tl.float32), dense.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(routed.to(dense.dtype), dense, acc)
    tl.store(
        out_ptr + rows[:, None].to(tl.int64) * out_row_stride + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(rows < n_rows)[:, None] & in_row[None, :],
    )


# (entries per step, columns per program, warps) of the gather kernel on a GPU. Measured on H200 at T=8192,
# H=4096, V=128256 on peaked logits, the whole skip-mode fwd+bwd (benchmarks/kernels/loss_skip.py, one run,
# 2026-11-26): (8, 256, 1) with dW by rows 20.1 ms; (16, 512, 4) with dW by rows 26.3, with dW by
# ("dot", 32, 32, 128, 4) 21.5; (8, 512, 2) with ("dot", 16, 16, 128, 4) 20.3. loss_skip times these again.
GATHER_LAUNCH = (8, 256, 1)
# (columns per step, warps) of the collecting kernel on a GPU: one program per row and block of the
# cross-entropy kernel's columns (16384 at its default launch). H100, same measurement as above: (1024, 2)
# 19.1 ms, (2048, 4) 19.5, (4096, 8) 20.8, (8192, 8) 21.4.
COLLECT_LAUNCH = (1024, 2)
# dW from the kept entries: "rows" runs the gather kernel above per vocabulary row; ("dot", R, E, N, warps)
# runs _gather_row_groups_dot_kernel over groups of R vocabulary rows, E entries and N columns per step.
DW_GATHER = ("rows",)


def _live_gradient_entries(
    grad: Tensor, scale: Tensor, threshold: float, counts: Tensor, count_columns: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The entries of ``grad [R, V]`` above ``threshold * |scale|`` (scale: one value or one per row) in
    row-compressed form: (row_starts [R + 1] int64, columns int32, values in grad's dtype), each row's
    entries in column order. ``counts`` [R, cdiv(V, count_columns)] int32: the kept entries per row and
    block of columns, as the cross-entropy kernel counted them when it wrote ``grad``. Synchronises with
    the device once (for the number of entries)."""
    n_rows, n_cols = grad.shape
    n_blocks = counts.shape[1]
    scale = scale.reshape(-1)
    scale_row_stride = 0 if scale.numel() == 1 else scale.stride(0)
    if interpreted() or grad.device.type != "cuda":
        block, warps = 256, 1
    else:
        block, warps = COLLECT_LAUNCH
    block = min(block, triton.next_power_of_2(count_columns))
    block_starts = torch.zeros(n_rows * n_blocks + 1, dtype=torch.int64, device=grad.device)
    torch.cumsum(counts.reshape(-1), 0, out=block_starts[1:])
    n_entries = int(block_starts[-1].item())
    cols = torch.empty(n_entries, dtype=torch.int32, device=grad.device)
    values = torch.empty(n_entries, dtype=grad.dtype, device=grad.device)
    _collect_live_kernel[(n_rows, n_blocks)](
        grad, grad.stride(0), scale, scale_row_stride, block_starts, cols, values, n_cols, count_columns,
        float(threshold), BLOCK=block, num_warps=warps,
    )  # fmt: skip
    return block_starts[::n_blocks].contiguous(), cols, values


def _gather_rows_product(
    row_starts: Tensor, entry_index: Tensor, entry_value: Tensor, dense: Tensor, out: Tensor
) -> None:
    """out [R, N] = the sparse [R, *] matrix given by (row_starts, entry_index, entry_value) @ dense [*, N]."""
    n_rows, n_cols = out.shape
    if n_rows == 0 or n_cols == 0:
        return
    if interpreted() or out.device.type != "cuda":
        block_e, block_n, warps = 8, min(64, triton.next_power_of_2(n_cols)), 1
    else:
        block_e, block_n, warps = GATHER_LAUNCH
        block_n = min(block_n, triton.next_power_of_2(n_cols))
    _gather_rows_product_kernel[(n_rows, triton.cdiv(n_cols, block_n))](
        row_starts, entry_index, entry_value, dense, dense.stride(0), out, out.stride(0), n_cols,
        BLOCK_E=block_e, BLOCK_N=block_n, SOFTWARE_BF16_ROUNDING=interpreted(), num_warps=warps,
    )  # fmt: skip


def _gather_weight_gradient(
    sorted_vocab: Tensor, tokens: Tensor, values: Tensor, hidden: Tensor, grad_weight: Tensor
) -> None:
    """grad_weight [V, H] = the kept entries (sorted by vocabulary row, in token order within a row)
    times hidden's rows: every row of grad_weight is written, rows without entries with 0."""
    vocab_size, hidden_size = grad_weight.shape
    row_starts = _row_starts(sorted_vocab, vocab_size)
    if DW_GATHER[0] == "rows":
        _gather_rows_product(row_starts, tokens, values, hidden, grad_weight)
        return
    _, rows, block_e, block_n, warps = DW_GATHER
    if interpreted() or grad_weight.device.type != "cuda":
        rows, block_e, block_n, warps = 16, 16, 32, 1
    block_n = min(block_n, max(16, triton.next_power_of_2(hidden_size)))
    _gather_row_groups_dot_kernel[(triton.cdiv(vocab_size, rows), triton.cdiv(hidden_size, block_n))](
        row_starts, sorted_vocab, tokens, values, hidden, hidden.stride(0), grad_weight, grad_weight.stride(0),
        vocab_size, hidden_size, ROWS=rows, BLOCK_E=block_e, BLOCK_N=block_n, DOT_IN_FLOAT32=interpreted(),
        num_warps=warps,
    )  # fmt: skip


def _row_starts(sorted_rows: Tensor, n_rows: int) -> Tensor:
    """CSR offsets [n_rows + 1] of row indices sorted ascending."""
    starts = torch.zeros(n_rows + 1, dtype=torch.int64, device=sorted_rows.device)
    if sorted_rows.numel() > 0:
        torch.cumsum(torch.bincount(sorted_rows.to(torch.int64), minlength=n_rows), 0, out=starts[1:])
    return starts


def _chunked_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None,
    *,
    ignore_index: int,
    reduction: str,
    num_items: float | Tensor | None,
    softcap: float,
    label_smoothing: float,
    z_loss_scale: float,
    accumulate_dw_in_fp32: bool,
    compute_accuracy: bool,
    grad_hidden_needed: bool,
    grad_weight_needed: bool,
    grad_bias_needed: bool,
    token_upstream: Tensor | None,
    logits_chunk_bytes: int | None,
    skip_threshold: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The chunk loop; returns (loss, accuracy, grad_hidden, grad_weight, grad_bias), empty when not asked.

    With ``token_upstream`` ([T] float32) the gradients are those of sum_t upstream_t * loss_t (the
    backward of reduction "none"); otherwise of the reduced loss. ``skip_threshold`` > 0 computes dh and
    dW from the gradient entries above it only (see the module docstring).
    """
    n_tokens, hidden_size = hidden.shape
    vocab_size = weight.shape[0]
    device = hidden.device
    compute_grads = grad_hidden_needed or grad_weight_needed or grad_bias_needed
    skipping = skip_threshold > 0.0 and (grad_hidden_needed or grad_weight_needed)
    if skipping:
        # The gather kernels address rows of W and h with unit column stride.
        weight = weight if weight.stride(1) == 1 else weight.contiguous()
        hidden = hidden if hidden.stride(1) == 1 else hidden.contiguous()

    # Chunks as if every token counted. One chunk runs over all tokens, ignored ones included (the
    # cross-entropy kernel gives them loss 0 and gradient 0), and never waits for the device: waiting for the
    # count of valid tokens stops the host until the device has run everything queued before the loss, and
    # the device then idles while the host issues the loop (on H100 at T=1024, H=2048, V=32000, fwd+bwd
    # 1.16 ms with the wait, 0.77 without, benchmarks/kernels/ops.py on one machine, 2026-11-26; on another whose
    # host ran the call's Python half as fast, both 1.11 ms, bound by the host). Several chunks first drop
    # the ignored tokens, which saves their matmuls at one wait in a call long beside it. Tried and not kept:
    # running the first chunk as it is before that wait, so that its work keeps the device busy through it
    # (H100, benchmarks/kernels/loss_launch_settings.py --parts sweep, before / after, two runs each, 2026-11-27):
    # within run-to-run noise with no token ignored (T=8192, H=1536, V=256000: 39.7 / 40.2 against
    # 38.7 / 40.8 ms; T=4096, H=2048, V=151936: 13.3 / 13.1 against 12.9 / 13.5), and slower with 30% of
    # them ignored (--ignored-percent 30), its ignored rows running: 9.08 -> 10.02 ms at T=4096, H=2048,
    # V=151936; 27.6 -> 29.6 at T=8192, H=4096, V=128256; 30.1 -> 31.1 at T=16384, H=2048, V=128256.
    # The loss's denominator is counted on the device either way, so nothing waits for it.
    chunk_sizes = fused_linear_cross_entropy_chunk_sizes(
        n_tokens, hidden_size, vocab_size, hidden.dtype, logits_chunk_bytes
    )
    valid = labels != ignore_index
    valid_count = valid.sum()
    grad_scale = _gradient_scale(reduction, num_items, valid_count)
    valid_rows = None  # the tokens that run, when they are not all
    n_rows = n_tokens
    # Several chunks whose logits fit in dW's memory (T <= H) become one held there, laid out [V, T] (see the
    # module docstring): then, as one chunk, all tokens run and nothing waits. Otherwise the ignored tokens
    # are dropped first.
    held_width = 0  # the held logits' row width, when they are
    if (
        len(chunk_sizes) > 1
        and n_tokens <= hidden_size
        and grad_weight_needed
        and not skipping
        and not accumulate_dw_in_fp32
        and weight.dtype == hidden.dtype
    ):
        held_width = _held_logits_width(n_tokens, hidden_size)
        chunk_sizes = [n_tokens]
    elif len(chunk_sizes) > 1:
        n_valid = _count_on_host(valid_count)
        if n_valid < n_tokens:
            valid_rows, n_rows = _true_indices(valid, n_valid), n_valid
            chunk_sizes = fused_linear_cross_entropy_chunk_sizes(
                n_tokens, hidden_size, vocab_size, hidden.dtype, logits_chunk_bytes, rows_to_chunk=n_rows
            )

    loss_rows = torch.empty(n_rows, dtype=torch.float32, device=device)
    correct_rows = torch.empty(n_rows, dtype=torch.float32, device=device) if compute_accuracy else None
    # Distinct empty tensors: a custom op's outputs may not alias one another.
    grad_hidden = hidden.new_empty(0)
    if grad_hidden_needed:
        every_row_written = valid_rows is None and n_rows > 0
        grad_hidden = torch.empty_like(hidden) if every_row_written else torch.zeros_like(hidden)
    grad_weight = hidden.new_empty(0)
    if grad_weight_needed and skipping:
        grad_weight = torch.empty_like(weight, memory_format=torch.contiguous_format)  # every row written
        kept_tokens: list[Tensor] = []
        kept_vocab: list[Tensor] = []
        kept_values: list[Tensor] = []
    elif grad_weight_needed:
        dw_dtype = torch.float32 if accumulate_dw_in_fp32 else weight.dtype
        # The first chunk writes dW with a plain matmul, so it needs no zero fill unless no row runs.
        first_chunk_overwrites = dw_dtype == weight.dtype and n_rows > 0
        grad_weight = (torch.empty if first_chunk_overwrites else torch.zeros)(
            weight.shape, dtype=dw_dtype, device=device
        )
    grad_bias_acc = torch.zeros(vocab_size, dtype=torch.float32, device=device) if grad_bias_needed else None

    if n_rows > 0:
        if held_width:
            bounce = torch.empty(
                _bounce_elements(n_tokens, weight, logits_chunk_bytes), dtype=hidden.dtype, device=device
            )
        else:
            chunk_rows = max(chunk_sizes)
            try:
                logits_buffer = _logits_buffer(chunk_rows, vocab_size, hidden.dtype, device)
            except torch.OutOfMemoryError:
                # Only now is the device asked: smaller chunks within half of what is free.
                free_bytes, _ = torch.cuda.mem_get_info(device)
                chunk_sizes = fused_linear_cross_entropy_chunk_sizes(
                    n_tokens, hidden_size, vocab_size, hidden.dtype, logits_chunk_bytes,
                    rows_to_chunk=n_rows, free_bytes=free_bytes,
                )  # fmt: skip
                chunk_rows = max(chunk_sizes)
                logits_buffer = _logits_buffer(chunk_rows, vocab_size, hidden.dtype, device)
        if skipping:
            count_columns = live_count_columns(vocab_size, device, compute_accuracy=compute_accuracy)
            live_counts = torch.empty(
                (chunk_rows, triton.cdiv(vocab_size, count_columns)), dtype=torch.int32, device=device
            )
        weight_t = weight.t()
        chunk_ends = list(itertools.accumulate(chunk_sizes))
        for start, end in zip([0, *chunk_ends[:-1]], chunk_ends, strict=True):
            if valid_rows is None:
                hidden_c, labels_c = hidden[start:end], labels[start:end]
                rows_c = None
            else:
                rows_c = valid_rows[start:end]
                hidden_c, labels_c = hidden.index_select(0, rows_c), labels.index_select(0, rows_c)
            if held_width:  # [T, V] as seen by the matmuls, laid out [V, T] in dW's memory
                logits_c = _transposed_logits_in(grad_weight, n_tokens, held_width).t()
            else:
                logits_c = logits_buffer[: end - start]
            if bias is None:
                torch.mm(hidden_c, weight_t, out=logits_c)
            else:
                torch.addmm(bias, hidden_c, weight_t, out=logits_c)
            if token_upstream is None:
                scale_c = grad_scale
            else:
                upstream = (
                    token_upstream[start:end] if rows_c is None else token_upstream.index_select(0, rows_c)
                )
                scale_c = upstream.to(torch.float32).contiguous()
            loss_options = dict(
                loss_out=loss_rows[start:end],
                grad_scale=scale_c,
                correct_out=correct_rows[start:end] if correct_rows is not None else None,
                ignore_index=ignore_index,
                label_smoothing=label_smoothing,
                z_loss_scale=z_loss_scale,
                softcap=softcap,
            )
            if held_width:  # dW is computed: so are the gradients
                launch_cross_entropy_columns(logits_c.t(), labels_c, grad_out=logits_c.t(), **loss_options)
            else:
                launch_cross_entropy_forward(
                    logits_c,
                    labels_c,
                    grad_out=logits_c if compute_grads else None,
                    live_counts_out=live_counts[: end - start] if skipping else None,
                    live_threshold=skip_threshold,
                    **loss_options,
                )
            if not compute_grads:
                continue
            grad_logits_c = logits_c
            if skipping:
                row_starts, entry_vocab, entry_values = _live_gradient_entries(
                    grad_logits_c, scale_c, skip_threshold, live_counts[: end - start], count_columns
                )
                if grad_hidden_needed:
                    target = grad_hidden[start:end]
                    direct = rows_c is None and target.stride(1) == 1
                    if not direct:
                        target = torch.empty((end - start, hidden_size), dtype=hidden.dtype, device=device)
                    _gather_rows_product(row_starts, entry_vocab, entry_values, weight, target)
                    if rows_c is not None:
                        grad_hidden.index_copy_(0, rows_c, target)
                    elif not direct:
                        grad_hidden[start:end] = target
                if grad_weight_needed:
                    entry_rows = torch.repeat_interleave(
                        torch.arange(end - start, device=device),
                        row_starts.diff(),
                        output_size=entry_vocab.numel(),
                    )
                    tokens = entry_rows + start if rows_c is None else rows_c[entry_rows]
                    kept_tokens.append(tokens.to(torch.int32))
                    kept_vocab.append(entry_vocab)
                    kept_values.append(entry_values)
            elif grad_hidden_needed:
                if rows_c is None:
                    torch.mm(grad_logits_c, weight, out=grad_hidden[start:end])
                else:
                    grad_hidden.index_copy_(0, rows_c, grad_logits_c @ weight)
            if grad_bias_acc is not None:
                grad_bias_acc += grad_logits_c.sum(dim=0, dtype=torch.float32)
            if grad_weight_needed and not skipping:
                if held_width:
                    _weight_gradient_over_its_transposed_logits(
                        grad_weight, grad_logits_c.t(), hidden_c, bounce
                    )
                elif grad_weight.dtype == grad_logits_c.dtype:
                    if start == 0 and first_chunk_overwrites:
                        torch.mm(grad_logits_c.t(), hidden_c, out=grad_weight)
                    else:
                        grad_weight.addmm_(grad_logits_c.t(), hidden_c)
                else:
                    _addmm_float32_(grad_weight, grad_logits_c.t(), hidden_c)
        if held_width:
            del bounce
        else:
            del logits_buffer
    if grad_weight_needed and skipping:
        # All chunks' kept entries at once, sorted by vocabulary row (stable: in token order), so each dW
        # row is summed in float32 and written once.
        if kept_vocab:
            vocab_ids, tokens, values = torch.cat(kept_vocab), torch.cat(kept_tokens), torch.cat(kept_values)
        else:
            vocab_ids = torch.empty(0, dtype=torch.int32, device=device)
            tokens = torch.empty(0, dtype=torch.int32, device=device)
            values = torch.empty(0, dtype=hidden.dtype, device=device)
        sorted_vocab, order = torch.sort(vocab_ids, stable=True)
        _gather_weight_gradient(sorted_vocab, tokens[order], values[order], hidden, grad_weight)

    if reduction == "none":
        loss = _per_token(loss_rows, valid_rows, n_tokens)
    else:
        loss = loss_rows.sum() * grad_scale[0]  # a new tensor, not a view: callers divide it in place
    if correct_rows is None:
        accuracy = loss.new_empty(0)
    elif reduction == "none":
        accuracy = _per_token(correct_rows, valid_rows, n_tokens)
    else:  # ignored tokens that ran count as not correct: divide by the valid ones
        accuracy = correct_rows.sum() / valid_count.clamp(min=1)
    if grad_weight_needed and grad_weight.dtype != weight.dtype:
        grad_weight = grad_weight.to(weight.dtype)
    grad_bias = (
        grad_bias_acc.to(bias.dtype)
        if grad_bias_acc is not None and bias is not None
        else hidden.new_empty(0)
    )
    return loss, accuracy, grad_hidden, grad_weight, grad_bias


# --------------------------------------------------------------------------------------------------
# torch.library custom ops: opaque to torch.compile (the chunk loop, its host synchronisation for the
# valid-token count and its buffer reuse stay eager), seen through their fake implementations.
# --------------------------------------------------------------------------------------------------


def _num_items(num_items_tensor: Tensor | None, num_items_value: float) -> float | Tensor | None:
    if num_items_tensor is not None:
        return num_items_tensor  # divided by on the device: reading it would synchronise
    return num_items_value if num_items_value > 0.0 else None


def _chunk_bytes(logits_chunk_bytes: int) -> int | None:
    return logits_chunk_bytes if logits_chunk_bytes > 0 else None


# _forward_eager, _backward_eager, the ops' fakes and the autograd Function list the same flat arguments on purpose:
# a torch.library op's schema takes no structures, so each layer states them.
def _forward_eager(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None,
    num_items_tensor: Tensor | None,
    num_items_value: float,
    ignore_index: int,
    reduction: str,
    softcap: float,
    label_smoothing: float,
    z_loss_scale: float,
    accumulate_dw_in_fp32: bool,
    compute_accuracy: bool,
    grad_hidden_needed: bool,
    grad_weight_needed: bool,
    grad_bias_needed: bool,
    logits_chunk_bytes: int,
    skip_threshold: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _chunked_linear_cross_entropy(
        hidden,
        weight,
        labels,
        bias,
        ignore_index=ignore_index,
        reduction=reduction,
        num_items=_num_items(num_items_tensor, num_items_value),
        softcap=softcap,
        label_smoothing=label_smoothing,
        z_loss_scale=z_loss_scale,
        accumulate_dw_in_fp32=accumulate_dw_in_fp32,
        compute_accuracy=compute_accuracy,
        grad_hidden_needed=grad_hidden_needed,
        grad_weight_needed=grad_weight_needed,
        grad_bias_needed=grad_bias_needed,
        token_upstream=None,
        logits_chunk_bytes=_chunk_bytes(logits_chunk_bytes),
        skip_threshold=skip_threshold,
    )


# The ops below are what torch.compile sees; eager calls skip their dispatch (about 50 us a call on H200's
# host, measured with benchmarks/kernels/loss_launch_settings.py --parts host-pieces) and run the same functions.
_forward_op = torch.library.custom_op("fusetune::fused_linear_cross_entropy_forward", mutates_args=())(
    _forward_eager
)


@_forward_op.register_fake
def _(
    hidden, weight, labels, bias, num_items_tensor, num_items_value, ignore_index, reduction, softcap,
    label_smoothing, z_loss_scale, accumulate_dw_in_fp32, compute_accuracy, grad_hidden_needed,
    grad_weight_needed, grad_bias_needed, logits_chunk_bytes, skip_threshold,
):  # fmt: skip
    per_token = (hidden.shape[0],) if reduction == "none" else ()
    loss = hidden.new_empty(per_token, dtype=torch.float32)
    accuracy = hidden.new_empty(per_token if compute_accuracy else (0,), dtype=torch.float32)
    grad_hidden = torch.empty_like(hidden) if grad_hidden_needed else hidden.new_empty(0)
    grad_weight = torch.empty_like(weight) if grad_weight_needed else hidden.new_empty(0)
    grad_bias = torch.empty_like(bias) if grad_bias_needed and bias is not None else hidden.new_empty(0)
    return loss, accuracy, grad_hidden, grad_weight, grad_bias


def _backward_eager(
    token_upstream: Tensor,
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None,
    ignore_index: int,
    softcap: float,
    label_smoothing: float,
    z_loss_scale: float,
    accumulate_dw_in_fp32: bool,
    grad_hidden_needed: bool,
    grad_weight_needed: bool,
    grad_bias_needed: bool,
    logits_chunk_bytes: int,
    skip_threshold: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of sum_t token_upstream[t] * loss[t] (the backward of reduction "none"), recomputed."""
    _, _, grad_hidden, grad_weight, grad_bias = _chunked_linear_cross_entropy(
        hidden,
        weight,
        labels,
        bias,
        ignore_index=ignore_index,
        reduction="none",
        num_items=None,
        softcap=softcap,
        label_smoothing=label_smoothing,
        z_loss_scale=z_loss_scale,
        accumulate_dw_in_fp32=accumulate_dw_in_fp32,
        compute_accuracy=False,
        grad_hidden_needed=grad_hidden_needed,
        grad_weight_needed=grad_weight_needed,
        grad_bias_needed=grad_bias_needed,
        token_upstream=token_upstream,
        logits_chunk_bytes=_chunk_bytes(logits_chunk_bytes),
        skip_threshold=skip_threshold,
    )
    return grad_hidden, grad_weight, grad_bias


_backward_op = torch.library.custom_op("fusetune::fused_linear_cross_entropy_backward", mutates_args=())(
    _backward_eager
)


@_backward_op.register_fake
def _(
    token_upstream, hidden, weight, labels, bias, ignore_index, softcap, label_smoothing, z_loss_scale,
    accumulate_dw_in_fp32, grad_hidden_needed, grad_weight_needed, grad_bias_needed, logits_chunk_bytes,
    skip_threshold,
):  # fmt: skip
    grad_hidden = torch.empty_like(hidden) if grad_hidden_needed else hidden.new_empty(0)
    grad_weight = torch.empty_like(weight) if grad_weight_needed else hidden.new_empty(0)
    grad_bias = torch.empty_like(bias) if grad_bias_needed and bias is not None else hidden.new_empty(0)
    return grad_hidden, grad_weight, grad_bias


def _scale_(x: Tensor, factor: Tensor) -> None:
    """x *= factor (one element), in place, through the cross-entropy's row-scaling kernel, which skips the
    work on the device when the factor is 1: the usual ``loss.backward()`` costs one tiny launch and no host
    synchronisation."""
    if x.numel() == 0:
        return
    factor = factor.to(torch.float32).reshape(1)
    if x.is_contiguous():
        launch_scale_rows_(x.view(-1, x.shape[-1]), factor)
    else:  # laid out like a transposed hidden: not rows with contiguous columns
        x.mul_(factor)


# --------------------------------------------------------------------------------------------------
# Autograd
# --------------------------------------------------------------------------------------------------


class _FusedLinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        bias: Tensor | None,
        num_items_tensor: Tensor | None,
        num_items_value: float,
        ignore_index: int,
        reduction: str,
        softcap: float,
        label_smoothing: float,
        z_loss_scale: float,
        accumulate_dw_in_fp32: bool,
        compute_accuracy: bool,
        logits_chunk_bytes: int,
        skip_threshold: float,
        grad_hidden_needed: bool,
        grad_weight_needed: bool,
        grad_bias_needed: bool,
    ) -> tuple[Tensor, Tensor]:
        per_token = reduction == "none"
        forward = _forward_op if torch.compiler.is_compiling() else _forward_eager
        loss, accuracy, grad_hidden, grad_weight, grad_bias = forward(
            hidden, weight, labels, bias, num_items_tensor, num_items_value, ignore_index, reduction, softcap,
            label_smoothing, z_loss_scale, accumulate_dw_in_fp32, compute_accuracy,
            grad_hidden_needed and not per_token, grad_weight_needed and not per_token,
            grad_bias_needed and not per_token, logits_chunk_bytes, skip_threshold,
        )  # fmt: skip
        ctx.per_token = per_token
        ctx.needed = (grad_hidden_needed, grad_weight_needed, grad_bias_needed)
        if per_token:
            ctx.options = (ignore_index, softcap, label_smoothing, z_loss_scale, accumulate_dw_in_fp32,
                           logits_chunk_bytes, skip_threshold)  # fmt: skip
            ctx.save_for_backward(hidden, weight, labels, bias)
        else:
            ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.mark_non_differentiable(accuracy)
        return loss, accuracy

    @staticmethod
    def backward(ctx, grad_loss: Tensor, grad_accuracy: Tensor):
        grad_hidden_needed, grad_weight_needed, grad_bias_needed = ctx.needed
        if ctx.per_token:
            hidden, weight, labels, bias = ctx.saved_tensors
            backward = _backward_op if torch.compiler.is_compiling() else _backward_eager
            grads = backward(
                grad_loss.to(torch.float32).contiguous(), hidden, weight, labels, bias, *ctx.options[:5],
                grad_hidden_needed, grad_weight_needed, grad_bias_needed, *ctx.options[5:],
            )  # fmt: skip
        else:
            grads = ctx.saved_tensors
            factor = grad_loss.to(torch.float32)
            if torch.compiler.is_compiling():
                grads = tuple(None if g is None else (g * factor).to(g.dtype) for g in grads)
            else:
                for g in grads:
                    if g is not None and g.numel() > 0:
                        _scale_(g, factor)
        grad_hidden, grad_weight, grad_bias = grads
        return (
            grad_hidden if grad_hidden_needed else None,
            grad_weight if grad_weight_needed else None,
            None,
            grad_bias if grad_bias_needed else None,
            *([None] * 14),
        )


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


def _validate(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None, reduction: str) -> None:
    _check_reduction(reduction)
    if hidden.dim() < 1 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be [..., H] and weight [V, H]: got hidden {tuple(hidden.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels must have hidden's leading shape {tuple(hidden.shape[:-1])}, got {tuple(labels.shape)}"
        )
    if hidden.dtype != weight.dtype or (bias is not None and bias.dtype != hidden.dtype):
        raise ValueError(
            f"hidden, weight and bias must share a dtype: got {hidden.dtype}, {weight.dtype}, "
            f"{None if bias is None else bias.dtype}"
        )
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must have shape [V]=[{weight.shape[0]}], got {tuple(bias.shape)}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels must be int64 or int32, got {labels.dtype}")


def _validate_skipping(skip_small_gradients: bool, skip_threshold: float, label_smoothing: float) -> None:
    if not skip_small_gradients:
        return
    if not 0.0 < skip_threshold < 1.0:
        raise ValueError(f"skip_threshold must be in (0, 1), got {skip_threshold}")
    if label_smoothing > 0.0:
        raise ValueError(
            "skip_small_gradients cannot be used with label_smoothing > 0: smoothing puts gradient "
            f"on every vocabulary entry (label_smoothing={label_smoothing})"
        )


def fused_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: int | float | Tensor | None = None,
    softcap: float | None = None,
    label_smoothing: float = 0.0,
    z_loss_scale: float = 0.0,
    accumulate_dw_in_fp32: bool = False,
    return_accuracy: bool = False,
    logits_chunk_bytes: int | None = None,
    skip_small_gradients: bool = False,
    skip_threshold: float = DEFAULT_SKIP_THRESHOLD,
) -> Tensor | tuple[Tensor, Tensor]:
    """Cross-entropy of ``hidden [..., H] @ weight[V, H]^T (+ bias)`` against ``labels [...]``.

    The per-token loss is that of :func:`fusetune.kernels.cross_entropy.cross_entropy` (softcap,
    label smoothing, z-loss). "mean" averages over non-ignored tokens; with ``num_items_in_batch`` (a
    number or a one-element tensor) "mean" and "sum" both return sum / num_items_in_batch, the Hugging
    Face gradient-accumulation convention. "none" returns the per-token losses (0 at ignored tokens).
    The loss is float32. ``weight`` may be a tied embedding: its gradient is returned through autograd
    and accumulates with the embedding's.

    accumulate_dw_in_fp32: accumulate grad_weight over the token chunks in float32 (one rounding to
        weight's dtype at the end) instead of in weight's dtype (one rounding per chunk; each chunk's
        matmul itself accumulates in float32). Costs a float32 [V, H] buffer and time: on H100 at
        T=8192, H=4096, V=128256 with the earlier default of 256-row chunks, 97 ms and +2 GB instead of
        64 ms. Off by
        default for that reason.
    logits_chunk_bytes: budget for the [C, V] logits chunk; None picks the default of
        :func:`fused_linear_cross_entropy_chunk_rows` (Liger-Kernel's chunk + 252 MiB). A larger budget
        trades memory for speed; its docstring has the measured trade-off.
    return_accuracy: also return argmax == label over valid tokens (a fraction; per token for "none").
    skip_small_gradients: compute grad_hidden and grad_weight only from the entries of dlogits above
        ``skip_threshold`` times the token's gradient scale (for a plain loss: softmax probabilities
        above it), see the module docstring. Off by default (exact). Not with label smoothing, whose
        gradient is spread over every vocabulary entry.
    """
    # Alike in shape to cross_entropy's entry point and module on purpose: the same options, checked and passed
    # on the same way, over hidden states instead of logits.
    _validate(hidden, weight, labels, bias, reduction)
    _validate_skipping(skip_small_gradients, skip_threshold, label_smoothing)
    hidden_size = hidden.shape[-1]
    leading_shape = labels.shape
    hidden2d = hidden.reshape(-1, hidden_size)
    labels1d = labels.reshape(-1).contiguous()
    num_items_tensor = num_items_in_batch if isinstance(num_items_in_batch, Tensor) else None
    num_items_value = (
        float(num_items_in_batch) if num_items_in_batch is not None and num_items_tensor is None else 0.0
    )
    if num_items_tensor is None and num_items_in_batch is not None and num_items_value <= 0.0:
        raise ValueError(f"num_items_in_batch must be positive, got {num_items_in_batch}")
    grad_enabled = torch.is_grad_enabled()
    loss, accuracy = _FusedLinearCrossEntropyFunction.apply(
        hidden2d,
        weight,
        labels1d,
        bias,
        num_items_tensor,
        num_items_value,
        ignore_index,
        reduction,
        float(softcap) if softcap is not None else 0.0,
        float(label_smoothing),
        float(z_loss_scale),
        accumulate_dw_in_fp32,
        return_accuracy,
        int(logits_chunk_bytes) if logits_chunk_bytes is not None else 0,
        float(skip_threshold) if skip_small_gradients else 0.0,
        grad_enabled and hidden.requires_grad,
        grad_enabled and weight.requires_grad,
        grad_enabled and bias is not None and bias.requires_grad,
    )
    return loss_result(loss, accuracy, reduction, return_accuracy, leading_shape)


# Mirrors fused_linear_cross_entropy argument for argument on purpose: tests call both with the same keywords.
def fused_linear_cross_entropy_reference(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: int | float | Tensor | None = None,
    softcap: float | None = None,
    label_smoothing: float = 0.0,
    z_loss_scale: float = 0.0,
    accumulate_dw_in_fp32: bool = False,
    return_accuracy: bool = False,
    logits_chunk_bytes: int | None = None,
    skip_small_gradients: bool = False,
    skip_threshold: float = DEFAULT_SKIP_THRESHOLD,
) -> Tensor | tuple[Tensor, Tensor]:
    """Pure-PyTorch definition of :func:`fused_linear_cross_entropy`: full logits in float32 (float64
    when given float64). ``accumulate_dw_in_fp32`` and ``logits_chunk_bytes`` are accepted and ignored;
    so is ``skip_small_gradients`` (the reference is always exact), after the same argument checks."""
    del accumulate_dw_in_fp32, logits_chunk_bytes
    _validate(hidden, weight, labels, bias, reduction)
    _validate_skipping(skip_small_gradients, skip_threshold, label_smoothing)
    compute_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    logits = hidden.to(compute_dtype) @ weight.to(compute_dtype).t()
    if bias is not None:
        logits = logits + bias.to(compute_dtype)
    options = dict(ignore_index=ignore_index, softcap=softcap, label_smoothing=label_smoothing,
                   z_loss_scale=z_loss_scale)  # fmt: skip
    divide = num_items_in_batch is not None and reduction != "none"
    loss = cross_entropy_reference(logits, labels, reduction="sum" if divide else reduction, **options)
    if divide:
        loss = loss / num_items_in_batch
    if not return_accuracy:
        return loss
    _, accuracy = cross_entropy_reference(
        logits.detach(), labels, reduction=reduction if reduction == "none" else "mean", return_accuracy=True,
        **options,
    )  # fmt: skip
    return loss, accuracy


# Alike in shape to FusedCrossEntropyLoss on purpose: a loss's nn.Module form keeps each option as an attribute,
# as torch's own losses do.
class FusedLinearCrossEntropyLoss(nn.Module):
    """nn.Module form of :func:`fused_linear_cross_entropy`; the projection weight is passed to forward
    (it belongs to the model's lm_head or tied embedding)."""

    def __init__(
        self,
        ignore_index: int = -100,
        reduction: str = "mean",
        softcap: float | None = None,
        label_smoothing: float = 0.0,
        z_loss_scale: float = 0.0,
        accumulate_dw_in_fp32: bool = False,
        return_accuracy: bool = False,
        logits_chunk_bytes: int | None = None,
        skip_small_gradients: bool = False,
        skip_threshold: float = DEFAULT_SKIP_THRESHOLD,
    ) -> None:
        super().__init__()
        _check_reduction(reduction)
        _validate_skipping(skip_small_gradients, skip_threshold, label_smoothing)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.softcap = softcap
        self.label_smoothing = label_smoothing
        self.z_loss_scale = z_loss_scale
        self.accumulate_dw_in_fp32 = accumulate_dw_in_fp32
        self.return_accuracy = return_accuracy
        self.logits_chunk_bytes = logits_chunk_bytes
        self.skip_small_gradients = skip_small_gradients
        self.skip_threshold = skip_threshold

    def forward(
        self,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        bias: Tensor | None = None,
        num_items_in_batch: int | float | Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        options = {name: getattr(self, name) for name in _LOSS_MODULE_OPTIONS}
        return fused_linear_cross_entropy(
            hidden, weight, labels, bias, num_items_in_batch=num_items_in_batch, **options
        )

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, softcap={self.softcap}"


# The module's constructor arguments, each kept under its own name, are fused_linear_cross_entropy's keyword
# arguments: forward passes them all on, so an option added to __init__ needs no second line there.
_LOSS_MODULE_OPTIONS = tuple(inspect.signature(FusedLinearCrossEntropyLoss.__init__).parameters)[1:]
