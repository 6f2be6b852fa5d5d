"""What bounds the cross-entropy kernel over given logits: the device's streaming rates on the same bytes
(a copy, a read-only and a write-only pass), this checkout's kernel (loss alone: its first sweep; loss and
gradient in place: both sweeps), and a design that reads each logit once: each row split over PARTS
co-resident programs (a cooperative launch) that keep their slice in registers and exchange the slice's
(max, sum of exponentials) through global memory before writing the gradient. All in one process,
do_bench medians (L2 flushed), at T=8192 for several vocabularies.

    python3 -m benchmarks.kernels.cross_entropy_bounds [--out DIR]

The split-row kernel is a measurement, not a product path: loss and gradient of the plain mean
cross-entropy only (no options), checked here against torch in float32 before it is timed. For the DRAM
bytes each kernel moves, run this script under Nsight Compute, e.g.
``ncu --clock-control none --kernel-name regex:"cross_entropy_forward" --metrics
dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed python3 ...``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)
SHAPES = ((8192, 32000), (8192, 128256), (8192, 151936), (8192, 256000))
# (columns per program, warps, load the next row's slice before the exchange)
SPLIT_VARIANTS = ((32768, 32, False), (32768, 32, True), (16384, 32, True), (16384, 16, True))


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offsets, mask=offsets < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


@triton.jit
def _write_kernel(x_ptr, n, BLOCK: tl.constexpr):
    zeros = tl.zeros([BLOCK], dtype=x_ptr.dtype.element_ty)
    for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        tl.store(x_ptr + offsets, zeros, mask=offsets < n)


@triton.jit
def _split_row_kernel(
    logits_ptr, row_stride, labels_ptr, loss_ptr, partials_ptr, arrivals_ptr, scale_ptr,
    n_rows, n_cols, ignore_index, n_groups,
    SLICE: tl.constexpr, PARTS: tl.constexpr, PARTS_POW2: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    """Programs [group * PARTS, (group + 1) * PARTS) share rows group, group + n_groups, ...; program
    ``part`` holds columns [part * SLICE, (part + 1) * SLICE). The gradient overwrites the logits."""
    group = tl.program_id(0) // PARTS
    part = tl.program_id(0) % PARTS
    cols = part * SLICE + tl.arange(0, SLICE)
    mask = cols < n_cols
    scale = tl.load(scale_ptr)
    parts = tl.arange(0, PARTS_POW2)
    arrived = 0
    if PREFETCH:
        next_x = tl.load(
            logits_ptr + tl.cast(group, tl.int64) * row_stride + cols, mask=mask & (group < n_rows),
            other=float("-inf"),
        )  # fmt: skip
    for row in range(group, n_rows, n_groups):
        row64 = tl.cast(row, tl.int64)
        if PREFETCH:
            x = next_x.to(tl.float32)
            following = row64 + n_groups
            next_x = tl.load(
                logits_ptr + following * row_stride + cols, mask=mask & (following < n_rows),
                other=float("-inf"),
            )  # fmt: skip
        else:
            x = tl.load(logits_ptr + row64 * row_stride + cols, mask=mask, other=float("-inf")).to(tl.float32)
        label = tl.load(labels_ptr + row64).to(tl.int32)
        if label == ignore_index:
            zeros = tl.zeros([SLICE], dtype=logits_ptr.dtype.element_ty)
            tl.store(logits_ptr + row64 * row_stride + cols, zeros, mask=mask)
            if part == 0:
                tl.store(loss_ptr + row64, 0.0)
        else:
            slice_max = tl.max(x, axis=0)
            slice_sum = tl.sum(tl.exp2((x - slice_max) * LOG2E), axis=0)
            # Two slots per group, by the parity of its rows: a program one row ahead writes the other.
            slot = partials_ptr + ((group * 2 + arrived % 2) * PARTS + part) * 2
            tl.store(slot, slice_max)
            tl.store(slot + 1, slice_sum)
            arrived += 1
            tl.debug_barrier()  # every thread's stores before the release
            tl.atomic_add(arrivals_ptr + group, 1, sem="release")
            seen = tl.atomic_add(arrivals_ptr + group, 0, sem="acquire")
            while seen < arrived * PARTS:
                seen = tl.atomic_add(arrivals_ptr + group, 0, sem="acquire")
            base = partials_ptr + ((group * 2 + (arrived - 1) % 2) * PARTS) * 2
            maxima = tl.load(base + parts * 2, mask=parts < PARTS, other=-1.0e30, volatile=True)
            sums = tl.load(base + parts * 2 + 1, mask=parts < PARTS, other=0.0, volatile=True)
            row_max = tl.max(maxima, axis=0)
            log2_sum = tl.log2(tl.sum(sums * tl.exp2((maxima - row_max) * LOG2E), axis=0))
            is_label = cols == label
            grad = scale * (tl.exp2((x - row_max) * LOG2E - log2_sum) - tl.where(is_label, 1.0, 0.0))
            tl.store(logits_ptr + row64 * row_stride + cols, grad.to(logits_ptr.dtype.element_ty), mask=mask)
            if label // SLICE == part:  # the program holding the label's logit writes the loss
                x_label = tl.sum(tl.where(is_label, x, 0.0), axis=0)
                tl.store(loss_ptr + row64, row_max - x_label + log2_sum * LN2)


def split_row_cross_entropy_(
    logits: torch.Tensor, labels: torch.Tensor, slice_cols: int, warps: int, prefetch: bool
):
    """Mean cross-entropy of ``logits``, whose buffer receives the gradient. Returns (loss, compiled kernel)."""
    n_rows, n_cols = logits.shape
    parts = triton.cdiv(n_cols, slice_cols)
    processors = torch.cuda.get_device_properties(logits.device).multi_processor_count
    n_groups = max(1, min(n_rows, processors // parts))
    arrivals = torch.zeros(n_groups, dtype=torch.int32, device=logits.device)
    partials = torch.empty(n_groups * 2 * parts * 2, dtype=torch.float32, device=logits.device)
    loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    scale = (labels != -100).sum().clamp_min(1).float().reciprocal().reshape(1)
    kernel = _split_row_kernel[(n_groups * parts,)](
        logits, logits.stride(0), labels, loss, partials, arrivals, scale, n_rows, n_cols, -100, n_groups,
        SLICE=slice_cols, PARTS=parts, PARTS_POW2=triton.next_power_of_2(parts), PREFETCH=prefetch,
        num_warps=warps, launch_cooperative_grid=True,  # all programs resident, or a launch error
    )  # fmt: skip
    return loss.sum() * scale, kernel


def measure_shape(tokens: int, vocab: int, bench) -> dict:
    from fusetune.kernels.cross_entropy import cross_entropy

    processors = torch.cuda.get_device_properties(0).multi_processor_count
    torch.manual_seed(0)
    logits = (torch.randn(tokens, vocab, device="cuda") * 4).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (tokens,), device="cuda")
    n = logits.numel()
    work = torch.empty_like(logits)
    partial_sums = torch.empty(16 * processors, device="cuda")
    row = {"T": tokens, "V": vocab, "logits_GB": round(n * logits.element_size() / 1e9, 3)}
    row["copy_ms"] = bench(lambda: work.copy_(logits))
    row["read_only_ms"] = min(
        bench(lambda b=b, w=w, p=p: _read_kernel[(processors * p,)](logits, partial_sums, n, BLOCK=b, num_warps=w))
        for b, w, p in ((16384, 32, 1), (2048, 8, 8), (1024, 4, 16))
    )  # fmt: skip
    row["write_only_ms"] = bench(lambda: _write_kernel[(processors * 8,)](work, n, BLOCK=2048, num_warps=8))
    grad_input = logits.clone().requires_grad_()
    row["fusetune_loss_ms"] = bench(lambda: cross_entropy(logits, labels))
    row["fusetune_fwd_bwd_ms"] = bench(
        lambda: torch.autograd.grad(cross_entropy(grad_input, labels, inplace_backward=True), [grad_input])
    )
    reference = logits.float().requires_grad_()
    reference_loss = torch.nn.functional.cross_entropy(reference, labels)
    (reference_grad,) = torch.autograd.grad(reference_loss, [reference])
    del reference
    for slice_cols, warps, prefetch in SPLIT_VARIANTS:
        name = f"split_rows_{slice_cols}cols_{warps}warps" + ("_prefetch" if prefetch else "")
        try:
            work.copy_(logits)
            loss, kernel = split_row_cross_entropy_(work, labels, slice_cols, warps, prefetch)
            grad_error = (work.float() - reference_grad).abs().max().item()
            loss_error = abs(loss.item() - reference_loss.item())
            if grad_error > 1e-5 or loss_error > 1e-4:
                raise AssertionError(f"differs from torch: gradient {grad_error:.2e}, loss {loss_error:.2e}")
            ms = bench(
                lambda s=slice_cols, w=warps, p=prefetch: split_row_cross_entropy_(work, labels, s, w, p)
            )
            row[name] = {"ms": ms, "registers": kernel.n_regs, "spills": kernel.n_spills}
        except Exception as error:  # a variant that cannot launch or is wrong: recorded, the run goes on
            row[name] = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    from triton.testing import do_bench

    def bench(fn) -> float:
        return round(float(do_bench(fn, warmup=25, rep=200, return_mode="median")), 4)

    rows = []
    for tokens, vocab in SHAPES:
        rows.append(measure_shape(tokens, vocab, bench))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "cross-entropy-bounds.json"), "w") as handle:
        json.dump(rows, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
