"""Grading: a grader (fusetune/spec/graders.py) scores sampled completions against their dataset items.

`grade_many` is what the reinforcement method calls once per step with every completion of the step; it runs
python graders in the sandbox, in parallel, and every other grader in this process. `grade` is one sample.
A grader that fails on a sample (a missing `{{ item.* }}` variable, a python grader that raised, ran out of time
or memory, a formula with no value) gives that sample a score of 0 and says why in `error`: it never raises,
so a bad sample costs its score, not the job. What cannot grade anything (python graders off, a model grader)
is refused before grading by `check_grader`, and a job whose first lines lack a `{{ item.* }}` variable its
grader reads by `preflight_grader`: both run when a job is created.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fusetune.config import Settings
from fusetune.graders.sandbox import run_python_grader, unavailable
from fusetune.graders.similarity import similarity
from fusetune.graders.templates import TemplateError, lookup, render
from fusetune.spec.graders import (
    AnyGrader,
    FormulaError,
    LabelModelGrader,
    MultiGrader,
    PythonGrader,
    ScoreModelGrader,
    StringCheckGrader,
    TextSimilarityGrader,
    sub_graders,
    template_references,
)
from fusetune.spec.hyperparameters import SpecError


@dataclass(frozen=True)
class Sample:
    """A sampled completion as graders see it (`{{ sample.* }}`, a python grader's `sample`)."""

    output_text: str
    output_json: Any = None  # the text's JSON value, when the text is JSON

    @classmethod
    def from_text(cls, text: str) -> Sample:
        try:
            return cls(text, json.loads(text))
        except ValueError:
            return cls(text)

    def as_dict(self) -> dict[str, Any]:
        # output_tools and choices are OpenAI's for tool-calling and multi-choice samples; these have none.
        return {
            "output_text": self.output_text,
            "output_json": self.output_json,
            "output_tools": [],
            "choices": [],
        }


# The kinds of failure, named as OpenAI's grader run reports them (`metadata.errors`).
INVALID_VARIABLE = "invalid_variable_error"
FORMULA = "formula_parse_error"
PYTHON_RUNTIME = "python_grader_runtime_error"
PYTHON_SERVER = "python_grader_server_error"
OTHER = "other_error"


@dataclass(frozen=True)
class GradeResult:
    """A sample's score; `per_grader` holds each named sub-grader's score (a multi grader's) or the grader's own
    under its name; `error` says why the score is 0 when grading failed, `error_type` which kind it was."""

    score: float
    per_grader: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    error_type: str | None = None


@dataclass(frozen=True)
class _Outcome:
    score: float = 0.0
    error: str | None = None
    error_type: str | None = None


def _fields(grader: AnyGrader, field: str) -> Iterator[tuple[str, AnyGrader]]:
    """Each grader that scores (a multi grader's, or the grader itself) with the request field it is at."""
    for name, each in sub_graders(grader).items():
        yield (f"{field}.graders.{name}" if isinstance(grader, MultiGrader) else field), each


def check_grader(grader: AnyGrader, settings: Settings, field: str = "grader") -> None:
    """Raises SpecError, naming the field, for a grader this server cannot run; silent otherwise."""
    for where, each in _fields(grader, field):
        if isinstance(each, PythonGrader):
            if not settings.python_graders:
                raise SpecError(
                    f"{where}.type",
                    "python graders are off on this server; its operator enables them with "
                    "FUSETUNE_PYTHON_GRADERS=true (they run sandboxed: see the README's Graders section)",
                )
            missing = unavailable()
            if missing:
                raise SpecError(f"{where}.type", f"python graders cannot run on this server: {missing}")
        elif isinstance(each, TextSimilarityGrader) and each.evaluation_metric == "cosine":
            raise SpecError(
                f"{where}.evaluation_metric",
                "cosine compares embeddings, and this server has no embedding model; use fuzzy_match, bleu, "
                "gleu, meteor, rouge_1 to rouge_5 or rouge_l",
            )
        elif isinstance(each, ScoreModelGrader | LabelModelGrader):
            raise SpecError(
                f"{where}.type",
                f"{each.type} graders (a model grading the sample) are not available on this server; use "
                "string_check, text_similarity, python or multi",
            )


def preflight_grader(
    grader: AnyGrader, items: Iterable[tuple[int, Mapping[str, Any]]], source: str, field: str = "grader"
) -> None:
    """Raises SpecError naming the template's field and the line when one of `items` ((line number, item) pairs:
    the first lines of a job's file, named by `source`) lacks a variable the grader reads as `{{ item.* }}`:
    every sample of that line would score 0. What `{{ sample.* }}` holds is known only once sampled."""
    templates = [
        (f"{where}.{name}", reference)
        for where, each in _fields(grader, field)
        if isinstance(each, StringCheckGrader | TextSimilarityGrader)
        for name in ("input", "reference")
        for reference in template_references(getattr(each, name))
        if reference.namespace == "item"
    ]
    if not templates:
        return
    for line, item in items:
        for where, reference in templates:
            try:
                lookup(reference, {"item": item})
            except TemplateError as exc:
                raise SpecError(
                    where,
                    f"{exc}: line {line} of {source} cannot be graded (every line needs what the "
                    "grader reads as {{ item.* }})",
                ) from exc


def _namespaces(sample: Sample, item: Mapping[str, Any]) -> dict[str, Any]:
    return {"sample": sample.as_dict(), "item": item}


def _grade_here(grader: AnyGrader, sample: Sample, item: Mapping[str, Any]) -> _Outcome:
    """A grader that needs no sandbox, on one sample."""
    namespaces = _namespaces(sample, item)
    try:
        if isinstance(grader, StringCheckGrader):
            text, reference = render(grader.input, namespaces), render(grader.reference, namespaces)
            passed = {
                "eq": text == reference,
                "ne": text != reference,
                "like": reference in text,
                "ilike": reference.lower() in text.lower(),
            }[grader.operation]
            return _Outcome(1.0 if passed else 0.0)
        if isinstance(grader, TextSimilarityGrader):
            text, reference = render(grader.input, namespaces), render(grader.reference, namespaces)
            return _Outcome(similarity(grader.evaluation_metric, text, reference))
    except TemplateError as exc:
        return _Outcome(error=str(exc), error_type=INVALID_VARIABLE)
    # check_grader refuses these before grading; a caller that skipped it gets a 0 that says why.
    return _Outcome(error=f"{grader.type} graders are not available on this server", error_type=OTHER)


def _python_outcomes(
    grader: PythonGrader, samples: Sequence[Sample], items: Sequence[Mapping[str, Any]], settings: Settings
) -> list[_Outcome]:
    if not settings.python_graders:
        return [_Outcome(error="python graders are off on this server", error_type=OTHER)] * len(samples)
    results = run_python_grader(
        grader.source, [(sample.as_dict(), dict(item)) for sample, item in zip(samples, items, strict=True)],
        settings,
    )  # fmt: skip
    outcomes = []
    for result in results:
        if result.error is not None:
            outcomes.append(
                _Outcome(error=result.error, error_type=PYTHON_RUNTIME if result.raised else PYTHON_SERVER)
            )
        else:
            outcomes.append(_Outcome(result.score))
    return outcomes


def grade_many(
    grader: AnyGrader,
    samples: Sequence[Sample | str],
    items: Sequence[Mapping[str, Any]],
    settings: Settings,
) -> list[GradeResult]:
    """Each sample graded against its item (`samples[i]` with `items[i]`); python graders run sandboxed, the
    samples in parallel, each with the server's time limit. Never raises for a sample: see GradeResult."""
    if len(samples) != len(items):
        raise ValueError(f"{len(samples)} samples but {len(items)} items; each sample needs its item")
    samples = [Sample.from_text(s) if isinstance(s, str) else s for s in samples]
    named = sub_graders(grader)
    outcomes: dict[str, list[_Outcome]] = {}
    for name, each in named.items():
        if isinstance(each, PythonGrader):
            outcomes[name] = _python_outcomes(each, samples, items, settings)
        else:
            outcomes[name] = [
                _grade_here(each, sample, item) for sample, item in zip(samples, items, strict=True)
            ]
    formula = grader.formula() if isinstance(grader, MultiGrader) else None
    results = []
    for index in range(len(samples)):
        per_grader = {name: outcomes[name][index].score for name in named}
        failed = next((outcomes[name][index] for name in named if outcomes[name][index].error), None)
        if failed is not None:
            failed_name = next(name for name in named if outcomes[name][index].error)
            error = failed.error if formula is None else f"{failed_name}: {failed.error}"
            results.append(GradeResult(0.0, per_grader, error, failed.error_type))
            continue
        if formula is None:
            results.append(GradeResult(per_grader[grader.name], per_grader))
            continue
        try:
            results.append(GradeResult(formula.evaluate(per_grader), per_grader))
        except FormulaError as exc:
            results.append(GradeResult(0.0, per_grader, f"calculate_output {exc}", FORMULA))
    return results


def grade(
    grader: AnyGrader, *, sample: Sample | str, item: Mapping[str, Any], settings: Settings
) -> GradeResult:
    """One sample graded against its item (see grade_many)."""
    return grade_many(grader, [sample], [item], settings)[0]
