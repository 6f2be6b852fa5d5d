"""Kernel benchmark: fusetune against Hugging Face eager, torch.compile and Liger-Kernel, in one run.

For every op and shape it times fwd, bwd and fwd+bwd (median ms), measures the peak extra memory of one
fwd+bwd, and compares each time with the floor set by the measured device ceilings (copy bandwidth and bf16
matmul rate, both measured at the start of the run). Results go to the section "ops" of
`benchmarks/results/<gpu-slug>-kernels.json`, rows in the format of shared/ANCHORS.md.

Run on a GPU machine from the repository root:

    python3 -m benchmarks.kernels.ops                 # everything, sweeps included
    python3 -m benchmarks.kernels.ops --quick         # main shapes only, fewer repetitions
    python3 -m benchmarks.kernels.ops --ops rms_norm,rope --impls fusetune,liger

An implementation that cannot run (not installed, import error, OOM, kernel error) becomes a row with an
"error" key; the run goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from benchmarks import harness
from benchmarks.harness import GIB, MIB, format_cell, markdown_table, short_error

RESULTS = harness.Benchmark("ops", topic="kernels")
IMPLS = ("hf", "compile", "liger", "cce", "fusetune", "fusetune+compile")
MODES = ("fwd", "bwd", "fwd+bwd")
BF16_BYTES = 2

METHOD = (
    "Times: median ms of triton.testing.do_bench(fn, return_mode='median') for fwd and fwd+bwd (L2 flushed "
    "before each repetition; main rows at least 20 repetitions, where runs before that rule took do_bench's "
    "100 ms, 2-20 repetitions for calls of 5-50 ms). bwd: the forward runs outside the timed region before "
    "every repetition, then "
    "the backward alone is timed between CUDA events, L2 flushed, median taken. Inputs and parameters require "
    "grad; backward is torch.autograd.grad(outputs, inputs + parameters, grad_outputs), so no .grad "
    "accumulation is timed. Peak extra memory: one fwd+bwd after warm-up, with every .grad set to None, "
    "gc + empty_cache, then torch.cuda.reset_peak_memory_stats(); peak_extra_mb = (max_memory_allocated() "
    "during it - memory_allocated() just before it) / 2**20; it is reported on the fwd+bwd row only and "
    "includes the returned gradients. Floors: fewest bytes / measured copy bandwidth (bytes read + written) "
    "or FLOPs / measured bf16 matmul rate (8192^3), whichever is larger; gbps and tflops are the floor's "
    "bytes or FLOPs divided by the measured time; floor_ratio = ms / floor_ms. Sweep rows (set 'sweep') are "
    "fwd+bwd only, with fewer repetitions. host_ms (main fwd+bwd rows): wall time to issue one fwd+bwd on the "
    "CPU, averaged over up to 20 calls with no synchronisation between them. device_ms (fwd+bwd rows): the "
    "GPU's own work in one fwd+bwd, the profiler's kernel durations summed (mean of 5 calls, L2 flushed "
    "before each, the flush not counted), so no launch overhead or idle gap is in it."
)

# Minimum traffic per mode, in units of one [T, H]-sized bf16 tensor (or its analogue), and why.
FLOOR_FORMULAS = {
    "rms_norm": "fwd 2·T·H·2 B (x read, y written); bwd 3·T·H·2 B (x, dy read, dx written); fwd+bwd "
    "4·T·H·2 B as in ANCHORS.md (x re-read in backward not counted)",
    "layer_norm": "same as rms_norm",
    "add_rms_norm": "fwd 4·T·H·2 B (x, residual read; normed, new residual written); bwd 4·T·H·2 B (dy, "
    "d_residual_out, new residual read; dx written once); fwd+bwd 7·T·H·2 B (re-read not counted)",
    "add_then_rms_norm": "same as add_rms_norm (the goal is to reach the fused floor)",
    "rope": "fwd 2·B·S·(Hq+Hkv)·D·2 B (q, k read and written); bwd the same for dq, dk; fwd+bwd 4x",
    "swiglu": "fwd 3·T·I·2 B (a, b read; c written); bwd 5·T·I·2 B (a, b, dc read; da, db written); "
    "fwd+bwd 6·T·I·2 B (re-read of a, b not counted)",
    "geglu": "same as swiglu",
    "swiglu_mlp": "FLOPs: fwd 3 GEMMs 6·T·H·I, bwd 12·T·H·I, fwd+bwd 18·T·H·I",
    "cross_entropy": "fwd T·V·2 B (logits read); bwd T·V·2 B (gradient written); fwd+bwd 2·T·V·2 B",
    "fused_linear_cross_entropy": "FLOPs: fwd 2·T·H·V (logits), bwd 4·T·H·V (dh, dW), fwd+bwd 6·T·H·V",
}


# ---------------------------------------------------------------------------------------------------------
# Cases: pure data, so the parent process can enumerate them without touching the GPU.


@dataclass(frozen=True)
class Case:
    op: str
    shape: dict[str, int]
    impl: str
    set_name: str  # "main" or "sweep"

    @property
    def modes(self) -> tuple[str, ...]:
        return MODES if self.set_name == "main" else ("fwd+bwd",)

    def key(self) -> tuple[str, str, str, str]:
        return (self.op, self.impl, json.dumps(self.shape, sort_keys=True), self.set_name)


OPS = (
    "rms_norm",
    "add_rms_norm",
    "add_then_rms_norm",
    "layer_norm",
    "rope",
    "swiglu",
    "geglu",
    "swiglu_mlp",
    "cross_entropy",
    "fused_linear_cross_entropy",
)

# add_then_rms_norm is the unfused baseline for our own fused add+RMSNorm: only our kernels run there.
# Cut Cross-Entropy (exact: filter_eps=None) is a fused linear cross-entropy only.
OP_IMPLS = {op: tuple(impl for impl in IMPLS if impl != "cce") for op in OPS} | {
    "add_then_rms_norm": ("fusetune",),
    "fused_linear_cross_entropy": IMPLS,
}

SWEEP_IMPLS = ("hf", "compile", "liger", "cce", "fusetune")
LOSS_SWEEP_VOCABS = (32000, 128256, 151936, 256000)
LOSS_SWEEP_TOKENS = (1024, 4096, 8192, 16384, 65536)
LINEAR_LOSS_SWEEP_HIDDEN = (1536, 2048, 4096)
# Gemma-style vocabularies come with a final-logit softcap: the sweep's V=256000 rows use one.
LINEAR_LOSS_SOFTCAP = {256000: 30}
NORM_SWEEP_HIDDEN = (1024, 2048, 4096, 8192, 16384, 32768)
NORM_SWEEP_TOKENS = (1024, 4096, 16384, 65536)


def main_shapes(op: str, tiny: bool) -> list[dict[str, int]]:
    if tiny:
        small = {
            "rope": {"B": 2, "S": 16, "Hq": 4, "Hkv": 2, "D": 64},
            "swiglu": {"T": 32, "I": 96},
            "geglu": {"T": 32, "I": 96},
            "swiglu_mlp": {"T": 32, "H": 64, "I": 96},
            "cross_entropy": {"T": 32, "V": 1000},
            "fused_linear_cross_entropy": {"T": 32, "H": 64, "V": 1000},
        }
        return [small.get(op, {"T": 64, "H": 256})]
    full = {
        "rms_norm": {"T": 16384, "H": 4096},
        "add_rms_norm": {"T": 16384, "H": 4096},
        "add_then_rms_norm": {"T": 16384, "H": 4096},
        "layer_norm": {"T": 16384, "H": 4096},
        "rope": {"B": 8, "S": 2048, "Hq": 32, "Hkv": 8, "D": 128},
        "swiglu": {"T": 8192, "I": 14336},
        "geglu": {"T": 8192, "I": 14336},
        "swiglu_mlp": {"T": 8192, "H": 4096, "I": 14336},
        "cross_entropy": {"T": 8192, "V": 128256},
        "fused_linear_cross_entropy": {"T": 8192, "H": 4096, "V": 128256},
    }
    return [full[op]]


def sweep_shapes(op: str, tiny: bool) -> list[dict[str, int]]:
    if op == "rms_norm":
        if tiny:
            return [{"T": t, "H": h} for h in (64, 1000) for t in (8, 24)]
        return [{"T": t, "H": h} for h in NORM_SWEEP_HIDDEN for t in NORM_SWEEP_TOKENS]
    if op == "cross_entropy":
        if tiny:
            return [{"T": t, "V": v} for v in (500, 1000) for t in (8, 24)]
        return [{"T": t, "V": v} for v in LOSS_SWEEP_VOCABS for t in LOSS_SWEEP_TOKENS]
    if op == "fused_linear_cross_entropy":
        if tiny:
            return [{"T": t, "H": 64, "V": v} for v in (500, 1000) for t in (8, 24)]
        return [
            {
                "T": t,
                "H": h,
                "V": v,
                **({"softcap": LINEAR_LOSS_SOFTCAP[v]} if v in LINEAR_LOSS_SOFTCAP else {}),
            }
            for h in LINEAR_LOSS_SWEEP_HIDDEN
            for v in LOSS_SWEEP_VOCABS
            for t in LOSS_SWEEP_TOKENS
        ]
    return []


def enumerate_cases(
    ops: list[str],
    impls: list[str],
    sweeps: str,
    tiny: bool,
    sweep_impls: list[str] | None = None,
    sweep_hidden: list[int] | None = None,
    sweep_vocab: list[int] | None = None,
    sweep_tokens: list[int] | None = None,
) -> list[Case]:
    """The cases to run; ``sweep_hidden`` / ``sweep_vocab`` / ``sweep_tokens`` keep only the sweep shapes of
    those H / V / T (a sweep split over calls, or rerun where a change applies)."""
    sweep_impls = [impl for impl in (sweep_impls or SWEEP_IMPLS) if impl in impls]
    cases: list[Case] = []
    for op in ops:
        main = main_shapes(op, tiny) if sweeps != "only" else []
        sweep = sweep_shapes(op, tiny) if sweeps != "none" else []
        if sweep_hidden:
            sweep = [shape for shape in sweep if shape.get("H") in sweep_hidden]
        if sweep_vocab:
            sweep = [shape for shape in sweep if shape.get("V") in sweep_vocab]
        if sweep_tokens:
            sweep = [shape for shape in sweep if shape.get("T") in sweep_tokens]
        for shape in main:
            cases += [Case(op, shape, impl, "main") for impl in OP_IMPLS[op] if impl in impls]
        for shape in sweep:
            if shape in main_shapes(op, tiny) and sweeps != "only":
                continue  # the main set already has this shape's fwd+bwd
            cases += [
                Case(op, shape, impl, "sweep")
                for impl in SWEEP_IMPLS
                if impl in sweep_impls and impl in OP_IMPLS[op]
            ]
    return cases


# ---------------------------------------------------------------------------------------------------------
# Floors.


def op_cost(op: str, shape: dict[str, int], mode: str) -> tuple[float, float]:
    """(fewest bytes moved, FLOPs) for one call in the given mode; see FLOOR_FORMULAS."""
    passes_by_op = {
        "rms_norm": (2, 3, 4),
        "layer_norm": (2, 3, 4),
        "add_rms_norm": (4, 4, 7),
        "add_then_rms_norm": (4, 4, 7),
        "rope": (2, 2, 4),
        "swiglu": (3, 5, 6),
        "geglu": (3, 5, 6),
        "cross_entropy": (1, 1, 2),
    }
    mode_index = MODES.index(mode)
    if op in passes_by_op:
        if op == "rope":
            elements = shape["B"] * shape["S"] * (shape["Hq"] + shape["Hkv"]) * shape["D"]
        elif op in ("swiglu", "geglu"):
            elements = shape["T"] * shape["I"]
        elif op == "cross_entropy":
            elements = shape["T"] * shape["V"]
        else:
            elements = shape["T"] * shape["H"]
        return passes_by_op[op][mode_index] * elements * BF16_BYTES, 0.0
    if op == "swiglu_mlp":
        return 0.0, (6, 12, 18)[mode_index] * shape["T"] * shape["H"] * shape["I"]
    if op == "fused_linear_cross_entropy":
        return 0.0, (2, 4, 6)[mode_index] * shape["T"] * shape["H"] * shape["V"]
    raise ValueError(f"unknown op {op!r}")


def floor_ms(op: str, shape: dict[str, int], mode: str, ceilings: dict[str, float] | None) -> float | None:
    if not ceilings:
        return None
    floor_bytes, flops = op_cost(op, shape, mode)
    byte_ms = floor_bytes / (ceilings["copy_GBps"] * 1e9) * 1e3
    flop_ms = flops / (ceilings["bf16_matmul_TFLOPs"] * 1e12) * 1e3
    return max(byte_ms, flop_ms)


# ---------------------------------------------------------------------------------------------------------
# Workloads: what one implementation runs, built only inside the measuring process.


class Unavailable(Exception):
    """The implementation is not installed or not written yet: the row is recorded as skipped."""


@dataclass
class Workload:
    forward: Callable[[], Any]
    grad_inputs: list  # tensors the backward differentiates with respect to (inputs and parameters)
    grad_outputs: list | None  # None when the output is a scalar loss
    options: dict[str, Any] = field(default_factory=dict)


def import_attr(module_name: str, attribute: str, what: str) -> Any:
    import importlib

    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise Unavailable(f"{what}: {module_name} not importable ({short_error(error, 160)})") from None
    if not hasattr(module, attribute):
        raise Unavailable(f"{what}: {module_name} has no {attribute}")
    return getattr(module, attribute)


def fusetune_attr(module: str, attribute: str) -> Any:
    return import_attr(f"fusetune.kernels.{module}", attribute, "fusetune kernel not available")


def liger_attr(module: str, attribute: str) -> Any:
    return import_attr(module, attribute, "liger-kernel not installed")


def compiled(fn: Callable, fullgraph: bool = False) -> Callable:
    import torch

    # dynamic=False: every shape gets its own specialised graph, as a training job with fixed shapes would.
    return torch.compile(fn, dynamic=False, fullgraph=fullgraph)


@dataclass
class Env:
    device: str
    dtype: Any
    seed: int = 0


def build_workload(case: Case, env: Env) -> Workload:
    import torch

    torch.manual_seed(env.seed)
    builder = {
        "rms_norm": _build_rms_norm,
        "add_rms_norm": _build_add_rms_norm,
        "add_then_rms_norm": _build_add_rms_norm,
        "layer_norm": _build_layer_norm,
        "rope": _build_rope,
        "swiglu": _build_gated_activation,
        "geglu": _build_gated_activation,
        "swiglu_mlp": _build_swiglu_mlp,
        "cross_entropy": _build_cross_entropy,
        "fused_linear_cross_entropy": _build_fused_linear_cross_entropy,
    }[case.op]
    return builder(case, env)


def _hf_llama(attribute: str) -> Any:
    return import_attr("transformers.models.llama.modeling_llama", attribute, "transformers has no llama")


def _build_rms_norm(case: Case, env: Env) -> Workload:
    import torch

    tokens, hidden = case.shape["T"], case.shape["H"]
    x = torch.randn(tokens, hidden, device=env.device, dtype=env.dtype, requires_grad=True)
    dy = torch.randn_like(x)
    weight_values = 1.0 + 0.1 * torch.randn(hidden, device=env.device)
    impl = case.impl
    if impl in ("hf", "compile"):
        module = _hf_llama("LlamaRMSNorm")(hidden, eps=1e-6)
    elif impl == "liger":
        module = liger_attr("liger_kernel.transformers.rms_norm", "LigerRMSNorm")(hidden, eps=1e-6)
    else:
        module = fusetune_attr("rms_norm", "FusedRMSNorm")(hidden, eps=1e-6)
    module = module.to(env.device, env.dtype)
    with torch.no_grad():
        module.weight.copy_(weight_values)
    callable_module = module
    if impl == "compile":
        callable_module = compiled(module)
    elif impl == "fusetune+compile":
        callable_module = compiled(module, fullgraph=True)
    return Workload(lambda: callable_module(x), [x, module.weight], [dy])


def _build_add_rms_norm(case: Case, env: Env) -> Workload:
    import torch

    tokens, hidden = case.shape["T"], case.shape["H"]
    x = torch.randn(tokens, hidden, device=env.device, dtype=env.dtype, requires_grad=True)
    residual = torch.randn_like(x).requires_grad_()
    d_normed, d_residual = torch.randn_like(x), torch.randn_like(x)
    weight = torch.nn.Parameter((1.0 + 0.1 * torch.randn(hidden, device=env.device)).to(env.dtype))
    impl = case.impl
    if case.op == "add_then_rms_norm":
        rms_norm = fusetune_attr("rms_norm", "rms_norm")

        def forward_fn(x, residual):
            new_residual = x + residual
            return rms_norm(new_residual, weight, 1e-6), new_residual

    elif impl in ("hf", "compile"):
        norm = _hf_llama("LlamaRMSNorm")(hidden, eps=1e-6).to(env.device, env.dtype)
        norm.weight = weight

        def forward_fn(x, residual):
            new_residual = x + residual
            return norm(new_residual), new_residual

    elif impl == "liger":
        norm = liger_attr("liger_kernel.transformers.fused_add_rms_norm", "LigerFusedAddRMSNorm")(
            hidden, eps=1e-6
        )
        norm = norm.to(env.device, env.dtype)
        norm.weight = weight
        forward_fn = norm
    else:
        add_rms_norm = fusetune_attr("rms_norm", "add_rms_norm")

        def forward_fn(x, residual):
            return add_rms_norm(x, residual, weight, 1e-6)

    if impl == "compile":
        forward_fn = compiled(forward_fn)
    elif impl == "fusetune+compile":
        forward_fn = compiled(forward_fn, fullgraph=True)
    return Workload(lambda: forward_fn(x, residual), [x, residual, weight], [d_normed, d_residual])


def _build_layer_norm(case: Case, env: Env) -> Workload:
    import torch

    tokens, hidden = case.shape["T"], case.shape["H"]
    x = torch.randn(tokens, hidden, device=env.device, dtype=env.dtype, requires_grad=True)
    dy = torch.randn_like(x)
    impl = case.impl
    if impl in ("hf", "compile"):
        module = torch.nn.LayerNorm(hidden, eps=1e-5)
    elif impl == "liger":
        module = liger_attr("liger_kernel.transformers.layer_norm", "LigerLayerNorm")(
            hidden, eps=1e-5, bias=True
        )
    else:
        module = fusetune_attr("layer_norm", "FusedLayerNorm")(hidden, eps=1e-5)
    module = module.to(env.device, env.dtype)
    with torch.no_grad():
        module.weight.copy_(1.0 + 0.1 * torch.randn(hidden, device=env.device))
        module.bias.copy_(0.1 * torch.randn(hidden, device=env.device))
    callable_module = module
    if impl == "compile":
        callable_module = compiled(module)
    elif impl == "fusetune+compile":
        callable_module = compiled(module, fullgraph=True)
    return Workload(lambda: callable_module(x), [x, module.weight, module.bias], [dy])


def rope_cos_sin(seq_len: int, head_dim: int, device: str, dtype: Any, theta: float = 500000.0):
    """cos/sin of shape [1, S, D] in the rotate-half layout that Hugging Face's rotary embedding returns."""
    import torch

    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    embedding = torch.cat((angles, angles), dim=-1)
    return embedding.cos()[None].to(dtype), embedding.sin()[None].to(dtype)


