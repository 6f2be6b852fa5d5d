"""The trainer's guard: every example is checked again (fusetune/tokenization/check.py) before the model loads, so
a job the API could not check (a fine-tuned model, a server without the tokenizer) still fails before any GPU time.
The model folders here hold a tokenizer and a config but no weights: a run that got as far as loading the model
would fail with model_not_found instead."""

from __future__ import annotations

import json

import pytest

from fusetune.demo import assets
from fusetune.spec.methods import method_spec
from fusetune.worker.train.config import TrainConfig
from fusetune.worker.train.launch import run
from fusetune.worker.train.outcome import EXIT_FAILED, ErrorCode, read_error


@pytest.fixture(scope="module")
def weightless_model(tmp_path_factory):
    """The demo's tokenizer with its end-of-turn token moved out of the generation block, and a config."""
    folder = tmp_path_factory.mktemp("weightless")
    tokenizer = assets.build_tokenizer()
    broken = assets.CHAT_TEMPLATE.replace(
        "{{- eos_token }}{%- endgeneration %}", "{%- endgeneration %}{{- eos_token }}"
    )
    assert broken != assets.CHAT_TEMPLATE
    tokenizer.chat_template = broken
    tokenizer.save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", **assets.TINY_MODEL_SHAPE}))
    return folder


@pytest.mark.parametrize(
    "method, data_file",
    [("supervised", assets.TRAIN_FILE), ("dpo", assets.PREFERENCE_FILE)],
)
def test_a_failing_example_fails_the_run_before_the_model_loads(
    weightless_model, tmp_path, method, data_file
):
    training = tmp_path / "train.jsonl"
    training.write_text(
        "\n" + "".join(data_file.read_text().splitlines(keepends=True)[:4])
    )  # line 1 is blank
    config = TrainConfig(
        model_path=str(weightless_model), training_file=str(training), output_dir=str(tmp_path / "out"),
        method=method_spec(method), n_epochs=1, batch_size=2, max_seq_length=128,
    )  # fmt: skip
    assert run(config) == EXIT_FAILED
    error = read_error(tmp_path / "out")
    assert error["code"] == ErrorCode.INVALID_TRAINING_FILE, error
    assert error["message"].startswith("train.jsonl, line 2: the data check 'end_of_turn_trained' failed: ")
    assert "its stop token '<|eot|>'" in error["message"]
    assert "<|assistant|>\n⟦44⟧<|eot|>" in error["message"]
