"""The data check at job creation and in the dry run (fusetune/tokenization/check.py), before any GPU time.

It runs where the server holds the model's tokenizer: a base model's folder in the models directory with a
tokenizer.json, loaded without torch. It checks the first `CHECKED_EXAMPLES` examples of the training and the
validation file (a template's mistake shows in the first example it renders; the trainer checks every example
again before the model loads). A fine-tuned model's tokenizer lives with its checkpoints, and a method with no
assistant targets has no check: then the data is not checked here, and the answer says why.
"""

from __future__ import annotations

import threading
from functools import lru_cache
from pathlib import Path
from typing import Any

from fusetune.api.errors import ApiError
from fusetune.api.file_validation import numbered_examples
from fusetune.api.schemas import (
    DataCheckFailureObject,
    DataCheckFile,
    DataCheckObject,
    DataCheckPreview,
    DataCheckSegment,
    DataCheckSequence,
)
from fusetune.catalog import base_model_location
from fusetune.config import Settings
from fusetune.db.models import File
from fusetune.spec.job import JobSpec
from fusetune.spec.methods import METHODS
from fusetune.storage import Storage, StorageError
from fusetune.tokenization.check import (
    CHECKS,
    FileCheck,
    check_examples,
    failure_message,
    marked_text,
    masking_for,
)
from fusetune.tokenization.tokenizer import load_tokenizer_without_torch, stop_token_ids

# About 2 ms an example for short chats on one core; a long conversation takes longer to render.
CHECKED_EXAMPLES = 256
# The Rust tokenizer is shared between request threads; one check at a time keeps its state (truncation and
# padding settings that a call may set) out of another's way.
_CHECK_LOCK = threading.Lock()
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
)


@lru_cache(maxsize=8)
def _cached_tokenizer(model_dir: str, _versions: tuple[int, ...]) -> Any | None:
    return load_tokenizer_without_torch(model_dir)


def _tokenizer(model_dir: Path) -> Any | None:
    """The folder's tokenizer, loaded once per version of its files (a Llama-3 tokenizer.json takes a second)."""
    versions = tuple(
        (model_dir / name).stat().st_mtime_ns if (model_dir / name).is_file() else 0
        for name in _TOKENIZER_FILES
    )
    return _cached_tokenizer(str(model_dir), versions)


def _not_checked(reason: str) -> DataCheckObject:
    return DataCheckObject(status="not_checked", reason=reason)


def _preview(file: File, line: int, previews: list) -> DataCheckPreview:
    return DataCheckPreview(
        file=file.id,
        line=line,
        sequences=[
            DataCheckSequence(
                label=sequence.label,
                tokens=sequence.tokens,
                trained_tokens=sequence.trained_tokens,
                segments=[DataCheckSegment(text=s.text, trained=s.trained) for s in sequence.segments],
            )
            for sequence in previews
        ],
        marked_text=marked_text(previews),
    )


def check_job_data(
    settings: Settings,
    storage: Storage,
    tenant: str,
    model: str,
    spec: JobSpec,
    files: list[tuple[str, File]],
) -> DataCheckObject:
    """The data check of a job's files ((param, file) pairs, the training file first)."""
    method_type = spec.method.type
    masking = masking_for(method_type)
    if masking is None:
        return _not_checked(f"the {method_type} method's {METHODS[method_type].example_format.name} examples "
                            "have no assistant targets to check")  # fmt: skip
    location = base_model_location(settings, model)
    model_dir = Path(location) if location is not None else None
    if model_dir is None or not model_dir.is_dir():
        return _not_checked("the model's tokenizer is not in the models directory: the trainer checks the data "
                            "before the model loads")  # fmt: skip
    tokenizer = _tokenizer(model_dir)
    if tokenizer is None:
        return _not_checked("the model's folder has no tokenizer.json: the trainer checks the data before the "
                            "model loads")  # fmt: skip
    hyperparameters = spec.hyperparameters
    result = DataCheckObject(status="passed", checks=CHECKS)
    with _CHECK_LOCK:
        stop_ids = stop_token_ids(tokenizer, model_dir)
        result.stop_tokens = [tokenizer.decode([i], skip_special_tokens=False) for i in sorted(stop_ids)]
        parse = METHODS[method_type].example_format.parse
        for param, file in files:
            try:
                checked: FileCheck = check_examples(
                    tokenizer,
                    masking,
                    numbered_examples(storage.iter_file(tenant, file.storage_name), parse),
                    max_seq_length=hyperparameters.max_seq_length,
                    # The trainer's option; a job's specification does not offer it (yet), and then it is off.
                    train_on_inputs=getattr(hyperparameters, "train_on_inputs", False),
                    stop_ids=stop_ids,
                    limit=CHECKED_EXAMPLES,
                )
            except StorageError as error:
                raise ApiError(503, f"The file store failed: {error}", code="storage_error") from error
            result.files.append(
                DataCheckFile(
                    file=file.id,
                    param=param,
                    examples_checked=checked.examples_checked,
                    all_examples_checked=checked.complete,
                    examples_truncated=checked.examples_truncated,
                    examples_without_trained_tokens=checked.examples_without_trained_tokens,
                )
            )
            if checked.line is not None and (result.preview is None or not checked.passed):
                result.preview = _preview(file, checked.line, checked.preview)
            if checked.failure is not None:
                where = f"{param} '{file.id}' ({file.filename}), line {checked.line}"
                result.status = "failed"
                result.failure = DataCheckFailureObject(
                    check=checked.failure.check,
                    file=file.id,
                    param=param,
                    line=checked.line,
                    problem=checked.failure.problem,
                    message=failure_message(tokenizer, checked.failure, where),
                )
                break
    return result


def refuse_if_the_data_fails(data_check: DataCheckObject) -> None:
    """A 400 naming the check, the file and the line, with the example's trained spans marked."""
    failure = data_check.failure
    if failure is not None:
        raise ApiError(400, failure.message, param=failure.param, code="data_check_failed")