def _build_rope(case: Case, env: Env) -> Workload:
    import torch

    batch, seq, q_heads, kv_heads, head_dim = (case.shape[k] for k in ("B", "S", "Hq", "Hkv", "D"))
    # Attention projections produce [B, S, H, D]; Hugging Face hands RoPE the transposed view [B, H, S, D].
    q_storage = torch.randn(
        batch, seq, q_heads, head_dim, device=env.device, dtype=env.dtype, requires_grad=True
    )
    k_storage = torch.randn(
        batch, seq, kv_heads, head_dim, device=env.device, dtype=env.dtype, requires_grad=True
    )
    dq = torch.randn_like(q_storage).transpose(1, 2)
    dk = torch.randn_like(k_storage).transpose(1, 2)
    cos, sin = rope_cos_sin(seq, head_dim, env.device, env.dtype)
    impl = case.impl
    if impl in ("hf", "compile"):
        rope_fn = _hf_llama("apply_rotary_pos_emb")
    elif impl == "liger":
        rope_fn = liger_attr("liger_kernel.transformers.rope", "liger_rotary_pos_emb")
    else:
        rope_fn = fusetune_attr("rope", "apply_rotary_pos_emb")

    def forward_fn(q_storage, k_storage):
        return rope_fn(q_storage.transpose(1, 2), k_storage.transpose(1, 2), cos, sin)

    if impl == "compile":
        forward_fn = compiled(forward_fn)
    elif impl == "fusetune+compile":
        forward_fn = compiled(forward_fn, fullgraph=True)
    return Workload(lambda: forward_fn(q_storage, k_storage), [q_storage, k_storage], [dq, dk])


