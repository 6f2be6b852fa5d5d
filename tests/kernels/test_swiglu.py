"""SwiGLU / GeGLU kernels and the fused gated MLPs against pure-PyTorch references and transformers' MLPs.

Kernel and reference both compute the activation in fp32 from the same inputs and round once, so outputs and
gradients may differ by about one rounding of the dtype. The MLPs are compared with the transformers class run
in fp32 on the same (rounded) weights and inputs: in low precision both implementations round the projections,
the product and every gradient product, which MLP_TOLERANCES allows for.
"""

import importlib.util
import inspect
import itertools
import math

import pytest
import torch
from torch import nn

from fusetune.kernels import swiglu as swiglu_module
from fusetune.kernels.swiglu import (
    FusedGeGLUMLP,
    FusedSwiGLUMLP,
    geglu,
    geglu_reference,
    swiglu,
    swiglu_reference,
)

# (atol, rtol) per dtype: one rounding of the dtype (bf16 keeps 8 significant bits, fp16 11) plus fp32 noise.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (1e-2, 1e-2),
    torch.float16: (1e-3, 1e-3),
}
# Whole MLP in the dtype vs the transformers class in fp32: the forward rounds gate, up, the product and the
# output, the backward grad_hidden, both activation gradients and every GEMM product. Measured worst error
# over the tests' inputs (3 seeds, sizes up to 256 -> 688 with 256 tokens), in units of one TOLERANCES
# rounding (weight gradients with the sqrt(tokens) atol scaling): bf16 1.3, fp16 2.0. Limits: 3 and 4.
MLP_TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (3e-2, 3e-2),
    torch.float16: (4e-3, 4e-3),
}
DTYPES = list(TOLERANCES)


def _assert_matches(actual, expected, dtype, table=TOLERANCES, summed_rows: int = 1) -> None:
    """assert_close with the dtype's tolerances; sums over `summed_rows` rows (weight gradients) get their
    atol scaled by sqrt(summed_rows): the rounding error of a sum of n terms grows like sqrt(n)."""
    atol, rtol = table[dtype]
    torch.testing.assert_close(
        actual.float(), expected.float(), atol=atol * math.sqrt(summed_rows), rtol=rtol
    )


def _randn(shape, dtype, device, seed, scale=1.0):
    # Drawn on the test device: real-size GPU cases would spend seconds drawing on the CPU.
    generator = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(shape, generator=generator, device=device) * scale).to(dtype=dtype)


def _check_gated(fn, reference, shape, dtype, device, intermediate: bool, layout: str = "contiguous"):
    """fn vs reference on (a, b): output, d a and d b. `intermediate` makes a, b non-leaf (in-place backward)."""
    a_leaf = _randn(shape, dtype, device, seed=1, scale=2.0).requires_grad_(True)
    b_leaf = _randn(shape, dtype, device, seed=2).requires_grad_(True)
    grad = _randn(shape, dtype, device, seed=3)
    results = []
    for f in (fn, reference):
        a_in = a_leaf.detach().clone().requires_grad_(True)
        b_in = b_leaf.detach().clone().requires_grad_(True)
        a, b = a_in, b_in
        if intermediate:
            a, b = a_in * 1, b_in * 1
        if layout == "rows_of_one_buffer":
            # gate and up as the two halves of one [rows, 2 * cols] buffer (row stride 2 * cols).
            fused = torch.cat((a, b), dim=-1)
            a, b = fused[..., : shape[-1]], fused[..., shape[-1] :]
        elif layout == "transposed":
            a, b = a.mT.contiguous().mT, b.mT.contiguous().mT
        out = f(a, b)
        out.backward(grad)
        results.append((out.detach().clone(), a_in.grad, b_in.grad))
    (out, grad_a, grad_b), (out_ref, grad_a_ref, grad_b_ref) = results
    _assert_matches(out, out_ref, dtype)
    _assert_matches(grad_a, grad_a_ref, dtype)
    _assert_matches(grad_b, grad_b_ref, dtype)


SHAPES = [
    pytest.param((1, 5), id="1x5"),
    pytest.param((3, 4095), id="3x4095"),
    pytest.param((2, 3, 64), id="2x3x64"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("intermediate", [True, False], ids=["in-place", "leaf"])
@pytest.mark.parametrize("shape", SHAPES)
def test_swiglu_matches_reference(shape, intermediate, dtype, device):
    _check_gated(swiglu, swiglu_reference, shape, dtype, device, intermediate)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[1]])
