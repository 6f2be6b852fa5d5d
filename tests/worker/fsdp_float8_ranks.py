"""One rank of test_float8.py's two-rank FSDP2 test, run under torchrun (gloo, CPU, emulated float8 casts, the
Triton interpreter for FusedAdamW).

Copies of the tiny model, converted to float8 (tensorwise, all-gathered in float8) and sharded over the two
ranks, train on the same batches, in pairs. In each pair one copy's weight scales follow its optimizer
(`weight_scales_from_optimizer`, one all-reduce a step) and the other's are left to torchao (a pass over each
shard and an all-reduce per weight at every all-gather): with FusedAdamW the scales come from the block maxima
its step keeps; with torch's AdamW, which keeps none, from each shard read once a step. Each rank checks, after
every step, that the scales are those of the whole weights' largest magnitudes (which no rank's shard alone
gives) and that both copies of a pair ran the same losses and hold the same parameters, bit for bit. Exits
non-zero on any failure.
"""

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from torchao.float8.float8_utils import amax_to_scale

from fusetune.kernels.adamw import FusedAdamW
from fusetune.worker.train import float8
from fusetune.worker.train.distributed import shard_fsdp
from tests.models.tiny import build_tiny_model, make_batches

STEPS = 3
OPTIMIZERS = {
    "FusedAdamW (block maxima)": lambda params: FusedAdamW(params, lr=1e-2, weight_decay=1e-2, seed=1),
    "AdamW (the shards read)": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=1e-2),
}


def build(optimizer_factory) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_tiny_model("llama", dtype=torch.bfloat16)
    float8.convert_linears(model, float8.float8_config("tensorwise", emulate=True, fsdp=True), "tensorwise")
    shard_fsdp(model, torch.device("cpu"), MixedPrecisionPolicy())
    return model, optimizer_factory(model.parameters())


def check_pair(name: str, optimizer_factory) -> None:
    rank = dist.get_rank()
    followed, followed_optimizer = build(optimizer_factory)
    plain, plain_optimizer = build(optimizer_factory)
    layers = [m for m in followed.modules() if isinstance(m, float8.frozen_aware_float8_linear())]
    kept = float8.weight_scales_from_optimizer(followed, followed_optimizer)
    assert kept == (len(layers) if isinstance(followed_optimizer, FusedAdamW) else 0) and layers, (name, kept)
    assert not any(hasattr(layer, "weight_maxima") for layer in layers)  # sharded: no whole-weight buffer
    # Some weight's largest magnitude is in one rank's shard only: agreeing over ranks is part of the test.
    # (A list, not a generator under any(): every rank must take part in every layer's all-gather.)
    whole_maxima = [layer.weight.full_tensor().abs().max() for layer in layers]
    assert any(layer.weight.to_local().abs().max() < m for layer, m in zip(layers, whole_maxima, strict=True))
    batches = make_batches()
    for step in range(STEPS + 1):
        for layer in layers:
            expected = amax_to_scale(layer.weight.full_tensor().abs().max(), torch.float8_e4m3fn)
            scale = layer.weight._local_tensor._precomputed_scale
            assert scale is not None and torch.equal(scale, expected), (name, rank, step, scale, expected)
        if step == STEPS:
            break
        losses = []
        for model, optimizer in ((followed, followed_optimizer), (plain, plain_optimizer)):
            loss = model(**batches[step % len(batches)]).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), (name, rank, step, losses)
        for (parameter, mine), theirs in zip(followed.named_parameters(), plain.parameters(), strict=True):
            assert torch.equal(mine.to_local(), theirs.to_local()), (name, rank, step, parameter)


def main() -> None:
    dist.init_process_group("gloo")
    for name, optimizer_factory in OPTIMIZERS.items():
        check_pair(name, optimizer_factory)
    print(f"rank {dist.get_rank()}: ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
