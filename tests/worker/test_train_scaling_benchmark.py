"""benchmarks/scaling.py: answers --help without a GPU, computes scaling efficiency, and its CPU smoke mode runs
the trainer under torchrun (gloo, 1 and 2 processes) end to end."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import scaling

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "benchmarks" / "scaling.py"


def test_help_runs_without_a_gpu():
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT
    )
    assert completed.returncode == 0, completed.stderr
    assert "--nproc" in completed.stdout and "--cpu-smoke" in completed.stdout


def test_arguments_are_checked():
    with pytest.raises(SystemExit):
        scaling.parse_args(["--impls", "fusetune,liger"])
    with pytest.raises(SystemExit):
        scaling.parse_args(["--nproc", "one"])
    args = scaling.parse_args(["--nproc", "2,1"])
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
    summary = scaling.scaling_summary(rows)
    assert summary == [
        {"impl": "fusetune", "from_gpus": 1, "to_gpus": 2, "efficiency": 0.95, "meets_goal": True},
        {"impl": "hf", "from_gpus": 1, "to_gpus": 2, "efficiency": 0.9, "meets_goal": False},
    ]
    assert rows[1]["scaling_efficiency"] == 0.95 and "scaling_efficiency" not in rows[4]
    meta = {"gpu": "NVIDIA H200", "date": "2026-11-23", "versions": {"fusetune": "abc"}, "ceilings": None}
    markdown = scaling.render_markdown(scaling.results_payload(meta, rows))
    assert "| m | fusetune | 2 | 8 x 2048 | 152,000 |" in markdown and "hf on 4 GPU(s): OOM" in markdown


@pytest.mark.slow
def test_cpu_smoke_trains_under_torchrun_and_writes_results(tmp_path):
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    payload = json.loads((tmp_path / "cpu-scaling.json").read_text())
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
    assert "| hf | 2 | 2 x 32 |" in (tmp_path / "cpu-scaling.md").read_text()
