"""Checks a training file line by line before anything is stored.

One JSON object per line, checked by the same code the trainer reads the file with: the line format of the
file's method (fusetune/spec/examples.py; the supervised formats are chat `{"messages": [...]}`,
`{"prompt", "completion"}` and `{"text"}`).

A UTF-8 byte order mark at the start of the file is allowed (Windows editors write one). Lines are parsed by
orjson, which never recurses on the interpreter's stack, and nesting deeper than MAX_NESTING_DEPTH, numbers no
double can hold and lone UTF-16 surrogates are refused with the line's number.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import orjson

from fusetune.spec.methods import DEFAULT_METHOD, METHODS, method_of_record

# The purpose of an uploaded training file; a job's results CSV has another ("fine-tune-results") and is not one.
TRAINING_PURPOSE = "fine-tune"
MAX_REPORTED_ERRORS = 20
# A rough count for estimates before tokenisation: about four characters per token in English text.
CHARS_PER_TOKEN = 4
UTF8_BOM = b"\xef\xbb\xbf"
# Examples nest a few levels (a tool call's arguments in a message in the list), tool schemas a few more; a line
# nested deeper is not a training example. The limit also keeps every line within what the trainer's parser
# reads without running out of stack.
MAX_NESTING_DEPTH = 64


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


def _nested_deeper_than(value: object, limit: int) -> bool:
    """Whether arrays and objects nest more than `limit` levels (`[]` is one level), walked without recursion."""
    pending = [(value, 1)] if isinstance(value, dict | list) else []
    while pending:
        node, depth = pending.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        pending.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


def parse_line(raw: bytes) -> object:
    """The JSON value of one line of a JSON Lines file; raises ValueError with a problem to show the user."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("not valid UTF-8") from None
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        where = f"at column {exc.colno}"
        if "depth" in exc.msg or "recursion" in exc.msg:
            raise ValueError(f"nested deeper than the limit of {MAX_NESTING_DEPTH} levels") from None
        if exc.msg.startswith("number"):
            raise ValueError(
                f"a number {where} is out of range: numbers must fit a 64-bit float (up to about 1.8e308)"
            ) from None
        raise ValueError(f"not valid JSON ({exc.msg} {where})") from None
    if _nested_deeper_than(value, MAX_NESTING_DEPTH):
        raise ValueError(f"nested deeper than the limit of {MAX_NESTING_DEPTH} levels")
    return value


def _example_over_limit(example_bytes: int, max_example_bytes: int) -> str:
    return (
        f"the example is {example_bytes:,} bytes, over the limit of {max_example_bytes:,} bytes for one "
        "example (the server's FUSETUNE_MAX_EXAMPLE_BYTES)"
    )


def _eval_line_over_limit(line_bytes: int, max_example_bytes: int) -> str:
    return (
        f"the line is {line_bytes:,} bytes, over the limit of {max_example_bytes:,} bytes (the server's "
        "FUSETUNE_MAX_EXAMPLE_BYTES)"
    )


def _parsed_lines(
    stream: BinaryIO,
    report: FileReport,
    max_example_bytes: int | None,
    over_limit: Callable[[int, int], str],
) -> Iterator[tuple[int, object, int]]:
    """The uploaded file's JSON lines as (line number, value, bytes without the line ending), for a validator
    to check against its format. The byte order mark is dropped from the first line, blank lines are skipped,
    and a line over `max_example_bytes` (refused unread, with `over_limit`'s message) or not JSON is reported
    in `report` and not yielded."""
    for line_number, raw in enumerate(stream, start=1):
        if line_number == 1:
            raw = raw.removeprefix(UTF8_BOM)  # the trainer reads the file as utf-8-sig
        line_bytes = len(raw.rstrip(b"\r\n"))
        if max_example_bytes is not None and line_bytes > max_example_bytes:
            report.add_error(line_number, over_limit(line_bytes, max_example_bytes))
            continue
        if not raw.strip():
            continue
        try:
            value = parse_line(raw)
        except ValueError as exc:
            report.add_error(line_number, str(exc))
            continue
        yield line_number, value, line_bytes


def validate_chat_jsonl(stream: BinaryIO, max_example_bytes: int | None = None) -> FileReport:
    """Reads the whole stream once, line by line, and reports every problem up to a limit. The file's method
    is the one whose line format its first JSON line is in; every line must be in that format. A line longer
    than `max_example_bytes` is refused unread."""
    example_format = None
    report = FileReport()
    for line_number, example, _ in _parsed_lines(stream, report, max_example_bytes, _example_over_limit):
        if example_format is None:
            report.method = method_of_record(example)
            example_format = METHODS[report.method].example_format
        elif method_of_record(example) != report.method:
            report.add_error(
                line_number,
                f"a {method_of_record(example)} example in a file of {report.method} examples (its first "
                "line's format); one file holds one method's examples",
            )
            continue
        try:
            parsed = example_format.parse(example)
        except ValueError as exc:
            report.add_error(line_number, str(exc))
            continue
        report.example_count += 1
        report.token_estimate += max(1, example_format.characters(parsed) // CHARS_PER_TOKEN)
    if report.example_count == 0 and not report.errors:
        report.errors.append("the file holds no examples")
    return report


def validate_eval_jsonl(stream: BinaryIO, max_example_bytes: int | None = None) -> FileReport:
    """An eval data file (purpose `evals`, OpenAI's format): every line an object `{"item": {...}}`, with an
    optional `"sample"` object beside it. What the item holds is the eval's item schema's to say."""
    report = FileReport(method="evals")
    for line_number, row, line_bytes in _parsed_lines(
        stream, report, max_example_bytes, _eval_line_over_limit
    ):
        if not isinstance(row, dict) or not isinstance(row.get("item"), dict):
            report.add_error(
                line_number, 'an eval line is an object {"item": {...}} (the item\'s fields inside)'
            )
            continue
        extra = sorted(set(row) - {"item", "sample"})
        if extra or not isinstance(row.get("sample", {}), dict):
            report.add_error(line_number, f'an eval line holds "item" and optionally a "sample" object (got '
                             f"{', '.join(extra) or 'a sample that is not an object'})")  # fmt: skip
            continue
        report.example_count += 1
        report.token_estimate += max(1, line_bytes // CHARS_PER_TOKEN)
    if report.example_count == 0 and not report.errors:
        report.errors.append("the file holds no items")
    return report


def numbered_examples(chunks: Iterable[bytes], parse: Callable[[Any], Any]) -> Iterator[tuple[int, Any]]:
    """A stored file's examples with their line numbers, read lazily from its bytes: lines split at "\n" as
    above, the byte order mark and blank lines left out, each line parsed by its format's `parse` (the file passed
    the upload check, so a line that fails it now is an error)."""
    pending: list[bytes] = []  # the start of a line not yet ended (a long line may span many chunks)
    line_number = 0
    for chunk in chunks:
        parts = chunk.split(b"\n")
        if len(parts) == 1:
            pending.append(chunk)
            continue
        lines = [b"".join([*pending, parts[0]]), *parts[1:-1]]
        pending = [parts[-1]]
        for raw in lines:
            line_number += 1
            if line_number == 1:
                raw = raw.removeprefix(UTF8_BOM)
            if raw.strip():
                yield line_number, parse(parse_line(raw))
    last = b"".join(pending)
    line_number += 1
    if line_number == 1:
        last = last.removeprefix(UTF8_BOM)
    if last.strip():
        yield line_number, parse(parse_line(last))
