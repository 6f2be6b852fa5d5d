"""The evidence that bf16 weights with FusedAdamW train as well as fp32 master weights, and plain bf16 does not;
and that FusedAdamW8bit's 8-bit moments do as well, and plain blockwise int8 moments do not.

A small MLP language model (two context tokens -> next token) is trained in fp32 to a plateau on task A (next
tokens drawn from one random teacher table), then fine-tuned on task B (another table) at fine-tuning learning
rates with

    (a) fp32 weights and torch.optim.AdamW                              (fp32 master weights, the reference)
    (b) bf16 weights and torch.optim.AdamW                              (round to nearest: small updates lost)
    (c) bf16 weights and state, FusedAdamW's stochastically rounded update

three seeds each (the seed picks the fine-tuning batches, and (c)'s rounding bits). (c)'s mean final eval loss
must lie within 1% of (a)'s, or within the spread of (a)'s three seeds if that is larger; (b) must be worse than
both by more than that margin, which shows the comparison can fail. The forward runs in fp32 from the stored
weights in every mode, so only how the weights and state are stored and updated differs. (c) runs
`adamw_step_reference`, which tests/kernels/test_adamw.py shows equal to the kernel bit for bit; the Triton
interpreter would take minutes here.

The weights of this model are 0.1-0.9 in magnitude and the learning rates 2e-5 and 1e-4, so a bf16 weight's half
ulp (2^-9 of it or more) is larger than an Adam update of about lr: in mode (b) almost no update survives.

8-bit moments (issue 34), the same protocol at lr 1e-4 and 1e-5 with

    (a) fp32 weights and torch.optim.AdamW                              (fp32 master weights, the reference)
    (d) bf16 weights, FusedAdamW8bit: moments in 8-bit codes of a small float per 256-element block, the
        codes and the weights rounded stochastically                    (`adamw8bit_step_reference`)
    (e) bf16 weights, FusedAdamW's update with its moments stored as plain blockwise int8 after each step:
        evenly spaced codes of m (127 levels a sign) and of v itself (255), each 256-element block's largest
        magnitude as its scale, rounded to nearest                      (the worse variant)

(d)'s mean must lie within the margin of (a)'s and (e) must be worse than both by more than it. Here the context
tokens are drawn with Zipf frequencies (exponent 1.2, as words in text) instead of uniformly: with uniform
contexts the gradients within a block are of one size, and even (e) fine-tunes as well as fp32 (measured at
1e-4 and 2e-5: within 0.1%), so the test could not fail. With Zipf contexts they span a wider range: from the
first step, hundreds of elements of every weight tensor have a v under half of (e)'s lowest level of their
block while their m is not, their step divides by eps, and training blows up (at 1e-4 within 80 steps; at
1e-5 the loss ends above 8, from 6.3). (d) codes sqrt(v) in 16 binades below the block's largest.
Measured (means of the three seeds): at 1e-4 fp32 4.7231, (d) 4.7151 (-0.17%), (e) infinite; at 1e-5 fp32
6.0890, (d) 6.0834 (-0.09%), (e) 10.985; margins 0.0472 and 0.0609.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusetune.kernels.adamw import adamw_step_reference
from fusetune.kernels.adamw8bit import adamw8bit_step_reference, adamw8bit_zero_state

VOCAB = 32
CONTEXT = 2
EMBEDDING = 16
HIDDEN = 64
TRAIN_EXAMPLES = 65536
EVAL_EXAMPLES = 8192
PRETRAIN_STEPS = 1500
PRETRAIN_LR = 1e-2
PRETRAIN_BATCH = 256
FINETUNE_STEPS = 200
FINETUNE_BATCH = 128
WEIGHT_DECAY = 0.01
SEEDS = (0, 1, 2)
MODES = ("fp32", "bf16", "bf16-sr")
MODES_8BIT = ("fp32", "adamw8bit", "linear-8bit-nearest")
ZIPF_EXPONENT = 1.2
QUANTIZATION_BLOCK = 256


class MlpLanguageModel(nn.Module):
    """Embeddings of the context tokens, concatenated, through two GELU layers to next-token logits; computed in
    fp32 whatever dtype the parameters are stored in."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, EMBEDDING)
        self.hidden1 = nn.Linear(CONTEXT * EMBEDDING, HIDDEN)
        self.hidden2 = nn.Linear(HIDDEN, HIDDEN)
        self.output = nn.Linear(HIDDEN, VOCAB)

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        def linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
            return F.linear(x, layer.weight.float(), layer.bias.float())

        x = self.embedding.weight.float()[context].flatten(1)
        x = F.gelu(linear(self.hidden1, x))
        x = F.gelu(linear(self.hidden2, x))
        return linear(self.output, x)


