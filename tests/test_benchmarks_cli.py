"""Every benchmark script answers --help without a GPU (run as `python -m benchmarks.<topic>.<script>`, as
gpu_session.sh runs it), and the kernel floors agree with shared/ANCHORS.md."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import workloads
from benchmarks.harness import gpu_slug
from benchmarks.kernels import ops, sustained
from benchmarks.step import e2e

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO_ROOT / "benchmarks"
# Every script, by module, with options its --help must name.
SCRIPT_OPTIONS = {
    "benchmarks.kernels.ops": ("--impls", "--out", "--merge", "--section"),
    "benchmarks.kernels.sustained": ("--impls", "--out", "--merge"),
    "benchmarks.kernels.optimizer": ("--impls", "--out"),
    "benchmarks.kernels.loss_skip": ("--budget-s", "--out"),
    "benchmarks.kernels.loss_launch_settings": ("--parts", "--tag"),
    "benchmarks.kernels.norm_launch_settings": ("--ops", "--shapes"),
    "benchmarks.kernels.float8_gated_launch_settings": ("--shapes", "--json"),
    "benchmarks.kernels.cross_entropy_ab": ("others",),
    "benchmarks.kernels.cross_entropy_bounds": ("--out",),
    "benchmarks.kernels.host_profile": ("--cases",),
    "benchmarks.step.e2e": ("--impls", "--out", "--merge", "--section"),
    "benchmarks.step.trainer_step": ("--variants", "--tiny", "--out"),
    "benchmarks.step.dpo": ("--impls", "--tiny", "--pairs", "--out"),
    "benchmarks.step.grpo": ("--variants", "--tiny", "--prompts", "--completion-tokens", "--out"),
    "benchmarks.step.generation": ("--variants", "--tiny", "--prompts", "--completion-tokens", "--profile"),
    "benchmarks.step.memory_estimate": ("--configs", "--out"),
    "benchmarks.step.memory_plans": ("--variants", "--memory-gib", "--tiny", "--out", "--merge"),
    "benchmarks.kernels.attention": ("--out",),
    "benchmarks.kernels.decode_attention": ("--out",),
    "benchmarks.service.jobs": ("--variants", "--out"),
    "benchmarks.service.load": ("--clients", "--out"),
    "benchmarks.service.lifecycle": ("--cases",),
    "benchmarks.service.object_store_clients": ("--endpoint",),
    "benchmarks.scaling.gpus": ("--nproc", "--cpu-smoke", "--out"),
    "benchmarks.quality.precision": ("--tiny", "--lrs", "--out"),
    "benchmarks.quality.float8": ("--tiny", "--lrs", "--impls", "--out"),
    "benchmarks.models.families_share": ("--model-types", "--out"),
    "benchmarks.serving.chat_throughput": ("--requests", "--new-tokens", "--arrival-s", "--tiny", "--out"),
    "benchmarks.serving.engine_host_step": ("--temperature", "--top-p"),
    "benchmarks.summary": ("--results", "--merge-in"),
}


def test_every_script_is_covered():
    scripts = {
        ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)
        for path in BENCHMARKS.rglob("*.py")
        if path.name != "__init__.py"
    }
    library = {"benchmarks.harness", "benchmarks.workloads"}
    assert scripts - library == set(SCRIPT_OPTIONS)


@pytest.mark.parametrize("module", sorted(SCRIPT_OPTIONS))
def test_help_runs_without_a_gpu(module):
    completed = subprocess.run(
        [sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT
    )
    assert completed.returncode == 0, completed.stderr
    for option in SCRIPT_OPTIONS[module]:
        assert option in completed.stdout, (module, option)


def test_unknown_op_is_refused():
    with pytest.raises(SystemExit):
        ops.parse_args(["--ops", "rms_norm,not_an_op"])


@pytest.mark.parametrize(
    ("device_name", "slug"),
    [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100")],
)
def test_gpu_slug(device_name, slug):
    assert gpu_slug(device_name) == slug


# Floors quoted in ANCHORS.md for the H100 run (copy 3012 GB/s, bf16 matmul 723 TFLOP/s), fwd+bwd.
ANCHOR_CEILINGS = {"copy_GBps": 3012.0, "bf16_matmul_TFLOPs": 723.0}


@pytest.mark.parametrize(
    ("op", "shape", "anchor_floor_ms"),
    [
        ("rms_norm", {"T": 16384, "H": 4096}, 0.178),
        ("rope", {"B": 8, "S": 2048, "Hq": 32, "Hkv": 8, "D": 128}, 0.223),
        ("swiglu_mlp", {"T": 8192, "H": 4096, "I": 14336}, 11.97),
        ("cross_entropy", {"T": 8192, "V": 128256}, 1.395),
        ("fused_linear_cross_entropy", {"T": 8192, "H": 4096, "V": 128256}, 35.7),
    ],
)
def test_floors_match_anchors(op, shape, anchor_floor_ms):
    floor = ops.floor_ms(op, shape, "fwd+bwd", ANCHOR_CEILINGS)
    assert floor == pytest.approx(anchor_floor_ms, rel=0.01)


def test_cases_cover_the_required_shapes():
    cases = ops.enumerate_cases(list(ops.OPS), list(ops.IMPLS), "all", tiny=False)
    keys = {(case.op, json.dumps(case.shape, sort_keys=True), case.impl) for case in cases}
    assert ("rms_norm", json.dumps({"H": 32768, "T": 65536}, sort_keys=True), "compile") in keys
    assert ("cross_entropy", json.dumps({"T": 65536, "V": 256000}, sort_keys=True), "liger") in keys
    assert (
        "fused_linear_cross_entropy",
        json.dumps({"H": 4096, "T": 1024, "V": 151936}, sort_keys=True),
        "hf",
    ) in keys
    quick = ops.enumerate_cases(list(ops.OPS), list(ops.IMPLS), "none", tiny=False)
    assert {case.set_name for case in quick} == {"main"}


def test_results_file_keeps_the_anchor_format_and_renders():
    case = ops.Case("rms_norm", {"T": 16384, "H": 4096}, "fusetune", "main")
    rows = [ops.measured_row(case, mode, 0.2, ANCHOR_CEILINGS) for mode in ops.MODES]
    rows[-1]["peak_extra_mb"] = 128.0
    rows += ops.error_rows(ops.Case("rms_norm", case.shape, "liger", "main"), "not installed", None, True)
    meta = {
        "gpu": "NVIDIA H100 80GB HBM3",
        "date": "2026-11-23",
        "versions": {"fusetune": "abc"},
        "ceilings": ANCHOR_CEILINGS,
    }
    payload = ops.results_payload(meta, rows, None, ["rms_norm"])
    assert {"gpu", "date", "versions", "ceilings", "rows"} <= payload.keys()
    total = next(row for row in payload["rows"] if row["mode"] == "fwd+bwd" and row["impl"] == "fusetune")
    assert {"op", "mode", "impl", "dtype", "shape", "ms", "peak_extra_mb", "floor_ms"} <= total.keys()
    assert total["floor_ratio"] == pytest.approx(0.2 / total["floor_ms"], rel=1e-3)
    markdown = ops.render_markdown(payload)
    assert "## rms_norm: T=16384, H=4096" in markdown and "skipped: not installed" in markdown


def test_e2e_configs_have_the_stated_shapes():
    family, fields = workloads.MODEL_SHAPES["llama-3.2-1b-shape"]
    assert family == "llama"
    assert (fields["hidden_size"], fields["intermediate_size"], fields["num_hidden_layers"]) == (
        2048,
        8192,
        16,
    )
    assert (fields["num_attention_heads"], fields["num_key_value_heads"], fields["vocab_size"]) == (
        32,
        8,
        128256,
    )
    assert fields["tie_word_embeddings"] and fields["rope_theta"] == 500000.0


def test_merge_keeps_rows_of_ops_not_rerun():
    meta = {"gpu": "g", "date": "d", "versions": {"fusetune": "new"}, "ceilings": ANCHOR_CEILINGS}
    old_rows = [
        ops.measured_row(ops.Case(op, {"T": 8, "H": 8}, "hf", "main"), "fwd", 1.0, ANCHOR_CEILINGS)
        for op in ("rms_norm", "layer_norm")
    ]
    previous = ops.results_payload(
        {**meta, "versions": {"fusetune": "old"}}, old_rows, None, ["rms_norm", "layer_norm"]
    )
    new_row = ops.measured_row(
        ops.Case("layer_norm", {"T": 8, "H": 8}, "hf", "main"), "fwd", 2.0, ANCHOR_CEILINGS
    )
    merged = ops.results_payload(meta, [new_row], previous, ["layer_norm"])
    assert [(row["op"], row["ms"]) for row in merged["rows"]] == [("rms_norm", 1.0), ("layer_norm", 2.0)]
    assert [run["ops"] for run in merged["runs"]] == [["rms_norm"], ["layer_norm"]]

    # a sweep of an op replaces its earlier sweep rows only: the main-shape rows stay
    sweep_row = ops.measured_row(
        ops.Case("rms_norm", {"T": 16, "H": 8}, "hf", "sweep"), "fwd+bwd", 3.0, ANCHOR_CEILINGS
    )
    swept = ops.results_payload(meta, [sweep_row], merged, ["rms_norm"])
    assert [(row["op"], row["set"], row["ms"]) for row in swept["rows"]] == [
        ("rms_norm", "main", 1.0), ("layer_norm", "main", 2.0), ("rms_norm", "sweep", 3.0)
    ]  # fmt: skip


def test_service_benchmark_variants_are_checked():
    from benchmarks.service import jobs

    args = jobs.parse_args(["--variants", "kernels=on,precision=bf16-mixed; kernels=off,batch_size=auto"])
    assert args.variant_hyper == [
        ("kernels=on,precision=bf16-mixed", {"kernels": True, "precision": "bf16-mixed"}),
        ("kernels=off,batch_size=auto", {"kernels": False, "batch_size": "auto"}),
    ]
    with pytest.raises(SystemExit):
        jobs.parse_args(["--variants", "kernel=on"])
    with pytest.raises(SystemExit):
        jobs.parse_args(["--variants", "kernels=maybe"])


def test_memory_plan_variants_name_every_part_of_the_plan():
    from benchmarks.step.memory_plans import parse_plan

    assert parse_plan("bf16-sr-8bit/r26/o6/ib1/m1/h1") == {
        "precision": "bf16-sr-8bit", "recompute_layers": 26, "offload_layers": 6, "optimizer_in_backward": True,
        "micro_batch_size": 1, "optimizer_state_on_host": True,
    }  # fmt: skip
    assert "optimizer_state_on_host" not in parse_plan("fp8-8bit/r0/o0/ib0/m1") and parse_plan("auto") == {}


def test_service_benchmark_data_has_the_asked_length_spread():
    from fusetune.demo.assets import build_tokenizer

    _, lengths = workloads.chat_examples(200, 620, seed=0, tokenizer=build_tokenizer())
    mean = sum(lengths) / len(lengths)
    assert 0.85 * 620 < mean < 1.15 * 620 and max(lengths) <= 3 * 620 + 64 and min(lengths) < 0.6 * 620


def test_e2e_profile_summary_counts_busy_time_once_and_finds_the_idle_gaps():
    """Overlapping kernels count once toward busy time; the gap after the last covering kernel is idle."""
    events = [
        {"ph": "X", "cat": "kernel", "ts": 0, "dur": 1000, "name": "nvjet_sm90_gemm"},
        {"ph": "X", "cat": "kernel", "ts": 500, "dur": 1000, "name": "_rms_norm_fwd_kernel"},  # overlaps
        {"ph": "X", "cat": "cpu_op", "ts": 2000, "dur": 50000, "name": "aten::mm"},  # host op: ignored
        {"ph": "X", "cat": "kernel", "ts": 10000, "dur": 5000, "name": "flash_fwd"},
    ]
    summary = e2e.summarize_trace(events)
    assert (summary["gpu_span_ms"], summary["gpu_busy_ms"], summary["gpu_idle_ms"]) == (15.0, 6.5, 8.5)
    assert summary["largest_gaps"] == [{"us": 8500.0, "after": "_rms_norm_fwd_kernel"}]
    assert summary["by_category_ms"] == {"attention": 5.0, "gemm": 1.0, "rms-norm": 1.0}
    rows = [{"model": "m", "impl": "fusetune", "profile": {**summary, "memory": {"forward_peak_gb": 1.0}}}]
    assert "## Profile of one step: m" in "\n".join(e2e.render_profiles(rows))


def test_backward_peak_replay_finds_the_largest_rise_and_what_was_live_then(tmp_path):
    """Frees of blocks from before the history count against the rise; the blocks live at the peak are grouped
    by their innermost frame outside torch, with its source line."""
    source = tmp_path / "compiled_layer.py"
    source.write_text("def call():\n    buf3 = empty_strided_cuda((16384, 9216))\n    buf4 = mm(buf3)\n")
    inside_torch = {"filename": "/site-packages/torch/autograd/graph.py", "line": 9, "name": "backward"}

    def frames(line: int) -> list[dict]:
        return [{"filename": str(source), "line": line, "name": "call"}, inside_torch]

    mib = 2**20
    events = [
        {"action": "free_requested", "addr": 1, "size": 100 * mib},  # an activation from the forward
        {"action": "alloc", "addr": 10, "size": 60 * mib, "frames": frames(2)},
        {"action": "alloc", "addr": 11, "size": 60 * mib, "frames": frames(2)},
        {"action": "alloc", "addr": 12, "size": 50 * mib, "frames": frames(3)},  # the peak: +70 MiB
        {"action": "free_requested", "addr": 12, "size": 50 * mib},
        {"action": "free_requested", "addr": 2, "size": 300 * mib},
        {"action": "alloc", "addr": 13, "size": 200 * mib, "frames": [inside_torch]},  # lower: -110 MiB
    ]
    peak = e2e.live_blocks_at_peak(events)
    assert peak["rise_gb"] == round(70 / 1024, 3) and peak["events_before_peak"] == 3
    assert [(g["site"], g["blocks"]) for g in peak["groups"]] == [
        ("compiled_layer.py:2 call: buf3 = empty_strided_cuda((16384, 9216))", 2),
        ("compiled_layer.py:3 call: buf4 = mm(buf3)", 1),
    ]
    assert e2e.allocation_site([inside_torch]) == "torch internals"
    summary = {"memory": {"forward_peak_gb": 1.0}, "backward_peak_blocks": peak, **e2e.summarize_trace(
        [{"ph": "X", "cat": "kernel", "ts": 0, "dur": 10, "name": "k"}])}  # fmt: skip
    rendered = "\n".join(e2e.render_profiles([{"model": "m", "impl": "fusetune", "profile": summary}]))
    assert "0.068 GB over what the forward left" in rendered and "buf4 = mm(buf3)" in rendered


def test_dpo_benchmark_arguments_are_checked():
    from benchmarks.step import dpo

    args = dpo.parse_args(["--impls", "fusetune, trl+liger"])
    assert args.impl_list == ["fusetune", "trl+liger"] and (args.pairs, args.seq) == (4, 2048)
    assert dpo.parse_args(["--tiny"]).seq == 64
    assert dpo.parse_args(["--tiny", "--seq", "128"]).seq == 128
    for bad in (["--impls", "fusetune,hf"], ["--impls", ","], ["--pairs", "0"], ["--seq", "16"],
                ["--perturbation", "0"], ["--beta", "-1"], ["--warmup-steps", "-1"]):  # fmt: skip
        with pytest.raises(SystemExit):
            dpo.parse_args(bad)


def test_sustained_shapes_are_parsed_and_bad_ones_named():
    assert sustained.parse_shape("T=8192,H=1536,V=256000,softcap=30") == {
        "T": 8192,
        "H": 1536,
        "V": 256000,
        "softcap": 30,
    }
    assert sustained.parse_shape("T=16,softcap=7.5")["softcap"] == 7.5
    with pytest.raises(argparse.ArgumentTypeError, match="H is not a number"):
        sustained.parse_shape("T=16,H=big")
    with pytest.raises(argparse.ArgumentTypeError, match="expected KEY=VALUE"):
        sustained.parse_shape("T=16,4096")
    for bad in (["--ops", "cross_entropy,not_an_op"], ["--calls", "0"], ["--settle-s", "-1"]):
        with pytest.raises(SystemExit):
            sustained.parse_args(bad)


def test_sustained_clock_summary_counts_power_capped_samples_in_the_window():
    sampler = sustained.ClockSampler()
    sampler.samples = [
        (1.0, 1980.0, 130.0, 0x0),  # before the window
        (2.0, 1980.0, 300.0, 0x0),
        (3.0, 1400.0, 700.0, 0x4),
        (4.0, 1300.0, 699.0, 0x4 | 0x1),
        (9.0, 345.0, 70.0, 0x1),  # after it
    ]
    summary = sampler.summary(2.0, 4.0)
    assert summary["samples"] == 3
    assert summary["sm_mhz_median"] == 1400.0
    assert (summary["sm_mhz_min"], summary["sm_mhz_max"]) == (1300.0, 1980.0)
    assert summary["power_capped_share"] == pytest.approx(2 / 3, abs=1e-3)
    assert sampler.summary(5.0, 6.0) is None


def test_sustained_smoke_on_cpu_writes_rows_in_the_kernel_format_and_merges(tmp_path):
    common = [
        "--device",
        "cpu",
        "--ops",
        "cross_entropy",
        "--impls",
        "hf,fusetune",
        "--calls",
        "2",
        "--settle-s",
        "0",
    ]
    common += ["--out", str(tmp_path), "--gpu-slug", "test"]
    assert sustained.main([*common, "--shape", "T=8,V=600"]) == 0
    assert sustained.main([*common, "--shape", "T=8,V=700", "--merge"]) == 0
    payload = json.loads((tmp_path / "test-kernels.json").read_text())["sections"]["sustained"]
    assert [group["shape"] for group in payload["groups"]] == [{"T": 8, "V": 600}, {"T": 8, "V": 700}]
    rows = payload["rows"]
    assert sorted((row["shape"]["V"], row["impl"]) for row in rows) == [
        (600, "fusetune"),
        (600, "hf"),
        (700, "fusetune"),
        (700, "hf"),
    ]
    for row in rows:
        assert row["mode"] == "fwd+bwd" and row["ms"] > 0 and row["ms_p10"] <= row["ms_p90"]
        assert len(row["ms_by_pass"]) == 2 and row["calls"] == 4
    markdown = sustained.render_markdown(payload)
    assert "## cross_entropy: T=8, V=700" in markdown


def test_sustained_records_unavailable_and_failing_implementations_and_times_the_rest(monkeypatch):
    import dataclasses

    import torch

    real_build = sustained.build_workload

    def build(case, env):
        if case.impl == "liger":
            raise ops.Unavailable("liger-kernel not installed")
        workload = real_build(case, env)
        if case.impl == "compile":  # built, but its call fails

            def broken():
                raise RuntimeError("the call failed here")

            return dataclasses.replace(workload, forward=broken)
        return workload

    monkeypatch.setattr(sustained, "build_workload", build)
    args = sustained.parse_args(["--device", "cpu", "--calls", "2", "--settle-s", "0"])
    env = ops.Env(device="cpu", dtype=torch.bfloat16)
    rows = sustained.measure_shape(
        "cross_entropy",
        {"T": 4, "V": 50},
        ["hf", "compile", "liger"],
        env,
        args,
        None,
        sustained.ClockSampler(),
    )
    by_impl = {row["impl"]: row for row in rows}
    assert by_impl["liger"]["skipped"] and "liger-kernel not installed" in by_impl["liger"]["error"]
    assert "the call failed here" in by_impl["compile"]["error"] and "skipped" not in by_impl["compile"]
    assert "ms" not in by_impl["compile"] and "ms" not in by_impl["liger"]
    assert by_impl["hf"]["ms"] > 0 and by_impl["hf"]["calls"] == 4