def test_geglu_matches_reference(shape, approximate, dtype, device):
    _check_gated(
        lambda a, b: geglu(a, b, approximate),
        lambda a, b: geglu_reference(a, b, approximate),
        shape,
        dtype,
        device,
        intermediate=True,
    )


@pytest.mark.parametrize("layout", ["rows_of_one_buffer", "transposed"])
def test_strided_inputs(layout, device):
    _check_gated(swiglu, swiglu_reference, (3, 37), torch.float32, device, True, layout)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # numpy's exp in the CPU interpreter
def test_extreme_inputs(device):
    """Large |a| saturates sigmoid/tanh/erf without producing inf or nan."""
    a = torch.tensor([[-1e4, -80.0, -20.0, -1e-6, 0.0, 1e-6, 20.0, 80.0, 1e4]], device=device)
    b = torch.full_like(a, 0.5)
    for fn, reference in (
        (swiglu, swiglu_reference),
        (lambda x, y: geglu(x, y, "tanh"), lambda x, y: geglu_reference(x, y, "tanh")),
        (lambda x, y: geglu(x, y, "none"), lambda x, y: geglu_reference(x, y, "none")),
    ):
        a_k, a_r = (a * 1).requires_grad_(), a.clone().requires_grad_()
        out = fn(a_k * 1, b)
        out.sum().backward()
        expected = reference(a_r, b)
        expected.sum().backward()
        _assert_matches(out, expected, torch.float32)
        _assert_matches(a_k.grad, a_r.grad, torch.float32)


def test_backward_writes_gradients_over_saved_inputs(device):
    a_leaf = _randn((4, 33), torch.float32, device, seed=1).requires_grad_(True)
    b_leaf = _randn((4, 33), torch.float32, device, seed=2).requires_grad_(True)
    a, b = a_leaf * 1, b_leaf * 1
    versions = (a._version, b._version)
    swiglu(a, b).backward(_randn((4, 33), torch.float32, device, seed=3))
    # a and b now hold exactly the gradients handed to their producers.
    assert torch.equal(a.detach(), a_leaf.grad) and torch.equal(b.detach(), b_leaf.grad)
    assert a._version > versions[0] and b._version > versions[1]


def test_leaf_and_shared_inputs_are_not_overwritten(device):
    a = _randn((2, 17), torch.float32, device, seed=1).requires_grad_(True)
    b = _randn((2, 17), torch.float32, device, seed=2).requires_grad_(True)
    a_before, b_before = a.detach().clone(), b.detach().clone()
    swiglu(a, b).sum().backward()
    assert torch.equal(a.detach(), a_before) and torch.equal(b.detach(), b_before)
    # The same intermediate as a and b: gradients must not be written over each other.
    x_leaf = _randn((2, 17), torch.float32, device, seed=1).requires_grad_(True)
    x_ref = x_leaf.detach().clone().requires_grad_(True)
    x = x_leaf * 1
    swiglu(x, x).sum().backward()
    swiglu_reference(x_ref, x_ref).sum().backward()
    _assert_matches(x_leaf.grad, x_ref.grad, torch.float32)


def test_other_saved_user_of_input_fails_loudly(device):
    """An input another node saved must not be read back after being overwritten with gradients."""
    a_leaf = _randn((2, 9), torch.float32, device, seed=1).requires_grad_(True)
    b = _randn((2, 9), torch.float32, device, seed=2).requires_grad_(True) * 1
    a = a_leaf * 1
    squared = a.square()  # saves a; created first, so its backward runs after swiglu's
    out = swiglu(a, b)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (out.sum() + squared.sum()).backward()


def test_rejects_mismatched_inputs(device):
    a = torch.randn(2, 8, device=device)
    with pytest.raises(ValueError, match="same shape"):
        swiglu(a, torch.randn(2, 9, device=device))
    with pytest.raises(ValueError, match="same dtype"):
        swiglu(a, a.double())
    with pytest.raises(ValueError, match="approximate"):
        geglu(a, a, "erf")