def _build_gated_activation(case: Case, env: Env) -> Workload:
    import torch
    import torch.nn.functional as F

    tokens, intermediate = case.shape["T"], case.shape["I"]
    a = torch.randn(tokens, intermediate, device=env.device, dtype=env.dtype, requires_grad=True)
    b = torch.randn_like(a).requires_grad_()
    dc = torch.randn_like(a)
    impl, is_swiglu = case.impl, case.op == "swiglu"
    if impl in ("hf", "compile"):
        if is_swiglu:
            activation_fn = lambda a, b: F.silu(a) * b
        else:
            activation_fn = lambda a, b: F.gelu(a, approximate="tanh") * b
    elif impl == "liger":
        if is_swiglu:
            function = liger_attr("liger_kernel.ops.swiglu", "LigerSiLUMulFunction")
            activation_fn = lambda a, b: function.apply(a, b, 1.0, 1.0)
        else:
            function = liger_attr("liger_kernel.ops.geglu", "LigerGELUMulFunction")
            activation_fn = function.apply
    elif is_swiglu:
        activation_fn = fusetune_attr("swiglu", "swiglu")
    else:
        geglu = fusetune_attr("swiglu", "geglu")
        activation_fn = lambda a, b: geglu(a, b, approximate="tanh")
    if impl == "compile":
        activation_fn = compiled(activation_fn)
    elif impl == "fusetune+compile":
        activation_fn = compiled(activation_fn, fullgraph=True)
    return Workload(lambda: activation_fn(a, b), [a, b], [dc])


