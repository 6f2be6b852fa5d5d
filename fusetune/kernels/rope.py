"""Rotary position embedding (the Hugging Face "rotate-half" form) for q and k in one launch.

For a rotated width R (the last dim of cos/sin, R <= head_dim, R even) and h = R // 2, each head vector x is
split into x_lo = x[:h], x_hi = x[h:R] and the pass-through rest x[R:]:

    y_lo = x_lo * cos[:h] - x_hi * sin[:h]
    y_hi = x_hi * cos[h:] + x_lo * sin[h:]
    y[R:] = x[R:]

which is exactly ``x * cos + rotate_half(x) * sin`` of transformers' ``apply_rotary_pos_emb`` on the first R
columns. One program handles one token and a block of heads; the programs of one launch cover the q head blocks
and then the k head blocks of every token, so q and k (with any numbers of heads, GQA included) go through a
single launch forwards and a single launch backwards.

What is done in place, and why it is safe: when q (and likewise k) is a non-leaf tensor, or a
reshape/transpose view that covers the whole of a non-leaf contiguous tensor (the ``q_proj(x).view(B, S, H,
D).transpose(1, 2)`` that attention layers pass), the forward writes the rotated values over that tensor's
storage instead of allocating new outputs. Autograd is told through ``ctx.mark_dirty`` on the underlying
non-view tensors, so their version counters move: any other user that saved the old values for its backward
raises the usual "modified by an inplace operation" error instead of reading rotated data, and the caller's
old view objects pick up the new history. Leaves that require grad, views of such leaves, views produced by
multi-output ops (split/unbind), q and k that share memory, and layouts that are not a plain view of a whole
tensor all take the out-of-place path instead (as does ``inplace=False``, and everything under
``torch.compile``, where the registered functional op lets the compiler plan the memory). The backward always
writes the input gradients into fresh buffers: autograd does not promise that an incoming gradient buffer is
ours to overwrite (a caller may hold it, it may be an expanded zero-stride tensor).
"""

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

__all__ = [
    "RopeLaunchSettings",
    "apply_rotary_pos_emb",
    "rope_launch_settings",
    "rope_reference",
]


# ----------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------


# The CPU interpreter (TRITON_INTERPRET=1, used by the tests on machines without a GPU) converts fp32 to bf16
# by truncation where the GPU rounds to nearest even. With ROUND_BF16 (set only under the interpreter) bf16
# results are rounded explicitly first, so CPU tests see the numbers the GPU produces.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _to_dtype(value, dtype: tl.constexpr, ROUND_BF16: tl.constexpr):
    """fp32 value -> dtype, rounding to nearest even."""
    if ROUND_BF16:
        if dtype == tl.bfloat16:
            bits = value.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            rounded = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
            value = tl.where(value != value, value, rounded)
    return value.to(dtype)


