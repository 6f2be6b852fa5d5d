"""A miniature of a model: its config shrunk to a few thousand parameters, built with random weights.

The recognizer looks at structure, which a miniature keeps: the same classes, the same layout, the same
config switches (activation, soft-capping, scaling), at hidden size 64 and two layers. `fusetune families
propose` and the share report (benchmarks/models/families_share.py) recognise miniatures, so that a family
can be looked at without its weights or a GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

# Config fields set to these values where a config has them (names differ across families).
MINIATURE_SIZES: dict[str, int] = {
    "hidden_size": 64,
    "n_embd": 64,
    "d_model": 64,
    "intermediate_size": 128,
    "ffn_dim": 128,
    "n_inner": 128,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "num_hidden_layers": 2,
    "n_layer": 2,
    "num_layers": 2,
    "num_attention_heads": 4,
    "n_head": 4,
    "num_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "kv_channels": 16,
    "rotary_dim": 8,
    "vocab_size": 256,
    "max_position_embeddings": 128,
    "n_positions": 128,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "top_k": 2,
    "sliding_window": 16,
    "sliding_window_size": 16,
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2,
    "swa_head_dim": 16,
    "unpadded_vocab_size": 256,
    # multi-head latent attention (DeepSeek-V2/V3 and their kin): the head is nope + rope wide
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
}
# A miniature with more parameters than this kept a size field the list above does not know.
MAX_MINIATURE_PARAMETERS = 20_000_000
# Fields that count layers: a list as long as the layers is cut to the miniature's layers.
_LAYER_COUNT_FIELDS = ("num_hidden_layers", "n_layer", "num_layers")
_TOKEN_ID_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")


def shrink_config(config: PretrainedConfig) -> PretrainedConfig:
    """A copy of `config` at miniature sizes, keeping every other field (sub-configs shrunk too)."""
    config = config.__class__.from_dict(config.to_dict())
    _shrink(config)
    return config


def _shrink(config: PretrainedConfig) -> None:
    layers_before = next((getattr(config, f) for f in _LAYER_COUNT_FIELDS if hasattr(config, f)), None)
    for name, value in MINIATURE_SIZES.items():
        current = getattr(config, name, None)
        derived = isinstance(getattr(type(config), name, None), property)  # computed from other fields
        if isinstance(current, int) and not isinstance(current, bool) and not derived:
            setattr(config, name, value)
    if isinstance(getattr(config, "qk_rope_head_dim", None), int) and hasattr(config, "head_dim"):
        config.head_dim = config.qk_rope_head_dim  # latent attention: head_dim names the rotary part
    layers = next((getattr(config, f) for f in _LAYER_COUNT_FIELDS if hasattr(config, f)), None)
    if isinstance(layers_before, int) and isinstance(layers, int):
        for name, value in list(vars(config).items()):
            if isinstance(value, list) and len(value) == layers_before and layers_before != layers:
                setattr(config, name, value[:layers])
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int):
        for index, name in enumerate(_TOKEN_ID_FIELDS):
            value = getattr(config, name, None)
            if isinstance(value, int) and value >= vocab:
                setattr(config, name, index % 3)
            elif isinstance(value, list):
                setattr(config, name, [v if v < vocab else index % 3 for v in value])
    for value in list(vars(config).values()):
        if isinstance(value, PretrainedConfig):
            _shrink(value)


def build_miniature(
    source: str | PretrainedConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32, **config_fields: Any
) -> PreTrainedModel:
    """A causal LM of the family of `source` (a model folder or hub name whose config is read, a
    model_type, or a config), shrunk, with random weights."""
    if isinstance(source, PretrainedConfig):
        config = source
    elif "/" in source or Path(source).is_dir():
        config = AutoConfig.from_pretrained(source)
    else:
        config = AutoConfig.for_model(source)
    config = shrink_config(config)
    for name, value in config_fields.items():
        setattr(config, name, value)
    with torch.device("meta"):  # counted first: building a model that stayed large would take minutes
        parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if parameters > MAX_MINIATURE_PARAMETERS:
        raise ValueError(
            f"the miniature of {config.model_type} still has {parameters:,} parameters: a size field of its "
            "config is not among fusetune.models.miniature.MINIATURE_SIZES"
        )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)