def _build_swiglu_mlp(case: Case, env: Env) -> Workload:
    import torch

    tokens, hidden, intermediate = case.shape["T"], case.shape["H"], case.shape["I"]
    config = import_attr("transformers", "LlamaConfig", "transformers missing")(
        hidden_size=hidden, intermediate_size=intermediate, hidden_act="silu", mlp_bias=False
    )
    impl = case.impl
    with torch.device(env.device):
        if impl in ("hf", "compile"):
            module = _hf_llama("LlamaMLP")(config)
        elif impl == "liger":
            module = liger_attr("liger_kernel.transformers.swiglu", "LigerSwiGLUMLP")(config)
        else:
            module = fusetune_attr("swiglu", "FusedSwiGLUMLP")(config)
    module = module.to(env.dtype)
    x = torch.randn(tokens, hidden, device=env.device, dtype=env.dtype, requires_grad=True)
    dy = torch.randn_like(x)
    callable_module = module
    if impl == "compile":
        callable_module = compiled(module)
    elif impl == "fusetune+compile":
        callable_module = compiled(module, fullgraph=True)
    return Workload(lambda: callable_module(x), [x, *module.parameters()], [dy])


def _build_cross_entropy(case: Case, env: Env) -> Workload:
    import torch
    import torch.nn.functional as F

    tokens, vocab = case.shape["T"], case.shape["V"]
    logits = torch.randn(tokens, vocab, device=env.device, dtype=env.dtype, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,), device=env.device)
    impl, options = case.impl, {}
    if impl in ("hf", "compile"):
        # As transformers' ForCausalLMLoss: upcast the logits to fp32, then mean over tokens.
        loss_fn = lambda logits, labels: F.cross_entropy(logits.float(), labels, ignore_index=-100)
    elif impl == "liger":
        loss_fn = liger_attr("liger_kernel.transformers.cross_entropy", "LigerCrossEntropyLoss")()
    else:
        cross_entropy = fusetune_attr("cross_entropy", "cross_entropy")
        # In training the logits are dead after the loss, so the gradient may take their buffer (Liger
        # always does this); the row records the option.
        options = {"inplace_backward": True}
        loss_fn = lambda logits, labels: cross_entropy(logits, labels, inplace_backward=True)
    if impl == "compile":
        loss_fn = compiled(loss_fn)
    elif impl == "fusetune+compile":
        loss_fn = compiled(loss_fn, fullgraph=True)
    return Workload(lambda: loss_fn(logits, labels), [logits], None, options)


def _build_fused_linear_cross_entropy(case: Case, env: Env) -> Workload:
    import torch
    import torch.nn.functional as F

    tokens, hidden_size, vocab = case.shape["T"], case.shape["H"], case.shape["V"]
    softcap = case.shape.get("softcap")
    hidden = torch.randn(tokens, hidden_size, device=env.device, dtype=env.dtype, requires_grad=True)
    weight = torch.nn.Parameter(0.02 * torch.randn(vocab, hidden_size, device=env.device, dtype=env.dtype))
    labels = torch.randint(0, vocab, (tokens,), device=env.device)
    impl = case.impl
    options: dict[str, Any] = {}
    if impl in ("hf", "compile"):
        # lm_head Linear, then transformers' loss on upcast logits (softcapped as Gemma's forward does).
        def loss_fn(hidden, weight, labels):
            logits = F.linear(hidden, weight).float()
            if softcap:
                logits = softcap * torch.tanh(logits / softcap)
            return F.cross_entropy(logits, labels)

    elif impl == "liger":
        liger_loss = liger_attr(
            "liger_kernel.transformers.fused_linear_cross_entropy", "LigerFusedLinearCrossEntropyLoss"
        )(softcap=softcap)
        loss_fn = lambda hidden, weight, labels: liger_loss(weight, hidden, labels)
    elif impl == "cce":
        cce_loss = import_attr("cut_cross_entropy", "linear_cross_entropy", "cut-cross-entropy not installed")
        # filter_eps=None: exact, no gradient skipping (the skipping mode is benchmarks/kernels/loss_skip.py's).
        options["filter_eps"] = None
        loss_fn = lambda hidden, weight, labels: cce_loss(
            hidden, weight, labels, softcap=softcap, filter_eps=None
        )
    else:
        fused = fusetune_attr("fused_linear_cross_entropy", "fused_linear_cross_entropy")
        loss_fn = lambda hidden, weight, labels: fused(hidden, weight, labels, softcap=softcap)
    if impl == "compile":
        loss_fn = compiled(loss_fn)
    elif impl == "fusetune+compile":
        loss_fn = compiled(loss_fn, fullgraph=True)
    return Workload(lambda: loss_fn(hidden, weight, labels), [hidden, weight], None, options)


def estimated_bytes(case: Case) -> int:
    """Rough device memory one fwd+bwd needs, used to skip cases that cannot fit rather than OOM."""
    shape, impl = case.shape, case.impl
    if case.op == "cross_entropy":
        logits = shape["T"] * shape["V"]
        # inputs + gradient (bf16); eager adds an fp32 copy, fp32 log-softmax and fp32 gradient.
        per_element = {"hf": 16, "compile": 8}.get(impl, 4)
        return per_element * logits
    if case.op == "fused_linear_cross_entropy":
        logits = shape["T"] * shape["V"]
        weights = shape["V"] * shape["H"]
        per_logit = {"hf": 16, "compile": 6}.get(impl, 0)
        return per_logit * logits + 8 * weights + 4 * shape["T"] * shape["H"]
    if case.op in ("rms_norm", "layer_norm"):
        elements = shape["T"] * shape["H"]
        return (16 if impl == "hf" else 6) * elements
    return 0


