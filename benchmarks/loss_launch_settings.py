"""Chunking of the fused linear cross-entropy and launch settings of the cross-entropy kernel, against
torch.compile and Liger-Kernel in one run: the measurements behind `fused_linear_cross_entropy_chunk_rows`
and `cross_entropy_launch_config`. Times and peak extra memory are taken as in benchmarks/kernels.py
(do_bench median of fwd+bwd through torch.autograd.grad; peak includes the returned gradients).

    PYTHONPATH=. python3 benchmarks/loss_launch_settings.py [--impls ...] [--tag NAME] [--budget-s S]

With ``--impls fusetune --tag old`` and PYTHONPATH pointing at another checkout it measures that checkout's
kernels at the same shapes, for an old-against-new table from one machine session.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.kernels import MIB, CudaTimer, Repetitions, free_device_memory

MAIN = Repetitions(warmup_ms=25, rep_ms=100)
SWEEP = Repetitions(warmup_ms=5, rep_ms=30)
# (T, H, V, softcap); the first is the main shape.
LINEAR_SHAPES = (
    (8192, 4096, 128256, None),
    (1024, 4096, 128256, None),
    (16384, 4096, 128256, None),
    (8192, 4096, 32000, None),
    (8192, 4096, 151936, None),
    (8192, 4096, 256000, 30.0),
    (16384, 1536, 128256, None),
    (65536, 4096, 128256, None),
)
# Chunk rows tried at the main shape, beside the default.
CHUNK_ROWS = (1024, 1536, 2048, 4096)
# (block_v, num_warps, programs_per_processor)
CE_SETTINGS = ((16384, 32, 1), (8192, 32, 1), (8192, 16, 2), (4096, 16, 2), (4096, 8, 4))


def measure(fn: Callable[[], Any], grad_inputs: list, reps: Repetitions) -> tuple[float, float]:
    """(fwd+bwd median ms, peak extra MiB of one fwd+bwd, returned gradients included)."""
    timer = CudaTimer()

    def fwd_bwd():
        return torch.autograd.grad([fn()], grad_inputs)

    fwd_bwd()
    peak = timer.peak_extra_bytes(fwd_bwd, grad_inputs) / MIB
    return timer.time(fwd_bwd, reps), peak


def linear_loss(impl: str, softcap: float | None, **options) -> Callable:
    if impl == "compile":

        def eager(hidden, weight, labels):
            logits = F.linear(hidden, weight).float()
            if softcap is not None:
                logits = softcap * torch.tanh(logits / softcap)
            return F.cross_entropy(logits, labels)

        torch._dynamo.reset()
        return torch.compile(eager, dynamic=False)
    if impl == "liger":
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        loss = LigerFusedLinearCrossEntropyLoss(softcap=softcap)
        return lambda hidden, weight, labels: loss(weight, hidden, labels)
    from fusetune.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy

    return lambda hidden, weight, labels: fused_linear_cross_entropy(
        hidden, weight, labels, softcap=softcap, **options
    )


def linear_case(shape, impl: str, reps: Repetitions, **options) -> dict:
    tokens, hidden_size, vocab, softcap = shape
    free_device_memory()  # the previous case's tensors are gone once it returned
    torch.manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.nn.Parameter(0.02 * torch.randn(vocab, hidden_size, device="cuda", dtype=torch.bfloat16))
    labels = torch.randint(0, vocab, (tokens,), device="cuda")
    loss_fn = linear_loss(impl, softcap, **options)
    try:
        ms, peak = measure(lambda: loss_fn(hidden, weight, labels), [hidden, weight], reps)
        result = {"ms": round(ms, 3), "peak_extra_mb": round(peak, 1)}
    except torch.cuda.OutOfMemoryError:
        result = {"error": "out of memory"}
    torch._dynamo.reset()
    return result


def ce_case(tokens: int, vocab: int, impl: str, setting=None) -> dict:
    torch.manual_seed(0)
    logits = torch.randn(tokens, vocab, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,), device="cuda")
    if impl == "compile":
        torch._dynamo.reset()
        loss_fn = torch.compile(lambda x, y: F.cross_entropy(x.float(), y), dynamic=False)
    elif impl == "liger":
        from liger_kernel.transformers.cross_entropy import LigerCrossEntropyLoss

        loss_fn = LigerCrossEntropyLoss()
    else:
        from fusetune.kernels import cross_entropy as ce_module

        loss_fn = lambda x, y: ce_module.cross_entropy(x, y, inplace_backward=True)  # noqa: E731
    restore = None
    if setting is not None:
        from fusetune.kernels import cross_entropy as ce_module

        block_v, warps, per_sm = setting
        restore = ce_module.cross_entropy_launch_config

        def config(*args, **kwargs):
            return dataclasses.replace(
                restore(*args, **kwargs), block_v=block_v, num_warps=warps, programs_per_processor=per_sm
            )

        ce_module.cross_entropy_launch_config = config
    try:
        ms, peak = measure(lambda: loss_fn(logits, labels), [logits], MAIN)
        result = {"ms": round(ms, 4), "peak_extra_mb": round(peak, 1)}
    finally:
        if restore is not None:
            ce_module.cross_entropy_launch_config = restore
    return result


def profile_kernels(fn: Callable[[], Any], top: int = 8) -> list[tuple[str, float, int]]:
    """(kernel name, total ms, calls) of one fwd+bwd, largest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals: dict[str, list] = {}
    for event in prof.events():
        if getattr(event.device_type, "name", "") != "CUDA":
            continue
        micros = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)
        entry = totals.setdefault(event.name[:90], [0.0, 0])
        entry[0] += micros / 1e3
        entry[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return [(name, round(ms, 3), calls) for name, (ms, calls) in ranked]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impls", default="compile,liger,fusetune")
    parser.add_argument("--tag", default="new")
    parser.add_argument("--budget-s", type=float, default=240.0)
    parser.add_argument("--parts", default="ce,main,profile,sweep")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    impls, parts = args.impls.split(","), args.parts.split(",")
    deadline = time.time() + args.budget_s
    rows = []

    def emit(row: dict) -> None:
        row["tag"] = args.tag
        rows.append(row)
        print(json.dumps(row), flush=True)

    if "ce" in parts:
        for impl in impls:
            emit({"op": "cross_entropy", "T": 8192, "V": 128256, "impl": impl, **ce_case(8192, 128256, impl)})
        if "fusetune" in impls and args.tag == "new":
            for setting in CE_SETTINGS:
                emit({"op": "cross_entropy", "T": 8192, "V": 128256, "impl": "fusetune", "setting": setting,
                      **ce_case(8192, 128256, "fusetune", setting)})  # fmt: skip
            for vocab in (32000, 256000):
                for impl in impls:
                    emit({"op": "cross_entropy", "T": 8192, "V": vocab, "impl": impl,
                          **ce_case(8192, vocab, impl)})  # fmt: skip
    shape = LINEAR_SHAPES[0]
    if "main" in parts:
        for impl in impls:
            emit({"op": "flce", "shape": shape, "impl": impl, **linear_case(shape, impl, MAIN)})
        if "fusetune" in impls and args.tag == "new":
            row_bytes = shape[2] * 2
            for rows_per_chunk in CHUNK_ROWS:
                emit({"op": "flce", "shape": shape, "impl": "fusetune", "chunk_rows": rows_per_chunk,
                      **linear_case(shape, "fusetune", MAIN, logits_chunk_bytes=rows_per_chunk * row_bytes)})  # fmt: skip
    if "profile" in parts and "fusetune" in impls:
        torch.manual_seed(0)
        tokens, hidden_size, vocab, _ = shape
        hidden = torch.randn(tokens, hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        weight = torch.nn.Parameter(
            0.02 * torch.randn(vocab, hidden_size, device="cuda", dtype=torch.bfloat16)
        )
        labels = torch.randint(0, vocab, (tokens,), device="cuda")
        loss_fn = linear_loss("fusetune", None)
        kernels = profile_kernels(
            lambda: torch.autograd.grad([loss_fn(hidden, weight, labels)], [hidden, weight])
        )
        emit({"op": "flce-profile", "shape": shape, "kernels": kernels})
        del hidden, weight, labels
        free_device_memory()
    if "sweep" in parts:
        for shape in LINEAR_SHAPES[1:]:
            for impl in impls:
                if time.time() > deadline:
                    emit({"op": "flce", "shape": shape, "impl": impl, "error": "time budget used up"})
                    continue
                if impl == "compile" and shape[0] * shape[2] > 65536 * 128256 // 2:
                    emit({"op": "flce", "shape": shape, "impl": impl, "error": "skipped (memory)"})
                    continue
                emit({"op": "flce", "shape": shape, "impl": impl, **linear_case(shape, impl, SWEEP)})
    with open(os.path.join(args.out, f"loss-{args.tag}.json"), "w") as handle:
        json.dump(rows, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
