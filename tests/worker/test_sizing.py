"""Micro-batches sized to the memory free on the GPU (the decision; the GPU's free memory is an argument)."""

import pytest

from fusetune.demo import assets
from fusetune.spec.estimate import DataCounts, ModelShape, estimate_job
from fusetune.spec.hyperparameters import JobHyperparameters
from fusetune.spec.job import JobSpec
from fusetune.worker.train.config import TrainConfig
from fusetune.worker.train.outcome import ErrorCode, TrainingFailure
from fusetune.worker.train.sizing import fitting_micro_batch


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return assets.build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _config(model_dir, **overrides) -> TrainConfig:
    fields = dict(model_path=str(model_dir), training_file="t.jsonl", output_dir="o", batch_size=8,
                  max_seq_length=128, precision="bf16-sr")  # fmt: skip
    return TrainConfig(**{**fields, **overrides})


def test_the_largest_micro_batch_that_fits_the_free_memory(model_dir):
    config = _config(model_dir)
    lengths = [100] * 64
    shape = ModelShape.from_config_file(model_dir / "config.json")

    def peak(micro: int) -> int:
        job = JobSpec(
            hyperparameters=JobHyperparameters(batch_size=8, max_seq_length=128, precision="bf16-sr")
        )
        data = DataCounts(example_count=64, token_estimate=6400, padded_length=100)
        return estimate_job(shape, job, data, micro_batch_size=micro).peak_memory_bytes_per_gpu

    assert fitting_micro_batch(config, 1, peak(8), lengths, 1) == 8
    assert fitting_micro_batch(config, 1, peak(4) + 1, lengths, 1) == 4
    assert fitting_micro_batch(config, 2, peak(8), lengths, 1) == 4  # 4 sequences per GPU
    # A micro-batch pads to the data's longest row, not to max_seq_length: longer rows need more memory.
    assert fitting_micro_batch(config, 1, peak(4) + 1, [128] * 64, 1) < 4
    with pytest.raises(TrainingFailure) as refused:
        fitting_micro_batch(config, 1, peak(1) - 1, lengths, 1)
    assert refused.value.code == ErrorCode.OUT_OF_MEMORY
    assert "even at micro_batch_size 1" in refused.value.message


def test_a_model_without_a_readable_config_keeps_the_default(tmp_path):
    assert fitting_micro_batch(_config(tmp_path), 1, 2**40, [100] * 8, 1) is None
