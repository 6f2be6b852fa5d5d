"""fusetune/serving/sampling.py: the batched draw samples each row's distribution (temperature, top_p cut), its
seeded draws do not depend on the rest of the batch, and greedy rows are argmax."""

from __future__ import annotations

import math

import pytest
import torch

from fusetune.serving.sampling import sample_rows, uniforms

LOGITS = [2.0, 1.0, 0.5, 0.0, -1.0, -3.0]
DRAWS = 40_000
# A correct sampler's count of a token is Binomial(DRAWS, p). Bernstein's inequality: P(|count - DRAWS p| >= t) <=
# 2 exp(-t^2 / (2 (v + t / 3))) with v = DRAWS p (1 - p), which is at most FAILURE for t = sqrt(2 v L) + 2 L / 3,
# L = ln(2 / FAILURE). Six tokens a case, three cases: a correct sampler fails with probability below 2e-5.
FAILURE = 1e-6


def _expected(logits: list[float], temperature: float, top_p: float) -> list[float]:
    """The distribution by hand: softmax at the temperature, the smallest most probable set reaching top_p."""
    weights = [math.exp(x / temperature) for x in logits]
    probs = [w / sum(weights) for w in weights]
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = [], 0.0
    for i in order:
        if mass >= top_p:
            break
        kept.append(i)
        mass += probs[i]
    return [probs[i] / mass if i in kept else 0.0 for i in range(len(probs))]


def _within_bounds(counts: list[int], probs: list[float]) -> bool:
    bound = math.log(2 / FAILURE)
    for count, p in zip(counts, probs, strict=True):
        if p == 0:
            if count:  # a token the cut leaves out is never drawn
                return False
            continue
        v = DRAWS * p * (1 - p)
        if abs(count - DRAWS * p) > math.sqrt(2 * v * bound) + 2 * bound / 3:
            return False
    return True


def _counts(temperature: float, top_p: float) -> list[int]:
    # 1,000 completions' seeds x their first 40 tokens' indices.
    seeds = torch.arange(DRAWS) // 40 * 7919 + 11
    counters = torch.arange(DRAWS) % 40
    tokens = sample_rows(
        torch.tensor([LOGITS]).expand(DRAWS, -1),
        torch.full((DRAWS,), temperature),
        torch.full((DRAWS,), top_p),
        uniforms(seeds, counters),
    )
    return torch.bincount(tokens, minlength=len(LOGITS)).tolist()


@pytest.mark.parametrize("temperature, top_p", [(0.5, 0.9), (1.3, 1.0), (1.0, 0.95)])
def test_the_draws_follow_the_cut_distribution_at_the_temperature(temperature, top_p):
    expected = _expected(LOGITS, temperature, top_p)
    assert _within_bounds(_counts(temperature, top_p), expected)
    # The check tells a wrong sampler: one that ignores the temperature, or the cut, fails it.
    if temperature != 1:
        assert not _within_bounds(_counts(1.0, top_p), expected)
    if top_p < 1:
        assert not _within_bounds(_counts(temperature, 1.0), expected)


def test_a_seeded_row_draws_the_same_token_whatever_the_rest_of_the_batch():
    generator = torch.Generator().manual_seed(0)
    rows, vocab = 64, 50
    logits = torch.randn(rows, vocab, generator=generator) * 2
    temperature = torch.rand(rows, generator=generator) + 0.5
    top_p = torch.where(torch.arange(rows) % 2 == 0, torch.ones(rows), torch.rand(rows, generator=generator))
    seeds = torch.randint(0, 1 << 62, (rows,), generator=generator)
    counters = torch.randint(0, 256, (rows,), generator=generator)
    together = sample_rows(logits, temperature, top_p, uniforms(seeds, counters))
    alone = [
        sample_rows(
            logits[i : i + 1],
            temperature[i : i + 1],
            top_p[i : i + 1],
            uniforms(seeds[i : i + 1], counters[i : i + 1]),
            cut=bool(top_p[i] < 1),
        )[0]
        for i in range(rows)
    ]
    assert together.tolist() == [int(t) for t in alone]
    # In another order, beside other rows (the batch reversed): the same tokens.
    assert (
        sample_rows(logits.flip(0), temperature.flip(0), top_p.flip(0), uniforms(seeds, counters).flip(0))
        .flip(0)
        .tolist()
        == together.tolist()
    )
    # The draws are not one token repeated: the key moves them.
    assert len(set(together.tolist())) > 10


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 30, generator=generator)
    temperature = torch.tensor([0.0, 1.0] * 4)
    tokens = sample_rows(
        logits,
        temperature,
        torch.full((8,), 0.5),
        uniforms(torch.arange(8), torch.zeros(8, dtype=torch.long)),
    )
    assert tokens[0::2].tolist() == logits[0::2].argmax(-1).tolist()


def test_uniforms_lie_in_the_unit_interval_and_spread_over_it():
    values = uniforms(torch.arange(100_000) * 3 + (1 << 40), torch.arange(100_000) % 7)
    assert values.dtype == torch.float64
    assert 0 <= values.min() and values.max() < 1
    # Ten equal bins of 100,000 uniforms: each Binomial(1e5, 0.1), sd ~95; 7 sd either side.
    counts = torch.histc(values, bins=10, min=0, max=1)
    assert (counts - 10_000).abs().max() < 7 * math.sqrt(100_000 * 0.1 * 0.9)
