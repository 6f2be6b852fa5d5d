"""Command line: ``fusetune serve | worker | migrate | keys | tenants | families | demo``."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer

from fusetune.config import Settings

app = typer.Typer(help="fusetune: a self-hosted fine-tuning service.", no_args_is_help=True)
log = logging.getLogger(__name__)


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


keys_app = typer.Typer(help="Create, list and revoke API keys (each key belongs to one tenant).")
app.add_typer(keys_app, name="keys")


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


families_app = typer.Typer(help="The model families fusetune patches: its table, and families it recognises.")
app.add_typer(families_app, name="families")


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


tenants_app = typer.Typer(
    help="Operate on a tenant's data (the API has no route for this: it is an operator's act)."
)
app.add_typer(tenants_app, name="tenants")


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
