"""LoRA through peft on CPU: only the adapters train, the checkpoint holds the adapter (and merged weights on
request) and loads with peft or the Auto classes, and a resume continues the same curve (dropout included)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from fusetune.catalog import adapter_module_paths
from fusetune.demo import assets
from fusetune.worker.train.checkpoints import layout as ckpt
from fusetune.worker.train.checkpoints import state as checkpoint_state
from fusetune.worker.train.outcome import JobStopped
from fusetune.worker.train.reporter import StopRequest
from fusetune.worker.train.trainer import Trainer, load_model
from tests.models import tiny
from tests.worker.test_train_trainer import ONE_CPU_RANK, RecordingReporter, make_config

LORA = {"r": 8, "alpha": 16, "dropout": 0.1}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return assets.build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def train_file(tmp_path_factory):
    return assets.write_demo_dataset(tmp_path_factory.mktemp("data") / "train.jsonl", n_examples=48, seed=5)


def lora_config(model_dir, train_file, output_dir, **overrides):
    fields = dict(lora=LORA, learning_rate=1e-2, n_epochs=2, checkpoint_every_steps=4)
    return make_config(model_dir, train_file, output_dir, **{**fields, **overrides})


@pytest.fixture(scope="module")
def merged_run(model_dir, train_file, tmp_path_factory):
    reporter = RecordingReporter()
    config = lora_config(model_dir, train_file, tmp_path_factory.mktemp("merged"), merge_lora_on_save=True)
    trainer = Trainer(config, ONE_CPU_RANK, reporter)
    result = trainer.train()
    return trainer, reporter, result


def eval_logits(model, model_dir) -> torch.Tensor:
    torch.manual_seed(3)
    input_ids = torch.randint(0, AutoModelForCausalLM.from_pretrained(model_dir).config.vocab_size, (2, 24))
    with torch.no_grad():
        return model.eval()(input_ids=input_ids).logits


def test_lora_trains_only_the_adapters(merged_run, model_dir):
    trainer, reporter, _ = merged_run
    losses = [values["train_loss"] for _, values in reporter.metrics]
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < losses[0] - 0.2

    started = next(data for _, data in reporter.events if data.get("event") == "started")
    assert started["lora"] == {**LORA, "target_modules": "all-linear", "adapted_modules": 2 * 7}
    assert 0 < started["trainable_parameters"] < started["model_parameters"] / 5

    base = dict(AutoModelForCausalLM.from_pretrained(model_dir).named_parameters())
    n_lora = 0
    for name, parameter in trainer.model.named_parameters():
        if "lora_" in name:
            n_lora += 1
            assert parameter.requires_grad
            if "lora_B" in name:  # starts at zero, so any training moves it
                assert parameter.abs().max() > 0, name
        else:
            assert not parameter.requires_grad
            base_name = name.removeprefix("base_model.model.").replace(".base_layer", "")
            assert torch.equal(parameter, base[base_name]), name
    # Every linear layer of both decoder layers (q, k, v, o, gate, up, down), A and B each.
    assert n_lora == 2 * 7 * 2


def test_lora_checkpoint_loads_with_peft_and_merged_with_auto_classes(merged_run, model_dir):
    trainer, _, result = merged_run
    expected = eval_logits(trainer.model, model_dir)
    checkpoint = ckpt.checkpoint_path(trainer.config.output_dir, 12)
    assert result.final_checkpoint == str(checkpoint)
    adapter = checkpoint / ckpt.ADAPTER_DIRNAME
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {p.name for p in adapter.iterdir()}
    assert (checkpoint / "tokenizer.json").is_file()
    assert not (checkpoint / "adapter_config.json").exists()  # or transformers would apply it a second time

    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapter)
    torch.testing.assert_close(eval_logits(with_adapter, model_dir), expected, rtol=1e-5, atol=1e-5)
    merged = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert merged.config.tie_word_embeddings
    torch.testing.assert_close(eval_logits(merged, model_dir), expected, rtol=1e-5, atol=1e-5)
    # Control: the base model alone gives other logits, so the comparisons above see the adapter.
    base_logits = eval_logits(AutoModelForCausalLM.from_pretrained(model_dir), model_dir)
    assert (base_logits - expected).abs().max() > 1e-2


def test_adapter_only_checkpoint_loads_and_serves_as_a_base_model(model_dir, train_file, tmp_path):
    config = lora_config(model_dir, train_file, tmp_path, max_steps=3, n_epochs=1)
    trainer = Trainer(config, ONE_CPU_RANK, RecordingReporter())
    checkpoint = ckpt.checkpoint_path(tmp_path, 3)
    assert trainer.train().final_checkpoint == str(checkpoint)
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= {
        p.name for p in checkpoint.iterdir()
    }
    assert not (checkpoint / "model.safetensors").exists()
    assert ckpt.is_adapter_checkpoint(checkpoint)
    expected = eval_logits(trainer.model, model_dir)
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), checkpoint)
    torch.testing.assert_close(eval_logits(with_adapter, model_dir), expected, rtol=1e-5, atol=1e-5)
    # A job whose model is this checkpoint starts from the base weights with the adapter merged in.
    as_base = load_model(str(checkpoint), torch.float32)
    assert not isinstance(as_base, PeftModel)
    torch.testing.assert_close(eval_logits(as_base, model_dir), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("merge_lora_on_save", [False, True])
def test_checkpoint_names_the_public_model_and_loads_without_the_servers_folders(
    model_dir, train_file, tmp_path, merge_lora_on_save
):
    """A tenant downloads a LoRA checkpoint (all but training_state/, which stays on the server): no file names
    the server's folders, and the adapter loads with peft onto the base model kept anywhere else."""
    server = tmp_path / "server"
    server_model = shutil.copytree(model_dir, server / "models" / "tiny-llama")
    config = lora_config(server_model, train_file, server / "runs" / "ftjob-1", max_steps=3, n_epochs=1,
                         model_name="tiny-llama", merge_lora_on_save=merge_lora_on_save)  # fmt: skip
    trainer = Trainer(config, ONE_CPU_RANK, RecordingReporter())
    checkpoint = Path(trainer.train().final_checkpoint)
    expected = eval_logits(trainer.model, model_dir)

    downloaded = tmp_path / "laptop" / "checkpoint"
    shutil.copytree(checkpoint, downloaded, ignore=shutil.ignore_patterns(ckpt.TRAINING_STATE_DIRNAME))
    for path in downloaded.rglob("*"):
        if path.is_file():
            assert str(server).encode() not in path.read_bytes(), path.relative_to(downloaded)
    adapter = downloaded / ckpt.ADAPTER_DIRNAME if merge_lora_on_save else downloaded
    adapter_config = json.loads((adapter / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == "tiny-llama"
    assert "base_model: tiny-llama" in (adapter / "README.md").read_text()

    base = shutil.copytree(server_model, tmp_path / "laptop" / "hub" / "my-copy-of-tiny-llama")
    shutil.rmtree(server)
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
    torch.testing.assert_close(eval_logits(with_adapter, model_dir), expected, rtol=1e-5, atol=1e-5)
    if not merge_lora_on_save:
        # As a job's model, the checkpoint's base is found where TrainConfig.adapter_base_models says.
        as_base = load_model(str(downloaded), torch.float32, {"tiny-llama": str(base)})
        torch.testing.assert_close(eval_logits(as_base, model_dir), expected, rtol=1e-5, atol=1e-5)


def _paused_then_resumed_losses(config, monkeypatch=None) -> list[float]:
    before = RecordingReporter(stop_after_step=5, stop=StopRequest.PAUSE)
    with pytest.raises(JobStopped):
        Trainer(config, ONE_CPU_RANK, before).train()
    after = RecordingReporter()
    Trainer(config, ONE_CPU_RANK, after).train()
    return [values["train_loss"] for _, values in before.metrics + after.metrics]


def test_lora_resume_continues_the_curve_dropout_included(merged_run, model_dir, train_file, tmp_path):
    """Without merged saves here: saving merged weights must not disturb training either."""
    _, whole, _ = merged_run
    whole_losses = [values["train_loss"] for _, values in whole.metrics]
    config = lora_config(model_dir, train_file, tmp_path / "resumed")
    torch.testing.assert_close(_paused_then_resumed_losses(config), whole_losses, rtol=1e-6, atol=0)


def test_lora_resume_without_the_rng_state_draws_other_dropout_masks(
    merged_run, model_dir, train_file, tmp_path, monkeypatch
):
    """Control: dropout makes the curve depend on the restored RNG state."""
    _, whole, _ = merged_run
    whole_losses = [values["train_loss"] for _, values in whole.metrics]
    monkeypatch.setattr(checkpoint_state, "restore_rng_state", lambda state, device: None)
    config = lora_config(model_dir, train_file, tmp_path / "resumed")
    with pytest.raises(AssertionError):
        torch.testing.assert_close(_paused_then_resumed_losses(config), whole_losses, rtol=1e-6, atol=0)


@pytest.mark.parametrize("model_type", [*tiny.FAMILY_NAMES, *tiny.STRUCTURE_FAMILY_NAMES])
def test_every_module_an_adapter_wraps_is_named_by_the_safetensors_headers(model_type, tmp_path):
    """The API refuses a target_modules name that matches none of adapter_module_paths (read from the saved
    headers); each family's linear layers and embeddings, as the loaded model names them, must be among them,
    or a name peft would wrap were refused."""
    tiny.build_tiny_model(model_type).save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    wrappable = {
        name
        for name, module in loaded.named_modules()
        if isinstance(module, torch.nn.Linear | torch.nn.Embedding)
    }
    assert wrappable and wrappable <= adapter_module_paths(tmp_path)
