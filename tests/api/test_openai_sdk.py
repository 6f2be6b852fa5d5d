"""The official ``openai`` SDK, unmodified, against a running fusetune service (embedded mode, real worker)."""

from __future__ import annotations

import time
from pathlib import Path

import openai
import pytest

from fusetune.demo.assets import PREFERENCE_FILE, TRAIN_FILE, build_tiny_model
from tests.services import running_service

pytestmark = pytest.mark.slow
MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("sdk") / "data"
    build_tiny_model(data_dir / "models" / MODEL)
    with running_service(data_dir) as service:
        yield service


@pytest.fixture(scope="module")
def client(service) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{service.base_url}/v1", api_key=service.api_key, max_retries=0)


@pytest.fixture(scope="module")
def training_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sdkdata") / "train.jsonl"
    path.write_text("".join(TRAIN_FILE.read_text().splitlines(keepends=True)[:64]))
    return path


# The waits gate on the job's own status and events, never on a deadline of their own: a slow machine makes a
# test slower, not red (pytest-timeout, `make test`'s --timeout, ends a test that truly hangs).
def _wait(client: openai.OpenAI, job_id: str, statuses: set[str]):
    while (job := client.fine_tuning.jobs.retrieve(job_id)).status not in statuses:
        time.sleep(0.5)
    return job


def test_files(client, training_path):
    with open(training_path, "rb") as handle:
        created = client.files.create(file=handle, purpose="fine-tune")
    assert created.id.startswith("file-") and created.purpose == "fine-tune" and created.bytes > 0
    assert client.files.retrieve(created.id).filename == "train.jsonl"
    assert created.id in [f.id for f in client.files.list()]
    assert client.files.content(created.id).text == training_path.read_text()
    deleted = client.files.delete(created.id)
    assert deleted.deleted and deleted.id == created.id
    with pytest.raises(openai.NotFoundError) as error:
        client.files.retrieve(created.id)
    assert error.value.status_code == 404 and error.value.body["code"] == "file_not_found"
    with pytest.raises(openai.BadRequestError) as error:
        client.files.create(file=("bad.jsonl", b'{"messages": 1}\n'), purpose="fine-tune")
    assert "line 1" in error.value.message


def test_models(client):
    assert MODEL in [m.id for m in client.models.list()]
    assert client.models.retrieve(MODEL).owned_by == "system"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_jobs_train_to_the_end(client, training_path):
    with open(training_path, "rb") as handle:
        training = client.files.create(file=handle, purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model=MODEL, training_file=training.id, seed=1, suffix="sdk", metadata={"suite": "sdk"},
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 2, "batch_size": 8,
                                                                         "learning_rate_multiplier": 20}}},
    )  # fmt: skip
    assert job.id.startswith("ftjob-") and job.status == "queued" and job.method.type == "supervised"
    assert job.hyperparameters.n_epochs == 2 and job.metadata == {"suite": "sdk"}
    done = _wait(client, job.id, {"succeeded", "failed", "cancelled"})
    assert done.status == "succeeded", done.error
    assert done.trained_tokens > 0 and done.fine_tuned_model.startswith(f"ft:{MODEL}:")
    assert done.fine_tuned_model in [m.id for m in client.models.list()]

    events = client.fine_tuning.jobs.list_events(job.id, limit=5)
    assert len(events.data) == 5 and all(e.id.startswith("ftevent-") for e in events.data)
    assert events.data[0].created_at >= events.data[-1].created_at  # newest first
    everything = list(client.fine_tuning.jobs.list_events(job.id, limit=3))  # the SDK follows `after` cursors
    assert len({e.id for e in everything}) == len(everything) > 5
    metrics = [e for e in everything if e.type == "metrics"]
    assert len(metrics) == 2 * 64 // 8
    for key in ("step", "train_loss", "tokens_per_second", "peak_memory_bytes", "learning_rate"):
        assert key in metrics[0].data, key

    checkpoints = client.fine_tuning.jobs.checkpoints.list(job.id)
    assert checkpoints.data and checkpoints.data[0].id.startswith("ftckpt_")
    assert checkpoints.data[0].step_number == 2 * 64 // 8 and checkpoints.data[0].fine_tuning_job_id == job.id

    listed = client.fine_tuning.jobs.list(limit=10, metadata={"suite": "sdk"})
    assert [j.id for j in listed.data] == [job.id]
    with pytest.raises(openai.BadRequestError) as error:  # 400, never a retried 409
        client.fine_tuning.jobs.cancel(job.id)
    assert error.value.body["code"] == "invalid_state"


def _wait_for_event(client: openai.OpenAI, job_id: str, ending: str):
    while True:
        for event in client.fine_tuning.jobs.list_events(job_id, limit=100):
            if event.message.endswith(ending):
                return event
        time.sleep(0.5)


