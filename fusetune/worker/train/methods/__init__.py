"""Training methods by the job specification's `method.type`: adding one is one module and one entry here.

Importing this package does not import torch (the API validates uploads with `parse_example`).
"""

from __future__ import annotations

from fusetune.worker.train.methods.base import TrainingMethod
from fusetune.worker.train.methods.dpo import DirectPreferenceOptimization
from fusetune.worker.train.methods.sft import SupervisedFineTuning

METHODS: dict[str, type[TrainingMethod]] = {
    method.type: method
    for method in (
        SupervisedFineTuning,
        DirectPreferenceOptimization,
    )
}  # fmt: skip
METHOD_TYPES: tuple[str, ...] = tuple(METHODS)
DEFAULT_METHOD = SupervisedFineTuning.type


def method_of_record(record: object) -> str:
    """The method whose line format a decoded JSONL record is in (the default method when none claims it)."""
    return next((name for name, method in METHODS.items() if method.recognizes(record)), DEFAULT_METHOD)


__all__ = ["DEFAULT_METHOD", "METHODS", "METHOD_TYPES", "TrainingMethod", "method_of_record"]
