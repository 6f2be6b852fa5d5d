"""The patched models in Hugging Face's `Trainer` and TRL's `SFTTrainer`, the user's code changed by one line.

Each test trains the same tiny Llama twice through the real trainer (same seed, same initial weights, same
data): once as transformers builds it, once with `apply_fusetune(model)` or built by
`AutoFusedModelForCausalLM`, and compares what the trainer logs at every step (loss, gradient norm) and, in
fp32, the final parameters.

Gradient accumulation over micro-batches with different numbers of trained tokens is where the loss
normalisation matters: `Trainer` counts the tokens of the whole accumulated batch and passes the count to the
model's forward as `num_items_in_batch`. So every run accumulates over such micro-batches, a spy checks that
the fused loss ran with that count, and deliberately broken normalisations must fail the same comparison.

TRL's SFTTrainer (1.8 and later by default, always from 1.15) replaces the model's forward with a chunked LM
head of its own that runs the model's backbone and computes the loss itself: there fusetune's layer kernels
run and its fused loss does not. Before 1.15, `loss_type="nll"` reads `outputs.logits`, which the fused loss
does not build, hence trl>=1.15 in the dev extra.

On the CPU (kernels interpreted) the RoPE kernel is left off: it costs most of the interpreter's time and
touches nothing a trainer sees (tests/models/test_convergence.py covers it); on the GPU every kernel is on.
"""

from __future__ import annotations

import importlib
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    DataCollatorWithFlattening,
    PreTrainedModel,
    Trainer,
    TrainingArguments,
    default_data_collator,
)

from fusetune.models import AutoFusedModelForCausalLM, apply_fusetune
from tests.models.tiny import VOCAB_SIZE, assert_parameters_track, build_tiny_model, tiny_config

SEQ_LEN = 16
BATCH_SIZE = 2
ACCUMULATION_STEPS = 2
TRAIN_STEPS = 4
LEARNING_RATE = 3e-3

# fp32, CPU: over 4 AdamW steps (the trainers' default gradient clipping at 1.0 included) the worst gaps
# measured between the patched and unpatched runs were 5e-7 on a logged loss and 1.4e-6 on a logged gradient
# norm (the kernels round differently from the unfused ops). Averaging each micro-batch on its own instead of
# using `num_items_in_batch` gives 5e-2 and 1.6e-1; ignoring `num_items_in_batch` multiplies the loss. Final
# parameters are compared per tensor, as in test_convergence.py and for its reason (AdamW steps an element whose
# gradient is zero but for rounding by up to the learning rate in whichever direction the rounding picks): the
# norm of the difference against the norm of what training moved the tensor: at most 2.0e-4 for the patched run
# (4 steps), at least 0.25 on every tensor for either broken normalisation (2 steps).
FP32_TOLERANCE = {
    "losses": {"atol": 2e-5, "rtol": 1e-5},
    "grad_norms": {"atol": 2e-5, "rtol": 1e-5},
    "parameters": {"of_moved": 1e-2},
}
# bf16 autocast (fp32 weights), 2 steps: the two runs round to bf16 in different places; measured gaps were
# 3.3e-3 on a loss and 6.6e-3 on a gradient norm (HF's own bf16 run is 1e-2 from its fp32 run), against
# 1.9e-1 and 1.8 for the micro-batch-averaging bug. Parameters are not compared: AdamW's first steps move
# every parameter by about the learning rate whatever its gradient's size, so bf16 rounding that flips a
# tiny gradient's sign gives a gap at the ceiling of what two steps allow, for right and wrong kernels alike.
BF16_TOLERANCE = {
    "losses": {"atol": 1e-2, "rtol": 0.0},
    "grad_norms": {"atol": 2e-2, "rtol": 0.0},
}

# The fused CausalLM loss alone: enough to test its normalisation, cheap under the interpreter.
ONLY_LOSS = {"rope": False, "rms_norm": False, "swiglu": False, "geglu": False}


def patch_options(device: str) -> dict[str, bool]:
    return {} if device == "cuda" else {"rope": False}


@dataclass
class TrainerRun:
    """What the trainer logged at each optimizer step, and the parameters it ended with."""

    losses: list[float]
    grad_norms: list[float]
    parameters: dict[str, torch.Tensor]
    log_history: list[dict[str, Any]] = field(repr=False)
    start_parameters: dict[str, torch.Tensor] = field(repr=False, default_factory=dict)
    trainer_replaced_forward: bool = False


