"""Training JSONL → token sequences with labels → per-rank micro-batches.

The line formats and their checks are the specification's (fusetune/spec/examples.py); this module reads a file
with a method's parser. Which tokens of an example are trained, and the data check that refuses a wrong mask, are
fusetune/tokenization's (shared with the API, which checks a job's files before accepting it); this module makes
rows of those masks, and checks every example again before the model loads.

Labels are stored already shifted (`labels[i]` is the token that follows position `i`), so that a sequence's
last position never predicts the first token of the next one when examples are packed.

Packing puts examples into rows by best-fit decreasing, so rows are nearly full (`pack_sequences`).

Batches: every rank computes the same shuffled order for an epoch, with rows of similar length grouped into the
same batch (`epoch_order`), cuts it into global batches of `batch_size` sequences, and each global batch into
micro-batches of `micro_batch_size`; micro-batch `j` of a step belongs to rank `j % world_size`. So one process
with two micro-batches sees exactly the micro-batches that two processes with one each see, which is what makes
their steps identical.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fusetune.spec.examples import SUPERVISED, ChatExample, SupervisedExample, parse_supervised_example
from fusetune.tokenization.check import MASKINGS, DataCheckFailure, checked_sequences, failure_message
from fusetune.tokenization.masks import MaskedTokens, default_stop_ids
from fusetune.worker.train.outcome import ErrorCode, TrainingFailure

IGNORE_INDEX = -100


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


def read_training_jsonl(
    path: str | Path, parse: Callable[[Any], Any] = parse_supervised_example
) -> list[Any]:
    """Every example of a training JSONL file, checked by `parse`; errors name the file and the line."""
    return [example for _, example in read_training_lines(path, parse)]


def read_training_lines(
    path: str | Path, parse: Callable[[Any], Any] = parse_supervised_example
) -> list[tuple[int, Any]]:
    """Every example of a training JSONL file with the number of its line, checked by `parse`."""
    path = Path(path)
    name = path.name
    if not path.is_file():
        raise TrainingDataError(f"training data file not found: {path}")
    examples: list[tuple[int, Any]] = []
    # A byte order mark at the start is not part of line 1. Lines end at "\n" only, as the upload check splits
    # them: a "\r" is JSON whitespace inside a line, not a line end.
    with path.open(encoding="utf-8-sig", newline="\n") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TrainingDataError(f"{name}, line {line_number}: not valid JSON ({exc.msg})") from None
            try:
                examples.append((line_number, parse(record)))
            except ValueError as exc:
                raise TrainingDataError(f"{name}, line {line_number}: {exc}") from None
    if not examples:
        raise TrainingDataError(f"{name} holds no examples")
    return examples


def data_check_error(
    tokenizer, failure: DataCheckFailure, path: str | Path, line_number: int
) -> TrainingDataError:
    """The job's error for an example that fails the data check: the file, the line, the check, the example with
    its trained spans marked."""
    return TrainingDataError(failure_message(tokenizer, failure, f"{Path(path).name}, line {line_number}"))


def shifted(masked: MaskedTokens, max_seq_length: int) -> tuple[TokenizedSequence, int]:
    """A masked sequence truncated to `max_seq_length` and shifted: position i is trained when the token it
    predicts (i + 1) is. Returns the sequence and the untruncated length."""
    full_length = len(masked.input_ids)
    input_ids = masked.input_ids[:max_seq_length]
    shifted_labels = [
        input_ids[i + 1] if masked.trained[i + 1] else IGNORE_INDEX for i in range(len(input_ids) - 1)
    ] + [IGNORE_INDEX]
    return TokenizedSequence(input_ids, shifted_labels, list(range(len(input_ids)))), full_length


def tokenize_example(
    tokenizer,
    example: SupervisedExample,
    max_seq_length: int,
    train_on_inputs: bool = False,
    stop_ids: Collection[int] | None = None,
) -> tuple[TokenizedSequence, int]:
    """Any example as a sequence truncated to `max_seq_length`, and its untruncated length; its mask is
    fusetune.tokenization's, and raises DataCheckFailure when the data check fails on it."""
    [sequence] = checked_sequences(
        MASKINGS[SUPERVISED.name],
        tokenizer,
        example,
        train_on_inputs=train_on_inputs,
        stop_ids=default_stop_ids(tokenizer) if stop_ids is None else stop_ids,
    )
    return shifted(sequence.masked, max_seq_length)


