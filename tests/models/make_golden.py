"""Write the golden loss curves of the unpatched Hugging Face models: tests/models/golden/<model_type>.json.

Regenerate (after changing tiny.py, or to follow a transformers release whose numerics moved), from the
repository root with the venv active:

    python -m tests.models.make_golden            # every family
    python -m tests.models.make_golden llama qwen3

The curves come from plain transformers (no fusetune patch), fp32 on CPU; the convergence tests check both
the unpatched and the patched runs against them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers

from tests.models.tiny import FAMILY_NAMES, TRAIN_STEPS, build_tiny_model, make_batches, train

GOLDEN_DIR = Path(__file__).parent / "golden"


def golden_path(model_type: str) -> Path:
    return GOLDEN_DIR / f"{model_type}.json"


def load_golden(model_type: str) -> dict:
    return json.loads(golden_path(model_type).read_text())


def write_golden(model_type: str) -> Path:
    run = train(build_tiny_model(model_type), make_batches("cpu"))
    record = {
        "model_type": model_type,
        "dtype": "float32",
        "device": "cpu",
        "steps": TRAIN_STEPS,
        "generated_with": {"torch": torch.__version__, "transformers": transformers.__version__},
        "command": "python -m tests.models.make_golden " + model_type,
        "losses": run.losses,
    }
    path = golden_path(model_type)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def main(argv: list[str]) -> None:
    for model_type in argv or FAMILY_NAMES:
        if model_type not in FAMILY_NAMES:
            raise SystemExit(f"unknown family {model_type!r}; choose from {', '.join(FAMILY_NAMES)}")
        print(write_golden(model_type))


if __name__ == "__main__":
    main(sys.argv[1:])
