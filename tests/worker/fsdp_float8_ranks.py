"""One rank of test_float8.py's two-rank FSDP2 test, run under torchrun (gloo, CPU, emulated float8 casts, the
Triton interpreter for FusedAdamW).

Two copies of the tiny model, converted to float8 (tensorwise, all-gathered in float8) and sharded over the two
ranks, train on the same batches with FusedAdamW. One takes its weights' scales from the optimizer's block
maxima (`keep_weight_maxima`, one all-reduce a step); the other leaves them to torchao (a pass over each shard
and an all-reduce per weight at every all-gather). Each rank checks, after every step, that the scales are
those of the whole weights' largest magnitudes (which no rank's shard alone gives) and that both copies ran the
same losses and hold the same parameters, bit for bit. Exits non-zero on any failure.
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


def build() -> tuple[torch.nn.Module, FusedAdamW]:
    model = build_tiny_model("llama", dtype=torch.bfloat16)
    float8.convert_linears(model, float8.float8_config("tensorwise", emulate=True, fsdp=True), "tensorwise")
    shard_fsdp(model, torch.device("cpu"), MixedPrecisionPolicy())
    return model, FusedAdamW(model.parameters(), lr=1e-2, weight_decay=1e-2, seed=1)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    kept, kept_optimizer = build()
    plain, plain_optimizer = build()
    layers = [m for m in kept.modules() if isinstance(m, float8.frozen_aware_float8_linear())]
    assert float8.keep_weight_maxima(kept, kept_optimizer) == len(layers) > 0
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
            assert scale is not None and torch.equal(scale, expected), (rank, step, scale, expected)
        if step == STEPS:
            break
        losses = []
        for model, optimizer in ((kept, kept_optimizer), (plain, plain_optimizer)):
            loss = model(**batches[step % len(batches)]).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), (rank, step, losses)
        for (name, mine), theirs in zip(kept.named_parameters(), plain.parameters(), strict=True):
            assert torch.equal(mine.to_local(), theirs.to_local()), (rank, step, name)
    print(f"rank {rank}: ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
