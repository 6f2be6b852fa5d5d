"""Scaling of the training engine over GPUs: the trainer itself (fusetune.worker.train) under torchrun.

For each implementation and GPU count, one torchrun launch trains a model of a public architecture's shape with
random weights on random tokens, `--batch` sequences of `--seq` tokens per GPU and step, bf16 weights and
fused AdamW, DDP over NCCL (or FSDP2 with `--distributed fsdp`). Implementations:

    fusetune   the trainer with its fused kernels (TrainConfig.kernels = True)
    hf         the same trainer with the kernels off: Hugging Face eager modules

The trainer's own per-step metrics give the numbers: the median step time of `--steps` steps after
`--warmup-steps`, the peak allocated memory (max over steps and ranks) and MFU against the bf16 matmul rate
measured at the start of the run. Scaling efficiency = tokens/s on N GPUs / (N x tokens/s on 1 GPU).
Results: the section "gpus" of `benchmarks/results/<gpu-slug>-scaling.json` (format of shared/ANCHORS.md, rows
with `n_gpus`).

    python3 -m benchmarks.scaling.gpus                               # 1 and 2 GPUs, both impls
    python3 -m benchmarks.scaling.gpus --nproc 2 --impls fusetune --ddp-bucket-cap-mb 50
    python3 -m benchmarks.scaling.gpus --cpu-smoke                   # tiny shape, gloo, < 1 minute
    python3 -m benchmarks.scaling.gpus --model llama-3.1-8b-shape --nproc 1 --impls fusetune --precision bf16-sr-8bit \
        --distributed fsdp --fsdp-one-gpu                            # FSDP2's cost on one GPU (and without it: ddp)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.harness import GIB, markdown_table, short_error
from benchmarks.workloads import MODEL_SHAPES, build_config

RESULTS = harness.Benchmark("gpus", topic="scaling")
IMPLS = ("fusetune", "hf")
# Scaling-efficiency goals by GPU count: 2 GPUs at the 1B shape (HF + Liger-Kernel under plain DDP measured
# 0.946 on H200s), 4 or 8 GPUs for the 1B (DDP) and 8B (FSDP2) shapes.
GOAL_EFFICIENCY = 0.95
GOAL_EFFICIENCY_MANY_GPUS = 0.85


def goal_efficiency(n_gpus: int) -> float:
    return GOAL_EFFICIENCY if n_gpus <= 2 else GOAL_EFFICIENCY_MANY_GPUS


METHOD = (
    "the trainer (fusetune.worker.train.trainer.Trainer, as the worker runs it) under torchrun --standalone, one "
    "process per GPU; model built from the architecture's config with random weights (seed 0), sdpa attention; "
    "random token ids, every next token trained; batch = --batch sequences of --seq tokens per GPU and step (one "
    "micro-batch); precision --precision, 'bf16' unless given (bf16 weights, AdamW state in bf16, "
    "torch.optim.AdamW(fused=True)); with --fsdp-one-gpu the 1-GPU row is sharded by FSDP2 over a world of one; "
    "gradient clipping at 1.0; step time = the trainer's step_time_s (micro-batches, all-reduce, clipping, "
    "optimizer step, then a device synchronize), median of the timed steps after the warm-up steps; "
    "tokens_per_s = n_gpus * batch * seq / median step time; peak_alloc_gb = the trainer's "
    "peak_memory_allocated_bytes (torch.cuda.max_memory_allocated per step, max over ranks and timed steps) / "
    "2**30; scaling efficiency = tokens_per_s(n) / (n * tokens_per_s(1)) for the same impl. No checkpoint is "
    "written (the measured loop is the training step)."
)


def _row_base(spec: dict[str, Any], n_gpus: int) -> dict[str, Any]:
    model = spec["model"] + ("-tiny" if spec["tiny"] else "")  # a smoke test's shape is not the named one
    return {
        "model": model,
        "impl": spec["impl"],
        "n_gpus": n_gpus,
        "batch": spec["batch"],
        "seq": spec["seq"],
        # The series a row belongs to: its 1-GPU row runs no data parallelism at all, whichever is asked, except
        # FSDP2 forced onto one GPU (--fsdp-one-gpu), a series of its own.
        "series_distributed": "fsdp-one-gpu" if spec.get("fsdp_one_gpu") else spec["distributed"],
        "series_precision": spec.get("precision", "bf16"),
    }


# ---------------------------------------------------------------------------------------------------------
# Worker: one rank inside torchrun.


def _synthetic_trainer_class():
    """A Trainer that trains a randomly initialised model on random tokens; imported inside the worker only,
    so that the parent process never loads torch."""
    from types import SimpleNamespace

    import torch
    from transformers import AutoModelForCausalLM

    from fusetune.worker.train.data import IGNORE_INDEX, LoadedData, TokenizedSequence
    from fusetune.worker.train.trainer import Trainer

    class SyntheticTrainer(Trainer):
        shard_one_process = False  # --fsdp-one-gpu: FSDP2 over a world of one, to measure its own cost

        def __init__(self, config, dist_info, reporter, model_config) -> None:
            self._model_config = model_config
            super().__init__(config, dist_info, reporter)

        @classmethod
        def _shards(cls, config, dist_info) -> bool:
            return Trainer._shards(config, dist_info) or (
                cls.shard_one_process and config.distributed == "fsdp"
            )

        def _load_tokenizer(self):
            return SimpleNamespace(pad_token_id=0, eos_token_id=None)  # ids are drawn directly, never decoded

        def _load_model(self, path: str, dtype: torch.dtype) -> torch.nn.Module:
            torch.manual_seed(0)
            # Built whole on this rank's GPU, FSDP included (an 8B model is 16 GB in bf16; fully_shard then keeps
            # only this rank's shard): initialising billions of parameters on the CPU takes minutes per rank.
            device = self.device if self.device.type == "cuda" else torch.device("cpu")
            with device:
                return AutoModelForCausalLM.from_config(
                    self._model_config, dtype=dtype, attn_implementation="sdpa"
                )

        def _load_data(self, path: str, packing: bool) -> LoadedData:
            config = self.config
            generator = torch.Generator().manual_seed(1)
            n_rows = config.batch_size * (config.max_steps or 1)
            ids = torch.randint(
                0, self._model_config.vocab_size, (n_rows, config.max_seq_length), generator=generator
            ).tolist()
            rows = [TokenizedSequence(row, row[1:] + [IGNORE_INDEX], list(range(len(row)))) for row in ids]
            return LoadedData(rows, n_rows, 0, 0)

        def _save_checkpoint(self, metrics: dict[str, float]) -> None:
            # The benchmark measures training steps; writing gigabytes of weights and optimizer state is not one.
            self.last_checkpoint, self.last_checkpoint_step = Path(self.config.output_dir), self.step

    return SyntheticTrainer


def _worker_main(spec_json: str) -> int:
    spec = json.loads(spec_json)
    from fusetune.worker.train.config import TrainConfig
    from fusetune.worker.train.distributed import DEFAULT_DDP_BUCKET_CAP_MB, init_distributed, shutdown
    from fusetune.worker.train.metrics import training_flops_per_token
    from fusetune.worker.train.reporter import NullReporter

    class Collector(NullReporter):
        def __init__(self) -> None:
            self.metrics: list[dict[str, float]] = []

        def metric(self, step: int, values: dict[str, float], rank_memory: list | None = None) -> None:
            self.metrics.append(values)

    dist_info = init_distributed()
    n_gpus = dist_info.world_size
    row = _row_base(spec, n_gpus)
    try:
        with tempfile.TemporaryDirectory(prefix="fusetune-scaling-") as output_dir:
            config = TrainConfig(
                model_path=f"random weights of the {spec['model']}",
                training_file="random tokens",
                output_dir=output_dir,
                batch_size=spec["batch"] * n_gpus,
                micro_batch_size=spec["batch"],
                max_seq_length=spec["seq"],
                max_steps=spec["warmup_steps"] + spec["steps"],
                learning_rate=1e-5,
                warmup_ratio=0.0,
                precision=spec.get("precision", "bf16") if dist_info.device.type == "cuda" else "fp32",
                lora=spec.get("lora"),
                kernels=spec["impl"] == "fusetune",
                distributed=spec["distributed"],
                ddp_bucket_cap_mb=spec["ddp_bucket_cap_mb"],
                gradient_checkpointing=spec["gradient_checkpointing"],
                resume=False,
            )
            reporter = Collector()
            trainer_class = _synthetic_trainer_class()
            trainer_class.shard_one_process = bool(spec.get("fsdp_one_gpu"))
            trainer = trainer_class(config, dist_info, reporter, build_config(spec["model"], spec["tiny"]))
            trainer.train()
            flops_per_token = training_flops_per_token(trainer.model, spec["seq"])
            timed = reporter.metrics[spec["warmup_steps"] :]
            step_s = statistics.median(m["step_time_s"] for m in timed)
            tokens_per_s = n_gpus * spec["batch"] * spec["seq"] / step_s
            peak_allocated = max(m["peak_memory_allocated_bytes"] for m in timed)
            peak_reserved = max(m["peak_memory_reserved_bytes"] for m in timed)
            row.update(
                tokens_per_s=round(tokens_per_s, 1),
                tokens_per_s_per_gpu=round(tokens_per_s / n_gpus, 1),
                peak_alloc_gb=round(peak_allocated / GIB, 2) if dist_info.device.type == "cuda" else None,
                peak_reserved_gb=round(peak_reserved / GIB, 2) if dist_info.device.type == "cuda" else None,
                mfu=None,
                flops_per_token=flops_per_token,
                step_ms=round(step_s * 1e3, 2),
                step_ms_min=round(min(m["step_time_s"] for m in timed) * 1e3, 2),
                step_ms_max=round(max(m["step_time_s"] for m in timed) * 1e3, 2),
                first_loss=round(reporter.metrics[0]["train_loss"], 4),
                last_loss=round(reporter.metrics[-1]["train_loss"], 4),
                kernels_applied=trainer.kernels_applied,
                distributed="fsdp" if trainer.fsdp else (spec["distributed"] if n_gpus > 1 else "none"),
                ddp_bucket_cap_mb=config.ddp_bucket_cap_mb or DEFAULT_DDP_BUCKET_CAP_MB,
                precision=trainer.precision.name,
                steps=spec["steps"],
                warmup_steps=spec["warmup_steps"],
            )
            if spec.get("peak_tflops"):
                row["mfu"] = round(
                    row["tokens_per_s_per_gpu"] * flops_per_token / (spec["peak_tflops"] * 1e12), 4
                )
            if spec["impl"] == "fusetune" and dist_info.device.type == "cuda" and not trainer.kernels_applied:
                row["error"] = "the fused kernels were not applied (see the trainer's kernels event)"
    except Exception as error:  # noqa: BLE001 - every failure becomes the row's error
        traceback.print_exc()
        row["error"] = ("OOM: " if "out of memory" in str(error).lower() else "") + short_error(error)
        if dist_info.is_main:
            harness.report(row)
        # Exit at once: the other ranks may wait in a collective, and torchrun stops them when one rank fails.
        sys.stdout.flush()
        os._exit(1)
    if dist_info.is_main:
        harness.report(row)
    shutdown()
    return 0


# ---------------------------------------------------------------------------------------------------------
# Parent: one torchrun launch per (impl, n_gpus).


def run_torchrun(spec: dict[str, Any], nproc: int, timeout_s: float, cpu: bool) -> dict[str, Any]:
    run = harness.run_worker(__spec__.name, ["--_worker", json.dumps(spec)], timeout_s, nproc=nproc, cpu=cpu)
    if run.results:
        return run.results[0]
    return {**_row_base(spec, nproc), "error": f"torchrun {run.failure}"}


def _series_key(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["model"], row["impl"], row["batch"], row["seq"], row.get("series_distributed", "ddp"),
            row.get("series_precision", "bf16"))  # fmt: skip


def scaling_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Efficiency of every row against the row of the fewest GPUs that ran in the same series (model, impl,
    batch, sequence, DDP or FSDP): tokens_per_s(n) / ((n / n0) * tokens_per_s(n0)); n0 is 1 unless the model
    did not fit on one GPU. Adds it to the row too."""
    summary = []
    base: dict[tuple[Any, ...], dict[str, Any]] = {}
    for row in sorted((r for r in rows if r.get("tokens_per_s")), key=lambda r: r["n_gpus"]):
        base.setdefault(_series_key(row), row)
    for row in rows:
        reference = base.get(_series_key(row))
        if reference is None or not row.get("tokens_per_s") or row["n_gpus"] == reference["n_gpus"]:
            continue
        ratio = row["n_gpus"] / reference["n_gpus"]
        efficiency = round(row["tokens_per_s"] / (ratio * reference["tokens_per_s"]), 4)
        row["scaling_efficiency"] = efficiency
        row["scaling_from_gpus"] = reference["n_gpus"]
        summary.append(
            {"model": row["model"], "impl": row["impl"], "distributed": row.get("series_distributed", "ddp"),
             "from_gpus": reference["n_gpus"], "to_gpus": row["n_gpus"], "efficiency": efficiency,
             "goal": goal_efficiency(row["n_gpus"]), "meets_goal": efficiency >= goal_efficiency(row["n_gpus"])}
        )  # fmt: skip
    return summary


