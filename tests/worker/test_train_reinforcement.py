"""The reinforcement method (GRPO): its loss against the formula in float64, advantages normalised within each
group (a mutant that normalises over the whole batch fails), the fused per-token log-probabilities against the
logits', exact resume, the references for the KL term, evaluation reaching the checkpoint's metrics, and a step
whose grading fails on most completions failing the job."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from fusetune.demo import assets
from fusetune.models import apply_fusetune, revert_fusetune
from fusetune.models.fused import has_fused_loss
from fusetune.spec.hyperparameters import HyperparametersRequest
from fusetune.spec.job import JobSpec
from fusetune.spec.methods import MethodRequest
from fusetune.worker.train.data import IGNORE_INDEX, collate
from fusetune.worker.train.methods import TRAINING_METHODS
from fusetune.worker.train.methods import reinforcement as grpo
from fusetune.worker.train.methods.reinforcement import GroupRelativePolicyOptimization
from fusetune.worker.train.outcome import ErrorCode, JobStopped, TrainingFailure
from fusetune.worker.train.reporter import StopRequest
from fusetune.worker.train.trainer import Trainer, load_model, load_tokenizer
from tests.worker.test_train_trainer import ONE_CPU_RANK, RecordingReporter, make_config

EXACT = {
    "type": "string_check", "name": "exact", "operation": "eq",
    "input": "{{ sample.output_text }}", "reference": "{{ item.answer }}",
}  # fmt: skip


def reinforcement(**settings) -> dict:
    return {
        "type": "reinforcement",
        "reinforcement": {"grader": EXACT, "n": 4, "max_completion_tokens": 4, **settings},
    }


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return assets.build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    """The bundled arithmetic chats as prompts: the question, and the answer as the grader's reference."""
    chats = [json.loads(line) for line in assets.TRAIN_FILE.read_text().splitlines()[:8]]
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    lines = [{"messages": chat["messages"][:-1], "answer": chat["messages"][-1]["content"]} for chat in chats]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def metric(reporter, key):
    return [values[key] for _, values in reporter.metrics]


def test_the_method_is_found_by_its_type_and_the_request_takes_openais_shape():
    assert TRAINING_METHODS["reinforcement"] is GroupRelativePolicyOptimization
    request = MethodRequest.model_validate(
        {"type": "reinforcement", "reinforcement": {"grader": EXACT, "hyperparameters": {
            "n_epochs": 2, "batch_size": 4, "eval_interval": 3, "eval_samples": "auto", "compute_multiplier": 1.5,
            "reasoning_effort": "low", "n": 4, "kl_beta": 0.05}}}
    )  # fmt: skip
    spec = JobSpec.from_request(request, None, example_count=16, base_learning_rate=1e-4)
    settings = spec.method.settings
    assert settings.grader.name == "exact" and settings.eval_interval == 3 and settings.eval_samples is None
    assert settings.completions_per_prompt == 6 and settings.kl_beta == 0.05
    assert spec.hyperparameters.n_epochs == 2 and spec.hyperparameters.batch_size == 4
    assert JobSpec.from_row(spec.to_row()) == spec
    with pytest.raises(ValueError, match="method.reinforcement with its grader is required"):
        MethodRequest.model_validate({"type": "reinforcement"})
    with pytest.raises(ValueError, match="greater than or equal to 2"):
        MethodRequest.model_validate({"type": "reinforcement", "reinforcement": {
            "grader": EXACT, "hyperparameters": {"n": 1}}})  # fmt: skip
    grader_only = MethodRequest.model_validate({"type": "reinforcement", "reinforcement": {"grader": EXACT}})
    sharded = JobSpec.from_request(
        grader_only, HyperparametersRequest(distributed="fsdp", n_gpus=2), 16, 1e-4
    )
    assert sharded.hyperparameters.distributed == "fsdp"


# ---- the loss and the advantages ---------------------------------------------------------------------------------


def _completion_batch(tokenizer, prompt_lengths, completion_lengths, pad_token_id):
    """Rows of a prompt and a completion of random tokens, labelled on the completion."""
    generator = torch.Generator().manual_seed(0)
    rows = []
    for prompt_length, completion_length in zip(prompt_lengths, completion_lengths, strict=True):
        ids = torch.randint(
            3, len(tokenizer), (prompt_length + completion_length,), generator=generator
        ).tolist()
        rows.append(GroupRelativePolicyOptimization._training_row(
            grpo.Prompt(0, ids[:prompt_length], {}), ids[prompt_length:]))  # fmt: skip
    return collate(rows, pad_token_id, packed=False)