# ---------------------------------------------------------------------------------------------------------
# Timing.


@dataclass(frozen=True)
class Repetitions:
    warmup_ms: int
    rep_ms: int
    # At least this many timed calls: do_bench's 100 ms makes a 40 ms call's median one of 2, and the same
    # fused linear loss call then measured 38.8-44.2 ms from run to run where 1,000 ms gave 40.4-40.7 (H100,
    # 2026-11-27). Longer runs are slower because matmul-bound calls reach the 700 W power cap within about
    # a second and the SM clock falls to ~1,390 MHz: benchmarks/kernels/sustained.py times each
    # implementation in that steady state.
    min_calls: int = 1


MAIN_REPS = Repetitions(
    warmup_ms=25, rep_ms=100, min_calls=20
)  # triton's do_bench defaults, 20 calls or more
QUICK_REPS = Repetitions(warmup_ms=10, rep_ms=40)
SWEEP_REPS = Repetitions(warmup_ms=5, rep_ms=20)


class CudaTimer:
    flush_bytes = harness.L2_FLUSH_BYTES

    def time(self, fn: Callable[[], Any], reps: Repetitions) -> float:
        import torch
        from triton.testing import do_bench

        rep_ms = reps.rep_ms
        if reps.min_calls > 1:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            rep_ms = max(rep_ms, reps.min_calls * start.elapsed_time(end))
        return float(do_bench(fn, warmup=reps.warmup_ms, rep=rep_ms, return_mode="median"))

    def time_backward(
        self, forward: Callable[[], Any], backward: Callable[[Any], Any], reps: Repetitions
    ) -> float:
        """Median of the backward alone; the forward that builds each graph runs outside the timed region."""
        import torch

        flush = torch.empty(self.flush_bytes, dtype=torch.int8, device="cuda")
        backward(forward())
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            backward(forward())
        end.record()
        torch.cuda.synchronize()
        iteration_ms = max(start.elapsed_time(end) / 3, 1e-3)
        warmup = max(1, int(reps.warmup_ms / iteration_ms))
        repeat = max(3, reps.min_calls, int(reps.rep_ms / iteration_ms))
        for _ in range(warmup):
            backward(forward())
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeat)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeat)]
        for index in range(repeat):
            outputs = forward()
            flush.zero_()
            starts[index].record()
            backward(outputs)
            ends[index].record()
            del outputs
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))

    def host_time(self, fn: Callable[[], Any], calls: int = 20) -> float:
        """Host milliseconds to issue one call (no synchronisation inside): when this is close to the
        measured time, the measurement is bound by launch overhead rather than by the GPU."""
        import torch

        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        issued = time.perf_counter()
        torch.cuda.synchronize()
        return (issued - started) * 1e3 / calls

    def device_time(self, fn: Callable[[], Any], calls: int = 5) -> float:
        """Mean ms the GPU spends running one call's kernels (L2 flushed before each call, the flush not
        counted): the work alone, which the wall time exceeds when the host cannot keep the GPU busy."""
        import torch

        flush = torch.empty(self.flush_bytes, dtype=torch.int8, device="cuda")
        return harness.flushed_device_ms(fn, flush, calls)

    def peak_extra_bytes(self, fwd_bwd: Callable[[], Any], grad_inputs: list) -> int:
        import torch

        for tensor in grad_inputs:
            tensor.grad = None
        harness.free_device_memory()
        torch.cuda.reset_peak_memory_stats()
        allocated_before = torch.cuda.memory_allocated()
        result = fwd_bwd()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - allocated_before
        del result
        return peak

    def free_bytes(self) -> int:
        import torch

        free, _total = torch.cuda.mem_get_info()
        return free


class CpuTimer:
    """Wall-clock timing for smoke-testing the harness on a machine without a GPU; numbers mean nothing."""

    def time(self, fn: Callable[[], Any], reps: Repetitions) -> float:
        fn()
        samples = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)

    def time_backward(
        self, forward: Callable[[], Any], backward: Callable[[Any], Any], reps: Repetitions
    ) -> float:
        samples = []
        for _ in range(3):
            outputs = forward()
            start = time.perf_counter()
            backward(outputs)
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)

    def host_time(self, fn: Callable[[], Any], calls: int = 3) -> float:
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - started) * 1e3 / calls

    def device_time(self, fn: Callable[[], Any], calls: int = 5) -> float | None:
        return None

    def peak_extra_bytes(self, fwd_bwd: Callable[[], Any], grad_inputs: list) -> int | None:
        return None

    def free_bytes(self) -> int:
        return 1 << 62


def run_backward(workload: Workload, outputs: Any) -> Any:
    import torch

    outputs = list(outputs) if isinstance(outputs, tuple | list) else [outputs]
    return torch.autograd.grad(outputs, workload.grad_inputs, workload.grad_outputs)


# ---------------------------------------------------------------------------------------------------------
# Measuring one case.


def base_row(case: Case, mode: str, ceilings: dict[str, float] | None) -> dict[str, Any]:
    return {
        "op": case.op,
        "mode": mode,
        "impl": case.impl,
        "dtype": "bfloat16",
        "shape": dict(case.shape),
        "set": case.set_name,
        "floor_ms": _round(floor_ms(case.op, case.shape, mode, ceilings)),
    }


def _round(value: float | None, digits: int = 4) -> float | None:
    if value is None:
        return None
    return float(f"{value:.{digits}g}")


def error_rows(
    case: Case, message: str, ceilings: dict[str, float] | None, skipped: bool = False
) -> list[dict]:
    rows = []
    for mode in case.modes:
        row = base_row(case, mode, ceilings)
        row["error"] = ("skipped: " if skipped else "") + message
        if skipped:
            row["skipped"] = True
        rows.append(row)
    return rows


def measured_row(case: Case, mode: str, ms: float, ceilings: dict[str, float] | None) -> dict[str, Any]:
    row = base_row(case, mode, ceilings)
    row["ms"] = _round(ms)
    floor_bytes, flops = op_cost(case.op, case.shape, mode)
    if floor_bytes:
        row["gbps"] = _round(floor_bytes / (ms * 1e-3) / 1e9)
    if flops:
        row["tflops"] = _round(flops / (ms * 1e-3) / 1e12)
    if row["floor_ms"]:
        row["floor_ratio"] = _round(ms / row["floor_ms"])
    return row


