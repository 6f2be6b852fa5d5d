"""Running one eval run: claim it in SQL, sample the model on every item through the serving engine, grade each
sample with every testing criterion, write the output items and the counts.

The run row is the truth, as a job's is: a message for a run that is not `queued` (a redelivery, a canceled run)
does nothing. Every item's request goes to the engine at once, so its iteration-level batching decodes them
together. A sample the engine refuses (a prompt longer than the model's context) or a grader that fails on it
makes that item `error`ed, not the run; a model that cannot be loaded, or a file that cannot be read, fails the
run with an error naming the cause.
"""

from __future__ import annotations

import json
import logging
import queue
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from sqlalchemy.orm import Session, sessionmaker

from fusetune.capacity import workers_alive_since
from fusetune.config import Settings
from fusetune.db import queries
from fusetune.db.models import EvalRun, EvalRunOutputItem
from fusetune.graders import Sample, grade_many
from fusetune.graders.templates import TemplateError, lookup, render
from fusetune.serving.errors import ServingError
from fusetune.serving.server import LazyEngine, resolve_model
from fusetune.spec.chat import ChatCompletionCreate
from fusetune.spec.evals import (
    DEFAULT_MAX_COMPLETION_TOKENS,
    DEFAULT_SEED,
    MAX_RUN_ITEMS,
    CompletionsDataSource,
    FileContentSource,
    ItemReferenceInput,
    RunStatus,
    passed,
)
from fusetune.spec.graders import parse_grader
from fusetune.storage import Storage, StorageError
from fusetune.worker.locations import ModelLocations
from fusetune.worker.train.outcome import TrainingFailure

log = logging.getLogger(__name__)

# How often a run waiting on its samples looks whether it was canceled.
CANCEL_CHECK_S = 1.0