# ----------------------------------------------------------------------------------------------------------
# MLP modules against transformers
# ----------------------------------------------------------------------------------------------------------


def _llama_config(hidden=32, intermediate=80, bias=False):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        mlp_bias=bias,
        hidden_act="silu",
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=4,  # only the MLP is built; keeps odd hidden sizes valid for the config's checks
    )


def _activation_reference(fused: nn.Module):
    if fused.activation == "silu":
        return swiglu_reference
    approximate = "tanh" if fused.activation == "gelu_tanh" else "none"
    return lambda a, b: geglu_reference(a, b, approximate)


def _check_mlp(
    fused_cls,
    hf_cls,
    config,
    dtype,
    device,
    batch_shape=(2, 3),
    seed=0,
    fused_module=None,
    compile_module=False,
    compile_backend="inductor",
):
    """Fused module vs (1) the transformers class's projections around the activation reference, in the same
    dtype (rounds where the kernels round: TOLERANCES), and (2) the transformers class itself in fp32 on the
    same weights (MLP_TOLERANCES). Output, dx and every weight gradient."""
    torch.manual_seed(seed)
    hf = hf_cls(config).to(device=device, dtype=dtype)
    with torch.no_grad():
        # Values of order 1 at every size (weights ~ 1/sqrt(fan_in)), spread so a wrong factor shows in every
        # gradient.
        for p in hf.parameters():
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]) if p.dim() == 2 else 0.2)
    fused = fused_module if fused_module is not None else fused_cls(config)
    fused = fused.to(device=device, dtype=dtype)
    assert sorted(fused.state_dict()) == sorted(hf.state_dict())
    fused.load_state_dict(hf.state_dict())
    truth = hf_cls(config).to(device=device, dtype=torch.float32)
    truth.load_state_dict({k: v.float() for k, v in hf.state_dict().items()})
    activation_reference = _activation_reference(fused)

    def same_precision_reference(t):
        return hf.down_proj(activation_reference(hf.gate_proj(t), hf.up_proj(t)))

    x = _randn((*batch_shape, config.hidden_size), dtype, device, seed=seed + 1)
    grad = _randn((*batch_shape, config.hidden_size), dtype, device, seed=seed + 2)
    runner = torch.compile(fused, fullgraph=True, backend=compile_backend) if compile_module else fused
    results = {}
    for name, module, forward, run_dtype in (
        ("fused", fused, runner, dtype),
        ("reference", hf, same_precision_reference, dtype),
        ("truth", truth, truth, torch.float32),
    ):
        x_in = x.detach().to(run_dtype).clone().requires_grad_(True)
        out = forward(x_in * 1)  # non-leaf input, as from a norm
        out.backward(grad.to(run_dtype))
        grads = dict(module.named_parameters())
        assert all(p.grad is not None and p.grad.dtype == p.dtype for p in grads.values()), name
        results[name] = [("out", out.detach()), ("dx", x_in.grad)] + [(k, p.grad) for k, p in grads.items()]

    assert results["fused"][0][1].dtype == dtype
    assert [k for k, _ in results["fused"]] == [k for k, _ in results["truth"]]
    tokens = math.prod(batch_shape)
    for (key, value), (_, reference), (_, truth_value) in zip(
        results["fused"], results["reference"], results["truth"], strict=True
    ):
        summed_rows = 1 if key in ("out", "dx") else tokens  # weight and bias gradients sum over tokens
        _assert_matches(value, reference, dtype, summed_rows=summed_rows)
        _assert_matches(value, truth_value, dtype, MLP_TOLERANCES, summed_rows=summed_rows)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "mlp-bias"])
def test_swiglu_mlp_matches_llama_mlp(bias, dtype, device):
    from transformers.models.llama.modeling_llama import LlamaMLP

    _check_mlp(FusedSwiGLUMLP, LlamaMLP, _llama_config(bias=bias), dtype, device)


def test_swiglu_mlp_single_token_and_odd_sizes(device):
    from transformers.models.llama.modeling_llama import LlamaMLP

    _check_mlp(FusedSwiGLUMLP, LlamaMLP, _llama_config(hidden=5, intermediate=7), torch.float32, device, (1,))


