"""`AutoFusedModelForCausalLM`: transformers' AutoModelForCausalLM, with fusetune's kernels applied."""

from __future__ import annotations

from typing import Any

from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from fusetune.models.patching import PatchOptions, apply_fusetune

# apply_fusetune's keywords besides the kernel options.
_PATCH_KEYWORDS = ("recognize_structure", "probe_device")


def _split_options(kwargs: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    names = [*PatchOptions.names(), *_PATCH_KEYWORDS]
    options = {name: kwargs.pop(name) for name in names if name in kwargs}
    strict = kwargs.pop("strict", False)
    return options, strict


class AutoFusedModelForCausalLM:
    """Load or build any causal LM as transformers would, then patch it with fusetune's kernels.

    The kernel options of `apply_fusetune` (rope, rms_norm, swiglu, geglu, add_rms_norm,
    fused_linear_cross_entropy), `recognize_structure` and `probe_device` are taken from the keywords;
    everything else goes to transformers. A family without a row in the table is recognised by its structure
    (see `apply_fusetune`); one with neither loads unpatched with a warning, unless `strict=True` is passed.
    The patch handle is `fusetune.models.fusetune_handle(model)`.
    """

    def __init__(self) -> None:
        raise OSError("use AutoFusedModelForCausalLM.from_pretrained(...) or .from_config(...)")

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: str, *model_args: Any, **kwargs: Any
    ) -> PreTrainedModel:
        options, strict = _split_options(kwargs)
        model = AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        apply_fusetune(model, strict=strict, **options)
        return model

    @classmethod
    def from_config(cls, config: PretrainedConfig, **kwargs: Any) -> PreTrainedModel:
        options, strict = _split_options(kwargs)
        model = AutoModelForCausalLM.from_config(config, **kwargs)
        apply_fusetune(model, strict=strict, **options)
        return model
