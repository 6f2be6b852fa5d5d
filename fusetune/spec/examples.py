"""The line formats of training files: how one decoded JSONL record becomes an example, or why it cannot.

The API checks an upload line by line with these parsers and the trainer reads the file with the same ones, so
a file the API accepts is a file the trainer can read. No torch here. A training method names its format in
the method table (fusetune/spec/methods.py); several methods may share one (DPO and SimPO read preference
pairs).

- "supervised": `{"messages": [...]}`, an OpenAI-style chat (system, user, assistant, tool); an
  assistant message with `"weight": 0` is not trained on; an assistant message that only calls tools
  (`tool_calls`) may have null content. Also `{"prompt": str, "completion": str}` and `{"text": str}`, which
  may be mixed with chats in one file.
- "preference": as in the OpenAI fine-tuning API, `{"input": {"messages": [...]}, "preferred_output":
  [{"role": "assistant", "content": ...}], "non_preferred_output": [...]}`. The input's last message is not
  the assistant's (the outputs answer it); each output is exactly one assistant message; the two differ.
- "reinforcement": as in the OpenAI fine-tuning API, `{"messages": [...], ...}`: the messages are the prompt,
  whose last message is not the assistant's (the model samples the answer), and the other keys (at least one)
  are the reference fields a grader reads as `{{ item.<key> }}` (the whole line is the grader's `item`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

OUTPUT_KEYS = ("preferred_output", "non_preferred_output")

CHAT_ROLES = ("system", "user", "assistant", "tool")


# One frozen record per form of a supervised line, each only its fields: alike in shape to others, sharing nothing.
@dataclass(frozen=True)
class ChatExample:
    messages: list[dict[str, Any]]


@dataclass(frozen=True)
class PromptCompletionExample:
    prompt: str
    completion: str


@dataclass(frozen=True)
class TextExample:
    text: str


SupervisedExample = ChatExample | PromptCompletionExample | TextExample


# A bad value is quoted back in the error, cut to this many characters (a 100 KB value would make a 100 KB error).
QUOTED_VALUE_CHARS = 60


def _quoted(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return (
        text
        if len(text) <= QUOTED_VALUE_CHARS
        else f"{text[:QUOTED_VALUE_CHARS]}... ({len(text):,} characters)"
    )


def check_messages(messages: Any, needs_assistant: bool = True) -> str | None:
    """What is wrong with a chat's `messages`, or None."""
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list"
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"messages[{index}] must be an object"
        role = message.get("role")
        if role not in CHAT_ROLES:
            return f"messages[{index}].role must be one of {', '.join(CHAT_ROLES)} (got {_quoted(role)})"
        content = message.get("content")
        # An assistant turn that only calls tools has no content (OpenAI sends null).
        calls_tools = (
            role == "assistant" and isinstance(message.get("tool_calls"), list) and message["tool_calls"]
        )
        if not isinstance(content, str) and not (calls_tools and content is None):
            return f"messages[{index}].content must be a string"
        if message.get("weight", 1) not in (0, 1):
            return f"messages[{index}].weight must be 0 or 1 (got {_quoted(message['weight'])})"
    if needs_assistant and not any(message["role"] == "assistant" for message in messages):
        return "needs at least one assistant message to learn from"
    return None


def parse_supervised_example(record: Any) -> SupervisedExample:
    """One JSONL record as an example; raises ValueError saying what is wrong with it."""
    if not isinstance(record, dict):
        raise ValueError("expected a JSON object with 'messages', 'prompt' and 'completion', or 'text'")
    if "messages" in record:
        problem = check_messages(record["messages"])
        if problem:
            raise ValueError(problem)
        return ChatExample(record["messages"])
    if "prompt" in record or "completion" in record:
        prompt, completion = record.get("prompt"), record.get("completion")
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise ValueError("'prompt' and 'completion' must both be strings")
        if not completion:
            raise ValueError("'completion' must not be empty")
        return PromptCompletionExample(prompt, completion)
    if "text" in record:
        if not isinstance(record["text"], str) or not record["text"]:
            raise ValueError("'text' must be a non-empty string")
        return TextExample(record["text"])
    raise ValueError("expected a non-empty 'messages' list, a 'prompt' and a 'completion', or a 'text'")


@dataclass(frozen=True)
class PreferenceExample:
    messages: list[dict[str, Any]]  # the input, ending before the assistant's answer
    preferred: dict[str, Any]
    non_preferred: dict[str, Any]


