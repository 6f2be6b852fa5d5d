"""A succeeded job's results file, as the OpenAI API has it: one CSV row per step, stored as a file of purpose
`fine-tune-results` that `GET /v1/files/{id}/content` serves, its id in the job's `result_files`."""

from __future__ import annotations

import csv
import io
import math
from typing import Any

from sqlalchemy.orm import Session

from fusetune.db import queries
from fusetune.db.models import File, Job, new_id
from fusetune.storage import Storage

RESULTS_PURPOSE = "fine-tune-results"
# OpenAI's columns, always there (empty where a step has no value: validation only on evaluation steps, token
# accuracy only for supervised training).
OPENAI_COLUMNS = (
    "step",
    "train_loss",
    "train_mean_token_accuracy",
    "valid_loss",
    "valid_mean_token_accuracy",
)
# What the loop itself reports of every step (fusetune/worker/train/metrics.py, StepMeter): throughput, memory,
# time and schedule, not results of the training. Every other metric is a method's (DPO's reward metrics, its
# valid_ ones) and gets a column after OpenAI's.
LOOP_METRICS = frozenset({
    "learning_rate", "grad_norm", "tokens_per_second", "trained_tokens_per_second", "padding_fraction",
    "tokens_per_second_per_device", "peak_memory_allocated_bytes", "peak_memory_reserved_bytes", "step_time_s",
    "epoch", "eta_s", "mfu", "trained_tokens",
})  # fmt: skip


def result_columns(rows: list[tuple[int, dict[str, Any]]]) -> list[str]:
    """OpenAI's columns, then the method's training metrics and its validation metrics, each in the order
    they first appear."""
    seen: dict[str, None] = {}
    for _, values in rows:
        for name in values:
            if name not in LOOP_METRICS and name not in OPENAI_COLUMNS:
                seen.setdefault(name)
    extra = list(seen)
    return [*OPENAI_COLUMNS, *[n for n in extra if not n.startswith("valid_")],
            *[n for n in extra if n.startswith("valid_")]]  # fmt: skip


def results_csv(rows: list[tuple[int, dict[str, Any]]]) -> bytes:
    columns = result_columns(rows)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(columns)
    for step, values in rows:
        cells = []
        for name in columns:
            value = step if name == "step" else values.get(name)
            ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            cells.append(repr(value) if isinstance(value, float) and ok else value if ok else "")
        writer.writerow(cells)
    return out.getvalue().encode()


def record_results_file(session: Session, storage: Storage, job: Job) -> File:
    """Stores the job's results CSV and records it on the job, in the caller's transaction."""
    content = results_csv(queries.metric_rows(session, job.id))
    file_id = new_id("file-")
    storage_name, filename = f"{file_id}.csv", f"{job.id}-results.csv"
    with storage.file_writer(job.tenant, storage_name, download_name=filename) as writer:
        writer.write(content)
        writer.commit()
    file = File(id=file_id, tenant=job.tenant, filename=filename, purpose=RESULTS_PURPOSE, bytes=len(content),
                storage_name=storage_name)  # fmt: skip
    queries.add_result_file(session, job.id, file)
    return file
