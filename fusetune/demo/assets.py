"""Demo assets that need no network: a learnable chat dataset and a tiny randomly initialised model.

No model or dataset hub is reachable from the machines fusetune runs on, so the demo makes its own:

* `write_demo_dataset` writes OpenAI-style chat examples (two-digit arithmetic and word reversal). The task is
  easy enough that a tiny model's loss visibly falls within a short CPU run, which is what the tests that train
  need; `make demo` trains on the task of `task.py` instead, which the model learns to answer right. The
  bundled `arithmetic*.jsonl` files under `fusetune/demo/data/` are produced by `write_bundled_datasets` and a
  test checks they still match it.
* `build_tiny_model` trains a byte-level BPE tokenizer on that text, gives it a chat template, builds a small
  causal LM from a config with random weights and saves both with `save_pretrained`, so the Auto classes load
  the directory offline.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

DATA_DIR = Path(__file__).parent / "data"
TRAIN_FILE = DATA_DIR / "arithmetic.jsonl"
VALID_FILE = DATA_DIR / "arithmetic_valid.jsonl"
PREFERENCE_FILE = DATA_DIR / "arithmetic_preference.jsonl"
BUNDLED_TRAIN_EXAMPLES = 512
BUNDLED_VALID_EXAMPLES = 64

SYSTEM_PROMPT = "You are a precise assistant. Reply with the answer only."

BOS_TOKEN = "<|bos|>"
# One token closes every turn; it is also the tokenizer's eos, so a trained model learns to stop after answering.
END_OF_TURN_TOKEN = "<|eot|>"
PAD_TOKEN = "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (BOS_TOKEN, END_OF_TURN_TOKEN, PAD_TOKEN, *ROLE_TOKENS)

# The `{% generation %}` block marks the assistant's reply (including the end-of-turn token, so the model learns
# to stop), which lets `apply_chat_template(..., return_assistant_tokens_mask=True)` find the trained tokens.
# An assistant turn's tool calls follow its content as JSON; tool results are a turn of role "tool".
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|assistant|>\\n' }}"
    "{%- generation %}{{- message['content'] or '' }}"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] %}{{- message['tool_calls'] | tojson }}"
    "{%- endif %}{{- eos_token }}{%- endgeneration %}"
    "{%- else %}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] + eos_token }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)

# Small enough to train in seconds on a CPU, big enough to learn the demo task's format and most answers.
TINY_MODEL_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
TINY_VOCAB_SIZE = 512


def _chat(question: str, answer: str) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ]
    }


def _random_example(rng: random.Random) -> dict[str, Any]:
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randrange(100), rng.randrange(100)
        return _chat(f"What is {a} + {b}?", str(a + b))
    if kind == 1:
        a, b = sorted((rng.randrange(100), rng.randrange(100)), reverse=True)
        return _chat(f"What is {a} - {b}?", str(a - b))
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6)))
    return _chat(f"Reverse the word: {word}", word[::-1])


def demo_examples(n_examples: int, seed: int = 0, exclude: set[str] | None = None) -> list[dict[str, Any]]:
    """`n_examples` distinct chat examples, the same for the same seed; questions in `exclude` are skipped."""
    rng = random.Random(seed)
    seen = set(exclude or ())
    examples: list[dict[str, Any]] = []
    while len(examples) < n_examples:
        example = _random_example(rng)
        question = example["messages"][1]["content"]
        if question in seen:
            continue
        seen.add(question)
        examples.append(example)
    return examples


def write_jsonl(path: str | Path, examples: list[dict[str, Any]]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for example in examples:
            f.write(json.dumps(example, ensure_ascii=False) + "\n")
    return path


def write_demo_dataset(path: str | Path, n_examples: int = BUNDLED_TRAIN_EXAMPLES, seed: int = 0) -> Path:
    """Write `n_examples` demo chat examples as JSON Lines to `path`."""
    return write_jsonl(path, demo_examples(n_examples, seed=seed))


def preference_example(chat: dict[str, Any]) -> dict[str, Any]:
    """A demo chat as a DPO pair: its correct answer preferred over a wrong one of the same kind (the
    arithmetic result 10 off, the word not reversed), a preference a small model learns quickly."""
    *prompt, answer = chat["messages"]
    correct = answer["content"]
    if prompt[-1]["content"].startswith("Reverse the word: "):
        wrong = correct[::-1]
    else:
        value = int(correct)
        wrong = str(value + 10 if value < 10 else value - 10)
    return {
        "input": {"messages": prompt},
        "preferred_output": [{"role": "assistant", "content": correct}],
        "non_preferred_output": [{"role": "assistant", "content": wrong}],
    }


def write_preference_dataset(path: str | Path, n_examples: int = 64, seed: int = 0) -> Path:
    """Write `n_examples` demo preference pairs (OpenAI's DPO format) as JSON Lines to `path`."""
    return write_jsonl(path, [preference_example(chat) for chat in demo_examples(n_examples, seed=seed)])


def bundled_examples() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The training and validation examples of the bundled files; no validation question is in the training set."""
    train = demo_examples(BUNDLED_TRAIN_EXAMPLES, seed=0)
    questions = {example["messages"][1]["content"] for example in train}
    valid = demo_examples(BUNDLED_VALID_EXAMPLES, seed=1, exclude=questions)
    return train, valid


def write_bundled_datasets(data_dir: str | Path = DATA_DIR) -> tuple[Path, Path]:
    """Regenerate `arithmetic.jsonl` and `arithmetic_valid.jsonl` (run after changing the generator)."""
    train, valid = bundled_examples()
    data_dir = Path(data_dir)
    write_preference_dataset(data_dir / PREFERENCE_FILE.name, seed=0)
    return write_jsonl(data_dir / TRAIN_FILE.name, train), write_jsonl(data_dir / VALID_FILE.name, valid)


def _texts_for_tokenizer(examples: list[dict[str, Any]]) -> Iterator[str]:
    for example in examples:
        for message in example["messages"]:
            yield message["content"]


def build_tokenizer(examples: list[dict[str, Any]] | None = None, vocab_size: int = TINY_VOCAB_SIZE):
    """A byte-level BPE tokenizer trained on the demo text, wrapped as a `PreTrainedTokenizerFast`.

    Byte-level means any text encodes (no unknown token). Digits are split one per token so that arithmetic is
    learnable digit by digit.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if examples is None:
        examples = bundled_examples()[0]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_texts_for_tokenizer(examples), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=END_OF_TURN_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS),
        padding_side="right",
        model_max_length=TINY_MODEL_SHAPE["max_position_embeddings"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(
    out_dir: str | Path,
    model_type: str = "llama",
    seed: int = 0,
    *,
    examples: list[dict[str, Any]] | None = None,
    shape: dict[str, Any] | None = None,
) -> Path:
    """Save a tokenizer and a tiny randomly initialised causal LM of `model_type` to `out_dir`.

    Any family whose config accepts the usual Llama-style size arguments works (llama, mistral, qwen2, qwen3,
    ...); the weights depend only on `seed`, and the global torch RNG is left as it was. The tokenizer is
    trained on `examples` (default: the bundled arithmetic) and the model has `shape` (default
    `TINY_MODEL_SHAPE`).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(examples)
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        **(shape or TINY_MODEL_SHAPE),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Generation should stop at the end of the assistant's turn.
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


if __name__ == "__main__":
    for written in write_bundled_datasets():
        print(f"wrote {written}")
