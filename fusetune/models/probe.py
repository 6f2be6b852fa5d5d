"""Numerical probes: does a fused replacement compute what the Hugging Face code it replaces computes?

A probe runs the original and the candidate replacement on the same small random input, forward and backward
with the same incoming gradient, and compares every output and every input and parameter gradient. It runs on
the device the model trains on, in float32 (sharp: a wrong epsilon or scale shows) and in the dtype of the
part's own parameters when that is another. Passing means: within the tolerance that fusetune's kernel tests
allow between the kernel and Hugging Face's own code for that op (`PROBE_TOLERANCES`), or in 16 bits, no
further from float32 than the original itself (`run_probe`). A probe that raises, or whose shapes or dtypes
differ, fails.

How a tensor is compared: element by element, |actual - expected| <= atol * scale + rtol * |expected|, where
`scale` is the largest |expected| of the element's row (the last dimension; the whole tensor for a vector).
The kernel tests scale their atol by the largest reference magnitude the same way; doing it per row keeps the
norm probes' rows of very different magnitude (chosen so that epsilon matters, see recognize.py) each to their
own scale. The loss is the exception (`WHOLE_TENSOR_SCALE`): its kernel test scales by the whole tensor
(tests/kernels/test_fused_linear_cross_entropy.py), and per row its lm_head gradient would be held to float32's
own rounding: a vocabulary row that is no label gets softmax(logits) times the hidden states, exp(logit - lse)
with lse about log(vocabulary size), so a rounding of lse (1e-6 of it at 100,000 tokens) is a relative error of
the whole row, on any implementation, Hugging Face's included.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

Tolerance = tuple[float, float]  # (atol, rtol)

# (atol, rtol) per op and dtype: the kernel tests' own tables for the kernel against Hugging Face's code (rows
# alike in shape on purpose: each op's numbers are data, cited from the test that set them).
PROBE_TOLERANCES: dict[str, dict[torch.dtype, Tolerance]] = {
    # tests/kernels/test_rms_norm.py HF_BACKWARD_TOLERANCES: HF's own bf16 backward rounds every intermediate
    # gradient, so forward and backward are held to the backward's table.
    "rms_norm": {
        torch.float32: (1e-5, 1e-5),
        torch.bfloat16: (2e-2, 2e-2),
        torch.float16: (4e-3, 4e-3),
    },
    # tests/kernels/test_swiglu.py MLP_TOLERANCES (the whole gated MLP against the transformers class).
    "gated_mlp": {
        torch.float32: (1e-5, 1e-5),
        torch.bfloat16: (3e-2, 3e-2),
        torch.float16: (4e-3, 4e-3),
    },
    # tests/kernels/test_swiglu.py TOLERANCES (act(gate) * up alone: the MoE experts' gate).
    "gated_activation": {
        torch.float32: (1e-5, 1e-5),
        torch.bfloat16: (1e-2, 1e-2),
        torch.float16: (1e-3, 1e-3),
    },
    # tests/kernels/test_rope.py TOLERANCES.
    "rope": {
        torch.float32: (1e-5, 1e-5),
        torch.bfloat16: (1e-2, 1e-2),
        torch.float16: (1e-3, 1e-3),
    },
    # tests/kernels/test_fused_linear_cross_entropy.py TOLERANCES (atol relative to the largest value); that
    # table has no float16 row, which takes bfloat16's.
    "causal_lm_loss": {
        torch.float32: (1e-6, 1e-5),
        torch.bfloat16: (4e-3, 2e-2),
        torch.float16: (4e-3, 2e-2),
    },
    # A decoder layer with its residual add, norm and gated MLP fused: the widest of its parts in 16-bit
    # (gated_mlp); in float32 the whole-step tolerance of tests/models/test_patching.py (FP32_STEP), since
    # attention and three matmuls sit between the kernels and the output.
    "decoder_layer": {
        torch.float32: (1e-4, 1e-4),
        torch.bfloat16: (3e-2, 3e-2),
        torch.float16: (4e-3, 4e-3),
    },
}


@dataclass(frozen=True)
class ProbeResult:
    """Whether a replacement matched; `error` is the worst |difference| / allowed over every compared
    element (at most 1 passes; inf when the probe failed outright), `detail` says where or why."""

    passed: bool
    error: float
    detail: str

    @classmethod
    def failure(cls, detail: str) -> ProbeResult:
        return cls(False, float("inf"), detail)


# Ops compared with atol scaled by the largest |expected| of the whole tensor, as their kernel test does.
WHOLE_TENSOR_SCALE = frozenset({"causal_lm_loss"})


def tolerance_for(op: str, dtype: torch.dtype) -> Tolerance:
    table = PROBE_TOLERANCES[op]
    return table.get(dtype, table[torch.float32])


def compare(
    actual: Sequence[torch.Tensor | None],
    expected: Sequence[torch.Tensor | None],
    names: Sequence[str],
    tolerance: Tolerance,
    per_row: bool = True,
) -> ProbeResult:
    """Every pair within `tolerance`, atol scaled per row or (`per_row=False`) by the whole tensor (see the
    module docstring); the worst one named in `detail`."""
    atol, rtol = tolerance
    worst, worst_name = 0.0, ""
    for name, got, want in zip(names, actual, expected, strict=True):
        if got is None and want is None:
            continue
        if got is None or want is None:
            return ProbeResult.failure(
                f"{name}: {'missing' if got is None else 'unexpected'} in the replacement"
            )
        if got.shape != want.shape:
            return ProbeResult.failure(f"{name}: shape {tuple(got.shape)} instead of {tuple(want.shape)}")
        if got.dtype != want.dtype:
            return ProbeResult.failure(f"{name}: dtype {got.dtype} instead of {want.dtype}")
        got64, want64 = got.detach().double(), want.detach().double()
        if not torch.isfinite(want64).all():
            return ProbeResult.failure(f"{name}: the original gives non-finite values on the probe input")
        if not torch.isfinite(got64).all():
            return ProbeResult.failure(f"{name}: non-finite values")
        if got64.numel() == 0:
            continue
        magnitude = want64.abs()
        scale = magnitude.amax(dim=-1, keepdim=True) if per_row and want64.dim() >= 2 else magnitude.max()
        allowed = atol * scale + rtol * magnitude
        ratio = float(((got64 - want64).abs() / allowed.clamp_min(1e-300)).max())
        if ratio > worst:
            worst, worst_name = ratio, name
    if worst <= 1.0:
        return ProbeResult(True, worst, f"worst {worst_name or 'difference'} at {worst:.2g} of the tolerance")
    return ProbeResult(False, worst, f"{worst_name} off by {worst:.3g} times the tolerance {tolerance}")


@dataclass
class ProbeCall:
    """One run of a probed function: positional and keyword arguments, and the leaf tensors whose gradients
    are compared (inputs made for the probe and the parameters that take part)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    wrt: list[torch.Tensor]
    wrt_names: list[str]


