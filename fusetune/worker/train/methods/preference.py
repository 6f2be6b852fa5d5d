"""What the preference methods share: pairs of a preferred and a non-preferred output, scored per sequence.

A line of a training file is a preference pair in the OpenAI fine-tuning API's format (fusetune/spec/examples.py).
A pair is one row of the run: `batch_size` counts pairs, and a micro-batch holds whole pairs (its chosen
sequences, then its rejected ones), so the two sides of a pair are always on one rank and in one forward. Each
side is the input rendered through the chat template with its output; only the output's tokens are scored.

With fusetune's kernels applied the per-sequence log-probabilities come from the hidden states and the output
layer without the logits (`fusetune.kernels.sequence_log_probs`, through the patched forward); otherwise from
the model's logits.

A method whose table entry has a reference pass (DPO) has the frozen starting model score every pair once
before the first step (`before_training`): with LoRA the base model with the adapters switched off, otherwise
the model before its first update. Those reference log-probabilities are part of the method's state, so a
checkpoint carries them and a resumed run does not recompute them; no second model is ever held.

Each method states only its formula (`pair_losses`). A step's loss is the mean over its pairs on all ranks.
Metrics per step, means over the step's pairs: `reward_accuracy` (the chosen reward above the rejected),
`chosen_reward` and `rejected_reward` (each method's implicit reward of each side) and `reward_margin` (their
difference).
"""

from __future__ import annotations

import contextlib
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fusetune.kernels.sequence_log_probs import sequence_log_probs_from_logits
from fusetune.models.fused import has_fused_loss
from fusetune.tokenization.check import DataCheckFailure, checked_sequences, masking_for
from fusetune.worker.train.data import (
    IGNORE_INDEX,
    LoadedData,
    TokenizedSequence,
    TrainingDataError,
    collate,
    data_check_error,
    model_inputs,
    read_training_lines,
    shifted,
)
from fusetune.worker.train.distributed import all_reduce
from fusetune.worker.train.methods.base import TrainingMethod

METRIC_NAMES = ("reward_accuracy", "chosen_reward", "rejected_reward", "reward_margin")


@dataclass(frozen=True)
class PreferencePair:
    """One row of a preference run: the two sides of a pair, tokenized, and where the pair sits in its file."""

    split: str  # "train" or "valid": which reference log-probabilities belong to it
    index: int
    chosen: TokenizedSequence
    rejected: TokenizedSequence


@dataclass(frozen=True)
class PairScores:
    """A micro-batch's pairs, scored: float32 [pairs] tensors."""

    chosen: torch.Tensor  # summed log-probability of each preferred output under the policy
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor  # output tokens of each side
    rejected_tokens: torch.Tensor
    # [pairs, 2] (chosen, rejected) under the reference model, for a method with a reference pass.
    reference: torch.Tensor | None


