"""skip_small_gradients against the exact fused linear cross-entropy, on peaked logits like a trained model's.

Near-uniform logits (random weights at the usual init) make every probability tiny, so skipping would look
free there and measure nothing; here the weights are scaled until the mean per-token entropy is about
2 nats, and labels are drawn from the model's own softmax (so the loss is near the entropy, as after
training). Times and peak extra memory as in benchmarks/kernels/ops.py (do_bench median of fwd+bwd through
torch.autograd.grad; peak includes the returned gradients); exact and skipping in the same run.

    python3 -m benchmarks.kernels.loss_skip [--out DIR] [--budget-s S]

Results go to the section "loss-skip" of `benchmarks/results/<gpu-slug>-kernels.json`. Besides the timings
they hold, per shape, the mean entropy reached and the entries a token keeps, a kernel
profile of one skipping fwd+bwd at the main shape, and the error of exact and skipping against a float64
reference at a smaller shape (max |error| / max |reference| per tensor, and the largest ratio of error to
the bfloat16 tolerance of tests/kernels: 4e-3 * max |reference| + 2e-2 * |reference|).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from benchmarks import harness
from benchmarks.harness import markdown_table
from benchmarks.kernels.loss_launch_settings import MAIN, SWEEP, measure
from fusetune.kernels import fused_linear_cross_entropy as flce_module
from fusetune.kernels.fused_linear_cross_entropy import (
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_reference,
)

RESULTS = harness.Benchmark("loss-skip", topic="kernels")
# (T, H, V, softcap); the first is the main shape.
SHAPES = (
    (8192, 4096, 128256, None),
    (8192, 2048, 128256, None),
    (16384, 2048, 151936, None),
    (8192, 4096, 256000, 30.0),
)
VARIANTS = {"exact": {}, "skip-2^-12": {"skip_small_gradients": True, "skip_threshold": 2.0**-12},
            "skip-2^-14": {"skip_small_gradients": True, "skip_threshold": 2.0**-14}}  # fmt: skip
TARGET_ENTROPY = 2.0
# Module settings of fused_linear_cross_entropy tried at the main shape, each combination beside the
# defaults: the dW kernel and its launch (DW_GATHER: "rows" is the per-row gather kernel with GATHER_LAUNCH,
# "dot" the tensor-core kernel over groups of rows), the per-row gather's launch (GATHER_LAUNCH: dh's, and
# dW's with "rows") and the collecting kernel's (COLLECT_LAUNCH).
SETTING_VARIANTS = (
    {"DW_GATHER": ("dot", 16, 16, 128, 4), "GATHER_LAUNCH": (8, 512, 2)},
    {"DW_GATHER": ("dot", 32, 32, 128, 4), "GATHER_LAUNCH": (16, 512, 4)},
    {"GATHER_LAUNCH": (4, 256, 1)},
    {"GATHER_LAUNCH": (8, 512, 2)},
    {"GATHER_LAUNCH": (4, 512, 2)},
    {"COLLECT_LAUNCH": (2048, 4)},
    {"COLLECT_LAUNCH": (4096, 8)},
    {"COLLECT_LAUNCH": (512, 1)},
)


def entropy_of(hidden: torch.Tensor, weight: torch.Tensor, softcap: float | None) -> torch.Tensor:
    logits = (hidden @ weight.t()).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    log_probs = torch.log_softmax(logits, dim=-1)
    return -(log_probs.exp() * log_probs).sum(-1)


def peaked_problem(tokens: int, hidden_size: int, vocab: int, softcap: float | None, seed: int = 0):
    """bf16 hidden [T, H] ~ N(0, 1), weight [V, H] scaled to a mean entropy of TARGET_ENTROPY (bisection on
    256 tokens), labels sampled from the softmax; returns them with the mean entropy over 1024 tokens."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, device="cuda", generator=generator).to(torch.bfloat16)
    base = torch.randn(vocab, hidden_size, device="cuda", generator=generator) / hidden_size**0.5
    # Up to 16: beyond, a softcap saturates many logits at once and the entropy rises again.
    low, high = 0.1, 16.0
    for _ in range(30):
        scale = (low + high) / 2
        mean = entropy_of(hidden[:256], (base * scale).to(torch.bfloat16), softcap).mean().item()
        low, high = (scale, high) if mean > TARGET_ENTROPY else (low, scale)
    weight = (base * scale).to(torch.bfloat16)
    del base
    labels = torch.empty(tokens, dtype=torch.int64, device="cuda")
    for start in range(0, tokens, 1024):
        logits = (hidden[start : start + 1024] @ weight.t()).float()
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        labels[start : start + 1024] = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)[
            :, 0
        ]
        del logits
    entropy = entropy_of(hidden[:1024], weight, softcap).mean().item()
    return hidden, weight, labels, entropy, scale


