"""How each optimizer of the specification's table (fusetune/spec/precision.py, `OPTIMIZERS`) is built.

A precision mode names the optimizer that updates its weights; the trainer builds it with `build_optimizer`.
The specification says what an optimizer keeps (its state per parameter, for the estimate); this table says how
it is made and stepped, one entry per name of the specification's table (tests/test_spec.py checks both have
the same names).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fusetune.spec.precision import OPTIMIZERS as SPEC_OPTIMIZERS

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class OptimizerEntry:
    name: str
    # (parameter groups, learning rate, device, seed, state in host memory) -> the optimizer; only the specs
    # that support_host_state are asked for the state in host memory.
    factory: Callable[[list[dict[str, Any]], float, torch.device, int, bool], torch.optim.Optimizer]
    # Whether `optimizer.found_inf` (a one-element tensor: 1 = skip) makes `step()` leave parameters and state
    # as they are, decided on the device (torch's fused Adam family); see `skip_step_if`.
    skips_on_found_inf: Callable[[torch.optim.Optimizer], bool]
    # Whether `step(grad_scale=t)` applies the clipping factor inside the update (one pass over the gradients
    # instead of two) and leaves everything as it is for a NaN factor (the non-finite guard, on the device).
    clips_in_step: bool = False


def _adamw(
    groups: list[dict[str, Any]], learning_rate: float, device: torch.device, seed: int, state_on_host: bool
) -> torch.optim.Optimizer:
    import torch

    # Fused on GPUs: one kernel for the whole update. The CPU keeps torch's default implementation.
    return torch.optim.AdamW(groups, lr=learning_rate, fused=device.type == "cuda")


def _adamw_stochastic_rounding(
    groups: list[dict[str, Any]], learning_rate: float, device: torch.device, seed: int, state_on_host: bool
) -> torch.optim.Optimizer:
    from fusetune.kernels import FusedAdamW

    # bf16 weights and moments rounded stochastically from bits of (seed, step, element): a rerun with the
    # job's seed trains the same weights.
    return FusedAdamW(groups, lr=learning_rate, seed=seed, state_on_host=state_on_host)


def _adamw_8bit(
    groups: list[dict[str, Any]], learning_rate: float, device: torch.device, seed: int, state_on_host: bool
) -> torch.optim.Optimizer:
    from fusetune.kernels import FusedAdamW8bit

    return FusedAdamW8bit(groups, lr=learning_rate, seed=seed, state_on_host=state_on_host)


OPTIMIZERS: dict[str, OptimizerEntry] = {
    entry.name: entry
    for entry in (
        OptimizerEntry(
            "adamw", factory=_adamw,
            skips_on_found_inf=lambda optimizer: bool(optimizer.defaults.get("fused")),
        ),
        OptimizerEntry(
            "adamw-stochastic-rounding", factory=_adamw_stochastic_rounding,
            skips_on_found_inf=lambda optimizer: False, clips_in_step=True,
        ),
        OptimizerEntry(
            "adamw-8bit", factory=_adamw_8bit, skips_on_found_inf=lambda optimizer: False, clips_in_step=True,
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
    seed: int = 0,
    state_on_host: bool = False,
) -> torch.optim.Optimizer:
    """The optimizer `name` over `trainable`; `state_on_host`: its state in host memory (the memory plan's
    optimizer_state_on_host, which the planner gives only to the optimizers whose spec supports_host_state)."""
    if state_on_host and not SPEC_OPTIMIZERS[name].supports_host_state:
        raise ValueError(f"optimizer {name} cannot keep its state in host memory")
    groups = parameter_groups(trainable, weight_decay)
    return OPTIMIZERS[name].factory(groups, learning_rate, device, seed, state_on_host)


def clip_and_step(
    optimizer: torch.optim.Optimizer,
    name: str,
    parameters: Sequence[torch.nn.Parameter],
    max_norm: float,
    loss: torch.Tensor,
    non_finite_error: Callable[[torch.Tensor], Exception],
) -> torch.Tensor:
    """Clip the gradients to `max_norm` (their global L2 norm) and step; returns the norm before clipping.

    A non-finite loss or norm leaves the weights and the optimizer state as they are, decided on the device
    where the optimizer can (the caller fails the job when it reads the step's numbers); elsewhere the flag is
    read on the host and `non_finite_error(norm)` raised before the step."""
    import torch

    if OPTIMIZERS[name].clips_in_step:
        from fusetune.kernels import gradient_clipping_scale

        norm = torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # a DTensor under FSDP
        scale = gradient_clipping_scale(torch.where(torch.isfinite(loss), norm, torch.nan), max_norm)
        optimizer.step(grad_scale=scale)
        return norm
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    non_finite = ~(torch.isfinite(loss) & torch.isfinite(norm))
    if not skip_step_if(optimizer, name, non_finite) and bool(non_finite):
        raise non_finite_error(norm)
    optimizer.step()
    return norm


def skip_step_if(optimizer: torch.optim.Optimizer, name: str, condition: torch.Tensor) -> bool:
    """Arrange for the next `optimizer.step()` to change nothing where the boolean `condition` is true, without
    reading it on the host. Returns False when this optimizer cannot (the caller must decide on the host)."""
    if not OPTIMIZERS[name].skips_on_found_inf(optimizer):
        return False
    optimizer.found_inf = condition.float()  # type: ignore[attr-defined]
    return True