def measure_case(case: Case, env: Env, timer: Any, reps: Repetitions, ceilings: dict | None) -> list[dict]:
    import torch

    needed = estimated_bytes(case)
    free = timer.free_bytes()
    if needed > 0.92 * free:
        return error_rows(
            case,
            f"needs about {needed / GIB:.1f} GiB by estimate, {free / GIB:.1f} GiB free (would OOM)",
            ceilings,
            skipped=True,
        )
    if case.impl in ("compile", "fusetune+compile"):
        torch._dynamo.reset()  # a fresh graph per case: no recompile limit, no shape generalisation
    try:
        workload = build_workload(case, env)
    except Unavailable as reason:
        return error_rows(case, str(reason), ceilings, skipped=True)
    except Exception as error:  # noqa: BLE001 - any failure to build becomes the row's error
        return error_rows(case, "build failed: " + short_error(error), ceilings)

    def fwd_bwd():
        return run_backward(workload, workload.forward())

    try:
        fwd_bwd()  # warm-up: compiles Triton kernels and torch.compile graphs outside any measurement
        peak = timer.peak_extra_bytes(fwd_bwd, workload.grad_inputs)
    except Exception as error:  # noqa: BLE001
        if os.environ.get("FUSETUNE_BENCH_TRACEBACK"):
            traceback.print_exc()
        return error_rows(case, short_error(error), ceilings)

    rows, host_ms, device_ms = [], None, None
    for mode in case.modes:
        try:
            if mode == "fwd":
                ms = timer.time(workload.forward, reps)
            elif mode == "bwd":
                ms = timer.time_backward(
                    workload.forward, lambda outputs: run_backward(workload, outputs), reps
                )
            else:
                ms = timer.time(fwd_bwd, reps)
                device_ms = timer.device_time(fwd_bwd)
                if case.set_name == "main":
                    host_ms = timer.host_time(fwd_bwd, calls=max(3, min(20, int(100 / max(ms, 1e-3)))))
        except Exception as error:  # noqa: BLE001
            row = base_row(case, mode, ceilings)
            row["error"] = short_error(error)
            rows.append(row)
            continue
        row = measured_row(case, mode, ms, ceilings)
        if mode == "fwd+bwd" and peak is not None:
            row["peak_extra_mb"] = round(peak / MIB, 1)
        if mode == "fwd+bwd" and host_ms is not None:
            row["host_ms"] = _round(host_ms)
        if mode == "fwd+bwd" and device_ms is not None:
            row["device_ms"] = _round(device_ms)
        if workload.options:
            row["options"] = workload.options
        rows.append(row)
    return rows


def run_cases(cases: list[Case], config: dict[str, Any], emit: Callable[[dict], None]) -> None:
    """Measure the cases in order; every row goes to `emit` as soon as it exists."""
    import torch

    device = config["device"]
    env = Env(device=device, dtype=torch.bfloat16)
    timer = CudaTimer() if device == "cuda" else CpuTimer()
    main_reps = QUICK_REPS if config["quick"] else MAIN_REPS
    deadline = config.get("deadline")
    for case in cases:
        if deadline is not None and time.time() > deadline:
            rows = error_rows(case, "time budget of the run used up", config["ceilings"], skipped=True)
        else:
            reps = main_reps if case.set_name == "main" else SWEEP_REPS
            case_started = time.time()
            try:
                rows = measure_case(case, env, timer, reps, config["ceilings"])
            except torch.cuda.OutOfMemoryError as error:
                rows = error_rows(case, short_error(error), config["ceilings"])
            if case.impl in ("compile", "fusetune+compile"):
                torch._dynamo.reset()
            harness.free_device_memory()
            print(f"  ({case.op} {case.impl} {_shape_text(case.shape)}: {time.time() - case_started:.1f} s)")
        for row in rows:
            emit(row)
        _log_rows(rows)


def _log_rows(rows: list[dict]) -> None:
    for row in rows:
        shape = ",".join(f"{k}={v}" for k, v in row["shape"].items())
        outcome = row.get("error") or (
            f"{row['ms']:.4g} ms"
            + (f", {row['peak_extra_mb']:.0f} MB" if "peak_extra_mb" in row else "")
            + (f", host {row['host_ms']:.3g} ms" if "host_ms" in row else "")
        )
        print(f"  {row['op']:<27} {shape:<34} {row['impl']:<17} {row['mode']:<8} {outcome}", flush=True)


# ---------------------------------------------------------------------------------------------------------
# Results files.


def _shape_key(shape: dict[str, Any]) -> str:
    return json.dumps(shape, sort_keys=True)


def results_payload(
    meta: dict[str, Any],
    rows: list[dict],
    previous: dict[str, Any] | None,
    ops: list[str],
    current_shapes: dict[str, set[str]] | None = None,
) -> dict[str, Any]:
    """The results file's content; ``current_shapes`` (op -> shape keys the code defines now), when given,
    drops earlier rows of shapes no longer defined (a sweep whose shape list changed)."""
    # A run replaces the earlier rows of the (op, set, shape) it measured: a sweep keeps the main-shape rows,
    # and a sweep split over several calls (--sweep-hidden) keeps the shapes of the other calls.
    measured = sorted({(row["op"], row.get("set", "main")) for row in rows} or {(op, "main") for op in ops})
    measured_shapes = {(row["op"], row.get("set", "main"), _shape_key(row["shape"])) for row in rows}
    run = {
        "date": meta["date"],
        "ceilings": meta["ceilings"],
        "fusetune": meta["versions"]["fusetune"],
        "ops": ops,
        "measured": [f"{op}/{set_name}" for op, set_name in measured],
    }
    kept_rows, runs = [], [run]
    if previous is not None:
        kept_rows = [
            row
            for row in previous.get("rows", [])
            if (row.get("op"), row.get("set", "main"), _shape_key(row.get("shape", {})))
            not in measured_shapes
            and (
                current_shapes is None
                or _shape_key(row.get("shape", {})) in current_shapes.get(row["op"], ())
            )
        ]
        still_shown = {row.get("op") for row in kept_rows}
        runs = [
            {**earlier, "ops": [op for op in earlier.get("ops", []) if op in still_shown]}
            for earlier in previous.get("runs", [])
        ]
        runs = [earlier for earlier in runs if earlier["ops"]] + [run]
    return {
        **meta,
        "method": METHOD,
        "floor_formulas": FLOOR_FORMULAS,
        "runs": runs,
        "rows": kept_rows + rows,
    }


def _shape_text(shape: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in shape.items())


def _fwd_bwd_lookup(rows: list[dict]) -> dict[tuple, dict]:
    return {
        (row["op"], json.dumps(row["shape"], sort_keys=True), row["impl"]): row
        for row in rows
        if row["mode"] == "fwd+bwd"
    }


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def _memory_ratio(numerator: float | None, denominator: float | None) -> float | None:
    # Below 1 MiB (Liger's in-place loss) a ratio says nothing; the table shows both numbers.
    if numerator is None or denominator is None or denominator < 1.0:
        return None
    return numerator / denominator


