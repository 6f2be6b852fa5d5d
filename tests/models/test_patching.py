"""Patching classes, instances and PEFT models; revert; the fused CausalLM forward's loss options; loading."""

from __future__ import annotations

import importlib
import json
import weakref
from collections import Counter

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from fusetune.models import (
    FAMILIES,
    AutoFusedModelForCausalLM,
    apply_fusetune,
    fusetune_handle,
    revert_fusetune,
    supported_model_types,
)
from tests.models.tiny import build_tiny_model, make_batches

# One fused fwd+bwd against the unfused one, fp32: the kernels' rounding differs by a few ulps.
FP32_STEP = {"atol": 1e-4, "rtol": 1e-4}

# Flags that leave only the fused CausalLM loss on, to test its options without the other kernels' cost.
ONLY_LOSS = {"rope": False, "rms_norm": False, "swiglu": False, "geglu": False}


def _pair(model_type: str, device: str):
    """Two identical tiny models: one to patch, one never patched."""
    return build_tiny_model(model_type).to(device), build_tiny_model(model_type).to(device)


def _loss_and_grads(model: nn.Module, batch: dict, **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.train()
    model.zero_grad(set_to_none=True)
    output = model(**batch, **kwargs)
    output.loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return output, grads


def _assert_same_step(patched_out, patched_grads, reference_out, reference_grads, *, exact: bool) -> None:
    tolerance = {"atol": 0.0, "rtol": 0.0} if exact else FP32_STEP
    torch.testing.assert_close(patched_out.loss, reference_out.loss, **tolerance)
    assert patched_grads.keys() == reference_grads.keys()
    for name, grad in reference_grads.items():
        torch.testing.assert_close(
            patched_grads[name], grad, **tolerance, msg=lambda m, n=name: f"grad {n}: {m}"
        )


def _eval_logits(model: nn.Module, batch: dict) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def _family_attributes(model_type: str) -> dict[tuple[object, str], object]:
    """Every attribute a class-level patch of this family may replace, as currently set."""
    spec = FAMILIES[model_type]
    owners = [(spec.resolve(name), "forward") for name in spec.norm_classes]
    for class_name in (spec.mlp_class, spec.decoder_layer_class, spec.causal_lm_class):
        if class_name:
            owners.append((spec.resolve(class_name), "forward"))
    if spec.experts_class:
        owners.append((spec.resolve(spec.experts_class), "_apply_gate"))
    if spec.rope_function:
        owners.append((spec.module(), spec.rope_function))
    return {(owner, name): vars(owner)[name] for owner, name in owners}


# ------------------------------------------------------------------------------------------- the table


def test_every_row_names_objects_of_the_installed_transformers() -> None:
    for model_type, spec in FAMILIES.items():
        assert AutoConfig.for_model(model_type).model_type == model_type
        names = [*spec.norm_classes, spec.causal_lm_class]
        names += [
            n for n in (spec.mlp_class, spec.experts_class, spec.decoder_layer_class, spec.rope_function) if n
        ]
        for name in names:
            assert spec.resolve(name) is not None
        causal_lm = spec.resolve(spec.causal_lm_class)
        assert AutoModelForCausalLM._model_mapping[type(AutoConfig.for_model(model_type))] is causal_lm


def test_unsupported_family_raises_with_the_supported_list_or_warns_when_lenient() -> None:
    """Without recognition by structure (tests/models/test_recognize.py has it), a family without a row is
    refused, or left as it is when lenient."""
    config = AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="gpt2") as error:
        apply_fusetune(model, recognize_structure=False)
    for model_type in supported_model_types():
        assert model_type in str(error.value)
    with pytest.raises(ValueError, match="supported model types"):
        apply_fusetune("gpt2")

    classes_before = [type(module) for module in model.modules()]
    with pytest.warns(UserWarning, match="without fusetune kernels"):
        handle = apply_fusetune(model, strict=False, recognize_structure=False)
    assert not handle.active and handle.patched == {}
    assert [type(module) for module in model.modules()] == classes_before

    with pytest.warns(UserWarning, match="without fusetune kernels"):
        auto_model = AutoFusedModelForCausalLM.from_config(config, recognize_structure=False)
    assert type(auto_model) is type(model)
    with pytest.raises(ValueError, match="supported model types"):
        AutoFusedModelForCausalLM.from_config(config, strict=True, recognize_structure=False)


