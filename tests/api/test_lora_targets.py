"""LoRA's target_modules are checked at job creation against the model's module names, read from its safetensors
headers (fusetune.catalog.adapter_module_paths): a name that matches no module is a 400 naming the field and
listing the names there are, where it was accepted and failed in the trainer."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from fusetune.catalog import adapter_module_paths
from tests.api.test_validation import GOOD_LINE, _assert_error_shape, _upload

# A Llama-shaped layer: matrices for the projections and embeddings, vectors for the norms.
TENSORS = {
    "model.embed_tokens.weight": (16, 8),
    "model.layers.0.self_attn.q_proj.weight": (8, 8),
    "model.layers.0.self_attn.k_proj.weight": (4, 8),
    "model.layers.0.self_attn.v_proj.weight": (4, 8),
    "model.layers.0.self_attn.o_proj.weight": (8, 8),
    "model.layers.0.mlp.gate_proj.weight": (12, 8),
    "model.layers.0.mlp.up_proj.weight": (12, 8),
    "model.layers.0.mlp.down_proj.weight": (8, 12),
    "model.layers.0.input_layernorm.weight": (8,),
    "model.norm.weight": (8,),
}


def _save(path, names) -> None:
    save_file({name: np.zeros(TENSORS[name], dtype=np.float32) for name in names}, str(path))


@pytest.fixture
def model_with_weights(settings):
    """The conftest's model "tiny" with its weights in one model.safetensors."""
    _save(settings.models_dir / "tiny" / "model.safetensors", TENSORS)
    return settings.models_dir / "tiny"


def _create(client, lora: dict, in_method: bool = False):
    training = _upload(client, "\n".join([GOOD_LINE] * 4) + "\n").json()["id"]
    hyperparameters = {"lora": lora, "n_epochs": 1}
    if in_method:
        method = {"type": "supervised", "supervised": {"hyperparameters": hyperparameters}}
        return client.post(
            "/v1/fine_tuning/jobs", json={"model": "tiny", "training_file": training, "method": method}
        )
    return client.post(
        "/v1/fine_tuning/jobs",
        json={"model": "tiny", "training_file": training, "hyperparameters": hyperparameters},
    )


@pytest.mark.parametrize("in_method", [False, True], ids=["top-level", "in-method"])
def test_an_unknown_target_module_is_refused_naming_the_field_and_the_modules(
    client, model_with_weights, in_method
):
    error = _assert_error_shape(_create(client, {"target_modules": ["q_proj", "nope"]}, in_method), 400)
    where = "method.supervised.hyperparameters" if in_method else "hyperparameters"
    assert error["param"] == f"{where}.lora.target_modules"
    assert error["message"].startswith("lora.target_modules ['nope'] name no module of model 'tiny'")
    for name in ("q_proj", "v_proj", "down_proj", "embed_tokens", "lm_head", "all-linear"):
        assert name in error["message"], name
    # A norm holds no matrix: no adapter can wrap it.
    assert "input_layernorm" not in error["message"]
    assert client.get("/v1/fine_tuning/jobs").json()["data"] == []


@pytest.mark.parametrize("target_modules", [[], [""]], ids=["none", "an-empty-name"])
def test_no_target_module_is_refused_naming_the_field(client, model_with_weights, target_modules):
    """No adapter would be built: the job would train nothing and succeed."""
    error = _assert_error_shape(_create(client, {"target_modules": target_modules}), 400)
    assert error["param"].startswith("hyperparameters.lora.target_modules"), error
    assert client.get("/v1/fine_tuning/jobs").json()["data"] == []


@pytest.mark.parametrize(
    "target_modules",
    [["q_proj", "v_proj"], ["self_attn.q_proj"], ["model.layers.0.mlp.down_proj"], ["lm_head"], "all-linear"],
)
def test_module_names_peft_matches_create_the_job(client, model_with_weights, target_modules):
    response = _create(client, {"target_modules": target_modules})
    assert response.status_code == 200, response.text


def test_a_sharded_model_is_read_through_its_index(client, settings):
    model = settings.models_dir / "tiny"
    first, second = list(TENSORS)[:5], list(TENSORS)[5:]
    _save(model / "model-00001-of-00002.safetensors", first)
    _save(model / "model-00002-of-00002.safetensors", second)
    weight_map = {name: "model-00001-of-00002.safetensors" for name in first}
    weight_map |= {name: "model-00002-of-00002.safetensors" for name in second}
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    assert "model.layers.0.mlp.down_proj" in adapter_module_paths(model)  # in the second shard
    error = _assert_error_shape(_create(client, {"target_modules": ["nope"]}), 400)
    assert "down_proj" in error["message"] and "q_proj" in error["message"]
    assert _create(client, {"target_modules": ["down_proj", "q_proj"]}).status_code == 200


def test_without_safetensors_the_names_are_not_checked_here(client, settings):
    assert adapter_module_paths(settings.models_dir / "tiny") is None
    assert _create(client, {"target_modules": ["nope"]}).status_code == 200


def test_a_file_that_is_not_safetensors_is_not_read_as_one(settings):
    (settings.models_dir / "tiny" / "model.safetensors").write_bytes((2**62).to_bytes(8, "little") + b"{}")
    assert adapter_module_paths(settings.models_dir / "tiny") is None
