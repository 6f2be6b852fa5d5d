"""Optimizers by name: how each is built and how much state it keeps per parameter.

A precision mode (`precision.PRECISIONS`) names the optimizer that updates its weights; the trainer builds it
with `build_optimizer`, and `fusetune.estimate` counts its state with `states_per_parameter`. Adding one is one
entry in `OPTIMIZERS`. torch is imported only inside the factories, so the API can read the table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class OptimizerEntry:
    name: str
    # Tensors of state per trained parameter, each the size of the parameter (AdamW: exp_avg, exp_avg_sq).
    states_per_parameter: int
    # (parameter groups, learning rate, device) -> the optimizer.
    factory: Callable[[list[dict[str, Any]], float, torch.device], torch.optim.Optimizer]
    # Whether `optimizer.found_inf` (a one-element tensor: 1 = skip) makes `step()` leave parameters and state
    # as they are, decided on the device (torch's fused Adam family); see `skip_step_if`.
    skips_on_found_inf: Callable[[torch.optim.Optimizer], bool]


def _adamw(groups: list[dict[str, Any]], learning_rate: float, device: torch.device) -> torch.optim.Optimizer:
    import torch

    # Fused on GPUs: one kernel for the whole update. The CPU keeps torch's default implementation.
    return torch.optim.AdamW(groups, lr=learning_rate, fused=device.type == "cuda")


OPTIMIZERS: dict[str, OptimizerEntry] = {
    entry.name: entry
    for entry in (
        OptimizerEntry(
            "adamw", states_per_parameter=2, factory=_adamw,
            skips_on_found_inf=lambda optimizer: bool(optimizer.defaults.get("fused")),
        ),
    )
}  # fmt: skip


def parameter_groups(trainable: Sequence[torch.nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """No weight decay on biases and norm weights (1-D), as is usual for transformers."""
    groups = [
        {"params": [p for p in trainable if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


def build_optimizer(
    name: str,
    trainable: Sequence[torch.nn.Parameter],
    *,
    learning_rate: float,
    weight_decay: float,
    device: torch.device,
) -> torch.optim.Optimizer:
    return OPTIMIZERS[name].factory(parameter_groups(trainable, weight_decay), learning_rate, device)


def skip_step_if(optimizer: torch.optim.Optimizer, name: str, condition: torch.Tensor) -> bool:
    """Arrange for the next `optimizer.step()` to change nothing where the boolean `condition` is true, without
    reading it on the host. Returns False when this optimizer cannot (the caller must decide on the host)."""
    if not OPTIMIZERS[name].skips_on_found_inf(optimizer):
        return False
    optimizer.found_inf = condition.float()  # type: ignore[attr-defined]
    return True
