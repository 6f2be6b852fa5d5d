"""The fp8 precision mode on CPU: refused where it cannot run, the layers it converts, its composition with the
fused MLP block, LoRA and FSDP2, and a run that checkpoints plain weights and resumes exactly.

torchao's float8 matmul (torch._scaled_mm) needs a GPU of compute capability 8.9 or newer; here its casts are
emulated (`Float8LinearConfig.emulate`: the same scales and float8 values, the matmul on the dequantized
operands), which is what the trainer does when a test lets the mode run on a CPU. The quality evidence is in
tests/worker/test_float8_quality.py.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import pytest
import torch
from safetensors import safe_open
from torch import nn
from torchao.float8.float8_linear import Float8Linear

from fusetune.demo import assets
from fusetune.spec.hyperparameters import LoraSpec
from fusetune.worker.train import float8, lora
from fusetune.worker.train.checkpoints import layout as ckpt
from fusetune.worker.train.outcome import JobStopped, TrainingFailure
from fusetune.worker.train.precision import resolve_precision
from fusetune.worker.train.reporter import StopRequest
from fusetune.worker.train.trainer import Trainer
from tests.hopper_target import run_on_hopper_target
from tests.models.tiny import build_tiny_model, make_batches
from tests.worker.test_train_trainer import ONE_CPU_RANK, RecordingReporter, make_config

CUDA = torch.device("cuda")
DECODER_LINEARS_PER_LAYER = 7  # q, k, v, o, gate, up, down


@pytest.fixture
def fp8_on_cpu(monkeypatch):
    """The fp8 mode allowed on this CPU, where the trainer emulates its float8 casts; with torch's AdamW, as
    FusedAdamW's Triton kernel would run interpreted here (minutes for a few runs; its own resume is
    tests/worker/test_train_resume.py's)."""
    from fusetune.spec import precision

    entry = dataclasses.replace(precision.PRECISIONS["fp8"], needs_gpu=False, optimizer="adamw")
    monkeypatch.setitem(precision.PRECISIONS, "fp8", entry)


@pytest.fixture
def float8_forwards(monkeypatch) -> Counter:
    """Counts Float8Linear forwards by layer name (a class attribute, not a hook: hooks change the fused path)."""
    calls: Counter = Counter()
    original = Float8Linear.forward

    def counted(self, input):
        calls[id(self)] += 1
        return original(self, input)

    monkeypatch.setattr(Float8Linear, "forward", counted)
    return calls


@pytest.fixture
def kernel_calls(monkeypatch) -> Counter:
    """Counts calls of the fused MLP's kernel functions (the patched models look them up per call)."""
    import importlib

    calls: Counter = Counter()
    for module_name, function_name in [
        ("swiglu", "swiglu"),
        ("swiglu", "gated_mlp"),
        ("swiglu", "add_rms_norm_gated_mlp"),
        ("rms_norm", "add_rms_norm"),
        ("fused_linear_cross_entropy", "fused_linear_cross_entropy"),
    ]:
        module = importlib.import_module(f"fusetune.kernels.{module_name}")
        real = getattr(module, function_name)

        def counted(*args, _real=real, _name=function_name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, function_name, counted)
    return calls


def emulated(recipe: str = float8.RECIPE, fsdp: bool = False):
    return float8.float8_config(recipe, emulate=True, fsdp=fsdp)


# ------------------------------------------------------------------------------------------------ refusal


def test_fp8_is_refused_on_cpu_and_below_compute_capability_8_9_with_the_reason():
    with pytest.raises(
        ValueError, match=r"'fp8' needs a GPU of compute capability 8\.9 or newer; use 'fp32'"
    ):
        resolve_precision("fp8", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"NVIDIA A100-SXM4-80GB is 8\.0: use 'bf16-sr'"):
        resolve_precision("fp8", CUDA, capability=(8, 0), gpu_name="NVIDIA A100-SXM4-80GB")
    for capability in ((8, 9), (9, 0), (10, 0)):
        policy = resolve_precision("fp8", CUDA, capability=capability, gpu_name="a GPU")
        assert policy.float8_linears and policy.weight_dtype == torch.bfloat16
        assert (
            policy.mode.optimizer == "adamw-stochastic-rounding" and policy.mode.mfu_peak_dtype == "bfloat16"
        )
    # Other modes do not ask for a capability.
    assert not resolve_precision("bf16-sr", CUDA, capability=(7, 0), gpu_name="V100").float8_linears


def test_a_trainer_refuses_fp8_on_cpu_before_it_loads_the_model(tmp_path):
    config = make_config(tmp_path / "no-model", tmp_path / "no-file.jsonl", tmp_path / "out", precision="fp8")
    with pytest.raises(TrainingFailure, match="compute capability 8.9") as failure:
        Trainer(config, ONE_CPU_RANK, RecordingReporter())
    assert failure.value.code == "trainer_error"


