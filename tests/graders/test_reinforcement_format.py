"""The reinforcement line format (OpenAI's): `messages` as the prompt, no final assistant turn, and any other keys
as the reference fields graders read as {{ item.* }}; checked line by line on upload like the other formats."""

from __future__ import annotations

import io

import pytest

from fusetune.api.file_validation import validate_chat_jsonl
from fusetune.spec.examples import REINFORCEMENT, parse_reinforcement_example
from fusetune.spec.methods import method_of_record

PROMPT = [{"role": "system", "content": "Answer with the number only."},
          {"role": "user", "content": "Write in digits: two nine one four"}]  # fmt: skip


def test_a_prompt_with_reference_fields_is_a_reinforcement_example():
    record = {"messages": PROMPT, "answer": "2914", "checks": {"digits": 4}}
    example = parse_reinforcement_example(record)
    assert example.messages == PROMPT and example.item == record  # the whole line is the graders' item
    assert method_of_record(record) == "reinforcement"
    # a chat that ends with the assistant's answer is a supervised one; so is a prompt with nothing to grade it
    # by (a supervised line missing its answer, which the supervised format says)
    assert method_of_record({"messages": [*PROMPT, {"role": "assistant", "content": "2914"}]}) == "supervised"
    assert method_of_record({"messages": PROMPT}) == "supervised"
    assert method_of_record({"messages": PROMPT, "tools": []}) == "supervised"


@pytest.mark.parametrize(
    ("record", "problem"),
    [
        ({"answer": "2914"}, "expected an object with 'messages'"),
        ({"messages": []}, "'messages' must be a non-empty list"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content must be a string"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role must be one of"),
        ({"messages": [*PROMPT, {"role": "assistant", "content": "2914"}]}, "the model samples the answer"),
    ],
)
def test_bad_lines_say_what_is_wrong(record, problem):
    with pytest.raises(ValueError, match=None) as refused:
        REINFORCEMENT.parse(record)
    assert problem in str(refused.value)


def test_an_upload_is_checked_line_by_line_and_records_its_method():
    good = b'{"messages": [{"role": "user", "content": "two nine one four"}], "answer": "2914"}\n'
    report = validate_chat_jsonl(io.BytesIO(good * 3))
    assert report.errors == [] and report.example_count == 3 and report.method == "reinforcement"
    mixed = (
        good + b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "2"}]}\n'
    )
    mixed += b'{"messages": [{"role": "user", "content": 5}], "answer": "5"}\n'
    report = validate_chat_jsonl(io.BytesIO(mixed))
    assert report.method == "reinforcement" and report.example_count == 1
    assert report.errors[0].startswith("line 2: a supervised example in a file of reinforcement examples")
    assert report.errors[1] == "line 3: messages[0].content must be a string"
