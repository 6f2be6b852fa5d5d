"""Supervised fine-tuning: next-token cross-entropy on the trained tokens of each example.

Three line formats, which may be mixed in one file:
- `{"messages": [...]}`: an OpenAI-style chat (system, user, assistant, tool). It goes through the tokenizer's
  own chat template; the loss is on the assistant's turns only (unless `train_on_inputs`). An assistant
  message with `"weight": 0` gets no loss either way (the weight of other roles is ignored, as OpenAI does); an
  assistant message that only calls tools (`tool_calls`) may have null content.
- `{"prompt": str, "completion": str}`: plain text; the loss is on the completion (and the end-of-sequence
  token that closes it) unless `train_on_inputs`.
- `{"text": str}`: plain text; the loss is on every token.

One example is one row (several when packed). A step's loss is the sum of the token losses of all its
micro-batches on all ranks divided by the number of trained tokens in the whole step, so any split of a global
batch over micro-batches and processes gives the same gradient.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fusetune.worker.train.methods.base import TrainingMethod

if TYPE_CHECKING:
    import torch

    from fusetune.worker.train.data import LoadedData, TokenizedSequence

CHAT_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class ChatExample:
    messages: list[dict[str, Any]]


@dataclass(frozen=True)
class PromptCompletionExample:
    prompt: str
    completion: str


@dataclass(frozen=True)
class TextExample:
    text: str


Example = ChatExample | PromptCompletionExample | TextExample


# A bad value is quoted back in the error, cut to this many characters (a 100 KB value would make a 100 KB error).
QUOTED_VALUE_CHARS = 60


def _quoted(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return (
        text
        if len(text) <= QUOTED_VALUE_CHARS
        else f"{text[:QUOTED_VALUE_CHARS]}... ({len(text):,} characters)"
    )


def check_messages(messages: Any, needs_assistant: bool = True) -> str | None:
    """What is wrong with a chat's `messages`, or None."""
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list"
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"messages[{index}] must be an object"
        role = message.get("role")
        if role not in CHAT_ROLES:
            return f"messages[{index}].role must be one of {', '.join(CHAT_ROLES)} (got {_quoted(role)})"
        content = message.get("content")
        # An assistant turn that only calls tools has no content (OpenAI sends null).
        calls_tools = (
            role == "assistant" and isinstance(message.get("tool_calls"), list) and message["tool_calls"]
        )
        if not isinstance(content, str) and not (calls_tools and content is None):
            return f"messages[{index}].content must be a string"
        if message.get("weight", 1) not in (0, 1):
            return f"messages[{index}].weight must be 0 or 1 (got {_quoted(message['weight'])})"
    if needs_assistant and not any(message["role"] == "assistant" for message in messages):
        return "needs at least one assistant message to learn from"
    return None


def parse_example(record: Any) -> Example:
    """One JSONL record as an example; raises ValueError saying what is wrong with it."""
    if not isinstance(record, dict):
        raise ValueError("expected a JSON object with 'messages', 'prompt' and 'completion', or 'text'")
    if "messages" in record:
        problem = check_messages(record["messages"])
        if problem:
            raise ValueError(problem)
        return ChatExample(record["messages"])
    if "prompt" in record or "completion" in record:
        prompt, completion = record.get("prompt"), record.get("completion")
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise ValueError("'prompt' and 'completion' must both be strings")
        if not completion:
            raise ValueError("'completion' must not be empty")
        return PromptCompletionExample(prompt, completion)
    if "text" in record:
        if not isinstance(record["text"], str) or not record["text"]:
            raise ValueError("'text' must be a non-empty string")
        return TextExample(record["text"])
    raise ValueError("expected a non-empty 'messages' list, a 'prompt' and a 'completion', or a 'text'")


class SupervisedFineTuning(TrainingMethod):
    type = "supervised"
    eval_sum_names = ("token_loss", "trained_tokens", "correct_tokens")

    @classmethod
    def parse_example(cls, record: Any) -> Example:
        return parse_example(record)

    @classmethod
    def example_characters(cls, example: Example) -> int:
        if isinstance(example, ChatExample):
            return sum(len(message.get("content") or "") for message in example.messages)
        if isinstance(example, PromptCompletionExample):
            return len(example.prompt) + len(example.completion)
        return len(example.text)

    def load_data(self, path: str, packing: bool) -> LoadedData:
        from fusetune.worker.train.data import load_sequences

        return load_sequences(
            path,
            self.tokenizer,
            self.config.max_seq_length,
            train_on_inputs=self.config.train_on_inputs,
            packing=packing,
        )

    def collate(self, rows: Sequence[TokenizedSequence], packed: bool) -> dict[str, torch.Tensor]:
        from fusetune.worker.train.data import collate

        return collate(rows, self.pad_token_id, packed=packed)

    def loss_normaliser(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["n_trained_tokens"])

    def loss(
        self, model: torch.nn.Module, batch: dict[str, torch.Tensor], normaliser: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        # The model computes the loss itself (fused with the output layer when the kernels are applied):
        # labels already shifted, summed over tokens and divided by the step's global count of trained tokens.
        outputs = model(
            **_model_inputs(batch),
            labels=batch["shifted_labels"],
            shift_labels=batch["shifted_labels"],
            num_items_in_batch=normaliser,
            use_cache=False,
        )
        return outputs.loss, {}

    def eval_sums(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        import torch

        from fusetune.worker.train.data import IGNORE_INDEX

        logits = model(**_model_inputs(batch), use_cache=False).logits
        labels = batch["shifted_labels"]
        trained = labels != IGNORE_INDEX
        token_logits = logits[trained].float()
        loss = torch.nn.functional.cross_entropy(token_logits, labels[trained], reduction="sum")
        correct = (token_logits.argmax(-1) == labels[trained]).sum()
        return torch.stack([loss.double(), trained.sum().double(), correct.double()])

    def eval_metrics(self, sums: list[float]) -> dict[str, float]:
        loss, tokens, correct = sums
        return {"valid_loss": loss / tokens, "valid_token_accuracy": correct / tokens}


def _model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    from fusetune.worker.train.data import model_inputs

    return model_inputs(batch)