# ----------------------------------------------------------------------------------------- what converts


def test_the_decoder_linears_convert_and_the_head_and_odd_sizes_stay_bf16():
    model = build_tiny_model("llama", dtype=torch.bfloat16)
    names_before = {name: (p.shape, p.dtype) for name, p in model.state_dict().items()}
    conversion = float8.convert_linears(model, emulated())
    assert len(conversion.converted) == 2 * DECODER_LINEARS_PER_LAYER
    assert all(isinstance(model.get_submodule(name), Float8Linear) for name in conversion.converted)
    assert conversion.left == {"lm_head": "the output layer (bf16 in the fused linear cross-entropy)"}
    assert type(model.lm_head) is nn.Linear
    # The parameters are the same tensors under the same names: optimizer, checkpoints and resume see no change.
    assert {name: (p.shape, p.dtype) for name, p in model.state_dict().items()} == names_before

    odd = torch.nn.Module()
    odd.proj = nn.Linear(64, 72)
    odd.router_block = torch.nn.Module()
    odd.router_block.experts = nn.ModuleList()
    odd.router_block.gate = nn.Linear(64, 64)
    assert float8.why_not_converted(odd, odd.proj, "proj") == "sizes not multiples of 16"
    assert float8.why_not_converted(odd, odd.router_block.gate, "router_block.gate") == (
        "a mixture of experts' router"
    )
    message, data = float8.convert_linears(odd, emulated()).event()
    assert data["converted"] == 0 and "1 sizes not multiples of 16" in message


def test_compiled_layers_keep_their_parameter_names():
    """Each decoder layer compiled in place (`nn.Module.compile`), not wrapped: the names checkpoints use stay. A
    layer with forward hooks (activation offload's) compiles its forward alone, the hooks staying eager."""
    model = build_tiny_model("llama", dtype=torch.bfloat16)
    names = list(model.state_dict())
    first, second = model.model.layers
    first.register_forward_pre_hook(lambda module, args: None)
    conversion = float8.convert_linears(model, emulated(), compile_layers=True)
    assert conversion.compiled_layers == 2
    assert first._compiled_call_impl is None and hasattr(first.forward, "_torchdynamo_orig_callable")
    assert second._compiled_call_impl is not None
    assert list(model.state_dict()) == names


def test_saved_tensor_hooks_around_a_compiled_layer_pack_what_its_graph_saves(monkeypatch):
    """Activation offload enters saved-tensor hooks in a layer's forward pre-hook and leaves them in its forward
    hook. With the layer's forward compiled, the hooks receive the compiled graph's saved tensors (offload would
    copy them to host memory), and what they give back trains exactly as the same compiled layer without them.

    Compiled by AOTAutograd without Inductor's code generation (backend "aot_eager"): the saved tensors are
    AOTAutograd's either way, and Inductor's C++ code for the float8 casts is not sound on every CPU (torch
    2.14.1 on an AMD EPYC: non-finite gradients under ATEN_CPU_CAPABILITY=avx2, a corrupted heap with AVX-512);
    on a GPU, where the trainer compiles these layers, Inductor writes Triton instead."""
    import copy
    import functools

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    torch.manual_seed(0)
    hooked = build_tiny_model("llama", dtype=torch.bfloat16)
    plain = copy.deepcopy(hooked)
    packed, entered = [], []

    def enter(module, args):
        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t.clone(), lambda t: t)
        hooks.__enter__()
        entered.append(hooks)

    hooked.model.layers[0].register_forward_pre_hook(enter)
    hooked.model.layers[0].register_forward_hook(
        lambda module, args, output: entered.pop().__exit__(None, None, None)
    )
    for model in (hooked, plain):
        assert float8.convert_linears(model, emulated(), compile_layers=True).compiled_layers == 2
        model(**make_batches("cpu")[0]).loss.backward()
    assert packed and not entered
    for (name, a), b in zip(hooked.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name


def test_the_layers_compile_in_the_mode_asked_for(monkeypatch):
    """The e2e benchmark's fusetune+fp8-cudagraphs row compiles the float8 layers in "reduce-overhead"."""
    modes = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kwargs: modes.append(kwargs.get("mode")))
    float8.convert_linears(build_tiny_model("llama"), emulated(), compile_layers=True)
    float8.convert_linears(
        build_tiny_model("llama"), emulated(), compile_layers=True, compile_mode="reduce-overhead"
    )
    assert modes == [None, None, "reduce-overhead", "reduce-overhead"]  # two layers each


def test_an_unknown_recipe_is_refused():
    with pytest.raises(ValueError, match="recipe 'blockwise' is not one of tensorwise, rowwise"):
        float8.float8_config("blockwise")


