"""A step's numbers as the loop keeps them on the device, and the throughput, memory and model-FLOPs-utilisation
helpers for the per-step metrics."""

from __future__ import annotations

import math
import resource
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from fusetune.worker.train.distributed import DistInfo, all_reduce
from fusetune.worker.train.outcome import ErrorCode, TrainingFailure
from fusetune.worker.train.reporter import Reporter, StopRequest


@dataclass(frozen=True)
class StepStats:
    """A step's numbers, summed over its micro-batches and all ranks, still on the device."""

    losses: torch.Tensor  # the loss, then the method's metrics (metric_names)
    metric_names: tuple[str, ...]
    grad_norm: torch.Tensor
    # All ranks: the loss's normaliser, input tokens (padding excluded), trained tokens (with a label), and all
    # tokens of the step's rows (padding included).
    counts: torch.Tensor
    learning_rate: float
    # The mean over input tokens of the length of the example a token attends within (MFU's attention term).
    attended_length: float

    def read(self) -> dict[str, float]:
        """The host values (one device read): train_loss, grad_norm, the token counts and the method's metrics."""
        values = torch.cat([self.losses.double(), self.grad_norm.double().reshape(1), self.counts.double()])
        loss, *metrics, grad_norm, _, n_input_tokens, n_trained_tokens, n_row_tokens = values.tolist()
        return {
            "train_loss": loss,
            "grad_norm": grad_norm,
            "n_input_tokens": n_input_tokens,
            "n_trained_tokens": n_trained_tokens,
            "n_row_tokens": n_row_tokens,
            **dict(zip(self.metric_names, metrics, strict=True)),
        }


def non_finite_failure(train_loss: float, grad_norm: float, step_number: int) -> TrainingFailure:
    what = (
        f"the training loss is {train_loss}"
        if not math.isfinite(train_loss)
        else f"the gradient norm is {grad_norm}"
    )
    return TrainingFailure(ErrorCode.NON_FINITE_LOSS, f"{what} at step {step_number}")


ETA_WINDOW_STEPS = 20


class StepMeter:
    """The per-step metrics the loop reports besides the method's: learning rate, throughput, memory, MFU,
    epoch and time left."""

    def __init__(
        self,
        model: torch.nn.Module,
        world_size: int,
        steps_per_epoch: int,
        total_steps: int,
        peak_flops: float | None,
    ) -> None:
        self.model = model
        self.world_size = world_size
        self.steps_per_epoch = steps_per_epoch
        self.total_steps = total_steps
        self.peak_flops = peak_flops
        self._recent_step_times: deque[float] = deque(maxlen=ETA_WINDOW_STEPS)
        # The last step's values (the loop adds its evaluation to them) and which of them are the method's.
        self.last_values: dict[str, float] = {}
        self.last_method_metrics: tuple[str, ...] = ()

    def step_values(
        self,
        read: dict[str, float],
        stats: StepStats,
        step_time: float,
        peak_memory: tuple[float, float],
        step: int,
        trained_tokens: int,
    ) -> dict[str, float]:
        """`read` is `stats.read()`; `peak_memory` the (allocated, reserved) peaks of the step over all ranks;
        `step` the number of steps done, `trained_tokens` the input tokens of all of them."""
        self._recent_step_times.append(step_time)
        mean_step_time = sum(self._recent_step_times) / len(self._recent_step_times)
        tokens_per_second = read["n_input_tokens"] / step_time
        per_device = tokens_per_second / self.world_size
        values: dict[str, float] = {
            "train_loss": read["train_loss"],
            "learning_rate": stats.learning_rate,
            "grad_norm": read["grad_norm"],
            **{name: read[name] for name in stats.metric_names},
            "tokens_per_second": tokens_per_second,
            "trained_tokens_per_second": read["n_trained_tokens"] / step_time,
            "padding_fraction": 1.0 - read["n_input_tokens"] / max(1.0, read["n_row_tokens"]),
            "tokens_per_second_per_device": per_device,
            "peak_memory_allocated_bytes": peak_memory[0],
            "peak_memory_reserved_bytes": peak_memory[1],
            "step_time_s": step_time,
            "epoch": step / self.steps_per_epoch,
            "eta_s": mean_step_time * (self.total_steps - step),
            "trained_tokens": trained_tokens,
        }
        if self.peak_flops:
            flops_per_token = training_flops_per_token(self.model, stats.attended_length)
            values["mfu"] = per_device * flops_per_token / self.peak_flops
        self.last_values, self.last_method_metrics = values, stats.metric_names
        return values

    def checkpoint_metrics(self, step: int) -> dict[str, float]:
        """A checkpoint's metrics as OpenAI has them, from the last step: `step`, `train_loss` and the method's
        training metrics, and the step's evaluation (over the whole validation file) under its names and again
        as `full_valid_*`. Any method's metrics flow in by name."""
        values = self.last_values
        metrics: dict[str, float] = {"step": float(step)}
        for name in ("train_loss", *self.last_method_metrics):
            if name in values:
                metrics[name] = values[name]
        for name, value in values.items():
            if name.startswith("valid_"):
                metrics[name] = metrics[f"full_{name}"] = value
        return metrics


