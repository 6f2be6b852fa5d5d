"""The interface every training method implements; the trainer calls it and knows no method by name.

What a method decides: how examples become rows and rows become micro-batches (rows that belong together, such
as a preference pair, stay on one rank), the loss of a micro-batch with what it is normalised by and its
metrics, the evaluation metrics, an optional pass over the data before training (a reference model's
log-probabilities, say) and any state of its own that a checkpoint must carry. What the loop keeps for itself:
precision, the optimizer, gradient accumulation and synchronisation, clipping, checkpoints and the reporter.

What a method is, as data (its line format, its settings, rows per example, packing), is its entry in the
specification's table (fusetune/spec/methods.py), which `spec` returns.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from fusetune.spec.methods import METHODS, Method
from fusetune.tokenization.tokenizer import stop_token_ids
from fusetune.worker.train.config import TrainConfig
from fusetune.worker.train.data import LoadedData, rank_micro_batches, read_training_jsonl


class TrainingMethod(ABC):
    # The specification's `method.type` that selects this class (fusetune/spec/methods.py, `METHODS`).
    type: ClassVar[str]
    # What `eval_sums` returns, in order.
    eval_sum_names: ClassVar[tuple[str, ...]]

    @classmethod
    def spec(cls) -> Method:
        return METHODS[cls.type]

    @property
    def rows_per_example(self) -> int:
        return self.spec().rows_per_example

    @property
    def has_reference_pass(self) -> bool:
        return self.spec().has_reference_pass

    def read_examples(self, path: str) -> list[Any]:
        """A training or validation file's examples, parsed by the method's line format."""
        return read_training_jsonl(path, self.spec().example_format.parse)

    @functools.cached_property
    def stop_ids(self) -> frozenset[int]:
        """The tokens that end the model's generation, which the data check wants trained at every turn's end."""
        return stop_token_ids(self.tokenizer, self.config.model_path)

    # ----------------------------------------------------------------------------------------- training

    def __init__(self, config: TrainConfig, tokenizer: Any, pad_token_id: int) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.pad_token_id = pad_token_id
        # The training batches' padded length is a multiple of this: the trainer raises it when the model's
        # matmuls need it (float8's weight gradient takes the batch's token count as its inner dimension).
        self.length_multiple = 1

    @abstractmethod
    def load_data(self, path: str, packing: bool) -> LoadedData:
        """A training or validation file as rows (`LoadedData.sequences`), checked, tokenized, truncated."""

    def row_length(self, row: Any) -> int:
        """Tokens of one row, by which batches are grouped so that a micro-batch needs little padding."""
        return len(row.input_ids)

    def micro_batches(
        self, global_batch: Sequence[int], micro_batch_size: int, rank: int, world_size: int
    ) -> list[list[int]]:
        """This rank's micro-batches (lists of row indices) of a global batch. Every rank computes the same
        split, so a method whose rows come in groups keeps each group inside one micro-batch."""
        return rank_micro_batches(global_batch, micro_batch_size, rank, world_size)

    @abstractmethod
    def collate(self, rows: Sequence[Any], packed: bool) -> dict[str, torch.Tensor]:
        """Rows as CPU tensors: at least `input_ids` (its width is the padded length the MFU counts) and the
        0-dim `n_input_tokens` (non-padding tokens, for throughput). The trainer moves the others to the device;
        0-dim tensors stay on the CPU, so that reading them never waits for the device."""

    @abstractmethod
    def loss_normaliser(self, batch: dict[str, torch.Tensor]) -> int:
        """This micro-batch's part of what the step's loss is divided by (summed over the step's micro-batches
        and ranks); read from the batch's CPU tensors."""

    def before_training(self, trainer: Any) -> None:  # noqa: B027 - optional, does nothing by default
        """A pass before the first step (a frozen reference model's log-probabilities, for instance)."""

    def prepare_step(self, trainer: Any, micro_batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """This rank's micro-batches of the step as the loss takes them, made from those of its examples
        (reinforcement samples and grades completions of its prompts here); inside the step's time. The same
        micro-batches by default."""
        return micro_batches

    @property
    def eval_every_steps(self) -> int | None:
        """Steps between evaluations besides those at each epoch's end (the run's `eval_every_steps`)."""
        return self.config.eval_every_steps

    @abstractmethod
    def loss(
        self, model: torch.nn.Module, batch: dict[str, torch.Tensor], normaliser: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The micro-batch's share of the step's loss (its sum over the batch divided by the step's global
        `normaliser`), and its shares of further metrics. Device tensors: the trainer sums them over the step's
        micro-batches and ranks and reads them only when it reports them."""

    @abstractmethod
    def eval_sums(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """A float64 device tensor of sums over the batch (`eval_sum_names`), added up over all batches and
        ranks."""

    @abstractmethod
    def eval_metrics(self, sums: list[float]) -> dict[str, float]:
        """The evaluation metrics (names start with `valid_`) from the summed `eval_sums`."""

    def state_dict(self) -> dict[str, Any]:
        """State of the method's own that a checkpoint carries (none by default)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - stateless by default
        pass