# ------------------------------------------------------------------------------------------ instances


def test_instance_patch_matches_hf_and_revert_restores_it_exactly(device: str, kernel_calls: Counter) -> None:
    modeling = importlib.import_module("transformers.models.llama.modeling_llama")
    original_rope = modeling.apply_rotary_pos_emb
    model, reference = _pair("llama", device)
    batch = make_batches(device)[0]
    state_before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    # Before patching: the rotary function is module-level in transformers, so while any llama model is
    # patched every llama model in the process uses the fused one.
    reference_out, reference_grads = _loss_and_grads(reference, batch)
    reference_logits = _eval_logits(reference, batch)

    handle = apply_fusetune(model)
    assert handle.patched == {
        "LlamaRMSNorm.forward": 5,
        "LlamaMLP.forward": 2,
        "LlamaDecoderLayer.forward": 2,
        "LlamaForCausalLM.forward": 1,
        "transformers.models.llama.modeling_llama.apply_rotary_pos_emb": 1,
    }
    assert fusetune_handle(model) is handle
    assert modeling.apply_rotary_pos_emb is not original_rope
    norm = model.model.norm
    assert isinstance(norm, modeling.LlamaRMSNorm) and type(norm) is not modeling.LlamaRMSNorm
    assert type(norm).__name__ == "LlamaRMSNorm" and type(model).__name__ == "LlamaForCausalLM"
    assert model.state_dict().keys() == state_before.keys()

    patched_out, patched_grads = _loss_and_grads(model, batch)
    assert patched_out.logits is None, "the fused loss must not build logits"
    assert reference_out.logits is not None
    _assert_same_step(patched_out, patched_grads, reference_out, reference_grads, exact=False)
    # 2 layers: one input norm each + the final norm; the post-attention norm, its residual add and the MLP
    # run as one node per layer.
    assert kernel_calls == Counter(
        rms_norm=3, add_rms_norm_gated_mlp=2, apply_rotary_pos_emb=2, fused_linear_cross_entropy=1
    )
    torch.testing.assert_close(_eval_logits(model, batch), reference_logits, **FP32_STEP)

    revert_fusetune(model)
    assert not handle.active and fusetune_handle(model) is None
    assert modeling.apply_rotary_pos_emb is original_rope
    assert all(type(module).__module__.startswith(("transformers.", "torch.")) for module in model.modules())
    assert all(not hasattr(type(module), "_fusetune_original_class") for module in model.modules())
    kernel_calls.clear()
    reverted_out, reverted_grads = _loss_and_grads(model, batch)
    _assert_same_step(reverted_out, reverted_grads, reference_out, reference_grads, exact=True)
    assert torch.equal(_eval_logits(model, batch), reference_logits)
    assert not kernel_calls


def test_patching_twice_is_refused_and_a_second_revert_does_nothing(device: str) -> None:
    model = build_tiny_model("qwen2").to(device)
    handle = apply_fusetune(model, rope=False)
    with pytest.raises(RuntimeError, match="already patched"):
        apply_fusetune(model)
    handle.revert()
    handle.revert()
    apply_fusetune(model, rope=False).revert()


def test_options_turn_single_kernels_off(device: str) -> None:
    model = build_tiny_model("gemma").to(device)
    handle = apply_fusetune(
        model, rope=False, geglu=False, add_rms_norm=False, fused_linear_cross_entropy=False
    )
    try:
        assert handle.patched == {"GemmaRMSNorm.forward": 5}
    finally:
        handle.revert()


def test_shared_rotary_function_is_restored_by_its_last_user(device: str) -> None:
    modeling = importlib.import_module("transformers.models.mistral.modeling_mistral")
    original_rope = modeling.apply_rotary_pos_emb
    first, second = build_tiny_model("mistral").to(device), build_tiny_model("mistral").to(device)
    class_handle = apply_fusetune("mistral")
    first_handle = apply_fusetune(first)
    second_handle = apply_fusetune(second)
    class_handle.revert()
    first_handle.revert()
    assert modeling.apply_rotary_pos_emb is not original_rope, "still used by the second model"
    second_handle.revert()
    assert modeling.apply_rotary_pos_emb is original_rope