# Dense bf16 tensor-core peak FLOP/s from the vendors' spec sheets, matched by substring of the device name,
# most specific first (e.g. "H100 PCIe" before "H100").
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989e12),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("A10G", 70e12),
    ("L4", 121e12),
)


# The peak tables by the dtype a precision mode divides by (fusetune/spec/precision.py, `mfu_peak_dtype`).
PEAK_FLOPS = {"bfloat16": PEAK_BF16_FLOPS}


def peak_flops(device_name: str, dtype: str = "bfloat16") -> float | None:
    for name, flops in PEAK_FLOPS[dtype]:
        if name in device_name:
            return flops
    return None


def training_flops_per_token(model: torch.nn.Module, seq_len: float) -> float:
    """Forward + backward FLOPs per token: 6 per matmul weight, plus the attention scores and weighted sum.

    The input embedding is a lookup, not a matmul, so it is left out unless it is tied to the output layer.
    The attention term (12 · layers · heads · head_dim · seq_len) counts the full square, as is customary,
    although causal attention computes about half of it; `seq_len` is the length of the sequence a token
    attends within (its example's, in a packed row).
    """
    n_params = sum(p.numel() for p in model.parameters())
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if embeddings is not None and (output is None or output.weight is not embeddings.weight):
        n_params -= embeddings.weight.numel()
    config = getattr(model, "config", None)
    attention = 0.0
    if config is not None and hasattr(config, "num_hidden_layers") and hasattr(config, "num_attention_heads"):
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        attention = 12.0 * config.num_hidden_layers * config.num_attention_heads * head_dim * seq_len
    return 6.0 * n_params + attention


def peak_memory_bytes(device: torch.device) -> tuple[int, int]:
    """(allocated, reserved) peaks since the last `reset_peak_memory`.

    On a GPU these are the CUDA caching allocator's peaks. On CPU both are the process's peak resident set size
    since it started (the OS keeps no resettable peak), which is the closest thing to what the GPU numbers mean.
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return peak_rss, peak_rss


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


# The stop request every rank acts on, by code: all ranks take the largest.
_STOP_CODES = {None: 0, StopRequest.PAUSE: 1, StopRequest.HANDOVER: 2, StopRequest.CANCEL: 3}


def share_step_state(
    dist_info: DistInfo, reporter: Reporter, checkpoint_due: bool
) -> tuple[list[tuple[float, float]], StopRequest | None, bool]:
    """Every rank's (allocated, reserved) memory peaks of this step, in rank order, the stop request every rank
    acts on, and whether any rank's checkpoint schedule is due (the save is collective): one collective (only
    rank 0 reads the job's status). Each rank fills its own slots of the peaks and leaves the others 0, so the
    MAX that settles the stop request also gathers the peaks."""
    allocated, reserved = peak_memory_bytes(dist_info.device)
    reset_peak_memory(dist_info.device)
    stop_code = _STOP_CODES[reporter.stop_request()]
    shared = torch.zeros(2 + 2 * dist_info.world_size, dtype=torch.long, device=dist_info.device)
    shared[0], shared[1] = stop_code, checkpoint_due
    shared[2 + 2 * dist_info.rank], shared[3 + 2 * dist_info.rank] = allocated, reserved
    shared = all_reduce(shared, op=torch.distributed.ReduceOp.MAX).tolist()
    stop = next(request for request, code in _STOP_CODES.items() if code == shared[0])
    peaks = [(float(shared[i]), float(shared[i + 1])) for i in range(2, len(shared), 2)]
    return peaks, stop, bool(shared[1])


def rank_memory(
    peaks: list[tuple[float, float]], hosts: list[str], local_world_size: int
) -> list[dict[str, Any]]:
    """Each rank's peaks with its node (torchrun numbers a node's ranks consecutively: node i holds ranks
    i * local_world_size onwards) and host: what the job's metrics keep per step (`rank_memory`), so that a
    node short of memory shows, where the step's maximum over ranks hides which one it was."""
    return [
        {"rank": rank, "node": rank // local_world_size, "host": hosts[rank],
         "peak_memory_allocated_bytes": allocated, "peak_memory_reserved_bytes": reserved}
        for rank, (allocated, reserved) in enumerate(peaks)
    ]  # fmt: skip


