"""Chat tokenisation, labels, packing and the split of batches over ranks."""

import json
import math
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fusetune.demo import assets
from fusetune.spec.examples import ChatExample, PromptCompletionExample, TextExample
from fusetune.worker.train.data import (
    IGNORE_INDEX,
    TokenizedSequence,
    TrainingDataError,
    best_fit_decreasing,
    collate,
    epoch_order,
    load_sequences,
    pack_sequences,
    rank_micro_batches,
    read_training_jsonl,
    tokenize_conversation,
    tokenize_example,
)
from fusetune.worker.train.outcome import ErrorCode

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "Reverse the word: abc"},
    {"role": "assistant", "content": "cba"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return assets.build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def _trained_text(tokenizer, sequence: TokenizedSequence) -> list[str]:
    """The decoded runs of consecutive trained target tokens."""
    runs, current = [], []
    for label in sequence.shifted_labels:
        if label == IGNORE_INDEX:
            if current:
                runs.append(tokenizer.decode(current))
            current = []
        else:
            current.append(label)
    if current:
        runs.append(tokenizer.decode(current))
    return runs


def test_labels_cover_only_assistant_turns(tokenizer):
    sequence, full_length = tokenize_conversation(tokenizer, MESSAGES, max_seq_length=512)
    assert full_length == len(sequence.input_ids)
    eot = tokenizer.eos_token
    assert _trained_text(tokenizer, sequence) == ["5" + eot, "cba" + eot]
    # Labels are the next token: wherever a label is set, it equals the following input id.
    for i, label in enumerate(sequence.shifted_labels[:-1]):
        assert label in (IGNORE_INDEX, sequence.input_ids[i + 1])
    assert sequence.shifted_labels[-1] == IGNORE_INDEX


def test_template_without_generation_markers_gives_the_same_labels(tokenizer):
    marked, _ = tokenize_conversation(tokenizer, MESSAGES, max_seq_length=512)
    by_prefixes, _ = tokenize_conversation(
        _without_generation_markers(tokenizer), MESSAGES, max_seq_length=512
    )
    assert by_prefixes == marked


def test_train_on_inputs_trains_every_next_token(tokenizer):
    sequence, _ = tokenize_conversation(tokenizer, MESSAGES, max_seq_length=512, train_on_inputs=True)
    assert sequence.shifted_labels == sequence.input_ids[1:] + [IGNORE_INDEX]


def _without_generation_markers(tokenizer):
    plain = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    plain.chat_template = assets.CHAT_TEMPLATE.replace("{%- generation %}", "").replace(
        "{%- endgeneration %}", ""
    )
    assert "{%- generation %}" not in plain.chat_template
    return plain


@pytest.mark.parametrize("markers", [True, False])
def test_weight_zero_assistant_turns_get_no_loss(tokenizer, markers):
    if not markers:
        tokenizer = _without_generation_markers(tokenizer)
    messages = [dict(m) for m in MESSAGES]
    messages[2]["weight"] = 0
    sequence, _ = tokenize_conversation(tokenizer, messages, max_seq_length=512)
    assert _trained_text(tokenizer, sequence) == ["cba" + tokenizer.eos_token]
    messages[4]["weight"] = 1  # explicit 1 is the default
    assert tokenize_conversation(tokenizer, messages, max_seq_length=512)[0] == sequence


def test_weight_zero_turns_stay_untrained_with_train_on_inputs(tokenizer):
    messages = [dict(m) for m in MESSAGES]
    messages[2]["weight"] = 0
    everything, _ = tokenize_conversation(tokenizer, MESSAGES, max_seq_length=512, train_on_inputs=True)
    sequence, _ = tokenize_conversation(tokenizer, messages, max_seq_length=512, train_on_inputs=True)
    dropped = [
        i
        for i, (a, b) in enumerate(zip(everything.shifted_labels, sequence.shifted_labels, strict=True))
        if a != b
    ]
    assert all(sequence.shifted_labels[i] == IGNORE_INDEX for i in dropped)
    assert tokenizer.decode([everything.shifted_labels[i] for i in dropped]) == "5" + tokenizer.eos_token


def test_tool_calls_and_results(tokenizer):
    call = [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    ]
    messages = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": None, "tool_calls": call},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
        {"role": "assistant", "content": "It is 5."},
    ]
    sequence, _ = tokenize_conversation(tokenizer, messages, max_seq_length=512)
    eot = tokenizer.eos_token
    trained = _trained_text(tokenizer, sequence)
    assert len(trained) == 2 and trained[1] == "It is 5." + eot
    # The call is learned (its JSON as the template renders it); the tool's result is input only.
    assert json.loads(trained[0].removesuffix(eot)) == call
    assert "<|tool|>\n5" + eot in tokenizer.decode(sequence.input_ids)


