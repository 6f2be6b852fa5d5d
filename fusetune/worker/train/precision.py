"""Precision modes: what a job's `precision` means, resolved once for the device and the parallelism.

A mode says which dtype the weights are kept and updated in, which dtype the matmuls run in, which optimizer
(from `optim.OPTIMIZERS`) updates them and in which dtype that optimizer keeps its state. The trainer asks the
resolved `PrecisionPolicy` for everything that depends on it: the dtype the model loads in, the autocast
context, the FSDP mixed-precision policy and the peak FLOP/s that MFU divides by; `fusetune.estimate` asks the
mode for bytes per parameter.

Adding a mode is one entry in `PRECISIONS` (and its optimizer's entry in `optim.OPTIMIZERS` if it brings one);
the job specification offers every name in the table. This module imports torch only inside the functions that
build torch objects, so the API can read the table.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fusetune.worker.train import optim

if TYPE_CHECKING:
    import torch

AUTO = "auto"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class PrecisionMode:
    name: str
    weight_dtype: str  # parameters as loaded, trained and saved
    compute_dtype: str  # matmuls: under autocast (one process, DDP) or FSDP's gathered parameters
    optimizer: str  # key of optim.OPTIMIZERS
    optimizer_state_dtype: str
    needs_gpu: bool
    description: str

    @property
    def mixed(self) -> bool:
        """Compute in a narrower dtype than the weights (autocast, or FSDP's bf16 gathers)."""
        return self.compute_dtype != self.weight_dtype

    @property
    def weight_bytes(self) -> int:
        return DTYPE_BYTES[self.weight_dtype]

    @property
    def compute_copy_bytes(self) -> int:
        """Bytes of the compute-dtype copy a mixed mode makes of each weight (kept for the backward)."""
        return DTYPE_BYTES[self.compute_dtype] if self.mixed else 0

    @property
    def optimizer_state_bytes(self) -> int:
        """Optimizer state per trained parameter."""
        return optim.OPTIMIZERS[self.optimizer].states_per_parameter * DTYPE_BYTES[self.optimizer_state_dtype]


PRECISIONS: dict[str, PrecisionMode] = {
    mode.name: mode
    for mode in (
        PrecisionMode(
            "fp32", "float32", "float32", "adamw", "float32", needs_gpu=False,
            description="fp32 weights, compute and AdamW state",
        ),
        PrecisionMode(
            "bf16-mixed", "float32", "bfloat16", "adamw", "float32", needs_gpu=True,
            description="fp32 weights and AdamW state, bf16 compute (autocast under DDP, bf16-gathered "
            "parameters and fp32 gradient reduction under FSDP)",
        ),
        PrecisionMode(
            "bf16", "bfloat16", "bfloat16", "adamw", "bfloat16", needs_gpu=True,
            description="bf16 weights and AdamW state, rounded to nearest: updates under about 2^-9 of a weight "
            "are lost, so fine-tuning at small learning rates barely moves many weights",
        ),
        PrecisionMode(
            "bf16-sr", "bfloat16", "bfloat16", "adamw-stochastic-rounding", "bfloat16", needs_gpu=True,
            description="bf16 weights, gradients and AdamW state, the update stochastically rounded "
            "(fusetune.kernels.FusedAdamW): the quality of fp32 master weights at half their memory "
            "(tests/kernels/test_adamw_quality.py)",
        ),
    )
}  # fmt: skip
# What "auto" means on each kind of device. On GPUs: bf16-sr, which fine-tuned to the eval loss of fp32 master
# weights (within 0.07%) where plain bf16 did not (tests/kernels/test_adamw_quality.py).
GPU_DEFAULT = "bf16-sr"
CPU_DEFAULT = "fp32"
PRECISION_NAMES: tuple[str, ...] = (AUTO, *PRECISIONS)


def mode_for(name: str, on_gpu: bool = True) -> PrecisionMode:
    """The mode a job's `precision` names ("auto" resolved for a GPU unless `on_gpu` is False)."""
    if name == AUTO:
        name = GPU_DEFAULT if on_gpu else CPU_DEFAULT
    return PRECISIONS[name]


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

    @property
    def optimizer_state_dtype(self) -> torch.dtype:
        return _dtype(self.mode.optimizer_state_dtype)

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
        """What MFU divides by: the device's dense bf16 tensor-core peak, whatever the mode, so that MFU
        compares across modes (None on CPU or an unknown GPU)."""
        if self.device.type != "cuda":
            return None
        import torch

        from fusetune.worker.train.metrics import peak_bf16_flops

        return peak_bf16_flops(torch.cuda.get_device_name(self.device))


def resolve_precision(name: str, device: torch.device, fsdp: bool = False) -> PrecisionPolicy:
    """The policy of a job's `precision` on `device`; raises ValueError for a GPU-only mode on a CPU."""
    on_gpu = device.type == "cuda"
    mode = mode_for(name, on_gpu)
    if mode.needs_gpu and not on_gpu:
        raise ValueError(f"precision {name!r} needs a GPU; use 'fp32' on CPU")
    return PrecisionPolicy(mode, device, fsdp)
