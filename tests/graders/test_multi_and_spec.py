"""multi graders and their formula, and the grader objects' strictness: an error names the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from fusetune.config import Settings
from fusetune.graders import grade
from fusetune.spec.graders import Formula, FormulaError, parse_grader

# As OpenAI's guide combines them: an exact check of one field of a JSON answer and a fuzzy one of another,
# weighted in calculate_output (the values here are this test's own).
PET = {
    "type": "multi",
    "name": "pet",
    "graders": {
        "name": {"type": "string_check", "name": "name", "operation": "eq",
                 "input": "{{ sample.output_json.name }}", "reference": "{{ item.name }}"},
        "breed": {"type": "text_similarity", "name": "breed", "evaluation_metric": "fuzzy_match",
                  "input": "{{ sample.output_json.breed }}", "reference": "{{ item.breed }}"},
    },
    "calculate_output": "0.5 * name + 0.5 * breed",
}  # fmt: skip


def test_a_multi_grader_weighs_its_graders_by_name(tmp_path):
    settings = Settings(data_dir=tmp_path)
    item = {"name": "Biscuit", "breed": "beagle"}
    right = grade(
        parse_grader(PET), sample='{"name": "Biscuit", "breed": "beagle"}', item=item, settings=settings
    )
    assert right.score == 1.0 and right.per_grader == {"name": 1.0, "breed": 1.0}
    half = grade(parse_grader(PET), sample='{"name": "Rex", "breed": "beagle"}', item=item, settings=settings)
    assert half.score == 0.5 and half.per_grader == {"name": 0.0, "breed": 1.0}
    # not JSON: output_json is null, so {{ sample.output_json.name }} has no value: 0 and the reason
    broken = grade(parse_grader(PET), sample="Biscuit the beagle", item=item, settings=settings)
    assert (
        broken.score == 0.0
        and broken.error_type == "invalid_variable_error"
        and broken.error.startswith("name:")
    )


def test_the_sdks_single_grader_stands_under_its_name():
    grader = parse_grader({**PET, "graders": PET["graders"]["name"], "calculate_output": "name"})
    assert list(grader.graders) == ["name"]


@pytest.mark.parametrize(
    ("formula", "value"),
    [("a + b", 1.5), ("2 * a - b / 2", 1.75), ("a ^ 2 + 1", 2.0), ("-a ** 2", -1.0), ("max(a, b) * min(a, b)", 0.5),
     ("floor(b + 0.6) + ceil(b) + abs(-a) + sqrt(4) + exp(0) + log(1)", 6.0), ("(a + b) % 1", 0.5)],
)  # fmt: skip
def test_formula_values(formula, value):
    assert Formula(formula, {"a", "b"}).evaluate({"a": 1.0, "b": 0.5}) == pytest.approx(value)


@pytest.mark.parametrize(
    ("formula", "complaint"),
    [
        ("__import__('os').system('true')", "__import__('os').system"),
        ("__import__('os')", "calls '__import__'"),
        ("a.__class__", "has 'a.__class__'"),
        ("(lambda: 1)()", "calls"),
        ("[x for x in (a,)][0]", "has"),
        ("'a' * 3", "holds only numbers and names"),
        ("c + 1", "names 'c', which is not one of the graders (a, b)"),
        ("max(a, key=b)", "positional arguments"),
        ("a if b else 0", "has"),
        ("a +", "is not a formula"),
        ("(" * 40 + "a" + ")" * 40 + " + " + "-" * 40 + "a", "nests deeper"),
        ("a" + " + a" * 600, "characters; the limit is 1000"),
    ],
)
def test_formulas_outside_the_whitelist_are_refused(formula, complaint):
    with pytest.raises(FormulaError, match=None) as refused:
        Formula(formula, {"a", "b"})
    assert complaint in str(refused.value)


@pytest.mark.parametrize("formula", ["a / (b - b)", "log(b - b)", "10 ** 400 * a", "sqrt(-a)"])
def test_a_formula_without_a_finite_value_scores_zero(tmp_path, formula):
    grader = parse_grader({**PET, "graders": {"a": PET["graders"]["name"], "b": PET["graders"]["breed"]},
                           "calculate_output": formula})  # fmt: skip
    result = grade(grader, sample='{"name": "Biscuit", "breed": "beagle"}', item={"name": "Biscuit", "breed": "beagle"},
                   settings=Settings(data_dir=tmp_path))  # fmt: skip
    assert result.score == 0.0 and result.error_type == "formula_parse_error"


def _error_location(value) -> tuple[str, str]:
    with pytest.raises(ValidationError) as refused:
        parse_grader(value)
    error = refused.value.errors()[0]
    return ".".join(str(part) for part in error["loc"] if "type=" not in str(part)), error["msg"]


def test_errors_name_the_field():
    check = {
        "type": "string_check",
        "name": "c",
        "input": "{{ sample.output_text }}",
        "reference": "x",
        "operation": "eq",
    }
    assert _error_location({**check, "operation": "equals"})[0] == "operation"
    assert _error_location({**check, "inputs": "x"})[0] == "inputs"  # a misspelt field is not ignored
    assert _error_location({**check, "reference": 3})[0] == "reference"  # nothing coerced
    location, message = _error_location({**check, "input": "{{ item }}"})
    assert location == "input" and "names a namespace but no variable" in message
    location, message = _error_location({**check, "input": "{{ sample.output_tools }}"})
    assert location == "input" and "sample holds output_text and output_json" in message
    location, message = _error_location({**check, "type": "regex"})
    assert (
        "type must be one of string_check, text_similarity, python, score_model, label_model, multi"
        in message
    )
    location, _ = _error_location({**PET, "graders": {"name": {**PET["graders"]["name"], "operation": "is"}}})
    assert location == "graders.name.operation"
    location, message = _error_location({**PET, "calculate_output": "name + colour"})
    assert location == "calculate_output" and "'colour'" in message
    location, message = _error_location(
        {"type": "python", "name": "p", "source": "def grade(sample, item)\n"}
    )
    assert location == "source" and "not valid Python on line 1" in message
    location, message = _error_location({"type": "label_model", "name": "l", "model": "m", "labels": ["yes", "no"],
                                         "passing_labels": ["maybe"], "input": [{"role": "user", "content": "x"}]})  # fmt: skip
    assert "passing_labels ['maybe'] are not among labels" in message
