"""Graders, as the OpenAI fine-tuning API spells them: what scores a sampled completion in reinforcement
fine-tuning and in `POST /v1/fine_tuning/alpha/graders/run`.

- `Grader`: a union discriminated by `type` of `StringCheckGrader`, `TextSimilarityGrader`, `PythonGrader`,
  `ScoreModelGrader`, `LabelModelGrader` and `MultiGrader` (whose `graders` are any of the others, by name).
  Strict like every spec: an unknown field, a wrong type or a misspelt operation is refused, naming the field.
- Templates: `{{ item.answer }}`, `{{ sample.output_text }}`, `{{ sample.output_json.steps[0] }}` (OpenAI's
  "JSON path like" syntax: names joined by dots, `[n]` indexes a list). `template_references` parses them, so
  a grader with a bad reference is refused when it is given, not when it first grades.
- `Formula`: a multi grader's `calculate_output`, parsed with `ast` into a tree of whitelisted nodes (numbers,
  the sub-graders' names, + - * / ** and ^ as a power, unary minus, and min, max, abs, floor, ceil, exp, sqrt,
  log) and evaluated by walking that tree. Never `eval`.

Grading itself (the metrics, the python sandbox) is fusetune/graders/; this module is what a request or a job
spec holds, and imports neither torch nor the rest of fusetune.
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import (
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationInfo,
    field_validator,
    model_validator,
)

from fusetune.spec.hyperparameters import Spec

GRADER_TYPES = ("string_check", "text_similarity", "python", "score_model", "label_model", "multi")
# The types a multi grader may combine (OpenAI's: a multi grader holds no multi grader).
SUB_GRADER_TYPES = GRADER_TYPES[:-1]

StringCheckOperation = Literal["eq", "ne", "like", "ilike"]
# OpenAI's list; "cosine" compares embeddings, which need an embedding model (refused when graded).
EvaluationMetric = Literal[
    "cosine", "fuzzy_match", "bleu", "gleu", "meteor",
    "rouge_1", "rouge_2", "rouge_3", "rouge_4", "rouge_5", "rouge_l",
]  # fmt: skip
EVALUATION_METRICS: tuple[str, ...] = EvaluationMetric.__args__  # type: ignore[attr-defined]

# A python grader's source, as OpenAI limits it (256 kB).
MAX_PYTHON_SOURCE_BYTES = 256 * 1024
MAX_FORMULA_CHARACTERS = 1000
MAX_FORMULA_DEPTH = 32


# ---- templates ------------------------------------------------------------------------------------------------

TEMPLATE = re.compile(r"\{\{(.*?)\}\}", re.DOTALL)
_PATH_PART = re.compile(r"\.?([A-Za-z_][A-Za-z0-9_\-]*)|\[(\d+)\]|\[\"([^\"]*)\"\]|\['([^']*)'\]")
NAMESPACES = ("item", "sample")
# What `sample.*` holds here: the completion's text, and its JSON value when the text parses as JSON.
SAMPLE_VARIABLES = ("output_text", "output_json")


@dataclass(frozen=True)
class TemplateReference:
    """One `{{ namespace.path }}`: `path` is the keys and list indexes after the namespace."""

    text: str  # as written, braces included
    namespace: str
    path: tuple[str | int, ...]


def parse_reference(text: str) -> TemplateReference:
    """The reference inside one pair of braces; raises ValueError saying what is wrong with it."""
    inner = TEMPLATE.fullmatch(text).group(1).strip() if TEMPLATE.fullmatch(text) else text.strip()
    parts: list[str | int] = []
    position = 0
    while position < len(inner):
        match = _PATH_PART.match(inner, position)
        if match is None or (position == 0 and match.group(0).startswith(".")):
            raise ValueError(
                f"{{{{ {inner} }}}} is not a reference like {{{{ item.answer }}}} (at column {position})"
            )
        name, index, quoted, single = match.groups()
        parts.append(
            int(index) if index is not None else next(p for p in (name, quoted, single) if p is not None)
        )
        position = match.end()
    if not parts or parts[0] not in NAMESPACES:
        raise ValueError(
            f"{{{{ {inner} }}}} must start with one of the namespaces {' or '.join(NAMESPACES)} "
            "(as in {{ item.answer }} or {{ sample.output_text }})"
        )
    if len(parts) < 2:
        raise ValueError(f"{{{{ {inner} }}}} names a namespace but no variable in it")
    if parts[0] == "sample" and parts[1] not in SAMPLE_VARIABLES:
        raise ValueError(
            f"{{{{ {inner} }}}}: sample holds {' and '.join(SAMPLE_VARIABLES)} (got {parts[1]!r})"
        )
    return TemplateReference(text, str(parts[0]), tuple(parts[1:]))


def template_references(text: str) -> list[TemplateReference]:
    """Every `{{ ... }}` in a string, parsed; raises ValueError naming the first bad one, or a `{{` that no
    `}}` closes (such a template would otherwise stay in the text as it is, and never match)."""
    references = []
    end = 0
    for match in TEMPLATE.finditer(text):
        references.append(parse_reference(match.group(0)))
        end = match.end()
    unclosed = text.find("{{", end)
    if unclosed >= 0:
        raise ValueError(
            f"the template at column {unclosed} ({text[unclosed : unclosed + 40]!r}) has no closing }}}}: "
            "write it as {{ item.answer }} or {{ sample.output_text }}"
        )
    return references


def _checked_template(value: str) -> str:
    template_references(value)
    return value


# ---- the safe formula of a multi grader ------------------------------------------------------------------------

FORMULA_FUNCTIONS: dict[str, Callable[..., float]] = {
    "min": min, "max": max, "abs": abs, "floor": math.floor, "ceil": math.ceil,
    "exp": math.exp, "sqrt": math.sqrt, "log": math.log,
}  # fmt: skip
_BINARY = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.Pow: lambda a, b: a**b,
    ast.Mod: lambda a, b: a % b,
}
_UNARY = {ast.USub: lambda a: -a, ast.UAdd: lambda a: a}


class FormulaError(ValueError):
    """A formula that cannot be parsed, names something that is not a sub-grader, or has no finite value."""


class Formula:
    """A multi grader's `calculate_output`, parsed once and checked against the names it may use."""

    def __init__(self, text: str, names: set[str] | frozenset[str]):
        if len(text) > MAX_FORMULA_CHARACTERS:
            raise FormulaError(f"is {len(text)} characters; the limit is {MAX_FORMULA_CHARACTERS}")
        try:
            # "^" is a power in a formula, as in a spreadsheet (Python's "^" would bind looser than "+").
            tree = ast.parse(text.strip().replace("^", "**"), mode="eval")
        except (SyntaxError, RecursionError, MemoryError, ValueError) as exc:
            message = exc.msg if isinstance(exc, SyntaxError) else type(exc).__name__
            raise FormulaError(f"is not a formula ({message})") from None
        self.text = text
        self.names = frozenset(names)
        self._check(tree.body, depth=0)
        self._tree = tree.body

    def _check(self, node: ast.AST, depth: int) -> None:
        if depth > MAX_FORMULA_DEPTH:
            raise FormulaError(f"nests deeper than {MAX_FORMULA_DEPTH} levels")
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, int | float):
                raise FormulaError(f"has {node.value!r}; a formula holds only numbers and names")
        elif isinstance(node, ast.Name):
            if node.id not in self.names:
                raise FormulaError(
                    f"names {node.id!r}, which is not one of the graders ({', '.join(sorted(self.names))})"
                )
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            self._check(node.left, depth + 1)
            self._check(node.right, depth + 1)
        elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            self._check(node.operand, depth + 1)
        elif isinstance(node, ast.Call):
            function = node.func.id if isinstance(node.func, ast.Name) else None
            if function not in FORMULA_FUNCTIONS or node.keywords or not node.args:
                raise FormulaError(
                    f"calls {ast.unparse(node.func)!r} in a way it may not; the functions are "
                    f"{', '.join(FORMULA_FUNCTIONS)}, each with positional arguments"
                )
            for argument in node.args:
                self._check(argument, depth + 1)
        else:
            raise FormulaError(
                f"has {ast.unparse(node)!r}; a formula holds numbers, the graders' names, + - * / % ** ^, "
                f"parentheses and {', '.join(FORMULA_FUNCTIONS)}"
            )

    def evaluate(self, values: Mapping[str, float]) -> float:
        """The formula's value for the sub-graders' scores; raises FormulaError when it has no finite one
        (a division by zero, the log of 0, an overflow)."""
        try:
            result = float(self._value(self._tree, values))
        except (ArithmeticError, ValueError, TypeError) as exc:
            raise FormulaError(f"has no value for these scores ({exc})") from None
        if not math.isfinite(result):
            raise FormulaError(f"has no finite value for these scores (got {result})")
        return result

    def _value(self, node: ast.AST, values: Mapping[str, float]) -> float:
        if isinstance(node, ast.Constant):
            return float(node.value)
        if isinstance(node, ast.Name):
            return float(values[node.id])
        if isinstance(node, ast.BinOp):
            return _BINARY[type(node.op)](self._value(node.left, values), self._value(node.right, values))
        if isinstance(node, ast.UnaryOp):
            return _UNARY[type(node.op)](self._value(node.operand, values))
        assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        return FORMULA_FUNCTIONS[node.func.id](*(self._value(argument, values) for argument in node.args))


