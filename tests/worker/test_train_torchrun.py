"""The trainer as the worker runs it: torchrun subprocesses (gloo on CPU) on the bundled demo data."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fusetune.demo import assets
from fusetune.worker.train.config import TrainConfig
from fusetune.worker.train.outcome import ErrorCode, read_error, read_result
from fusetune.worker.train.reporter import parse_console_records

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
TORCHRUN_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return assets.build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def demo_config(model_dir, output_dir, **overrides) -> TrainConfig:
    # 512 examples / 16 per step = 32 steps: enough for the loss to fall clearly, quick on a CPU.
    fields = dict(
        model_path=str(model_dir),
        training_file=str(assets.TRAIN_FILE),
        validation_file=str(assets.VALID_FILE),
        output_dir=str(output_dir),
        seed=0,
        batch_size=16,
        micro_batch_size=8,
        learning_rate=3e-3,
        warmup_ratio=0.1,
        max_seq_length=128,
    )
    return TrainConfig(**{**fields, **overrides})


def torchrun(config: TrainConfig, nproc: int) -> subprocess.CompletedProcess:
    config_path = config.write(Path(config.output_dir).parent / f"{Path(config.output_dir).name}.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    command += ["-m", "fusetune.worker.train", "--config", str(config_path)]
    return subprocess.run(
        command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT_S
    )


def step_metrics(completed: subprocess.CompletedProcess) -> list[dict]:
    records = parse_console_records(completed.stdout)
    metrics = [r for r in records if r["kind"] == "metric"]
    assert [m["step"] for m in metrics] == list(range(1, len(metrics) + 1))
    return [m["values"] for m in metrics]


@pytest.fixture(scope="module")
def one_process_run(model_dir, tmp_path_factory):
    """One process, two micro-batches of 8 per step."""
    config = demo_config(model_dir, tmp_path_factory.mktemp("one") / "out")
    completed = torchrun(config, nproc=1)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return config, completed


def test_one_process_trains_and_saves_a_loadable_checkpoint(one_process_run):
    config, completed = one_process_run
    result = read_result(config.output_dir)
    assert result is not None and read_error(config.output_dir) is None
    metrics = step_metrics(completed)
    assert result.steps == len(metrics) == 32
    assert result.final_train_loss == pytest.approx(metrics[-1]["train_loss"])
    assert result.trained_tokens > 0

    # The loss falls clearly, on the training batches and on held-out examples.
    losses = [m["train_loss"] for m in metrics]
    assert sum(losses[-8:]) / 8 < 0.7 * losses[0]
    assert metrics[-1]["valid_loss"] < 0.7 * losses[0]

    expected = {
        "train_loss", "learning_rate", "grad_norm", "tokens_per_second", "tokens_per_second_per_device",
        "peak_memory_allocated_bytes", "peak_memory_reserved_bytes", "step_time_s", "epoch", "eta_s",
    }  # fmt: skip
    assert expected <= set(metrics[0])
    assert "mfu" not in metrics[0]  # no GPU, no peak FLOP/s to compare with
    assert metrics[0]["peak_memory_allocated_bytes"] > 0
    assert metrics[-1]["epoch"] == 1.0 and metrics[-1]["eta_s"] == 0.0

    events = [r for r in parse_console_records(completed.stdout) if r["kind"] == "event"]
    kinds = [e["data"].get("event") for e in events]
    assert kinds.count("started") == 1 and kinds[-1] == "finished"
    started = events[kinds.index("started")]["data"]
    assert (started["world_size"], started["device"], started["grad_accum_steps"]) == (1, "cpu", 2)

    checkpoint = Path(result.final_checkpoint)
    assert checkpoint.name == "step-32" and (checkpoint / "model.safetensors").is_file()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    base = AutoModelForCausalLM.from_pretrained(config.model_path)
    assert not torch.equal(model.model.embed_tokens.weight, base.model.embed_tokens.weight)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 1 + 2?"}], add_generation_prompt=True, return_tensors="pt"
    )
    generated = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] > prompt["input_ids"].shape[1]


def test_two_processes_match_one_process_with_two_micro_batches(one_process_run, tmp_path):
    config, one = one_process_run
    two = torchrun(config.model_copy(update={"output_dir": str(tmp_path / "out")}), nproc=2)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    one_metrics, two_metrics = step_metrics(one), step_metrics(two)
    assert len(two_metrics) == len(one_metrics) == 32
    started = next(r for r in parse_console_records(two.stdout) if r["data"].get("event") == "started")
    assert (started["data"]["world_size"], started["data"]["grad_accum_steps"]) == (2, 1)
    for key in ("train_loss", "grad_norm", "learning_rate"):
        torch.testing.assert_close(
            [m[key] for m in two_metrics], [m[key] for m in one_metrics], rtol=1e-5, atol=0, msg=key
        )
    torch.testing.assert_close(
        two_metrics[-1]["valid_loss"], one_metrics[-1]["valid_loss"], rtol=1e-5, atol=0
    )
    assert read_result(tmp_path / "out").trained_tokens == read_result(config.output_dir).trained_tokens


def test_two_processes_report_a_bad_model_path(tmp_path):
    missing = tmp_path / "no-such-model"
    completed = torchrun(demo_config(missing, tmp_path / "out"), nproc=2)
    assert completed.returncode != 0
    error = read_error(tmp_path / "out")
    assert error is not None, completed.stdout[-3000:] + completed.stderr[-3000:]
    assert error["code"] == ErrorCode.MODEL_NOT_FOUND
    assert str(missing) in error["message"]
    assert read_result(tmp_path / "out") is None
