"""A model folder's tokenizer without torch, and the tokens that stop the model's generation.

`AutoTokenizer` imports torch (transformers' auto classes reach its model code); the API process must not, so it
loads the fast tokenizer class that tokenizer_config.json names, which is torch-free (a subclass of
`PreTrainedTokenizerFast` defined in a transformers tokenization module), or `PreTrainedTokenizerFast` itself.
Both read the folder's tokenizer.json, as `AutoTokenizer` does for a fast tokenizer; the trainer loads the model's
tokenizer with `AutoTokenizer` and checks its data again with it before the model loads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fusetune.tokenization.masks import default_stop_ids

TOKENIZER_FILE = "tokenizer.json"


def _json_object(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def load_tokenizer_without_torch(model_dir: str | Path) -> Any | None:
    """The tokenizer of a model folder, or None when it has no tokenizer.json to load without torch."""
    import transformers
    from transformers import PreTrainedTokenizerFast

    model_dir = Path(model_dir)
    if not (model_dir / TOKENIZER_FILE).is_file():
        return None
    named = _json_object(model_dir / "tokenizer_config.json").get("tokenizer_class")
    tokenizer_class = PreTrainedTokenizerFast
    if isinstance(named, str) and named.isidentifier():
        candidate = getattr(transformers, named, None)
        if (
            isinstance(candidate, type)
            and issubclass(candidate, PreTrainedTokenizerFast)
            and ".tokenization_" in candidate.__module__
        ):
            tokenizer_class = candidate
    return tokenizer_class.from_pretrained(str(model_dir), local_files_only=True)


def stop_token_ids(tokenizer: Any, model_path: str | Path) -> frozenset[int]:
    """The tokens at which generation stops: the tokenizer's eos and the eos_token_id (one or a list) of the
    model folder's generation_config.json, which serving stacks stop at too."""
    ids = set(default_stop_ids(tokenizer))
    configured = _json_object(Path(model_path) / "generation_config.json").get("eos_token_id")
    for value in configured if isinstance(configured, list) else [configured]:
        if isinstance(value, int) and not isinstance(value, bool):
            ids.add(value)
    return frozenset(ids)
