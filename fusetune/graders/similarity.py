"""The metrics of text_similarity graders, each from a well-kept library, each a score from 0 to 1.

- fuzzy_match: rapidfuzz's `fuzz.ratio` (the normalised Indel similarity of the two strings).
- bleu: sacrebleu's `sentence_bleu` (its default 13a tokenizer and exponential smoothing), divided by 100.
- gleu: nltk's `sentence_gleu` (Google-BLEU, n-grams 1 to 4).
- meteor: nltk's `single_meteor_score` with exact and Porter-stem matching only. METEOR's synonym stage reads
  WordNet, which nltk downloads from outside PyPI at run time; a server may not reach it, so that stage is
  left out everywhere (a synonym counts as a miss), and the score is the same on every server.
- rouge_1 .. rouge_5, rouge_l: the F-measure of Google's `rouge-score` (its tokenizer: lower case, letters and
  digits only; no stemming).
- cosine compares embeddings and needs an embedding model, which fusetune does not have: it is refused when a
  grader is checked (fusetune/graders/grading.py).

gleu and meteor compare word tokens: words and single punctuation marks, case kept (meteor lowers them).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import cache

# The libraries are imported when a metric is first used, not with this module: nltk alone takes over a second
# to import, and the API imports this module at start whether or not anyone grades text similarity.

_WORD = re.compile(r"\w+|[^\w\s]")


def _words(text: str) -> list[str]:
    return _WORD.findall(text)


class _NoSynonyms:
    """Stands where nltk's METEOR reads WordNet: no word has a synonym (see the module's docstring)."""

    @staticmethod
    def synsets(_word: str) -> list:
        return []


def _fuzzy_match(output: str, reference: str) -> float:
    from rapidfuzz import fuzz

    return fuzz.ratio(output, reference) / 100


@cache
def _bleu():
    from sacrebleu.metrics import BLEU

    # effective_order: a short sentence without 4-grams is scored on the orders it has, as sentence BLEU should.
    return BLEU(effective_order=True)


def _gleu(output: str, reference: str) -> float:
    from nltk.translate.gleu_score import sentence_gleu

    return sentence_gleu([_words(reference)], _words(output))


def _meteor(output: str, reference: str) -> float:
    from nltk.translate.meteor_score import single_meteor_score

    return single_meteor_score(_words(reference), _words(output), wordnet=_NoSynonyms())


@cache
def _rouge(rouge_type: str):
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer([rouge_type])


def _rouge_metric(rouge_type: str) -> Callable[[str, str], float]:
    return lambda output, reference: _rouge(rouge_type).score(reference, output)[rouge_type].fmeasure


METRICS: dict[str, Callable[[str, str], float]] = {
    "fuzzy_match": _fuzzy_match,
    "bleu": lambda output, reference: _bleu().sentence_score(output, [reference]).score / 100,
    "gleu": _gleu,
    "meteor": _meteor,
    **{f"rouge_{n}": _rouge_metric(f"rouge{n}") for n in range(1, 6)},
    "rouge_l": _rouge_metric("rougeL"),
}


def similarity(metric: str, output: str, reference: str) -> float:
    """How close `output` is to `reference` by `metric`, from 0 to 1 (clipped: float sums may pass 1)."""
    return min(1.0, max(0.0, float(METRICS[metric](output, reference))))
