"""The training loop: the same code for one process or N under torchrun (DDP or FSDP2), full weights or LoRA,
whatever the training method.

The loop keeps what every method shares; the parts it is built from live beside it:
- `methods/`: what differs between training methods (examples, micro-batches, the loss and its metrics,
  evaluation, a pass before training); the job's `method.type` picks one from `methods.TRAINING_METHODS`.
- `precision.py`: the precision policy (weight dtype, autocast, FSDP mixed precision, MFU's peak).
- `optim.py`: the optimizer the precision mode names; `lr_schedule.py`: the LR schedule; `checkpoints/`: the
  data position, resume.pt and checkpoint folders, local and in the store; `loading.py`: tokenizer, model and
  kernels.

`train()` runs epochs of `train_step()`s; a step runs one `forward_backward_step()` per micro-batch of this
rank, then clips and steps the optimizer. A micro-batch's loss is its share of the step's loss: the method
divides its sum by the step's normaliser over all ranks (for supervised training, the trained tokens), so any
split of a global batch over micro-batches and processes gives the same gradient.

Nothing in a step reads a device value back to the host: the loss, the method's metrics and the gradient norm
stay on the device until the step is reported. A non-finite loss or gradient norm still never reaches the
weights: an optimizer that can skip its update on the device (fused AdamW) is told to, and any other one is
checked on the host before it steps (free on a CPU); the step then fails the job when its metrics are read.

Checkpoints carry the training state through each part's state dict (optimizer, scheduler, data position, RNG
states, method), and a trainer started on an output_dir that holds one continues from the newest: the same loss
curve, step for step, as a run that was never interrupted. After every step the trainer asks the reporter
whether the job was paused (checkpoint, then exit) or cancelled (exit at once); all ranks act on the same answer.
"""

from __future__ import annotations

import contextlib
import math
import socket
import time
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from fusetune.worker.train import float8, optim, optimizer_in_backward
from fusetune.worker.train.activations import ActivationLayout, ActivationOffload, apply_activation_layout
from fusetune.worker.train.checkpoints import state as checkpoint_state
from fusetune.worker.train.checkpoints.checkpointer import Checkpointer
from fusetune.worker.train.checkpoints.schedule import CheckpointSchedule
from fusetune.worker.train.checkpoints.state import (
    TrainingProgress,
    check_resumable,
    find_resume_point,
    read_resume_state,
    resume_state,
    run_description,
)
from fusetune.worker.train.config import TrainConfig
from fusetune.worker.train.data import LoadedData, epoch_order
from fusetune.worker.train.distributed import (
    DistInfo,
    all_gather_object,
    all_reduce,
    parallelize,
    synchronize,
)
from fusetune.worker.train.early_stopping import RESUME_EARLY_STOPPING, EarlyStopping
from fusetune.worker.train.evaluation import evaluate
from fusetune.worker.train.loading import (
    apply_kernels,
    load_model,
    load_tokenizer,
    prepare_model,
    report_data,
)
from fusetune.worker.train.lr_schedule import build_scheduler, lr_factor, schedule_lengths
from fusetune.worker.train.methods import TRAINING_METHODS
from fusetune.worker.train.metrics import (
    StepMeter,
    StepStats,
    non_finite_failure,
    rank_memory,
    resolved_plan,
    run_summary,
    share_step_state,
)
from fusetune.worker.train.optimizer_in_backward import OptimizerInBackward
from fusetune.worker.train.outcome import (
    ErrorCode,
    JobStopped,
    TrainingFailure,
    TrainResult,
)
from fusetune.worker.train.planning import RunPlan, free_gpu_memory_bytes, plan_training
from fusetune.worker.train.precision import PrecisionPolicy, resolve_precision, runnable_mode
from fusetune.worker.train.reporter import Reporter, StopRequest

__all__ = ["StepStats", "Trainer", "load_model", "load_tokenizer", "lr_factor"]


