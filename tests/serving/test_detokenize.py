"""fusetune/serving/detokenize.py: the text decoded a token at a time is the whole list's decoding, on the tiny
(byte-level) tokenizer, with characters whose UTF-8 bytes are split across tokens."""

from __future__ import annotations

import random

import pytest

from fusetune.demo.assets import build_tokenizer
from fusetune.serving.detokenize import IncrementalDecoder

TEXTS = ["héllo 日本語 🎉 café, ok.", "Write in digits: 29 — naïve ☃ x², done", "🎉🎉 ünïcödé\n\n  spaces  "]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _check_every_prefix(tokenizer, ids: list[int]) -> int:
    """Feeds `ids` a token at a time; at each, the text given out plus the rest equals the prefix's decoding, and
    what was given out ends in a whole character. Returns how many tokens added no text (a character waited)."""
    decoder, given, waited = IncrementalDecoder(tokenizer), "", 0
    for end in range(1, len(ids) + 1):
        added = decoder.add(ids[:end])
        waited += added == ""
        given += added
        assert not given.endswith("\ufffd")
        assert given + decoder.rest(ids[:end]) == tokenizer.decode(ids[:end], skip_special_tokens=True)
    return waited


@pytest.mark.parametrize("text", TEXTS)
def test_text_with_multibyte_characters_decodes_as_a_whole(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    # The tokenizer does split these characters' bytes across tokens (what makes the test bite).
    assert any(tokenizer.decode([i]).endswith("\ufffd") for i in ids)
    waited = _check_every_prefix(tokenizer, ids)
    assert waited > 0
    decoder = IncrementalDecoder(tokenizer)
    assert "".join(decoder.add(ids[:end]) for end in range(1, len(ids) + 1)) == text


def test_random_token_lists_with_special_tokens_decode_as_a_whole(tokenizer):
    # Any ids, special ones (skipped) included: bytes that form no character decode to U+FFFD in the whole too.
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))]
        _check_every_prefix(tokenizer, ids)