class PreferenceMethod(TrainingMethod):
    eval_sum_names = ("loss", "pairs", *METRIC_NAMES)

    def __init__(self, config: Any, tokenizer: Any, pad_token_id: int) -> None:
        super().__init__(config, tokenizer, pad_token_id)
        self.settings = config.method.settings
        # Whether the model's forward is fusetune's fused one (decided in before_training).
        self.fused_forward = False
        # Per split, [pairs, 2] float32 log-probabilities of (chosen, rejected) under the reference model.
        self.reference: dict[str, torch.Tensor] = {}

    def row_length(self, row: PreferencePair) -> int:
        # Both sides are padded to the longer of the micro-batch's rows.
        return 2 * max(len(row.chosen.input_ids), len(row.rejected.input_ids))

    def load_data(self, path: str, packing: bool) -> LoadedData:
        if packing:
            raise TrainingDataError(
                f"packing is not available with the {self.type} method: a pair is one row"
            )
        examples = read_training_lines(path, self.spec().example_format.parse)
        split = "train" if path == self.config.training_file else "valid"
        max_length = self.config.max_seq_length
        pairs: list[PreferencePair] = []
        n_truncated = n_dropped = 0
        masking = masking_for(self.type)
        for line_number, example in examples:
            # Both sides checked as the API checks them; the input's own assistant turns are context, not trained.
            try:
                sides = checked_sequences(
                    masking, self.tokenizer, example, train_on_inputs=False, stop_ids=self.stop_ids
                )
            except DataCheckFailure as failure:
                raise data_check_error(self.tokenizer, failure, path, line_number) from None
            (chosen, chosen_length), (rejected, rejected_length) = (
                shifted(side.masked, max_length) for side in sides
            )
            n_truncated += max(chosen_length, rejected_length) > max_length
            if chosen.n_label_tokens == 0 or rejected.n_label_tokens == 0:
                n_dropped += 1
                continue
            pairs.append(PreferencePair(split, len(pairs), chosen, rejected))
        if not pairs:
            raise TrainingDataError(
                f"{Path(path).name}: no pair keeps an output token within max_seq_length={max_length}"
            )
        return LoadedData(pairs, len(examples), n_truncated, n_dropped)

    def collate(self, rows: Sequence[PreferencePair], packed: bool) -> dict[str, torch.Tensor]:
        batch = collate(
            [pair.chosen for pair in rows] + [pair.rejected for pair in rows],
            self.pad_token_id,
            packed=False,
            length_multiple=self.length_multiple,
        )
        batch["n_pairs"] = torch.tensor(len(rows))
        reference = self.reference.get(rows[0].split)
        if reference is not None:
            batch["reference_log_probs"] = reference[[pair.index for pair in rows]]
        return batch

    def loss_normaliser(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["n_pairs"])

    def sequence_log_probs(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Each row's summed log-probability of its output tokens, float32 [rows]: through the fused forward
        (no logits) when the kernels are applied, else from the logits."""
        labels = batch["shifted_labels"]
        inputs = model_inputs(batch)
        if self.fused_forward:
            output = model(
                **inputs, labels=labels, shift_labels=labels, sequence_log_probs=True, use_cache=False
            )
            return output.loss
        return sequence_log_probs_from_logits(model(**inputs, use_cache=False).logits, labels)

    def before_training(self, trainer: Any) -> None:
        """Whether the fused forward scores the sequences; then, for a method with a reference pass, every pair
        of the training and validation files scored once by the frozen starting model, split over the ranks,
        unless a resumed checkpoint brought the scores."""
        self.fused_forward = trainer.kernels_applied and has_fused_loss(trainer.model)
        if not self.has_reference_pass:
            return
        splits = {"train": trainer.train_data, "valid": trainer.valid_data}
        for split, data in splits.items():
            if data is not None and split not in self.reference:
                self.reference[split] = self._reference_log_probs(trainer, data.sequences)
        trainer.reporter.event(
            "Reference log-probabilities of "
            + ", ".join(f"{len(self.reference[s])} {s} pairs" for s in splits if s in self.reference)
            + " ready",
            data={"event": "reference_ready", **{f"{s}_pairs": len(v) for s, v in self.reference.items()}},
        )

    def _reference_log_probs(self, trainer: Any, pairs: Sequence[PreferencePair]) -> torch.Tensor:
        model, dist = trainer.model, trainer.dist
        size = trainer.micro_batch_size
        chunks = [list(range(i, min(i + size, len(pairs)))) for i in range(0, len(pairs), size)]
        mine = chunks[dist.rank :: dist.world_size]
        # Under FSDP every rank runs as many forwards as the others (parameters are gathered in each).
        n_forwards = -(-len(chunks) // dist.world_size) if trainer.fsdp else len(mine)
        scores = torch.zeros(len(pairs), 2, dtype=torch.float32, device=trainer.device)
        adapters_off = model.disable_adapter() if self.config.lora is not None else contextlib.nullcontext()
        model.eval()
        with torch.no_grad(), adapters_off:
            for index in range(n_forwards):
                chunk = mine[index] if index < len(mine) else chunks[0]
                batch = trainer._batch([pairs[i] for i in chunk], False)
                with trainer._autocast():
                    log_probs = self.sequence_log_probs(model, batch).float()
                if index < len(mine):
                    scores[chunk] = log_probs.view(2, -1).T
        model.train()
        return all_reduce(scores).cpu()

    @abstractmethod
    def pair_losses(self, scores: PairScores) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per pair: the loss, and the chosen and rejected rewards (detached), each float32 [pairs]."""

    def sft_term(self, scores: PairScores, weight: float) -> torch.Tensor:
        """`weight` times the preferred output's mean token negative log-likelihood, per pair (0: none)."""
        return -weight * scores.chosen / scores.chosen_tokens if weight else scores.chosen.new_zeros(())

    def _pair_terms(
        self, model: torch.nn.Module, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.has_reference_pass and "reference_log_probs" not in batch:
            raise RuntimeError(f"the {self.type} method needs its reference pass (before_training) first")
        n_pairs = int(batch["n_pairs"])
        policy = self.sequence_log_probs(model, batch).float()
        tokens = (batch["shifted_labels"] != IGNORE_INDEX).sum(-1).clamp(min=1).float()
        reference = batch.get("reference_log_probs")
        scores = PairScores(
            policy[:n_pairs], policy[n_pairs:], tokens[:n_pairs], tokens[n_pairs:],
            reference.float() if reference is not None else None,
        )  # fmt: skip
        return self.pair_losses(scores)

    def loss(
        self, model: torch.nn.Module, batch: dict[str, torch.Tensor], normaliser: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        losses, chosen_reward, rejected_reward = self._pair_terms(model, batch)
        normaliser = normaliser.to(losses.device).float()
        metrics = {
            "reward_accuracy": (chosen_reward > rejected_reward).float().sum() / normaliser,
            "chosen_reward": chosen_reward.sum() / normaliser,
            "rejected_reward": rejected_reward.sum() / normaliser,
            "reward_margin": (chosen_reward - rejected_reward).sum() / normaliser,
        }
        return losses.sum() / normaliser, metrics

    def eval_sums(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        losses, chosen_reward, rejected_reward = self._pair_terms(model, batch)
        return torch.stack(
            [
                losses.sum(),
                torch.tensor(float(losses.numel()), device=losses.device),
                (chosen_reward > rejected_reward).float().sum(),
                chosen_reward.sum(),
                rejected_reward.sum(),
                (chosen_reward - rejected_reward).sum(),
            ]
        ).double()

    def eval_metrics(self, sums: list[float]) -> dict[str, float]:
        loss, pairs, *metrics = sums
        return {
            "valid_loss": loss / pairs,
            **{f"valid_{n}": v / pairs for n, v in zip(METRIC_NAMES, metrics, strict=True)},
        }

    def state_dict(self) -> dict[str, Any]:
        return {"reference_log_probs": dict(self.reference)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reference = dict(state.get("reference_log_probs", {}))