def kept_per_token(hidden, weight, labels, softcap, options) -> float:
    kept = []
    original = flce_module._live_gradient_entries

    def recording(*args):
        row_starts, cols, values = original(*args)
        grad = args[0]
        kept.append((cols.numel(), grad.shape[0]))
        return row_starts, cols, values

    flce_module._live_gradient_entries = recording
    try:
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        torch.autograd.grad([fused_linear_cross_entropy(h, w, labels, softcap=softcap, **options)], [h, w])
    finally:
        flce_module._live_gradient_entries = original
    return sum(k for k, _ in kept) / max(1, sum(r for _, r in kept))


def gather_calls(fn) -> list[tuple[str, float]]:
    """(kernel, ms) of every call of the skipping path's own kernels in one fwd+bwd, in launch order."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    calls = []
    for event in prof.events():
        if getattr(event.device_type, "name", "") == "CUDA" and event.name.startswith(
            ("_gather", "_collect", "_cross_entropy")
        ):
            micros = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)
            calls.append((event.name, round(micros / 1e3, 3)))
    return calls


def errors_against_float64(tokens: int, hidden_size: int, vocab: int) -> list[dict]:
    hidden, weight, labels, entropy, _ = peaked_problem(tokens, hidden_size, vocab, None, seed=1)
    ref_h, ref_w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref_loss = fused_linear_cross_entropy_reference(ref_h, ref_w, labels)
    ref_loss.backward()
    rows = []
    for name, options in VARIANTS.items():
        h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
        loss = fused_linear_cross_entropy(h, w, labels, **options)
        loss.backward()
        row = {"op": "flce-error", "shape": [tokens, hidden_size, vocab], "variant": name,
               "entropy": round(entropy, 3), "loss_abs_error": abs(loss.item() - ref_loss.item())}  # fmt: skip
        for label, got, ref in (("grad_hidden", h.grad, ref_h.grad), ("grad_weight", w.grad, ref_w.grad)):
            err = (got.double() - ref).abs()
            ref_max = ref.abs().max()
            row[label + "_max_rel"] = float(err.max() / ref_max)
            row[label + "_tol_ratio"] = float((err / (4e-3 * ref_max + 2e-2 * ref.abs())).max())
        rows.append(row)
    return rows


def bench_shape(shape, reps, emit, profile: bool) -> None:
    tokens, hidden_size, vocab, softcap = shape
    hidden, weight, labels, entropy, scale = peaked_problem(tokens, hidden_size, vocab, softcap)
    emit({"op": "peaked", "shape": shape, "entropy": round(entropy, 3), "weight_scale": round(scale, 3)})
    hidden.requires_grad_()
    weight.requires_grad_()

    def fwd_bwd(options):
        loss = fused_linear_cross_entropy(hidden, weight, labels, softcap=softcap, **options)
        return torch.autograd.grad([loss], [hidden, weight])

    exact_ms = None
    for name, options in VARIANTS.items():
        ms, peak = measure(lambda options=options: fused_linear_cross_entropy(
            hidden, weight, labels, softcap=softcap, **options), [hidden, weight], reps)  # fmt: skip
        exact_ms = ms if exact_ms is None else exact_ms
        row = {
            "op": "flce",
            "shape": shape,
            "variant": name,
            "ms": round(ms, 3),
            "peak_extra_mb": round(peak, 1),
        }
        if options:
            row["kept_per_token"] = round(kept_per_token(hidden, weight, labels, softcap, options), 1)
            row["speedup_vs_exact"] = round(exact_ms / ms, 3)
        emit(row)
    if profile:
        for settings in SETTING_VARIANTS:
            defaults = {name: getattr(flce_module, name) for name in settings}
            for name, value in settings.items():
                setattr(flce_module, name, value)
            try:
                ms, _ = measure(lambda: fused_linear_cross_entropy(
                    hidden, weight, labels, softcap=softcap, **VARIANTS["skip-2^-12"]), [hidden, weight], reps)  # fmt: skip
            finally:
                for name, value in defaults.items():
                    setattr(flce_module, name, value)
            emit(
                {
                    "op": "flce",
                    "shape": shape,
                    "variant": "skip-2^-12",
                    "settings": settings,
                    "ms": round(ms, 3),
                }
            )
        for name in ("skip-2^-12", "exact"):
            kernels = harness.profile_kernels(lambda name=name: fwd_bwd(VARIANTS[name]), top=12)
            emit({"op": "flce-profile", "shape": shape, "variant": name, "kernels": kernels})
        calls = gather_calls(lambda: fwd_bwd(VARIANTS["skip-2^-12"]))
        emit({"op": "flce-skip-calls", "shape": shape, "calls": calls})


def render_markdown(payload: dict[str, Any]) -> str:
    rows = payload["rows"]
    entropy = {json.dumps(r["shape"]): r["entropy"] for r in rows if r["op"] == "peaked"}
    timed = [r for r in rows if r["op"] == "flce" and "settings" not in r]
    settings = [r for r in rows if r["op"] == "flce" and "settings" in r]
    errors = [r for r in rows if r["op"] == "flce-error"]
    lines = [
        f"# skip_small_gradients against the exact fused linear cross-entropy: {payload['gpu']}, {payload['date']}",
        "",
        f"Versions: {payload['versions']}.",
        "",
        "Peaked logits: weights scaled to a mean entropy of about 2 nats, labels drawn from the softmax. fwd+bwd "
        "ms (do_bench median) and peak extra MB of one fwd+bwd; `kept` is the gradient entries a token keeps.",
        "",
        markdown_table(
            ["T, H, V, softcap", "entropy", "variant", "ms", "peak extra MB", "kept per token", "÷ exact"],
            [
                [
                    ", ".join(map(str, r["shape"])),
                    entropy.get(json.dumps(r["shape"])),
                    r.get("variant"),
                    r.get("ms"),
                    r.get("peak_extra_mb"),
                    r.get("kept_per_token"),
                    r.get("speedup_vs_exact") or r.get("error"),
                ]
                for r in timed
            ],
        ),  # fmt: skip
        "",
    ]
    if settings:
        lines += ["## Launch settings of skip-2^-12 at the main shape", ""]
        lines += [
            markdown_table(["settings", "ms"], [[json.dumps(r["settings"]), r["ms"]] for r in settings]),
            "",
        ]
    if errors:
        lines += [
            "## Errors against float64 (max |error| / max |reference|; ratio to the bf16 test tolerance)",
            "",
        ]
        lines.append(markdown_table(
            ["T, H, V", "variant", "loss |error|", "dh max rel", "dh ÷ tolerance", "dW max rel", "dW ÷ tolerance"],
            [[", ".join(map(str, r["shape"])), r["variant"], r["loss_abs_error"], r["grad_hidden_max_rel"],
              r["grad_hidden_tol_ratio"], r["grad_weight_max_rel"], r["grad_weight_tol_ratio"]] for r in errors],
        ))  # fmt: skip
        lines.append("")
    for r in rows:
        if r["op"] == "flce-profile":
            lines += [
                f"## Kernels of one fwd+bwd, {r['variant']}, T, H, V = {', '.join(map(str, r['shape'][:3]))}",
                "",
            ]
            lines += [markdown_table(["kernel", "ms", "launches"], r["kernels"]), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_results_arguments(parser, RESULTS)
    parser.add_argument("--budget-s", type=float, default=200.0)
    args = parser.parse_args(argv)
    deadline = time.time() + args.budget_s
    rows: list[dict] = []

    def emit(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)

    for index, shape in enumerate(SHAPES):
        if time.time() > deadline:
            emit({"op": "flce", "shape": shape, "error": "time budget used up"})
            continue
        harness.free_device_memory()
        bench_shape(shape, MAIN if index == 0 else SWEEP, emit, profile=index == 0)
    harness.free_device_memory()
    for row in errors_against_float64(1024, 2048, 128256):
        emit(row)
    payload = {**harness.run_meta(torch.cuda.get_device_name()), "rows": rows}
    RESULTS.save(args, harness.results_slug(args, payload["gpu"]), payload, render_markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
