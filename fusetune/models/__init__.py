"""Hugging Face model loading and kernel patching.

Three ways in:
- `AutoFusedModelForCausalLM.from_pretrained(path_or_id, **options)` / `.from_config(config, **options)`;
- `apply_fusetune(model_or_model_type, rope=True, rms_norm=True, ...)` on a built model (PEFT-wrapped too)
  or a model_type before loading, undone with `revert_fusetune(...)` or the returned handle's `revert()`;
- the kernels themselves, `fusetune.kernels`, for hand-written models.

What is replaced per family is the table in `families.py`. A family without a row is recognised by its
structure (`recognize.py`), each part proven equal to the original by a probe (`probe.py`) before it is
patched by the same code as a row; `fusetune families propose` prints such a family as a proposed row.
"""

from fusetune.models.auto import AutoFusedModelForCausalLM
from fusetune.models.families import FAMILIES, FamilySpec, family_for, proposed_row, supported_model_types
from fusetune.models.patching import (
    FusetuneHandle,
    PatchOptions,
    apply_fusetune,
    fusetune_handle,
    revert_fusetune,
    unwrap_model,
)
from fusetune.models.recognize import Recognition, recognize

__all__ = [
    "FAMILIES",
    "AutoFusedModelForCausalLM",
    "FamilySpec",
    "FusetuneHandle",
    "PatchOptions",
    "Recognition",
    "apply_fusetune",
    "family_for",
    "fusetune_handle",
    "proposed_row",
    "recognize",
    "revert_fusetune",
    "supported_model_types",
    "unwrap_model",
]
