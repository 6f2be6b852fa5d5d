"""Causal attention forward + backward on one GPU: fusetune's variable-length flash path against
scaled_dot_product_attention's back ends, on rows of one sequence each (what unpacked training rows are).

    varlen            fusetune.models.attention's _VarlenFlashAttention (aten::_flash_attention_forward over
                      cumulative lengths), what the trainer runs for every row today
    sdpa              F.scaled_dot_product_attention(is_causal=True, enable_gqa=True), torch's choice of back end
    sdpa-<backend>    the same with one back end forced (flash, efficient, cudnn); keys and values repeated to
                      the query heads where the back end takes no grouped-query attention

    python3 -m benchmarks.kernels.attention
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from benchmarks import harness

RESULTS = harness.Benchmark("attention", topic="kernels")
# (name, batch, seq, query heads, key/value heads, head dim)
SHAPES = (
    ("llama-3.1-8b 1x8192", 1, 8192, 32, 8, 128),
    ("llama-3.1-8b 1x16384", 1, 16384, 32, 8, 128),
    ("llama-3.2-1b 8x2048", 8, 2048, 32, 8, 64),
    ("qwen2.5-1.5b 8x2048", 8, 2048, 12, 2, 128),
)
IMPLS = ("varlen", "sdpa", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn")


def attention_call(impl: str, batch: int, seq: int, heads: int, dim: int):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fusetune.models.attention import _VarlenFlashAttention

    if impl == "varlen":
        cu = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device="cuda")

        def run(q, k, v):
            packed = [t.transpose(1, 2).reshape(batch * seq, t.shape[1], dim) for t in (q, k, v)]
            return _VarlenFlashAttention.apply(*packed, cu, seq, dim**-0.5)

        return run
    backend = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
               "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}.get(impl)  # fmt: skip

    def run(q, k, v):
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        repeat = heads // k.shape[1]
        k, v = (t.repeat_interleave(repeat, dim=1) for t in (k, v))
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return run


def measure(
    name: str, batch: int, seq: int, heads: int, kv_heads: int, dim: int, impl: str
) -> dict[str, Any]:
    import torch
    import triton.testing

    generator = torch.Generator(device="cuda").manual_seed(0)

    def tensor(n_heads: int):
        # [batch, heads, seq, dim] laid out as a projection writes it ([batch, seq, heads, dim]).
        t = torch.randn(batch, seq, n_heads, dim, device="cuda", dtype=torch.bfloat16, generator=generator)
        return t.transpose(1, 2).requires_grad_()

    q, k, v = tensor(heads), tensor(kv_heads), tensor(kv_heads)
    run = attention_call(impl, batch, seq, heads, dim)
    grad = torch.randn_like(run(q, k, v))
    reference = None
    if impl != "varlen":
        varlen = attention_call("varlen", batch, seq, heads, dim)(q, k, v)
        reference = varlen.view(batch, seq, heads, dim).transpose(1, 2)

    def step():
        q.grad = k.grad = v.grad = None
        run(q, k, v).backward(grad)

    ms = triton.testing.do_bench(step, warmup=50, rep=300)
    row = {"shape": name, "impl": impl, "fwd_bwd_ms": round(ms, 3)}
    # Causal attention's work (forward 2 matmuls, backward 5, each 2*S*S*D/2 per head): TFLOP/s.
    flops = 3.5 * 2 * 2 * batch * heads * seq * seq * dim / 2
    row["tflops"] = round(flops / (ms * 1e-3) / 1e12, 1)
    if reference is not None:
        out = run(q, k, v)
        row["max_abs_diff_vs_varlen"] = float((out.float() - reference.float()).abs().max())
    return row


def render_markdown(payload: dict[str, Any]) -> str:
    return harness.shape_rows_markdown(
        payload,
        "Causal attention, forward + backward",
        (
            ("fwd+bwd ms", "fwd_bwd_ms"),
            ("TFLOP/s", "tflops"),
            ("max |diff| vs varlen", "max_abs_diff_vs_varlen"),
        ),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    harness.add_results_arguments(parser, RESULTS)
    args = parser.parse_args(argv)
    return harness.measure_shapes(__spec__.name, args, RESULTS, SHAPES, IMPLS, measure, render_markdown)


if __name__ == "__main__":
    sys.exit(main())
