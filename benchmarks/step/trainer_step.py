"""The service's training step taken apart: where a job's step spends time and memory that the step of
`benchmarks/step/e2e.py` does not.

`benchmarks/service/jobs.py` measures a job through the HTTP API; this script builds the same job's `Trainer` in
process (the model of `benchmarks/service/jobs.py` saved in bf16 and loaded as the worker loads it, its generated
chat file, packing, batch 8 x 2048, the GPU default precision) and times variants of its step that differ from
the one before by one thing, each in a fresh subprocess:

    trainer          Trainer.train_step on the job's batches: the step whose time the service reports
    no-clip          the same micro-batches and optimizer, without the gradient norm and clipping
    torch-adamw      the same, with torch.optim.AdamW(fused=True) on the bf16 weights (e2e's optimizer)
    random-tokens    the job's model and torch AdamW on e2e's batches (random ids, labels = ids, rows of
                     documents of --packed-length tokens)
    e2e              e2e.py's fusetune row (its own model, built from the config)

Per variant: the median step time, the median of the per-step allocated peaks, the memory held between steps,
and for one more step the peak of each phase (forward, backward, optimizer) and a profile of GPU time by
kernel category. Results go to the section "trainer-step" of `benchmarks/results/<gpu-slug>-step.json` (the
format of shared/ANCHORS.md).

    python3 -m benchmarks.step.trainer_step
    python3 -m benchmarks.step.trainer_step --variants trainer,e2e --steps 10
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.harness import GIB, markdown_table, short_error
from benchmarks.step.e2e import summarize_trace, train_one
from benchmarks.workloads import build_model, chat_examples

RESULTS = harness.Benchmark("trainer-step", topic="step")
VARIANTS = ("trainer", "no-clip", "torch-adamw", "random-tokens", "e2e")


# ------------------------------------------------------------------------------------------- one variant


def build_trainer(
    spec: dict[str, Any], trainer_class: type | None = None, packing: bool = True, **fields: Any
):
    """A job's Trainer (or `trainer_class`) built in this process as one rank, on `spec`'s model, training
    file, batch and sequence length; `fields` set more of its TrainConfig."""
    import torch

    from fusetune.worker.train.config import TrainConfig
    from fusetune.worker.train.distributed import DistInfo
    from fusetune.worker.train.reporter import NullReporter
    from fusetune.worker.train.trainer import Trainer

    config = TrainConfig(
        model_path=spec["model_path"],
        training_file=spec["training_file"],
        output_dir=tempfile.mkdtemp(prefix="fusetune-trainer-step-"),
        n_epochs=1,
        batch_size=spec["batch"],
        max_seq_length=spec["seq"],
        packing=packing,
        seed=0,
        **fields,
    )
    device = torch.device("cuda", 0) if spec["device"] == "cuda" else torch.device("cpu")
    dist = DistInfo(rank=0, local_rank=0, world_size=1, device=device)
    return (trainer_class or Trainer)(config, dist, NullReporter())


def job_batches(trainer, count: int) -> list[list[dict[str, Any]]]:
    batches = []
    for _, micro_batches in trainer.epoch_batches(0):
        batches.append(micro_batches)
        if len(batches) == count:
            break
    return batches


def run_variant(spec: dict[str, Any]) -> dict[str, Any]:
    """One variant in this process: timed steps, per-step peaks, phase peaks and a profile of one step."""
    import torch

    variant = spec["variant"]
    cuda = spec["device"] == "cuda"

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize()

    def reset_peak() -> None:
        if cuda:
            torch.cuda.reset_peak_memory_stats()

    def peak_gb() -> float | None:
        return torch.cuda.max_memory_allocated() / GIB if cuda else None

    def allocated_gb() -> float | None:
        return torch.cuda.memory_allocated() / GIB if cuda else None

    row: dict[str, Any] = {
        "variant": variant,
        "model": spec["model"],
        "batch": spec["batch"],
        "seq": spec["seq"],
    }
    if variant == "e2e":
        e2e = train_one(
            {
                "model": spec["model"], "impl": "fusetune", "device": spec["device"], "batch": spec["batch"],
                "seq": spec["seq"], "tiny": spec["tiny"], "attn": "auto", "warmup_steps": spec["warmup_steps"],
                "steps": spec["steps"], "packed_length": spec["packed_length"], "profile": cuda,
            }
        )  # fmt: skip
        profile = e2e.get("profile", {})
        return {
            **row, "step_ms": e2e.get("step_ms"), "tokens_per_step": spec["batch"] * spec["seq"],
            "peak_alloc_gb": e2e.get("peak_alloc_gb"), "params": e2e.get("params"),
            "memory": profile.get("memory"), "profile": {k: v for k, v in profile.items() if k != "memory"},
            "error": e2e.get("error"),
        }  # fmt: skip

    trainer = build_trainer(spec)
    model, device = trainer.train_model, trainer.device
    row.update(
        params=sum(p.numel() for p in trainer.model.parameters()),
        micro_batch_size=trainer.micro_batch_size,
        micro_batches_per_step=trainer.grad_accum_steps,
        precision=trainer.precision.mode.name,
        optimizer=trainer.optimizer_name,
        kernels_applied=trainer.kernels_applied,
        tied_embeddings=_tied(trainer.model),
    )
    n_batches = spec["warmup_steps"] + spec["steps"] + 2
    if variant == "random-tokens":
        from fusetune.models.attention import packed_sequence_kwargs

        generator = torch.Generator(device=device).manual_seed(1)
        positions = (torch.arange(spec["seq"]) % spec["packed_length"]).expand(spec["batch"], -1)
        boundaries = {
            key: value.to(device) if isinstance(value, torch.Tensor) else value
            for key, value in packed_sequence_kwargs(positions).items()
        }
        vocab = trainer.model.config.vocab_size
        batches = []
        for _ in range(n_batches):
            ids = torch.randint(0, vocab, (spec["batch"], spec["seq"]), device=device, generator=generator)
            batches.append(
                [{"input_ids": ids, "position_ids": positions.to(device), "labels": ids, **boundaries}]
            )
    else:
        batches = job_batches(trainer, n_batches)

    optimizer = trainer.optimizer
    if variant in ("torch-adamw", "random-tokens"):
        trainer.optimizer = None
        optimizer = torch.optim.AdamW(trainer._trainable_parameters(), lr=1e-5, fused=True)

    def forward(batch: dict[str, Any], normaliser) -> Any:
        if variant == "random-tokens":
            inputs = {key: value for key, value in batch.items() if key != "labels"}
            return model(**inputs, labels=batch["labels"], use_cache=False).loss
        with trainer._autocast():
            return trainer.method.loss(model, batch, normaliser)[0]

    def optimizer_step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def step(micro_batches: list[dict[str, Any]]) -> None:
        if variant == "trainer":
            trainer.train_step(micro_batches)
            return
        normaliser = torch.tensor(sum(trainer.method.loss_normaliser(mb) for mb in micro_batches
                                      if "n_trained_tokens" in mb) or 1, device=device)  # fmt: skip
        for batch in micro_batches:
            forward(batch, normaliser).backward()
        optimizer_step()

    times, peaks = [], []
    for micro_batches in batches[:-2]:
        synchronize()
        reset_peak()
        started = time.perf_counter()
        step(micro_batches)
        synchronize()
        times.append(time.perf_counter() - started)
        peaks.append(peak_gb())
    timed = slice(spec["warmup_steps"], None)
    row.update(
        step_ms=round(statistics.median(times[timed]) * 1e3, 2),
        step_ms_min=round(min(times[timed]) * 1e3, 2),
        peak_alloc_gb=_round(statistics.median(peaks[timed]) if cuda else None),
        held_between_steps_gb=_round(allocated_gb()),
        tokens_per_step=sum(int(mb["input_ids"].numel()) for mb in batches[0]),
    )

    # Phases of one step, then a profile of another (the first micro-batch of each).
    micro = batches[-2][0]
    normaliser = torch.tensor(1, device=device)
    memory: dict[str, float | None] = {}
    synchronize()
    reset_peak()
    loss = forward(micro, normaliser)
    synchronize()
    memory["forward_peak_gb"] = peak_gb()
    memory["held_after_forward_gb"] = allocated_gb()
    reset_peak()
    loss.backward()
    synchronize()
    memory["backward_peak_gb"] = peak_gb()
    memory["held_after_backward_gb"] = allocated_gb()
    reset_peak()
    if variant == "trainer":
        from fusetune.worker.train import optim

        optim.clip_and_step(optimizer, trainer.optimizer_name, trainer._trainable_parameters(), 1.0,
                            loss.detach(), lambda norm: RuntimeError("non-finite"))  # fmt: skip
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer_step()
    synchronize()
    memory["optimizer_peak_gb"] = peak_gb()
    row["memory"] = {key: _round(value) for key, value in memory.items()}

    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        synchronize()
        step(batches[-1])
        synchronize()
    with tempfile.TemporaryDirectory() as folder:
        trace_path = Path(folder) / "trace.json"
        profiler.export_chrome_trace(str(trace_path))
        row["profile"] = summarize_trace(json.loads(trace_path.read_text()).get("traceEvents", []))
    return row


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _tied(model) -> bool | None:
    output, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if output is None or embedding is None:
        return None
    return output.weight is embedding.weight


# ------------------------------------------------------------------------------------------- main


def prepare_inputs(args, folder: Path) -> tuple[Path, Path, dict[str, Any]]:
    from fusetune.demo.assets import build_tokenizer

    model_path = build_model(folder / "models", args.model, tiny=args.tiny)
    examples, lengths = chat_examples(args.examples, args.mean_tokens, seed=0, tokenizer=build_tokenizer())
    training_file = folder / "train.jsonl"
    training_file.write_text("".join(json.dumps(e) + "\n" for e in examples))
    return model_path, training_file, {"examples": len(examples), "tokens": sum(lengths)}


def render_markdown(payload: dict[str, Any]) -> str:
    rows = payload["rows"]
    lines = [
        f"# The service's training step taken apart — {payload['gpu']}, {payload['date']}",
        "",
        f"`{payload['command']}`; versions: {payload['versions']}",
        "",
        f"Data: {payload['data']['examples']} generated chat examples ({payload['data']['tokens']:,} tokens), "
        f"packed into rows of {payload['seq']}, batch {payload['batch']}; model {payload['model']} (random "
        "weights, demo tokenizer). Each variant differs from the one before it by one thing (see the script's "
        "docstring); medians of the timed steps.",
        "",
    ]
    header = ["variant", "step ms", "tokens/step", "peak GB", "held between steps GB", "params", "error"]
    lines.append(markdown_table(header, [
        [r["variant"], r.get("step_ms"), r.get("tokens_per_step"), r.get("peak_alloc_gb"),
         r.get("held_between_steps_gb"), r.get("params"), r.get("error") or ""]
        for r in rows
    ]))  # fmt: skip
    profiled = [r for r in rows if isinstance(r.get("profile"), dict) and "by_category_ms" in r["profile"]]
    if profiled:
        keys = ("gpu_span_ms", "gpu_busy_ms", "gpu_idle_ms", "kernel_count")
        table = [[key, *(r["profile"].get(key) for r in profiled)] for key in keys]
        memory_keys = list(dict.fromkeys(k for r in profiled for k in (r.get("memory") or {})))
        table += [[key, *((r.get("memory") or {}).get(key) for r in profiled)] for key in memory_keys]
        categories = list(dict.fromkeys(c for r in profiled for c in r["profile"]["by_category_ms"]))
        table += [
            [f"GPU ms: {c}", *(r["profile"]["by_category_ms"].get(c) for r in profiled)] for c in categories
        ]
        lines += [
            "",
            "## Profile of one step",
            "",
            markdown_table(["", *(r["variant"] for r in profiled)], table),
        ]
        for r in profiled:
            lines += ["", f"Top kernels, {r['variant']}:", ""]
            lines.append(markdown_table(
                ["kernel", "category", "calls", "GPU ms"],
                [[k["name"], k["category"], k["calls"], k["ms"]] for k in r["profile"]["top_kernels"]],
            ))  # fmt: skip
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="llama-3.2-1b-shape", help="a model shape of benchmarks/workloads.py"
    )
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {VARIANTS}")
    parser.add_argument("--examples", type=int, default=600)
    parser.add_argument("--mean-tokens", type=int, default=620)
    parser.add_argument("--packed-length", type=int, default=620, help="document length of random-tokens/e2e")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    harness.add_results_arguments(parser, RESULTS)
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="a tiny model of the same family, on the CPU without a GPU (a smoke run)",
    )
    parser.add_argument("--_worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.variant_list = harness.choices(parser, "--variants", args.variants, VARIANTS)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._worker:
        return harness.run_as_worker(
            run_variant, args._worker, lambda spec, _error: {"variant": spec["variant"]}
        )
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.tiny:
        print(
            f"{__spec__.name} measures a GPU step; no CUDA device here (--tiny runs on CPU)", file=sys.stderr
        )
        return 2
    folder = Path(tempfile.mkdtemp(prefix="fusetune-trainer-step-"))
    model_path, training_file, data = prepare_inputs(args, folder)
    rows = []
    for variant in args.variant_list:
        spec = {
            "variant": variant, "model": args.model, "model_path": str(model_path),
            "training_file": str(training_file), "batch": args.batch, "seq": args.seq,
            "warmup_steps": args.warmup_steps, "steps": args.steps, "packed_length": args.packed_length,
            "device": device, "tiny": args.tiny,
        }  # fmt: skip
        print(f"variant {variant} ...", flush=True)
        run = harness.run_worker(__spec__.name, ["--_worker", json.dumps(spec)], timeout_s=900)
        row = run.results[-1] if run.results else {"variant": variant, "error": short_error(run.failure, 600)}
        print(f"  {json.dumps({k: v for k, v in row.items() if k != 'profile'})}", flush=True)
        rows.append(row)

    device_name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    payload = {
        **harness.run_meta(device_name),
        "command": f"python3 -m {__spec__.name} " + " ".join(sys.argv[1:]),
        "model": args.model, "batch": args.batch, "seq": args.seq, "data": data,
        "rows": [{"impl": r["variant"], **r} for r in rows],
    }  # fmt: skip
    RESULTS.save(args, harness.results_slug(args, device_name), payload, render_markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
