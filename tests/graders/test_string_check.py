"""string_check, as OpenAI's graders guide describes it: 1 or 0 by eq, ne, like (contains) or ilike (contains,
ignoring case), after the templates are filled from the sample and the item."""

import pytest

from fusetune.config import Settings
from fusetune.graders import Sample, grade
from fusetune.spec.graders import parse_grader


def _grader(operation: str, reference: str = "{{ item.city }}") -> object:
    return parse_grader({"type": "string_check", "name": "city", "input": "{{ sample.output_text }}",
                         "reference": reference, "operation": operation})  # fmt: skip


@pytest.mark.parametrize(
    ("operation", "output", "expected"),
    [
        ("eq", "Lisbon", 1.0),
        ("eq", "lisbon", 0.0),  # eq is exact: case counts
        ("ne", "Porto", 1.0),
        ("ne", "Lisbon", 0.0),
        ("like", "The capital is Lisbon.", 1.0),
        ("like", "The capital is LISBON.", 0.0),  # like is case-sensitive
        ("ilike", "The capital is LISBON.", 1.0),
        ("ilike", "The capital is Porto.", 0.0),
    ],
)
def test_operations(tmp_path, operation, output, expected):
    result = grade(_grader(operation), sample=Sample.from_text(output), item={"city": "Lisbon"},
                   settings=Settings(data_dir=tmp_path))  # fmt: skip
    assert result.score == expected and result.per_grader == {"city": expected} and result.error is None


def test_a_reference_into_the_sample_json_and_a_nested_item(tmp_path):
    grader = parse_grader({"type": "string_check", "name": "first", "operation": "eq",
                           "input": "{{ sample.output_json.steps[0] }}", "reference": "{{ item.answer.first }}"})  # fmt: skip
    sample = Sample.from_text('{"steps": ["add", "carry"]}')
    assert (
        grade(
            grader, sample=sample, item={"answer": {"first": "add"}}, settings=Settings(data_dir=tmp_path)
        ).score
        == 1.0
    )


def test_a_missing_item_field_scores_zero_and_says_which(tmp_path):
    result = grade(
        _grader("eq"), sample="Lisbon", item={"town": "Lisbon"}, settings=Settings(data_dir=tmp_path)
    )
    assert result.score == 0.0 and result.error_type == "invalid_variable_error"
    assert "item has no 'city'" in result.error


def test_graders_import_no_torch():
    import subprocess
    import sys

    code = "import sys, fusetune.graders, fusetune.spec.graders; print('torch' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        == "False\n"
    )
