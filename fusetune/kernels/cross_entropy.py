"""Cross-entropy over given logits, with the gradient written during the forward.

One persistent Triton kernel walks each row of ``logits [N, V]`` twice: a first sweep keeps an online
max / sum-of-exponentials per group of neighbouring columns (never the whole row in registers, so
vocabularies of 32k-262k cost the same per element), a second sweep, in reverse order so that it
starts on the lines the first sweep touched last and are most likely still in L2, writes the gradient of
the per-token loss. The backward is then only a multiplication by the upstream gradient, skipped on
the device when that gradient is exactly 1 (the usual ``loss.backward()``). Under torch.compile the
forward runs the first sweep only and the backward both, with the upstream gradient in the kernel's
scale (see ``_CrossEntropyFunction``).

Logits laid out [V, N] (token n's logits a column, as ``W @ h^T`` writes them: the fused linear loss's
chunk held in its weight gradient) take two other kernels with the same arithmetic (shared @triton.jit
helpers): tiles of [vocabulary rows, 128 neighbouring tokens], whose 256-byte rows keep the reads near
bandwidth, over splits of the vocabulary, so that few tokens still make programs for every SM; the first
writes each split's statistics, the second combines them and writes the loss and the gradient.

Per valid token (label ``y`` != ``ignore_index``), with ``s = softcap * tanh(x / softcap)`` when a
softcap is set (else ``s = x``), ``lse = logsumexp(s)``, class weights ``w`` (all ones when absent),
``W = sum_j w_j``, smoothing ``eps`` and z-loss scale ``z``::

    loss = (1 - eps) * w_y * (lse - s_y) + eps / V * sum_j w_j * (lse - s_j) + z * lse**2

which is ``torch.nn.functional.cross_entropy`` (weights, ``label_smoothing``) plus the z-loss term
(unweighted). "mean" divides the summed loss by ``sum of w_y`` over valid tokens (the token count
without weights), as torch does; with no valid token the loss is 0, not NaN. Ignored tokens have
loss 0 and gradient 0.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor, nn

from fusetune.kernels._interpreter import interpreted, round_to_dtype
from fusetune.kernels._tensors import multiprocessor_count

__all__ = [
    "CrossEntropyLaunchConfig",
    "FusedCrossEntropyLoss",
    "cross_entropy",
    "cross_entropy_launch_config",
    "cross_entropy_reference",
]

_REDUCTIONS = ("mean", "sum", "none")
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)
# Start value of the running maxima: finite, so that (s - m) is never (-inf) - (-inf) = NaN on lanes
# that have seen only masked (-inf) columns so far, and small enough that exp(s - m) of it is 0 without
# overflowing float32 on the way.
_LOWEST: tl.constexpr = tl.constexpr(-1.0e30)
_INT32_MAX: tl.constexpr = tl.constexpr(2147483647)
# Columns of the row kernel's first sweep that share a running max: one thread's 16-byte load of bfloat16
# (see _cross_entropy_forward_kernel); blocks are at least this wide.
_COLUMN_GROUP = 8


# --------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _tanh(u):
    # One exp2 and one fast division (div.full.f32, within 2 ulp): exact to ~2e-7 absolute and saturating
    # cleanly for large |u|. With the IEEE division (and x / softcap) it replaced, fwd+bwd with softcap 30
    # took 5.08 ms instead of 4.76 at T=8192, V=256000, and 2.51 instead of 2.32 at V=128256 (H100,
    # benchmarks/kernels/cross_entropy_ab.py, 2026-11-26; without a softcap 3.80 and 1.73 both).
    e = tl.exp2(tl.abs(u) * (-2.0 * LOG2E))
    t = tl.fdiv(1.0 - e, 1.0 + e, ieee_rounding=False)
    return tl.where(u < 0.0, -t, t)


@triton.jit
def is_live_gradient(g, limit):
    """The one place an entry of a gradient is judged worth keeping (fused linear cross-entropy's
    ``skip_small_gradients``): |g| > limit, with g the stored (rounded) value in float32."""
    return tl.abs(g) > limit


@triton.jit
def _online_update(s, running_max, running_sum):
    """One step of the per-lane online max m and sum of exp(s - m) (the kernels over [V, N] logits; the row
    kernel has the same lines inline). Updating with e = exp(-|s - m|) needs one exponential per element,
    not two; differences are taken before scaling to base 2, so logits of magnitude 1e4 keep their float32
    precision."""
    delta = s - running_max
    e = tl.exp2(tl.abs(delta) * -LOG2E)
    grows = delta > 0.0
    return tl.where(grows, s, running_max), tl.where(grows, running_sum * e + 1.0, running_sum + e)


@triton.jit
def _token_loss(
    nll_coef,
    row_max,
    s_label,
    log2_sum,
    lse,
    weighted_logit_sum,
    class_weight_sum,
    label_smoothing,
    inv_n_cols,
    z_loss_scale,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
):
    """A token's loss (see the module docstring) from its row statistics; scalars or one per token."""
    loss = nll_coef * ((row_max - s_label) + log2_sum * LN2)
    if HAS_SMOOTHING:
        loss += label_smoothing * inv_n_cols * (class_weight_sum * lse - weighted_logit_sum)
    if HAS_Z_LOSS:
        loss += z_loss_scale * lse * lse
    return loss


@triton.jit
def _gradient_coefficients(
    nll_coef,
    scale,
    lse,
    class_weight_sum,
    label_smoothing,
    inv_n_cols,
    z_loss_scale,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
):
    """(coefficient of p_j, of the label's indicator, of the class weight w_j) in a token's gradient
    ``scale * dloss/ds_j`` (see :func:`_entry_gradient`)."""
    coef_p = nll_coef
    if HAS_SMOOTHING:
        coef_p += label_smoothing * inv_n_cols * class_weight_sum
    if HAS_Z_LOSS:
        coef_p += 2.0 * z_loss_scale * lse
    return coef_p * scale, nll_coef * scale, label_smoothing * inv_n_cols * scale


@triton.jit
def _entry_gradient(
    s, t, is_label, row_max, log2_sum, coef_p, coef_label, uniform, HAS_SMOOTHING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):  # fmt: skip
    """The gradient at logit entries s (t = tanh(x / softcap) with a softcap): coef_p * p - coef_label at the
    label - uniform (coef_uniform * w_j) with smoothing, times the softcap's derivative 1 - t**2. (The kernels
    over [V, N] logits; the row kernel keeps one max per group of columns instead.)"""
    p = tl.exp2((s - row_max) * LOG2E - log2_sum)
    g = coef_p * p - tl.where(is_label, coef_label, 0.0)
    if HAS_SMOOTHING:
        g -= uniform
    if HAS_SOFTCAP:
        g = g * (1.0 - t * t)
    return g


@triton.jit
def _first_sweep_load(logits_row, cols, n_cols, EVICTION: tl.constexpr):
    """The row kernel's first-sweep load: columns past the row read as -inf (exp(-inf) = 0)."""
    return tl.load(logits_row + cols, mask=cols < n_cols, other=float("-inf"), eviction_policy=EVICTION)