@triton.jit
def _rotate_head_block(
    x_ptr,
    out_ptr,
    cos_ptr,
    sin_ptr,
    head_start,
    n_heads,
    stride_x_h,
    stride_x_d,
    stride_out_h,
    stride_out_d,
    stride_cos_d,
    stride_sin_d,
    HALF: tl.constexpr,
    PASS: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    COPY_PASS: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """Rotate heads [head_start, head_start + BLOCK_HEADS) of one token (pointers already at that token)."""
    heads = head_start + tl.arange(0, BLOCK_HEADS)
    cols = tl.arange(0, BLOCK_HALF)
    head_mask = heads < n_heads
    col_mask = cols < HALF
    mask = head_mask[:, None] & col_mask[None, :]

    cos_lo = tl.load(cos_ptr + cols * stride_cos_d, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    cos_hi = tl.load(cos_ptr + (cols + HALF) * stride_cos_d, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    sin_lo = tl.load(sin_ptr + cols * stride_sin_d, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    sin_hi = tl.load(sin_ptr + (cols + HALF) * stride_sin_d, mask=col_mask, other=0.0).to(tl.float32)[None, :]

    x_lo_ptrs = x_ptr + heads[:, None] * stride_x_h + cols[None, :] * stride_x_d
    x_lo = tl.load(x_lo_ptrs, mask=mask, other=0.0).to(tl.float32)
    x_hi = tl.load(x_lo_ptrs + HALF * stride_x_d, mask=mask, other=0.0).to(tl.float32)

    if TRANSPOSE:
        # The transpose of the forward map (see _rope_backward_kernel).
        y_lo = x_lo * cos_lo + x_hi * sin_hi
        y_hi = x_hi * cos_hi - x_lo * sin_lo
    else:
        y_lo = x_lo * cos_lo - x_hi * sin_lo
        y_hi = x_hi * cos_hi + x_lo * sin_hi

    out_lo_ptrs = out_ptr + heads[:, None] * stride_out_h + cols[None, :] * stride_out_d
    tl.store(out_lo_ptrs, _to_dtype(y_lo, out_ptr.dtype.element_ty, ROUND_BF16), mask=mask)
    tl.store(
        out_lo_ptrs + HALF * stride_out_d, _to_dtype(y_hi, out_ptr.dtype.element_ty, ROUND_BF16), mask=mask
    )

    if COPY_PASS:
        # Columns past the rotated width pass through unchanged (only needed when out is not x itself).
        pass_cols = tl.arange(0, BLOCK_PASS)
        pass_mask = head_mask[:, None] & (pass_cols < PASS)[None, :]
        passthrough = tl.load(
            x_ptr + heads[:, None] * stride_x_h + (2 * HALF + pass_cols)[None, :] * stride_x_d, mask=pass_mask
        )
        tl.store(
            out_ptr + heads[:, None] * stride_out_h + (2 * HALF + pass_cols)[None, :] * stride_out_d,
            passthrough.to(out_ptr.dtype.element_ty),
            mask=pass_mask,
        )


@triton.jit
def _rope_program(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    seq_len,
    n_tokens,
    n_q_heads,
    n_k_heads,
    stride_q_b,
    stride_q_h,
    stride_q_s,
    stride_q_d,
    stride_k_b,
    stride_k_h,
    stride_k_s,
    stride_k_d,
    stride_qo_b,
    stride_qo_h,
    stride_qo_s,
    stride_qo_d,
    stride_ko_b,
    stride_ko_h,
    stride_ko_s,
    stride_ko_d,
    stride_cos_b,
    stride_cos_s,
    stride_cos_d,
    stride_sin_b,
    stride_sin_s,
    stride_sin_d,
    stride_pos_b,
    stride_pos_s,
    HALF: tl.constexpr,
    PASS: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
    COPY_PASS: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    HEADS_FASTEST: tl.constexpr,
    N_Q_BLOCKS: tl.constexpr,
    N_BLOCKS: tl.constexpr,
):
    # 1-D grid over (token, head block); which of the two varies fastest between neighbouring programs is a
    # launch setting (neighbours then touch neighbouring memory for one layout or the other). Every thread
    # repeats this index arithmetic, so it stays in int32 (the launcher checks the grid fits) and divides by
    # compile-time block counts where it can; only the pointer offsets are int64.
    pid = tl.program_id(0)
    if HEADS_FASTEST:
        token = pid // N_BLOCKS
        head_block = pid - token * N_BLOCKS
    else:
        head_block = pid // n_tokens
        token = pid - head_block * n_tokens
    batch_i32 = token // seq_len
    seq_i32 = token - batch_i32 * seq_len
    batch = batch_i32.to(tl.int64)
    seq = seq_i32.to(tl.int64)
    n_q_blocks = N_Q_BLOCKS

    if HAS_POSITIONS:
        # cos/sin are a table indexed by position: row = position_ids[batch, seq].
        angle_row = tl.load(pos_ptr + batch * stride_pos_b + seq * stride_pos_s).to(tl.int64)
    else:
        angle_row = seq
    cos_row_ptr = cos_ptr + batch * stride_cos_b + angle_row * stride_cos_s
    sin_row_ptr = sin_ptr + batch * stride_sin_b + angle_row * stride_sin_s

    if head_block < n_q_blocks:
        _rotate_head_block(
            q_ptr + batch * stride_q_b + seq * stride_q_s,
            q_out_ptr + batch * stride_qo_b + seq * stride_qo_s,
            cos_row_ptr,
            sin_row_ptr,
            head_block * BLOCK_HEADS,
            n_q_heads,
            stride_q_h,
            stride_q_d,
            stride_qo_h,
            stride_qo_d,
            stride_cos_d,
            stride_sin_d,
            HALF,
            PASS,
            BLOCK_HEADS,
            BLOCK_HALF,
            BLOCK_PASS,
            TRANSPOSE,
            COPY_PASS,
            ROUND_BF16,
        )
    else:
        _rotate_head_block(
            k_ptr + batch * stride_k_b + seq * stride_k_s,
            k_out_ptr + batch * stride_ko_b + seq * stride_ko_s,
            cos_row_ptr,
            sin_row_ptr,
            (head_block - n_q_blocks) * BLOCK_HEADS,
            n_k_heads,
            stride_k_h,
            stride_k_d,
            stride_ko_h,
            stride_ko_d,
            stride_cos_d,
            stride_sin_d,
            HALF,
            PASS,
            BLOCK_HEADS,
            BLOCK_HALF,
            BLOCK_PASS,
            TRANSPOSE,
            COPY_PASS,
            ROUND_BF16,
        )


@triton.jit
def _rope_forward_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    seq_len,
    n_tokens,
    n_q_heads,
    n_k_heads,
    stride_q_b,
    stride_q_h,
    stride_q_s,
    stride_q_d,
    stride_k_b,
    stride_k_h,
    stride_k_s,
    stride_k_d,
    stride_qo_b,
    stride_qo_h,
    stride_qo_s,
    stride_qo_d,
    stride_ko_b,
    stride_ko_h,
    stride_ko_s,
    stride_ko_d,
    stride_cos_b,
    stride_cos_s,
    stride_cos_d,
    stride_sin_b,
    stride_sin_s,
    stride_sin_d,
    stride_pos_b,
    stride_pos_s,
    HALF: tl.constexpr,
    PASS: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
    COPY_PASS: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    HEADS_FASTEST: tl.constexpr,
    N_Q_BLOCKS: tl.constexpr,
    N_BLOCKS: tl.constexpr,
):
    """y_lo = x_lo * c_lo - x_hi * s_lo;  y_hi = x_hi * c_hi + x_lo * s_hi;  y[R:] = x[R:]  (x is q or k).

    Grid: batch * seq_len * (cdiv(n_q_heads, BLOCK_HEADS) + cdiv(n_k_heads, BLOCK_HEADS)) programs, one per
    (token, head block). q_out/k_out may be q/k themselves (in place): every element is read and written by
    the same program, read first.
    """
    _rope_program(
        q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, pos_ptr, seq_len, n_tokens, n_q_heads, n_k_heads,
        stride_q_b, stride_q_h, stride_q_s, stride_q_d, stride_k_b, stride_k_h, stride_k_s, stride_k_d,
        stride_qo_b, stride_qo_h, stride_qo_s, stride_qo_d, stride_ko_b, stride_ko_h, stride_ko_s, stride_ko_d,
        stride_cos_b, stride_cos_s, stride_cos_d, stride_sin_b, stride_sin_s, stride_sin_d,
        stride_pos_b, stride_pos_s,
        HALF, PASS, BLOCK_HEADS, BLOCK_HALF, BLOCK_PASS, HAS_POSITIONS, COPY_PASS, False, ROUND_BF16, HEADS_FASTEST,
        N_Q_BLOCKS, N_BLOCKS,
    )  # fmt: skip


@triton.jit
def _rope_backward_kernel(
    dy_q_ptr,
    dy_k_ptr,
    dx_q_ptr,
    dx_k_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    seq_len,
    n_tokens,
    n_q_heads,
    n_k_heads,
    stride_q_b,
    stride_q_h,
    stride_q_s,
    stride_q_d,
    stride_k_b,
    stride_k_h,
    stride_k_s,
    stride_k_d,
    stride_qo_b,
    stride_qo_h,
    stride_qo_s,
    stride_qo_d,
    stride_ko_b,
    stride_ko_h,
    stride_ko_s,
    stride_ko_d,
    stride_cos_b,
    stride_cos_s,
    stride_cos_d,
    stride_sin_b,
    stride_sin_s,
    stride_sin_d,
    stride_pos_b,
    stride_pos_s,
    HALF: tl.constexpr,
    PASS: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
    COPY_PASS: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    HEADS_FASTEST: tl.constexpr,
    N_Q_BLOCKS: tl.constexpr,
    N_BLOCKS: tl.constexpr,
):
    """The forward is linear in x, y = M x, so dx = M^T dy:

        dx_lo = dy_lo * c_lo + dy_hi * s_hi
        dx_hi = dy_hi * c_hi - dy_lo * s_lo
        dx[R:] = dy[R:]

    With the cos/sin of a rotary embedding (both halves equal: c_lo = c_hi, s_lo = s_hi) this is the forward
    rotation with sin negated; the form above is the exact transpose for any cos/sin. No gradient flows to
    cos/sin. Same grid and in-place rule as the forward.
    """
    _rope_program(
        dy_q_ptr, dy_k_ptr, dx_q_ptr, dx_k_ptr, cos_ptr, sin_ptr, pos_ptr, seq_len, n_tokens, n_q_heads,
        n_k_heads,
        stride_q_b, stride_q_h, stride_q_s, stride_q_d, stride_k_b, stride_k_h, stride_k_s, stride_k_d,
        stride_qo_b, stride_qo_h, stride_qo_s, stride_qo_d, stride_ko_b, stride_ko_h, stride_ko_s, stride_ko_d,
        stride_cos_b, stride_cos_s, stride_cos_d, stride_sin_b, stride_sin_s, stride_sin_d,
        stride_pos_b, stride_pos_s,
        HALF, PASS, BLOCK_HEADS, BLOCK_HALF, BLOCK_PASS, HAS_POSITIONS, COPY_PASS, True, ROUND_BF16, HEADS_FASTEST,
        N_Q_BLOCKS, N_BLOCKS,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# Launch settings and launcher
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RopeLaunchSettings:
    block_heads: int
    num_warps: int
    heads_fastest: bool


def rope_launch_settings(n_heads: int, rotary_dim: int, tokens_major: bool) -> RopeLaunchSettings:
    """Heads per program, warps, and the program order.

    H100, B=8, S=2048, 32 q / 8 kv heads, D=128, bf16, kernel-level fwd + bwd medians
    (.scratch/bench_rope_swiglu.py, 2026-11-22), heads per program / warps, heads-fastest order:
    4/1 0.80 ms, 4/2 0.80, 8/2 0.85, 8/4 0.88, 16/4 0.84, 16/8 0.93, 32/4 0.97, 32/8 1.02; tokens-fastest
    order on that [B, S, H, D] layout: 8/2 1.10, 16/4 0.91, 32/8 0.93; on a contiguous [B, H, S, D] layout
    the tokens-fastest order was faster (fwd 0.45 vs 0.53 ms). Hence about 256 rotated pairs (4 heads of
    D=128) per program, 2 warps, and the order that keeps neighbouring programs on neighbouring memory.
    Those runs used int64 index arithmetic, since replaced by int32 and compile-time block counts: not yet
    measured, and all of them are far from the 0.22 ms floor (see the benchmark notes).
    """
    half_block = triton.next_power_of_2(max(rotary_dim // 2, 1))
    target_heads = max(1, 256 // half_block)
    block_heads = min(triton.next_power_of_2(max(n_heads, 1)), target_heads)
    return RopeLaunchSettings(block_heads=block_heads, num_warps=2, heads_fastest=tokens_major)


def _angle_strides(t: torch.Tensor) -> tuple[int, int, int]:
    # A batch dim of 1 is broadcast over the batch by a zero stride.
    return (t.stride(0) if t.shape[0] > 1 else 0, t.stride(1), t.stride(2))


def _launch_rope(
    kernel,
    q: torch.Tensor,
    k: torch.Tensor,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
    copy_pass: bool,
) -> None:
    """q, k, q_out, k_out: [B, H, S, D] with any strides; cos/sin: [1 or B, S or P, R]; position_ids: [1 or B, S]."""
    batch, n_q_heads, seq_len, head_dim = q.shape
    n_k_heads = k.shape[1]
    rotary_dim = cos.shape[-1]
    half = rotary_dim // 2
    pass_width = head_dim - rotary_dim
    if batch * seq_len == 0 or n_q_heads + n_k_heads == 0:
        return
    settings = rope_launch_settings(max(n_q_heads, n_k_heads), rotary_dim, _is_tokens_major(q))
    block_heads = settings.block_heads
    n_tokens = batch * seq_len
    n_q_blocks = triton.cdiv(n_q_heads, block_heads)
    n_blocks = n_q_blocks + triton.cdiv(n_k_heads, block_heads)
    if n_tokens * n_blocks >= 2**31:
        raise ValueError(f"rope: {n_tokens} tokens x {n_blocks} head blocks exceed the int32 program index")
    grid = (n_tokens * n_blocks,)
    if position_ids is None:
        positions, stride_pos_b, stride_pos_s = cos, 0, 0  # unused placeholder pointer
    else:
        positions = position_ids
        stride_pos_b = position_ids.stride(0) if position_ids.shape[0] > 1 else 0
        stride_pos_s = position_ids.stride(1)
    wrap_triton(kernel)[grid](
        q, k, q_out, k_out, cos, sin, positions,
        seq_len, n_tokens, n_q_heads, n_k_heads,
        *q.stride(), *k.stride(), *q_out.stride(), *k_out.stride(),
        *_angle_strides(cos), *_angle_strides(sin),
        stride_pos_b, stride_pos_s,
        HALF=half,
        PASS=pass_width,
        BLOCK_HEADS=block_heads,
        BLOCK_HALF=triton.next_power_of_2(max(half, 1)),
        BLOCK_PASS=triton.next_power_of_2(max(pass_width, 1)),
        HAS_POSITIONS=position_ids is not None,
        COPY_PASS=copy_pass and pass_width > 0,
        ROUND_BF16=_INTERPRETED,
        HEADS_FASTEST=settings.heads_fastest,
        N_Q_BLOCKS=n_q_blocks,
        N_BLOCKS=n_blocks,
        num_warps=settings.num_warps,
    )  # fmt: skip


def _is_tokens_major(x: torch.Tensor) -> bool:
    """True for a [B, H, S, D] view of a [B, S, H, D] layout (heads closer together than tokens)."""
    return x.stride(1) < x.stride(2)


def _empty_bhsd(like: torch.Tensor, tokens_major: bool) -> torch.Tensor:
    # Gradients and outputs follow the layout of the tensor they stand for, so that the view/transpose that
    # produced q from its projection maps them back without a copy.
    # empty_strided rather than a transposed view: outputs of custom ops and autograd nodes should not be views.
    batch, heads, seq_len, head_dim = like.shape
    if tokens_major:
        strides = (seq_len * heads * head_dim, head_dim, heads * head_dim, 1)
    else:
        strides = (heads * seq_len * head_dim, seq_len * head_dim, head_dim, 1)
    return torch.empty_strided(like.shape, strides, dtype=like.dtype, device=like.device)


def _rope_backward_impl(
    grad_q: torch.Tensor,
    grad_k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
    q_tokens_major: bool,
    k_tokens_major: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    grad_q_in = _empty_bhsd(grad_q, q_tokens_major)
    grad_k_in = _empty_bhsd(grad_k, k_tokens_major)
    _launch_rope(_rope_backward_kernel, grad_q, grad_k, grad_q_in, grad_k_in, cos, sin, position_ids, True)
    return grad_q_in, grad_k_in


# ----------------------------------------------------------------------------------------------------------
# Registered ops (functional: used under torch.compile and whenever the in-place path is not allowed)
# ----------------------------------------------------------------------------------------------------------


@triton_op("fusetune::rope", mutates_args=())
def _rope_op(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    q_out = _empty_bhsd(q, _is_tokens_major(q))
    k_out = _empty_bhsd(k, _is_tokens_major(k))
    _launch_rope(_rope_forward_kernel, q, k, q_out, k_out, cos, sin, position_ids, True)
    return q_out, k_out


@triton_op("fusetune::rope_backward", mutates_args=())
def _rope_backward_op(
    grad_q: torch.Tensor,
    grad_k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
    q_tokens_major: bool,
    k_tokens_major: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rope_backward_impl(grad_q, grad_k, cos, sin, position_ids, q_tokens_major, k_tokens_major)


def _rope_setup_context(ctx, inputs, output) -> None:
    q, k, cos, sin, position_ids = inputs
    ctx.save_for_backward(cos, sin, position_ids)
    ctx.layouts = (_is_tokens_major(q), _is_tokens_major(k))


def _rope_op_backward(ctx, grad_q_out, grad_k_out):
    cos, sin, position_ids = ctx.saved_tensors
    grad_q, grad_k = torch.ops.fusetune.rope_backward(
        grad_q_out, grad_k_out, cos, sin, position_ids, *ctx.layouts
    )
    return grad_q, grad_k, None, None, None


_rope_op.register_autograd(_rope_op_backward, setup_context=_rope_setup_context)


# ----------------------------------------------------------------------------------------------------------
# In-place path (eager only)
# ----------------------------------------------------------------------------------------------------------

# How an in-place operand is seen as [B, H, S, D]: "bshd" = transpose of a [B, S, H, D] tensor (the HF layout),
# "bhsd" = a [B, H, S, D] tensor as is.
_TOKENS_MAJOR, _HEADS_MAJOR = "bshd", "bhsd"


def _bhsd_view(t: torch.Tensor, shape: tuple[int, int, int, int], layout: str) -> torch.Tensor:
    batch, heads, seq_len, head_dim = shape
    if layout == _TOKENS_MAJOR:
        return t.reshape(batch, seq_len, heads, head_dim).transpose(1, 2)
    return t.reshape(batch, heads, seq_len, head_dim)


def _same_geometry(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.data_ptr() != b.data_ptr():
        return False
    return all(sa == sb for sa, sb, n in zip(a.stride(), b.stride(), a.shape, strict=True) if n > 1)


def _get_creation_meta(t: torch.Tensor):
    getter = getattr(torch._C._autograd, "_get_creation_meta", None)
    return None if getter is None else getter(t)


def _in_place_source(x: torch.Tensor) -> tuple[torch.Tensor, str] | None:
    """The non-view tensor whose storage can take the rotated x, and how x sits in it; None if not allowed."""
    if x.requires_grad and x.is_leaf:
        return None
    source = x._base if x._is_view() else x
    if source is None or source._is_view():
        return None
    if source.requires_grad and source.is_leaf:
        return None
    if x._is_view() and x.requires_grad:
        meta = _get_creation_meta(x)
        if meta is None or meta != torch._C._autograd.CreationMeta.DEFAULT:
            return None  # e.g. an output of split/unbind, or a view made under no_grad
    if source.numel() != x.numel() or not source.is_contiguous():
        return None
    for layout in (_TOKENS_MAJOR, _HEADS_MAJOR):
        if _same_geometry(_bhsd_view(source, tuple(x.shape), layout), x):
            return source, layout
    return None


def _storage_span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1
    return start, start + extent * t.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a0, a1), (b0, b1) = _storage_span(a), _storage_span(b)
    return a0 < b1 and b0 < a1


class _RotaryInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_source, k_source, q_shape, k_shape, layouts, cos, sin, position_ids):
        q = _bhsd_view(q_source, q_shape, layouts[0])
        k = _bhsd_view(k_source, k_shape, layouts[1])
        _launch_rope(_rope_forward_kernel, q, k, q, k, cos, sin, position_ids, False)
        ctx.mark_dirty(q_source, k_source)
        ctx.save_for_backward(cos, sin, position_ids)
        ctx.geometry = (q_shape, k_shape, layouts)
        return q_source, k_source

    @staticmethod
    def backward(ctx, grad_q_source, grad_k_source):
        cos, sin, position_ids = ctx.saved_tensors
        q_shape, k_shape, layouts = ctx.geometry
        grad_q = _bhsd_view(grad_q_source, q_shape, layouts[0])
        grad_k = _bhsd_view(grad_k_source, k_shape, layouts[1])
        grad_q_in, grad_k_in = _rope_backward_impl(
            grad_q, grad_k, cos, sin, position_ids, layouts[0] == _TOKENS_MAJOR, layouts[1] == _TOKENS_MAJOR
        )
        # Back to the shape of the sources: contiguous in the source layout, so these are views.
        grad_q_source_in = _source_from_bhsd(grad_q_in, layouts[0]).view(grad_q_source.shape)
        grad_k_source_in = _source_from_bhsd(grad_k_in, layouts[1]).view(grad_k_source.shape)
        return grad_q_source_in, grad_k_source_in, None, None, None, None, None, None


def _source_from_bhsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    return x.transpose(1, 2) if layout == _TOKENS_MAJOR else x


# ----------------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------------


def _angles_and_positions(
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
    batch: int,
    seq_len: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    if cos.shape != sin.shape:
        raise ValueError(
            f"cos and sin must have the same shape, got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if position_ids is None:
        if cos.dim() != 3 or cos.shape[0] not in (1, batch) or cos.shape[1] != seq_len:
            raise ValueError(
                f"without position_ids, cos/sin must be [1 or batch={batch}, seq_len={seq_len}, rotary_dim] "
                f"(one row per token, as transformers' rotary embedding returns them), got {tuple(cos.shape)}"
            )
    else:
        if cos.dim() != 2:
            raise ValueError(
                "with position_ids, cos/sin must be a 2-D table [max_position, rotary_dim] indexed by position, "
                f"got shape {tuple(cos.shape)}; pass position_ids=None for per-token cos/sin"
            )
        if position_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"position_ids must be int32 or int64, got {position_ids.dtype}")
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)
        if (
            position_ids.dim() != 2
            or position_ids.shape[0] not in (1, batch)
            or position_ids.shape[1] != seq_len
        ):
            raise ValueError(
                f"position_ids must be [1 or batch={batch}, seq_len={seq_len}], got {tuple(position_ids.shape)}"
            )
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    rotary_dim = cos.shape[-1]
    if rotary_dim % 2 or rotary_dim == 0 or rotary_dim > head_dim:
        raise ValueError(
            f"rotary dim (last dim of cos/sin) must be even and in [2, head_dim={head_dim}], got {rotary_dim}"
        )
    return cos, sin, position_ids


def apply_rotary_pos_emb(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    unsqueeze_dim: int = 1,
    *,
    inplace: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for transformers' ``apply_rotary_pos_emb``: returns ``(q_embed, k_embed)``.

    q: [B, Hq, S, D] and k: [B, Hkv, S, D] (or [B, S, H, D] with ``unsqueeze_dim=2``), any strides, any head
    counts. cos/sin are accepted in two forms:

    - ``position_ids=None``: per-token values [1 or B, S, R], as transformers' rotary embedding module returns
      them (already gathered for the positions of the batch). This is the HF drop-in use.
    - ``position_ids`` given ([1 or B, S] or [S], int32/int64): cos/sin are a table [max_position, R] and row
      ``position_ids[b, s]`` is used for token (b, s), e.g. packed sequences whose positions restart. Positions
      must lie in [0, max_position); they are not bounds-checked on the device.

    R (even, <= D) is the rotated width; columns R..D pass through unchanged. The result is computed in fp32
    and rounded once to q's dtype. With ``inplace`` (the default) q and k are overwritten when autograd allows
    it (module docstring), so callers must use the returned tensors, as HF's attention layers do. No gradient
    flows to cos/sin.
    """
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be 4-D, got {q.dim()}-D and {k.dim()}-D")
    if unsqueeze_dim in (1, -3):
        heads_dim_is_2 = False
    elif unsqueeze_dim in (2, -2):
        heads_dim_is_2 = True
    else:
        raise ValueError(f"unsqueeze_dim must be 1 ([B, H, S, D]) or 2 ([B, S, H, D]), got {unsqueeze_dim}")
    q_bhsd = q.transpose(1, 2) if heads_dim_is_2 else q
    k_bhsd = k.transpose(1, 2) if heads_dim_is_2 else k
    batch, _, seq_len, head_dim = q_bhsd.shape
    if k_bhsd.shape[0] != batch or k_bhsd.shape[2] != seq_len or k_bhsd.shape[3] != head_dim:
        raise ValueError(
            f"q {tuple(q_bhsd.shape)} and k {tuple(k_bhsd.shape)} (as [B, H, S, D]) must share B, S and D"
        )
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError("gradients with respect to cos/sin are not supported; pass them detached")
    cos, sin, position_ids = _angles_and_positions(cos, sin, position_ids, batch, seq_len, head_dim)

    q_embed = k_embed = None
    if inplace and not torch.compiler.is_compiling():
        q_source = _in_place_source(q_bhsd)
        k_source = _in_place_source(k_bhsd)
        if q_source is not None and k_source is not None and not _overlap(q_bhsd, k_bhsd):
            (q_src, q_layout), (k_src, k_layout) = q_source, k_source
            q_src, k_src = _RotaryInPlace.apply(
                q_src,
                k_src,
                tuple(q_bhsd.shape),
                tuple(k_bhsd.shape),
                (q_layout, k_layout),
                cos,
                sin,
                position_ids,
            )
            q_embed = _bhsd_view(q_src, tuple(q_bhsd.shape), q_layout)
            k_embed = _bhsd_view(k_src, tuple(k_bhsd.shape), k_layout)
    if q_embed is None:
        q_embed, k_embed = torch.ops.fusetune.rope(q_bhsd, k_bhsd, cos, sin, position_ids)
    if heads_dim_is_2:
        q_embed, k_embed = q_embed.transpose(1, 2), k_embed.transpose(1, 2)
    return q_embed, k_embed


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int = 1,
    *,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure PyTorch, computed in fp32 and cast back to the input dtype; same arguments as apply_rotary_pos_emb."""
    if position_ids is not None:
        cos, sin = cos[position_ids], sin[position_ids]
    cos = cos.unsqueeze(unsqueeze_dim).float()
    sin = sin.unsqueeze(unsqueeze_dim).float()
    rotary_dim = cos.shape[-1]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x_rot = x[..., :rotary_dim].float()
        rotated = (x_rot * cos + _rotate_half(x_rot) * sin).to(x.dtype)
        return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)

    return rotate(q), rotate(k)