def test_jobs_pause_resume_cancel(client, training_path):
    with open(training_path, "rb") as handle:
        training = client.files.create(file=handle, purpose="fine-tune")
    # 800 steps: more than the job can train between the requests below, on any machine; it is cancelled.
    job = client.fine_tuning.jobs.create(model=MODEL, training_file=training.id,
                                         hyperparameters={"n_epochs": 100, "batch_size": 8})  # fmt: skip
    _wait(client, job.id, {"running"})
    assert client.fine_tuning.jobs.pause(job.id).status == "paused"
    assert client.fine_tuning.jobs.resume(job.id).status == "queued"
    _wait(client, job.id, {"running"})
    cancelled = client.fine_tuning.jobs.cancel(job.id)
    assert cancelled.status == "cancelled"
    # The worker writes this event once its training processes are gone and it has finished with the job;
    # only then is it sure that nothing overwrites the status.
    _wait_for_event(client, job.id, "the job was cancelled")
    assert client.fine_tuning.jobs.retrieve(job.id).status == "cancelled"
    page = client.fine_tuning.jobs.list(limit=1)
    assert len(page.data) == 1 and page.has_more
    second = client.fine_tuning.jobs.list(limit=1, after=page.data[0].id)
    assert second.data[0].id != page.data[0].id


def test_errors_have_the_openai_shape(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.fine_tuning.jobs.create(model="gpt-4o-mini", training_file="file-nope")
    assert error.value.body["param"] == "training_file"
    with pytest.raises(openai.NotFoundError):
        client.fine_tuning.jobs.retrieve("ftjob-nope")
    bad_key = openai.OpenAI(base_url=str(client.base_url), api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.files.list()


def test_a_dpo_job_learns_the_bundled_preferences(client, training_path):
    """SFT, then DPO from its fine-tuned model, end to end through the SDK, unchanged: the bundled preference
    file (correct arithmetic answers preferred over wrong ones), 2 processes, and the reward accuracy the job
    reports rises."""
    chats = "".join(training_path.read_text().splitlines(keepends=True)[:8])
    sft = client.fine_tuning.jobs.create(
        model=MODEL, seed=3,
        training_file=client.files.create(file=("chats.jsonl", chats.encode()), purpose="fine-tune").id,
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1, "batch_size": 8}}},
    )  # fmt: skip
    sft = _wait(client, sft.id, {"succeeded", "failed", "cancelled"})
    assert sft.status == "succeeded", sft.error
    pairs = "".join(PREFERENCE_FILE.read_text().splitlines(keepends=True)[:32])
    training = client.files.create(file=("pairs.jsonl", pairs.encode()), purpose="fine-tune")
    assert training.method == "dpo" and training.example_count == 32
    job = client.fine_tuning.jobs.create(
        model=sft.fine_tuned_model, training_file=training.id, seed=3,
        method={"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.1, "n_epochs": 3, "batch_size": 8,
                                                           "learning_rate_multiplier": 30}}},
    )  # fmt: skip
    assert job.method.type == "dpo" and job.method.dpo.hyperparameters.beta == 0.1
    assert job.model == sft.fine_tuned_model
    done = _wait(client, job.id, {"succeeded", "failed", "cancelled"})
    assert done.status == "succeeded", done.error
    events = list(client.fine_tuning.jobs.list_events(job.id, limit=100))
    assert any((e.data or {}).get("event") == "reference_ready" for e in events)
    metrics = sorted((e.data for e in events if e.type == "metrics"), key=lambda data: data["step"])
    assert [m["step"] for m in metrics] == list(range(1, 13))
    accuracy = [m["reward_accuracy"] for m in metrics]
    assert accuracy[0] == 0.0  # the policy is the reference at the first step: no reward yet
    assert sum(accuracy[-4:]) / 4 >= 0.7, accuracy
    for key in ("chosen_reward", "rejected_reward", "reward_margin", "train_loss"):
        assert key in metrics[-1], key


def test_a_simpo_job_runs_through_the_sdk_without_a_reference_pass(client):
    """A method added as one module and one table entry: the SDK sends it like any other method, the job
    reports its settings, trains on the preference file DPO takes, and runs no reference pass."""
    pairs = "".join(PREFERENCE_FILE.read_text().splitlines(keepends=True)[:32])
    training = client.files.create(file=("pairs.jsonl", pairs.encode()), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model=MODEL, training_file=training.id, seed=3,
        method={"type": "simpo", "simpo": {"hyperparameters": {"gamma_beta_ratio": 0.25, "n_epochs": 2,
                                                               "batch_size": 8, "learning_rate_multiplier": 30}}},
    )  # fmt: skip
    reported = job.method.model_extra["simpo"]["hyperparameters"]
    assert job.method.type == "simpo" and reported["beta"] == 2.0 and reported["gamma_beta_ratio"] == 0.25
    done = _wait(client, job.id, {"succeeded", "failed", "cancelled"})
    assert done.status == "succeeded", done.error
    events = list(client.fine_tuning.jobs.list_events(job.id, limit=100))
    assert not any((e.data or {}).get("event") == "reference_ready" for e in events)
    metrics = sorted((e.data for e in events if e.type == "metrics"), key=lambda data: data["step"])
    assert [m["step"] for m in metrics] == list(range(1, 9))
    for key in ("reward_accuracy", "chosen_reward", "rejected_reward", "reward_margin", "train_loss"):
        assert key in metrics[-1], key
