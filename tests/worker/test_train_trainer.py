"""The trainer in this process (one rank, CPU): config, schedule, loss normalisation, checkpoints, failures and
reporting to SQL."""

import dataclasses
import json
import math

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM

from fusetune.demo import assets
from fusetune.worker.train import launch as launch_module
from fusetune.worker.train import optim
from fusetune.worker.train.checkpoints import layout as ckpt
from fusetune.worker.train.checkpoints.checkpointer import Checkpointer
from fusetune.worker.train.config import TrainConfig, default_micro_batch_size
from fusetune.worker.train.data import collate, epoch_order, rank_micro_batches
from fusetune.worker.train.distributed import DistInfo, decoder_layers
from fusetune.worker.train.launch import run
from fusetune.worker.train.metrics import RESOLVED_KEYS
from fusetune.worker.train.outcome import (
    EXIT_FAILED,
    EXIT_STOPPED,
    ErrorCode,
    JobStopped,
    TrainingFailure,
    read_error,
    read_result,
    read_stopped,
)
from fusetune.worker.train.reporter import ConsoleReporter, NullReporter, StopRequest, parse_console_records
from fusetune.worker.train.trainer import Trainer, lr_factor

ONE_CPU_RANK = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


class Float64Trainer(Trainer):
    """The trainer with the model in float64, for tests that two ways of running the same step (micro batches,
    accumulation) agree: in float32 the two runs' matmuls have other shapes, so oneDNN and MKL pick other
    kernels and sum in another order (AVX2 against AVX-512 or AMX differ again), and a few optimizer steps make
    that rounding (~1e-7 of each value) into differences a float32 tolerance cannot bound on every CPU. In
    float64 that part is ~1e-16; what remains is the float32 of the reported metrics (FLOAT32_METRIC_ATOL)."""

    def _load_model(self, path, dtype):
        return super()._load_model(path, torch.float64)


def float32_metric_atol(values, n_partial_sums: int) -> float:
    """The difference two runs' float32 metrics may show when their float64 values agree: each run sums the
    metric in float32 over up to ``n_partial_sums`` micro batches, each addition rounding by at most half an
    ulp of the running size, and casts it once: at most (n + 1) * eps32 / 2 of the largest |value|, twice."""
    largest = max(abs(v) for v in values)
    return (n_partial_sums + 1) * torch.finfo(torch.float32).eps * largest


def event_data(event) -> dict:
    """An event row's data (``queries.list_events`` returns it as the stored JSON text), {} when it has none."""
    return json.loads(event.data_json or "null") or {}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return assets.build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def small_train_file(tmp_path_factory):
    return assets.write_demo_dataset(tmp_path_factory.mktemp("data") / "train.jsonl", n_examples=48, seed=5)


def make_config(model_dir, train_file, output_dir, **overrides) -> TrainConfig:
    fields = dict(
        model_path=str(model_dir),
        training_file=str(train_file),
        output_dir=str(output_dir),
        n_epochs=1,
        batch_size=8,
        learning_rate=3e-3,
        max_seq_length=128,
        warmup_ratio=0.0,
    )
    return TrainConfig(**{**fields, **overrides})


class RecordingReporter(NullReporter):
    def __init__(self, stop_after_step: int | None = None, stop: StopRequest = StopRequest.CANCEL):
        self.events, self.metrics, self.checkpoints, self.deleted = [], [], [], []
        self._stop_after_step = stop_after_step
        self._stop = stop
        self._stop_checks = 0

    def event(self, message, *, level="info", type="message", data=None):
        self.events.append((message, data or {}))

    def metric(self, step, values, rank_memory=None):
        self.metrics.append((step, values))

    def checkpoint(self, step, path, metrics):
        self.checkpoints.append((step, path))

    def checkpoints_deleted(self, paths):
        self.deleted.extend(paths)

    def stop_request(self):  # asked once per step
        self._stop_checks += 1
        if self._stop_after_step is not None and self._stop_checks >= self._stop_after_step:
            return self._stop
        return None


# ---------------------------------------------------------------------------------------------- config


def test_config_json_round_trip(tmp_path):
    config = TrainConfig(
        model_path="m", training_file="t.jsonl", output_dir="o", micro_batch_size=4, lora={"r": 8}
    )
    assert TrainConfig.from_json(config.to_json()) == config
    assert TrainConfig.read(config.write(tmp_path / "c.json")) == config


