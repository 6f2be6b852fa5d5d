"""The training engine the worker launches with torchrun: `python -m torch.distributed.run -m fusetune.worker.train`.

Importing this package stays light (no torch, nothing imported eagerly): the API reads the specification tables
of `methods/`, `precision.py` and `optim.py`, and the worker needs only `TrainConfig` and the outcome files.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "ErrorCode": "outcome",
    "LoraConfig": "config",
    "TrainConfig": "config",
    "TrainResult": "outcome",
    "read_error": "outcome",
    "read_result": "outcome",
    "read_stopped": "outcome",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    # Imported on first use, so that `fusetune.jobspec` can import this package's tables while config.py
    # imports the job specification.
    if name in _EXPORTS:
        return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
