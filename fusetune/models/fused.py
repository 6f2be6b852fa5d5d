"""The fused forwards that replace Hugging Face ones, built per family from its `FamilySpec` row.

Each factory returns a plain function taking `self` first, used in two ways by `patching.py`: set on an
HF class (patching by model_type), or as the `forward` of a same-named subclass that one module instance is
switched to (patching an instance). The kernels are looked up on their modules at call time, so a test can
swap one for a broken variant and see the patched model go wrong.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as module_internals
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

from fusetune.kernels._interpreter import interpreted
from fusetune.models.families import FamilySpec
from fusetune.models.wrappers import unwrap_model


class _Kernels:
    """The kernel modules, whose functions are looked up at call time (so a test can swap one).

    import_module, not `from fusetune.kernels import rms_norm`: the package re-exports functions named like
    their modules (rms_norm, swiglu, ...), which would shadow the submodules as attributes. Plain attributes
    set at import, so that torch.compile traces the lookups without running any import machinery.
    """

    def __init__(self) -> None:
        self.rms_norm = importlib.import_module("fusetune.kernels.rms_norm")
        self.rope = importlib.import_module("fusetune.kernels.rope")
        self.swiglu = importlib.import_module("fusetune.kernels.swiglu")
        self.fused_linear_cross_entropy = importlib.import_module(
            "fusetune.kernels.fused_linear_cross_entropy"
        )
        self.sequence_log_probs = importlib.import_module("fusetune.kernels.sequence_log_probs")


kernels = _Kernels()

# Activation names of HF's ACT2FN that a gated MLP can hand to a fused kernel, and the GELU approximation.
SWIGLU_ACTIVATIONS = frozenset({"silu", "swish"})
GEGLU_APPROXIMATIONS = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu": "none"}


def gated_activation_kernel(
    activation: str | None, *, use_swiglu: bool, use_geglu: bool
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """The fused `act(gate) * up` for an MLP whose activation is `activation`, or None to keep the original."""
    if activation in SWIGLU_ACTIVATIONS and use_swiglu:
        return kernels.swiglu.swiglu
    if activation in GEGLU_APPROXIMATIONS and use_geglu:
        return functools.partial(kernels.swiglu.geglu, approximate=GEGLU_APPROXIMATIONS[activation])
    return None


def gated_activation_name(activation: str | None, *, use_swiglu: bool, use_geglu: bool) -> str | None:
    """The activation name of `fusetune.kernels.swiglu.gated_mlp` for an HF activation, or None."""
    if activation in SWIGLU_ACTIVATIONS and use_swiglu:
        return "silu"
    if activation in GEGLU_APPROXIMATIONS and use_geglu:
        return "gelu_tanh" if GEGLU_APPROXIMATIONS[activation] == "tanh" else "gelu"
    return None


def _is_plain_linear(module: nn.Module) -> bool:
    """An nn.Linear whose forward is exactly F.linear on plain tensors: no adapter (a LoRA layer is another
    class), no hooks, no sharded parameters."""
    if type(module) is not nn.Linear or module._forward_hooks or module._forward_pre_hooks:
        return False
    return type(module.weight.data) is torch.Tensor and (
        module.bias is None or type(module.bias.data) is torch.Tensor
    )


def mlp_weights(mlp: nn.Module, fused_gate_up: bool) -> tuple[torch.Tensor | None, ...] | None:
    """(gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias) of a gated MLP whose projections
    are plain Linears (up_* None for a fused gate_up_proj), or None when the whole MLP cannot run as one node."""
    if mlp._forward_hooks or mlp._forward_pre_hooks:
        return None
    down = mlp.down_proj
    if fused_gate_up:
        gate_up = mlp.gate_up_proj
        if not (_is_plain_linear(gate_up) and _is_plain_linear(down)):
            return None
        return gate_up.weight, gate_up.bias, None, None, down.weight, down.bias
    gate, up = mlp.gate_proj, mlp.up_proj
    if not (_is_plain_linear(gate) and _is_plain_linear(up) and _is_plain_linear(down)):
        return None
    return gate.weight, gate.bias, up.weight, up.bias, down.weight, down.bias


def whole_mlp_fusable(x: torch.Tensor, tensors: tuple[torch.Tensor | None, ...]) -> bool:
    """Whether the MLP (and its norm) may run as one eager autograd node on `x`: not under torch.compile
    (which gets the registered ops), not under autocast (whose casts the node would skip), one dtype and
    device throughout, a device the kernels reach, and no global module hooks (the node calls no modules)."""
    if torch.compiler.is_compiling() or torch.is_autocast_enabled(x.device.type):
        return False
    if not (x.is_cuda or interpreted()):
        return False
    if module_internals._global_forward_hooks or module_internals._global_forward_pre_hooks:
        return False
    return all(t.dtype == x.dtype and t.device == x.device for t in tensors if t is not None)


def activation_of(module: nn.Module, spec: FamilySpec) -> str | None:
    config = getattr(module, "config", None)
    return getattr(config, spec.activation_config_attribute, None) if config is not None else None


# ----------------------------------------------------------------------------------------------- rotary


def make_apply_rotary_pos_emb(original: Callable[..., Any]) -> Callable[..., Any]:
    """Drop-in for transformers' module-level `apply_rotary_pos_emb` (same signature in 5.x).

    The function is module-level, so patching one model instance replaces it for every model of the family
    in the process; tensors the kernel cannot reach (a CPU model beside a GPU one, with no interpreter) go to
    the original function.
    """

    @functools.wraps(original)
    def apply_rotary_pos_emb(
        q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not (q.is_cuda or interpreted()):
            return original(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        return kernels.rope.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

    return apply_rotary_pos_emb


# ---------------------------------------------------------------------------------------------- RMSNorm


def make_rms_norm_forward(spec: FamilySpec) -> Callable[..., torch.Tensor]:
    offset, casting_mode, eps_attribute = spec.norm_offset, spec.norm_casting_mode, spec.norm_eps_attribute

    def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm.rms_norm(
            hidden_states,
            self.weight,
            eps=getattr(self, eps_attribute),
            offset=offset,
            casting_mode=casting_mode,
        )

    return forward


# -------------------------------------------------------------------------------------------------- MLP


def make_mlp_forward(
    spec: FamilySpec, original_forward: Callable[..., torch.Tensor], *, use_swiglu: bool, use_geglu: bool
) -> Callable[..., torch.Tensor]:
    """Gated MLP forward. With plain Linear projections the whole MLP is one autograd node
    (`kernels.swiglu.gated_mlp`) that keeps x, gate and up but not the product; otherwise (LoRA-wrapped
    Linears, hooks, autocast, torch.compile) the projections stay the module's own and only `act(gate) * up`
    runs in one kernel whose backward reuses the gate and up buffers."""
    fused_gate_up = spec.mlp_layout == "fused_gate_up"

    def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        activation = activation_of(self, spec)
        name = gated_activation_name(activation, use_swiglu=use_swiglu, use_geglu=use_geglu)
        if name is None:
            return original_forward(self, hidden_states)
        weights = mlp_weights(self, fused_gate_up)
        if weights is not None and whole_mlp_fusable(hidden_states, weights):
            return kernels.swiglu.gated_mlp(hidden_states, *weights, activation=name)
        # A precision mode whose projections run another way may run the whole MLP as one node of its own (the
        # fp8 mode: fusetune/worker/train/float8_mlp.py); it returns None for an input it does not take.
        override = getattr(self, "gated_mlp_override", None)
        output = override(hidden_states, name) if override is not None else None
        if output is not None:
            return output
        gated = gated_activation_kernel(activation, use_swiglu=use_swiglu, use_geglu=use_geglu)
        if fused_gate_up:
            gate, up = self.gate_up_proj(hidden_states).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(hidden_states), self.up_proj(hidden_states)
        return self.down_proj(gated(gate, up))

    return forward


def make_experts_apply_gate(
    spec: FamilySpec, original_apply_gate: Callable[..., torch.Tensor], *, use_swiglu: bool, use_geglu: bool
) -> Callable[..., torch.Tensor]:
    """`_apply_gate` of transformers' MoE experts (called by the grouped_mm / batched_mm experts
    implementations on the [gate; up] projection output). The "eager" experts loop does not call it and keeps
    its own activation."""

    def apply_gate(self: nn.Module, gate_up_out: torch.Tensor) -> torch.Tensor:
        gated = gated_activation_kernel(activation_of(self, spec), use_swiglu=use_swiglu, use_geglu=use_geglu)
        if gated is None or not getattr(self, "is_concatenated", True):
            return original_apply_gate(self, gate_up_out)
        gate, up = gate_up_out.chunk(2, dim=-1)
        return gated(gate, up)

    return apply_gate


# -------------------------------------------------------------------------------------- decoder layers


def make_decoder_layer_forward(
    spec: FamilySpec, *, use_swiglu: bool = True, use_geglu: bool = True
) -> Callable[..., torch.Tensor]:
    """The family's decoder layer with its middle "residual add, then RMSNorm" done by `add_rms_norm`, and
    when the MLP can run as one node, that add, the norm and the gated MLP done by `add_rms_norm_gated_mlp`,
    which keeps neither the norm output nor the MLP's product for the backward.

    Everything else (attention, the other norms, the last residual add) is the layer's own modules in HF's
    order, so this is exact up to the kernels' rounding. The models call their layers as
    `layer(hidden_states, attention_mask=..., position_embeddings=..., ...)`; those keywords go to the
    attention unchanged, as HF's layers do.
    """
    offset, casting_mode, eps_attribute = spec.norm_offset, spec.norm_casting_mode, spec.norm_eps_attribute
    attn_dropout_name, mlp_dropout_name = spec.residual_dropout_attributes or (None, None)
    mlp_class = spec.resolve(spec.mlp_class) if spec.mlp_class else None
    fused_gate_up = spec.mlp_layout == "fused_gate_up"
    norm_names = spec.decoder_norms()
    multiplier_name = spec.residual_multiplier_attribute

    def scaled(self: nn.Module, branch: torch.Tensor) -> torch.Tensor:
        """The branch as the layer adds it to the residual stream (Granite's `branch * residual_multiplier`)."""
        return branch * getattr(self, multiplier_name) if multiplier_name is not None else branch

    def norm_arguments(norm: nn.Module) -> dict[str, Any]:
        """The family's RMSNorm settings, as both fused adds (alone and with the MLP) take them."""
        return {"eps": getattr(norm, eps_attribute), "offset": offset, "casting_mode": casting_mode}

    def add_norm(norm: nn.Module, branch: torch.Tensor, residual: torch.Tensor):
        if branch.dtype != residual.dtype:
            # Under autocast the attention / MLP output is in the autocast dtype while the residual stream
            # keeps the weights' dtype; HF's `residual + branch` promotes, and widening is exact, so the fused
            # add sees the same values as HF's.
            dtype = torch.promote_types(branch.dtype, residual.dtype)
            branch, residual = branch.to(dtype), residual.to(dtype)
        return kernels.rms_norm.add_rms_norm(branch, residual, norm.weight, **norm_arguments(norm))

    def add_norm_mlp(norm: nn.Module, mlp: nn.Module, branch: torch.Tensor, residual: torch.Tensor):
        """(mlp(norm(branch + residual)), branch + residual)."""
        name = None
        if mlp_class is not None and isinstance(mlp, mlp_class):
            name = gated_activation_name(activation_of(mlp, spec), use_swiglu=use_swiglu, use_geglu=use_geglu)
        weights = mlp_weights(mlp, fused_gate_up) if name is not None else None
        if (
            weights is not None
            and type(norm.weight.data) is torch.Tensor
            and whole_mlp_fusable(branch, (residual, norm.weight, *weights))
        ):
            return kernels.swiglu.add_rms_norm_gated_mlp(
                branch, residual, norm.weight, *weights, **norm_arguments(norm), activation=name
            )
        hidden_states, residual = add_norm(norm, branch, residual)
        return mlp(hidden_states), residual

    def prenorm_forward(self: nn.Module, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        input_norm, pre_mlp_norm = (getattr(self, name) for name in norm_names)
        residual = hidden_states
        hidden_states = input_norm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
        if attn_dropout_name is not None:
            hidden_states = getattr(self, attn_dropout_name)(hidden_states)
        hidden_states, residual = add_norm_mlp(pre_mlp_norm, self.mlp, scaled(self, hidden_states), residual)
        if mlp_dropout_name is not None:
            hidden_states = getattr(self, mlp_dropout_name)(hidden_states)
        return residual + scaled(self, hidden_states)

    def sandwich_forward(self: nn.Module, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        input_norm, post_attention_norm, pre_mlp_norm, post_mlp_norm = (getattr(self, n) for n in norm_names)
        residual = hidden_states
        hidden_states = input_norm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
        hidden_states = post_attention_norm(hidden_states)
        hidden_states, residual = add_norm_mlp(pre_mlp_norm, self.mlp, scaled(self, hidden_states), residual)
        hidden_states = post_mlp_norm(hidden_states)
        return residual + scaled(self, hidden_states)

    if spec.decoder_layout == "prenorm":
        return prenorm_forward
    if spec.decoder_layout == "sandwich":
        return sandwich_forward
    raise ValueError(f"model_type {spec.model_type!r} has no decoder_layout to fuse")


# ------------------------------------------------------------------------------------------ CausalLM


def keep_positions(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The hidden states whose logits HF would compute for `logits_to_keep` (0 keeps all)."""
    if isinstance(logits_to_keep, int):
        return hidden_states[:, -logits_to_keep:, :] if logits_to_keep else hidden_states
    if logits_to_keep.dtype == torch.bool and logits_to_keep.dim() == 2:
        return hidden_states[logits_to_keep]
    if logits_to_keep.dim() == 2:
        index = logits_to_keep.unsqueeze(-1).expand(-1, -1, hidden_states.shape[-1])
        return hidden_states.gather(1, index)
    return hidden_states[:, logits_to_keep, :]


def make_causal_lm_forward(spec: FamilySpec, original_forward: Callable[..., Any]) -> Callable[..., Any]:
    """CausalLM forward whose training loss never builds the logits.

    In training with `labels`, the last hidden states go with `lm_head.weight` straight into
    `fused_linear_cross_entropy`, honouring the loss keywords HF's `ForCausalLMLoss` takes
    (`num_items_in_batch`, `shift_labels`, `ignore_index`), `logits_to_keep`, the family's constant logit
    scaling (folded into the hidden states) and its final logit soft-capping; the output has `logits=None`. In eval, without labels, or when `lm_head` is not an
    nn.Linear (a LoRA-wrapped head), the original HF forward runs unchanged.

    `sequence_log_probs=True` (fusetune's own keyword; in training and in eval, with labels) returns in
    `loss` each row's sum of log-probabilities of its labelled tokens, [batch], through
    `fusetune.kernels.sequence_log_probs` (what preference losses need), still without the logits.
    `token_log_probs=True` returns each labelled token's log-probability instead, [batch, length] (what
    policy-gradient losses need), of the logits divided by `logits_temperature` (default 1; the temperature
    completions were sampled at).
    """
    softcap_attribute = spec.logit_softcap_config_attribute
    scale_attribute, scale_operation = spec.logit_scale_config_attribute, spec.logit_scale_operation

    @functools.wraps(original_forward)
    def forward(
        self: nn.Module,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Any,
    ) -> Any:
        per_sequence = bool(kwargs.pop("sequence_log_probs", False))
        # fusetune's own keyword: also return in `token_accuracy` the share of labelled tokens whose argmax is the
        # label (the kernel counts them as it goes; the unfused forward's caller reads its logits instead).
        token_accuracy, accuracy = bool(kwargs.pop("token_accuracy", False)), None
        per_token = bool(kwargs.pop("token_log_probs", False))
        temperature = float(kwargs.pop("logits_temperature", 1.0))
        if not (
            (self.training or per_sequence or per_token)
            and labels is not None
            and isinstance(self.lm_head, nn.Linear)
        ):
            if per_sequence or per_token:
                raise ValueError(
                    "sequence_log_probs or token_log_probs needs labels and an nn.Linear lm_head"
                )
            return original_forward(
                self,
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
                inputs_embeds=inputs_embeds,
                labels=labels,
                use_cache=use_cache,
                logits_to_keep=logits_to_keep,
                **kwargs,
            )
        return_dict = kwargs.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        shift_labels = kwargs.pop("shift_labels", None)
        ignore_index = kwargs.pop("ignore_index", -100)
        if spec.router_aux_loss:
            output_router_logits = kwargs.pop("output_router_logits", None)
            if output_router_logits is None:
                output_router_logits = self.config.output_router_logits
            kwargs["output_router_logits"] = output_router_logits

        outputs = getattr(self, self.base_model_prefix)(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = keep_positions(outputs.last_hidden_state, logits_to_keep)
        if shift_labels is None:
            # Same shift as HF: position t predicts token t + 1, the last position predicts nothing.
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        per_sequence_shape = hidden_states.shape
        hidden_states = hidden_states.reshape(-1, hidden_states.shape[-1])
        shift_labels = shift_labels.reshape(-1).to(hidden_states.device)
        if shift_labels.shape[0] != hidden_states.shape[0]:
            raise ValueError(
                f"labels give {shift_labels.shape[0]} targets but the model kept {hidden_states.shape[0]} "
                f"positions (logits_to_keep={logits_to_keep!r})"
            )
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(hidden_states.device)
        weight, bias = self.lm_head.weight, self.lm_head.bias
        device_type = hidden_states.device.type
        autocast_dtype = (
            torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
        )
        if autocast_dtype is not None:
            # What autocast does to HF's lm_head: the projection runs in the autocast dtype (the casts carry
            # the gradients back to the fp32 weights); the kernel itself then runs with autocast off.
            hidden_states, weight = hidden_states.to(autocast_dtype), weight.to(autocast_dtype)
            bias = bias.to(autocast_dtype) if bias is not None else None
        softcap = getattr(self.config, softcap_attribute, None) if softcap_attribute else None
        logit_scale = getattr(self.config, scale_attribute, None) if scale_attribute else None
        if temperature != 1:
            if softcap is not None:
                raise ValueError(
                    "token log-probabilities at a temperature other than 1 need logits without a softcap"
                )
            logit_scale = (logit_scale if logit_scale is not None else 1.0) * (
                1 / temperature if scale_operation != "divide" else temperature
            )
        if logit_scale is not None and logit_scale != 1:
            # (h * s) @ W^T + b * s = s * (h @ W^T + b): the scaled logits without building them.
            factor = 1.0 / logit_scale if scale_operation == "divide" else logit_scale
            hidden_states = hidden_states * factor
            bias = bias * factor if bias is not None else None
        with torch.autocast(device_type, enabled=False) if autocast_dtype else contextlib.nullcontext():
            if per_token or per_sequence:
                log_probs = kernels.sequence_log_probs
                of_each = log_probs.token_log_probs if per_token else log_probs.sequence_log_probs
                loss = of_each(
                    hidden_states.view(per_sequence_shape),
                    weight,
                    shift_labels.view(per_sequence_shape[:-1]),
                    bias,
                    ignore_index=ignore_index,
                    softcap=softcap,
                )
            else:
                loss = kernels.fused_linear_cross_entropy.fused_linear_cross_entropy(
                    hidden_states,
                    weight,
                    shift_labels,
                    bias=bias,
                    ignore_index=ignore_index,
                    num_items_in_batch=num_items_in_batch,
                    softcap=softcap,
                    return_accuracy=token_accuracy,
                )
                if token_accuracy:
                    loss, accuracy = loss

        if spec.router_aux_loss:
            output = _moe_output(self, spec, loss, outputs, attention_mask, kwargs["output_router_logits"])
        else:
            output = CausalLMOutputWithPast(
                loss=loss,
                logits=None,
                past_key_values=outputs.past_key_values,
                hidden_states=outputs.hidden_states,
                attentions=outputs.attentions,
            )
        if accuracy is not None:
            output["token_accuracy"] = accuracy
        return output if return_dict else output.to_tuple()

    forward.fusetune_fused_loss = True  # type: ignore[attr-defined]
    return forward


def has_fused_loss(model: nn.Module) -> bool:
    """Whether `model` (or the model inside a PEFT or DDP wrapper) runs the fused CausalLM forward above with
    a plain nn.Linear output layer, so that it takes `sequence_log_probs=True`."""
    base = unwrap_model(getattr(model, "module", model))
    head = getattr(base, "lm_head", None)
    return getattr(type(base).forward, "fusetune_fused_loss", False) and isinstance(head, nn.Linear)


def _moe_output(
    model: nn.Module,
    spec: FamilySpec,
    loss: torch.Tensor,
    outputs: Any,
    attention_mask: torch.Tensor | None,
    output_router_logits: bool,
) -> MoeCausalLMOutputWithPast:
    aux_loss = None
    if output_router_logits:
        load_balancing_loss = spec.resolve("load_balancing_loss_func")
        aux_loss = load_balancing_loss(
            outputs.router_logits, model.num_experts, model.num_experts_per_tok, attention_mask
        )
        loss = loss + model.router_aux_loss_coef * aux_loss.to(loss.device)
    return MoeCausalLMOutputWithPast(
        loss=loss,
        aux_loss=aux_loss,
        logits=None,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
        router_logits=outputs.router_logits,
    )
