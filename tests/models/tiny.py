"""Tiny models of every supported family and the seeded training run the convergence tests compare.

Everything that decides the numbers is set here (config, weights, data, optimizer), so a run is the same on
any transformers 5.x: weights are drawn by this module rather than by each version's `_init_weights`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

VOCAB_SIZE = 128
BATCH_SIZE = 2
SEQ_LEN = 8
TRAIN_STEPS = 20
DISTINCT_BATCHES = 4
LEARNING_RATE = 3e-3

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    attention_dropout=0.0,
)

# What each family's mini config adds to the common shape: the features the patch has to get right.
_FAMILY_CONFIG: dict[str, dict] = {
    "llama": {},
    "mistral": {"sliding_window": 4},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "output_router_logits": True},
    "qwen2": {},  # q/k/v carry biases
    "qwen3": {},  # q_norm / k_norm on the head dim
    "gemma": {},  # (1 + w) norms, GeGLU, scaled and tied embeddings
    "gemma2": {"sliding_window": 4, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
    "gemma3_text": {
        "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"],
        "final_logit_softcapping": 30.0,
    },
    "phi3": {"partial_rotary_factor": 0.5, "resid_pdrop": 0.0, "embd_pdrop": 0.0},  # fused gate_up_proj
}

FAMILY_NAMES = tuple(_FAMILY_CONFIG)

# Families without a row in the table, patched by structure (fusetune/models/recognize.py): what each mini
# config adds to the common shape.
_STRUCTURE_FAMILY_CONFIG: dict[str, dict] = {
    "olmo2": {},  # post-norm layers, q_norm / k_norm over whole projections, norms in fp32 (gemma casting)
    "granite": {"residual_multiplier": 0.5, "logits_scaling": 4.0, "embedding_multiplier": 3.0},
    "smollm3": {"no_rope_layer_interval": 2},  # the second layer runs no rotary embedding
    "glm4": {},  # sandwich layers named otherwise, fused gate_up_proj, interleaved partial rotary
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48},
    "gpt_oss": {
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 4,
    },
}
STRUCTURE_FAMILY_NAMES = tuple(_STRUCTURE_FAMILY_CONFIG)


def tiny_config(model_type: str) -> PretrainedConfig:
    family_config = _FAMILY_CONFIG.get(model_type, _STRUCTURE_FAMILY_CONFIG.get(model_type))
    if family_config is None:
        raise KeyError(f"no mini config for model_type {model_type!r}")
    config = AutoConfig.for_model(model_type, **_COMMON, **family_config)
    config._attn_implementation = "eager"
    if model_type in ("mixtral", "qwen3_moe", "gpt_oss"):
        # grouped_mm calls the experts' `_apply_gate`, which fusetune fuses; the eager loop does not.
        config._experts_implementation = "grouped_mm"
    return config


def _init_weights_(model: PreTrainedModel, seed: int) -> None:
    """Seeded weights independent of the transformers version; norm weights are drawn too (about 1 for
    Llama-style norms, about 0 for Gemma's 1 + w), so their gradients and the offset are exercised."""
    generator = torch.Generator().manual_seed(seed)
    gemma_norms = model.config.model_type.startswith("gemma")
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float32, device="cpu")
            if parameter.dim() == 1 and "norm" in name:
                value = 0.1 * noise if gemma_norms else 1.0 + 0.1 * noise
            elif parameter.dim() == 1:
                value = 0.02 * noise
            else:
                value = noise / math.sqrt(parameter.shape[-1])
            parameter.copy_(value.to(parameter.dtype))


def build_tiny_model(
    model_type: str, *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_config(tiny_config(model_type))
    _init_weights_(model, seed)
    return model.to(dtype)


def make_batches(device: str | torch.device = "cpu", *, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """Fixed batches: random tokens, the first tokens of row 0 masked from the loss like a prompt, and row 1
    right-padded (attention_mask 0, labels -100)."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(DISTINCT_BATCHES):
        input_ids = torch.randint(3, VOCAB_SIZE, (BATCH_SIZE, SEQ_LEN), generator=generator)
        attention_mask = torch.ones_like(input_ids)
        attention_mask[1, -2:] = 0
        input_ids[1, -2:] = 0
        labels = input_ids.clone()
        labels[0, :3] = -100
        labels[attention_mask == 0] = -100
        batches.append(
            {
                "input_ids": input_ids.to(device),
                "attention_mask": attention_mask.to(device),
                "labels": labels.to(device),
            }
        )
    return batches


@dataclass
class TrainingRun:
    losses: list[float]
    parameters: dict[str, torch.Tensor]
    eval_logits: torch.Tensor
    start_parameters: dict[str, torch.Tensor]  # before the first step: what training moved is the difference


def assert_parameters_track(
    start: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
    actual: dict[str, torch.Tensor],
    of_moved: float,
) -> None:
    """Each final parameter tensor of `actual` within `of_moved` of what training moved `expected`'s from
    `start`, in norm: per tensor, not per element, because AdamW steps an element whose gradient is zero but
    for rounding by up to the learning rate in whichever direction the rounding picks."""
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        gap = (actual[name] - value).norm()
        moved = (value - start[name]).norm()
        assert gap <= of_moved * moved, (
            f"parameter {name}: the runs differ by {gap:.3g}, {gap / moved:.3g} of the {moved:.3g} that "
            f"training moved it (up to {of_moved} allowed)"
        )


def train(
    model: PreTrainedModel,
    batches: list[dict[str, torch.Tensor]],
    *,
    steps: int = TRAIN_STEPS,
    eps: float = 1e-8,
) -> TrainingRun:
    """`steps` AdamW steps over the batches in turn; then the logits of the first batch in eval mode. `eps`:
    AdamW's (torch's default, which the golden curves ran with)."""
    start_parameters = {name: p.detach().float().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.01, eps=eps)
    model.train()
    losses = []
    for step in range(steps):
        loss = model(**batches[step % len(batches)]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        eval_batch = {key: value for key, value in batches[0].items() if key != "labels"}
        eval_logits = model(**eval_batch).logits.float()
    parameters = {name: p.detach().float().clone() for name, p in model.named_parameters()}
    return TrainingRun(
        losses=losses, parameters=parameters, eval_logits=eval_logits, start_parameters=start_parameters
    )
