"""The DPO method: its line format and checks, training that learns a preference, exact resume with the
reference kept, the LoRA reference with adapters off, and the fused per-sequence path against the logits one."""

from __future__ import annotations

import pytest
import torch

from fusetune.demo import assets
from fusetune.models import apply_fusetune, revert_fusetune
from fusetune.models.fused import has_fused_loss
from fusetune.spec.examples import parse_preference_example
from fusetune.spec.methods import method_of_record
from fusetune.worker.train.methods import TRAINING_METHODS
from fusetune.worker.train.methods.dpo import DirectPreferenceOptimization
from fusetune.worker.train.outcome import JobStopped
from fusetune.worker.train.reporter import StopRequest
from fusetune.worker.train.trainer import Trainer, load_model, load_tokenizer
from tests.worker.test_train_trainer import (
    ONE_CPU_RANK,
    Float64Trainer,
    RecordingReporter,
    float32_metric_atol,
    make_config,
)

DPO = {"type": "dpo", "dpo": {"beta": 0.1}}
PAIR = {
    "input": {"messages": [{"role": "user", "content": "What is 2 + 2?"}]},
    "preferred_output": [{"role": "assistant", "content": "4"}],
    "non_preferred_output": [{"role": "assistant", "content": "5"}],
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return assets.build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    return assets.write_preference_dataset(
        tmp_path_factory.mktemp("data") / "pairs.jsonl", n_examples=32, seed=5
    )


def metric(reporter, key):
    return [values[key] for _, values in reporter.metrics]


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"input": {"messages": [*PAIR["input"]["messages"], {"role": "assistant", "content": "x"}]}},
         "last input message must not be the assistant's"),
        ({"preferred_output": []}, "'preferred_output' must be a list of exactly one assistant message (got 0)"),
        ({"non_preferred_output": [{"role": "user", "content": "5"}]}, "must hold an assistant message"),
        ({"non_preferred_output": PAIR["preferred_output"]}, "are the same"),
        ({"input": {"messages": []}}, "input.messages must be a non-empty list"),
        ({"input": None}, "'input' must be an object with 'messages'"),
    ],
)  # fmt: skip
def test_bad_pairs_are_refused_with_the_problem(change, problem):
    with pytest.raises(ValueError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        parse_preference_example({**PAIR, **change})


def test_a_pair_is_recognised_as_dpo_and_a_chat_as_supervised():
    assert method_of_record(PAIR) == "dpo"
    assert method_of_record({"messages": [{"role": "user", "content": "hi"}]}) == "supervised"
    assert TRAINING_METHODS["dpo"] is DirectPreferenceOptimization


def test_dpo_learns_the_preference_and_resumes_exactly_without_a_second_reference_pass(
    model_dir, pairs_file, tmp_path, monkeypatch
):
    # 32 pairs, 8 per step, 3 epochs: 12 steps; a pause after step 5 is mid-epoch.
    run = dict(n_epochs=3, learning_rate=3e-3, method=DPO, checkpoint_every_steps=4)
    whole = RecordingReporter()
    Trainer(make_config(model_dir, pairs_file, tmp_path / "whole", **run), ONE_CPU_RANK, whole).train()

    accuracy = metric(whole, "reward_accuracy")
    # Step 1 scores the policy against itself: every reward is 0, so no pair is ranked right.
    assert accuracy[0] == 0.0 and metric(whole, "reward_margin")[0] == 0.0
    assert sum(accuracy[-4:]) / 4 >= 0.7, accuracy
    assert sum(metric(whole, "reward_margin")[-4:]) > 0
    for key in ("chosen_reward", "rejected_reward", "train_loss"):
        assert len(metric(whole, key)) == 12

    config = make_config(model_dir, pairs_file, tmp_path / "paused", **run)
    before = RecordingReporter(stop_after_step=5, stop=StopRequest.PAUSE)
    with pytest.raises(JobStopped):
        Trainer(config, ONE_CPU_RANK, before).train()

    def no_second_pass(*args, **kwargs):
        raise AssertionError("the resumed run recomputed the reference log-probabilities")

    monkeypatch.setattr(DirectPreferenceOptimization, "_reference_log_probs", no_second_pass)
    after = RecordingReporter()
    Trainer(config, ONE_CPU_RANK, after).train()
    for key in ("train_loss", "reward_accuracy", "reward_margin", "grad_norm"):
        torch.testing.assert_close(
            metric(before, key) + metric(after, key), metric(whole, key), rtol=1e-6, atol=0
        )


def test_a_pair_stays_in_one_micro_batch_and_micro_batches_change_nothing(model_dir, pairs_file, tmp_path):
    curves = []
    for micro_batch_size in (8, 2):
        reporter = RecordingReporter()
        config = make_config(
            model_dir, pairs_file, tmp_path / str(micro_batch_size), method=DPO, max_steps=3,
            learning_rate=3e-3, micro_batch_size=micro_batch_size,
        )  # fmt: skip
        trainer = Float64Trainer(config, ONE_CPU_RANK, reporter)  # why float64: its docstring
        batch = trainer._batch(trainer.train_data.sequences[:2], False)
        # Rows: the chosen sides, then the rejected ones; one reference pair per pair.
        assert batch["input_ids"].shape[0] == 4 and int(batch["n_pairs"]) == 2
        trainer.train()
        curves.append({key: metric(reporter, key) for key in ("train_loss", "reward_margin")})
    for key, values in curves[0].items():  # the step of 8 pairs in 4 micro batches of 2 against 1 of 8
        atol = float32_metric_atol(values, n_partial_sums=4)
        torch.testing.assert_close(curves[1][key], values, rtol=0, atol=atol, msg=key)


def test_with_lora_the_reference_is_the_base_model_with_adapters_off(model_dir, pairs_file, tmp_path):
    config = make_config(model_dir, pairs_file, tmp_path, method=DPO, lora={"r": 4, "alpha": 8}, max_steps=1)
    trainer = Trainer(config, ONE_CPU_RANK, RecordingReporter())
    with torch.no_grad():  # adapters that are not zero, as after some training, must not reach the reference
        for name, parameter in trainer.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    trainer.method.before_training(trainer)
    base = load_model(str(model_dir), torch.float32).eval()
    pairs = trainer.train_data.sequences[:4]
    batch = trainer._batch(pairs, False)
    with torch.no_grad():
        expected = trainer.method.sequence_log_probs(base, batch).view(2, -1).T
        with_adapters = trainer.method.sequence_log_probs(trainer.model.eval(), batch).view(2, -1).T
    torch.testing.assert_close(trainer.method.reference["train"][:4], expected, rtol=1e-5, atol=1e-5)
    assert (with_adapters - expected).abs().max() > 1e-2  # the adapters do change the scores


def test_the_fused_forward_gives_the_logits_paths_log_probs_and_gradients(model_dir, pairs_file, tmp_path):
    config = make_config(model_dir, pairs_file, tmp_path, method=DPO)
    method = DirectPreferenceOptimization(config, load_tokenizer(str(model_dir)), 0)
    model = load_model(str(model_dir), torch.float32).train()
    rows = method.load_data(str(pairs_file), packing=False).sequences[:3]
    batch = method.collate(rows, packed=False)
    results = []
    for fused in (False, True):
        if fused:
            apply_fusetune(model, rope=False, rms_norm=False, swiglu=False)  # only the output layer
            assert has_fused_loss(model)
        method.fused_forward = fused
        model.zero_grad()
        log_probs = method.sequence_log_probs(model, batch)
        (log_probs * torch.arange(1.0, 7.0)).sum().backward()
        results.append((log_probs.detach(), model.lm_head.weight.grad.clone()))
    revert_fusetune(model)
    assert results[0][0].shape == (6,) and (results[0][0] < 0).all()
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    ("loss_type", "sft_weight"), [("sigmoid", 0.0), ("ipo", 0.0), ("sigmoid", 0.5), ("ipo", 2.0)]
)
def test_each_loss_is_its_formula(model_dir, pairs_file, tmp_path, monkeypatch, loss_type, sft_weight):
    """The per-pair loss and rewards from known log-probabilities, against the formulas written out here."""
    import math

    method_spec = {"type": "dpo", "dpo": {"beta": 0.2, "loss_type": loss_type, "sft_weight": sft_weight}}
    config = make_config(model_dir, pairs_file, tmp_path, method=method_spec)
    method = DirectPreferenceOptimization(config, load_tokenizer(str(model_dir)), 0)
    # Two pairs: policy log-probabilities of (chosen 1, chosen 2, rejected 1, rejected 2), their references,
    # and output token counts 3, 5 (chosen) and 4, 2 (rejected).
    policy = torch.tensor([-4.0, -9.0, -7.5, -3.0])
    monkeypatch.setattr(method, "sequence_log_probs", lambda model, batch: policy)
    counts = [3, 5, 4, 2]
    labels = torch.full((4, 6), -100)
    for row, n in enumerate(counts):
        labels[row, :n] = 1
    batch = {
        "n_pairs": torch.tensor(2),
        "shifted_labels": labels,
        "reference_log_probs": torch.tensor([[-5.0, -7.0], [-8.0, -2.5]]),  # (chosen, rejected) per pair
    }
    losses, chosen_reward, rejected_reward = method._pair_terms(None, batch)

    beta = 0.2
    for pair in range(2):
        chosen_ratio = policy[pair].item() - batch["reference_log_probs"][pair, 0].item()
        rejected_ratio = policy[2 + pair].item() - batch["reference_log_probs"][pair, 1].item()
        if loss_type == "ipo":
            h = chosen_ratio / counts[pair] - rejected_ratio / counts[2 + pair]
            expected = (h - 1 / (2 * beta)) ** 2
        else:
            expected = math.log1p(math.exp(-beta * (chosen_ratio - rejected_ratio)))
        expected += sft_weight * -policy[pair].item() / counts[pair]  # the preferred output's mean token NLL
        assert losses[pair].item() == pytest.approx(expected, rel=1e-6)
        assert chosen_reward[pair].item() == pytest.approx(beta * chosen_ratio, rel=1e-6)
        assert rejected_reward[pair].item() == pytest.approx(beta * rejected_ratio, rel=1e-6)