# ---- the graders -------------------------------------------------------------------------------------------------

Template = Annotated[
    str, Field(description="May hold templates: {{ item.<field> }}, {{ sample.output_text }}")
]


class _GraderBase(Spec):
    name: str = Field(min_length=1, max_length=256, description="The grader's name; a multi grader's formula "
                      "and per-grader scores use the names its `graders` are given under")  # fmt: skip


class StringCheckGrader(_GraderBase):
    """1 when `input` and `reference` (after templates) compare as `operation` says, else 0: eq (equal), ne (not
    equal), like (input contains reference), ilike (contains, ignoring case)."""

    type: Literal["string_check"]
    input: Template
    reference: Template
    operation: StringCheckOperation

    _templates = field_validator("input", "reference")(_checked_template)


class TextSimilarityGrader(_GraderBase):
    """How close `input` is to `reference` by `evaluation_metric`, from 0 to 1."""

    type: Literal["text_similarity"]
    input: Template
    reference: Template
    evaluation_metric: EvaluationMetric
    # OpenAI's evals send it; the score is the same, the threshold says what counts as a pass.
    pass_threshold: float | None = None

    _templates = field_validator("input", "reference")(_checked_template)


class PythonGrader(_GraderBase):
    """`source` defines `grade(sample: dict, item: dict) -> float`; it runs in a sandbox (fusetune/graders/
    sandbox.py), only where the server enables python graders."""

    type: Literal["python"]
    source: str = Field(min_length=1)
    # OpenAI picks its grading image by this tag; here there is one, the server's Python (the tag is kept).
    image_tag: str | None = None
    pass_threshold: float | None = None

    @field_validator("source")
    @classmethod
    def _compiles(cls, source: str) -> str:
        size = len(source.encode())
        if size > MAX_PYTHON_SOURCE_BYTES:
            raise ValueError(f"is {size:,} bytes; the limit is {MAX_PYTHON_SOURCE_BYTES:,}")
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
            where = f" on line {exc.lineno}" if isinstance(exc, SyntaxError) and exc.lineno else ""
            raise ValueError(
                f"is not valid Python{where}: {getattr(exc, 'msg', type(exc).__name__)}"
            ) from None
        if not any(isinstance(node, ast.FunctionDef) and node.name == "grade" for node in tree.body):
            raise ValueError("must define a function grade(sample, item) at its top level")
        return source


