"""Families without a table row, recognised by structure (fusetune/models/recognize.py): what is found, that
the patched model computes what the unpatched one does, that the probes reject wrong candidates, and what a
job reports when nothing is recognised."""

from __future__ import annotations

import importlib
from collections import Counter

import pytest
import torch
from torch import nn

from fusetune.models import FAMILIES, apply_fusetune, revert_fusetune
from fusetune.models.families import proposed_row
from fusetune.models.probe import ProbeCall, compare, run_probe
from fusetune.models.probe import tolerance_for as tolerance_for_probe
from fusetune.models.recognize import recognize
from fusetune.worker.train.loading import kernels_event
from tests.models.test_convergence import tolerance_for
from tests.models.test_patching import FP32_STEP, _assert_same_step, _eval_logits, _loss_and_grads
from tests.models.tiny import STRUCTURE_FAMILY_NAMES, build_tiny_model, make_batches, train

ROPE = "rotary apply_rotary_pos_emb"

# model_type -> (parts found, parts left, fields of the proposed row). transformers 5.x has every one of
# these families.
EXPECTED = {
    "olmo2": (
        {
            "norm Olmo2RMSNorm",
            "mlp Olmo2MLP",
            "loss Olmo2ForCausalLM",
            ROPE,
            "decoder layer Olmo2DecoderLayer",
        },
        set(),
        # HF's Olmo2RMSNorm multiplies in fp32 and casts last; its layers are post-norm (nothing to fuse).
        {"norm_casting_mode": "gemma", "norm_offset": 0.0, "decoder_layout": None, "mlp_layout": "split"},
    ),
    "granite": (
        {
            "norm GraniteRMSNorm",
            "mlp GraniteMLP",
            "loss GraniteForCausalLM",
            ROPE,
            "decoder layer GraniteDecoderLayer",
        },
        set(),
        {
            "norm_casting_mode": "llama",
            "decoder_layout": "prenorm",
            "residual_multiplier_attribute": "residual_multiplier",
            "logit_scale_config_attribute": "logits_scaling",
            "logit_scale_operation": "divide",
        },
    ),
    "smollm3": (
        {
            "norm SmolLM3RMSNorm",
            "mlp SmolLM3MLP",
            "loss SmolLM3ForCausalLM",
            ROPE,
            "decoder layer SmolLM3DecoderLayer",
        },
        set(),
        {"decoder_layout": "prenorm", "decoder_norm_attributes": None},
    ),
    "glm4": (
        {"norm Glm4RMSNorm", "mlp Glm4MLP", "loss Glm4ForCausalLM", "decoder layer Glm4DecoderLayer"},
        # GLM-4 rotates interleaved pairs, which the rotate-half kernel does not: its probe fails.
        {ROPE},
        {
            "mlp_layout": "fused_gate_up",
            "decoder_layout": "sandwich",
            "decoder_norm_attributes": (
                "input_layernorm",
                "post_self_attn_layernorm",
                "post_attention_layernorm",
                "post_mlp_layernorm",
            ),
            "rope_function": None,
        },
    ),
    "qwen3_moe": (
        {
            "norm Qwen3MoeRMSNorm",
            "experts Qwen3MoeExperts",
            "loss Qwen3MoeForCausalLM",
            ROPE,
            "decoder layer Qwen3MoeDecoderLayer",
        },
        set(),
        {"experts_class": "Qwen3MoeExperts", "router_aux_loss": True, "decoder_layout": "prenorm"},
    ),
    "gpt_oss": (
        {"norm GptOssRMSNorm", "loss GptOssForCausalLM"},
        # Its experts' gate is clamped and interleaved, its rotary angles are half-width, and its MLP returns
        # the router scores beside the hidden states.
        {"experts GptOssExperts", ROPE, "decoder layer GptOssDecoderLayer"},
        {"norm_casting_mode": "gemma", "router_aux_loss": True, "experts_class": None},
    ),
}

# The kernels each family's patched training forward calls (kernel_calls counts them).
EXPECTED_KERNELS = {
    "olmo2": {"rms_norm", "gated_mlp", "apply_rotary_pos_emb", "fused_linear_cross_entropy"},
    "granite": {"rms_norm", "add_rms_norm_gated_mlp", "apply_rotary_pos_emb", "fused_linear_cross_entropy"},
    "smollm3": {"rms_norm", "add_rms_norm_gated_mlp", "apply_rotary_pos_emb", "fused_linear_cross_entropy"},
    "glm4": {"rms_norm", "add_rms_norm_gated_mlp", "fused_linear_cross_entropy"},
    "qwen3_moe": {"rms_norm", "add_rms_norm", "swiglu", "apply_rotary_pos_emb", "fused_linear_cross_entropy"},
    "gpt_oss": {"rms_norm", "fused_linear_cross_entropy"},
}
TRAIN_STEPS = 3


