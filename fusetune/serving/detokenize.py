"""A completion's text, decoded a token at a time from a small window of its last tokens rather than all of them.

The window is the tokens from `prefix` on. The tokens before `read` were already turned into text; those between
`prefix` and `read` are decoded again with the new ones because a token's text may depend on the one before it (a
character's UTF-8 bytes split across tokens; a tokenizer that drops the leading space of the first token it
decodes, which then applies to both decodes alike). What the new tokens add is the window's text past the
already-read part's. It is taken only when it ends in a whole character: a text that ends in U+FFFD (what decoding
gives for an unfinished UTF-8 sequence) waits for the next token. Once taken, the window moves on: `prefix` to the
old `read`, `read` to the end.

Why that is the text of decoding the whole list: the window starts where the text read so far ended in a whole
character, so the bytes before it decode alone to what they decode to in the whole; decoding is then the
concatenation of the two parts. `rest` gives what is left unread (with its U+FFFD), for a completion that ends
there. Decoding uses clean_up_tokenization_spaces=False: that clean-up (a space before punctuation removed, for
word-piece tokenizers) rewrites text across token boundaries, so no stream could apply it to text already sent
(transformers 5 skips it for BPE tokenizers anyway). A fast tokenizer is decoded by its `tokenizers` backend, what
transformers' decode calls.
tests/serving/test_detokenize.py checks the equality on the tiny tokenizer, multi-byte characters included.
"""

from __future__ import annotations

from typing import Any


class IncrementalDecoder:
    """Decodes a growing list of token ids (special tokens skipped) a token at a time."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        # A fast tokenizer's own decoder (the Rust `tokenizers` one), called directly: transformers' decode wraps it
        # in some 20 us of Python per call (measured on the demo tokenizer), twice per token of every row.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend if callable(getattr(backend, "decode", None)) else None
        self.prefix = 0  # the window's first token
        self.read = 0  # the tokens before it are in the text given out
        self._read_text = ""  # the text of tokens[prefix:read]

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, tokens: list[int]) -> str:
        """The text that `tokens` (the whole list so far, its last ones new) adds: whole characters only."""
        text = self._decode(tokens[self.prefix :])
        if len(text) <= len(self._read_text) or text.endswith("\ufffd"):
            return ""
        added = text[len(self._read_text) :]
        self.prefix, self.read = self.read, len(tokens)
        # Decoded again rather than taken from `text`: alone, its first token's text may differ (a leading space).
        self._read_text = self._decode(tokens[self.prefix : self.read])
        return added

    def rest(self, tokens: list[int]) -> str:
        """The text of the tokens not given out yet (an unfinished character's U+FFFD included)."""
        return self._decode(tokens[self.prefix :])[len(self._read_text) :]
