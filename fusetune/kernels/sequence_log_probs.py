"""Per-sequence log-probabilities of labelled tokens without holding the [T, V] logits.

    log p(row b) = sum_t  log softmax(h[b, t] @ W^T (+ bias))[labels[b, t]]     over t with labels != ignore

which is minus the sum of the per-token cross-entropies, so it is built on the fused linear cross-entropy with
``reduction="none"``: its forward never holds more than one [C, V] chunk of logits, and its backward recomputes
each chunk with the per-token upstream gradient folded in. The backward of the row sum hands every valid token
of row b the upstream gradient of row b, negated:

    d loss / d h[b, t] = -g[b] * (softmax(z[b, t]) - onehot(labels[b, t])) @ W        (0 at ignored tokens)
    d loss / d W       = sum_{b, t} -g[b] * (softmax(z[b, t]) - onehot(labels[b, t]))^T h[b, t]

Preference losses (DPO, IPO) need exactly this: one number per chosen or rejected sequence, with the gradient
of the sequence's loss flowing back into every one of its tokens. A row whose tokens are all ignored has log
probability 0 and no gradient. Policy-gradient losses (GRPO) need the terms before the sum, one per token:
`token_log_probs`, whose backward takes any per-token upstream gradient (g[b, t] in place of g[b] above).

`sequence_log_probs_from_logits` is the same quantity from logits a model has already built (the path of models
whose output layer is not fused); `sequence_log_probs_reference` is the float64 reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusetune.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy

__all__ = [
    "sequence_log_probs",
    "sequence_log_probs_from_logits",
    "sequence_log_probs_reference",
    "token_log_probs",
    "token_log_probs_from_logits",
]


# The signature is token_log_probs' (and fused_linear_cross_entropy's first arguments) on purpose: callers swap them.
def sequence_log_probs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    softcap: float | None = None,
    logits_chunk_bytes: int | None = None,
) -> Tensor:
    """Sum over each row of ``labels [B, T]`` of log p(label), from ``hidden [B, T, H]`` and the output layer
    ``weight [V, H]`` (+ ``bias``): a float32 tensor [B]. Ignored tokens (``ignore_index``) count 0."""
    return token_log_probs(
        hidden,
        weight,
        labels,
        bias,
        ignore_index=ignore_index,
        softcap=softcap,
        logits_chunk_bytes=logits_chunk_bytes,
    ).sum(dim=-1)


def token_log_probs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    softcap: float | None = None,
    logits_chunk_bytes: int | None = None,
) -> Tensor:
    """log p(label) of every token of ``labels [B, T]``, float32 [B, T] (0 at ignored tokens), from ``hidden
    [B, T, H]`` and ``weight [V, H]``, one [C, V] chunk of logits at a time."""
    if labels.dim() != 2 or hidden.shape[:2] != labels.shape:
        raise ValueError(
            f"hidden [B, T, H] and labels [B, T] must agree (got {tuple(hidden.shape)} and {tuple(labels.shape)})"
        )
    per_token_loss = fused_linear_cross_entropy(
        hidden,
        weight,
        labels,
        bias,
        ignore_index=ignore_index,
        reduction="none",
        softcap=softcap,
        logits_chunk_bytes=logits_chunk_bytes,
    )
    return -per_token_loss.view(labels.shape)


def token_log_probs_from_logits(logits: Tensor, labels: Tensor, *, ignore_index: int = -100) -> Tensor:
    """The same from logits [B, T, V] (pure PyTorch, in float32 or the logits' wider dtype; 0 at ignored
    tokens)."""
    valid = labels != ignore_index
    log_probs = torch.log_softmax(logits if logits.dtype.itemsize >= 4 else logits.float(), dim=-1)
    return log_probs.gather(-1, labels.masked_fill(~valid, 0).unsqueeze(-1)).squeeze(-1) * valid


def sequence_log_probs_from_logits(logits: Tensor, labels: Tensor, *, ignore_index: int = -100) -> Tensor:
    """The same from logits [B, T, V] (pure PyTorch, float32): for models whose output layer is not fused."""
    valid = labels != ignore_index
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    picked = log_probs.gather(-1, labels.masked_fill(~valid, 0).unsqueeze(-1)).squeeze(-1)
    return (picked * valid).sum(dim=-1)


def sequence_log_probs_reference(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    softcap: float | None = None,
) -> Tensor:
    """Float64 reference of :func:`sequence_log_probs` (returns float64)."""
    logits = hidden.double() @ weight.double().T
    if bias is not None:
        logits = logits + bias.double()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    valid = labels != ignore_index
    log_probs = torch.log_softmax(logits, dim=-1)
    picked = log_probs.gather(-1, labels.masked_fill(~valid, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, picked, torch.zeros_like(picked)).sum(dim=-1)
