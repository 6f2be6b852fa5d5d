"""The training loop: the same code for one process or N under torchrun (DDP or FSDP2), full weights or LoRA.

`train()` runs epochs of `train_step()`s; a step runs one `forward_backward_step()` per micro-batch of this
rank, then clips, checks the loss and gradient are finite and steps AdamW. The loss of every micro-batch is its
sum of token losses divided by the number of trained tokens in the whole step on all ranks, so any split of a
global batch over micro-batches and processes gives the same gradient.

Checkpoints carry the training state (optimizer, scheduler, data position, RNG states, token count), and a
trainer started on an output_dir that holds one continues from the newest: the same loss curve, step for step,
as a run that was never interrupted. After every step the trainer asks the reporter whether the job was
paused (checkpoint, then exit) or cancelled (exit at once); all ranks act on the same answer.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import traceback
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.nn.parallel import DistributedDataParallel

from fusetune.worker.train import checkpoint as ckpt
from fusetune.worker.train import lora
from fusetune.worker.train.checkpoint_store import publish_checkpoint
from fusetune.worker.train.config import TrainConfig
from fusetune.worker.train.data import (
    IGNORE_INDEX,
    LoadedData,
    TokenizedSequence,
    collate,
    epoch_order,
    load_sequences,
    rank_micro_batches,
)
from fusetune.worker.train.distributed import (
    DistInfo,
    all_gather_object,
    all_reduce,
    barrier,
    broadcast_object,
    init_distributed,
    shard_fsdp,
    shutdown,
    synchronize,
    wrap_ddp,
)
from fusetune.worker.train.metrics import (
    peak_bf16_flops,
    peak_memory_bytes,
    reset_peak_memory,
    training_flops_per_token,
)
from fusetune.worker.train.outcome import (
    ERROR_FILENAME,
    EXIT_FAILED,
    EXIT_STOPPED,
    OUT_OF_MEMORY_HINT,
    OUTCOME_FILENAMES,
    ErrorCode,
    JobStopped,
    TrainingFailure,
    TrainResult,
    write_error,
    write_result,
    write_stopped,
)
from fusetune.worker.train.reporter import Reporter, StopRequest, make_reporter

# How long ranks other than 0 wait, after a known failure, for rank 0 to write error.json before they exit:
# torchrun tears down the whole group as soon as one process exits with an error.
ERROR_FILE_WAIT_S = 10.0
ETA_WINDOW_STEPS = 20


def resolve_precision(precision: str, device: torch.device) -> str:
    if precision == "auto":
        return "bf16-mixed" if device.type == "cuda" else "fp32"
    if precision != "fp32" and device.type != "cuda":
        raise TrainingFailure(
            ErrorCode.TRAINER_ERROR, f"precision {precision!r} needs a GPU; use 'fp32' on CPU"
        )
    return precision


def lr_factor(step: int, warmup_steps: int, total_steps: int, schedule: str) -> float:
    """Multiplier of the peak learning rate for optimizer step `step` (0-based): a linear warmup that reaches
    the peak at the last warmup step, then a cosine or linear decay towards zero over the remaining steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0 - progress


def _model_not_found(model_path: str, what: str, exc: Exception) -> TrainingFailure:
    if Path(model_path).exists():
        detail = " ".join(str(exc).split())[:500] or type(exc).__name__
        message = f"could not load a {what} from model path '{model_path}': {detail}"
    else:
        message = (
            f"model path '{model_path}' is neither a local directory nor a model in the local Hugging Face "
            "cache"
        )
    return TrainingFailure(ErrorCode.MODEL_NOT_FOUND, message)


