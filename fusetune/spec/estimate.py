"""Up-front estimates for a job: training tokens, peak GPU memory per GPU and duration.

Computed from the model's config.json (no weights loaded), the dataset's counts and the job's settings. The
memory model follows what the trainer does on a GPU (precision "auto" = bf16-sr: bf16 weights, gradients and
AdamW state; bf16-mixed: fp32 weights and state, bf16 compute under autocast; activations of one micro-batch
kept for the backward); the bytes of weights, gradients and optimizer state per parameter come from the
precision mode and its optimizer (fusetune/spec/precision.py; the 8-bit state is its codes and scales). Each
term is derived from the tensors that stay alive at the peak (the start of the backward), not fitted; the check
against measured peaks on a GPU is benchmarks/step/memory_estimate.py (benchmarks/results/h100-step.json, section
memory-estimate).

Every part of a memory plan (fusetune/spec/plan.py) moves its own term, and nothing else:
- `recompute_layers` k of L: those layers keep only their input; the backward rebuilds one layer at a time, so
  one layer's full activations come back while it runs (the rule measured for full checkpointing, k = L).
- `offload_layers` o (of the L - k layers not recomputed): their saved activations wait in pinned host memory
  (`host_activation_bytes`); `OFFLOAD_PREFETCH_LAYERS` of them stay on the GPU at a time (the one being copied
  out while the next runs, the one prefetched back before its backward).
- `optimizer_in_backward`: each gradient is stepped and freed as soon as it is complete, so the gradients that
  exist at once are the ones in flight: the largest outside the layers (the embedding, which a tied output head
  keeps accumulating through the whole backward) and two layers' (one being completed, one being stepped).
- `optimizer_state_on_host`: the optimizer's state waits in pinned host memory (`host_optimizer_state_bytes`);
  the GPU holds the buffers one parameter's state is staged in, the largest parameter's size.
- `precision`: the bytes of weights, gradients and optimizer state, as above.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from fusetune.spec.job import JobSpec
from fusetune.spec.methods import METHODS
from fusetune.spec.plan import MemoryPlan
from fusetune.spec.precision import DTYPE_BYTES, PrecisionMode, mode_for


# Tensors saved for the backward, bytes per token and decoder layer, with h = hidden size, q = heads x
# head_dim, kv = kv heads x head_dim, i = intermediate size. Under bf16 autocast the residual stream is fp32
# (the fp32 embedding starts it), everything a matmul saves is its bf16 input.
#   fused kernels: the two norms' fp32 inputs (2 x 4h) and bf16 outputs (2 x 2h), q/k/v after RoPE in place
#   (2q + 4kv), the attention output (2q), gate and up of the MLP (2 x 2i) and their product, which down_proj
#   saves (2i).
#   Hugging Face modules add the fp32 normalised rows of both norms (2 x 4h), RoPE's rotated copies of q and k
#   (2q + 2kv, twice), and the MLP's activation output (2i).
#   fused kernels with bf16 weights (precision bf16, bf16-sr; no autocast): the MLP block is one autograd node
#   with the residual add and its norm (fusetune.kernels.add_rms_norm_gated_mlp), which keeps the bf16 residual
#   (2h, the next layer's input too), gate and up (2 x 2i), and rebuilds the norm output and the product in the
#   backward; the attention block keeps its norm's output (2h), q/k/v (2q + 4kv) and its output (2q).
# With gradient checkpointing a layer keeps only its input (4h, or 2h in bf16) until its backward recomputes it.
# (The product and the checkpointing case were added after the first comparison with a GPU had left them out:
# benchmarks/results/h100-step.json, section memory-estimate.)
def saved_bytes_per_token_layer(h: int, q: int, kv: int, i: int, fused: bool, bf16_weights: bool) -> int:
    if fused and bf16_weights:
        return 4 * h + 4 * q + 4 * kv + 4 * i
    fused_bytes = 12 * h + 4 * q + 4 * kv + 6 * i
    return fused_bytes if fused else fused_bytes + 8 * h + 4 * q + 4 * kv + 2 * i


# Logits of the micro-batch when the loss is not fused: bf16 logits 2 + their fp32 copy 4 + the saved fp32
# log-softmax 4 + its fp32 gradient 4 at the start of the backward.
UNFUSED_LOGIT_BYTES_PER_TOKEN_PER_VOCAB = 14
# The fused loss holds one chunk of bf16 logits (its gradient is written in place): Liger-Kernel's chunk at
# the shape plus this many bytes. The same rule as fusetune.kernels.fused_linear_cross_entropy_chunk_rows,
# written again here because this module must not import torch; tests/test_estimate.py checks they agree.
FUSED_LOSS_EXTRA_CHUNK_BYTES = 252 * 2**20
# cuBLAS workspaces, the NCCL/DDP buffers and the allocator's rounding and fragmentation (what torch reserves
# beyond what it has allocated), observed at 0.5-2 GiB.
FIXED_OVERHEAD_BYTES = 2 * 2**30
# Offloaded layers whose activations are on the GPU at once: one copied out while the next layer runs forward,
# one copied back ahead of its backward.
OFFLOAD_PREFETCH_LAYERS = 2
# Layers whose gradients exist at once under optimizer_in_backward: one being completed, one being stepped.
OPTIMIZER_IN_BACKWARD_LAYERS_IN_FLIGHT = 2

# The default micro-batch holds at most this many tokens (sequences x max_seq_length) per process: 8 x 2048,
# the end-to-end benchmark shape. Activation memory grows with the tokens of a micro-batch, not with the global
# batch, so a larger batch_size only adds accumulation steps. (The trainer's default, read by the estimate.)
DEFAULT_MICRO_BATCH_TOKENS = 16384


def default_micro_batch_size(sequences_per_process: int, max_seq_length: int) -> int:
    """The largest divisor of `sequences_per_process` whose micro-batch stays within
    DEFAULT_MICRO_BATCH_TOKENS tokens (at least 1 sequence)."""
    limit = max(1, DEFAULT_MICRO_BATCH_TOKENS // max_seq_length)
    return max(d for d in range(1, min(limit, sequences_per_process) + 1) if sequences_per_process % d == 0)


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool

    @classmethod
    def from_config_file(cls, path: Path) -> ModelShape:
        return cls.from_config_dict(json.loads(path.read_text()))

    @classmethod
    def from_config_dict(cls, config: dict) -> ModelShape:
        """From a Hugging Face config.json's fields (a multimodal model's text_config when it has one)."""
        config = config.get("text_config") or config
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        return cls(
            hidden_size=hidden,
            intermediate_size=int(config.get("intermediate_size", 4 * hidden)),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab_size=int(config["vocab_size"]),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        )

    def layer_parameter_count(self) -> int:
        """Parameters of one decoder layer (attention, MLP and its two norms)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h
        mlp = 3 * h * self.intermediate_size
        return attention + mlp + 2 * h

    def parameter_count(self) -> int:
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)
        return self.num_layers * self.layer_parameter_count() + embeddings + self.hidden_size

    def flops_per_token(self, seq_len: int) -> float:
        matmul_params = self.parameter_count() - (
            0 if self.tied_embeddings else self.vocab_size * self.hidden_size
        )
        return 6.0 * matmul_params + 12.0 * self.num_layers * self.num_heads * self.head_dim * seq_len