@pytest.mark.parametrize("kl_beta", [0.0, 0.3])
def test_the_loss_and_its_gradient_are_the_formula_in_float64(model_dir, prompts_file, tmp_path, kl_beta):
    """Two groups of three completions, with log-probabilities of an older policy that put some tokens outside
    the clip range on either side; against the formula written out token by token."""
    temperature, epsilon = 0.7, 0.2
    config = make_config(model_dir, prompts_file, tmp_path, method=reinforcement(
        n=3, temperature=temperature, clip_epsilon=epsilon, kl_beta=kl_beta))  # fmt: skip
    tokenizer = load_tokenizer(str(model_dir))
    method = GroupRelativePolicyOptimization(config, tokenizer, 0)
    model = load_model(str(model_dir), torch.float64).train()
    batch = _completion_batch(tokenizer, [5, 3, 4, 6, 2, 4], [3, 1, 4, 2, 5, 3], 0)
    labels = batch["shifted_labels"]
    trained = labels != IGNORE_INDEX
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0], dtype=torch.float64)
    generator = torch.Generator().manual_seed(1)
    shift = torch.randn(labels.shape, generator=generator, dtype=torch.float64) * 0.3  # ratios e^{-0.9..0.9}
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        current = torch.log_softmax(logits / temperature, -1).gather(-1, labels.clamp(min=0)[..., None])[
            ..., 0
        ]
    batch["old_log_probs"] = (current + shift) * trained
    if kl_beta:
        batch["reference_log_probs"] = (
            current - torch.randn(labels.shape, generator=generator) * 0.5
        ) * trained
    batch["advantages"] = grpo.group_advantages(rewards, 3)
    batch["step_metrics"] = torch.zeros(len(method.step_metric_names))
    normaliser = torch.tensor(int(trained.sum()))

    loss, metrics = method.loss(model, batch, normaliser)
    (weight_gradient,) = torch.autograd.grad(loss, model.lm_head.weight)

    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    log_softmax = torch.log_softmax(logits.double() / temperature, -1)
    expected, kl_sum, clipped = torch.zeros((), dtype=torch.float64), 0.0, 0
    for row in range(labels.shape[0]):
        group = rewards[row // 3 * 3 : row // 3 * 3 + 3]
        mean = sum(group.tolist()) / 3
        std = (sum((r - mean) ** 2 for r in group.tolist()) / 2) ** 0.5
        advantage = (rewards[row].item() - mean) / (std + 1e-4)
        for t in range(labels.shape[1]):
            if labels[row, t] == IGNORE_INDEX:
                continue
            log_p = log_softmax[row, t, labels[row, t]]
            ratio = torch.exp(log_p - batch["old_log_probs"][row, t])
            bounded = min(max(ratio.item(), 1 - epsilon), 1 + epsilon)
            # min(rho A, clip(rho) A): where the clipped term is the smaller, rho is outside the range and the
            # term a constant (no gradient).
            if bounded * advantage < ratio.item() * advantage:
                term = torch.tensor(-bounded * advantage, dtype=torch.float64)
                clipped += 1
            else:
                term = -ratio * advantage
            if kl_beta:
                delta = batch["reference_log_probs"][row, t] - log_p
                kl = torch.exp(delta) - delta - 1
                term = term + kl_beta * kl
                kl_sum += kl.item()
            expected = expected + term
    expected = expected / int(trained.sum())
    (expected_gradient,) = torch.autograd.grad(expected, model.lm_head.weight)

    assert loss.dtype == torch.float64 and 0 < clipped < int(
        trained.sum()
    )  # the clip binds on some tokens only
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(weight_gradient, expected_gradient, rtol=1e-10, atol=1e-12)
    assert metrics["clip_fraction"].item() == pytest.approx(clipped / int(trained.sum()), rel=1e-12)
    assert metrics["kl"].item() == pytest.approx(kl_sum / int(trained.sum()), rel=1e-10, abs=1e-15)


def _grade_with_fixed_scores(monkeypatch, scores: list[float]) -> None:
    def fixed_scores(method, prompts, completions, group_size):  # in sampling order, whatever was sampled
        return [
            SimpleNamespace(score=s, per_grader={"exact": s}, error=None) for s in scores[: len(completions)]
        ]

    monkeypatch.setattr(GroupRelativePolicyOptimization, "_grade", fixed_scores)


def _step_advantages(trainer, scores, monkeypatch) -> torch.Tensor:
    _grade_with_fixed_scores(monkeypatch, scores)
    trainer.method.before_training(trainer)
    _, micro_batches = next(trainer.epoch_batches(0))
    prepared = trainer.method.prepare_step(trainer, micro_batches)
    return torch.cat([batch["advantages"] for batch in prepared])


def _assert_normalised_within_groups(advantages: torch.Tensor, scores: list[float], group_size: int) -> None:
    for start in range(0, len(scores), group_size):
        group = torch.tensor(scores[start : start + group_size], dtype=torch.float64)
        expected = (group - group.mean()) / (group.std() + 1e-4)
        torch.testing.assert_close(
            advantages[start : start + group_size].double(), expected, rtol=1e-6, atol=1e-6
        )


# Two prompts of four completions each: the second group scores higher throughout, so normalising over the whole
# batch (or not at all) gives other advantages than normalising each group.
SCORES = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.5]


