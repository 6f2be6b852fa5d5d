"""The data check on real chat templates in the styles models ship (Llama 3's headers, ChatML), each with a
byte-level BPE tokenizer trained here in a fraction of a second: templates that mask wrongly are refused with the
check named and the trained spans marked, correct ones pass with exactly the served completion trained, and the
bundled demo data passes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from fusetune.demo import assets, task
from fusetune.spec import methods
from fusetune.spec.examples import (
    SUPERVISED,
    ChatExample,
    ExampleFormat,
    PromptCompletionExample,
    TextExample,
    parse_preference_example,
    parse_supervised_example,
)
from fusetune.spec.hyperparameters import MAX_SEQ_LENGTH
from fusetune.tokenization.check import (
    DataCheckFailure,
    check_examples,
    checked_sequences,
    failure_message,
    marked_text,
    masking_for,
    preview,
    text_chars_used,
)
from fusetune.tokenization.masks import mask_conversation
from fusetune.tokenization.tokenizer import load_tokenizer_without_torch, stop_token_ids

REPO = Path(__file__).resolve().parents[2]
TEXT = [
    "Be brief.",
    "What is 2 + 3?",
    "5",
    "Reverse the word: abc",
    "cba",
    "Hello there, how are you today?",
] * 4

# ---- Llama 3 style: a header per message, <|eot_id|> closing every turn --------------------------------------
LLAMA_SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
LLAMA_HEADER = "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
LLAMA_PROMPT = (
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
LLAMA = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- " + LLAMA_HEADER + " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}" + LLAMA_PROMPT
)


def _llama_with_assistant(assistant: str) -> str:
    """The Llama 3 style with its own rendering of assistant turns (`content` is the trimmed content)."""
    return (
        "{{- bos_token }}{%- for message in messages %}{%- set content = message['content'] | trim %}"
        "{%- if message['role'] == 'assistant' %}" + assistant + "{%- else %}"
        "{{- " + LLAMA_HEADER + " + content + '<|eot_id|>' }}{%- endif %}{%- endfor %}" + LLAMA_PROMPT
    )


ASSISTANT_HEADER = "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
LLAMA_MARKED = _llama_with_assistant(
    ASSISTANT_HEADER + "{%- generation %}{{- content + '<|eot_id|>' }}{%- endgeneration %}"
)
# The end-of-turn token left outside the generation block: never trained, the model never learns to stop.
LLAMA_MARKED_WITHOUT_EOT = _llama_with_assistant(
    ASSISTANT_HEADER + "{%- generation %}{{- content }}{%- endgeneration %}{{- '<|eot_id|>' }}"
)
# The block opened before the header: the generation prompt, which the model is given, is trained.
LLAMA_MARKED_WITH_HEADER = _llama_with_assistant(
    "{%- generation %}" + ASSISTANT_HEADER + "{{- content + '<|eot_id|>' }}{%- endgeneration %}"
)

# ---- ChatML: <|im_start|>role\n ... <|im_end|>\n ----------------------------------------------------------------
CHATML_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_PROMPT = "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}" + CHATML_PROMPT
)
# Closes the user's and the system's turns but forgets the assistant's: no answer ends with <|im_end|>.
CHATML_ASSISTANT_WITHOUT_IM_END = (
    "{%- for message in messages %}{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + message['content'] }}{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}" + CHATML_PROMPT
)
# Served with an empty reasoning block after the generation prompt that the conversation never renders.
CHATML_SERVED_WITH_THINK = CHATML.replace(
    "{{- '<|im_start|>assistant\\n' }}", "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}"
)

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "Reverse the word: abc"},
    {"role": "assistant", "content": "cba"},
]


def _tokenizer(special: list[str], bos: str | None, eos: str, template: str) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    backend.train_from_iterator(TEXT, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos)
    tokenizer.chat_template = template
    return tokenizer


@pytest.fixture(scope="module")
def llama_backend() -> PreTrainedTokenizerFast:
    return _tokenizer(LLAMA_SPECIAL, "<|begin_of_text|>", "<|eot_id|>", LLAMA)


@pytest.fixture(scope="module")
def chatml_backend() -> PreTrainedTokenizerFast:
    return _tokenizer(CHATML_SPECIAL, None, "<|im_end|>", CHATML)


def _with_template(tokenizer: PreTrainedTokenizerFast, template: str) -> PreTrainedTokenizerFast:
    tokenizer.chat_template = template
    return tokenizer


def _check(tokenizer, messages, *, train_on_inputs=False, stop_ids=None, method="supervised"):
    stop_ids = stop_ids if stop_ids is not None else {tokenizer.eos_token_id}
    example = ChatExample(messages) if method == "supervised" else messages
    return checked_sequences(
        masking_for(method), tokenizer, example, train_on_inputs=train_on_inputs, stop_ids=stop_ids
    )


def _trained(tokenizer, sequence) -> list[str]:
    return [segment.text for segment in preview(tokenizer, [sequence])[0].segments if segment.trained]


# ---- templates that mask right -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "template", [LLAMA, LLAMA_MARKED], ids=["no-generation-markers", "generation-markers"]
)
def test_llama_style_trains_exactly_each_answer_and_its_end_of_turn(llama_backend, template):
    tokenizer = _with_template(llama_backend, template)
    [sequence] = _check(tokenizer, CHAT)
    assert _trained(tokenizer, sequence) == ["5<|eot_id|>", "cba<|eot_id|>"]
    # What precedes each answer is its prompt as served, generation prompt included.
    text = marked_text(preview(tokenizer, [sequence]))
    assert text.startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
    )
    assert "<|start_header_id|>assistant<|end_header_id|>\n\n⟦5<|eot_id|>⟧<|start_header_id|>user" in text


def test_chatml_without_markers_trains_through_im_end_and_not_the_newline_after(chatml_backend):
    tokenizer = _with_template(chatml_backend, CHATML)
    [sequence] = _check(tokenizer, CHAT)
    # Generation stops at <|im_end|>: the newline the template writes after it is never generated.
    assert _trained(tokenizer, sequence) == ["5<|im_end|>", "cba<|im_end|>"]


def test_weight_zero_turns_and_train_on_inputs(llama_backend):
    tokenizer = _with_template(llama_backend, LLAMA)
    messages = [dict(message) for message in CHAT]
    messages[2]["weight"] = 0
    [sequence] = _check(tokenizer, messages)
    assert _trained(tokenizer, sequence) == ["cba<|eot_id|>"]
    [everything] = _check(tokenizer, messages, train_on_inputs=True)
    untrained = [s.text for s in preview(tokenizer, [everything])[0].segments if not s.trained]
    assert untrained == ["5<|eot_id|>"]


# ---- templates that mask wrongly ---------------------------------------------------------------------------------


def _refusal(tokenizer, messages, **kwargs) -> DataCheckFailure:
    with pytest.raises(DataCheckFailure) as caught:
        _check(tokenizer, messages, **kwargs)
    return caught.value


def test_a_generation_block_without_the_end_of_turn_token_is_refused(llama_backend):
    tokenizer = _with_template(llama_backend, LLAMA_MARKED_WITHOUT_EOT)
    failure = _refusal(tokenizer, CHAT)
    assert failure.check == "end_of_turn_trained"
    assert "messages[2] (assistant): its stop token '<|eot_id|>'" in failure.problem
    message = failure_message(tokenizer, failure, "train.jsonl, line 7")
    assert message.startswith("train.jsonl, line 7: the data check 'end_of_turn_trained' failed")
    assert "<|start_header_id|>assistant<|end_header_id|>\n\n⟦5⟧<|eot_id|>" in message


def test_a_template_that_drops_the_end_of_turn_token_is_refused(chatml_backend):
    tokenizer = _with_template(chatml_backend, CHATML_ASSISTANT_WITHOUT_IM_END)
    failure = _refusal(tokenizer, CHAT)
    assert failure.check == "end_of_turn_trained"
    assert "messages[2] (assistant) ends without a stop token" in failure.problem
    assert "this model stops at '<|im_end|>'" in failure.problem
    text = marked_text(preview(tokenizer, failure.sequences))
    assert "<|im_start|>assistant\n⟦5⟧<|im_start|>user" in text and text.endswith("⟦cba⟧")


def test_a_template_that_trains_the_prompt_is_refused_unless_train_on_inputs(llama_backend):
    tokenizer = _with_template(llama_backend, LLAMA_MARKED_WITH_HEADER)
    failure = _refusal(tokenizer, CHAT)
    assert failure.check == "prompt_not_trained"
    assert "the first '<|start_header_id|>'" in failure.problem
    assert "⟦<|start_header_id|>assistant<|end_header_id|>\n\n5<|eot_id|>⟧" in marked_text(
        preview(tokenizer, failure.sequences)
    )
    _check(tokenizer, CHAT, train_on_inputs=True)  # training the prompt is then what was asked for


def test_a_turn_rendered_otherwise_than_it_is_served_is_refused(chatml_backend):
    tokenizer = _with_template(chatml_backend, CHATML_SERVED_WITH_THINK)
    failure = _refusal(tokenizer, CHAT)
    assert failure.check == "served_form"
    assert "differently from the prompt the model is served with" in failure.problem
    assert "<|im_start|>assistant\\n' then '<think>\\n\\n</think>\\n\\n'; in training" in failure.problem
    assert failure.problem.endswith("<|im_start|>assistant\\n' then '5<|im_end|>\\n'")


def test_an_end_of_turn_token_that_does_not_stop_the_model_is_refused(tmp_path, llama_backend):
    """A base model's tokenizer ends sequences with <|end_of_text|>: a turn closed by <|eot_id|> would never
    stop generation, unless generation_config.json lists it."""
    tokenizer = _tokenizer(LLAMA_SPECIAL, "<|begin_of_text|>", "<|end_of_text|>", LLAMA)
    tokenizer.save_pretrained(tmp_path)
    assert stop_token_ids(tokenizer, tmp_path) == {tokenizer.eos_token_id}
    failure = _refusal(tokenizer, CHAT, stop_ids=stop_token_ids(tokenizer, tmp_path))
    assert failure.check == "end_of_turn_trained" and "stops at '<|end_of_text|>'" in failure.problem
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [tokenizer.eos_token_id, eot]})
    )
    _check(tokenizer, CHAT, stop_ids=stop_token_ids(tokenizer, tmp_path))


def test_a_template_that_raises_or_is_missing_is_named(llama_backend):
    tokenizer = _with_template(llama_backend, "{{ raise_exception('no system turns') }}")
    failure = _refusal(tokenizer, CHAT)
    assert failure.check == "chat_template" and "no system turns" in failure.problem
    assert failure.sequences is None
    bare = _tokenizer(LLAMA_SPECIAL, "<|begin_of_text|>", "<|eot_id|>", LLAMA)
    bare.chat_template = None
    assert "has no chat template" in _refusal(bare, CHAT).problem


def test_preference_pairs_are_checked_on_both_sides(llama_backend, chatml_backend):
    pair = parse_preference_example(
        {
            "input": {"messages": CHAT[:4]},
            "preferred_output": [{"role": "assistant", "content": "cba"}],
            "non_preferred_output": [{"role": "assistant", "content": "abc"}],
        }
    )
    for method in ("dpo", "simpo"):
        chosen, rejected = _check(_with_template(llama_backend, LLAMA), pair, method=method)
        # Only the output is trained; the input's own assistant turn is context.
        assert _trained(llama_backend, chosen) == ["cba<|eot_id|>"]
        assert _trained(llama_backend, rejected) == ["abc<|eot_id|>"]
        failure = _refusal(
            _with_template(chatml_backend, CHATML_ASSISTANT_WITHOUT_IM_END), pair, method=method
        )
        assert failure.check == "end_of_turn_trained" and failure.problem.startswith("preferred_output: ")
        assert "[non_preferred_output] " in marked_text(preview(chatml_backend, failure.sequences))


def test_a_completion_without_an_end_of_sequence_token_is_refused(llama_backend):
    tokenizer = _with_template(llama_backend, LLAMA)
    example = PromptCompletionExample("Reverse the word: abc", " cba")
    masking = masking_for("supervised")
    stop_ids = {tokenizer.eos_token_id}
    [sequence] = checked_sequences(masking, tokenizer, example, train_on_inputs=False, stop_ids=stop_ids)
    assert _trained(tokenizer, sequence) == [" cba<|eot_id|>"]
    with pytest.raises(DataCheckFailure, match="the completion ends without a stop token"):
        checked_sequences(masking, tokenizer, example, train_on_inputs=False, stop_ids=set())
    checked_sequences(masking, tokenizer, TextExample("17 + 25 = 42"), train_on_inputs=False, stop_ids=set())


# ---- a file: truncation, the first failure, the per-method hook ------------------------------------------------


def _numbered(records) -> list[tuple[int, object]]:
    return [(line, parse_supervised_example(record)) for line, record in records]


def test_truncation_is_counted_and_a_file_of_only_cut_examples_is_refused(llama_backend):
    tokenizer = _with_template(llama_backend, LLAMA)
    long = {"messages": [{"role": "user", "content": "Hello there, how are you today? " * 20}, CHAT[2]]}
    short = {"messages": CHAT[1:3]}
    kwargs = dict(train_on_inputs=False, stop_ids={tokenizer.eos_token_id}, max_seq_length=40)
    both = check_examples(tokenizer, masking_for("supervised"), _numbered([(1, long), (3, short)]), **kwargs)
    assert both.passed and both.examples_checked == 2 and both.complete
    assert (both.examples_truncated, both.examples_without_trained_tokens) == (1, 1)
    # The preview is of the first example, its "5<|eot_id|>" trained.
    assert both.line == 1 and both.preview[0].trained_tokens == 2
    only_long = check_examples(
        tokenizer, masking_for("supervised"), _numbered([(1, long), (2, long)]), **kwargs
    )
    assert only_long.failure.check == "trained_tokens_after_truncation"
    # Checked in part, a file is never refused for what its first examples lose to truncation.
    part = check_examples(
        tokenizer, masking_for("supervised"), _numbered([(1, long), (2, short)]), limit=1, **kwargs
    )
    assert part.passed and not part.complete and part.examples_checked == 1


def test_a_file_whose_assistant_turns_all_have_weight_zero_is_refused_for_that(llama_backend):
    tokenizer = _with_template(llama_backend, LLAMA)
    context_only = {"messages": [*CHAT[:2], {**CHAT[2], "weight": 0}]}
    result = check_examples(
        tokenizer, masking_for("supervised"), _numbered([(1, context_only), (2, context_only)]),
        max_seq_length=512, train_on_inputs=False, stop_ids={tokenizer.eos_token_id},
    )  # fmt: skip
    assert result.failure.check == "trained_tokens" and "weight 0" in result.failure.problem
    assert "max_seq_length" not in result.failure.problem


def test_at_the_largest_max_seq_length_the_refusal_does_not_advise_raising_it(llama_backend):
    tokenizer = _with_template(llama_backend, LLAMA)
    long = {"messages": [{"role": "user", "content": "a b c d " * (MAX_SEQ_LENGTH // 2)}, CHAT[2]]}
    result = check_examples(
        tokenizer, masking_for("supervised"), _numbered([(1, long)]), max_seq_length=MAX_SEQ_LENGTH,
        train_on_inputs=False, stop_ids={tokenizer.eos_token_id},
    )  # fmt: skip
    assert result.failure.check == "trained_tokens_after_truncation"
    assert "raise max_seq_length" not in result.failure.problem
    assert f"{MAX_SEQ_LENGTH} is the largest max_seq_length" in result.failure.problem


def test_a_text_is_tokenized_only_as_far_as_max_seq_length_reaches(llama_backend):
    """A 2-million-character line is checked at the cost of what max_seq_length tokens can reach, and counts as
    truncated as it would whole."""
    tokenizer = _with_template(llama_backend, LLAMA)
    huge = "Hello there, how are you today? " * 62_500
    chars = text_chars_used(tokenizer, 64)
    assert chars < len(huge) // 10
    records = [
        (1, {"messages": [{"role": "user", "content": huge}, {"role": "assistant", "content": huge}]}),
        (2, {"prompt": huge, "completion": huge}),
    ]
    result = check_examples(
        tokenizer, masking_for("supervised"), _numbered(records), max_seq_length=64, train_on_inputs=False,
        stop_ids={tokenizer.eos_token_id},
    )  # fmt: skip
    assert result.examples_truncated == 2 and result.examples_without_trained_tokens == 2
    assert result.failure.check == "trained_tokens_after_truncation"
    # What was tokenized: the two cut texts and the template's tokens, never the whole line.
    assert result.preview[0].tokens <= 2 * chars + 64
    pairs = [(1, parse_preference_example({
        "input": {"messages": [{"role": "user", "content": huge}]},
        "preferred_output": [{"role": "assistant", "content": huge}],
        "non_preferred_output": [{"role": "assistant", "content": huge + "!"}],
    }))]  # fmt: skip
    checked = check_examples(
        tokenizer, masking_for("dpo"), pairs, max_seq_length=64, train_on_inputs=False,
        stop_ids={tokenizer.eos_token_id},
    )  # fmt: skip
    assert all(sequence.tokens <= 2 * chars + 64 for sequence in checked.preview)


def _renderings_of_a_check(tokenizer, monkeypatch, records, **kwargs) -> tuple[int, object]:
    calls = []
    render = type(tokenizer).apply_chat_template

    def counted(self, messages, *args, **render_kwargs):
        calls.append(len(messages))
        return render(self, messages, *args, **render_kwargs)

    monkeypatch.setattr(type(tokenizer), "apply_chat_template", counted)
    result = check_examples(tokenizer, masking_for(kwargs.pop("method", "supervised")), records, **kwargs)
    monkeypatch.undo()
    return len(calls), result


@pytest.mark.parametrize("weight_zero_turns", [False, True], ids=["trained-turns", "weight-0-turns"])
def test_a_line_of_many_short_messages_renders_what_max_seq_length_reaches(
    llama_backend, monkeypatch, weight_zero_turns
):
    """A chat of 20,000 short turns renders as often as one of 2,000, and each rendering as few messages: the
    prompt of every trained turn was rendered, costing the square of the message count. What counts is kept:
    the example is truncated, and its trained turns past max_seq_length still count as trained ones."""
    tokenizer = _with_template(llama_backend, LLAMA)
    kwargs = dict(max_seq_length=64, train_on_inputs=weight_zero_turns, stop_ids={tokenizer.eos_token_id})

    def line(turns: int) -> list[tuple[int, object]]:
        answer = {"role": "assistant", "content": "5", **({"weight": 0} if weight_zero_turns else {})}
        messages = [CHAT[1], answer] * (turns // 2) + [CHAT[1], {"role": "assistant", "content": "5"}]
        return _numbered([(1, {"messages": messages})])

    counts = {}
    for turns in (2_000, 20_000):
        counts[turns], result = _renderings_of_a_check(tokenizer, monkeypatch, line(turns), **kwargs)
        assert result.examples_truncated == 1 and result.examples_checked == 1
        if weight_zero_turns:
            assert result.passed and result.examples_without_trained_tokens == 0  # train_on_inputs
        else:
            assert result.examples_without_trained_tokens == 0 and result.preview[0].trained_tokens > 0
    assert counts[20_000] == counts[2_000] < 40, counts
    # Only its last turn trained, far past max_seq_length: refused for truncation, as the whole line was.
    last_only = [(1, {"messages": [*[CHAT[1], {**CHAT[2], "weight": 0}] * 10_000, CHAT[1], CHAT[2]]})]
    renderings, result = _renderings_of_a_check(
        tokenizer, monkeypatch, _numbered(last_only), **{**kwargs, "train_on_inputs": False}
    )
    assert result.failure.check == "trained_tokens_after_truncation" and renderings < 40


def test_a_conversation_that_fits_is_checked_whole(llama_backend, monkeypatch):
    tokenizer = _with_template(llama_backend, LLAMA)
    messages = [CHAT[0], *CHAT[1:3] * 40]  # 81 messages, about 900 tokens
    kwargs = dict(max_seq_length=4096, train_on_inputs=False, stop_ids={tokenizer.eos_token_id})
    _, result = _renderings_of_a_check(
        tokenizer, monkeypatch, _numbered([(1, {"messages": messages})]), **kwargs
    )
    assert result.passed and result.examples_truncated == 0
    assert result.preview[0].tokens == len(
        tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]
    )
    assert result.preview[0].trained_tokens == 2 * 40


def test_a_file_stops_at_its_first_failing_line(llama_backend):
    tokenizer = _with_template(llama_backend, LLAMA_MARKED_WITHOUT_EOT)
    nothing_trained = {"messages": [*CHAT[:2], {**CHAT[2], "weight": 0}]}
    records = [(1, nothing_trained), (2, {"messages": CHAT}), (4, {"messages": CHAT})]
    result = check_examples(
        tokenizer, masking_for("supervised"), _numbered(records), max_seq_length=512, train_on_inputs=False,
        stop_ids={tokenizer.eos_token_id},
    )  # fmt: skip
    assert result.failure.check == "end_of_turn_trained" and result.line == 2 and result.examples_checked == 2
    assert "⟦5⟧<|eot_id|>" in marked_text(result.preview)


def test_a_method_without_assistant_targets_has_no_check(monkeypatch):
    assert {name: masking_for(name) is not None for name in ("supervised", "dpo", "simpo")} == dict.fromkeys(
        ("supervised", "dpo", "simpo"), True
    )
    prompts_only = ExampleFormat(
        "prompts-only", lambda record: record, lambda example: 1, lambda record: False
    )
    monkeypatch.setitem(methods.METHODS, "sampled", methods.Method("sampled", "prompts only", prompts_only))
    assert masking_for("sampled") is None and masking_for("no-such-method") is None
    assert SUPERVISED.name == "supervised"


# ---- the bundled demo data ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, method",
    [
        (assets.TRAIN_FILE, "supervised"),
        (assets.VALID_FILE, "supervised"),
        (assets.PREFERENCE_FILE, "dpo"),
        (assets.PREFERENCE_FILE, "simpo"),
        (task.TRAIN_FILE, "supervised"),
        (task.HELD_OUT_FILE, "supervised"),
    ],
)
def test_the_bundled_demo_data_passes(path, method, demo_tokenizers):
    tokenizer = demo_tokenizers[path.name.startswith("digits")]
    parse = methods.METHODS[method].example_format.parse
    lines = [(n, parse(json.loads(line))) for n, line in enumerate(path.read_text().splitlines(), 1)]
    result = check_examples(
        tokenizer, masking_for(method), lines, max_seq_length=512, train_on_inputs=False,
        stop_ids={tokenizer.eos_token_id},
    )  # fmt: skip
    assert result.passed, result.failure
    assert result.complete and result.examples_checked == len(lines)
    assert result.examples_without_trained_tokens == 0
    assert all(text.endswith("<|eot|>⟧") for text in marked_text(result.preview).splitlines()[-1:])


@pytest.fixture(scope="module")
def demo_tokenizers():
    """The demo's tokenizers: the arithmetic files' (False) and the digits task's (True), as the demo builds them."""
    return {False: assets.build_tokenizer(), True: assets.build_tokenizer(task.bundled_examples()[0])}


