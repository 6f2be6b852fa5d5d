"""The storage layer against a real S3 HTTP server (moto's standalone server): uploads streamed and validated
on the way, nothing left behind by a refused one, checkpoints published with checksums and downloaded as the
same archive as from a local folder, tenants apart by prefix, bad settings refused at start by name."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text, update
from typer.testing import CliRunner

from fusetune.api.app import create_app
from fusetune.api.checkpoint_archive import iter_archive_bytes, plan_archive, plan_stored_archive
from fusetune.cli import app as cli_app
from fusetune.config import Settings
from fusetune.db import queries
from fusetune.db.migrate import upgrade
from fusetune.db.models import Job, JobStatus
from fusetune.db.session import make_engine, make_session_factory
from fusetune.demo.assets import TRAIN_FILE, build_tiny_model
from fusetune.storage import (
    MANIFEST_FILENAME,
    ObjectStorage,
    StorageConfigError,
    StorageError,
    file_key,
    open_storage,
    run_key,
)
from tests.services import TERMINAL, StoreOutage, moto_s3_server, service_env, start_worker, stop_process

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {Settings().dev_api_key}"}
GOOD_LINE = b'{"messages": [{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4"}]}\n'


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with moto_s3_server(tmp_path_factory.mktemp("moto")) as server:
        yield server


def _settings(tmp_path, s3, prefix: str, **overrides) -> Settings:
    env = s3.storage_env(prefix)
    values = {
        "storage_url": env["FUSETUNE_STORAGE_URL"],
        "storage_endpoint": env["FUSETUNE_STORAGE_ENDPOINT"],
        "storage_access_key_id": env["FUSETUNE_STORAGE_ACCESS_KEY_ID"],
        "storage_secret_access_key": env["FUSETUNE_STORAGE_SECRET_ACCESS_KEY"],
    }
    return Settings(data_dir=tmp_path / "data", **{**values, **overrides})


@pytest.fixture
def client(tmp_path, s3, request):
    settings = _settings(tmp_path, s3, request.node.name.replace("[", "-").rstrip("]"), max_upload_bytes=4096)
    settings.ensure_dirs()
    upgrade(settings.database_url)
    with TestClient(create_app(settings), headers=AUTH) as client:
        client.prefix = settings.storage_url.split("/", 3)[3]
        yield client


def _upload(client, content: bytes, name: str = "train.jsonl"):
    return client.post(
        "/v1/files", files={"file": (name, io.BytesIO(content))}, data={"purpose": "fine-tune"}
    )


def test_upload_streams_to_the_store_and_delete_removes_the_object(client, s3):
    content = GOOD_LINE * 20
    response = _upload(client, content)
    assert response.status_code == 200, response.text
    file_id = response.json()["id"]
    assert response.json()["example_count"] == 20 and response.json()["bytes"] == len(content)
    assert s3.keys(client.prefix) == [f"{client.prefix}/tenants/default/files/{file_id}.jsonl"]
    # Nothing lands on the API's disk.
    assert not any(client.app.state.settings.files_dir.iterdir())
    assert client.get(f"/v1/files/{file_id}/content").content == content
    assert client.delete(f"/v1/files/{file_id}").status_code == 200
    assert s3.keys(client.prefix) == []


@pytest.mark.parametrize(
    "content, status, code",
    [
        (GOOD_LINE * 10 + b'{"messages": []}\n', 400, "invalid_file"),  # validated while it streams
        (GOOD_LINE * 200, 413, None),  # over the 4096-byte limit: refused as it crosses it
    ],
)
def test_a_refused_upload_leaves_no_object_and_no_open_multipart_upload(client, s3, content, status, code):
    response = _upload(client, content)
    assert response.status_code == status, response.text
    if code:
        assert response.json()["error"]["code"] == code
        assert "line 11" in response.json()["error"]["message"]
    assert s3.keys(client.prefix) == []
    assert not s3.client().list_multipart_uploads(Bucket=s3.bucket).get("Uploads")


def test_idempotent_upload_replays_without_a_second_object(client, s3):
    headers = {"Idempotency-Key": "upload-1"}
    first = client.post("/v1/files", files={"file": ("t.jsonl", GOOD_LINE)}, data={"purpose": "fine-tune"},
                        headers=headers)  # fmt: skip
    again = client.post("/v1/files", files={"file": ("t.jsonl", GOOD_LINE)}, data={"purpose": "fine-tune"},
                        headers=headers)  # fmt: skip
    assert first.json()["id"] == again.json()["id"]
    assert len(s3.keys(client.prefix)) == 1


def _checkpoint_folder(root):
    folder = root / "ftjob-abc" / "checkpoints" / "step-4"
    (folder / "training_state").mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    # Over one 5 MiB part: a multipart upload with per-part checksums.
    (folder / "model.safetensors").write_bytes(hashlib.sha256(b"w").digest() * (7 * 1024 * 1024 // 32))
    (folder / "training_state" / "optimizer.pt").write_bytes(b"o" * 3000)
    return folder


def test_a_published_checkpoint_downloads_as_the_same_archive_as_its_folder(tmp_path, s3):
    storage = open_storage(_settings(tmp_path, s3, "archive", storage_part_bytes=5 * 1024 * 1024))
    folder = _checkpoint_folder(tmp_path / "runs")
    storage.publish_checkpoint("acme", "ftjob-abc/checkpoints/step-4", folder)
    for excluded in ((), ("training_state",)):
        files = storage.checkpoint_files("acme", "ftjob-abc/checkpoints/step-4", excluded)

        def read(relative, first, last):
            return storage.read_checkpoint_file("acme", "ftjob-abc/checkpoints/step-4", relative, first, last)

        remote = plan_stored_archive("step-4", files, read)
        local = plan_archive(folder, excluded_top_level=excluded)
        assert remote.etag == local.etag and remote.size == local.size
        whole = b"".join(iter_archive_bytes(remote, 0, remote.size))
        assert whole == b"".join(iter_archive_bytes(local, 0, local.size))
        start = remote.size // 3
        assert (
            b"".join(iter_archive_bytes(remote, start, start + 5_000_000)) == whole[start : start + 5_000_000]
        )
        names = tarfile.open(fileobj=io.BytesIO(whole)).getnames()
        assert ("step-4/training_state/optimizer.pt" in names) == (excluded == ())
    # Another tenant's prefix holds nothing of it.
    assert storage.checkpoint_files("other", "ftjob-abc/checkpoints/step-4") is None


def test_restore_checks_every_file_against_the_manifest(tmp_path, s3):
    storage = open_storage(_settings(tmp_path, s3, "restore"))
    folder = _checkpoint_folder(tmp_path / "runs")
    storage.publish_checkpoint("acme", "ftjob-abc/checkpoints/step-4", folder)
    restored = storage.restore_checkpoint(
        "acme", "ftjob-abc/checkpoints/step-4", tmp_path / "scratch" / "step-4"
    )
    for path in folder.rglob("*"):
        if path.is_file():
            copy = restored / path.relative_to(folder)
            assert (
                copy.read_bytes() == path.read_bytes() and copy.stat().st_mtime_ns == path.stat().st_mtime_ns
            )
    key = f"restore/{run_key('acme', 'ftjob-abc/checkpoints/step-4')}/config.json"
    s3.client().put_object(Bucket=s3.bucket, Key=key, Body=b'{"model_type": "gpt2"}')
    with pytest.raises(StorageError, match="SHA-256"):
        storage.restore_checkpoint("acme", "ftjob-abc/checkpoints/step-4", tmp_path / "again" / "step-4")
    assert not (tmp_path / "again" / "step-4").exists()


def test_keys_escape_tenants_and_refuse_paths_that_are_not_plain_names():
    assert file_key("a/../b", "file-1.jsonl") == "tenants/a%2F..%2Fb/files/file-1.jsonl"
    for bad in ("../other/runs/x", "ftjob-1/../../x", "/abs", "a//b", ""):
        with pytest.raises(StorageError):
            run_key("acme", bad)


def test_a_tenants_objects_go_with_it_and_no_one_elses(tmp_path, s3):
    storage = open_storage(_settings(tmp_path, s3, "tenants"))
    for tenant in ("acme", "acme2"):
        with storage.file_writer(tenant, "file-1.jsonl") as writer:
            writer.write(GOOD_LINE)
            writer.commit()
    storage.delete_tenant("acme")
    assert s3.keys("tenants/") == ["tenants/tenants/acme2/files/file-1.jsonl"]


@pytest.fixture(scope="module")
def s3_with_auth(tmp_path_factory):
    # moto checks signatures against its IAM users once no unauthenticated calls are allowed.
    with moto_s3_server(
        tmp_path_factory.mktemp("moto-auth"), bucket=None, INITIAL_NO_AUTH_ACTION_COUNT="0"
    ) as server:
        yield server


@pytest.mark.parametrize(
    "what, overrides, message",
    [
        (
            "bucket",
            {"storage_url": "s3://no-such-bucket/x"},
            "bucket 'no-such-bucket' of FUSETUNE_STORAGE_URL",
        ),
        (
            "endpoint",
            {"storage_endpoint": "http://127.0.0.1:9", "storage_max_retries": 0},
            "FUSETUNE_STORAGE_ENDPOINT",
        ),
        ("credentials", {"storage_url": "s3://fusetune-test/x"}, "FUSETUNE_STORAGE_ACCESS_KEY_ID"),
        ("url", {"storage_url": "https://bucket/x"}, "FUSETUNE_STORAGE_URL must be"),
    ],
)
def test_bad_settings_are_refused_naming_the_setting(tmp_path, s3, s3_with_auth, what, overrides, message):
    server = s3_with_auth if what == "credentials" else s3
    with pytest.raises(StorageConfigError, match=message.replace("(", r"\(")):
        open_storage(_settings(tmp_path, server, "x", **overrides)).check()


def test_the_worker_refuses_to_start_on_a_missing_bucket(tmp_path, s3):
    settings = _settings(tmp_path, s3, "x", storage_url="s3://no-such-bucket/x")
    result = subprocess.run([sys.executable, "-m", "fusetune.cli", "worker"], env=service_env(settings),
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 2
    assert "bucket 'no-such-bucket' of FUSETUNE_STORAGE_URL" in result.stderr


def test_object_storage_is_chosen_only_by_the_url(tmp_path, s3):
    assert not open_storage(Settings(data_dir=tmp_path)).remote
    assert isinstance(open_storage(_settings(tmp_path, s3, "x")), ObjectStorage)


LLAMA_1B = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True}  # fmt: skip
PREFERENCE_LINE = (
    b'{"input": {"messages": [{"role": "user", "content": "2+2"}]}, "preferred_output": [{"role": "assistant", '
    b'"content": "4"}], "non_preferred_output": [{"role": "assistant", "content": "5"}]}\n'
)


def test_dry_run_of_a_fine_tuned_model_reads_its_config_from_the_store(client, tmp_path):
    """The API host holds no checkpoint: the fine-tuned model's shape comes from the config.json in the store,
    and gives the same estimate as a base model of that shape."""
    settings, storage = client.app.state.settings, client.app.state.storage
    (settings.models_dir / "llama-1b").mkdir()
    (settings.models_dir / "llama-1b" / "config.json").write_text(json.dumps(LLAMA_1B))
    sft_file = _upload(client, GOOD_LINE * 8).json()["id"]
    dpo_file = _upload(client, PREFERENCE_LINE * 8).json()["id"]
    fine_tuned = "llama-1b:ft-default-abc"
    with make_session_factory(make_engine(settings.database_url))() as session:
        job = Job(id="ftjob-abc", tenant="default", model="llama-1b", training_file_id=sft_file,
                  status=JobStatus.SUCCEEDED, fine_tuned_model=fine_tuned)  # fmt: skip
        session.add(job)
        session.flush()
        queries.add_checkpoint(session, job.id, 4, "ftjob-abc/checkpoints/step-4", {})
        session.commit()

    def dry_run(model, training_file, method):
        body = {"model": model, "training_file": training_file, "dry_run": True,
                "method": {"type": method}, "hyperparameters": {"n_epochs": 1, "batch_size": 4}}  # fmt: skip
        return client.post("/v1/fine_tuning/jobs", json=body)

    # Recorded in SQL but not (yet) in the store: no config to read, and a clear refusal.
    missing = dry_run(fine_tuned, sft_file, "supervised")
    assert missing.status_code == 400 and "no config.json" in missing.json()["error"]["message"]
    folder = tmp_path / "worker" / "ftjob-abc" / "checkpoints" / "step-4"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({**LLAMA_1B, "num_hidden_layers": 8}))
    storage.publish_checkpoint("default", "ftjob-abc/checkpoints/step-4", folder)
    assert not (settings.runs_dir / "ftjob-abc").exists()

    estimates = {}
    for method, training_file in (("supervised", sft_file), ("dpo", dpo_file)):
        response = dry_run(fine_tuned, training_file, method)
        assert response.status_code == 200, response.text
        estimates[method] = response.json()
        # Half the layers of the base model: the checkpoint's config was read, not the base model's.
        (settings.models_dir / "llama-1b" / "config.json").write_text(
            json.dumps({**LLAMA_1B, "num_hidden_layers": 8})
        )
        base = dry_run("llama-1b", training_file, method).json()
        (settings.models_dir / "llama-1b" / "config.json").write_text(json.dumps(LLAMA_1B))
        # Neither data check runs (no tokenizer in the models directory), each saying why in its own words.
        # The disk's free space is the machine's, which other processes change between the two calls.
        unrelated = {"model": None, "data_check": None, "disk_free_bytes": None}
        assert {**estimates[method], **unrelated} == {**base, **unrelated}
        assert (
            estimates[method]["parameters"] < dry_run("llama-1b", training_file, method).json()["parameters"]
        )
    assert (
        estimates["dpo"]["peak_memory_bytes_per_gpu"] != estimates["supervised"]["peak_memory_bytes_per_gpu"]
    )


def _presigned_client(tmp_path, s3, prefix: str, **overrides) -> TestClient:
    settings = _settings(tmp_path, s3, prefix, storage_presigned_downloads=True, storage_presigned_expiry_s=120,
                         **overrides)  # fmt: skip
    settings.ensure_dirs()
    upgrade(settings.database_url)
    return TestClient(create_app(settings), headers=AUTH, follow_redirects=False)


def _recorded_checkpoint(settings: Settings, file_id: str, tenant: str = "default") -> str:
    with make_session_factory(make_engine(settings.database_url))() as session:
        session.add(Job(id="ftjob-abc", tenant=tenant, model="tiny", training_file_id=file_id,
                        status=JobStatus.SUCCEEDED))  # fmt: skip
        session.flush()
        checkpoint = queries.add_checkpoint(session, "ftjob-abc", 4, "ftjob-abc/checkpoints/step-4", {})
        session.commit()
        return checkpoint.id


def test_presigned_downloads_redirect_to_the_store_after_the_api_checks(tmp_path, s3):
    client = _presigned_client(tmp_path, s3, "presigned")
    settings, storage = client.app.state.settings, client.app.state.storage
    content = GOOD_LINE * 20
    file_id = _upload(client, content, name="my data.jsonl").json()["id"]
    response = client.get(f"/v1/files/{file_id}/content")
    assert response.status_code == 307 and response.headers["cache-control"] == "no-store"
    url = response.headers["location"]
    assert url.startswith(f"{s3.endpoint}/{s3.bucket}/presigned/tenants/default/files/{file_id}.jsonl?")
    assert "X-Amz-Expires=120" in url and "X-Amz-Signature=" in url
    direct = httpx.get(url)  # no API key: the URL alone grants this one object
    assert direct.content == content
    assert direct.headers["content-disposition"] == "attachment; filename*=utf-8''my%20data.jsonl"
    ranged = httpx.get(url, headers={"Range": "bytes=10-99"})
    assert ranged.status_code == 206 and ranged.content == content[10:100]

    # Signed for the address clients use, where it differs from the one the service uses.
    public = s3.endpoint.replace("127.0.0.1", "localhost")
    signer = open_storage(_settings(tmp_path, s3, "presigned", storage_presigned_downloads=True,
                                    storage_public_endpoint=public))  # fmt: skip
    public_url = signer.file_download_url("default", f"{file_id}.jsonl")
    assert public_url.startswith(f"{public}/") and httpx.get(public_url).content == content

    # Authentication and the tenant's ownership are checked before anything is signed.
    assert client.get(f"/v1/files/{file_id}/content", headers={"Authorization": ""}).status_code == 401
    with make_session_factory(make_engine(settings.database_url))() as session:
        _, other_key = queries.create_api_key(session, "other")
        session.commit()
    other = client.get(f"/v1/files/{file_id}/content", headers={"Authorization": f"Bearer {other_key}"})
    assert other.status_code == 404 and "location" not in other.headers

    checkpoint_id = _recorded_checkpoint(settings, file_id)
    folder = _checkpoint_folder(tmp_path / "runs")
    storage.publish_checkpoint("default", "ftjob-abc/checkpoints/step-4", folder)
    route = f"/v1/fine_tuning/jobs/ftjob-abc/checkpoints/{checkpoint_id}/content"
    other = client.get(route, headers={"Authorization": f"Bearer {other_key}"})
    assert other.status_code == 404 and "location" not in other.headers
    for query, excluded in (("", ("training_state",)), ("?include_training_state=true", ())):
        local = plan_archive(folder, excluded_top_level=excluded)
        expected = b"".join(iter_archive_bytes(local, 0, local.size))
        first = client.get(route + query)
        assert first.status_code == 307, first.text
        # The first request wrote the archive to the store; the next one finds it and only signs.
        archives = [key for key in s3.keys("presigned/") if "fusetune-archive-" in key]
        assert client.get(route + query).status_code == 307
        assert [key for key in s3.keys("presigned/") if "fusetune-archive-" in key] == archives
        downloaded = httpx.get(first.headers["location"])
        assert downloaded.content == expected, "the presigned archive differs from the streamed one"
        assert downloaded.headers["content-disposition"].endswith(
            f"ftjob-abc-step-4{query and '-with-training-state'}.tar"
        )
        start = len(expected) // 3
        ranged = httpx.get(first.headers["location"], headers={"Range": f"bytes={start}-{start + 99_999}"})
        assert ranged.status_code == 206 and ranged.content == expected[start : start + 100_000]
    assert len(archives) == 2
    # The archives go with the checkpoint.
    storage.delete_checkpoints("default", ["ftjob-abc/checkpoints/step-4"])
    assert not [key for key in s3.keys("presigned/") if "/runs/" in key]


def test_the_local_store_ignores_presigned_downloads(tmp_path):
    settings = Settings(data_dir=tmp_path / "data", storage_presigned_downloads=True)
    settings.ensure_dirs()
    upgrade(settings.database_url)
    client = TestClient(create_app(settings), headers=AUTH, follow_redirects=False)
    file_id = _upload(client, GOOD_LINE).json()["id"]
    response = client.get(f"/v1/files/{file_id}/content")
    assert response.status_code == 200 and response.content == GOOD_LINE


def _tenant_rows(settings: Settings, tenant: str) -> dict[str, int]:
    engine = make_engine(settings.database_url)
    with engine.connect() as connection:
        jobs = f"(SELECT id FROM jobs WHERE tenant = '{tenant}')"
        counts = {
            table: connection.execute(text(f"SELECT COUNT(*) FROM {table} WHERE {where}")).scalar_one()
            for table, where in (
                ("files", f"tenant = '{tenant}'"), ("jobs", f"tenant = '{tenant}'"),
                ("api_keys", f"tenant = '{tenant}'"), ("idempotent_requests", f"tenant = '{tenant}'"),
                ("checkpoints", f"job_id IN {jobs}"), ("job_events", f"job_id IN {jobs}"),
                ("job_metrics", f"job_id IN {jobs}"),
            )
        }  # fmt: skip
    engine.dispose()
    return counts


def _stored(settings: Settings, s3, prefix: str) -> list[str]:
    if s3 is not None:
        return s3.keys(prefix)
    return sorted(str(path.relative_to(settings.data_dir)) for path in settings.data_dir.glob("[fr]*s/**/*"))


@pytest.mark.parametrize("store", ["local", "s3"])
def test_deleting_a_tenant_removes_its_rows_and_objects_and_no_one_elses(tmp_path, request, store):
    s3 = request.getfixturevalue("s3") if store == "s3" else None
    settings = _settings(tmp_path, s3, "tenant-delete") if s3 else Settings(data_dir=tmp_path / "data")
    settings.ensure_dirs()
    upgrade(settings.database_url)
    (settings.models_dir / "tiny").mkdir()
    (settings.models_dir / "tiny" / "config.json").write_text("{}")
    sessions = make_session_factory(make_engine(settings.database_url))
    app = create_app(settings)
    jobs, files = {}, {}
    for tenant in ("acme", "other"):
        with sessions() as session:
            _, key = queries.create_api_key(session, tenant)
            session.commit()
        client = TestClient(app, headers={"Authorization": f"Bearer {key}"})
        file_id = client.post("/v1/files", files={"file": ("t.jsonl", GOOD_LINE * 4)}, data={"purpose": "fine-tune"},
                              headers={"Idempotency-Key": "k"}).json()["id"]  # fmt: skip
        job_id = client.post("/v1/fine_tuning/jobs", json={"model": "tiny", "training_file": file_id}).json()[
            "id"
        ]
        with sessions() as session:
            queries.add_metric(session, job_id, 4, {"train_loss": 1.0})
            queries.add_checkpoint(session, job_id, 4, f"{job_id}/checkpoints/step-4", {})
            session.commit()
        folder = settings.runs_dir / job_id / "checkpoints" / "step-4"
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        app.state.storage.publish_checkpoint(tenant, f"{job_id}/checkpoints/step-4", folder)
        if s3 is not None:
            shutil.rmtree(settings.runs_dir / job_id)  # the store holds it; the API host keeps no copy
        jobs[tenant], files[tenant] = job_id, file_id
    prefix = "tenant-delete/tenants/"
    others_before, acme_before = _tenant_rows(settings, "other"), _tenant_rows(settings, "acme")
    acme_names = ("/acme/", jobs["acme"], files["acme"])
    others_stored = [name for name in _stored(settings, s3, prefix) if not any(n in name for n in acme_names)]
    assert all(acme_before.values()) and len(others_stored) >= 2
    assert len(_stored(settings, s3, prefix)) > len(others_stored)

    def delete(*args):
        return CliRunner().invoke(cli_app, ["tenants", "delete", "acme", "--data-dir", str(settings.data_dir), *args],
                                  env={k: v for k, v in settings.subprocess_env().items() if "STORAGE" in k})  # fmt: skip

    with sessions() as session:
        session.execute(update(Job).where(Job.id == jobs["acme"]).values(status=JobStatus.RUNNING))
        session.commit()
    refused = delete("--yes")
    assert refused.exit_code == 1 and f"1 running job(s): {jobs['acme']}" in refused.output
    assert _tenant_rows(settings, "acme") == acme_before
    assert delete().exit_code == 1  # not confirmed
    with sessions() as session:
        session.execute(update(Job).where(Job.id == jobs["acme"]).values(status=JobStatus.QUEUED))
        session.commit()

    deleted = delete("--yes")
    assert deleted.exit_code == 0, deleted.output
    assert "1 files, 1 jobs, 1 checkpoints, 1 API keys" in deleted.output
    assert not any(_tenant_rows(settings, "acme").values())
    assert _tenant_rows(settings, "other") == others_before
    assert _stored(settings, s3, prefix) == others_stored


def test_a_store_lost_mid_job_fails_it_with_storage_error_and_keeps_the_recorded_checkpoint(tmp_path, s3):
    """The worker and its trainer reach the store through a proxy that becomes unreachable once the first
    checkpoint's manifest is stored (so that checkpoint is whole); the next checkpoint's upload fails after the
    client's retries, the job fails with `storage_error`, and the recorded checkpoint still downloads."""
    settings = _settings(tmp_path, s3, "outage", checkpoint_every_steps=1, checkpoint_every_epoch=False)
    settings.ensure_dirs()
    upgrade(settings.database_url)
    build_tiny_model(settings.models_dir / "tiny-llama")
    outage = StoreOutage(s3.endpoint, lambda method, path: method == "PUT" and MANIFEST_FILENAME in path)
    worker_env = {"FUSETUNE_STORAGE_ENDPOINT": outage.endpoint, "FUSETUNE_STORAGE_MAX_RETRIES": "2",
                  "FUSETUNE_STORAGE_RETRY_TIMEOUT_S": "10", "FUSETUNE_STORAGE_CONNECT_TIMEOUT_S": "2"}  # fmt: skip
    worker = start_worker(settings, tmp_path / "worker.log", worker_env)
    try:
        with TestClient(create_app(settings), headers=AUTH) as client:
            lines = TRAIN_FILE.read_bytes().splitlines(keepends=True)[:8]
            file_id = _upload(client, b"".join(lines)).json()["id"]
            body = {"model": "tiny-llama", "training_file": file_id, "seed": 0,
                    "hyperparameters": {"n_epochs": 2, "batch_size": 8, "n_gpus": 1}}  # fmt: skip
            job_id = client.post("/v1/fine_tuning/jobs", json=body).json()["id"]
            deadline = time.monotonic() + 300
            while (job := client.get(f"/v1/fine_tuning/jobs/{job_id}").json())["status"] not in TERMINAL:
                assert time.monotonic() < deadline, (tmp_path / "worker.log").read_text()[-3000:]
                time.sleep(0.5)
            assert outage.down.is_set()
            assert job["status"] == "failed" and job["error"]["code"] == "storage_error", job
            assert "uploading the checkpoint" in job["error"]["message"]
            assert f"{job_id}/checkpoints/step-2" in job["error"]["message"]
            checkpoints = client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints").json()["data"]
            assert [c["step_number"] for c in checkpoints] == [1]
            archive = client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints/{checkpoints[0]['id']}/content")
            with tarfile.open(fileobj=io.BytesIO(archive.content)) as tar:
                names = tar.getnames()
            assert {"step-1/config.json", "step-1/model.safetensors"} <= set(names), names
    finally:
        stop_process(worker)
        outage.close()
