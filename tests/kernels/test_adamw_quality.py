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

The model, the tasks, pre-training and the fine-tuning loop are tests/quality_protocol.py's.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusetune.kernels.adamw8bit import adamw8bit_step_reference, adamw8bit_zero_state
from tests.quality_protocol import (
    SEEDS,
    VOCAB,
    WEIGHT_DECAY,
    MlpLanguageModel,
    ReferenceFusedAdamW,
    assert_matches_and_worse,
    eval_loss,
    loaded,
    make_tasks,
    mean,
    one_thread,  # noqa: F401 (an autouse fixture: one torch thread)
    pretrain,
    train_on_task_b,
)

FINETUNE_STEPS = 200
MODES = ("fp32", "bf16", "bf16-sr")
MODES_8BIT = ("fp32", "adamw8bit", "linear-8bit-nearest")
ZIPF_EXPONENT = 1.2
QUANTIZATION_BLOCK = 256


class Fp32ForwardMlp(MlpLanguageModel):
    """The protocol's model computed in fp32 whatever dtype the parameters are stored in."""

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        def linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
            return F.linear(x, layer.weight.float(), layer.bias.float())

        x = self.embedding.weight.float()[context].flatten(1)
        x = F.gelu(linear(self.hidden1, x))
        x = F.gelu(linear(self.hidden2, x))
        return linear(self.output, x)


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


class _LinearNearest8bitAdamW(ReferenceFusedAdamW):
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


@pytest.fixture(scope="module")
def tasks():
    return make_tasks()


@pytest.fixture(scope="module")
def zipf_tasks():
    return make_tasks(_zipf_probs())


@pytest.fixture(scope="module")
def pretrained(tasks) -> dict[str, torch.Tensor]:
    return pretrain(tasks, Fp32ForwardMlp)


@pytest.fixture(scope="module")
def zipf_pretrained(zipf_tasks) -> dict[str, torch.Tensor]:
    return pretrain(zipf_tasks, Fp32ForwardMlp)


OPTIMIZERS = {
    "bf16-sr": ReferenceFusedAdamW,
    "adamw8bit": _Reference8bitAdamW,
    "linear-8bit-nearest": _LinearNearest8bitAdamW,
}


def finetune(mode: str, seed: int, lr: float, pretrained: dict[str, torch.Tensor], tasks) -> float:
    """Task-B eval loss after fine-tuning the pretrained model in `mode` ("fp32", "bf16" (torch.optim.AdamW on
    bf16 weights) or a key of OPTIMIZERS); a non-finite loss counts as infinite."""
    model = loaded(Fp32ForwardMlp, pretrained)
    if mode != "fp32":
        model.to(torch.bfloat16)
    params = list(model.parameters())
    if mode in OPTIMIZERS:
        optimizer = OPTIMIZERS[mode](params, lr, WEIGHT_DECAY, seed)
    else:
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=WEIGHT_DECAY)
    train_on_task_b(model, optimizer, seed, FINETUNE_STEPS, tasks)
    loss = eval_loss(model, tasks["eval_b"])
    return loss if math.isfinite(loss) else math.inf


@pytest.mark.parametrize("lr", [1e-4, 2e-5])
def test_stochastic_rounding_matches_fp32_master_weights_and_plain_bf16_does_not(lr, pretrained, tasks):
    losses = {mode: [finetune(mode, seed, lr, pretrained, tasks) for seed in SEEDS] for mode in MODES}
    _assert_criterion(losses, "bf16-sr", "bf16", lr, pretrained, tasks)


@pytest.mark.parametrize("lr", [1e-4, 1e-5])
def test_8bit_moments_match_fp32_master_weights_and_plain_int8_does_not(lr, zipf_pretrained, zipf_tasks):
    losses = {
        mode: [finetune(mode, seed, lr, zipf_pretrained, zipf_tasks) for seed in SEEDS] for mode in MODES_8BIT
    }
    _assert_criterion(losses, "adamw8bit", "linear-8bit-nearest", lr, zipf_pretrained, zipf_tasks)


def _assert_criterion(losses, matching: str, worse: str, lr: float, pretrained, tasks) -> None:
    """The criterion against fp32 (module docstring): margin = max(1% of fp32's mean, the spread of its seeds);
    fine-tuning moved fp32 by more than twice the margin; `matching` within it, `worse` worse than both."""
    fp32 = losses["fp32"]
    margin = max(0.01 * mean(fp32), max(fp32) - min(fp32))
    report = f"final task-B eval losses at lr {lr}: {losses}, margin {margin:.4f}"
    start = eval_loss(loaded(Fp32ForwardMlp, pretrained), tasks["eval_b"])
    assert max(fp32) < start - 2 * margin, f"fine-tuning barely moved from {start:.4f}: " + report
    print(report)
    assert_matches_and_worse(losses, "fp32", matching, worse, margin, report)