# make_call(dtype, upcast): the probe's call in `dtype`; with `upcast`, the very same values in float32 (the
# part copied to float32, the inputs made in `dtype` and then widened), to run the original exactly.
MakeCall = Callable[[torch.dtype, bool], ProbeCall]

# One rounding of each 16-bit dtype, relative: what a kernel may add to the original's own distance from
# float32 in the comparison against float32 below.
_ROUNDING = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def run_probe(
    original: Callable[..., Any],
    replacement: Callable[..., Any],
    make_call: MakeCall,
    outputs: Callable[[Any], Sequence[torch.Tensor]],
    op: str,
    dtype: torch.dtype,
    *,
    seed: int = 0,
) -> ProbeResult:
    """Run `original` and `replacement` on fresh copies of one input in `dtype`, forward and backward with one
    random incoming gradient, under one RNG seed (so dropout and routing noise draw alike); compare the
    `outputs` and every gradient of the call's `wrt` within `PROBE_TOLERANCES[op][dtype]`.

    In a 16-bit dtype both sides carry their own rounding, and where they differ by more than the table, the
    replacement still passes if, tensor by tensor, it is no further from the original run in float32 on the
    same values than twice the original's own distance plus one rounding of the dtype (the bar
    tests/models/test_convergence.py sets bf16 training). The shapes and dtypes must be the original's.
    """
    grad_outputs: list[torch.Tensor] = []
    original_run = _run(original, make_call(dtype, False), outputs, grad_outputs, seed)
    if isinstance(original_run, str):
        return ProbeResult.failure(f"the original raised {original_run}")
    replacement_run = _run(replacement, make_call(dtype, False), outputs, grad_outputs, seed)
    if isinstance(replacement_run, str):
        return ProbeResult.failure(f"the replacement raised {replacement_run}")
    (expected, names), (actual, _) = original_run, replacement_run
    if len(actual) != len(expected):
        return ProbeResult.failure(f"{len(actual)} outputs and gradients instead of {len(expected)}")
    result = compare(actual, expected, names, tolerance_for(op, dtype), per_row=op not in WHOLE_TENSOR_SCALE)
    if result.passed or dtype not in _ROUNDING or not torch.isfinite(torch.tensor(result.error)):
        return result
    truth_run = _run(original, make_call(dtype, True), outputs, [g.float() for g in grad_outputs], seed)
    if isinstance(truth_run, str):
        return result
    truth, _ = truth_run
    worst, worst_name = 0.0, ""
    for name, got, own, want in zip(names, actual, expected, truth, strict=True):
        if got is None or want is None or own is None:
            continue
        scale = float(want.double().abs().max()) or 1.0
        replacement_error = float((got.double() - want.double()).abs().max()) / scale
        original_error = float((own.double() - want.double()).abs().max()) / scale
        ratio = replacement_error / (2 * original_error + _ROUNDING[dtype])
        if ratio > worst:
            worst, worst_name = ratio, name
    if worst <= 1.0:
        return ProbeResult(
            True, worst, f"{result.detail}, but as close to float32 as the original ({worst:.2g} of the bar)"
        )
    return ProbeResult(
        False, worst, f"{result.detail}; and {worst_name} {worst:.3g} times further from float32 than allowed"
    )