def _output_message(record: dict[str, Any], key: str) -> dict[str, Any]:
    output = record[key]
    if not isinstance(output, list) or len(output) != 1:
        count = len(output) if isinstance(output, list) else "not a list"
        raise ValueError(f"'{key}' must be a list of exactly one assistant message (got {count})")
    message = output[0]
    if not isinstance(message, dict) or message.get("role") != "assistant":
        role = message.get("role") if isinstance(message, dict) else None
        raise ValueError(f"'{key}' must hold an assistant message (got role {json.dumps(role)})")
    if not isinstance(message.get("content"), str) or not message["content"]:
        raise ValueError(f"'{key}'[0].content must be a non-empty string")
    return {"role": "assistant", "content": message["content"]}


def parse_preference_example(record: Any) -> PreferenceExample:
    """One JSONL record as a preference pair; raises ValueError saying what is wrong with it."""
    if not isinstance(record, dict):
        raise ValueError("expected a JSON object with 'input', 'preferred_output' and 'non_preferred_output'")
    missing = [key for key in ("input", *OUTPUT_KEYS) if key not in record]
    if missing:
        raise ValueError(f"a preference example needs {', '.join(repr(key) for key in missing)}")
    if not isinstance(record["input"], dict) or "messages" not in record["input"]:
        raise ValueError("'input' must be an object with 'messages'")
    messages = record["input"]["messages"]
    problem = check_messages(messages, needs_assistant=False)
    if problem:
        raise ValueError("input." + problem.replace("'messages'", "messages", 1))
    if messages[-1]["role"] == "assistant":
        raise ValueError("the last input message must not be the assistant's: the outputs answer it")
    preferred, non_preferred = (_output_message(record, key) for key in OUTPUT_KEYS)
    if preferred["content"] == non_preferred["content"]:
        raise ValueError("'preferred_output' and 'non_preferred_output' are the same; a preference needs two")
    return PreferenceExample(messages, preferred, non_preferred)


def supervised_example_characters(example: SupervisedExample) -> int:
    if isinstance(example, ChatExample):
        return sum(len(message.get("content") or "") for message in example.messages)
    if isinstance(example, PromptCompletionExample):
        return len(example.prompt) + len(example.completion)
    return len(example.text)


def preference_example_characters(example: PreferenceExample) -> int:
    prompt = sum(len(message.get("content") or "") for message in example.messages)
    # Both sides are trained on, each with the whole input.
    return 2 * prompt + len(example.preferred["content"]) + len(example.non_preferred["content"])


def _is_preference_record(record: Any) -> bool:
    return isinstance(record, dict) and any(key in record for key in ("input", *OUTPUT_KEYS))


@dataclass(frozen=True)
class ReinforcementExample:
    messages: list[dict[str, Any]]  # the prompt, ending before the answer the model samples
    item: dict[str, Any]  # the whole line: what graders read as {{ item.* }}


def parse_reinforcement_example(record: Any) -> ReinforcementExample:
    """One JSONL record as a prompt with its reference fields; raises ValueError saying what is wrong with it."""
    if not isinstance(record, dict) or "messages" not in record:
        raise ValueError("expected an object with 'messages' (the prompt) and the graders' reference fields")
    messages = record["messages"]
    problem = check_messages(messages, needs_assistant=False)
    if problem:
        raise ValueError(problem)
    if messages[-1]["role"] == "assistant":
        raise ValueError("the last message must not be the assistant's: the model samples the answer")
    return ReinforcementExample(messages, record)


def reinforcement_example_characters(example: ReinforcementExample) -> int:
    return sum(len(message.get("content") or "") for message in example.messages)


# Keys a chat line may have beside its messages in every format (OpenAI's tool definitions).
CHAT_KEYS = ("messages", "tools", "parallel_tool_calls", "functions")


def _is_reinforcement_record(record: Any) -> bool:
    # A prompt waiting for its answer with something to grade it by: a chat whose last message is a user, system
    # or tool turn (a supervised chat ends with the answer it learns from), and a reference field beside it. A
    # chat line with neither answer nor reference field is a supervised line missing its answer, and is told so.
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list) or not record["messages"]:
        return False
    last = record["messages"][-1]
    ends_with_prompt = isinstance(last, dict) and last.get("role") in ("user", "system", "tool")
    return ends_with_prompt and any(key not in CHAT_KEYS for key in record)


@dataclass(frozen=True)
class ExampleFormat:
    """One line format: how a record is parsed and counted, and whether a record is in it."""

    name: str
    parse: Callable[[Any], Any]
    characters: Callable[[Any], int]
    # Whether a record has keys only this format's lines have (the default format need not claim any).
    recognizes: Callable[[Any], bool]


SUPERVISED = ExampleFormat(
    "supervised", parse_supervised_example, supervised_example_characters, lambda record: False
)
PREFERENCE = ExampleFormat(
    "preference", parse_preference_example, preference_example_characters, _is_preference_record
)
REINFORCEMENT = ExampleFormat(
    "reinforcement", parse_reinforcement_example, reinforcement_example_characters, _is_reinforcement_record
)
