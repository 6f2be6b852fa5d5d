"""Which base models this server offers, and where they live on disk.

A base model is a Hugging Face model directory under ``Settings.models_dir`` (a folder holding config.json),
or an id listed in ``Settings.hub_models`` that is already in the local Hugging Face cache. Nothing outside
those is ever loaded, so a job cannot make the server read an arbitrary path.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from fusetune.config import Settings

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def list_base_models(settings: Settings) -> list[str]:
    names: list[str] = []
    if settings.models_dir.is_dir():
        # A dot folder is a copy still being made (add_model_folder).
        names += sorted(
            p.name
            for p in settings.models_dir.iterdir()
            if (p / "config.json").is_file() and not p.name.startswith(".")
        )
    names += [name for name in settings.hub_models if name not in names]
    return names


def base_model_location(settings: Settings, name: str) -> str | None:
    """A local directory or an offline hub id for ``name``, or None if the server does not offer it."""
    if not _NAME.match(name) or ".." in name:
        return None
    local = settings.models_dir / name
    if "/" not in name and (local / "config.json").is_file():
        return str(local)
    if name in settings.hub_models:
        return name
    return None


# safetensors' own bound on a header; a larger one is not a safetensors file.
_SAFETENSORS_HEADER_LIMIT = 100 * 1024 * 1024


def _safetensors_header(path: Path) -> dict:
    """The tensor table at the head of a safetensors file (8 bytes little-endian length, then JSON); no weight
    is read."""
    with path.open("rb") as file:
        length = int.from_bytes(file.read(8), "little")
        if length > _SAFETENSORS_HEADER_LIMIT:
            raise ValueError(f"{path} is not a safetensors file: its header claims {length} bytes")
        header = json.loads(file.read(length))
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file: its header is not a table")
    return header


def adapter_module_paths(model_dir: Path) -> set[str] | None:
    """The paths of the modules a LoRA adapter can wrap ("model.layers.0.self_attn.q_proj"): those holding a
    matrix (linear layers and embeddings, a quantized layer's packed weight; not norms or biases), read from the
    tensor names and shapes in the folder's safetensors headers, no weight loaded. An output head tied to the embeddings has no tensor of its own but is
    a module of the loaded model: lm_head is always one. None when the folder holds no safetensors
    (model.safetensors or a sharded index) or they cannot be read: then nothing is known here."""
    index = model_dir / "model.safetensors.index.json"
    try:
        if index.is_file():
            shards = set(json.loads(index.read_bytes())["weight_map"].values())
            files = [model_dir / shard for shard in shards if "/" not in shard and ".." not in shard]
        elif (model_dir / "model.safetensors").is_file():
            files = [model_dir / "model.safetensors"]
        else:
            return None
        paths = {
            name.rpartition(".")[0]
            for file in files
            for name, tensor in _safetensors_header(file).items()
            if "." in name and isinstance(tensor, dict) and len(tensor.get("shape", ())) >= 2
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not any(path == "lm_head" or path.endswith(".lm_head") for path in paths):
        paths.add("lm_head")
    return paths


class ModelFolderError(ValueError):
    """A model folder that cannot be added, with the reason."""


def add_model_folder(settings: Settings, source: Path, name: str) -> Path:
    """Copy the model folder `source` (links followed, as in the Hugging Face cache) to the models directory as
    `name`, which jobs then use as their `model`. The copy appears whole or not at all: it is made beside its
    place and renamed into it."""
    if "/" in name or not _NAME.match(name):
        raise ModelFolderError(
            f"the name {name!r} is not a folder name: letters, digits, '.', '_' and '-', "
            "starting with a letter or digit"
        )
    if not (source / "config.json").is_file():
        raise ModelFolderError(f"{source} holds no config.json: it is not a Hugging Face model folder")
    target = settings.models_dir / name
    if target.exists():
        raise ModelFolderError(
            f"the models directory {settings.models_dir} already has a model named {name!r}"
        )
    settings.models_dir.mkdir(parents=True, exist_ok=True)
    partial = settings.models_dir / f".{name}.partial-{os.getpid()}"
    try:
        shutil.copytree(source, partial, symlinks=False)
        partial.rename(target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def fine_tuned_model_name(base_model: str, tenant: str, suffix: str | None, job_id: str) -> str:
    # The OpenAI API's shape: ft:<base>:<org>:<suffix>:<id>.
    return f"ft:{base_model}:{tenant}:{suffix or ''}:{job_id}"


_CHECKPOINT_NAME = re.compile(r"^(?P<model>.+):ckpt-step-(?P<step>[0-9]{1,9})$")


def checkpoint_model_name(fine_tuned_model: str, step: int) -> str:
    # The OpenAI API's shape: the fine-tuned model's name, then :ckpt-step-<step>.
    return f"{fine_tuned_model}:ckpt-step-{step}"


def split_checkpoint_model_name(name: str) -> tuple[str, int] | None:
    """(the fine-tuned model, the step) a checkpoint's model name names; None for any other name."""
    found = _CHECKPOINT_NAME.match(name)
    return (found["model"], int(found["step"])) if found else None