# ---------------------------------------------------------------------------------------- composition


def test_the_fused_mlp_block_runs_its_matmuls_in_float8(float8_forwards, kernel_calls, monkeypatch):
    """With Float8Linear projections the fused decoder layer calls the attention's projection modules and runs
    the MLP as one float8 node (float8_mlp.py; every decoder matmul in float8), and trains as the bf16 model does
    within float8's rounding."""
    from fusetune.worker.train import float8_mlp

    nodes = Counter()
    real_backward = float8_mlp.gated_float8_backward

    def counted_backward(*args, **kwargs):
        nodes["backward"] += 1
        return real_backward(*args, **kwargs)

    monkeypatch.setattr(float8_mlp, "gated_float8_backward", counted_backward)
    from fusetune.models import apply_fusetune

    batch = make_batches()[0]
    reference = build_tiny_model("llama", dtype=torch.bfloat16)
    model = build_tiny_model("llama", dtype=torch.bfloat16)
    handles = [apply_fusetune(reference, strict=True), apply_fusetune(model, strict=True)]
    try:
        float8.convert_linears(model, emulated())
        loss = model(**batch).loss
        loss.backward()
        calls = dict(kernel_calls)
        kernel_calls.clear()
        reference_loss = reference(**batch).loss
        reference_loss.backward()
        # The control: in bf16 the layer runs its add, norm and whole MLP as one node.
        assert kernel_calls["add_rms_norm_gated_mlp"] == 2
    finally:
        for handle in handles:
            handle.revert()
    # q, k, v and o as modules; gate, up and down inside the MLP's node, whose backward ran once per layer.
    assert len(float8_forwards) == 2 * (DECODER_LINEARS_PER_LAYER - 3) and set(float8_forwards.values()) == {
        1
    }
    assert nodes["backward"] == 2
    assert calls.get("add_rms_norm") == 2 and "add_rms_norm_gated_mlp" not in calls
    assert calls.get("fused_linear_cross_entropy") == 1
    # e4m3 rounds each operand by up to 2^-4 of its value, so the loss moves by about a percent and each
    # gradient by a few; a wrong matmul (dropped, transposed, of another layer) points elsewhere entirely.
    torch.testing.assert_close(loss, reference_loss, rtol=0.02, atol=0)
    for (name, ours), (_, theirs) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        cosine = nn.functional.cosine_similarity(
            ours.grad.float().flatten(), theirs.grad.float().flatten(), 0
        )
        assert cosine > 0.95, (name, float(cosine))


def _fused_float8_model(model_type: str, *, node: bool, maxima: bool = False, device: str = "cpu"):
    """A tiny fusetune-patched model with float8 decoder linears (emulated on a CPU; on a GPU real, each layer
    compiled as the trainer does); without `node`, its MLPs run their projection modules. `maxima`: the
    weights' scales from block maxima (as FusedAdamW keeps them)."""
    from fusetune.kernels.adamw import adamw_launch_settings, block_maxima_reference
    from fusetune.models import AutoFusedModelForCausalLM
    from tests.models.tiny import tiny_config

    torch.manual_seed(0)
    model = AutoFusedModelForCausalLM.from_config(tiny_config(model_type), dtype=torch.bfloat16)
    model = model.to(device=device, dtype=torch.bfloat16)
    on_gpu = device != "cpu"
    config = float8.float8_config() if on_gpu else emulated()
    conversion = float8.convert_linears(model, config, compile_layers=on_gpu)
    for module in model.modules():
        if not node:
            module.__dict__.pop("gated_mlp_override", None)
        if maxima and isinstance(module, Float8Linear):
            block = adamw_launch_settings().block_size
            module.register_buffer(
                "weight_maxima", block_maxima_reference(module.weight, block), persistent=False
            )
    return model, conversion


