"""Quality of the fp8 precision mode at a real model shape: does fp8 fine-tune as well as bf16-sr?

benchmarks/quality/precision.py's protocol (its docstring: random bigram tasks, pre-training on task A with fp32
weights to a plateau near the task's floor, then fine-tuning on task B, `--seeds` seeds per learning rate), with
its pre-training and helpers, fine-tuning in

    bf16-sr            precision "bf16-sr" (the reference here)
    fp8                precision "fp8": bf16-sr with the decoder's linear layers converted by
                       fusetune.worker.train.float8 (its RECIPE, tensorwise: one scale per tensor, e5m2 output
                       gradients); on a GPU each decoder layer compiled in place, as the trainer runs them
                       (eager float8 ran 4-5x slower than bf16-sr and a run of both learning rates did not fit
                       in 10 minutes; every fresh model reuses the one compiled graph)
    fp8-8bit           precision "fp8-8bit": the same with bf16-sr-8bit's optimizer (8-bit AdamW moments)
    fp8-rowwise        fp8 with the rowwise recipe (a scale per row of each operand, e4m3 both ways)
    fp8-e5m2-forward   worse variant: rowwise, with the inputs and weights in e5m2 (2 mantissa bits) instead of e4m3
    fp8-stale-scale    worse variant: the decoder's linears cast their input, weight and output gradient to e4m3
                       with one scale per tensor computed once, on the model before its pre-training, and never
                       updated (as tests/worker/test_float8_quality.py's (c); an emulation, bf16 matmuls)
    fp8-unscaled       worse variant: the same casts with every scale 1 (no scaling: output gradients, mostly far
                       below e4m3's smallest subnormal, 2^-9, flush to zero; an emulation, bf16 matmuls)

Each run is scored by the task-B eval loss of its trained weights evaluated in bf16 (what the checkpoint holds
and serves; the float8 forward's own eval loss is reported beside it): on task B the pre-trained model is
confidently wrong, and a forward that blurs its logits scores better without having learnt more.

The criterion (issue 35), per learning rate: margin = max(1% of bf16-sr's mean, the spread of bf16-sr's seeds);
fp8's mean (and fp8-8bit's and fp8-rowwise's, when run) within the margin of bf16-sr's; fine-tuning moved bf16-sr by more
than twice the margin; and at least one worse variant that ran measurably worse: its best seed above the worst
of bf16-sr and of fp8 by more than the margin (each worse variant's check is reported). Exit 1 when any of
these, or the plateau, fails.

Results go to the section "precision-fp8" of `benchmarks/results/<gpu-slug>-quality.json`. One learning rate
per command keeps each within about 8 minutes at the 1B shape on an H100:

    python3 -m benchmarks.quality.float8 --lrs 1e-5 --section precision-fp8-lr1e-5
    python3 -m benchmarks.quality.float8 --lrs 1e-4 --section precision-fp8-lr1e-4
    python3 -m benchmarks.quality.float8 --tiny            # CPU smoke run (float8 emulated), a few minutes
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import statistics
import sys
import time
from typing import Any

from benchmarks import harness
from benchmarks.quality import precision as protocol
from benchmarks.workloads import MODEL_SHAPES

RESULTS = harness.Benchmark("precision-fp8", topic="quality")
IMPLS = ("bf16-sr", "fp8", "fp8-8bit", "fp8-rowwise", "fp8-e5m2-forward", "fp8-stale-scale", "fp8-unscaled")
MATCHING = ("fp8", "fp8-8bit", "fp8-rowwise")
# impl -> the precision mode whose optimizer it trains with (bf16-sr's otherwise)
OPTIMIZER_PRECISION = {"fp8-8bit": "fp8-8bit"}
WORSE = ("fp8-e5m2-forward", "fp8-stale-scale", "fp8-unscaled")
REFERENCE = "bf16-sr"


# ------------------------------------------------------------------------------------------- the variants


def e5m2_forward_config() -> Any:
    """The rowwise config with the inputs and weights cast to e5m2 in every matmul they enter, emulated (the
    matmul in bf16 on the dequantized operands) everywhere: torch._scaled_mm refuses two e5m2 operands."""
    import torch
    from torchao.float8.config import CastConfig, ScalingGranularity

    from fusetune.worker.train.float8 import float8_config

    e5m2 = CastConfig(scaling_granularity=ScalingGranularity.AXISWISE, target_dtype=torch.float8_e5m2)
    return dataclasses.replace(
        float8_config("rowwise", emulate=True),
        cast_config_input=e5m2,
        cast_config_weight=e5m2,
        cast_config_input_for_grad_weight=e5m2,
        cast_config_weight_for_grad_input=e5m2,
    )


def stale_scale_linears(model: Any, scales: dict[str, dict]) -> None:
    """Swap the linears float8 would convert for a module that casts with fixed per-tensor e4m3 scales (taken
    from `scales[name]`; missing ones are computed from the first tensors seen, then kept)."""
    import torch
    from torch import nn

    from fusetune.worker.train.float8 import why_not_converted

    def cast(values, scale):
        largest = torch.finfo(torch.float8_e4m3fn).max
        return (values.float() * scale).clamp(-largest, largest).to(torch.float8_e4m3fn).float().div(scale)

    def scale_of(values):
        return torch.finfo(torch.float8_e4m3fn).max / values.detach().abs().amax().float().clamp_min(1e-30)

    class StaleScaleMatmul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, fixed):
            fixed.setdefault("input", scale_of(x))
            fixed.setdefault("weight", scale_of(weight))
            x8 = cast(x, fixed["input"]).to(x.dtype)
            weight8 = cast(weight, fixed["weight"]).to(weight.dtype)
            ctx.save_for_backward(x8, weight8)
            ctx.fixed = fixed
            return x8 @ weight8.t()

        @staticmethod
        def backward(ctx, grad_output):
            x8, weight8 = ctx.saved_tensors
            scale = ctx.fixed.setdefault("grad_output", scale_of(grad_output))
            grad8 = cast(grad_output, scale).to(grad_output.dtype)
            flat = grad8.reshape(-1, grad8.shape[-1])
            return grad8 @ weight8, flat.t() @ x8.reshape(-1, x8.shape[-1]), None

    class StaleScaleLinear(nn.Linear):
        def forward(self, x):
            out = StaleScaleMatmul.apply(x, self.weight, self.fixed)
            return out + self.bias if self.bias is not None else out

    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and why_not_converted(model, module, name) is None:
            stale = StaleScaleLinear(module.in_features, module.out_features, bias=False, device="meta")
            stale.weight, stale.bias, stale.fixed = module.weight, module.bias, scales.setdefault(name, {})
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, stale)


def initial_scales(args, device, kernels, task) -> dict[str, dict]:
    """The stale variant's scales: one forward and backward of a task-A batch through the model as built (random
    init, seed 0, as pre-training starts from), in bf16."""
    import torch

    model = protocol.build_model(args.model, args.tiny, device, kernels).to(torch.bfloat16)
    scales: dict[str, dict] = {}
    stale_scale_linears(model, scales)
    batch = task.sample(args.batch, args.seq, seed=5)
    model(input_ids=batch, labels=batch, use_cache=False).loss.backward()
    del model
    gc.collect()
    return scales


def build_run_model(impl: str, args, device, kernels, pretrained, scales) -> Any:
    """A fresh model with the pretrained weights in bf16, its linears as `impl` computes them."""
    import torch

    from fusetune.worker.train.float8 import RECIPE, convert_linears, float8_config

    model = protocol.build_model(args.model, args.tiny, device, kernels).to(torch.bfloat16)
    model.load_state_dict(pretrained)
    on_gpu = device.type == "cuda"
    if impl in ("fp8", "fp8-8bit"):
        convert_linears(model, float8_config(RECIPE, emulate=not on_gpu), RECIPE, compile_layers=on_gpu)
    elif impl == "fp8-rowwise":
        convert_linears(model, float8_config("rowwise", emulate=not on_gpu), "rowwise", compile_layers=on_gpu)
    elif impl == "fp8-e5m2-forward":
        convert_linears(model, e5m2_forward_config(), "rowwise-e5m2-forward", compile_layers=on_gpu)
    elif impl == "fp8-stale-scale":
        stale_scale_linears(model, {name: dict(values) for name, values in scales.items()})
    elif impl == "fp8-unscaled":
        one = torch.ones((), device=device)
        stale_scale_linears(
            model, {name: dict.fromkeys(("input", "weight", "grad_output"), one) for name in scales}
        )
    return model


# -------------------------------------------------------------------------------------------------- runs


def finetune(impl, lr, seed, pretrained, scales, plain, pool, eval_sets, args, device, kernels):
    """Fine-tune in `impl`; the task-B eval loss of the weights in bf16 (`plain` holds them) and in `impl`."""
    policy = protocol.policy(OPTIMIZER_PRECISION.get(impl, REFERENCE), device)
    model = build_run_model(impl, args, device, kernels, pretrained, scales)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = protocol.trainer_optimizer(policy, params, lr, seed, args, device)
    losses, seconds = protocol.timed_finetune_steps(model, optimizer, policy, pool, seed, args, device)
    own = protocol.eval_loss(model, eval_sets["b"], policy.autocast, args.batch)
    plain.load_state_dict(model.state_dict())
    result = {
        "impl": impl,
        "lr": lr,
        "seed": seed,
        "eval_loss": protocol.eval_loss(plain, eval_sets["b"], policy.autocast, args.batch),
        "eval_loss_own_forward": own,
        "first_train_loss": float(losses[0]),
        "last_train_loss": float(losses[-1]),
        "step_ms": round(seconds / args.finetune_steps * 1e3, 1),
    }
    if not all(math.isfinite(value) for value in losses.tolist()):
        result["error"] = "non-finite training loss"
    del model, optimizer
    gc.collect()
    return result


def verdict(losses: dict[str, list[float]], start: float) -> dict[str, Any]:
    """The criterion for one learning rate (module docstring); a non-finite loss counts as infinite."""
    losses = {impl: [v if math.isfinite(v) else math.inf for v in values] for impl, values in losses.items()}
    reference = losses[REFERENCE]
    mean = statistics.fmean(reference)
    margin = max(0.01 * mean, max(reference) - min(reference))
    checks: dict[str, bool] = {"finetuning_moved": start - mean > 2 * margin}
    measures: dict[str, float] = {}
    for impl in (*MATCHING, *WORSE):
        if impl in losses:
            measures[f"{impl}_relative_to_bf16_sr"] = round(statistics.fmean(losses[impl]) / mean - 1, 5)
    for impl in MATCHING:
        if impl in losses:
            checks[f"{impl}_matches_bf16_sr"] = abs(statistics.fmean(losses[impl]) - mean) <= margin
    worse = {}
    for impl in WORSE:
        if impl in losses:
            best_good = max([*reference, *losses.get("fp8", [])])
            worse[f"{impl}_worse_than_bf16_sr_and_fp8"] = min(losses[impl]) > best_good + margin
    if worse:
        checks["a_worse_variant_fails"] = any(worse.values())
    rule = "max(0.01 * mean(bf16-sr), max - min of bf16-sr's seeds)"
    return protocol.verdict_record(start, margin, rule, {**measures, **worse}, checks)


def summary_rows(runs: list[dict[str, Any]], args) -> list[dict[str, Any]]:
    return [
        {
            "model": args.model,
            "impl": impl,
            "lr": lr,
            **protocol.eval_loss_summary(mine),
            "own_forward_mean": round(
                statistics.fmean(r.get("eval_loss_own_forward", math.nan) for r in mine), 5
            ),
            **protocol.step_summary(mine),
        }
        for lr, impl, mine in protocol.runs_by_lr_and_impl(runs, args)
    ]


def render_markdown(payload: dict[str, Any]) -> str:
    setup, pre = payload["setup"], payload["pretrain"]
    lines = [
        *protocol.markdown_head("fp8 quality", payload),
        f"Model {setup['model']} ({setup['params']:,} parameters), protocol of benchmarks/quality/float8.py; "
        f"`{payload['command']}`. Pre-training: {pre['steps']} steps to task-A eval {pre['eval_loss']} "
        f"({100 * pre['gap_to_floor']:.2f}% above the floor; plateau "
        f"{'reached' if pre['plateau_reached'] else 'NOT reached'}). Fine-tuning: {setup['finetune_steps']} "
        f"steps; task-B eval loss of the trained weights in bf16 (own forward: the float8 model's).",
        "",
        protocol.rows_table(
            payload["rows"], "task-B eval per seed", ("own forward (mean)", "own_forward_mean")
        ),
        "",
    ]
    for lr, check in payload["verdicts"].items():
        failed = [name for name, value in check.items() if value is False and name != "passed"]
        relative = ", ".join(
            f"{key.removesuffix('_relative_to_bf16_sr')} {100 * value:+.3f}%"
            for key, value in check.items()
            if key.endswith("_relative_to_bf16_sr")
        )
        verdict_text = "pass" if check["passed"] else "FAIL: " + ", ".join(failed)
        lines.append(f"- lr {lr}: margin {check['margin']:.4f}; against bf16-sr: {relative}; {verdict_text}")
    return "\n".join([*lines, *protocol.markdown_verdict(payload)])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="a few-thousand-parameter model: CPU smoke run")
    parser.add_argument(
        "--impls", default=",".join(IMPLS), help=f"of {', '.join(IMPLS)}; bf16-sr always runs"
    )
    parser.add_argument("--model", choices=sorted(MODEL_SHAPES), default=None)
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--lrs", default="1e-5,1e-4")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--finetune-steps", type=int, default=None)
    parser.add_argument("--pretrain-max-steps", type=int, default=None)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    harness.add_results_arguments(parser, RESULTS)
    args = protocol.complete_args(parser, parser.parse_args(argv), IMPLS, REFERENCE)
    args.plateau_threshold, args.plateau_max_gap = 0.01, 0.1  # precision.py's defaults
    return args


REPORT = protocol.Report(RESULTS, summary_rows, render_markdown, frozenset(WORSE))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    device = protocol.choose_device(args)
    kernels = device.type == "cuda"
    command = f"python3 -m {__spec__.name} " + " ".join(sys.argv[1:] if argv is None else argv)
    started = time.perf_counter()

    model = protocol.build_model(args.model, args.tiny, device, kernels)
    tasks = protocol.build_tasks(model, args, device)
    eval_sets = tasks.eval_sets
    params = sum(p.numel() for p in model.parameters())
    scales = (
        initial_scales(args, device, kernels, tasks.a)
        if {"fp8-stale-scale", "fp8-unscaled"} & set(args.impls)
        else {}
    )

    pre = protocol.pretrain(model, tasks.a, eval_sets["a"], tasks.floor_a, args, device)
    print(
        f"pretrain: {pre['steps']} steps, eval {pre['eval_loss']}, plateau {pre['plateau_reached']}",
        flush=True,
    )
    pretrained = {name: value.detach().clone() for name, value in model.state_dict().items()}
    plain = model.to(torch.bfloat16)  # the bf16 model every run's weights are evaluated in
    start_b = protocol.eval_loss(
        plain, eval_sets["b"], protocol.policy("bf16-sr", device).autocast, args.batch
    )

    slug, meta = protocol.results_meta(args, device, command)
    payload: dict[str, Any] = {
        **meta,
        "setup": {
            **protocol.model_setup(args, params, kernels),
            "finetune_steps": args.finetune_steps,
            "lrs": args.lrs,
            "seeds": args.seeds,
            "pretrained_eval_loss_b": round(start_b, 5),
        },  # fmt: skip
        "pretrain": pre,
        "verdicts": {},
    }

    def finetune_one(impl: str, lr: float, seed: int) -> dict[str, Any]:
        return finetune(
            impl, lr, seed, pretrained, scales, plain, tasks.pool, eval_sets, args, device, kernels
        )

    def progress(run: dict[str, Any]) -> str:
        return (
            f"  lr {run['lr']:g} {run['impl']:18s} seed {run['seed']}: task-B eval {run['eval_loss']:.4f} "
            f"(own forward {run['eval_loss_own_forward']:.4f}), {run['step_ms']} ms/step"
        )

    runs = protocol.finetune_all(
        REPORT, args, slug, payload, finetune_one, progress, lambda losses: verdict(losses, start_b)
    )
    return protocol.conclude(REPORT, args, slug, payload, runs, started, device)


if __name__ == "__main__":
    sys.exit(main())
