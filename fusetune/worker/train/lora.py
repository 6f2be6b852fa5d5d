"""LoRA through peft: wrapping a model, saving and restoring the adapter, and merging it into full weights.

The state dicts handed in here are full (unsharded) and on the CPU, keyed by the names the PEFT model gives its
parameters, so the same functions serve one process, DDP and FSDP.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fusetune.spec.hyperparameters import LoraSpec
from fusetune.worker.train.checkpoints.layout import ADAPTER_WEIGHTS_FILENAME


def apply_lora(model: torch.nn.Module, lora: LoraSpec, base_model_name: str | None = None) -> torch.nn.Module:
    """The model wrapped in LoRA adapters; only the adapters require gradients.

    `base_model_name` is what the adapter's checkpoints name as their base model (adapter_config.json and the
    README.md peft writes, which read it from the model): the model's public name, where its local path would
    tell the tenant the server's folders and load only where they exist. None: the path it was loaded from.
    """
    import peft

    if base_model_name is not None:
        model.config.name_or_path = base_model_name
        model.name_or_path = base_model_name
    config = peft.LoraConfig(
        base_model_name_or_path=base_model_name,
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        task_type="CAUSAL_LM",
    )
    return peft.get_peft_model(model, config)


def merge_adapter(base: torch.nn.Module, path: str | Path) -> torch.nn.Module:
    """A full model from an adapter checkpoint and its base model, the adapter merged in, so that a LoRA job's
    result can be fine-tuned further like any base model."""
    import peft

    return peft.PeftModel.from_pretrained(base, str(path)).merge_and_unload()


def load_adapter_weights(model: torch.nn.Module, adapter_dir: Path) -> None:
    """Put a saved adapter's weights into a model wrapped by `apply_lora` with the same LoRA settings."""
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    result = set_peft_model_state_dict(model, load_file(adapter_dir / ADAPTER_WEIGHTS_FILENAME))
    missing_adapter_keys = [key for key in result.missing_keys if "lora_" in key]
    if missing_adapter_keys or result.unexpected_keys:
        raise ValueError(
            f"the adapter in {adapter_dir} does not fit this model's LoRA settings: missing "
            f"{missing_adapter_keys[:3]}, unexpected {list(result.unexpected_keys)[:3]}"
        )


def save_adapter(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], directory: Path) -> None:
    """adapter_model.safetensors + adapter_config.json from a state dict holding at least the adapter."""
    model.save_pretrained(str(directory), state_dict=state_dict)


def save_merged(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], directory: Path) -> None:
    """Full weights with the adapter merged in, from the full state dict of the PEFT model.

    The merge runs on a CPU copy filled from the state dict. It must be a copy: merging adds to the base
    weights in place, and in a single process the state dict's tensors are the training model's own.
    """
    import peft
    from transformers import AutoModelForCausalLM

    base_config = model.get_base_model().config
    with torch.device("meta"):
        copy = peft.get_peft_model(
            AutoModelForCausalLM.from_config(base_config), model.peft_config["default"]
        )
    copy.to_empty(device="cpu")
    copy.get_base_model().tie_weights()  # to_empty gave tied weights separate storage
    copy.load_state_dict(state_dict, strict=True)
    copy.merge_and_unload().save_pretrained(str(directory))


def lora_summary(model: torch.nn.Module, lora: LoraSpec) -> dict[str, Any]:
    """The LoRA settings and how many layers got an adapter, for the job's "started" event."""
    adapted = sum(1 for module in model.modules() if hasattr(module, "lora_A"))
    return {**lora.model_dump(), "adapted_modules": adapted}
