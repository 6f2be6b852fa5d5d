"""The dry run's memory plan for the GPU a job would land on, a user's pins, and the refusals at creation: no
plan fits the GPU, or the checkpoints do not fit the disk."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from fusetune.api import admission
from fusetune.api.app import create_app
from fusetune.api.job_object import to_schema
from fusetune.config import Settings
from fusetune.db.migrate import upgrade

GIB = 2**30
LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}  # fmt: skip
# Llama-3.1-70B's shape (its config.json's fields the estimate reads).
LLAMA_70B = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
             "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256}  # fmt: skip
LINE = json.dumps(
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
)


@pytest.fixture(autouse=True)
def a_large_disk(monkeypatch):
    """The data directory's free space as the test sets it, not as this machine has it."""
    monkeypatch.setattr(admission, "free_disk_bytes", lambda path: 10**15)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    settings = Settings(data_dir=tmp_path_factory.mktemp("plan") / "data")
    settings.ensure_dirs()
    upgrade(settings.database_url)
    (settings.models_dir / "llama-8b").mkdir()
    (settings.models_dir / "llama-8b" / "config.json").write_text(json.dumps(LLAMA_8B))
    (settings.models_dir / "llama-70b").mkdir()
    (settings.models_dir / "llama-70b" / "config.json").write_text(json.dumps(LLAMA_70B))
    return settings.data_dir


def _client(data_dir, gpu_memory_bytes: int | None, **settings_fields) -> tuple[TestClient, str]:
    settings = Settings(data_dir=data_dir, gpu_memory_bytes=gpu_memory_bytes, **settings_fields)
    client = TestClient(create_app(settings), headers={"Authorization": f"Bearer {settings.dev_api_key}"})
    upload = {"file": ("train.jsonl", "\n".join([LINE] * 8).encode())}
    file_id = client.post("/v1/files", files=upload, data={"purpose": "fine-tune"}).json()["id"]
    return client, file_id


def _dry_run(client, file_id, **hyperparameters):
    body = {"model": "llama-8b", "training_file": file_id, "dry_run": True,
            "hyperparameters": {"batch_size": 4, **hyperparameters}}  # fmt: skip
    return client.post("/v1/fine_tuning/jobs", json=body)


def test_the_dry_run_returns_the_plan_for_the_gpu_the_job_would_land_on(data_dir):
    client, file_id = _client(data_dir, 80 * GIB)
    roomy = _dry_run(client, file_id).json()
    # 8B in bf16-sr: weights, gradients and AdamW state take 60 GiB; everything else is small at this data.
    assert roomy["plan"] == {"micro_batch_size": 4, "recompute_layers": 0, "offload_layers": 0,
                             "precision": "bf16-sr", "optimizer_in_backward": False,
                             "optimizer_state_on_host": False}  # fmt: skip
    assert roomy["plan_description"] == "micro-batch 4, precision bf16-sr, no recompute"
    assert roomy["fits"] is True and roomy["refusal"] is None and roomy["alternatives"] is None
    assert roomy["peak_memory_bytes_per_gpu"] == sum(roomy["memory_breakdown"].values()) <= 80 * GIB
    # Its checkpoints: bf16 weights and two bf16 moments (48 GB each), the two kept and the next.
    assert 47e9 < roomy["checkpoint_bytes"] < 49e9 and roomy["checkpoints_on_disk"] == 3
    assert roomy["checkpoint_disk_bytes"] == 3 * roomy["checkpoint_bytes"]
    assert roomy["disk_free_bytes"] == 10**15 and roomy["disk_fits"] is True

    client, file_id = _client(data_dir, 40 * GIB)
    tight = _dry_run(client, file_id).json()
    # 40 GiB: the 8-bit state and the step inside the backward (all four sequences in one micro-batch).
    assert tight["fits"] is True and tight["peak_memory_bytes_per_gpu"] <= 40 * GIB
    assert tight["plan"]["precision"] == "bf16-sr-8bit" and tight["plan"]["optimizer_in_backward"] is True
    assert tight["plan"]["micro_batch_size"] == 4
    assert tight["checkpoint_bytes"] < 0.7 * roomy["checkpoint_bytes"]  # the 8-bit state is saved as such

    # 24 GiB: the weights leave no room for the state, which waits in host memory between updates.
    client, file_id = _client(data_dir, 24 * GIB)
    small = _dry_run(client, file_id).json()
    assert small["fits"] is True and small["plan"]["optimizer_state_on_host"] is True
    assert (
        small["host_optimizer_state_bytes"] > 15 * GIB
        and "optimizer state in host memory" in small["plan_description"]
    )
    assert tight["host_optimizer_state_bytes"] == 0

    # A server that does not know its GPUs' memory: the job's settings and the defaults, fits unknown.
    client, file_id = _client(data_dir, None)
    unknown = _dry_run(client, file_id).json()
    assert (
        unknown["fits"] is None and unknown["gpu_memory_bytes"] is None and unknown["plan"] == roomy["plan"]
    )


