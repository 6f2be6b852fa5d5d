"""Base models on a fresh install: `fusetune models add` puts a model folder in the models directory, and `serve`
offers the bundled tiny model when the server has none (tests/test_readme_snippets.py starts a real one)."""

from __future__ import annotations

import subprocess

import pytest
from typer.testing import CliRunner

from fusetune import cli
from fusetune.catalog import list_base_models
from fusetune.cli import app
from fusetune.config import Settings
from fusetune.demo.task import BUNDLED_MODEL


def _model_folder(path):
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "model.safetensors").write_bytes(b"weights")
    return path


def test_models_add_copies_a_local_folder_under_its_name_or_another(tmp_path):
    source = _model_folder(tmp_path / "my-model")
    data_dir = tmp_path / "data"
    runner = CliRunner()
    result = runner.invoke(app, ["models", "add", str(source), "--data-dir", str(data_dir)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(
        app, ["models", "add", str(source), "--name", "other", "--data-dir", str(data_dir)]
    )
    assert result.exit_code == 0, result.output
    models_dir = data_dir / "models"
    assert (models_dir / "my-model" / "model.safetensors").read_bytes() == b"weights"
    assert list_base_models(Settings(data_dir=data_dir)) == ["my-model", "other"]
    listed = runner.invoke(app, ["models", "list", "--data-dir", str(data_dir)])
    assert listed.stdout.split() == ["my-model", "other"]


def test_models_add_honours_fusetune_models_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSETUNE_MODELS_DIR", str(tmp_path / "elsewhere"))
    source = _model_folder(tmp_path / "src" / "m")
    result = CliRunner().invoke(app, ["models", "add", str(source), "--data-dir", str(tmp_path / "data")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "elsewhere" / "m" / "config.json").is_file()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--name", "../up"], "is not a folder name"),
        (["--name", "taken"], "already has a model named 'taken'"),
    ],
)
def test_models_add_refuses_with_the_reason(tmp_path, arguments, message):
    source = _model_folder(tmp_path / "src")
    data_dir = tmp_path / "data"
    _model_folder(data_dir / "models" / "taken")
    result = CliRunner().invoke(app, ["models", "add", str(source), *arguments, "--data-dir", str(data_dir)])
    assert result.exit_code == 2 and message in result.output
    assert list_base_models(Settings(data_dir=data_dir)) == ["taken"]


def test_models_add_refuses_a_folder_without_config_and_an_id_not_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "empty").mkdir()
    data_dir = str(tmp_path / "data")
    result = CliRunner().invoke(app, ["models", "add", str(tmp_path / "empty"), "--data-dir", data_dir])
    assert result.exit_code == 2 and "holds no config.json" in result.output
    result = CliRunner().invoke(app, ["models", "add", "someone/not-cached", "--data-dir", data_dir])
    assert (
        result.exit_code == 2 and "neither a folder nor a Hugging Face id in the local cache" in result.output
    )


def test_models_add_takes_a_hugging_face_id_from_the_local_cache(tmp_path, monkeypatch):
    """The cache's layout: a snapshot folder of links to blobs; the copy holds the files, not the links."""
    cache = tmp_path / "hub-cache"
    repo = cache / "models--someone--tiny"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc").write_text('{"model_type": "llama"}')
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").symlink_to(repo / "blobs" / "abc")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data_dir = tmp_path / "data"
    result = CliRunner().invoke(app, ["models", "add", "someone/tiny", "--data-dir", str(data_dir)])
    assert result.exit_code == 0, result.output
    copied = data_dir / "models" / "tiny" / "config.json"
    assert copied.is_file() and not copied.is_symlink()


def _no_build(*_args, **_kwargs):
    raise AssertionError("the bundled model was built")


def test_serve_offers_the_bundled_model_only_to_a_server_with_none(tmp_path, monkeypatch):
    built = []

    def build(command, **_kwargs):
        built.append(command)
        _model_folder(tmp_path / "data" / "models" / BUNDLED_MODEL)
        return subprocess.CompletedProcess(command, 0)

    settings = Settings(data_dir=tmp_path / "data")
    monkeypatch.setattr(cli.subprocess, "run", _no_build)
    cli._offer_bundled_model(Settings(data_dir=tmp_path / "data", bundled_model=False))
    monkeypatch.setattr(cli.subprocess, "run", build)
    cli._offer_bundled_model(settings)
    assert built and built[0][-2:] == ["--build-base-model", str(settings.models_dir / BUNDLED_MODEL)]
    assert list_base_models(settings) == [BUNDLED_MODEL]
    # Once there (or any model there), nothing more is built.
    monkeypatch.setattr(cli.subprocess, "run", _no_build)
    cli._offer_bundled_model(settings)


def test_the_bundled_model_builds_without_deprecation_warnings(tmp_path):
    """torchao, imported by transformers, registers enums that torch 2.14 treats natively, and torch logged
    a warning for each at the demo's start (fusetune/demo/__init__.py)."""
    target = tmp_path / "models" / BUNDLED_MODEL
    result = subprocess.run(
        [cli.sys.executable, "-m", "fusetune.demo.task", "--build-base-model", str(target)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert (target / "config.json").is_file()
    assert "deprecated" not in result.stderr.lower(), result.stderr
