"""One decoding step of grouped-query attention over a KV cache, reading only the cache slots the mask keeps.

Sampling runs one query token per row through every layer over a KV cache. Over a static cache (what a
compiled or CUDA-graphed decoding step needs) the cache has its final length from the first token on, and
the mask marks which slots are filled and which are left padding. scaled_dot_product_attention reads every
slot and masks afterwards: in a GRPO step of 512 completions of 512 tokens, the cache's average filled share
is about half, so half of the bytes read are thrown away. On one H100 at the Llama-3.2-1B shape, 512 rows
over a 528-slot cache, cuDNN's attention took 0.66 ms a layer call inside the compiled step and 5.4 of the
7.5 s of GPU time of a step's sampling (issue 38's note, 2026-11-27).

The kernel here skips a block of cache slots whose mask entries are all False without reading its keys and
values, so its cost follows the filled length, not the cache's. One program owns one (row, KV head): the
query heads that share the KV head are the rows of its query tile (grouped-query attention without widening
the cache), padded to the 16 rows a tensor-core dot needs, and it walks the cache in blocks with an online
softmax in base 2, float32 accumulators, and the probabilities rounded to the value dtype for the second dot
as flash attention does. Decoding is bound by reading the cache, which this does once.

query [batch, heads, 1, dim], key and value [batch, kv_heads, length, dim] (any strides), mask [batch, 1, 1,
>= length] boolean (True: attend) or None (every slot); returns [batch, 1, heads, dim], the layout
transformers' attention functions return. Query head h reads KV head h // (heads / kv_heads), as
transformers' `repeat_kv` pairs them. A row whose mask keeps no slot gets zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusetune.kernels._interpreter import interpreted, launchable, round_to_dtype

__all__ = ["grouped_decode_attention", "grouped_decode_attention_reference", "grouped_decode_kernel_applies"]

_LOG2E = 1.4426950408889634
# A tensor-core dot takes operands of at least 16 along each dimension: the query heads of a KV head are padded
# up to this many rows, and a smaller head dim up to this many (zero) columns.
_MIN_DOT_SIZE = 16


@triton.jit
def _grouped_decode_kernel(
    Q, K, V, MASK, OUT,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mn,
    length, qk_scale,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, SOFTWARE_BF16_ROUNDING: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    n_kv_heads = tl.num_programs(1)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    g_valid = offs_g < GROUP
    d_valid = offs_d < HEAD_DIM
    q = tl.load(
        Q + row * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=g_valid[:, None] & d_valid[None, :], other=0.0,
    )  # fmt: skip
    # The interpreter's dot mishandles bfloat16 operands; their float32 values multiply alike.
    if SOFTWARE_BF16_ROUNDING:
        q = q.to(tl.float32)
    k_base = K + row * stride_kb + kv_head * stride_kh
    v_base = V + row * stride_vb + kv_head * stride_vh
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    for start in range(0, length, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        keep = offs_n < length
        if HAS_MASK:
            keep = keep & (tl.load(MASK + row * stride_mb + offs_n * stride_mn, mask=keep, other=0) != 0)
        # A block with no kept slot (not yet written, or all left padding) is skipped unread.
        if tl.max(keep.to(tl.int32), axis=0) > 0:
            kv_mask = keep[:, None] & d_valid[None, :]
            k = tl.load(
                k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0
            )
            if SOFTWARE_BF16_ROUNDING:
                k = k.to(tl.float32)
            # float32 whatever type the compiler gives the scale (Inductor passed it as a float64).
            scores = (tl.dot(q, tl.trans(k)) * qk_scale).to(tl.float32)
            scores = tl.where(keep[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(
                v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0
            )
            p = round_to_dtype(p, v.dtype, SOFTWARE_BF16_ROUNDING)
            if SOFTWARE_BF16_ROUNDING:
                p, v = p.to(tl.float32), v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v)
            m_i = m_new
    out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    # OUT is [batch, 1, heads, dim], contiguous.
    out_ptrs = OUT + (row * n_kv_heads * GROUP + heads[:, None]) * HEAD_DIM + offs_d[None, :]
    tl.store(
        out_ptrs,
        round_to_dtype(out, OUT.dtype.element_ty, SOFTWARE_BF16_ROUNDING),
        mask=g_valid[:, None] & d_valid[None, :],
    )


def grouped_decode_kernel_applies(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None
) -> bool:
    """Whether the kernel takes these inputs: one query token per row, key and value of one shape whose heads
    divide the query's, a float16 or bfloat16 dtype shared by all three, a head dim up to 256, and a
    boolean mask [batch or 1, 1, 1, >= length] or none. Additive masks are left to
    scaled_dot_product_attention (which slots they keep is a matter of magnitude, not of a flag)."""
    if query.dim() != 4 or key.dim() != 4 or query.shape[2] != 1 or key.shape != value.shape:
        return False
    batch, heads, _, dim = query.shape
    if key.shape[0] != batch or key.shape[3] != dim or heads % key.shape[1] or dim > 256:
        return False
    if query.dtype not in (torch.float16, torch.bfloat16) or not (key.dtype == value.dtype == query.dtype):
        return False
    if mask is None:
        return True
    return (
        mask.dtype == torch.bool
        and mask.dim() == 4
        and mask.shape[0] in (1, batch)
        and mask.shape[1] == mask.shape[2] == 1
        and mask.shape[3] >= key.shape[2]
    )


def _launch(query, key, value, mask, scale: float, traced: bool = False) -> torch.Tensor:
    batch, heads, _, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    group = heads // kv_heads
    out = query.new_empty(batch, 1, heads, dim)
    if batch == 0:
        return out
    if mask is not None:
        mask_row_stride = mask.stride(0) if mask.shape[0] > 1 else 0
        mask_arg, mask_col_stride = mask, mask.stride(3)
    else:
        mask_arg, mask_row_stride, mask_col_stride = query, 0, 0  # unused by the kernel
    block_d = max(_MIN_DOT_SIZE, triton.next_power_of_2(dim))  # head dims under 16 padded with zeros
    kernel = launchable(_grouped_decode_kernel, traced)
    kernel[(batch, kv_heads)](
        query, key, value, mask_arg, out,
        query.stride(0), query.stride(1), query.stride(3),
        key.stride(0), key.stride(1), key.stride(2), key.stride(3),
        value.stride(0), value.stride(1), value.stride(2), value.stride(3),
        mask_row_stride, mask_col_stride,
        length, scale * _LOG2E,
        GROUP=group, GROUP_PAD=max(_MIN_DOT_SIZE, triton.next_power_of_2(group)), HEAD_DIM=dim,
        BLOCK_D=block_d, BLOCK_N=64 if block_d <= 128 else 32, HAS_MASK=mask is not None,
        SOFTWARE_BF16_ROUNDING=interpreted(), num_warps=4,
    )  # fmt: skip
    return out


# torch.compile (Hugging Face's compiled decoding step) traces through this op; eager calls launch directly.
@torch.library.triton_op("fusetune::grouped_decode_attention", mutates_args=())
def _grouped_decode_op(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    return _launch(query, key, value, mask, scale, traced=True)


def grouped_decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of one query token per row over the cache (see the module docstring); no gradient."""
    if not grouped_decode_kernel_applies(query, key, value, mask):
        raise ValueError(
            f"grouped_decode_attention: unsupported inputs query {tuple(query.shape)} {query.dtype}, key "
            f"{tuple(key.shape)}, mask {None if mask is None else (tuple(mask.shape), mask.dtype)}"
        )
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    if torch.compiler.is_compiling():
        return torch.ops.fusetune.grouped_decode_attention(query, key, value, mask, scale)
    return _launch(query, key, value, mask, scale)


# Mirrors grouped_decode_attention argument for argument on purpose: tests call both with the same inputs.
def grouped_decode_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None = None,
) -> torch.Tensor:
    """The same in float32 PyTorch with the cache widened to every query head: [batch, 1, heads, dim]."""
    batch, heads, _, dim = query.shape
    repeat = heads // key.shape[1]
    k, v = (t.float().repeat_interleave(repeat, dim=1) for t in (key, value))
    scores = (query.float() @ k.transpose(-1, -2)) * (dim**-0.5 if scale is None else scale)
    if mask is not None:
        scores = scores.masked_fill(~mask[..., : key.shape[2]], float("-inf"))
    probs = torch.nan_to_num(scores.softmax(-1), nan=0.0)  # a row with no kept slot: zeros
    return (probs @ v).to(query.dtype).transpose(1, 2)
