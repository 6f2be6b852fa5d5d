"""The CPU quality protocol that tests/kernels/test_adamw_quality.py and tests/worker/test_float8_quality.py share.

A small MLP language model (two context tokens -> next token) is trained in fp32 to a plateau on task A (next
tokens drawn from one random teacher table), then fine-tuned on task B (another table) in the modes a test
compares, one run per seed; each test module's docstring says which modes, and why its criterion is what it is.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusetune.kernels.adamw import adamw_step_reference

VOCAB = 32
CONTEXT = 2
EMBEDDING = 16
HIDDEN = 64
TRAIN_EXAMPLES = 65536
EVAL_EXAMPLES = 8192
PRETRAIN_STEPS = 1500
PRETRAIN_LR = 1e-2
PRETRAIN_BATCH = 256
FINETUNE_BATCH = 128
WEIGHT_DECAY = 0.01
SEEDS = (0, 1, 2)

Examples = tuple[torch.Tensor, torch.Tensor]  # (contexts (n, CONTEXT), next tokens (n,))


class MlpLanguageModel(nn.Module):
    """Embeddings of the context tokens, concatenated, through two GELU layers to next-token logits, in the
    parameters' dtype; `get_output_embeddings` names the output layer as transformers' models do, so that the
    float8 conversion leaves it in bf16 as it leaves an lm_head."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, EMBEDDING)
        self.hidden1 = nn.Linear(CONTEXT * EMBEDDING, HIDDEN)
        self.hidden2 = nn.Linear(HIDDEN, HIDDEN)
        self.output = nn.Linear(HIDDEN, VOCAB)

    def get_output_embeddings(self) -> nn.Module:
        return self.output

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        x = self.embedding(context).flatten(1)
        x = F.gelu(self.hidden1(x))
        x = F.gelu(self.hidden2(x))
        return self.output(x).float()


def teacher(seed: int) -> torch.Tensor:
    """Log-probabilities of the next token for each of the VOCAB^2 contexts: a task."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(VOCAB**CONTEXT, VOCAB, generator=generator) * 3.0).log_softmax(-1)


def examples(
    teacher: torch.Tensor, count: int, seed: int, token_probs: torch.Tensor | None = None
) -> Examples:
    """`count` (context, next token) pairs of the task; context tokens uniform, or drawn from `token_probs`."""
    generator = torch.Generator().manual_seed(seed)
    if token_probs is None:
        context = torch.randint(0, VOCAB, (count, CONTEXT), generator=generator)
    else:
        context = torch.multinomial(token_probs, count * CONTEXT, replacement=True, generator=generator)
        context = context.view(count, CONTEXT)
    probabilities = teacher[context[:, 0] * VOCAB + context[:, 1]].exp()
    return context, torch.multinomial(probabilities, 1, generator=generator).squeeze(1)


def make_tasks(token_probs: torch.Tensor | None = None) -> dict[str, Examples]:
    """Training and eval examples of task A (teacher 1) and task B (teacher 2)."""
    task_a, task_b = teacher(1), teacher(2)
    return {
        "train_a": examples(task_a, TRAIN_EXAMPLES, 10, token_probs),
        "train_b": examples(task_b, TRAIN_EXAMPLES, 11, token_probs),
        "eval_a": examples(task_a, EVAL_EXAMPLES, 100, token_probs),
        "eval_b": examples(task_b, EVAL_EXAMPLES, 101, token_probs),
    }


def eval_loss(model: nn.Module, examples: Examples) -> float:
    with torch.no_grad():
        return F.cross_entropy(model(examples[0]), examples[1]).item()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: one thread is faster, and spares the spinning of a second one on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def initial_model(model_class: Callable[[], nn.Module]) -> nn.Module:
    """The fp32 model pre-training starts from (random init, seed 0)."""
    torch.manual_seed(0)
    return model_class()


def pretrain(tasks: dict[str, Examples], model_class: Callable[[], nn.Module]) -> dict[str, torch.Tensor]:
    """The fp32 model trained on task A with a cosine schedule to zero (checked to have levelled off)."""
    model = initial_model(model_class)
    optimizer = torch.optim.AdamW(model.parameters(), lr=PRETRAIN_LR, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / PRETRAIN_STEPS))
    )
    generator = torch.Generator().manual_seed(0)
    context, targets = tasks["train_a"]
    eval_losses = []
    for step in range(PRETRAIN_STEPS):
        batch = torch.randint(0, TRAIN_EXAMPLES, (PRETRAIN_BATCH,), generator=generator)
        loss = F.cross_entropy(model(context[batch]), targets[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % (PRETRAIN_STEPS // 5) == PRETRAIN_STEPS // 5 - 1:
            eval_losses.append(eval_loss(model, tasks["eval_a"]))
    # A plateau: the last fifth of pretraining improved the task-A loss by under 1%.
    assert eval_losses[-2] - eval_losses[-1] < 0.01 * eval_losses[-1], eval_losses
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def loaded(model_class: Callable[[], nn.Module], weights: dict[str, torch.Tensor]) -> nn.Module:
    model = model_class()
    model.load_state_dict(weights)
    return model


class ReferenceFusedAdamW:
    """FusedAdamW's update through its pure-PyTorch reference: bf16 state for bf16 parameters."""

    def __init__(self, params: list[nn.Parameter], lr: float, weight_decay: float, seed: int) -> None:
        self.params, self.lr, self.weight_decay, self.seed = params, lr, weight_decay, seed
        self.exp_avgs = [torch.zeros_like(p) for p in params]
        self.exp_avg_sqs = [torch.zeros_like(p) for p in params]
        self.steps = 0

    def step(self) -> None:
        self.steps += 1
        with torch.no_grad():
            adamw_step_reference(
                self.params,
                [p.grad for p in self.params],
                self.exp_avgs,
                self.exp_avg_sqs,
                step=self.steps,
                lr=self.lr,
                weight_decay=self.weight_decay,
                seed=self.seed,
            )


def train_on_task_b(model: nn.Module, optimizer, seed: int, steps: int, tasks: dict[str, Examples]) -> None:
    """`steps` steps of `optimizer` on batches of task B's training examples picked by `seed` (the same batches
    in every mode)."""
    params = list(model.parameters())
    generator = torch.Generator().manual_seed(1000 + seed)
    context, targets = tasks["train_b"]
    for _ in range(steps):
        batch = torch.randint(0, TRAIN_EXAMPLES, (FINETUNE_BATCH,), generator=generator)
        loss = F.cross_entropy(model(context[batch]), targets[batch])
        for param in params:
            param.grad = None
        loss.backward()
        optimizer.step()


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def assert_matches_and_worse(
    losses: dict[str, list[float]], reference: str, matching: str, worse: str, margin: float, report: str
) -> None:
    """The criterion's comparison: `matching`'s mean within `margin` of `reference`'s, and `worse`'s best seed
    worse than the worst seed of both by more than `margin` (which shows the comparison can fail)."""
    assert abs(mean(losses[matching]) - mean(losses[reference])) <= margin, report
    assert min(losses[worse]) > max(losses[reference]) + margin, report
    assert min(losses[worse]) > max(losses[matching]) + margin, report