def test_prompt_completion_trains_the_completion_and_its_end(tokenizer):
    example = PromptCompletionExample("Reverse the word: abc ->", " cba")
    sequence, full_length = tokenize_example(tokenizer, example, max_seq_length=512)
    prompt_ids = tokenizer(example.prompt)["input_ids"]
    completion_ids = tokenizer(example.completion, add_special_tokens=False)["input_ids"]
    assert sequence.input_ids == prompt_ids + completion_ids + [tokenizer.eos_token_id]
    assert full_length == len(sequence.input_ids)
    assert _trained_text(tokenizer, sequence) == [" cba" + tokenizer.eos_token]
    everything, _ = tokenize_example(tokenizer, example, max_seq_length=512, train_on_inputs=True)
    assert everything.shifted_labels == everything.input_ids[1:] + [IGNORE_INDEX]


def test_text_trains_every_token(tokenizer):
    sequence, _ = tokenize_example(tokenizer, TextExample("17 + 25 = 42"), max_seq_length=512)
    assert sequence.input_ids[-1] == tokenizer.eos_token_id
    assert sequence.shifted_labels == sequence.input_ids[1:] + [IGNORE_INDEX]
    assert tokenizer.decode(sequence.input_ids) == "17 + 25 = 42" + tokenizer.eos_token


def test_formats_mix_in_one_file(tmp_path, tokenizer):
    lines = [
        json.dumps({"messages": MESSAGES[1:3]}),
        json.dumps({"prompt": "What is 2 + 3?", "completion": " 5"}),
        json.dumps({"text": "cba is abc reversed"}),
    ]
    path = _write(tmp_path / "mixed.jsonl", lines)
    assert [type(e) for e in read_training_jsonl(path)] == [ChatExample, PromptCompletionExample, TextExample]
    data = load_sequences(path, tokenizer, max_seq_length=64)
    assert (data.n_examples, len(data.sequences), data.n_dropped) == (3, 3, 0)
    assert _trained_text(tokenizer, data.sequences[1]) == [" 5" + tokenizer.eos_token]


def test_truncation_keeps_the_prefix(tokenizer):
    full, full_length = tokenize_conversation(tokenizer, MESSAGES, max_seq_length=512)
    cut, cut_full_length = tokenize_conversation(tokenizer, MESSAGES, max_seq_length=10)
    assert cut_full_length == full_length > 10
    assert cut.input_ids == full.input_ids[:10]
    assert cut.shifted_labels == full.shifted_labels[:9] + [IGNORE_INDEX]


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("{not json", "line 2: not valid JSON"),
        (json.dumps({"prompt": "x"}), "line 2: 'prompt' and 'completion' must both be strings"),
        (json.dumps({"question": "x"}), "line 2: expected a non-empty 'messages' list, a 'prompt'"),
        (json.dumps({"messages": []}), "line 2: 'messages' must be a non-empty list"),
        (
            json.dumps({"messages": [{"role": "robot", "content": "x"}]}),
            'line 2: messages[0].role must be one of system, user, assistant, tool (got "robot")',
        ),
        (
            json.dumps({"messages": [{"role": "user", "content": 3}]}),
            "line 2: messages[0].content must be a string",
        ),
        (
            json.dumps({"messages": [{"role": "user", "content": "x"}]}),
            "line 2: needs at least one assistant message",
        ),
        (
            json.dumps({"messages": [{"role": "assistant", "content": "x", "weight": 2}]}),
            "messages[0].weight must be 0 or 1 (got 2)",
        ),
        (
            json.dumps({"messages": [{"role": "assistant", "content": None}]}),
            "messages[0].content must be a string",
        ),
        (json.dumps({"text": ""}), "line 2: 'text' must be a non-empty string"),
    ],
)
def test_bad_lines_are_named(tmp_path, line, expected):
    good = json.dumps({"messages": MESSAGES})
    path = _write(tmp_path / "train.jsonl", [good, line, good])
    with pytest.raises(TrainingDataError) as raised:
        read_training_jsonl(path)
    assert raised.value.code == ErrorCode.INVALID_TRAINING_FILE
    assert expected in raised.value.message


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(TrainingDataError, match="not found"):
        read_training_jsonl(tmp_path / "absent.jsonl")
    with pytest.raises(TrainingDataError, match="no examples"):
        read_training_jsonl(_write(tmp_path / "empty.jsonl", [""]))


