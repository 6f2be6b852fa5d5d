"""Command line: ``fusetune serve | worker | migrate | keys | tenants | families | models | files | jobs | demo``.

`files` and `jobs` speak to a server's HTTP API with a key (through fusetune.client), as the `openai` SDK does;
the other commands act on this host's data directory."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import httpx
import typer

from fusetune import client
from fusetune.config import Settings

app = typer.Typer(help="fusetune: a self-hosted fine-tuning service.", no_args_is_help=True)
log = logging.getLogger(__name__)


def _command_group(name: str, help: str) -> typer.Typer:
    """A `fusetune <name> ...` group of subcommands, registered on the app."""
    group = typer.Typer(help=help)
    app.add_typer(group, name=name)
    return group


# The command groups (`fusetune keys ...`); each group's subcommands follow its helpers below.
keys_app = _command_group("keys", "Create, list and revoke API keys (each key belongs to one tenant).")
families_app = _command_group(
    "families", "The model families fusetune patches: its table, and families it recognises."
)
tenants_app = _command_group(
    "tenants", "Operate on a tenant's data (the API has no route for this: it is an operator's act)."
)
models_app = _command_group(
    "models", "The base models this host's server offers (folders in its models directory)."
)
files_app = _command_group("files", "Upload files to a server's API (as `POST /v1/files`).")
jobs_app = _command_group("jobs", "Create, list, follow and cancel fine-tuning jobs through a server's API.")


def _settings(data_dir: Path | None) -> Settings:
    overrides = {"data_dir": data_dir} if data_dir is not None else {}
    settings = Settings(**overrides)
    settings.ensure_dirs()
    return settings


def _check_storage(settings: Settings) -> None:
    """Bad storage settings stop the process at start with the setting named, not the first job later."""
    from fusetune.storage import StorageConfigError, open_storage

    try:
        open_storage(settings).check()
    except StorageConfigError as error:
        typer.echo(f"fusetune: storage is not usable: {error}", err=True)
        raise typer.Exit(2) from error


DataDirOption = Annotated[
    Path | None, typer.Option(help="Data directory (default: $FUSETUNE_DATA_DIR or .fusetune)")
]


@app.command()
def migrate(data_dir: DataDirOption = None, revision: str = "head") -> None:
    """Upgrade the database schema (Alembic) to a revision."""
    from fusetune.db.migrate import upgrade

    settings = _settings(data_dir)
    upgrade(settings.database_url, revision)
    typer.echo(f"database at {revision}: {settings.database_url.split('@')[-1]}")


@app.command()
def worker(
    data_dir: DataDirOption = None,
    loglevel: str = "INFO",
    parent_pid: Annotated[
        int | None, typer.Option(hidden=True, help="Stop, as on SIGTERM, when this process exits")
    ] = None,
) -> None:
    """Run a Celery worker that trains jobs one at a time. SIGTERM or SIGINT hands a job in training back to the
    queue with a checkpoint, then stops the worker; SIGHUP does the same, then starts the worker again in the same
    process (on a terminal that hung up, it only stops)."""
    from fusetune.worker.celery_app import run_worker

    logging.basicConfig(level=loglevel, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = _settings(data_dir)
    _check_storage(settings)
    run_worker(settings, loglevel=loglevel, parent_pid=parent_pid)


class _StopSignal(SystemExit):
    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


def _exit_on_signal(signum: int, _frame) -> None:
    raise _StopSignal(signum)


def _stop_as_on_sigterm(_signum: int, _frame) -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def _stop_on_signals() -> None:
    """SIGTERM, SIGINT and SIGHUP end `serve` through its `finally`, which stops the worker.

    uvicorn catches SIGINT and SIGTERM while it serves, shuts down, and raises the signal again: with the default
    handlers that ended the process on the spot, and the worker outlived it. Here the signal raised again, or one
    that comes before or after uvicorn serves, is a SystemExit. uvicorn leaves SIGHUP alone, whose default ends
    the process at once: it becomes a SIGTERM, which uvicorn serves first. Once the worker is stopped, `serve`
    ends by the signal, as it would have without these handlers (a supervisor reads a stop, not a failure)."""
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, _exit_on_signal)
    signal.signal(signal.SIGHUP, _stop_as_on_sigterm)


@app.command()
def serve(
    data_dir: DataDirOption = None,
    host: Annotated[str | None, typer.Option(help="Bind address (default $FUSETUNE_HOST)")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default $FUSETUNE_PORT)")] = None,
    embedded_worker: Annotated[bool | None, typer.Option(help="Also start one worker process")] = None,
    migrate_db: Annotated[
        bool, typer.Option("--migrate/--no-migrate", help="Upgrade the schema first")
    ] = True,
) -> None:
    """Run the HTTP API (and, in embedded mode, one worker beside it)."""
    from fusetune.api.server import run_api
    from fusetune.db.migrate import upgrade

    settings = _settings(data_dir)
    if host is not None:
        settings.host = host
    if port is not None:
        settings.port = port
    if embedded_worker is not None:
        settings.embedded_worker = embedded_worker
    _check_storage(settings)
    if migrate_db:
        upgrade(settings.database_url)
    _offer_bundled_model(settings)
    _stop_on_signals()
    worker = None
    received = None
    try:
        if settings.embedded_worker:
            env = {**os.environ, **settings.subprocess_env()}
            command = [sys.executable, "-m", "fusetune.cli", "worker", "--parent-pid", str(os.getpid())]
            # Time for the worker to hand its job over: the trainer's checkpoint, then SIGKILL as the last resort.
            stop_timeout_s = settings.handover_grace_s + settings.terminate_grace_s + 15
            worker = EmbeddedWorker(command, env, stop_timeout_s=stop_timeout_s)
            worker.start()
        run_api(settings)
    except _StopSignal as stop:
        received = stop.signum
    finally:
        # A second signal must not cut the hand-over short (the worker would still stop, on its parent's exit).
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)
        if worker is not None:
            worker.stop()
    if received is not None:
        signal.signal(received, signal.SIG_DFL)
        os.kill(os.getpid(), received)


def _offer_bundled_model(settings: Settings) -> None:
    """A server that offers no base model gets the bundled tiny one (the demo's), so that a fresh install has a
    model to fine-tune. It is built in a child process, which keeps torch out of the API's memory."""
    from fusetune.catalog import list_base_models
    from fusetune.demo.task import BUNDLED_MODEL

    if not settings.bundled_model or list_base_models(settings):
        return
    target = settings.models_dir / BUNDLED_MODEL
    command = [sys.executable, "-m", "fusetune.demo.task", "--build-base-model", str(target)]
    if subprocess.run(command).returncode != 0:
        log.error("could not build the bundled model in %s; the server offers no base model", target)
        return
    typer.echo(f"fusetune: the server offers the bundled model '{BUNDLED_MODEL}' (built in {target}; "
               "FUSETUNE_BUNDLED_MODEL=false builds none)", err=True)  # fmt: skip


class EmbeddedWorker:
    """The worker process `serve` runs beside the API, started again whenever it exits on its own: a worker
    that died (at start, say) would otherwise leave every job queued while the API keeps accepting them.
    Restarts wait 1 s, doubling to 30 s while the worker keeps dying within a minute of its start.

    The worker runs in a session of its own, so a terminal's Ctrl-C or hang-up reaches `serve` alone, which then
    stops the worker: with SIGTERM, and SIGKILL after `stop_timeout_s`."""

    def __init__(
        self,
        command: Sequence[str],
        env: dict[str, str],
        first_delay_s: float = 1.0,
        stop_timeout_s: float = 30.0,
    ):
        self._command = list(command)
        self._env = env
        self._first_delay_s = first_delay_s
        self._stop_timeout_s = stop_timeout_s
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._thread = threading.Thread(target=self._supervise, name="fusetune-embedded-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _supervise(self) -> None:
        delay = self._first_delay_s
        while True:
            with self._lock:
                if self._stopping.is_set():
                    return
                # This thread starts every worker and lives as long as they do: Linux sends the parent-death signal
                # (see fusetune.worker.lifecycle) when the thread that forked the child ends, not the process.
                self._process = subprocess.Popen(self._command, env=self._env, start_new_session=True)
                process = self._process
            started = time.monotonic()
            code = process.wait()
            if self._stopping.is_set():
                return
            if time.monotonic() - started > 60:
                delay = self._first_delay_s
            log.error("the embedded worker exited with code %s; starting it again in %.0f s", code, delay)
            self._stopping.wait(delay)
            delay = min(2 * delay, 30.0)

    def stop(self) -> None:
        with self._lock:
            self._stopping.set()
            process = self._process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=self._stop_timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()  # its training processes die with it (fusetune.worker.train.process)
                process.wait()
        self._thread.join(timeout=5)


def _key_session(data_dir: Path | None):
    from fusetune.db.session import make_engine, make_session_factory

    return make_session_factory(make_engine(_settings(data_dir).database_url))()


@keys_app.command("create")
def keys_create(
    tenant: Annotated[str, typer.Option(help="Tenant (organization) the key belongs to")],
    name: Annotated[str, typer.Option(help="A label for people")] = "",
    data_dir: DataDirOption = None,
) -> None:
    """Create a key; it is printed once and only its hash is stored."""
    from fusetune.db import queries
    from fusetune.tenants import tenant_name_problem

    problem = tenant_name_problem(tenant)
    if problem is not None:
        typer.echo(f"fusetune: {problem}", err=True)
        raise typer.Exit(2)
    with _key_session(data_dir) as session:
        row, plaintext = queries.create_api_key(session, tenant, name)
        session.commit()
        typer.echo(f"{row.id}\t{tenant}\t{plaintext}")


@keys_app.command("list")
def keys_list(data_dir: DataDirOption = None) -> None:
    from fusetune.db import queries

    with _key_session(data_dir) as session:
        for row in queries.list_api_keys(session):
            state = "revoked" if row.revoked_at else "active"
            typer.echo(f"{row.id}\t{row.tenant}\t{row.name}\t{state}")


@keys_app.command("revoke")
def keys_revoke(key_id: str, data_dir: DataDirOption = None) -> None:
    from fusetune.db import queries

    with _key_session(data_dir) as session:
        if not queries.revoke_api_key(session, key_id):
            typer.echo(f"no active key with id {key_id}", err=True)
            raise typer.Exit(1)
        session.commit()
        typer.echo(f"revoked {key_id}")


@families_app.command("propose")
def families_propose(
    source: Annotated[
        str, typer.Argument(help="A model folder (only its config.json is read) or a transformers model_type")
    ],
) -> None:
    """Recognise a family by its structure and print it as a proposed row of fusetune/models/families.py.

    A miniature of the model (its config at hidden size 64, two layers, random weights) is built and walked;
    each part found is proven by its probe, on the GPU, or on the CPU under the Triton interpreter. What
    stays unpatched is listed with the reason. Exits 1 when nothing was recognised."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' first import
    from fusetune.models import FAMILIES
    from fusetune.models.families import proposed_row
    from fusetune.models.miniature import build_miniature
    from fusetune.models.recognize import recognize

    try:
        model = build_miniature(source)
    except (OSError, ValueError, KeyError) as error:
        typer.echo(f"fusetune: cannot build a miniature of {source!r}: {error}", err=True)
        raise typer.Exit(2) from error
    if torch.cuda.is_available():
        model.to("cuda")
    recognition = recognize(model)
    model_type = recognition.model_type
    if model_type in FAMILIES:
        typer.echo(f"# {model_type} has a row in the table, which keeps priority; recognition finds:")
    typer.echo(f"# {model_type}: {recognition.share}")
    for part, what in recognition.found.items():
        typer.echo(f"#   found {part}: {what}")
    for part, why in recognition.left.items():
        typer.echo(f"#   left  {part}: {why}")
    if recognition.spec is None:
        raise typer.Exit(1)
    typer.echo(proposed_row(recognition.spec))


@tenants_app.command("limit")
def tenants_limit(
    tenant: Annotated[str, typer.Argument(help="The tenant the limits are for")],
    max_running_jobs: Annotated[
        int | None, typer.Option(min=1, help="Jobs it may have training at once (omitted: no limit)")
    ] = None,
    max_gpus: Annotated[
        int | None, typer.Option(min=1, help="GPUs its training jobs may use at once (omitted: no limit)")
    ] = None,
    reset: Annotated[
        bool, typer.Option("--reset", help="Forget this tenant's limits: the settings' defaults apply")
    ] = False,
    data_dir: DataDirOption = None,
) -> None:
    """Set a tenant's limits. Its jobs over them wait in the queue, with the reason as their status_details, and
    start (within a reaper pass) once a running one ends or a limit is raised."""
    from fusetune.db import queries
    from fusetune.tenants import tenant_name_problem

    problem = tenant_name_problem(tenant)
    if problem is not None:
        typer.echo(f"fusetune: {problem}", err=True)
        raise typer.Exit(2)
    with _key_session(data_dir) as session:
        if reset:
            queries.delete_tenant_limit(session, tenant)
        else:
            queries.set_tenant_limit(session, tenant, max_running_jobs, max_gpus)
        session.commit()
    shown = "the settings' defaults" if reset else (
        f"at most {max_running_jobs or 'any number of'} running job(s), {max_gpus or 'any number of'} GPU(s)"
    )  # fmt: skip
    typer.echo(f"tenant '{tenant}': {shown}")


@tenants_app.command("limits")
def tenants_limits(data_dir: DataDirOption = None) -> None:
    """The tenants with limits of their own (others have the settings' defaults)."""
    from fusetune.db import queries

    with _key_session(data_dir) as session:
        for row in queries.list_tenant_limits(session):
            typer.echo(f"{row.tenant}\t{row.max_running_jobs or '-'}\t{row.max_gpus or '-'}")


@tenants_app.command("delete")
def tenants_delete(
    tenant: Annotated[str, typer.Argument(help="The tenant whose data goes")],
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask for confirmation")] = False,
    data_dir: DataDirOption = None,
) -> None:
    """Delete a tenant's files, jobs, checkpoints and API keys, in SQL and in the store. Refused while one of
    its jobs is running."""
    from fusetune.db.session import make_engine, make_session_factory
    from fusetune.storage import StorageError, open_storage
    from fusetune.tenants import TenantBusy, delete_tenant_data

    settings = _settings(data_dir)
    _check_storage(settings)
    if not yes:
        typer.confirm(f"Delete every file, job, checkpoint and API key of tenant '{tenant}'?", abort=True)
    engine = make_engine(settings.database_url)
    try:
        deleted = delete_tenant_data(make_session_factory(engine), open_storage(settings), tenant)
    except TenantBusy as error:
        typer.echo(f"fusetune: {error}", err=True)
        raise typer.Exit(1) from error
    except StorageError as error:
        typer.echo(f"fusetune: the tenant's rows are deleted, but the store failed: {error}. Run the command "
                   "again to delete the objects left under its prefix.", err=True)  # fmt: skip
        raise typer.Exit(1) from error
    finally:
        engine.dispose()
    typer.echo(
        f"deleted tenant '{tenant}': {deleted.files} files, {deleted.jobs} jobs, {deleted.checkpoints} "
        f"checkpoints, {deleted.api_keys} API keys"
    )


@models_app.command("add")
def models_add(
    source: Annotated[
        str, typer.Argument(help="A local model folder, or a Hugging Face id already in the local cache")
    ],
    name: Annotated[
        str | None,
        typer.Option(help="The name jobs use as `model` (default: the folder's or the id's last part)"),
    ] = None,
    data_dir: DataDirOption = None,
) -> None:
    """Copy a Hugging Face model folder into the models directory ($FUSETUNE_MODELS_DIR, default
    <data dir>/models), where the server offers it as a base model; nothing is downloaded."""
    from fusetune.catalog import ModelFolderError, add_model_folder

    settings = _settings(data_dir)
    folder = Path(source).expanduser()
    if not folder.is_dir():
        folder = _cached_hub_folder(source)
    try:
        target = add_model_folder(settings, folder, name or source.rstrip("/").rsplit("/", 1)[-1])
    except ModelFolderError as error:
        typer.echo(f"fusetune: {error}", err=True)
        raise typer.Exit(2) from error
    typer.echo(f"added {target.name} in {target}; jobs may fine-tune model '{target.name}'")


def _cached_hub_folder(model_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(model_id, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError) as error:
        typer.echo(f"fusetune: {model_id!r} is neither a folder nor a Hugging Face id in the local cache "
                   "(`hf download` fetches one)", err=True)  # fmt: skip
        raise typer.Exit(2) from error


@models_app.command("list")
def models_list(data_dir: DataDirOption = None) -> None:
    """The base models the server offers: the models directory's folders, then FUSETUNE_HUB_MODELS."""
    from fusetune.catalog import list_base_models

    for name in list_base_models(_settings(data_dir)):
        typer.echo(name)


BaseUrlOption = Annotated[
    str | None,
    typer.Option(
        help="The API's URL, ending in /v1 (default: $FUSETUNE_BASE_URL, $OPENAI_BASE_URL or "
        "http://127.0.0.1:8000/v1)"
    ),  # fmt: skip
]
ApiKeyOption = Annotated[
    str | None,
    typer.Option(help="API key (default: $FUSETUNE_API_KEY or $OPENAI_API_KEY)", show_default=False),
]


@contextmanager
def _api(base_url: str | None, api_key: str | None) -> Iterator[client.Client]:
    """A client of the API; a refused request or an unreachable server ends the command with its reason."""
    base_url = base_url or client.default_base_url()
    api_key = api_key or client.default_api_key()
    if not api_key:
        typer.echo("fusetune: no API key: pass --api-key or set FUSETUNE_API_KEY", err=True)
        raise typer.Exit(2)
    try:
        with client.Client(base_url, api_key) as api:
            yield api
    except client.ApiError as error:
        typer.echo(f"fusetune: the server answered {error.status_code}: {error.message}", err=True)
        raise typer.Exit(1) from error
    except httpx.TransportError as error:
        typer.echo(f"fusetune: cannot reach {base_url}: {error}", err=True)
        raise typer.Exit(1) from error


@files_app.command("upload")
def files_upload(
    path: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="A JSON Lines file")],
    purpose: Annotated[str, typer.Option(help="fine-tune, or another purpose the API takes")] = "fine-tune",
    base_url: BaseUrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Upload a file; prints its id (and, on stderr, what the server counted in it)."""
    with _api(base_url, api_key) as api:
        uploaded = api.upload_file(path, purpose)
    typer.echo(f"{uploaded['filename']}: {uploaded.get('example_count')} examples", err=True)
    typer.echo(uploaded["id"])


@jobs_app.command("create")
def jobs_create(
    model: Annotated[str, typer.Option(help="A base model of the server, or one of your fine-tuned models")],
    training_file: Annotated[str, typer.Option(help="The id of an uploaded training file")],
    validation_file: Annotated[str | None, typer.Option(help="The id of an uploaded validation file")] = None,
    n_epochs: Annotated[int | None, typer.Option(help="Epochs")] = None,
    batch_size: Annotated[int | None, typer.Option(help="Sequences per optimizer step")] = None,
    learning_rate: Annotated[float | None, typer.Option(help="Peak learning rate")] = None,
    hyperparameters: Annotated[
        str | None, typer.Option(help="More hyperparameters as JSON, e.g. '{\"warmup_ratio\": 0.05}'")
    ] = None,
    suffix: Annotated[str | None, typer.Option(help="Part of the fine-tuned model's name")] = None,
    seed: Annotated[int | None, typer.Option(help="Random seed")] = None,
    base_url: BaseUrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Create a job; prints its id. The API's defaults fill what is not given (README, "Hyperparameters")."""
    try:
        chosen = json.loads(hyperparameters) if hyperparameters else {}
    except json.JSONDecodeError as error:
        typer.echo(f"fusetune: --hyperparameters is not JSON: {error}", err=True)
        raise typer.Exit(2) from error
    flags = {"n_epochs": n_epochs, "batch_size": batch_size, "learning_rate": learning_rate}
    chosen.update({key: value for key, value in flags.items() if value is not None})
    body = {"model": model, "training_file": training_file, "validation_file": validation_file,
            "suffix": suffix, "seed": seed, "hyperparameters": chosen}  # fmt: skip
    with _api(base_url, api_key) as api:
        job = api.create_job({key: value for key, value in body.items() if value is not None})
    typer.echo(f"{job['id']}: {job['status']}", err=True)
    typer.echo(job["id"])


@jobs_app.command("list")
def jobs_list(
    limit: Annotated[int, typer.Option(min=1, max=100, help="Newest jobs shown")] = 20,
    base_url: BaseUrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """The newest jobs: id, status, model, fine-tuned model, created (UTC)."""
    with _api(base_url, api_key) as api:
        jobs = api.list_jobs(limit)
    for job in jobs:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(job["created_at"]))
        typer.echo(
            f"{job['id']}\t{job['status']}\t{job['model']}\t{job.get('fine_tuned_model') or '-'}\t{created}"
        )


@jobs_app.command("cancel")
def jobs_cancel(job_id: str, base_url: BaseUrlOption = None, api_key: ApiKeyOption = None) -> None:
    """Cancel a queued, running or paused job."""
    with _api(base_url, api_key) as api:
        job = api.cancel_job(job_id)
    typer.echo(f"{job['id']}\t{job['status']}")


@jobs_app.command("follow")
def jobs_follow(
    job_id: str,
    poll_s: Annotated[float, typer.Option(min=0.1, help="Seconds between polls")] = 1.0,
    base_url: BaseUrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Show a job's progress (steps, loss, tokens/s, time left) and its messages until it ends, then its status
    and fine-tuned model. Exits 0 when the job succeeded, 1 otherwise."""
    with _api(base_url, api_key) as api:
        job = _follow(api, job_id, poll_s)
    if job["status"] == "succeeded":
        typer.echo(f"{job['id']} succeeded: {job['fine_tuned_model']}")
        return
    error = job.get("error") or {}
    typer.echo(f"{job['id']} {job['status']}" + (f": {error.get('message')}" if error else ""))
    raise typer.Exit(1)


def _follow(api: client.Client, job_id: str, poll_s: float) -> dict:
    """The job's progress bar and messages on stderr, until it ends; returns the ended job."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    console = Console(stderr=True)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[figures]}"),
    )
    with Progress(*columns, console=console) as bar:
        task = bar.add_task("queued", total=None, figures="")
        for progress, events in api.follow(job_id, poll_s):
            for event in events:
                bar.console.print(event["message"], highlight=False, markup=False)
            bar.update(task, description=progress.job["status"], total=progress.total_steps,
                       completed=progress.step or 0, figures=_figures(progress))  # fmt: skip
    return progress.job


def _figures(progress: client.Progress) -> str:
    figures = []
    if progress.train_loss is not None:
        figures.append(f"loss {progress.train_loss:.4f}")
    if progress.tokens_per_second is not None:
        figures.append(f"{progress.tokens_per_second:,.0f} tokens/s")
    if progress.eta_s is not None and not progress.finished:
        minutes, seconds = divmod(round(progress.eta_s), 60)
        figures.append(f"ETA {minutes}:{seconds:02d}")
    return "  ".join(figures)


@app.command()
def demo(
    data_dir: DataDirOption = None,
    port: int = 8765,
    n_gpus: Annotated[int, typer.Option(help="Training processes (gloo on CPU, one per GPU with NCCL)")] = 2,
    n_epochs: Annotated[int | None, typer.Option(help="Epochs (default: the demo task's)")] = None,
    keep_serving: Annotated[
        bool, typer.Option("--keep-serving", help="Leave the service up after the demo (Ctrl-C stops it)")
    ] = False,
) -> None:
    """Start the embedded service, fine-tune the bundled tiny model over HTTP and compare its answers before and
    after on held-out prompts."""
    from fusetune.demo.run import run_demo

    settings = _settings(data_dir)
    exit_code = run_demo(settings, port=port, n_gpus=n_gpus, n_epochs=n_epochs, keep_serving=keep_serving)
    raise typer.Exit(exit_code)


if __name__ == "__main__":
    app()
