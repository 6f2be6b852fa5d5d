"""The demo's task: write four spelled-out digits as a number ("Write in digits: two nine one four" -> "2914").

A tiny model with random weights learns this for real in a short CPU run, and what it learns carries over to
prompts it never saw: each answer digit is the image of one word at a fixed distance back in the prompt, so an
attention head that looks that far back and a ten-entry lookup answer every one of the 10,000 prompts.

What chose the settings (runs in one process of the same model code and chat template, batch 16, greedy answers
to 50 held-out prompts every 24-32 steps, seeds 0-3): with the tests' tiny model (hidden size 64) and the
arithmetic data's system prompt before the question, three-digit prompts were 0% right after 192 steps on one
seed of two; without the system prompt, at learning rate 1e-2, the four seeds answered every prompt right from
steps 64, 160, 224 and 64; at hidden size 128 and learning rate 3e-3, every seed did from step 48, for three
digits (seeds 0-3) and for four (seeds 0-2). Prompts of 2 to 5 digits were about half right after 192 steps
on two seeds of three, so the length is fixed.

Held-out prompts are honest: the bundled held-out file shares no question with the training file (a test
checks it), and it is uploaded as the job's validation file, which is evaluated and never trained on.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusetune.demo.assets import DATA_DIR, write_jsonl

TASK_NAME = "digits-from-words"
# The name of the base model the demo fine-tunes, which `fusetune serve` also builds and offers when it has none.
BUNDLED_MODEL = "tiny-llama"
# The base model is rebuilt when its folder was made for another task (an older demo's tokenizer knows other text).
TASK_MARKER_FILE = "fusetune_demo_task.txt"
TRAIN_FILE = DATA_DIR / "digits.jsonl"
HELD_OUT_FILE = DATA_DIR / "digits_held_out.jsonl"
TRAIN_EXAMPLES = 1024
HELD_OUT_EXAMPLES = 64
DIGITS_PER_PROMPT = 4
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
QUESTION_PREFIX = "Write in digits: "

# Twice the width of the tests' tiny model (fusetune.demo.assets.TINY_MODEL_SHAPE): the narrower one found the
# attention pattern late on some seeds (see the module's docstring).
MODEL_SHAPE: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}

# The job the demo submits: 1024 examples x 2 epochs / 16 = 128 optimizer steps. Every seed tried answered all
# held-out prompts right from step 48, and the demo's job (seed 0, two processes) does at its first evaluation,
# step 64; a third epoch added only time.
JOB_HYPERPARAMETERS: dict[str, Any] = {
    "n_epochs": 2,
    "batch_size": 16,
    "learning_rate": 3e-3,
    "warmup_ratio": 0.05,
}


def example(digits: list[int]) -> dict[str, Any]:
    """One chat example: the digits spelled out in the question, written as a number in the answer.

    No system prompt: the answer's attention then has a short prompt to search, which is what made the task
    learnable in a few dozen steps.
    """
    question = QUESTION_PREFIX + " ".join(NUMBER_WORDS[digit] for digit in digits)
    answer = "".join(str(digit) for digit in digits)
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def examples(n_examples: int, seed: int, exclude: set[str] | None = None) -> list[dict[str, Any]]:
    """`n_examples` distinct examples, the same for the same seed; questions in `exclude` are skipped."""
    rng = random.Random(seed)
    seen = set(exclude or ())
    chosen: list[dict[str, Any]] = []
    while len(chosen) < n_examples:
        candidate = example([rng.randrange(10) for _ in range(DIGITS_PER_PROMPT)])
        question = candidate["messages"][0]["content"]
        if question not in seen:
            seen.add(question)
            chosen.append(candidate)
    return chosen


def bundled_examples() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The training examples and the held-out ones; no held-out question is in the training set."""
    train = examples(TRAIN_EXAMPLES, seed=0)
    held_out = examples(HELD_OUT_EXAMPLES, seed=1, exclude={question(e) for e in train})
    return train, held_out


def write_bundled_files(data_dir: str | Path = DATA_DIR) -> tuple[Path, Path]:
    """Regenerate the bundled training and held-out files (run after changing the generator)."""
    train, held_out = bundled_examples()
    data_dir = Path(data_dir)
    train_file = write_jsonl(data_dir / TRAIN_FILE.name, train)
    return train_file, write_jsonl(data_dir / HELD_OUT_FILE.name, held_out)


def read_examples(path: str | Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def question(chat: dict[str, Any]) -> str:
    return chat["messages"][0]["content"]


def expected_answer(chat: dict[str, Any]) -> str:
    return chat["messages"][-1]["content"]


@contextmanager
def _no_progress_bars() -> Iterator[None]:
    """Without transformers' progress bars for saving and loading a model of a few hundred kB, which would
    interleave with the demo's output; restored afterwards (a test process may want them)."""
    from transformers.utils import logging

    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            logging.enable_progress_bar()


def build_base_model(out_dir: str | Path) -> Path:
    """The demo's base model: a tiny Llama with random weights and a tokenizer trained on the task's text."""
    from fusetune.demo.assets import build_tiny_model

    with _no_progress_bars():
        out_dir = build_tiny_model(out_dir, examples=bundled_examples()[0], shape=MODEL_SHAPE)
    (out_dir / TASK_MARKER_FILE).write_text(TASK_NAME + "\n")
    return out_dir


def ensure_base_model(out_dir: str | Path) -> tuple[Path, bool]:
    """The base model in `out_dir`, built unless it is there for this task already; returns (folder, built)."""
    out_dir = Path(out_dir)
    marker = out_dir / TASK_MARKER_FILE
    if (out_dir / "config.json").exists() and marker.exists() and marker.read_text().strip() == TASK_NAME:
        return out_dir, False
    return build_base_model(out_dir), True


@dataclass(frozen=True)
class Answers:
    """A model's greedy answers to the held-out prompts, scored by exact match."""

    answers: list[str]
    expected: list[str]

    @property
    def correct(self) -> int:
        return sum(answer == want for answer, want in zip(self.answers, self.expected, strict=True))

    @property
    def accuracy(self) -> float:
        return self.correct / len(self.expected)


def answer_held_out(model_dir: str | Path, chats: list[dict[str, Any]]) -> Answers:
    """Load `model_dir` as a user would (`from_pretrained`) and answer each chat's question greedily.

    Prompts of the same token count are answered as one batch (all of them, for this task): no padding, so
    each answer is what the prompt alone gets, and one `generate` call instead of one per prompt, which took
    20 s for the 64 held-out prompts on a busy 2-core machine."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with _no_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.eval()
    prompts = [
        tokenizer.apply_chat_template(chat["messages"][:-1], add_generation_prompt=True)["input_ids"]
        for chat in chats
    ]
    by_length: dict[int, list[int]] = {}
    for index, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(index)
    answers = [""] * len(chats)
    with torch.inference_mode():
        for length, indices in by_length.items():
            input_ids = torch.tensor([prompts[i] for i in indices])
            # Room for the answer and its end-of-turn token, and a little more so that a wrong length shows.
            output = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=DIGITS_PER_PROMPT + 3,
                do_sample=False,
            )
            for row, index in enumerate(indices):
                answers[index] = tokenizer.decode(output[row, length:], skip_special_tokens=True).strip()
    return Answers(answers=answers, expected=[expected_answer(chat) for chat in chats])


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == [
        "--build-base-model"
    ]:  # `fusetune serve` builds the bundled model in a child process
        print(f"built {ensure_base_model(sys.argv[2])[0]}")
    else:
        for written in write_bundled_files():
            print(f"wrote {written}")