def test_every_family_here_is_outside_the_table() -> None:
    assert set(EXPECTED) == set(STRUCTURE_FAMILY_NAMES)
    assert not set(EXPECTED) & set(FAMILIES)


@pytest.mark.parametrize("model_type", STRUCTURE_FAMILY_NAMES)
def test_recognition_finds_the_parts_and_proves_them(model_type: str, device: str) -> None:
    found, left, fields = EXPECTED[model_type]
    recognition = recognize(build_tiny_model(model_type).to(device))
    assert set(recognition.found) == found, recognition.left
    assert set(recognition.left) == left, recognition.left
    assert recognition.share == ("partly" if left else "recognised")
    for name, value in fields.items():
        assert getattr(recognition.spec, name) == value, name
    row = proposed_row(recognition.spec)
    assert f"model_type={model_type!r}" in row and row.startswith("FamilySpec(")


@pytest.mark.parametrize("model_type", STRUCTURE_FAMILY_NAMES)
def test_structure_patched_model_matches_hf(model_type: str, device: str, kernel_calls: Counter) -> None:
    """Loss, every gradient and the eval logits of one step, then a few training steps (losses, final
    parameters, eval logits) against the same model unpatched; the kernels named are the ones that ran."""
    batches = make_batches(device)
    # Before patching: the rotary function is module-level, shared by every model of the family.
    reference = build_tiny_model(model_type).to(device)
    reference_out, reference_grads = _loss_and_grads(reference, batches[0])
    reference_logits = _eval_logits(reference, batches[0])
    # AdamW's eps at 1e-6 in both runs: at torch's 1e-8, a gradient of rounding size (1e-8) moves its weight by
    # g / (|g| + eps) of a whole step, so two roundings of one zero-ish gradient move it differently. One expert
    # of the tiny GPT-OSS took 1.0e-8 against 2.3e-8 in its first step under transformers 5.24 (grouped_mm
    # experts), 0.5 against 0.7 of a step, which moved the eval logits 8.6e-4. A gradient of 1e-4 or more, which
    # a wrong kernel changes, steps as before.
    reference_run = train(build_tiny_model(model_type).to(device), batches, steps=TRAIN_STEPS, eps=1e-6)

    model = build_tiny_model(model_type).to(device)
    handle = apply_fusetune(model)
    assert handle.source == "structure" and handle.spec is not None
    assert set(handle.left) == EXPECTED[model_type][1]
    kernel_calls.clear()  # the probes ran the kernels too
    patched_out, patched_grads = _loss_and_grads(model, batches[0])
    assert patched_out.logits is None, "the fused loss must not build logits"
    assert {name for name, n in kernel_calls.items() if n} == EXPECTED_KERNELS[model_type]
    _assert_same_step(patched_out, patched_grads, reference_out, reference_grads, exact=False)
    torch.testing.assert_close(_eval_logits(model, batches[0]), reference_logits, **FP32_STEP)
    handle.revert()
    assert all(not hasattr(type(m), "_fusetune_original_class") for m in model.modules())

    trained = build_tiny_model(model_type).to(device)
    handle = apply_fusetune(trained)
    try:
        patched_run = train(trained, batches, steps=TRAIN_STEPS, eps=1e-6)
    finally:
        handle.revert()
    # The loss curve and the eval logits after it. Not every final parameter: a parameter whose gradient is
    # zero but for rounding (GLM-4's key bias, say) takes whole AdamW steps in a direction the rounding picks;
    # the gradients of every parameter are compared above, one step in.
    tolerance = tolerance_for(device)
    torch.testing.assert_close(
        torch.tensor(patched_run.losses), torch.tensor(reference_run.losses), **tolerance["losses"]
    )
    torch.testing.assert_close(patched_run.eval_logits, reference_run.eval_logits, **tolerance["logits"])


