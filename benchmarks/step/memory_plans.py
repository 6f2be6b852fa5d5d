"""8B-class full fine-tunes on one GPU at long rows: fusetune's memory plans against TRL's SFTTrainer with
Liger-Kernel, on the same rows.

Each row runs in a fresh process:

    trl-liger        TRL's SFTTrainer with use_liger_kernel=True: bf16 model, AdamW (adamw_torch_fused), one row
                     per micro-batch and gradient accumulation to the batch, gradient checkpointing on
                     (`trl-liger:nogc` without it)
    fusetune:PLAN    fusetune's Trainer, the worker's training loop (kernels, precision, plan) on the same rows,
                     with the memory plan PLAN = precision/recompute/offload/in-backward/micro-batch, for example
                     `bf16-sr-8bit/r0/o0/ib0/m1`, and optionally `/h1` for the optimizer state in host memory
                     (`bf16-sr-8bit/r26/o6/ib1/m1/h1`); `fusetune:auto` leaves every part to the planner; a suffix
                     `@varlen` runs whole rows through the variable-length flash kernel instead of sdpa

Rows: documents of random words, each longer than --seq tokens of the demo tokenizer and cut to --seq, so every
row is --seq tokens of one document and every token is trained in both setups. The model is built with random
weights in bf16 directly on the GPU (an 8B model built on the host in fp32 needs 32 GB of host memory).

--memory-gib caps what each process may allocate (torch.cuda.set_per_process_memory_fraction): an 80 GB plan
runs as on an H100 on a larger card, and a plan is shown to fit in 40 GiB. Per row: median step time and tokens/s
over --steps steps after --warmup-steps, peak allocated and reserved memory, and for fusetune the plan that
ran (compare its estimate with `python -m benchmarks.step.memory_plans --estimates RESULTS_JSON` on any machine).

    python3 -m benchmarks.step.memory_plans --model llama-3.1-8b-shape --seq 8192 --batch 8 \\
        --variants trl-liger,fusetune:bf16-sr/r32/o0/ib0/m1,fusetune:bf16-sr-8bit/r0/o0/ib0/m1,fusetune:auto
"""

from __future__ import annotations

import argparse
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
from benchmarks.step.trainer_step import build_trainer, job_batches
from benchmarks.workloads import MODEL_SHAPES, build_config

RESULTS = harness.Benchmark("memory-plans", topic="step")
PLAN_FIELDS = ("precision", "recompute_layers", "offload_layers", "optimizer_in_backward", "micro_batch_size")


def parse_plan(text: str) -> dict[str, Any]:
    """`bf16-sr-8bit/r4/o2/ib1/m1` -> the TrainConfig fields of the plan; "auto" -> none (the planner's)."""
    if text == "auto":
        return {}
    precision, *parts = text.split("/")
    fields: dict[str, Any] = {"precision": precision}
    names = {
        "r": "recompute_layers",
        "o": "offload_layers",
        "ib": "optimizer_in_backward",
        "m": "micro_batch_size",
        "h": "optimizer_state_on_host",
    }
    for part in parts:
        key = part.rstrip("0123456789")
        value = int(part[len(key) :])
        fields[names[key]] = bool(value) if key in ("ib", "h") else value
    return fields


def _cap_memory(spec: dict[str, Any]) -> None:
    import torch

    if spec.get("memory_gib") and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, spec["memory_gib"] * GIB / total))


def _build_model(spec: dict[str, Any], device, dtype):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(build_config(spec["model"], tiny=spec["tiny"]), dtype=dtype)


def _timed(step, batches, warmup: int, cuda: bool) -> dict[str, Any]:
    import torch

    times, peaks, retries = [], [], []
    for batch in batches:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        step(batch)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        peaks.append(torch.cuda.max_memory_allocated() / GIB if cuda else None)
        retries.append(alloc_retries() if cuda else None)
    timed = times[warmup:] or times
    return {
        "step_ms": round(statistics.median(timed) * 1e3, 1),
        "peak_alloc_gb": round(max(p for p in peaks if p is not None), 2) if cuda else None,
        "peak_reserved_gb": round(torch.cuda.max_memory_reserved() / GIB, 2) if cuda else None,
        "alloc_retries_timed": retries_after_warmup(retries, warmup) if cuda else None,
    }


def retries_after_warmup(retries: list[int], warmup: int) -> int | None:
    """The allocator's retries in the timed steps, from its count after each step (None without warm-up steps
    to count from, or without timed steps)."""
    return retries[-1] - retries[warmup - 1] if 0 < warmup < len(retries) else None


