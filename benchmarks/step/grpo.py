"""A GRPO step: fusetune's reinforcement method against TRL's GRPOTrainer with Liger-Kernel, on the same model,
prompts, group size and completion length, each setup in a fresh process of the same run.

    trl-liger           TRL's GRPOTrainer, use_liger_kernel=True, no vLLM: Hugging Face `generate` with TRL's
                        default (dynamic) KV cache, TRL's chunked log-prob head
    fusetune            fusetune's Trainer with method reinforcement, as the worker runs it (kernels, bf16-sr,
                        the fused per-token log-probs, sampling over a static KV cache with Hugging Face
                        compiling the decoding step)
    fusetune:eager      the same with the decoding step left uncompiled
    fusetune:8bit       the same as fusetune with precision "bf16-sr-8bit": the AdamW moments in 8 bits
                        (about 2 bytes of state per parameter instead of 4; its quality: h100-quality.md,
                        section precision-8bit)
    fusetune:dynamic    the same with Hugging Face's dynamic KV cache, eager (not in the default --variants)

Both: --prompts arithmetic prompts a step, --n completions each, at most --completion-tokens tokens, temperature 1
over the whole vocabulary, no KL term (beta 0: no reference model), one optimizer step per batch of completions,
the token-level loss (TRL's default "dapo"), bf16 weights, --micro-completions completions per forward with
gradient accumulation to the step, and the same exact-match reward (fusetune: a string_check grader; TRL: the
same comparison as a reward function). With random weights the end-of-sequence token is rarely sampled, so
completions run to the limit on both sides; the mean completion length of each is reported. Per setup: median
time per step over --steps steps after --warmup-steps, split into generation, grading and training (the rest of
the step), peak allocated memory and tokens generated per second.

    python3 -m benchmarks.step.grpo                                     # Llama-3.2-1B shape, 64 x 8 x 512
    python3 -m benchmarks.step.grpo --tiny --prompts 4 --n 4 --completion-tokens 8   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.harness import GIB, markdown_table
from benchmarks.workloads import MODEL_SHAPES, build_config

RESULTS = harness.Benchmark("grpo", topic="step")
# What the TRL row needs beyond the GPU image (carried as wheels there, see the module's docstring).
TRL_MODULES = ("trl", "datasets", "dill", "multiprocess", "liger_kernel")
GRADER = {
    "type": "string_check", "name": "exact", "operation": "eq",
    "input": "{{ sample.output_text }}", "reference": "{{ item.answer }}",
}  # fmt: skip
LEARNING_RATE = 1e-6


def _build_model(spec: dict[str, Any], device, dtype):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(build_config(spec["model"], tiny=spec["tiny"]), dtype=dtype)


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def run_fusetune(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from fusetune.worker.train.config import TrainConfig
    from fusetune.worker.train.distributed import DistInfo
    from fusetune.worker.train.methods.reinforcement import GroupRelativePolicyOptimization
    from fusetune.worker.train.reporter import NullReporter
    from fusetune.worker.train.trainer import Trainer

    GroupRelativePolicyOptimization.compile_generation = spec["variant"] in ("fusetune", "fusetune:8bit")
    GroupRelativePolicyOptimization.static_cache = not spec["variant"].endswith(":dynamic")
    precision = {"precision": "bf16-sr-8bit"} if spec["variant"] == "fusetune:8bit" else {}
    cuda = spec["device"] == "cuda"

    class Recording(NullReporter):
        def __init__(self) -> None:
            self.metrics: list[dict[str, float]] = []

        def metric(self, step: int, values: dict[str, float], rank_memory: list | None = None) -> None:
            self.metrics.append(values)

    class BuiltOnTheDevice(Trainer):
        def _load_model(self, path: str, dtype: torch.dtype) -> torch.nn.Module:
            return _build_model(spec, self.device, dtype)

        def _save_checkpoint(self, metrics: dict[str, float]) -> None:  # steps are timed, nothing is kept
            self.last_checkpoint, self.last_checkpoint_step = Path(self.config.output_dir), self.step

    n_steps = spec["warmup_steps"] + spec["steps"]
    config = TrainConfig(
        model_path=spec["model_path"], training_file=spec["training_file"],
        output_dir=tempfile.mkdtemp(prefix="fusetune-grpo-"), n_epochs=1, batch_size=spec["prompts"],
        max_steps=n_steps, micro_batch_size=spec["micro_completions"] // spec["n"], max_seq_length=256,
        learning_rate=LEARNING_RATE, seed=0, checkpoint_every_steps=None, checkpoint_every_minutes=None, **precision,
        method={"type": "reinforcement", "reinforcement": {
            "grader": GRADER, "n": spec["n"], "max_completion_tokens": spec["completion_tokens"],
            "temperature": 1.0, "kl_beta": 0.0}},
    )  # fmt: skip
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    reporter = Recording()
    trainer = BuiltOnTheDevice(config, DistInfo(rank=0, local_rank=0, world_size=1, device=device), reporter)
    trainer.train()
    timed = reporter.metrics[spec["warmup_steps"] :] or reporter.metrics
    step = [m["step_time_s"] for m in timed]
    generation = [m["generation_s"] for m in timed]
    grading = [m["grading_s"] for m in timed]
    return {
        "impl": spec["variant"],
        "precision": trainer.precision.name,
        "kernels": trainer.kernels_applied,
        "step_s": _median(step),
        "generation_s": _median(generation),
        "grading_s": _median(grading),
        "training_s": _median([s - g - r for s, g, r in zip(step, generation, grading, strict=True)]),
        "generated_tokens_per_s": round(statistics.median(m["generated_tokens_per_second"] for m in timed)),
        "completion_length": round(statistics.mean(m["completion_length"] for m in timed), 1),
        "peak_alloc_gb": round(max(m["peak_memory_allocated_bytes"] for m in timed) / GIB, 2)
        if cuda
        else None,
        "peak_reserved_gb": round(max(m["peak_memory_reserved_bytes"] for m in timed) / GIB, 2)
        if cuda
        else None,
    }


def run_trl(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cuda = spec["device"] == "cuda"
    tokenizer = AutoTokenizer.from_pretrained(spec["model_path"])
    lines = [json.loads(line) for line in Path(spec["training_file"]).read_text().splitlines()]
    model = _build_model(spec, spec["device"], torch.bfloat16 if cuda else torch.float32)
    timings = {"generation": 0.0, "grading": 0.0}

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize()

    generate = model.generate

    def timed_generate(*args, **kwargs):
        synchronize()
        started = time.perf_counter()
        output = generate(*args, **kwargs)
        synchronize()
        timings["generation"] += time.perf_counter() - started
        return output

    model.generate = timed_generate

    def exact_match(completions, answer, **kwargs) -> list[float]:
        started = time.perf_counter()
        texts = [completion[0]["content"] for completion in completions]
        scores = [float(text.strip() == want) for text, want in zip(texts, answer, strict=True)]
        timings["grading"] += time.perf_counter() - started
        return scores

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.rows: list[dict[str, float]] = []
            self.started = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            synchronize()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            timings.update(generation=0.0, grading=0.0)
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            synchronize()
            self.rows.append({
                "step": time.perf_counter() - self.started, **timings,
                "peak": torch.cuda.max_memory_allocated() / GIB if cuda else 0.0,
                "reserved": torch.cuda.max_memory_reserved() / GIB if cuda else 0.0,
            })  # fmt: skip

    n_steps = spec["warmup_steps"] + spec["steps"]
    completions = spec["prompts"] * spec["n"]
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="fusetune-trl-grpo-"),
        per_device_train_batch_size=spec["micro_completions"],
        gradient_accumulation_steps=completions // spec["micro_completions"],
        num_generations=spec["n"], max_completion_length=spec["completion_tokens"], temperature=1.0,
        beta=0.0, loss_type="dapo", max_steps=n_steps, learning_rate=LEARNING_RATE, bf16=cuda,
        use_cpu=not cuda, use_liger_kernel=cuda,  # Liger's kernels need a GPU (a --tiny smoke run goes without)
        gradient_checkpointing=False, logging_steps=1, save_strategy="no", report_to=[],
        dataloader_num_workers=0, disable_tqdm=True, seed=0,
    )  # fmt: skip
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model, args=args, reward_funcs=[exact_match], processing_class=tokenizer, callbacks=[timer],
        train_dataset=Dataset.from_dict({
            "prompt": [line["messages"] for line in lines], "answer": [line["answer"] for line in lines]}),
    )  # fmt: skip
    trainer.train()
    lengths = [
        log["completions/mean_length"]
        for log in trainer.state.log_history
        if "completions/mean_length" in log
    ]
    for row, length in zip(timer.rows, lengths, strict=False):  # TRL logs each step's mean completion length
        row["generated_tokens"] = length * completions
    timed = timer.rows[spec["warmup_steps"] :] or timer.rows
    return {
        "impl": spec["variant"],
        "liger": cuda,
        "step_s": _median([r["step"] for r in timed]),
        "generation_s": _median([r["generation"] for r in timed]),
        "grading_s": _median([r["grading"] for r in timed]),
        "training_s": _median([r["step"] - r["generation"] - r["grading"] for r in timed]),
        "generated_tokens_per_s": round(
            statistics.median(r.get("generated_tokens", 0) / r["generation"] for r in timed)
        ),
        "completion_length": round(statistics.mean(lengths), 1) if lengths else None,
        "peak_alloc_gb": round(max(r["peak"] for r in timed), 2) if cuda else None,
        "peak_reserved_gb": round(max(r["reserved"] for r in timed), 2) if cuda else None,
    }


def run_row(spec: dict[str, Any]) -> dict[str, Any]:
    row = run_trl(spec) if spec["variant"].startswith("trl") else run_fusetune(spec)
    return {"model": spec["model"], "prompts": spec["prompts"], "n": spec["n"],
            "completion_tokens": spec["completion_tokens"], **row}  # fmt: skip


def write_prompts(path: Path, n_prompts: int, seed: int = 0) -> None:
    """Two-number sums and differences as chats, each answer the grader's reference (`{{ item.answer }}`)."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_prompts):
        a, b, op = rng.randrange(10, 100), rng.randrange(10, 100), rng.choice("+-")
        question = f"What is {a} {op} {b}?"
        answer = str(a + b if op == "+" else a - b)
        lines.append(
            json.dumps({"messages": [{"role": "user", "content": question}], "answer": answer}) + "\n"
        )
    path.write_text("".join(lines))