def test_advantages_are_normalised_within_each_group(model_dir, prompts_file, tmp_path, monkeypatch):
    config = make_config(model_dir, prompts_file, tmp_path, method=reinforcement(), batch_size=2, max_steps=1)
    trainer = Trainer(config, ONE_CPU_RANK, RecordingReporter())
    _assert_normalised_within_groups(_step_advantages(trainer, SCORES, monkeypatch), SCORES, 4)


def _whole_batch_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    return (rewards - rewards.mean()) / (rewards.std() + 1e-4)


def test_a_mutant_that_drops_the_group_normalisation_fails(model_dir, prompts_file, tmp_path, monkeypatch):
    monkeypatch.setattr(grpo, "group_advantages", _whole_batch_advantages)
    config = make_config(model_dir, prompts_file, tmp_path, method=reinforcement(), batch_size=2, max_steps=1)
    trainer = Trainer(config, ONE_CPU_RANK, RecordingReporter())
    with pytest.raises(AssertionError):
        _assert_normalised_within_groups(_step_advantages(trainer, SCORES, monkeypatch), SCORES, 4)


def test_the_fused_token_log_probs_are_the_logits_ones_at_a_temperature(model_dir, prompts_file, tmp_path):
    config = make_config(model_dir, prompts_file, tmp_path, method=reinforcement(temperature=0.7))
    tokenizer = load_tokenizer(str(model_dir))
    method = GroupRelativePolicyOptimization(config, tokenizer, 0)
    model = load_model(str(model_dir), torch.float32).train()
    batch = _completion_batch(tokenizer, [4, 6, 3], [3, 2, 5], 0)
    results = []
    for fused in (False, True):
        if fused:
            apply_fusetune(model, rope=False, rms_norm=False, swiglu=False)  # only the output layer
            assert has_fused_loss(model) and method._fused_log_probs(model)
        model.zero_grad()
        log_probs = method._token_log_probs(model, batch, fused)
        (log_probs * torch.linspace(-1.0, 2.0, log_probs.numel()).view_as(log_probs)).sum().backward()
        results.append((log_probs.detach(), model.lm_head.weight.grad.clone()))
    revert_fusetune(model)
    trained = batch["shifted_labels"] != IGNORE_INDEX
    assert (results[0][0][trained] < 0).all() and (results[0][0][~trained] == 0).all()
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-4, atol=1e-6)


# ---- runs --------------------------------------------------------------------------------------------------------


class CheckpointMetricsReporter(RecordingReporter):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.checkpoint_metrics = {}

    def checkpoint(self, step, path, metrics):
        super().checkpoint(step, path, metrics)
        self.checkpoint_metrics[step] = dict(metrics)