def test_config_is_validated():
    with pytest.raises(ValidationError, match="multiple of micro_batch_size"):
        TrainConfig(model_path="m", training_file="t", output_dir="o", batch_size=8, micro_batch_size=3)
    with pytest.raises(ValidationError):
        TrainConfig(model_path="m", training_file="t", output_dir="o", n_epochs=0)
    with pytest.raises(ValidationError):
        TrainConfig(model_path="m", training_file="t", output_dir="o", learning_rate_multiplier=2)


def test_micro_batches_per_rank():
    config = TrainConfig(model_path="m", training_file="t", output_dir="o", batch_size=8, micro_batch_size=2)
    assert config.micro_batches_per_rank(1) == (2, 4)
    assert config.micro_batches_per_rank(4) == (2, 1)
    with pytest.raises(ValueError, match="number of processes"):
        config.micro_batches_per_rank(3)
    default = TrainConfig(model_path="m", training_file="t", output_dir="o", batch_size=8)
    assert default.micro_batches_per_rank(2) == (4, 1)


def test_default_micro_batch_keeps_the_tokens_of_a_micro_batch_bounded():
    assert default_micro_batch_size(16, max_seq_length=2048) == 8  # 16384 tokens at most
    assert default_micro_batch_size(12, max_seq_length=2048) == 6  # a divisor of the per-process batch
    assert default_micro_batch_size(9, max_seq_length=2048) == 3
    assert default_micro_batch_size(11, max_seq_length=2048) == 1
    assert default_micro_batch_size(16, max_seq_length=128) == 16
    assert default_micro_batch_size(16, max_seq_length=8192) == 2
    assert default_micro_batch_size(4, max_seq_length=65536) == 1
    large = TrainConfig(model_path="m", training_file="t", output_dir="o", batch_size=64, max_seq_length=2048)
    assert large.micro_batches_per_rank(2) == (8, 4)
    with pytest.raises(ValueError, match="number of processes"):
        large.micro_batches_per_rank(3)


def test_merge_lora_on_save_needs_lora():
    with pytest.raises(ValidationError, match="merge_lora_on_save needs lora"):
        TrainConfig(model_path="m", training_file="t", output_dir="o", merge_lora_on_save=True)


# -------------------------------------------------------------------------------------------- schedule


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_lr_schedule_warms_up_then_decays(schedule):
    factors = [lr_factor(step, warmup_steps=4, total_steps=20, schedule=schedule) for step in range(20)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == 1.0
    assert all(a > b for a, b in zip(factors[4:], factors[5:], strict=False))
    assert 0 < factors[-1] < 0.1
    middle = lr_factor(12, 4, 20, schedule)  # halfway through the decay
    assert middle == pytest.approx(0.5)


def test_lr_schedule_without_warmup_starts_at_peak():
    assert lr_factor(0, 0, 10, "cosine") == 1.0
    assert lr_factor(5, 0, 10, "linear") == pytest.approx(0.5)


# ----------------------------------------------------------------------------------- loss normalisation


@pytest.mark.numerics
def test_loss_is_normalised_by_the_trained_tokens_of_the_whole_step(model_dir, small_train_file, tmp_path):
    trainer = Trainer(make_config(model_dir, small_train_file, tmp_path), ONE_CPU_RANK, NullReporter())
    rows = trainer.train_data.sequences[:4]
    batches = [trainer._batch(rows[:1], packed=False), trainer._batch(rows[1:], packed=False)]
    n_trained = sum(int((b["shifted_labels"] != -100).sum()) for b in batches)
    returned = sum(trainer.forward_backward_step(b, torch.tensor(n_trained)) for b in batches)

    reference = AutoModelForCausalLM.from_pretrained(model_dir)
    total = 0.0
    for batch in batches:
        logits = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        total += torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), batch["shifted_labels"].flatten(), ignore_index=-100, reduction="sum"
        )
    torch.testing.assert_close(returned, (total / n_trained).detach(), atol=1e-6, rtol=1e-5)


def _train_steps(model_dir, train_file, output_dir, micro_batch_size, trainer_class=Trainer):
    reporter = RecordingReporter()
    config = make_config(model_dir, train_file, output_dir, micro_batch_size=micro_batch_size, max_steps=3)
    trainer = trainer_class(config, ONE_CPU_RANK, reporter)
    trainer.train()
    return [values["train_loss"] for _, values in reporter.metrics], trainer