def _loss_and_gradients(model, device: str = "cpu") -> list[torch.Tensor]:
    batch = make_batches(device)[0]
    loss = model(**batch).loss
    loss.backward()
    return [loss.detach(), *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("maxima", [False, True], ids=["weight-passes", "kept-maxima"])
@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_the_float8_mlp_node_trains_as_its_modules_bit_for_bit(model_type, maxima):
    """The MLP as one node computes what its three float8 modules and the gated activation between them compute:
    the same casts, matmuls and bf16-rounded activation gradients, so the same loss and gradients, bit for bit
    (eager; SwiGLU and GeGLU)."""
    node, conversion = _fused_float8_model(model_type, node=True, maxima=maxima)
    modules, _ = _fused_float8_model(model_type, node=False, maxima=maxima)
    assert conversion.fused_mlps == 2 and conversion.event()[1]["fused_mlps"] == 2
    for ours, theirs in zip(_loss_and_gradients(node), _loss_and_gradients(modules), strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_on_a_gpu_the_compiled_float8_mlp_node_trains_as_its_modules(model_type):
    """Real float8 matmuls in compiled layers: Inductor fuses the forward's casts and computes the activation
    and its gradients its own way (the node rounds them to bf16 before the e5m2 cast, Inductor's modules do
    not), so the two agree to float8's noise, not bit for bit. e5m2 keeps 2 mantissa bits: a gradient that sums
    few products moves with the elements whose rounding flips (one tensor of the tiny Gemma-2 at cosine 0.98 on
    an H200), while the whole gradient, and every tensor of it, points the same way; a wrong layout or scale
    would not."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 matmuls need compute capability 8.9")
    node, conversion = _fused_float8_model(model_type, node=True, device="cuda")
    modules, _ = _fused_float8_model(model_type, node=False, device="cuda")
    assert conversion.fused_mlps == 2 and conversion.compiled_layers == 2
    ours, theirs = _loss_and_gradients(node, "cuda"), _loss_and_gradients(modules, "cuda")
    torch.testing.assert_close(ours[0], theirs[0], rtol=2e-3, atol=0)

    def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), 0))

    assert (
        cosine(torch.cat([g.flatten() for g in ours[1:]]), torch.cat([g.flatten() for g in theirs[1:]]))
        > 0.99
    )
    assert min(cosine(mine, expected) for mine, expected in zip(ours[1:], theirs[1:], strict=True)) > 0.9


# A compiled decoder layer of the fp8 mode, traced against Hopper's target: the backend records each graph's
# operations and answers zeros of the right shapes (computed on fake tensors) so that the layer runs on.
_GRAPHS_SCRIPT = """
import json, sys, torch
from torch._subclasses.fake_tensor import FakeTensorMode
from fusetune.models import AutoFusedModelForCausalLM
from fusetune.worker.train import float8
from tests.models.tiny import make_batches, tiny_config

model = AutoFusedModelForCausalLM.from_config(tiny_config(sys.argv[1]), dtype=torch.bfloat16)
float8.convert_linears(model, float8.float8_config(emulate=True))
layer = float8.decoder_layers(model)[0]
call, graphs = {}, []


class Captured(Exception):
    pass


def capture_call(module, args, kwargs):
    call.update(args=args, kwargs=kwargs)
    raise Captured


def record(graph_module, example_inputs):
    nodes = graph_module.graph.nodes
    targets = {str(node.target) for node in nodes if node.op == "call_function"}
    sources = {line.split('"')[1].rsplit("/", 1)[-1] for node in nodes
               for line in (node.meta.get("stack_trace") or "").splitlines() if line.strip().startswith("File ")}
    graphs.append({"targets": sorted(targets), "sources": sorted(sources)})

    def zeros(*args):
        with FakeTensorMode(allow_non_fake_inputs=True):
            outputs = graph_module(*args)
        return [torch.zeros(o.shape, dtype=o.dtype) if isinstance(o, torch.Tensor) else o for o in outputs]

    return zeros


layer.register_forward_pre_hook(capture_call, with_kwargs=True)
try:
    model(**make_batches("cpu")[0])
except Captured:
    pass
layer._forward_pre_hooks.clear()
torch.compile(layer.forward, backend=record)(*call["args"], **call["kwargs"])
print(json.dumps(graphs))
"""


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_a_compiled_float8_layer_runs_its_mlp_node_as_a_graph_of_its_own(model_type):
    """The trainer compiles each decoder layer; the MLP node breaks it so that the node compiles alone, which
    measured faster than one graph with the attention block (float8_mlp.gated_mlp_override says why). The node
    sits in exactly one graph, and no attention runs in that graph."""
    graphs = run_on_hopper_target(_GRAPHS_SCRIPT.replace("sys.argv[1]", repr(model_type)))
    with_node = [graph for graph in graphs if "float8_mlp.py" in graph["sources"]]
    assert len(with_node) == 1, graphs
    attention = ("softmax", "scaled_dot_product", "flex_attention")
    assert not any(name in target for target in with_node[0]["targets"] for name in attention), with_node
    assert any(name in target for graph in graphs for target in graph["targets"] for name in attention), (
        graphs
    )


def test_a_node_whose_kernel_skips_the_bf16_rounding_fails_that_comparison(tmp_path, monkeypatch):
    from fusetune.kernels import float8_gated
    from tests.kernels.mutation import mutated_kernel

    mutant = mutated_kernel(
        float8_gated._gated_float8_backward_kernel,
        "round_to_dtype(grad * up * slope, dtype, SOFTWARE_ROUNDING)",
        "(grad * up * slope)",
        tmp_path,
    )
    monkeypatch.setattr(float8_gated, "_gated_float8_backward_kernel", mutant)
    with pytest.raises(AssertionError):
        test_the_float8_mlp_node_trains_as_its_modules_bit_for_bit("gemma2", False)


def test_the_node_stands_in_only_for_trained_tensorwise_mlps():
    """Rowwise scales: no node. A frozen weight (a LoRA base) or an FSDP2 shard at call time: the modules run."""
    from fusetune.worker.train import float8_mlp

    rowwise = build_tiny_model("llama", dtype=torch.bfloat16)
    assert float8.convert_linears(rowwise, emulated("rowwise"), "rowwise").fused_mlps == 0
    model, conversion = _fused_float8_model("llama", node=True)
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 4, mlp.gate_proj.in_features, dtype=torch.bfloat16)
    assert mlp.gated_mlp_override(x, "silu") is not None
    mlp.up_proj.weight.requires_grad_(False)
    assert mlp.gated_mlp_override(x, "silu") is None
    mlp.up_proj.weight.requires_grad_(True)
    assert mlp.gated_mlp_override(x.float(), "silu") is None
    assert float8_mlp._plain_trained(mlp.up_proj.weight)

    class Shard(torch.Tensor):
        def to_local(self):
            return self

    assert not float8_mlp._plain_trained(nn.Parameter(torch.zeros(2).as_subclass(Shard)))


def test_lora_keeps_its_adapters_in_bf16_over_a_float8_base():
    model = lora.apply_lora(build_tiny_model("llama", dtype=torch.bfloat16), LoraSpec(r=8, alpha=16))
    conversion = float8.convert_linears(model, emulated())
    assert len(conversion.converted) == 2 * DECODER_LINEARS_PER_LAYER
    assert all(name.endswith(".base_layer") for name in conversion.converted)
    adapters = [
        name for name, reason in conversion.left.items() if reason == "LoRA adapters (trained in bf16)"
    ]
    assert len(adapters) == 2 * 2 * DECODER_LINEARS_PER_LAYER

    model(**make_batches()[0]).loss.backward()
    for name, parameter in model.named_parameters():
        assert (parameter.grad is not None) == ("lora_" in name), name
    merged = model.merge_and_unload()
    plain = build_tiny_model("llama", dtype=torch.bfloat16).state_dict()
    assert {k: (v.shape, v.dtype) for k, v in merged.state_dict().items()} == {
        k: (v.shape, v.dtype) for k, v in plain.items()
    }


@pytest.mark.parametrize("recipe", float8.RECIPES)
def test_a_frozen_float8_layer_computes_the_input_gradient_alone(recipe):
    """A weight without gradient (a LoRA base layer): the output and input gradient of torchao's Float8Linear,
    bit for bit, without its weight-gradient matmul and without keeping the input for it."""
    torch.manual_seed(0)
    ours = nn.Sequential(nn.Linear(64, 48, dtype=torch.bfloat16))
    ours[0].weight.requires_grad_(False)
    torchaos = Float8Linear.from_float(nn.Linear(64, 48, dtype=torch.bfloat16), config=emulated(recipe))
    torchaos.load_state_dict(ours[0].state_dict())
    torchaos.weight.requires_grad_(False)
    float8.convert_linears(ours, emulated(recipe), recipe)

    results = []
    for layer in (ours, torchaos):
        x = torch.randn(3, 8, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
        x.requires_grad_(True)
        saved: list[torch.Tensor] = []

        def pack(tensor, saved=saved):
            saved.append(tensor)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            y = layer(x)
        y.backward(torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(2)))
        results.append((y, x.grad, len(saved)))
    (y, grad, saved), (torchao_y, torchao_grad, torchao_saved) = results
    assert torch.equal(y, torchao_y) and torch.equal(grad, torchao_grad)
    assert (saved, torchao_saved) == (1, 2)  # the weight; torchao's also the input, for the weight gradient
    # A trained weight goes through torchao's own matmul.
    ours[0].weight.requires_grad_(True)
    ours(x).sum().backward()
    assert ours[0].weight.grad is not None


def _weights_and_inputs_after_steps(keep_maxima: bool, steps: int = 2):
    """Two float8 layers (tensorwise, emulated) trained by FusedAdamW at a learning rate that moves their weights'
    largest magnitudes: each step's output, input gradient and weight gradients."""
    from fusetune.kernels import FusedAdamW

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48, dtype=torch.bfloat16), nn.Linear(48, 32, dtype=torch.bfloat16))
    float8.convert_linears(model, emulated("tensorwise"), "tensorwise")
    optimizer = FusedAdamW(model.parameters(), lr=0.05, seed=3)
    kept = float8.weight_scales_from_optimizer(model, optimizer) if keep_maxima else 0
    generator = torch.Generator().manual_seed(1)
    results = []
    for _ in range(steps):
        x = torch.randn(3, 8, 64, dtype=torch.bfloat16, generator=generator).requires_grad_(True)
        y = model(x)
        y.backward(torch.randn(y.shape, dtype=y.dtype, generator=generator))
        results.append((y.detach(), x.grad, *(p.grad.clone() for p in model.parameters())))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return kept, results


