"""The training engine the worker launches with torchrun: `python -m torch.distributed.run -m fusetune.worker.train`.

Importing this package stays light (no torch): the worker needs only `TrainConfig` and the outcome files.
"""

from fusetune.worker.train.config import LoraConfig, TrainConfig
from fusetune.worker.train.outcome import ErrorCode, TrainResult, read_error, read_result, read_stopped

__all__ = [
    "ErrorCode",
    "LoraConfig",
    "TrainConfig",
    "TrainResult",
    "read_error",
    "read_result",
    "read_stopped",
]
