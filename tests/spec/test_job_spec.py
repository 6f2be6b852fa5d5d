"""The job specification: one set of defaults from the API request to the trainer's configuration, names taken
from the method and precision tables, and nothing of torch imported on the way."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from fusetune.api.app import create_app
from fusetune.config import Settings
from fusetune.db import queries
from fusetune.db.migrate import upgrade
from fusetune.spec.hyperparameters import HyperparametersRequest, JobHyperparameters
from fusetune.spec.job import JobSpec
from fusetune.spec.methods import METHODS
from fusetune.spec.precision import OPTIMIZERS, PRECISIONS
from fusetune.worker.tasks import JobRunner
from fusetune.worker.train import optim
from fusetune.worker.train.config import TrainConfig
from fusetune.worker.train.methods import TRAINING_METHODS

REPO_ROOT = Path(__file__).resolve().parents[2]
AUTH = {"Authorization": f"Bearer {Settings().dev_api_key}"}
LINE = json.dumps(
    {"messages": [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}]}
)
# What a run's configuration holds besides its training choices: where it lives, and its seed (random).
RUN_FIELDS = {
    "job_id", "database_url", "model_path", "training_file", "validation_file", "output_dir",
    "checkpoint_paths_relative_to", "seed", "integrations", "mlflow_tracking_uri",
    "model_name", "adapter_base_models",  # the model's public name, and where a LoRA model's bases lie here
}  # fmt: skip


@pytest.fixture
def settings(tmp_path) -> Settings:
    settings = Settings(data_dir=tmp_path / "data")
    settings.ensure_dirs()
    upgrade(settings.database_url)
    (settings.models_dir / "tiny").mkdir()
    (settings.models_dir / "tiny" / "config.json").write_text("{}")
    return settings


@pytest.fixture
def client(settings):
    with TestClient(create_app(settings), headers=AUTH) as client:
        yield client


def _documented_default_config() -> dict:
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme[readme.index("A job that sets none") :]
    block = re.search(r"```json\n(.*?)```", section, re.DOTALL)
    assert block, "README.md lost the block of the default trainer configuration"
    return json.loads(block.group(1))


def _job_config(client, settings, tmp_path, body: dict) -> TrainConfig:
    """The trainer configuration the worker writes for a job created through the API with `body`."""
    uploaded = client.post(
        "/v1/files",
        files={"file": ("t.jsonl", ("\n".join([LINE] * 10)).encode())},
        data={"purpose": "fine-tune"},
    )
    assert uploaded.status_code == 200, uploaded.text
    response = client.post(
        "/v1/fine_tuning/jobs", json={"model": "tiny", "training_file": uploaded.json()["id"], **body}
    )
    assert response.status_code == 200, response.text
    runner = JobRunner(settings, requeue=lambda job_id: None)
    with runner.session_factory() as session:
        job = queries.get_job(session, response.json()["id"])
    return TrainConfig.read(runner._write_config(job, tmp_path / "run", str(settings.models_dir / "tiny")))


def test_a_job_without_hyperparameters_runs_the_documented_trainer_configuration(client, settings, tmp_path):
    config = _job_config(client, settings, tmp_path, {})
    assert config.model_dump(mode="json", exclude=RUN_FIELDS) == _documented_default_config()


def test_every_hyperparameter_reaches_the_trainer_as_given(client, settings, tmp_path):
    chosen = {
        "n_epochs": 2, "batch_size": 4, "learning_rate": 0.02, "lr_scheduler": "linear", "warmup_ratio": 0.1,
        "max_seq_length": 64, "packing": True, "precision": "fp32", "kernels": False,
        "gradient_checkpointing": True, "recompute_layers": 3, "offload_layers": 1, "optimizer_in_backward": True,
        "micro_batch_size": 2, "optimizer_state_on_host": False,
        "lora": {"r": 4, "alpha": 8.0, "dropout": 0.1, "target_modules": ["q_proj"]},
        "merge_lora_on_save": True, "distributed": "fsdp", "eval_every_steps": 5,
    }  # fmt: skip
    # early_stopping needs a validation file: tests/test_tracking_and_results.py sends it.
    assert set(chosen) == set(JobHyperparameters.model_fields) - {
        "learning_rate_multiplier", "n_gpus", "early_stopping"
    }  # fmt: skip
    body = {"method": {"type": "supervised", "supervised": {"hyperparameters": {**chosen, "n_gpus": 2}}}}
    config = _job_config(client, settings, tmp_path, body)
    assert config.model_dump(mode="json", include=set(chosen)) == chosen
    assert config.method.type == "supervised"


def test_the_worker_passes_the_gpu_memory_the_service_plans_for(client, settings, tmp_path):
    capped = settings.model_copy(update={"gpu_memory_bytes": 80 * 2**30})
    assert _job_config(client, capped, tmp_path, {}).gpu_memory_bytes == 80 * 2**30


def test_the_job_reports_its_method_and_precision(client):
    uploaded = client.post(
        "/v1/files", files={"file": ("t.jsonl", LINE.encode())}, data={"purpose": "fine-tune"}
    )
    body = {"model": "tiny", "training_file": uploaded.json()["id"], "hyperparameters": {"precision": "bf16"}}
    job = client.post("/v1/fine_tuning/jobs", json=body).json()
    assert job["hyperparameters"]["precision"] == "bf16" and "method" not in job["hyperparameters"]
    assert (
        job["method"]["type"] == "supervised"
        and job["method"]["supervised"]["hyperparameters"]["n_epochs"] == 3
    )
    for bad, param in (
        ({"hyperparameters": {"precision": "fp4"}}, "hyperparameters.precision"),
        ({"method": {"type": "reinforce"}}, "method.type"),
    ):
        error = client.post("/v1/fine_tuning/jobs", json={**body, **bad}).json()["error"]
        assert error["param"] == param, error


def test_names_come_from_the_method_and_precision_tables():
    for name in ("auto", *PRECISIONS):
        assert JobHyperparameters(precision=name).precision == name
    with pytest.raises(ValidationError, match="precision"):
        JobHyperparameters(precision="fp4")
    assert set(METHODS) >= {"supervised", "dpo"}
    # A row stored before methods and precision were part of the job: supervised, precision auto.
    old_row = {
        "n_epochs": 2,
        "batch_size": 4,
        "learning_rate": 0.1,
        "learning_rate_multiplier": 1.0,
        "n_gpus": 1,
    }
    spec = JobSpec.from_row(old_row)
    assert spec.method.type == "supervised" and spec.hyperparameters.precision == "auto"
    assert JobSpec.from_row(spec.to_row()) == spec


def test_every_method_and_optimizer_of_the_specification_has_its_worker_half():
    assert set(TRAINING_METHODS) == set(METHODS)
    assert set(optim.OPTIMIZERS) == set(OPTIMIZERS)
    assert {mode.optimizer for mode in PRECISIONS.values()} <= set(OPTIMIZERS)


def test_a_learning_rate_and_its_multiplier_are_not_both_taken():
    with pytest.raises(ValidationError, match="not both"):
        HyperparametersRequest(learning_rate=0.01, learning_rate_multiplier=2)
    # A learning rate given alone is reported with the multiplier it amounts to.
    resolved = HyperparametersRequest(learning_rate=2e-4).resolve(example_count=10, base_learning_rate=1e-4)
    assert resolved.learning_rate == 2e-4 and resolved.learning_rate_multiplier == pytest.approx(2.0)


def test_request_bounds_are_the_specifications():
    for field, value in (("n_epochs", 101), ("batch_size", 0), ("learning_rate_multiplier", -1)):
        with pytest.raises(ValidationError, match=field):
            HyperparametersRequest(**{field: value})
    assert HyperparametersRequest(n_epochs=100).n_epochs == 100


def test_the_api_imports_neither_torch_nor_the_worker():
    """The API process and the specification load in a fresh interpreter without torch or any module of the
    worker (the Celery side included)."""
    code = (
        "import sys, fusetune.api.app, fusetune.spec.job, fusetune.spec.estimate\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'fusetune.worker')))\n"
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)


def test_the_worker_side_imports_no_torch():
    code = "import sys, fusetune.worker.tasks; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)


def test_nothing_is_coerced_and_a_non_finite_number_is_refused_as_such(client):
    uploaded = client.post(
        "/v1/files", files={"file": ("t.jsonl", LINE.encode())}, data={"purpose": "fine-tune"}
    )
    body = {"model": "tiny", "training_file": uploaded.json()["id"]}
    for hyperparameters, param, problem in (
        ({"n_epochs": True}, "hyperparameters.n_epochs", "valid integer"),
        ({"n_epochs": "3"}, "hyperparameters.n_epochs", "valid integer"),
        ({"packing": 1}, "hyperparameters.packing", "valid boolean"),
        ({"learning_rate": float("nan")}, "hyperparameters.learning_rate", "finite number"),
        ({"n_epochs": 101}, "hyperparameters.n_epochs", "less than or equal to 100"),
    ):
        response = client.post(
            "/v1/fine_tuning/jobs",
            content=json.dumps({**body, "hyperparameters": hyperparameters}),  # NaN as JSON's NaN token
            headers={"Content-Type": "application/json"},
        )
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == param, (hyperparameters, error)
        assert problem in error["message"], (hyperparameters, error)
    method = {"type": "dpo", "dpo": {"hyperparameters": {"beta": "0.1"}}}
    error = client.post("/v1/fine_tuning/jobs", json={**body, "method": method}).json()["error"]
    assert error["param"] == "method.dpo.hyperparameters.beta", error


def test_the_8bit_optimizer_state_runs_under_fsdp_but_not_in_host_memory_there(client):
    """FusedAdamW8bit quantizes each rank's shard (tests/kernels/test_adamw8bit.py's two-rank test), so a job
    may pin bf16-sr-8bit under FSDP; the state in host memory stays refused there (FSDP shards it already)."""
    uploaded = client.post(
        "/v1/files",
        files={"file": ("t.jsonl", ("\n".join([LINE] * 4)).encode())},
        data={"purpose": "fine-tune"},
    )
    hyperparameters = {"precision": "bf16-sr-8bit", "distributed": "fsdp", "n_gpus": 2, "batch_size": 4}
    body = {"model": "tiny", "training_file": uploaded.json()["id"], "hyperparameters": hyperparameters}
    accepted = client.post("/v1/fine_tuning/jobs", json=body)
    assert accepted.status_code == 200, accepted.json()
    assert accepted.json()["hyperparameters"]["precision"] == "bf16-sr-8bit"
    on_host = {**body, "hyperparameters": {**hyperparameters, "optimizer_state_on_host": True}}
    error = client.post("/v1/fine_tuning/jobs", json=on_host).json()["error"]
    assert error["param"] == "hyperparameters.optimizer_state_on_host" and "fsdp" in error["message"], error


def test_a_method_setting_without_bounds_is_checked_by_its_type(client):
    uploaded = client.post(
        "/v1/files", files={"file": ("t.jsonl", LINE.encode())}, data={"purpose": "fine-tune"}
    )
    method = {"type": "dpo", "dpo": {"hyperparameters": {"loss_type": "hinge"}}}
    response = client.post(
        "/v1/fine_tuning/jobs",
        json={"model": "tiny", "training_file": uploaded.json()["id"], "method": method},
    )
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "method.dpo.hyperparameters.loss_type", error
    assert "'sigmoid' or 'ipo'" in error["message"], error


GRADER = {
    "type": "string_check", "name": "exact", "operation": "eq",
    "input": "{{ sample.output_text }}", "reference": "{{ item.answer }}",
}  # fmt: skip


@pytest.mark.parametrize("method_type", sorted(METHODS))
def test_a_stored_method_maps_back_to_the_request_it_came_from(method_type):
    """The job object's `method` is the request's shape again: read back as a request, it stores the same method
    (settings under `hyperparameters`, a reinforcement grader beside them), for every method of the table."""
    from fusetune.spec.methods import MethodRequest, method_in_request_shape

    settings = METHODS[method_type].settings
    given = {
        name: field.default * 2
        for name, field in (settings.model_fields.items() if settings else ())
        if isinstance(field.default, float) and name not in METHODS[method_type].request_fields
    }
    beside = {"grader": GRADER} if "grader" in METHODS[method_type].request_fields else {}
    shared = {"n_epochs": 2, "batch_size": 4, "learning_rate_multiplier": 0.5}
    request = MethodRequest.model_validate(
        {"type": method_type, method_type: {"hyperparameters": {**shared, **given}, **beside}}
    )
    stored = request.spec().model_dump(mode="json")
    shown = method_in_request_shape(stored, shared)
    assert MethodRequest.model_validate(shown).spec() == request.spec()
    assert {name: shown[method_type]["hyperparameters"][name] for name in given} == given
    assert {name: shown[method_type][name] for name in beside} == beside
