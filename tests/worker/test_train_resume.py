"""Exact resume from checkpoints with training state, pause and cancel through the job's SQL status, and
pruning of old checkpoints (folders, download archives and rows)."""

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fusetune.demo import assets
from fusetune.worker.train.checkpoints import layout as ckpt
from fusetune.worker.train.checkpoints.state import RESUME_FORMAT, RESUME_METHOD, RESUME_RUN
from fusetune.worker.train.launch import run
from fusetune.worker.train.outcome import (
    EXIT_STOPPED,
    ErrorCode,
    JobStopped,
    TrainingFailure,
    read_result,
    read_stopped,
)
from fusetune.worker.train.reporter import StopRequest
from fusetune.worker.train.trainer import Trainer
from tests.worker.test_train_trainer import (
    ONE_CPU_RANK,
    RecordingReporter,
    event_data,
    make_config,
    make_job_database,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
# 48 examples / 8 per step = 6 steps per epoch; 2 epochs, so a resume mid-epoch crosses an epoch boundary.
RUN = dict(n_epochs=2, checkpoint_every_steps=4, warmup_ratio=0.2)
PAUSE_AFTER_STEP = 5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return assets.build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def train_file(tmp_path_factory):
    return assets.write_demo_dataset(tmp_path_factory.mktemp("data") / "train.jsonl", n_examples=48, seed=5)


def curve(reporter: RecordingReporter, key: str = "train_loss") -> list[float]:
    return [values[key] for _, values in reporter.metrics]


def train_paused_then_resumed(config) -> tuple[RecordingReporter, RecordingReporter, Trainer]:
    """Train until a pause after PAUSE_AFTER_STEP steps, then start a new trainer on the same output_dir."""
    before = RecordingReporter(stop_after_step=PAUSE_AFTER_STEP, stop=StopRequest.PAUSE)
    with pytest.raises(JobStopped) as stopped:
        Trainer(config, ONE_CPU_RANK, before).train()
    assert stopped.value.reason == "paused"
    after = RecordingReporter()
    resumed = Trainer(config, ONE_CPU_RANK, after)
    resumed.train()
    return before, after, resumed


@pytest.fixture(scope="module")
def uninterrupted(model_dir, train_file, tmp_path_factory):
    reporter = RecordingReporter()
    trainer = Trainer(
        make_config(model_dir, train_file, tmp_path_factory.mktemp("whole"), **RUN), ONE_CPU_RANK, reporter
    )
    result = trainer.train()
    return reporter, trainer, result


def test_a_paused_run_resumes_on_the_same_loss_curve(uninterrupted, model_dir, train_file, tmp_path):
    whole, whole_trainer, whole_result = uninterrupted
    config = make_config(model_dir, train_file, tmp_path, **RUN)
    before, after, resumed = train_paused_then_resumed(config)

    # The pause saved a checkpoint at the step it stopped at, off the 4-step schedule, and the run resumed there.
    assert [step for step, _ in before.checkpoints] == [4, PAUSE_AFTER_STEP]
    resumed_event = next(data for _, data in after.events if data.get("event") == "resumed")
    assert resumed_event["step"] == PAUSE_AFTER_STEP
    assert [step for step, _ in after.metrics] == list(range(PAUSE_AFTER_STEP + 1, 13))

    # Fp32 on one CPU process is deterministic: the continued curve is the uninterrupted one, step for step.
    for key in ("train_loss", "learning_rate", "grad_norm"):
        torch.testing.assert_close(
            curve(before, key) + curve(after, key), curve(whole, key), rtol=1e-6, atol=0
        )
    for (name, a), (_, b) in zip(
        whole_trainer.model.named_parameters(), resumed.model.named_parameters(), strict=True
    ):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-7, msg=name)
    assert resumed.trained_tokens == whole_result.trained_tokens


# The optimizer step inside the backward clips each step by the previous step's norm (clipping well below the
# tiny model's norms, so that the carried norm matters), which the checkpoint must carry.
IN_BACKWARD = {"optimizer_in_backward": True, "micro_batch_size": 8, "max_grad_norm": 0.05}
# The state in host memory, staged for each parameter's update inside the backward (the 24 GiB plan of an 8B
# model); on a CPU the staging runs between two buffers of the same memory.
HOST_STATE = {**IN_BACKWARD, "optimizer_state_on_host": True}


