"""The gated activation's float8 backward against its definition: torchao's tensorwise casts of what the bf16
gated backward kernel stores, bit for bit, in both layouts."""

import pytest
import torch
from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
from torchao.float8.float8_utils import amax_to_scale

from fusetune.kernels import float8_gated
from fusetune.kernels._interpreter import interpreted
from fusetune.kernels.float8_gated import gated_float8_backward, gated_float8_gradient_maxima
from fusetune.kernels.swiglu import _launch_gated_backward
from tests.hopper_target import run_on_hopper_target
from tests.kernels.mutation import mutated_kernel

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ACTIVATIONS = ["silu", "gelu_tanh", "gelu"]
# Tokens x intermediate: whole tiles, ragged ones in both directions, one token.
SHAPES = [(128, 192), (100, 200), (1, 48)]


def _inputs(tokens: int, intermediate: int, device: str, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    grad = torch.randn(tokens, intermediate, generator=generator) * 1e-3
    gate = torch.randn(tokens, intermediate, generator=generator) * 2
    up = torch.randn(tokens, intermediate, generator=generator)
    return (t.to(device=device, dtype=torch.bfloat16) for t in (grad, gate, up))


def _reference(grad, gate, up, activation, scale_factor: float = 1.0):
    """((hidden^T, d gate, d gate^T, d up, d up^T), scales, maxima): the bf16 kernel's gradients and product,
    cast by torchao with tensorwise scales from their maxima (times `scale_factor`: above 1, values overflow the
    format and are clamped)."""
    d_gate, d_up, hidden = torch.empty_like(gate), torch.empty_like(up), torch.empty_like(gate)
    _launch_gated_backward(grad, gate, up, d_gate, d_up, hidden, activation)
    scales = scale_factor * torch.stack([
        amax_to_scale(hidden.abs().max(), E4M3),
        amax_to_scale(d_gate.abs().max(), E5M2),
        amax_to_scale(d_up.abs().max(), E5M2),
    ])  # fmt: skip

    def cast(tensor, scale, dtype):
        return hp_tensor_and_scale_to_float8(tensor, scale, dtype)._data

    d_gate8, d_up8 = cast(d_gate, scales[1], E5M2), cast(d_up, scales[2], E5M2)
    hidden_t = cast(hidden, scales[0], E4M3).t().contiguous()
    maxima = torch.stack([d_gate.abs().max(), d_up.abs().max()]).float()
    return (hidden_t, d_gate8, d_gate8.t().contiguous(), d_up8, d_up8.t().contiguous()), scales, maxima


def _matches(grad, gate, up, activation, scale_factor: float = 1.0) -> bool:
    """Whether the kernels give the reference's maxima and five tensors, bit for bit."""
    expected, scales, maxima = _reference(grad, gate, up, activation, scale_factor)
    if not torch.equal(gated_float8_gradient_maxima(grad, gate, up, activation), maxima):
        return False
    actual = gated_float8_backward(grad, gate, up, activation, scales)
    for tensor, reference in zip(actual, expected, strict=True):
        assert tensor.shape == reference.shape and tensor.is_contiguous()
        if not torch.equal(tensor.view(torch.uint8), reference.view(torch.uint8)):
            return False
    return True


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_torchaos_casts_of_the_bf16_backward_bit_for_bit(activation, shape, device):
    grad, gate, up = _inputs(*shape, device)
    assert _matches(grad, gate, up, activation)
    # Scales 4x larger than 448 / amax: the values beyond the format's range are clamped, as torchao's are.
    assert _matches(grad, gate, up, activation, scale_factor=4.0)


@pytest.mark.parametrize(
    ("kernel", "old", "new"),
    [
        pytest.param("_gated_float8_backward_kernel", "tl.store(d_gate_t_ptr + transposed, d_gate8, mask=mask)",
                     "tl.store(d_gate_t_ptr + offsets, d_gate8, mask=mask)", id="transposed-written-row-major"),
        pytest.param("_gated_float8_backward_kernel", "tl.load(scales_ptr + 2)", "tl.load(scales_ptr + 1)",
                     id="d-up-with-d-gates-scale"),
        pytest.param("_gated_float8_backward_kernel", "round_to_dtype(grad * up * slope, dtype, SOFTWARE_ROUNDING)",
                     "(grad * up * slope)", id="d-gate-not-rounded-to-bf16"),
        pytest.param("_gated_float8_backward_kernel", "tl.minimum(tl.maximum(value * scale, -largest), largest)",
                     "value * scale", id="not-clamped"),
        pytest.param("_gated_gradient_maxima_kernel", "tl.max(tl.max(tl.abs(d_up), axis=1), axis=0)",
                     "tl.max(tl.max(d_up, axis=1), axis=0)", id="maximum-without-magnitude"),
    ],
)  # fmt: skip
def test_a_mutated_kernel_fails_the_comparison(kernel, old, new, tmp_path, monkeypatch, device):
    """Each edit breaks a different part: a layout, a scale, the bf16 rounding, the clamp, the maxima."""
    if "minimum" in old and not interpreted():
        pytest.skip(
            "the GPU's float8 conversion saturates by itself: the clamp matters to the software rounding"
        )
    monkeypatch.setattr(
        float8_gated, kernel, mutated_kernel(getattr(float8_gated, kernel), old, new, tmp_path)
    )
    grad, gate, up = _inputs(100, 200, device)
    assert not _matches(grad, gate, up, "gelu_tanh", scale_factor=4.0)


def test_bad_inputs_are_refused_with_the_argument(device):
    grad, gate, up = _inputs(4, 16, device)
    scales = torch.ones(3, device=device)
    with pytest.raises(ValueError, match="one \\[tokens, intermediate\\] shape"):
        gated_float8_gradient_maxima(grad, gate, up[:, :8], "silu")
    with pytest.raises(ValueError, match="share a dtype"):
        gated_float8_gradient_maxima(grad.float(), gate, up, "silu")
    with pytest.raises(ValueError, match="activation must be one of silu, gelu_tanh, gelu, got 'relu'"):
        gated_float8_backward(grad, gate, up, "relu", scales)
    with pytest.raises(ValueError, match="scales must be 3 float32 values"):
        gated_float8_backward(grad, gate, up, "silu", scales[:2])
    with pytest.raises(ValueError, match="grad_dtype must be torch.float8_e4m3fn or torch.float8_e5m2"):
        gated_float8_backward(grad, gate, up, "silu", scales, grad_dtype=torch.bfloat16)


# What Inductor reads from the kernels' stores: the arguments a launch writes, which a compiled graph copies
# first (Inductor only lowers the kernels to Triton's IR for this).
_WRITES_SCRIPT = """
import json, torch, triton.language as tl
from torch._higher_order_ops.triton_kernel_wrap import identify_accessed_tensors
from fusetune.kernels import float8_gated as fg

rows, cols = 256, 512
inputs = dict(grad_ptr=torch.empty(rows, cols, dtype=torch.bfloat16))
inputs.update(gate_ptr=torch.empty_like(inputs["grad_ptr"]), up_ptr=torch.empty_like(inputs["grad_ptr"]))
tile = dict(n_rows=rows, n_cols=cols, ACTIVATION=1, BLOCK_ROWS=64, BLOCK_COLS=64, SOFTWARE_ROUNDING=False)
e5m2 = lambda *shape: torch.empty(*shape, dtype=torch.float8_e5m2)
launches = {
    "maxima": (fg._gated_gradient_maxima_kernel, dict(**inputs, maxima_ptr=torch.zeros(32, 2), **tile)),
    "backward": (fg._gated_float8_backward_kernel, dict(
        **inputs, scales_ptr=torch.ones(3), hidden_t_ptr=torch.empty(cols, rows, dtype=torch.float8_e4m3fn),
        d_gate_ptr=e5m2(rows, cols), d_gate_t_ptr=e5m2(cols, rows), d_up_ptr=e5m2(rows, cols),
        d_up_t_ptr=e5m2(cols, rows), HIDDEN_DTYPE=tl.float8e4nv, GRAD_DTYPE=tl.float8e5, **tile)),
}
print(json.dumps({name: sorted(access.name for access in identify_accessed_tensors(kernel, kwargs, {})
                               .read_writes.writes) for name, (kernel, kwargs) in launches.items()}))
"""


def test_inductor_reads_each_kernel_as_writing_only_its_outputs():
    """Inductor decides which arguments a Triton kernel writes from the addresses of its stores. When the
    backward kernel took its store addresses from a helper given the input pointers, Inductor counted grad, gate
    and up as written and copied gate and up before each launch: 0.28 ms a layer at the Gemma-2-2B shape, 8 x
    2,048 tokens (h200-step.md, e2e-fp8-gemma-mlp-node, triton_poi_fused_10)."""
    triton_kernel_wrap = pytest.importorskip("torch._higher_order_ops.triton_kernel_wrap")
    if not hasattr(triton_kernel_wrap, "identify_accessed_tensors"):
        pytest.skip("this torch names Inductor's analysis of a kernel's stores otherwise")
    assert run_on_hopper_target(_WRITES_SCRIPT) == {
        "maxima": ["maxima_ptr"],
        "backward": ["d_gate_ptr", "d_gate_t_ptr", "d_up_ptr", "d_up_t_ptr", "hidden_t_ptr"],
    }


def test_no_tokens_give_zero_maxima_and_empty_float8_tensors(device):
    grad, gate, up = _inputs(0, 48, device)
    assert torch.equal(gated_float8_gradient_maxima(grad, gate, up, "silu"), torch.zeros(2, device=device))
    outputs = gated_float8_backward(grad, gate, up, "silu", torch.ones(3, device=device))
    assert [tuple(t.shape) for t in outputs] == [(48, 0), (0, 48), (48, 0), (0, 48), (48, 0)]