def test_a_patched_model_freed_without_revert_is_freed_and_gives_the_rotary_function_back(
    device: str,
) -> None:
    """The handle must not keep its model alive: a worker that patches one model per job would otherwise hold
    every model's weights, and the module-level rotary function would stay the kernel for every later model
    of the family in the process, unpatched ones included."""
    modeling = importlib.import_module("transformers.models.mistral.modeling_mistral")
    original_rope = modeling.apply_rotary_pos_emb
    model = build_tiny_model("mistral").to(device)
    apply_fusetune(model)
    assert modeling.apply_rotary_pos_emb is not original_rope
    freed = weakref.ref(model)
    del model  # no revert_fusetune, and no garbage collection: the last reference going frees it
    assert freed() is None
    assert modeling.apply_rotary_pos_emb is original_rope


# -------------------------------------------------------------------------------------------- classes


def test_class_patch_before_loading_and_revert(device: str, kernel_calls: Counter) -> None:
    """qwen3: its q_norm / k_norm share the RMSNorm class, so they run the kernel too."""
    attributes_before = _family_attributes("qwen3")
    batch = make_batches(device)[0]
    reference = build_tiny_model("qwen3").to(device)

    handle = apply_fusetune("qwen3")
    try:
        for (owner, name), original in attributes_before.items():
            assert vars(owner)[name] is not original, f"{owner}.{name} was not patched"
        model = build_tiny_model("qwen3").to(device)
        patched_out, patched_grads = _loss_and_grads(model, batch)
    finally:
        revert_fusetune("qwen3")

    assert not handle.active
    for (owner, name), original in attributes_before.items():
        assert vars(owner)[name] is original, f"{owner}.{name} was not restored"
    reference_out, reference_grads = _loss_and_grads(reference, batch)
    assert patched_out.logits is None
    _assert_same_step(patched_out, patched_grads, reference_out, reference_grads, exact=False)
    # Per layer: input norm, q_norm, k_norm; plus the final norm. The post-attention norms are fused with the
    # residual add and the MLP.
    assert kernel_calls == Counter(
        rms_norm=2 * 3 + 1, add_rms_norm_gated_mlp=2, apply_rotary_pos_emb=2, fused_linear_cross_entropy=1
    )
    kernel_calls.clear()
    # The model built while patched runs plain HF code again.
    reverted_out, reverted_grads = _loss_and_grads(model, batch)
    _assert_same_step(reverted_out, reverted_grads, reference_out, reference_grads, exact=True)
    assert not kernel_calls


@pytest.mark.parametrize("target", ["class", "instance"])
def test_gradient_checkpointing_still_applies_to_fused_layers(target: str, device: str) -> None:
    batch = make_batches(device)[0]
    reference = build_tiny_model("llama").to(device)
    reference_out, reference_grads = _loss_and_grads(reference, batch)
    handle = apply_fusetune("llama", rope=False) if target == "class" else None
    try:
        model = build_tiny_model("llama").to(device)
        if target == "instance":
            handle = apply_fusetune(model, rope=False)
        if hasattr(
            model, "activation_checkpointing_enable"
        ):  # transformers 5.2x's name; 5.17 has the old one
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        checkpointed = Counter()
        for layer in model.model.layers:

            def counting(*args, _checkpoint=layer._gradient_checkpointing_func, **kwargs):
                checkpointed["layers"] += 1
                return _checkpoint(*args, **kwargs)

            layer._gradient_checkpointing_func = counting
        patched_out, patched_grads = _loss_and_grads(model, batch)
    finally:
        handle.revert()
    assert checkpointed["layers"] == 2, "each fused decoder layer must still run under the checkpoint"
    _assert_same_step(patched_out, patched_grads, reference_out, reference_grads, exact=False)


# ----------------------------------------------------------------------------------------------- PEFT


