"""The FastAPI application factory."""

from __future__ import annotations

import os

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, multiprocess

from fusetune import __version__
from fusetune.api.deps import Reads
from fusetune.api.errors import install_error_handlers
from fusetune.api.middleware import MULTIPART_OVERHEAD_BYTES, BodyReadTimeout, BodySizeLimit, RequestMetrics
from fusetune.api.routes import chat, evals, files, graders, jobs, metrics, models, options
from fusetune.api.routes.ui import install_dashboard
from fusetune.config import Settings
from fusetune.db.session import make_engine, make_session_factory
from fusetune.queue import JobQueue, make_celery_app
from fusetune.storage import open_storage


def create_app(settings: Settings | None = None, queue: JobQueue | None = None) -> FastAPI:
    settings = settings or Settings()
    settings.ensure_dirs()
    # /docs and /redoc are the dashboard's routes, served from vendored files (fusetune/api/routes/ui.py).
    app = FastAPI(
        title="fusetune",
        version=__version__,
        description="Fine-tuning API (OpenAI-compatible /v1).",
        docs_url=None,
        redoc_url=None,
    )
    engine = make_engine(settings.database_url)
    app.state.settings = settings
    app.state.engine = engine
    app.state.session_factory = make_session_factory(engine)
    app.state.reads = Reads.for_engine(engine)
    app.state.queue = queue or JobQueue(make_celery_app(settings))
    app.state.storage = open_storage(settings)
    # A registry per app, so several apps in one process (tests) don't share counters. With several API
    # processes (PROMETHEUS_MULTIPROC_DIR set, see `fusetune serve`), each writes its request metrics to files
    # there and a scrape answered by any of them reads them all.
    app.state.metrics_registry = CollectorRegistry()
    request_registry = app.state.metrics_registry
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        request_registry = CollectorRegistry()  # its values live in the files, not here
        multiprocess.MultiProcessCollector(app.state.metrics_registry)
    install_error_handlers(app, request_registry)
    for module in (files, jobs, options, graders, models, chat, evals, metrics):
        app.include_router(module.router)
    app.include_router(evals.job_runs_router)
    install_dashboard(app)
    app.state.job_metrics_registry = metrics.install_state_collector(
        app.state.metrics_registry, app.state.session_factory
    )
    app.add_middleware(BodySizeLimit, max_body_bytes=settings.max_upload_bytes + MULTIPART_OVERHEAD_BYTES)
    app.add_middleware(BodyReadTimeout, timeout_s=settings.body_read_timeout_s)
    # Outermost (added last), so that it counts what the limits answer (413, 408) as the client gets it.
    app.add_middleware(RequestMetrics, registry=request_registry)

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, str]:
        return {"status": "ok", "version": __version__}

    return app