@pytest.mark.parametrize(
    ("family", "activation"),
    [("gemma", "gelu_pytorch_tanh"), ("gemma2", "gelu_pytorch_tanh"), ("gemma2", "gelu")],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_geglu_mlp_matches_gemma_mlp(family, activation, dtype, device):
    if family == "gemma":
        from transformers import GemmaConfig
        from transformers.models.gemma.modeling_gemma import GemmaMLP as hf_cls

        config = GemmaConfig(hidden_size=32, intermediate_size=80, hidden_act=activation)
    else:
        from transformers import Gemma2Config
        from transformers.models.gemma2.modeling_gemma2 import Gemma2MLP as hf_cls

        config = Gemma2Config(hidden_size=32, intermediate_size=80, hidden_activation=activation)
    fused = FusedGeGLUMLP(config)
    assert fused.activation == ("gelu" if activation == "gelu" else "gelu_tanh")
    _check_mlp(FusedGeGLUMLP, hf_cls, config, dtype, device, fused_module=fused)


def test_mlp_rejects_wrong_activation():
    with pytest.raises(ValueError, match="hidden_act"):
        FusedSwiGLUMLP(_llama_config().__class__(hidden_act="gelu"))
    with pytest.raises(ValueError, match="gelu"):
        FusedGeGLUMLP(_llama_config())


def test_mlp_respects_hooks_and_wrapped_projections(device):
    """Hooks and adapter-wrapped projections take the module path, so their effects are kept."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    class ScaledLinear(nn.Linear):  # stands in for an adapter that changes the projection's forward
        def forward(self, x):
            return super().forward(x) * 0.5

    config = _llama_config()
    for patch in ("hook", "subclass"):
        hf, fused = LlamaMLP(config).to(device), FusedSwiGLUMLP(config).to(device)
        fused.load_state_dict(hf.state_dict())
        for module in (hf, fused):
            if patch == "hook":
                module.up_proj.register_forward_hook(lambda mod, args, out: out * 3.0)
            else:
                scaled = ScaledLinear(config.hidden_size, config.intermediate_size, bias=False).to(device)
                scaled.load_state_dict(module.gate_proj.state_dict())
                module.gate_proj = scaled
        x = torch.randn(2, 3, config.hidden_size, device=device)
        _assert_matches(fused(x), hf(x), torch.float32)


def test_mlp_frozen_weights_and_no_grad(device):
    from transformers.models.llama.modeling_llama import LlamaMLP

    config = _llama_config()
    hf, fused = LlamaMLP(config).to(device), FusedSwiGLUMLP(config).to(device)
    fused.load_state_dict(hf.state_dict())
    for module in (hf, fused):
        module.requires_grad_(False)
    x = torch.randn(2, 3, config.hidden_size, device=device)
    x_hf, x_fused = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    hf(x_hf).sum().backward()
    fused(x_fused).sum().backward()
    _assert_matches(x_fused.grad, x_hf.grad, torch.float32)
    assert all(p.grad is None for p in fused.parameters())
    with torch.no_grad():
        _assert_matches(fused(x), hf(x), torch.float32)


def test_mlp_under_checkpointing_and_saved_tensor_hooks(device):
    """Saved-tensor hooks (activation checkpointing, CPU offload) see and restore the MLP's saved tensors."""
    from torch.utils.checkpoint import checkpoint

    config = _llama_config()
    fused = FusedSwiGLUMLP(config).to(device)
    x = torch.randn(2, 3, config.hidden_size, device=device)
    grad = torch.randn_like(x)

    def run(wrapper):
        fused.zero_grad(set_to_none=True)
        x_in = x.clone().requires_grad_(True)
        out = wrapper(x_in * 1)
        out.backward(grad)
        return out.detach(), x_in.grad, [p.grad.clone() for p in fused.parameters()]

    plain = run(fused)
    for wrapped in (
        run(lambda t: checkpoint(fused, t, use_reentrant=False)),
        run(lambda t: checkpoint(fused, t, use_reentrant=True)),
    ):
        _assert_matches(wrapped[0], plain[0], torch.float32)
        _assert_matches(wrapped[1], plain[1], torch.float32)
        for got, want in zip(wrapped[2], plain[2], strict=True):
            _assert_matches(got, want, torch.float32)
    with torch.autograd.graph.save_on_cpu():
        offloaded = run(fused)
    _assert_matches(offloaded[1], plain[1], torch.float32)


def test_mlp_second_backward_raises(device):
    fused = FusedSwiGLUMLP(_llama_config()).to(device)
    out = fused(torch.randn(2, 32, device=device, requires_grad=True))
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        out.sum().backward()


# ----------------------------------------------------------------------------------------------------------
# Mutation tests: a deliberately broken kernel must fail the same comparisons.
# ----------------------------------------------------------------------------------------------------------

_KERNEL_CHAIN = ["_activation_and_slope", "_gated_forward_kernel", "_gated_backward_kernel"]
_mutant_ids = itertools.count()


def _load_mutant(old: str, new: str, tmp_path):
    """Fresh copies of the kernels with one source edit (a fresh module, so no compiled-kernel cache hit)."""
    source = "\n\n".join(inspect.getsource(getattr(swiglu_module, name).fn) for name in _KERNEL_CHAIN)
    assert source.count(old) == 1, f"mutation target not found exactly once: {old!r}"
    name = f"swiglu_mutant_{next(_mutant_ids)}"
    path = tmp_path / f"{name}.py"
    path.write_text(
        "import triton\nimport triton.language as tl\n\n"
        "from fusetune.kernels._interpreter import round_to_dtype\n\n\n" + source.replace(old, new)
    )
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _swiglu_check(device):
    _check_gated(swiglu, swiglu_reference, (3, 41), torch.float32, device, intermediate=True)


def _geglu_tanh_check(device):
    _check_gated(
        lambda a, b: geglu(a, b, "tanh"), lambda a, b: geglu_reference(a, b, "tanh"), (3, 41), torch.float32,
        device, intermediate=True,
    )  # fmt: skip


def _mlp_check(device):
    from transformers.models.llama.modeling_llama import LlamaMLP

    _check_mlp(FusedSwiGLUMLP, LlamaMLP, _llama_config(), torch.float32, device)


MUTATIONS = [
    pytest.param("round_to_dtype(grad * act, grad_b_ptr", "round_to_dtype(grad * b, grad_b_ptr", _swiglu_check,
                 id="grad-b-uses-wrong-factor"),
    pytest.param("slope = sig * (1.0 + a * (1.0 - sig))", "slope = sig", _swiglu_check,
                 id="silu-derivative-dropped-term"),
    pytest.param("round_to_dtype(act * b, out_ptr", "round_to_dtype(act * a, out_ptr", _swiglu_check,
                 id="forward-wrong-factor"),
    pytest.param("0.044715 * a * a * a", "0.044715 * a * a", _geglu_tanh_check, id="gelu-tanh-cubic-term"),
    pytest.param("round_to_dtype(act * b, hidden_ptr", "round_to_dtype(act, hidden_ptr", _mlp_check,
                 id="recomputed-product-misses-up"),
    pytest.param("mask = cols < n_cols\n    grad =", "mask = cols < n_cols - 1\n    grad =", _swiglu_check,
                 id="backward-mask-off-by-one"),
]  # fmt: skip


@pytest.mark.parametrize(("old", "new", "check"), MUTATIONS)
def test_mutated_kernel_fails(old, new, check, tmp_path, monkeypatch, device):
    mutant = _load_mutant(old, new, tmp_path)
    monkeypatch.setattr(swiglu_module, "_gated_forward_kernel", mutant._gated_forward_kernel)
    monkeypatch.setattr(swiglu_module, "_gated_backward_kernel", mutant._gated_backward_kernel)
    with pytest.raises(AssertionError):
        check(device)


# ----------------------------------------------------------------------------------------------------------
# GPU: torch.compile, real sizes, memory
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("approximate", [None, "tanh", "none"], ids=["swiglu", "geglu-tanh", "geglu-erf"])
def test_compiled_fullgraph(approximate, device):
    if approximate is None:
        fn, reference = swiglu, swiglu_reference
    else:
        fn = lambda a, b: geglu(a, b, approximate)  # noqa: E731
        reference = lambda a, b: geglu_reference(a, b, approximate)  # noqa: E731
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b: fn(a * 1, b * 1), fullgraph=True)
    _check_gated(compiled, lambda a, b: reference(a * 1, b * 1), (64, 1000), torch.bfloat16, device, True)