# ---- the API's side: no torch ------------------------------------------------------------------------------------


def _transformers_tokenizers_import_torch() -> bool:
    """Whether importing transformers' fast-tokenizer module alone imports torch: transformers 5.17 (the GPU
    image's) does, through its GGUF helpers (modeling_gguf_pytorch_utils imports torch at module level whenever
    it is installed); 5.24 (the lock's) does not. fusetune cannot keep torch out of a process where its tokenizer
    library brings it in."""
    probe = "import sys, transformers.tokenization_utils_tokenizers; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", probe], check=True, cwd=REPO, capture_output=True, text=True
    )
    return result.stdout.strip() == "True"


def test_the_check_loads_the_tokenizer_and_runs_without_torch(tmp_path, llama_backend):
    tokenizer = _with_template(llama_backend, LLAMA_MARKED_WITHOUT_EOT)
    tokenizer.save_pretrained(tmp_path)
    # With a transformers that imports torch itself, the check must still work; only the absence is not ours.
    expect_no_torch = not _transformers_tokenizers_import_torch()
    code = f"""
import sys
from fusetune.spec.examples import ChatExample
from fusetune.tokenization.check import check_examples, masking_for
from fusetune.tokenization.tokenizer import load_tokenizer_without_torch, stop_token_ids
tokenizer = load_tokenizer_without_torch({str(tmp_path)!r})
result = check_examples(tokenizer, masking_for("supervised"), [(1, ChatExample({CHAT!r}))], max_seq_length=64,
                        train_on_inputs=False, stop_ids=stop_token_ids(tokenizer, {str(tmp_path)!r}))
assert result.failure.check == "end_of_turn_trained", result.failure
assert "torch" not in sys.modules or not {expect_no_torch}, "torch was imported"
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
    assert load_tokenizer_without_torch(tmp_path / "missing") is None
    assert (
        mask_conversation(load_tokenizer_without_torch(tmp_path), CHAT).input_ids
        == mask_conversation(tokenizer, CHAT).input_ids
    )
