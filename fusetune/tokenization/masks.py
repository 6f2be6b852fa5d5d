"""An example as token ids and a loss mask (which tokens are trained), through the model's own tokenizer.

A chat goes through the model's chat template. Which of its tokens are trained comes from the template's
`{% generation %}` blocks when it has one per assistant message, and otherwise from rendering the conversation
turn by turn. Either way the mask is held against what serving would produce (`Completion`): the model is asked
with the conversation before an assistant turn rendered with the generation prompt
(`apply_chat_template(messages[:i], add_generation_prompt=True)`) and generates until a stop token, so a turn's
trained tokens should be exactly what follows that prompt in the rendered conversation, through the first stop
token. What the template renders after the stop token (ChatML's newline) is never generated, so never trained.
`fusetune.tokenization.check` says whether a mask holds to that.

No torch here: the API runs the same masking on a job's files before it accepts the job.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from fusetune.spec.examples import ChatExample, PromptCompletionExample, SupervisedExample

_GENERATION_BLOCK = re.compile(r"{%-?\s*generation\s*-?%}")


class TemplateError(ValueError):
    """The chat template failed on an example, or the model has none."""


@dataclass(frozen=True)
class Completion:
    """What the model would generate for one trained target when served: tokens [start, end) of the sequence.
    `start` is where the served prompt ends; `end` is one past the first stop token after it, or the end of the
    turn's rendering when the template puts no stop token there (`has_stop` False)."""

    what: str  # what it is, for messages: "messages[2] (assistant)", "the completion"
    start: int
    end: int
    has_stop: bool


@dataclass(frozen=True)
class MaskedTokens:
    """One sequence of an example: its tokens, which are trained, and the served completions its trained
    targets should equal. `served_problem` says why the served completions could not be found (the template
    renders a turn differently from its generation prompt); the mask is then not checked against them."""

    input_ids: list[int]
    trained: list[bool]
    completions: list[Completion]
    train_on_inputs: bool = False
    served_problem: str | None = None

    def trained_tokens_within(self, max_seq_length: int) -> int:
        """Trained tokens left after truncation to `max_seq_length` (the first token is never a target)."""
        return sum(self.trained[1:max_seq_length])