def load_tokenizer(model_path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise _model_not_found(model_path, "tokenizer", exc) from exc


def load_model(model_path: str, dtype: torch.dtype) -> torch.nn.Module:
    """A causal LM from a model folder, a model in the local cache, or a LoRA checkpoint (merged into the base
    model it names)."""
    from transformers import AutoModelForCausalLM

    try:
        if lora.is_adapter_checkpoint(model_path):
            return lora.load_merged_adapter_model(model_path, dtype)
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise _model_not_found(model_path, "causal LM", exc) from exc


@dataclass(frozen=True)
class StepStats:
    train_loss: float
    grad_norm: float
    learning_rate: float
    n_input_tokens: int  # all ranks, padding excluded
    n_trained_tokens: int  # all ranks, tokens with a label
    mean_padded_length: float


# Gathered state dicts: whole tensors, on the CPU, on rank 0 only (other ranks get empty dicts).
FULL_STATE_ON_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)
# Loading: every rank reads the whole optimizer state and keeps its part (its shard under FSDP).
FULL_STATE_ON_EVERY_RANK = StateDictOptions(full_state_dict=True)
_STOP_CODES = {None: 0, StopRequest.PAUSE: 1, StopRequest.CANCEL: 2}  # all ranks take the largest


class Trainer:
    """One rank of a training run.

    The setup steps that touch the outside world (`_load_tokenizer`, `_load_data`, `_load_model`) are methods
    so that a benchmark can feed synthetic data or a randomly initialised model through the same loop.
    """

    def __init__(self, config: TrainConfig, dist_info: DistInfo, reporter: Reporter) -> None:
        self.config = config
        self.dist = dist_info
        self.device = dist_info.device
        self.reporter = reporter
        self.precision = resolve_precision(config.precision, self.device)
        self.fsdp = config.distributed == "fsdp" and dist_info.world_size > 1
        try:
            self.micro_batch_size, self.grad_accum_steps = config.micro_batches_per_rank(dist_info.world_size)
        except ValueError as exc:
            raise TrainingFailure(ErrorCode.TRAINER_ERROR, str(exc)) from exc
        torch.manual_seed(config.seed)

        resume_from = None
        if dist_info.is_main:
            ckpt.remove_incomplete(config.output_dir)
            resume_from = ckpt.latest_resumable(config.output_dir) if config.resume else None
        # Every rank must resume from the same checkpoint, whatever each sees of a shared folder.
        self.resume_from: tuple[int, Path] | None = broadcast_object(resume_from)

        self.tokenizer = self._load_tokenizer()
        self.pad_token_id = next(
            (t for t in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id) if t is not None), 0
        )
        self.train_data = self._load_data(config.training_file, packing=config.packing)
        self.valid_data = (
            self._load_data(config.validation_file, packing=False) if config.validation_file else None
        )
        # Checked before the model loads, so that a run that cannot resume fails fast.
        resume_state = ckpt.read_resume_state(self.resume_from[1]) if self.resume_from is not None else None
        if resume_state is not None:
            self._check_resumable(resume_state, self.resume_from[1])

        weights_dtype = torch.bfloat16 if self.precision == "bf16" else torch.float32
        resumed_weights = self.resume_from is not None and config.lora is None
        self.model = self._load_model(
            str(self.resume_from[1]) if resumed_weights else config.model_path, weights_dtype
        )
        self.model.config.use_cache = False
        if config.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if config.lora is not None:
            self.model = lora.apply_lora(self.model, config.lora)
            if self.resume_from is not None:
                lora.load_adapter_weights(self.model, ckpt.adapter_dir(self.resume_from[1]))
        self.kernels_applied = self._apply_kernels()
        self.model.train()
        self.train_model = self._parallelize()

        self.steps_per_epoch = math.ceil(len(self.train_data.sequences) / config.batch_size)
        self.total_steps = self.steps_per_epoch * config.n_epochs
        if config.max_steps is not None:
            self.total_steps = min(self.total_steps, config.max_steps)
        self.warmup_steps = math.ceil(config.warmup_ratio * self.total_steps)
        self.optimizer = self._build_optimizer()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: lr_factor(step, self.warmup_steps, self.total_steps, config.lr_scheduler),
        )

        self.step = 0
        self.position = (0, 0)  # (epoch, global batch within its shuffled order) of the next step
        self.trained_tokens = 0
        self.last_train_loss = float("nan")
        self.last_checkpoint: Path | None = None
        self.last_checkpoint_step: int | None = None
        self._recent_step_times: deque[float] = deque(maxlen=ETA_WINDOW_STEPS)
        self._peak_flops = (
            peak_bf16_flops(torch.cuda.get_device_name(self.device)) if self.device.type == "cuda" else None
        )
        if resume_state is not None:
            self._restore_training_state(resume_state, self.resume_from[1])

    # ----------------------------------------------------------------------------------------------- setup

    def _load_tokenizer(self):
        return load_tokenizer(self.config.model_path)

    def _load_model(self, path: str, dtype: torch.dtype) -> torch.nn.Module:
        return load_model(path, dtype)

    def _load_data(self, path: str, packing: bool) -> LoadedData:
        data = load_sequences(
            path,
            self.tokenizer,
            self.config.max_seq_length,
            train_on_inputs=self.config.train_on_inputs,
            packing=packing,
        )
        if data.n_truncated or data.n_dropped:
            self.reporter.event(
                f"{Path(path).name}: {data.n_truncated} of {data.n_examples} examples were cut to "
                f"max_seq_length={self.config.max_seq_length}; {data.n_dropped} were left out because no "
                "trained token remained",
                level="warning",
                data={"event": "data", "n_truncated": data.n_truncated, "n_dropped": data.n_dropped},
            )
        return data

    def _apply_kernels(self) -> bool:
        if not self.config.kernels:
            return False
        if self.device.type != "cuda":
            self.reporter.event(
                "Fused kernels need a GPU; training on CPU runs the model unpatched",
                data={"event": "kernels", "applied": False},
            )
            return False
        try:
            from fusetune.models import apply_fusetune  # type: ignore[attr-defined]
        except ImportError:
            self.reporter.event(
                "Fused kernels are not available in this build; training runs unpatched",
                level="warning",
                data={"event": "kernels", "applied": False},
            )
            return False
        # strict=False: a family without fused kernels trains unpatched instead of failing the job. A PEFT
        # model is patched through to its base model, the LoRA layers inside the patched modules kept.
        handle = apply_fusetune(self.model, strict=False)
        model_type = getattr(self.model.config, "model_type", "?")
        if not handle.active:
            self.reporter.event(
                f"No fused kernels for model type '{model_type}'; training runs unpatched",
                level="warning",
                data={"event": "kernels", "applied": False},
            )
            return False
        self.reporter.event(
            f"Fused kernels applied to '{model_type}': {', '.join(sorted(handle.patched))}",
            data={"event": "kernels", "applied": True, "patched": dict(handle.patched)},
        )
        return True

    def _parallelize(self) -> torch.nn.Module:
        """The module the training forward goes through: the model itself, its DDP wrapper, or the model
        sharded in place by FSDP2 (whose parameters stay on the CPU until sharded, so a model too large for
        one GPU never lands on one whole)."""
        if self.fsdp:
            try:
                return shard_fsdp(self.model, self.device, mixed_bf16=self.precision == "bf16-mixed")
            except ValueError as exc:
                raise TrainingFailure(ErrorCode.TRAINER_ERROR, f"cannot shard the model: {exc}") from exc
        self.model.to(self.device)
        if self.dist.world_size > 1:
            return wrap_ddp(self.model, self.device, self.config.ddp_bucket_cap_mb)
        return self.model

    def _trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _build_optimizer(self) -> torch.optim.Optimizer:
        # No weight decay on biases and norm weights (1-D), as is usual for transformers.
        trainable = self._trainable_parameters()
        groups = [
            {"params": [p for p in trainable if p.ndim >= 2], "weight_decay": self.config.weight_decay},
            {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(
            [group for group in groups if group["params"]],
            lr=self.config.learning_rate,
            fused=self.device.type == "cuda",
        )

    def _autocast(self):
        # Under FSDP the mixed-precision policy casts the gathered parameters to bf16 instead.
        if self.precision == "bf16-mixed" and not self.fsdp:
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _gradient_sync(self, enabled: bool):
        """Reduce gradients over ranks after this micro-batch's backward (the step's last) or keep
        accumulating them locally."""
        if self.fsdp:
            self.model.set_requires_gradient_sync(enabled)
        elif isinstance(self.train_model, DistributedDataParallel) and not enabled:
            return self.train_model.no_sync()
        return contextlib.nullcontext()

    def _batch(self, rows: list[TokenizedSequence], packed: bool) -> dict[str, torch.Tensor]:
        batch = collate(rows, self.pad_token_id, packed=packed)
        # The token counts stay on the CPU so that reading them never waits for the GPU.
        return {
            key: value if value.ndim == 0 else value.to(self.device, non_blocking=True)
            for key, value in batch.items()
        }

    # ------------------------------------------------------------------------------------------- training

    def forward_backward_step(self, batch: dict[str, torch.Tensor], n_trained_tokens_global: torch.Tensor):
        """Forward and backward of one micro-batch; returns its share of the step's mean loss (detached)."""
        model_inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
        with self._autocast():
            outputs = self.train_model(
                **model_inputs,
                labels=batch["shifted_labels"],
                shift_labels=batch["shifted_labels"],
                num_items_in_batch=n_trained_tokens_global,
                use_cache=False,
            )
        loss = outputs.loss
        # DDP and FSDP average gradients over ranks; scaling by the world size turns that average into the
        # sum that the global token count normalises.
        (loss * self.dist.world_size).backward()
        return loss.detach()

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> StepStats:
        counts = torch.tensor(
            [
                sum(int(mb["n_trained_tokens"]) for mb in micro_batches),
                sum(int(mb["n_input_tokens"]) for mb in micro_batches),
            ],
            dtype=torch.long,
            device=self.device,
        )
        all_reduce(counts)
        n_trained_global, n_input_global = counts[0], counts[1]

        loss_share = torch.zeros((), dtype=torch.float32, device=self.device)
        for index, batch in enumerate(micro_batches):
            # Gradients are reduced over ranks once per step, after the last micro-batch.
            with self._gradient_sync(enabled=index == len(micro_batches) - 1):
                loss_share += self.forward_backward_step(batch, n_trained_global)
        train_loss = float(all_reduce(loss_share))
        step_number = self.step + 1
        if not math.isfinite(train_loss):
            raise TrainingFailure(
                ErrorCode.NON_FINITE_LOSS, f"the training loss is {train_loss} at step {step_number}"
            )
        max_norm = self.config.max_grad_norm or float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self._trainable_parameters(), max_norm)
        if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP
            grad_norm = grad_norm.full_tensor()
        grad_norm = float(grad_norm)
        if not math.isfinite(grad_norm):
            raise TrainingFailure(
                ErrorCode.NON_FINITE_LOSS, f"the gradient norm is {grad_norm} at step {step_number}"
            )
        learning_rate = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        padded = sum(mb["input_ids"].shape[1] for mb in micro_batches) / len(micro_batches)
        return StepStats(
            train_loss=train_loss,
            grad_norm=grad_norm,
            learning_rate=learning_rate,
            n_input_tokens=int(n_input_global),
            n_trained_tokens=int(n_trained_global),
            mean_padded_length=padded,
        )

    def train(self) -> TrainResult:
        config = self.config
        self._report_start()
        start_epoch, start_batch = self.position
        for epoch in range(start_epoch, config.n_epochs):
            order = epoch_order(
                len(self.train_data.sequences), self.steps_per_epoch, config.batch_size, config.seed, epoch
            )
            first_batch = start_batch if epoch == start_epoch else 0
            for batch_index in range(first_batch, self.steps_per_epoch):
                if self.step >= self.total_steps:
                    break
                global_batch = order[batch_index * config.batch_size : (batch_index + 1) * config.batch_size]
                rows = self.train_data.sequences
                micro_batches = [
                    self._batch([rows[i] for i in chunk], packed=config.packing)
                    for chunk in rank_micro_batches(
                        global_batch, self.micro_batch_size, self.dist.rank, self.dist.world_size
                    )
                ]
                started = time.perf_counter()
                stats = self.train_step(micro_batches)
                synchronize(self.device)  # the step time covers the optimizer step the GPU may still run
                step_time = time.perf_counter() - started
                self.step += 1
                self.trained_tokens += stats.n_input_tokens
                self.last_train_loss = stats.train_loss
                epoch_done = batch_index == self.steps_per_epoch - 1
                self.position = (epoch + 1, 0) if epoch_done else (epoch, batch_index + 1)
                self._after_step(stats, step_time, epoch_done=epoch_done)
            else:
                self.reporter.event(
                    f"Epoch {epoch + 1}/{config.n_epochs} done at step {self.step}",
                    data={
                        "event": "epoch_done",
                        "epoch": epoch + 1,
                        "step": self.step,
                        "train_loss": self.last_train_loss,
                    },
                )
                continue
            break  # max_steps reached inside the epoch

        if self.last_checkpoint_step != self.step:
            self._save_checkpoint({"train_loss": self.last_train_loss})
        assert self.last_checkpoint is not None
        result = TrainResult(
            trained_tokens=self.trained_tokens,
            final_checkpoint=str(self.last_checkpoint),
            steps=self.step,
            final_train_loss=self.last_train_loss,
        )
        self.reporter.event(
            f"Training finished: {self.step} steps, {self.trained_tokens:,} tokens, "
            f"final loss {self.last_train_loss:.4f}",
            data={"event": "finished", **result.__dict__},
        )
        return result

    def _report_start(self) -> None:
        n_params = sum(p.numel() for p in self.model.parameters())
        n_trainable = sum(p.numel() for p in self._trainable_parameters())
        self.reporter.event(
            f"Training started: {self.dist.world_size} process(es) on {self.device.type}, "
            f"{n_params:,} parameters ({n_trainable:,} trained), {self.total_steps} steps",
            data={
                "event": "started",
                "world_size": self.dist.world_size,
                "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
                "distributed": "fsdp" if self.fsdp else "ddp" if self.dist.world_size > 1 else "none",
                "model_parameters": n_params,
                "trainable_parameters": n_trainable,
                "lora": lora.lora_summary(self.model, self.config.lora)
                if self.config.lora is not None
                else None,
                "precision": self.precision,
                "optimizer_state_dtype": str(self._trainable_parameters()[0].dtype).removeprefix("torch."),
                "kernels": self.kernels_applied,
                "gradient_checkpointing": self.config.gradient_checkpointing,
                "n_train_sequences": len(self.train_data.sequences),
                "steps_per_epoch": self.steps_per_epoch,
                "total_steps": self.total_steps,
                "start_step": self.step,
                "micro_batch_size": self.micro_batch_size,
                "grad_accum_steps": self.grad_accum_steps,
                "memory_metrics": "CUDA allocator peaks of each step, max over ranks"
                if self.device.type == "cuda"
                else "peak resident set size of each process since its start, max over ranks",
            },
        )

    def _after_step(self, stats: StepStats, step_time: float, epoch_done: bool) -> None:
        config = self.config
        self._recent_step_times.append(step_time)
        allocated, reserved = peak_memory_bytes(self.device)
        reset_peak_memory(self.device)
        # One collective shares the memory peaks and the stop request (only rank 0 reads the job's status).
        shared = all_reduce(
            torch.tensor(
                [allocated, reserved, _STOP_CODES[self.reporter.stop_request()]],
                dtype=torch.long,
                device=self.device,
            ),
            op=torch.distributed.ReduceOp.MAX,
        ).tolist()
        stop = next(request for request, code in _STOP_CODES.items() if code == shared[2])
        mean_step_time = sum(self._recent_step_times) / len(self._recent_step_times)
        tokens_per_second = stats.n_input_tokens / step_time
        per_device = tokens_per_second / self.dist.world_size
        values: dict[str, float] = {
            "train_loss": stats.train_loss,
            "learning_rate": stats.learning_rate,
            "grad_norm": stats.grad_norm,
            "tokens_per_second": tokens_per_second,
            "tokens_per_second_per_device": per_device,
            "peak_memory_allocated_bytes": float(shared[0]),
            "peak_memory_reserved_bytes": float(shared[1]),
            "step_time_s": step_time,
            "epoch": self.step / self.steps_per_epoch,
            "eta_s": mean_step_time * (self.total_steps - self.step),
        }
        if self._peak_flops:
            flops_per_token = training_flops_per_token(self.model, stats.mean_padded_length)
            values["mfu"] = per_device * flops_per_token / self._peak_flops
        evaluate_now = (
            stop != StopRequest.CANCEL
            and self.valid_data is not None
            and (
                epoch_done
                or self.step == self.total_steps
                or (config.eval_every_steps is not None and self.step % config.eval_every_steps == 0)
            )
        )
        if evaluate_now:
            values.update(self.evaluate())
        self.reporter.metric(self.step, values)
        if stop == StopRequest.CANCEL:
            raise JobStopped("cancelled", f"stopped at step {self.step}: the job was cancelled", self.step)
        periodic = (
            config.checkpoint_every_steps is not None and self.step % config.checkpoint_every_steps == 0
        )
        # The final checkpoint is saved after the loop, unless a pause needs it now.
        if (periodic and self.step < self.total_steps) or stop == StopRequest.PAUSE:
            if self.last_checkpoint_step != self.step:
                self._save_checkpoint({k: v for k, v in values.items() if k in ("train_loss", "valid_loss")})
        if stop == StopRequest.PAUSE:
            raise JobStopped(
                "paused",
                f"paused at step {self.step}: checkpoint saved, training resumes from it",
                self.step,
                self._reported_path(self.last_checkpoint),
            )

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean loss and next-token accuracy over the trained tokens of the validation set, all ranks together."""
        assert self.valid_data is not None
        self.model.eval()
        rows = self.valid_data.sequences
        chunks = [
            list(range(i, min(i + self.micro_batch_size, len(rows))))
            for i in range(0, len(rows), self.micro_batch_size)
        ]
        mine = chunks[self.dist.rank :: self.dist.world_size]
        # FSDP gathers parameters inside each forward, so every rank must run as many forwards as the others;
        # a rank short of chunks repeats one and leaves it out of the sums.
        n_forwards = math.ceil(len(chunks) / self.dist.world_size) if self.fsdp else len(mine)
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)  # loss, tokens, correct
        for index in range(n_forwards):
            counted = index < len(mine)
            batch = self._batch([rows[i] for i in (mine[index] if counted else chunks[0])], packed=False)
            with self._autocast():
                logits = self.model(
                    input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
                ).logits
            if not counted:
                continue
            labels = batch["shifted_labels"]
            trained = labels != IGNORE_INDEX
            token_logits = logits[trained].float()
            sums[0] += torch.nn.functional.cross_entropy(
                token_logits, labels[trained], reduction="sum"
            ).double()
            sums[1] += trained.sum()
            sums[2] += (token_logits.argmax(-1) == labels[trained]).sum()
        all_reduce(sums)
        self.model.train()
        loss, tokens, correct = sums.tolist()
        results = {"valid_loss": loss / tokens, "valid_token_accuracy": correct / tokens}
        self.reporter.event(
            f"Evaluation at step {self.step}: valid_loss {results['valid_loss']:.4f}, "
            f"token accuracy {results['valid_token_accuracy']:.3f}",
            data={"event": "eval", "step": self.step, **results},
        )
        return results

    # ---------------------------------------------------------------------------------------- checkpoints

    def _reported_path(self, path: Path) -> str:
        base = self.config.checkpoint_paths_relative_to
        return os.path.relpath(path, base) if base else str(path)

    def _run_description(self) -> dict[str, Any]:
        """What a checkpoint's data position depends on; a run may resume from it only if all of it matches."""
        return {
            "training_rows": len(self.train_data.sequences),
            "batch_size": self.config.batch_size,
            "seed": self.config.seed,
            "max_seq_length": self.config.max_seq_length,
            "packing": self.config.packing,
            "lora": self.config.lora is not None,
        }

    def _save_checkpoint(self, metrics: dict[str, float]) -> None:
        """Weights, tokenizer and training state of the current step; collective (every rank calls it)."""
        config = self.config
        # Adapter-only checkpoints gather only the trained parameters; merged weights need the frozen ones too.
        adapter_only = config.lora is not None and not config.merge_lora_on_save
        model_state = get_model_state_dict(
            self.model,
            options=StateDictOptions(
                full_state_dict=True, cpu_offload=True, ignore_frozen_params=adapter_only
            ),
        )
        optimizer_state = get_optimizer_state_dict(self.model, self.optimizer, options=FULL_STATE_ON_RANK0)
        rng_states = all_gather_object(ckpt.capture_rng_state(self.device))
        path = ckpt.checkpoint_path(config.output_dir, self.step)
        if self.dist.is_main:
            epoch_index, batch_index = self.position
            resume_state = {
                ckpt.RESUME_STEP: self.step,
                ckpt.RESUME_EPOCH_INDEX: epoch_index,
                ckpt.RESUME_BATCH_INDEX: batch_index,
                ckpt.RESUME_TRAINED_TOKENS: self.trained_tokens,
                ckpt.RESUME_TRAIN_LOSS: self.last_train_loss,
                ckpt.RESUME_SCHEDULER: self.scheduler.state_dict(),
                ckpt.RESUME_RNG: rng_states,
                ckpt.RESUME_RUN: self._run_description(),
            }
            with ckpt.staged_checkpoint(config.output_dir, self.step) as staging:
                self._write_weights(staging, model_state)
                self.tokenizer.save_pretrained(staging)
                ckpt.write_trainer_state(staging, self.step, self.step / self.steps_per_epoch, metrics)
                ckpt.write_training_state(staging, optimizer_state, resume_state)
            reported_path = self._reported_path(path)
            publish_checkpoint(path, reported_path)  # to the object store, if any, before SQL records it
            self.reporter.checkpoint(self.step, reported_path, metrics)
            self.reporter.event(
                f"Saved checkpoint at step {self.step}",
                data={"event": "checkpoint_saved", "step": self.step, "path": reported_path},
            )
            self._prune_checkpoints()
        self.last_checkpoint, self.last_checkpoint_step = path, self.step
        barrier()

    def _write_weights(self, directory: Path, model_state: dict[str, torch.Tensor]) -> None:
        if self.config.lora is None:
            self.model.save_pretrained(directory, state_dict=model_state)
        elif self.config.merge_lora_on_save:
            lora.save_merged(self.model, model_state, directory)
            lora.save_adapter(self.model, model_state, directory / ckpt.ADAPTER_DIRNAME)
        else:
            lora.save_adapter(self.model, model_state, directory)

    def _prune_checkpoints(self) -> None:
        """Keep the newest `keep_last_checkpoints`; the reporter forgets the others before their files go, so
        the API never lists a checkpoint whose folder is gone."""
        stale = ckpt.stale_checkpoints(self.config.output_dir, self.config.keep_last_checkpoints)
        if stale:
            self.reporter.checkpoints_deleted([self._reported_path(path) for path in stale])
        for path in stale:
            ckpt.delete_checkpoint(path)

    def _check_resumable(self, state: dict[str, Any], checkpoint: Path) -> None:
        saved, current = state[ckpt.RESUME_RUN], self._run_description()
        differences = [
            f"{key}={saved.get(key)!r} there, {value!r} now"
            for key, value in current.items()
            if saved.get(key) != value
        ]
        if differences:
            raise TrainingFailure(
                ErrorCode.TRAINER_ERROR,
                f"cannot resume from checkpoint {checkpoint}: its run differs ({'; '.join(differences)}); start "
                "a new job or set resume to false",
            )

    def _restore_training_state(self, state: dict[str, Any], checkpoint: Path) -> None:
        """Continue from `checkpoint` (its weights are loaded already): optimizer, schedule, data position,
        token count and this rank's random number generators."""
        self._restore_optimizer(checkpoint)
        self.scheduler.load_state_dict(state[ckpt.RESUME_SCHEDULER])
        self.step = state[ckpt.RESUME_STEP]
        self.position = (state[ckpt.RESUME_EPOCH_INDEX], state[ckpt.RESUME_BATCH_INDEX])
        self.trained_tokens = state[ckpt.RESUME_TRAINED_TOKENS]
        self.last_train_loss = state[ckpt.RESUME_TRAIN_LOSS]
        rng_states = state[ckpt.RESUME_RNG]
        # Under another world size, ranks beyond the saved ones reuse saved states (only dropout draws).
        ckpt.restore_rng_state(rng_states[self.dist.rank % len(rng_states)], self.device)
        self.last_checkpoint, self.last_checkpoint_step = checkpoint, self.step
        self.reporter.event(
            f"Resumed from the checkpoint of step {self.step}",
            data={"event": "resumed", "step": self.step, "path": self._reported_path(checkpoint)},
        )

    def _restore_optimizer(self, checkpoint: Path) -> None:
        set_optimizer_state_dict(
            self.model,
            self.optimizer,
            ckpt.read_optimizer_state(checkpoint),
            options=FULL_STATE_ON_EVERY_RANK,
        )


# ------------------------------------------------------------------------------------------------ entry point


def _wait_for_error_file(output_dir: str) -> None:
    deadline = time.monotonic() + ERROR_FILE_WAIT_S
    while time.monotonic() < deadline and not (Path(output_dir) / ERROR_FILENAME).exists():
        time.sleep(0.1)


def run(config: TrainConfig) -> int:
    """Train as one rank of the job; returns the process exit status. Rank 0 writes the outcome file."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    dist_info = init_distributed()
    output_dir = Path(config.output_dir)
    if dist_info.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        for stale in OUTCOME_FILENAMES:
            (output_dir / stale).unlink(missing_ok=True)
    barrier()

    reporter: Reporter | None = None
    failure: tuple[ErrorCode, str] | None = None
    try:
        reporter = make_reporter(config.database_url, config.job_id, dist_info.is_main)
        result = Trainer(config, dist_info, reporter).train()
        if dist_info.is_main:
            write_result(output_dir, result)
    except JobStopped as stopped:
        if dist_info.is_main:
            write_stopped(output_dir, stopped)
        if reporter is not None:
            reporter.event(str(stopped), level="warning", data={"event": "stopped", "reason": stopped.reason})
        shutdown()
        return EXIT_STOPPED
    except TrainingFailure as exc:
        failure = (exc.code, exc.message)
    except torch.OutOfMemoryError as exc:
        traceback.print_exc()
        failure = (
            ErrorCode.OUT_OF_MEMORY,
            f"out of memory: {str(exc).splitlines()[0]}. {OUT_OF_MEMORY_HINT}",
        )
    except Exception as exc:
        traceback.print_exc()
        failure = (ErrorCode.TRAINER_ERROR, f"{type(exc).__name__}: {exc}")
    finally:
        if reporter is not None:
            reporter.close()

    if failure is not None:
        code, message = failure
        print(f"fusetune trainer (rank {dist_info.rank}) failed [{code}]: {message}", flush=True)
        if dist_info.is_main:
            write_error(output_dir, code, message)
        else:
            _wait_for_error_file(config.output_dir)
        return EXIT_FAILED
    shutdown()
    return 0