def test_a_user_pins_any_part_and_a_plan_that_cannot_fit_is_refused_with_one_that_would(data_dir):
    client, file_id = _client(data_dir, 40 * GIB)
    pinned = _dry_run(client, file_id, micro_batch_size=2, recompute_layers=8, offload_layers=4).json()
    assert pinned["plan"]["micro_batch_size"] == 2 and pinned["plan"]["recompute_layers"] == 8
    assert pinned["plan"]["offload_layers"] == 4
    # bf16-sr with the step after the backward and its state on the GPU cannot fit 40 GiB: the refusal names
    # plans that would.
    on_gpu = {"precision": "bf16-sr", "optimizer_in_backward": False, "optimizer_state_on_host": False}
    refused = _dry_run(client, file_id, **on_gpu).json()
    assert refused["fits"] is False and refused["plan"]["precision"] == "bf16-sr"
    changes = {alternative["change"]: alternative for alternative in refused["alternatives"]}
    assert "n_gpus 2 and distributed fsdp" in changes and "LoRA (r=16)" in changes
    assert all(a["peak_memory_bytes_per_gpu"] <= 40 * GIB for a in refused["alternatives"])
    assert changes["LoRA (r=16)"]["plan"]["precision"] == "bf16-sr"
    created = client.post(
        "/v1/fine_tuning/jobs",
        json={"model": "llama-8b", "training_file": file_id,
              "hyperparameters": {"batch_size": 4, **on_gpu}},
    )  # fmt: skip
    error = created.json()["error"]
    assert (
        created.status_code == 400
        and error["code"] == "job_too_large"
        and error["message"] == refused["refusal"]
    )
    assert "It would fit with: n_gpus 2 and distributed fsdp (" in error["message"]
    # Pins no trainer could run, each named.
    for pins, param in [
        ({"recompute_layers": 33}, "hyperparameters.recompute_layers"),
        ({"micro_batch_size": 3}, "hyperparameters.micro_batch_size"),
        ({"micro_batch_size": 2, "optimizer_in_backward": True}, "hyperparameters.micro_batch_size"),
        ({"recompute_layers": 30, "offload_layers": 3}, "hyperparameters.offload_layers"),
    ]:
        response = _dry_run(client, file_id, **pins)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_a_job_whose_checkpoints_cannot_fit_the_disk_is_refused(data_dir, monkeypatch):
    client, file_id = _client(data_dir, 80 * GIB)
    monkeypatch.setattr(admission, "free_disk_bytes", lambda path: 100 * 10**9)
    estimate = _dry_run(client, file_id).json()
    assert estimate["disk_free_bytes"] == 100 * 10**9 and estimate["disk_fits"] is False
    body = {"model": "llama-8b", "training_file": file_id, "hyperparameters": {"batch_size": 4}}
    refused = client.post("/v1/fine_tuning/jobs", json=body)
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["code"] == "insufficient_disk"
    need = estimate["checkpoint_disk_bytes"]
    assert f"about {need / 1e9:.1f} GB of disk" in error["message"] and "100.0 GB free" in error["message"]
    assert client.get("/v1/fine_tuning/jobs").json()["data"] == []
    # The 8-bit optimizer state makes three checkpoints fit.
    smaller = _dry_run(client, file_id, precision="bf16-sr-8bit").json()
    assert smaller["disk_fits"] is True and smaller["refusal"] is None