def finish(trainer: Trainer) -> TrainerRun:
    def parameters() -> dict[str, torch.Tensor]:
        return {name: p.detach().float().cpu().clone() for name, p in trainer.model.named_parameters()}

    start_parameters = parameters()
    trainer.train()
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    return TrainerRun(
        losses=[entry["loss"] for entry in steps],
        grad_norms=[entry["grad_norm"] for entry in steps],
        parameters=parameters(),
        log_history=trainer.state.log_history,
        start_parameters=start_parameters,
    )


def assert_runs_match(
    expected: TrainerRun, actual: TrainerRun, tolerance: dict[str, dict[str, float]]
) -> None:
    """Per-step logged losses and gradient norms, then every final parameter where `tolerance` has them."""
    assert len(expected.losses) == len(actual.losses) > 0
    assert all(math.isfinite(loss) for loss in actual.losses)
    for logged in ("losses", "grad_norms"):
        torch.testing.assert_close(
            torch.tensor(getattr(actual, logged)),
            torch.tensor(getattr(expected, logged)),
            **tolerance[logged],
            msg=lambda m, logged=logged: f"{logged}: {m}",
        )
    if "parameters" not in tolerance:
        return
    assert_parameters_track(
        expected.start_parameters, expected.parameters, actual.parameters, tolerance["parameters"]["of_moved"]
    )


@dataclass
class FusedLossCall:
    num_items_in_batch: float | None
    trained_tokens: int


@pytest.fixture
def fused_loss_calls(monkeypatch: pytest.MonkeyPatch) -> list[FusedLossCall]:
    """Records each call of the fused linear cross-entropy: the count it normalises by and its own tokens."""
    module = importlib.import_module("fusetune.kernels.fused_linear_cross_entropy")
    real = module.fused_linear_cross_entropy
    calls: list[FusedLossCall] = []

    def recorded(hidden, weight, labels, *args, num_items_in_batch=None, ignore_index=-100, **kwargs):
        count = num_items_in_batch
        calls.append(
            FusedLossCall(
                num_items_in_batch=None if count is None else float(count),
                trained_tokens=int(labels.ne(ignore_index).sum()),
            )
        )
        return real(
            hidden,
            weight,
            labels,
            *args,
            num_items_in_batch=num_items_in_batch,
            ignore_index=ignore_index,
            **kwargs,
        )

    monkeypatch.setattr(module, "fused_linear_cross_entropy", recorded)
    return calls


# ------------------------------------------------------------------------------------ transformers Trainer


def token_dataset(n_examples: int, *, packed: bool = False, seed: int = 3) -> list[dict[str, Any]]:
    """Fixed-length rows of random tokens: a prompt of random length masked from the loss and some right
    padding, so micro-batches carry very different numbers of trained tokens. `packed`: the same rows
    without their padding, for a collator that concatenates them."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n_examples):
        input_ids = torch.randint(3, VOCAB_SIZE, (SEQ_LEN,), generator=generator)
        prompt_length = int(torch.randint(0, SEQ_LEN - 3, (1,), generator=generator))
        padding = int(torch.randint(0, 5, (1,), generator=generator))
        attention_mask = torch.ones(SEQ_LEN, dtype=torch.long)
        if padding:
            attention_mask[-padding:] = 0
            input_ids[-padding:] = 0
        labels = input_ids.clone()
        labels[:prompt_length] = -100
        labels[attention_mask == 0] = -100
        if packed:
            kept = attention_mask.bool()
            rows.append({"input_ids": input_ids[kept].tolist(), "labels": labels[kept].tolist()})
        else:
            rows.append({"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels})
    return rows


def trainer_arguments(
    output_dir, device: str, *, steps: int = TRAIN_STEPS, **overrides: Any
) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(output_dir),
        max_steps=steps,
        per_device_train_batch_size=BATCH_SIZE,
        gradient_accumulation_steps=ACCUMULATION_STEPS,
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        seed=0,
        report_to=[],
        use_cpu=device == "cpu",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        **overrides,
    )


def run_trainer(
    model: PreTrainedModel, output_dir, device: str, *, packed: bool = False, **overrides: Any
) -> TrainerRun:
    """`packed`: padding-free batches, each micro-batch one row of concatenated examples whose
    position_ids restart at every example (transformers' DataCollatorWithFlattening)."""
    args = trainer_arguments(output_dir, device, **overrides)
    dataset = token_dataset(args.max_steps * BATCH_SIZE * ACCUMULATION_STEPS, packed=packed)
    collator = DataCollatorWithFlattening() if packed else default_data_collator
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator)
    # Trainer hands `num_items_in_batch` to the forward only when the forward takes **kwargs.
    assert trainer.model_accepts_loss_kwargs
    return finish(trainer)