def _first_step_gradients(model_dir, train_file, output_dir, micro_batch_size, per_micro_batch_mean=False):
    config = make_config(model_dir, train_file, output_dir, micro_batch_size=micro_batch_size)
    trainer = Float64Trainer(config, ONE_CPU_RANK, NullReporter())  # why float64: its docstring
    order = epoch_order(len(trainer.train_data.sequences), trainer.steps_per_epoch, 8, seed=0, epoch=0)
    rows = trainer.train_data.sequences
    batches = [
        trainer._batch([rows[i] for i in chunk], packed=False)
        for chunk in rank_micro_batches(order[:8], micro_batch_size, rank=0, world_size=1)
    ]
    counts = [int((b["shifted_labels"] != -100).sum()) for b in batches]
    for batch, count in zip(batches, counts, strict=True):
        # The control weighs each micro-batch's mean loss equally instead of every token equally.
        normaliser = count * len(batches) if per_micro_batch_mean else sum(counts)
        trainer.forward_backward_step(batch, torch.tensor(normaliser))
    return {name: p.grad.clone() for name, p in trainer.model.named_parameters()}, counts


@pytest.mark.numerics
def test_micro_batches_give_the_same_gradients_as_one_batch(model_dir, small_train_file, tmp_path):
    whole, _ = _first_step_gradients(model_dir, small_train_file, tmp_path, micro_batch_size=8)
    split, counts = _first_step_gradients(model_dir, small_train_file, tmp_path, micro_batch_size=2)
    assert len(counts) == 4 and len(set(counts)) > 1  # unequal micro-batches, or the control proves nothing
    # float64 sums of a few thousand terms in any order: ~1e-13 of the largest term; the bound below is far
    # above that and far below what the control's weighting changes (1e-2 of the gradient).
    for name, grad in whole.items():
        torch.testing.assert_close(
            split[name], grad, rtol=1e-9, atol=1e-9 * grad.abs().max().item(), msg=name
        )
    control, _ = _first_step_gradients(model_dir, small_train_file, tmp_path, 2, per_micro_batch_mean=True)
    with pytest.raises(AssertionError):
        for name, grad in whole.items():
            torch.testing.assert_close(control[name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.numerics
def test_micro_batches_give_the_same_loss_curve_as_one_batch(model_dir, small_train_file, tmp_path):
    runs = {
        size: _train_steps(model_dir, small_train_file, tmp_path / str(size), size, Float64Trainer)
        for size in (8, 2)
    }
    (whole_losses, whole), (split_losses, split) = runs[8], runs[2]
    atol = float32_metric_atol(whole_losses, n_partial_sums=4)  # why float64 and this bound: their docstrings
    torch.testing.assert_close(split_losses, whole_losses, rtol=0, atol=atol)
    # The runs' weight updates agree to a small part of their size. Compared as a whole per tensor: AdamW divides
    # each gradient by its own running size, so a weight whose gradient nearly cancels (3e-8 against a typical
    # 1e-3, near AdamW's eps) turns summation noise into a larger part of its step than of its gradient.
    base = dict(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).named_parameters())
    for (name, a), (_, b) in zip(whole.model.named_parameters(), split.model.named_parameters(), strict=True):
        update = (a - base[name]).norm()
        assert update > 0 and (b - a).norm() < 1e-3 * update, name


@pytest.mark.parametrize("packing", [False, True], ids=["unpacked", "packed"])
def test_throughput_metrics_count_padding_and_trained_tokens(model_dir, small_train_file, tmp_path, packing):
    reporter = RecordingReporter()
    config = make_config(
        model_dir, small_train_file, tmp_path, micro_batch_size=4, max_steps=2, packing=packing
    )
    trainer = Trainer(config, ONE_CPU_RANK, reporter)
    trainer.train()
    started = next(data for _, data in reporter.events if data.get("event") == "started")
    assert "mfu_peak_flops" in started and started["mfu_peak_flops"] is None  # no GPU, no peak
    # The same steps (two micro-batches of 4 rows, each padded to its longest row), counted here from their rows.
    rows, lengths = trainer.train_data.sequences, trainer.row_lengths
    order = epoch_order(len(rows), trainer.steps_per_epoch, 8, seed=0, epoch=0, lengths=lengths)
    for step, values in reporter.metrics:
        step_rows = [rows[i] for i in order[(step - 1) * 8 : step * 8]]
        batches = [collate(step_rows[:4], trainer.pad_token_id, packing), collate(step_rows[4:], 0, packing)]
        n_input = sum(int(batch["n_input_tokens"]) for batch in batches)
        n_trained = sum(int(batch["n_trained_tokens"]) for batch in batches)
        padding = 1 - n_input / sum(batch["input_ids"].numel() for batch in batches)
        assert values["padding_fraction"] == pytest.approx(padding, abs=1e-12)
        assert values["trained_tokens_per_second"] * values["step_time_s"] == pytest.approx(n_trained)
        assert values["tokens_per_second"] * values["step_time_s"] == pytest.approx(n_input)
        assert n_trained < n_input  # prompts are not trained: the two rates differ


def _mlp_forwards_in_one_step(trainer) -> int:
    # Pre-hooks on the layers' MLPs: recent transformers checkpoint a layer's `forward`, so hooks on the layer
    # itself do not run again, and a recomputation stops as soon as it has rebuilt what the backward needs, so
    # hooks that run after a module's forward may not either.
    calls = []
    for layer in decoder_layers(trainer.model):
        layer.mlp.register_forward_pre_hook(lambda *args: calls.append(1))
    trainer.train_step([trainer._batch(trainer.train_data.sequences[:4], packed=False)])
    return len(calls)


@pytest.mark.numerics
def test_gradient_checkpointing_recomputes_layers_and_keeps_the_losses(model_dir, small_train_file, tmp_path):
    plain_losses, _ = _train_steps(model_dir, small_train_file, tmp_path / "plain", micro_batch_size=4)
    reporter = RecordingReporter()
    config = make_config(
        model_dir,
        small_train_file,
        tmp_path / "gc",
        micro_batch_size=4,
        max_steps=3,
        gradient_checkpointing=True,
    )
    trainer = Trainer(config, ONE_CPU_RANK, reporter)
    trainer.train()
    torch.testing.assert_close(
        [v["train_loss"] for _, v in reporter.metrics], plain_losses, rtol=1e-5, atol=0
    )
    # Each decoder layer runs again during the backward pass: that is what saves the memory.
    plain = Trainer(make_config(model_dir, small_train_file, tmp_path / "p2"), ONE_CPU_RANK, NullReporter())
    n_layers = len(decoder_layers(plain.model))
    assert n_layers == 2
    assert _mlp_forwards_in_one_step(plain) == n_layers
    assert _mlp_forwards_in_one_step(trainer) == 2 * n_layers


@pytest.mark.gpu
@pytest.mark.parametrize("lora", [None, {"r": 8, "alpha": 16}], ids=["full", "lora"])
def test_kernels_on_the_gpu_train_like_the_unpatched_model(model_dir, small_train_file, tmp_path, lora):
    gpu = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cuda", 0))
    curves = {}
    for kernels in (False, True):
        reporter = RecordingReporter()
        config = make_config(
            model_dir, small_train_file, tmp_path / str(kernels), precision="fp32", kernels=kernels, lora=lora,
            max_steps=4,
        )  # fmt: skip
        trainer = Trainer(config, gpu, reporter)
        trainer.train()
        assert trainer.kernels_applied == kernels  # a PEFT-wrapped model is patched too
        curves[kernels] = [values["train_loss"] for _, values in reporter.metrics]
    torch.testing.assert_close(curves[True], curves[False], rtol=1e-3, atol=0)


# ------------------------------------------------------------------------------------------ checkpoints


def test_checkpoints_every_n_steps_keep_the_last_k(model_dir, small_train_file, tmp_path):
    reporter = RecordingReporter()
    config = make_config(
        model_dir,
        small_train_file,
        tmp_path / "out",
        checkpoint_every_steps=2,
        keep_last_checkpoints=2,
        checkpoint_paths_relative_to=str(tmp_path),
    )
    result = Trainer(config, ONE_CPU_RANK, reporter).train()  # 48 examples / 8 = 6 steps
    assert result.steps == 6
    assert [step for step, _ in reporter.checkpoints] == [2, 4, 6]
    assert reporter.checkpoints[-1][1] == "out/checkpoints/step-6"
    assert [step for step, _ in ckpt.list_checkpoints(tmp_path / "out")] == [4, 6]
    assert result.final_checkpoint == str(ckpt.checkpoint_path(tmp_path / "out", 6))
    state = json.loads((tmp_path / "out/checkpoints/step-6" / ckpt.TRAINER_STATE_FILENAME).read_text())
    assert state[ckpt.STATE_STEP] == 6
    assert state[ckpt.STATE_METRICS]["train_loss"] == pytest.approx(result.final_train_loss)


def test_incomplete_checkpoints_are_not_listed(tmp_path):
    root = ckpt.checkpoints_root(tmp_path)
    (root / "step-3").mkdir(parents=True)
    (root / f"step-5{ckpt.INCOMPLETE_SUFFIX}").mkdir()
    (root / "step-10").mkdir()
    (root / "other").mkdir()
    assert [step for step, _ in ckpt.list_checkpoints(tmp_path)] == [3, 10]
    assert ckpt.stale_checkpoints(tmp_path, keep_last=1) == [root / "step-3"]
    assert ckpt.latest_resumable(tmp_path) is None  # no training state in these


# --------------------------------------------------------------------------------------------- failures


@pytest.mark.parametrize("model", ["missing", "empty directory", "config without weights"])
def test_unloadable_model_fails_with_model_not_found(model_dir, small_train_file, tmp_path, model):
    model_path = tmp_path / "model"
    if model != "missing":
        model_path.mkdir()
    if model == "config without weights":
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            (model_path / name).write_bytes((model_dir / name).read_bytes())
    assert run(make_config(model_path, small_train_file, tmp_path / "out")) == EXIT_FAILED
    error = read_error(tmp_path / "out")
    assert error["code"] == ErrorCode.MODEL_NOT_FOUND
    assert f"model path '{model_path}'" in error["message"]
    assert read_result(tmp_path / "out") is None


def test_broken_training_file_fails_with_invalid_training_file(model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(assets.TRAIN_FILE.read_text().splitlines()[0] + "\n{oops\n")
    assert run(make_config(model_dir, bad, tmp_path / "out")) == EXIT_FAILED
    error = read_error(tmp_path / "out")
    assert error["code"] == ErrorCode.INVALID_TRAINING_FILE
    assert "line 2" in error["message"]


def test_huge_learning_rate_fails_with_non_finite_loss_before_the_update(
    model_dir, small_train_file, tmp_path
):
    config = make_config(
        model_dir, small_train_file, tmp_path / "out", learning_rate=1e30, max_grad_norm=None
    )
    reporter = RecordingReporter()
    trainer = Trainer(config, ONE_CPU_RANK, reporter)
    with pytest.raises(TrainingFailure) as raised:
        trainer.train()
    assert raised.value.code == ErrorCode.NON_FINITE_LOSS
    failed_step = len(reporter.metrics) + 1
    assert f"at step {failed_step}" in raised.value.message
    # The bad step's optimizer update was not applied: the step counter and the schedule did not move.
    assert trainer.step == failed_step - 1
    assert trainer.scheduler.last_epoch == failed_step - 1

    assert run(config) == EXIT_FAILED
    error = read_error(tmp_path / "out")
    assert error["code"] == ErrorCode.NON_FINITE_LOSS
    assert error["message"] == raised.value.message
    assert ckpt.list_checkpoints(tmp_path / "out") == []


class WeightRecordingReporter(RecordingReporter):
    """Keeps the weights as they are after each reported step."""

    def __init__(self):
        super().__init__()
        self.model = None
        self.weights = []

    def metric(self, step, values, rank_memory=None):
        super().metric(step, values, rank_memory)
        self.weights.append([p.detach().clone() for p in self.model.parameters()])


@pytest.mark.parametrize("fused", [False, True], ids=["checked-on-host", "skipped-on-device"])
def test_a_non_finite_step_leaves_the_weights_as_the_last_good_step_left_them(
    model_dir, small_train_file, tmp_path, monkeypatch, fused
):
    if fused:
        # Fused AdamW (what a GPU runs) skips the bad update on the device and the failure is raised when the
        # step is read; torch's fused AdamW runs on the CPU too.
        def fused_adamw(groups, learning_rate, device, seed, state_on_host):
            return torch.optim.AdamW(groups, lr=learning_rate, fused=True)

        entry = dataclasses.replace(optim.OPTIMIZERS["adamw"], factory=fused_adamw)
        monkeypatch.setitem(optim.OPTIMIZERS, "adamw", entry)
    config = make_config(model_dir, small_train_file, tmp_path, learning_rate=1e30, max_grad_norm=None)
    reporter = WeightRecordingReporter()
    trainer = Trainer(config, ONE_CPU_RANK, reporter)
    assert optim.OPTIMIZERS["adamw"].skips_on_found_inf(trainer.optimizer) == fused
    reporter.model = trainer.model
    initial = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(TrainingFailure) as raised:
        trainer.train()
    assert raised.value.code == ErrorCode.NON_FINITE_LOSS
    assert (trainer.step, trainer.scheduler.last_epoch) == (len(reporter.metrics), len(reporter.metrics))
    last_good = reporter.weights[-1] if reporter.weights else initial
    for after, before in zip(trainer.model.parameters(), last_good, strict=True):
        torch.testing.assert_close(after.detach(), before, rtol=0, atol=0)


def test_bf16_sr_trains_bf16_weights_with_the_stochastic_rounding_optimizer(
    model_dir, small_train_file, tmp_path, bf16_sr_on_cpu
):
    from fusetune.kernels import FusedAdamW

    reporter = RecordingReporter()
    config = make_config(model_dir, small_train_file, tmp_path, precision="bf16-sr", max_steps=4)
    trainer = Trainer(config, ONE_CPU_RANK, reporter)
    assert isinstance(trainer.optimizer, FusedAdamW) and trainer.optimizer.seed == config.seed
    initial = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert all(p.dtype == torch.bfloat16 for p in trainer.model.parameters())
    state = trainer.optimizer.state[next(trainer.model.parameters())]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    started = next(data for _, data in reporter.events if data.get("event") == "started")
    assert (started["precision"], started["optimizer"]) == ("bf16-sr", "adamw-stochastic-rounding")
    losses = [values["train_loss"] for _, values in reporter.metrics]
    assert losses[-1] < losses[0]
    moved = [
        not torch.equal(p.detach(), before)
        for p, before in zip(trainer.model.parameters(), initial, strict=True)
    ]
    assert all(moved)


def test_bf16_sr_skips_a_non_finite_step_on_the_device(model_dir, small_train_file, tmp_path, bf16_sr_on_cpu):
    config = make_config(
        model_dir, small_train_file, tmp_path, precision="bf16-sr", learning_rate=1e30, max_grad_norm=None
    )
    reporter = WeightRecordingReporter()
    trainer = Trainer(config, ONE_CPU_RANK, reporter)
    reporter.model = trainer.model
    initial = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(TrainingFailure) as raised:
        trainer.train()
    assert raised.value.code == ErrorCode.NON_FINITE_LOSS
    last_good = reporter.weights[-1] if reporter.weights else initial
    for after, before in zip(trainer.model.parameters(), last_good, strict=True):
        torch.testing.assert_close(after.detach(), before, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("exception", "code", "expected"),
    [
        (
            torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
            "out_of_memory",
            "gradient_checkpointing",
        ),
        (RuntimeError("boom"), "trainer_error", "RuntimeError: boom"),
    ],
)
def test_other_failures_are_classified(
    model_dir, small_train_file, tmp_path, monkeypatch, exception, code, expected
):
    def fail(self):
        raise exception

    monkeypatch.setattr(Trainer, "train", fail)
    assert run(make_config(model_dir, small_train_file, tmp_path / "out")) == EXIT_FAILED
    error = read_error(tmp_path / "out")
    assert error["code"] == code
    assert expected in error["message"]


def test_a_checkpoint_the_disk_refuses_is_a_storage_error(model_dir, small_train_file, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(
            13, "Permission denied", str(tmp_path / "out" / "checkpoints" / "step-1.incomplete")
        )

    monkeypatch.setattr(Checkpointer, "save", refuse)
    config = make_config(model_dir, small_train_file, tmp_path / "out", checkpoint_every_steps=1)
    with pytest.raises(TrainingFailure) as raised:
        Trainer(config, ONE_CPU_RANK, RecordingReporter()).train()
    assert raised.value.code == ErrorCode.STORAGE_ERROR
    assert "writing the checkpoint of step 1 failed" in raised.value.message


def test_a_stop_request_ends_the_run_without_a_result(model_dir, small_train_file, tmp_path, monkeypatch):
    reporter = RecordingReporter(stop_after_step=2)
    with pytest.raises(JobStopped):
        Trainer(make_config(model_dir, small_train_file, tmp_path), ONE_CPU_RANK, reporter).train()
    assert len(reporter.metrics) == 2

    monkeypatch.setattr(launch_module, "make_reporter", lambda *args: RecordingReporter(stop_after_step=1))
    assert run(make_config(model_dir, small_train_file, tmp_path / "out")) == EXIT_STOPPED
    assert read_result(tmp_path / "out") is None and read_error(tmp_path / "out") is None
    # torchrun reports any non-zero rank exit as its own 1: the file is what tells the worker it was a stop.
    assert read_stopped(tmp_path / "out") == {"reason": "cancelled", "step": 1, "checkpoint": None}


# ---------------------------------------------------------------------------------------------- reporting


def test_console_records_survive_surrounding_noise():
    lines = []

    class Sink:
        def write(self, text):
            lines.append(text)

        def flush(self):
            pass

    reporter = ConsoleReporter(Sink())
    reporter.metric(3, {"train_loss": 1.5})
    reporter.event("hello", data={"a": 1})
    log = "W1122 torchrun warning\n[rank0]: " + "".join(lines) + "not json {\n"
    records = parse_console_records(log)
    assert records[0] == {"kind": "metric", "step": 3, "values": {"train_loss": 1.5}}
    assert records[1]["message"] == "hello" and records[1]["data"] == {"a": 1}


def make_job_database(tmp_path, status: str = "running"):
    """A migrated SQLite database holding one job; returns (url, session factory, job id)."""
    from fusetune.db.migrate import upgrade
    from fusetune.db.models import File, Job
    from fusetune.db.session import make_engine, make_session_factory

    url = f"sqlite:///{tmp_path / 'state.db'}"
    upgrade(url)
    sessions = make_session_factory(make_engine(url))
    with sessions() as session:
        file = File(filename="train.jsonl", purpose="fine-tune", bytes=1, storage_name="train.jsonl")
        session.add(file)
        session.flush()
        job = Job(model="tiny", training_file_id=file.id, status=status)
        session.add(job)
        session.commit()
        return url, sessions, job.id


def test_sql_reporter_records_a_run(model_dir, small_train_file, tmp_path):
    from fusetune.db import queries

    url, sessions, job_id = make_job_database(tmp_path)
    config = make_config(
        model_dir,
        small_train_file,
        tmp_path / "runs" / job_id,
        database_url=url,
        job_id=job_id,
        validation_file=str(small_train_file),
        checkpoint_paths_relative_to=str(tmp_path / "runs"),
        checkpoint_every_steps=2,
        keep_last_checkpoints=2,
    )
    assert run(config) == 0
    with sessions() as session:
        metrics, _ = queries.list_metrics(session, job_id)
        assert [m.step for m in metrics] == list(range(1, 7))
        assert all(math.isfinite(m.train_loss) for m in metrics)
        assert {
            "learning_rate",
            "grad_norm",
            "tokens_per_second",
            "peak_memory_allocated_bytes",
            "eta_s",
        } <= set(json.loads(metrics[0].values_json))
        assert "valid_loss" in json.loads(metrics[-1].values_json)
        # The checkpoint of step 2 was pruned (keep the last 2): its row went with its folder.
        rows = [(c.step, c.storage_path) for c in queries.list_checkpoints(session, job_id)]
        assert rows == [(6, f"{job_id}/checkpoints/step-6"), (4, f"{job_id}/checkpoints/step-4")]
        assert [step for step, _ in ckpt.list_checkpoints(tmp_path / "runs" / job_id)] == [4, 6]
        events, _ = queries.list_events(session, job_id, limit=100)
        # The metrics rows are mirrored as "metrics" events; the trainer's own events are messages.
        kinds = [event_data(e).get("event") for e in reversed(events) if e.type == "message"]
        assert None not in kinds
        assert kinds.index("started") < kinds.index("checkpoint_saved") < kinds.index("finished")
        assert kinds.index("started") < kinds.index("eval") < kinds.index("finished")
        assert kinds[-1] == "finished"
        assert {"epoch_done", "eval", "checkpoint_saved"} <= set(kinds)
        assert queries.get_job_status(session, job_id) == "running"  # the worker owns status changes
        # The job row keeps what the run resolved, as its started event says it.
        started = next(event_data(e) for e in events if event_data(e).get("event") == "started")
        resolved = queries.get_job(session, job_id).resolved
        assert resolved == {key: started[key] for key in RESOLVED_KEYS}