@dataclass(frozen=True)
class Estimate:
    training_tokens: int
    steps: int
    parameters: int
    micro_batch_size: int  # sequences per forward on one GPU (examples, for a method of paired rows)
    peak_memory_bytes_per_gpu: int
    memory_breakdown: dict[str, int]
    # The plan the memory was estimated for (a dict in as_dict()).
    plan: MemoryPlan
    # Pinned host memory per GPU that the offloaded activations take.
    host_activation_bytes: int
    # Pinned host memory per GPU that the optimizer's state takes (the plan's optimizer_state_on_host).
    host_optimizer_state_bytes: int
    tokens_per_second: float | None
    duration_s: float | None
    throughput_source: str

    def as_dict(self) -> dict:
        return asdict(self)


def _linear_shapes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear layer of a decoder layer, by the module names LoRA targets."""
    h, q, kv, i = (
        shape.hidden_size,
        shape.num_heads * shape.head_dim,
        shape.num_kv_heads * shape.head_dim,
        (shape.intermediate_size),
    )
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip


def lora_parameter_count(shape: ModelShape, r: int, target_modules: list[str] | str) -> int:
    """Parameters of rank-`r` adapters (A: r x in, B: out x r) on the targeted linear layers of every layer."""
    linears = _linear_shapes(shape)
    targets = (
        linears if target_modules == "all-linear" else {n: linears[n] for n in target_modules if n in linears}
    )
    return shape.num_layers * sum(r * (fan_in + fan_out) for fan_in, fan_out in targets.values())


def fused_loss_chunk_rows(tokens: int, shape: ModelShape) -> int:
    """Most rows of the fused loss's bf16 logits chunk under its default budget (before the kernel balances
    the chunks, which only makes them smaller)."""
    row_bytes = shape.vocab_size * 2
    vocab_per_hidden = -(-shape.vocab_size // shape.hidden_size)
    liger_rows = 1 << max(0, (-(-tokens // vocab_per_hidden) - 1).bit_length())
    budget_rows = (min(liger_rows, tokens) * row_bytes + FUSED_LOSS_EXTRA_CHUNK_BYTES) // row_bytes
    return max(1, min(tokens, budget_rows))


@dataclass(frozen=True)
class DataCounts:
    """What the estimate knows of a job's training data: its examples and their token count (estimated from
    characters at upload, exact once tokenized), and the tokens of a padded row when the data is known (its
    longest row), else None: max_seq_length when examples come near it and twice the mean if not."""

    example_count: int
    token_estimate: int
    padded_length: int | None = None


def sequences_per_gpu(job: JobSpec) -> int:
    hyper = job.hyperparameters
    return max(1, hyper.batch_size // hyper.n_gpus)


def job_plan(
    shape: ModelShape, job: JobSpec, micro_batch_size: int | None = None, on_gpu: bool = True
) -> MemoryPlan:
    """The plan a job's own hyperparameters name, with what the planner would choose left at its plainest: the
    trainer's default micro-batch, no recompute (every layer with gradient_checkpointing), no offload, the step
    after the backward."""
    hyper = job.hyperparameters
    micro = micro_batch_size or hyper.micro_batch_size
    if micro is None:
        micro = default_micro_batch_size(sequences_per_gpu(job), hyper.max_seq_length)
    if hyper.recompute_layers is not None:
        recompute = hyper.recompute_layers
    else:
        recompute = shape.num_layers if hyper.gradient_checkpointing else 0
    return MemoryPlan(
        micro_batch_size=micro,
        recompute_layers=recompute,
        offload_layers=hyper.offload_layers or 0,
        precision=mode_for(hyper.precision, on_gpu).name,
        optimizer_in_backward=bool(hyper.optimizer_in_backward),
        optimizer_state_on_host=bool(hyper.optimizer_state_on_host),
    )


def row_tokens(job: JobSpec, data: DataCounts) -> int:
    """Tokens of a padded row: the data's longest when known, else max_seq_length when examples come near it and
    twice the mean if not."""
    hyper, method = job.hyperparameters, METHODS[job.method.type]
    rows = data.example_count * method.rows_per_example
    mean_tokens = max(1, min(hyper.max_seq_length, data.token_estimate // max(1, rows)))
    return data.padded_length or min(hyper.max_seq_length, 2 * mean_tokens)


def _model_state_bytes(shape: ModelShape, job: JobSpec, plan: MemoryPlan, mode: PrecisionMode) -> int:
    """Weights, gradients, optimizer state and a mixed mode's compute-dtype weight copies on one GPU."""
    hyper = job.hyperparameters
    params, layers = shape.parameter_count(), shape.num_layers
    if hyper.lora is not None:
        trained = lora_parameter_count(shape, hyper.lora.r, hyper.lora.target_modules)
        trained_outside_layers = 0
    else:
        trained = params
        trained_outside_layers = params - layers * shape.layer_parameter_count()
    # A mixed mode's autocast keeps a compute-dtype copy of each weight for the backward (the input gradient
    # needs it). A recomputed layer saves nothing in its forward, so its copies are made again, one layer at a
    # time, when the backward recomputes it: only the other layers' copies stay.
    copy = mode.compute_copy_bytes * (layers - plan.recompute_layers) / layers
    weights = (params + (trained if hyper.lora is not None else 0)) * (mode.weight_bytes + copy)
    if plan.optimizer_in_backward:
        # Each gradient is freed once its parameter is updated: a few layers' gradients exist at once, beside the
        # tables outside the layers. A tied embedding's gradient accumulates through the whole backward (the
        # output layer uses it first, the embedding last); untied, the output layer's is stepped and freed at
        # the start and the embedding's is made at the end, so only the larger of a table and the layers counts.
        table = shape.vocab_size * shape.hidden_size
        per_layer = (trained - trained_outside_layers) // layers
        layers_in_flight = OPTIMIZER_IN_BACKWARD_LAYERS_IN_FLIGHT * per_layer
        if trained_outside_layers >= 2 * table:
            in_flight = max(table, layers_in_flight) + trained_outside_layers - 2 * table
        else:
            in_flight = trained_outside_layers + layers_in_flight
        gradients = min(trained, in_flight) * mode.weight_bytes
    else:
        gradients = trained * mode.weight_bytes
    states = int(weights + gradients + optimizer_state_bytes(shape, job, plan)[0])
    # FSDP shards all of it over the GPUs and gathers one layer's weights (in the compute dtype) at a time (two
    # in flight while the next is prefetched).
    if hyper.distributed == "fsdp" and hyper.n_gpus > 1:
        states = states // hyper.n_gpus + 2 * shape.layer_parameter_count() * DTYPE_BYTES[mode.compute_dtype]
    return states