def test_weight_scales_from_the_kept_maxima_give_torchao_s_bits():
    """The trained layers' weight scales from the block maxima FusedAdamW keeps: outputs and gradients bit for bit
    those of torchao's scales computed from the weights, step after step."""
    kept, ours = _weights_and_inputs_after_steps(keep_maxima=True)
    none, torchaos = _weights_and_inputs_after_steps(keep_maxima=False)
    assert (kept, none) == (2, 0)
    for step, (mine, theirs) in enumerate(zip(ours, torchaos, strict=True)):
        for value, expected in zip(mine, theirs, strict=True):
            assert torch.equal(value, expected), f"step {step}"


def test_maxima_the_step_does_not_rewrite_fail_the_comparison(tmp_path, monkeypatch):
    """The comparison above can fail: with a kernel that keeps the first maxima, the second step's weight scales
    are stale (the weights' largest magnitudes moved), and its output differs from torchao's."""
    from fusetune.kernels import adamw
    from tests.kernels.mutation import mutated_kernel

    mutant = mutated_kernel(
        adamw._adamw_kernel, "if block_maxima != 0 and start < numel:", "if False:", tmp_path, "stale"
    )
    monkeypatch.setattr(adamw, "_adamw_kernel", mutant)
    with pytest.raises(AssertionError, match="step 1"):
        test_weight_scales_from_the_kept_maxima_give_torchao_s_bits()


