"""Attention over packed and padded rows that computes only what each sequence attends to.

A packed training row holds several examples; Hugging Face's "sdpa" attention keeps them apart with a
[batch, 1, seq, seq] block-diagonal mask, and scaled_dot_product_attention with an explicit mask computes
every query-key tile of the row (the masked ones too) and keeps the mask for the backward. On one H100 at the
Llama-3.2-1B shape, 8 rows of 2048 tokens packed with ~620-token examples, that attention was a large part of
a job's step (benchmarks/step/trainer_step.py, GPU time by kernel category); the step with the implementation
below is in benchmarks/results/h100-step.json, section trainer-step, and against Liger-Kernel on sdpa in
section e2e-packed.

The "fusetune_varlen" implementation, registered with transformers' AttentionInterface, runs the
variable-length flash-attention kernels that ship with PyTorch (`aten::_flash_attention_forward` over
cumulative sequence lengths) instead: each example attends causally within itself, nothing across examples
is computed, and no mask is built or kept. It takes the sequence boundaries from the keywords that
transformers' flash-attention path already defines (`cu_seq_lens_q`, `cu_seq_lens_k`, `max_length_q`,
`max_length_k`, as `DataCollatorWithFlattening` produces them); `packed_sequence_kwargs` computes them from
a batch's position ids on the host. A call without them, on a CPU, in float32, with dropout, soft-capping or
a sliding window runs transformers' own sdpa attention with the usual mask, so switching a model to this
implementation never changes what it computes.
"""

from __future__ import annotations

from typing import Any

import torch

from fusetune.kernels._interpreter import interpreted
from fusetune.kernels.decode_attention import grouped_decode_attention, grouped_decode_kernel_applies

VARLEN_ATTENTION = "fusetune_varlen"

_registered = False


def register_varlen_attention() -> None:
    """Make "fusetune_varlen" a valid `attn_implementation` (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
    # The mask the sdpa fallback needs; the varlen kernel ignores it.
    AttentionMaskInterface.register(VARLEN_ATTENTION, sdpa_mask)
    _registered = True


def switch_to_varlen_attention(model: torch.nn.Module) -> str | None:
    """Switch a model that uses sdpa attention to "fusetune_varlen"; returns the implementation it had (to
    switch back to), or None when it was left as it is (another implementation was chosen, or the model does
    not take its attention from transformers' AttentionInterface)."""
    config = getattr(model, "config", None)
    previous = getattr(config, "_attn_implementation", None)
    if previous != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return None
    register_varlen_attention()
    try:
        model.set_attn_implementation(VARLEN_ATTENTION)
    except (ValueError, ImportError):
        return None
    return previous if config._attn_implementation == VARLEN_ATTENTION else None


def packed_sequence_kwargs(position_ids: torch.Tensor) -> dict[str, Any]:
    """The variable-length attention keywords of a [batch, seq] position-id tensor on the host: a sequence
    starts wherever the position does not follow the previous one (a new example of a packed row, the padding
    after it, the next row). Every token belongs to exactly one sequence, so the kernel's output keeps the
    batch's layout; padding attends only to padding."""
    flat = position_ids.reshape(-1).to(torch.int64)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1] + 1
    row_length = position_ids.shape[-1]
    starts[::row_length] = True  # a row never continues the one before it
    boundaries = torch.cat([starts.nonzero().flatten(), torch.tensor([flat.numel()])])
    cu_seq_lens = boundaries.to(torch.int32)
    max_length = int((boundaries[1:] - boundaries[:-1]).max()) if flat.numel() else 0
    return {
        "cu_seq_lens_q": cu_seq_lens,
        "cu_seq_lens_k": cu_seq_lens,
        "max_length_q": max_length,
        "max_length_k": max_length,
    }


class _VarlenFlashAttention(torch.autograd.Function):
    """Causal flash attention over [tokens, heads, head_dim] with sequences given by cumulative lengths; key
    and value may have fewer heads (grouped-query attention)."""

    @staticmethod
    def forward(ctx, query, key, value, cu_seq_lens, max_length, scale):
        output, logsumexp, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            query, key, value, cu_seq_lens, cu_seq_lens, max_length, max_length, 0.0, True, False, scale=scale
        )
        ctx.save_for_backward(query, key, value, output, logsumexp, cu_seq_lens, rng_state, unused)
        ctx.max_length, ctx.scale = max_length, scale
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, output, logsumexp, cu_seq_lens, rng_state, unused = ctx.saved_tensors
        grad_query, grad_key, grad_value = torch.ops.aten._flash_attention_backward(
            grad_output.contiguous(), query, key, value, output, logsumexp, cu_seq_lens, cu_seq_lens,
            ctx.max_length, ctx.max_length, 0.0, True, rng_state, unused, scale=ctx.scale,
        )  # fmt: skip
        return grad_query, grad_key, grad_value, None, None, None


def varlen_kernel_applies(query: torch.Tensor, key: torch.Tensor, dropout: float, kwargs: dict) -> bool:
    """Whether this call can run the variable-length kernel (anything else runs sdpa with its mask)."""
    return (
        kwargs.get("cu_seq_lens_q") is not None
        and kwargs.get("max_length_q") is not None
        and query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and key.dtype == query.dtype
        and query.shape[-1] % 8 == 0
        and query.shape[-1] <= 256
        and query.shape[1] % key.shape[1] == 0
        and query.shape[2] == key.shape[2]  # no KV cache: queries and keys are the same tokens
        and not dropout
        and kwargs.get("softcap") is None
        and kwargs.get("sliding_window") is None
        and kwargs.get("s_aux") is None
        and kwargs.get("position_bias") is None
    )


