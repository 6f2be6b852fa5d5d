"""Evals, as OpenAI's Evals API spells them: what `POST /v1/evals` and `POST /v1/evals/{id}/runs` take.

- An eval: a `custom` data source config (the JSON schema of one item) and `testing_criteria`, each a grader of
  fusetune/spec/graders.py under OpenAI's eval field names (`name`, and `pass_threshold` where a score is not a
  pass by itself). `passed` is the one rule that says whether a criterion's score is a pass.
- A run: a `completions` data source. A model (base or fine-tuned) is sampled once per item of a file (purpose
  `evals`, each line `{"item": {...}}`) or of inline `file_content`, on messages rendered from a template
  (`{{ item.question }}`) or read from the item (`item_reference`).

The API checks a template against the item schema and the grader against what this server can run when the eval
or run is created; the worker (fusetune/worker/evals.py) renders, samples and grades. No torch here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from fusetune.spec.graders import (
    AnyGrader,
    PythonGrader,
    StringCheckGrader,
    TemplateReference,
    TextSimilarityGrader,
    parse_grader,
    parse_reference,
    template_references,
)

# The purpose of an uploaded eval data file, as OpenAI names it.
EVALS_PURPOSE = "evals"
# OpenAI's limit on metadata: 16 pairs, keys of 64 characters, values of 512.
Metadata = dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]]
MAX_METADATA_PAIRS = 16
# An eval's criteria are graders of these types (OpenAI's: no multi grader; the model graders are refused by the
# server's own check, fusetune.graders.check_grader).
CRITERION_TYPES = ("string_check", "text_similarity", "python", "score_model", "label_model")
# A python grader's score passes at this value when the criterion gives no pass_threshold.
DEFAULT_PASS_THRESHOLD = 1.0
# Items per run: every item is sampled and kept as an output item row.
MAX_RUN_ITEMS = 10_000
DEFAULT_MAX_COMPLETION_TOKENS = 256
# A run's seed when its sampling_params give none: OpenAI's documented default. A run draws with a seed it then
# reports in every output item's sample (OpenAI's schema requires an integer there), so a rerun draws the same.
DEFAULT_SEED = 42


class RunStatus:
    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELED = "canceled"
    FINISHED = frozenset({COMPLETED, FAILED, CANCELED})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CustomDataSourceConfig(_Strict):
    type: Literal["custom"]
    item_schema: dict[str, Any]
    include_sample_schema: bool = False

    @field_validator("item_schema")
    @classmethod
    def _an_object_schema(cls, schema: dict[str, Any]) -> dict[str, Any]:
        if schema.get("type", "object") != "object":
            raise ValueError(f"must be a JSON schema of type object (got type {schema.get('type')!r})")
        if not isinstance(schema.get("properties", {}), dict):
            raise ValueError("properties must be an object of the item's fields")
        return schema

    def stored_schema(self) -> dict[str, Any]:
        """The schema an eval object shows: the item (and the sample) as one object, as OpenAI returns it."""
        properties: dict[str, Any] = {"item": self.item_schema}
        required = ["item"]
        if self.include_sample_schema:
            properties["sample"] = {"type": "object", "properties": {"output_text": {"type": "string"}}}
            required.append("sample")
        return {"type": "object", "properties": properties, "required": required}


class EvalCreate(_Strict):
    name: str | None = Field(None, max_length=256)
    metadata: Metadata | None = Field(None, max_length=MAX_METADATA_PAIRS)
    data_source_config: CustomDataSourceConfig
    testing_criteria: list[dict[str, Any]] = Field(min_length=1)


class EvalUpdate(_Strict):
    name: str | None = Field(None, max_length=256)
    metadata: Metadata | None = Field(None, max_length=MAX_METADATA_PAIRS)


class FileIdSource(_Strict):
    type: Literal["file_id"]
    id: str = Field(min_length=1)


class ContentRow(_Strict):
    item: dict[str, Any]
    sample: dict[str, Any] | None = None


class FileContentSource(_Strict):
    type: Literal["file_content"]
    content: list[ContentRow] = Field(min_length=1, max_length=MAX_RUN_ITEMS)


class InputText(_Strict):
    type: Literal["input_text", "output_text"]
    text: str


class TemplateMessage(_Strict):
    """One message of a prompt template: OpenAI's `{role, content}` or its EvalItem (`type: message`)."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | InputText
    type: Literal["message"] | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else self.content.text


