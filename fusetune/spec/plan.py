"""A job's memory plan: how it trades memory for time on the GPU it runs on.

The planner (see `plan_job`, added beside the memory model) picks the fastest plan that fits; the trainer runs
exactly the plan it is given. Each part may be pinned by the job's hyperparameters of the same name.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class MemoryPlan:
    # Sequences per micro-batch on each GPU (gradient accumulation makes up the rest of the batch).
    micro_batch_size: int
    # Decoder layers whose activations are recomputed in the backward (0: none; every layer: full checkpointing).
    recompute_layers: int
    # Decoder layers whose saved activations wait in pinned host memory until the backward needs them.
    offload_layers: int
    # The precision mode (fusetune/spec/precision.py): it names the optimizer and the dtype of its state.
    precision: str
    # Each parameter updated as soon as its gradient is complete, its gradient freed at once.
    optimizer_in_backward: bool
    # The optimizer's state in pinned host memory, each parameter's copied to the GPU for its update and back.
    optimizer_state_on_host: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        parts = [f"micro-batch {self.micro_batch_size}", f"precision {self.precision}"]
        parts.append(
            f"{self.recompute_layers} layers recomputed" if self.recompute_layers else "no recompute"
        )
        if self.offload_layers:
            parts.append(f"{self.offload_layers} layers offloaded to host memory")
        if self.optimizer_in_backward:
            parts.append("optimizer step in the backward")
        if self.optimizer_state_on_host:
            parts.append("optimizer state in host memory")
        return ", ".join(parts)