def tokenize_conversation(
    tokenizer, messages: list[dict[str, Any]], max_seq_length: int, train_on_inputs: bool = False
) -> tuple[TokenizedSequence, int]:
    """A conversation through its chat template, truncated to `max_seq_length`, and its untruncated length."""
    return tokenize_example(tokenizer, ChatExample(messages), max_seq_length, train_on_inputs)


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
    stop_ids: Collection[int] | None = None,
) -> LoadedData:
    """A supervised file as rows, every example checked (fusetune.tokenization.check) before any is trained on."""
    examples = read_training_lines(path)
    sequences, n_truncated, n_dropped = [], 0, 0
    for line_number, example in examples:
        try:
            sequence, full_length = tokenize_example(
                tokenizer, example, max_seq_length, train_on_inputs, stop_ids
            )
        except DataCheckFailure as failure:
            raise data_check_error(tokenizer, failure, path, line_number) from None
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


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into rows of at most `capacity` tokens: longest first, each into the fullest
    row it still fits (a new row when none has room). A length over `capacity` gets a row of its own.

    The rows come in the order of their first index, each row's indices ascending. Ties (equal lengths, rows
    with equal room) go by index, so the result depends on the lengths alone.
    """
    rows: list[list[int]] = []
    rows_by_room: dict[int, list[int]] = {}  # free tokens -> the rows that have exactly that many
    rooms_mask = 0  # bit r is set while some row has exactly r free tokens: the fullest fitting row is one
    # shift and one lowest-bit lookup away, whatever the number of rows
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        length = lengths[index]
        fitting_rooms = rooms_mask >> length if length <= capacity else 0
        if fitting_rooms:
            room = length + (fitting_rooms & -fitting_rooms).bit_length() - 1
            candidates = rows_by_room[room]
            row = candidates.pop()
            if not candidates:
                rooms_mask &= ~(1 << room)
        else:
            row, room = len(rows), capacity
            rows.append([])
        rows[row].append(index)
        room -= length
        if room > 0:
            rows_by_room.setdefault(room, []).append(row)
            rooms_mask |= 1 << room
    for row in rows:
        row.sort()
    rows.sort(key=lambda row: row[0])
    return rows


def pack_sequences(sequences: Sequence[TokenizedSequence], max_seq_length: int) -> list[TokenizedSequence]:
    """Concatenate examples into rows of at most `max_seq_length` tokens, placed by best-fit decreasing so that
    rows come out nearly full (in-order packing of ~600-token examples into 2048-token rows left about a fifth of
    every row as padding). Within a row the examples keep their order in the file.

    Positions restart with each example, which is how the model tells the examples apart and keeps attention
    inside each one. The rows are the same for the same examples; `epoch_order` shuffles their order per epoch.
    """
    rows = []
    for members in best_fit_decreasing([len(s.input_ids) for s in sequences], max_seq_length):
        ids: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        for index in members:
            ids += sequences[index].input_ids
            labels += sequences[index].shifted_labels
            positions += sequences[index].position_ids
        rows.append(TokenizedSequence(ids, labels, positions))
    return rows


# Batches per window of the shuffled order that is sorted by length (see `epoch_order`): in unpacked batches of
# 8 of lognormal lengths (median 600, sigma 0.5), 32 leaves about 4% padding, 8 leaves 14% and no grouping 46%.
LENGTH_GROUP_BATCHES = 32


def epoch_order(
    n_sequences: int,
    steps_per_epoch: int,
    batch_size: int,
    seed: int,
    epoch: int,
    lengths: Sequence[int] | None = None,
) -> list[int]:
    """The same shuffled order on every rank; the last batch wraps around so every step is full.

    With `lengths` (of each sequence), batches are grouped by length: the shuffled order is cut into windows of
    `LENGTH_GROUP_BATCHES` batches, each window is sorted longest first and cut into batches, and the batches are
    shuffled again, so that the rows of a batch, and of each of its micro-batches, have similar lengths and need
    little padding. The batch that holds the longest row goes first, so that a run that cannot fit it in memory
    fails at its first step. The order depends on (seed, epoch) and the lengths only, never on the number of
    processes or micro-batches, which keeps their steps identical and a resumed run exact.
    """
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(n_sequences, generator=generator).tolist()
    order = [order[i % n_sequences] for i in range(steps_per_epoch * batch_size)]
    if lengths is None:
        return order
    window = batch_size * LENGTH_GROUP_BATCHES
    by_length = [
        index
        for start in range(0, len(order), window)
        for index in sorted(order[start : start + window], key=lambda i: -lengths[i])
    ]
    batches = [by_length[start : start + batch_size] for start in range(0, len(by_length), batch_size)]
    batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
    longest = max(range(len(batches)), key=lambda b: lengths[batches[b][0]])
    batches[0], batches[longest] = batches[longest], batches[0]
    return [index for batch in batches for index in batch]


def rank_micro_batches(
    global_batch: Sequence[int], micro_batch_size: int, rank: int, world_size: int
) -> list[list[int]]:
    """This rank's micro-batches of a global batch: micro-batch j goes to rank j % world_size."""
    chunks = [
        list(global_batch[i : i + micro_batch_size]) for i in range(0, len(global_batch), micro_batch_size)
    ]
    return chunks[rank::world_size]


