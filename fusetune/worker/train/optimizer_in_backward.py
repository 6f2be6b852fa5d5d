"""The optimizer step inside the backward: each parameter is updated as soon as its gradient is complete and the
gradient is freed at once, so a step never holds every gradient (an 8B model's are 16 GB in bf16).

Clipping. Global-norm clipping needs every gradient before the first update, which this mode never has. It
clips step t's gradients by the factor the previous step's global norm gives, min(1, max_norm / norm_{t-1}); the
first step of a run (and the first after a resume from a checkpoint written before this mode kept the norm)
is unclipped. Step t's own norm is summed as its gradients arrive and reported as `grad_norm`, as in the other
mode, and carried to the next step (and in checkpoints, so a resumed run clips exactly as an uninterrupted one).
Under AdamW a factor that is constant over a few steps cancels out of the update (m / sqrt(v) does not depend on
the gradients' scale), so clipping by the previous norm differs from clipping by the current one only when the
norm jumps from one step to the next; the quality test (tests/kernels/test_adamw_quality.py) measures it.

Non-finite values. A non-finite loss is known before the backward: the factor is then NaN, which makes the fused
optimizers change nothing, and the trainer fails the job on the step's numbers as before. A non-finite gradient
leaves its own parameter as it was; parameters updated earlier in that backward keep their update, and the job
fails on the step's non-finite norm (a retry resumes from the last checkpoint).

Where it runs. One process and one micro-batch per step: a gradient accumulated over micro-batches is complete
only after the last, and under DDP or FSDP only after its reduction across processes, which the hook would run
ahead of. Only the optimizers that take the clipping factor in their step (`clips_in_step`) and can update
single parameters run it. `refusal` says why a run cannot use it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from fusetune.worker.train import optim


def refusal(optimizer_name: str, world_size: int, micro_batches_per_step: int) -> str | None:
    """Why a run cannot step its optimizer inside the backward, or None when it can."""
    if world_size > 1:
        return (
            f"optimizer_in_backward needs a single process, this run has {world_size}: under DDP and FSDP a "
            "gradient is complete only after its reduction across processes"
        )
    if micro_batches_per_step > 1:
        return (
            f"optimizer_in_backward needs one micro-batch per step, this run accumulates {micro_batches_per_step}: "
            "set micro_batch_size to the batch size or turn optimizer_in_backward off"
        )
    if not optim.OPTIMIZERS[optimizer_name].clips_in_step:
        return (
            f"optimizer_in_backward needs an optimizer that takes the clipping factor in its step; "
            f"{optimizer_name} does not (precision bf16-sr or bf16-sr-8bit do)"
        )
    return None


class OptimizerInBackward:
    """Steps `optimizer` on each of `parameters` from a hook that runs when its gradient is complete.

    Per step: `start(loss, previous_norm)` before the backward, then the backward, then `finish()` for the
    step's gradient norm (a device tensor)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        parameters: Sequence[torch.nn.Parameter],
        max_norm: float | None,
    ) -> None:
        self.optimizer = optimizer
        self.max_norm = max_norm if max_norm is not None else math.inf
        self._scale: torch.Tensor | None = None
        self._sum_of_squares: torch.Tensor | None = None
        self._handles = [param.register_post_accumulate_grad_hook(self._update) for param in parameters]

    def start(self, loss: torch.Tensor, previous_norm: float) -> None:
        from fusetune.kernels import gradient_clipping_scale

        carried = previous_norm if math.isfinite(previous_norm) else 0.0  # 0: no clipping
        norm = torch.where(
            torch.isfinite(loss.detach()),
            torch.tensor(carried, dtype=torch.float32, device=loss.device),
            torch.tensor(math.nan, dtype=torch.float32, device=loss.device),
        )
        self._scale = gradient_clipping_scale(norm, self.max_norm)
        self._sum_of_squares = torch.zeros((), dtype=torch.float32, device=loss.device)

    @torch.no_grad()
    def _update(self, param: torch.Tensor) -> None:
        if self._scale is None:
            raise RuntimeError("OptimizerInBackward: a backward ran without start() before it")
        squares = torch.linalg.vector_norm(param.grad, dtype=torch.float32).square()
        self._sum_of_squares += squares
        # A non-finite gradient leaves its parameter as it is (a NaN factor changes nothing).
        scale = torch.where(torch.isfinite(squares), self._scale, torch.full_like(self._scale, math.nan))
        self.optimizer.step(grad_scale=scale, params=(param,))
        param.grad = None

    def finish(self) -> torch.Tensor:
        """The step's global gradient norm (before clipping), as `clip_and_step` returns it."""
        assert self._sum_of_squares is not None
        norm = self._sum_of_squares.sqrt()
        self._scale = self._sum_of_squares = None
        return norm

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
