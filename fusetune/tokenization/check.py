"""The data check: a job's examples tokenized and masked as the trainer will, refused when the mask is silently
wrong, before any GPU time is spent.

Each example's sequences (`masks.MaskedTokens`) are held against what serving produces (`masks.Completion`):

- `chat_template`: the model's chat template renders the example (it exists, and does not raise on it);
- `end_of_turn_trained`: every trained assistant turn, and every completion, ends with a stop token of the model
  (its tokenizer's eos or generation_config.json's eos_token_id), and that token is trained, so the model learns
  to stop;
- `prompt_not_trained`: no token outside the assistant's completions is trained, unless `train_on_inputs`;
- `served_form`: each trained turn is exactly what the model generates when served, the prompt rendered with
  `add_generation_prompt=True` followed by the completion and its stop token: the prompt's rendering is what
  precedes the turn, and every token of the completion is trained;
- `trained_tokens`: a file has at least one trained token (an example whose assistant messages all have weight 0
  trains nothing), and is refused when no example has one;
- `trained_tokens_after_truncation`: examples cut by `max_seq_length` to no trained token are counted, and a file
  where every example is so cut is refused.

The work is bounded by `max_seq_length`: each text of an example (a message's content, a prompt, a completion) is
cut, before it is tokenized, to what the first `max_seq_length` tokens can reach (`text_chars_used`), so a line of
megabytes costs what its first tokens cost; a conversation of many messages is cut to those that start within
`max_seq_length` tokens (`messages_within`), so a line of 100,000 short messages costs what those few cost.

Which sequences an example makes is its line format's (`FormatMasking`, one per format in `MASKINGS`): a
supervised example is one sequence, a preference pair two (the input with each output; the input's own
assistant turns are context, never trained). A method whose format has no entry (one trained on prompts alone,
with no assistant targets) has no check.

A failure names the check and the line, and the example is shown as the model sees it with its trained spans
between ⟦ and ⟧ (`preview`, `marked_text`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from fusetune.spec.examples import (
    PREFERENCE,
    SUPERVISED,
    ChatExample,
    PreferenceExample,
    PromptCompletionExample,
    TextExample,
)
from fusetune.spec.hyperparameters import MAX_SEQ_LENGTH
from fusetune.spec.methods import METHODS
from fusetune.tokenization.masks import MaskedTokens, TemplateError, mask_conversation, mask_example

CHECKS = {
    "chat_template": "the model's chat template renders every example",
    "end_of_turn_trained": "every trained assistant turn ends with a stop token of the model, and it is trained",
    "prompt_not_trained": "no prompt token is trained (unless train_on_inputs)",
    "served_form": "each trained turn is what the model generates when served: the prompt rendered with the "
    "generation prompt, then the completion and its stop token",
    "trained_tokens": "some example has a trained token: an assistant message whose weight is not 0",
    "trained_tokens_after_truncation": "examples cut by max_seq_length to no trained token are counted; a file of "
    "only such examples is refused",
}
CheckName = Literal[
    "chat_template",
    "end_of_turn_trained",
    "prompt_not_trained",
    "served_form",
    "trained_tokens",
    "trained_tokens_after_truncation",
]
TRAINED_OPEN, TRAINED_CLOSE = "⟦", "⟧"
# A preview stays readable and an error stays small however long the example: each stretch of trained or
# untrained text keeps its start and its end, and long conversations their first stretches.
PREVIEW_SEGMENT_CHARS = 600
PREVIEW_SEGMENTS = 40


@dataclass(frozen=True)
class LabeledSequence:
    label: str  # "example"; a preference pair's "preferred_output" and "non_preferred_output"
    masked: MaskedTokens


class DataCheckFailure(ValueError):
    """An example that fails a check: which check, what is wrong, and its sequences (None when the template could
    not render it)."""

    def __init__(self, check: CheckName, problem: str, sequences: list[LabeledSequence] | None) -> None:
        super().__init__(f"the data check '{check}' failed: {problem}")
        self.check = check
        self.problem = problem
        self.sequences = sequences


# ---- the sequences of each line format -------------------------------------------------------------------------


@dataclass(frozen=True)
class FormatMasking:
    """How the examples of one line format become the sequences trained on, each with its loss mask:
    (tokenizer, example, train_on_inputs, stop token ids) -> sequences; and the example with each of its texts
    cut to at most so many characters and its conversation's messages cut by a function of them: (example,
    characters, messages -> messages) -> example."""

    sequences: Callable[[Any, Any, bool, Collection[int]], list[LabeledSequence]]
    cut_texts: Callable[[Any, int, Callable[[list], list]], Any]


def _supervised_sequences(
    tokenizer: Any, example: Any, train_on_inputs: bool, stop_ids: Collection[int]
) -> list[LabeledSequence]:
    return [LabeledSequence("example", mask_example(tokenizer, example, train_on_inputs, stop_ids))]


def _preference_sequences(
    tokenizer: Any, example: PreferenceExample, train_on_inputs: bool, stop_ids: Collection[int]
) -> list[LabeledSequence]:
    """The input with the preferred output, and with the other. The input's own assistant turns are context
    (weight 0); only the output is trained, whatever `train_on_inputs`."""
    prompt = [
        {**message, "weight": 0} if message["role"] == "assistant" else message
        for message in example.messages
    ]
    return [
        LabeledSequence(label, mask_conversation(tokenizer, [*prompt, output], stop_ids=stop_ids))
        for label, output in (
            ("preferred_output", example.preferred),
            ("non_preferred_output", example.non_preferred),
        )
    ]


def _cut_message(message: dict[str, Any], chars: int) -> dict[str, Any]:
    content = message.get("content")
    return (
        {**message, "content": content[:chars]}
        if isinstance(content, str) and len(content) > chars
        else message
    )


def _cut_supervised(example: Any, chars: int, cut_messages: Callable[[list], list]) -> Any:
    if isinstance(example, ChatExample):
        return ChatExample(cut_messages([_cut_message(message, chars) for message in example.messages]))
    if isinstance(example, PromptCompletionExample):
        return PromptCompletionExample(example.prompt[:chars], example.completion[:chars])
    return TextExample(example.text[:chars])


def _cut_preference(
    example: PreferenceExample, chars: int, cut_messages: Callable[[list], list]
) -> PreferenceExample:
    return PreferenceExample(
        cut_messages([_cut_message(message, chars) for message in example.messages]),
        _cut_message(example.preferred, chars),
        _cut_message(example.non_preferred, chars),
    )


MASKINGS: dict[str, FormatMasking] = {
    SUPERVISED.name: FormatMasking(_supervised_sequences, _cut_supervised),
    PREFERENCE.name: FormatMasking(_preference_sequences, _cut_preference),
}

# A normalizer may join a few characters into one before the vocabulary sees them (NFC joins a letter and its
# combining accent, Hangul jamo join three into one syllable).
CHARACTERS_PER_NORMALIZED_CHARACTER = 4


def text_chars_used(tokenizer: Any, max_seq_length: int) -> int:
    """How many characters of one text the first `max_seq_length` tokens of a sequence can reach. No token stands
    for more characters of the text than its vocabulary entry has (a byte-level entry's characters stand for one
    byte each, a SentencePiece piece's for one character each), times what a normalizer joins into one. A text cut
    there keeps the tokens within `max_seq_length` as they were, and still reaches past it when the whole did."""
    longest_entry = max(map(len, tokenizer.get_vocab()), default=1)
    return max_seq_length * longest_entry * CHARACTERS_PER_NORMALIZED_CHARACTER


# A conversation of up to so many messages is checked whole; one of more is first cut to the messages that start
# within max_seq_length tokens (`messages_within`), which costs a few renderings of its start.
MESSAGES_CHECKED_WHOLE = 32


def _rendered_tokens(tokenizer: Any, messages: list[dict[str, Any]]) -> int | None:
    try:
        return len(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
    except Exception:  # the check proper names the template's failure
        return None


def messages_within(
    tokenizer: Any, messages: list[dict[str, Any]], max_seq_length: int, train_on_inputs: bool
) -> list[dict[str, Any]]:
    """The messages of a conversation that start within its first `max_seq_length` tokens: its first k, where the
    rendering of k messages is the shortest longer than `max_seq_length` (found by doubling, then halving, so a
    few renderings of the start), and through its first trained assistant turn (with `train_on_inputs` every
    message is trained). Rendering each trained turn's
    prompt costs as much as the conversation before it, so a line of 100,000 short messages would cost the
    square; what starts past `max_seq_length` is never trained, and the cut conversation is as truncated, and
    as trained, as the whole. A conversation that fits is returned whole."""
    if len(messages) <= MESSAGES_CHECKED_WHOLE:
        return messages
    fits, longer = 0, MESSAGES_CHECKED_WHOLE  # the rendering of `fits` messages is within max_seq_length
    while True:
        tokens = _rendered_tokens(tokenizer, messages[:longer])
        if tokens is None or (longer == len(messages) and tokens <= max_seq_length):
            return messages
        if tokens > max_seq_length:
            break
        fits, longer = longer, min(2 * longer, len(messages))
    while longer - fits > 1:
        middle = (fits + longer) // 2
        tokens = _rendered_tokens(tokenizer, messages[:middle])
        if tokens is None:
            return messages
        fits, longer = (middle, longer) if tokens <= max_seq_length else (fits, middle)
    first_trained = next(
        (i for i, m in enumerate(messages) if m["role"] == "assistant" and m.get("weight", 1) != 0), 0
    )
    if train_on_inputs:
        first_trained = 0
    return messages[: max(longer, first_trained + 1)]


def masking_for(method_type: str) -> FormatMasking | None:
    """The masking of a method's line format, or None: a method whose examples have no assistant targets has no
    data check."""
    method = METHODS.get(method_type)
    return MASKINGS.get(method.example_format.name) if method is not None else None


# ---- the checks --------------------------------------------------------------------------------------------------


def _token_text(tokenizer: Any, token_id: int) -> str:
    return repr(tokenizer.decode([token_id], skip_special_tokens=False))


def _stop_names(tokenizer: Any, stop_ids: Collection[int]) -> str:
    if not stop_ids:
        return "this model has no stop token: neither its tokenizer nor generation_config.json names an eos"
    return "this model stops at " + ", ".join(_token_text(tokenizer, i) for i in sorted(stop_ids))


def sequence_problem(
    tokenizer: Any, masked: MaskedTokens, stop_ids: Collection[int]
) -> tuple[CheckName, str] | None:
    """The first check one sequence fails, with what is wrong, or None."""
    if masked.served_problem is not None:
        return "served_form", masked.served_problem
    expected = [False] * len(masked.input_ids)
    for completion in masked.completions:
        expected[completion.start : completion.end] = [True] * (completion.end - completion.start)
    for completion in masked.completions:
        if not completion.has_stop:
            return "end_of_turn_trained", (
                f"{completion.what} ends without a stop token, so the model never learns to stop after it "
                f"({_stop_names(tokenizer, stop_ids)}; the template drops the end-of-turn token, or it is not "
                "the model's eos)"
            )
        if not masked.trained[completion.end - 1]:
            return "end_of_turn_trained", (
                f"{completion.what}: its stop token "
                f"{_token_text(tokenizer, masked.input_ids[completion.end - 1])} (token {completion.end - 1}) is "
                "not trained, so the model never learns to stop after it"
            )
    if not masked.train_on_inputs:
        wrong = [
            i
            for i, (trained, wanted) in enumerate(zip(masked.trained, expected, strict=True))
            if trained and not wanted
        ]
        if wrong:
            return "prompt_not_trained", (
                f"{len(wrong)} token(s) outside the assistant's completions are trained, the first "
                f"{_token_text(tokenizer, masked.input_ids[wrong[0]])} (token {wrong[0]}): prompt tokens are "
                "trained only with train_on_inputs"
            )
    for completion in masked.completions:
        untrained = [i for i in range(completion.start, completion.end) if not masked.trained[i]]
        if untrained:
            return "served_form", (
                f"{completion.what}: {len(untrained)} token(s) of what the model generates when served are not "
                f"trained, the first {_token_text(tokenizer, masked.input_ids[untrained[0]])} "
                f"(token {untrained[0]})"
            )
    return None


def checked_sequences(
    masking: FormatMasking,
    tokenizer: Any,
    example: Any,
    *,
    train_on_inputs: bool,
    stop_ids: Collection[int],
) -> list[LabeledSequence]:
    """An example's sequences with their masks; raises DataCheckFailure when the template fails on it or one
    of its sequences fails a check."""
    try:
        sequences = masking.sequences(tokenizer, example, train_on_inputs, stop_ids)
    except TemplateError as exc:
        raise DataCheckFailure("chat_template", str(exc), None) from exc
    for sequence in sequences:
        found = sequence_problem(tokenizer, sequence.masked, stop_ids)
        if found is not None:
            check, problem = found
            where = f"{sequence.label}: " if len(sequences) > 1 else ""
            raise DataCheckFailure(check, where + problem, sequences)
    return sequences


# ---- the preview -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PreviewSegment:
    text: str
    trained: bool


@dataclass(frozen=True)
class PreviewSequence:
    label: str
    tokens: int
    trained_tokens: int
    segments: list[PreviewSegment]


def _shortened(text: str) -> str:
    if len(text) <= PREVIEW_SEGMENT_CHARS:
        return text
    half = PREVIEW_SEGMENT_CHARS // 2
    return f"{text[:half]} … ({len(text) - 2 * half:,} characters) … {text[-half:]}"


def preview(tokenizer: Any, sequences: list[LabeledSequence]) -> list[PreviewSequence]:
    """Each sequence as text, cut into its trained and untrained stretches (each decoded on its own)."""
    previews = []
    for sequence in sequences:
        ids, trained = sequence.masked.input_ids, sequence.masked.trained
        segments = []
        start = 0
        for end in range(1, len(ids) + 1):
            if end == len(ids) or trained[end] != trained[start]:
                text = tokenizer.decode(ids[start:end], skip_special_tokens=False)
                segments.append(PreviewSegment(_shortened(text), trained[start]))
                start = end
        if len(segments) > PREVIEW_SEGMENTS:
            left_out = len(segments) - PREVIEW_SEGMENTS
            segments = [
                *segments[:PREVIEW_SEGMENTS],
                PreviewSegment(f" … ({left_out} more stretches)", False),
            ]
        previews.append(PreviewSequence(sequence.label, len(ids), sum(trained), segments))
    return previews


def marked_text(previews: list[PreviewSequence]) -> str:
    """The previews as one text, trained stretches between ⟦ and ⟧ (a preference pair's sides each labelled)."""
    parts = []
    for sequence in previews:
        text = "".join(
            f"{TRAINED_OPEN}{segment.text}{TRAINED_CLOSE}" if segment.trained else segment.text
            for segment in sequence.segments
        )
        parts.append(text if len(previews) == 1 else f"[{sequence.label}] {text}")
    return "\n".join(parts)


def failure_message(tokenizer: Any, failure: DataCheckFailure, where: str) -> str:
    """What a refused job's error says: where, which check, what is wrong, and the example with its trained spans
    marked."""
    message = f"{where}: the data check '{failure.check}' failed: {failure.problem}."
    if failure.sequences:
        message += (
            f"\nThe example as the model sees it, trained tokens between {TRAINED_OPEN} and {TRAINED_CLOSE}:\n"
            + marked_text(preview(tokenizer, failure.sequences))
        )
    return message


# ---- a file's examples -------------------------------------------------------------------------------------------


@dataclass
class FileCheck:
    """The check of one file's examples, as far as it went: the first failure (check, problem, line) or none; the
    preview of the failing example, else of the first; the counts of truncated examples and of those left with no
    trained token."""

    examples_checked: int = 0
    complete: bool = True  # whether every example of the file was checked
    examples_truncated: int = 0
    examples_without_trained_tokens: int = 0
    failure: DataCheckFailure | None = None
    line: int | None = None  # of the failure, else of the previewed example
    preview: list[PreviewSequence] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.failure is None


def check_examples(
    tokenizer: Any,
    masking: FormatMasking,
    numbered_examples: Iterable[tuple[int, Any]],
    *,
    max_seq_length: int,
    train_on_inputs: bool,
    stop_ids: Collection[int],
    limit: int | None = None,
) -> FileCheck:
    """Checks (line number, example) pairs in order, at most `limit`, stopping at the first failure. Each text is
    cut to what `max_seq_length` tokens can reach before it is tokenized, and a long conversation to the
    messages that start within them."""
    result = FileCheck()
    first: tuple[int, list[LabeledSequence]] | None = None
    chars = text_chars_used(tokenizer, max_seq_length)
    examples_with_trained_tokens = 0
    for line, example in numbered_examples:
        if limit is not None and result.examples_checked >= limit:
            result.complete = False
            break
        result.examples_checked += 1
        try:
            sequences = checked_sequences(
                masking,
                tokenizer,
                masking.cut_texts(
                    example,
                    chars,
                    lambda messages: messages_within(tokenizer, messages, max_seq_length, train_on_inputs),
                ),
                train_on_inputs=train_on_inputs,
                stop_ids=stop_ids,
            )
        except DataCheckFailure as failure:
            result.failure, result.line = failure, line
            result.preview = preview(tokenizer, failure.sequences) if failure.sequences else []
            result.complete = False
            return result
        if first is None:
            first = (line, sequences)
        result.examples_truncated += any(len(s.masked.input_ids) > max_seq_length for s in sequences)
        result.examples_without_trained_tokens += any(
            s.masked.trained_tokens_within(max_seq_length) == 0 for s in sequences
        )
        examples_with_trained_tokens += all(any(s.masked.trained) for s in sequences)
    if first is not None:
        result.line, result.preview = first[0], preview(tokenizer, first[1])
        if result.complete and examples_with_trained_tokens == 0:
            result.failure = DataCheckFailure(
                "trained_tokens",
                "no example of the file has a trained token: every assistant message has weight 0, which "
                "makes it context only (give the turns to learn weight 1, or leave weight out)",
                first[1],
            )
        elif result.complete and result.examples_without_trained_tokens == result.examples_checked:
            remedy = (
                "raise max_seq_length, or shorten the prompts"
                if max_seq_length < MAX_SEQ_LENGTH
                else f"shorten the prompts: {MAX_SEQ_LENGTH} is the largest max_seq_length"
            )
            result.failure = DataCheckFailure(
                "trained_tokens_after_truncation",
                f"every example of the file is cut by max_seq_length={max_seq_length} to no trained token "
                f"({remedy})",
                first[1],
            )
    return result