def test_a_job_that_checkpoints_only_at_its_end_needs_the_disk_of_one_checkpoint(data_dir, monkeypatch):
    monkeypatch.setattr(admission, "free_disk_bytes", lambda path: 52 * 10**9)
    # The 8-bit state's checkpoint (about 32 GB) fits 52 GB once, not three times (the default schedule's).
    client, file_id = _client(data_dir, 80 * GIB, checkpoint_every_minutes=0, checkpoint_every_epoch=False)
    estimate = _dry_run(client, file_id, precision="bf16-sr-8bit").json()
    assert estimate["checkpoints_on_disk"] == 1 and estimate["disk_fits"] is True, estimate
    assert estimate["checkpoint_disk_bytes"] == estimate["checkpoint_bytes"]
    client, file_id = _client(data_dir, 80 * GIB)  # the same data, the default schedule
    refused = _dry_run(client, file_id, precision="bf16-sr-8bit").json()
    assert refused["checkpoints_on_disk"] == 3 and refused["disk_fits"] is False


def test_the_job_object_reports_the_plan_that_ran():
    """Once a trainer started, the job's hyperparameters say what its plan decided (null meant "the planner")."""
    from types import SimpleNamespace

    plan = {"micro_batch_size": 2, "recompute_layers": 8, "offload_layers": 0, "precision": "bf16-sr-8bit",
            "optimizer_in_backward": False}  # fmt: skip
    row = {"n_epochs": 3, "batch_size": 8, "learning_rate_multiplier": 1.0, "precision": "auto",
           "micro_batch_size": None, "recompute_layers": None, "offload_layers": None, "optimizer_in_backward": None}  # fmt: skip
    job = SimpleNamespace(
        id="ftjob-1", created_at=1, error=None, fine_tuned_model=None, finished_at=None, started_at=2,
        hyperparameters=row, model="llama-8b", tenant="default", seed=0, status="running", trained_tokens=0,
        training_file_id="file-1", validation_file_id=None, user_metadata=None, suffix=None, waiting_reason=None,
        result_file_id=None, estimated_finish=None, integrations=None,
        resolved={"precision": "bf16-sr-8bit", "kernels": True, "memory_plan": plan,
                  "memory_plan_description": "micro-batch 2, precision bf16-sr-8bit, 8 layers recomputed"},
    )  # fmt: skip
    reported = to_schema(job).hyperparameters
    assert {key: reported[key] for key in plan} == plan


def _worker_plan(data_dir, tmp_path, memory_bytes: int, rows: list[int]):
    """The worker's plan for the dry run's job (batch 4, max_seq_length 128, "auto" precision) on one GPU of
    `memory_bytes` free, with rows of `rows` tokens."""
    from fusetune.worker.train.config import TrainConfig
    from fusetune.worker.train.planning import plan_training

    config = TrainConfig(model_path=str(Settings(data_dir=data_dir).models_dir / "llama-8b"),
                         training_file="t.jsonl", output_dir=str(tmp_path / "run"), batch_size=4,
                         max_seq_length=128)  # fmt: skip
    return plan_training(config, 1, rows, 1, memory_bytes, on_gpu=True, free_disk=10**15)


def test_the_dry_run_and_the_worker_plan_by_one_function(data_dir, tmp_path, monkeypatch):
    """Given the same memory and the same data (rows of max_seq_length tokens, which the API's counts also
    reach), the API's dry run and the worker's planning choose the same plan: both ask spec.planner.plan_run. A
    change to its rules (here: which runs save before their end) reaches both from its one home."""
    from fusetune.spec import planner

    long_line = json.dumps({"messages": [{"role": "user", "content": "Hi " * 400},
                                         {"role": "assistant", "content": "Hello " * 400}]})  # fmt: skip
    upload = {"file": ("long.jsonl", "\n".join([long_line] * 8).encode())}
    for memory in (40 * GIB, 24 * GIB):
        client, _ = _client(data_dir, memory)
        file_id = client.post("/v1/files", files=upload, data={"purpose": "fine-tune"}).json()["id"]
        api = _dry_run(client, file_id, max_seq_length=128).json()
        worker = _worker_plan(data_dir, tmp_path, memory, [128] * 8)
        assert api["plan"] == worker.plan.as_dict(), (memory, api["plan"])
        assert api["peak_memory_bytes_per_gpu"] == worker.estimate.peak_memory_bytes_per_gpu
    assert api["checkpoints_on_disk"] == 3 and worker.disk.checkpoints_on_disk == 3
    monkeypatch.setattr(planner, "saves_before_the_end", lambda *schedule: False)
    api = _dry_run(client, file_id, max_seq_length=128).json()
    worker = _worker_plan(data_dir, tmp_path, 24 * GIB, [128] * 8)
    assert api["checkpoints_on_disk"] == 1 and worker.disk.checkpoints_on_disk == 1


