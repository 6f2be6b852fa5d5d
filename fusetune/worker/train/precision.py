"""A job's precision mode (fusetune/spec/precision.py) resolved once for the device and the parallelism.

The trainer asks the resolved `PrecisionPolicy` for everything that depends on the mode: the dtype the model
loads in, the autocast context, the FSDP mixed-precision policy and the peak FLOP/s that MFU divides by. A
mode the device cannot run (a GPU mode on a CPU, float8 below compute capability 8.9) is refused here, before
the model loads, with the reason.
"""

from __future__ import annotations

import contextlib
import importlib.util
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
    def float8_linears(self) -> bool:
        """Whether the decoder's linear layers compute in float8 (fusetune/worker/train/float8.py)."""
        return self.mode.float8_linears

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


def resolve_precision(
    name: str,
    device: torch.device,
    fsdp: bool = False,
    capability: tuple[int, int] | None = None,
    gpu_name: str | None = None,
) -> PrecisionPolicy:
    """The policy of a job's `precision` on `device`, once the plan has made "auto" concrete; raises
    ValueError as `runnable_mode` does."""
    return PrecisionPolicy(runnable_mode(name, device, capability, gpu_name), device, fsdp)


def runnable_mode(
    name: str,
    device: torch.device,
    capability: tuple[int, int] | None = None,
    gpu_name: str | None = None,
) -> PrecisionMode:
    """The mode `name` names on `device`; raises ValueError, saying why and what to use instead, for a GPU-only
    mode on a CPU or a mode that needs a newer GPU than `device` (`capability` and `gpu_name`: the device's,
    read from CUDA when None). The trainer asks it of the job's precision before anything loads."""
    on_gpu = device.type == "cuda"
    mode = mode_for(name, on_gpu)
    if mode.needs_gpu and not on_gpu:
        need = ""
        if mode.min_compute_capability is not None:
            need = f" of compute capability {_version(mode.min_compute_capability)} or newer"
        raise ValueError(f"precision {name!r} needs a GPU{need}; use 'fp32' on CPU")
    if on_gpu and mode.min_compute_capability is not None:
        if capability is None or gpu_name is None:
            import torch

            capability = capability or torch.cuda.get_device_capability(device)
            gpu_name = gpu_name or torch.cuda.get_device_name(device)
        if tuple(capability) < mode.min_compute_capability:
            raise ValueError(
                f"precision {name!r} needs a GPU of compute capability "
                f"{_version(mode.min_compute_capability)} or newer (float8 tensor cores: H100, H200, L40S); "
                f"this worker's {gpu_name} is {_version(capability)}: use 'bf16-sr'"
            )
    if mode.float8_linears and importlib.util.find_spec("torchao") is None:
        raise ValueError(f"precision {name!r} needs torchao (float8 training), which this worker lacks")
    return mode


def _version(capability: tuple[int, int]) -> str:
    return ".".join(map(str, capability))
