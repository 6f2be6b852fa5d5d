"""Supervised fine-tuning: next-token cross-entropy on the trained tokens of each example.

Its line formats (chat, prompt/completion, text) are the specification's (fusetune/spec/examples.py). A chat's
loss is on the assistant's turns only (unless `train_on_inputs`, and never on an assistant message of weight
0); a prompt/completion's on the completion and the end-of-sequence token that closes it; a text's on every
token.

One example is one row (several when packed). A step's loss is the sum of the token losses of all its
micro-batches on all ranks divided by the number of trained tokens in the whole step, so any split of a global
batch over micro-batches and processes gives the same gradient.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fusetune.models.fused import has_fused_loss
from fusetune.worker.train.data import (
    IGNORE_INDEX,
    LoadedData,
    TokenizedSequence,
    collate,
    load_sequences,
    model_inputs,
)
from fusetune.worker.train.methods.base import TrainingMethod


class SupervisedFineTuning(TrainingMethod):
    type = "supervised"
    eval_sum_names = ("token_loss", "trained_tokens", "correct_tokens")

    def load_data(self, path: str, packing: bool) -> LoadedData:
        return load_sequences(
            path,
            self.tokenizer,
            self.config.max_seq_length,
            train_on_inputs=self.config.train_on_inputs,
            packing=packing,
            stop_ids=self.stop_ids,
        )

    def collate(self, rows: Sequence[TokenizedSequence], packed: bool) -> dict[str, torch.Tensor]:
        return collate(rows, self.pad_token_id, packed=packed, length_multiple=self.length_multiple)

    def loss_normaliser(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["n_trained_tokens"])

    def loss(
        self, model: torch.nn.Module, batch: dict[str, torch.Tensor], normaliser: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        # The model computes the loss itself (fused with the output layer when the kernels are applied):
        # labels already shifted, summed over tokens and divided by the step's global count of trained tokens.
        # The fused loss never builds the logits: its kernel counts the tokens predicted right instead.
        fused = has_fused_loss(model)
        outputs = model(
            **model_inputs(batch),
            labels=batch["shifted_labels"],
            shift_labels=batch["shifted_labels"],
            num_items_in_batch=normaliser,
            use_cache=False,
            **({"token_accuracy": True} if fused else {}),
        )
        labels = batch["shifted_labels"]
        if fused:
            correct = outputs["token_accuracy"] * int(batch["n_trained_tokens"])
        else:
            correct = ((outputs.logits.detach().argmax(-1) == labels) & (labels != IGNORE_INDEX)).sum()
        return outputs.loss, {"train_mean_token_accuracy": correct / normaliser.to(correct.device)}

    def eval_sums(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(**model_inputs(batch), use_cache=False).logits
        labels = batch["shifted_labels"]
        trained = labels != IGNORE_INDEX
        token_logits = logits[trained].float()
        loss = torch.nn.functional.cross_entropy(token_logits, labels[trained], reduction="sum")
        correct = (token_logits.argmax(-1) == labels[trained]).sum()
        return torch.stack([loss.double(), trained.sum().double(), correct.double()])

    def eval_metrics(self, sums: list[float]) -> dict[str, float]:
        loss, tokens, correct = sums
        return {"valid_loss": loss / tokens, "valid_mean_token_accuracy": correct / tokens}