@triton.jit
def _cross_entropy_forward_kernel(
    logits_ptr,
    logits_row_stride,
    grad_ptr,
    grad_row_stride,
    labels_ptr,
    class_weight_ptr,
    stats_ptr,
    grad_scale_ptr,
    grad_scale_row_stride,
    loss_ptr,
    correct_ptr,
    live_counts_ptr,
    n_rows,
    n_cols,
    ignore_index,
    label_smoothing,
    z_loss_scale,
    softcap,
    live_threshold,
    HAS_CLASS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    COMPUTE_ACCURACY: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    COUNT_LIVE: tl.constexpr,
    BLOCK_V: tl.constexpr,
    GROUP: tl.constexpr,
    FIRST_SWEEP_EVICTION: tl.constexpr,
    SOFTWARE_BF16_ROUNDING: tl.constexpr,
):
    """Per-token loss (and optionally the gradient of ``scale_i * loss_i``) for rows of logits.

    Backward math, for a valid row with label y, p = softmax(s), scale c (1/denominator for "mean",
    1 for "sum"/"none" -- the backward multiplies by the upstream gradient afterwards)::

        dloss/ds_j = (1-eps) * w_y * (p_j - [j == y]) + eps/V * (W * p_j - w_j) + 2 * z * lse * p_j
        dloss/dx_j = dloss/ds_j * (1 - (s_j / softcap)**2)        (only with a softcap)
        grad_j     = c * dloss/dx_j

    Ignored rows get loss 0 and gradient 0 and their logits are never read. ``grad_ptr`` may equal
    ``logits_ptr`` (in place): every element is read before it is written, by the same program.
    With COUNT_LIVE (and WRITE_GRAD) ``live_counts_ptr[row, b]`` ([n_rows, cdiv(n_cols, BLOCK_V)], contiguous)
    receives the number of stored gradient entries of columns [b * BLOCK_V, (b + 1) * BLOCK_V) that
    :func:`is_live_gradient` keeps against ``live_threshold * |scale|``, judged on the stored value, so a
    later pass that collects them from the stored gradient finds exactly that many, each block's apart.
    ``stats_ptr`` holds [denominator, inverse denominator, sum of class weights].
    """
    program = tl.program_id(0)
    n_programs = tl.num_programs(0)
    lanes = tl.arange(0, BLOCK_V)
    n_blocks = tl.cdiv(n_cols, BLOCK_V)
    inv_n_cols = 1.0 / n_cols
    # x / softcap as one multiplication: within an ulp of the division, at a fraction of its cost.
    inv_softcap = 1.0 / softcap if HAS_SOFTCAP else 0.0
    for row in range(program, n_rows, n_programs):
        row64 = tl.cast(row, tl.int64)
        label = tl.load(labels_ptr + row64)
        grad_row = grad_ptr + row64 * grad_row_stride
        if label == ignore_index:
            tl.store(loss_ptr + row64, 0.0)
            if COMPUTE_ACCURACY:
                tl.store(correct_ptr + row64, 0.0)
            if COUNT_LIVE:
                for block in range(0, n_blocks):
                    tl.store(live_counts_ptr + row64 * n_blocks + block, 0)
            if WRITE_GRAD:
                zeros = tl.zeros([BLOCK_V], dtype=grad_ptr.dtype.element_ty)
                for block in range(0, n_blocks):
                    cols = block * BLOCK_V + lanes
                    tl.store(grad_row + cols, zeros, mask=cols < n_cols)
        else:
            label32 = label.to(tl.int32)
            logits_row = logits_ptr + row64 * logits_row_stride
            # Sweep 1: online max m and sum of exp(s - m), one pair per group of GROUP neighbouring
            # columns, the group a thread loads in one 16-byte access, so that each block's group max is
            # taken within the thread. Differences are taken before scaling to base 2, so logits of
            # magnitude 1e4 keep their float32 precision.
            groups = tl.arange(0, BLOCK_V // GROUP)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
            running_max = tl.full([BLOCK_V // GROUP], _LOWEST, dtype=tl.float32)
            running_sum = tl.zeros([BLOCK_V // GROUP], dtype=tl.float32)
            weighted_logit_sum = tl.zeros([BLOCK_V // GROUP, GROUP], dtype=tl.float32)
            best_logit = tl.full([BLOCK_V // GROUP, GROUP], float("-inf"), dtype=tl.float32)
            best_col = tl.zeros([BLOCK_V // GROUP, GROUP], dtype=tl.int32)
            # The loads run four blocks ahead of the arithmetic. In fwd+bwd, where other programs' second
            # sweeps write at the same time, fewer loads in flight leave the memory idle: H100, fwd+bwd ms,
            # one block ahead / two / three / four (benchmarks/kernels/cross_entropy_ab.py, 2026-11-27): T=8192
            # V=128256 1.71 / 1.65 / 1.63 / 1.62; V=151936 2.09 / 2.06 / 2.03 / 2.03; V=256000 3.73 /
            # 3.71 / 3.71 / 3.71, softcap 30 4.53 / 4.48 / 4.56 / 4.49; T=16384 V=65536 1.86 / 1.72 / 1.55 /
            # 1.56. The loss alone (this sweep by itself) takes the same time at every depth. Deeper is much
            # slower, past what the 32-warp program's 64 registers a thread hold: five ahead (with the next
            # row's label loaded a row early) 2.19 ms and six 2.88 at V=128256; the label alone 1.62.
            ahead1 = _first_sweep_load(logits_row, groups, n_cols, FIRST_SWEEP_EVICTION)
            ahead2 = _first_sweep_load(logits_row, BLOCK_V + groups, n_cols, FIRST_SWEEP_EVICTION)
            ahead3 = _first_sweep_load(logits_row, 2 * BLOCK_V + groups, n_cols, FIRST_SWEEP_EVICTION)
            ahead4 = _first_sweep_load(logits_row, 3 * BLOCK_V + groups, n_cols, FIRST_SWEEP_EVICTION)
            for block in range(0, n_blocks):
                cols = block * BLOCK_V + groups
                mask = cols < n_cols
                x = ahead1.to(tl.float32)
                ahead1, ahead2, ahead3 = ahead2, ahead3, ahead4
                ahead4 = _first_sweep_load(logits_row, cols + 4 * BLOCK_V, n_cols, FIRST_SWEEP_EVICTION)
                if HAS_SOFTCAP:
                    s = tl.where(mask, softcap * _tanh(x * inv_softcap), float("-inf"))
                else:
                    s = x
                # Per group rather than per lane (as _online_update, which needs one exponential but
                # a compare and two selects per element): fwd+bwd at T=8192 1.706 against 1.732 ms for
                # V=128256, 3.727 against 3.756 for V=256000 and 4.50 against 4.61 with softcap 30
                # (H100, benchmarks/kernels/cross_entropy_ab.py, 2026-11-27). The loss alone (this sweep) is not
                # faster, 0.816 / 1.508 ms either way and with the exponentials left out: its bound is
                # the row-by-row stream of loads, not the arithmetic.
                new_max = tl.maximum(running_max, tl.max(s, axis=1))
                running_sum = running_sum * tl.exp2((running_max - new_max) * LOG2E) + tl.sum(
                    tl.exp2((s - new_max[:, None]) * LOG2E), axis=1
                )
                running_max = new_max
                if HAS_SMOOTHING:
                    s_or_zero = tl.where(mask, s, 0.0)
                    if HAS_CLASS_WEIGHT:
                        w = tl.load(class_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                        weighted_logit_sum += w * s_or_zero
                    else:
                        weighted_logit_sum += s_or_zero
                if COMPUTE_ACCURACY:
                    better = x > best_logit
                    best_logit = tl.where(better, x, best_logit)
                    best_col = tl.where(better, cols, best_col)
            row_max = tl.max(running_max, axis=0)
            row_sum = tl.sum(running_sum * tl.exp2((running_max - row_max) * LOG2E), axis=0)
            log2_sum = tl.log2(row_sum)
            lse = row_max + log2_sum * LN2

            x_label = tl.load(logits_row + label32).to(tl.float32)
            if HAS_SOFTCAP:
                s_label = softcap * _tanh(x_label * inv_softcap)
            else:
                s_label = x_label
            if HAS_CLASS_WEIGHT:
                w_label = tl.load(class_weight_ptr + label32).to(tl.float32)
            else:
                w_label = 1.0
            nll_coef = w_label
            class_weight_sum = n_cols * 1.0
            if HAS_SMOOTHING:
                nll_coef = (1.0 - label_smoothing) * w_label
                if HAS_CLASS_WEIGHT:
                    class_weight_sum = tl.load(stats_ptr + 2)
            logit_sum = 0.0
            if HAS_SMOOTHING:
                logit_sum = tl.sum(tl.sum(weighted_logit_sum, axis=1), axis=0)
            loss = _token_loss(
                nll_coef, row_max, s_label, log2_sum, lse, logit_sum, class_weight_sum, label_smoothing,
                inv_n_cols, z_loss_scale, HAS_SMOOTHING, HAS_Z_LOSS,
            )  # fmt: skip
            tl.store(loss_ptr + row64, loss)
            if COMPUTE_ACCURACY:
                top = tl.max(tl.max(best_logit, axis=1), axis=0)
                predicted = tl.min(tl.min(tl.where(best_logit == top, best_col, _INT32_MAX), axis=1), axis=0)
                tl.store(correct_ptr + row64, (predicted == label32).to(tl.float32))

            if WRITE_GRAD:
                scale = tl.load(grad_scale_ptr + row64 * grad_scale_row_stride).to(tl.float32)
                coef_p, coef_label, coef_uniform = _gradient_coefficients(
                    nll_coef, scale, lse, class_weight_sum, label_smoothing, inv_n_cols, z_loss_scale,
                    HAS_SMOOTHING, HAS_Z_LOSS,
                )  # fmt: skip
                live_limit = live_threshold * tl.abs(scale)
                # Sweep 2, last block first: those lines were read most recently.
                last = (n_blocks - 1) * BLOCK_V
                next_x = tl.load(
                    logits_row + last + lanes,
                    mask=last + lanes < n_cols,
                    other=0.0,
                    eviction_policy="evict_first",
                )
                for block in range(0, n_blocks):
                    cols = (n_blocks - 1 - block) * BLOCK_V + lanes
                    mask = cols < n_cols
                    x = next_x.to(tl.float32)
                    prev_cols = cols - BLOCK_V
                    next_x = tl.load(
                        logits_row + prev_cols,
                        mask=(prev_cols >= 0) & (prev_cols < n_cols),
                        other=0.0,
                        eviction_policy="evict_first",
                    )
                    if HAS_SOFTCAP:
                        t = _tanh(x * inv_softcap)
                        s = softcap * t
                    else:
                        s = x
                    p = tl.exp2((s - row_max) * LOG2E - log2_sum)
                    g = coef_p * p - tl.where(cols == label32, coef_label, 0.0)
                    if HAS_SMOOTHING:
                        if HAS_CLASS_WEIGHT:
                            w = tl.load(class_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                            g -= coef_uniform * w
                        else:
                            g -= coef_uniform
                    if HAS_SOFTCAP:
                        g = g * (1.0 - t * t)
                    stored = round_to_dtype(g, grad_ptr.dtype.element_ty, SOFTWARE_BF16_ROUNDING)
                    tl.store(grad_row + cols, stored, mask=mask)
                    if COUNT_LIVE:
                        live = is_live_gradient(stored.to(tl.float32), live_limit) & mask
                        tl.store(
                            live_counts_ptr + row64 * n_blocks + (n_blocks - 1 - block),
                            tl.sum(live.to(tl.int32), axis=0),
                        )


# Statistics per token and vocabulary split that the columns kernels pass on, in this order: running max,
# sum of exponentials below it, logit sum (label smoothing), best logit and its column (accuracy).
_N_COLUMN_STATS = 5


@triton.jit
def _columns_tile(logits_ptr, col_stride, cols, tokens, mask, other, eviction: tl.constexpr):
    """The [len(cols), len(tokens)] tile of logits laid out [V, N] (entry (v, n) at v * col_stride + n)."""
    return tl.load(
        logits_ptr + cols.to(tl.int64)[:, None] * col_stride + tokens[None, :],
        mask=mask,
        other=other,
        eviction_policy=eviction,
    )


@triton.jit
def _cross_entropy_columns_stats_kernel(
    logits_ptr,
    logits_col_stride,
    partial_ptr,
    n_tokens,
    n_cols,
    cols_per_split,
    softcap,
    HAS_SMOOTHING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    COMPUTE_ACCURACY: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """First sweep of the cross-entropy over logits laid out [V, N] (token n's logits are column n): program
    (b, k) walks [BLOCK_V, BLOCK_T] tiles of tokens [b * BLOCK_T, (b + 1) * BLOCK_T) over the k-th split of
    the vocabulary, keeping per-(lane, token) online statistics, and writes each token's statistics of its
    split to ``partial_ptr`` [_N_COLUMN_STATS, splits, n_tokens] (float32). A tile's rows are BLOCK_T
    contiguous entries, the split makes enough programs for the device however few the tokens."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    in_range = tokens < n_tokens
    lanes = tl.arange(0, BLOCK_V)
    inv_softcap = 1.0 / softcap if HAS_SOFTCAP else 0.0
    first = split * cols_per_split
    end = tl.minimum(first + cols_per_split, n_cols)
    running_max = tl.full([BLOCK_V, BLOCK_T], _LOWEST, dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_V, BLOCK_T], dtype=tl.float32)
    logit_sum = tl.zeros([BLOCK_V, BLOCK_T], dtype=tl.float32)
    best_logit = tl.full([BLOCK_V, BLOCK_T], float("-inf"), dtype=tl.float32)
    best_col = tl.zeros([BLOCK_V, BLOCK_T], dtype=tl.int32)
    cols = first + lanes
    next_x = _columns_tile(
        logits_ptr, logits_col_stride, cols, tokens, (cols < end)[:, None] & in_range[None, :], float("-inf"),
        "evict_last",
    )  # fmt: skip
    for block_start in range(first, end, BLOCK_V):
        cols = block_start + lanes
        mask = (cols < end)[:, None]
        x = next_x.to(tl.float32)
        next_cols = cols + BLOCK_V
        next_x = _columns_tile(
            logits_ptr, logits_col_stride, next_cols, tokens, (next_cols < end)[:, None] & in_range[None, :],
            float("-inf"), "evict_last",
        )  # fmt: skip
        if HAS_SOFTCAP:
            s = tl.where(mask, softcap * _tanh(x * inv_softcap), float("-inf"))
        else:
            s = x
        running_max, running_sum = _online_update(s, running_max, running_sum)
        if HAS_SMOOTHING:
            logit_sum += tl.where(mask, s, 0.0)
        if COMPUTE_ACCURACY:
            better = x > best_logit
            best_logit = tl.where(better, x, best_logit)
            best_col = tl.where(better, cols[:, None], best_col)
    split_max = tl.max(running_max, axis=0)
    split_sum = tl.sum(running_sum * tl.exp2((running_max - split_max[None, :]) * LOG2E), axis=0)
    out = partial_ptr + split * n_tokens + tokens
    stride = n_splits * n_tokens
    tl.store(out, split_max, mask=in_range)
    tl.store(out + stride, split_sum, mask=in_range)
    if HAS_SMOOTHING:
        tl.store(out + 2 * stride, tl.sum(logit_sum, axis=0), mask=in_range)
    if COMPUTE_ACCURACY:
        top = tl.max(best_logit, axis=0)
        predicted = tl.min(tl.where(best_logit == top[None, :], best_col, _INT32_MAX), axis=0)
        tl.store(out + 3 * stride, top, mask=in_range)
        tl.store(out + 4 * stride, predicted.to(tl.float32), mask=in_range)


@triton.jit
def _cross_entropy_columns_kernel(
    logits_ptr,
    logits_col_stride,
    grad_ptr,
    grad_col_stride,
    partial_ptr,
    labels_ptr,
    grad_scale_ptr,
    grad_scale_stride,
    loss_ptr,
    correct_ptr,
    n_tokens,
    n_cols,
    cols_per_split,
    n_splits,
    ignore_index,
    label_smoothing,
    z_loss_scale,
    softcap,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    COMPUTE_ACCURACY: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    SPLITS_POW2: tl.constexpr,
    SOFTWARE_BF16_ROUNDING: tl.constexpr,
):
    """Second sweep over logits laid out [V, N], same programs as :func:`_cross_entropy_columns_stats_kernel`:
    each combines its tokens' statistics of all ``n_splits`` splits into the loss (written by the programs of
    split 0) and writes the gradient of its split, as :func:`_cross_entropy_forward_kernel` does (no class weights,
    no live counts). Ignored and out-of-range tokens are read like the others (their columns lie between
    valid ones) but get loss 0 and gradient 0. ``grad_ptr`` may equal ``logits_ptr``: each entry is read by
    the program that writes it, before (the first sweep's kernel has finished)."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    split = tl.program_id(1)
    in_range = tokens < n_tokens
    labels = tl.load(labels_ptr + tokens, mask=in_range, other=ignore_index)
    valid = in_range & (labels != ignore_index)
    label32 = tl.where(valid, labels, 0).to(tl.int32)
    inv_n_cols = 1.0 / n_cols
    inv_softcap = 1.0 / softcap if HAS_SOFTCAP else 0.0

    splits = tl.arange(0, SPLITS_POW2)
    stat_mask = (splits < n_splits)[:, None] & in_range[None, :]
    stat_ptrs = partial_ptr + splits[:, None] * n_tokens + tokens[None, :]
    stride = n_splits * n_tokens
    split_max = tl.load(stat_ptrs, mask=stat_mask, other=_LOWEST)
    split_sum = tl.load(stat_ptrs + stride, mask=stat_mask, other=0.0)
    row_max = tl.max(split_max, axis=0)
    row_sum = tl.sum(split_sum * tl.exp2((split_max - row_max[None, :]) * LOG2E), axis=0)
    # Tokens past the end have no statistics: finite stand-ins keep their (unused) arithmetic free of NaN.
    row_max = tl.where(in_range, row_max, 0.0)
    log2_sum = tl.log2(tl.where(in_range, row_sum, 1.0))
    lse = row_max + log2_sum * LN2
    nll_coef = 1.0 - label_smoothing if HAS_SMOOTHING else 1.0

    if split == 0:
        x_label = tl.load(
            logits_ptr + label32.to(tl.int64) * logits_col_stride + tokens, mask=valid, other=0.0
        ).to(tl.float32)
        if HAS_SOFTCAP:
            s_label = softcap * _tanh(x_label * inv_softcap)
        else:
            s_label = x_label
        logit_sum = 0.0
        if HAS_SMOOTHING:
            logit_sum = tl.sum(tl.load(stat_ptrs + 2 * stride, mask=stat_mask, other=0.0), axis=0)
        loss = _token_loss(
            nll_coef, row_max, s_label, log2_sum, lse, logit_sum, n_cols * 1.0, label_smoothing, inv_n_cols,
            z_loss_scale, HAS_SMOOTHING, HAS_Z_LOSS,
        )  # fmt: skip
        tl.store(loss_ptr + tokens, tl.where(valid, loss, 0.0), mask=in_range)
        if COMPUTE_ACCURACY:
            split_best = tl.load(stat_ptrs + 3 * stride, mask=stat_mask, other=float("-inf"))
            split_col = tl.load(stat_ptrs + 4 * stride, mask=stat_mask, other=0.0).to(tl.int32)
            top = tl.max(split_best, axis=0)
            predicted = tl.min(tl.where(split_best == top[None, :], split_col, _INT32_MAX), axis=0)
            tl.store(correct_ptr + tokens, ((predicted == label32) & valid).to(tl.float32), mask=in_range)

    if WRITE_GRAD:
        scale = tl.load(grad_scale_ptr + tokens * grad_scale_stride, mask=in_range, other=0.0)
        coef_p, coef_label, coef_uniform = _gradient_coefficients(
            nll_coef, scale.to(tl.float32), lse, n_cols * 1.0, label_smoothing, inv_n_cols, z_loss_scale,
            HAS_SMOOTHING, HAS_Z_LOSS,
        )  # fmt: skip
        row_max_t, log2_sum_t = row_max[None, :], log2_sum[None, :]
        coef_p_t, coef_label_t, coef_uniform_t = coef_p[None, :], coef_label[None, :], coef_uniform[None, :]
        valid_t = valid[None, :]
        lanes = tl.arange(0, BLOCK_V)
        first = split * cols_per_split
        end = tl.minimum(first + cols_per_split, n_cols)
        cols = first + lanes
        next_x = _columns_tile(
            logits_ptr, logits_col_stride, cols, tokens, (cols < end)[:, None] & in_range[None, :], 0.0,
            "evict_first",
        )  # fmt: skip
        for block_start in range(first, end, BLOCK_V):
            cols = block_start + lanes
            mask = (cols < end)[:, None] & in_range[None, :]
            x = next_x.to(tl.float32)
            next_cols = cols + BLOCK_V
            next_x = _columns_tile(
                logits_ptr, logits_col_stride, next_cols, tokens, (next_cols < end)[:, None] & in_range[None, :],
                0.0, "evict_first",
            )  # fmt: skip
            if HAS_SOFTCAP:
                t = _tanh(x * inv_softcap)
                s = softcap * t
            else:
                s = x
                t = x
            g = _entry_gradient(
                s, t, cols[:, None] == label32[None, :], row_max_t, log2_sum_t, coef_p_t, coef_label_t,
                coef_uniform_t, HAS_SMOOTHING, HAS_SOFTCAP,
            )  # fmt: skip
            # Ignored tokens' gradient is set, not computed (their logits need not even be finite).
            g = tl.where(valid_t, g, 0.0)
            stored = round_to_dtype(g, grad_ptr.dtype.element_ty, SOFTWARE_BF16_ROUNDING)
            tl.store(
                grad_ptr + cols.to(tl.int64)[:, None] * grad_col_stride + tokens[None, :], stored, mask=mask
            )


@triton.jit
def _cross_entropy_stats_kernel(
    labels_ptr,
    class_weight_ptr,
    stats_ptr,
    n_rows,
    n_cols,
    ignore_index,
    HAS_CLASS_WEIGHT: tl.constexpr,
    MEAN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program: stats = [denominator, grad scale (1/denominator for "mean", 0 if none valid), sum(w)]."""
    offsets = tl.arange(0, BLOCK)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_rows, BLOCK):
        rows = start + offsets
        labels = tl.load(labels_ptr + rows, mask=rows < n_rows, other=ignore_index)
        valid = labels != ignore_index
        if HAS_CLASS_WEIGHT:
            w = tl.load(class_weight_ptr + labels, mask=valid, other=0.0).to(tl.float32)
        else:
            w = valid.to(tl.float32)
        total += tl.where(valid, w, 0.0)
    denominator = tl.sum(total, axis=0)
    if MEAN:
        scale = tl.where(denominator > 0.0, 1.0 / tl.where(denominator > 0.0, denominator, 1.0), 0.0)
    else:
        scale = 1.0
    weight_sum = 0.0
    if HAS_CLASS_WEIGHT:
        weight_total = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + offsets
            weight_total += tl.load(class_weight_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        weight_sum = tl.sum(weight_total, axis=0)
    tl.store(stats_ptr, denominator)
    tl.store(stats_ptr + 1, scale)
    tl.store(stats_ptr + 2, weight_sum)


@triton.jit
def _scale_rows_kernel(
    x_ptr,
    row_stride,
    n_rows,
    n_cols,
    factor_ptr,
    factor_row_stride,
    BLOCK: tl.constexpr,
    SOFTWARE_BF16_ROUNDING: tl.constexpr,
):
    """x[i, :] *= factor[i * factor_row_stride], in place; rows whose factor is exactly 1 are not touched.

    The check runs on the device, so ``loss.backward()`` (upstream gradient 1) costs one tiny launch and
    no host synchronisation.
    """
    program = tl.program_id(0)
    n_programs = tl.num_programs(0)
    lanes = tl.arange(0, BLOCK)
    for row in range(program, n_rows, n_programs):
        row64 = tl.cast(row, tl.int64)
        factor = tl.load(factor_ptr + row64 * factor_row_stride).to(tl.float32)
        if factor != 1.0:
            x_row = x_ptr + row64 * row_stride
            for start in range(0, n_cols, BLOCK):
                cols = start + lanes
                mask = cols < n_cols
                x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
                tl.store(
                    x_row + cols,
                    round_to_dtype(x * factor, x_ptr.dtype.element_ty, SOFTWARE_BF16_ROUNDING),
                    mask=mask,
                )


# --------------------------------------------------------------------------------------------------
# Launch settings
# --------------------------------------------------------------------------------------------------


def _num_processors(device: torch.device) -> int:
    return multiprocessor_count(device, interpreter_count=4)


@dataclass(frozen=True)
class CrossEntropyLaunchConfig:
    """How the forward kernel is launched.

    block_v: vocabulary columns per loop step (per-lane state is block_v / (32 * num_warps) floats).
    num_warps: warps per program.
    programs_per_processor: persistent grid size per SM. Each program keeps one row "in flight" between
        its two sweeps, so the number of programs bounds the L2 working set (rows * V * itemsize).
    first_sweep_eviction: L2 hint for the first sweep's loads ("evict_last" keeps them for the second).
    """

    block_v: int
    num_warps: int
    programs_per_processor: float
    first_sweep_eviction: str


def cross_entropy_launch_config(
    n_cols: int, device: torch.device, *, extra_lane_state: int = 0
) -> CrossEntropyLaunchConfig:
    """Launch settings for the forward kernel (the only place they are chosen).

    ``extra_lane_state`` counts the per-lane vectors beyond the running max and sum: 2 for accuracy
    (best logit, its column), 1 for label smoothing (the logit sum).

    GPU, measured on H100 in two runs (N=8192, V=128256, bf16, in place, fwd+bwd; Liger-Kernel 0.8.5
    2.71 / 2.45 ms in the same runs, floor 1.395 ms): one 32-warp program per SM on 16384-column blocks
    1.72 / 1.75 ms (first sweep alone 0.82 ms); 8192 columns / 32 warps 1.92; 8192 / 16 warps 2.06-2.12;
    4096 / 16 warps 2.30; 32768 / 32 warps 4.76 (spills); without the evict_last hint 1.88 instead of
    1.76; 0.75 or 0.5 programs per SM (fewer rows in flight) 2.09 / 2.61: the first sweep needs every SM;
    four 8-warp programs per SM on 2048 columns 2.22 (its first sweep alone is the fastest, 0.80 ms,
    but 528 rows in flight no longer fit in L2 for the second sweep). The 32-warp program is capped at
    64 registers, so with extra lane state (ptxas: 240-800 bytes of spills) the 16-warp programs take
    over: 8192 columns (no spills with accuracy or smoothing alone; 2.14 ms with accuracy, Liger 2.55)
    and 4096 with both. Splitting each row's first sweep over 2, 4 or 8 programs (the last to finish
    combines their partial max/sum through an atomic arrival count and writes the gradient, so fewer
    bytes lie between a line's two reads) was slower, 2.33 / 3.53 / 6.36 ms against 1.74 unsplit
    (benchmarks/kernels/loss_launch_settings.py, one run, 2026-11-25; Liger 2.86, torch.compile 2.88).
    Tried on H100 against this kernel in one process (benchmarks/kernels/cross_entropy_ab.py, 2026-11-26; ms at
    T=8192 for V=128256 / V=256000, this kernel 1.73 / 3.80), none kept: rows pipelined (the next row's
    label and first block, and each row's label logit and scale, loaded ahead) 1.72 / 3.85; the first
    sweep's loads two blocks ahead 1.76 / 3.87, or three ahead on 8192-column blocks 1.86 / 4.19
    (with the per-lane first sweep of then: on the grouped one four ahead is faster, see the kernel;
    the second sweep's loads two ahead there took 1.90 / 3.74, 2026-11-27);
    Triton's software pipelining (tl.range with 3 or 4 stages) of the first sweep 1.89 / 4.05, of both
    sweeps 1.97 / 4.15; the gradient stored with an evict-first hint or as streaming (.cs) 1.75 / 3.76.
    At V=32000 (4096 columns / 16 warps / 2 per SM 0.469 against 0.491 here) runs differed by up to 30%.
    Where the time goes (H100, T=8192, V=128256, 2026-11-27, bab792e): Nsight Compute counts 2.42 GB read
    from memory (the second sweep finds 85% of its lines in L2) and 2.07 GB written in 1.59 ms, 84.5% of
    the peak memory throughput, where a copy of the logits moves 2.10 GB each way in 1.39 ms at 90%; the
    loss alone (first sweep) 0.78 ms at 80%, where a kernel that only reads them takes 0.69-0.74 ms and
    one that only writes 0.66 (benchmarks/kernels/cross_entropy_bounds.py). The first sweep took as long with its
    exponentials left out, so the bound is the row-by-row stream of loads, not the arithmetic (the
    registers hold four blocks in flight, see the kernel). Reading each logit once needs the row on chip,
    256 KB at V=128256, more than one SM holds (64 registers a thread at 32 warps); splitting each row
    over 4-8 co-resident programs (a cooperative launch) that keep their slice in registers and exchange
    (max, sum) through global memory took 2.02-2.49 ms (same script, against 1.71 for this kernel then):
    the exchange's round trip every row costs more than the second read saves.
    Interpreter (CPU tests): 512-column blocks and 4 programs, so that test vocabularies of 600-1000
    still walk two blocks with a ragged tail and each program handles several rows; the interpreter's
    cost is per operation, not per element, so smaller blocks only make the tests slower.
    """
    if interpreted() or device.type != "cuda":
        return CrossEntropyLaunchConfig(
            block_v=max(_COLUMN_GROUP, min(512, triton.next_power_of_2(n_cols))),
            num_warps=1,
            programs_per_processor=1,
            first_sweep_eviction="",
        )
    if extra_lane_state == 0:
        block_v, num_warps = 16384, 32
    elif extra_lane_state <= 2:
        block_v, num_warps = 8192, 16
    else:
        block_v, num_warps = 4096, 16
    return CrossEntropyLaunchConfig(
        block_v=max(_COLUMN_GROUP, min(block_v, triton.next_power_of_2(n_cols))),
        num_warps=num_warps,
        programs_per_processor=1,
        first_sweep_eviction="evict_last",
    )


# --------------------------------------------------------------------------------------------------
# Launchers (plain functions: used by the custom ops below and by fused_linear_cross_entropy)
# --------------------------------------------------------------------------------------------------


def _check_reduction(reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")


def launch_cross_entropy_stats(
    labels: Tensor, class_weight: Tensor | None, n_cols: int, ignore_index: int, mean: bool
) -> Tensor:
    """Returns a float32 [3] tensor: [denominator, gradient scale, sum of class weights] (see the kernel)."""
    stats = torch.empty(3, dtype=torch.float32, device=labels.device)
    _cross_entropy_stats_kernel[(1,)](
        labels,
        class_weight if class_weight is not None else stats,
        stats,
        labels.numel(),
        n_cols,
        ignore_index,
        HAS_CLASS_WEIGHT=class_weight is not None,
        MEAN=mean,
        BLOCK=1024,
        num_warps=4,
    )
    return stats


def _extra_lane_state(compute_accuracy: bool, label_smoothing: float) -> int:
    return (2 if compute_accuracy else 0) + (1 if label_smoothing > 0.0 else 0)


def live_count_columns(
    n_cols: int, device: torch.device, *, compute_accuracy: bool = False, label_smoothing: float = 0.0
) -> int:
    """Columns per count of ``live_counts_out`` of :func:`launch_cross_entropy_forward` (its block)."""
    extra = _extra_lane_state(compute_accuracy, label_smoothing)
    return cross_entropy_launch_config(n_cols, device, extra_lane_state=extra).block_v


def launch_cross_entropy_forward(
    logits: Tensor,
    labels: Tensor,
    *,
    loss_out: Tensor,
    grad_out: Tensor | None,
    grad_scale: Tensor,
    correct_out: Tensor | None = None,
    class_weight: Tensor | None = None,
    stats: Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss_scale: float = 0.0,
    softcap: float = 0.0,
    live_counts_out: Tensor | None = None,
    live_threshold: float = 0.0,
) -> None:
    """Runs the forward kernel over ``logits [N, V]`` (last dimension contiguous).

    loss_out: float32 [N] per-token losses. grad_out: [N, V] (may be ``logits`` itself) or None.
    grad_scale: float32 tensor; one value (stride 0) or one per row, multiplied into the gradient.
    stats: the [3] tensor from :func:`launch_cross_entropy_stats` (needed with class weights + smoothing).
    live_counts_out: int32 [N, cdiv(V, :func:`live_count_columns`)], with grad_out: per row and block of
    columns, the gradient entries above ``live_threshold * |grad_scale|`` (see :func:`is_live_gradient`).
    """
    if live_counts_out is not None and grad_out is None:
        raise ValueError("live_counts_out counts gradient entries: it needs grad_out")
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    config = cross_entropy_launch_config(
        n_cols, logits.device, extra_lane_state=_extra_lane_state(correct_out is not None, label_smoothing)
    )
    if live_counts_out is not None:
        expected = (n_rows, triton.cdiv(n_cols, config.block_v))
        if tuple(live_counts_out.shape) != expected or not live_counts_out.is_contiguous():
            raise ValueError(
                f"live_counts_out must be a contiguous {expected}, got {tuple(live_counts_out.shape)}"
            )
    programs = int(config.programs_per_processor * _num_processors(logits.device))
    grid = (max(1, min(n_rows, programs)),)
    write_grad = grad_out is not None
    scale_row_stride = 0 if grad_scale.numel() == 1 else grad_scale.stride(0)
    _cross_entropy_forward_kernel[grid](
        logits,
        logits.stride(0),
        grad_out if write_grad else logits,
        grad_out.stride(0) if write_grad else 0,
        labels,
        class_weight if class_weight is not None else loss_out,
        stats if stats is not None else loss_out,
        grad_scale,
        scale_row_stride,
        loss_out,
        correct_out if correct_out is not None else loss_out,
        live_counts_out if live_counts_out is not None else loss_out,
        n_rows,
        n_cols,
        ignore_index,
        float(label_smoothing),
        float(z_loss_scale),
        float(softcap),
        float(live_threshold),
        HAS_CLASS_WEIGHT=class_weight is not None,
        HAS_SMOOTHING=label_smoothing > 0.0,
        HAS_Z_LOSS=z_loss_scale != 0.0,
        HAS_SOFTCAP=softcap > 0.0,
        COMPUTE_ACCURACY=correct_out is not None,
        WRITE_GRAD=write_grad,
        COUNT_LIVE=live_counts_out is not None,
        BLOCK_V=config.block_v,
        GROUP=_COLUMN_GROUP,
        FIRST_SWEEP_EVICTION=config.first_sweep_eviction,
        SOFTWARE_BF16_ROUNDING=interpreted(),
        num_warps=config.num_warps,
    )


@dataclass(frozen=True)
class CrossEntropyColumnsLaunchConfig:
    """How :func:`launch_cross_entropy_columns` launches its two kernels: tokens and vocabulary rows per
    tile, warps, and the vocabulary splits (programs per group of tokens)."""

    block_t: int
    block_v: int
    num_warps: int
    splits: int


def cross_entropy_columns_launch_config(
    n_tokens: int, n_cols: int, device: torch.device, *, extra_lane_state: int = 0
) -> CrossEntropyColumnsLaunchConfig:
    """Launch settings of the kernels over [V, N] logits (the only place they are chosen).

    Interpreter: 16 tokens, 512 vocabulary rows and 2 splits, so test shapes walk a ragged last block,
    several token groups and splits. GPU: tiles of 128 tokens (256-byte rows) by 64 vocabulary rows over 16
    warps (32 rows with extra lane state: accuracy, smoothing), and as many vocabulary splits as make 4
    programs per SM. Measured on H100 (benchmarks/kernels/loss_launch_settings.py --parts columns, GPU time, bf16,
    gradient in place), against the row kernel over the same logits laid out [N, V]: 0.322 / 0.238 ms at
    N=1024, V=128256; 1.001 / 0.926 at 1536 x 256000 with softcap; 0.704 / 0.556 at 2048 x 151936; 1.286 /
    0.921 at 4096 x 128256; 3.08 / 2.38 at 4096 x 256000 with softcap. That setting was the best or within
    5% of the best of 10 at every shape; 64-token tiles on 8 warps 1.05-1.2x slower, 32-token ones 1.5x,
    and one program per group of tokens (no split, 16-32 tokens wide) 2-5x: rows of 32-64 bytes, a DRAM
    page apart, are read far below bandwidth.
    """
    if interpreted() or device.type != "cuda":
        block_v = min(512, triton.next_power_of_2(n_cols))
        return CrossEntropyColumnsLaunchConfig(
            block_t=16, block_v=block_v, num_warps=1, splits=min(2, triton.cdiv(n_cols, block_v))
        )
    block_t = 128
    block_v = min(64 if extra_lane_state == 0 else 32, triton.next_power_of_2(n_cols))
    splits = triton.cdiv(4 * _num_processors(device), triton.cdiv(n_tokens, block_t))
    return CrossEntropyColumnsLaunchConfig(
        block_t=block_t,
        block_v=block_v,
        num_warps=16,
        splits=max(1, min(splits, triton.cdiv(n_cols, block_v))),
    )


def launch_cross_entropy_columns(
    logits_t: Tensor,
    labels: Tensor,
    *,
    loss_out: Tensor,
    grad_out: Tensor | None,
    grad_scale: Tensor,
    correct_out: Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss_scale: float = 0.0,
    softcap: float = 0.0,
    config: CrossEntropyColumnsLaunchConfig | None = None,
) -> None:
    """:func:`launch_cross_entropy_forward` over logits laid out [V, N] (token n's logits are column n of
    ``logits_t``, whose rows are contiguous), as ``weight @ hidden.t()`` computes them; ``grad_out`` (may be
    ``logits_t`` itself) is laid out the same way. No class weights or live counts."""
    n_cols, n_tokens = logits_t.shape
    if n_tokens == 0:
        return
    if logits_t.stride(1) != 1 or (grad_out is not None and grad_out.stride(1) != 1):
        raise ValueError("launch_cross_entropy_columns needs rows with contiguous entries (stride(1) == 1)")
    if config is None:
        config = cross_entropy_columns_launch_config(
            n_tokens,
            n_cols,
            logits_t.device,
            extra_lane_state=_extra_lane_state(correct_out is not None, label_smoothing),
        )
    # Whole blocks per split, so that only the last split's last block is ragged.
    cols_per_split = triton.cdiv(triton.cdiv(n_cols, config.splits), config.block_v) * config.block_v
    splits = triton.cdiv(n_cols, cols_per_split)
    grid = (triton.cdiv(n_tokens, config.block_t), splits)
    partial = torch.empty((_N_COLUMN_STATS, splits, n_tokens), dtype=torch.float32, device=logits_t.device)
    flags = dict(
        HAS_SMOOTHING=label_smoothing > 0.0,
        HAS_SOFTCAP=softcap > 0.0,
        COMPUTE_ACCURACY=correct_out is not None,
    )
    _cross_entropy_columns_stats_kernel[grid](
        logits_t, logits_t.stride(0), partial, n_tokens, n_cols, cols_per_split, float(softcap),
        BLOCK_T=config.block_t, BLOCK_V=config.block_v, num_warps=config.num_warps, **flags,
    )  # fmt: skip
    write_grad = grad_out is not None
    _cross_entropy_columns_kernel[grid if write_grad else (grid[0], 1)](
        logits_t,
        logits_t.stride(0),
        grad_out if write_grad else logits_t,
        grad_out.stride(0) if write_grad else 0,
        partial,
        labels,
        grad_scale,
        0 if grad_scale.numel() == 1 else grad_scale.stride(0),
        loss_out,
        correct_out if correct_out is not None else loss_out,
        n_tokens,
        n_cols,
        cols_per_split,
        splits,
        ignore_index,
        float(label_smoothing),
        float(z_loss_scale),
        float(softcap),
        HAS_Z_LOSS=z_loss_scale != 0.0,
        WRITE_GRAD=write_grad,
        BLOCK_T=config.block_t,
        BLOCK_V=config.block_v,
        SPLITS_POW2=triton.next_power_of_2(splits),
        SOFTWARE_BF16_ROUNDING=interpreted(),
        num_warps=config.num_warps,
        **flags,
    )


def launch_scale_rows_(x: Tensor, factor: Tensor) -> None:
    """x [R, C] (last dim contiguous) *= factor, in place; factor is one value or one per row."""
    n_rows, n_cols = x.shape
    if n_rows == 0 or n_cols == 0:
        return
    factor = factor.reshape(-1)
    factor_row_stride = 0 if factor.numel() == 1 else factor.stride(0)
    if interpreted() or x.device.type != "cuda":
        grid, block, warps = (min(n_rows, 4),), 1024, 1
    else:
        grid, block, warps = (min(n_rows, 4 * _num_processors(x.device)),), 4096, 8
    _scale_rows_kernel[grid](
        x, x.stride(0), n_rows, n_cols, factor, factor_row_stride, BLOCK=block,
        SOFTWARE_BF16_ROUNDING=interpreted(), num_warps=warps,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# torch.library custom ops (opaque to torch.compile, which sees them through their fake impls)
# --------------------------------------------------------------------------------------------------
# The impl, the eager functions, the ops and their fakes list the same flat arguments on purpose: a torch.library
# op's schema takes no structures, so each layer states them.


def _forward_impl(
    logits: Tensor,
    labels: Tensor,
    class_weight: Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    z_loss_scale: float,
    softcap: float,
    compute_accuracy: bool,
    grad_out: Tensor | None,
    upstream: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Loss and accuracy; with ``grad_out`` the gradient of the loss, times ``upstream`` when given (the
    backward's incoming gradient: one value, or one per token for reduction "none")."""
    n_rows, n_cols = logits.shape
    device = logits.device
    stats = launch_cross_entropy_stats(labels, class_weight, n_cols, ignore_index, mean=reduction == "mean")
    grad_scale = stats[1:2]
    if upstream is not None:
        upstream = upstream.to(torch.float32).reshape(-1)
        grad_scale = upstream.contiguous() if reduction == "none" else upstream * grad_scale
    loss_rows = torch.empty(n_rows, dtype=torch.float32, device=device)
    correct = torch.empty(n_rows, dtype=torch.float32, device=device) if compute_accuracy else None
    launch_cross_entropy_forward(
        logits,
        labels,
        loss_out=loss_rows,
        grad_out=grad_out,
        grad_scale=grad_scale,
        correct_out=correct,
        class_weight=class_weight,
        stats=stats,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        z_loss_scale=z_loss_scale,
        softcap=softcap,
    )
    if reduction == "none":
        loss = loss_rows
        accuracy = correct if correct is not None else loss_rows.new_empty(0)
    else:
        loss = loss_rows.sum()
        if reduction == "mean":
            loss = loss * stats[1]
        if correct is not None:
            n_valid = (labels != ignore_index).sum()
            accuracy = correct.sum() / n_valid.clamp_min(1)
        else:
            accuracy = loss_rows.new_empty(0)
    return loss, accuracy


def _cross_entropy_forward_eager(
    logits: Tensor,
    labels: Tensor,
    class_weight: Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    z_loss_scale: float,
    softcap: float,
    compute_accuracy: bool,
    write_grad: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    grad = torch.empty_like(logits) if write_grad else logits.new_empty(0)
    loss, accuracy = _forward_impl(
        logits,
        labels,
        class_weight,
        ignore_index,
        reduction,
        label_smoothing,
        z_loss_scale,
        softcap,
        compute_accuracy,
        grad if write_grad else None,
    )
    return loss, accuracy, grad


# The ops are what torch.compile sees; eager calls skip their dispatch (about 50 us a call on H200's host,
# benchmarks/kernels/loss_launch_settings.py --parts host-pieces) and run the same functions.
_cross_entropy_forward_op = torch.library.custom_op("fusetune::cross_entropy_forward", mutates_args=())(
    _cross_entropy_forward_eager
)


@_cross_entropy_forward_op.register_fake
def _(
    logits, labels, class_weight, ignore_index, reduction, label_smoothing, z_loss_scale, softcap,
    compute_accuracy, write_grad,
):  # fmt: skip
    n_rows = logits.shape[0]
    loss = logits.new_empty((n_rows,) if reduction == "none" else (), dtype=torch.float32)
    if compute_accuracy:
        accuracy = logits.new_empty((n_rows,) if reduction == "none" else (), dtype=torch.float32)
    else:
        accuracy = logits.new_empty(0, dtype=torch.float32)
    grad = torch.empty_like(logits) if write_grad else logits.new_empty(0)
    return loss, accuracy, grad


def _cross_entropy_backward_eager(
    logits: Tensor,
    labels: Tensor,
    class_weight: Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    z_loss_scale: float,
    softcap: float,
    grad_loss: Tensor,
) -> Tensor:
    """The gradient of ``grad_loss`` * the loss, recomputed from the logits into a new tensor, the upstream
    gradient folded into the kernel's scale (the backward under torch.compile, see _CrossEntropyFunction)."""
    grad = torch.empty_like(logits)
    _forward_impl(
        logits, labels, class_weight, ignore_index, reduction, label_smoothing, z_loss_scale, softcap, False,
        grad, upstream=grad_loss,
    )  # fmt: skip
    return grad


_cross_entropy_backward_op = torch.library.custom_op("fusetune::cross_entropy_backward", mutates_args=())(
    _cross_entropy_backward_eager
)


@_cross_entropy_backward_op.register_fake
def _(
    logits, labels, class_weight, ignore_index, reduction, label_smoothing, z_loss_scale, softcap, grad_loss
):
    return torch.empty_like(logits)


# --------------------------------------------------------------------------------------------------
# Autograd
# --------------------------------------------------------------------------------------------------


class _CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        logits: Tensor,
        labels: Tensor,
        class_weight: Tensor | None,
        ignore_index: int,
        reduction: str,
        label_smoothing: float,
        z_loss_scale: float,
        softcap: float,
        compute_accuracy: bool,
        inplace: bool,
    ) -> tuple[Tensor, Tensor]:
        options = (ignore_index, reduction, label_smoothing, z_loss_scale, softcap)
        ctx.recompute = torch.compiler.is_compiling()
        if ctx.recompute:
            # Under torch.compile the gradient cannot be scaled in place in the backward (Inductor copies
            # a saved tensor before a kernel writes it, and its multiply reads and writes the whole
            # gradient): the forward computes the loss only, and the backward the gradient with the
            # upstream gradient folded into the kernel's scale. One extra read of the logits instead of a
            # read and a write of the gradient: H100, T=8192, V=128256, fwd+bwd 3.11 ms before
            # (benchmarks/kernels/ops.py, 2026-11-27); now the cross_entropy fusetune+compile row of
            # benchmarks/results/h100-kernels.json (section ops), beside torch.compile's.
            loss, accuracy, _ = _cross_entropy_forward_op(
                logits, labels, class_weight, *options, compute_accuracy, False
            )
            ctx.save_for_backward(logits, labels, class_weight)
            ctx.options = options
        elif inplace:
            # The gradient overwrites the logits.
            loss, accuracy = _forward_impl(logits, labels, class_weight, *options, compute_accuracy, logits)
            ctx.save_for_backward(logits)
        else:
            loss, accuracy, grad = _cross_entropy_forward_eager(
                logits, labels, class_weight, *options, compute_accuracy, True
            )
            ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(accuracy)
        return loss, accuracy

    @staticmethod
    def backward(ctx, grad_loss: Tensor, grad_accuracy: Tensor):
        if ctx.recompute:
            logits, labels, class_weight = ctx.saved_tensors
            grad = _cross_entropy_backward_op(logits, labels, class_weight, *ctx.options, grad_loss)
        else:
            (grad,) = ctx.saved_tensors
            launch_scale_rows_(grad, grad_loss.to(torch.float32).contiguous())
        return grad, None, None, None, None, None, None, None, None, None


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


def loss_result(
    loss: Tensor, accuracy: Tensor, reduction: str, return_accuracy: bool, leading_shape: torch.Size
) -> Tensor | tuple[Tensor, Tensor]:
    """What the public loss functions return: the loss (and the accuracy with `return_accuracy`), per token in
    the labels' shape for reduction "none"."""
    if reduction == "none":
        loss = loss.view(leading_shape)
        if return_accuracy:
            accuracy = accuracy.view(leading_shape)
    return (loss, accuracy) if return_accuracy else loss


def _validate(logits: Tensor, labels: Tensor, weight: Tensor | None, reduction: str, softcap: float | None):
    _check_reduction(reduction)
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor, got {logits.dtype}")
    if logits.dim() < 1 or logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits must be [..., V] and labels the leading shape: got logits {tuple(logits.shape)}, "
            f"labels {tuple(labels.shape)}"
        )
    if labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels must be int64 or int32, got {labels.dtype}")
    if weight is not None and weight.shape != (logits.shape[-1],):
        raise ValueError(f"weight must have shape [V]=[{logits.shape[-1]}], got {tuple(weight.shape)}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be positive or None, got {softcap}")


def cross_entropy(
    logits: Tensor,
    labels: Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss_scale: float = 0.0,
    softcap: float | None = None,
    weight: Tensor | None = None,
    return_accuracy: bool = False,
    inplace_backward: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Fused cross-entropy of ``logits [..., V]`` against ``labels [...]`` (see the module docstring).

    Returns the float32 loss (a scalar, or the leading shape for ``reduction="none"``), and with
    ``return_accuracy`` also the token accuracy: argmax(logits) == label, as a fraction of the valid
    tokens ("mean"/"sum") or per token as 0/1 ("none"; 0 at ignored tokens).

    ``inplace_backward=True`` lets the forward overwrite ``logits`` with the gradient (saves a [N, V]
    buffer); the caller must not read ``logits`` afterwards, and nothing else may have saved it for its
    own backward (autograd then reports the in-place modification). Under torch.compile nothing is
    overwritten: the forward computes the loss only and the backward the gradient, from the saved logits,
    into a new tensor. Backward twice through the same graph (retain_graph) is not supported.
    """
    _validate(logits, labels, weight, reduction, softcap)
    vocab = logits.shape[-1]
    leading_shape = labels.shape
    logits2d = logits.reshape(-1, vocab)
    if logits2d.stride(-1) != 1:
        logits2d = logits2d.contiguous()
    labels1d = labels.reshape(-1).contiguous()
    class_weight = weight.contiguous() if weight is not None else None
    cap = float(softcap) if softcap is not None else 0.0
    needs_grad = torch.is_grad_enabled() and logits.requires_grad
    if needs_grad:
        loss, accuracy = _CrossEntropyFunction.apply(
            logits2d, labels1d, class_weight, ignore_index, reduction, float(label_smoothing),
            float(z_loss_scale), cap, return_accuracy, inplace_backward,
        )  # fmt: skip
    else:
        loss, accuracy, _ = torch.ops.fusetune.cross_entropy_forward(
            logits2d, labels1d, class_weight, ignore_index, reduction, float(label_smoothing),
            float(z_loss_scale), cap, return_accuracy, False,
        )  # fmt: skip
    return loss_result(loss, accuracy, reduction, return_accuracy, leading_shape)


# Mirrors cross_entropy argument for argument on purpose: tests call both with the same keywords.
def cross_entropy_reference(
    logits: Tensor,
    labels: Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss_scale: float = 0.0,
    softcap: float | None = None,
    weight: Tensor | None = None,
    return_accuracy: bool = False,
    inplace_backward: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Pure-PyTorch definition of :func:`cross_entropy` (float32 math, float64 if given float64).

    ``inplace_backward`` is accepted for signature parity and ignored.
    """
    del inplace_backward
    _validate(logits, labels, weight, reduction, softcap)
    compute_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    vocab = logits.shape[-1]
    leading_shape = labels.shape
    x = logits.reshape(-1, vocab).to(compute_dtype)
    labels1d = labels.reshape(-1)
    s = softcap * torch.tanh(x / softcap) if softcap is not None else x
    valid = labels1d != ignore_index
    safe_labels = torch.where(valid, labels1d, torch.zeros_like(labels1d))
    w = (
        weight.to(compute_dtype)
        if weight is not None
        else torch.ones(vocab, dtype=compute_dtype, device=x.device)
    )
    lse = torch.logsumexp(s, dim=-1)
    s_label = s.gather(1, safe_labels[:, None]).squeeze(1)
    w_label = w[safe_labels]
    per_token = (1.0 - label_smoothing) * w_label * (lse - s_label)
    if label_smoothing > 0.0:
        per_token = per_token + label_smoothing / vocab * (w.sum() * lse - (s * w).sum(-1))
    if z_loss_scale != 0.0:
        per_token = per_token + z_loss_scale * lse * lse
    zero = torch.zeros((), dtype=compute_dtype, device=x.device)
    per_token = torch.where(valid, per_token, zero)
    if reduction == "none":
        loss = per_token.view(leading_shape)
    elif reduction == "sum":
        loss = per_token.sum()
    else:
        denominator = torch.where(valid, w_label, zero).sum()
        loss = per_token.sum() / torch.where(denominator > 0, denominator, torch.ones_like(denominator))
    if not return_accuracy:
        return loss
    correct = ((x.argmax(dim=-1) == labels1d) & valid).to(compute_dtype)
    if reduction == "none":
        accuracy = correct.view(leading_shape)
    else:
        accuracy = correct.sum() / valid.sum().clamp_min(1)
    return loss, accuracy


class FusedCrossEntropyLoss(nn.Module):
    """nn.Module form of :func:`cross_entropy`; ``weight`` is a buffer, as in ``nn.CrossEntropyLoss``."""

    def __init__(
        self,
        weight: Tensor | None = None,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        z_loss_scale: float = 0.0,
        softcap: float | None = None,
        return_accuracy: bool = False,
        inplace_backward: bool = False,
    ) -> None:
        super().__init__()
        _check_reduction(reduction)
        self.register_buffer("weight", weight)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.z_loss_scale = z_loss_scale
        self.softcap = softcap
        self.return_accuracy = return_accuracy
        self.inplace_backward = inplace_backward

    def forward(self, logits: Tensor, labels: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        return cross_entropy(logits, labels, **{name: getattr(self, name) for name in _LOSS_MODULE_OPTIONS})

    def extra_repr(self) -> str:
        return (
            f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
            f"label_smoothing={self.label_smoothing}, z_loss_scale={self.z_loss_scale}, softcap={self.softcap}"
        )


# The module's constructor arguments, each kept under its own name (weight as a buffer), are cross_entropy's
# keyword arguments: forward passes them all on, so an option added to __init__ needs no second line there.
_LOSS_MODULE_OPTIONS = tuple(inspect.signature(FusedCrossEntropyLoss.__init__).parameters)[1:]
