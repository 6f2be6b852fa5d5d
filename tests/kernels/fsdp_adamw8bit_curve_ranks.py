"""The ranks of test_adamw8bit.py's loss-curve test, under torchrun (gloo, CPU, the Triton interpreter):
`fsdp_adamw8bit_curve_ranks.py OUT.json`.

A small bf16 regression MLP is trained with FusedAdamW8bit on the same global batches (8 rows a step) by two
FSDP2 ranks (4 rows each, gradients averaged by the reduce-scatter) and, in each process, by one unsharded copy
with several rounding seeds. The 63 x 37 weight's shards (32 and 31 rows: 1,184 and 1,147 elements) cut the
whole tensor's 256-element blocks, so the sharded run's blocks differ from the unsharded one's. Two broken
optimizers run beside it as negative controls: one that forgets the second moment before every step, one whose
codes are read against the neighbouring block's scale (a block grid misaligned with the shard). Rank 0 writes
{"one": {seed: curve}, "fsdp": curve, "mutants": {name: curve}}, each curve the global batch's loss per step.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fusetune.kernels.adamw8bit import FusedAdamW8bit

STEPS = 40
GLOBAL_BATCH = 8
SEED = 1
UNSHARDED_SEEDS = (1, 2, 3, 4)
HYPERPARAMETERS = dict(lr=1e-2, weight_decay=1e-2)


class _NoSecondMoment(FusedAdamW8bit):
    """Broken on purpose: sqrt(v)'s codes and scales zeroed before each step, so v is only this step's g^2."""

    def step(self, *args, **kwargs):
        for state in self.state.values():
            for name in ("exp_avg_sq_codes", "exp_avg_sq_scales"):
                state[name].to_local().zero_()
        return super().step(*args, **kwargs)


class _MisalignedBlocks(FusedAdamW8bit):
    """Broken on purpose: after each step a rank's scales move one block along its row, so the next step reads
    every code against the neighbouring block's scale."""

    def step(self, *args, **kwargs):
        result = super().step(*args, **kwargs)
        for state in self.state.values():
            for name in ("exp_avg_scales", "exp_avg_sq_scales"):
                row = state[name].to_local()
                row.copy_(row.roll(1, dims=1))
        return result


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(37, 63), torch.nn.Tanh(), torch.nn.Linear(63, 3)).to(
        torch.bfloat16
    )


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    inputs = torch.randn(STEPS, GLOBAL_BATCH, 37, generator=generator)
    teacher = torch.randn(37, 3, generator=generator) / 37**0.5
    return inputs.to(torch.bfloat16), torch.tanh(inputs @ teacher) * 2


def _loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(inputs).float(), targets)


def _unsharded_curve(seed: int, inputs: torch.Tensor, targets: torch.Tensor) -> list[float]:
    model = _model()
    optimizer = FusedAdamW8bit(model.parameters(), **HYPERPARAMETERS, seed=seed)
    curve = []
    for step in range(STEPS):
        loss = _loss(model, inputs[step], targets[step])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        curve.append(loss.item())
    return curve


def _sharded_curve(optimizer_class, mesh, inputs: torch.Tensor, targets: torch.Tensor) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    model = _model()
    fully_shard(model, mesh=mesh)
    optimizer = optimizer_class(model.parameters(), **HYPERPARAMETERS, seed=SEED)
    curve = []
    for step in range(STEPS):
        loss = _loss(model, inputs[step, rows], targets[step, rows])
        loss.backward()  # FSDP2's reduce-scatter averages the ranks' gradients: the global batch's mean
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        curve.append(total.item() / world)
    return curve


def main(out: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    inputs, targets = _data()
    result = {
        "fsdp": _sharded_curve(FusedAdamW8bit, mesh, inputs, targets),
        "mutants": {
            "no second moment": _sharded_curve(_NoSecondMoment, mesh, inputs, targets),
            "misaligned blocks": _sharded_curve(_MisalignedBlocks, mesh, inputs, targets),
        },
    }
    if dist.get_rank() == 0:
        result["one"] = {seed: _unsharded_curve(seed, inputs, targets) for seed in UNSHARDED_SEEDS}
        with open(out, "w") as file:
            json.dump(result, file)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    assert "RANK" in os.environ, "run under torchrun"
    main(sys.argv[1])