def render_markdown(payload: dict[str, Any]) -> str:
    rows = payload["rows"]
    versions = ", ".join(f"{k} {v}" for k, v in payload["versions"].items())
    ceilings = payload["ceilings"] or {}
    lines = [
        f"# Kernel benchmarks: {payload['gpu']}, {payload['date']}",
        "",
        f"Versions: {versions}.",
        "",
        f"Measured ceilings: copy {ceilings.get('copy_GBps')} GB/s (read + written), bf16 matmul "
        f"{ceilings.get('bf16_matmul_TFLOPs')} TFLOP/s.",
        "",
        f"Method: {payload['method']}",
        "",
        "`÷ liger` and `÷ compile` are fwd+bwd time divided by that implementation's (below 1 = faster); "
        "`mem ÷ liger` likewise for peak extra memory (blank when Liger's is under 1 MB). `host ms` is the "
        "CPU time to issue one fwd+bwd: where it is close to the fwd+bwd time, that time is launch "
        "overhead, not GPU work. `GPU ms` is the fwd+bwd kernels' own durations summed (device_ms), and "
        "`GPU ÷` compares those: the work itself, apart from the host.",
        "",
    ]
    lookup = _fwd_bwd_lookup(rows)
    main_groups: dict[tuple, list[dict]] = {}
    sweep_groups: dict[str, list[dict]] = {}
    shape_by_key = {json.dumps(row["shape"], sort_keys=True): row["shape"] for row in rows}
    for row in rows:
        if row.get("set", "main") == "main":
            main_groups.setdefault((row["op"], json.dumps(row["shape"], sort_keys=True)), []).append(row)
        else:
            sweep_groups.setdefault(row["op"], []).append(row)
    for (op, shape_key), group in main_groups.items():
        shape = shape_by_key[shape_key]
        floors = {row["mode"]: row.get("floor_ms") for row in group}
        lines += [
            f"## {op}: {_shape_text(shape)} (bf16)",
            "",
            f"Floor ms: fwd {format_cell(floors.get('fwd'))}, bwd {format_cell(floors.get('bwd'))}, fwd+bwd "
            f"{format_cell(floors.get('fwd+bwd'))} ({FLOOR_FORMULAS.get(op, '')}).",
            "",
        ]
        table_rows, notes = [], []
        for impl in IMPLS:
            by_mode = {row["mode"]: row for row in group if row["impl"] == impl}
            if not by_mode:
                continue
            total = by_mode.get("fwd+bwd", {})
            liger = lookup.get((op, shape_key, "liger"), {})
            compile_row = lookup.get((op, shape_key, "compile"), {})
            throughput = total.get("gbps")
            throughput_text = (
                f"{format_cell(throughput)} GB/s"
                if throughput is not None
                else (f"{format_cell(total['tflops'])} TFLOP/s" if "tflops" in total else None)
            )
            table_rows.append(
                [
                    impl,
                    by_mode.get("fwd", {}).get("ms"),
                    by_mode.get("bwd", {}).get("ms"),
                    total.get("ms"),
                    total.get("host_ms"),
                    total.get("device_ms"),
                    total.get("peak_extra_mb"),
                    total.get("floor_ratio"),
                    throughput_text,
                    _ratio(total.get("ms"), liger.get("ms")),
                    _ratio(total.get("ms"), compile_row.get("ms")),
                    _memory_ratio(total.get("peak_extra_mb"), liger.get("peak_extra_mb")),
                ]
            )
            errors = {row["error"] for row in by_mode.values() if "error" in row}
            notes += [f"- {impl}: {error}" for error in sorted(errors)]
        lines.append(
            markdown_table(
                [
                    "impl",
                    "fwd ms",
                    "bwd ms",
                    "fwd+bwd ms",
                    "host ms",
                    "GPU ms",
                    "peak extra MB",
                    "× floor",
                    "fwd+bwd rate",
                    "÷ liger",
                    "÷ compile",
                    "mem ÷ liger",
                ],
                table_rows,
            )
        )
        lines += ["", *notes, ""] if notes else [""]
    for op, group in sweep_groups.items():
        shapes: list[str] = []
        for row in group:
            key = json.dumps(row["shape"], sort_keys=True)
            if key not in shapes:
                shapes.append(key)
        # The main shape's fwd+bwd belongs in the sweep table too.
        shapes += [key for (main_op, key) in main_groups if main_op == op and key not in shapes]
        shape_keys: list[str] = []  # in order of first appearance: only some shapes have a softcap
        for key in shapes:
            shape_keys += [k for k in shape_by_key[key] if k not in shape_keys]
        shapes.sort(key=lambda key: tuple(shape_by_key[key].get(k, 0) for k in reversed(shape_keys)))
        impls = [impl for impl in SWEEP_IMPLS if any(row["impl"] == impl for row in group)]
        ratio_baselines = [impl for impl in ("liger", "compile", "cce") if impl in impls]
        # Sweep rows measured before device_ms existed have none: no GPU ratio columns then.
        gpu_baselines = [
            impl
            for impl in ("liger", "compile")
            if impl in impls and any("device_ms" in row for row in group)
        ]
        lines += [f"## {op} sweep: fwd+bwd ms / peak extra MB (bf16)", ""]
        table_rows, notes = [], []
        for key in shapes:
            shape = shape_by_key[key]
            cells = [shape.get(k) for k in shape_keys]
            for impl in impls:
                row = lookup.get((op, key, impl))
                if row is None:
                    cells.append(None)
                elif "error" in row:
                    cells.append("skipped" if row.get("skipped") else "error")
                    notes.append(f"- {_shape_text(shape)} {impl}: {row['error']}")
                else:
                    cells.append(f"{format_cell(row['ms'])} / {format_cell(row.get('peak_extra_mb'))}")
            fusetune = lookup.get((op, key, "fusetune"), {})
            for baseline in ratio_baselines:
                cells.append(_ratio(fusetune.get("ms"), lookup.get((op, key, baseline), {}).get("ms")))
            for baseline in gpu_baselines:
                baseline_row = lookup.get((op, key, baseline), {})
                cells.append(_ratio(fusetune.get("device_ms"), baseline_row.get("device_ms")))
            table_rows.append(cells)
        lines.append(
            markdown_table(
                [
                    *shape_keys,
                    *impls,
                    *[f"fusetune ÷ {baseline}" for baseline in ratio_baselines],
                    *[f"GPU ÷ {baseline}" for baseline in gpu_baselines],
                ],
                table_rows,
            )
        )
        lines += ["", *notes, ""] if notes else [""]
    return "\n".join(lines)


def summary_table(rows: list[dict]) -> str:
    """The short table printed at the end: main shapes, fwd+bwd ms (peak extra MB) per impl."""
    lookup = _fwd_bwd_lookup(rows)
    shape_by_key = {json.dumps(row["shape"], sort_keys=True): row["shape"] for row in rows}
    keys = []
    for row in rows:
        key = (row["op"], json.dumps(row["shape"], sort_keys=True))
        if row.get("set", "main") == "main" and key not in keys:
            keys.append(key)
    table_rows = []
    for op, shape_key in keys:
        cells: list[Any] = [op, _shape_text(shape_by_key[shape_key])]
        for impl in IMPLS:
            row = lookup.get((op, shape_key, impl))
            if row is None:
                cells.append(None)
            elif "error" in row:
                cells.append("skip" if row.get("skipped") else "err")
            else:
                memory = row.get("peak_extra_mb")
                cells.append(f"{format_cell(row['ms'])}" + (f" ({memory:.0f})" if memory is not None else ""))
        floor_value = next(
            (
                r.get("floor_ms")
                for r in rows
                if (r["op"], json.dumps(r["shape"], sort_keys=True)) == (op, shape_key)
                and r["mode"] == "fwd+bwd"
            ),
            None,
        )
        cells.append(floor_value)
        table_rows.append(cells)
    return markdown_table(["op", "shape", *[f"{impl} ms (MB)" for impl in IMPLS], "floor ms"], table_rows)


