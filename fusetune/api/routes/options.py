"""/v1/fine_tuning/options: what a job may ask for, every default and bound read from the job specification.

The dashboard's new-job form is built from this answer, so that a method, a precision mode or a bound added or
changed in fusetune/spec/ reaches the form with no change to the page. Each option is read from the JSON
schemas of the spec's models (the ones the OpenAPI schema publishes): its type, bounds and choices from the
model of decided values (`JobHyperparameters`, a method's settings, `LoraSpec`), its default and whether it
may be "auto" or null from the model of the request (`HyperparametersRequest`, `hyperparameters_request`).
"""

from __future__ import annotations

from functools import cache
from typing import Any, Literal

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field

from fusetune.api.deps import get_tenant
from fusetune.spec.hyperparameters import HyperparametersRequest, JobHyperparameters
from fusetune.spec.methods import DEFAULT_METHOD, METHODS, hyperparameters_request
from fusetune.spec.precision import AUTO, CPU_DEFAULT, GPU_DEFAULT, PRECISIONS

router = APIRouter(prefix="/v1/fine_tuning/options", tags=["fine-tuning"], dependencies=[Depends(get_tenant)])


class Option(BaseModel):
    """One field a request may set."""

    type: Literal["integer", "number", "boolean", "string", "array", "object"]
    default: Any = Field(description='What a request that leaves the field out gets: a value, "auto" or null')
    auto: bool = Field(description='"auto" is accepted: the server decides the value')
    nullable: bool = Field(description="null is accepted: the field is left unused (lora) or to the server")
    minimum: int | float | None = None
    exclusive_minimum: bool = Field(False, description="The value must be above `minimum`, not equal to it")
    maximum: int | float | None = None
    exclusive_maximum: bool = Field(False, description="The value must be below `maximum`, not equal to it")
    choices: list[str] | None = Field(
        None,
        description="The strings accepted: a string field's only values; beside another type, its special ones",
    )
    description: str | None = None
    fields: dict[str, Option] | None = Field(None, description="An object's own fields (those of lora)")


class MethodOption(BaseModel):
    description: str
    example_format: str = Field(
        description="The line format of its training files (a file serves every method of it)"
    )
    supports_packing: bool
    settings: dict[str, Option] = Field(
        description="The method's own settings, sent beside the shared ones in method.<type>.hyperparameters"
    )


class PrecisionOption(BaseModel):
    description: str
    needs_gpu: bool


class AutoPrecision(BaseModel):
    """The precision mode "auto" resolves to on each kind of device (the API does not know the workers')."""

    gpu: str
    cpu: str


class JobOptions(BaseModel):
    object: Literal["fine_tuning.options"] = "fine_tuning.options"
    hyperparameters: dict[str, Option] = Field(
        description="Shared by every method, as `hyperparameters` takes them"
    )
    methods: dict[str, MethodOption] = Field(description="By `method.type`")
    default_method: str
    precisions: dict[str, PrecisionOption] = Field(
        description='The modes `precision` may name besides "auto"'
    )
    precision_auto: AutoPrecision


def _accepts(branch: dict[str, Any], value: Any) -> bool:
    return value in branch.get("enum", ()) or branch.get("const", object()) == value


def _option(decided: dict[str, Any], requested: dict[str, Any], defs: dict[str, Any]) -> Option:
    """An option from a field's schema in the decided model and in the request's model."""
    branches = [b for b in decided.get("anyOf", [decided]) if b.get("type") != "null"]
    strings = [b for b in branches if "enum" in b or "const" in b]
    # The field's own type: a string field's, or the other branch's beside special strings ("all-linear").
    main = next((b for b in branches if b not in strings), branches[0])
    fields = None
    if "$ref" in main:
        nested = defs[main["$ref"].rsplit("/", 1)[1]]
        main = {**nested, "type": "object"}
        fields = _options(nested, nested, defs)
    requested_branches = requested.get("anyOf", [requested])
    return Option(
        type=main["type"],
        default=requested.get("default"),
        auto=any(_accepts(b, AUTO) for b in requested_branches),
        nullable=any(b.get("type") == "null" for b in requested_branches),
        minimum=main.get("minimum", main.get("exclusiveMinimum")),
        exclusive_minimum="exclusiveMinimum" in main,
        maximum=main.get("maximum", main.get("exclusiveMaximum")),
        exclusive_maximum="exclusiveMaximum" in main,
        choices=[value for b in strings for value in b.get("enum", [b.get("const")])] or None,
        description=requested.get("description") or decided.get("description") or main.get("description"),
        fields=fields,
    )


def _options(
    decided: dict[str, Any], requested: dict[str, Any], defs: dict[str, Any] | None = None
) -> dict[str, Option]:
    """Options for the fields of `requested` (a model's JSON schema), their bounds those of `decided`."""
    defs = {**(defs or {}), **decided.get("$defs", {})}
    properties = decided["properties"]
    return {name: _option(properties[name], field, defs) for name, field in requested["properties"].items()}


def _method_settings(method_type: str) -> dict[str, Option]:
    settings = METHODS[method_type].settings
    if settings is None:
        return {}
    decided = settings.model_json_schema()
    requested = hyperparameters_request(method_type).model_json_schema()
    # A setting the request gives beside the hyperparameters (reinforcement's grader) is no hyperparameter.
    names = [name for name in decided["properties"] if name not in METHODS[method_type].request_fields]
    return _options(decided, {"properties": {name: requested["properties"][name] for name in names}})


@cache
def job_options() -> JobOptions:
    return JobOptions(
        hyperparameters=_options(
            JobHyperparameters.model_json_schema(), HyperparametersRequest.model_json_schema()
        ),
        methods={
            name: MethodOption(
                description=method.description,
                example_format=method.example_format.name,
                supports_packing=method.supports_packing,
                settings=_method_settings(name),
            )
            for name, method in METHODS.items()
        },
        default_method=DEFAULT_METHOD,
        precisions={
            name: PrecisionOption(description=mode.description, needs_gpu=mode.needs_gpu)
            for name, mode in PRECISIONS.items()
        },
        precision_auto=AutoPrecision(gpu=GPU_DEFAULT, cpu=CPU_DEFAULT),
    )


@router.get("", response_model=JobOptions)
async def get_options() -> JobOptions:
    """The hyperparameters, methods (with their own settings) and precision modes a job may ask for, with every
    default, bound and choice, as the job specification has them."""
    return job_options()
