"""Chunking of the fused linear cross-entropy and launch settings of the cross-entropy kernel, against
torch.compile and Liger-Kernel in one run: the measurements behind `fused_linear_cross_entropy_chunk_rows`
and `cross_entropy_launch_config`. Times and peak extra memory are taken as in benchmarks/kernels/ops.py
(do_bench median of fwd+bwd through torch.autograd.grad; peak includes the returned gradients). Rows go to
`loss-<tag>.json` in `--out`: a measurement to read, not a committed results file.

    python3 -m benchmarks.kernels.loss_launch_settings [--impls ...] [--tag NAME] [--budget-s S]

With ``--impls fusetune --tag old`` it measures another version's kernels at the same shapes, for an
old-against-new table from one machine session: that version's `fusetune` folder alone first on PYTHONPATH,
and `-P` so that this checkout's own is not put before it (``git archive REV fusetune | tar -x -C /tmp/old``,
then ``PYTHONPATH=/tmp/old:. python3 -P -m benchmarks.kernels.loss_launch_settings --impls fusetune --tag
old``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks import harness
from benchmarks.harness import MIB, free_device_memory, profile_kernels
from benchmarks.kernels.ops import CudaTimer, Repetitions
from benchmarks.kernels.sustained import timed_in_steady_state

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
# Part "gemms": the chunk loop's pieces timed alone at each (H, V) of the kernels.py sweep, for these rows.
GEMM_HIDDEN = (1536, 2048, 4096)
GEMM_VOCABS = (32000, 128256, 151936, 256000)
GEMM_ROWS = (256, 384, 512, 640, 768, 832, 896, 1024, 1152, 1216, 1280, 1536, 2048, 3072, 4096)
# Part "chunk-rows": the default chunking against others of the same tokens (chunk rows in units of 128, 512 or
# 2048, fixed 1024- or 2048-row chunks) and Liger-Kernel, at the --shapes, each in its own steady power state
# (see chunking_cases).
# Part "sweep-profile": kernel profiles (fusetune's and torch.compile's) at sweep shapes where fusetune trails
# torch.compile.
PROFILE_SHAPES = (
    (8192, 4096, 128256, None),
    (8192, 2048, 128256, None),
    (4096, 2048, 256000, 30.0),
)
# Part "overlap": a chunk's backward matmuls one after the other and side by side on two streams, at sweep
# shapes where fusetune trails torch.compile (their chunk rows by the default budget).
OVERLAP_SHAPES = (
    (8192, 1536, 256000, 30.0),
    (4096, 4096, 256000, 30.0),
    (4096, 4096, 151936, None),
    (8192, 1536, 151936, None),
    (8192, 4096, 128256, None),
)
# Part "columns": (block_t, block_v, num_warps, programs per SM) of the kernels over [V, N] logits.
COLUMNS_SETTINGS = (
    (32, 128, 8, 4), (64, 64, 8, 4), (128, 32, 8, 4), (64, 128, 16, 4), (128, 64, 16, 4), (64, 64, 8, 2),
    (64, 64, 8, 8), (64, 32, 4, 8), (128, 32, 8, 2),
)  # fmt: skip
COLUMNS_SHAPES = (
    (1024, 128256, None), (1536, 256000, 30.0), (2048, 151936, None), (4096, 128256, None),
    (4096, 256000, 30.0),
)  # fmt: skip
# (block_v, num_warps, programs_per_processor)
CE_SETTINGS = (
    (16384, 32, 1),
    (8192, 32, 1),
    (8192, 16, 2),
    (4096, 16, 2),
    (4096, 8, 4),
    (2048, 4, 8),
    (32768, 32, 1),
)


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


IGNORED_PERCENT = 0


def linear_inputs(
    shape, impl: str = "fusetune", **options
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Callable]:
    """(hidden, weight, labels, loss function) of ``impl``'s fused linear cross-entropy at ``shape``
    (T, H, V, softcap), drawn afresh after the device's cache is emptied (the previous case's tensors are
    gone once it returned)."""
    tokens, hidden_size, vocab, softcap = shape
    free_device_memory()
    torch.manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.nn.Parameter(0.02 * torch.randn(vocab, hidden_size, device="cuda", dtype=torch.bfloat16))
    labels = torch.randint(0, vocab, (tokens,), device="cuda")
    # Supervised fine-tuning ignores the prompts' tokens: the first --ignored-percent of every 100.
    labels[torch.arange(tokens, device="cuda") % 100 < IGNORED_PERCENT] = -100
    return hidden, weight, labels, linear_loss(impl, softcap, **options)


def linear_case(shape, impl: str, reps: Repetitions, **options) -> dict:
    hidden, weight, labels, loss_fn = linear_inputs(shape, impl, **options)
    try:
        ms, peak = measure(lambda: loss_fn(hidden, weight, labels), [hidden, weight], reps)
        result = {"ms": round(ms, 3), "peak_extra_mb": round(peak, 1)}
    except torch.cuda.OutOfMemoryError:
        result = {"error": "out of memory"}
    torch._dynamo.reset()
    return result


def chunking_cases(shape, calls: int = 8, settle_s: float = 3.0) -> list[dict]:
    """Fused linear CE at ``shape`` (with Liger-Kernel's in the same process) under other chunkings of the
    same tokens: the default, its chunk rows in units of 128, 512 or 2048 at every size (the module picks
    _CHUNK_ROW_ALIGNMENT or, where 2048 rows fit, _LARGE_CHUNK_ROW_ALIGNMENT), and every chunk of 1024 or
    2048 rows (2048: Liger-Kernel's at T=65536, H=4096, V=128256; over the memory budget where it is larger
    than the default's). Each variant is timed in its own steady power state (benchmarks/kernels/sustained.py's
    timing: ``settle_s`` of back-to-back calls, then ``calls`` timed), all in order and again in reverse
    order; ``ms`` is the mean of the two passes' medians."""
    import statistics

    from fusetune.kernels import fused_linear_cross_entropy as flce

    tokens, hidden_size, vocab, _ = shape
    variants = [{"impl": "liger"}, {"impl": "fusetune"}, {"impl": "fusetune", "alignment": 128},
                {"impl": "fusetune", "alignment": 512}, {"impl": "fusetune", "alignment": 2048},
                {"impl": "fusetune", "chunk_rows": 1024}, {"impl": "fusetune", "chunk_rows": 2048}]  # fmt: skip
    defaults = (flce._CHUNK_ROW_ALIGNMENT, flce._LARGE_CHUNK_ROW_ALIGNMENT)

    @contextlib.contextmanager
    def chunk_units(variant: dict):
        """The variant's chunk-row unit at every size, or the module's own rule."""
        units = (variant["alignment"],) * 2 if "alignment" in variant else defaults
        flce._CHUNK_ROW_ALIGNMENT, flce._LARGE_CHUNK_ROW_ALIGNMENT = units
        try:
            yield
        finally:
            flce._CHUNK_ROW_ALIGNMENT, flce._LARGE_CHUNK_ROW_ALIGNMENT = defaults

    free_device_memory()
    hidden, weight, labels, _ = linear_inputs(shape)
    calls_by_variant = []
    for variant in variants:
        options = {"logits_chunk_bytes": variant["chunk_rows"] * vocab * 2} if "chunk_rows" in variant else {}
        loss_fn = linear_loss(variant["impl"], shape[3], **options)

        def fwd_bwd(loss_fn=loss_fn, variant=variant):
            with chunk_units(variant):
                return torch.autograd.grad([loss_fn(hidden, weight, labels)], [hidden, weight])

        with chunk_units(variant):
            sizes = flce.fused_linear_cross_entropy_chunk_sizes(
                tokens, hidden_size, vocab, torch.bfloat16, options.get("logits_chunk_bytes")
            )
        fwd_bwd()
        peak = CudaTimer().peak_extra_bytes(fwd_bwd, [hidden, weight]) / MIB
        calls_by_variant.append((variant, fwd_bwd, sizes, peak))
    medians: dict[int, list[float]] = {index: [] for index in range(len(variants))}
    order = list(range(len(variants)))
    for indices in (order, order[::-1]):
        for index in indices:
            samples, _began, _ended = timed_in_steady_state(
                calls_by_variant[index][1], calls, settle_s, "cuda"
            )
            medians[index].append(statistics.median(samples))
    results = []
    for index, (variant, _fn, sizes, peak) in enumerate(calls_by_variant):
        chunks = sorted(set(sizes)) if variant["impl"] == "fusetune" else None
        results.append({"op": "flce-chunking", "shape": shape, **variant, "chunks": chunks,
                        "n_chunks": len(sizes) if chunks else None, "ms": round(statistics.mean(medians[index]), 3),
                        "ms_by_pass": [round(ms, 3) for ms in medians[index]], "peak_extra_mb": round(peak, 1)})  # fmt: skip
    return results


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


def chunk_pieces(hidden_size: int, vocab: int, rows_list=GEMM_ROWS) -> list[dict]:
    """ms of each piece of one chunk of ``rows`` tokens: the logits matmul, the cross-entropy kernel (gradient
    in place), dh, dW written (first chunk) and accumulated (later chunks, beta=1), and dW accumulated
    through its transpose (cuBLAS then sees the other layout). No L2 flush: every operand is larger than L2
    but h's rows at small chunks."""
    from triton.testing import do_bench

    free_device_memory()
    rows_max = max(rows_list)
    torch.manual_seed(0)
    hidden = torch.randn(rows_max, hidden_size, device="cuda", dtype=torch.bfloat16)
    weight = 0.02 * torch.randn(vocab, hidden_size, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, vocab, (rows_max,), device="cuda")
    logits = torch.empty(rows_max, vocab, device="cuda", dtype=torch.bfloat16)
    grad_hidden = torch.empty_like(hidden)
    grad_weight = torch.zeros_like(weight)
    loss = torch.empty(rows_max, device="cuda", dtype=torch.float32)
    scale = torch.full((1,), 1.0 / rows_max, device="cuda", dtype=torch.float32)
    results = []
    for rows in rows_list:
        h, z, y, dh = hidden[:rows], logits[:rows], labels[:rows], grad_hidden[:rows]
        torch.mm(h, weight.t(), out=z)
        row = {"op": "chunk-pieces", "H": hidden_size, "V": vocab, "rows": rows}
        for name, fn in _chunk_piece_calls(h, z, y, dh, weight, grad_weight, loss[:rows], scale).items():
            row[name] = round(float(do_bench(fn, warmup=5, rep=15, return_mode="median")), 4)
        flops = 2 * rows * hidden_size * vocab
        row["tflops"] = {k: round(flops / (row[k] * 1e9), 1) for k in ("logits", "dh", "dw_first", "dw_acc")}
        results.append(row)
    return results


def _chunk_piece_calls(h, z, y, dh, weight, grad_weight, loss, scale) -> dict[str, Callable[[], Any]]:
    from fusetune.kernels.cross_entropy import launch_cross_entropy_forward

    return {
        "logits": lambda: torch.mm(h, weight.t(), out=z),
        "ce": lambda: launch_cross_entropy_forward(
            z, y, loss_out=loss, grad_out=z, grad_scale=scale, correct_out=None, ignore_index=-100,
            label_smoothing=0.0, z_loss_scale=0.0, softcap=0.0,
        ),
        "dh": lambda: torch.mm(z, weight, out=dh),
        "dw_first": lambda: torch.mm(z.t(), h, out=grad_weight),
        "dw_acc": lambda: grad_weight.addmm_(z.t(), h),
        "dw_acc_t": lambda: grad_weight.t().addmm_(h.t(), z),
    }  # fmt: skip


def overlap_case(shape) -> list[dict]:
    """ms of one chunk's pieces at ``shape``'s chunk rows: the logits matmul, dh = dlogits @ W and
    dW += dlogits^T @ h alone, one after the other, and concurrently on two streams, plainly and with
    cuBLAS told to leave SMs to the other matmul (torch's SM carve-out, split n ways), under each BLAS
    backend. The question: does dW's memory traffic (it reads and writes all of dW per chunk) hide under
    dh's tensor-core work when they share the device?"""
    from fusetune.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy_chunk_rows

    tokens, hidden_size, vocab, _ = shape
    rows = fused_linear_cross_entropy_chunk_rows(tokens, hidden_size, vocab, torch.bfloat16)
    free_device_memory()
    torch.manual_seed(0)
    h = torch.randn(rows, hidden_size, device="cuda", dtype=torch.bfloat16)
    weight = 0.02 * torch.randn(vocab, hidden_size, device="cuda", dtype=torch.bfloat16)
    dlogits = (1e-4 * torch.randn(rows, vocab, device="cuda")).to(torch.bfloat16)
    logits = torch.empty_like(dlogits)
    dh = torch.empty_like(h)
    dw = torch.zeros_like(weight)
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    carve = torch._C._set_sm_carveout_experimental

    def run_dh(carveout=None):
        carve(carveout)
        torch.mm(dlogits, weight, out=dh)
        carve(None)

    def run_dw(carveout=None):
        carve(carveout)
        dw.addmm_(dlogits.t(), h)
        carve(None)

    def side_by_side(first, second):
        def call():
            side.wait_stream(main)
            with torch.cuda.stream(side):
                first()
            second()
            main.wait_stream(side)

        return call

    timer = CudaTimer()

    def timed(fn) -> float:
        return round(timer.time(fn, SWEEP), 4)

    results = []
    default_library = torch.backends.cuda.preferred_blas_library()
    for library in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(library)
        cases = {
            "logits": lambda: torch.mm(h, weight.t(), out=logits),
            "dh": run_dh,
            "dw": run_dw,
            "dh,dw in turn": lambda: (run_dh(), run_dw()),
            "dh || dw": side_by_side(run_dh, run_dw),
            "dw || dh": side_by_side(run_dw, run_dh),
        }
        for share in (16, 33, 66, 99):
            cases[f"dw on {share} SMs"] = lambda share=share: run_dw(n_sm - share)
            cases[f"dh on {share} SMs"] = lambda share=share: run_dh(n_sm - share)
            cases[f"dh on {n_sm - share} || dw on {share}"] = side_by_side(
                lambda share=share: run_dh(share), lambda share=share: run_dw(n_sm - share)
            )
        row = {"op": "chunk-overlap", "shape": shape, "rows": rows, "blas": library}
        row.update({name: timed(fn) for name, fn in cases.items()})
        results.append(row)
    torch.backends.cuda.preferred_blas_library(default_library)
    return results


def columns_case(tokens: int, vocab: int, softcap: float | None) -> list[dict]:
    """GPU ms of the cross-entropy kernel over [V, N] logits (fused linear cross-entropy's chunk held in dW)
    at each launch setting, beside the row kernel over the same logits laid out [N, V]; gradients in place."""
    from fusetune.kernels import cross_entropy as ce_module

    free_device_memory()
    torch.manual_seed(0)
    rows = torch.randn(tokens, vocab, device="cuda", dtype=torch.bfloat16)
    columns = rows.t().contiguous()
    labels = torch.randint(0, vocab, (tokens,), device="cuda")
    loss = torch.empty(tokens, device="cuda")
    scale = torch.full((1,), 1.0 / tokens, device="cuda")
    options = dict(loss_out=loss, grad_scale=scale, softcap=softcap or 0.0)
    base = {"op": "ce-columns", "T": tokens, "V": vocab, "softcap": softcap}

    def gpu_ms(fn, reps: int = 5) -> float:  # the kernel's mean GPU time, from the profiler
        return round(sum(ms for _, ms, _ in profile_kernels(fn, top=None, reps=reps)) / reps, 4)

    results = [{**base, "layout": "rows", **{"ms": gpu_ms(lambda: ce_module.launch_cross_entropy_forward(
        rows, labels, grad_out=rows, **options))}}]  # fmt: skip
    default = ce_module.cross_entropy_columns_launch_config(tokens, vocab, columns.device)
    processors = torch.cuda.get_device_properties(0).multi_processor_count
    configs = {default: True}
    for block_t, block_v, warps, per_sm in COLUMNS_SETTINGS:
        splits = max(1, min(-(-per_sm * processors // -(-tokens // block_t)), -(-vocab // block_v)))
        config = ce_module.CrossEntropyColumnsLaunchConfig(block_t, block_v, warps, splits)
        configs.setdefault(config, False)
    for config, is_default in configs.items():
        ms = gpu_ms(lambda config=config: ce_module.launch_cross_entropy_columns(
            columns, labels, grad_out=columns, config=config, **options))  # fmt: skip
        setting = (config.block_t, config.block_v, config.num_warps, config.splits)
        results.append({**base, "layout": "columns", "setting": setting, "ms": ms, "default": is_default})
    return results


def device_timeline(fn: Callable[[], Any]) -> dict:
    """One call's device timeline: span from the first kernel's start to the last one's end, busy time,
    and the five longest idle gaps between kernels with the kernel that ended before each."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    spans = sorted(
        (event.time_range.start, event.time_range.end, event.name[:60])
        for event in prof.events()
        if getattr(event.device_type, "name", "") == "CUDA"
    )
    if not spans:
        return {}
    gaps, busy, last_end, last_name = [], 0.0, spans[0][0], ""
    for start, end, name in spans:
        if start > last_end:
            gaps.append((round((start - last_end) / 1e3, 3), last_name))
        busy += max(0.0, end - max(start, last_end))
        if end > last_end:
            last_end, last_name = end, name
    return {"span_ms": round((last_end - spans[0][0]) / 1e3, 3), "busy_ms": round(busy / 1e3, 3),
            "gaps": sorted(gaps, reverse=True)[:5]}  # fmt: skip


def fusetune_call(shape) -> Callable[[], Any]:
    """One fwd+bwd of fusetune's fused linear cross-entropy at ``shape``."""
    hidden, weight, labels, loss_fn = linear_inputs(shape)
    return lambda: torch.autograd.grad([loss_fn(hidden, weight, labels)], [hidden, weight])


def idle_gaps(shape, min_gap_us: float = 20.0, top: int = 8) -> dict:
    """Where the device waits for the host in one fwd+bwd: the call's span on the host, the time from its
    start to its first kernel, the device's span, and the longest idle gaps between kernels, each with the
    host operators running during it (shortest first: the innermost explain the wait). Replaces a CPU-only
    profile of self times, whose profiler overhead showed the 20-us scale launch as 1.7 ms."""
    from torch.profiler import ProfilerActivity, profile, record_function

    call = fusetune_call(shape)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("fwd_bwd_call"):
            call()
        torch.cuda.synchronize()
    kernels, host = [], []
    for event in prof.events():
        span = (event.time_range.start, event.time_range.end, event.name[:70])
        (kernels if getattr(event.device_type, "name", "") == "CUDA" else host).append(span)
    kernels.sort()
    call_span = next(s for s in host if s[2] == "fwd_bwd_call")
    gaps, last_end = [], kernels[0][0]
    for start, end, _ in kernels:
        if start - last_end >= min_gap_us:
            during = sorted(
                (e - s, n) for s, e, n in host if s < start and e > last_end and n != "fwd_bwd_call"
            )
            names = list(dict.fromkeys(n for _, n in during))[:6]
            gaps.append((round((start - last_end) / 1e3, 3), names))
        last_end = max(last_end, end)
    return {"op": "flce-gaps", "shape": shape, "host_call_ms": round((call_span[1] - call_span[0]) / 1e3, 3),
            "before_first_kernel_ms": round((kernels[0][0] - call_span[0]) / 1e3, 3),
            "device_span_ms": round((last_end - kernels[0][0]) / 1e3, 3),
            "gaps": sorted(gaps, key=lambda g: -g[0])[:top]}  # fmt: skip


def host_pieces(repeats: int = 50) -> dict:
    """Host microseconds of each piece of a fused linear cross-entropy call, issued while a sleep kernel keeps
    the device busy (so no launch waits for it); the pieces that synchronise run with the device idle."""
    from fusetune.kernels import fused_linear_cross_entropy as flce
    from fusetune.kernels.cross_entropy import launch_cross_entropy_forward

    device = torch.device("cuda")
    grad = torch.randn(1024, 4096, device=device, dtype=torch.bfloat16)
    weight = torch.randn(32000, 4096, device=device, dtype=torch.bfloat16, requires_grad=True)
    hidden = torch.randn(1024, 4096, device=device, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 32000, (1024,), device=device)
    factor = torch.ones((), device=device)
    logits = torch.randn(64, 32000, device=device, dtype=torch.bfloat16)
    loss, scale = torch.empty(64, device=device), torch.ones(1, device=device)
    busy = {
        "memory_allocated": lambda: torch.cuda.memory_allocated(device),
        "memory_reserved": lambda: torch.cuda.memory_reserved(device),
        "scale (eager, no op dispatch)": lambda: flce._scale_(grad, factor),
        "cross-entropy launch": lambda: launch_cross_entropy_forward(
            logits, labels[:64], loss_out=loss, grad_out=logits, grad_scale=scale
        ),
        "torch.mm": lambda: torch.mm(grad[:64], weight.detach()[:64].t()),
        "torch.full": lambda: torch.full((1,), 0.5, device=device),
        "empty 64 MB": lambda: torch.empty((1024, 32000), device=device, dtype=torch.bfloat16),
        # A call of one chunk no longer synchronises, so its pieces are timed with the device busy too.
        "flce chunk loop (T=1024, H=4096, V=32000)": lambda: flce._chunked_linear_cross_entropy(
            hidden.detach(),
            weight.detach(),
            labels,
            None,
            ignore_index=-100,
            reduction="mean",
            num_items=None,
            softcap=0.0,
            label_smoothing=0.0,
            z_loss_scale=0.0,
            accumulate_dw_in_fp32=False,
            compute_accuracy=False,
            grad_hidden_needed=True,
            grad_weight_needed=True,
            grad_bias_needed=False,
            token_upstream=None,
            logits_chunk_bytes=None,
        ),
        "flce forward": lambda: flce.fused_linear_cross_entropy(hidden, weight, labels),
        "flce fwd+bwd": lambda: torch.autograd.grad(
            [flce.fused_linear_cross_entropy(hidden, weight, labels)], [hidden, weight]
        ),
    }
    idle = {
        "mem_get_info": lambda: torch.cuda.mem_get_info(device),
        "nonzero": lambda: torch.nonzero(labels != -100),
        "count on host (pinned copy + event)": lambda: flce._HostCount((labels != -100).sum()).value(),
    }
    result = {}
    for name, fn in {**busy, **idle}.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        total = 0.0
        for _ in range(repeats):
            if name in busy:
                torch.cuda._sleep(2_000_000)
            else:
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            total += time.perf_counter() - start
        torch.cuda.synchronize()
        result[name] = round(total / repeats * 1e6, 1)
    return {"op": "flce-host-pieces", "us": result}


def profile_case(shape, impl: str = "fusetune") -> dict:
    """Kernel profile of ``impl`` at one shape, with its measured time (and for fusetune the chunk rows)."""
    from fusetune.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy_chunk_rows

    tokens, hidden_size, vocab, _ = shape
    hidden, weight, labels, loss_fn = linear_inputs(shape, impl)
    rows = fused_linear_cross_entropy_chunk_rows(tokens, hidden_size, vocab, torch.bfloat16)
    ms, peak = measure(lambda: loss_fn(hidden, weight, labels), [hidden, weight], SWEEP)
    kernels = profile_kernels(
        lambda: torch.autograd.grad([loss_fn(hidden, weight, labels)], [hidden, weight]), top=40
    )
    timeline = device_timeline(
        lambda: torch.autograd.grad([loss_fn(hidden, weight, labels)], [hidden, weight])
    )
    torch._dynamo.reset()
    return {"op": "flce-profile", "impl": impl, "shape": shape, "chunk_rows": rows if impl == "fusetune" else None,
            "ms": round(ms, 3), "kernel_ms": round(sum(k[1] for k in kernels), 3), "timeline": timeline,
            "kernels": kernels[:10]}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impls", default="compile,liger,fusetune")
    parser.add_argument("--tag", default="new")
    parser.add_argument("--budget-s", type=float, default=240.0)
    parser.add_argument("--parts", default="ce,main,profile,sweep")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument(
        "--shapes",
        default="",
        help='the sweep and sweep-profile parts\' shapes instead of their own: "T,H,V,softcap;..." (softcap 0: '
        "none)",
    )
    parser.add_argument(
        "--ignored-percent",
        type=int,
        default=0,
        help="fused linear CE: tokens labelled ignore_index, per 100",
    )
    args = parser.parse_args()
    global IGNORED_PERCENT
    IGNORED_PERCENT = args.ignored_percent
    sweep_shapes, profile_shapes = LINEAR_SHAPES[1:], PROFILE_SHAPES
    if args.shapes:
        sweep_shapes = tuple(
            (int(t), int(h), int(v), float(c) or None)
            for t, h, v, c in (item.split(",") for item in args.shapes.split(";"))
        )
        profile_shapes = sweep_shapes
    impls, parts = args.impls.split(","), args.parts.split(",")
    deadline = time.time() + args.budget_s
    rows = []

    def emit(row: dict) -> None:
        row["tag"] = args.tag
        if args.ignored_percent:
            row["ignored_percent"] = args.ignored_percent
        rows.append(row)
        print(json.dumps(row), flush=True)

    if "ce" in parts:
        for impl in impls:
            emit({"op": "cross_entropy", "T": 8192, "V": 128256, "impl": impl, **ce_case(8192, 128256, impl)})
        if "fusetune" in impls and args.tag == "new":
            for vocab in (128256, 32000):
                for setting in CE_SETTINGS:
                    emit({"op": "cross_entropy", "T": 8192, "V": vocab, "impl": "fusetune", "setting": setting,
                          **ce_case(8192, vocab, "fusetune", setting)})  # fmt: skip
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
        hidden, weight, labels, loss_fn = linear_inputs(shape)
        kernels = profile_kernels(
            lambda: torch.autograd.grad([loss_fn(hidden, weight, labels)], [hidden, weight])
        )
        emit({"op": "flce-profile", "shape": shape, "kernels": kernels})
        del hidden, weight, labels
        free_device_memory()
    if "gemms" in parts:
        for hidden_size in GEMM_HIDDEN:
            for vocab in GEMM_VOCABS:
                if time.time() > deadline:
                    break
                for row in chunk_pieces(hidden_size, vocab):
                    emit(row)
    if "columns" in parts:
        for tokens, vocab, softcap in COLUMNS_SHAPES:
            for row in columns_case(tokens, vocab, softcap):
                emit(row)
    if "overlap" in parts:
        for overlap_shape in OVERLAP_SHAPES:
            for row in overlap_case(overlap_shape):
                emit(row)
    if "host-pieces" in parts:
        emit(host_pieces())
    if "gaps" in parts:
        for gap_shape in ((1024, 4096, 32000, None), (1024, 4096, 151936, None), LINEAR_SHAPES[0]):
            emit(idle_gaps(gap_shape))
    if "chunk-rows" in parts:
        for chunking_shape in sweep_shapes:
            if time.time() < deadline:
                for row in chunking_cases(chunking_shape):
                    emit(row)
    if "sweep-profile" in parts:
        for profile_shape in profile_shapes:
            for impl in impls:
                if impl != "liger" and time.time() < deadline:
                    emit(profile_case(profile_shape, impl))
    if "sweep" in parts:
        for shape in sweep_shapes:
            for impl in impls:
                if time.time() > deadline:
                    emit({"op": "flce", "shape": shape, "impl": impl, "error": "time budget used up"})
                    continue
                if impl == "compile" and shape[0] * shape[2] > 65536 * 128256 // 2:
                    emit({"op": "flce", "shape": shape, "impl": impl, "error": "skipped (memory)"})
                    continue
                emit({"op": "flce", "shape": shape, "impl": impl, **linear_case(shape, impl, SWEEP)})
    harness.write_json(Path(args.out) / f"loss-{args.tag}.json", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