# Whether rows that are each one whole sequence run torch's scaled_dot_product_attention instead of the
# variable-length kernel (see varlen_attention_forward).
WHOLE_ROWS_TO_SDPA = True
# Whether a decoding step runs fusetune's kernel where it applies (see grouped_query_decode); benchmarks turn it
# off to measure scaled_dot_product_attention in its place.
DECODE_KERNEL = True


def _one_sequence_per_row(kwargs: dict, batch: int, seq: int) -> bool:
    """Whether the boundaries (on the host) make each row one sequence of its full length: as many sequences as
    rows, none shorter than a row."""
    boundaries = kwargs["cu_seq_lens_q"]
    return int(boundaries.numel()) - 1 == batch and int(kwargs["max_length_q"]) == seq


def grouped_decode_applies(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, dropout: float,
                           attention_mask: torch.Tensor | None, kwargs: dict) -> bool:  # fmt: skip
    """Whether this call is one decoding step of grouped-query attention over a KV cache, which
    `grouped_query_decode` runs without widening the cache to every query head."""
    return (
        query.shape[2] == 1
        and key.shape[2] > 1
        and key.shape[1] < query.shape[1]
        and query.shape[1] % key.shape[1] == 0
        and not dropout
        and (attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1] == 1))
        and kwargs.get("softcap") is None
        and kwargs.get("s_aux") is None
        and kwargs.get("position_bias") is None
        and not getattr(module, "training", False)
    )


def grouped_query_decode(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
) -> tuple[torch.Tensor, None]:
    """One decoding step of grouped-query attention: the query heads that share a KV head become that head's
    query rows, so the cache is read as it is. transformers' sdpa path widens K and V to every query head
    first whenever a mask is passed (always, over a static cache): a copy of the whole cache per layer and
    step. H100, Llama-3.2-1B shape, 512 rows over a static cache of 152, compiled decoding
    (benchmarks/step/generation.py --profile, 2026-11-27): that copy took 4.3 ms of a 15.4 ms step's GPU time
    and the attention over the widened cache 5.0.

    On a GPU (or under the Triton interpreter), in float16/bfloat16 with a boolean mask or none, without a
    gradient, fusetune.kernels.decode_attention runs it, reading only the slots the mask keeps (a static
    cache's written slots); anything else runs scaled_dot_product_attention over the grouped rows.

    query [batch, heads, 1, dim], key and value [batch, kv_heads, length, dim], the mask [batch, 1, 1, >=length]
    (boolean or additive) or None; returns ([batch, 1, heads, dim], None) as transformers' attention functions.
    Query head h reads KV head h // (heads / kv_heads), as transformers' `repeat_kv` pairs them."""
    if (
        DECODE_KERNEL
        and (query.is_cuda or interpreted())
        and not (torch.is_grad_enabled() and query.requires_grad)
        and grouped_decode_kernel_applies(query, key, value, attention_mask)
    ):
        return grouped_decode_attention(query, key, value, attention_mask, scaling), None
    batch, heads, _, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    mask = attention_mask[:, :, :, :length] if attention_mask is not None else None
    output = torch.nn.functional.scaled_dot_product_attention(
        grouped, key, value, attn_mask=mask, scale=scaling
    )
    return output.reshape(batch, heads, 1, dim).transpose(1, 2), None


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [batch, heads, seq, dim], key and value [batch,
    kv_heads, seq, dim]; returns ([batch, seq, heads, dim], None)."""
    if grouped_decode_applies(module, query, key, dropout, attention_mask, kwargs):
        return grouped_query_decode(query, key, value, attention_mask, scaling)
    if not (varlen_kernel_applies(query, key, dropout, kwargs) and getattr(module, "is_causal", True)):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
            **kwargs,
        )  # fmt: skip
    batch, heads, seq, dim = query.shape
    scale = scaling if scaling is not None else dim**-0.5
    if WHOLE_ROWS_TO_SDPA and query.is_cuda and _one_sequence_per_row(kwargs, batch, seq):
        # Unpacked rows without padding: torch's own causal attention, whose back end on Hopper outruns the
        # variable-length flash kernel (benchmarks/results/h100-kernels.json, section attention).
        output = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scale, enable_gqa=key.shape[1] != heads
        )
        return output.transpose(1, 2), None
    cu_seq_lens = kwargs["cu_seq_lens_q"].to(device=query.device, dtype=torch.int32)
    if int(cu_seq_lens.numel()) < 2:
        raise ValueError("cu_seq_lens_q must hold at least two boundaries")
    # [batch, heads, seq, dim] -> [tokens, heads, dim]: free when the projection wrote [batch, seq, heads, dim].
    packed = [t.transpose(1, 2).reshape(batch * seq, t.shape[1], dim) for t in (query, key, value)]
    output = _VarlenFlashAttention.apply(*packed, cu_seq_lens, int(kwargs["max_length_q"]), scale)
    return output.view(batch, seq, heads, dim), None