def _run(
    function: Callable[..., Any],
    call: ProbeCall,
    outputs: Callable[[Any], Sequence[torch.Tensor]],
    grad_outputs: list[torch.Tensor],
    seed: int,
) -> tuple[list[torch.Tensor | None], list[str]] | str:
    """(outputs and gradients, their names) of one forward and backward, or what it raised. The first run
    fills `grad_outputs` (random, seeded); later runs take the same."""
    try:
        devices = sorted({t.device.index or 0 for t in call.wrt if t.is_cuda})
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            result = list(outputs(function(*call.args, **call.kwargs)))
            if not grad_outputs:
                generator = torch.Generator().manual_seed(seed + 1)
                grad_outputs += [
                    torch.randn(o.shape, generator=generator, device="cpu").to(o.device, o.dtype)
                    for o in result
                ]
            if [o.shape for o in result] != [g.shape for g in grad_outputs]:
                shapes = [tuple(o.shape) for o in result]
                return f"ValueError: output shapes {shapes}, not {[tuple(g.shape) for g in grad_outputs]}"
            differentiable = [(o, g) for o, g in zip(result, grad_outputs, strict=True) if o.requires_grad]
            grads: Sequence[torch.Tensor | None] = [None] * len(call.wrt)
            if differentiable and call.wrt:
                grads = torch.autograd.grad(
                    [o for o, _ in differentiable],
                    call.wrt,
                    [g.to(o.dtype) for o, g in differentiable],
                    allow_unused=True,
                )
    except Exception as error:  # noqa: BLE001 - a probe that raises is a failed probe, with its reason
        return f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"
    output_names = [f"output {i}" if len(result) > 1 else "output" for i in range(len(result))]
    tensors = [o.detach() for o in result] + [g.detach() if g is not None else None for g in grads]
    return tensors, [*output_names, *(f"grad {name}" for name in call.wrt_names)]


def first_tensors(result: Any) -> tuple[torch.Tensor, ...]:
    """The floating-point tensor outputs of a module call: a tensor, or the tensors of a tuple or list."""
    if isinstance(result, torch.Tensor):
        return (result,)
    if isinstance(result, (tuple, list)):
        return tuple(t for t in result if isinstance(t, torch.Tensor) and t.is_floating_point())
    raise TypeError(f"returned {type(result).__name__}, not a tensor or a tuple of tensors")
