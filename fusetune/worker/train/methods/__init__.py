"""Training methods by the job specification's `method.type`: adding one is one module and one entry here.

Importing this package does not import torch (the API validates uploads with `parse_example`).
"""

from __future__ import annotations

from fusetune.worker.train.methods.base import TrainingMethod
from fusetune.worker.train.methods.sft import SupervisedFineTuning

METHODS: dict[str, type[TrainingMethod]] = {
    method.type: method
    for method in (
        SupervisedFineTuning,
    )
}  # fmt: skip
METHOD_TYPES: tuple[str, ...] = tuple(METHODS)
DEFAULT_METHOD = SupervisedFineTuning.type

__all__ = ["DEFAULT_METHOD", "METHODS", "METHOD_TYPES", "TrainingMethod"]
