"""Loading what a run trains: the tokenizer, the model (a folder, the local cache, or a LoRA checkpoint merged
into its base model), and patching the model with fusetune's kernels."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fusetune.worker.train import lora
from fusetune.worker.train.checkpoints.layout import adapter_base_model_name, adapter_dir
from fusetune.worker.train.config import TrainConfig
from fusetune.worker.train.data import LoadedData
from fusetune.worker.train.outcome import ErrorCode, TrainingFailure
from fusetune.worker.train.reporter import Reporter

if TYPE_CHECKING:
    from fusetune.models import FusetuneHandle


def _model_not_found(model_path: str, what: str, exc: Exception) -> TrainingFailure:
    if Path(model_path).exists():
        detail = " ".join(str(exc).split())[:500] or type(exc).__name__
        message = f"could not load a {what} from model path '{model_path}': {detail}"
    else:
        message = (
            f"model path '{model_path}' is neither a local directory nor a model in the local Hugging Face "
            "cache"
        )
    return TrainingFailure(ErrorCode.MODEL_NOT_FOUND, message)


def load_tokenizer(model_path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise _model_not_found(model_path, "tokenizer", exc) from exc


def load_model(
    model_path: str, dtype: torch.dtype, adapter_base_models: Mapping[str, str] | None = None
) -> torch.nn.Module:
    """A causal LM from a model folder, a model in the local cache, or a LoRA checkpoint merged into the base
    model it names. A checkpoint names its base model by its public name; `adapter_base_models` says where each
    such name is here (TrainConfig.adapter_base_models), and a name it lacks is loaded as a path or a cached id."""
    from transformers import AutoModelForCausalLM

    adapter_base_models = adapter_base_models or {}
    base_name = adapter_base_model_name(model_path)
    if base_name is not None:
        # The base may itself be a LoRA job's checkpoint (a fine-tuned model fine-tuned again).
        base = load_model(adapter_base_models.get(base_name, base_name), dtype, adapter_base_models)
    try:
        if base_name is not None:
            return lora.merge_adapter(base, model_path)
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise _model_not_found(model_path, "causal LM", exc) from exc


def prepare_model(model: torch.nn.Module, config: TrainConfig, resumed: Path | None) -> torch.nn.Module:
    """A loaded model made ready to train: no KV cache, gradient checkpointing and LoRA adapters as configured
    (the adapters of the checkpoint a LoRA run resumes)."""
    model.config.use_cache = False
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if config.lora is not None:
        model = lora.apply_lora(model, config.lora, config.model_name)
        if resumed is not None:
            lora.load_adapter_weights(model, adapter_dir(resumed))
    return model


def apply_kernels(model: torch.nn.Module, device: torch.device, reporter: Reporter) -> bool:
    """Patch `model` with the fused kernels where its family has them; reports what happened. Returns whether
    any kernel was applied."""
    if device.type != "cuda":
        reporter.event(
            "Fused kernels need a GPU; training on CPU runs the model unpatched",
            data={"event": "kernels", "applied": False},
        )
        return False
    try:
        from fusetune.models import apply_fusetune  # type: ignore[attr-defined]
    except ImportError:
        reporter.event(
            "Fused kernels are not available in this build; training runs unpatched",
            level="warning",
            data={"event": "kernels", "applied": False},
        )
        return False
    # strict=False: a family without fused kernels trains unpatched instead of failing the job. A family
    # without a row in the table is recognised by its structure, each part proven by a probe on `device`
    # before it is patched. A PEFT model is patched through to its base model, the LoRA layers inside the
    # patched modules kept.
    handle = apply_fusetune(model, strict=False, probe_device=device)
    message, level, data = kernels_event(getattr(model.config, "model_type", "?"), handle)
    reporter.event(message, level=level, data=data)
    return handle.active


def kernels_event(model_type: str, handle: FusetuneHandle) -> tuple[str, str, dict[str, Any]]:
    """The `kernels` event of one `apply_fusetune` handle: (message, level, data). The data says whether any
    kernel was applied, from the table's row or by structure (`source`), what was patched (`patched`: what
    replaced -> how many modules) and what was left as it is, and why (`left`: part -> reason)."""
    left = dict(handle.left)
    left_text = "; ".join(f"{part}: {why}" for part, why in left.items())
    data = {
        "event": "kernels",
        "applied": handle.active,
        "source": handle.source,
        "patched": dict(handle.patched),
        "left": left,
    }
    if not handle.active:
        reason = f" ({left_text})" if left_text else ""
        return (
            f"No fused kernels for model type '{model_type}'; training runs unpatched{reason}",
            "warning",
            data,
        )
    how = " (recognised by structure)" if handle.source == "structure" else ""
    message = f"Fused kernels applied to '{model_type}'{how}: {', '.join(sorted(handle.patched))}"
    if left_text:
        message += f". Left as they are: {left_text}"
    return message, "info", data


def report_data(data: LoadedData, path: str, max_seq_length: int, reporter: Reporter) -> LoadedData:
    """Warns about examples cut to max_seq_length or left out; returns `data`."""
    if data.n_truncated or data.n_dropped:
        reporter.event(
            f"{Path(path).name}: {data.n_truncated} of {data.n_examples} examples were cut to "
            f"max_seq_length={max_seq_length}; {data.n_dropped} were left out because no trained token "
            "remained",
            level="warning",
            data={"event": "data", "n_truncated": data.n_truncated, "n_dropped": data.n_dropped},
        )
    return data
