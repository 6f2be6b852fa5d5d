"""Direct preference optimisation (DPO, and IPO's loss) on pairs of a preferred and a non-preferred output.

A line of a training file, as in the OpenAI fine-tuning API:
`{"input": {"messages": [...]}, "preferred_output": [{"role": "assistant", "content": ...}],
"non_preferred_output": [{"role": "assistant", "content": ...}]}`. The input's last message is not the
assistant's (the outputs answer it); each output is exactly one assistant message; the two differ.

A pair is one row of the run: `batch_size` counts pairs, and a micro-batch holds whole pairs (its chosen
sequences, then its rejected ones), so the two sides of a pair are always on one rank and in one forward. Each
side is the input rendered through the chat template with its output; only the output's tokens are scored.

Before the first step the frozen starting model scores every pair once (`before_training`): with LoRA the base
model with the adapters switched off, otherwise the model before its first update. Those reference
log-probabilities are part of the method's state, so a checkpoint carries them and a resumed run does not
recompute them; no second model is ever held. With fusetune's kernels applied the per-sequence log-probabilities
come from the hidden states and the output layer without the logits (`fusetune.kernels.sequence_log_probs`,
through the patched forward); otherwise from the model's logits.

Losses, with h = (log p(chosen) - log ref(chosen)) - (log p(rejected) - log ref(rejected)):
- "sigmoid" (DPO): -log sigmoid(beta * h).
- "ipo": (h' - 1 / (2 beta))^2, where h' takes each side's log-probabilities divided by its token count.
plus `sft_weight` times the preferred output's mean token negative log-likelihood. A step's loss is the mean
over its pairs on all ranks. Metrics per step, means over the step's pairs: `reward_accuracy` (the chosen
reward above the rejected), `chosen_reward` and `rejected_reward` (beta times each side's log-ratio) and
`reward_margin` (their difference).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fusetune.worker.train.methods.base import TrainingMethod
from fusetune.worker.train.methods.sft import check_messages

if TYPE_CHECKING:
    import torch

    from fusetune.worker.train.data import LoadedData, TokenizedSequence

OUTPUT_KEYS = ("preferred_output", "non_preferred_output")
METRIC_NAMES = ("reward_accuracy", "chosen_reward", "rejected_reward", "reward_margin")


@dataclass(frozen=True)
class PreferenceExample:
    messages: list[dict[str, Any]]  # the input, ending before the assistant's answer
    preferred: dict[str, Any]
    non_preferred: dict[str, Any]


def _output_message(record: dict[str, Any], key: str) -> dict[str, Any]:
    output = record[key]
    if not isinstance(output, list) or len(output) != 1:
        count = len(output) if isinstance(output, list) else "not a list"
        raise ValueError(f"'{key}' must be a list of exactly one assistant message (got {count})")
    message = output[0]
    if not isinstance(message, dict) or message.get("role") != "assistant":
        role = message.get("role") if isinstance(message, dict) else None
        raise ValueError(f"'{key}' must hold an assistant message (got role {json.dumps(role)})")
    if not isinstance(message.get("content"), str) or not message["content"]:
        raise ValueError(f"'{key}'[0].content must be a non-empty string")
    return {"role": "assistant", "content": message["content"]}


def parse_preference_example(record: Any) -> PreferenceExample:
    """One JSONL record as a preference pair; raises ValueError saying what is wrong with it."""
    if not isinstance(record, dict):
        raise ValueError("expected a JSON object with 'input', 'preferred_output' and 'non_preferred_output'")
    missing = [key for key in ("input", *OUTPUT_KEYS) if key not in record]
    if missing:
        raise ValueError(f"a preference example needs {', '.join(repr(key) for key in missing)}")
    if not isinstance(record["input"], dict) or "messages" not in record["input"]:
        raise ValueError("'input' must be an object with 'messages'")
    messages = record["input"]["messages"]
    problem = check_messages(messages, needs_assistant=False)
    if problem:
        raise ValueError("input." + problem.replace("'messages'", "messages", 1))
    if messages[-1]["role"] == "assistant":
        raise ValueError("the last input message must not be the assistant's: the outputs answer it")
    preferred, non_preferred = (_output_message(record, key) for key in OUTPUT_KEYS)
    if preferred["content"] == non_preferred["content"]:
        raise ValueError("'preferred_output' and 'non_preferred_output' are the same; a preference needs two")
    return PreferenceExample(messages, preferred, non_preferred)


@dataclass(frozen=True)
class PreferencePair:
    """One row of a DPO run: the two sides of a pair, tokenized, and where the pair sits in its file."""

    split: str  # "train" or "valid": which reference log-probabilities belong to it
    index: int
    chosen: TokenizedSequence
    rejected: TokenizedSequence


class DirectPreferenceOptimization(TrainingMethod):
    type = "dpo"
    eval_sum_names = ("loss", "pairs", *METRIC_NAMES)
    rows_per_example = 2
    supports_packing = False
    has_reference_pass = True

    def row_length(self, row: PreferencePair) -> int:
        # Both sides are padded to the longer of the micro-batch's rows.
        return 2 * max(len(row.chosen.input_ids), len(row.rejected.input_ids))

    @classmethod
    def recognizes(cls, record: Any) -> bool:
        return isinstance(record, dict) and any(key in record for key in ("input", *OUTPUT_KEYS))

    @classmethod
    def parse_example(cls, record: Any) -> PreferenceExample:
        return parse_preference_example(record)

    @classmethod
    def example_characters(cls, example: PreferenceExample) -> int:
        prompt = sum(len(message.get("content") or "") for message in example.messages)
        # Both sides are trained on, each with the whole input.
        return 2 * prompt + len(example.preferred["content"]) + len(example.non_preferred["content"])

    # ----------------------------------------------------------------------------------------- training

    def __init__(self, config: Any, tokenizer: Any, pad_token_id: int) -> None:
        super().__init__(config, tokenizer, pad_token_id)
        from fusetune.jobspec import DpoSpec

        self.settings = config.method.dpo or DpoSpec()
        # Whether the model's forward is fusetune's fused one (decided in before_training).
        self.fused_forward = False
        # Per split, [pairs, 2] float32 log-probabilities of (chosen, rejected) under the reference model.
        self.reference: dict[str, torch.Tensor] = {}

    def load_data(self, path: str, packing: bool) -> LoadedData:
        from fusetune.worker.train.data import (
            LoadedData,
            TrainingDataError,
            read_training_jsonl,
            tokenize_conversation,
        )

        if packing:
            raise TrainingDataError("packing is not available with the dpo method: a pair is one row")
        examples = read_training_jsonl(path, self.parse_example)
        split = "train" if path == self.config.training_file else "valid"
        max_length = self.config.max_seq_length
        pairs: list[PreferencePair] = []
        n_truncated = n_dropped = 0
        for line_index, example in enumerate(examples):
            # Earlier assistant turns of the input are context, not trained.
            prompt = [
                {**message, "weight": 0} if message["role"] == "assistant" else message
                for message in example.messages
            ]
            try:
                chosen, chosen_length = tokenize_conversation(
                    self.tokenizer, [*prompt, example.preferred], max_length
                )
                rejected, rejected_length = tokenize_conversation(
                    self.tokenizer, [*prompt, example.non_preferred], max_length
                )
            except TrainingDataError as exc:
                raise TrainingDataError(
                    f"{Path(path).name}, example {line_index + 1}: {exc.message}"
                ) from exc
            except Exception as exc:  # a template may raise on content it does not accept
                raise TrainingDataError(
                    f"{Path(path).name}, example {line_index + 1}: the chat template failed: {exc}"
                ) from exc
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
        import torch

        from fusetune.worker.train.data import collate

        batch = collate(
            [pair.chosen for pair in rows] + [pair.rejected for pair in rows], self.pad_token_id, packed=False
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
        from fusetune.kernels.sequence_log_probs import sequence_log_probs_from_logits

        labels = batch["shifted_labels"]
        from fusetune.worker.train.data import model_inputs

        inputs = model_inputs(batch)
        if self.fused_forward:
            output = model(
                **inputs, labels=labels, shift_labels=labels, sequence_log_probs=True, use_cache=False
            )
            return output.loss
        return sequence_log_probs_from_logits(model(**inputs, use_cache=False).logits, labels)

    def before_training(self, trainer: Any) -> None:
        """The reference pass: every pair of the training and validation files scored once by the frozen
        starting model, split over the ranks, unless a resumed checkpoint brought the scores."""
        from fusetune.models.fused import has_fused_loss

        self.fused_forward = trainer.kernels_applied and has_fused_loss(trainer.model)
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
        import contextlib

        import torch

        from fusetune.worker.train.distributed import all_reduce

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

    def _pair_terms(
        self, model: torch.nn.Module, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per pair: the loss, the chosen and rejected rewards, and the preferred side's log-probability."""
        import torch.nn.functional as F

        from fusetune.worker.train.data import IGNORE_INDEX

        if "reference_log_probs" not in batch:
            raise RuntimeError("the dpo method needs its reference pass (before_training) first")
        n_pairs = int(batch["n_pairs"])
        policy = self.sequence_log_probs(model, batch).float()
        chosen, rejected = policy[:n_pairs], policy[n_pairs:]
        reference = batch["reference_log_probs"].float()
        chosen_ratio, rejected_ratio = chosen - reference[:, 0], rejected - reference[:, 1]
        beta = self.settings.beta
        tokens = (batch["shifted_labels"] != IGNORE_INDEX).sum(-1).clamp(min=1).float()
        if self.settings.loss_type == "ipo":
            margin = chosen_ratio / tokens[:n_pairs] - rejected_ratio / tokens[n_pairs:]
            losses = (margin - 1 / (2 * beta)) ** 2
        else:
            losses = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
        if self.settings.sft_weight:
            losses = losses - self.settings.sft_weight * chosen / tokens[:n_pairs]
        return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach(), chosen.detach()

    def loss(
        self, model: torch.nn.Module, batch: dict[str, torch.Tensor], normaliser: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        losses, chosen_reward, rejected_reward, _ = self._pair_terms(model, batch)
        normaliser = normaliser.to(losses.device).float()
        metrics = {
            "reward_accuracy": (chosen_reward > rejected_reward).float().sum() / normaliser,
            "chosen_reward": chosen_reward.sum() / normaliser,
            "rejected_reward": rejected_reward.sum() / normaliser,
            "reward_margin": (chosen_reward - rejected_reward).sum() / normaliser,
        }
        return losses.sum() / normaliser, metrics

    def eval_sums(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        import torch

        losses, chosen_reward, rejected_reward, _ = self._pair_terms(model, batch)
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
