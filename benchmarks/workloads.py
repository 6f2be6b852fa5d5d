"""What the benchmarks train on: model shapes of public architectures (random weights, no download) and
generated chat data."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

# Architecture shapes of public checkpoints; weights are random. Keys are transformers config fields.
MODEL_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-3.2-1b-shape": (
        "llama",
        {
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "vocab_size": 128256,
            "tie_word_embeddings": True,
            "rope_theta": 500000.0,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 131072,
            "hidden_act": "silu",
        },
    ),
    "qwen2.5-1.5b-shape": (
        "qwen2",
        {
            "hidden_size": 1536,
            "intermediate_size": 8960,
            "num_hidden_layers": 28,
            "num_attention_heads": 12,
            "num_key_value_heads": 2,
            "vocab_size": 151936,
            "tie_word_embeddings": True,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 32768,
            "hidden_act": "silu",
        },
    ),
    "gemma-2-2b-shape": (
        "gemma2",
        {
            "hidden_size": 2304,
            "intermediate_size": 9216,
            "num_hidden_layers": 26,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "vocab_size": 256000,
            "tie_word_embeddings": True,
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 8192,
            "hidden_activation": "gelu_pytorch_tanh",
            "final_logit_softcapping": 30.0,
            "attn_logit_softcapping": 50.0,
            "query_pre_attn_scalar": 256,
            "sliding_window": 4096,
        },
    ),
    # Families without a row in fusetune's table, patched by structure (fusetune/models/recognize.py); e2e
    # runs them at batch 4 x 2048, where Hugging Face unpatched still fits on one 80 GB GPU.
    "olmo-2-1b-shape": (
        "olmo2",
        {
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "vocab_size": 100352,
            "tie_word_embeddings": False,
            "rope_theta": 500000.0,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 4096,
            "hidden_act": "silu",
        },
    ),
    "granite-3.3-2b-shape": (
        "granite",
        {
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 40,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 49159,
            "tie_word_embeddings": True,
            "rope_theta": 10000000.0,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 131072,
            "hidden_act": "silu",
            "embedding_multiplier": 12.0,
            "attention_multiplier": 0.015625,
            "residual_multiplier": 0.22,
            "logits_scaling": 8.0,
        },
    ),
    "smollm3-3b-shape": (
        "smollm3",
        {
            "hidden_size": 2048,
            "intermediate_size": 11008,
            "num_hidden_layers": 36,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "vocab_size": 128256,
            "tie_word_embeddings": True,
            "rope_theta": 5000000.0,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 65536,
            "hidden_act": "silu",
            "no_rope_layer_interval": 4,
            "pad_token_id": None,  # the config's default (128004) is outside the tiny variant's vocabulary
        },
    ),
    # For multi-GPU runs (benchmarks.scaling.gpus with FSDP2): too large to train in full on one GPU at 8 x 2048.
    "llama-3-8b-shape": (
        "llama",
        {
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 128256,
            "tie_word_embeddings": False,
            "rope_theta": 500000.0,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 8192,
            "hidden_act": "silu",
        },
    ),
    # The 8B-class shapes users fine-tune in full on one GPU (benchmarks.step.memory_plans); Llama-3.1-8B's is
    # added below the table, from Llama-3-8B's.
    "qwen2.5-7b-shape": (
        "qwen2",
        {
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "vocab_size": 152064,
            "tie_word_embeddings": False,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 131072,
            "hidden_act": "silu",
        },
    ),
}

# Llama-3.1-8B is Llama-3-8B's shape with a longer context; its rope scaling does not change the work of a step.
MODEL_SHAPES["llama-3.1-8b-shape"] = (
    "llama",
    {**MODEL_SHAPES["llama-3-8b-shape"][1], "max_position_embeddings": 131072},
)

# The shapes that train in full on one 80 GB GPU at 8 x 2048 (the default of benchmarks.step.e2e).
SINGLE_GPU_MODELS = ("llama-3.2-1b-shape", "qwen2.5-1.5b-shape", "gemma-2-2b-shape")

# For smoke tests on a CPU: the same families, a few thousand parameters.
TINY_OVERRIDES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "max_position_embeddings": 256,
}

CONFIG_CLASSES = {
    "llama": "LlamaConfig",
    "qwen2": "Qwen2Config",
    "gemma2": "Gemma2Config",
    "olmo2": "Olmo2Config",
    "granite": "GraniteConfig",
    "smollm3": "SmolLM3Config",
}
# The shapes of families fusetune patches by structure (no row in its table).
STRUCTURE_MODELS = ("olmo-2-1b-shape", "granite-3.3-2b-shape", "smollm3-3b-shape")


def build_config(model: str, tiny: bool) -> Any:
    """The transformers config of a model shape (its tiny version with `tiny`)."""
    import transformers

    family, fields = MODEL_SHAPES[model]
    if tiny:
        fields = {**fields, **TINY_OVERRIDES}
        if family == "gemma2":
            fields["query_pre_attn_scalar"] = fields["head_dim"]
    return getattr(transformers, CONFIG_CLASSES[family])(**fields)


def chat_examples(n_examples: int, mean_tokens: int, seed: int, tokenizer) -> tuple[list[dict], list[int]]:
    """Chat examples whose templated lengths are spread around `mean_tokens` (log-normal, as real chat data
    is), and those lengths. Text is made of digit groups and words the demo tokenizer knows."""
    rng = random.Random(seed)
    words = ["What", "is", "the", "sum", "answer", "plus", "minus", "of", "and", "Reply"]

    def text(n_pieces: int) -> str:
        return " ".join(
            rng.choice(words) if rng.random() < 0.5 else str(rng.randrange(10, 10_000))
            for _ in range(n_pieces)
        )

    examples, lengths = [], []
    for _ in range(n_examples):
        target = max(32, min(int(rng.lognormvariate(-0.1, 0.45) * mean_tokens), 3 * mean_tokens))
        # About 3.5 tokens per piece with this tokenizer; the real length is measured below.
        question_pieces = max(4, int(target * 0.3 / 3.5))
        answer_pieces = max(4, int(target * 0.7 / 3.5))
        example = {
            "messages": [
                {"role": "system", "content": "You are a precise assistant."},
                {"role": "user", "content": text(question_pieces)},
                {"role": "assistant", "content": text(answer_pieces)},
            ]
        }
        examples.append(example)
        ids = tokenizer.apply_chat_template(example["messages"], tokenize=True, return_dict=True)["input_ids"]
        lengths.append(len(ids))
    return examples, lengths


def build_model(models_dir: Path, model_name: str, tiny: bool = False) -> Path:
    """A model shape (its tiny version with `tiny`) with random weights (seed 0) and the demo tokenizer, saved
    in bf16 as a job's model: the model of the service, trainer-step and DPO benchmarks."""
    import torch
    from transformers import AutoModelForCausalLM

    from fusetune.demo.assets import build_tokenizer

    out = models_dir / model_name
    tokenizer = build_tokenizer()
    config = build_config(model_name, tiny=tiny)
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(0)
    # Initialised on the GPU where there is one: an 8B model's random init takes minutes on the host's cores.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


