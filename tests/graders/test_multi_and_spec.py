"""multi graders and their formula, the grader objects' strictness (an error names the field), and the preflight
of a grader's `{{ item.* }}` templates on a job's first lines."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from fusetune.config import Settings
from fusetune.graders import grade, preflight_grader
from fusetune.spec.graders import Formula, FormulaError, parse_grader
from fusetune.spec.hyperparameters import SpecError

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


@pytest.mark.parametrize(
    ("template", "column"),
    [("{{ sample.output_text ", 0), ("{{ item.answer }} and {{ item.extra", 22), ("{{", 0)],
)
def test_an_unclosed_template_is_refused_naming_the_field(template, column):
    # It would stay in the text as it is, so that every sample compared against it scored 0.
    check = {"type": "string_check", "name": "c", "input": "{{ sample.output_text }}", "operation": "eq"}
    location, message = _error_location({**check, "reference": template})
    assert (
        location == "reference" and f"template at column {column}" in message and "no closing }}" in message
    )
    location, _ = _error_location({**PET, "graders": {"name": {**PET["graders"]["name"], "input": template}}})
    assert location == "graders.name.input"
    # Closing braces with nothing opened are text (a JSON reference holds them).
    assert parse_grader({**check, "reference": '{"a": {"b": 1}}'}).reference == '{"a": {"b": 1}}'


def test_the_preflight_names_the_template_and_the_first_line_without_its_variable():
    lines = [
        (1, {"name": "Rex", "breed": "collie"}),
        (2, {"name": "Tom", "breed": "tabby"}),
        (4, {"name": "Bo"}),
    ]
    preflight_grader(parse_grader(PET), lines[:2], "training_file 'file-1'", "method.reinforcement.grader")
    with pytest.raises(SpecError) as refused:
        preflight_grader(
            parse_grader(PET), iter(lines), "training_file 'file-1'", "method.reinforcement.grader"
        )
    assert refused.value.field == "method.reinforcement.grader.graders.breed.reference"
    assert "{{ item.breed }}: item has no 'breed'" in str(refused.value)
    assert "line 4 of training_file 'file-1'" in str(refused.value)
    # What a sample holds is unknown before sampling; a python grader has no templates.
    nested = {"type": "string_check", "name": "c", "operation": "eq",
              "input": "{{ sample.output_json.x }}", "reference": "{{ item.answer[1] }}"}  # fmt: skip
    with pytest.raises(SpecError, match="item.answer has no 1"):
        preflight_grader(parse_grader(nested), [(1, {"answer": ["only one"]})], "f")
    preflight_grader(parse_grader(nested), [(1, {"answer": ["a", "b"]})], "f")
    python = {"type": "python", "name": "p", "source": "def grade(sample, item):\n    return 1.0\n"}
    preflight_grader(parse_grader(python), [(1, {})], "f")