# What the job object reports of its run (`resolved`), from the `started` event: what "auto" and the device made of
# the job's hyperparameters, and how the run is split.
RESOLVED_KEYS = (
    "precision", "optimizer", "kernels", "micro_batch_size", "micro_batch_reason", "grad_accum_steps",
    "gradient_checkpointing", "distributed", "world_size", "nodes", "processes_per_node", "device", "memory_plan",
    "memory_plan_description",
)  # fmt: skip


def resolved_plan(summary: dict[str, Any]) -> dict[str, Any]:
    """The `RESOLVED_KEYS` of a run's `started` event data."""
    return {key: summary[key] for key in RESOLVED_KEYS}


def run_summary(trainer: Any) -> tuple[str, dict[str, Any]]:
    """The `started` event of a run: what runs where, in which precision, with which batches."""
    from fusetune.worker.train import lora

    n_params = sum(p.numel() for p in trainer.model.parameters())
    trainable = trainer._trainable_parameters()
    n_trainable = sum(p.numel() for p in trainable)
    device, world_size = trainer.device, trainer.dist.world_size
    message = (
        f"Training started: {world_size} process(es) on {device.type}, "
        f"{n_params:,} parameters ({n_trainable:,} trained), {trainer.total_steps} steps"
    )
    config = trainer.config
    return message, {
        "event": "started",
        "world_size": world_size,
        # nodes x processes_per_node = world_size (several nodes: one torchrun per node, fusetune/worker/ray_driver.py)
        "nodes": world_size // trainer.dist.local_world_size,
        "processes_per_node": trainer.dist.local_world_size,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "distributed": "fsdp" if trainer.fsdp else "ddp" if world_size > 1 else "none",
        "model_parameters": n_params,
        "trainable_parameters": n_trainable,
        "lora": lora.lora_summary(trainer.model, config.lora) if config.lora is not None else None,
        "mfu_peak_flops": trainer.precision.peak_flops(),
        "method": config.method.type,
        "precision": trainer.precision.name,
        "optimizer": trainer.optimizer_name,
        "optimizer_state_dtype": trainer.precision.mode.optimizer_state_dtype,
        "kernels": trainer.kernels_applied,
        "gradient_checkpointing": config.gradient_checkpointing,
        "n_train_sequences": len(trainer.train_data.sequences),
        "steps_per_epoch": trainer.steps_per_epoch,
        "total_steps": trainer.total_steps,
        "start_step": trainer.step,
        "micro_batch_size": trainer.micro_batch_size,
        "micro_batch_reason": trainer.micro_batch_reason,
        "grad_accum_steps": trainer.grad_accum_steps,
        "memory_metrics": "CUDA allocator peaks of each step, max over ranks"
        if device.type == "cuda"
        else "peak resident set size of each process since its start, max over ranks",
    }
