"""The model inside a wrapper: below both `patching.py` (which keys its handles by it) and `fused.py` (which
asks whether it runs the fused forward), so neither imports the other for it."""

from __future__ import annotations

from torch import nn


def unwrap_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (or the model itself)."""
    if hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None)):
        return model.get_base_model()
    return model