def prepare(args: argparse.Namespace, folder: Path) -> tuple[Path, Path]:
    """The model folder (config and the demo tokenizer; weights are built in each process) and the prompts, one
    step's worth for each step (both setups take them in order)."""
    from fusetune.demo.assets import build_tokenizer

    tokenizer = build_tokenizer()
    model_path = folder / args.model
    config = build_config(args.model, tiny=args.tiny)
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    config.save_pretrained(model_path)
    tokenizer.save_pretrained(model_path)
    prompts = folder / "prompts.jsonl"
    write_prompts(prompts, args.prompts * (args.warmup_steps + args.steps))
    return model_path, prompts


def missing_modules(variants: list[str]) -> list[str]:
    """The modules a TRL row needs that do not import here (checked before any row runs)."""
    if not any(variant.startswith("trl") for variant in variants):
        return []
    missing = []
    for module in TRL_MODULES:
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - any failure to import is a missing wheel
            missing.append(module)
    return missing


def render_markdown(payload: dict[str, Any]) -> str:
    lines = [
        f"# A GRPO step: fusetune against TRL + Liger-Kernel — {payload['gpu']}, {payload['date']}",
        "",
        f"`{payload['command']}`; versions: {payload['versions']}",
        "",
        "Random weights; per step the same prompts, completions per prompt and completion limit on both sides; "
        "medians of the timed steps. Training is the step less generation and grading.",
        "",
    ]
    rows = payload["rows"]
    anchor = next((r for r in rows if r["impl"].startswith("trl") and r.get("step_s")), None)
    table = []
    for r in rows:
        time_ratio = (
            round(r["step_s"] / anchor["step_s"], 2)
            if anchor and r.get("step_s") and r is not anchor
            else None
        )
        memory_ratio = (round(r["peak_alloc_gb"] / anchor["peak_alloc_gb"], 2)
                        if anchor and r.get("peak_alloc_gb") and anchor.get("peak_alloc_gb") and r is not anchor
                        else None)  # fmt: skip
        table.append([r["model"], f"{r['prompts']} x {r['n']} x {r['completion_tokens']}", r["impl"],
                      r.get("step_s"), r.get("generation_s"), r.get("grading_s"), r.get("training_s"),
                      r.get("generated_tokens_per_s"), r.get("completion_length"), r.get("peak_alloc_gb"),
                      time_ratio, memory_ratio, r.get("error") or ""])  # fmt: skip
    lines.append(markdown_table(
        ["model", "prompts x n x tokens", "setup", "step s", "generation s", "grading s", "training s",
         "generated tokens/s", "mean completion", "peak alloc GB", "time x TRL", "memory x TRL", "error"],
        table))  # fmt: skip
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    harness.add_results_arguments(parser, RESULTS, merge="the rows of an earlier run")
    parser.add_argument("--model", default="llama-3.2-1b-shape", help=f"one of {', '.join(MODEL_SHAPES)}")
    parser.add_argument("--variants", default="trl-liger,fusetune,fusetune:eager")
    parser.add_argument("--prompts", type=int, default=64, help="prompts per step")
    parser.add_argument("--n", type=int, default=8, help="completions per prompt")
    parser.add_argument("--completion-tokens", type=int, default=512)
    parser.add_argument("--micro-completions", type=int, default=16, help="completions per forward")
    parser.add_argument("--warmup-steps", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    # Three rows within about 8 minutes: a row's model build, 3 steps and (fusetune) the compilation of
    # the decoding step.
    parser.add_argument("--timeout-s", type=float, default=160, help="per row")
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny model of the family on the CPU (a smoke run)"
    )
    parser.add_argument("--_worker", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._worker:
        return harness.run_as_worker(run_row, args._worker, lambda spec, _error: identity(spec))
    variants = harness.comma_list(args.variants)
    missing = missing_modules(variants)
    if missing:
        print(f"{__spec__.name}: the TRL row needs {', '.join(missing)}; install the wheels (see "
              "benchmarks/README.md) or leave trl-liger out of --variants", file=sys.stderr)  # fmt: skip
        return 2
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.tiny:
        print(
            f"{__spec__.name} measures a GPU step; no CUDA device here (--tiny runs on CPU)", file=sys.stderr
        )
        return 2
    if (args.prompts * args.n) % args.micro_completions or args.micro_completions % args.n:
        print("--micro-completions must divide prompts x n and be a multiple of n", file=sys.stderr)
        return 2
    folder = Path(tempfile.mkdtemp(prefix="fusetune-grpo-"))
    model_path, training_file = prepare(args, folder)
    device_name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    slug = harness.results_slug(args, device_name, on_gpu=device == "cuda")
    specs = [
        {"variant": variant, "model": args.model, "model_path": str(model_path),
         "training_file": str(training_file), "prompts": args.prompts, "n": args.n,
         "completion_tokens": args.completion_tokens, "micro_completions": args.micro_completions,
         "warmup_steps": args.warmup_steps, "steps": args.steps, "device": device, "tiny": args.tiny}
        for variant in variants
    ]  # fmt: skip
    harness.run_rows_in_workers(
        __spec__.name, specs, identity, args=args, benchmark=RESULTS, slug=slug, device_name=device_name,
        render=render_markdown, timeout_s=args.timeout_s,
    )  # fmt: skip
    return 0


def identity(spec: dict[str, Any]) -> dict[str, Any]:
    """What names a row, also the row of a setup that failed."""
    return {"impl": spec["variant"], "model": spec["model"], "prompts": spec["prompts"], "n": spec["n"],
            "completion_tokens": spec["completion_tokens"]}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
