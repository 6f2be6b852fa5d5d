"""One rank of test_adamw8bit.py's two-rank FSDP2 test, run under torchrun (gloo, CPU, the Triton interpreter).

Each rank checks, exactly, that FusedAdamW8bit updates its own shard as the reference does on that shard alone
(blocks from the shard's first element, the tail block masked), that the state it keeps is its shard's, and
that torch's full-state-dict helpers (the trainer's checkpoints) round-trip it exactly on the same world size
(another one converts it: fsdp_adamw8bit_reshard_ranks.py). Exits non-zero on any failure.
"""

import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from fusetune.kernels.adamw8bit import FusedAdamW8bit, adamw8bit_step_reference, adamw8bit_zero_state

# 32-element blocks: the (7, 37) weight's shards are 4 x 37 = 148 and 3 x 37 = 111 elements, neither a multiple
# of the block, and the whole tensor's blocks (259 elements) straddle the shard boundary at element 148; on 3 ranks
# (fsdp_adamw8bit_reshard_ranks.py, which takes these from here) its shards are 111, 111 and 37 elements.
BLOCK_SIZE = 32
STEPS = 3
HYPERPARAMETERS = dict(lr=1e-2, weight_decay=1e-2, seed=1)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(37, 7), torch.nn.Linear(7, 3)).to(torch.bfloat16)


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = build_model()
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    optimizer = FusedAdamW8bit(params, **HYPERPARAMETERS, block_size=BLOCK_SIZE)
    expected = [p.to_local().detach().clone() for p in params]
    states = [adamw8bit_zero_state(e, BLOCK_SIZE) for e in expected]
    inputs = torch.randn(STEPS, 4, 37, dtype=torch.bfloat16)  # the same on every rank (same seed)
    for step in range(1, STEPS + 1):
        model(inputs[step - 1]).float().square().sum().backward()
        grads = [p.grad.to_local().clone() for p in params]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # The reference on the shards alone, offsets counted over the rank's shards (as the optimizer's).
        adamw8bit_step_reference(
            expected, grads, states, step=step, block_size=BLOCK_SIZE, betas=(0.9, 0.999), eps=1e-8,
            **HYPERPARAMETERS,
        )  # fmt: skip
        for index, (param, value, state) in enumerate(zip(params, expected, states, strict=True)):
            assert torch.equal(param.to_local(), value), (rank, step, index)
            kept = optimizer.state[param]
            for name, tensor in state.items():
                assert isinstance(kept[name], DTensor), name
                local = kept[name].to_local()
                if name.endswith("scales"):
                    # One row of (world, blocks of the largest shard): this shard's blocks, then zeros.
                    largest = -(-param.shape[0] // world) * (param.numel() // param.shape[0])
                    assert local.shape == (1, -(-largest // BLOCK_SIZE)), (name, local.shape)
                    assert torch.equal(local[0, : tensor.numel()], tensor), (rank, step, index, name)
                    assert not local[0, tensor.numel() :].any()
                else:
                    assert local.numel() == param.to_local().numel()
                    assert torch.equal(local, tensor), (rank, step, index, name)
    # Both ranks' shards are uneven tails of their blocks: the test covers what it says.
    assert params[0].to_local().numel() % BLOCK_SIZE != 0

    full = StateDictOptions(full_state_dict=True)
    saved = get_optimizer_state_dict(model, optimizer, options=full)
    resumed = FusedAdamW8bit(params, **HYPERPARAMETERS, block_size=BLOCK_SIZE)
    resumed.initialize_state()  # as the trainer's restore does
    set_optimizer_state_dict(model, resumed, saved, options=full)
    for param in params:
        assert resumed.state[param]["step"].item() == STEPS
        for name in states[0]:
            assert torch.equal(resumed.state[param][name].to_local(), optimizer.state[param][name].to_local())

    dist.barrier()
    print(f"rank {rank}: ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    assert "RANK" in os.environ, "run under torchrun"
    main()