def test_a_run_resumes_exactly_and_its_evaluations_reach_the_checkpoints(model_dir, prompts_file, tmp_path):
    # 8 prompts, 4 per step: 2 steps an epoch, 4 in all; evaluated at each epoch's end and every 3 steps, on the
    # first 4 validation prompts; paused after step 2.
    run = dict(method=reinforcement(eval_interval=3, eval_samples=4), batch_size=4, n_epochs=2,
               learning_rate=1e-3, validation_file=str(prompts_file), checkpoint_every_steps=2)  # fmt: skip
    whole = CheckpointMetricsReporter()
    Trainer(make_config(model_dir, prompts_file, tmp_path / "whole", **run), ONE_CPU_RANK, whole).train()
    assert [step for step, values in whole.metrics if "valid_reward_mean" in values] == [2, 3, 4]
    assert {"valid_reward_mean", "valid_pass_rate_exact", "train_loss"} <= set(whole.checkpoint_metrics[2])
    for key in ("reward_mean", "reward_std", "zero_std_groups", "pass_rate_exact", "completion_length",
                "kl", "clip_fraction", "generated_tokens_per_second", "generation_s", "grading_s",
                "trained_tokens_per_second"):  # fmt: skip
        assert len(metric(whole, key)) == 4, key
    assert all(0 < length <= 4 for length in metric(whole, "completion_length"))
    assert metric(whole, "clip_fraction") == [0.0] * 4  # one update per batch of completions: on-policy

    config = make_config(model_dir, prompts_file, tmp_path / "paused", **run)
    before = RecordingReporter(stop_after_step=2, stop=StopRequest.PAUSE)
    with pytest.raises(JobStopped):
        Trainer(config, ONE_CPU_RANK, before).train()
    after = RecordingReporter()
    Trainer(config, ONE_CPU_RANK, after).train()
    for key in ("train_loss", "reward_mean", "completion_length", "grad_norm"):
        torch.testing.assert_close(
            metric(before, key) + metric(after, key), metric(whole, key), rtol=1e-6, atol=0
        )


def test_the_kl_term_is_to_the_starting_model(model_dir, prompts_file, tmp_path, monkeypatch):
    """A full fine-tune loads a frozen copy of the starting model; with LoRA the reference is the adapters off.
    Either way the policy is its reference at the first step (KL 0) and moves away from it after."""
    _grade_with_fixed_scores(monkeypatch, [1.0, 0.0, 0.0, 1.0] * 4)  # the random model is never right
    for name, lora in (("full", None), ("lora", {"r": 4, "alpha": 8})):
        config = make_config(model_dir, prompts_file, tmp_path / name, method=reinforcement(kl_beta=0.5),
                             batch_size=4, n_epochs=2, max_steps=3, learning_rate=3e-3, lora=lora)  # fmt: skip
        reporter = RecordingReporter()
        trainer = Trainer(config, ONE_CPU_RANK, reporter)
        trainer.train()
        assert (trainer.method.reference_model is None) == (lora is not None), name
        kl = metric(reporter, "kl")
        assert abs(kl[0]) < 1e-6 and kl[-1] > 1e-6, (name, kl)


def test_a_step_whose_grading_fails_on_most_completions_fails_the_job(model_dir, prompts_file, tmp_path):
    """A grader that fails on every completion (here a variable no line has, which job creation refuses; a python
    grader that raises fails the same way) fails the job with grader_error and the grader's error, before any
    step trains on its scores of 0, where it used to succeed."""
    grader = {**EXACT, "reference": "{{ item.nonexistent }}"}
    config = make_config(model_dir, prompts_file, tmp_path, method=reinforcement(grader=grader), batch_size=2,
                         max_steps=2)  # fmt: skip
    reporter = RecordingReporter()
    with pytest.raises(TrainingFailure) as failed:
        Trainer(config, ONE_CPU_RANK, reporter).train()
    assert failed.value.code == ErrorCode.GRADER_ERROR == "grader_error"
    assert failed.value.message.startswith("the grader failed on 8 of 8 completions of step 1")
    assert (
        "(invalid_variable_error): {{ item.nonexistent }}: item has no 'nonexistent'" in failed.value.message
    )
    assert reporter.metrics == []


def _grade_with_errors(monkeypatch, failures: int) -> None:
    def some_fail(method, prompts, completions, group_size):
        return [
            SimpleNamespace(
                score=0.0,
                per_grader={"exact": 0.0},
                error="ZeroDivisionError: division by zero",
                error_type="python_grader_runtime_error",
            )  # fmt: skip
            if index < failures
            else SimpleNamespace(score=1.0, per_grader={"exact": 1.0}, error=None)
            for index in range(len(completions))
        ]

    monkeypatch.setattr(GroupRelativePolicyOptimization, "_grade", some_fail)