def test_peft_lora_model_trains_like_unpatched_and_reverts(device: str) -> None:
    peft = pytest.importorskip("peft")
    batches = make_batches(device)[:2]
    lora = dict(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],
    )

    def lora_model():
        model = peft.get_peft_model(build_tiny_model("llama").to(device), peft.LoraConfig(**lora))
        with torch.no_grad():  # seeded adapters (peft draws A from the global RNG and sets B to zero)
            generator = torch.Generator().manual_seed(5)
            for name, parameter in sorted(model.named_parameters()):
                if "lora_" in name:
                    value = 0.05 * torch.randn(parameter.shape, generator=generator)
                    parameter.copy_(value.to(parameter.device))
        return model

    def train_two_steps(model):
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        model.train()
        losses = []
        for batch in batches:
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    reference = lora_model()
    reference_losses, reference_params = train_two_steps(reference)  # before patching: the rope is shared
    model = lora_model()
    keys_before = model.state_dict().keys()
    handle = apply_fusetune(model)
    mlp = model.get_base_model().model.layers[0].mlp
    assert type(mlp).__name__ == "LlamaMLP" and type(mlp) is not type(
        reference.get_base_model().model.layers[0].mlp
    )
    assert isinstance(mlp.gate_proj, peft.tuners.lora.LoraLayer), "the LoRA layers stay inside the fused MLP"
    assert fusetune_handle(model) is handle
    assert model.state_dict().keys() == keys_before

    patched_losses, patched_params = train_two_steps(model)
    torch.testing.assert_close(torch.tensor(patched_losses), torch.tensor(reference_losses), **FP32_STEP)
    assert patched_params.keys() == reference_params.keys() and patched_params
    for name, value in reference_params.items():
        torch.testing.assert_close(
            patched_params[name], value, atol=1e-3, rtol=1e-3, msg=lambda m, n=name: f"{n}: {m}"
        )

    revert_fusetune(model)
    assert not handle.active
    assert type(model.get_base_model().model.layers[0].mlp) is type(
        reference.get_base_model().model.layers[0].mlp
    )


# ------------------------------------------------------------------------------------ the fused loss


def _labels_batch(device: str) -> dict:
    return make_batches(device)[1]


@pytest.mark.parametrize(
    "loss_kwargs",
    [
        {},
        {"num_items_in_batch": torch.tensor(7)},
        {"num_items_in_batch": 9},
        {"return_dict": False},
    ],
    ids=["mean", "num_items_tensor", "num_items_int", "tuple"],
)
def test_fused_loss_honours_hf_loss_keywords(device: str, loss_kwargs: dict) -> None:
    model, reference = _pair("llama", device)
    batch = _labels_batch(device)
    apply_fusetune(model, **ONLY_LOSS)
    kwargs = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in loss_kwargs.items()}
    if kwargs.get("return_dict") is False:
        model.train()
        patched = model(**batch, **kwargs)
        assert isinstance(patched, tuple) and patched[0].dim() == 0
        return
    patched_out, patched_grads = _loss_and_grads(model, batch, **kwargs)
    reference_out, reference_grads = _loss_and_grads(reference, batch, **kwargs)
    assert patched_out.logits is None
    _assert_same_step(patched_out, patched_grads, reference_out, reference_grads, exact=False)


def test_fused_loss_with_shift_labels_and_logits_to_keep(device: str) -> None:
    model, reference = _pair("llama", device)
    batch = _labels_batch(device)
    apply_fusetune(model, **ONLY_LOSS)

    # Pre-shifted labels (as context-parallel trainers pass them): used as they are, no second shift.
    shift_labels = torch.roll(batch["labels"], -1, dims=1)
    shift_labels[:, -1] = -100
    patched_out, patched_grads = _loss_and_grads(model, batch, shift_labels=shift_labels)
    reference_out, reference_grads = _loss_and_grads(reference, batch, shift_labels=shift_labels)
    _assert_same_step(patched_out, patched_grads, reference_out, reference_grads, exact=False)

    # logits_to_keep with labels for the kept positions only.
    kept = dict(batch, labels=batch["labels"][:, -5:])
    patched_out, patched_grads = _loss_and_grads(model, kept, logits_to_keep=5)
    reference_out, reference_grads = _loss_and_grads(reference, kept, logits_to_keep=5)
    _assert_same_step(patched_out, patched_grads, reference_out, reference_grads, exact=False)


