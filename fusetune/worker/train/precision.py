"""A job's precision mode (fusetune/spec/precision.py) resolved once for the device and the parallelism.

The trainer asks the resolved `PrecisionPolicy` for everything that depends on the mode: the dtype the model
loads in, the autocast context, the FSDP mixed-precision policy and the peak FLOP/s that MFU divides by.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fusetune.spec.precision import PrecisionMode, mode_for
from fusetune.worker.train.metrics import peak_flops

if TYPE_CHECKING:
    import torch


def _dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


@dataclass(frozen=True)
class PrecisionPolicy:
    """A mode resolved for one run: its device and whether FSDP shards the model."""

    mode: PrecisionMode
    device: torch.device
    fsdp: bool

    @property
    def name(self) -> str:
        return self.mode.name

    @property
    def weight_dtype(self) -> torch.dtype:
        return _dtype(self.mode.weight_dtype)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        # Under FSDP the mixed-precision policy casts the gathered parameters to the compute dtype instead.
        if self.mode.mixed and not self.fsdp:
            import torch

            return torch.autocast(device_type=self.device.type, dtype=_dtype(self.mode.compute_dtype))
        return contextlib.nullcontext()

    def fsdp_mixed_precision(self):
        """FSDP2's policy: parameters gathered in the compute dtype, gradients reduced in the weights' dtype."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if not self.mode.mixed:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(
            param_dtype=_dtype(self.mode.compute_dtype), reduce_dtype=_dtype(self.mode.weight_dtype)
        )

    def peak_flops(self) -> float | None:
        """What MFU divides by: the device's dense tensor-core peak in the mode's `mfu_peak_dtype` (bf16 for
        every mode, so that MFU compares across modes); None on CPU or an unknown GPU."""
        if self.device.type != "cuda":
            return None
        import torch

        return peak_flops(torch.cuda.get_device_name(self.device), self.mode.mfu_peak_dtype)


def resolve_precision(name: str, device: torch.device, fsdp: bool = False) -> PrecisionPolicy:
    """The policy of a job's `precision` on `device`; raises ValueError for a GPU-only mode on a CPU."""
    on_gpu = device.type == "cuda"
    mode = mode_for(name, on_gpu)
    if mode.needs_gpu and not on_gpu:
        raise ValueError(f"precision {name!r} needs a GPU; use 'fp32' on CPU")
    return PrecisionPolicy(mode, device, fsdp)