@pytest.mark.parametrize(("failures", "fails"), [(4, False), (5, True)])
def test_the_job_goes_on_while_grading_fails_on_at_most_half_a_steps_completions(
    model_dir, prompts_file, tmp_path, monkeypatch, failures, fails
):
    _grade_with_errors(monkeypatch, failures)
    config = make_config(model_dir, prompts_file, tmp_path, method=reinforcement(), batch_size=2, max_steps=1)
    trainer = Trainer(config, ONE_CPU_RANK, RecordingReporter())
    trainer.method.before_training(trainer)
    _, micro_batches = next(trainer.epoch_batches(0))
    if not fails:
        trainer.method.prepare_step(trainer, micro_batches)
        warning = trainer.reporter.events[-1][1]
        assert warning["event"] == "grading_errors" and warning["failed"] == failures
        return
    with pytest.raises(TrainingFailure, match="failed on 5 of 8 completions") as failed:
        trainer.method.prepare_step(trainer, micro_batches)
    assert failed.value.code == ErrorCode.GRADER_ERROR and "ZeroDivisionError" in failed.value.message


@pytest.mark.parametrize(("errors", "fails"), [(2, False), (3, True)])
def test_a_validation_whose_grading_fails_on_most_completions_fails_the_job(
    model_dir, prompts_file, tmp_path, monkeypatch, errors, fails
):
    """The validation's sums count the grader's failures (summed over batches and ranks like the scores), and
    more than half of them failed fails the job as a training step's would, where it reported a pass rate of
    the few that graded."""
    _grade_with_errors(monkeypatch, errors)
    config = make_config(model_dir, prompts_file, tmp_path, method=reinforcement(), batch_size=2, max_steps=1)
    trainer = Trainer(config, ONE_CPU_RANK, RecordingReporter())
    method = trainer.method
    batch = method.collate(method.load_data(str(prompts_file), packing=False).sequences[:4], packed=False)
    sums = method.eval_sums(trainer.model, batch).tolist()
    assert sums[1:3] == [4.0, float(errors)]
    if not fails:
        assert method.eval_metrics(sums)["valid_pass_rate_exact"] == (4 - errors) / 4
        return
    with pytest.raises(TrainingFailure, match="failed on 3 of 4 validation completions") as failed:
        method.eval_metrics(sums)
    assert failed.value.code == ErrorCode.GRADER_ERROR


def test_over_a_static_cache_prompts_pad_to_a_width_class_that_samples_alike():
    """The widths a static cache (and the compiled decoding step) sees are powers of two: 5 and 16 pad to 16,
    17 and 30 to 32; the extra padding is on the left and masked, and greedy sampling of the padded prompts
    gives the unpadded prompts' completions."""
    from transformers import LlamaConfig, LlamaForCausalLM

    method = SimpleNamespace(pad_token_id=0, STATIC_PROMPT_WIDTH_MIN=16)
    pad = GroupRelativePolicyOptimization.padded_to_width_class
    for width, expected in ((5, 16), (16, 16), (17, 32), (30, 32), (64, 64)):
        batch = {"input_ids": torch.arange(1, width + 1).repeat(2, 1), "attention_mask": torch.ones(2, width)}
        batch["attention_mask"][1, :2] = 0
        padded = pad(method, batch)
        assert padded["input_ids"].shape == (2, expected)
        assert torch.equal(padded["input_ids"][:, expected - width :], batch["input_ids"])
        assert torch.equal(padded["attention_mask"][:, expected - width :], batch["attention_mask"])
        assert not padded["attention_mask"][:, : expected - width].any()
        assert (padded["input_ids"][:, : expected - width] == 0).all()

    config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    prompts = {
        "input_ids": torch.randint(3, 61, (2, 9)),
        "attention_mask": torch.ones(2, 9, dtype=torch.long),
    }
    prompts["attention_mask"][0, :4] = 0

    def completions(batch):
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
        return out[:, batch["input_ids"].shape[1] :]

    assert torch.equal(completions(pad(method, prompts)), completions(prompts))