class InputText(Spec):
    type: Literal["input_text"]
    text: Template


class OutputText(Spec):
    type: Literal["output_text"]
    text: Template


class InputImage(Spec):
    type: Literal["input_image"]
    image_url: str
    detail: str | None = None


class InputAudioData(Spec):
    data: str
    format: Literal["mp3", "wav"]


class InputAudio(Spec):
    type: Literal["input_audio"]
    input_audio: InputAudioData


ContentPart = Annotated[InputText | OutputText | InputImage | InputAudio, Field(discriminator="type")]


class ModelInput(Spec):
    """One message of a model grader's prompt (templates allowed in its text)."""

    role: Literal["user", "assistant", "system", "developer"]
    content: Template | ContentPart | list[ContentPart]
    type: Literal["message"] | None = None

    @field_validator("content")
    @classmethod
    def _templates(cls, content: Any) -> Any:
        if isinstance(content, str):
            template_references(content)
        return content


class SamplingParams(Spec):
    max_completions_tokens: int | None = Field(None, ge=1)
    reasoning_effort: str | None = None
    seed: int | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)


class ScoreModelGrader(_GraderBase):
    """A model reads `input` and answers a score within `range` ([0, 1] by default)."""

    type: Literal["score_model"]
    model: str
    input: list[ModelInput] = Field(min_length=1)
    range: list[float] | None = Field(None, min_length=2, max_length=2)
    sampling_params: SamplingParams | None = None
    pass_threshold: float | None = None

    @field_validator("range")
    @classmethod
    def _increasing(cls, value: list[float] | None) -> list[float] | None:
        if value is not None and not value[0] < value[1]:
            raise ValueError(f"must be [low, high] with low < high (got {value})")
        return value


