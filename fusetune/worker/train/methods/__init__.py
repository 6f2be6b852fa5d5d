"""The training half of each method of the specification's table (fusetune/spec/methods.py), by `type`.

Each module of this package holds one `TrainingMethod` subclass; `training_method` finds it by its `type`, so
adding a method is its module here and its entry in the specification's table, nothing else.
"""

from __future__ import annotations

import importlib
import pkgutil

from fusetune.worker.train.methods.base import TrainingMethod


def _training_methods() -> dict[str, type[TrainingMethod]]:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    return {method.type: method for method in _subclasses(TrainingMethod)}


def _subclasses(cls: type) -> list[type]:
    found = []
    for subclass in cls.__subclasses__():
        if "type" in vars(subclass):
            found.append(subclass)
        found.extend(_subclasses(subclass))
    return found


TRAINING_METHODS: dict[str, type[TrainingMethod]] = _training_methods()

__all__ = ["TRAINING_METHODS", "TrainingMethod"]