class RunFailure(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class _Sampled:
    messages: list[dict[str, str]]
    text: str = ""
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    handle: Any = None
    parts: list[str] = field(default_factory=list)


def _read_items(storage: Storage, tenant: str, storage_name: str) -> list[tuple[dict, dict | None]]:
    raw = b"".join(storage.iter_file(tenant, storage_name)).decode("utf-8-sig")
    rows = [json.loads(line) for line in raw.splitlines() if line.strip()]
    return [(row["item"], row.get("sample")) for row in rows]


def _messages(data_source: CompletionsDataSource, item: dict[str, Any]) -> list[dict[str, str]]:
    """The prompt for one item; raises TemplateError naming what the item lacks."""
    source = data_source.input_messages
    if isinstance(source, ItemReferenceInput):
        value = lookup(source.reference(), {"item": item})
        if not isinstance(value, list) or not all(isinstance(m, dict) and "role" in m for m in value):
            raise TemplateError(f"{source.item_reference} is not a list of messages with a role each")
        messages = []
        for message in value:
            content = message.get("content") or ""
            if isinstance(content, list):
                content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
            messages.append({"role": message["role"], "content": str(content)})
        return messages
    return [{"role": m.role, "content": render(m.text, {"item": item})} for m in source.template]


def _seed(data_source: CompletionsDataSource) -> int:
    params = data_source.sampling_params
    return params.seed if params is not None and params.seed is not None else DEFAULT_SEED


@dataclass(eq=False)
class EvalRunner:
    settings: Settings
    session_factory: sessionmaker[Session]
    storage: Storage
    locations: ModelLocations
    worker_name: str
    # The worker's chat engine, asked at each run: None on a worker that serves no chat.
    serving_engine: Callable[[], LazyEngine | None]
    _own_engine: LazyEngine | None = field(default=None, init=False)

    def engine(self) -> LazyEngine:
        """The worker's chat completions engine (its models stay warm for chat), or, on a worker that serves
        none, one of the runner's own, built (torch imported) at its first run."""
        engine = self.serving_engine()
        if engine is not None:
            return engine
        if self._own_engine is None:
            self._own_engine = LazyEngine(
                self.settings.serving_idle_s, self.settings.serving_max_batch, self.settings.serving_max_len
            )
        return self._own_engine

    def run(self, run_id: str) -> str:
        try:
            return self._claim_and_run(run_id)
        finally:
            if self._own_engine is not None:
                # Nothing pauses the runner's own engine before a job trains here: its models go now, not
                # after serving_idle_s, so that the next job has the devices' memory.
                self._own_engine.pause()
                self._own_engine.resume()

    def _claim_and_run(self, run_id: str) -> str:
        with self.session_factory() as session:
            run = queries.claim_eval_run(session, run_id, self.worker_name)
            session.commit()
            if run is None:
                log.info("eval run %s is not queued; nothing to do", run_id)
                return "skipped"
            evaluation = queries.get_eval(session, run.eval_id, run.tenant)
            criteria = [parse_grader(c) for c in evaluation.testing_criteria] if evaluation else []
        try:
            if evaluation is None:
                raise RunFailure("eval_not_found", f"The eval {run.eval_id} was deleted.")
            fields = self._run(run, criteria)
        except RunFailure as failure:
            log.warning("eval run %s failed: %s", run_id, failure.message)
            with self.session_factory() as session:
                queries.finish_eval_run(session, run_id, RunStatus.FAILED, self.worker_name,
                                        error={"code": failure.code, "message": failure.message})  # fmt: skip
                session.commit()
            return RunStatus.FAILED
        except Exception:
            log.exception("eval run %s failed", run_id)
            with self.session_factory() as session:
                message = "The run failed on the worker; the worker's log has the traceback."
                queries.finish_eval_run(session, run_id, RunStatus.FAILED, self.worker_name,
                                        error={"code": "internal_error", "message": message})  # fmt: skip
                session.commit()
            return RunStatus.FAILED
        if fields is None:
            return RunStatus.CANCELED
        with self.session_factory() as session:
            finished = queries.finish_eval_run(
                session, run_id, RunStatus.COMPLETED, self.worker_name, **fields
            )
            session.commit()
        return RunStatus.COMPLETED if finished else RunStatus.CANCELED

    # ---- the run -------------------------------------------------------------------------------------------

    def _canceled(self, run_id: str) -> bool:
        with self.session_factory() as session:
            return not queries.eval_run_held_by(session, run_id, self.worker_name)

    def _items(self, run: EvalRun, data_source: CompletionsDataSource) -> list[tuple[dict, dict | None]]:
        source = data_source.source
        if isinstance(source, FileContentSource):
            return [(row.item, row.sample) for row in source.content]
        with self.session_factory() as session:
            file = queries.get_file(session, source.id, run.tenant)
        if file is None:
            raise RunFailure("file_not_found", f"data_source.source.id: the file {source.id} was deleted.")
        try:
            items = _read_items(self.storage, run.tenant, file.storage_name)
        except StorageError as error:
            raise RunFailure("storage_error", f"The file {source.id} could not be read: {error}") from error
        if len(items) > MAX_RUN_ITEMS:
            raise RunFailure("too_many_items", f"The file {source.id} has {len(items):,} items; a run samples at "
                             f"most {MAX_RUN_ITEMS:,}.")  # fmt: skip
        return items

    def _sample(
        self, run: EvalRun, data_source: CompletionsDataSource, prompts: list[_Sampled | None]
    ) -> bool:
        """Samples every prompt (None: an item whose prompt could not be rendered); False when the run was
        canceled meanwhile."""
        engine = self.engine()
        try:
            key, load = resolve_model(engine, self.locations, data_source.model, run.tenant)
        except ServingError as error:
            raise RunFailure("model_not_found", f"data_source.model: {error.message}") from error
        params = data_source.sampling_params
        events: queue.Queue = queue.Queue()
        waiting = 0
        for index, sampled in enumerate(prompts):
            if sampled is None:
                continue
            try:
                body = ChatCompletionCreate(
                    model=data_source.model,
                    messages=sampled.messages,
                    temperature=params.temperature if params else None,
                    top_p=params.top_p if params else None,
                    seed=_seed(data_source),
                    max_completion_tokens=(params and params.max_completion_tokens)
                    or DEFAULT_MAX_COMPLETION_TOKENS,
                )
            except ValidationError as error:  # an item's own messages in a shape chat does not take
                sampled.error = f"input_messages: {error.errors()[0]['msg']}"
                continue
            try:
                sampled.handle = engine.submit(key, load, body, lambda event, i=index: events.put((i, event)))
                waiting += 1
            except ServingError as error:
                if error.status_code == 503:  # the engine paused or stopped: the run cannot go on here
                    raise RunFailure("worker_unavailable", error.message) from error
                sampled.error = error.message
            except TrainingFailure as failure:
                raise RunFailure("model_load_failed",
                                 f"data_source.model: '{data_source.model}' could not be loaded: {failure}") from failure  # fmt: skip
        while waiting:
            try:
                index, (kind, first, second) = events.get(timeout=CANCEL_CHECK_S)
            except queue.Empty:
                if self._canceled(run.id):
                    for sampled in prompts:
                        if sampled is not None and sampled.handle is not None:
                            sampled.handle.cancelled.set()
                    return False
                continue
            sampled = prompts[index]
            if kind == "delta":
                sampled.parts.append(second)
            elif kind == "finish":
                sampled.finish_reason = second
            elif kind in ("usage", "error"):
                if kind == "usage":
                    sampled.prompt_tokens, sampled.completion_tokens = first, second
                else:
                    sampled.error = second
                sampled.text = "".join(sampled.parts)
                waiting -= 1
        return True

    def _run(self, run: EvalRun, criteria: list) -> dict[str, Any] | None:
        data_source = CompletionsDataSource.model_validate(run.data_source)
        items = self._items(run, data_source)
        prompts: list[_Sampled | None] = []
        render_errors: dict[int, str] = {}
        for index, (item, _sample) in enumerate(items):
            try:
                prompts.append(_Sampled(_messages(data_source, item)))
            except TemplateError as error:
                prompts.append(None)
                render_errors[index] = f"input_messages: {error}"
        if not self._sample(run, data_source, prompts):
            return None
        graded_indexes = [i for i, s in enumerate(prompts) if s is not None and s.error is None]
        graded_items = [items[i][0] for i in graded_indexes]
        graded_samples = [Sample.from_text(prompts[i].text) for i in graded_indexes]
        scores = {
            position: grade_many(criterion, graded_samples, graded_items, self.settings)
            for position, criterion in enumerate(criteria)
        }
        params = data_source.sampling_params
        counts = {"total": len(items), "passed": 0, "failed": 0, "errored": 0}
        per_criterion = [{"testing_criteria": c.name, "passed": 0, "failed": 0} for c in criteria]
        usage = {"prompt_tokens": 0, "completion_tokens": 0}
        rows = []
        row_of_graded = {index: order for order, index in enumerate(graded_indexes)}
        for index, (item, _sample) in enumerate(items):
            sampled = prompts[index]
            error = render_errors.get(index) or (sampled.error if sampled else None)
            results = []
            if error is None:
                for position, criterion in enumerate(criteria):
                    result = scores[position][row_of_graded[index]]
                    ok = result.error is None and passed(criterion, result.score)
                    error = error or (f"{criterion.name}: {result.error}" if result.error else None)
                    results.append({"name": criterion.name, "type": criterion.type, "score": result.score,
                                    "passed": ok, "sample": None})  # fmt: skip
                    if result.error is None:
                        per_criterion[position]["passed" if ok else "failed"] += 1
            if error is not None:
                status = "error"
            else:
                status = "pass" if all(r["passed"] for r in results) else "fail"
            counts[{"pass": "passed", "fail": "failed", "error": "errored"}[status]] += 1
            if sampled is not None:
                usage["prompt_tokens"] += sampled.prompt_tokens
                usage["completion_tokens"] += sampled.completion_tokens
            sample = {
                "input": sampled.messages if sampled else [],
                "output": [{"role": "assistant", "content": sampled.text}] if sampled and not sampled.error else [],
                "finish_reason": sampled.finish_reason if sampled else "",
                "model": data_source.model,
                "usage": {"prompt_tokens": sampled.prompt_tokens if sampled else 0,
                          "completion_tokens": sampled.completion_tokens if sampled else 0,
                          "total_tokens": (sampled.prompt_tokens + sampled.completion_tokens) if sampled else 0,
                          "cached_tokens": 0},
                "error": {"code": "sample_error", "message": error} if error else {"code": "", "message": ""},
                "temperature": params.temperature if params and params.temperature is not None else 1.0,
                "max_completion_tokens": (params and params.max_completion_tokens) or DEFAULT_MAX_COMPLETION_TOKENS,
                "top_p": params.top_p if params and params.top_p is not None else 1.0,
                "seed": _seed(data_source),
            }  # fmt: skip
            rows.append(EvalRunOutputItem(run_id=run.id, datasource_item_id=index, datasource_item=item,
                                          status=status, sample=sample, results=results))  # fmt: skip
        with self.session_factory() as session:
            if not queries.eval_run_held_by(session, run.id, self.worker_name):
                return None  # canceled, deleted, or requeued (this worker taken for lost) while grading
            session.add_all(rows)
            session.commit()
        invocations = sum(1 for sampled in prompts if sampled is not None and sampled.handle is not None)
        model_usage = {"model_name": data_source.model, "invocation_count": invocations,
                       **usage, "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
                       "cached_tokens": 0}  # fmt: skip
        return {
            "result_counts": counts,
            "per_testing_criteria_results": per_criterion,
            "per_model_usage": [model_usage],
        }


def reap_lost_eval_runs(settings: Settings, session_factory, requeue: Callable[[str], None]) -> list[str]:
    """Requeues in-progress runs whose worker stopped beating (killed, frozen, cut off from the database), or
    fails them once max_attempts workers claimed them: the policy of jobs (fusetune.worker.tasks.reap_lapsed_jobs),
    with the worker's heartbeat for the lease (a run holds no lease of its own). Any worker may run this."""
    requeued = []
    with session_factory() as session:
        for run in queries.lost_eval_runs(session, workers_alive_since(settings)):
            if run.attempts < settings.max_attempts:
                if queries.requeue_eval_run(session, run.id, run.worker):
                    session.commit()
                    requeue(run.id)
                    requeued.append(run.id)
                else:
                    session.rollback()  # the run moved on meanwhile
                continue
            message = (f"The run's worker ({run.worker}) stopped responding; giving up after {run.attempts} "
                       f"attempts (max_attempts).")  # fmt: skip
            queries.finish_eval_run(session, run.id, RunStatus.FAILED, run.worker,
                                    error={"code": "worker_lost", "message": message})  # fmt: skip
            session.commit()
    return requeued
