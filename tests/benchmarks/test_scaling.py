"""benchmarks/scaling/gpus.py: answers --help without a GPU, computes scaling efficiency, and its CPU smoke mode
runs the trainer under torchrun (gloo, 1 and 2 processes) end to end."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.scaling import gpus

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ["-m", "benchmarks.scaling.gpus"]


def test_help_runs_without_a_gpu():
    completed = subprocess.run(
        [sys.executable, *SCRIPT, "--help"], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT
    )
    assert completed.returncode == 0, completed.stderr
    assert "--nproc" in completed.stdout and "--cpu-smoke" in completed.stdout


def test_arguments_are_checked():
    with pytest.raises(SystemExit):
        gpus.parse_args(["--impls", "fusetune,liger"])
    with pytest.raises(SystemExit):
        gpus.parse_args(["--nproc", "one"])
    args = gpus.parse_args(["--nproc", "2,1"])
    assert (args.nproc, args.impls, args.batch, args.seq, args.steps) == (
        [1, 2],
        ["fusetune", "hf"],
        8,
        2048,
        10,
    )


def _row(impl, n_gpus, tokens_per_s):
    return {
        "model": "m",
        "impl": impl,
        "n_gpus": n_gpus,
        "batch": 8,
        "seq": 2048,
        "tokens_per_s": tokens_per_s,
    }


def test_scaling_efficiency_compares_with_one_gpu_of_the_same_impl():
    rows = [_row("fusetune", 1, 80_000.0), _row("fusetune", 2, 152_000.0), _row("hf", 1, 50_000.0),
            _row("hf", 2, 90_000.0), {**_row("hf", 4, None), "error": "OOM"}]  # fmt: skip
    summary = gpus.scaling_summary(rows)
    common = {"model": "m", "distributed": "ddp", "from_gpus": 1, "to_gpus": 2, "goal": 0.95}
    assert summary == [
        {**common, "impl": "fusetune", "efficiency": 0.95, "meets_goal": True},
        {**common, "impl": "hf", "efficiency": 0.9, "meets_goal": False},
    ]
    assert rows[1]["scaling_efficiency"] == 0.95 and "scaling_efficiency" not in rows[4]
    meta = {"gpu": "NVIDIA H200", "date": "2026-11-23", "versions": {"fusetune": "abc"}, "ceilings": None}
    markdown = gpus.render_markdown(gpus.results_payload(meta, rows))
    assert (
        "| m | fusetune | ddp | bf16 | 2 | 8 x 2048 | 152,000 |" in markdown
        and "hf on 4 GPU(s): OOM" in markdown
    )


def test_scaling_efficiency_starts_from_the_fewest_gpus_that_ran_and_keeps_series_apart():
    """An 8B model that runs out of memory on one GPU is measured from 2; DDP and FSDP rows of one model
    are separate series; 4 GPUs are held to the many-GPU goal."""
    fsdp = {"series_distributed": "fsdp"}
    rows = [{**_row("fusetune", 1, None), **fsdp, "error": "OOM"}, {**_row("fusetune", 2, 20_000.0), **fsdp},
            {**_row("fusetune", 4, 36_000.0), **fsdp}, _row("fusetune", 1, 11_000.0)]  # fmt: skip
    (entry,) = gpus.scaling_summary(rows)
    assert entry == {"model": "m", "impl": "fusetune", "distributed": "fsdp", "from_gpus": 2, "to_gpus": 4,
                     "efficiency": 0.9, "goal": 0.85, "meets_goal": True}  # fmt: skip


def test_merge_keeps_earlier_rows_that_were_not_measured_again():
    earlier = [_row("fusetune", 1, 1.0), _row("fusetune", 2, 2.0), {**_row("hf", 2, 3.0), "model": "other"}]
    new = [_row("fusetune", 2, 5.0)]
    merged = gpus.merge_rows(earlier, new)
    assert [(r["model"], r["impl"], r["n_gpus"], r["tokens_per_s"]) for r in merged] == [
        ("m", "fusetune", 1, 1.0), ("other", "hf", 2, 3.0), ("m", "fusetune", 2, 5.0),
    ]  # fmt: skip


@pytest.mark.slow
def test_cpu_smoke_trains_under_torchrun_and_writes_results(tmp_path):
    completed = subprocess.run(
        [sys.executable, *SCRIPT, "--cpu-smoke", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    payload = json.loads((tmp_path / "cpu-scaling.json").read_text())["sections"]["gpus"]
    assert {"gpu", "date", "versions", "ceilings", "rows", "scaling", "method"} <= payload.keys()
    assert [(row["impl"], row["n_gpus"]) for row in payload["rows"]] == [("hf", 1), ("hf", 2)]
    for row in payload["rows"]:
        assert "error" not in row, row
        assert row["model"] == "llama-3.2-1b-shape-tiny" and (row["batch"], row["seq"]) == (2, 32)
        assert row["tokens_per_s"] > 0 and row["tokens_per_s_per_gpu"] == pytest.approx(
            row["tokens_per_s"] / row["n_gpus"], rel=1e-3
        )
        assert {"peak_alloc_gb", "mfu", "step_ms", "first_loss", "last_loss"} <= row.keys()
        assert row["distributed"] == ("ddp" if row["n_gpus"] == 2 else "none")
    one, two = payload["rows"]
    (entry,) = payload["scaling"]
    assert entry["efficiency"] == pytest.approx(two["tokens_per_s"] / (2 * one["tokens_per_s"]), abs=1e-3)
    assert "| hf | ddp | fp32 | 2 | 2 x 32 |" in gpus.render_markdown(payload)