def merge_rows(previous: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Earlier rows, less those this run measured again (same series and GPU count), then this run's rows."""
    measured = {(*_series_key(row), row["n_gpus"]) for row in new}
    kept = [row for row in previous if (*_series_key(row), row["n_gpus"]) not in measured]
    return kept + new


def results_payload(meta: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        **harness.results_header(meta, METHOD),
        "goal": f"scaling efficiency >= {GOAL_EFFICIENCY} on 2 GPUs and >= {GOAL_EFFICIENCY_MANY_GPUS} on 4 or 8, "
        "with the kernels on (HF + Liger-Kernel under plain DDP, 1 -> 2 GPUs: "
        "0.946 on H200, shared/ANCHORS.md)",
        "scaling": scaling_summary(rows),
        "rows": rows,
    }


def render_markdown(payload: dict[str, Any]) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in payload["versions"].items())
    lines = [
        f"# Scaling of the trainer over GPUs: {payload['gpu']}, {payload['date']}",
        "",
        f"Versions: {versions}.",
        "",
        f"Method: {payload['method']}",
        "",
        f"MFU: {payload['mfu_formula']}.",
        "",
        f"Goal: {payload['goal']}.",
        "",
    ]
    table = []
    notes = []
    for row in payload["rows"]:
        table.append(
            [
                row["model"], row["impl"], row.get("distributed", row.get("series_distributed", "ddp")),
                row.get("precision", row.get("series_precision", "bf16")), row["n_gpus"],
                f"{row['batch']} x {row['seq']}", row.get("tokens_per_s"),
                row.get("tokens_per_s_per_gpu"), row.get("scaling_efficiency"), row.get("peak_alloc_gb"),
                row.get("mfu"), row.get("step_ms"), row.get("kernels_applied"),
            ]
        )  # fmt: skip
        if "error" in row:
            notes.append(f"- {row['impl']} on {row['n_gpus']} GPU(s): {row['error']}")
    header = ["model", "impl", "parallelism", "precision", "GPUs", "batch per GPU", "tokens/s", "tokens/s per GPU", "scaling efficiency",
              "peak alloc GB", "MFU", "step ms", "kernels"]  # fmt: skip
    lines.append(markdown_table(header, table))
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Tokens/s of the trainer on 1 and N GPUs under torchrun, kernels on and off; scaling efficiency.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", default="llama-3.2-1b-shape", choices=sorted(MODEL_SHAPES))
    parser.add_argument(
        "--nproc", default="1,2", help="comma-separated GPU counts (1 is needed for efficiency)"
    )
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated: {', '.join(IMPLS)}")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (the median is reported)")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="sequences per GPU and step")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--distributed", choices=("ddp", "fsdp"), default="ddp")
    parser.add_argument(
        "--ddp-bucket-cap-mb", type=int, default=None, help="DDP bucket size (default: the trainer's)"
    )
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument(
        "--precision", default="bf16", help="the trainer's precision mode (spec/precision.py)"
    )
    parser.add_argument(
        "--fsdp-one-gpu", action="store_true",
        help="with --distributed fsdp, shard with FSDP2 on one GPU too (a world of one: FSDP2's own cost)",
    )  # fmt: skip
    harness.add_results_arguments(parser, RESULTS, merge="the rows this run does not measure again")
    parser.add_argument("--run-timeout-s", type=float, default=540, help="limit of one torchrun launch")
    parser.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="check the harness on a CPU: tiny shape, batch 2 x 32, gloo, 1 and 2 processes, hf only, 1 warm-up "
        "and 2 timed steps; numbers mean nothing; writes to a temporary folder unless --out is given",
    )
    parser.add_argument("--_worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        defaults = {"impls": ",".join(IMPLS), "steps": 10, "warmup_steps": 3, "batch": 8, "seq": 2048}
        smoke = {"impls": "hf", "steps": 2, "warmup_steps": 1, "batch": 2, "seq": 32}
        for name, value in smoke.items():
            if getattr(args, name) == defaults[name]:
                setattr(args, name, value)
        harness.smoke_out(args, "fusetune-scaling-cpu-")
    args.impls = harness.choices(parser, "--impls", args.impls, IMPLS)
    try:
        args.nproc = sorted({int(n) for n in args.nproc.split(",")})
    except ValueError:
        parser.error(f"--nproc: expected comma-separated integers, got {args.nproc!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._worker:
        return _worker_main(args._worker)

    meta = harness.measured_meta("cpu (smoke test, gloo)" if args.cpu_smoke else None)
    if meta is None:
        return 2
    rows = []
    for impl in args.impls:
        for nproc in args.nproc:
            spec = {
                "model": args.model, "impl": impl, "batch": args.batch, "seq": args.seq, "steps": args.steps,
                "warmup_steps": args.warmup_steps, "tiny": args.cpu_smoke, "distributed": args.distributed,
                "ddp_bucket_cap_mb": args.ddp_bucket_cap_mb, "gradient_checkpointing": args.gradient_checkpointing,
                "precision": args.precision, "fsdp_one_gpu": args.fsdp_one_gpu and args.distributed == "fsdp",
                "peak_tflops": (meta["ceilings"] or {}).get("bf16_matmul_TFLOPs"),
            }  # fmt: skip
            started = time.monotonic()
            print(f"{args.model} / {impl} / {nproc} process(es) ...", flush=True)
            row = run_torchrun(spec, nproc, args.run_timeout_s, cpu=args.cpu_smoke)
            print(f"  {json.dumps(row)} ({time.monotonic() - started:.0f} s)", flush=True)
            rows.append(row)
    slug = harness.results_slug(args, meta["gpu"], on_gpu=not args.cpu_smoke)
    previous = RESULTS.previous(args, slug)
    if previous is not None:
        rows = merge_rows(previous["rows"], rows)
    payload = results_payload(meta, rows)
    RESULTS.save(args, slug, payload, render_markdown)
    for entry in payload["scaling"]:
        print(
            f"scaling efficiency {entry['model']} {entry['impl']} ({entry['distributed']}) "
            f"{entry['from_gpus']} -> {entry['to_gpus']} GPUs: {entry['efficiency']:.3f}"
        )
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