def collate(
    rows: Sequence[TokenizedSequence], pad_token_id: int, packed: bool, length_multiple: int = 1
) -> dict[str, Any]:
    """Right-pad rows to the longest one, rounded up to a multiple of `length_multiple`. The token counts
    (`n_input_tokens` without padding, `n_trained_tokens` with a label, `n_row_tokens` with padding) are 0-d
    tensors; `attended_length` (a float) is the mean over input tokens of the length of the example each belongs
    to.

    Unpacked rows get an `attention_mask`; packed rows get `position_ids` instead (and no mask), from which the
    model builds attention that stays within each example. Padding of a packed row is given positions of its own
    so it forms a separate, untrained segment. Both also get the sequence boundaries that variable-length
    attention takes (`cu_seq_lens_q`... of `fusetune.models.attention.packed_sequence_kwargs`).
    """
    length = -(-max(len(row.input_ids) for row in rows) // length_multiple) * length_multiple
    input_ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long)
    shifted_labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((len(rows), length), dtype=torch.long)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
    sequence_lengths: list[int] = []  # of the examples, padding left out
    for i, row in enumerate(rows):
        n = len(row.input_ids)
        sequence_lengths += _sequence_lengths(row.position_ids) if packed else [n]
        input_ids[i, :n] = torch.tensor(row.input_ids)
        shifted_labels[i, :n] = torch.tensor(row.shifted_labels)
        # Under an attention mask (unpacked) a row's tokens are one sequence, whatever positions they carry.
        position_ids[i, :n] = torch.tensor(row.position_ids) if packed else torch.arange(n)
        position_ids[i, n:] = torch.arange(length - n)
        attention_mask[i, :n] = 1
    batch = {
        "input_ids": input_ids,
        "shifted_labels": shifted_labels,
        "n_input_tokens": attention_mask.sum(),
        "n_trained_tokens": (shifted_labels != IGNORE_INDEX).sum(),
        "n_row_tokens": torch.tensor(input_ids.numel()),  # padding included
        # The mean, over input tokens, of the length of the sequence a token attends within: what MFU's
        # attention term counts.
        "attended_length": sum(n * n for n in sequence_lengths) / max(1, sum(sequence_lengths)),
    }
    if packed:
        batch["position_ids"] = position_ids
    else:
        batch["attention_mask"] = attention_mask
    # The sequence boundaries (each example, each stretch of padding), computed here on the host, so that
    # attention that takes them (fusetune_varlen) never builds a mask nor waits for the GPU to find them.
    from fusetune.models.attention import packed_sequence_kwargs

    batch.update(packed_sequence_kwargs(position_ids))
    return batch


def _sequence_lengths(position_ids: Sequence[int]) -> list[int]:
    """Lengths of the examples of a packed row: a new one starts wherever the position restarts."""
    starts = [i for i, p in enumerate(position_ids) if i == 0 or p != position_ids[i - 1] + 1]
    return [end - start for start, end in zip(starts, [*starts[1:], len(position_ids)], strict=True)]


# What a model's forward takes from a collated batch (the rest is labels and counts for the loss).
MODEL_INPUT_KEYS = (
    "input_ids", "attention_mask", "position_ids",
    "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
)  # fmt: skip


def model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    return {key: batch[key] for key in MODEL_INPUT_KEYS if key in batch}
