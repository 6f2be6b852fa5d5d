"""/v1/evals: OpenAI's Evals API. An eval holds an item schema and testing criteria (graders); a run samples a
model (base or one of the tenant's fine-tuned models) over a file's items and grades every sample.

What can be checked before a run is checked at creation, as a 400 naming the field: a criterion this server
cannot grade with, a template naming an item field the schema lacks, an unknown model, a file that is not the
tenant's or not of purpose `evals`. A run is queued and run by a worker (fusetune/worker/evals.py); its counts
appear when it ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from fusetune.api.deps import QueueDep, SessionDep, SettingsDep, TenantDep
from fusetune.api.errors import ApiError, not_found
from fusetune.api.grader_check import refuse_unsupported_grader
from fusetune.catalog import base_model_location
from fusetune.db import queries
from fusetune.db.models import Eval, EvalRun, EvalRunOutputItem, new_id
from fusetune.spec.evals import (
    EVALS_PURPOSE,
    CompletionsDataSource,
    CriterionError,
    EvalCreate,
    EvalUpdate,
    FileContentSource,
    ItemReferenceInput,
    RunCreate,
    RunStatus,
    item_fields,
    missing_item_fields,
    parse_criterion,
)
from fusetune.spec.graders import StringCheckGrader, TextSimilarityGrader, sub_graders, template_references

router = APIRouter(prefix="/v1/evals", tags=["evals"])
# fusetune's own: the runs of a job's fine-tuned model, which the dashboard shows on the job's page (OpenAI lists
# runs only by eval).
job_runs_router = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["evals"])

MAX_PAGE = 100
Order = Annotated[Literal["asc", "desc"], Query(description="By creation time")]
Limit = Annotated[int, Query(ge=1, le=MAX_PAGE)]


@dataclass(frozen=True)
class Page:
    """Which page of a list: the items after the id `after` (from the start when None), at most `limit`, by
    creation time in `order`; as OpenAI pages evals, runs and output items alike."""

    after: str | None
    limit: int
    order: Literal["asc", "desc"]


def _page(after: str | None = None, limit: Limit = 20, order: Order = "asc") -> Page:
    return Page(after, limit, order)


PageDep = Annotated[Page, Depends(_page)]


# ---- objects as OpenAI returns them -------------------------------------------------------------------------


def eval_object(row: Eval) -> dict[str, Any]:
    config = row.data_source_config
    schema = config.get("schema") or {}
    return {
        "object": "eval",
        "id": row.id,
        "name": row.name,
        "data_source_config": {"type": "custom", "schema": schema},
        "testing_criteria": row.testing_criteria,
        "created_at": row.created_at,
        "metadata": row.user_metadata or {},
    }


def run_object(row: EvalRun) -> dict[str, Any]:
    counts = {"total": 0, "passed": 0, "failed": 0, "errored": 0, **(row.result_counts or {})}
    return {
        "object": "eval.run",
        "id": row.id,
        "eval_id": row.eval_id,
        "name": row.name,
        "model": row.model,
        "status": row.status,
        "created_at": row.created_at,
        "data_source": row.data_source,
        "metadata": row.user_metadata or {},
        "result_counts": counts,
        "per_testing_criteria_results": row.per_testing_criteria_results or [],
        "per_model_usage": row.per_model_usage or [],
        # OpenAI's run always carries an error object; an empty one when nothing failed.
        "error": row.error or {"code": "", "message": ""},
        "report_url": f"/ui/evals/{row.eval_id}/runs/{row.id}",
    }


def output_item_object(row: EvalRunOutputItem, run: EvalRun) -> dict[str, Any]:
    return {
        "object": "eval.run.output_item",
        "id": row.id,
        "run_id": run.id,
        "eval_id": run.eval_id,
        "created_at": row.created_at,
        "status": row.status,
        "datasource_item_id": row.datasource_item_id,
        "datasource_item": row.datasource_item,
        "results": row.results,
        "sample": row.sample,
    }


def _list(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


# ---- checks -----------------------------------------------------------------------------------------------------


def _criteria(body: EvalCreate, settings) -> list[dict[str, Any]]:
    """The testing criteria as graders this server can grade with, stored as given (defaults left out)."""
    item_schema = body.data_source_config.item_schema
    stored = []
    for index, value in enumerate(body.testing_criteria):
        where = f"testing_criteria.{index}"
        try:
            criterion = parse_criterion(value)
        except ValidationError as error:
            raise RequestValidationError(
                [{**e, "loc": ("body", "testing_criteria", index, *e["loc"])} for e in error.errors()]
            ) from error
        except CriterionError as error:
            raise ApiError(400, f"{where}.{error.field}: {error}", param=f"{where}.{error.field}",
                           code="invalid_testing_criteria") from error  # fmt: skip
        refuse_unsupported_grader(criterion, settings, where)
        texts = [
            getattr(each, name)
            for each in sub_graders(criterion).values()
            if isinstance(each, StringCheckGrader | TextSimilarityGrader)
            for name in ("input", "reference")
        ]
        for template, field in missing_item_fields(texts, item_schema):
            raise ApiError(400, f"{where}: {template} reads the item's '{field}', which the item schema "
                           f"(data_source_config.item_schema) does not have", param=where,
                           code="invalid_template_variable")  # fmt: skip
        stored.append(criterion.model_dump(mode="json", exclude_none=True))
    return stored


def _check_model(session, settings, model: str, tenant: str) -> None:
    if base_model_location(settings, model) is None and not queries.callable_fine_tuned_model(
        session.connection(), model, tenant
    ):
        raise ApiError(400, f"data_source.model: no model '{model}' (a base model this server offers or one of "
                       "your fine-tuned models)", param="data_source.model", code="model_not_found")  # fmt: skip


def _check_source(session, source, tenant: str) -> None:
    if isinstance(source, FileContentSource):
        return
    file = queries.get_file(session, source.id, tenant)
    if file is None:
        raise ApiError(400, f"data_source.source.id: no file with id '{source.id}'",
                       param="data_source.source.id", code="file_not_found")  # fmt: skip
    if file.purpose != EVALS_PURPOSE:
        raise ApiError(400, f"data_source.source.id: file '{source.id}' has purpose '{file.purpose}'; an eval "
                       f"run reads a file of purpose '{EVALS_PURPOSE}' (lines of {{\"item\": {{...}}}})",
                       param="data_source.source.id", code="invalid_file")  # fmt: skip


def _check_input(data_source: CompletionsDataSource, item_schema: dict[str, Any]) -> None:
    messages = data_source.input_messages
    if isinstance(messages, ItemReferenceInput):
        where = "data_source.input_messages.item_reference"
        try:
            reference = messages.reference()
        except ValueError as error:
            raise ApiError(400, f"{where}: {error}", param=where, code="invalid_item_reference") from error
        fields = item_fields(item_schema)
        if fields is not None and reference.path[0] not in fields:
            raise ApiError(400, f"{where}: the item schema has no field '{reference.path[0]}'", param=where,
                           code="invalid_item_reference")  # fmt: skip
        return
    for index, message in enumerate(messages.template):
        where = f"data_source.input_messages.template.{index}.content"
        try:
            references = template_references(message.text)
        except ValueError as error:
            raise ApiError(400, f"{where}: {error}", param=where, code="invalid_template") from error
        if any(reference.namespace == "sample" for reference in references):
            raise ApiError(400, f"{where}: a prompt is rendered before sampling, so it cannot read "
                           "{{ sample.* }}", param=where, code="invalid_template")  # fmt: skip
        for template, field in missing_item_fields([message.text], item_schema):
            raise ApiError(400, f"{where}: {template} reads the item's '{field}', which the eval's item schema "
                           "does not have", param=where, code="invalid_template_variable")  # fmt: skip


def _get_eval(session, eval_id: str, tenant: str) -> Eval:
    row = queries.get_eval(session, eval_id, tenant)
    if row is None:
        raise not_found("eval", eval_id, param="eval_id")
    return row


def _get_run(session, eval_id: str, run_id: str, tenant: str) -> EvalRun:
    row = queries.get_eval_run(session, run_id, tenant, eval_id)
    if row is None:
        raise not_found("eval run", run_id, param="run_id")
    return row


# ---- evals -----------------------------------------------------------------------------------------------------


# Creating an eval or a run answers 201, as OpenAI's spec declares for these two (its other creations answer 200).
@router.post("", status_code=201)
def create_eval(body: EvalCreate, session: SessionDep, settings: SettingsDep, tenant: TenantDep) -> dict:
    criteria = _criteria(body, settings)
    config = body.data_source_config
    row = Eval(
        id=new_id("eval_"),
        tenant=tenant,
        name=body.name or "",
        data_source_config={"item_schema": config.item_schema, "schema": config.stored_schema()},
        testing_criteria=criteria,
        user_metadata=body.metadata,
    )
    session.add(row)
    session.commit()
    return eval_object(row)


@router.get("")
def list_evals(session: SessionDep, tenant: TenantDep, page: PageDep) -> dict:
    cursor = _get_eval(session, page.after, tenant) if page.after else None
    rows, has_more = queries.page_evals(session, tenant, after=cursor, limit=page.limit, order=page.order)
    return _list([eval_object(row) for row in rows], has_more)


@router.get("/{eval_id}")
def retrieve_eval(eval_id: str, session: SessionDep, tenant: TenantDep) -> dict:
    return eval_object(_get_eval(session, eval_id, tenant))


@router.post("/{eval_id}")
def update_eval(eval_id: str, body: EvalUpdate, session: SessionDep, tenant: TenantDep) -> dict:
    row = _get_eval(session, eval_id, tenant)
    if body.name is not None:
        row.name = body.name
    if body.metadata is not None:
        row.user_metadata = body.metadata
    session.commit()
    return eval_object(row)


@router.delete("/{eval_id}")
def delete_eval(eval_id: str, session: SessionDep, tenant: TenantDep) -> dict:
    queries.delete_eval(session, _get_eval(session, eval_id, tenant))
    session.commit()
    return {"object": "eval.deleted", "deleted": True, "eval_id": eval_id}


# ---- runs ------------------------------------------------------------------------------------------------------


@router.post("/{eval_id}/runs", status_code=201)
def create_run(
    eval_id: str,
    body: RunCreate,
    session: SessionDep,
    settings: SettingsDep,
    queue: QueueDep,
    tenant: TenantDep,
) -> dict:
    evaluation = _get_eval(session, eval_id, tenant)
    data_source = body.data_source
    _check_model(session, settings, data_source.model, tenant)
    _check_source(session, data_source.source, tenant)
    _check_input(data_source, evaluation.data_source_config["item_schema"])
    row = EvalRun(
        id=new_id("evalrun_"),
        eval_id=eval_id,
        tenant=tenant,
        name=body.name or f"{data_source.model} on {evaluation.name or eval_id}",
        model=data_source.model,
        status=RunStatus.QUEUED,
        data_source=data_source.model_dump(mode="json", exclude_none=True),
        user_metadata=body.metadata,
    )
    session.add(row)
    session.commit()
    try:
        queue.enqueue_eval_run(row.id)  # after the commit: the worker reads the run from SQL
    except Exception as error:
        row.status, row.error = RunStatus.FAILED, {"code": "queue_unavailable",
                                                   "message": f"The run could not be queued: {error}"}  # fmt: skip
        session.commit()
    return run_object(row)


@router.get("/{eval_id}/runs")
def list_runs(
    eval_id: str,
    session: SessionDep,
    tenant: TenantDep,
    page: PageDep,
    status: Annotated[
        str | None, Query(description="queued, in_progress, completed, canceled or failed")
    ] = None,
) -> dict:
    _get_eval(session, eval_id, tenant)
    cursor = _get_run(session, eval_id, page.after, tenant) if page.after else None
    rows, has_more = queries.page_eval_runs(session, eval_id, status=status, after=cursor, limit=page.limit,
                                            order=page.order)  # fmt: skip
    return _list([run_object(row) for row in rows], has_more)


@router.get("/{eval_id}/runs/{run_id}")
def retrieve_run(eval_id: str, run_id: str, session: SessionDep, tenant: TenantDep) -> dict:
    return run_object(_get_run(session, eval_id, run_id, tenant))


@router.post("/{eval_id}/runs/{run_id}")
def cancel_run(eval_id: str, run_id: str, session: SessionDep, tenant: TenantDep) -> dict:
    """Cancels a queued or running run: a running one stops before its next item's grading and keeps no counts."""
    row = _get_run(session, eval_id, run_id, tenant)
    queries.cancel_eval_run(session, row)
    session.commit()
    session.refresh(row)
    return run_object(row)