def default_stop_ids(tokenizer: Any) -> frozenset[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return frozenset() if eos is None else frozenset([eos])


def _template_text(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: apply_chat_template uses "default"
        template = template.get("default")
    return template if isinstance(template, str) else ""


def _render_ids(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    try:
        encoded = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)
    except Exception as exc:  # a template may raise on content it does not accept (role order, say)
        if not _template_text(tokenizer):
            raise TemplateError(
                "the model has no chat template, so chats cannot be rendered (use prompt/completion lines)"
            ) from exc
        raise TemplateError(f"the chat template failed: {exc}") from exc
    return list(encoded["input_ids"])


def _runs_of_ones(mask: Sequence[int]) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, value in enumerate([*mask, 0]):
        if value and start is None:
            start = i
        elif not value and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _is_trained(message: dict[str, Any]) -> bool:
    return message["role"] == "assistant" and message.get("weight", 1) != 0


def _served_completions(
    tokenizer: Any, messages: list[dict[str, Any]], input_ids: list[int], stop_ids: Collection[int]
) -> tuple[list[Completion], str | None]:
    """Each trained assistant turn as serving would produce it, in the coordinates of `input_ids`: its prompt
    (the conversation before it, with the generation prompt) must be what precedes it, and the turn must come out
    the same rendered alone as with later turns after it. Returns the completions, or why they cannot be found."""
    completions = []
    for index, message in enumerate(messages):
        if not _is_trained(message):
            continue
        what = f"messages[{index}] (assistant)"
        prompt = _render_ids(tokenizer, messages[:index], add_generation_prompt=True)
        # The conversation through this turn (for its last message, the whole rendering already at hand).
        last = index == len(messages) - 1
        through = input_ids if last else _render_ids(tokenizer, messages[: index + 1])
        if through[: len(prompt)] != prompt:
            same = next(
                (i for i, (a, b) in enumerate(zip(prompt, through, strict=False)) if a != b), len(through)
            )
            return completions, (
                f"{what}: the template renders the turn differently from the prompt the model is served with "
                f"(add_generation_prompt=True): served, the prompt reads {_quoted_tail(tokenizer, prompt, same)}; "
                f"in training, the conversation reads {_quoted_tail(tokenizer, through, same)}"
            )
        if input_ids[: len(through)] != through:
            return completions, (
                f"{what}: the template renders this turn differently once later messages follow it, so what is "
                "trained is not what the model generates when served (train one assistant turn per example, or "
                "give the earlier ones weight 0)"
            )
        start = len(prompt)
        stop = next((i for i in range(start, len(through)) if through[i] in stop_ids), None)
        end = stop + 1 if stop is not None else len(through)
        completions.append(Completion(what, start, end, stop is not None))
    return completions, None


def _quoted_tail(tokenizer: Any, ids: list[int], differs_at: int, chars: int = 30) -> str:
    """The text around where two renderings part: "…'<|im_start|>assistant\\n' then '<think>\\n\\n'"."""
    before = tokenizer.decode(ids[max(0, differs_at - chars) : differs_at], skip_special_tokens=False)
    after = tokenizer.decode(ids[differs_at : differs_at + chars], skip_special_tokens=False)
    before, after = before[-chars:], after[:chars]
    return f"…{before!r} then {after!r}" if after else f"…{before!r}, where it ends"


def mask_conversation(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    train_on_inputs: bool = False,
    stop_ids: Collection[int] | None = None,
) -> MaskedTokens:
    """A conversation through its chat template. Trained: every assistant message but those of weight 0 (all
    other tokens too with `train_on_inputs`). Raises TemplateError when the template fails on it."""
    stop_ids = default_stop_ids(tokenizer) if stop_ids is None else stop_ids
    n_assistant = sum(message["role"] == "assistant" for message in messages)
    marked_spans = None
    if _GENERATION_BLOCK.search(_template_text(tokenizer)):
        try:
            encoded = tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
        except Exception as exc:
            raise TemplateError(f"the chat template failed: {exc}") from exc
        input_ids = list(encoded["input_ids"])
        spans = _runs_of_ones(encoded["assistant_masks"])
        # One block per assistant message is the usual case; otherwise (an empty block, say) the blocks cannot
        # be matched to messages, and the turns' served form decides what is trained.
        if len(spans) == n_assistant:
            marked_spans = spans
    else:
        input_ids = _render_ids(tokenizer, messages)
    completions, served_problem = _served_completions(tokenizer, messages, input_ids, stop_ids)
    trained = [train_on_inputs] * len(input_ids)
    if marked_spans is not None:
        assistant = [message for message in messages if message["role"] == "assistant"]
        for (start, end), message in zip(marked_spans, assistant, strict=True):
            trained[start:end] = [_is_trained(message)] * (end - start)
    else:
        if train_on_inputs:
            weight_zero, problem = _weight_zero_spans(tokenizer, messages, input_ids)
            served_problem = served_problem or problem
            for start, end in weight_zero:
                trained[start:end] = [False] * (end - start)
        for completion in completions:
            trained[completion.start : completion.end] = [True] * (completion.end - completion.start)
    return MaskedTokens(input_ids, trained, completions, train_on_inputs, served_problem)


def _weight_zero_spans(
    tokenizer: Any, messages: list[dict[str, Any]], input_ids: list[int]
) -> tuple[list[tuple[int, int]], str | None]:
    """With `train_on_inputs`, the tokens of assistant messages of weight 0, which stay untrained: what each adds
    to the rendering after its generation prompt (templates without generation blocks); or why they cannot be
    found."""
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant" or message.get("weight", 1) != 0:
            continue
        prompt = _render_ids(tokenizer, messages[:index], add_generation_prompt=True)
        through = _render_ids(tokenizer, messages[: index + 1])
        if through[: len(prompt)] != prompt or input_ids[: len(through)] != through:
            return spans, (
                f"messages[{index}] (assistant, weight 0): the template does not render the conversation as "
                "its turns one after another, so this turn's tokens cannot be told apart to leave them untrained"
            )
        spans.append((len(prompt), len(through)))
    return spans, None


def _text_ids(tokenizer: Any, text: str, *, starts_sequence: bool) -> list[int]:
    # The tokenizer's special tokens (a BOS, for most models) belong at the start of the sequence only.
    return list(tokenizer(text, add_special_tokens=starts_sequence)["input_ids"])


def _with_eos(tokenizer: Any, ids: list[int]) -> list[int]:
    eos = tokenizer.eos_token_id
    return ids + [eos] if eos is not None and (not ids or ids[-1] != eos) else ids


def mask_example(
    tokenizer: Any,
    example: SupervisedExample,
    train_on_inputs: bool = False,
    stop_ids: Collection[int] | None = None,
) -> MaskedTokens:
    """Any supervised example. Plain-text formats end with the end-of-sequence token, trained, so the model
    learns where a completion stops; a text's every token is trained, and it has no prompt to check."""
    if isinstance(example, ChatExample):
        return mask_conversation(tokenizer, example.messages, train_on_inputs, stop_ids)
    stop_ids = default_stop_ids(tokenizer) if stop_ids is None else stop_ids
    if isinstance(example, PromptCompletionExample):
        prompt_ids = _text_ids(tokenizer, example.prompt, starts_sequence=True)
        completion_ids = _with_eos(tokenizer, _text_ids(tokenizer, example.completion, starts_sequence=False))
        input_ids = prompt_ids + completion_ids
        trained = [train_on_inputs] * len(prompt_ids) + [True] * len(completion_ids)
        completion = Completion("the completion", len(prompt_ids), len(input_ids), input_ids[-1] in stop_ids)
        return MaskedTokens(input_ids, trained, [completion], train_on_inputs)
    input_ids = _with_eos(tokenizer, _text_ids(tokenizer, example.text, starts_sequence=True))
    return MaskedTokens(input_ids, [True] * len(input_ids), [], train_on_inputs=True)
