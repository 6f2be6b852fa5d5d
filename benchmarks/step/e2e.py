"""End-to-end training benchmark: tokens/s, MFU and peak memory of real model shapes with random weights.

Each model is built from its architecture's config (no download), in bf16, and trained on random tokens
(labels = input ids) with torch.optim.AdamW(fused=True): the median step time of `--steps` steps after
`--warmup-steps` warm-up steps. Implementations:

    hf                Hugging Face eager
    compile           torch.compile(model)
    liger             liger_kernel's apply_liger_kernel_to_<family>(rope, rms_norm, swiglu/geglu,
                      fused_linear_cross_entropy), applied before the model is built
    fusetune          AutoFusedModelForCausalLM.from_config (apply_fusetune on the built model)
    fusetune+compile  the same, then torch.compile(model)
    fusetune+fp8      fusetune with the fp8 precision mode's float8 linear layers (fusetune/worker/train/float8.py,
                      its recipe, tensorwise), each decoder layer compiled in place, as the trainer runs them;
                      with --optimizer fusetune-adamw the weights' scales from the optimizer's block maxima, as well
    fusetune+fp8-tensorwise   the same, the recipe named (rows from before tensorwise became the mode's recipe)
    fusetune+fp8-rowwise      the same with the rowwise recipe (what fusetune+fp8 ran before; each fp8 row
                              records its recipe, and the markdown shows it beside the impl)
    fusetune+fp8-gw-bf16      the same with rowwise scaling and the weight gradients in bf16 (rowwise_with_gw_hp)
    fusetune+fp8-cudagraphs   fusetune+fp8 with each compiled layer replayed as CUDA graphs (torch.compile's
                              "reduce-overhead"): float8 doubles a step's kernels, and at 1 x 4,096 tokens of the
                              8B shape the GPU waited 26 ms more a step between them than in bf16 (h200-step.md)
    fusetune+fp8-cpp-wrapper  fusetune+fp8 with Inductor's C++ wrapper (torch._inductor.config.cpp_wrapper): each
                              compiled layer launches its kernels from C++ instead of Python. At 1 x 4,096 tokens of
                              the 8B shape a float8 step ran 4,155 kernels (bf16: 2,107) and left the GPU idle
                              33 ms of 330 (bf16: 6), in 426 gaps over 20 us (h200-step.md, e2e-fp8-recipes).
                              Measured: 13,479 tokens/s against fusetune+fp8's 13,392, with the GPU idle 9.9 and
                              9.3 ms a step (e2e-fp8-8b-launch): the launches do not bound the step
    fusetune+fp8-max-autotune fusetune+fp8 compiled in torch.compile's "max-autotune-no-cudagraphs" mode: Inductor
                              times variants of its fused cast and reduction kernels (and of the matmuls). At the
                              8B shape it had not finished compiling when the call's 470 s ran out
    fusetune+fp8-weight-passes  fusetune+fp8 with each weight's float8 scale from a pass over the weight at every
                              cast (torchao's), not from the block maxima FusedAdamW keeps (--optimizer
                              fusetune-adamw rows; the trainer's fp8 mode keeps them)
    fusetune+fp8-memory-budget  fusetune+fp8 with the compiler's activation memory budget at --fp8-memory-budget
                              (0.9 unless given; the row records it) of what its
                              partitioner would save (torch._functorch.config.activation_memory_budget): it
                              recomputes the cheapest saved activations instead; fp8 held 0.5-1.0 GB more than
                              bf16 at the 1-3B shapes (h200-step.md, e2e-fp8). At the Gemma-2-2B shape 0.97 and
                              0.9 kept the same (40.7 GB, 4% slower than without a budget, e2e-fp8-gemma-budget-97);
                              the fp8 mode's MLP node (float8_mlp.py) took the excess away without that cost

`--optimizer fusetune-adamw` steps every row with fusetune.kernels.FusedAdamW (bf16-sr's and fp8's optimizer)
instead of torch's fused AdamW, for rows that compare with a bf16-sr job.

Every (model, impl) pair runs in a fresh subprocess, so no monkey-patch or compiled graph leaks into the
next. Results go to the section "e2e" of `benchmarks/results/<gpu-slug>-step.json` (rows in the format of
shared/ANCHORS.md; `--section` keeps a variant's run beside it, e2e-packed say).

    python3 -m benchmarks.step.e2e
    python3 -m benchmarks.step.e2e --models llama-3.2-1b-shape --impls hf,liger,fusetune --steps 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.harness import GIB, format_cell, markdown_table, short_error
from benchmarks.workloads import MODEL_SHAPES, SINGLE_GPU_MODELS, build_config

RESULTS = harness.Benchmark("e2e", topic="step")
IMPLS = (
    "hf",
    "compile",
    "liger",
    "fusetune",
    "fusetune+compile",
    "fusetune+fp8",
    "fusetune+fp8-tensorwise",
    "fusetune+fp8-rowwise",
    "fusetune+fp8-gw-bf16",
    "fusetune+fp8-cudagraphs",
    "fusetune+fp8-cpp-wrapper",
    "fusetune+fp8-max-autotune",
    "fusetune+fp8-weight-passes",
    "fusetune+fp8-memory-budget",
)
# impl -> its float8 recipe; fusetune+fp8's is the mode's (float8.RECIPE, which tests/benchmarks check it against)
FLOAT8_IMPLS = {
    "fusetune+fp8": "tensorwise",
    "fusetune+fp8-rowwise": "rowwise",
    "fusetune+fp8-tensorwise": "tensorwise",
    "fusetune+fp8-gw-bf16": "rowwise_with_gw_hp",
    "fusetune+fp8-cudagraphs": "tensorwise",
    "fusetune+fp8-cpp-wrapper": "tensorwise",
    "fusetune+fp8-max-autotune": "tensorwise",
    "fusetune+fp8-weight-passes": "tensorwise",
    "fusetune+fp8-memory-budget": "tensorwise",
}
# impls whose compiled float8 layers may keep only --fp8-memory-budget of the partitioner's saved activations
FLOAT8_MEMORY_BUDGETS = ("fusetune+fp8-memory-budget",)
# impl -> torch.compile's mode for its float8 layers (the default otherwise)
FLOAT8_COMPILE_MODES = {
    "fusetune+fp8-cudagraphs": "reduce-overhead",
    "fusetune+fp8-max-autotune": "max-autotune-no-cudagraphs",
}
# impl -> Inductor settings of its subprocess
FLOAT8_INDUCTOR_SETTINGS = {"fusetune+fp8-cpp-wrapper": {"cpp_wrapper": True}}
OPTIMIZERS = ("torch-adamw", "fusetune-adamw")

LIGER_PATCHES = {
    "llama": ("apply_liger_kernel_to_llama", "swiglu"),
    "qwen2": ("apply_liger_kernel_to_qwen2", "swiglu"),
    "gemma2": ("apply_liger_kernel_to_gemma2", "geglu"),
    "olmo2": ("apply_liger_kernel_to_olmo2", "swiglu"),
    "granite": ("apply_liger_kernel_to_granite", "swiglu"),
    "smollm3": ("apply_liger_kernel_to_smollm3", "swiglu"),
}
# Liger-Kernel's loss per family where it is not the fused linear cross-entropy: Granite's function refuses it
# (its logits are scaled), so Liger's Granite runs its cross-entropy on the built logits.
LIGER_LOSS = {"granite": {"fused_linear_cross_entropy": False, "cross_entropy": True}}

METHOD = (
    "bf16 weights, random init (seed 0), random token ids, labels = input ids, torch.optim.AdamW(fused=True, "
    "lr=1e-5); step = forward with labels + loss.backward() + optimizer.step() + zero_grad(set_to_none=True); "
    "step time from torch.cuda.synchronize() to torch.cuda.synchronize(), median of the timed steps after "
    "the warm-up steps (compilation happens there); tokens_per_s = batch*seq / median step time; "
    "peak_alloc_gb = torch.cuda.max_memory_allocated() over the whole process (weights, gradients, optimizer "
    "state, activations) / 2**30 (GiB; peak_alloc_bytes has the exact count). Each (model, impl) runs in a fresh process."
)


def attention_implementation(requested: str, family: str, device: str) -> str:
    """sdpa where transformers allows it. Gemma 2 refuses sdpa (attention softcapping), so it gets
    flex_attention on a GPU (memory-efficient, softcap kept) and eager on a CPU."""
    if requested != "auto":
        return requested
    if family == "gemma2":
        return "flex_attention" if device == "cuda" else "eager"
    return "sdpa"


def matmul_parameter_count(model: Any) -> int:
    unique = {id(p): p.numel() for p in model.parameters()}
    total = sum(unique.values())
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    tied = output is not None and output.weight is embedding
    return total if tied else total - embedding.numel()


def flops_per_token(model: Any, config: Any, seq: int) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * head_dim * seq
    return 6 * matmul_parameter_count(model) + attention


def _count_modules_from(model: Any, package: str) -> int:
    count = 0
    for module in model.modules():
        forward = getattr(type(module), "forward", None)
        if type(module).__module__.startswith(package) or getattr(forward, "__module__", "").startswith(
            package
        ):
            count += 1
    return count


# ---------------------------------------------------------------------------------------------------------
# Worker: one (model, impl) in this process.


def train_one(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import transformers

    model_name, impl, device = spec["model"], spec["impl"], spec["device"]
    family = MODEL_SHAPES[model_name][0]
    row: dict[str, Any] = {"model": model_name, "impl": impl, "batch": spec["batch"], "seq": spec["seq"]}
    row.update(optimizer_field(spec.get("optimizer")))
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    config = build_config(model_name, spec["tiny"])
    attn = attention_implementation(spec["attn"], family, device)
    row["attn_implementation"] = attn  # replaced below by what the built model runs

    build_kwargs = {"dtype": torch.bfloat16, "attn_implementation": attn}
    if impl == "liger":
        try:
            import liger_kernel.transformers as liger_transformers
        except ImportError as error:
            return {
                **row,
                "error": f"skipped: liger-kernel not installed ({short_error(error, 120)})",
                "skipped": True,
            }
        patch_name, mlp_option = LIGER_PATCHES[family]
        loss = LIGER_LOSS.get(family, {"fused_linear_cross_entropy": True, "cross_entropy": False})
        row["liger_loss"] = (
            "fused_linear_cross_entropy" if loss["fused_linear_cross_entropy"] else "cross_entropy"
        )
        getattr(liger_transformers, patch_name)(rope=True, rms_norm=True, **loss, **{mlp_option: True})
    with torch.device(device):
        if impl.startswith("fusetune"):
            try:
                from fusetune.models import AutoFusedModelForCausalLM, fusetune_handle
            except ImportError as error:
                return {
                    **row,
                    "error": f"skipped: fusetune.models not importable ({short_error(error, 160)})",
                    "skipped": True,
                }
            model = AutoFusedModelForCausalLM.from_config(
                config,
                rope=True,
                rms_norm=True,
                swiglu=True,
                fused_linear_cross_entropy=True,
                strict=True,
                **build_kwargs,
            )
            handle = fusetune_handle(model)
            row["patched"] = dict(handle.patched) if handle is not None else {}
            if handle is not None and handle.source == "structure":  # no row in the table: recognised
                row["patched_by"], row["left"] = "structure", dict(handle.left)
            if spec.get("loss_chunk") == "liger":
                # The loss as it chunked before its budget grew: Liger-Kernel's chunk rows, no extra bytes.
                import fusetune.kernels.fused_linear_cross_entropy as flce_module

                flce_module.DEFAULT_EXTRA_CHUNK_BYTES = 0
                row["loss_chunk"] = "liger"
            if not row["patched"]:
                return {**row, "error": "apply_fusetune replaced nothing in this model"}
        else:
            model = transformers.AutoModelForCausalLM.from_config(config, **build_kwargs)
    if impl == "liger":
        row["patched"] = {"liger_modules": _count_modules_from(model, "liger_kernel")}
        if not row["patched"]["liger_modules"]:
            return {**row, "error": "the Liger patch replaced no module of this model"}
    model.to(device=device, dtype=torch.bfloat16)
    model.train()
    row["attn_implementation"] = model.config._attn_implementation  # what ran (a patch may switch it)
    if spec.get("gradient_checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        row["gradient_checkpointing"] = True
    row["params"] = sum(p.numel() for p in model.parameters())
    # A token of a packed row attends within its document: the attention term counts the document's length.
    row["flops_per_token"] = flops_per_token(model, config, spec.get("packed_length") or spec["seq"])

    if impl in FLOAT8_IMPLS:
        from fusetune.worker.train.float8 import convert_linears, float8_config

        recipe = FLOAT8_IMPLS[impl]
        if impl in FLOAT8_MEMORY_BUDGETS:  # this row's subprocess only
            import torch._functorch.config as partitioner_config

            partitioner_config.activation_memory_budget = spec["fp8_memory_budget"]
        if impl in FLOAT8_INDUCTOR_SETTINGS:
            import torch._inductor.config as inductor_config

            for name, value in FLOAT8_INDUCTOR_SETTINGS[impl].items():
                setattr(inductor_config, name, value)
        # Each decoder layer compiled on its own (eager float8 runs its casts as separate kernels; a whole 8B
        # model under torch.compile with float8 did not compile within 140 s, shared/PLATFORM.md).
        conversion = convert_linears(
            model,
            float8_config(recipe, emulate=device != "cuda"),
            recipe,
            compile_layers=device == "cuda" and spec.get("fp8_compile_layers", True),
            compile_mode=FLOAT8_COMPILE_MODES.get(impl),
        )
        row["float8"] = {"recipe": recipe, "converted": len(conversion.converted), "left": conversion.left,
                         "compiled_layers": conversion.compiled_layers,
                         "compile_mode": FLOAT8_COMPILE_MODES.get(impl),
                         "inductor_settings": FLOAT8_INDUCTOR_SETTINGS.get(impl),
                         "activation_memory_budget":
                             spec["fp8_memory_budget"] if impl in FLOAT8_MEMORY_BUDGETS else None}  # fmt: skip
    if spec.get("optimizer") == "fusetune-adamw":
        from fusetune.kernels import FusedAdamW

        optimizer = FusedAdamW(model.parameters(), lr=1e-5, seed=0)
        if impl in FLOAT8_IMPLS and impl != "fusetune+fp8-weight-passes":
            from fusetune.worker.train.float8 import weight_scales_from_optimizer

            row["float8"]["weight_maxima_layers"] = weight_scales_from_optimizer(model, optimizer)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    step_model = torch.compile(model) if impl in ("compile", "fusetune+compile") else model

    generator = torch.Generator(device=device).manual_seed(1)
    total_steps = spec["warmup_steps"] + spec["steps"]
    batches = [
        torch.randint(0, config.vocab_size, (spec["batch"], spec["seq"]), device=device, generator=generator)
        for _ in range(total_steps)
    ]

    def synchronize() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    # --packed-length N: each row holds documents of N tokens, as packed training rows do; position_ids restart
    # at every document, from which the model builds attention that stays inside each document.
    # The sequence boundaries go to every implementation the way transformers' flash-attention path takes
    # them (cu_seq_lens_q...); sdpa ignores them and keeps documents apart with a mask, fusetune's varlen
    # attention skips what lies across documents. use_cache=False, as training does: with a cache transformers
    # builds no packed mask, and documents would attend to each other.
    extra: dict[str, Any] = {"use_cache": False}
    if spec.get("packed_length"):
        from fusetune.models.attention import packed_sequence_kwargs

        positions = (torch.arange(spec["seq"]) % spec["packed_length"]).expand(spec["batch"], -1)
        extra["position_ids"] = positions.to(device)
        boundaries = packed_sequence_kwargs(positions)
        for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
            boundaries[key] = boundaries[key].to(device)
        extra.update(boundaries)
        row["packed_length"] = spec["packed_length"]

    # --untrained-fraction f: the first f of every document has no label (a chat prompt), as in SFT data.
    untrained = None
    if spec.get("untrained_fraction"):
        document = spec.get("packed_length") or spec["seq"]
        positions = torch.arange(spec["seq"], device=device) % document
        untrained = positions < int(spec["untrained_fraction"] * document)
        row["untrained_fraction"] = spec["untrained_fraction"]

    def labels_of(input_ids: Any) -> Any:
        return input_ids if untrained is None else input_ids.masked_fill(untrained, -100)

    # CUDA graphs (torch.compile's reduce-overhead) replay into memory of their own: a step begins a new
    # replay, after which the last step's outputs may be overwritten (its loss is kept as a copy).
    cuda_graphs = device == "cuda" and FLOAT8_COMPILE_MODES.get(impl) == "reduce-overhead"
    step_seconds, losses = [], []
    for input_ids in batches:
        synchronize()
        started = time.perf_counter()
        if cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        loss = step_model(input_ids=input_ids, labels=labels_of(input_ids), **extra).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize()
        step_seconds.append(time.perf_counter() - started)
        losses.append(loss.detach().clone())
        print(f"    step {len(step_seconds)}/{total_steps}: {step_seconds[-1] * 1e3:.1f} ms", flush=True)
    losses = [float(loss) for loss in losses]
    timed = step_seconds[spec["warmup_steps"] :]
    step_s = statistics.median(timed)
    tokens_per_s = spec["batch"] * spec["seq"] / step_s
    row.update(
        tokens_per_s=round(tokens_per_s, 1),
        peak_alloc_gb=round(torch.cuda.max_memory_allocated() / GIB, 2) if device == "cuda" else None,
        peak_alloc_bytes=torch.cuda.max_memory_allocated() if device == "cuda" else None,
        mfu=None,
        step_ms=round(step_s * 1e3, 2),
        step_ms_min=round(min(timed) * 1e3, 2),
        step_ms_max=round(max(timed) * 1e3, 2),
        first_loss=round(losses[0], 4),
        last_loss=round(losses[-1], 4),
        steps=spec["steps"],
        warmup_steps=spec["warmup_steps"],
    )
    peak = spec.get("peak_tflops")
    if peak:
        row["mfu"] = round(tokens_per_s * row["flops_per_token"] / (peak * 1e12), 4)
    if not all(map(_finite, losses)):
        row["error"] = f"non-finite loss {losses}"
    if spec.get("profile") and device == "cuda":
        # After the row's peak is read: the profile resets the peak counter per phase.
        kept = spec.get("profile_kernels", MARKDOWN_KERNELS)
        row["profile"] = profile_step(step_model, optimizer, batches[-1], labels_of(batches[-1]), extra, kept)
    return row


# ---------------------------------------------------------------------------------------------------------
# Profile of one step (--profile): where the GPU time goes, where it idles, where the memory peak sits.

# Kernels of a profile in the markdown (the results file keeps --profile-kernels of them).
MARKDOWN_KERNELS = 15

KERNEL_CATEGORIES = (
    # (category, substrings of the kernel name, lower case); the first match wins
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "sm80_")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("cross-entropy", ("cross_entropy", "logsumexp", "_ce_", "flce", "_lse")),
    ("rms-norm", ("rms_norm", "rmsnorm", "_norm_")),
    ("rope", ("rope", "rotary")),
    ("gated-activation", ("gated", "swiglu", "geglu", "silu", "gelu")),
    ("copy/fill", ("copy", "fill", "memcpy", "memset", "cat", "index")),
    ("reduce", ("reduce", "sum")),
    ("elementwise", ("elementwise", "vectorized")),
)


def kernel_category(name: str) -> str:
    lowered = name.lower()
    for category, needles in KERNEL_CATEGORIES:
        if any(needle in lowered for needle in needles):
            return category
    return "other"


def profile_step(
    step_model: Any, optimizer: Any, input_ids: Any, labels: Any, extra: dict[str, Any], top: int = 15
) -> dict[str, Any]:
    """One more training step, measured twice: first the memory of each phase (peak allocated during the
    forward, held after it, peak during the backward and the optimizer step) and the blocks the backward holds
    at its peak (from the allocator's history), then a torch.profiler trace of the same step for the GPU time by
    kernel and the idle gaps of the GPU (host-bound stretches)."""
    import torch

    def phase_peaks() -> tuple[dict[str, float], dict[str, Any]]:
        """The peaks of each phase, and the blocks the backward held at its peak: the backward runs under the
        allocator's history (which records on the host and allocates nothing on the GPU)."""
        peaks: dict[str, float] = {}
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        loss = step_model(input_ids=input_ids, labels=labels, **extra).loss
        torch.cuda.synchronize()
        peaks["forward_peak_gb"] = torch.cuda.max_memory_allocated() / GIB
        peaks["held_after_forward_gb"] = torch.cuda.memory_allocated() / GIB
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
        try:
            loss.backward()
            torch.cuda.synchronize()
            history = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        peaks["backward_peak_gb"] = torch.cuda.max_memory_allocated() / GIB
        torch.cuda.reset_peak_memory_stats()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        peaks["optimizer_peak_gb"] = torch.cuda.max_memory_allocated() / GIB
        backward = live_blocks_at_peak(history["device_traces"][torch.cuda.current_device()])
        return {key: round(value, 3) for key, value in peaks.items()}, backward

    memory, backward_peak = phase_peaks()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        torch.cuda.synchronize()
        loss = step_model(input_ids=input_ids, labels=labels, **extra).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        trace_path = Path(folder) / "trace.json"
        profiler.export_chrome_trace(str(trace_path))
        trace = json.loads(trace_path.read_text())
    return {
        "memory": memory,
        "backward_peak_blocks": backward_peak,
        **summarize_trace(trace.get("traceEvents", []), top),
    }


# Groups of live blocks at the backward's memory peak that a profile keeps (largest first).
MARKDOWN_PEAK_BLOCKS = 12


def allocation_site(frames: list[dict[str, Any]]) -> str:
    """Where a block was allocated: the innermost Python frame outside torch itself (fusetune's, torchao's, a
    model's, or the wrapper Inductor generated for a compiled graph, whose line names the buffer), with the
    source line when it can be read."""
    import linecache

    for frame in frames:
        filename = str(frame.get("filename", ""))
        if "/torch/" in filename or filename.startswith("<") or not filename:
            continue
        line = int(frame.get("line", 0))
        source = linecache.getline(filename, line).strip()
        site = f"{Path(filename).name}:{line} {frame.get('name', '?')}"
        return f"{site}: {source[:100]}" if source else site
    return "torch internals"


def live_blocks_at_peak(events: list[dict[str, Any]], top: int = MARKDOWN_PEAK_BLOCKS) -> dict[str, Any]:
    """Replay an allocator history (torch.cuda.memory._snapshot()["device_traces"][device]): the moment the
    bytes allocated most exceeded those at its start (`rise_gb`; blocks from before, freed during it, count
    against it), and the blocks allocated during it that are live then, grouped by allocation site."""

    def replay(until: int) -> tuple[dict[int, dict[str, Any]], int, int]:
        """(blocks of the history live after event `until`, the largest rise up to it, the event of that)."""
        live: dict[int, dict[str, Any]] = {}
        held = peak = peak_index = 0
        for index, event in enumerate(events[: until + 1]):
            if event.get("action") == "alloc":
                live[event["addr"]] = event
                held += event["size"]
                if held > peak:
                    peak, peak_index = held, index
            elif event.get("action") == "free_requested":
                live.pop(event["addr"], None)
                held -= event["size"]
        return live, peak, peak_index

    _, peak, peak_index = replay(len(events) - 1)
    peak_live, _, _ = replay(peak_index)
    groups: dict[str, list[int]] = {}
    for event in peak_live.values():
        entry = groups.setdefault(allocation_site(event.get("frames") or []), [0, 0])
        entry[0] += event["size"]
        entry[1] += 1
    ranked = sorted(groups.items(), key=lambda item: -item[1][0])
    return {
        "rise_gb": round(peak / GIB, 3),
        "events_before_peak": peak_index,
        "events": len(events),
        "groups": [
            {"site": site, "gb": round(size / GIB, 3), "blocks": count}
            for site, (size, count) in ranked[:top]
        ],
    }


def summarize_trace(events: list[dict[str, Any]], top: int = 15) -> dict[str, Any]:
    """GPU time by kernel and by category, and the GPU's idle time between the first and last kernel."""
    kernels = sorted(
        (float(e["ts"]), float(e.get("dur", 0.0)), e.get("name", "?"))
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    if not kernels:
        return {"error": "the trace holds no GPU kernels"}
    by_name: dict[str, list[float]] = {}
    by_category: dict[str, float] = {}
    for _, duration, name in kernels:
        entry = by_name.setdefault(name, [0.0, 0])
        entry[0] += duration
        entry[1] += 1
        category = kernel_category(name)
        by_category[category] = by_category.get(category, 0.0) + duration
    busy_us, gaps, covered_until = 0.0, [], kernels[0][0]
    previous_name = kernels[0][2]
    for start, duration, name in kernels:
        if start > covered_until:
            gaps.append((start - covered_until, previous_name))
        busy_us += max(0.0, start + duration - max(start, covered_until))
        if start + duration >= covered_until:
            covered_until, previous_name = start + duration, name
    span_us = covered_until - kernels[0][0]
    gaps.sort(reverse=True)
    return {
        "gpu_span_ms": round(span_us / 1e3, 2),
        "gpu_busy_ms": round(busy_us / 1e3, 2),
        "gpu_idle_ms": round((span_us - busy_us) / 1e3, 2),
        "idle_gaps_over_20us": sum(1 for gap, _ in gaps if gap > 20),
        "largest_gaps": [{"us": round(gap, 1), "after": name[:90]} for gap, name in gaps[:5]],
        "kernel_count": len(kernels),
        "by_category_ms": {
            category: round(us / 1e3, 2)
            for category, us in sorted(by_category.items(), key=lambda item: -item[1])
        },
        "top_kernels": [
            {"name": name[:120], "ms": round(us / 1e3, 3), "calls": calls, "category": kernel_category(name)}
            for name, (us, calls) in sorted(by_name.items(), key=lambda item: -item[1][0])[:top]
        ],
    }


def impl_label(row: dict[str, Any]) -> str:
    """A row's impl, with the float8 recipe that ran for an fp8 row (fusetune+fp8 ran rowwise before tensorwise
    became the fp8 mode's recipe)."""
    float8 = row.get("float8") or {}
    recipe, budget = float8.get("recipe"), float8.get("activation_memory_budget")
    if budget is not None:
        recipe = f"{recipe}, activation memory budget {budget}"
    return f"{row['impl']} ({recipe})" if recipe else row["impl"]


def render_profiles(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown of the --profile results: one section per model, implementations side by side."""
    lines: list[str] = []
    profiled = [row for row in rows if isinstance(row.get("profile"), dict) and "memory" in row["profile"]]
    for model in dict.fromkeys(row["model"] for row in profiled):
        group = [row for row in profiled if row["model"] == model]
        impls = [impl_label(row) for row in group]
        lines += [f"## Profile of one step: {model}", ""]
        summary_keys = ("gpu_span_ms", "gpu_busy_ms", "gpu_idle_ms", "idle_gaps_over_20us", "kernel_count")
        memory_keys = tuple(group[0]["profile"]["memory"])
        table = [[key, *(row["profile"].get(key) for row in group)] for key in summary_keys]
        table += [[key, *(row["profile"]["memory"].get(key) for row in group)] for key in memory_keys]
        categories = list(dict.fromkeys(c for row in group for c in row["profile"]["by_category_ms"]))
        table += [
            [f"GPU ms: {category}", *(row["profile"]["by_category_ms"].get(category) for row in group)]
            for category in categories
        ]
        lines += [markdown_table(["", *impls], table), ""]
        for row in group:
            lines += [f"Top kernels, {impl_label(row)}:", ""]
            lines.append(
                markdown_table(
                    ["kernel", "category", "calls", "GPU ms"],
                    [
                        [k["name"], k["category"], k["calls"], k["ms"]]
                        for k in row["profile"]["top_kernels"][:MARKDOWN_KERNELS]
                    ],
                )
            )
            gaps = ", ".join(f"{g['us']} us after {g['after']}" for g in row["profile"]["largest_gaps"])
            lines += ["", f"Largest GPU idle gaps: {gaps}", ""]
            peak = row["profile"].get("backward_peak_blocks")
            if peak:
                lines += [
                    f"The backward's peak, {impl_label(row)}: {peak['rise_gb']} GB over what the forward left; "
                    "the blocks the backward had allocated and held then, by where:",
                    "",
                    markdown_table(
                        ["allocated at", "blocks", "GB"],
                        [[g["site"].replace("|", "/"), g["blocks"], g["gb"]] for g in peak["groups"]],
                    ),
                    "",
                ]
    return lines


def _finite(value: float) -> bool:
    return value == value and abs(value) != float("inf")


def optimizer_field(optimizer: str | None) -> dict[str, str]:
    """The row's `optimizer`, named only when it is not torch's AdamW (the rows before the option had none)."""
    return {"optimizer": optimizer} if optimizer and optimizer != "torch-adamw" else {}


def _failed_row(spec: dict[str, Any], error: BaseException) -> dict[str, Any]:
    row = {"model": spec["model"], "impl": spec["impl"], "batch": spec["batch"], "seq": spec["seq"]}
    row.update(optimizer_field(spec.get("optimizer")))
    if type(error).__name__ == "OutOfMemoryError":
        import torch

        row["peak_alloc_gb"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
    return row


# ---------------------------------------------------------------------------------------------------------
# Results files.


def results_payload(meta: dict[str, Any], rows: list[dict], previous: dict | None, models: list[str]) -> dict:
    def key(row: dict) -> tuple:
        return (row.get("impl"), *setup_key(row))

    run_keys = {key(row) for row in rows}
    kept = [row for row in (previous or {}).get("rows", []) if key(row) not in run_keys]
    return {**harness.results_header(meta, METHOD), "rows": kept + rows}


def setup_key(row: dict[str, Any]) -> tuple:
    return (
        row.get("model"),
        row.get("batch"),
        row.get("seq"),
        row.get("gradient_checkpointing", False),
        row.get("packed_length"),
        row.get("untrained_fraction"),
        row.get("loss_chunk"),
        row.get("optimizer", "torch-adamw"),
    )


def setup_title(row: dict[str, Any]) -> str:
    title = f"{row['model']}, batch {row['batch']} x {row['seq']} tokens"
    if row.get("packed_length"):
        title += f", rows packed with documents of {row['packed_length']} tokens"
    if row.get("untrained_fraction"):
        title += f", the first {row['untrained_fraction']:.0%} of each document untrained"
    if row.get("gradient_checkpointing"):
        title += ", gradient checkpointing"
    if row.get("optimizer") == "fusetune-adamw":
        title += ", fusetune's FusedAdamW (bf16-sr's optimizer) in every row"
    if row.get("loss_chunk") == "liger":
        title += ", fusetune's fused linear cross-entropy with Liger-Kernel's chunk rows"
    return title


def render_markdown(payload: dict[str, Any]) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in payload["versions"].items())
    ceilings = payload["ceilings"] or {}
    lines = [
        f"# End-to-end training: {payload['gpu']}, {payload['date']}",
        "",
        f"Versions: {versions}.",
        "",
        f"Measured ceilings: copy {ceilings.get('copy_GBps')} GB/s, bf16 matmul "
        f"{ceilings.get('bf16_matmul_TFLOPs')} TFLOP/s (the MFU peak).",
        "",
        f"Method: {payload['method']}",
        "",
        f"MFU: {payload['mfu_formula']}.",
        "",
        "`÷ liger` columns: tokens/s and peak memory divided by Liger's in the same run.",
        "",
    ]
    # One table per setup: rows of the same model with other batch, packing or checkpointing stay apart.
    setups: dict[tuple, list[dict[str, Any]]] = {}
    for row in payload["rows"]:
        setups.setdefault(setup_key(row), []).append(row)
    for rows in setups.values():
        group = {row["impl"]: row for row in rows}
        liger = group.get("liger", {})
        sample = rows[0]
        lines += [f"## {setup_title(sample)}", ""]
        table_rows, notes = [], []
        for impl in IMPLS:
            row = group.get(impl)
            if row is None:
                continue
            if "error" in row:
                notes.append(f"- {impl}: {row['error']}")
            table_rows.append(
                [
                    impl_label(row),
                    row.get("tokens_per_s"),
                    row.get("peak_alloc_gb"),
                    row.get("mfu"),
                    row.get("step_ms"),
                    _ratio(row.get("tokens_per_s"), liger.get("tokens_per_s")),
                    _ratio(row.get("peak_alloc_gb"), liger.get("peak_alloc_gb")),
                    f"{format_cell(row.get('first_loss'))} → {format_cell(row.get('last_loss'))}"
                    if "first_loss" in row
                    else None,
                    row.get("attn_implementation"),
                ]
            )
        lines.append(
            markdown_table(
                [
                    "impl",
                    "tokens/s",
                    "peak alloc GB",
                    "MFU",
                    "step ms",
                    "tokens/s ÷ liger",
                    "memory ÷ liger",
                    "loss first → last",
                    "attention",
                ],
                table_rows,
            )
        )
        lines += ["", *notes, ""] if notes else [""]
    lines += render_profiles(payload["rows"])
    return "\n".join(lines)


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


# ---------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train real model shapes with random weights: tokens/s, MFU, peak memory per implementation.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--models",
        default=",".join(SINGLE_GPU_MODELS),
        help=f"comma-separated: {', '.join(MODEL_SHAPES)}",
    )
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated: {', '.join(IMPLS)}")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (the median is reported)")
    parser.add_argument(
        "--warmup-steps", type=int, default=3, help="untimed steps first (compilation happens here)"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after the timed steps, profile one more step: memory per phase, what the backward holds at its "
        "peak, GPU time by kernel, idle gaps",
    )
    parser.add_argument(
        "--profile-kernels",
        type=int,
        default=MARKDOWN_KERNELS,
        help=f"kernels a profile keeps in the results file, by GPU time (the markdown shows {MARKDOWN_KERNELS})",
    )
    parser.add_argument(
        "--gradient-checkpointing", action="store_true", help="recompute each decoder layer in the backward"
    )
    parser.add_argument(
        "--untrained-fraction",
        type=float,
        default=None,
        help="the first this fraction of every document has no label (a prompt), as in chat data",
    )
    parser.add_argument(
        "--packed-length",
        type=int,
        default=None,
        help="rows packed with documents of this many tokens (position_ids restart per document)",
    )
    parser.add_argument(
        "--loss-chunk",
        choices=("default", "liger"),
        default="default",
        help="chunk rows of fusetune's fused linear cross-entropy: its default budget, or Liger-Kernel's "
        "chunk (the loss before its budget grew), to compare the two in one run",
    )
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="torch-adamw",
        help="torch's fused AdamW on the bf16 weights, or fusetune's FusedAdamW (stochastic rounding: bf16-sr)",
    )
    parser.add_argument(
        "--fp8-compile-layers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the fp8 rows compile each decoder layer (as the trainer does); --no-fp8-compile-layers: eager",
    )
    parser.add_argument(
        "--fp8-memory-budget",
        type=float,
        default=0.9,
        help="fusetune+fp8-memory-budget's activation memory budget: the fraction (0 to 1] of the partitioner's "
        "saved activations its compiled layers keep",
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument(
        "--attn",
        default="auto",
        help="attention implementation; auto = sdpa, or flex_attention for Gemma 2 (which refuses sdpa)",
    )
    harness.add_results_arguments(parser, RESULTS, merge="the rows of other (model, impl) pairs")
    parser.add_argument(
        "--impl-timeout-s",
        type=float,
        default=600,
        help="a (model, impl) process running longer is stopped and recorded as an error",
    )
    parser.add_argument(
        "--time-budget-s",
        type=float,
        default=None,
        help="pairs left after this many seconds are recorded as skipped",
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu smoke-tests the harness with tiny configs (batch 2 x 32); numbers mean nothing and it writes "
        "to a temporary folder unless --out is given",
    )
    parser.add_argument("--_worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.models = harness.choices(parser, "--models", args.models, MODEL_SHAPES)
    args.impls = harness.choices(parser, "--impls", args.impls, IMPLS)
    if not 0 < args.fp8_memory_budget <= 1:
        parser.error(f"--fp8-memory-budget must lie in (0, 1], got {args.fp8_memory_budget}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._worker:
        return harness.run_as_worker(train_one, args._worker, _failed_row)

    started = time.time()
    tiny = args.device == "cpu"
    if tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        harness.smoke_out(args, "fusetune-e2e-cpu-")
        if (args.batch, args.seq) == (8, 2048):
            args.batch, args.seq = 2, 32
    meta = harness.measured_meta("cpu (smoke test, TRITON_INTERPRET=1)" if tiny else None)
    if meta is None:
        return 2
    print(f"{meta['gpu']}: ceilings {meta['ceilings']}\nversions: {meta['versions']}", flush=True)
    slug = harness.results_slug(args, meta["gpu"], on_gpu=not tiny)
    previous = RESULTS.previous(args, slug)
    peak_tflops = (meta["ceilings"] or {}).get("bf16_matmul_TFLOPs")

    rows: list[dict] = []
    for model in args.models:
        for impl in args.impls:
            base = {"model": model, "impl": impl, "batch": args.batch, "seq": args.seq}
            base.update(optimizer_field(args.optimizer))
            if args.time_budget_s is not None and time.time() - started > args.time_budget_s:
                rows.append({**base, "error": "skipped: time budget of the run used up", "skipped": True})
                continue
            print(f"{model} / {impl}", flush=True)
            spec = {
                **base,
                "device": args.device,
                "tiny": tiny,
                "steps": args.steps,
                "warmup_steps": args.warmup_steps,
                "attn": args.attn,
                "gradient_checkpointing": args.gradient_checkpointing,
                "packed_length": args.packed_length,
                "untrained_fraction": args.untrained_fraction,
                "peak_tflops": peak_tflops,
                "profile": args.profile,
                "profile_kernels": args.profile_kernels,
                "loss_chunk": args.loss_chunk,
                "optimizer": args.optimizer,
                "fp8_compile_layers": args.fp8_compile_layers,
                "fp8_memory_budget": args.fp8_memory_budget,
            }
            timeout = args.impl_timeout_s
            if args.time_budget_s is not None:
                timeout = min(timeout, max(60.0, args.time_budget_s - (time.time() - started) + 60))
            run = harness.run_worker(__spec__.name, ["--_worker", json.dumps(spec)], timeout)
            row = run.results[-1] if run.results else {**base, "error": short_error(run.failure, 400)}
            rows.append(row)
            outcome = row.get("error") or (
                f"{row['tokens_per_s']:,.0f} tokens/s, {format_cell(row['peak_alloc_gb'])} GB, "
                f"MFU {format_cell(row['mfu'])}"
            )
            print(f"  -> {outcome}", flush=True)
            RESULTS.write(args.out, slug, results_payload(meta, rows, previous, args.models), args.section)
    path = RESULTS.write(args.out, slug, results_payload(meta, rows, previous, args.models), args.section)
    print(f"\nwrote {path} ({args.section}) in {time.time() - started:.0f} s\n")
    summary = [
        [r["model"], r["impl"], r.get("tokens_per_s"), r.get("peak_alloc_gb"), r.get("mfu"), r.get("error")]
        for r in rows
    ]
    print(markdown_table(["model", "impl", "tokens/s", "peak GB", "MFU", "error"], summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