def test_only_an_optimizer_that_keeps_maxima_gets_them():
    model = nn.Sequential(nn.Linear(64, 48, dtype=torch.bfloat16))
    float8.convert_linears(model, emulated("tensorwise"), "tensorwise")
    assert float8.weight_scales_from_optimizer(model, torch.optim.AdamW(model.parameters())) == 0
    assert getattr(model[0], "weight_maxima", None) is None


def test_ddp_and_fsdp2_take_the_converted_model(tmp_path):
    """One rank of a gloo group. DDP wraps the converted model and reduces every gradient. FSDP2 shards it; with
    the tensorwise recipe its weights are torchao's float8-all-gather tensors, and a step runs; the state dict
    keeps plain names and bf16 values."""
    import torch.distributed as dist
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from fusetune.worker.train.distributed import shard_fsdp, wrap_ddp

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = build_tiny_model("llama", dtype=torch.bfloat16)
        float8.convert_linears(model, emulated())
        wrap_ddp(model, torch.device("cpu"), None)(**make_batches()[0]).loss.backward()
        assert all(p.grad is not None for p in model.parameters())

        model = build_tiny_model("llama", dtype=torch.bfloat16)
        names = set(model.state_dict())
        conversion = float8.convert_linears(model, emulated("tensorwise", fsdp=True), "tensorwise")
        assert conversion.fsdp_float8_all_gather
        projection = model.model.layers[0].self_attn.q_proj
        assert isinstance(projection.weight.data, WeightWithDynamicFloat8CastTensor)
        shard_fsdp(model, torch.device("cpu"), torch.distributed.fsdp.MixedPrecisionPolicy())
        model(**make_batches()[0]).loss.backward()
        assert all(p.grad is not None for p in model.parameters())
        state = model.state_dict()
        assert set(state) == names
        assert {v.full_tensor().dtype for v in state.values()} == {torch.bfloat16}
    finally:
        dist.destroy_process_group()
    # Rowwise has no float8 all-gather in torchao: the weights stay plain parameters.
    assert not float8.float8_config("rowwise", fsdp=True).enable_fsdp_float8_all_gather


@pytest.mark.slow
@pytest.mark.parametrize("optimizer_name", ["adamw", "adamw8bit"])
def test_the_fused_optimizers_step_shards_that_fsdp2_all_gathers_in_float8(tmp_path, optimizer_name):
    """torchao wraps a weight that FSDP2 all-gathers in float8 in its own tensor type, whose `data_ptr()` is 0:
    the fused optimizers step the memory it wraps (they had written to address 0, a crash), bit for bit as they
    step the same values held plainly with the same gradients."""
    import torch.distributed as dist

    from fusetune.kernels import FusedAdamW, FusedAdamW8bit
    from fusetune.worker.train.distributed import shard_fsdp

    optimizer_class = {"adamw": FusedAdamW, "adamw8bit": FusedAdamW8bit}[optimizer_name]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = build_tiny_model("llama", dtype=torch.bfloat16)
        float8.convert_linears(model, emulated("tensorwise", fsdp=True), "tensorwise")
        shard_fsdp(model, torch.device("cpu"), torch.distributed.fsdp.MixedPrecisionPolicy())
        params = list(model.parameters())
        model(**make_batches()[0]).loss.backward()
        plain = [nn.Parameter(p.to_local().detach().clone()) for p in params]
        for copy, param in zip(plain, params, strict=True):
            copy.grad = param.grad.to_local().clone()
        optimizer_class(params, lr=1e-2, seed=3).step()
        optimizer_class(plain, lr=1e-2, seed=3).step()
        projection = model.model.layers[0].self_attn.q_proj.weight
        assert type(projection.to_local()).__name__ == "WeightWithDynamicFloat8CastTensor"
        for index, (param, copy) in enumerate(zip(params, plain, strict=True)):
            assert torch.equal(param.to_local().detach(), copy.detach()), index
        assert not torch.equal(projection.to_local().detach(), plain[0].detach())  # the step changed it
    finally:
        dist.destroy_process_group()


