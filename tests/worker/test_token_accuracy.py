"""A supervised step's train_mean_token_accuracy is the same whether the model builds its logits or the fused
loss kernel counts the tokens predicted right (on a GPU, or under the Triton interpreter on a CPU)."""

from __future__ import annotations

import torch

from fusetune.demo import assets
from fusetune.models import apply_fusetune
from fusetune.models.fused import has_fused_loss
from fusetune.worker.train.config import TrainConfig
from fusetune.worker.train.loading import load_model, load_tokenizer
from fusetune.worker.train.methods.sft import SupervisedFineTuning

# Only the loss is patched: the accuracy is all this compares.
ONLY_LOSS = {"rope": False, "rms_norm": False, "swiglu": False, "geglu": False}


def test_the_fused_loss_counts_the_same_accuracy_as_the_logits(tmp_path, device):
    model_dir = assets.build_tiny_model(tmp_path / "model")
    train = assets.write_demo_dataset(tmp_path / "train.jsonl", n_examples=6, seed=3)
    config = TrainConfig(model_path=str(model_dir), training_file=str(train), output_dir=str(tmp_path / "out"),
                         max_seq_length=64, batch_size=6)  # fmt: skip
    tokenizer = load_tokenizer(str(model_dir))
    method = SupervisedFineTuning(config, tokenizer, tokenizer.pad_token_id or 0)
    batch = method.collate(method.load_data(str(train), packing=False).sequences, packed=False)
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) and v.ndim else v for k, v in batch.items()}
    model = load_model(str(model_dir), torch.float32).to(device)
    model.train()
    normaliser = torch.tensor(int(batch["n_trained_tokens"]) * 2, device=device)  # another rank's as many
    loss, metrics = method.loss(model, batch, normaliser)
    handle = apply_fusetune(model, **ONLY_LOSS)
    try:
        assert has_fused_loss(model)
        fused_loss, fused_metrics = method.loss(model, batch, normaliser)
    finally:
        handle.revert()
    accuracy = metrics["train_mean_token_accuracy"]
    assert 0 < accuracy <= 0.5  # this micro-batch's share of the step's tokens: at most half
    torch.testing.assert_close(fused_metrics["train_mean_token_accuracy"], accuracy)
    torch.testing.assert_close(fused_loss, loss, atol=1e-5, rtol=1e-5)