def test_table_rows_keep_priority(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    recognizer = importlib.import_module("fusetune.models.recognize")

    def never(*args, **kwargs):
        raise AssertionError("a family with a row must not be recognised by structure")

    monkeypatch.setattr(recognizer, "recognize", never)
    handle = apply_fusetune(build_tiny_model("qwen3").to(device), rope=False)
    assert handle.source == "table" and handle.spec is FAMILIES["qwen3"]
    handle.revert()


def test_peft_wrapped_structure_family_is_patched_and_reverted(device: str) -> None:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "gate_proj"])
    model = peft.get_peft_model(build_tiny_model("granite").to(device), config)
    handle = apply_fusetune(model)
    mlp = model.get_base_model().model.layers[0].mlp
    assert handle.source == "structure" and handle.patched["GraniteMLP.forward"] == 2
    assert isinstance(mlp.gate_proj, peft.tuners.lora.LoraLayer), "the LoRA layers stay inside the fused MLP"
    model.train()
    loss = model(**make_batches(device)[0]).loss
    loss.backward()
    assert torch.isfinite(loss)
    revert_fusetune(model)
    assert not hasattr(type(mlp), "_fusetune_original_class")


# ------------------------------------------------------------------------------------- the probes bite


def _olmo2_norm_left(device: str) -> str | None:
    return recognize(build_tiny_model("olmo2").to(device)).left.get("norm Olmo2RMSNorm")