def test_a_frozen_sharded_float8_weight_gets_its_scale_once(tmp_path):
    """A LoRA base sharded by FSDP2 and all-gathered in float8: its scale is set once, the whole weight's (one
    rank here), and no step changes it; the trained weights' follow the optimizer."""
    import torch.distributed as dist
    from torchao.float8.float8_utils import amax_to_scale

    from fusetune.worker.train.distributed import shard_fsdp

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = build_tiny_model("llama", dtype=torch.bfloat16)
        float8.convert_linears(model, emulated("tensorwise", fsdp=True), "tensorwise")
        frozen = model.model.layers[0].self_attn.q_proj
        frozen.weight.requires_grad_(False)
        shard_fsdp(model, torch.device("cpu"), torch.distributed.fsdp.MixedPrecisionPolicy())
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        assert float8.weight_scales_from_optimizer(model, optimizer) == 0  # no maxima: torch's AdamW
        expected = amax_to_scale(frozen.weight.full_tensor().abs().max(), torch.float8_e4m3fn)
        assert torch.equal(frozen.weight._local_tensor._precomputed_scale, expected)
        trained = model.model.layers[0].self_attn.k_proj.weight
        before = trained._local_tensor._precomputed_scale.clone()
        model(**make_batches()[0]).loss.backward()
        optimizer.step()
        assert torch.equal(frozen.weight._local_tensor._precomputed_scale, expected)
        after = amax_to_scale(trained.full_tensor().abs().max(), torch.float8_e4m3fn)
        assert torch.equal(trained._local_tensor._precomputed_scale, after) and not torch.equal(after, before)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_sharded_float8_weights_take_their_scales_once_a_step_agreed_over_the_ranks():
    """Two gloo ranks under torchrun (tests/worker/fsdp_float8_ranks.py): the weights' scales follow the
    optimizer's steps, from the block maxima of each rank's shard (FusedAdamW) or from the shard itself (an
    optimizer without maxima), agreed over the ranks, and are those of the whole weights; each run is bit for
    bit the one whose scales torchao computes at every all-gather."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    completed = subprocess.run(
        [*command, "-m", "tests.worker.fsdp_float8_ranks"],
        cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-4000:]
    assert "rank 0: ok" in output and "rank 1: ok" in output, output[-4000:]


# ------------------------------------------------------------------------------------ a run, and its resume


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return assets.build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def train_file(tmp_path_factory):
    return assets.write_demo_dataset(tmp_path_factory.mktemp("data") / "train.jsonl", n_examples=48, seed=5)


def test_an_fp8_run_checkpoints_plain_weights_and_resumes_exactly(
    model_dir, train_file, tmp_path, fp8_on_cpu
):
    run = dict(precision="fp8", n_epochs=1, max_steps=4, checkpoint_every_steps=2)
    whole = RecordingReporter()
    whole_trainer = Trainer(
        make_config(model_dir, train_file, tmp_path / "whole", **run), ONE_CPU_RANK, whole
    )
    whole_trainer.train()
    started = next(data for _, data in whole.events if data.get("event") == "started")
    assert started["precision"] == "fp8"
    float8_event = next(data for _, data in whole.events if data.get("event") == "float8")
    assert (
        float8_event["recipe"] == float8.RECIPE and float8_event["converted"] == 2 * DECODER_LINEARS_PER_LAYER
    )

    # The checkpoint holds the base model's tensors under their names, in bf16: nothing of float8.
    checkpoint = ckpt.list_checkpoints(tmp_path / "whole")[-1][1]
    with (
        safe_open(str(checkpoint / "model.safetensors"), "pt") as saved,
        safe_open(str(model_dir / "model.safetensors"), "pt") as base,
    ):
        assert set(saved.keys()) == set(base.keys())
        assert {saved.get_tensor(key).dtype for key in saved.keys()} == {torch.bfloat16}
    assert json.loads((checkpoint / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]

    before = RecordingReporter(stop_after_step=2, stop=StopRequest.PAUSE)
    config = make_config(model_dir, train_file, tmp_path / "resumed", **run)
    with pytest.raises(JobStopped):
        Trainer(config, ONE_CPU_RANK, before).train()
    after = RecordingReporter()
    resumed = Trainer(config, ONE_CPU_RANK, after)
    resumed.train()
    curve = [values["train_loss"] for _, values in before.metrics + after.metrics]
    assert curve == [values["train_loss"] for _, values in whole.metrics]
    for a, b in zip(whole_trainer.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_an_fp8_trainer_takes_its_weight_scales_from_the_optimizer(
    model_dir, train_file, tmp_path, monkeypatch
):
    """With the mode's own optimizer (FusedAdamW, interpreted here), every trained float8 layer reads its weight's
    scale from block maxima the optimizer keeps, and after the steps they are those of the weights it stored."""
    from fusetune.kernels.adamw import adamw_launch_settings, block_maxima_reference
    from fusetune.spec import precision

    monkeypatch.setitem(
        precision.PRECISIONS, "fp8", dataclasses.replace(precision.PRECISIONS["fp8"], needs_gpu=False)
    )
    config = make_config(model_dir, train_file, tmp_path / "run", precision="fp8", max_steps=2)
    trainer = Trainer(config, ONE_CPU_RANK, RecordingReporter())
    trainer.train()
    layers = [m for m in trainer.model.modules() if isinstance(m, Float8Linear)]
    assert len(layers) == 2 * DECODER_LINEARS_PER_LAYER
    block = adamw_launch_settings().block_size
    for layer in layers:
        assert torch.equal(layer.weight_maxima, block_maxima_reference(layer.weight, block))


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", float8.RECIPES)
def test_on_a_gpu_compiled_float8_layers_train_as_bf16_does(recipe):
    """The real float8 matmul (torch._scaled_mm) under each decoder layer's torch.compile, with the fused
    kernels: a few steps track the bf16 model's losses (needs compute capability 8.9 or newer)."""
    from fusetune.models import apply_fusetune

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 matmuls need compute capability 8.9")
    batches = make_batches("cuda")
    losses = {}
    for name in ("bf16", "fp8"):
        model = build_tiny_model("llama", dtype=torch.bfloat16).cuda()
        handle = apply_fusetune(model, strict=True)
        try:
            if name == "fp8":
                conversion = float8.convert_linears(
                    model, float8.float8_config(recipe), recipe, compile_layers=True
                )
                assert conversion.compiled_layers == 2
            optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
            losses[name] = []
            for batch in batches * 2:
                loss = model(**batch).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses[name].append(float(loss))
        finally:
            handle.revert()
    assert losses["fp8"][-1] < losses["fp8"][0], losses
    torch.testing.assert_close(torch.tensor(losses["fp8"]), torch.tensor(losses["bf16"]), rtol=0.03, atol=0)


