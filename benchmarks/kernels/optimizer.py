"""Optimizer-step benchmark at the Llama-3.2-1B (or -3.1-8B) parameter set: step time and optimizer-state memory.

Implementations, each on the 146 tensors of a Llama-3.2-1B-shaped model (1.236e9 parameters: tied 128256 x 2048
embedding, 16 layers of q/k/v/o and gate/up/down projections and two norms, the final norm), or with
`--model llama-3.1-8b-shape` the 291 tensors of Llama-3.1-8B (8.03e9: untied 128256 x 4096 embedding and
lm_head, 32 layers), one at a time:

    torch-fp32       torch.optim.AdamW(fused=True) on fp32 parameters and gradients (the service's default today)
    torch-bf16       torch.optim.AdamW(fused=True) on bf16 parameters and gradients (state in bf16)
    torchao-bf16-sr  torchao.optim.AdamW(bf16_stochastic_round=True) (torchao 0.17: _AdamW) on bf16 parameters
                     (state in bf16, rounded to nearest; one torch.compile'd function per parameter)
    fusetune         fusetune.kernels.FusedAdamW, bf16 parameters, bf16 state, stochastic rounding
    fusetune-fp32-state   the same with fp32 exp_avg / exp_avg_sq
    fusetune-flat    FusedAdamW on one flat tensor of the same size: the cost of the address table
    fusetune-8bit    fusetune.kernels.FusedAdamW8bit, bf16 parameters, 8-bit moments (256-element blocks),
                     weights and codes rounded stochastically
    torchao-8bit     torchao.optim.AdamW8bit(bf16_stochastic_round=True): 8-bit moments (256-element blocks,
                     rounded to nearest), bf16 weights rounded stochastically; one torch.compile'd function per
                     parameter (tensors under 4096 elements keep bf16 moments)
    bnb-8bit         bitsandbytes.optim.AdamW8bit: blockwise 8-bit moments, bf16 weights rounded to nearest
                     (no stochastic rounding); tensors under 4096 elements keep fp32 moments
    (--sweep) fusetune with other launch settings (block size, warps)
    (--sweep-8bit) fusetune-8bit with other launch settings (elements per program, warps)

An implementation whose library is not installed, or whose parameters, gradients and state would not fit the
free device memory (torch-fp32 at 8B), is a row with its error instead of numbers. State bytes per parameter:
the state memory over the parameter count.

Step time: median of CUDA-event times of `--steps` steps after `--warmup` steps (torchao compiles in them), the
gradients left in place. Host ms: wall time of issuing one step() without waiting for the GPU. State memory:
memory_allocated after the first step minus before it (the state is created lazily), in GiB; peak extra: the
peak during a later step minus the allocation before it. Floor: the bytes one step must move (parameters,
gradients and both moments read, parameters and moments written) over the copy bandwidth measured in the run.

    python3 -m benchmarks.kernels.optimizer [--impls torch-fp32,fusetune] [--sweep] [--out DIR]
    python3 -m benchmarks.kernels.optimizer --model llama-3.1-8b-shape --section optimizer-8b

Results go to the section "optimizer" of `benchmarks/results/<gpu-slug>-kernels.json` (`--section` for another).
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
IMPLS = (
    "torch-fp32",
    "torch-bf16",
    "torchao-bf16-sr",
    "fusetune",
    "fusetune-fp32-state",
    "fusetune-flat",
    "fusetune-8bit",
    "torchao-8bit",
    "bnb-8bit",
)
EIGHT_BIT_IMPLS = ("fusetune-8bit", "torchao-8bit", "bnb-8bit")
# (block_size, num_warps) tried by --sweep; (elements_per_program, num_warps) by --sweep-8bit
SWEEP_SETTINGS = ((512, 2), (1024, 2), (1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (4096, 16), (8192, 16))  # fmt: skip
SWEEP_8BIT_SETTINGS = (
    (256, 1),
    (256, 2),
    (512, 2),
    (512, 4),
    (1024, 2),
    (1024, 4),
    (1024, 8),
    (2048, 4),
    (2048, 8),
    (4096, 16),
)
MODELS = ("llama-3.2-1b-shape", "llama-3.1-8b-shape")
LR, WEIGHT_DECAY = 1e-5, 0.01
IMPL_NOTES = (
    "torch-fp32: torch fused AdamW on fp32 weights (bf16-mixed); torch-bf16: on bf16 weights, rounded to "
    "nearest (bf16); torchao-bf16-sr: torchao's AdamW with bf16 stochastic rounding; fusetune: FusedAdamW "
    "(bf16-sr); fusetune-fp32-state: with fp32 moments; fusetune-flat: on one flat tensor."
)
EIGHT_BIT_NOTES = (
    "fusetune-8bit: FusedAdamW8bit (8-bit moments, weights and codes rounded stochastically); torchao-8bit: "
    "torchao's AdamW8bit with bf16 stochastic rounding of the weights; bnb-8bit: bitsandbytes' AdamW8bit "
    "(weights rounded to nearest)."
)
MODEL_NAMES = {"llama-3.2-1b-shape": "the Llama-3.2-1B shape", "llama-3.1-8b-shape": "the Llama-3.1-8B shape"}


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


def llama_3_1_8b_shapes() -> list[tuple[int, ...]]:
    hidden, intermediate, kv, vocab, layers = 4096, 14336, 1024, 128256, 32
    layer = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (intermediate, hidden),
             (intermediate, hidden), (hidden, intermediate), (hidden,), (hidden,)]  # fmt: skip
    return [(vocab, hidden)] + layer * layers + [(hidden,), (vocab, hidden)]  # embedding ... norm, lm_head


def model_shapes(model: str) -> list[tuple[int, ...]]:
    return {"llama-3.2-1b-shape": llama_3_2_1b_shapes, "llama-3.1-8b-shape": llama_3_1_8b_shapes}[model]()


def bytes_per_param(impl: str) -> tuple[float, float]:
    """(bytes read, bytes written) per parameter by one step: parameter, gradient and two moments (8-bit:
    a byte each, and two fp32 scales per 256 elements)."""
    if impl == "torch-fp32":
        return 16, 12
    if impl == "fusetune-fp32-state":
        return 12, 10
    if impl in EIGHT_BIT_IMPLS:
        return 6 + 8 / 256, 4 + 8 / 256
    return 8, 6


def resident_bytes_per_param(impl: str) -> float:
    """Parameters, gradients and optimizer state per parameter: what must fit before the first step."""
    if impl == "torch-fp32":
        return 16
    if impl == "fusetune-fp32-state":
        return 12
    if impl in EIGHT_BIT_IMPLS:
        return 6 + 8 / 256
    return 8


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
    if impl == "torchao-8bit":
        from torchao.optim import AdamW8bit

        return params, AdamW8bit(params, lr=LR, weight_decay=WEIGHT_DECAY, bf16_stochastic_round=True)
    if impl == "bnb-8bit":
        from bitsandbytes.optim import AdamW8bit

        return params, AdamW8bit(params, lr=LR, weight_decay=WEIGHT_DECAY)
    if impl == "fusetune-8bit":
        from fusetune.kernels.adamw8bit import FusedAdamW8bit

        return params, FusedAdamW8bit(params, lr=LR, weight_decay=WEIGHT_DECAY)
    from fusetune.kernels.adamw import FusedAdamW

    state_dtype = torch.float32 if impl == "fusetune-fp32-state" else torch.bfloat16
    return params, FusedAdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, state_dtype=state_dtype)


def _settings_patch(impl: str, settings: tuple[int, int] | None):
    """A context in which FusedAdamW (or FusedAdamW8bit, for fusetune-8bit) takes `settings`."""
    from fusetune.kernels import adamw as adamw_module
    from fusetune.kernels import adamw8bit as adamw8bit_module

    if settings is None:
        return contextlib.nullcontext()
    if impl == "fusetune-8bit":
        return mock.patch.object(
            adamw8bit_module,
            "adamw8bit_launch_settings",
            lambda block_size: adamw8bit_module.AdamW8bitLaunchSettings(*settings),
        )
    return mock.patch.object(
        adamw_module, "adamw_launch_settings", lambda: adamw_module.AdamWLaunchSettings(*settings)
    )


def _row_name(impl: str, settings: tuple[int, int] | None) -> str:
    if settings is None:
        return impl
    if impl == "fusetune-8bit":
        return f"fusetune-8bit elements {settings[0]} warps {settings[1]}"
    return f"fusetune block {settings[0]} warps {settings[1]}"


def measure(impl: str, shapes, warmup: int, steps: int, copy_gbps: float, settings=None) -> dict[str, Any]:
    import torch

    row: dict[str, Any] = {"impl": _row_name(impl, settings)}
    try:
        n_params = sum(int(torch.Size(shape).numel()) for shape in shapes)
        needed = n_params * resident_bytes_per_param(impl)
        free, _ = torch.cuda.mem_get_info()
        if needed > 0.95 * free:
            raise MemoryError(
                f"skipped: parameters, gradients and state need {needed / GIB:.1f} GiB, {free / GIB:.1f} GiB free"
            )
        with _settings_patch(impl, settings):
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
            if impl in EIGHT_BIT_IMPLS:
                row["state_bytes_per_param"] = row["state_gib"] * GIB / n_params
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
    notes = IMPL_NOTES
    if any(row["impl"].split(" ")[0] in EIGHT_BIT_IMPLS for row in rows):
        # 8-bit rows (issue 34): their state bytes per parameter beside the table's columns
        header.append("state bytes/param")
        for table_row, row in zip(table, rows, strict=True):
            table_row.append(
                None
                if "error" in row
                else row.get("state_bytes_per_param", row["state_gib"] * GIB / row["params"])
            )
        notes = f"{IMPL_NOTES} {EIGHT_BIT_NOTES}"
    return "\n".join(
        [
            f"# Optimizer step: {payload['gpu']}, {payload['date']}",
            "",
            f"Versions: {payload['versions']}",
            "",
            f"One AdamW step over {sized.get('params', 0):,} parameters in {sized.get('tensors')} tensors "
            f"({MODEL_NAMES.get(payload['model'], payload['model'])}), median of {payload['steps']} steps after "
            f"{payload['warmup']} warm-up steps; `{payload['command']}`. {notes}",
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
    parser.add_argument(
        "--sweep-8bit", action="store_true", help="also time fusetune-8bit's other launch settings"
    )
    parser.add_argument("--model", choices=MODELS, default=MODELS[0], help="the parameter set")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    harness.add_results_arguments(parser, RESULTS)
    args = parser.parse_args(argv)

    import torch

    shapes = model_shapes(args.model)
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
    if args.sweep_8bit:
        for settings in SWEEP_8BIT_SETTINGS:
            rows.append(measure("fusetune-8bit", shapes, 2, args.steps, copy_gbps, settings))
            print(json.dumps(rows[-1]), flush=True)
    payload = {
        **harness.run_meta(torch.cuda.get_device_name(), {"copy_GBps": round(copy_gbps, 1)}),
        "model": args.model,
        "command": "python3 -m benchmarks.kernels.optimizer "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "steps": args.steps,
        "warmup": args.warmup,
        "rows": rows,
    }
    payload["versions"]["torchao"] = harness.package_version("torchao")
    if any(impl == "bnb-8bit" for impl in harness.comma_list(args.impls)):
        payload["versions"]["bitsandbytes"] = harness.package_version("bitsandbytes")
    RESULTS.save(args, harness.results_slug(args, payload["gpu"]), payload, render_markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
