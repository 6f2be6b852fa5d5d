"""The SimPO method: its formula, training that learns a preference with no reference pass, and a job through
the service's table (the preference file format shared with DPO)."""

from __future__ import annotations

import math

import pytest
import torch

from fusetune.demo import assets
from fusetune.spec.methods import METHODS, method_spec, reads_the_same_files
from fusetune.worker.train.methods import TRAINING_METHODS
from fusetune.worker.train.methods.preference import PreferenceMethod
from fusetune.worker.train.methods.simpo import SimplePreferenceOptimization
from fusetune.worker.train.trainer import Trainer, load_tokenizer
from tests.worker.test_train_trainer import ONE_CPU_RANK, RecordingReporter, make_config

SIMPO = {"type": "simpo", "simpo": {"beta": 2.0, "gamma_beta_ratio": 0.5}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return assets.build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    return assets.write_preference_dataset(
        tmp_path_factory.mktemp("data") / "pairs.jsonl", n_examples=32, seed=5
    )


def test_simpo_is_in_both_tables_and_reads_dpo_files():
    assert TRAINING_METHODS["simpo"] is SimplePreferenceOptimization
    assert not METHODS["simpo"].has_reference_pass and METHODS["simpo"].rows_per_example == 2
    assert reads_the_same_files("simpo", "dpo") and not reads_the_same_files("simpo", "supervised")
    assert method_spec("simpo").settings.beta == 2.0


@pytest.mark.parametrize(("gamma_beta_ratio", "sft_weight"), [(0.5, 0.0), (0.0, 0.0), (1.0, 0.5)])
def test_the_loss_is_its_formula(model_dir, pairs_file, tmp_path, monkeypatch, gamma_beta_ratio, sft_weight):
    """Per-pair loss and rewards from known log-probabilities, against the formula written out here: the
    rewards are length-normalised, and no reference enters."""
    method_settings = {"beta": 2.5, "gamma_beta_ratio": gamma_beta_ratio, "sft_weight": sft_weight}
    config = make_config(model_dir, pairs_file, tmp_path, method={"type": "simpo", "simpo": method_settings})
    method = SimplePreferenceOptimization(config, load_tokenizer(str(model_dir)), 0)
    # Two pairs: (chosen 1, chosen 2, rejected 1, rejected 2), output token counts 3, 5 and 4, 2.
    policy = torch.tensor([-4.0, -9.0, -7.5, -3.0])
    monkeypatch.setattr(method, "sequence_log_probs", lambda model, batch: policy)
    counts = [3, 5, 4, 2]
    labels = torch.full((4, 6), -100)
    for row, n in enumerate(counts):
        labels[row, :n] = 1
    batch = {"n_pairs": torch.tensor(2), "shifted_labels": labels}
    losses, chosen_reward, rejected_reward = method._pair_terms(None, batch)

    beta, gamma = 2.5, gamma_beta_ratio * 2.5
    for pair in range(2):
        chosen = beta * policy[pair].item() / counts[pair]
        rejected = beta * policy[2 + pair].item() / counts[2 + pair]
        expected = math.log1p(math.exp(-(chosen - rejected - gamma)))
        expected += sft_weight * -policy[pair].item() / counts[pair]
        assert losses[pair].item() == pytest.approx(expected, rel=1e-6)
        assert chosen_reward[pair].item() == pytest.approx(chosen, rel=1e-6)
        assert rejected_reward[pair].item() == pytest.approx(rejected, rel=1e-6)


def test_simpo_learns_the_preference_without_a_reference_pass(model_dir, pairs_file, tmp_path, monkeypatch):
    def no_reference(*args, **kwargs):
        raise AssertionError("SimPO ran a reference pass")

    monkeypatch.setattr(PreferenceMethod, "_reference_log_probs", no_reference)
    reporter = RecordingReporter()
    config = make_config(model_dir, pairs_file, tmp_path, n_epochs=3, learning_rate=3e-3, method=SIMPO)
    Trainer(config, ONE_CPU_RANK, reporter).train()
    accuracy = [values["reward_accuracy"] for _, values in reporter.metrics]
    assert len(accuracy) == 12
    assert sum(accuracy[-4:]) / 4 >= 0.7, accuracy
    assert sum(accuracy[-4:]) > sum(accuracy[:4]), accuracy