def largest_trained_tensor(shape: ModelShape, job: JobSpec) -> int:
    """Elements of the largest parameter tensor a job trains: the embedding (or output) table, else a layer's
    largest matrix, or with LoRA its largest adapter."""
    hyper = job.hyperparameters
    if hyper.lora is not None:
        targets = hyper.lora.target_modules
        return max(
            hyper.lora.r * max(features)
            for name, features in _linear_shapes(shape).items()
            if targets == "all-linear" or name in targets
        )
    return max(shape.vocab_size * shape.hidden_size, max(a * b for a, b in _linear_shapes(shape).values()))


def optimizer_state_bytes(shape: ModelShape, job: JobSpec, plan: MemoryPlan) -> tuple[int, int]:
    """(on one GPU, in pinned host memory) bytes of the optimizer's state under `plan`: all of it on the GPU, or
    with the state in host memory all of it there and on the GPU the buffers one parameter's state is staged in
    (the largest parameter's size)."""
    hyper, per_parameter = job.hyperparameters, mode_for(plan.precision).optimizer_state_bytes
    if hyper.lora is not None:
        trained = lora_parameter_count(shape, hyper.lora.r, hyper.lora.target_modules)
    else:
        trained = shape.parameter_count()
    whole = int(trained * per_parameter)
    if not plan.optimizer_state_on_host:
        return whole, 0
    return int(largest_trained_tensor(shape, job) * per_parameter), whole