def _teacher(seed: int) -> torch.Tensor:
    """Log-probabilities of the next token for each of the VOCAB^2 contexts: a task."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(VOCAB**CONTEXT, VOCAB, generator=generator) * 3.0).log_softmax(-1)


def _examples(
    teacher: torch.Tensor, count: int, seed: int, token_probs: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` (context, next token) pairs of the task; context tokens uniform, or drawn from `token_probs`."""
    generator = torch.Generator().manual_seed(seed)
    if token_probs is None:
        context = torch.randint(0, VOCAB, (count, CONTEXT), generator=generator)
    else:
        context = torch.multinomial(token_probs, count * CONTEXT, replacement=True, generator=generator)
        context = context.view(count, CONTEXT)
    probabilities = teacher[context[:, 0] * VOCAB + context[:, 1]].exp()
    return context, torch.multinomial(probabilities, 1, generator=generator).squeeze(1)


def _eval_loss(model: nn.Module, examples: tuple[torch.Tensor, torch.Tensor]) -> float:
    with torch.no_grad():
        return F.cross_entropy(model(examples[0]), examples[1]).item()


class _ReferenceFusedAdamW:
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


class _Reference8bitAdamW:
    """FusedAdamW8bit's update through its pure-PyTorch reference (bit for bit the kernel's)."""

    def __init__(self, params: list[nn.Parameter], lr: float, weight_decay: float, seed: int) -> None:
        self.params, self.lr, self.weight_decay, self.seed = params, lr, weight_decay, seed
        self.states = [adamw8bit_zero_state(p, QUANTIZATION_BLOCK) for p in params]
        self.steps = 0

    def step(self) -> None:
        self.steps += 1
        with torch.no_grad():
            adamw8bit_step_reference(
                self.params,
                [p.grad for p in self.params],
                self.states,
                step=self.steps,
                lr=self.lr,
                weight_decay=self.weight_decay,
                seed=self.seed,
                block_size=QUANTIZATION_BLOCK,
            )


class _LinearNearest8bitAdamW(_ReferenceFusedAdamW):
    """The worse variant: FusedAdamW's update with fp32 moments, which are then replaced by their plain
    blockwise int8 values (evenly spaced codes of the block's largest magnitude, rounded to nearest)."""

    def __init__(self, params: list[nn.Parameter], lr: float, weight_decay: float, seed: int) -> None:
        super().__init__(params, lr, weight_decay, seed)
        self.exp_avgs = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        self.exp_avg_sqs = [torch.zeros_like(p, dtype=torch.float32) for p in params]

    def step(self) -> None:
        super().step()
        for exp_avg, exp_avg_sq in zip(self.exp_avgs, self.exp_avg_sqs, strict=True):
            exp_avg.copy_(_linear_nearest(exp_avg, levels=127))
            exp_avg_sq.copy_(_linear_nearest(exp_avg_sq, levels=255))


def _linear_nearest(values: torch.Tensor, levels: int) -> torch.Tensor:
    """`values` rounded to the nearest of `levels` evenly spaced magnitudes per QUANTIZATION_BLOCK elements."""
    flat = values.flatten()
    blocks = torch.nn.functional.pad(flat, (0, -flat.numel() % QUANTIZATION_BLOCK)).view(
        -1, QUANTIZATION_BLOCK
    )
    scale = blocks.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / levels
    return (torch.round(blocks / scale) * scale).flatten()[: flat.numel()].view(values.shape)