def test_a_70b_full_fine_tune_on_eight_80_gb_gpus_plans_the_8bit_state_and_fits(data_dir):
    """Llama-3.1-70B's shape, fully fine-tuned under FSDP2 on 8 GPUs of 80 GB (80e9 bytes: less than any
    80 GB card reports, so a plan that fits here fits there) on rows of 4096 tokens, one per GPU a step. bf16-sr
    cannot fit: its bf16 weights, gradients and two bf16 moments (8 bytes a parameter) alone take 74.0e9 bytes
    a GPU once sharded. The planner's own rules pick the 8-bit state (6.03 bytes a parameter, sharded as the
    rest: 56.6e9) and recompute and offload layers until the activations of a 4096-token row fit beside it.
    Pinned to bf16-sr, the same job is refused, naming the 8-bit state as what would fit."""
    memory = 80 * 10**9
    client, _ = _client(data_dir, memory)
    long_line = json.dumps({"messages": [{"role": "user", "content": "word " * 5000},
                                         {"role": "assistant", "content": "Hello"}]})  # fmt: skip
    upload = {"file": ("long.jsonl", "\n".join([long_line] * 64).encode())}
    file_id = client.post("/v1/files", files=upload, data={"purpose": "fine-tune"}).json()["id"]
    job = {"n_gpus": 8, "distributed": "fsdp", "batch_size": 8, "max_seq_length": 4096}
    body = {"model": "llama-70b", "training_file": file_id, "dry_run": True, "hyperparameters": job}
    estimate = client.post("/v1/fine_tuning/jobs", json=body).json()

    assert estimate["parameters"] == 70_553_706_496  # Llama-3.1-70B's published count
    assert estimate["fits"] is True and estimate["refusal"] is None, estimate
    plan = estimate["plan"]
    assert plan["precision"] == "bf16-sr-8bit" and plan["micro_batch_size"] == 1
    assert (
        plan["recompute_layers"] + plan["offload_layers"] > 0
    )  # a 4096-token row's 80 layers do not fit whole
    assert not plan["optimizer_state_on_host"]
    breakdown = estimate["memory_breakdown"]
    assert estimate["peak_memory_bytes_per_gpu"] == sum(breakdown.values()) <= memory
    # Per GPU: bf16 weights and gradients (2 bytes a parameter each) and the 8-bit state (two codes and two fp32
    # scales per 256-element block), all divided by the 8 ranks, plus two decoder layers gathered in bf16 (the
    # one computing and the one prefetched).
    parameters, layer_parameters = estimate["parameters"], 855_654_400
    weights, gradients = parameters * 2 // 8, parameters * 2 // 8
    optimizer_state = int(parameters * (2 + 2 * 4 / 256)) // 8
    assert (weights, gradients, optimizer_state) == (17_638_426_624, 17_638_426_624, 17_914_027_040)
    assert (
        breakdown["weights_grads_optimizer"]
        == weights + gradients + optimizer_state + 2 * layer_parameters * 2
    )
    assert (
        0 < breakdown["activations"] < memory - breakdown["weights_grads_optimizer"] - breakdown["overhead"]
    )

    pinned = client.post(
        "/v1/fine_tuning/jobs", json={**body, "hyperparameters": {**job, "precision": "bf16-sr"}}
    ).json()
    assert pinned["fits"] is False and pinned["peak_memory_bytes_per_gpu"] > memory
    changes = {alternative["change"]: alternative for alternative in pinned["alternatives"]}
    assert changes["precision bf16-sr-8bit"]["plan"] == plan
