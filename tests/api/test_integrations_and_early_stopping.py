"""A job's `integrations` and `early_stopping` as the API takes them: stored and reported as asked, refused with
the field named when they cannot work; and what the worker hands the trainer."""

from __future__ import annotations

import json

import pytest

from fusetune.config import Settings
from fusetune.db import queries
from fusetune.worker.tasks import JobRunner
from fusetune.worker.train.config import TrainConfig

LINE = json.dumps(
    {"messages": [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}]}
)


@pytest.fixture
def files(client) -> tuple[str, str]:
    ids = []
    for name in ("train.jsonl", "valid.jsonl"):
        response = client.post("/v1/files", files={"file": (name, "\n".join([LINE] * 10).encode())},
                               data={"purpose": "fine-tune"})  # fmt: skip
        assert response.status_code == 200, response.text
        ids.append(response.json()["id"])
    return ids[0], ids[1]


def test_integrations_and_early_stopping_are_stored_and_reach_the_trainer(client, settings, files, tmp_path):
    training, validation = files
    integrations = [
        {"type": "wandb", "wandb": {"project": "p", "name": "n", "entity": "team", "tags": ["a"]}},
        {"type": "mlflow", "mlflow": {"tracking_uri": "https://mlflow.example", "experiment_name": "e"}},
    ]
    response = client.post("/v1/fine_tuning/jobs", json={
        "model": "tiny", "training_file": training, "validation_file": validation, "integrations": integrations,
        "hyperparameters": {"eval_every_steps": 10, "early_stopping": {"patience": 2}},
    })  # fmt: skip
    assert response.status_code == 200, response.text
    job = response.json()
    assert job["integrations"] == integrations
    assert job["hyperparameters"]["early_stopping"] == {"patience": 2, "min_delta": 0.0}
    assert job["result_files"] == [] and job["estimated_finish"] is None
    assert client.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["integrations"] == integrations

    served = Settings(data_dir=settings.data_dir, mlflow_tracking_uri="http://mlflow.internal:5000")
    runner = JobRunner(served, requeue=lambda job_id: None)
    with runner.session_factory() as session:
        row = queries.get_job(session, job["id"])
    config = TrainConfig.read(runner._write_config(row, tmp_path / "run", str(settings.models_dir / "tiny")))
    assert [i.model_dump(mode="json", exclude_none=True) for i in config.integrations] == integrations
    assert config.mlflow_tracking_uri == "http://mlflow.internal:5000"
    assert config.early_stopping.patience == 2 and config.eval_every_steps == 10


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"integrations": [{"type": "comet", "comet": {}}]}, "integrations", "comet"),
        ({"integrations": [{"type": "wandb", "wandb": {"name": "no project"}}]}, "integrations", "project"),
        ({"integrations": [{"type": "mlflow", "mlflow": {"tracking_uri": "file:///etc"}}]}, "integrations",
         "http"),
        ({"integrations": [{"type": "mlflow", "mlflow": {"tracking_uri": "sqlite:///x.db"}}]}, "integrations",
         "http"),
        ({"integrations": [{"type": "wandb", "wandb": {"project": "a"}}] * 2}, "integrations", "at most one"),
        ({"hyperparameters": {"early_stopping": {"patience": 0}}}, "hyperparameters", "patience"),
        ({"hyperparameters": {"early_stopping": {"patience": 2, "min_delta": -1.0}}}, "hyperparameters",
         "min_delta"),
        ({"hyperparameters": {"early_stopping": {"patience": 2}}, "validation_file": None},
         "hyperparameters.early_stopping", "validation_file"),
    ],
)  # fmt: skip
def test_what_cannot_work_is_refused_naming_the_field(client, files, body, param, says):
    training, validation = files
    request = {"model": "tiny", "training_file": training, "validation_file": validation, **body}
    response = client.post("/v1/fine_tuning/jobs", json=request)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].startswith(param) and says in error["message"], error


@pytest.mark.parametrize(
    ("integration", "param"),
    [
        ({"type": "mlflow", "mlflow": {"tracking_uri": "file:///etc"}}, "integrations.0.mlflow.tracking_uri"),
        ({"type": "wandb", "wandb": {"project": "p", "entity": ""}}, "integrations.0.wandb.entity"),
        ({"type": "comet", "comet": {}}, "integrations.0"),
    ],
)
def test_an_integrations_error_names_its_field_as_the_request_spells_it(client, files, integration, param):
    request = {"model": "tiny", "training_file": files[0], "integrations": [integration]}
    error = client.post("/v1/fine_tuning/jobs", json=request).json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: "), error
