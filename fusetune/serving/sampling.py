"""The next token of every row of a decoding step, drawn at once on the logits' device.

Each row has its own temperature, top_p, seed and counter (the index of the token it draws in its completion), as
tensors. Temperature 0 is greedy (argmax). Otherwise the row's distribution is softmax(logits / temperature), cut
to the smallest set of tokens whose probability reaches top_p (when top_p < 1), and one token is drawn from it by
inverting its cumulative distribution in vocabulary order with one uniform number u per row:

    token = the first i with  cum_i > u * cum_last,   cum_i = p_0 + ... + p_i  (float64)

Why that is exact sampling: for u uniform on [0, 1), u * cum_last falls in [cum_{i-1}, cum_i) with probability
(cum_i - cum_{i-1}) / cum_last = p_i / (the kept mass): token i's probability in the renormalised cut distribution.
A token left out by the cut has p_i = 0, an empty interval, and is never drawn. The only departures are float64's
rounding of the sums (relative 2^-53 per term) and u's grid of 2^-53.

u is a counter-based draw: a hash of (the completion's seed, its token's index), in integer operations on
tensors (the engine computes a completion's uniforms for all its token indices at once when it takes a slot, so a
step only gathers each row's). It depends on nothing else: not on the other rows of the batch, the row the completion has,
or whether another row's top_p needed a sort (the cut is applied in vocabulary order, by a threshold on the
probabilities, so a row's draw never depends on a sort's order). So a seeded request gives the same completions
whatever else is decoding, streamed or not, as long as its logits are the same (the engine's step runs every slot
at one shape). Against a torch.Generator per row, one draw per row in one go instead of a few kernel launches per
row, and inverse-CDF sampling needs one uniform per row where a Gumbel-max draw needs one per vocabulary entry.

The cut: a token is kept when the probability mass of the tokens sorted before it is below top_p (the first always),
and then every token at least as probable as the least probable kept one: the same set as a cut in sorted order,
except that tokens tied with the last kept one are all kept (a sort's order among equal probabilities is arbitrary).
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """x * constant mod 2^32 for x in [0, 2^32), in int64 without overflow: the constant in two 16-bit halves."""
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijection of 32-bit integers whose every output bit depends on every input bit (lowbias32's constants)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One float64 in [0, 1) per row, on a grid of 2^-53, from the row's (seed, counter) (int64, non-negative; the
    seed's 64 bits and the counter's low 32 are used)."""
    seeds, counters = seeds.long(), counters.long()
    key = _mix32(_mix32(_mix32((seeds >> 32) & _MASK32) ^ (seeds & _MASK32)) ^ (counters & _MASK32))
    high = _mix32(key ^ 0x68E31DA4)  # 32 bits
    low = _mix32(key ^ 0xB5297A4D) >> 11  # 21 bits
    return (high * (1 << 21) + low).double() * 2.0**-53


def sample_rows(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor, cut: bool = True
) -> torch.Tensor:
    """Each row's token ([rows], long) from its logits ([rows, vocab]): argmax where its temperature is 0, else the
    draw the module docstring describes with the row's uniform `u` (float64, from `uniforms`). `cut`: False when no
    row has top_p < 1 (what skips the sort)."""
    greedy = logits.argmax(-1)
    sampled = temperature > 0
    # Greedy rows divide by 1 rather than 0 (their draw is discarded); float32, as a model's softmax would be.
    scale = torch.where(sampled, temperature, torch.ones_like(temperature)).float()
    probs = torch.softmax(logits.float() / scale[:, None], dim=-1)
    if cut:
        ordered = probs.sort(dim=-1, descending=True).values
        keep = (ordered.cumsum(-1) - ordered) < top_p[:, None]
        kept = keep.sum(-1).clamp(min=1)
        threshold = ordered.gather(1, (kept - 1)[:, None])
        # top_p 1 keeps every token (its float32 sums could reach 1 before the last token's mass is counted).
        threshold = torch.where(top_p[:, None] < 1, threshold, torch.zeros_like(threshold))
        probs = torch.where(probs >= threshold, probs, torch.zeros_like(probs))
    cum = probs.double().cumsum(-1)
    total = cum[:, -1:]
    target = u[:, None] * total
    # Strictly below the total, whatever the product's rounding: the token found then has a mass above 0.
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    drawn = torch.searchsorted(cum, target, right=True)[:, 0]
    return torch.where(sampled, drawn, greedy)