def test_compiled_mlp_traces_with_aot_eager(device):
    """Dynamo + AOTAutograd through the MLP as it runs under torch.compile: the projections as modules around
    the activation, which is left to the compiler (CPU-safe backend)."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch._dynamo.reset()
    config = _llama_config(hidden=32, intermediate=48)
    _check_mlp(
        FusedSwiGLUMLP, LlamaMLP, config, torch.float32, device, (2, 5), compile_module=True,
        compile_backend="aot_eager",
    )  # fmt: skip


@pytest.mark.gpu
def test_compiled_mlp_fullgraph(device):
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch._dynamo.reset()
    config = _llama_config(hidden=256, intermediate=688)
    _check_mlp(FusedSwiGLUMLP, LlamaMLP, config, torch.bfloat16, device, (4, 64), compile_module=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_real_size_swiglu(dtype, device):
    _check_gated(swiglu, swiglu_reference, (2048, 14336), dtype, device, intermediate=True)


def _relative_error(actual, expected):
    return (
        torch.linalg.vector_norm(actual.float() - expected.float())
        / torch.linalg.vector_norm(expected.float())
    ).item()


@pytest.mark.gpu
def test_real_size_mlp_as_accurate_as_transformers(device):
    """At T=2048, 4096 -> 14336 in bf16 the fused MLP is no less accurate than LlamaMLP against fp32."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    config = _llama_config(hidden=4096, intermediate=14336)
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the GPU: 3 x 58M weights are slow to draw on the CPU
        hf = LlamaMLP(config).to(dtype=torch.bfloat16)
        fused = FusedSwiGLUMLP(config).to(dtype=torch.bfloat16)
        truth = LlamaMLP(config)
    fused.load_state_dict(hf.state_dict())
    truth.load_state_dict({k: v.float() for k, v in hf.state_dict().items()})
    x = torch.randn(2048, 4096, device=device, dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    results = {}
    for name, module, dtype in (
        ("hf", hf, torch.bfloat16),
        ("fused", fused, torch.bfloat16),
        ("truth", truth, torch.float32),
    ):
        x_in = x.detach().to(dtype).clone().requires_grad_(True)
        out = module(x_in * 1)
        out.backward(grad.to(dtype))
        results[name] = [out.detach(), x_in.grad] + [p.grad for p in module.parameters()]
    for fused_value, hf_value, truth_value in zip(
        results["fused"], results["hf"], results["truth"], strict=True
    ):
        fused_error = _relative_error(fused_value, truth_value)
        hf_error = _relative_error(hf_value, truth_value)
        assert fused_error < 1e-2
        assert fused_error <= 1.25 * hf_error + 1e-4, (fused_error, hf_error)


@pytest.mark.gpu
def test_mlp_peak_memory_holds_three_intermediate_buffers(device):
    """fwd+bwd peak: gate, up and one more [T, I] buffer (+ out, dx and the weight grads), below LlamaMLP's."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    tokens, hidden, intermediate = 4096, 512, 2048
    config = _llama_config(hidden=hidden, intermediate=intermediate)
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    grad = torch.randn_like(x)

    def peak_extra_bytes(module):
        for _ in range(2):  # the first round also creates cuBLAS workspaces
            module.zero_grad(set_to_none=True)
            x_in = x.clone().requires_grad_(True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            out = module(x_in)
            out.backward(grad)
            del out
            torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before

    element = 2
    bound = (3 * tokens * intermediate + 2 * tokens * hidden + 3 * hidden * intermediate) * element + 2**21
    fused_peak = peak_extra_bytes(FusedSwiGLUMLP(config).to(device=device, dtype=torch.bfloat16))
    hf_peak = peak_extra_bytes(LlamaMLP(config).to(device=device, dtype=torch.bfloat16))
    assert fused_peak <= bound, (fused_peak, bound)
    assert hf_peak > bound, (hf_peak, bound)  # the bound tells the two designs apart


# ----------------------------------------------------------------------------------------------------------
# Whole-MLP nodes used by the patched decoder layers: gated_mlp and add_rms_norm_gated_mlp
# ----------------------------------------------------------------------------------------------------------

_MLP_NODE_CASES = [
    # (layout, activation, bias, casting mode, norm offset)
    ("split", "silu", False, "llama", 0.0),
    ("fused_gate_up", "silu", True, "llama", 0.0),
    ("split", "gelu_tanh", False, "gemma", 1.0),
]


def _mlp_node_tensors(layout, bias, device, tokens=(2, 3), hidden=8, intermediate=12, seed=0):
    gate_rows = 2 * intermediate if layout == "fused_gate_up" else intermediate
    shapes = {
        "branch": (*tokens, hidden),
        "residual": (*tokens, hidden),
        "norm_weight": (hidden,),
        "gate_weight": (gate_rows, hidden),
        "gate_bias": (gate_rows,) if bias else None,
        "up_weight": (intermediate, hidden) if layout == "split" else None,
        "up_bias": (intermediate,) if bias and layout == "split" else None,
        "down_weight": (hidden, intermediate),
        "down_bias": (hidden,) if bias else None,
    }
    tensors = {}
    for index, (name, shape) in enumerate(shapes.items()):
        if shape is not None:
            scale = 1.0 / math.sqrt(shape[-1]) if len(shape) == 2 and "weight" in name else 0.5
            tensors[name] = _randn(shape, torch.float32, device, seed + index, scale).requires_grad_(True)
        else:
            tensors[name] = None
    return tensors


def _mlp_node_reference(t, activation, casting_mode, offset, eps):
    from fusetune.kernels.rms_norm import add_rms_norm_reference

    normed, new_residual = add_rms_norm_reference(
        t["branch"], t["residual"], t["norm_weight"], eps, offset, casting_mode
    )
    if t["up_weight"] is None:
        gate, up = torch.nn.functional.linear(normed, t["gate_weight"], t["gate_bias"]).chunk(2, dim=-1)
    else:
        gate = torch.nn.functional.linear(normed, t["gate_weight"], t["gate_bias"])
        up = torch.nn.functional.linear(normed, t["up_weight"], t["up_bias"])
    act = (
        torch.nn.functional.silu(gate)
        if activation == "silu"
        else torch.nn.functional.gelu(gate, approximate="tanh")
    )
    out = torch.nn.functional.linear(act * up, t["down_weight"], t["down_bias"])
    return out, new_residual


def _run_mlp_node(t, activation, casting_mode, offset, eps, grads):
    names = [k for k, v in t.items() if v is not None]
    inputs = {k: v.detach().clone().requires_grad_(True) if v is not None else None for k, v in t.items()}
    branch = inputs["branch"] * 1  # an intermediate of the graph, as the attention output is
    out, new_residual = swiglu_module.add_rms_norm_gated_mlp(
        branch,
        inputs["residual"],
        inputs["norm_weight"],
        inputs["gate_weight"],
        inputs["gate_bias"],
        inputs["up_weight"],
        inputs["up_bias"],
        inputs["down_weight"],
        inputs["down_bias"],
        eps=eps,
        offset=offset,
        casting_mode=casting_mode,
        activation=activation,
    )
    torch.autograd.backward((out, new_residual), grads)
    return out.detach(), new_residual.detach(), {k: inputs[k].grad for k in names}


@pytest.mark.parametrize("layout, activation, bias, casting_mode, offset", _MLP_NODE_CASES)
def test_add_rms_norm_gated_mlp_matches_reference(layout, activation, bias, casting_mode, offset, device):
    """Outputs and every gradient, with gradients arriving on both outputs (the MLP output and the residual
    stream, as in a decoder layer)."""
    t = _mlp_node_tensors(layout, bias, device)
    grads = (_randn((2, 3, 8), torch.float32, device, 90), _randn((2, 3, 8), torch.float32, device, 91))
    out, new_residual, actual = _run_mlp_node(t, activation, casting_mode, offset, 1e-6, grads)

    ref_out, ref_residual = _mlp_node_reference(t, activation, casting_mode, offset, 1e-6)
    torch.autograd.backward((ref_out, ref_residual), grads)
    _assert_matches(out, ref_out, torch.float32)
    _assert_matches(new_residual, ref_residual, torch.float32)
    assert actual.keys() == {k for k, v in t.items() if v is not None}
    for name, grad in actual.items():
        summed_rows = 1 if name in ("branch", "residual") else 6
        _assert_matches(grad, t[name].grad, torch.float32, summed_rows=summed_rows)


def test_add_rms_norm_gated_mlp_keeps_neither_the_norm_output_nor_the_product(device):
    """What the node saves for the backward: the new residual stream (returned anyway), rstd, the weights, and
    the gate and up projections; no [tokens, hidden] norm output and no third [tokens, intermediate] buffer."""
    t = _mlp_node_tensors("split", False, device, tokens=(5,), hidden=8, intermediate=12)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        out, new_residual = swiglu_module.add_rms_norm_gated_mlp(
            t["branch"] * 1, t["residual"], t["norm_weight"], t["gate_weight"], None, t["up_weight"], None,
            t["down_weight"], None, eps=1e-6,
        )  # fmt: skip
    activations = sorted(tuple(s.shape) for s in saved if s.shape[0] == 5)  # rows = tokens
    assert activations == [(5,), (5, 8), (5, 12), (5, 12)]
    assert any(s is new_residual for s in saved), "the saved stream must be the returned one, not a copy"


def test_add_rms_norm_gated_mlp_tolerance_catches_a_wrong_recomputed_product(device, monkeypatch):
    """The backward recomputes act(gate) * up for down_proj's weight gradient; a backward that skips that
    (and so multiplies by grad_hidden instead) must fail the comparison above."""
    t = _mlp_node_tensors("split", False, device)
    grads = (_randn((2, 3, 8), torch.float32, device, 90), _randn((2, 3, 8), torch.float32, device, 91))
    real = swiglu_module._launch_gated_backward

    def without_product(grad, a, b, grad_a, grad_b, hidden, activation):
        return real(grad, a, b, grad_a, grad_b, None, activation)

    monkeypatch.setattr(swiglu_module, "_launch_gated_backward", without_product)
    _, _, actual = _run_mlp_node(t, "silu", "llama", 0.0, 1e-6, grads)
    ref_out, ref_residual = _mlp_node_reference(t, "silu", "llama", 0.0, 1e-6)
    torch.autograd.backward((ref_out, ref_residual), grads)
    with pytest.raises(AssertionError):
        _assert_matches(actual["down_weight"], t["down_weight"].grad, torch.float32, summed_rows=6)


def test_gated_mlp_with_a_fused_gate_up_projection(device):
    """Phi-3's layout: one [gate; up] projection whose output halves feed the activation."""
    t = _mlp_node_tensors("fused_gate_up", True, device)
    x = t["branch"].detach().clone().requires_grad_(True)
    weights = [
        t[k].detach().clone().requires_grad_(True) for k in ("gate_weight", "gate_bias", "down_weight")
    ]
    out = swiglu_module.gated_mlp(x * 1, weights[0], weights[1], None, None, weights[2], None, "silu")
    grad = _randn(out.shape, torch.float32, device, 92)
    out.backward(grad)
    x_ref = x.detach().clone().requires_grad_(True)
    gate, up = torch.nn.functional.linear(x_ref, t["gate_weight"], t["gate_bias"]).chunk(2, dim=-1)
    ref = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, t["down_weight"])
    ref.backward(grad)
    _assert_matches(out, ref, torch.float32)
    _assert_matches(x.grad, x_ref.grad, torch.float32)
    for mine, name in zip(weights, ("gate_weight", "gate_bias", "down_weight"), strict=True):
        _assert_matches(mine.grad, t[name].grad, torch.float32, summed_rows=6)


def test_mlp_nodes_name_a_wrong_argument(device):
    t = _mlp_node_tensors("split", False, device)
    with pytest.raises(ValueError, match="up_weight must have shape"):
        swiglu_module.gated_mlp(
            t["branch"], t["gate_weight"], None, t["gate_weight"][:5], None, t["down_weight"], None
        )
    with pytest.raises(ValueError, match="activation must be one of"):
        swiglu_module.gated_mlp(
            t["branch"], t["gate_weight"], None, t["up_weight"], None, t["down_weight"], None, "relu"
        )
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        swiglu_module.add_rms_norm_gated_mlp(
            t["branch"], t["residual"], t["down_weight"], t["gate_weight"], None, t["up_weight"], None,
            t["down_weight"], None, eps=1e-6,
        )  # fmt: skip
