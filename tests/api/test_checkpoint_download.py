"""GET /v1/fine_tuning/jobs/{id}/checkpoints/{ckpt}/content: a tar of the checkpoint folder, without its
training_state/ unless asked, the same bytes on every request, so that HTTP Range can resume a download.

The app runs in-process on a migrated SQLite database; the job is created through the API (it stays queued,
nothing consumes the queue) and a checkpoint row points at a folder written here the way the trainer writes
one: a tiny model saved with save_pretrained plus training_state/.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pytest
import torch

from fusetune.api.checkpoint_archive import iter_archive_bytes, plan_archive
from fusetune.api.routes import jobs as jobs_routes
from fusetune.db import queries
from fusetune.db.session import make_engine, make_session_factory
from fusetune.worker.train.checkpoints import layout as worker_checkpoint

TRAINING_LINE = json.dumps(
    {"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]}
)
STEP = 3


def _tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _write_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    """A checkpoint folder as the trainer leaves it; returns the saved weights."""
    model = _tiny_model()
    model.save_pretrained(folder)
    (folder / worker_checkpoint.TRAINER_STATE_FILENAME).write_text(json.dumps({"step": STEP}))
    state = folder / worker_checkpoint.TRAINING_STATE_DIRNAME
    state.mkdir()
    torch.save({"state": {"model.norm.weight": {"exp_avg": torch.ones(16)}}}, state / "optimizer.pt")
    torch.save({"step": STEP, "rng": [torch.get_rng_state()]}, state / "resume.pt")
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


@pytest.fixture
def checkpoint(client, settings) -> tuple[str, str, dict[str, torch.Tensor]]:
    """(job id, checkpoint id, saved weights) of a queued job with one checkpoint on disk."""
    upload = client.post(
        "/v1/files",
        files={"file": ("train.jsonl", (TRAINING_LINE + "\n") * 4)},
        data={"purpose": "fine-tune"},
    )
    assert upload.status_code == 200, upload.text
    job = client.post("/v1/fine_tuning/jobs", json={"model": "tiny", "training_file": upload.json()["id"]})
    assert job.status_code == 200, job.text
    job_id = job.json()["id"]
    relative = f"{job_id}/{worker_checkpoint.CHECKPOINTS_DIRNAME}/{worker_checkpoint.CHECKPOINT_PREFIX}{STEP}"
    weights = _write_checkpoint(settings.runs_dir / relative)
    with make_session_factory(make_engine(settings.database_url))() as session:
        row = queries.add_checkpoint(session, job_id, STEP, relative, {"train_loss": 1.0})
        session.commit()
        return job_id, row.id, weights


def _url(checkpoint) -> str:
    job_id, checkpoint_id, _ = checkpoint
    return f"/v1/fine_tuning/jobs/{job_id}/checkpoints/{checkpoint_id}/content"


def _download(client, checkpoint, include_training_state: bool | None = None, **headers) -> bytes:
    params = {} if include_training_state is None else {"include_training_state": include_training_state}
    response = client.get(_url(checkpoint), params=params, headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/x-tar"
    assert int(response.headers["content-length"]) == len(response.content)
    return response.content


def _members(archive: bytes) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        return tar.getnames()


def _extract(archive: bytes, target: Path) -> Path:
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(target, filter="data")
    (folder,) = [path for path in target.iterdir() if path.is_dir()]
    return folder


def test_default_archive_has_no_training_state_and_loads(client, checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    response = client.get(_url(checkpoint))
    assert response.status_code == 200
    disposition = response.headers["content-disposition"]
    assert disposition == f'attachment; filename="{checkpoint[0]}-step-{STEP}.tar"'
    names = _members(response.content)
    assert f"step-{STEP}/config.json" in names and f"step-{STEP}/model.safetensors" in names
    assert not [name for name in names if "training_state" in name], names

    folder = _extract(response.content, tmp_path / "downloaded")
    model = AutoModelForCausalLM.from_pretrained(folder)
    loaded = model.state_dict()
    for name, saved in checkpoint[2].items():
        torch.testing.assert_close(loaded[name], saved, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("value", ["false", "0"])
def test_false_flag_is_the_default(client, checkpoint, value):
    assert _download(client, checkpoint, value) == _download(client, checkpoint)


def test_flag_includes_training_state(client, checkpoint, settings, tmp_path):
    response = client.get(_url(checkpoint), params={"include_training_state": "true"})
    assert response.status_code == 200
    assert response.headers["content-disposition"].endswith(f'-step-{STEP}-with-training-state.tar"')
    full, default = set(_members(response.content)), set(_members(_download(client, checkpoint)))
    state = f"step-{STEP}/{worker_checkpoint.TRAINING_STATE_DIRNAME}"
    assert full - default == {f"{state}/optimizer.pt", f"{state}/resume.pt"}

    folder = _extract(response.content, tmp_path / "downloaded")
    source = settings.runs_dir / checkpoint[0] / "checkpoints" / f"step-{STEP}"
    for relative in ("training_state/optimizer.pt", "training_state/resume.pt", "model.safetensors"):
        assert (folder / relative).read_bytes() == (source / relative).read_bytes(), relative


def test_invalid_flag_is_a_400_naming_it(client, checkpoint):
    response = client.get(_url(checkpoint), params={"include_training_state": "maybe"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "include_training_state"


@pytest.mark.parametrize("include_training_state", [False, True], ids=["default", "with-training-state"])
def test_range_resumes_to_the_same_bytes(client, checkpoint, include_training_state):
    full = _download(client, checkpoint, include_training_state)
    params = {"include_training_state": include_training_state}
    etag = client.get(_url(checkpoint), params=params).headers["etag"]
    # Cut inside a header, inside a file's content and inside the end-of-archive padding.
    for cut in (100, len(full) // 2 + 7, len(full) - 300):
        head = client.get(_url(checkpoint), params=params, headers={"Range": f"bytes=0-{cut - 1}"})
        tail = client.get(
            _url(checkpoint), params=params, headers={"Range": f"bytes={cut}-", "If-Range": etag}
        )
        assert head.status_code == tail.status_code == 206
        assert head.headers["content-range"] == f"bytes 0-{cut - 1}/{len(full)}"
        assert tail.headers["content-range"] == f"bytes {cut}-{len(full) - 1}/{len(full)}"
        assert int(tail.headers["content-length"]) == len(full) - cut
        assert head.content + tail.content == full
    middle = client.get(_url(checkpoint), params=params, headers={"Range": "bytes=1000-1999"})
    assert middle.status_code == 206 and middle.content == full[1000:2000]
    suffix = client.get(_url(checkpoint), params=params, headers={"Range": "bytes=-700"})
    assert suffix.status_code == 206 and suffix.content == full[-700:]
    beyond_the_end = client.get(
        _url(checkpoint), params=params, headers={"Range": f"bytes=5-{len(full) + 50}"}
    )
    assert beyond_the_end.status_code == 206 and beyond_the_end.content == full[5:]


def test_the_two_variants_have_different_etags(client, checkpoint):
    default = client.get(_url(checkpoint)).headers["etag"]
    with_state = client.get(_url(checkpoint), params={"include_training_state": True}).headers["etag"]
    assert default != with_state


def test_changed_folder_gets_a_new_etag_and_a_stale_if_range_the_whole_archive(client, checkpoint, settings):
    first = client.get(_url(checkpoint))
    config = settings.runs_dir / checkpoint[0] / "checkpoints" / f"step-{STEP}" / "config.json"
    stat = config.stat()
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns + 5_000_000_000))
    second = client.get(_url(checkpoint), headers={"Range": "bytes=10-", "If-Range": first.headers["etag"]})
    assert second.status_code == 200 and second.headers["etag"] != first.headers["etag"]
    assert "content-range" not in second.headers and len(second.content) == len(first.content)


@pytest.mark.parametrize(
    "range_header", ["bytes=0-9,20-29", "items=0-9", "bytes=9-0", "bytes=-", "bytes=a-b"]
)
def test_ranges_it_does_not_honour_get_the_whole_archive(client, checkpoint, range_header):
    full = _download(client, checkpoint)
    assert _download(client, checkpoint, Range=range_header) == full


@pytest.mark.parametrize("range_of", [lambda size: f"bytes={size}-", lambda size: f"bytes={size + 10}-{size + 20}",
                                      lambda size: "bytes=-0"])  # fmt: skip
def test_range_outside_the_archive_is_a_416(client, checkpoint, range_of):
    size = len(_download(client, checkpoint))
    response = client.get(_url(checkpoint), headers={"Range": range_of(size)})
    assert response.status_code == 416
    assert response.headers["content-range"] == f"bytes */{size}"
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def _tarfile_reference(folder: Path, names: list[str]) -> bytes:
    """What Python's tarfile writes for the same members with the same metadata."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in names:
            path = folder.parent / name
            info = tar.gettarinfo(path, arcname=name)
            info.mtime = int(path.stat().st_mtime)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            with path.open("rb") as handle:
                tar.addfile(info, handle)
    return buffer.getvalue()