# ---------------------------------------------------------------------------------------------------------
# Processes: each op runs in its own worker so that a crashed kernel (a sticky CUDA error) or a
# monkey-patch cannot spoil the ops after it.


def _worker_main(config_json: str) -> int:
    config = json.loads(config_json)
    cases = [Case(c["op"], c["shape"], c["impl"], c["set_name"]) for c in config["cases"]]
    run_cases(cases, config, harness.report)
    return 0


def _run_op_in_worker(op: str, cases: list[Case], config: dict, timeout_s: float | None) -> list[dict]:
    worker_config = dict(config, cases=[c.__dict__ for c in cases])
    run = harness.run_worker(__spec__.name, ["--_worker", json.dumps(worker_config)], timeout_s)
    rows = run.results
    if run.failure:
        failure = f"worker for {op} {run.failure}"
        done = {
            (r["op"], r["impl"], json.dumps(r["shape"], sort_keys=True), r.get("set", "main")) for r in rows
        }
        for case in cases:
            if case.key() not in done:
                rows += error_rows(case, short_error(failure, 400), config["ceilings"])
        print(f"  {failure}", flush=True)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Benchmark fusetune's kernels against Hugging Face eager, torch.compile and Liger-Kernel.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of: {', '.join(OPS)}")
    parser.add_argument(
        "--impls", default=",".join(IMPLS), help=f"comma-separated subset of: {', '.join(IMPLS)}"
    )
    parser.add_argument(
        "--quick", action="store_true", help="main shapes only (no sweeps), fewer repetitions"
    )
    parser.add_argument(
        "--sweeps",
        choices=("all", "none", "only"),
        default=None,
        help="shape sweeps (fwd+bwd only): all, none or only; default all, or none with --quick",
    )
    parser.add_argument(
        "--sweep-impls",
        default=",".join(SWEEP_IMPLS),
        help="implementations run in the sweeps (compile costs a compilation per shape)",
    )
    parser.add_argument(
        "--sweep-hidden",
        default="",
        help="comma-separated H values: run only the sweep shapes of those (a long sweep split over calls, "
        "with --merge)",
    )
    parser.add_argument(
        "--sweep-vocab",
        default="",
        help="comma-separated V values: run only the sweep shapes of those (with --merge)",
    )
    parser.add_argument(
        "--sweep-tokens",
        default="",
        help="comma-separated T values: run only the sweep shapes of those (with --merge)",
    )
    harness.add_results_arguments(
        parser,
        RESULTS,
        merge="the rows of the ops and shapes this run does not measure (a run split over calls)",
    )
    parser.add_argument(
        "--time-budget-s",
        type=float,
        default=None,
        help="cases left after this many seconds "
        "are recorded as skipped, so that a run ends inside a hard limit",
    )
    parser.add_argument("--op-timeout-s", type=float, default=1800, help="a worker running longer is stopped")
    parser.add_argument("--no-isolate", action="store_true", help="run every op in this process (debugging)")
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu smoke-tests the harness at tiny shapes under TRITON_INTERPRET=1; its numbers mean nothing "
        "and it writes to a temporary folder unless --out is given",
    )
    parser.add_argument("--list-cases", action="store_true", help="print the cases that would run and exit")
    parser.add_argument("--_worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.ops = harness.choices(parser, "--ops", args.ops, OPS)
    args.impls = harness.choices(parser, "--impls", args.impls, IMPLS)
    args.sweep_impls = harness.choices(parser, "--sweep-impls", args.sweep_impls, SWEEP_IMPLS)
    for option in ("sweep_hidden", "sweep_vocab", "sweep_tokens"):
        try:
            setattr(args, option, [int(value) for value in getattr(args, option).split(",") if value.strip()])
        except ValueError:
            flag = "--" + option.replace("_", "-")
            parser.error(f"{flag}: expected comma-separated integers, got {getattr(args, option)!r}")
    if args.sweeps is None:
        args.sweeps = "none" if args.quick else "all"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._worker:
        return _worker_main(args._worker)
    tiny = args.device == "cpu"
    cases = enumerate_cases(
        args.ops,
        args.impls,
        args.sweeps,
        tiny,
        args.sweep_impls,
        args.sweep_hidden,
        args.sweep_vocab,
        args.sweep_tokens,
    )
    if args.list_cases:
        for case in cases:
            print(f"{case.op:<27} {case.set_name:<6} {case.impl:<17} {_shape_text(case.shape)}")
        print(f"{len(cases)} cases")
        return 0
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        harness.smoke_out(args, "fusetune-bench-cpu-")

    import torch

    started = time.time()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("no CUDA device: run on a GPU machine, or pass --device cpu to smoke-test", file=sys.stderr)
            return 2
        gpu_name = torch.cuda.get_device_name()
        print(f"Measuring ceilings on {gpu_name} ...", flush=True)
        ceilings = harness.measure_ceilings()
    else:
        gpu_name, ceilings = "cpu (smoke test, TRITON_INTERPRET=1)", None
    slug = harness.results_slug(args, gpu_name, on_gpu=args.device == "cuda")
    meta = harness.run_meta(gpu_name, ceilings)
    print(f"ceilings: {ceilings}\nversions: {meta['versions']}", flush=True)
    previous = RESULTS.previous(args, slug)
    config = {
        "device": args.device,
        "quick": args.quick,
        "ceilings": ceilings,
        "deadline": started + args.time_budget_s if args.time_budget_s else None,
    }

    rows: list[dict] = []
    current_shapes = {
        op: {_shape_key(shape) for shape in main_shapes(op, tiny) + sweep_shapes(op, tiny)} for op in OPS
    }

    def save() -> dict[str, Any]:
        payload = results_payload(meta, rows, previous, args.ops, current_shapes)
        RESULTS.write(args.out, slug, payload, args.section)
        return payload

    for op in args.ops:
        op_cases = [case for case in cases if case.op == op]
        if not op_cases:
            continue
        print(f"{op}: {len(op_cases)} cases", flush=True)
        if args.no_isolate:
            run_cases(op_cases, config, rows.append)
        else:
            timeout = args.op_timeout_s
            if config["deadline"] is not None:
                timeout = min(timeout, max(60.0, config["deadline"] - time.time() + 120))
            rows += _run_op_in_worker(op, op_cases, config, timeout)
        save()
    payload = save()
    print(f"\nwrote {RESULTS.path(args.out, slug)} ({args.section}) in {time.time() - started:.0f} s\n")
    print(summary_table([row for row in payload["rows"] if row["op"] in args.ops]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