def assert_trainer_counts_reached_the_loss(calls: list[FusedLossCall], steps: int) -> None:
    """Every micro-batch's fused loss was normalised by the tokens of its whole accumulated batch."""
    assert len(calls) == steps * ACCUMULATION_STEPS
    for step in range(steps):
        micro_batches = calls[step * ACCUMULATION_STEPS : (step + 1) * ACCUMULATION_STEPS]
        trained_tokens = sum(call.trained_tokens for call in micro_batches)
        assert [call.num_items_in_batch for call in micro_batches] == [trained_tokens] * ACCUMULATION_STEPS
    per_micro_batch = [call.trained_tokens for call in calls]
    assert len(set(per_micro_batch)) > 1, "the data should give micro-batches different token counts"


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "padding_free"])
def test_trainer_with_gradient_accumulation_matches_unpatched(
    tmp_path, device: str, fused_loss_calls: list[FusedLossCall], packed: bool
) -> None:
    reference = run_trainer(build_tiny_model("llama"), tmp_path / "reference", device, packed=packed)
    assert not fused_loss_calls

    model = build_tiny_model("llama")
    handle = apply_fusetune(model, **patch_options(device))  # the one line
    try:
        patched = run_trainer(model, tmp_path / "patched", device, packed=packed)
    finally:
        handle.revert()

    assert_trainer_counts_reached_the_loss(fused_loss_calls, TRAIN_STEPS)
    assert_runs_match(reference, patched, FP32_TOLERANCE)
    assert patched.losses[-1] < patched.losses[0]


def _ignores_num_items_in_batch(real):
    """Each micro-batch's mean, while the trainer believes the model scaled it (it doubles the loss)."""

    def broken(*args, num_items_in_batch=None, **kwargs):
        return real(*args, **kwargs)

    return broken


def _averages_each_micro_batch(real):
    """The mean of the micro-batch means: right on equal token counts, wrong weights otherwise."""

    def broken(*args, num_items_in_batch=None, **kwargs):
        return real(*args, **kwargs) / ACCUMULATION_STEPS

    return broken


@pytest.mark.parametrize(
    ("break_loss", "bf16"),
    [
        (_ignores_num_items_in_batch, False),
        (_averages_each_micro_batch, False),
        (_averages_each_micro_batch, True),
    ],
    ids=["ignores_num_items-fp32", "averages_micro_batches-fp32", "averages_micro_batches-bf16"],
)
def test_broken_loss_normalisation_fails_the_comparison(
    tmp_path, device: str, monkeypatch: pytest.MonkeyPatch, break_loss, bf16: bool
) -> None:
    steps, tolerance = 2, BF16_TOLERANCE if bf16 else FP32_TOLERANCE
    reference = run_trainer(build_tiny_model("llama"), tmp_path / "reference", device, steps=steps, bf16=bf16)
    module = importlib.import_module("fusetune.kernels.fused_linear_cross_entropy")
    monkeypatch.setattr(module, "fused_linear_cross_entropy", break_loss(module.fused_linear_cross_entropy))

    model = build_tiny_model("llama")
    handle = apply_fusetune(model, **ONLY_LOSS)
    try:
        broken = run_trainer(model, tmp_path / "broken", device, steps=steps, bf16=bf16)
    finally:
        handle.revert()
    with pytest.raises(AssertionError, match="losses"):
        assert_runs_match(reference, broken, tolerance)


def test_trainer_bf16_mixed_precision_tracks_unpatched(tmp_path, device: str, kernel_calls: Counter) -> None:
    """`bf16=True` (fp32 weights under autocast) is the usual way to train; the residual stream then stays
    fp32 while the attention and MLP outputs are bf16, and the patched layers must take that as HF does."""
    steps = 2
    reference = run_trainer(build_tiny_model("llama"), tmp_path / "reference", device, steps=steps, bf16=True)
    model = build_tiny_model("llama")
    handle = apply_fusetune(model, **patch_options(device))
    try:
        patched = run_trainer(model, tmp_path / "patched", device, steps=steps, bf16=True)
    finally:
        handle.revert()
    assert kernel_calls["add_rms_norm"] > 0 and kernel_calls["fused_linear_cross_entropy"] > 0
    assert_runs_match(reference, patched, BF16_TOLERANCE)