def alloc_retries() -> int:
    """The caching allocator's count of allocations that failed and were retried after it released its cached
    blocks: each synchronizes the device, so a plan near the memory cap that keeps retrying runs slow however
    well its copies overlap."""
    import torch

    return int(torch.cuda.memory_stats().get("num_alloc_retries", 0))


def run_fusetune(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from fusetune.worker.train import planning
    from fusetune.worker.train.trainer import Trainer

    # The benchmark times steps and writes no checkpoint: the planner's check of the checkpoints' disk would
    # refuse an 8B run on the GPU machine's 64 GB disk.
    planning.free_disk_bytes = lambda path: 1 << 50

    class BuiltOnTheDevice(Trainer):
        def _load_model(self, path: str, dtype: torch.dtype) -> torch.nn.Module:
            return _build_model(spec, self.device, dtype)

    plan_text, _, attention = spec["plan"].partition("@")
    if attention == "varlen":  # whole rows through the variable-length kernel, as before sdpa took them
        from fusetune.models import attention as attention_module

        attention_module.WHOLE_ROWS_TO_SDPA = False
    plan = parse_plan(plan_text)
    # A cap is the run's gpu_memory_bytes, as the service's worker passes it: the trainer caps the process and
    # plans for a card of that size (`fusetune:auto` at --memory-gib 24 plans for a 24 GiB card).
    cap = int(spec["memory_gib"] * GIB) if spec.get("memory_gib") and torch.cuda.is_available() else None
    trainer = build_trainer(spec, BuiltOnTheDevice, packing=False, gpu_memory_bytes=cap, **plan)
    config = trainer.config
    batches = job_batches(trainer, spec["warmup_steps"] + spec["steps"])
    row = {
        "impl": f"fusetune:{spec['plan']}",
        "plan": {
            "precision": trainer.precision.mode.name,
            "recompute_layers": len(trainer.activation_layout.recomputed) if trainer.activation_layout else 0,
            "offload_layers": len(trainer.activation_layout.offloaded) if trainer.activation_layout else 0,
            "optimizer_in_backward": trainer.in_backward is not None,
            "micro_batch_size": trainer.micro_batch_size,
            "optimizer_state_on_host": getattr(trainer.optimizer, "host_state", None) is not None,
        },
        "max_grad_norm": config.max_grad_norm,
        "tokens_per_step": sum(int(mb["input_ids"].numel()) for mb in batches[0]),
    }
    row.update(_timed(trainer.train_step, batches, spec["warmup_steps"], spec["device"] == "cuda"))
    return row


def run_trl(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    _cap_memory(spec)
    gradient_checkpointing = not spec["variant"].endswith(":nogc")
    tokenizer = AutoTokenizer.from_pretrained(spec["model_path"])
    documents = [json.loads(line)["text"] for line in Path(spec["training_file"]).read_text().splitlines()]
    rows = [tokenizer(document)["input_ids"][: spec["seq"]] for document in documents]
    n_steps = spec["warmup_steps"] + spec["steps"]
    cuda = spec["device"] == "cuda"
    model = _build_model(spec, spec["device"], torch.bfloat16)

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize()

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.peaks: list[float] = []
            self.retries: list[int] = []
            self.started = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            synchronize()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            synchronize()
            self.times.append(time.perf_counter() - self.started)
            self.peaks.append(torch.cuda.max_memory_allocated() / GIB if cuda else 0.0)
            self.retries.append(alloc_retries() if cuda else 0)

    args = SFTConfig(
        output_dir=tempfile.mkdtemp(prefix="fusetune-trl-"),
        per_device_train_batch_size=1,
        gradient_accumulation_steps=spec["batch"],
        max_steps=n_steps,
        learning_rate=1e-5,
        bf16=cuda,
        use_cpu=not cuda,
        use_liger_kernel=cuda,  # Liger's kernels need a GPU (a --tiny smoke run on the CPU goes without)
        gradient_checkpointing=gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        optim="adamw_torch_fused",
        max_length=spec["seq"],
        packing=False,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    timer = StepTimer()
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_dict({"input_ids": rows[: n_steps * spec["batch"]]}),
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.train()
    warmup = spec["warmup_steps"]
    timed = timer.times[warmup:] or timer.times
    return {
        "impl": spec["variant"],
        "gradient_checkpointing": gradient_checkpointing,
        "tokens_per_step": spec["batch"] * spec["seq"],
        "step_ms": round(statistics.median(timed) * 1e3, 1),
        "liger": cuda,
        "peak_alloc_gb": round(max(timer.peaks), 2) if cuda else None,
        "peak_reserved_gb": round(torch.cuda.max_memory_reserved() / GIB, 2) if cuda else None,
        "alloc_retries_timed": retries_after_warmup(timer.retries, warmup) if cuda else None,
    }


def run_row(spec: dict[str, Any]) -> dict[str, Any]:
    row = run_trl(spec) if spec["variant"].startswith("trl-liger") else run_fusetune(spec)
    if row.get("step_ms"):
        row["tokens_per_s"] = round(row["tokens_per_step"] / (row["step_ms"] / 1e3))
    return {"model": spec["model"], "seq": spec["seq"], "batch": spec["batch"],
            "memory_gib": spec.get("memory_gib"), **row}  # fmt: skip


def write_documents(path: Path, tokenizer, n_documents: int, seq: int, seed: int = 0) -> None:
    """Documents of random words, each longer than `seq` tokens."""
    rng = random.Random(seed)
    words = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        for _ in range(4000)
    ]
    lines = []
    for _ in range(n_documents):
        n_words = seq
        while True:
            text = " ".join(rng.choice(words) for _ in range(n_words))
            if len(tokenizer(text)["input_ids"]) > seq:
                break
            n_words *= 2
        lines.append(json.dumps({"text": text}) + "\n")
    path.write_text("".join(lines))


def prepare(args: argparse.Namespace, folder: Path) -> tuple[Path, Path]:
    """The model folder (config and tokenizer: the weights are built in each process) and the documents."""
    from fusetune.demo.assets import build_tokenizer

    tokenizer = build_tokenizer()
    model_path = folder / args.model
    config = build_config(args.model, tiny=args.tiny)
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    config.save_pretrained(model_path)
    tokenizer.save_pretrained(model_path)
    training_file = folder / "documents.jsonl"
    write_documents(training_file, tokenizer, args.batch * (args.warmup_steps + args.steps), args.seq)
    return model_path, training_file


def render_markdown(payload: dict[str, Any]) -> str:
    lines = [
        f"# 8B-class memory plans against TRL + Liger-Kernel — {payload['gpu']}, {payload['date']}",
        "",
        f"`{payload['command']}`; versions: {payload['versions']}",
        "",
        "Rows of one document each, every token trained; random weights built in bf16 on the GPU; medians of the "
        "timed steps. fusetune's plan: precision / layers recomputed / layers offloaded / optimizer step in the "
        "backward / micro-batch. A memory cap is `torch.cuda.set_per_process_memory_fraction`.",
        "",
    ]
    rows = payload["rows"]
    anchors = {
        (r["model"], r["seq"], r.get("memory_gib")): r
        for r in rows
        if r["impl"].startswith("trl-liger") and r.get("tokens_per_s")
    }

    def plan(r: dict[str, Any]) -> str:
        p = r.get("plan")
        if not p:
            return "gradient checkpointing" if r.get("gradient_checkpointing") else "no checkpointing"
        return (f"{p['precision']} / r{p['recompute_layers']} / o{p['offload_layers']} / "
                f"ib{int(p['optimizer_in_backward'])} / m{p['micro_batch_size']}"
                + (" / h1" if p.get("optimizer_state_on_host") else ""))  # fmt: skip

    table = []
    for r in rows:
        anchor = anchors.get((r["model"], r["seq"], r.get("memory_gib")))
        ratio = (round(r["tokens_per_s"] / anchor["tokens_per_s"], 2)
                 if anchor and r.get("tokens_per_s") and anchor is not r else None)  # fmt: skip
        table.append([r["model"], f"{r['batch']} x {r['seq']}", r.get("memory_gib") or "", r["impl"], plan(r),
                      r.get("tokens_per_s"), r.get("step_ms"), r.get("peak_alloc_gb"), r.get("peak_reserved_gb"),
                      r.get("alloc_retries_timed"), ratio, r.get("error") or ""])  # fmt: skip
    lines.append(markdown_table(
        ["model", "rows", "cap GiB", "setup", "plan", "tokens/s", "step ms", "peak alloc GB", "peak reserved GB",
         "alloc retries", "x TRL+Liger", "error"], table))  # fmt: skip
    if payload.get("estimates"):
        lines += ["", "The memory model's peak for each plan (fusetune/spec/estimate.py; `--estimates`) beside the "
                  "measured one:", ""]  # fmt: skip
        lines.append(markdown_table(
            ["setup", "model", "rows", "measured GiB", "estimated GiB", "estimate / measured"],
            [[r["impl"], r["model"], r["rows"], r["measured_gib"], r["estimated_gib"], r["ratio"]]
             for r in payload["estimates"]]))  # fmt: skip
    return "\n".join(lines) + "\n"


def estimate_rows(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """The memory model's peak (fusetune/spec/estimate.py) for each fusetune row's plan beside its measured peak."""
    from fusetune.spec.estimate import DataCounts, ModelShape, estimate_job
    from fusetune.spec.hyperparameters import JobHyperparameters
    from fusetune.spec.job import JobSpec
    from fusetune.spec.plan import MemoryPlan

    rows = []
    for row in payload["rows"]:
        if not (row["impl"].startswith("fusetune") and row.get("plan") and row.get("peak_alloc_gb")):
            continue
        shape = ModelShape.from_config_dict(build_config(row["model"], tiny=False).to_dict())
        job = JobSpec(hyperparameters=JobHyperparameters(batch_size=row["batch"], max_seq_length=row["seq"]))
        data = DataCounts(
            example_count=row["batch"], token_estimate=row["batch"] * row["seq"], padded_length=row["seq"]
        )
        estimate = estimate_job(shape, job, data, plan=MemoryPlan(**row["plan"]))
        estimated_gib = estimate.peak_memory_bytes_per_gpu / GIB
        rows.append({"impl": row["impl"], "model": row["model"], "rows": f"{row['batch']} x {row['seq']}",
                     "measured_gib": row["peak_alloc_gb"], "estimated_gib": round(estimated_gib, 2),
                     "ratio": round(estimated_gib / row["peak_alloc_gb"], 3)})  # fmt: skip
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    harness.add_results_arguments(parser, RESULTS, merge="the rows of an earlier run")
    parser.add_argument("--model", default="llama-3.1-8b-shape", help=f"one of {', '.join(MODEL_SHAPES)}")
    parser.add_argument("--variants", default="trl-liger,fusetune:auto")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--warmup-steps", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--memory-gib", type=float, default=None, help="cap each process's GPU memory")
    parser.add_argument("--timeout-s", type=float, default=400, help="per row")
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny model of the family on the CPU (a smoke run)"
    )
    parser.add_argument("--estimates", type=Path, default=None,
                        help="print the memory model's estimate of each plan in this results file beside its "
                        "measured peak (any machine), and add them to the file's section")  # fmt: skip
    parser.add_argument("--_worker", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.estimates:
        content = harness.load_json(args.estimates)
        section = content["sections"][args.section]
        section["estimates"] = estimate_rows(section)
        harness.write_json(args.estimates, content)
        print(markdown_table(["setup", "model", "rows", "measured GiB", "estimated GiB", "estimate / measured"],
                             [list(r.values()) for r in section["estimates"]]))  # fmt: skip
        return 0
    if args._worker:
        return harness.run_as_worker(run_row, args._worker, lambda spec, _error: identity(spec))
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.tiny:
        print(
            f"{__spec__.name} measures a GPU step; no CUDA device here (--tiny runs on CPU)", file=sys.stderr
        )
        return 2
    folder = Path(tempfile.mkdtemp(prefix="fusetune-memory-plans-"))
    model_path, training_file = prepare(args, folder)
    device_name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    slug = harness.results_slug(args, device_name, on_gpu=device == "cuda")
    specs = [
        {"variant": variant, "plan": variant.split(":", 1)[1] if variant.startswith("fusetune:") else None,
         "model": args.model, "model_path": str(model_path), "training_file": str(training_file),
         "batch": args.batch, "seq": args.seq, "warmup_steps": args.warmup_steps, "steps": args.steps,
         "device": device, "tiny": args.tiny, "memory_gib": args.memory_gib}
        for variant in harness.comma_list(args.variants)
    ]  # fmt: skip
    harness.run_rows_in_workers(
        __spec__.name, specs, identity, args=args, benchmark=RESULTS, slug=slug, device_name=device_name,
        render=render_markdown, timeout_s=args.timeout_s,
    )  # fmt: skip
    return 0


def identity(spec: dict[str, Any]) -> dict[str, Any]:
    """What names a row, also the row of a plan that failed."""
    return {"impl": spec["variant"], "model": spec["model"], "seq": spec["seq"], "batch": spec["batch"],
            "memory_gib": spec.get("memory_gib")}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
