"""Chat JSONL → token sequences with labels → per-rank micro-batches.

Tokenisation goes through the tokenizer's own chat template; the loss is on the assistant's tokens only (unless
`train_on_inputs`). Labels are stored already shifted (`labels[i]` is the token that follows position `i`), so
that a sequence's last position never predicts the first token of the next one when examples are packed.

Batches: every rank computes the same shuffled order for an epoch, cuts it into global batches of `batch_size`
sequences, and each global batch into micro-batches of `micro_batch_size`; micro-batch `j` of a step belongs to
rank `j % world_size`. So one process with two micro-batches sees exactly the micro-batches that two processes
with one each see, which is what makes their steps identical.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fusetune.worker.train.outcome import ErrorCode, TrainingFailure

IGNORE_INDEX = -100
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
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


def read_chat_jsonl(path: str | Path) -> list[list[dict[str, Any]]]:
    """The `messages` of every line of an OpenAI-style chat JSONL file, checked; errors name the line."""
    path = Path(path)
    name = path.name
    if not path.is_file():
        raise TrainingDataError(f"training data file not found: {path}")
    conversations = []
    with path.open(encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TrainingDataError(f"{name}, line {line_number}: not valid JSON ({exc.msg})") from None
            messages = record.get("messages") if isinstance(record, dict) else None
            if not isinstance(messages, list) or not messages:
                raise TrainingDataError(f"{name}, line {line_number}: expected a non-empty 'messages' list")
            for index, message in enumerate(messages):
                role = message.get("role") if isinstance(message, dict) else None
                if role not in CHAT_ROLES:
                    raise TrainingDataError(
                        f"{name}, line {line_number}: message {index} has role {role!r}; "
                        f"expected one of {sorted(CHAT_ROLES)}"
                    )
                if not isinstance(message.get("content"), str):
                    raise TrainingDataError(
                        f"{name}, line {line_number}: message {index} needs a string 'content'"
                    )
            if not any(message["role"] == "assistant" for message in messages):
                raise TrainingDataError(f"{name}, line {line_number}: no assistant message to learn from")
            conversations.append(messages)
    if not conversations:
        raise TrainingDataError(f"{name} holds no examples")
    return conversations


def _render_ids(tokenizer, messages: list[dict[str, Any]], **kwargs) -> list[int]:
    return list(
        tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"]
    )


def _assistant_mask_by_prefixes(tokenizer, messages: list[dict[str, Any]], input_ids: list[int]) -> list[int]:
    """For templates without `{% generation %}` markers: an assistant turn's tokens are those its rendering
    adds after the generation prompt that precedes it. Needs a template that renders incrementally."""
    mask = [0] * len(input_ids)
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
        mask[start : len(through)] = [1] * (len(through) - start)
    return mask


def tokenize_conversation(
    tokenizer, messages: list[dict[str, Any]], max_seq_length: int, train_on_inputs: bool = False
) -> tuple[TokenizedSequence, int]:
    """A conversation through its chat template, truncated to `max_seq_length`, and its untruncated length."""
    template = tokenizer.chat_template or ""
    if train_on_inputs:
        input_ids = _render_ids(tokenizer, messages)
        trained = [1] * len(input_ids)
    elif _GENERATION_BLOCK.search(template):
        encoded = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        input_ids, trained = list(encoded["input_ids"]), list(encoded["assistant_masks"])
    else:
        input_ids = _render_ids(tokenizer, messages)
        trained = _assistant_mask_by_prefixes(tokenizer, messages, input_ids)
    full_length = len(input_ids)
    input_ids = input_ids[:max_seq_length]
    # Position i is trained when the token it predicts (i + 1) is an assistant token.
    shifted_labels = [
        input_ids[i + 1] if trained[i + 1] else IGNORE_INDEX for i in range(len(input_ids) - 1)
    ] + [IGNORE_INDEX]
    return TokenizedSequence(input_ids, shifted_labels, list(range(len(input_ids)))), full_length


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
    conversations = read_chat_jsonl(path)
    sequences, n_truncated, n_dropped = [], 0, 0
    for line_index, messages in enumerate(conversations):
        try:
            sequence, full_length = tokenize_conversation(
                tokenizer, messages, max_seq_length, train_on_inputs
            )
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
            f"{Path(path).name}: no example keeps an assistant token within max_seq_length={max_seq_length}"
        )
    if packing:
        sequences = pack_sequences(sequences, max_seq_length)
    return LoadedData(sequences, len(conversations), n_truncated, n_dropped)


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
