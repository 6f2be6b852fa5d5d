"""Checks a training file line by line before anything is stored.

One JSON object per line, checked by the same code the trainer reads the file with: the training method's
`parse_example` (fusetune/worker/train/methods/; the supervised formats are chat `{"messages": [...]}`,
`{"prompt", "completion"}` and `{"text"}`). That code imports no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import BinaryIO

from fusetune.worker.train.methods import DEFAULT_METHOD, METHODS, method_of_record

MAX_REPORTED_ERRORS = 20
# A rough count for estimates before tokenisation: about four characters per token in English text.
CHARS_PER_TOKEN = 4


@dataclass
class FileReport:
    example_count: int = 0
    token_estimate: int = 0
    errors: list[str] = field(default_factory=list)
    more_errors: int = 0
    method: str = DEFAULT_METHOD  # whose line format the file is in: that of its first example

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


def validate_chat_jsonl(stream: BinaryIO) -> FileReport:
    """Reads the whole stream once, line by line, and reports every problem up to a limit. The file's method
    is the one whose line format its first JSON line is in; every line must be in that format."""
    method = None
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
        if method is None:
            report.method = method_of_record(example)
            method = METHODS[report.method]
        elif method_of_record(example) != report.method:
            report.add_error(
                line_number,
                f"a {method_of_record(example)} example in a file of {report.method} examples (its first "
                "line's format); one file holds one method's examples",
            )
            continue
        try:
            parsed = method.parse_example(example)
        except ValueError as exc:
            report.add_error(line_number, str(exc))
            continue
        report.example_count += 1
        report.token_estimate += max(1, method.example_characters(parsed) // CHARS_PER_TOKEN)
    if report.example_count == 0 and not report.errors:
        report.errors.append("the file holds no examples")
    return report
