"""Rotary position embedding (the Hugging Face "rotate-half" form) for q and k in one launch.

For a rotated width R (the last dim of cos/sin, R <= head_dim, R even) and h = R // 2, each head vector x is
split into x_lo = x[:h], x_hi = x[h:R] and the pass-through rest x[R:]:

    y_lo = x_lo * cos[:h] - x_hi * sin[:h]
    y_hi = x_hi * cos[h:] + x_lo * sin[h:]
    y[R:] = x[R:]

which is exactly ``x * cos + rotate_half(x) * sin`` of transformers' ``apply_rotary_pos_emb`` on the first R
columns.

How the kernel is laid out, and why (bandwidth reasoning, to be confirmed by ``benchmarks/kernels/ops.py --ops
rope``): the op moves 2 bytes in and 2 out per element of q and k and does 3 flops on each, so only the bytes
matter. One program owns one token (or a few consecutive tokens of one sequence when a token carries little
work): it reads that token's cos/sin row once and rotates ALL q heads and ALL kv heads of the token as two 2-D
tiles [heads, h] (heads padded to a power of two and masked), so every access is a run of h contiguous elements
per head and, for the [B, S, H, D] layout of attention projections (q/k passed as its transposed view), the
whole token is one contiguous block of H*D elements. The grid is (token blocks, batch): no division or modulo
anywhere, and per-program offsets are int32 unless a tensor spans 2**31 elements (chosen on the host). q and k
loads are issued before any store so both are in flight together. Forward and backward are the same kernel:
the backward is the transpose of the forward map, i.e. the forward with the two halves of sin swapped and
negated (see ``_rope_kernel``), which is exact also when cos/sin halves differ.

Both halves of cos/sin are always read. transformers' cos/sin repeat their first half, so reading only it would
save h values of each per token; but knowing that the halves are equal would cost a device-to-host sync per call
(or trusting the caller), while the second halves are R * 2 bytes per token (bf16) against 2 * (Hq + Hkv) * D
bytes of q/k read (2.5% more reads at 32/8 heads, D=128, and mostly L2 hits: a [1, S, R] table is shared by
the whole batch).

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

The in-place results are outputs of the autograd Function itself (views of the rotated projection output),
not views made afterwards: their incoming gradients then reach the backward kernel with whatever strides they
have. A gradient routed through view ops made outside would be copied into the [B, S, H*D] layout first
whenever it arrives as [B, H, S, D] (e.g. through ``repeat_kv`` or a ``.contiguous()`` before attention), one
extra read and write of dq/dk per layer; this is the suspected cause of the in-place path measuring slower
end to end before (reasoned, not measured). The price: like any view returned by a custom Function, these
results may not be modified in place while autograd records (none of the supported families does so).
"""

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fusetune.kernels._interpreter import interpreted, round_to_dtype
from fusetune.kernels._tensors import storage_overlaps

__all__ = [
    "RopeLaunchSettings",
    "apply_rotary_pos_emb",
    "rope_launch_settings",
    "rope_reference",
]


# ----------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _rotate_and_store(
    x_lo,
    x_hi,
    out_ptrs,
    mask,
    cos_lo,
    cos_hi,
    sin_lo,
    sin_hi,
    HALF: tl.constexpr,
    stride_out_d,
    SOFTWARE_BF16_ROUNDING: tl.constexpr,
):
    """Writes the rotation of one [heads, h] tile pair (fp32 in) to out_ptrs (the low-half pointers)."""
    y_lo = x_lo * cos_lo - x_hi * sin_lo
    y_hi = x_hi * cos_hi + x_lo * sin_hi
    out_dtype = out_ptrs.dtype.element_ty
    tl.store(out_ptrs, round_to_dtype(y_lo, out_dtype, SOFTWARE_BF16_ROUNDING), mask=mask)
    tl.store(
        out_ptrs + HALF * stride_out_d, round_to_dtype(y_hi, out_dtype, SOFTWARE_BF16_ROUNDING), mask=mask
    )