def test_examples_without_trained_tokens_after_truncation_are_dropped(tmp_path, tokenizer):
    long_prompt = {
        "messages": [{"role": "user", "content": "x " * 100}, {"role": "assistant", "content": "y"}]
    }
    short = {"messages": MESSAGES[1:3]}
    path = _write(tmp_path / "t.jsonl", [json.dumps(long_prompt), json.dumps(short)])
    data = load_sequences(path, tokenizer, max_seq_length=40)
    assert (data.n_examples, data.n_truncated, data.n_dropped, len(data.sequences)) == (2, 1, 1, 1)
    only_long = _write(tmp_path / "long.jsonl", [json.dumps(long_prompt)])
    with pytest.raises(TrainingDataError, match="max_seq_length=40"):
        load_sequences(only_long, tokenizer, max_seq_length=40)


def test_packing_concatenates_and_restarts_positions(tokenizer):
    sequences = [tokenize_conversation(tokenizer, MESSAGES[:3], 512)[0] for _ in range(5)]
    length = len(sequences[0].input_ids)
    rows = pack_sequences(sequences, max_seq_length=2 * length + 1)
    assert [len(row.input_ids) for row in rows] == [2 * length, 2 * length, length]
    assert rows[0].position_ids == list(range(length)) * 2
    assert rows[0].shifted_labels == sequences[0].shifted_labels * 2
    assert sum(row.n_label_tokens for row in rows) == sum(s.n_label_tokens for s in sequences)


