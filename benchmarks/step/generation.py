"""Sampling as the reinforcement method does it: one `generate` over a step's prompts, `--n` completions each,
on the same model patched or not, with each KV cache and with or without Hugging Face's compiled decoding step,
each setup in a fresh process of the same run. It splits the GRPO step's generation time (benchmarks/step/grpo.py)
by what the sampling path is made of.

    hf:dynamic               unpatched model, Hugging Face's default (dynamic) KV cache, eager
    liger:dynamic            Liger-Kernel's patch (what TRL's GRPOTrainer with use_liger_kernel samples with)
    fusetune:dynamic         fusetune's kernels (apply_fusetune), dynamic cache, eager
    fusetune:static          fusetune's kernels, static cache, eager
    fusetune:static-compiled fusetune's kernels, static cache, the decoding step compiled (the method's default)
    fusetune-sdpa:static-compiled  the same with the decoding kernel off: scaled_dot_product_attention over the
                             grouped query rows (fusetune.models.attention.DECODE_KERNEL = False)
    hf:static-compiled       unpatched, static cache, compiled

Every setup: random weights (seed 0), --prompts prompts of --prompt-tokens random tokens, --completion-tokens new
tokens each (no end-of-sequence token, so every row runs to the limit), temperature 1 over the whole vocabulary.
One untimed `generate` first (compilation happens there), then one timed; then one timed `generate` with prompts
two tokens longer (`new_length_s`: what a step whose prompts pad to another width pays, recompilation
included). --profile adds one profiled `generate` of 32 new tokens: GPU busy time against wall time and the
largest kernels.

    python3 -m benchmarks.step.generation                       # Llama-3.2-1B shape, 64 x 8 x 256
    python3 -m benchmarks.step.generation --tiny --prompts 2 --n 2 --completion-tokens 4   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from benchmarks import harness
from benchmarks.harness import GIB, markdown_table
from benchmarks.step.grpo import identity  # a sampling row is named as the GRPO step's rows are
from benchmarks.workloads import MODEL_SHAPES, build_config

RESULTS = harness.Benchmark("generation", topic="step")
VARIANTS = (
    "hf:dynamic", "liger:dynamic", "fusetune:dynamic", "fusetune:static", "fusetune:static-compiled",
    "fusetune-sdpa:static-compiled", "hf:static-compiled",
)  # fmt: skip
PROFILE_TOKENS = 32


def _patch(kernels: str, model: Any) -> dict[str, int] | None:
    if kernels in ("fusetune", "fusetune-sdpa"):
        from fusetune.models import apply_fusetune, attention

        attention.DECODE_KERNEL = kernels == "fusetune"
        return dict(apply_fusetune(model).patched)
    if kernels == "liger":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
        return {"liger": 1}
    return None


def run_row(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    kernels, cache = spec["variant"].split(":")
    device = torch.device(spec["device"])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(build_config(spec["model"], tiny=spec["tiny"]), dtype=dtype)
    patched = _patch(kernels, model)
    model.eval()
    vocab = model.config.vocab_size

    def prompts(length: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(length)
        ids = torch.randint(3, vocab, (spec["prompts"], length), generator=generator, device="cpu")
        return {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)}

    def generate(batch: dict[str, torch.Tensor], new_tokens: int) -> float:
        options: dict[str, Any] = dict(
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, num_return_sequences=spec["n"],
            do_sample=True, temperature=1.0, top_k=0, top_p=1.0, use_cache=True, pad_token_id=0,
        )  # fmt: skip
        if cache != "dynamic":
            options.update(cache_implementation="static", disable_compile=cache != "static-compiled")
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            output = model.generate(**batch, generation_config=GenerationConfig(**options))
        if device.type == "cuda":
            torch.cuda.synchronize()
        assert output.shape[1] == batch["input_ids"].shape[1] + new_tokens, output.shape
        return time.perf_counter() - start

    length, new_tokens = spec["prompt_tokens"], spec["completion_tokens"]
    first_s = generate(prompts(length), new_tokens)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    timed_s = generate(prompts(length), new_tokens)
    new_length_s = generate(prompts(length + 2), new_tokens)
    rows = spec["prompts"] * spec["n"]
    row: dict[str, Any] = {
        "impl": spec["variant"], "model": spec["model"], "prompts": spec["prompts"], "n": spec["n"],
        "prompt_tokens": length, "completion_tokens": new_tokens, "patched": patched,
        "first_s": round(first_s, 3), "generation_s": round(timed_s, 3),
        "ms_per_token_step": round(1e3 * timed_s / new_tokens, 2),
        "generated_tokens_per_s": round(rows * new_tokens / timed_s),
        "new_length_s": round(new_length_s, 3),
        "peak_alloc_gb": round(torch.cuda.max_memory_allocated() / GIB, 2) if device.type == "cuda" else None,
    }  # fmt: skip
    if spec["profile"] and device.type == "cuda":
        row["profile"] = _profile(lambda: generate(prompts(length), PROFILE_TOKENS))
    return row


def _profile(call) -> dict[str, Any]:
    """GPU busy time (the sum of kernel durations) against the wall time of one call, and its largest kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        wall_s = call()
    totals: dict[str, list] = {}
    for event in profiler.events():
        if getattr(event.device_type, "name", "") != "CUDA":
            continue
        entry = totals.setdefault(event.name[:80], [0.0, 0])
        entry[0] += (getattr(event, "device_time_total", None) or 0.0) / 1e3
        entry[1] += 1
    torch.cuda.synchronize()
    busy_ms = sum(ms for ms, _ in totals.values())
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:8]
    return {
        "new_tokens": PROFILE_TOKENS,
        "wall_ms": round(1e3 * wall_s, 1),
        "gpu_busy_ms": round(busy_ms, 1),
        "kernel_launches": sum(calls for _, calls in totals.values()),
        "top_kernels": [[name, round(ms, 2), calls] for name, (ms, calls) in ranked],
    }