def test_a_layer_norm_posing_as_rms_norm_is_rejected(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    modeling = importlib.import_module("transformers.models.olmo2.modeling_olmo2")
    rms_forward = modeling.Olmo2RMSNorm.forward

    def layer_norm_forward(self, hidden_states):  # centred first: a LayerNorm without a bias
        centred = hidden_states - hidden_states.float().mean(-1, keepdim=True).to(hidden_states.dtype)
        return rms_forward(self, centred)

    monkeypatch.setattr(modeling.Olmo2RMSNorm, "forward", layer_norm_forward)
    reason = _olmo2_norm_left(device)
    assert reason is not None and "not an RMS norm" in reason


def test_a_norm_with_another_epsilon_is_rejected(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The module says 1e-6 and computes with 2e-6: the probe's rows at the scale of sqrt(eps) see it."""
    modeling = importlib.import_module("transformers.models.olmo2.modeling_olmo2")
    rms_forward = modeling.Olmo2RMSNorm.forward

    def other_epsilon_forward(self, hidden_states):
        said = self.variance_epsilon
        self.variance_epsilon = 2 * said
        try:
            return rms_forward(self, hidden_states)
        finally:
            self.variance_epsilon = said

    monkeypatch.setattr(modeling.Olmo2RMSNorm, "forward", other_epsilon_forward)
    reason = _olmo2_norm_left(device)
    assert reason is not None and "not an RMS norm" in reason


def _mutated(module_name: str, function_name: str, mutate):
    module = importlib.import_module(f"fusetune.kernels.{module_name}")
    real = getattr(module, function_name)
    return module, function_name, lambda *args, **kwargs: mutate(real, *args, **kwargs)


# A kernel that is slightly wrong must fail its probe: the tolerances bite. Each mutation is small (an
# epsilon doubled, a 1e-4 change of the output) and the part it touches must be left, with the probe's
# reason.
KERNEL_MUTATIONS = {
    "rms_norm eps x2": (
        ("rms_norm", "rms_norm", lambda real, x, w, eps=1e-6, **kw: real(x, w, eps=2 * eps, **kw)),
        "norm Olmo2RMSNorm",
    ),
    "rope sin negated": (
        (
            "rope",
            "apply_rotary_pos_emb",
            lambda real, q, k, cos, sin, *a, **kw: real(q, k, cos, -sin, *a, **kw),
        ),
        ROPE,
    ),
    "gated mlp output x (1 + 1e-4)": (
        ("swiglu", "gated_mlp", lambda real, *args, **kw: real(*args, **kw) * (1 + 1e-4)),
        "mlp Olmo2MLP",
    ),
    "loss soft-capped at 50": (
        (
            "fused_linear_cross_entropy",
            "fused_linear_cross_entropy",
            lambda real, *args, softcap=None, **kw: real(*args, softcap=50.0, **kw),
        ),
        "loss Olmo2ForCausalLM",
    ),
}


@pytest.mark.parametrize("mutation", sorted(KERNEL_MUTATIONS))
def test_a_wrong_kernel_fails_its_probe(mutation: str, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    (module_name, function_name, mutate), part = KERNEL_MUTATIONS[mutation]
    correct = recognize(build_tiny_model("olmo2").to(device))
    assert part in correct.found
    monkeypatch.setattr(*_mutated(module_name, function_name, mutate))
    recognition = recognize(build_tiny_model("olmo2").to(device))
    assert part in recognition.left and "probe failed" in recognition.left[part], recognition.left
    # The decoder layer is found from its norms: it goes with them.
    others = (
        set(correct.found)
        - {part}
        - ({"decoder layer Olmo2DecoderLayer"} if part.startswith("norm") else set())
    )
    assert others <= set(recognition.found), "a wrong kernel must cost only its own part"


# ------------------------------------------------------------------------------ nothing recognised


class _Unrecognisable(nn.Module):
    """A causal LM with nothing fusetune has kernels for: LayerNorm, a GELU MLP without a gate, and an output
    layer that is not an nn.Linear named lm_head."""

    def __init__(self, vocab: int = 64, hidden: int = 32) -> None:
        super().__init__()
        self.config = type("Config", (), {"model_type": "unrecognisable", "vocab_size": vocab})()
        self.embed = nn.Embedding(vocab, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, input_ids, labels=None, **kwargs):
        hidden = self.embed(input_ids)
        logits = self.head(self.norm(hidden + self.mlp(hidden)))
        loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return type("Output", (), {"loss": loss, "logits": logits})()


def test_a_model_nothing_is_recognised_in_trains_unpatched_with_the_reason(device: str) -> None:
    model = _Unrecognisable().to(device)
    classes_before = [type(m) for m in model.modules()]
    with pytest.warns(UserWarning, match="without fusetune kernels"):
        handle = apply_fusetune(model, strict=False)
    assert not handle.active and handle.source is None
    message, level, data = kernels_event("unrecognisable", handle)
    assert level == "warning" and "training runs unpatched" in message
    assert data["applied"] is False and data["left"], data
    assert "loss" in " ".join(data["left"]) and "lm_head" in message
    with pytest.raises(ValueError, match="no part of it was recognised"):
        apply_fusetune(model)

    assert [type(m) for m in model.modules()] == classes_before
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    input_ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0)).to(device)
    losses = []
    for _ in range(3):
        loss = model(input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_the_event_of_a_structure_patch_says_what_was_left(device: str) -> None:
    handle = apply_fusetune(build_tiny_model("gpt_oss").to(device))
    message, level, data = kernels_event("gpt_oss", handle)
    assert level == "info" and data["applied"] and data["source"] == "structure"
    assert "recognised by structure" in message and "Left as they are" in message
    assert set(data["left"]) == EXPECTED["gpt_oss"][1]
    assert data["patched"]["GptOssRMSNorm.forward"] == 5
    handle.revert()


def _loss_probe_call(vocab: int, hidden: int = 256, tokens: int = 16):
    """A head and cross-entropy probe of `vocab` tokens: hidden states and weights as the loss probe draws
    them (random, std 1 and 1/sqrt(hidden))."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, hidden, generator=generator) / hidden**0.5
    states = torch.randn(tokens, hidden, generator=generator)
    labels = torch.randint(0, vocab, (tokens,), generator=generator)

    def make_call(dtype: torch.dtype, upcast: bool) -> ProbeCall:
        target = torch.float32 if upcast else dtype
        w, x = weight.to(dtype).to(target).requires_grad_(), states.to(dtype).to(target).requires_grad_()
        return ProbeCall((x, w, labels), {}, [x, w], ["hidden states", "lm_head.weight"])

    return make_call


def _cross_entropy(x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor]:
    return (torch.nn.functional.cross_entropy(x @ w.T, labels),)


def _chunked_cross_entropy(x, w, labels, scale: float = 1.0, chunk: int = 4096):
    """The same loss as the fused kernel orders it: logits a vocabulary chunk at a time, a running
    log-sum-exp; `scale` != 1 is a wrong replacement (logits off by that factor)."""
    lse = torch.full((x.shape[0],), -torch.inf)
    for start in range(0, w.shape[0], chunk):
        lse = torch.logaddexp(lse, torch.logsumexp(scale * x @ w[start : start + chunk].T, dim=-1))
    picked = scale * (x * w[labels]).sum(-1)
    return ((lse - picked).mean(),)


def test_the_loss_probe_scales_its_tolerance_as_the_kernel_test_does() -> None:
    """At a real vocabulary, float32's own rounding of the log-sum-exp (about log(vocab) * 6e-8) moves every
    vocabulary row of the lm_head gradient by a relative 1e-6: per row, a correct chunked loss misses the
    kernel test's tolerance, while scaled by the whole tensor (as the kernel test scales it) it passes, and a
    loss whose logits are off by 1e-4 relative still fails."""
    make_call = _loss_probe_call(vocab=100_000)
    passed = run_probe(_cross_entropy, _chunked_cross_entropy, make_call, lambda out: out, "causal_lm_loss",
                       torch.float32)  # fmt: skip
    assert passed.passed, passed.detail
    expected = [t for t in probe_outputs(_cross_entropy, make_call)]
    actual = [t for t in probe_outputs(_chunked_cross_entropy, make_call)]
    per_row = compare(actual, expected, ["loss", "grad hidden", "grad lm_head"],
                      tolerance_for_probe("causal_lm_loss", torch.float32), per_row=True)  # fmt: skip
    assert not per_row.passed, per_row.detail
    wrong = run_probe(_cross_entropy, lambda *a: _chunked_cross_entropy(*a, scale=1 + 1e-4), make_call,
                      lambda out: out, "causal_lm_loss", torch.float32)  # fmt: skip
    assert not wrong.passed, wrong.detail


def probe_outputs(function, make_call) -> list[torch.Tensor]:
    call = make_call(torch.float32, False)
    (loss,) = function(*call.args)
    return [loss.detach(), *torch.autograd.grad(loss, call.wrt)]


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", STRUCTURE_FAMILY_NAMES)
def test_structure_patched_model_under_torch_compile_fullgraph(model_type: str, device: str) -> None:
    """torch.compile(fullgraph=True) of the whole structure-patched model: a graph break is an error; the
    steps and the eval logits match eager HF. A family whose unpatched transformers model already breaks the
    graph is skipped with transformers' error: the patch must add no break of its own."""
    batches = make_batches(device)[:3]
    reference = build_tiny_model(model_type).to(device)
    expected = [_loss_and_grads(reference, batch) for batch in batches]
    expected_logits = _eval_logits(reference, batches[0])
    torch._dynamo.reset()
    try:
        torch.compile(reference, fullgraph=True)(**batches[0]).loss.backward()
    except Exception as error:  # noqa: BLE001 - transformers' own graph break, reported as the skip's reason
        pytest.skip(f"transformers' unpatched {model_type} does not compile with fullgraph: {error}"[:400])
    model = build_tiny_model(model_type).to(device)
    handle = apply_fusetune(model)
    # Each family adds a train and an eval entry to the cache of the one patched forward it shares with the
    # others: without a reset the fifth family would meet Dynamo's recompile limit, which fullgraph makes an
    # error. A worker compiles one model per process.
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    try:
        for batch, (reference_out, reference_grads) in zip(batches, expected, strict=True):
            model.zero_grad(set_to_none=True)
            compiled.train()
            compiled_out = compiled(**batch)
            compiled_out.loss.backward()
            torch.testing.assert_close(compiled_out.loss, reference_out.loss, **FP32_STEP)
            for name, parameter in model.named_parameters():
                torch.testing.assert_close(parameter.grad, reference_grads[name], atol=1e-3, rtol=1e-3)
        compiled.eval()
        with torch.no_grad():
            inputs = {k: v for k, v in batches[0].items() if k != "labels"}
            torch.testing.assert_close(compiled(**inputs).logits, expected_logits, **FP32_STEP)
    finally:
        handle.revert()


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["olmo2", "granite", "qwen3_moe"])
def test_bf16_recognition_on_the_gpu(model_type: str, device: str) -> None:
    """The probes in the model's own dtype on the GPU: a bf16 model is recognised as the fp32 one is."""
    recognition = recognize(build_tiny_model(model_type, dtype=torch.bfloat16).to(device))
    found, left, _ = EXPECTED[model_type]
    assert set(recognition.found) == found and set(recognition.left) == left, recognition.left


@pytest.mark.gpu
def test_recognition_of_a_model_built_under_a_default_gpu_device(device: str) -> None:
    """benchmarks/step/e2e.py builds its models under `with torch.device("cuda")`: the probes' inputs, drawn
    from seeded CPU generators, must not follow the default device there."""
    with torch.device(device):
        model = build_tiny_model("granite")
        recognition = recognize(model)
    found, left, _ = EXPECTED["granite"]
    assert set(recognition.found) == found and set(recognition.left) == left, recognition.left


@pytest.mark.gpu
def test_a_model_still_on_the_cpu_is_probed_on_the_gpu_as_the_worker_does(device: str) -> None:
    """The worker patches the model before moving it to the GPU: each part is copied there for its probe."""
    batch = make_batches(device)[0]
    reference = build_tiny_model("granite").to(device)
    reference_out, reference_grads = _loss_and_grads(reference, batch)
    model = build_tiny_model("granite")
    handle = apply_fusetune(model, probe_device=device)
    assert handle.source == "structure" and not handle.left, handle.left
    assert all(p.device.type == "cpu" for p in model.parameters()), "probing must not move the model"
    model.to(device)
    patched_out, patched_grads = _loss_and_grads(model, batch)
    _assert_same_step(patched_out, patched_grads, reference_out, reference_grads, exact=False)
    handle.revert()
