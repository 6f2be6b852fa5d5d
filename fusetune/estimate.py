"""Up-front estimates for a job: training tokens, peak GPU memory per GPU and duration.

Computed from the model's config.json (no weights loaded), the dataset's counts and the job's settings.
The memory model follows what the trainer does: bf16 autocast over fp32 master weights, fp32 gradients and two
fp32 AdamW moments, i.e. 16 bytes per trained parameter, plus the activations of one micro-batch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

BYTES_PER_TRAINED_PARAM = 16  # fp32 weight 4 + fp32 grad 4 + AdamW exp_avg 4 + exp_avg_sq 4
BYTES_PER_FROZEN_PARAM = 4  # fp32 weight only
# Activation bytes kept for the backward, per token per layer, as a multiple of hidden_size (bf16). Sources:
# attention inputs/outputs and norms (~10 h), the gated MLP's gate/up/product (~3 * intermediate). Measured
# values replace this once GPU runs calibrate it (benchmarks/results/*-estimate.json).
ACTIVATION_HIDDEN_MULTIPLE = 18
ACTIVATION_INTERMEDIATE_MULTIPLE = 6
# Logits of the whole batch in fp32 (and their gradient) when the loss is not fused.
UNFUSED_LOGIT_BYTES_PER_TOKEN_PER_VOCAB = 12
# CUDA context, cuBLAS workspaces, allocator slack.
FIXED_OVERHEAD_BYTES = 2 * 2**30


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
        config = json.loads(path.read_text())
        config = config.get("text_config", config)
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
    peak_memory_bytes_per_gpu: int
    memory_breakdown: dict[str, int]
    tokens_per_second: float | None
    duration_s: float | None
    throughput_source: str

    def as_dict(self) -> dict:
        return asdict(self)


def estimate_job(
    shape: ModelShape,
    *,
    example_count: int,
    token_estimate: int,
    n_epochs: int,
    batch_size: int,
    max_seq_length: int,
    n_gpus: int,
    fused_kernels: bool,
    measured_tokens_per_second: float | None = None,
) -> Estimate:
    mean_tokens = max(1, min(max_seq_length, token_estimate // max(1, example_count)))
    training_tokens = min(token_estimate, example_count * max_seq_length) * n_epochs
    steps = n_epochs * max(1, example_count // batch_size)
    params = shape.parameter_count()
    states = params * BYTES_PER_TRAINED_PARAM
    micro_batch = max(1, batch_size // n_gpus)
    # Padded batches: every sequence of the micro-batch is as long as its longest; take max_seq_length as bound
    # when examples come near it, else twice the mean.
    padded = min(max_seq_length, 2 * mean_tokens)
    tokens = micro_batch * padded
    per_token_layer = 2 * (ACTIVATION_HIDDEN_MULTIPLE * shape.hidden_size
                           + ACTIVATION_INTERMEDIATE_MULTIPLE * shape.intermediate_size // 2)  # fmt: skip
    activations = tokens * shape.num_layers * per_token_layer
    logits = 0 if fused_kernels else tokens * shape.vocab_size * UNFUSED_LOGIT_BYTES_PER_TOKEN_PER_VOCAB
    breakdown = {"weights_grads_optimizer": states, "activations": activations, "logits": logits,
                 "overhead": FIXED_OVERHEAD_BYTES}  # fmt: skip
    duration = training_tokens / measured_tokens_per_second if measured_tokens_per_second else None
    return Estimate(
        training_tokens=int(training_tokens),
        steps=steps,
        parameters=params,
        peak_memory_bytes_per_gpu=int(sum(breakdown.values())),
        memory_breakdown=breakdown,
        tokens_per_second=measured_tokens_per_second,
        duration_s=duration,
        throughput_source="median tokens/s of this model's earlier jobs on this server"
        if measured_tokens_per_second
        else "no earlier job of this model on this server",
    )