def render_markdown(payload: dict[str, Any]) -> str:
    rows = payload.get("rows", [])
    lines = [f"### Sampling ({payload.get('gpu', '?')}, {payload.get('date', '?')})", ""]
    table = [
        [r["model"], f"{r['prompts']} x {r['n']} x {r['completion_tokens']}", r["impl"], r.get("generation_s"),
         r.get("ms_per_token_step"), r.get("generated_tokens_per_s"), r.get("first_s"), r.get("new_length_s"),
         (r.get("profile") or {}).get("gpu_busy_ms"), (r.get("profile") or {}).get("wall_ms"),
         r.get("peak_alloc_gb"), r.get("error") or ""]
        for r in rows
    ]  # fmt: skip
    lines.append(markdown_table(
        ["model", "prompts x n x tokens", "setup", "generate s", "ms per token step", "generated tokens/s",
         "first call s", "new prompt width s", f"GPU busy ms ({PROFILE_TOKENS} tokens)", "wall ms",
         "peak alloc GB", "error"], table))  # fmt: skip
    for r in rows:
        profile = r.get("profile")
        if profile:
            lines += [
                "",
                f"{r['impl']}: {profile['kernel_launches']} kernel launches for {PROFILE_TOKENS} tokens",
            ]
            lines.append(markdown_table(["kernel", "ms", "calls"], profile["top_kernels"]))
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    harness.add_results_arguments(parser, RESULTS, merge="the rows of an earlier run")
    parser.add_argument("--model", default="llama-3.2-1b-shape", help=f"one of {', '.join(MODEL_SHAPES)}")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8, help="completions per prompt")
    parser.add_argument("--prompt-tokens", type=int, default=24)
    parser.add_argument("--completion-tokens", type=int, default=256)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--timeout-s", type=float, default=150, help="per row")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (a smoke run)")
    parser.add_argument("--_worker", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args._worker:
        return harness.run_as_worker(run_row, args._worker, lambda spec, _error: identity(spec))
    variants = harness.choices(parser, "--variants", args.variants, VARIANTS)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.tiny:
        print(f"{__spec__.name} measures sampling on a GPU; no CUDA device here (--tiny runs on CPU)",
              file=sys.stderr)  # fmt: skip
        return 2
    device_name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    specs = [
        {"variant": variant, "model": args.model, "prompts": args.prompts, "n": args.n,
         "prompt_tokens": args.prompt_tokens, "completion_tokens": args.completion_tokens,
         "profile": args.profile, "device": device, "tiny": args.tiny}
        for variant in variants
    ]  # fmt: skip
    harness.run_rows_in_workers(
        __spec__.name, specs, identity, args=args, benchmark=RESULTS, device_name=device_name,
        slug=harness.results_slug(args, device_name, on_gpu=device == "cuda"), render=render_markdown,
        timeout_s=args.timeout_s,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
