"""Up-front estimates for a job: training tokens, peak GPU memory per GPU and duration.

Computed from the model's config.json (no weights loaded), the dataset's counts and the job's settings. The
memory model follows what the trainer does on a GPU (precision "auto" = bf16-sr: bf16 weights, gradients and
AdamW state; bf16-mixed: fp32 weights and state, bf16 compute under autocast; activations of one micro-batch
kept for the backward); the bytes of weights, gradients and optimizer state per parameter come from the
precision mode and its optimizer (fusetune/spec/precision.py). Each term is
derived from the tensors that stay alive at the peak (the start of the backward), not fitted; the check
against measured peaks on a GPU is benchmarks/step/memory_estimate.py (benchmarks/results/h100-step.json, section
memory-estimate).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from fusetune.spec.hyperparameters import LoraSpec
from fusetune.spec.job import JobSpec
from fusetune.spec.methods import METHODS
from fusetune.spec.precision import DTYPE_BYTES, PrecisionMode, mode_for


def bytes_per_trained_param(mode: PrecisionMode) -> float:
    """Weight + gradient (both in the weights' dtype) + the optimizer's state; under bf16-mixed 4 + 4 + 8."""
    return 2 * mode.weight_bytes + mode.optimizer_state_bytes


def bytes_per_frozen_param(mode: PrecisionMode) -> int:
    """LoRA's base model: the weight only."""
    return mode.weight_bytes


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
def _saved_bytes_per_token_layer(h: int, q: int, kv: int, i: int, fused: bool, bf16_weights: bool) -> int:
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

    def parameter_count(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h
        mlp = 3 * h * self.intermediate_size
        per_layer = attention + mlp + 2 * h
        embeddings = self.vocab_size * h * (1 if self.tied_embeddings else 2)
        return self.num_layers * per_layer + embeddings + h

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


def estimate_job(
    shape: ModelShape,
    job: JobSpec,
    data: DataCounts,
    *,
    micro_batch_size: int | None = None,
    measured_tokens_per_second: float | None = None,
) -> Estimate:
    """`micro_batch_size`: sequences per forward on one GPU, the trainer's default when None;
    `measured_tokens_per_second`: for the duration (earlier jobs of the model on this server)."""
    hyper, method = job.hyperparameters, METHODS[job.method.type]
    n_epochs, batch_size, max_seq_length, n_gpus = (
        hyper.n_epochs, hyper.batch_size, hyper.max_seq_length, hyper.n_gpus,
    )  # fmt: skip
    example_count, token_estimate, rows_per_example = (
        data.example_count,
        data.token_estimate,
        method.rows_per_example,
    )
    mode = mode_for(hyper.precision, on_gpu=True)
    rows = example_count * rows_per_example
    mean_tokens = max(1, min(max_seq_length, token_estimate // max(1, rows)))
    epoch_tokens = min(token_estimate, rows * max_seq_length)
    training_tokens = epoch_tokens * n_epochs
    steps = n_epochs * max(1, example_count // batch_size)
    params = shape.parameter_count()

    # Weights, gradients and optimizer state; FSDP shards all three over the GPUs and gathers one layer's
    # weights (in the compute dtype) at a time (two in flight while the next is prefetched).
    if hyper.lora is not None:
        trained = lora_parameter_count(shape, hyper.lora.r, hyper.lora.target_modules)
        frozen = params
    else:
        trained, frozen = params, 0
    # A mixed mode's autocast keeps a compute-dtype copy of each weight for the backward (the input gradient
    # needs it). Under gradient checkpointing the forward saves nothing inside the layers, so the copies are
    # made again, one layer at a time, when the backward recomputes it.
    copy = 0 if hyper.gradient_checkpointing else mode.compute_copy_bytes
    states = int(
        trained * (bytes_per_trained_param(mode) + copy) + frozen * (bytes_per_frozen_param(mode) + copy)
    )
    if hyper.distributed == "fsdp" and n_gpus > 1:
        layer_params = (params - shape.vocab_size * shape.hidden_size) // shape.num_layers
        states = states // n_gpus + 2 * layer_params * DTYPE_BYTES[mode.compute_dtype]

    # Activations of one micro-batch (the trainer's default micro-batch; padded to its longest sequence, taken
    # as max_seq_length when examples come near it, else twice the mean).
    sequences_per_gpu = max(1, batch_size // n_gpus)
    micro_batch = micro_batch_size or default_micro_batch_size(sequences_per_gpu, max_seq_length)
    row_tokens = data.padded_length or min(max_seq_length, 2 * mean_tokens)
    tokens = micro_batch * rows_per_example * row_tokens
    h, q, kv = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    bf16_weights = mode.weight_dtype == "bfloat16"
    fused_kernels = hyper.kernels
    per_layer = _saved_bytes_per_token_layer(h, q, kv, shape.intermediate_size, fused_kernels, bf16_weights)
    if hyper.gradient_checkpointing:
        activations = tokens * (shape.num_layers * (2 if bf16_weights else 4) * h + per_layer)
    else:
        activations = tokens * shape.num_layers * per_layer
    if fused_kernels:
        logits = fused_loss_chunk_rows(tokens, shape) * shape.vocab_size * 2
    else:
        logits = tokens * shape.vocab_size * UNFUSED_LOGIT_BYTES_PER_TOKEN_PER_VOCAB
    breakdown = {"weights_grads_optimizer": states, "activations": activations, "logits": logits,
                 "overhead": FIXED_OVERHEAD_BYTES}  # fmt: skip
    # A forward is about a third of a training step's compute (forward + backward).
    timed_tokens = training_tokens + (epoch_tokens / 3 if method.has_reference_pass else 0)
    duration = timed_tokens / measured_tokens_per_second if measured_tokens_per_second else None
    return Estimate(
        training_tokens=int(training_tokens),
        steps=steps,
        parameters=params,
        micro_batch_size=micro_batch,
        peak_memory_bytes_per_gpu=int(sum(breakdown.values())),
        memory_breakdown=breakdown,
        tokens_per_second=measured_tokens_per_second,
        duration_s=duration,
        throughput_source="median tokens/s of this model's earlier jobs on this server"
        if measured_tokens_per_second
        else "no earlier job of this model on this server",
    )


# What may make a job fit that does not, tried one at a time by `fit_micro_batch`.
_REMEDIES: tuple[tuple[str, dict], ...] = (
    ("kernels on", {"kernels": True}),
    ("gradient_checkpointing on", {"gradient_checkpointing": True}),
    ("LoRA (r=16)", {"lora": LoraSpec(r=16, target_modules="all-linear")}),
)


@dataclass(frozen=True)
class MicroBatchFit:
    """The estimate at the largest micro-batch that fits (or at 1 when none does), and, when none does, what
    would make the job fit at micro-batch 1 with its peak."""

    estimate: Estimate
    fits: bool
    remedies: dict[str, int]

    def refusal(self, memory_bytes: int) -> str:
        return too_large_message(self.estimate.peak_memory_bytes_per_gpu, memory_bytes, self.remedies)


def too_large_message(peak_bytes: int, memory_bytes: int, remedies: dict[str, int] | None) -> str:
    """Why a job does not fit one GPU, and what would make it fit."""
    text = (
        f"The job needs about {peak_bytes / 2**30:.1f} GiB per GPU even at micro_batch_size 1, more than the "
        f"{memory_bytes / 2**30:.1f} GiB a GPU has for it."
    )
    if remedies:
        options = ", ".join(f"{name} ({peak / 2**30:.1f} GiB)" for name, peak in remedies.items())
        return f"{text} It would fit with: {options}."
    return f"{text} Use a smaller max_seq_length, FSDP over more GPUs, or a smaller model."


def fit_micro_batch(
    shape: ModelShape,
    memory_bytes: int,
    job: JobSpec,
    data: DataCounts,
    measured_tokens_per_second: float | None = None,
) -> MicroBatchFit:
    """The largest micro-batch (a divisor of the sequences per GPU) whose estimated peak fits `memory_bytes`.
    Larger micro-batches need fewer accumulation steps, and fewer, larger matmuls run closer to the GPU's
    peak."""
    hyper = job.hyperparameters
    sequences_per_gpu = max(1, hyper.batch_size // hyper.n_gpus)
    for micro in sorted(
        (d for d in range(1, sequences_per_gpu + 1) if sequences_per_gpu % d == 0), reverse=True
    ):
        estimate = estimate_job(
            shape, job, data, micro_batch_size=micro, measured_tokens_per_second=measured_tokens_per_second
        )
        if estimate.peak_memory_bytes_per_gpu <= memory_bytes:
            return MicroBatchFit(estimate, True, {})
    remedies = {}
    for name, change in _REMEDIES:
        if all(getattr(hyper, key) == value for key, value in change.items()):
            continue  # already so
        changed = job.model_copy(update={"hyperparameters": hyper.model_copy(update=change)})
        peak = estimate_job(shape, changed, data, micro_batch_size=1).peak_memory_bytes_per_gpu
        if peak <= memory_bytes:
            remedies[name] = peak
    return MicroBatchFit(estimate, False, remedies)
