"""The table of supported model families: for each Hugging Face `model_type`, what fusetune replaces.

Adding a family is adding a row to `FAMILIES`. Every name in a row is looked up in the family's modeling
module of the installed transformers when a model is patched, so a row written against transformers 5.x keeps
working as long as those names exist (checked by `tests/models/test_patching.py`).

A model whose `model_type` has no row is recognised by its structure instead (`recognize.py`): its parts are
found, each proven equal to the original by a numerical probe, and described by a `FamilySpec` of the same
shape as a row, which `fusetune families propose` prints for review. Rows keep priority.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

CastingMode = Literal["llama", "gemma"]
MlpLayout = Literal["split", "fused_gate_up"]
DecoderLayout = Literal["prenorm", "sandwich"]
LogitScaleOperation = Literal["multiply", "divide"]

# The norms of a decoder layer by attribute name, in the order each layout calls them (Llama's, Gemma 2's).
DEFAULT_DECODER_NORMS: dict[str, tuple[str, ...]] = {
    "prenorm": ("input_layernorm", "post_attention_layernorm"),
    "sandwich": (
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    ),
}


@dataclass(frozen=True)
class FamilySpec:
    """What to replace in one Hugging Face model family.

    model_type: `config.model_type` of the family.
    modeling_module: the transformers module that defines the family's classes and rotary function.
    causal_lm_class: the `*ForCausalLM` class whose forward computes its training loss with the fused linear
        cross-entropy instead of building the logits (None: the loss stays Hugging Face's).
    norm_classes: RMSNorm classes whose forward becomes `fusetune.kernels.rms_norm` (Qwen3 and Gemma3 use the
        same class for their q_norm / k_norm, which are therefore patched too).
    norm_casting_mode / norm_offset: how the family's RMSNorm computes, "llama" (`w * x_hat.to(dtype)`) or
        "gemma" (`(x_hat * (1 + w)).to(dtype)` in fp32, with the weight stored as an offset from 1).
    norm_eps_attribute: the attribute holding epsilon on the family's norm instances.
    rope_function: the module-level rotary function that the attention layers call by name.
    mlp_class / mlp_layout: the gated MLP; "split" has gate_proj and up_proj, "fused_gate_up" one gate_up_proj
        whose output halves are [gate, up] (Phi-3).
    activation_config_attribute: the config field naming the MLP activation ("hidden_act" or
        "hidden_activation"); silu selects the SwiGLU kernel, gelu / gelu_pytorch_tanh the GeGLU kernel, and
        any other activation keeps the original MLP.
    experts_class: MoE experts stored as fused [gate; up] tensors (Mixtral); their gated activation is fused.
    decoder_layer_class / decoder_layout: the decoder layer whose "residual add, then RMSNorm" pair becomes one
        `add_rms_norm` call. "prenorm" is Llama's layer (input norm, attention, add, post-attention norm, MLP,
        add); "sandwich" is Gemma 2/3's (attention, post-attention norm, add, pre-feed-forward norm, MLP,
        post-feed-forward norm, add).
    decoder_norm_attributes: the layer's norms by attribute name, in the order the layout calls them; None
        takes the Llama / Gemma names (`DEFAULT_DECODER_NORMS`). GLM-4's sandwich, say, calls
        post_self_attn_layernorm after attention and post_attention_layernorm before the MLP.
    residual_multiplier_attribute: a float attribute of the layer that scales each branch before its
        residual add (Granite's residual_multiplier), or None.
    residual_dropout_attributes: dropout modules applied to the attention and MLP branches before their
        residual adds (Phi-3's resid_attn_dropout / resid_mlp_dropout).
    logit_softcap_config_attribute: config field of the final logit soft-capping (Gemma 2/3), or None.
    logit_scale_config_attribute / logit_scale_operation: config field of a constant the logits are multiplied
        or divided by before the loss (Granite divides by logits_scaling, Cohere multiplies by logit_scale),
        or None.
    router_aux_loss: the CausalLM adds a router load-balancing loss and returns a MoE output (Mixtral).
    """

    model_type: str
    modeling_module: str
    causal_lm_class: str | None
    norm_classes: tuple[str, ...]
    norm_casting_mode: CastingMode = "llama"
    norm_offset: float = 0.0
    norm_eps_attribute: str = "variance_epsilon"
    rope_function: str | None = "apply_rotary_pos_emb"
    mlp_class: str | None = None
    mlp_layout: MlpLayout = "split"
    activation_config_attribute: str = "hidden_act"
    experts_class: str | None = None
    decoder_layer_class: str | None = None
    decoder_layout: DecoderLayout | None = None
    decoder_norm_attributes: tuple[str, ...] | None = None
    residual_multiplier_attribute: str | None = None
    residual_dropout_attributes: tuple[str, str] | None = None
    logit_softcap_config_attribute: str | None = None
    logit_scale_config_attribute: str | None = None
    logit_scale_operation: LogitScaleOperation = "multiply"
    router_aux_loss: bool = False

    def decoder_norms(self) -> tuple[str, ...]:
        """The decoder layer's norm attributes in the order its layout calls them."""
        if self.decoder_norm_attributes is not None:
            return self.decoder_norm_attributes
        if self.decoder_layout is None:
            return ()
        return DEFAULT_DECODER_NORMS[self.decoder_layout]

    def module(self) -> ModuleType:
        return importlib.import_module(self.modeling_module)

    def resolve(self, name: str) -> object:
        """The object called `name` in the family's modeling module; a clear error if this transformers
        version has renamed it."""
        module = self.module()
        try:
            return getattr(module, name)
        except AttributeError as error:
            raise AttributeError(
                f"fusetune's row for model_type {self.model_type!r} names {name!r}, which "
                f"{self.modeling_module} of the installed transformers does not define"
            ) from error


def _family(model_type: str, family: str, *, prefix: str, **differences: Any) -> FamilySpec:
    """Row of a family whose classes are transformers.models.<family>.modeling_<family>'s `<prefix>ForCausalLM`,
    `<prefix>RMSNorm`, `<prefix>MLP` and `<prefix>DecoderLayer`, laid out as Llama's (a prenorm decoder layer);
    `differences` are the fields in which the family departs from Llama."""
    llama_layout = FamilySpec(
        model_type=model_type,
        modeling_module=f"transformers.models.{family}.modeling_{family}",
        causal_lm_class=f"{prefix}ForCausalLM",
        norm_classes=(f"{prefix}RMSNorm",),
        mlp_class=f"{prefix}MLP",
        decoder_layer_class=f"{prefix}DecoderLayer",
        decoder_layout="prenorm",
    )
    return dataclasses.replace(llama_layout, **differences)


# Gemma's RMSNorm: computed in fp32 with the weight stored as an offset from 1, epsilon in `eps`.
_GEMMA_NORM: dict[str, Any] = {"norm_casting_mode": "gemma", "norm_offset": 1.0, "norm_eps_attribute": "eps"}
# Gemma 2 and 3 over Gemma: the sandwich layer, the activation under its other config name, soft-capped logits.
_GEMMA2_LAYER: dict[str, Any] = {
    "activation_config_attribute": "hidden_activation",
    "decoder_layout": "sandwich",
    "logit_softcap_config_attribute": "final_logit_softcapping",
}

# One row per family: adding a family is adding a row, not copying a function.
FAMILIES: dict[str, FamilySpec] = {
    spec.model_type: spec
    for spec in (
        _family("llama", "llama", prefix="Llama"),
        _family("mistral", "mistral", prefix="Mistral"),
        _family("qwen2", "qwen2", prefix="Qwen2"),
        _family("qwen3", "qwen3", prefix="Qwen3"),
        _family(
            "mixtral", "mixtral", prefix="Mixtral",
            mlp_class=None, experts_class="MixtralExperts", router_aux_loss=True,
        ),
        _family(
            "phi3", "phi3", prefix="Phi3",
            mlp_layout="fused_gate_up", residual_dropout_attributes=("resid_attn_dropout", "resid_mlp_dropout"),
        ),
        _family("gemma", "gemma", prefix="Gemma", **_GEMMA_NORM),
        _family("gemma2", "gemma2", prefix="Gemma2", **_GEMMA_NORM, **_GEMMA2_LAYER),
        _family("gemma3_text", "gemma3", prefix="Gemma3", **_GEMMA_NORM, **_GEMMA2_LAYER),
    )
}  # fmt: skip


def supported_model_types() -> list[str]:
    return sorted(FAMILIES)


def family_for(model_type: str) -> FamilySpec:
    """The row for `model_type`; a ValueError naming the supported ones otherwise."""
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ValueError(
            f"fusetune has no kernel patches for model_type {model_type!r}; supported model types: "
            f"{', '.join(supported_model_types())}"
        ) from None


# The fields every row states, whatever their value.
_ROW_IDENTITY = ("model_type", "modeling_module", "causal_lm_class", "norm_classes")


def proposed_row(spec: FamilySpec) -> str:
    """`spec` as the Python of a row of `FAMILIES`: the fields that differ from their defaults."""
    defaults = FamilySpec(model_type="", modeling_module="", causal_lm_class=None, norm_classes=())
    lines = ["FamilySpec("]
    for spec_field in dataclasses.fields(spec):
        value = getattr(spec, spec_field.name)
        if spec_field.name in _ROW_IDENTITY or value != getattr(defaults, spec_field.name):
            lines.append(f"    {spec_field.name}={value!r},")
    lines.append("),")
    return "\n".join(lines)
