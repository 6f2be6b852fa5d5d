"""The trainer's side of checkpoints: write one (weights, tokenizer, every part's training state), publish it to
the object store, record it in SQL, prune the old ones; and read the optimizer's state back on resume."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from fusetune.worker.train import lora
from fusetune.worker.train.checkpoints import layout, state
from fusetune.worker.train.checkpoints.store import publish_checkpoint
from fusetune.worker.train.config import TrainConfig
from fusetune.worker.train.distributed import DistInfo, all_gather_object, barrier
from fusetune.worker.train.reporter import Reporter

# Gathered state dicts: whole tensors, on the CPU, on rank 0 only (other ranks get empty dicts).
FULL_STATE_ON_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)
# Loading: every rank reads the whole optimizer state and keeps its part (its shard under FSDP).
FULL_STATE_ON_EVERY_RANK = StateDictOptions(full_state_dict=True)


class Checkpointer:
    """Writes a run's checkpoints (weights, tokenizer, the optimizer's and every other part's state), publishes,
    reports and prunes them, and reads the optimizer's state back."""

    def __init__(self, config: TrainConfig, dist_info: DistInfo, reporter: Reporter) -> None:
        self.config = config
        self.dist = dist_info
        self.reporter = reporter
        # A checkpoint pruning leaves alone whatever keep_last_checkpoints says (early stopping's best).
        self.keep: Path | None = None

    def reported_path(self, path: Path) -> str:
        base = self.config.checkpoint_paths_relative_to
        return os.path.relpath(path, base) if base else str(path)

    def save(
        self,
        step: int,
        epoch: float,
        metrics: dict[str, float],
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        tokenizer: Any,
        training_state: Callable[[list[dict[str, Any]]], dict[str, Any]],
    ) -> Path:
        """Collective (every rank calls it); `training_state(every rank's RNG states)` is resume.pt's content.
        Returns the checkpoint's folder."""
        config = self.config
        # Adapter-only checkpoints gather only the trained parameters; merged weights need the frozen ones too.
        adapter_only = config.lora is not None and not config.merge_lora_on_save
        model_state = get_model_state_dict(
            model,
            options=StateDictOptions(
                full_state_dict=True, cpu_offload=True, ignore_frozen_params=adapter_only
            ),
        )
        optimizer_state = get_optimizer_state_dict(model, optimizer, options=FULL_STATE_ON_RANK0)
        rng_states = all_gather_object(state.capture_rng_state(self.dist.device))
        path = layout.checkpoint_path(config.output_dir, step)
        if self.dist.is_main:
            with layout.staged_checkpoint(config.output_dir, step) as staging:
                self._write_weights(model, staging, model_state)
                tokenizer.save_pretrained(staging)
                layout.write_trainer_state(staging, step, epoch, metrics)
                state.write_training_state(staging, optimizer_state, training_state(rng_states))
            reported_path = self.reported_path(path)
            publish_checkpoint(path, reported_path)  # to the object store, if any, before SQL records it
            self.reporter.checkpoint(step, reported_path, metrics)
            self.reporter.event(
                f"Saved checkpoint at step {step}",
                data={"event": "checkpoint_saved", "step": step, "path": reported_path},
            )
            self._prune()
        barrier()
        return path

    def _write_weights(self, model: torch.nn.Module, directory: Path, model_state: dict[str, Any]) -> None:
        if self.config.lora is None:
            model.save_pretrained(directory, state_dict=without_tied_copies(model, model_state))
        elif self.config.merge_lora_on_save:
            lora.save_merged(model, model_state, directory)
            lora.save_adapter(model, model_state, directory / layout.ADAPTER_DIRNAME)
        else:
            lora.save_adapter(model, model_state, directory)

    def _prune(self) -> None:
        """Keep the newest `keep_last_checkpoints`; the reporter forgets the others before their files go, so
        the API never lists a checkpoint whose folder is gone (the worker removes their objects from the store
        after the run, see store.remove_unrecorded_checkpoints)."""
        stale = layout.stale_checkpoints(self.config.output_dir, self.config.keep_last_checkpoints)
        stale = [path for path in stale if path != self.keep]
        if stale:
            self.reporter.checkpoints_deleted([self.reported_path(path) for path in stale])
        for path in stale:
            layout.delete_checkpoint(path)

    def restore_optimizer(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint: Path
    ) -> None:
        # An optimizer that can make its state without a step (the fused ones) does, so that the loader below
        # does not step it on zero gradients of every parameter at once: a plan that fits the GPU only with the
        # gradients freed in the backward (or the state in host memory) has no room for them.
        initialize_state = getattr(optimizer, "initialize_state", None)
        if initialize_state is not None:
            initialize_state()
        set_optimizer_state_dict(
            model, optimizer, state.read_optimizer_state(checkpoint), options=FULL_STATE_ON_EVERY_RANK
        )


def without_tied_copies(model: torch.nn.Module, model_state: dict[str, Any]) -> dict[str, Any]:
    """`model_state` without the second name of a tied parameter (a tied lm_head's weight).

    A full state dict offloaded to the CPU holds a separate copy under each name of a shared parameter, and not
    every transformers version drops the tied one on save; kept, it adds the whole embedding table (0.5 GB at
    the Llama-3.2-1B shape) to every checkpoint. Loading re-ties it from the config, as for any checkpoint.
    """
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    copies = {alias for aliases in names.values() for alias in aliases[1:]}
    return {key: value for key, value in model_state.items() if key not in copies}
