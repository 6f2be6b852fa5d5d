"""Process-group setup for torchrun (NCCL on GPUs, gloo on CPU; a plain `python -m` run is one process), the
collectives the trainer needs, and wrapping the model for data parallelism: DDP or FSDP2.

Multi-node: the trainer reads only what torchrun puts in the environment, so the same entry point runs on
several machines with torchrun's rendezvous, e.g. on each of 2 nodes
`torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint <host of node 0>:29400
--rdzv_id <job id> -m fusetune.worker.train --config <shared path>/train_config.json`, with output_dir and the
data on storage every node sees (rank 0 writes checkpoints; every rank reads them to resume).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# DDP all-reduces gradients in buckets while the backward pass goes on, one bucket as soon as all its
# gradients are ready; whatever is reduced after the last gradient is computed is not hidden. A decoder layer
# of a 1B model yields 120 MB (bf16) to 240 MB (fp32) of gradients, so 25 MB buckets start reducing a layer
# after a fifth of its backward and keep the unhidden tail (the first layer's buckets; the embedding, whose
# gradient is complete only at the very end, is its own bucket whatever the size) short, while NCCL already
# runs near its full NVLink bandwidth at that size. Larger buckets save launches but lengthen the tail.
# Not tuned by measurement yet: benchmarks/scaling/gpus.py --ddp-bucket-cap-mb sweeps it.
DEFAULT_DDP_BUCKET_CAP_MB = 25


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    # The ranks on this rank's node (torchrun's LOCAL_WORLD_SIZE): a job on several nodes runs as many on each.
    local_world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()


def init_distributed() -> DistInfo:
    """Join the process group torchrun describes in the environment (RANK, WORLD_SIZE, LOCAL_RANK...)."""
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if "RANK" in os.environ and not dist.is_initialized():
        if device.type == "cuda":
            dist.init_process_group(backend="nccl", device_id=device)
        else:
            dist.init_process_group(backend="gloo")
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    return DistInfo(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        device=device,
        local_world_size=local_world_size,
    )


def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce that is a no-op for a single process; returns `tensor`."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=op)
    return tensor


def _is_multiprocess() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def broadcast_object(value: Any, src: int = 0) -> Any:
    """Rank `src`'s `value` on every rank (picklable objects; small ones)."""
    if not _is_multiprocess():
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def all_gather_object(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order, on every rank."""
    if not _is_multiprocess():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a wall-clock time covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a Hugging Face model (PEFT-wrapped too): its `_no_split_modules` classes."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    block_names = set(getattr(base, "_no_split_modules", None) or ())
    return [module for module in model.modules() if type(module).__name__ in block_names]


def wrap_ddp(model: torch.nn.Module, device: torch.device, bucket_cap_mb: int | None) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        # Gradients live in the communication buckets: no copy into and out of them, no second copy in memory.
        gradient_as_bucket_view=True,
        bucket_cap_mb=bucket_cap_mb or DEFAULT_DDP_BUCKET_CAP_MB,
        # The only buffers are constants (rotary frequencies): broadcasting them before every forward would
        # cost a collective per micro-batch for nothing.
        broadcast_buffers=False,
    )


def shard_fsdp(model: torch.nn.Module, device: torch.device, mp_policy: Any) -> torch.nn.Module:
    """FSDP2 in place: one unit per decoder layer, then the root (embeddings, final norm, output head).

    `mp_policy` is the precision policy's `MixedPrecisionPolicy` (under bf16-mixed, parameters are gathered in
    bf16 for compute while the sharded fp32 copy is what AdamW updates, and gradients are reduced in fp32).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class (_no_split_modules) to shard")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    # fully_shard moves each unit's parameters and buffers to the mesh's device as it shards them, so a model
    # loaded on the CPU never has to fit on one GPU whole.
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    return model


@contextlib.contextmanager
def gathered_for_sampling(model: torch.nn.Module) -> Iterator[None]:
    """Under FSDP2, every unit's parameters gathered once and kept whole while the block runs, then sharded
    again: sampling runs one forward per generated token, and each would otherwise all-gather every layer
    anew (and free it after). Costs one whole copy of the weights in the compute dtype for the duration. A
    model that is not sharded is left as it is."""
    from torch.distributed.fsdp import FSDPModule

    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            # Back to what shard_fsdp's units do: the decoder layers reshard after forward (fully_shard's
            # default); the root (the first unit) does not, as FSDP2 decides for a root by itself, whose
            # parameters the backward would otherwise gather again at once.
            unit.set_reshard_after_forward(unit is not units[0], recurse=False)


def parallelize(
    model: torch.nn.Module,
    dist_info: DistInfo,
    fsdp: bool,
    fsdp_mp_policy: Callable[[], Any],
    ddp_bucket_cap_mb: int | None,
) -> torch.nn.Module:
    """The module the training forward goes through: the model itself, its DDP wrapper, or the model sharded
    in place by FSDP2 (whose parameters stay on the CPU until sharded, so a model too large for one GPU never
    lands on one whole). Raises ValueError for a model FSDP cannot shard."""
    if fsdp:
        return shard_fsdp(model, dist_info.device, fsdp_mp_policy())
    model.to(dist_info.device)
    if dist_info.world_size > 1:
        return wrap_ddp(model, dist_info.device, ddp_bucket_cap_mb)
    return model
