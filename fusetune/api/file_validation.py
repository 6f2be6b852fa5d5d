"""Checks a training file line by line before anything is stored.

One JSON object per line, in one of three shapes (they may be mixed):
- chat, OpenAI's fine-tuning format: ``{"messages": [...]}``, each message ``{"role": "system" | "user" |
  "assistant" | "tool", "content": str}`` (an assistant message may carry ``tool_calls`` and null content, and
  an optional ``weight`` of 0 or 1), with at least one assistant message;
- ``{"prompt": str, "completion": str}`` (the loss is on the completion);
- ``{"text": str}`` (the loss is on every token).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import BinaryIO

ROLES = ("system", "user", "assistant", "tool")
MAX_REPORTED_ERRORS = 20
# A rough count for estimates before tokenisation: about four characters per token in English text.
CHARS_PER_TOKEN = 4


@dataclass
class FileReport:
    example_count: int = 0
    token_estimate: int = 0
    errors: list[str] = field(default_factory=list)
    more_errors: int = 0

    def add_error(self, line_number: int, problem: str) -> None:
        if len(self.errors) < MAX_REPORTED_ERRORS:
            self.errors.append(f"line {line_number}: {problem}")
        else:
            self.more_errors += 1

    def summary(self) -> str:
        text = "; ".join(self.errors)
        if self.more_errors:
            text += f"; and {self.more_errors} more errors"
        return text


def _check_example(example: object) -> str | None:
    if not isinstance(example, dict):
        return "expected a JSON object with 'messages', 'prompt' and 'completion', or 'text'"
    if "messages" not in example:
        if "prompt" in example or "completion" in example:
            if not isinstance(example.get("prompt"), str) or not isinstance(example.get("completion"), str):
                return "'prompt' and 'completion' must both be strings"
            return None if example["completion"] else "'completion' must not be empty"
        if "text" in example:
            return (
                None
                if isinstance(example["text"], str) and example["text"]
                else "'text' must be a non-empty string"
            )
        return "expected 'messages', 'prompt' and 'completion', or 'text'"
    messages = example.get("messages")
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list"
    has_assistant = False
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"messages[{index}] must be an object"
        role = message.get("role")
        if role not in ROLES:
            return f"messages[{index}].role must be one of {', '.join(ROLES)} (got {json.dumps(role)})"
        content = message.get("content")
        tool_call_only = (
            role == "assistant" and content is None and isinstance(message.get("tool_calls"), list)
        )
        if not isinstance(content, str) and not tool_call_only:
            return f"messages[{index}].content must be a string"
        weight = message.get("weight", 1)
        if weight not in (0, 1):
            return f"messages[{index}].weight must be 0 or 1"
        has_assistant |= role == "assistant"
    if not has_assistant:
        return "needs at least one assistant message to learn from"
    return None


def _characters(example: dict) -> int:
    if "messages" in example:
        return sum(len(m.get("content") or "") for m in example["messages"])
    return sum(len(example.get(key, "")) for key in ("prompt", "completion", "text"))


def validate_chat_jsonl(stream: BinaryIO) -> FileReport:
    """Reads the whole stream once, line by line, and reports every problem up to a limit."""
    report = FileReport()
    for line_number, raw in enumerate(stream, start=1):
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            report.add_error(line_number, "not valid UTF-8")
            continue
        try:
            example = json.loads(text)
        except json.JSONDecodeError as exc:
            report.add_error(line_number, f"not valid JSON ({exc.msg} at column {exc.colno})")
            continue
        problem = _check_example(example)
        if problem:
            report.add_error(line_number, problem)
            continue
        report.example_count += 1
        report.token_estimate += max(1, _characters(example) // CHARS_PER_TOKEN)
    if report.example_count == 0 and not report.errors:
        report.errors.append("the file holds no examples")
    return report
