"""Evaluation over a validation set, split over the ranks, with the training method's sums and metrics."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from fusetune.worker.train.distributed import DistInfo, all_reduce
from fusetune.worker.train.methods import TrainingMethod


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    method: TrainingMethod,
    rows: Sequence[Any],
    make_batch: Callable[[list[Any], bool], dict[str, torch.Tensor]],
    autocast: Callable[[], AbstractContextManager[Any]],
    micro_batch_size: int,
    dist: DistInfo,
    same_forwards_on_every_rank: bool,
) -> dict[str, float]:
    """`method.eval_metrics` of the sums over every row: rank r takes chunks r, r + world_size, ...

    Under FSDP (`same_forwards_on_every_rank`) parameters are gathered inside each forward, so every rank must
    run as many forwards as the others; a rank short of chunks repeats one and leaves it out of the sums.
    """
    model.eval()
    chunks = [
        list(range(i, min(i + micro_batch_size, len(rows)))) for i in range(0, len(rows), micro_batch_size)
    ]
    mine = chunks[dist.rank :: dist.world_size]
    n_forwards = math.ceil(len(chunks) / dist.world_size) if same_forwards_on_every_rank else len(mine)
    sums = torch.zeros(len(method.eval_sum_names), dtype=torch.float64, device=dist.device)
    for index in range(n_forwards):
        counted = index < len(mine)
        batch = make_batch([rows[i] for i in (mine[index] if counted else chunks[0])], False)
        with autocast():
            batch_sums = method.eval_sums(model, batch)
        if counted:
            sums += batch_sums
    all_reduce(sums)
    model.train()
    return method.eval_metrics(sums.tolist())
