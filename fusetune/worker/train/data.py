"""Training JSONL → token sequences with labels → per-rank micro-batches.

The line formats and their checks belong to the training method (`methods/sft.py` for the formats below); this
module reads a file with a method's parser and tokenizes the supervised formats.

Labels are stored already shifted (`labels[i]` is the token that follows position `i`), so that a sequence's
last position never predicts the first token of the next one when examples are packed.

Batches: every rank computes the same shuffled order for an epoch, cuts it into global batches of `batch_size`
sequences, and each global batch into micro-batches of `micro_batch_size`; micro-batch `j` of a step belongs to
rank `j % world_size`. So one process with two micro-batches sees exactly the micro-batches that two processes
with one each see, which is what makes their steps identical.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# The supervised example types, re-exported: they are defined with their parser in the method's module.
from fusetune.worker.train.methods.sft import (  # noqa: F401
    ChatExample,
    Example,
    PromptCompletionExample,
    TextExample,
    parse_example,
)
from fusetune.worker.train.outcome import ErrorCode, TrainingFailure

IGNORE_INDEX = -100
_GENERATION_BLOCK = re.compile(r"{%-?\s*generation\s*-?%}")


class TrainingDataError(TrainingFailure):
    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.INVALID_TRAINING_FILE, message)


@dataclass(frozen=True)
class TokenizedSequence:
    """Token ids, shifted labels and positions of one training row (one example, or several when packed)."""

    input_ids: list[int]
    shifted_labels: list[int]
    position_ids: list[int]

    @property
    def n_label_tokens(self) -> int:
        return sum(label != IGNORE_INDEX for label in self.shifted_labels)


def read_training_jsonl(path: str | Path, parse: Callable[[Any], Any] = parse_example) -> list[Any]:
    """Every example of a training JSONL file, checked by `parse`; errors name the file and the line."""
    path = Path(path)
    name = path.name
    if not path.is_file():
        raise TrainingDataError(f"training data file not found: {path}")
    examples: list[Any] = []
    with path.open(encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TrainingDataError(f"{name}, line {line_number}: not valid JSON ({exc.msg})") from None
            try:
                examples.append(parse(record))
            except ValueError as exc:
                raise TrainingDataError(f"{name}, line {line_number}: {exc}") from None
    if not examples:
        raise TrainingDataError(f"{name} holds no examples")
    return examples


def _render_ids(tokenizer, messages: list[dict[str, Any]], **kwargs) -> list[int]:
    return list(
        tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"]
    )


def _runs_of_ones(mask: Sequence[int]) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, value in enumerate([*mask, 0]):
        if value and start is None:
            start = i
        elif not value and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _assistant_spans_by_prefixes(
    tokenizer, messages: list[dict[str, Any]], input_ids: list[int]
) -> list[tuple[int, int]]:
    """For templates without `{% generation %}` markers: an assistant turn's tokens are those its rendering
    adds after the generation prompt that precedes it. Needs a template that renders incrementally."""
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _render_ids(tokenizer, messages[:index], add_generation_prompt=True) if index else []
        through = _render_ids(tokenizer, messages[: index + 1])
        start = len(prompt)
        if through != input_ids[: len(through)] or prompt != through[:start]:
            raise TrainingDataError(
                "the model's chat template does not render a conversation as the concatenation of its turns, "
                "so the assistant's tokens cannot be found; give the template {% generation %} markers"
            )
        spans.append((start, len(through)))
    return spans


def _chat_ids_and_assistant_spans(
    tokenizer, messages: list[dict[str, Any]]
) -> tuple[list[int], list[tuple[int, int]]]:
    """The rendered conversation and the (start, end) token span of each assistant message, in order."""
    n_assistant = sum(message["role"] == "assistant" for message in messages)
    if _GENERATION_BLOCK.search(tokenizer.chat_template or ""):
        encoded = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        input_ids = list(encoded["input_ids"])
        spans = _runs_of_ones(encoded["assistant_masks"])
        # One block per assistant message is the usual case; otherwise (an empty block, say) the spans
        # cannot be matched to messages, and rendering turn by turn tells them apart.
        if len(spans) == n_assistant:
            return input_ids, spans
    else:
        input_ids = _render_ids(tokenizer, messages)
    return input_ids, _assistant_spans_by_prefixes(tokenizer, messages, input_ids)


def _shifted(input_ids: list[int], trained: list[int], max_seq_length: int) -> tuple[TokenizedSequence, int]:
    """Truncate to `max_seq_length` and shift: position i is trained when the token it predicts (i + 1) is.
    Returns the sequence and the untruncated length."""
    full_length = len(input_ids)
    input_ids = input_ids[:max_seq_length]
    shifted_labels = [
        input_ids[i + 1] if trained[i + 1] else IGNORE_INDEX for i in range(len(input_ids) - 1)
    ] + [IGNORE_INDEX]
    return TokenizedSequence(input_ids, shifted_labels, list(range(len(input_ids)))), full_length


def tokenize_conversation(
    tokenizer, messages: list[dict[str, Any]], max_seq_length: int, train_on_inputs: bool = False
) -> tuple[TokenizedSequence, int]:
    """A conversation through its chat template, truncated to `max_seq_length`, and its untruncated length."""
    assistant_messages = [message for message in messages if message["role"] == "assistant"]
    excluded = [message.get("weight", 1) == 0 for message in assistant_messages]
    if train_on_inputs and not any(excluded):
        # Every token is trained: no need to find the turns, so any template works.
        input_ids = _render_ids(tokenizer, messages)
        return _shifted(input_ids, [1] * len(input_ids), max_seq_length)
    input_ids, spans = _chat_ids_and_assistant_spans(tokenizer, messages)
    trained = [int(train_on_inputs)] * len(input_ids)
    for (start, end), is_excluded in zip(spans, excluded, strict=True):
        trained[start:end] = [0 if is_excluded else 1] * (end - start)
    return _shifted(input_ids, trained, max_seq_length)


def _text_ids(tokenizer, text: str, *, starts_sequence: bool) -> list[int]:
    # The tokenizer's special tokens (a BOS, for most models) belong at the start of the sequence only.
    return list(tokenizer(text, add_special_tokens=starts_sequence)["input_ids"])


def _with_eos(tokenizer, ids: list[int]) -> list[int]:
    eos = tokenizer.eos_token_id
    return ids + [eos] if eos is not None and (not ids or ids[-1] != eos) else ids


def tokenize_example(
    tokenizer, example: Example, max_seq_length: int, train_on_inputs: bool = False
) -> tuple[TokenizedSequence, int]:
    """Any example as a sequence truncated to `max_seq_length`, and its untruncated length. Plain-text
    formats end with the end-of-sequence token, trained, so the model learns where a completion stops."""
    if isinstance(example, ChatExample):
        return tokenize_conversation(tokenizer, example.messages, max_seq_length, train_on_inputs)
    if isinstance(example, PromptCompletionExample):
        prompt_ids = _text_ids(tokenizer, example.prompt, starts_sequence=True)
        completion_ids = _with_eos(tokenizer, _text_ids(tokenizer, example.completion, starts_sequence=False))
        trained = [int(train_on_inputs)] * len(prompt_ids) + [1] * len(completion_ids)
        return _shifted(prompt_ids + completion_ids, trained, max_seq_length)
    input_ids = _with_eos(tokenizer, _text_ids(tokenizer, example.text, starts_sequence=True))
    return _shifted(input_ids, [1] * len(input_ids), max_seq_length)


@dataclass(frozen=True)
class LoadedData:
    sequences: list[TokenizedSequence]
    n_examples: int
    n_truncated: int
    n_dropped: int  # examples with no trained token left after truncation


def load_sequences(
    path: str | Path,
    tokenizer,
    max_seq_length: int,
    *,
    train_on_inputs: bool = False,
    packing: bool = False,
) -> LoadedData:
    examples = read_training_jsonl(path)
    sequences, n_truncated, n_dropped = [], 0, 0
    for line_index, example in enumerate(examples):
        try:
            sequence, full_length = tokenize_example(tokenizer, example, max_seq_length, train_on_inputs)
        except TrainingDataError as exc:
            raise TrainingDataError(f"{Path(path).name}, example {line_index + 1}: {exc.message}") from exc
        except Exception as exc:  # a template may raise on content it does not accept (e.g. role order)
            raise TrainingDataError(
                f"{Path(path).name}, example {line_index + 1}: the chat template failed: {exc}"
            ) from exc
        n_truncated += full_length > max_seq_length
        if sequence.n_label_tokens == 0:
            n_dropped += 1
            continue
        sequences.append(sequence)
    if not sequences:
        raise TrainingDataError(
            f"{Path(path).name}: no example keeps a trained token within max_seq_length={max_seq_length}"
        )
    if packing:
        sequences = pack_sequences(sequences, max_seq_length)
    return LoadedData(sequences, len(examples), n_truncated, n_dropped)


def pack_sequences(sequences: Sequence[TokenizedSequence], max_seq_length: int) -> list[TokenizedSequence]:
    """Concatenate examples, in order, into rows of at most `max_seq_length` tokens. Positions restart with each
    example, which is how the model tells the examples apart and keeps attention inside each one."""
    rows: list[TokenizedSequence] = []
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    for sequence in sequences:
        if ids and len(ids) + len(sequence.input_ids) > max_seq_length:
            rows.append(TokenizedSequence(ids, labels, positions))
            ids, labels, positions = [], [], []
        ids = ids + sequence.input_ids
        labels = labels + sequence.shifted_labels
        positions = positions + sequence.position_ids
    if ids:
        rows.append(TokenizedSequence(ids, labels, positions))
    return rows


def epoch_order(n_sequences: int, steps_per_epoch: int, batch_size: int, seed: int, epoch: int) -> list[int]:
    """The same shuffled order on every rank; the last batch wraps around so every step is full."""
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(n_sequences, generator=generator).tolist()
    return [order[i % n_sequences] for i in range(steps_per_epoch * batch_size)]


def rank_micro_batches(
    global_batch: Sequence[int], micro_batch_size: int, rank: int, world_size: int
) -> list[list[int]]:
    """This rank's micro-batches of a global batch: micro-batch j goes to rank j % world_size."""
    chunks = [
        list(global_batch[i : i + micro_batch_size]) for i in range(0, len(global_batch), micro_batch_size)
    ]
    return chunks[rank::world_size]


def collate(rows: Sequence[TokenizedSequence], pad_token_id: int, packed: bool) -> dict[str, torch.Tensor]:
    """Right-pad rows to the longest one.

    Unpacked rows get an `attention_mask`; packed rows get `position_ids` instead (and no mask), from which the
    model builds attention that stays within each example. Padding of a packed row is given positions of its own
    so it forms a separate, untrained segment.
    """
    length = max(len(row.input_ids) for row in rows)
    input_ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long)
    shifted_labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((len(rows), length), dtype=torch.long)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row.input_ids)
        input_ids[i, :n] = torch.tensor(row.input_ids)
        shifted_labels[i, :n] = torch.tensor(row.shifted_labels)
        position_ids[i, :n] = torch.tensor(row.position_ids)
        position_ids[i, n:] = torch.arange(length - n)
        attention_mask[i, :n] = 1
    batch = {
        "input_ids": input_ids,
        "shifted_labels": shifted_labels,
        "n_input_tokens": attention_mask.sum(),
        "n_trained_tokens": (shifted_labels != IGNORE_INDEX).sum(),
    }
    if packed:
        batch["position_ids"] = position_ids
    else:
        batch["attention_mask"] = attention_mask
    return batch