@pytest.mark.parametrize(
    ("precision", "plan"),
    [("bf16-sr", {}), ("bf16-sr-8bit", {}), ("bf16-sr", IN_BACKWARD), ("bf16-sr", HOST_STATE)],
    ids=["bf16-sr", "bf16-sr-8bit", "bf16-sr-optimizer-in-backward", "bf16-sr-state-on-host"],
)
def test_a_bf16_sr_run_resumes_exactly(model_dir, train_file, tmp_path, bf16_sr_on_cpu, precision, plan):
    """bf16 weights with stochastically rounded AdamW (moments in bf16, or in 8-bit codes with their block
    scales; stepped after the backward or inside it): the moments and the step count come back from the
    checkpoint, and the rounding bits follow (seed, step), so the resumed run draws the bits the uninterrupted
    one drew."""
    run_config = dict(RUN, n_epochs=1, checkpoint_every_steps=3, precision=precision, **plan)
    whole = RecordingReporter()
    whole_trainer = Trainer(
        make_config(model_dir, train_file, tmp_path / "whole", **run_config), ONE_CPU_RANK, whole
    )
    whole_trainer.train()
    assert (
        type(whole_trainer.optimizer).__name__
        == {"bf16-sr": "FusedAdamW", "bf16-sr-8bit": "FusedAdamW8bit"}[precision]
    )
    assert (whole_trainer.optimizer.host_state is not None) == ("optimizer_state_on_host" in plan)
    before, after, resumed = train_paused_then_resumed(
        make_config(model_dir, train_file, tmp_path / "r", **run_config)
    )
    assert curve(before) + curve(after) == curve(whole)
    for a, b in zip(whole_trainer.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_resuming_without_the_optimizer_state_leaves_the_curve(
    uninterrupted, model_dir, train_file, tmp_path, monkeypatch
):
    """Control: the comparison above notices a resume that loses part of the state."""
    whole, _, _ = uninterrupted
    monkeypatch.setattr(Trainer, "_restore_optimizer", lambda self, checkpoint: None)
    before, after, _ = train_paused_then_resumed(make_config(model_dir, train_file, tmp_path, **RUN))
    with pytest.raises(AssertionError):
        torch.testing.assert_close(curve(before) + curve(after), curve(whole), rtol=1e-6, atol=0)


def test_a_finished_run_started_again_reports_its_result_without_training(model_dir, train_file, tmp_path):
    config = make_config(model_dir, train_file, tmp_path, max_steps=3)
    assert run(config) == 0
    first = read_result(tmp_path)
    (tmp_path / "result.json").unlink()  # as if the process died right after the final checkpoint
    reporter = RecordingReporter()
    trainer = Trainer(config, ONE_CPU_RANK, reporter)
    assert trainer.train() == first
    assert reporter.metrics == [] and reporter.checkpoints == []

    fresh = Trainer(config.model_copy(update={"resume": False}), ONE_CPU_RANK, RecordingReporter())
    assert (fresh.step, fresh.trained_tokens) == (0, 0)


def test_resume_refuses_a_checkpoint_of_a_different_run(model_dir, train_file, tmp_path):
    config = make_config(model_dir, train_file, tmp_path, checkpoint_every_steps=2, max_steps=2)
    Trainer(config, ONE_CPU_RANK, RecordingReporter()).train()
    with pytest.raises(TrainingFailure) as refused:
        Trainer(config.model_copy(update={"batch_size": 16}), ONE_CPU_RANK, RecordingReporter())
    assert refused.value.code == ErrorCode.TRAINER_ERROR
    assert "batch_size=8 there, 16 now" in refused.value.message


def _rewrite_resume_state(checkpoint, change) -> None:
    path = checkpoint / ckpt.TRAINING_STATE_DIRNAME / ckpt.RESUME_STATE_FILENAME
    torch.save(change(torch.load(path, weights_only=True)), path)


def _first_format(state: dict) -> dict:
    """resume.pt as the trainer wrote it before training methods: no format, no method state or name."""
    old = {key: value for key, value in state.items() if key not in (RESUME_FORMAT, RESUME_METHOD)}
    old[RESUME_RUN] = {key: value for key, value in state[RESUME_RUN].items() if key != "method"}
    return old


def test_a_checkpoint_of_the_first_format_resumes_and_a_newer_format_is_refused(
    model_dir, train_file, tmp_path
):
    whole = RecordingReporter()
    Trainer(make_config(model_dir, train_file, tmp_path / "whole", max_steps=3), ONE_CPU_RANK, whole).train()
    config = make_config(model_dir, train_file, tmp_path / "old", max_steps=3)
    with pytest.raises(JobStopped):
        Trainer(config, ONE_CPU_RANK, RecordingReporter(stop_after_step=2, stop=StopRequest.PAUSE)).train()
    _rewrite_resume_state(ckpt.checkpoint_path(config.output_dir, 2), _first_format)

    after = RecordingReporter()
    Trainer(config, ONE_CPU_RANK, after).train()
    assert [step for step, _ in after.metrics] == [3]
    torch.testing.assert_close(curve(after), curve(whole)[2:], rtol=1e-6, atol=0)

    _rewrite_resume_state(
        ckpt.checkpoint_path(config.output_dir, 3), lambda state: {**state, RESUME_FORMAT: 99}
    )
    with pytest.raises(TrainingFailure) as refused:
        Trainer(config.model_copy(update={"max_steps": 4}), ONE_CPU_RANK, RecordingReporter())
    assert "format 99" in refused.value.message and "resume to false" in refused.value.message


def test_an_interrupted_save_is_ignored_and_cleaned_up(model_dir, train_file, tmp_path):
    config = make_config(model_dir, train_file, tmp_path, checkpoint_every_steps=2, max_steps=2)
    Trainer(config, ONE_CPU_RANK, RecordingReporter()).train()
    # A save of step 4 cut short by a crash, and a checkpoint folder whose training state never got written.
    half_written = ckpt.checkpoints_root(tmp_path) / f"step-4{ckpt.INCOMPLETE_SUFFIX}"
    half_written.mkdir()
    (ckpt.checkpoints_root(tmp_path) / "step-3").mkdir()
    assert ckpt.latest_resumable(tmp_path) == (2, ckpt.checkpoint_path(tmp_path, 2))
    trainer = Trainer(config.model_copy(update={"max_steps": 4}), ONE_CPU_RANK, RecordingReporter())
    assert trainer.step == 2
    assert not half_written.exists()


def test_pruned_checkpoints_go_with_their_rows(model_dir, train_file, tmp_path):
    reporter = RecordingReporter()
    config = make_config(model_dir, train_file, tmp_path, checkpoint_every_steps=1, keep_last_checkpoints=2)
    Trainer(config, ONE_CPU_RANK, reporter).train()
    root = ckpt.checkpoints_root(tmp_path)
    assert sorted(path.name for path in root.iterdir()) == ["step-5", "step-6"]
    assert reporter.deleted == [str(ckpt.checkpoint_path(tmp_path, step)) for step in range(1, 5)]


# ----------------------------------------------------------------------------- pause and cancel through SQL


def start_trainer(config, tmp_path) -> subprocess.Popen:
    config_path = config.write(tmp_path / "train_config.json")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "fusetune.worker.train", "--config", str(config_path)]
    return subprocess.Popen(
        command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def wait_for_steps(sessions, job_id, n_steps: int, process: subprocess.Popen, timeout_s: float = 120) -> None:
    from fusetune.db import queries

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with sessions() as session:
            if len(queries.list_metrics(session, job_id)[0]) >= n_steps:
                return
        assert process.poll() is None, process.communicate()[0][-3000:]
        time.sleep(0.1)
    raise TimeoutError(f"the trainer did not report {n_steps} steps")


def set_status(sessions, job_id, status: str) -> None:
    from fusetune.db.models import Job

    with sessions() as session:
        session.get(Job, job_id).status = status
        session.commit()


def sql_job(model_dir, train_file, tmp_path):
    url, sessions, job_id = make_job_database(tmp_path)
    config = make_config(
        model_dir,
        train_file,
        tmp_path / "runs" / job_id,
        database_url=url,
        job_id=job_id,
        checkpoint_paths_relative_to=str(tmp_path / "runs"),
    )
    return config, sessions, job_id


def test_pause_checkpoints_and_exits_then_the_job_resumes_from_there(model_dir, train_file, tmp_path):
    from fusetune.db import queries

    config, sessions, job_id = sql_job(model_dir, train_file, tmp_path)
    # Paused while the trainer loads: it sees the pause at its first step boundary, whenever that comes.
    set_status(sessions, job_id, "paused")
    assert run(config) == EXIT_STOPPED
    with sessions() as session:
        assert [m.step for m in queries.list_metrics(session, job_id)[0]] == [1]
        assert [(c.step, c.storage_path) for c in queries.list_checkpoints(session, job_id)] == [
            (1, f"{job_id}/checkpoints/step-1")
        ]
        events, _ = queries.list_events(session, job_id, limit=1000)
        assert any(event_data(e).get("reason") == "paused" for e in events)
    assert ckpt.latest_resumable(config.output_dir) == (1, ckpt.checkpoint_path(config.output_dir, 1))
    assert read_result(config.output_dir) is None
    stopped = {"reason": "paused", "step": 1, "checkpoint": f"{job_id}/checkpoints/step-1"}
    assert read_stopped(config.output_dir) == stopped

    set_status(sessions, job_id, "running")  # what the worker does when it picks the resumed job up
    assert run(config) == 0
    assert read_result(config.output_dir).steps == 6 and read_stopped(config.output_dir) is None
    with sessions() as session:
        assert [m.step for m in queries.list_metrics(session, job_id)[0]] == list(range(1, 7))
        assert [c.step for c in queries.list_checkpoints(session, job_id)] == [6, 1]
        events, _ = queries.list_events(session, job_id, limit=1000)
        resumed = [event_data(e) for e in events if event_data(e).get("event") == "resumed"]
        assert [data["step"] for data in resumed] == [1]


@pytest.mark.slow
def test_cancel_stops_a_running_trainer_without_a_checkpoint(model_dir, tmp_path):
    from fusetune.db import queries

    # 10,000 epochs of the bundled demo set (640,000 steps): the run cannot end before the cancel arrives,
    # whatever the machine's speed. The test gates on the trainer's own metric rows, never on a clock. No
    # checkpoint is scheduled (an idle machine finished the first 64-step epoch, and wrote its checkpoint, within
    # the poll interval after the cancel), so any checkpoint would be the cancel's own.
    config, sessions, job_id = sql_job(model_dir, assets.TRAIN_FILE, tmp_path)
    config = config.model_copy(
        update={"n_epochs": 10_000, "checkpoint_every_epoch": False, "checkpoint_every_minutes": None}
    )
    process = start_trainer(config, tmp_path)
    wait_for_steps(sessions, job_id, 2, process)
    set_status(sessions, job_id, "cancelled")
    cancelled_at = time.monotonic()
    # A generous guard against a hang, not a speed claim: the poll interval is tested with a clock below.
    output = process.communicate(timeout=300)[0]
    print(f"cancel honoured {time.monotonic() - cancelled_at:.2f} s after the status changed")
    assert process.returncode == EXIT_STOPPED, output[-3000:]
    assert ckpt.list_checkpoints(config.output_dir) == []
    assert read_stopped(config.output_dir)["reason"] == "cancelled"
    with sessions() as session:
        metric_steps = [m.step for m in queries.list_metrics(session, job_id)[0]]
        assert queries.list_checkpoints(session, job_id) == []
        events, _ = queries.list_events(session, job_id, limit=1000)
        assert any(event_data(e).get("reason") == "cancelled" for e in events)
    assert 2 <= len(metric_steps) < 64 * 10_000


def test_the_status_is_read_once_per_poll_interval(tmp_path, monkeypatch):
    """A cancel or pause reaches the trainer at the first step boundary after one poll interval: the reporter
    reads the job's status when the interval has passed and never in between (a clock the test moves)."""
    from fusetune.worker.train import reporter as reporter_module

    url, sessions, job_id = make_job_database(tmp_path)
    set_status(sessions, job_id, "running")
    now = [1000.0]
    monkeypatch.setattr(reporter_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    sql = reporter_module.SqlReporter(url, job_id, status_poll_interval_s=1.0)
    try:
        assert sql.stop_request() is None  # the first call always reads
        set_status(sessions, job_id, "paused")
        now[0] += 0.5
        assert sql.stop_request() is None  # within the interval: no read
        now[0] += 0.5
        assert sql.stop_request() == StopRequest.PAUSE
        set_status(sessions, job_id, "cancelled")
        now[0] += 0.9
        assert sql.stop_request() == StopRequest.PAUSE
        now[0] += 0.1
        assert sql.stop_request() == StopRequest.CANCEL
        set_status(sessions, job_id, "running")
        now[0] += 5
        assert sql.stop_request() == StopRequest.CANCEL  # a cancel is final
    finally:
        sql.close()