def _zipf_probs() -> torch.Tensor:
    weights = 1.0 / torch.arange(1, VOCAB + 1, dtype=torch.float64) ** ZIPF_EXPONENT
    return (weights / weights.sum()).float()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: one thread is faster, and spares the spinning of a second one on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _tasks(token_probs: torch.Tensor | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    task_a, task_b = _teacher(1), _teacher(2)
    return {
        "train_a": _examples(task_a, TRAIN_EXAMPLES, 10, token_probs),
        "train_b": _examples(task_b, TRAIN_EXAMPLES, 11, token_probs),
        "eval_a": _examples(task_a, EVAL_EXAMPLES, 100, token_probs),
        "eval_b": _examples(task_b, EVAL_EXAMPLES, 101, token_probs),
    }


@pytest.fixture(scope="module")
def tasks():
    return _tasks()


@pytest.fixture(scope="module")
def zipf_tasks():
    return _tasks(_zipf_probs())


@pytest.fixture(scope="module")
def pretrained(tasks) -> dict[str, torch.Tensor]:
    return _pretrain(tasks)


@pytest.fixture(scope="module")
def zipf_pretrained(zipf_tasks) -> dict[str, torch.Tensor]:
    return _pretrain(zipf_tasks)


def _pretrain(tasks) -> dict[str, torch.Tensor]:
    """The fp32 model trained on task A with a cosine schedule to zero (checked to have levelled off)."""
    torch.manual_seed(0)
    model = MlpLanguageModel()
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
            eval_losses.append(_eval_loss(model, tasks["eval_a"]))
    # A plateau: the last fifth of pretraining improved the task-A loss by under 1%.
    assert eval_losses[-2] - eval_losses[-1] < 0.01 * eval_losses[-1], eval_losses
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


OPTIMIZERS = {
    "bf16-sr": _ReferenceFusedAdamW,
    "adamw8bit": _Reference8bitAdamW,
    "linear-8bit-nearest": _LinearNearest8bitAdamW,
}


def finetune(mode: str, seed: int, lr: float, pretrained: dict[str, torch.Tensor], tasks) -> float:
    """Task-B eval loss after fine-tuning the pretrained model in `mode` ("fp32", "bf16" (torch.optim.AdamW on
    bf16 weights) or a key of OPTIMIZERS); a non-finite loss counts as infinite."""
    model = MlpLanguageModel()
    model.load_state_dict(pretrained)
    if mode != "fp32":
        model.to(torch.bfloat16)
    params = list(model.parameters())
    if mode in OPTIMIZERS:
        optimizer = OPTIMIZERS[mode](params, lr, WEIGHT_DECAY, seed)
    else:
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=WEIGHT_DECAY)
    generator = torch.Generator().manual_seed(1000 + seed)
    context, targets = tasks["train_b"]
    for _ in range(FINETUNE_STEPS):
        batch = torch.randint(0, TRAIN_EXAMPLES, (FINETUNE_BATCH,), generator=generator)
        loss = F.cross_entropy(model(context[batch]), targets[batch])
        for param in params:
            param.grad = None
        loss.backward()
        optimizer.step()
    loss = _eval_loss(model, tasks["eval_b"])
    return loss if math.isfinite(loss) else math.inf


@pytest.mark.parametrize("lr", [1e-4, 2e-5])
def test_stochastic_rounding_matches_fp32_master_weights_and_plain_bf16_does_not(lr, pretrained, tasks):
    losses = {mode: [finetune(mode, seed, lr, pretrained, tasks) for seed in SEEDS] for mode in MODES}
    fp32, bf16, stochastic = losses["fp32"], losses["bf16"], losses["bf16-sr"]
    fp32_mean = sum(fp32) / len(fp32)
    margin = max(0.01 * fp32_mean, max(fp32) - min(fp32))
    report = f"final task-B eval losses at lr {lr}: {losses}, margin {margin:.4f}"
    start = _eval_loss(_loaded(pretrained), tasks["eval_b"])
    assert max(fp32) < start - 2 * margin, f"fine-tuning barely moved from {start:.4f}: " + report
    print(report)
    assert abs(sum(stochastic) / len(stochastic) - fp32_mean) <= margin, report
    assert min(bf16) > max(fp32) + margin, report
    assert min(bf16) > max(stochastic) + margin, report


@pytest.mark.parametrize("lr", [1e-4, 1e-5])
def test_8bit_moments_match_fp32_master_weights_and_plain_int8_does_not(lr, zipf_pretrained, zipf_tasks):
    losses = {
        mode: [finetune(mode, seed, lr, zipf_pretrained, zipf_tasks) for seed in SEEDS] for mode in MODES_8BIT
    }
    fp32, eight_bit, worse = losses["fp32"], losses["adamw8bit"], losses["linear-8bit-nearest"]
    fp32_mean = sum(fp32) / len(fp32)
    margin = max(0.01 * fp32_mean, max(fp32) - min(fp32))
    report = f"final task-B eval losses at lr {lr}: {losses}, margin {margin:.4f}"
    start = _eval_loss(_loaded(zipf_pretrained), zipf_tasks["eval_b"])
    assert max(fp32) < start - 2 * margin, f"fine-tuning barely moved from {start:.4f}: " + report
    print(report)
    assert abs(sum(eight_bit) / len(eight_bit) - fp32_mean) <= margin, report
    assert min(worse) > max(fp32) + margin, report
    assert min(worse) > max(eight_bit) + margin, report


def _loaded(state: dict[str, torch.Tensor]) -> nn.Module:
    model = MlpLanguageModel()
    model.load_state_dict(state)
    return model