def test_archive_is_byte_for_byte_what_tarfile_writes(tmp_path):
    folder = tmp_path / "step-7"
    _write_checkpoint(folder)
    # A name longer than a plain tar header holds (PAX), a non-ASCII one, an empty file, and a link left out.
    (folder / "nested" / ("d" * 90)).mkdir(parents=True)
    (folder / "nested" / ("d" * 90) / ("f" * 60 + ".json")).write_text("{}")
    (folder / "nested" / "données.txt").write_text("é")
    (folder / "nested" / "empty").touch()
    (folder / "link.json").symlink_to(folder / "config.json")

    for excluded in ((), (worker_checkpoint.TRAINING_STATE_DIRNAME,)):
        archive = plan_archive(folder, excluded_top_level=excluded)
        streamed = b"".join(iter_archive_bytes(archive, 0, archive.size))
        assert len(streamed) == archive.size and archive.size % tarfile.RECORDSIZE == 0
        assert streamed == _tarfile_reference(folder, list(archive.member_names))
        # The comparison sees a difference as small as the order of the members.
        assert streamed != _tarfile_reference(folder, list(reversed(archive.member_names)))
        assert "step-7/link.json" not in archive.member_names
        # Sorted, so that the archive does not depend on the order a file system lists a folder in.
        assert list(archive.member_names) == sorted(archive.member_names, key=lambda name: name.split("/"))
        assert ("step-7/training_state/optimizer.pt" in archive.member_names) == (not excluded)
        assert streamed == b"".join(iter_archive_bytes(plan_archive(folder, excluded_top_level=excluded), 0,
                                                       archive.size))  # fmt: skip


def test_api_names_the_training_state_folder_as_the_worker_writes_it():
    assert jobs_routes.TRAINING_STATE_DIRNAME == worker_checkpoint.TRAINING_STATE_DIRNAME
