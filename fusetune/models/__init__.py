"""Hugging Face model loading and kernel patching.

Three ways in:
- `AutoFusedModelForCausalLM.from_pretrained(path_or_id, **options)` / `.from_config(config, **options)`;
- `apply_fusetune(model_or_model_type, rope=True, rms_norm=True, ...)` on a built model (PEFT-wrapped too)
  or a model_type before loading, undone with `revert_fusetune(...)` or the returned handle's `revert()`;
- the kernels themselves, `fusetune.kernels`, for hand-written models.

What is replaced per family is the table in `families.py`.
"""

from fusetune.models.auto import AutoFusedModelForCausalLM
from fusetune.models.families import FAMILIES, FamilySpec, family_for, supported_model_types
from fusetune.models.patching import (
    FusetuneHandle,
    PatchOptions,
    apply_fusetune,
    fusetune_handle,
    revert_fusetune,
    unwrap_model,
)

__all__ = [
    "FAMILIES",
    "AutoFusedModelForCausalLM",
    "FamilySpec",
    "FusetuneHandle",
    "PatchOptions",
    "apply_fusetune",
    "family_for",
    "fusetune_handle",
    "revert_fusetune",
    "supported_model_types",
    "unwrap_model",
]
