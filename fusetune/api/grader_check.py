"""A grader checked before anything is graded with it: by `POST /v1/fine_tuning/alpha/graders/validate` and
`/run`, and by job creation, which also tries it on the first lines of the job's files.

- `refuse_unsupported_grader`: a 400 naming the field for a grader this server cannot run (python graders off,
  a model grader, cosine similarity): `fusetune.graders.check_grader`, the one answer to that question.
- `check_job_grader`: job creation's check, the same refusal under `method.reinforcement.grader`, then a 400
  naming the template's field, the file and the line when one of the first `PREFLIGHT_LINES` lines lacks a
  variable the grader reads as `{{ item.* }}` (such a job would train on scores of 0).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from fusetune.api.errors import ApiError
from fusetune.api.file_validation import numbered_examples
from fusetune.config import Settings
from fusetune.db.models import File
from fusetune.graders import check_grader, preflight_grader
from fusetune.spec.graders import AnyGrader
from fusetune.spec.hyperparameters import SpecError
from fusetune.spec.job import JobSpec
from fusetune.spec.methods import METHODS
from fusetune.storage import Storage, StorageError

# A dataset's lines share their fields, so a field a template names and the file lacks shows in the first lines;
# these are read and parsed (not tokenized), which costs little next to the data check's.
PREFLIGHT_LINES = 16


def refuse_unsupported_grader(grader: AnyGrader, settings: Settings, field: str = "grader") -> None:
    try:
        check_grader(grader, settings, field)
    except SpecError as exc:
        raise ApiError(400, f"{exc.field}: {exc}", param=exc.field, code="unsupported_grader") from exc


def _first_items(chunks: Iterator[bytes], parse: Callable[[Any], Any]) -> Iterator[tuple[int, Any]]:
    examples = numbered_examples(chunks, parse)
    for _ in range(PREFLIGHT_LINES):
        try:
            line, example = next(examples)
        except StopIteration:
            return
        except ValueError:
            # A line the method's format refuses: the trainer's data check names it, with its own error.
            return
        yield line, example.item


def check_job_grader(
    settings: Settings,
    storage: Storage,
    tenant: str,
    spec: JobSpec,
    training: File,
    validation: File | None,
) -> None:
    """A job's grader, if its method has one: refused as `/graders/validate` refuses it, then tried on the
    first lines of the training and the validation file (evaluation grades the validation file's lines)."""
    grader = getattr(spec.method.settings, "grader", None)
    if grader is None:
        return
    field = f"method.{spec.method.type}.grader"
    refuse_unsupported_grader(grader, settings, field)
    parse = METHODS[spec.method.type].example_format.parse
    for param, file in (("training_file", training), ("validation_file", validation)):
        if file is None:
            continue
        source = f"{param} '{file.id}' ({file.filename})"
        try:
            preflight_grader(grader, _first_items(storage.iter_file(tenant, file.storage_name), parse), source,
                             field)  # fmt: skip
        except SpecError as exc:
            raise ApiError(
                400, f"{exc.field}: {exc}", param=exc.field, code="invalid_grader_variable"
            ) from exc
        except StorageError as error:
            raise ApiError(503, f"The file store failed: {error}", code="storage_error") from error