@triton.jit
def _copy_pass_through(
    x_token_ptr,
    out_token_ptr,
    heads,
    head_mask,
    stride_x_h,
    stride_x_d,
    stride_out_h,
    stride_out_d,
    ROTARY: tl.constexpr,
    PASS: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    """Columns [R, D) of the given heads of one token, unchanged (only when out is not x itself)."""
    cols = tl.arange(0, BLOCK_PASS)
    mask = head_mask[:, None] & (cols < PASS)[None, :]
    values = tl.load(
        x_token_ptr + heads[:, None] * stride_x_h + (ROTARY + cols)[None, :] * stride_x_d, mask=mask
    )
    tl.store(
        out_token_ptr + heads[:, None] * stride_out_h + (ROTARY + cols)[None, :] * stride_out_d,
        values.to(out_token_ptr.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    seq_len,
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
    N_Q_HEADS: tl.constexpr,
    N_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    PASS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    BLOCK_Q_HEADS: tl.constexpr,
    BLOCK_K_HEADS: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    TOKENS_PER_PROGRAM: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
    COPY_PASS: tl.constexpr,
    BACKWARD: tl.constexpr,
    INDEX_64: tl.constexpr,
    SOFTWARE_BF16_ROUNDING: tl.constexpr,
):
    """Forward (x = q, k; out = rotated) or backward (x = dy; out = dx) of the rotation, all heads of a token.

    Forward:   y_lo = x_lo * c_lo - x_hi * s_lo;  y_hi = x_hi * c_hi + x_lo * s_hi;  y[R:] = x[R:].
    The forward is linear in x, y = M x, so the backward is dx = M^T dy:
               dx_lo = dy_lo * c_lo + dy_hi * s_hi;  dx_hi = dy_hi * c_hi - dy_lo * s_lo;  dx[R:] = dy[R:],
    i.e. the forward formula with (s_lo, s_hi) replaced by (-s_hi, -s_lo). With transformers' cos/sin (equal
    halves) that is the forward with sin negated; the swap keeps it exact for any cos/sin. No gradient flows to
    cos/sin.

    Grid: (cdiv(seq_len, TOKENS_PER_PROGRAM), batch). Program (i, b) handles tokens s = i * TOKENS_PER_PROGRAM
    + t of sequence b; per token it reads one cos/sin row and rotates heads in HEAD_BLOCKS steps of
    BLOCK_Q_HEADS q heads and BLOCK_K_HEADS kv heads (one step unless a token is very wide). q_out/k_out may be
    q/k themselves (in place): every element is read and written by the same program, read first.
    """
    seq_block = tl.program_id(0)
    batch = tl.program_id(1)
    if INDEX_64:
        batch = batch.to(tl.int64)
        seq_block = seq_block.to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < HALF

    for t in range(TOKENS_PER_PROGRAM):
        seq = seq_block * TOKENS_PER_PROGRAM + t
        token_in_range = seq < seq_len

        # The token's cos/sin row: its own row, or row position_ids[b, s] of a table.
        if HAS_POSITIONS:
            angle_row = tl.load(
                pos_ptr + batch * stride_pos_b + seq * stride_pos_s, mask=token_in_range, other=0
            )
            if INDEX_64:
                angle_row = angle_row.to(tl.int64)
            else:
                angle_row = angle_row.to(tl.int32)
        else:
            angle_row = seq
        cos_row = cos_ptr + batch * stride_cos_b + angle_row * stride_cos_s
        sin_row = sin_ptr + batch * stride_sin_b + angle_row * stride_sin_s
        angle_mask = col_mask & token_in_range
        cos_lo = tl.load(cos_row + cols * stride_cos_d, mask=angle_mask, other=0.0)
        cos_hi = tl.load(cos_row + (cols + HALF) * stride_cos_d, mask=angle_mask, other=0.0)
        sin_first = tl.load(sin_row + cols * stride_sin_d, mask=angle_mask, other=0.0)
        sin_second = tl.load(sin_row + (cols + HALF) * stride_sin_d, mask=angle_mask, other=0.0)
        cos_lo = cos_lo.to(tl.float32)[None, :]
        cos_hi = cos_hi.to(tl.float32)[None, :]
        if BACKWARD:
            # dx = M^T dy (docstring): the forward formula with sin's halves swapped and negated.
            sin_lo = -sin_second.to(tl.float32)[None, :]
            sin_hi = -sin_first.to(tl.float32)[None, :]
        else:
            sin_lo = sin_first.to(tl.float32)[None, :]
            sin_hi = sin_second.to(tl.float32)[None, :]

        q_token = q_ptr + batch * stride_q_b + seq * stride_q_s
        k_token = k_ptr + batch * stride_k_b + seq * stride_k_s
        q_out_token = q_out_ptr + batch * stride_qo_b + seq * stride_qo_s
        k_out_token = k_out_ptr + batch * stride_ko_b + seq * stride_ko_s

        for head_block in range(HEAD_BLOCKS):
            q_heads = head_block * BLOCK_Q_HEADS + tl.arange(0, BLOCK_Q_HEADS)
            k_heads = head_block * BLOCK_K_HEADS + tl.arange(0, BLOCK_K_HEADS)
            if INDEX_64:
                q_heads = q_heads.to(tl.int64)
                k_heads = k_heads.to(tl.int64)
            q_head_mask = (q_heads < N_Q_HEADS) & token_in_range
            k_head_mask = (k_heads < N_K_HEADS) & token_in_range
            if BLOCK_HALF == HALF:
                # Masks constant along D, so the loads stay full-width vector accesses.
                q_mask = q_head_mask[:, None]
                k_mask = k_head_mask[:, None]
            else:
                q_mask = q_head_mask[:, None] & col_mask[None, :]
                k_mask = k_head_mask[:, None] & col_mask[None, :]

            # All loads of the step first, so q and k are in flight together.
            q_lo_ptrs = q_token + q_heads[:, None] * stride_q_h + cols[None, :] * stride_q_d
            k_lo_ptrs = k_token + k_heads[:, None] * stride_k_h + cols[None, :] * stride_k_d
            q_lo = tl.load(q_lo_ptrs, mask=q_mask, other=0.0).to(tl.float32)
            q_hi = tl.load(q_lo_ptrs + HALF * stride_q_d, mask=q_mask, other=0.0).to(tl.float32)
            k_lo = tl.load(k_lo_ptrs, mask=k_mask, other=0.0).to(tl.float32)
            k_hi = tl.load(k_lo_ptrs + HALF * stride_k_d, mask=k_mask, other=0.0).to(tl.float32)

            _rotate_and_store(
                q_lo, q_hi,
                q_out_token + q_heads[:, None] * stride_qo_h + cols[None, :] * stride_qo_d,
                q_mask, cos_lo, cos_hi, sin_lo, sin_hi, HALF, stride_qo_d, SOFTWARE_BF16_ROUNDING,
            )  # fmt: skip
            _rotate_and_store(
                k_lo, k_hi,
                k_out_token + k_heads[:, None] * stride_ko_h + cols[None, :] * stride_ko_d,
                k_mask, cos_lo, cos_hi, sin_lo, sin_hi, HALF, stride_ko_d, SOFTWARE_BF16_ROUNDING,
            )  # fmt: skip

            if COPY_PASS:
                _copy_pass_through(
                    q_token, q_out_token, q_heads, q_head_mask, stride_q_h, stride_q_d, stride_qo_h,
                    stride_qo_d, 2 * HALF, PASS, BLOCK_PASS,
                )  # fmt: skip
                _copy_pass_through(
                    k_token, k_out_token, k_heads, k_head_mask, stride_k_h, stride_k_d, stride_ko_h,
                    stride_ko_d, 2 * HALF, PASS, BLOCK_PASS,
                )  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# Launch settings and launcher
# ----------------------------------------------------------------------------------------------------------

# Rotated pairs (elements of one half) per operand tile; wider tokens are rotated in several head steps so that
# a tile stays a few fp32 registers per thread. 32 heads of D=128 (2048 pairs) fit in one step.
_MAX_PAIRS_PER_TILE = 2048
# Work one program should have at least (rotated pairs over its tokens), so that tiny heads do not make tiny
# programs: below it, a program takes several consecutive tokens.
_MIN_PAIRS_PER_PROGRAM = 1024


@dataclass(frozen=True)
class RopeLaunchSettings:
    block_q_heads: int
    block_k_heads: int
    head_blocks: int
    tokens_per_program: int
    num_warps: int
    block_half: int  # next power of two of the rotated half width
    block_pass: int  # next power of two of the pass-through width (1 when there is none)

    def launch_arguments(self) -> dict[str, int]:
        """The tiling and launch arguments _rope_kernel takes from these settings (as the norms'
        `NormLaunchSettings.forward_launch_arguments`)."""
        return {
            "BLOCK_HALF": self.block_half,
            "BLOCK_PASS": self.block_pass,
            "BLOCK_Q_HEADS": self.block_q_heads,
            "BLOCK_K_HEADS": self.block_k_heads,
            "HEAD_BLOCKS": self.head_blocks,
            "TOKENS_PER_PROGRAM": self.tokens_per_program,
            "num_warps": self.num_warps,
        }


def _previous_power_of_2(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def rope_launch_settings(
    n_q_heads: int, n_k_heads: int, rotary_dim: int, head_dim: int | None = None
) -> RopeLaunchSettings:
    """Heads per step, head steps and tokens per program, warps and block widths (`_rope_launch_settings`)."""
    # int(): under torch.compile these may be symbolic; they are compile-time constants of the kernel anyway.
    return _rope_launch_settings(
        int(n_q_heads),
        int(n_k_heads),
        int(rotary_dim),
        int(rotary_dim if head_dim is None else head_dim),
        _MAX_PAIRS_PER_TILE,
        _MIN_PAIRS_PER_PROGRAM,
    )


@functools.lru_cache(maxsize=256)
def _rope_launch_settings(
    n_q_heads: int,
    n_k_heads: int,
    rotary_dim: int,
    head_dim: int,
    max_pairs_per_tile: int,
    min_pairs_per_program: int,
) -> RopeLaunchSettings:
    """Cached by shape: this runs on every call, on the host.

    NOT YET MEASURED: the values below are reasoning, to be confirmed on the GPU with
    ``benchmarks/kernels/ops.py --ops rope`` (B=8, S=2048, 32 q / 8 kv heads, D=128 gives one program per token,
    one step of 32 + 8 heads, 4 warps). The reasoning: about 16 rotated pairs per thread per step, i.e. each
    thread reads one 16-byte vector of bf16 from each half of each q head row it owns (8 warps would leave the
    narrower kv tile with 4-byte accesses); a program of 4 warps moving ~20 KB leaves room for many programs per
    SM, which is what keeps enough bytes in flight for a memory-bound kernel. Checked without a GPU by
    compiling for sm_90 (triton 3.8, ptxas -v): 62 registers, q rows read and written as 16-byte vectors, kv
    rows as 8-byte vectors.
    """
    block_half = triton.next_power_of_2(max(rotary_dim // 2, 1))
    max_heads = max(1, max_pairs_per_tile // block_half)
    q_block = min(triton.next_power_of_2(max(n_q_heads, 1)), max_heads)
    k_block = min(triton.next_power_of_2(max(n_k_heads, 1)), max_heads)
    head_blocks = max(triton.cdiv(n_q_heads, q_block), triton.cdiv(n_k_heads, k_block), 1)
    # Spread both operands over the same number of steps (no step with one side fully masked off).
    q_block = triton.next_power_of_2(max(triton.cdiv(n_q_heads, head_blocks), 1))
    k_block = triton.next_power_of_2(max(triton.cdiv(n_k_heads, head_blocks), 1))
    pairs_per_step = (q_block + k_block) * block_half
    num_warps = min(8, _previous_power_of_2(pairs_per_step // (32 * 16)))
    pairs_per_token = (n_q_heads + n_k_heads) * block_half
    tokens_per_program = min(8, _previous_power_of_2(min_pairs_per_program // max(pairs_per_token, 1)))
    return RopeLaunchSettings(
        block_q_heads=q_block,
        block_k_heads=k_block,
        head_blocks=head_blocks,
        tokens_per_program=tokens_per_program,
        num_warps=num_warps,
        block_half=block_half,
        block_pass=triton.next_power_of_2(max(head_dim - rotary_dim, 1)),
    )


def _angle_strides(t: torch.Tensor) -> tuple[int, int, int]:
    # A batch dim of 1 is broadcast over the batch by a zero stride.
    return (t.stride(0) if t.shape[0] > 1 else 0, t.stride(1), t.stride(2))


# Element offsets at or above this use int64 arithmetic in the kernel.
_INT32_OFFSET_LIMIT = 2**31 - 1


def _storage_elements(t: torch.Tensor) -> int:
    """Elements of t's whole storage: a bound on any offset the kernel forms from t's pointer, found in two
    calls (walking shapes and strides cost more host time per launch than the kernel's GPU time at small
    sizes). Only a view into a storage of 2**31 elements or more, which is rare, pays int64 needlessly."""
    return t.untyped_storage().nbytes() // t.element_size()


def _launch_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
    copy_pass: bool,
    backward: bool,
) -> None:
    """q, k, q_out, k_out: [B, H, S, D] with any strides; cos/sin: [1 or B, S or P, R]; position_ids: [1 or B, S]."""
    batch, n_q_heads, seq_len, head_dim = q.shape
    n_k_heads = k.shape[1]
    rotary_dim = cos.shape[-1]
    half = rotary_dim // 2
    pass_width = head_dim - rotary_dim
    if batch * seq_len == 0 or n_q_heads + n_k_heads == 0:
        return
    settings = rope_launch_settings(n_q_heads, n_k_heads, rotary_dim, head_dim)
    if batch > 65535:
        raise ValueError(f"rope: batch {batch} exceeds the grid limit of 65535")
    if position_ids is None:
        positions, stride_pos_b, stride_pos_s = cos, 0, 0  # unused placeholder pointer
    else:
        positions = position_ids
        stride_pos_b = position_ids.stride(0) if position_ids.shape[0] > 1 else 0
        stride_pos_s = position_ids.stride(1)
    # int32 offsets unless some storage spans 2**31 elements (a table row index times its stride included).
    index_64 = max(map(_storage_elements, (q, k, q_out, k_out, cos, sin))) >= _INT32_OFFSET_LIMIT
    if position_ids is not None:
        index_64 = index_64 or cos.shape[1] * max(cos.stride(1), sin.stride(1)) >= _INT32_OFFSET_LIMIT
    grid = (-(-seq_len // settings.tokens_per_program), batch)
    _rope_kernel[grid](
        q, k, q_out, k_out, cos, sin, positions, seq_len,
        *q.stride(), *k.stride(), *q_out.stride(), *k_out.stride(),
        *_angle_strides(cos), *_angle_strides(sin),
        stride_pos_b, stride_pos_s,
        N_Q_HEADS=n_q_heads,
        N_K_HEADS=n_k_heads,
        HALF=half,
        PASS=pass_width,
        HAS_POSITIONS=position_ids is not None,
        COPY_PASS=copy_pass and pass_width > 0,
        BACKWARD=backward,
        INDEX_64=index_64,
        SOFTWARE_BF16_ROUNDING=interpreted(),
        **settings.launch_arguments(),
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


def _rope_forward_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    q_out = _empty_bhsd(q, _is_tokens_major(q))
    k_out = _empty_bhsd(k, _is_tokens_major(k))
    _launch_rope(q, k, q_out, k_out, cos, sin, position_ids, copy_pass=True, backward=False)
    return q_out, k_out


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
    _launch_rope(grad_q, grad_k, grad_q_in, grad_k_in, cos, sin, position_ids, True, True)
    return grad_q_in, grad_k_in


# ----------------------------------------------------------------------------------------------------------
# Registered ops (functional: used under torch.compile)
# ----------------------------------------------------------------------------------------------------------

# Opaque custom ops, seen by the compiler through their fake implementations. As triton_ops (the kernel traced
# into the graph) Inductor cloned the [B, H, S, D] output buffers around the kernel and kept the forward's for
# the backward's gradients (one allocation of the same shape and strides in each): fwd+bwd took 0.70 ms of
# GPU time (H100, B=8, S=2048, Hq=32, Hkv=8, D=128, benchmarks/kernels/ops.py device_ms, 2026-11-27). As
# custom ops it takes torch.compile's own rotation's GPU time, both including AOTAutograd's copy of the
# transposed incoming gradients (0.24 ms then): the rope rows' device_ms in benchmarks/results/h100-kernels.json,
# section ops (fusetune+compile, compile, and eager fusetune).
_rope_op = torch.library.custom_op("fusetune::rope", mutates_args=())(_rope_forward_impl)
_rope_backward_op = torch.library.custom_op("fusetune::rope_backward", mutates_args=())(_rope_backward_impl)


@_rope_op.register_fake
def _(q, k, cos, sin, position_ids):
    return _empty_bhsd(q, _is_tokens_major(q)), _empty_bhsd(k, _is_tokens_major(k))


@_rope_backward_op.register_fake
def _(grad_q, grad_k, cos, sin, position_ids, q_tokens_major, k_tokens_major):
    return _empty_bhsd(grad_q, q_tokens_major), _empty_bhsd(grad_k, k_tokens_major)


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
# Out-of-place path in eager mode: the same kernels launched directly (no op dispatch on the host)
# ----------------------------------------------------------------------------------------------------------


class _RotaryOutOfPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, position_ids):
        q_out, k_out = _rope_forward_impl(q, k, cos, sin, position_ids)
        ctx.save_for_backward(cos, sin, position_ids)
        ctx.layouts = (_is_tokens_major(q), _is_tokens_major(k))
        return q_out, k_out

    @staticmethod
    def backward(ctx, grad_q_out, grad_k_out):
        cos, sin, position_ids = ctx.saved_tensors
        grad_q, grad_k = _rope_backward_impl(grad_q_out, grad_k_out, cos, sin, position_ids, *ctx.layouts)
        return grad_q, grad_k, None, None, None


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


class _RotaryInPlace(torch.autograd.Function):
    """Rotates q/k in their sources' storage; returns the dirty sources and the [B, H, S, D] views of them.

    The views are outputs of this Function (not views made by the caller afterwards) so that their gradients
    reach the backward with whatever strides they have (read in place by the kernel): a gradient that came
    through the caller's view ops instead would be copied into the source layout first whenever it is not
    laid out as [B, S, H, D] (e.g. from ``repeat_kv``).
    """

    @staticmethod
    def forward(ctx, q_source, k_source, q_shape, k_shape, layouts, cos, sin, position_ids):
        ctx.set_materialize_grads(False)
        q = _bhsd_view(q_source, q_shape, layouts[0])
        k = _bhsd_view(k_source, k_shape, layouts[1])
        _launch_rope(q, k, q, k, cos, sin, position_ids, copy_pass=False, backward=False)
        ctx.mark_dirty(q_source, k_source)
        ctx.save_for_backward(cos, sin, position_ids)
        ctx.geometry = (q_shape, k_shape, layouts, q_source.shape, k_source.shape)
        return q_source, k_source, q, k

    @staticmethod
    def backward(ctx, grad_q_source, grad_k_source, grad_q, grad_k):
        cos, sin, position_ids = ctx.saved_tensors
        q_shape, k_shape, layouts, q_source_shape, k_source_shape = ctx.geometry
        grad_q = _gradient_as_bhsd(grad_q, grad_q_source, q_shape, layouts[0])
        grad_k = _gradient_as_bhsd(grad_k, grad_k_source, k_shape, layouts[1])
        if grad_q is None and grad_k is None:
            return (None,) * 8
        if grad_q is None or grad_k is None:
            # One of the two is unused downstream: rotate zeros for it rather than launch twice (rare).
            like = grad_k if grad_q is None else grad_q
            zeros = like.new_zeros(q_shape if grad_q is None else k_shape)
            grad_q, grad_k = (zeros, grad_k) if grad_q is None else (grad_q, zeros)
        grad_q_in, grad_k_in = _rope_backward_impl(
            grad_q, grad_k, cos, sin, position_ids, layouts[0] == _TOKENS_MAJOR, layouts[1] == _TOKENS_MAJOR
        )
        # Back to the shape of the sources: contiguous in the source layout, so these are views.
        grad_q_source_in = _source_from_bhsd(grad_q_in, layouts[0]).view(q_source_shape)
        grad_k_source_in = _source_from_bhsd(grad_k_in, layouts[1]).view(k_source_shape)
        return grad_q_source_in, grad_k_source_in, None, None, None, None, None, None


def _gradient_as_bhsd(
    grad_view: torch.Tensor | None,
    grad_source: torch.Tensor | None,
    shape: tuple[int, int, int, int],
    layout: str,
) -> torch.Tensor | None:
    """The gradient of one rotated operand as [B, H, S, D]: through the returned view, the source, or both.

    The source receives a gradient only if the caller still uses it (or an old view of it) after the call.
    """
    if grad_source is None:
        return grad_view
    from_source = _bhsd_view(grad_source, shape, layout)
    return from_source if grad_view is None else grad_view + from_source


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
        if q_source is not None and k_source is not None and not storage_overlaps(q_bhsd, k_bhsd):
            (q_src, q_layout), (k_src, k_layout) = q_source, k_source
            _, _, q_embed, k_embed = _RotaryInPlace.apply(
                q_src,
                k_src,
                tuple(q_bhsd.shape),
                tuple(k_bhsd.shape),
                (q_layout, k_layout),
                cos,
                sin,
                position_ids,
            )
    if q_embed is None:
        if torch.compiler.is_compiling():
            q_embed, k_embed = torch.ops.fusetune.rope(q_bhsd, k_bhsd, cos, sin, position_ids)
        else:
            q_embed, k_embed = _RotaryOutOfPlace.apply(q_bhsd, k_bhsd, cos, sin, position_ids)
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
