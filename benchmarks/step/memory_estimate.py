"""The job estimate's peak GPU memory (fusetune.spec.estimate, what `POST /v1/fine_tuning/jobs` with `dry_run`
returns) against the peak the trainer measures on a GPU, for a few job settings.

Each configuration is one torchrun launch of the trainer (fusetune.worker.train, the worker's own code) with the
job's GPU defaults: precision bf16-mixed, the default micro-batch, AdamW; a model of a public architecture's
shape with random weights, random token ids filling every sequence to `seq` tokens (so the estimate's padded
length is exactly `seq`). The measured number is the largest `torch.cuda.max_memory_reserved` over the steps
(what the allocator took from the GPU, which is what must fit); allocated is shown beside it. The goal: every
estimate within 25% of the measured peak. Results go to the section "memory-estimate" of
`benchmarks/results/<gpu-slug>-step.json`.

    python3 -m benchmarks.step.memory_estimate               # all configurations (one GPU)
    python3 -m benchmarks.step.memory_estimate --configs full-fused,lora-fused
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from benchmarks import harness
from benchmarks.harness import GIB, markdown_table
from benchmarks.scaling import gpus
from benchmarks.workloads import build_config
from fusetune.spec.estimate import DataCounts, ModelShape, estimate_job
from fusetune.spec.hyperparameters import JobHyperparameters
from fusetune.spec.job import JobSpec

RESULTS = harness.Benchmark("memory-estimate", topic="step")
TOLERANCE = 0.25
LORA = {"r": 16, "alpha": 32.0, "dropout": 0.0, "target_modules": "all-linear"}

# name -> the job settings that change the memory: model shape, sequences per step, tokens per sequence,
# kernels, LoRA, gradient checkpointing.
CONFIGS: dict[str, dict[str, Any]] = {
    "full-fused": {"model": "llama-3.2-1b-shape", "batch": 8, "seq": 2048, "kernels": True},
    "full-unfused": {"model": "llama-3.2-1b-shape", "batch": 4, "seq": 2048, "kernels": False},
    "lora-fused": {"model": "llama-3.2-1b-shape", "batch": 8, "seq": 2048, "kernels": True, "lora": LORA},
    "checkpointing-fused": {
        "model": "llama-3.2-1b-shape",
        "batch": 8,
        "seq": 2048,
        "kernels": True,
        "gradient_checkpointing": True,
    },  # fmt: skip
    "qwen-full-fused": {"model": "qwen2.5-1.5b-shape", "batch": 4, "seq": 2048, "kernels": True},
    # Added after the estimate's terms were corrected from the first five: settings it had not been checked on.
    "lora-checkpointing-long": {
        "model": "llama-3.2-1b-shape",
        "batch": 2,
        "seq": 8192,
        "kernels": True,
        "lora": LORA,
        "gradient_checkpointing": True,
    },  # fmt: skip
    "qwen-lora-unfused": {
        "model": "qwen2.5-1.5b-shape",
        "batch": 4,
        "seq": 2048,
        "kernels": False,
        "lora": LORA,
    },
}

METHOD = (
    "estimate: fusetune.spec.estimate.estimate_job for the configuration (example_count = batch x steps, every "
    "example seq tokens long, n_gpus 1). measured: the trainer under torchrun on one GPU, precision bf16-mixed "
    "(the job default on a GPU: fp32 weights and AdamW state, bf16 autocast), micro-batch = batch (the "
    "default up to 16384 tokens), 3 steps; peak = max over steps of torch.cuda.max_memory_reserved (and "
    "max_memory_allocated). ratio = estimate / measured reserved; goal |ratio - 1| <= 0.25."
)


def _estimate(config: dict[str, Any], steps: int) -> dict[str, Any]:
    shape = ModelShape.from_config_dict(build_config(config["model"], tiny=False).to_dict())
    hyperparameters = {
        "n_epochs": 1, "batch_size": config["batch"], "max_seq_length": config["seq"], "kernels": config["kernels"],
        "lora": config.get("lora"), "gradient_checkpointing": config.get("gradient_checkpointing", False),
        "precision": "bf16-mixed", "micro_batch_size": config["batch"],
    }  # fmt: skip
    job = JobSpec(hyperparameters=JobHyperparameters(**hyperparameters))
    data = DataCounts(
        example_count=config["batch"] * steps,
        token_estimate=config["batch"] * steps * config["seq"],
        padded_length=config["seq"],
    )
    estimate = estimate_job(shape, job, data)
    return {
        "estimate_gb": round(estimate.peak_memory_bytes_per_gpu / GIB, 2),
        "estimate_breakdown_gb": {k: round(v / GIB, 2) for k, v in estimate.memory_breakdown.items()},
    }


def measure(name: str, config: dict[str, Any], steps: int, timeout_s: float) -> dict[str, Any]:
    spec = {
        "model": config["model"], "impl": "fusetune" if config["kernels"] else "hf", "batch": config["batch"],
        "seq": config["seq"], "steps": steps - 1, "warmup_steps": 1, "tiny": False, "distributed": "ddp",
        "ddp_bucket_cap_mb": None, "gradient_checkpointing": config.get("gradient_checkpointing", False),
        "precision": "bf16-mixed", "lora": config.get("lora"), "peak_tflops": None,
    }  # fmt: skip
    measured = gpus.run_torchrun(spec, 1, timeout_s, cpu=False)
    row: dict[str, Any] = {
        "config": name,
        "model": config["model"],
        "batch": config["batch"],
        "seq": config["seq"],
        "kernels": config["kernels"],
        "lora": bool(config.get("lora")),
        "gradient_checkpointing": config.get("gradient_checkpointing", False),
        **_estimate(config, steps),
    }
    if "error" in measured:
        row["error"] = measured["error"]
        return row
    row["measured_reserved_gb"] = measured["peak_reserved_gb"]
    row["measured_alloc_gb"] = measured["peak_alloc_gb"]
    row["ratio"] = round(row["estimate_gb"] / row["measured_reserved_gb"], 3)
    row["within_tolerance"] = abs(row["ratio"] - 1) <= TOLERANCE
    return row


def render_markdown(payload: dict[str, Any]) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in payload["versions"].items())
    table = [
        [r["config"], r["model"], f"{r['batch']} x {r['seq']}", r["kernels"], r["lora"], r["gradient_checkpointing"],
         r["estimate_gb"], r.get("measured_reserved_gb"), r.get("measured_alloc_gb"), r.get("ratio"),
         r.get("within_tolerance", r.get("error"))]
        for r in payload["rows"]
    ]  # fmt: skip
    header = ["config", "model", "batch", "kernels", "LoRA", "checkpointing", "estimate GB", "measured reserved GB",
              "measured allocated GB", "estimate / measured", "within 25%"]  # fmt: skip
    return "\n".join(
        [
            f"# Job memory estimate against the trainer on {payload['gpu']}, {payload['date']}",
            "",
            f"Versions: {versions}.",
            "",
            f"Method: {payload['method']}",
            "",
            markdown_table(header, table),
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated: {', '.join(CONFIGS)}")
    parser.add_argument("--steps", type=int, default=3)
    harness.add_results_arguments(parser, RESULTS)
    parser.add_argument("--run-timeout-s", type=float, default=300)
    args = parser.parse_args(argv)
    names = harness.choices(parser, "--configs", args.configs, CONFIGS)
    meta = harness.measured_meta()
    if meta is None:
        return 2
    rows = []
    for name in names:
        started = time.monotonic()
        rows.append(measure(name, CONFIGS[name], args.steps, args.run_timeout_s))
        print(f"{name}: {rows[-1]} ({time.monotonic() - started:.0f} s)", flush=True)
    payload = {**meta, "method": METHOD, "tolerance": TOLERANCE, "rows": rows}
    RESULTS.save(args, harness.results_slug(args, meta["gpu"]), payload, render_markdown)
    return 0 if all(r.get("within_tolerance") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
