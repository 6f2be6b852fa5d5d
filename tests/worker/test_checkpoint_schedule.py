"""When the trainer saves a resumable checkpoint before the final one: by step count, at epoch ends and by time
(on a clock the test moves)."""

from __future__ import annotations

import pytest

from fusetune.config import Settings
from fusetune.demo import assets
from fusetune.worker.train.checkpoints import layout as ckpt
from fusetune.worker.train.checkpoints.schedule import CheckpointSchedule
from fusetune.worker.train.config import TrainConfig
from fusetune.worker.train.trainer import Trainer
from tests.worker.test_train_trainer import ONE_CPU_RANK, RecordingReporter, make_config


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def _due_steps(schedule: CheckpointSchedule, clock: FakeClock, steps: int, step_s: float, per_epoch: int):
    """Runs `steps` steps of `step_s` seconds each, saving whenever due; returns the steps that saved."""
    saved = []
    for step in range(1, steps + 1):
        clock.now_s += step_s
        if schedule.due(step, epoch_done=step % per_epoch == 0):
            schedule.saved()
            saved.append(step)
    return saved


def test_every_n_steps_and_every_epoch():
    clock = FakeClock()
    assert _due_steps(CheckpointSchedule(every_steps=4, clock=clock), clock, 12, 1.0, per_epoch=5) == [
        4,
        8,
        12,
    ]
    assert _due_steps(CheckpointSchedule(every_epoch=True, clock=clock), clock, 12, 1.0, per_epoch=5) == [
        5,
        10,
    ]
    both = CheckpointSchedule(every_steps=4, every_epoch=True, clock=clock)
    assert _due_steps(both, clock, 12, 1.0, per_epoch=5) == [4, 5, 8, 10, 12]


def test_by_time_counts_from_the_start_and_from_each_save():
    clock = FakeClock()
    schedule = CheckpointSchedule(every_s=60.0, clock=clock)
    clock.now_s += 300  # setup time before the first step counts: the schedule starts when the trainer does
    assert schedule.due(1, epoch_done=False)
    schedule.saved()
    # 25 s per step: due at the step that reaches 60 s since the last save, not before.
    assert _due_steps(schedule, clock, 10, 25.0, per_epoch=100) == [3, 6, 9]
    # A save for another reason (an epoch end) starts the interval again.
    schedule = CheckpointSchedule(every_epoch=True, every_s=60.0, clock=clock)
    assert _due_steps(schedule, clock, 6, 20.0, per_epoch=2) == [2, 4, 6]


def test_nothing_is_due_when_all_are_off():
    clock = FakeClock()
    schedule = CheckpointSchedule(clock=clock)
    clock.now_s += 1e9
    assert not schedule.due(4, epoch_done=True)


def test_service_defaults_and_the_schedule_built_from_a_config(tmp_path):
    settings = Settings(data_dir=tmp_path)
    assert (settings.checkpoint_every_epoch, settings.checkpoint_every_minutes) == (True, 30.0)
    assert settings.keep_last_checkpoints == 2
    config = TrainConfig(model_path="m", training_file="t", output_dir="o", checkpoint_every_epoch=True,
                         checkpoint_every_minutes=30.0)  # fmt: skip
    clock = FakeClock()
    schedule = CheckpointSchedule.from_config(config, clock)
    assert (schedule.every_steps, schedule.every_epoch, schedule.every_s) == (None, True, 1800.0)
    clock.now_s += 1799
    assert not schedule.due(1, epoch_done=False)
    clock.now_s += 1
    assert schedule.due(2, epoch_done=False)
    env = Settings(
        data_dir=tmp_path, checkpoint_every_epoch=False, checkpoint_every_minutes=5
    ).subprocess_env()
    assert (
        env["FUSETUNE_CHECKPOINT_EVERY_EPOCH"] == "false"
        and env["FUSETUNE_CHECKPOINT_EVERY_MINUTES"] == "5.0"
    )


class ClockReporter(RecordingReporter):
    """Moves the schedule's clock on by `step_s` with every reported step."""

    def __init__(self, clock: FakeClock, step_s: float):
        super().__init__()
        self.clock, self.step_s = clock, step_s

    def metric(self, step, values, rank_memory=None):
        super().metric(step, values, rank_memory)
        self.clock.now_s += self.step_s


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return assets.build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_the_trainer_saves_at_epoch_ends_and_by_time_keeping_the_last_two(model_dir, tmp_path, monkeypatch):
    train_file = assets.write_demo_dataset(
        tmp_path / "train.jsonl", n_examples=32, seed=5
    )  # 4 steps per epoch
    clock = FakeClock()
    build = CheckpointSchedule.from_config
    monkeypatch.setattr(CheckpointSchedule, "from_config", lambda config: build(config, clock))
    config = make_config(model_dir, train_file, tmp_path / "out", n_epochs=2, checkpoint_every_epoch=True,
                         checkpoint_every_minutes=1.0, keep_last_checkpoints=2)  # fmt: skip
    reporter = ClockReporter(clock, step_s=30.0)
    Trainer(config, ONE_CPU_RANK, reporter).train()
    # A step is 30 s on this clock, reported after the check: 60 s have passed at step 3's check (a save by
    # time), step 4 ends the epoch (a save, and the interval starts again), 7 by time, 8 is the final checkpoint.
    assert [step for step, _ in reporter.checkpoints] == [3, 4, 7, 8]
    assert [step for step, _ in ckpt.list_checkpoints(tmp_path / "out")] == [7, 8]
    assert all(ckpt.has_training_state(path) for _, path in ckpt.list_checkpoints(tmp_path / "out"))


def test_a_tied_lm_head_is_saved_once():
    from transformers import LlamaConfig, LlamaForCausalLM

    from fusetune.worker.train.checkpoints.checkpointer import without_tied_copies

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, tie_word_embeddings=True)  # fmt: skip
    model = LlamaForCausalLM(config)
    # What an offloaded full state dict holds: a separate copy under each name.
    state = {name: p.detach().clone() for name, p in model.named_parameters(remove_duplicate=False)}
    assert "lm_head.weight" in state and "model.embed_tokens.weight" in state
    kept = without_tied_copies(model, state)
    assert "lm_head.weight" not in kept and "model.embed_tokens.weight" in kept
    assert set(state) - set(kept) == {"lm_head.weight"}

    untied = LlamaForCausalLM(LlamaConfig(**{**config.to_dict(), "tie_word_embeddings": False}))
    untied_state = {name: p for name, p in untied.named_parameters(remove_duplicate=False)}
    assert without_tied_copies(untied, untied_state).keys() == untied_state.keys()