class TemplateInput(_Strict):
    type: Literal["template"]
    template: list[TemplateMessage] = Field(min_length=1)


class ItemReferenceInput(_Strict):
    type: Literal["item_reference"]
    item_reference: str = Field(min_length=1, description="Where the item holds its messages: item.messages")

    def reference(self) -> TemplateReference:
        text = self.item_reference.strip()
        return parse_reference(text if text.startswith("item") else f"item.{text}")


class SamplingParams(_Strict):
    temperature: float | None = Field(None, ge=0, le=2)
    max_completion_tokens: int | None = Field(None, ge=1)
    top_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None


class CompletionsDataSource(_Strict):
    type: Literal["completions"]
    model: str = Field(min_length=1)
    source: Annotated[FileIdSource | FileContentSource, Field(discriminator="type")]
    input_messages: Annotated[TemplateInput | ItemReferenceInput, Field(discriminator="type")]
    sampling_params: SamplingParams | None = None


class RunCreate(_Strict):
    name: str | None = Field(None, max_length=256)
    metadata: Metadata | None = Field(None, max_length=MAX_METADATA_PAIRS)
    data_source: CompletionsDataSource


# ---- the rules both sides read -------------------------------------------------------------------------------


class CriterionError(ValueError):
    """A testing criterion refused: `field` names where, as the API reports it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def parse_criterion(value: Any) -> AnyGrader:
    """One testing criterion as a grader; raises pydantic's ValidationError for a malformed grader and
    CriterionError for one an eval cannot use."""
    grader = parse_grader(value)
    if grader.type not in CRITERION_TYPES:
        raise CriterionError("type", f"an eval's testing criteria are graders of type {', '.join(CRITERION_TYPES)}"
                             f" (got {grader.type!r}; combine criteria as several entries instead)")  # fmt: skip
    if isinstance(grader, TextSimilarityGrader) and grader.pass_threshold is None:
        raise CriterionError("pass_threshold", "a text_similarity criterion needs pass_threshold (the score "
                             "from which a sample passes), as OpenAI's evals do")  # fmt: skip
    return grader


def passed(criterion: AnyGrader, score: float) -> bool:
    """Whether a criterion's score is a pass: string_check's and label_model's score is 1 or 0, the others pass
    from their pass_threshold."""
    if isinstance(criterion, StringCheckGrader):
        return score >= 1.0
    threshold = getattr(criterion, "pass_threshold", None)
    if threshold is None:
        threshold = DEFAULT_PASS_THRESHOLD if isinstance(criterion, PythonGrader) else 1.0
    return score >= threshold


def item_fields(item_schema: dict[str, Any]) -> set[str] | None:
    """The top-level fields an item has by its schema; None when the schema does not list them (any field)."""
    properties = item_schema.get("properties")
    if not properties or item_schema.get("additionalProperties") not in (False, None):
        return None
    return set(properties)


def missing_item_fields(texts: list[str], item_schema: dict[str, Any]) -> list[tuple[str, str]]:
    """(template, field) for each `{{ item.<field> }}` in `texts` whose field the item schema lacks."""
    fields = item_fields(item_schema)
    if fields is None:
        return []
    missing = []
    for text in texts:
        for reference in template_references(text):
            if reference.namespace == "item" and reference.path[0] not in fields:
                missing.append((reference.text, str(reference.path[0])))
    return missing