def estimate_job(
    shape: ModelShape,
    job: JobSpec,
    data: DataCounts,
    *,
    micro_batch_size: int | None = None,
    plan: MemoryPlan | None = None,
    measured_tokens_per_second: float | None = None,
) -> Estimate:
    """The job's tokens, memory and duration under `plan` (default: the plan its hyperparameters name, see
    `job_plan`, at `micro_batch_size` when given); `measured_tokens_per_second`: for the duration (earlier jobs
    of the model on this server)."""
    hyper, method = job.hyperparameters, METHODS[job.method.type]
    plan = plan or job_plan(shape, job, micro_batch_size)
    mode = mode_for(plan.precision)
    rows = data.example_count * method.rows_per_example
    epoch_tokens = min(data.token_estimate, rows * hyper.max_seq_length)
    training_tokens = epoch_tokens * hyper.n_epochs
    steps = hyper.n_epochs * max(1, data.example_count // hyper.batch_size)

    # Activations of one micro-batch (padded to its longest sequence).
    tokens = plan.micro_batch_size * method.rows_per_example * row_tokens(job, data)
    h, q, kv = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    bf16_weights = mode.weight_dtype == "bfloat16"
    per_layer = saved_bytes_per_token_layer(h, q, kv, shape.intermediate_size, hyper.kernels, bf16_weights)
    layer_input = (2 if bf16_weights else 4) * h
    recomputed, offloaded = plan.recompute_layers, plan.offload_layers
    kept = shape.num_layers - recomputed - offloaded
    on_gpu_layers = kept + min(offloaded, OFFLOAD_PREFETCH_LAYERS) + (1 if recomputed else 0)
    activations = tokens * (on_gpu_layers * per_layer + recomputed * layer_input)
    if hyper.kernels:
        logits = fused_loss_chunk_rows(tokens, shape) * shape.vocab_size * 2
    else:
        logits = tokens * shape.vocab_size * UNFUSED_LOGIT_BYTES_PER_TOKEN_PER_VOCAB
    breakdown = {"weights_grads_optimizer": _model_state_bytes(shape, job, plan, mode), "activations": activations,
                 "logits": logits, "overhead": FIXED_OVERHEAD_BYTES}  # fmt: skip
    # A forward is about a third of a training step's compute (forward + backward).
    timed_tokens = training_tokens + (epoch_tokens / 3 if method.has_reference_pass else 0)
    measured = measured_tokens_per_second
    return Estimate(
        training_tokens=int(training_tokens),
        steps=steps,
        parameters=shape.parameter_count(),
        micro_batch_size=plan.micro_batch_size,
        peak_memory_bytes_per_gpu=int(sum(breakdown.values())),
        memory_breakdown=breakdown,
        plan=plan,
        host_activation_bytes=tokens * offloaded * per_layer,
        host_optimizer_state_bytes=optimizer_state_bytes(shape, job, plan)[1],
        tokens_per_second=measured,
        duration_s=timed_tokens / measured if measured else None,
        throughput_source="median tokens/s of this model's earlier jobs on this server"
        if measured
        else "no earlier job of this model on this server",
    )


def checkpoint_bytes(shape: ModelShape, job: JobSpec, precision: str) -> int:
    """Bytes of one checkpoint: the weights it saves (in the weights' dtype; the adapter alone for LoRA, plus
    the merged model with merge_lora_on_save) and the training state, whose optimizer part is the optimizer's
    state per trained parameter (fusetune/spec/precision.py: the 8-bit state saves its codes and scales). The
    tokenizer and the small files are left out: megabytes beside gigabytes."""
    hyper, mode = job.hyperparameters, mode_for(precision)
    params = shape.parameter_count()
    if hyper.lora is not None:
        trained = lora_parameter_count(shape, hyper.lora.r, hyper.lora.target_modules)
        saved = trained + (params if hyper.merge_lora_on_save else 0)
    else:
        trained = saved = params
    return int(saved * mode.weight_bytes + trained * mode.optimizer_state_bytes)


def saves_before_the_end(
    job: JobSpec, every_steps: int | None, every_epoch: bool, every_minutes: float | None
) -> bool:
    """Whether a run of `job` may write a checkpoint before its final one under the service's schedule (by steps,
    by minutes, at the end of each of several epochs) or for early stopping's best so far. A run that writes none
    holds only the final checkpoint (and a paused run's, until the final one is whole)."""
    hyper = job.hyperparameters
    by_epoch = every_epoch and hyper.n_epochs > 1
    return bool(every_steps) or bool(every_minutes) or by_epoch or hyper.early_stopping is not None


def checkpoints_on_disk(keep_last_checkpoints: int) -> int:
    """Checkpoints a run holds at most: the kept ones and the next while it is written (the oldest goes only
    once the new one is whole)."""
    return keep_last_checkpoints + 1


def disk_refusal(need_bytes: int, free_bytes: int, per_checkpoint: int, count: int) -> str | None:
    """Why a job's checkpoints cannot fit the free space, or None when they can."""
    if need_bytes <= free_bytes:
        return None
    which = (
        f"{count} checkpoints of {per_checkpoint / 1e9:.1f} GB: the kept ones and the next while it is written"
        if count > 1
        else f"its final checkpoint of {per_checkpoint / 1e9:.1f} GB"
    )
    return (
        f"The job's checkpoints need about {need_bytes / 1e9:.1f} GB of disk ({which}), but the data directory "
        f"has {free_bytes / 1e9:.1f} GB free. Free space, keep fewer checkpoints (FUSETUNE_KEEP_LAST_CHECKPOINTS), "
        "checkpoint only at the end (FUSETUNE_CHECKPOINT_EVERY_MINUTES=0, FUSETUNE_CHECKPOINT_EVERY_STEPS=0), "
        "train LoRA adapters, or use precision bf16-sr-8bit (a smaller optimizer state)."
    )
