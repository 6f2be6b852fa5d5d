"""One decoding step of grouped-query attention over a KV cache (what sampling runs per layer and token, see
fusetune.models.attention.grouped_query_decode), by how the query heads meet the cache and which back end of
scaled_dot_product_attention runs it. The mask is a static cache's: row-wise left padding and the slots not yet
written, [batch, 1, 1, length] boolean.

    widened            transformers' sdpa path: K and V repeated to every query head, then sdpa with the mask
    kernel             fusetune.kernels.decode_attention (what fusetune.models.attention.grouped_query_decode
                       runs): the query heads of a KV head as its query rows, blocks the mask drops unread
    grouped            scaled_dot_product_attention over the same grouped rows (the path before the kernel),
                       torch's choice of back end
    grouped-<backend>  the same with one back end forced (math, efficient, cudnn)
    grouped-compiled   the grouped math (two matmuls and a masked softmax) compiled by torch.compile

Per row: microseconds per call (triton.testing.do_bench) and the K and V bytes read once over that time.

    python3 -m benchmarks.kernels.decode_attention
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from benchmarks import harness

RESULTS = harness.Benchmark("decode-attention", topic="kernels")
# (name, rows, query heads, key/value heads, head dim, cache length, filled length)
SHAPES = (
    ("llama-3.2-1b 512 rows, cache 280", 512, 32, 8, 64, 280, 200),
    ("llama-3.2-1b 512 rows, cache 528, half filled", 512, 32, 8, 64, 528, 272),
    ("llama-3.2-1b 512 rows, cache 536", 512, 32, 8, 64, 536, 400),
    ("llama-3.1-8b 64 rows, cache 2048", 64, 32, 8, 128, 2048, 1500),
)
IMPLS = (
    "widened",
    "kernel",
    "grouped",
    "grouped-math",
    "grouped-efficient",
    "grouped-cudnn",
    "grouped-compiled",
)


def decode_call(impl: str):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fusetune.kernels.decode_attention import grouped_decode_attention

    if impl == "kernel":
        return lambda q, k, v, mask: grouped_decode_attention(q, k, v, mask)
    if impl == "widened":

        def run(q, k, v, mask):
            repeat = q.shape[1] // k.shape[1]
            k, v = (t.repeat_interleave(repeat, dim=1) for t in (k, v))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

        return run
    if impl == "grouped-compiled":

        def grouped_math(q, k, v, mask):
            batch, heads, _, dim = q.shape
            grouped = q.reshape(batch, k.shape[1], heads // k.shape[1], dim)
            scores = (grouped @ k.transpose(-1, -2)).float() * dim**-0.5
            probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).to(q.dtype)
            return (probs @ v).reshape(batch, heads, 1, dim)

        return torch.compile(grouped_math, fullgraph=True)
    backend = {"grouped-math": SDPBackend.MATH, "grouped-efficient": SDPBackend.EFFICIENT_ATTENTION,
               "grouped-cudnn": SDPBackend.CUDNN_ATTENTION}.get(impl)  # fmt: skip

    def grouped(q, k, v, mask):
        batch, heads, _, dim = q.shape
        rows = q.reshape(batch, k.shape[1], heads // k.shape[1], dim)
        return F.scaled_dot_product_attention(rows, k, v, attn_mask=mask).reshape(batch, heads, 1, dim)

    def run(q, k, v, mask):
        if backend is None:
            return grouped(q, k, v, mask)
        with sdpa_kernel([backend]):
            return grouped(q, k, v, mask)

    return run


def measure(name: str, rows: int, heads: int, kv_heads: int, dim: int, length: int, filled: int, impl: str):
    import torch
    import triton.testing

    generator = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(rows, heads, 1, dim, device="cuda", dtype=torch.bfloat16, generator=generator)
    k, v = (
        torch.randn(rows, kv_heads, length, dim, device="cuda", dtype=torch.bfloat16, generator=generator)
        for _ in range(2)
    )
    positions = torch.arange(length, device="cuda")
    padding = torch.randint(0, 16, (rows, 1), device="cuda", generator=generator)
    mask = ((positions >= padding) & (positions < filled)).view(rows, 1, 1, length)
    run = decode_call(impl)
    out = run(q, k, v, mask)
    reference = decode_call("widened")(q, k, v, mask)
    us = triton.testing.do_bench(lambda: run(q, k, v, mask), warmup=25, rep=200) * 1e3
    cache_bytes = 2 * k.numel() * k.element_size()
    return {
        "shape": name, "impl": impl, "us": round(us, 1), "cache_gb_per_s": round(cache_bytes / (us * 1e-6) / 1e9),
        "max_abs_diff_vs_widened": float((out.float().reshape(reference.shape) - reference.float()).abs().max()),
    }  # fmt: skip


def render_markdown(payload: dict[str, Any]) -> str:
    return harness.shape_rows_markdown(
        payload,
        "One decoding step of grouped-query attention",
        (("us", "us"), ("K+V GB/s", "cache_gb_per_s"), ("max |diff| vs widened", "max_abs_diff_vs_widened")),
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
