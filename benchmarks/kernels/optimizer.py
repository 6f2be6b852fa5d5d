"""Optimizer-step benchmark at the Llama-3.2-1B parameter set: step time and optimizer-state memory.

Implementations, each on the 146 tensors of a Llama-3.2-1B-shaped model (1.236e9 parameters: tied 128256 x 2048
embedding, 16 layers of q/k/v/o and gate/up/down projections and two norms, the final norm), one at a time:

    torch-fp32       torch.optim.AdamW(fused=True) on fp32 parameters and gradients (the service's default today)
    torch-bf16       torch.optim.AdamW(fused=True) on bf16 parameters and gradients (state in bf16)
    torchao-bf16-sr  torchao.optim.AdamW(bf16_stochastic_round=True) (torchao 0.17: _AdamW) on bf16 parameters
                     (state in bf16, rounded to nearest; one torch.compile'd function per parameter)
    fusetune         fusetune.kernels.FusedAdamW, bf16 parameters, bf16 state, stochastic rounding
    fusetune-fp32-state   the same with fp32 exp_avg / exp_avg_sq
    fusetune-flat    FusedAdamW on one flat tensor of the same size: the cost of the address table
    (--sweep) fusetune with other launch settings (block size, warps)

Step time: median of CUDA-event times of `--steps` steps after `--warmup` steps (torchao compiles in them), the
gradients left in place. Host ms: wall time of issuing one step() without waiting for the GPU. State memory:
memory_allocated after the first step minus before it (the state is created lazily), in GiB; peak extra: the
peak during a later step minus the allocation before it. Floor: the bytes one step must move (parameters,
gradients and both moments read, parameters and moments written) over the copy bandwidth measured in the run.

    python3 -m benchmarks.kernels.optimizer [--impls torch-fp32,fusetune] [--sweep] [--out DIR]

Results go to the section "optimizer" of `benchmarks/results/<gpu-slug>-kernels.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import traceback
from typing import Any
from unittest import mock

from benchmarks import harness
from benchmarks.harness import GIB, markdown_table, short_error

RESULTS = harness.Benchmark("optimizer", topic="kernels")
IMPLS = ("torch-fp32", "torch-bf16", "torchao-bf16-sr", "fusetune", "fusetune-fp32-state", "fusetune-flat")
# (block_size, num_warps) tried by --sweep
SWEEP_SETTINGS = ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16))
LR, WEIGHT_DECAY = 1e-5, 0.01
IMPL_NOTES = (
    "torch-fp32: torch fused AdamW on fp32 weights (bf16-mixed); torch-bf16: on bf16 weights, rounded to "
    "nearest (bf16); torchao-bf16-sr: torchao's AdamW with bf16 stochastic rounding; fusetune: FusedAdamW "
    "(bf16-sr); fusetune-fp32-state: with fp32 moments; fusetune-flat: on one flat tensor."
)


def llama_3_2_1b_shapes() -> list[tuple[int, ...]]:
    hidden, intermediate, kv, vocab, layers = 2048, 8192, 512, 128256, 16
    layer = [
        (hidden, hidden),  # q_proj
        (kv, hidden),  # k_proj
        (kv, hidden),  # v_proj
        (hidden, hidden),  # o_proj
        (intermediate, hidden),  # gate_proj
        (intermediate, hidden),  # up_proj
        (hidden, intermediate),  # down_proj
        (hidden,),  # input_layernorm
        (hidden,),  # post_attention_layernorm
    ]
    return [(vocab, hidden)] + layer * layers + [(hidden,)]


def bytes_per_param(impl: str) -> tuple[int, int]:
    """(bytes read, bytes written) per parameter by one step: parameter, gradient and two moments."""
    if impl == "torch-fp32":
        return 16, 12
    if impl == "fusetune-fp32-state":
        return 12, 10
    return 8, 6


def build(impl: str, shapes: list[tuple[int, ...]]):
    import torch

    dtype = torch.float32 if impl == "torch-fp32" else torch.bfloat16
    if impl == "fusetune-flat":
        shapes = [(sum(int(torch.Size(s).numel()) for s in shapes),)]
    params = []
    for shape in shapes:
        param = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device="cuda").normal_(0, 0.02))
        param.grad = torch.empty_like(param).normal_(0, 1e-3)
        params.append(param)
    if impl.startswith("torch-"):
        return params, torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    if impl == "torchao-bf16-sr":
        import torchao.optim

        # torchao 0.17 renamed its public AdamW to the private _AdamW ("only for quantized training")
        adamw = getattr(torchao.optim, "AdamW", None) or torchao.optim._AdamW
        return params, adamw(params, lr=LR, weight_decay=WEIGHT_DECAY, bf16_stochastic_round=True)
    from fusetune.kernels.adamw import FusedAdamW

    state_dtype = torch.float32 if impl == "fusetune-fp32-state" else torch.bfloat16
    return params, FusedAdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, state_dtype=state_dtype)


def measure(impl: str, shapes, warmup: int, steps: int, copy_gbps: float, settings=None) -> dict[str, Any]:
    import torch

    from fusetune.kernels import adamw as adamw_module

    row: dict[str, Any] = {
        "impl": impl if settings is None else f"fusetune block {settings[0]} warps {settings[1]}"
    }
    patch = (
        mock.patch.object(
            adamw_module, "adamw_launch_settings", lambda: adamw_module.AdamWLaunchSettings(*settings)
        )
        if settings
        else contextlib.nullcontext()
    )
    try:
        with patch:
            params, optimizer = build(impl, shapes)
            n_params = sum(p.numel() for p in params)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            optimizer.step()
            torch.cuda.synchronize()
            row["state_gib"] = (torch.cuda.memory_allocated() - before) / GIB
            for _ in range(max(warmup - 1, 0)):
                optimizer.step()
            torch.cuda.synchronize()
            times, host = [], []
            for _ in range(steps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                issue = time.perf_counter()
                optimizer.step()
                host.append((time.perf_counter() - issue) * 1e3)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            optimizer.step()
            torch.cuda.synchronize()
            row["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / GIB
            read, written = bytes_per_param(impl)
            floor_ms = n_params * (read + written) / (copy_gbps * 1e9) * 1e3
            row.update(
                params=n_params,
                tensors=len(params),
                ms=statistics.median(times),
                host_ms=statistics.median(host),
                floor_ms=floor_ms,
                weights_and_grads_gib=sum(p.numel() * p.element_size() * 2 for p in params) / GIB,
            )
            row["floor_ratio"] = row["ms"] / floor_ms
            row["effective_GBps"] = n_params * (read + written) / (row["ms"] * 1e-3) / 1e9
    except Exception as error:  # one failing implementation must not stop the others
        traceback.print_exc()
        row["error"] = short_error(error)
    finally:
        params = optimizer = None  # noqa: F841
        harness.free_device_memory()
    return row


def render_markdown(payload: dict[str, Any]) -> str:
    rows = payload["rows"]
    sized = next((row for row in rows if "params" in row), {})
    header = [
        "impl",
        "ms",
        "floor ms",
        "x floor",
        "host ms",
        "state GiB",
        "peak extra GiB",
        "weights+grads GiB",
    ]
    table = [
        [r["impl"], r.get("ms"), r.get("floor_ms"), r.get("floor_ratio"), r.get("host_ms"), r.get("state_gib"),
         r.get("peak_extra_gib"), r.get("weights_and_grads_gib")] if "error" not in r else [r["impl"], r["error"]]
        + [None] * 6
        for r in rows
    ]  # fmt: skip
    return "\n".join(
        [
            f"# Optimizer step: {payload['gpu']}, {payload['date']}",
            "",
            f"Versions: {payload['versions']}",
            "",
            f"One AdamW step over {sized.get('params', 0):,} parameters in {sized.get('tensors')} tensors (the "
            f"Llama-3.2-1B shape), median of {payload['steps']} steps after {payload['warmup']} warm-up steps; "
            f"`{payload['command']}`. {IMPL_NOTES}",
            "",
            markdown_table(header, table),
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--sweep", action="store_true", help="also time fusetune's other launch settings")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    harness.add_results_arguments(parser, RESULTS)
    args = parser.parse_args(argv)

    import torch

    shapes = llama_3_2_1b_shapes()
    copy_gbps = harness.copy_rate_gbps(GIB, warmup_ms=100, rep_ms=300)
    harness.free_device_memory()
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbps:.0f} GB/s", flush=True)
    rows = []
    for impl in harness.comma_list(args.impls):
        rows.append(measure(impl, shapes, args.warmup, args.steps, copy_gbps))
        print(json.dumps(rows[-1]), flush=True)
    if args.sweep:
        for settings in SWEEP_SETTINGS:
            rows.append(measure("fusetune", shapes, 2, args.steps, copy_gbps, settings))
            print(json.dumps(rows[-1]), flush=True)
    payload = {
        **harness.run_meta(torch.cuda.get_device_name(), {"copy_GBps": round(copy_gbps, 1)}),
        "model": "llama-3.2-1b-shape",
        "command": "python3 -m benchmarks.kernels.optimizer "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "steps": args.steps,
        "warmup": args.warmup,
        "rows": rows,
    }
    payload["versions"]["torchao"] = harness.package_version("torchao")
    RESULTS.save(args, harness.results_slug(args, payload["gpu"]), payload, render_markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