# The serving benchmarks' tokenizer: the demo tokenizer's chat template, a fast (Rust) decoder over the model's
# vocabulary.
#
# The benchmarks build models of real shapes with random weights (a Llama-3.2-1B shape has 128,256 token ids) and no
# tokenizer of that size can be downloaded here. The demo tokenizer (byte-level BPE, 512 tokens) writes the prompts;
# the sampled ids, anywhere in the model's vocabulary, are decoded by a `tokenizers` WordLevel model with one printable
# word per id. The engine decodes a completion through a fast tokenizer's `backend_tokenizer` (the Rust decoder, as it
# does a real model's tokenizer; fusetune/serving/detokenize.py), so the host's work per token is a real tokenizer's,
# not a Python wrapper's: an earlier wrapper that folded the ids onto the demo's 512 in Python cost the benchmark a
# fifth of its step time on the CPU machine (4.8 against 3.1 ms a step of 64 rows, through the HTTP server).
#
# No end-of-turn token: `eos_token_id` is None, so every completion runs to its token limit.
class BenchTokenizer:
    """The demo tokenizer's chat template and a fast (Rust) decoder over a model's vocabulary, for the serving
    benchmarks (see the comment above)."""

    eos_token_id = None

    def __init__(self, vocab_size: int):
        from tokenizers import Tokenizer, models

        from fusetune.demo.assets import build_tokenizer

        self._chat = build_tokenizer()
        words = {f"w{i}": i for i in range(vocab_size)}
        self.backend_tokenizer = Tokenizer(models.WordLevel(words, unk_token="w0"))

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        return self._chat.apply_chat_template(*args, **kwargs)

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return self.backend_tokenizer.decode(ids, skip_special_tokens=True)


def serving_model(model_name: str, device: Any, tiny: bool = False) -> tuple[Any, BenchTokenizer]:
    """The serving benchmarks' model and tokenizer: a model shape (its tiny version with `tiny`) with random weights
    (seed 0), built on `device` in bf16 on a GPU and fp32 on a CPU, whose generation config names no end of turn,
    so that every completion runs to its token limit; and a BenchTokenizer of its vocabulary."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(build_config(model_name, tiny=tiny), dtype=dtype)
    model.generation_config.eos_token_id = None
    return model.eval(), BenchTokenizer(model.config.vocab_size)
