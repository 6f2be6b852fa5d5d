"""The trainer as the worker runs it: torchrun subprocesses (gloo on CPU) on the bundled demo data: one process,
two under DDP, two under FSDP2, and an FSDP run killed with SIGKILL mid-training that resumes from its last
checkpoint, also with bf16-sr-8bit's sharded 8-bit optimizer state; and two-rank FSDP2 checkpoints resumed by one
process (another world size), plain AdamW state and the 8-bit one."""

import os
import signal
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
        n_epochs=1,
        batch_size=16,
        micro_batch_size=8,
        learning_rate=3e-3,
        warmup_ratio=0.1,
        max_seq_length=128,
    )
    return TrainConfig(**{**fields, **overrides})


# The trainer's entry point, and the same with the bf16-sr modes allowed on this CPU (their kernels interpreted).
TRAINER = "fusetune.worker.train"
TRAINER_WITH_BF16_SR = "tests.worker.bf16_sr_train"


def torchrun_command(
    config: TrainConfig, nproc: int, module: str = TRAINER
) -> tuple[list[str], dict[str, str]]:
    config_path = config.write(Path(config.output_dir).parent / f"{Path(config.output_dir).name}.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return command + ["-m", module, "--config", str(config_path)], env


def torchrun(config: TrainConfig, nproc: int, module: str = TRAINER) -> subprocess.CompletedProcess:
    command, env = torchrun_command(config, nproc, module)
    return subprocess.run(
        command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT_S
    )


def step_metrics(output: subprocess.CompletedProcess | str, first_step: int = 1) -> list[dict]:
    records = parse_console_records(output if isinstance(output, str) else output.stdout)
    metrics = [r for r in records if r["kind"] == "metric"]
    assert [m["step"] for m in metrics] == list(range(first_step, first_step + len(metrics)))
    return [m["values"] for m in metrics]


def assert_same_curves(
    actual: list[dict], expected: list[dict], rtol: float, keys=("train_loss", "grad_norm")
):
    assert len(actual) == len(expected)
    for key in (*keys, "learning_rate"):
        torch.testing.assert_close(
            [m[key] for m in actual], [m[key] for m in expected], rtol=rtol, atol=0, msg=key
        )


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
        "trained_tokens_per_second", "padding_fraction",
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
    assert started["mfu_peak_flops"] is None

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


@pytest.fixture(scope="module")
def ddp_run(one_process_run, tmp_path_factory):
    """Two processes under DDP, one micro-batch of 8 each per step."""
    config, _ = one_process_run
    config = config.model_copy(update={"output_dir": str(tmp_path_factory.mktemp("ddp") / "out")})
    completed = torchrun(config, nproc=2)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return config, completed


def test_two_processes_match_one_process_with_two_micro_batches(one_process_run, ddp_run):
    config, one = one_process_run
    ddp_config, two = ddp_run
    one_metrics, two_metrics = step_metrics(one), step_metrics(two)
    assert len(two_metrics) == len(one_metrics) == 32
    started = next(r for r in parse_console_records(two.stdout) if r["data"].get("event") == "started")
    assert (started["data"]["world_size"], started["data"]["grad_accum_steps"]) == (2, 1)
    assert started["data"]["distributed"] == "ddp"
    assert_same_curves(two_metrics, one_metrics, rtol=1e-5)
    torch.testing.assert_close(
        two_metrics[-1]["valid_loss"], one_metrics[-1]["valid_loss"], rtol=1e-5, atol=0
    )
    assert read_result(ddp_config.output_dir).trained_tokens == read_result(config.output_dir).trained_tokens


@pytest.mark.slow
def test_four_processes_match_one_process_with_four_micro_batches(model_dir, tmp_path):
    """The global-token normalisation across ranks and micro-batches: 1 process x 4 micro-batches of 4 and
    4 processes x 1 micro-batch of 4 give the same curve (8 steps of 16 sequences)."""
    runs = {}
    for nproc in (1, 4):
        config = demo_config(model_dir, tmp_path / f"out-{nproc}", micro_batch_size=4, max_steps=8)
        completed = torchrun(config, nproc=nproc)
        assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
        started = next(
            r for r in parse_console_records(completed.stdout) if r["data"].get("event") == "started"
        )
        assert (started["data"]["world_size"], started["data"]["grad_accum_steps"]) == (nproc, 4 // nproc)
        runs[nproc] = step_metrics(completed)
    assert len(runs[1]) == len(runs[4]) == 8
    assert_same_curves(runs[4], runs[1], rtol=1e-5)


def fsdp_config(config: TrainConfig, output_dir: Path) -> TrainConfig:
    # Checkpoints every 4 steps: the killed run below resumes from one. Micro-batches of 4 make each rank
    # accumulate two per step, which FSDP must not reduce early.
    update = {
        "output_dir": str(output_dir),
        "distributed": "fsdp",
        "micro_batch_size": 4,
        "checkpoint_every_steps": 4,
    }
    return config.model_copy(update=update)


@pytest.fixture(scope="module")
def fsdp_run(one_process_run, tmp_path_factory):
    config = fsdp_config(one_process_run[0], tmp_path_factory.mktemp("fsdp") / "out")
    completed = torchrun(config, nproc=2)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return config, completed


def test_fsdp_matches_ddp(ddp_run, fsdp_run):
    ddp_config, ddp = ddp_run
    fsdp_config_, fsdp = fsdp_run
    started = next(r for r in parse_console_records(fsdp.stdout) if r["data"].get("event") == "started")
    assert (started["data"]["distributed"], started["data"]["grad_accum_steps"]) == ("fsdp", 2)
    ddp_metrics, fsdp_metrics = step_metrics(ddp), step_metrics(fsdp)
    # The same sums in another order (reduce-scatter of shards instead of an all-reduce of buckets).
    assert_same_curves(fsdp_metrics, ddp_metrics, rtol=1e-5)
    torch.testing.assert_close(
        fsdp_metrics[-1]["valid_loss"], ddp_metrics[-1]["valid_loss"], rtol=1e-5, atol=0
    )
    # Rank 0 gathered the sharded weights into an ordinary checkpoint.
    from_fsdp = AutoModelForCausalLM.from_pretrained(read_result(fsdp_config_.output_dir).final_checkpoint)
    from_ddp = AutoModelForCausalLM.from_pretrained(read_result(ddp_config.output_dir).final_checkpoint)
    for (name, a), (_, b) in zip(from_ddp.named_parameters(), from_fsdp.named_parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5, msg=name)


def test_fsdp_run_killed_mid_training_resumes_on_the_same_curve(fsdp_run, tmp_path):
    assert_killed_run_resumes_on_the_same_curve(*fsdp_run, tmp_path, TRAINER, rtol=1e-6)


def assert_killed_run_resumes_on_the_same_curve(
    whole_config: TrainConfig,
    whole: subprocess.CompletedProcess,
    tmp_path: Path,
    module: str,
    rtol: float,
) -> None:
    """`whole_config` run again under FSDP on 2 processes, killed at its first checkpoint and started again:
    the resumed steps continue `whole`'s curve."""
    config = fsdp_config(whole_config, tmp_path / "out")
    command, env = torchrun_command(config, nproc=2, module=module)
    process = subprocess.Popen(
        command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    killed_output = []
    try:
        for line in process.stdout:
            killed_output.append(line)
            records = parse_console_records(line)
            if records and records[0]["kind"] == "checkpoint":
                os.killpg(process.pid, signal.SIGKILL)  # torchrun and both ranks, mid-training
                break
    finally:
        process.kill()
        killed_output.append(process.communicate(timeout=60)[0])
    killed_output = "".join(killed_output)
    assert process.returncode == -signal.SIGKILL, killed_output[-3000:]
    assert read_result(config.output_dir) is None

    resumed = torchrun(config, nproc=2, module=module)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    events = [r["data"] for r in parse_console_records(resumed.stdout) if r["kind"] == "event"]
    resumed_from = next(data["step"] for data in events if data.get("event") == "resumed")
    total_steps = len(step_metrics(whole))
    assert resumed_from % 4 == 0 and 4 <= resumed_from < total_steps
    # The steps the killed run made after its checkpoint are made again; the curve is the uninterrupted one.
    before = step_metrics(killed_output)[:resumed_from]
    after = step_metrics(resumed, first_step=resumed_from + 1)
    assert_same_curves(before + after, step_metrics(whole), rtol=rtol)
    assert (
        read_result(config.output_dir).trained_tokens == read_result(whole_config.output_dir).trained_tokens
    )


def test_two_processes_report_a_bad_model_path(tmp_path):
    missing = tmp_path / "no-such-model"
    completed = torchrun(demo_config(missing, tmp_path / "out"), nproc=2)
    assert completed.returncode != 0
    error = read_error(tmp_path / "out")
    assert error is not None, completed.stdout[-3000:] + completed.stderr[-3000:]
    assert error["code"] == ErrorCode.MODEL_NOT_FOUND
    assert str(missing) in error["message"]
    assert read_result(tmp_path / "out") is None


def test_dpo_under_ddp_and_fsdp_matches_one_process(model_dir, tmp_path):
    """The reference pass split over ranks and the pair losses normalised over all ranks' pairs: DDP and FSDP2
    on two processes follow one process's curve (loss, rewards) step for step."""
    pairs = assets.write_preference_dataset(tmp_path / "pairs.jsonl", n_examples=32, seed=5)
    base = demo_config(
        model_dir, tmp_path / "one", training_file=str(pairs), validation_file=None, batch_size=8,
        micro_batch_size=2, max_steps=4, method={"type": "dpo", "dpo": {"beta": 0.1}},
    )  # fmt: skip
    runs = {}
    for name, nproc, distributed in (("one", 1, "ddp"), ("ddp", 2, "ddp"), ("fsdp", 2, "fsdp")):
        config = base.model_copy(update={"output_dir": str(tmp_path / name), "distributed": distributed})
        completed = torchrun(config, nproc=nproc)
        assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
        runs[name] = step_metrics(completed)
    keys = ("train_loss", "grad_norm", "chosen_reward", "rejected_reward", "reward_margin")
    assert len(runs["one"]) == 4
    assert_same_curves(runs["ddp"], runs["one"], rtol=1e-5, keys=keys)
    assert_same_curves(runs["fsdp"], runs["one"], rtol=1e-5, keys=keys)


def test_reinforcement_under_ddp_and_fsdp_follows_one_curve(model_dir, tmp_path):
    """Each rank samples completions for its own prompts, with its own seed: DDP and FSDP2 on two processes
    sample the same completions (FSDP2 from its weights gathered whole for sampling), score them alike and
    follow one curve (reward, loss, gradient norm) step for step. A fuzzy-match grader gives partial scores, so
    the advantages, and so the loss and its gradient, are not all zero."""
    import json

    chats = [json.loads(line) for line in assets.TRAIN_FILE.read_text().splitlines()[:16]]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(
        json.dumps({"messages": chat["messages"][:-1], "answer": chat["messages"][-1]["content"]}) + "\n"
        for chat in chats))  # fmt: skip
    grader = {"type": "text_similarity", "name": "close", "evaluation_metric": "fuzzy_match",
              "input": "{{ sample.output_text }}", "reference": "{{ item.answer }}"}  # fmt: skip
    base = demo_config(
        model_dir, tmp_path / "ddp", training_file=str(prompts), validation_file=None, batch_size=4,
        micro_batch_size=1, max_steps=3, learning_rate=1e-3, warmup_ratio=0.0,
        method={"type": "reinforcement", "reinforcement": {"grader": grader, "n": 4, "max_completion_tokens": 6}},
    )  # fmt: skip
    runs = {}
    for distributed in ("ddp", "fsdp"):
        config = base.model_copy(
            update={"output_dir": str(tmp_path / distributed), "distributed": distributed}
        )
        completed = torchrun(config, nproc=2)
        assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
        runs[distributed] = step_metrics(completed)
    assert len(runs["ddp"]) == 3
    assert max(abs(m["train_loss"]) for m in runs["ddp"]) > 0 and max(m["grad_norm"] for m in runs["ddp"]) > 0
    keys = ("train_loss", "grad_norm", "reward_mean", "reward_std", "completion_length")
    assert_same_curves(runs["fsdp"], runs["ddp"], rtol=1e-5, keys=keys)


@pytest.fixture(scope="module")
def fsdp_8bit_run(model_dir, tmp_path_factory):
    """bf16-sr-8bit under FSDP2 on 2 processes, 8 steps with checkpoints every 4 (the optimizer's interpreted
    kernel is slow here)."""
    output_dir = tmp_path_factory.mktemp("fsdp-8bit") / "out"
    config = fsdp_config(
        demo_config(model_dir, output_dir, precision="bf16-sr-8bit", max_steps=8), output_dir
    )
    completed = torchrun(config, nproc=2, module=TRAINER_WITH_BF16_SR)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    started = next(r for r in parse_console_records(completed.stdout) if r["data"].get("event") == "started")
    data = started["data"]
    assert (data["distributed"], data["world_size"], data["optimizer"]) == ("fsdp", 2, "adamw-8bit")
    assert len(step_metrics(completed)) == 8
    return config, completed


def test_fsdp_with_8bit_state_killed_mid_training_resumes_exactly(fsdp_8bit_run, tmp_path):
    """Each rank's 8-bit codes and block scales go into the checkpoint (gathered whole by rank 0) and come back
    to the same ranks' shards, and the rounding bits follow (seed, step), so the run killed at its first
    checkpoint and resumed on the same world size continues the uninterrupted curve exactly."""
    assert_killed_run_resumes_on_the_same_curve(*fsdp_8bit_run, tmp_path, TRAINER_WITH_BF16_SR, rtol=0)


def resume_from_a_copy(
    config: TrainConfig,
    checkpoint: Path,
    output_dir: Path,
    nproc: int,
    module: str = TRAINER,
    edit_optimizer_state=None,
) -> subprocess.CompletedProcess:
    """`config` resumed on `nproc` processes from a copy of `checkpoint` alone, in a fresh output folder
    (`edit_optimizer_state(state)`, if given, changes the copy's optimizer state in place first)."""
    import shutil

    from fusetune.worker.train.checkpoints import layout

    step = int(checkpoint.name.removeprefix(layout.CHECKPOINT_PREFIX))
    shutil.copytree(checkpoint, layout.checkpoint_path(output_dir, step))
    if edit_optimizer_state is not None:
        path = layout.training_state_dir(layout.checkpoint_path(output_dir, step)) / layout.OPTIMIZER_FILENAME
        state = torch.load(path, weights_only=True)
        edit_optimizer_state(state)
        torch.save(state, path)
    resumed = torchrun(config.model_copy(update={"output_dir": str(output_dir)}), nproc=nproc, module=module)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    events = [r["data"] for r in parse_console_records(resumed.stdout) if r["kind"] == "event"]
    started = next(data for data in events if data.get("event") == "started")
    assert started["world_size"] == nproc
    assert next(data["step"] for data in events if data.get("event") == "resumed") == step
    return resumed


def test_fsdp_run_resumes_on_one_process(fsdp_run, tmp_path):
    """Plain AdamW state under FSDP2 (a full state dict keyed by parameter name in the checkpoint): the 2-rank
    run's next-to-last checkpoint resumed by one process continues its curve, the same sums in another order
    (one process's four micro-batches instead of two ranks' two), within test_fsdp_matches_ddp's tolerance."""
    from fusetune.worker.train.checkpoints import layout

    config, whole = fsdp_run
    (step, checkpoint), _ = layout.list_checkpoints(config.output_dir)  # keep_last_checkpoints: 2
    resumed = resume_from_a_copy(config, checkpoint, tmp_path / "out", nproc=1)
    whole_metrics = step_metrics(whole)
    assert 0 < step < len(whole_metrics)
    assert_same_curves(step_metrics(resumed, first_step=step + 1), whole_metrics[step:], rtol=1e-5)


def test_fsdp_with_8bit_state_resumes_on_one_process_within_the_rounding_spread(
    fsdp_8bit_run, model_dir, tmp_path
):
    """The 2-rank bf16-sr-8bit run's step-4 checkpoint (scales of 2 shards' blocks) resumed by one process: the
    8-bit moments are decoded in the saved blocks and encoded again in the whole tensors' (FusedAdamW8bit's
    docstring), so the curve is not bit-equal; it continues the 2-rank one no farther than the same job run
    start to end on one process lies from it (the optimizer's own spread under another sharding: its blocks and
    rounding bits differ from the first step). A resume that lost the moments (the copy's codes and scales
    zeroed, the step count kept) falls outside it."""
    config, whole = fsdp_8bit_run
    whole_losses = [m["train_loss"] for m in step_metrics(whole)]
    one = torchrun(config.model_copy(update={"output_dir": str(tmp_path / "one")}), 1, TRAINER_WITH_BF16_SR)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    one_losses = [m["train_loss"] for m in step_metrics(one)]

    def distance(losses: list[float]) -> float:
        return max(abs(a - b) for a, b in zip(losses, whole_losses[4:], strict=True))

    spread = distance(one_losses[4:])
    checkpoint = Path(config.output_dir) / "checkpoints" / "step-4"
    resumed = resume_from_a_copy(config, checkpoint, tmp_path / "resumed", 1, TRAINER_WITH_BF16_SR)
    resumed_losses = [m["train_loss"] for m in step_metrics(resumed, first_step=5)]

    def without_moments(state: dict) -> None:
        for parameter_state in state["state"].values():
            for name in ("exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales"):
                parameter_state[name].zero_()

    lost = resume_from_a_copy(
        config, checkpoint, tmp_path / "lost", 1, TRAINER_WITH_BF16_SR, edit_optimizer_state=without_moments
    )
    lost_losses = [m["train_loss"] for m in step_metrics(lost, first_step=5)]
    assert 0 < distance(resumed_losses) <= spread, (resumed_losses, whole_losses, one_losses)
    assert distance(lost_losses) > spread, (lost_losses, whole_losses, one_losses)