class Trainer:
    """One rank of a training run.

    The setup steps that touch the outside world (`_load_tokenizer`, `_load_data`, `_load_model`) are methods
    so that a benchmark can feed synthetic data or a randomly initialised model through the same loop.
    """

    @staticmethod
    def _shards(config: TrainConfig, dist_info: DistInfo) -> bool:
        """Whether the model is sharded with FSDP2: asked for, over more than one process (one process has nothing
        to shard across: it trains the model whole, as without data parallelism). A benchmark overrides this to
        measure FSDP2's own cost on one GPU."""
        return config.distributed == "fsdp" and dist_info.world_size > 1

    def __init__(self, config: TrainConfig, dist_info: DistInfo, reporter: Reporter) -> None:
        self.config = config
        self.dist = dist_info
        self.device = dist_info.device
        self.reporter = reporter
        # Every rank's host, in rank order, once: each step's memory peaks are reported with them.
        self.hosts: list[str] = all_gather_object(socket.gethostname())
        self.fsdp = self._shards(config, dist_info)
        try:
            # A mode this device cannot run, or a batch the processes cannot split, fails before anything loads;
            # the precision is resolved once the plan has decided it (_plan_run).
            runnable_mode(config.precision, self.device)
            config.micro_batches_per_rank(dist_info.world_size)
        except ValueError as exc:
            raise TrainingFailure(ErrorCode.TRAINER_ERROR, str(exc)) from exc
        torch.manual_seed(config.seed)

        self.resume_from: tuple[int, Path] | None = find_resume_point(config, dist_info)
        self.checkpoints = Checkpointer(config, dist_info, reporter)
        self.early_stopping = EarlyStopping(config.early_stopping, self.checkpoints, reporter)

        self.tokenizer = self._load_tokenizer()
        self.pad_token_id = next(
            (t for t in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id) if t is not None), 0
        )
        self.method = TRAINING_METHODS[config.method.type](config, self.tokenizer, self.pad_token_id)
        self.train_data = self._load_data(config.training_file, packing=config.packing)
        self.row_lengths = [self.method.row_length(row) for row in self.train_data.sequences]
        # Read before planning (a resumed run keeps the precision its checkpoint records) and checked before the
        # model loads, so that a run that cannot resume fails fast.
        saved_state = read_resume_state(self.resume_from[1]) if self.resume_from is not None else None
        # The memory plan, before the model loads: from here on the config has every part of it decided.
        self.run_plan = self._plan_run(saved_state[checkpoint_state.RESUME_RUN] if saved_state else None)
        config = self.config = self.run_plan.config
        self.valid_data = (
            self._load_data(config.validation_file, packing=False) if config.validation_file else None
        )
        if saved_state is not None:
            check_resumable(
                saved_state[checkpoint_state.RESUME_RUN], self._run_description(), self.resume_from[1]
            )

        self.model = self._build_model()
        self.kernels_applied = self._apply_kernels()
        self.model.train()
        self.activation_layout, self.activation_offload = self._arrange_activations()
        self.float8 = float8.apply(self.model, self.precision, self.reporter)  # fp8's linears; None otherwise
        if self.float8 is not None:
            self.method.length_multiple = float8.TOKEN_MULTIPLE
        self.train_model = self._parallelize()

        self.steps_per_epoch, self.total_steps, self.warmup_steps = schedule_lengths(
            config, len(self.train_data.sequences)
        )
        self.optimizer_name = self.precision.mode.optimizer
        self.optimizer = self._build_optimizer()
        if self.float8 is not None:  # the weights' float8 scales from what the optimizer's step keeps
            float8.weight_scales_from_optimizer(self.model, self.optimizer)
        self.in_backward = self._optimizer_in_backward()
        self.scheduler = build_scheduler(
            self.optimizer, self.warmup_steps, self.total_steps, config.lr_scheduler
        )

        self.progress = TrainingProgress()
        self.last_checkpoint: Path | None = None
        self.last_checkpoint_step: int | None = None
        self.checkpoint_schedule = CheckpointSchedule.from_config(config)
        self.meter = StepMeter(
            self.model,
            self.dist.world_size,
            self.steps_per_epoch,
            self.total_steps,
            self.precision.peak_flops(),
        )
        if saved_state is not None:
            self._restore_training_state(saved_state, self.resume_from[1])

    # The progress's fields, by the names the rest of the code and its readers use.
    step = property(lambda self: self.progress.step)
    trained_tokens = property(lambda self: self.progress.trained_tokens)
    last_train_loss = property(lambda self: self.progress.last_train_loss)

    # ----------------------------------------------------------------------------------------------- setup

    def _plan_memory_bytes(self) -> int | None:
        """The GPU memory the plan must fit: free on the tightest of the job's GPUs; None on a CPU (a test may
        give a size, so that the CPU runs a plan chosen against one)."""
        return free_gpu_memory_bytes(self.device, self.config.gpu_memory_bytes)

    def _plan_run(self, resumed_run: dict[str, Any] | None = None) -> RunPlan:
        """The run's memory plan (planning.py); the precision and the micro-batches follow it. `resumed_run`:
        the run description of the checkpoint it resumes."""
        pinned_micro = self.config.micro_batch_size
        run_plan = plan_training(
            self.config,
            self.dist.world_size,
            self.row_lengths,
            self.method.rows_per_example,
            self._plan_memory_bytes(),
            on_gpu=self.device.type == "cuda",
            resumed_checkpoint=self.resume_from[1] if self.resume_from is not None else None,
            resumed_run=resumed_run,
        )
        try:
            # The one place the precision is resolved: after the plan made "auto" concrete.
            self.precision: PrecisionPolicy = resolve_precision(
                run_plan.config.precision, self.device, self.fsdp
            )
            self.micro_batch_size, self.grad_accum_steps = run_plan.config.micro_batches_per_rank(
                self.dist.world_size
            )
        except ValueError as exc:
            raise TrainingFailure(ErrorCode.TRAINER_ERROR, str(exc)) from exc
        self.micro_batch_reason = "as set" if pinned_micro else run_plan.reason
        return run_plan

    def _load_tokenizer(self):
        return load_tokenizer(self.config.model_path)

    def _load_model(self, path: str, dtype: torch.dtype) -> torch.nn.Module:
        return load_model(path, dtype, self.config.adapter_base_models)

    def _load_data(self, path: str, packing: bool) -> LoadedData:
        return report_data(
            self.method.load_data(path, packing), path, self.config.max_seq_length, self.reporter
        )

    def _build_model(self) -> torch.nn.Module:
        """The model in the precision's weight dtype, from the checkpoint it resumes (full weights) or the base
        model, with gradient checkpointing and LoRA adapters as configured."""
        resumed = self.resume_from[1] if self.resume_from is not None else None
        path = str(resumed) if resumed is not None and self.config.lora is None else self.config.model_path
        return prepare_model(self._load_model(path, self.precision.weight_dtype), self.config, resumed)

    def _apply_kernels(self) -> bool:
        return self.config.kernels and apply_kernels(self.model, self.device, self.reporter)

    def _parallelize(self) -> torch.nn.Module:
        try:
            return parallelize(
                self.model,
                self.dist,
                self.fsdp,
                self.precision.fsdp_mixed_precision,
                self.config.ddp_bucket_cap_mb,
            )
        except ValueError as exc:
            raise TrainingFailure(ErrorCode.TRAINER_ERROR, f"cannot shard the model: {exc}") from exc

    def _trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _build_optimizer(self) -> torch.optim.Optimizer:
        return optim.build_optimizer(
            self.optimizer_name,
            self._trainable_parameters(),
            learning_rate=self.config.learning_rate,
            weight_decay=self.config.weight_decay,
            device=self.device,
            seed=self.config.seed,
            state_on_host=bool(self.config.optimizer_state_on_host),
        )

    def _arrange_activations(self) -> tuple[ActivationLayout | None, ActivationOffload | None]:
        """The plan's recompute and offload of decoder layers' activations (None: the model's own setting)."""
        recompute, offload = self.config.recompute_layers, self.config.offload_layers or 0
        if recompute is None and not offload:
            return None, None
        if offload and self.device.type != "cuda":
            raise TrainingFailure(ErrorCode.TRAINER_ERROR, "offload_layers needs a GPU: set it to 0 on CPU")
        try:
            return apply_activation_layout(self.model, recompute or 0, offload)
        except ValueError as exc:
            raise TrainingFailure(ErrorCode.TRAINER_ERROR, str(exc)) from exc

    def _optimizer_in_backward(self) -> OptimizerInBackward | None:
        if not self.config.optimizer_in_backward:
            return None
        reason = optimizer_in_backward.refusal(
            self.optimizer_name, self.dist.world_size, self.grad_accum_steps
        )
        if reason is not None:
            raise TrainingFailure(ErrorCode.TRAINER_ERROR, reason)
        return OptimizerInBackward(self.optimizer, self._trainable_parameters(), self.config.max_grad_norm)

    def _autocast(self):
        return self.precision.autocast()

    def _gradient_sync(self, enabled: bool):
        """Reduce gradients over ranks after this micro-batch's backward (the step's last) or keep
        accumulating them locally."""
        if self.fsdp:
            self.model.set_requires_gradient_sync(enabled)
        elif isinstance(self.train_model, DistributedDataParallel) and not enabled:
            return self.train_model.no_sync()
        return contextlib.nullcontext()

    def _batch(self, rows: list[Any], packed: bool) -> dict[str, torch.Tensor]:
        batch = self.method.collate(rows, packed=packed)
        # The token counts and sequence lengths stay on the CPU so that reading them never waits for the GPU.
        return {
            key: value.to(self.device, non_blocking=True)
            if isinstance(value, torch.Tensor) and value.ndim
            else value
            for key, value in batch.items()
        }

    # ------------------------------------------------------------------------------------------- training

    def forward_backward_step(
        self,
        batch: dict[str, torch.Tensor],
        normaliser: torch.Tensor,
        metric_sums: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns its share of the step's loss (detached) and adds
        its shares of the method's metrics to `metric_sums`."""
        with self._autocast():
            loss, metrics = self.method.loss(self.train_model, batch, normaliser)
        if self.in_backward is not None:
            self.in_backward.start(loss, self.progress.last_grad_norm)
        # DDP and FSDP average gradients over ranks; scaling by the world size turns that average into the
        # sum that the global normaliser divides.
        (loss * self.dist.world_size).backward()
        if metric_sums is not None:
            for name, value in metrics.items():
                metric_sums[name] = (
                    metric_sums[name] + value.detach() if name in metric_sums else value.detach()
                )
        return loss.detach()

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> StepStats:
        counts = torch.tensor(
            [
                sum(self.method.loss_normaliser(mb) for mb in micro_batches),
                sum(int(mb["n_input_tokens"]) for mb in micro_batches),
                sum(int(mb.get("n_trained_tokens", 0)) for mb in micro_batches),
                sum(mb["input_ids"].numel() for mb in micro_batches),  # padding included
            ],
            dtype=torch.long,
            device=self.device,
        )
        all_reduce(counts)
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        metric_sums: dict[str, torch.Tensor] = {}
        for index, batch in enumerate(micro_batches):
            # Gradients are reduced over ranks once per step, after the last micro-batch.
            with self._gradient_sync(enabled=index == len(micro_batches) - 1):
                loss_sum += self.forward_backward_step(batch, counts[0], metric_sums)
        losses = all_reduce(torch.stack([loss_sum, *(value.float() for value in metric_sums.values())]))
        learning_rate = self.optimizer.param_groups[0]["lr"]
        if self.in_backward is not None:
            grad_norm = self.in_backward.finish()  # each parameter was updated in the backward
        else:
            grad_norm = optim.clip_and_step(
                self.optimizer,
                self.optimizer_name,
                self._trainable_parameters(),
                self.config.max_grad_norm or float("inf"),
                losses[0],
                lambda norm: non_finite_failure(float(losses[0]), float(norm), self.step + 1),
            )
            self.optimizer.zero_grad(set_to_none=True)
        return StepStats(
            losses=losses,
            metric_names=tuple(metric_sums),
            grad_norm=grad_norm,
            counts=counts,
            learning_rate=learning_rate,
            attended_length=sum(mb["attended_length"] * int(mb["n_input_tokens"]) for mb in micro_batches)
            / max(1, sum(int(mb["n_input_tokens"]) for mb in micro_batches)),
        )

    def epoch_batches(self, epoch: int, first_batch: int = 0):
        """(batch index, this rank's micro-batches on the device) for each step of `epoch` from `first_batch`,
        in the epoch's order (deterministic by seed and epoch)."""
        config = self.config
        order = epoch_order(
            len(self.train_data.sequences),
            self.steps_per_epoch,
            config.batch_size,
            config.seed,
            epoch,
            lengths=self.row_lengths,
        )
        rows = self.train_data.sequences
        for batch_index in range(first_batch, self.steps_per_epoch):
            global_batch = order[batch_index * config.batch_size : (batch_index + 1) * config.batch_size]
            yield (
                batch_index,
                [
                    self._batch([rows[i] for i in chunk], packed=config.packing)
                    for chunk in self.method.micro_batches(
                        global_batch, self.micro_batch_size, self.dist.rank, self.dist.world_size
                    )
                ],
            )

    def train(self) -> TrainResult:
        config = self.config
        self._report_start()
        self.method.before_training(self)
        start_epoch, start_batch = self.progress.epoch_index, self.progress.batch_index
        for epoch in range(start_epoch, config.n_epochs):
            first_batch = start_batch if epoch == start_epoch else 0
            for batch_index, micro_batches in self.epoch_batches(epoch, first_batch):
                if self.step >= self.total_steps or self.early_stopping.stopped:
                    break
                started = time.perf_counter()
                stats = self.train_step(self.method.prepare_step(self, micro_batches))
                synchronize(self.device)  # the step time covers the optimizer step the GPU may still run
                step_time = time.perf_counter() - started
                values = stats.read()
                if not (math.isfinite(values["train_loss"]) and math.isfinite(values["grad_norm"])):
                    # The optimizer skipped this step's update on the device.
                    raise non_finite_failure(values["train_loss"], values["grad_norm"], self.step + 1)
                self.scheduler.step()
                epoch_done = batch_index == self.steps_per_epoch - 1
                self.progress.advance(
                    epoch, batch_index, epoch_done, int(values["n_input_tokens"]), values["train_loss"],
                    values["grad_norm"],
                )  # fmt: skip
                self._after_step(values, stats, step_time, epoch_done=epoch_done)
            else:
                done = {"event": "epoch_done", "epoch": epoch + 1, "step": self.step}
                self.reporter.event(
                    f"Epoch {epoch + 1}/{config.n_epochs} done at step {self.step}",
                    data={**done, "train_loss": self.last_train_loss},
                )
                continue
            break  # max_steps reached inside the epoch

        if self.early_stopping.stopped:
            self.last_checkpoint = self.early_stopping.end_on_best()
        elif self.last_checkpoint_step != self.step:
            self._save_checkpoint(self.meter.checkpoint_metrics(self.step))
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
        message, data = run_summary(self)
        # The started event names the memory plan that runs, with the estimate it was chosen by.
        message, data = f"{message}; {self.run_plan.summary()}", {**data, **self.run_plan.event_data()}
        self.reporter.event(message, data=data)
        self.reporter.resolved(resolved_plan(data))

    def _after_step(
        self, read: dict[str, float], stats: StepStats, step_time: float, epoch_done: bool
    ) -> None:
        rank_peaks, stop, periodic = share_step_state(
            self.dist, self.reporter, self.checkpoint_schedule.due(self.step, epoch_done)
        )
        peaks = (max(peak[0] for peak in rank_peaks), max(peak[1] for peak in rank_peaks))
        values = self.meter.step_values(read, stats, step_time, peaks, self.step, self.trained_tokens)
        every = self.method.eval_every_steps
        periodic = periodic and self.step < self.total_steps  # the final checkpoint is saved after the loop
        evaluate_now = (
            stop != StopRequest.CANCEL
            and self.valid_data is not None
            and (
                epoch_done
                or self.step == self.total_steps
                or (every is not None and self.step % every == 0)
                or periodic  # a checkpoint's metrics include the whole validation file's
            )
        )
        if evaluate_now:
            values.update(self.evaluate())
        self.reporter.metric(
            self.step, values, rank_memory(rank_peaks, self.hosts, self.dist.local_world_size)
        )
        if stop == StopRequest.CANCEL:
            raise JobStopped("cancelled", f"stopped at step {self.step}: the job was cancelled", self.step)
        best = evaluate_now and self.early_stopping.observe(self.step, values.get("valid_loss"))
        if periodic or best or stop in (StopRequest.PAUSE, StopRequest.HANDOVER):
            if self.last_checkpoint_step != self.step:
                self._save_checkpoint(self.meter.checkpoint_metrics(self.step))
                self.checkpoint_schedule.saved()
            if best:
                self.early_stopping.best_saved()
        if stop in (StopRequest.PAUSE, StopRequest.HANDOVER):
            reason = "paused" if stop == StopRequest.PAUSE else "handed_over"
            what = "paused" if stop == StopRequest.PAUSE else "handed over (its worker is stopping)"
            raise JobStopped(
                reason,
                f"{what} at step {self.step}: checkpoint saved, training resumes from it",
                self.step,
                self.checkpoints.reported_path(self.last_checkpoint),
            )

    def evaluate(self) -> dict[str, float]:
        """The method's evaluation metrics over the validation set, all ranks together."""
        assert self.valid_data is not None
        results = evaluate(
            self.model, self.method, self.valid_data.sequences, self._batch, self._autocast,
            self.micro_batch_size, self.dist, same_forwards_on_every_rank=self.fsdp,
        )  # fmt: skip
        summary = ", ".join(f"{name} {value:.4f}" for name, value in results.items())
        self.reporter.event(
            f"Evaluation at step {self.step}: {summary}",
            data={"event": "eval", "step": self.step, **results},
        )
        return results

    # ---------------------------------------------------------------------------------------- checkpoints

    def _run_description(self) -> dict[str, Any]:
        return run_description(self.config, len(self.train_data.sequences), self.run_plan.plan)

    def _save_checkpoint(self, metrics: dict[str, float]) -> None:
        """Weights, tokenizer and training state of the current step; collective (every rank calls it). A disk
        that refuses the write (full, read-only, permissions) is the job's storage_error."""
        try:
            path = self._write_checkpoint(metrics)
        except OSError as exc:
            raise TrainingFailure(
                ErrorCode.STORAGE_ERROR, f"writing the checkpoint of step {self.step} failed: {exc}"
            ) from exc
        self.last_checkpoint, self.last_checkpoint_step = path, self.step

    def _write_checkpoint(self, metrics: dict[str, float]) -> Path:
        return self.checkpoints.save(
            self.step,
            self.step / self.steps_per_epoch,
            metrics,
            self.model,
            self.optimizer,
            self.tokenizer,
            lambda rng_states: (
                resume_state(
                    self.progress,
                    self.scheduler,
                    rng_states,
                    self._run_description(),
                    self.method.state_dict(),
                )
                | {RESUME_EARLY_STOPPING: self.early_stopping.state_dict()}
            ),
        )

    def _restore_training_state(self, state: dict[str, Any], checkpoint: Path) -> None:
        """Continue from `checkpoint` (its weights are loaded already): each part from its own state."""
        self._restore_optimizer(checkpoint)
        self.scheduler.load_state_dict(state[checkpoint_state.RESUME_SCHEDULER])
        self.progress.load_state_dict(state)
        self.method.load_state_dict(state[checkpoint_state.RESUME_METHOD])
        self.early_stopping.load_state_dict(state.get(RESUME_EARLY_STOPPING))
        rng_states = state[checkpoint_state.RESUME_RNG]
        # Under another world size, ranks beyond the saved ones reuse saved states (only dropout draws).
        checkpoint_state.restore_rng_state(rng_states[self.dist.rank % len(rng_states)], self.device)
        self.last_checkpoint, self.last_checkpoint_step = checkpoint, self.step
        self.reporter.event(
            f"Resumed from the checkpoint of step {self.step}",
            data={"event": "resumed", "step": self.step, "path": self.checkpoints.reported_path(checkpoint)},
        )

    def _restore_optimizer(self, checkpoint: Path) -> None:
        self.checkpoints.restore_optimizer(self.model, self.optimizer, checkpoint)
