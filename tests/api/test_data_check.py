"""The data check through the API: the dry run returns it with the preview of the first example, a job whose data
fails is refused with a 400 naming the check, the file and the line, with the example's trained spans marked, and
nothing is created; a model whose tokenizer the server does not hold is not checked, and says so."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from fusetune.api.app import create_app
from fusetune.config import Settings
from fusetune.db.migrate import upgrade
from fusetune.db.models import Job
from fusetune.db.session import make_engine, make_session_factory
from fusetune.demo import assets
from fusetune.storage import open_storage
from fusetune.worker.results import record_results_file
from tests.tokenization.test_data_check import (
    CHAT,
    LLAMA,
    LLAMA_MARKED_WITH_HEADER,
    LLAMA_MARKED_WITHOUT_EOT,
    LLAMA_SPECIAL,
    _tokenizer,
)

TINY_CONFIG = {
    "model_type": "llama",
    "vocab_size": 512,
    "tie_word_embeddings": True,
    **assets.TINY_MODEL_SHAPE,
}
# Llama 2's rule, which templates of that family enforce by raising.
ALTERNATING = LLAMA.replace(
    "{%- for message in messages %}",
    "{%- for message in messages %}{%- if message['role'] == 'user' and loop.previtem is defined and "
    "loop.previtem['role'] == 'user' %}{{ raise_exception('Conversation roles must alternate') }}{%- endif %}",
)


@pytest.fixture
def settings(tmp_path) -> Settings:
    settings = Settings(data_dir=tmp_path / "data")
    settings.ensure_dirs()
    upgrade(settings.database_url)
    assets.build_tokenizer().save_pretrained(settings.models_dir / "demo")
    for name, template in (
        ("no-eot", LLAMA_MARKED_WITHOUT_EOT),
        ("trains-header", LLAMA_MARKED_WITH_HEADER),
        ("alternating", ALTERNATING),
    ):
        _tokenizer(LLAMA_SPECIAL, "<|begin_of_text|>", "<|eot_id|>", template).save_pretrained(
            settings.models_dir / name
        )
    for name in ("demo", "no-eot", "trains-header", "alternating", "no-tokenizer"):
        (settings.models_dir / name).mkdir(exist_ok=True)
        (settings.models_dir / name / "config.json").write_text(json.dumps(TINY_CONFIG))
    return settings


@pytest.fixture
def client(settings) -> TestClient:
    with TestClient(
        create_app(settings), headers={"Authorization": f"Bearer {settings.dev_api_key}"}
    ) as client:
        yield client


def _upload(client: TestClient, lines: list[dict], name: str = "train.jsonl") -> str:
    content = "\n".join(json.dumps(line) for line in lines).encode()
    response = client.post("/v1/files", files={"file": (name, content)}, data={"purpose": "fine-tune"})
    assert response.status_code == 200, response.text
    return response.json()["id"]


def _job(client: TestClient, model: str, training: str, **extra):
    return client.post("/v1/fine_tuning/jobs", json={"model": model, "training_file": training, **extra})


def test_the_dry_run_previews_the_first_example_of_the_demo_data(client):
    lines = [json.loads(line) for line in assets.TRAIN_FILE.read_text().splitlines()[:300]]
    training = _upload(client, lines)
    check = _job(client, "demo", training, dry_run=True).json()["data_check"]
    assert check["status"] == "passed" and check["failure"] is None
    assert set(check["checks"]) >= {"end_of_turn_trained", "prompt_not_trained", "served_form"}
    assert check["stop_tokens"] == ["<|eot|>"]
    # The first examples only: the trainer checks every one before the model loads.
    [counts] = check["files"]
    assert counts == {"file": training, "param": "training_file", "examples_checked": 256,
                      "all_examples_checked": False, "examples_truncated": 0,
                      "examples_without_trained_tokens": 0}  # fmt: skip
    preview = check["preview"]
    assert preview["file"] == training and preview["line"] == 1
    assert preview["marked_text"].endswith("What is 97 - 53?<|eot|><|assistant|>\n⟦44<|eot|>⟧")
    assert [s["trained"] for s in preview["sequences"][0]["segments"]] == [False, True]
    preference = _upload(
        client, [json.loads(line) for line in assets.PREFERENCE_FILE.read_text().splitlines()]
    )
    pair = _job(client, "demo", preference, dry_run=True, method={"type": "dpo"}).json()["data_check"]
    assert pair["status"] == "passed"
    assert [s["label"] for s in pair["preview"]["sequences"]] == ["preferred_output", "non_preferred_output"]
    assert _job(client, "demo", training).status_code == 200


@pytest.mark.parametrize(
    "model, check",
    [("no-eot", "end_of_turn_trained"), ("trains-header", "prompt_not_trained")],
)
def test_a_template_that_masks_wrongly_refuses_the_job_before_it_exists(client, model, check):
    training = _upload(client, [{"messages": CHAT}] * 3)
    dry = _job(client, model, training, dry_run=True).json()["data_check"]
    assert dry["status"] == "failed" and dry["failure"]["check"] == check and dry["failure"]["line"] == 1
    assert dry["preview"]["line"] == 1 and "⟦" in dry["preview"]["marked_text"]
    refused = _job(client, model, training)
    error = refused.json()["error"]
    assert (
        refused.status_code == 400
        and error["code"] == "data_check_failed"
        and error["param"] == "training_file"
    )
    assert error["message"].startswith(
        f"training_file '{training}' (train.jsonl), line 1: the data check '{check}' failed: "
    )
    assert "trained tokens between ⟦ and ⟧:\n<|begin_of_text|>" in error["message"]
    assert (
        f"failed: {dry['failure']['problem']}." in error["message"]
        and dry["failure"]["message"] == error["message"]
    )
    assert client.get("/v1/fine_tuning/jobs").json()["data"] == []


def test_the_failing_line_of_the_validation_file_is_named(client):
    training = _upload(client, [{"messages": CHAT}])
    repeated_user = [CHAT[1], CHAT[1], CHAT[2]]
    validation = _upload(
        client, [{"messages": CHAT}, {"messages": CHAT}, {"messages": repeated_user}], "v.jsonl"
    )
    refused = _job(client, "alternating", training, validation_file=validation)
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["param"] == "validation_file"
    assert error["message"] == (
        f"validation_file '{validation}' (v.jsonl), line 3: the data check 'chat_template' failed: the chat "
        "template failed: Conversation roles must alternate."
    )


def test_without_the_models_tokenizer_the_data_is_not_checked_here(client):
    training = _upload(client, [{"messages": CHAT}])
    check = _job(client, "no-tokenizer", training, dry_run=True).json()["data_check"]
    assert check["status"] == "not_checked" and "the trainer checks the data" in check["reason"]
    assert _job(client, "no-tokenizer", training).status_code == 200


def test_a_jobs_results_file_is_refused_as_training_or_validation_file(client, settings):
    training = _upload(client, [{"messages": CHAT}])
    job = _job(client, "demo", training).json()
    with make_session_factory(make_engine(settings.database_url))() as session:
        results = record_results_file(session, open_storage(settings), session.get(Job, job["id"])).id
        session.commit()
    for param, files, extras in (
        ("training_file", {"training_file": results}, ({}, {"dry_run": True}, {"method": {"type": "dpo"}})),
        ("validation_file", {"training_file": training, "validation_file": results}, ({}, {"dry_run": True})),
    ):
        for extra in extras:
            response = client.post("/v1/fine_tuning/jobs", json={"model": "demo", **files, **extra})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == param and error["code"] == "invalid_file_purpose"
            assert "purpose 'fine-tune-results'" in error["message"]
            assert f"a {param} must be a training file of purpose 'fine-tune'" in error["message"]
    assert [j["id"] for j in client.get("/v1/fine_tuning/jobs").json()["data"]] == [job["id"]]