# ------------------------------------------------------------------------------------ TRL SFTTrainer


def chat_examples(n_examples: int) -> list[dict[str, Any]]:
    from fusetune.demo.assets import demo_examples

    return demo_examples(n_examples, seed=0)


def sft_model_and_tokenizer(examples: list[dict[str, Any]]):
    """A local byte-level BPE tokenizer with a chat template that marks the assistant's tokens, and a tiny
    Llama sized to it."""
    from fusetune.demo.assets import build_tokenizer

    tokenizer = build_tokenizer(examples, vocab_size=300)
    config = tiny_config("llama")
    config.vocab_size = len(tokenizer)
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
    return model, tokenizer


def run_sft(model, tokenizer, examples, output_dir, device: str, **overrides: Any) -> TrainerRun:
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    args = trl.SFTConfig(
        output_dir=str(output_dir),
        max_steps=len(examples) // (BATCH_SIZE * ACCUMULATION_STEPS),
        per_device_train_batch_size=BATCH_SIZE,
        gradient_accumulation_steps=ACCUMULATION_STEPS,
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        seed=0,
        report_to=[],
        use_cpu=device == "cpu",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        assistant_only_loss=True,
        **{"max_length": 64, **overrides},
    )
    trainer = trl.SFTTrainer(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_list(examples),
        processing_class=tokenizer,
    )
    assert trainer.model_accepts_loss_kwargs
    run = finish(trainer)
    # TRL's own LM head is set as an instance attribute over the model's forward (see the module docstring).
    run.trainer_replaced_forward = "forward" in vars(model)
    return run


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "padding_free"])
def test_sft_trainer_matches_unpatched(
    tmp_path, device: str, kernel_calls: Counter, padding_free: bool
) -> None:
    pytest.importorskip("trl")
    examples = chat_examples(2 * BATCH_SIZE * ACCUMULATION_STEPS)
    model, tokenizer = sft_model_and_tokenizer(examples)
    initial_state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    fp32 = {"bf16": False, "gradient_checkpointing": False, "padding_free": padding_free}
    if padding_free:  # the rows are short; TRL refuses a max_length it would not enforce without packing
        fp32["max_length"] = None
    reference = run_sft(model, tokenizer, examples, tmp_path / "reference", device, **fp32)
    assert not kernel_calls

    # The one line: AutoFusedModelForCausalLM instead of AutoModelForCausalLM.
    patched_model = AutoFusedModelForCausalLM.from_config(model.config, **patch_options(device))
    patched_model.load_state_dict(initial_state)
    patched = run_sft(patched_model, tokenizer, examples, tmp_path / "patched", device, **fp32)

    assert kernel_calls["rms_norm"] > 0 and kernel_calls["add_rms_norm_gated_mlp"] > 0
    if patched.trainer_replaced_forward:
        assert kernel_calls["fused_linear_cross_entropy"] == 0
    else:
        assert kernel_calls["fused_linear_cross_entropy"] > 0
    assert_runs_match(reference, patched, FP32_TOLERANCE)
    accuracy = [
        entry["mean_token_accuracy"] for entry in patched.log_history if "mean_token_accuracy" in entry
    ]
    assert len(accuracy) == len(patched.losses)


def test_sft_trainer_with_its_default_precision_and_checkpointing(
    tmp_path, device: str, kernel_calls: Counter
) -> None:
    """bf16 autocast and gradient checkpointing, SFTConfig's defaults in TRL 1.x."""
    pytest.importorskip("trl")
    examples = chat_examples(2 * BATCH_SIZE * ACCUMULATION_STEPS)
    model, tokenizer = sft_model_and_tokenizer(examples)
    initial_state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    defaults = {"bf16": True, "gradient_checkpointing": True}
    reference = run_sft(model, tokenizer, examples, tmp_path / "reference", device, **defaults)
    patched_model = AutoFusedModelForCausalLM.from_config(model.config, **patch_options(device))
    patched_model.load_state_dict(initial_state)
    patched = run_sft(patched_model, tokenizer, examples, tmp_path / "patched", device, **defaults)
    assert kernel_calls["add_rms_norm"] > 0
    assert_runs_match(reference, patched, BF16_TOLERANCE)