@router.delete("/{eval_id}/runs/{run_id}")
def delete_run(eval_id: str, run_id: str, session: SessionDep, tenant: TenantDep) -> dict:
    row = _get_run(session, eval_id, run_id, tenant)
    queries.delete_eval_run(session, row)
    session.commit()
    return {"object": "eval.run.deleted", "deleted": True, "run_id": run_id}


@router.get("/{eval_id}/runs/{run_id}/output_items")
def list_output_items(
    eval_id: str,
    run_id: str,
    session: SessionDep,
    tenant: TenantDep,
    page: PageDep,
    status: Annotated[str | None, Query(description="pass, fail or error")] = None,
) -> dict:
    run = _get_run(session, eval_id, run_id, tenant)
    cursor = None
    if page.after:
        cursor = queries.get_output_item(session, run_id, page.after)
        if cursor is None:
            raise not_found("output item", page.after, param="after")
    # OpenAI's `fail` filter names the items that did not pass.
    rows, has_more = queries.page_output_items(session, run_id, status=status, after=cursor, limit=page.limit,
                                               order=page.order)  # fmt: skip
    return _list([output_item_object(row, run) for row in rows], has_more)


@router.get("/{eval_id}/runs/{run_id}/output_items/{item_id}")
def retrieve_output_item(
    eval_id: str, run_id: str, item_id: str, session: SessionDep, tenant: TenantDep
) -> dict:
    run = _get_run(session, eval_id, run_id, tenant)
    row = queries.get_output_item(session, run_id, item_id)
    if row is None:
        raise not_found("output item", item_id, param="output_item_id")
    return output_item_object(row, run)


@job_runs_router.get("/{job_id}/eval_runs")
def list_job_eval_runs(job_id: str, session: SessionDep, tenant: TenantDep) -> dict:
    """The newest eval runs (at most 20) that sampled the model the job made; none before it made one."""
    job = queries.get_job(session, job_id, tenant)
    if job is None:
        raise not_found("fine-tuning job", job_id, param="job_id")
    rows = queries.eval_runs_of_model(session, job.fine_tuned_model, tenant) if job.fine_tuned_model else []
    return _list([run_object(row) for row in rows], False)
