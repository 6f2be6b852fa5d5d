"""text_similarity: each metric on small cases worked out by hand, so a metric wired to the wrong library call
(precision for F-measure, characters for words, rouge_1 for rouge_l) fails."""

from __future__ import annotations

import pytest

from fusetune.config import Settings
from fusetune.graders import check_grader, grade
from fusetune.graders.similarity import METRICS, similarity
from fusetune.spec.graders import EVALUATION_METRICS, parse_grader
from fusetune.spec.hyperparameters import SpecError


def test_every_metric_but_cosine_is_implemented():
    assert set(METRICS) == set(EVALUATION_METRICS) - {"cosine"}


@pytest.mark.parametrize("metric", sorted(METRICS))
def test_identical_text_scores_one_and_text_with_no_word_in_common_less(metric):
    text = "the quick brown fox jumps over the lazy dog"
    assert similarity(metric, text, text) == pytest.approx(1.0, abs=0.01)  # meteor's fragmentation penalty
    unrelated = similarity(metric, "violet umbrellas", text)
    # fuzzy_match compares characters, which unrelated words share; the word metrics find nothing in common
    assert unrelated < 0.35 if metric == "fuzzy_match" else unrelated == 0.0


def test_rouge_by_hand():
    # one shared unigram of 3 each side out of 3: P = R = F = 2/3; bigrams: 1 of 2 shared
    assert similarity("rouge_1", "the cat sat", "the cat ran") == pytest.approx(2 / 3)
    assert similarity("rouge_2", "the cat sat", "the cat ran") == pytest.approx(1 / 2)
    assert similarity("rouge_3", "the cat sat", "the cat ran") == 0.0
    # every word shared, in the reverse order: unigrams all match, the longest common subsequence is one word
    assert similarity("rouge_1", "a b c d", "d c b a") == 1.0
    assert similarity("rouge_l", "a b c d", "d c b a") == pytest.approx(1 / 4)
    # F-measure, not recall: two words of a four-word reference, nothing else: P = 1, R = 1/2, F = 2/3
    assert similarity("rouge_1", "alpha beta", "alpha beta gamma delta") == pytest.approx(2 / 3)


def test_fuzzy_match_is_the_normalised_indel_similarity():
    # kitten / sitting: longest common subsequence "ittn" (4), so 6 + 7 - 2 * 4 = 5 edits over 13 characters
    assert similarity("fuzzy_match", "kitten", "sitting") == pytest.approx(1 - 5 / 13)


def test_gleu_by_hand():
    # n-grams 1 to 4 of "a b": {a, b, a b}; of "a c": {a, c, a c}; one of three shared: min(P, R) = 1/3
    assert similarity("gleu", "a b", "a c") == pytest.approx(1 / 3)


def test_bleu_clips_repeated_words():
    # "the" four times against a reference holding it twice: unigram precision is clipped to 2/4
    assert similarity("bleu", "the the the the", "the cat is on the mat") < 0.3
    assert similarity("bleu", "the cat is on the mat", "the cat is on the mat") == pytest.approx(1.0)


def test_meteor_matches_stems_but_not_synonyms():
    # "cats" and "running" share their Porter stems with "cat" and "run": all three words match
    assert similarity("meteor", "the cats running", "the cat run") > 0.9
    # no WordNet (see fusetune/graders/similarity.py): a synonym is a miss
    assert (
        similarity("meteor", "a fast car", "a quick car")
        < similarity("meteor", "a quick car", "a quick car") - 0.3
    )


def test_a_text_similarity_grader_reads_its_templates(tmp_path):
    grader = parse_grader({"type": "text_similarity", "name": "summary", "input": "{{ sample.output_text }}",
                           "reference": "{{ item.reference_answer }}", "evaluation_metric": "fuzzy_match"})  # fmt: skip
    result = grade(grader, sample="fine-tuning works", item={"reference_answer": "fine-tuning works"},
                   settings=Settings(data_dir=tmp_path))  # fmt: skip
    assert result.score == 1.0 and result.per_grader == {"summary": 1.0}


def test_cosine_is_refused_naming_the_field(tmp_path):
    grader = parse_grader({"type": "text_similarity", "name": "c", "input": "a", "reference": "b",
                           "evaluation_metric": "cosine"})  # fmt: skip
    with pytest.raises(SpecError, match="embedding") as refused:
        check_grader(grader, Settings(data_dir=tmp_path))
    assert refused.value.field == "grader.evaluation_metric"