class LabelModelGrader(_GraderBase):
    """A model reads `input` and answers one of `labels`; 1 when it is one of `passing_labels`, else 0."""

    type: Literal["label_model"]
    model: str
    input: list[ModelInput] = Field(min_length=1)
    labels: list[str] = Field(min_length=1)
    passing_labels: list[str] = Field(min_length=1)

    @model_validator(mode="after")
    def _passing_labels_are_labels(self) -> LabelModelGrader:
        unknown = [label for label in self.passing_labels if label not in self.labels]
        if unknown:
            raise ValueError(f"passing_labels {unknown} are not among labels {self.labels}")
        return self


def _tag(type_name: str) -> str:
    # The tag appears in a validation error's location; written with quotes, the API's error names the field
    # ("grader.operation"), not the tag (fusetune/api/errors.py drops location parts that are union members).
    return f"type='{type_name}'"


def _grader_tag(value: Any) -> str | None:
    grader_type = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return _tag(grader_type) if isinstance(grader_type, str) else None


def _discriminated(*models: type[_GraderBase]) -> Any:
    names = [model.model_fields["type"].annotation.__args__[0] for model in models]
    return Annotated[
        Union[tuple(Annotated[model, Tag(_tag(name))] for model, name in zip(models, names, strict=True))],  # noqa: UP007
        Discriminator(
            _grader_tag,
            custom_error_type="invalid_grader_type",
            custom_error_message=f"type must be one of {', '.join(names)}",
        ),
    ]


SubGrader = _discriminated(
    StringCheckGrader, TextSimilarityGrader, PythonGrader, ScoreModelGrader, LabelModelGrader
)


class MultiGrader(_GraderBase):
    """Several graders, each under a name, combined by `calculate_output`, a formula of those names."""

    type: Literal["multi"]
    graders: dict[str, SubGrader] = Field(min_length=1)
    calculate_output: str = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _single_grader_under_its_name(cls, value: Any) -> Any:
        # The openai SDK types `graders` as one grader; OpenAI's guide gives an object of graders by name.
        # One grader object (it has a string `type`) stands under its own name.
        if isinstance(value, dict) and isinstance(value.get("graders"), dict):
            graders = value["graders"]
            if isinstance(graders.get("type"), str) and isinstance(graders.get("name"), str):
                return {**value, "graders": {graders["name"]: graders}}
        return value

    @field_validator("calculate_output")
    @classmethod
    def _formula_of_the_graders(cls, text: str, info: ValidationInfo) -> str:
        if "graders" in info.data:  # else the graders were refused, and that error says why
            try:
                Formula(text, set(info.data["graders"]))
            except FormulaError as exc:
                raise ValueError(str(exc)) from None
        return text

    def formula(self) -> Formula:
        return Formula(self.calculate_output, set(self.graders))


Grader = _discriminated(
    StringCheckGrader, TextSimilarityGrader, PythonGrader, ScoreModelGrader, LabelModelGrader, MultiGrader
)
GRADER = TypeAdapter(Grader)
AnyGrader = (
    StringCheckGrader
    | TextSimilarityGrader
    | PythonGrader
    | ScoreModelGrader
    | LabelModelGrader
    | MultiGrader
)


def parse_grader(value: Any) -> AnyGrader:
    """A grader from its JSON object; raises pydantic's ValidationError naming the field."""
    return GRADER.validate_python(value)


def sub_graders(grader: AnyGrader) -> dict[str, AnyGrader]:
    """The graders whose scores a result reports by name: a multi grader's, by the names it gives them;
    any other grader, itself under its own name."""
    return dict(grader.graders) if isinstance(grader, MultiGrader) else {grader.name: grader}


def uses_python(grader: AnyGrader) -> bool:
    return any(isinstance(each, PythonGrader) for each in sub_graders(grader).values())