def test_an_fp8_run_pads_every_batch_to_a_token_count_float8_can_multiply(
    model_dir, train_file, tmp_path, fp8_on_cpu
):
    """The weight gradient's float8 matmul takes the batch's token count as its inner dimension, which
    torch._scaled_mm wants a multiple of 16: packed rows of any length are padded to one (a compiled layer on a
    GPU failed on an odd length); other precisions pad to the longest row only."""
    widths: dict[str, list[int]] = {}
    for precision in ("fp8", "fp32"):
        trainer = Trainer(
            make_config(
                model_dir, train_file, tmp_path / precision, precision=precision, n_epochs=1, max_steps=2
            ),
            ONE_CPU_RANK,
            RecordingReporter(),
        )
        collate = trainer.method.collate

        def recording(rows, packed, collate=collate, precision=precision):
            batch = collate(rows, packed=packed)
            widths.setdefault(precision, []).append(batch["input_ids"].shape[1])
            return batch

        trainer.method.collate = recording
        trainer.train()
    assert widths["fp8"] and all(width % float8.TOKEN_MULTIPLE == 0 for width in widths["fp8"])
    assert any(width % float8.TOKEN_MULTIPLE for width in widths["fp32"])


def test_collate_rounds_the_padded_length_up_to_the_multiple():
    from fusetune.worker.train.data import TokenizedSequence, collate

    rows = [
        TokenizedSequence([1, 2, 3], [2, 3, -100], [0, 1, 2]),
        TokenizedSequence([4] * 17, [4] * 17, list(range(17))),
    ]
    assert collate(rows, 0, packed=True)["input_ids"].shape == (2, 17)
    batch = collate(rows, 0, packed=True, length_multiple=16)
    assert batch["input_ids"].shape == (2, 32)
    assert int(batch["n_input_tokens"]) == 20 and int(batch["n_trained_tokens"]) == 19