def test_eval_and_unlabelled_forwards_are_hf_exactly(device: str, kernel_calls: Counter) -> None:
    model, reference = _pair("llama", device)
    batch = _labels_batch(device)
    apply_fusetune(model, **ONLY_LOSS)
    unlabelled = {k: v for k, v in batch.items() if k != "labels"}
    for training in (False, True):
        model.train(training)
        reference.train(training)
        with torch.no_grad():
            patched, expected = model(**unlabelled), reference(**unlabelled)
        assert torch.equal(patched.logits, expected.logits)
    model.eval()
    reference.eval()
    with torch.no_grad():
        patched, expected = model(**batch), reference(**batch)
    assert torch.equal(patched.logits, expected.logits) and torch.equal(patched.loss, expected.loss)
    assert not kernel_calls
    assert model.generate(unlabelled["input_ids"][:1], max_new_tokens=3, do_sample=False).shape == (1, 11)


@pytest.mark.parametrize("model_type", ["gemma2", "mixtral"])
def test_fused_loss_of_softcapped_and_moe_families(model_type: str, device: str) -> None:
    """gemma2: final logit soft-capping inside the fused loss; mixtral: router aux loss added on top."""
    model, reference = _pair(model_type, device)
    batch = _labels_batch(device)
    apply_fusetune(model, **ONLY_LOSS)
    patched_out, patched_grads = _loss_and_grads(model, batch)
    reference_out, reference_grads = _loss_and_grads(reference, batch)
    _assert_same_step(patched_out, patched_grads, reference_out, reference_grads, exact=False)
    if model_type == "mixtral":
        assert patched_out.aux_loss is not None and patched_out.router_logits is not None
        torch.testing.assert_close(patched_out.aux_loss, reference_out.aux_loss, atol=0.0, rtol=0.0)


# ------------------------------------------------------------------------------------------- loading


def test_auto_fused_from_pretrained_on_a_saved_model(tmp_path, device: str) -> None:
    saved = build_tiny_model("phi3")
    saved.save_pretrained(tmp_path / "tiny-phi3")
    batch = make_batches(device)[0]

    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny-phi3").to(device)
    reference_logits = _eval_logits(reference, batch)  # before patching: the rope is shared
    model = AutoFusedModelForCausalLM.from_pretrained(tmp_path / "tiny-phi3", swiglu=False).to(device)
    handle = fusetune_handle(model)
    assert handle is not None and handle.active and not handle.options.swiglu
    assert "Phi3MLP.forward" not in handle.patched and handle.patched["Phi3RMSNorm.forward"] == 5
    torch.testing.assert_close(_eval_logits(model, batch), reference_logits, **FP32_STEP)

    # A patched model saves as the plain HF architecture and loads back without fusetune.
    model.save_pretrained(tmp_path / "resaved")
    assert json.loads((tmp_path / "resaved" / "config.json").read_text())["architectures"] == [
        "Phi3ForCausalLM"
    ]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "resaved").to(device)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
    revert_fusetune(model)


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["llama", "gemma2", "phi3"])
def test_whole_model_torch_compile(model_type: str, device: str) -> None:
    """torch.compile of the whole patched model: training steps and eval match eager HF."""
    batches = make_batches(device)[:3]
    reference = build_tiny_model(model_type).to(device)
    # Before patching: the rope is shared by every model of the family while one is patched.
    expected = [_loss_and_grads(reference, batch) for batch in batches]
    expected_logits = _eval_logits(reference, batches[0])
    model = build_tiny_model(model_type).to(device)
    handle = apply_fusetune(model)
    compiled = torch.compile(model)
    try:
        for batch, (reference_out, reference_grads) in zip(batches, expected, strict=True):
            model.zero_grad(set_to_none=True)
            compiled.train()
            compiled_out = compiled(**batch)
            compiled_out.loss.backward()
            assert compiled_out.logits is None
            torch.testing.assert_close(compiled_out.loss, reference_out.loss, **FP32_STEP)
            for name, parameter in model.named_parameters():
                torch.testing.assert_close(parameter.grad, reference_grads[name], atol=1e-3, rtol=1e-3)
        compiled.eval()
        with torch.no_grad():
            inputs = {k: v for k, v in batches[0].items() if k != "labels"}
            compiled_logits = compiled(**inputs).logits
        torch.testing.assert_close(compiled_logits, expected_logits, **FP32_STEP)
    finally:
        handle.revert()