def _chat_lengths(n: int, seed: int = 0, median: int = 600, sigma: float = 0.5, cap: int = 2048) -> list[int]:
    """Token counts like those of chat data: lognormal around `median`, cut to `cap`."""
    rng = random.Random(seed)
    return [min(cap, max(16, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


def _in_order_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """The packing this module did before: examples in file order, a new row when the next does not fit."""
    rows, used = [[]], 0
    for index, length in enumerate(lengths):
        if rows[-1] and used + length > capacity:
            rows, used = [*rows, []], 0
        rows[-1].append(index)
        used += length
    return rows


def _row_padding(rows: list[list[int]], lengths: list[int], capacity: int) -> float:
    return 1.0 - sum(lengths) / (len(rows) * capacity)


def _best_fit_row_lengths_reference(lengths: list[int], capacity: int) -> list[int]:
    """Best-fit decreasing the slow, obvious way: the filled lengths of its rows, sorted."""
    used: list[int] = []
    for length in sorted(lengths, reverse=True):
        fitting = [row for row, total in enumerate(used) if total + length <= capacity]
        if fitting:
            used[max(fitting, key=lambda row: used[row])] += length
        else:
            used.append(length)
    return sorted(used)


def test_best_fit_decreasing_packs_chat_lengths_with_under_2_percent_padding():
    lengths = _chat_lengths(1500)
    sequences = [TokenizedSequence([i] * n, [i] * n, list(range(n))) for i, n in enumerate(lengths)]
    rows = pack_sequences(sequences, max_seq_length=2048)
    padding = 1.0 - sum(lengths) / (len(rows) * 2048)
    assert padding < 0.02
    # Control: in file order the same examples leave far more (about a fifth of every row).
    assert _row_padding(_in_order_rows(lengths, 2048), lengths, 2048) > 0.1

    # Every example exactly once, whole, in file order within its row, its positions restarting.
    seen = []
    for row in rows:
        assert len(row.input_ids) <= 2048
        members = list(dict.fromkeys(row.input_ids))
        assert members == sorted(members)
        assert row.input_ids == [i for i in members for _ in range(lengths[i])]
        assert row.position_ids == [p for i in members for p in range(lengths[i])]
        seen += members
    assert sorted(seen) == list(range(len(lengths)))


@pytest.mark.parametrize("seed", range(3))
def test_best_fit_decreasing_places_each_example_in_the_fullest_row_it_fits(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 40) for _ in range(300)]
    rows = best_fit_decreasing(lengths, capacity=64)
    assert sorted(i for row in rows for i in row) == list(range(300))
    # Which of two rows of equal room takes an example does not change the rows' lengths.
    assert sorted(sum(lengths[i] for i in row) for row in rows) == _best_fit_row_lengths_reference(
        lengths, 64
    )
    assert best_fit_decreasing([70, 3, 64, 1], capacity=64) == [[0], [1, 3], [2]]  # too long: a row alone


def _batch_padding(order: list[int], lengths: list[int], batch_size: int) -> float:
    """Padding of the batches of `order`, each padded to its longest row."""
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    padded = sum(max(lengths[i] for i in batch) * len(batch) for batch in batches)
    return 1.0 - sum(lengths[i] for i in order) / padded


def test_epoch_order_groups_batches_by_length_and_reshuffles_every_epoch():
    lengths = _chat_lengths(1000, seed=1)
    steps = math.ceil(1000 / 8)
    grouped = epoch_order(1000, steps, 8, seed=0, epoch=0, lengths=lengths)
    assert len(grouped) == steps * 8 and set(grouped) == set(range(1000))
    assert grouped == epoch_order(1000, steps, 8, seed=0, epoch=0, lengths=lengths)
    assert max(lengths[i] for i in grouped[:8]) == max(lengths)  # a step that cannot fit fails first
    # Unpacked batches of similar lengths: little padding, where a plain shuffle pads nearly half.
    assert _batch_padding(grouped, lengths, 8) < 0.08
    assert _batch_padding(epoch_order(1000, steps, 8, seed=0, epoch=0), lengths, 8) > 0.3

    # Another epoch or seed puts other rows together, not only in another order.
    def batches(order):
        return {frozenset(order[i : i + 8]) for i in range(0, len(order), 8)}

    for other in (
        epoch_order(1000, steps, 8, seed=0, epoch=1, lengths=lengths),
        epoch_order(1000, steps, 8, seed=1, epoch=0, lengths=lengths),
    ):
        assert len(batches(grouped) & batches(other)) < steps // 10


def _packed_logits_error(model, tokenizer, restart_positions: bool) -> float:
    conversations = [MESSAGES[:3], MESSAGES[:1] + MESSAGES[3:], MESSAGES]
    sequences = [tokenize_conversation(tokenizer, messages, 512)[0] for messages in conversations]
    (row,) = pack_sequences(sequences, max_seq_length=1024)
    if not restart_positions:
        row = TokenizedSequence(row.input_ids, row.shifted_labels, list(range(len(row.input_ids))))
    # A padded batch of 2 rows, so the padding segment is exercised too.
    packed = collate([row, sequences[0]], tokenizer.pad_token_id, packed=True)
    with torch.no_grad():
        # No KV cache: with one, transformers does not look for packed sequences in the positions.
        packed_logits = model(
            input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False
        ).logits[0]
        start, worst = 0, 0.0
        for sequence in sequences:
            alone = model(input_ids=torch.tensor([sequence.input_ids]), use_cache=False).logits[0]
            end = start + len(sequence.input_ids)
            worst = max(worst, (packed_logits[start:end] - alone).abs().max().item())
            start = end
    return worst


def test_packed_examples_do_not_attend_to_each_other(model_dir, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert _packed_logits_error(model, tokenizer, restart_positions=True) < 1e-5
    # Control: with positions running on, attention crosses examples and the logits change.
    assert _packed_logits_error(model, tokenizer, restart_positions=False) > 1e-3


def test_collate_pads_right_and_masks(tokenizer):
    a = TokenizedSequence([5, 6, 7], [6, 7, IGNORE_INDEX], [0, 1, 2])
    b = TokenizedSequence([8, 9], [IGNORE_INDEX, IGNORE_INDEX], [0, 1])
    batch = collate([a, b], pad_token_id=2, packed=False)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 2]]
    assert batch["shifted_labels"].tolist() == [[6, 7, -100], [-100, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert (int(batch["n_input_tokens"]), int(batch["n_trained_tokens"])) == (5, 2)
    assert "position_ids" not in batch
    packed = collate([a, b], pad_token_id=2, packed=True)
    assert packed["position_ids"].tolist() == [[0, 1, 2], [0, 1, 0]]
    assert "attention_mask" not in packed


def test_epoch_order_is_shared_and_wraps():
    order = epoch_order(10, steps_per_epoch=3, batch_size=4, seed=0, epoch=0)
    assert len(order) == 12
    assert sorted(order[:10]) == list(range(10))
    assert order[10:] == order[:2]
    assert order == epoch_order(10, 3, 4, seed=0, epoch=0)
    assert order != epoch_order(10, 3, 4, seed=0, epoch=1)


def test_ranks_split_a_global_batch_like_accumulation():
    global_batch = list(range(8))
    one_process = rank_micro_batches(global_batch, micro_batch_size=2, rank=0, world_size=1)
    two_processes = [rank_micro_batches(global_batch, 2, rank, world_size=2) for rank in (0, 1)]
    four_processes = [rank_micro_batches(global_batch, 2, rank, world_size=4) for rank in range(4)]
    assert one_process == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert two_processes == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert sorted(sum(four_processes, [])) == one_process


def test_a_template_that_rejects_an_example_names_it(tmp_path, tokenizer):
    strict = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    strict.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system turns') }}"
        "{% endif %}{{ m['content'] + eos_token }}{% endfor %}"
    )
    path = _write(
        tmp_path / "t.jsonl", [json.dumps({"messages": MESSAGES[1:3]}), json.dumps({"messages": MESSAGES})]
    )
    with pytest.raises(
        TrainingDataError, match="t.jsonl, line 2: .*the chat template failed: no system turns"
    ):
        load_sequences(path, strict, max_seq_length=64)


def test_a_byte_order_mark_at_the_start_is_not_part_of_line_one(tmp_path):
    # Files saved by Windows editors start with one; the upload check accepts them, so the trainer must too.
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "\r\n".join([json.dumps({"messages": MESSAGES})] * 2).encode())
    assert len(read_training_jsonl(path)) == 2


def test_a_carriage_return_inside_a_line_does_not_end_it(tmp_path):
    # "\r" is JSON whitespace; the upload check splits lines at "\n" only, and so must the trainer.
    line = json.dumps({"messages": MESSAGES}).replace(", ", ",\r ", 1)
    path = tmp_path / "cr.jsonl"
    path.write_bytes(("\n".join([line] * 3) + "\n").encode())
    assert len(read_training_jsonl(path)) == 3


def test_a_huge_bad_value_is_quoted_short():
    from fusetune.spec.examples import QUOTED_VALUE_CHARS, parse_supervised_example

    with pytest.raises(ValueError) as refused:
        parse_supervised_example({"messages": [{"role": "x" * 100_000, "content": "hi"}]})
    assert len(str(refused.value)) < 2 * QUOTED_VALUE_CHARS + 200 and "100,002 characters" in str(
        refused.value
    )
