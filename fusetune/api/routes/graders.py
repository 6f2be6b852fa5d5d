"""/v1/fine_tuning/alpha/graders: try a grader before a job trains with it, as the OpenAI API offers.

- `POST /run`: grades `model_sample` against `item` and answers OpenAI's `GraderRunResponse` (the reward, each
  grader's score, which kind of error there was, how long it took).
- `POST /validate`: answers the grader back when this server can run it; a grader it cannot run (python graders
  off, a model grader, cosine similarity) is a 400 naming the field, as a job with it would be.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from fusetune.api.deps import SettingsDep, get_tenant
from fusetune.api.grader_check import refuse_unsupported_grader
from fusetune.graders import Sample, grade
from fusetune.graders.grading import FORMULA, INVALID_VARIABLE, OTHER, PYTHON_RUNTIME, PYTHON_SERVER
from fusetune.spec.graders import Grader

router = APIRouter(
    prefix="/v1/fine_tuning/alpha/graders", tags=["fine-tuning"], dependencies=[Depends(get_tenant)]
)

_STRICT = ConfigDict(extra="forbid")


class GraderRunRequest(BaseModel):
    model_config = _STRICT
    grader: Grader
    model_sample: str = Field(description="The sample graded: {{ sample.output_text }}, and output_json when it "
                              "is JSON")  # fmt: skip
    item: dict[str, Any] = Field(default_factory=dict, description="The dataset item: {{ item.* }}")


class GraderValidateRequest(BaseModel):
    model_config = _STRICT
    grader: Grader


class GraderValidateResponse(BaseModel):
    grader: Grader


class GraderRunErrors(BaseModel):
    """OpenAI's flags of what went wrong; the model grader flags stay false (no model graders here)."""

    formula_parse_error: bool = False
    invalid_variable_error: bool = False
    model_grader_parse_error: bool = False
    model_grader_refusal_error: bool = False
    model_grader_server_error: bool = False
    model_grader_server_error_details: str | None = None
    other_error: bool = False
    python_grader_runtime_error: bool = False
    python_grader_runtime_error_details: str | None = None
    python_grader_server_error: bool = False
    python_grader_server_error_type: str | None = None
    sample_parse_error: bool = False
    truncated_observation_error: bool = False
    unresponsive_reward_error: bool = False


class GraderRunMetadata(BaseModel):
    errors: GraderRunErrors
    execution_time: float = Field(description="Seconds the grading took")
    name: str
    sampled_model_name: str | None = None
    scores: dict[str, float]
    token_usage: int | None = None
    type: str


class GraderRunResponse(BaseModel):
    metadata: GraderRunMetadata
    model_grader_token_usage_per_model: dict[str, Any] = Field(default_factory=dict)
    reward: float
    sub_rewards: dict[str, float]


def _errors(error: str | None, error_type: str | None) -> GraderRunErrors:
    if error is None:
        return GraderRunErrors()
    if error_type == PYTHON_RUNTIME:
        return GraderRunErrors(python_grader_runtime_error=True, python_grader_runtime_error_details=error)
    if error_type == PYTHON_SERVER:
        return GraderRunErrors(python_grader_server_error=True, python_grader_server_error_type=error)
    return GraderRunErrors(
        formula_parse_error=error_type == FORMULA,
        invalid_variable_error=error_type == INVALID_VARIABLE,
        other_error=error_type in (OTHER, None),
    )


@router.post("/run", response_model=GraderRunResponse)
def run_grader(body: GraderRunRequest, settings: SettingsDep) -> GraderRunResponse:
    refuse_unsupported_grader(body.grader, settings)
    started = time.perf_counter()
    result = grade(body.grader, sample=Sample.from_text(body.model_sample), item=body.item, settings=settings)
    return GraderRunResponse(
        reward=result.score,
        sub_rewards=result.per_grader,
        metadata=GraderRunMetadata(
            errors=_errors(result.error, result.error_type),
            execution_time=time.perf_counter() - started,
            name=body.grader.name,
            type=body.grader.type,
            scores=result.per_grader,
        ),
    )


@router.post("/validate", response_model=GraderValidateResponse, response_model_exclude_none=True)
def validate_grader(body: GraderValidateRequest, settings: SettingsDep) -> GraderValidateResponse:
    refuse_unsupported_grader(body.grader, settings)
    return GraderValidateResponse(grader=body.grader)
