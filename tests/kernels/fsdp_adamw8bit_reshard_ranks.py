"""The ranks of test_adamw8bit.py's resharding tests, under torchrun (gloo, CPU, the Triton interpreter).

`fsdp_adamw8bit_reshard_ranks.py save OUT.pt` (2 ranks): FusedAdamW8bit steps an FSDP2-sharded model 3 times;
rank 0 writes {"optimizer": the full state dict as the trainer's checkpoints gather it, "moments": {name: (m,
sqrt(v))}}, the moments being each rank's own shard decoded against its own blocks (`dequantize_moments`),
joined in rank order: what the saved codes mean, found without the conversion under test.

`fsdp_adamw8bit_reshard_ranks.py load OUT.pt` (3 ranks): the same model sharded over 3 ranks (7 rows: 3, 3 and 1;
3 rows: 1 each), its optimizer loads the 2-rank state through the trainer's full-state-dict helpers, and each
rank checks that its shard's moments, decoded against its new blocks, lie within one code step of the saved
ones; then that a step runs on the converted state. Exits non-zero on any failure.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fusetune.kernels.adamw8bit import EXP_AVG_MANTISSA_BITS, EXP_AVG_SQ_MANTISSA_BITS, FusedAdamW8bit
from fusetune.kernels.adamw8bit import dequantize_moments as shard_moments
from tests.kernels.adamw_helpers import assert_within_one_code_step
from tests.kernels.fsdp_adamw8bit_ranks import BLOCK_SIZE, HYPERPARAMETERS, STEPS, build_model


def local_moments(optimizer: FusedAdamW8bit, param: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(m, sqrt(v)) of this rank's shard, flat, decoded against its own blocks (its row of scales, trimmed),
    and those blocks' scales (m's, then sqrt(v)'s)."""
    numel = param.to_local().numel()
    state = {name: value.to_local() for name, value in optimizer.state[param].items() if name != "step"}
    blocks = -(-numel // BLOCK_SIZE)
    for name in ("exp_avg_scales", "exp_avg_sq_scales"):
        assert not state[name][0, blocks:].any(), "a shard's row ends in unused zeros"
        state[name] = state[name][0, :blocks]
    exp_avg, exp_avg_sq = shard_moments(state, BLOCK_SIZE)
    return exp_avg.flatten(), exp_avg_sq.sqrt().flatten(), state["exp_avg_scales"], state["exp_avg_sq_scales"]


def save(out: str, mesh) -> None:
    model = build_model()
    fully_shard(model, mesh=mesh)
    optimizer = FusedAdamW8bit(model.parameters(), **HYPERPARAMETERS, block_size=BLOCK_SIZE)
    inputs = torch.randn(STEPS, 4, 37, dtype=torch.bfloat16)  # the same on every rank (same seed)
    for step in range(STEPS):
        model(inputs[step]).float().square().sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    saved = get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    moments = {}
    for name, param in model.named_parameters():
        exp_avg, root, _, _ = local_moments(optimizer, param)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (exp_avg, root))
        moments[name] = tuple(torch.cat([part[i] for part in gathered]).view(param.shape) for i in (0, 1))
    if dist.get_rank() == 0:
        torch.save({"optimizer": saved, "moments": moments}, out)


def shard_range(shape: torch.Size, rank: int, world: int) -> tuple[int, int]:
    """This rank's [start, end) elements of the whole tensor (torch.chunk's split of the rows)."""
    rows_per_rank, row_numel = -(-shape[0] // world), shape.numel() // shape[0]
    return (
        min(rank * rows_per_rank, shape[0]) * row_numel,
        min((rank + 1) * rows_per_rank, shape[0]) * row_numel,
    )


def load(saved_path: str, mesh) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    saved = torch.load(saved_path, weights_only=True)
    model = build_model()
    fully_shard(model, mesh=mesh)
    optimizer = FusedAdamW8bit(model.parameters(), **HYPERPARAMETERS, block_size=BLOCK_SIZE)
    optimizer.initialize_state()  # as the trainer's restore does
    set_optimizer_state_dict(
        model, optimizer, saved["optimizer"], options=StateDictOptions(full_state_dict=True)
    )
    for name, param in model.named_parameters():
        state = optimizer.state[param]
        assert state["step"].item() == STEPS, name
        assert state["exp_avg_codes"].to_local().dtype == torch.uint8, name
        assert state["exp_avg_scales"].shape[0] == world, (name, state["exp_avg_scales"].shape)
        exp_avg, root, m_scales, r_scales = local_moments(optimizer, param)
        start, end = shard_range(param.shape, rank, world)
        saved_exp_avg, saved_root = (moment.flatten()[start:end] for moment in saved["moments"][name])
        assert exp_avg.numel() == end - start, (name, exp_avg.numel(), start, end)
        assert saved_root.abs().max() > 0, "the saved moments are not all zero: the check means something"
        assert_within_one_code_step(exp_avg, saved_exp_avg, m_scales, EXP_AVG_MANTISSA_BITS, BLOCK_SIZE)
        assert_within_one_code_step(root, saved_root, r_scales, EXP_AVG_SQ_MANTISSA_BITS, BLOCK_SIZE)
    model(torch.randn(4, 37, dtype=torch.bfloat16)).float().square().sum().backward()
    optimizer.step()
    assert all(torch.isfinite(p.to_local()).all() for p in model.parameters())
    assert all(optimizer.state[p]["step"].item() == STEPS + 1 for p in model.parameters())


def main() -> None:
    mode, path = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    {"save": save, "load": load}[mode](path, mesh)
    dist.barrier()
    print(f"rank {dist.get_rank()}: ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    assert "RANK" in os.environ, "run under torchrun"
    main()
