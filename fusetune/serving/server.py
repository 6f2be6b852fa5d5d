"""The worker's chat completions server: a small HTTP app over the serving engine, run by uvicorn in a thread of
the worker process, on serving_host:serving_port. The worker writes its URL and a token made at its start into
its row (queries.record_worker) on every heartbeat; the API forwards a tenant's checked request there
(fusetune/api/routes/chat.py) with that token and the tenant, and passes the answer or the event stream through.

It speaks OpenAI's shape (chat.completion, chat.completion.chunk events ending with `data: [DONE]`), so the API
adds nothing to a reply.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from fusetune.config import Settings
from fusetune.serving.errors import ServingError
from fusetune.spec.chat import TENANT_HEADER, ChatCompletionCreate
from fusetune.worker.train.outcome import TrainingFailure

if TYPE_CHECKING:
    from fusetune.serving.engine import Engine, Event
    from fusetune.serving.engine import Request as EngineRequest

    # Annotations only: the worker hands its locations in, so the server itself imports no SQL package (a
    # process that runs it without a database, as benchmarks/serving/chat_throughput.py does, needs none).
    from fusetune.worker.locations import ModelLocations

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def _sse(payload: dict[str, Any] | str) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()


def resolve_model(
    engine: Engine | LazyEngine, locations: ModelLocations, model: str, tenant: str
) -> tuple[str, Any]:
    """The model's location (the engine's key) and how to load it; the caller checked the tenant may call it.
    Chat completions and eval runs (fusetune/worker/evals.py) both submit to the engine with these."""
    location = locations.location_of(model, tenant)
    if location is None:
        raise ServingError(404, f"No model with id '{model}'.", "model", "model_not_found")
    bases = locations.adapter_base_models(tenant, location)
    return location, lambda: engine.load_model(location, bases)


class LazyEngine:
    """The serving engine, built when it is first used (a chat request, an eval run). The engine imports torch and
    transformers, which took most of a worker's start when the server built it there (the commit that made it
    lazy has the measurement): a worker that serves nothing never imports them in its main process. Training
    pauses and resumes it before it is built as after."""

    def __init__(self, idle_s: float, max_batch: int, max_len: int = 4096):
        self._idle_s, self._max_batch, self._max_len = idle_s, max_batch, max_len
        self._engine: Engine | None = None
        self._build_lock = threading.Lock()  # one build; held through torch's import
        self._lock = threading.Lock()  # the state below, never held through an import
        self._paused = False
        self._stopped = False

    def get(self) -> Engine:
        engine = self._engine
        if engine is not None:
            return engine
        with self._build_lock:
            if self._engine is None:
                # torch and transformers: imported once something is served, not at the worker's start
                from fusetune.serving.engine import Engine

                engine = Engine(self._idle_s, self._max_batch, max_len=self._max_len)
                with self._lock:
                    if self._stopped:
                        engine.stop()
                        raise ServingError(503, "The worker is stopping.")
                    if self._paused:  # a job started training while the engine was built
                        engine.pause()
                    self._engine = engine
                log.info("serving: engine started on %s", engine.device)
            return self._engine

    def submit(
        self, key: str, load: Callable[[], tuple[Any, Any]], body: ChatCompletionCreate,
        emit: Callable[[Event], None],
    ) -> EngineRequest:  # fmt: skip
        with self._lock:
            if self._paused and self._engine is None:  # refused as the engine would, without building it now
                raise ServingError(503, "The worker is training a job; chat completions resume after it.",
                                   code="worker_training")  # fmt: skip
        return self.get().submit(key, load, body, emit)

    def load_model(self, location: str, adapter_base_models: Mapping[str, str]) -> tuple[Any, Any]:
        return self.get().load_model(location, adapter_base_models)

    def pause(self) -> None:
        with self._lock:
            self._paused = True
            if self._engine is not None:
                self._engine.pause()

    def resume(self) -> None:
        with self._lock:
            self._paused = False
            if self._engine is not None:
                self._engine.resume()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            engine = self._engine
        if engine is not None:
            engine.stop()

    @property
    def loaded_models(self) -> list[str]:
        engine = self._engine
        return engine.loaded_models if engine is not None else []


class _Outbox:
    """Events from the engine's thread to the requests' queues in one event loop, with one wake-up of the loop for
    all the events that arrive before it runs. The engine emits an event per new token of every sequence in a
    step (64 at 64 busy slots) and a call_soon_threadsafe per event woke the loop as often, a write to its
    self-pipe each, from the thread that must get back to launching the next step."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, Event]] = []

    def put(self, queue: asyncio.Queue, event: Event) -> None:
        with self._lock:
            self._pending.append((queue, event))
            if len(self._pending) > 1:  # a delivery is scheduled and has not run yet: it takes this one too
                return
        self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for queue, event in pending:
            queue.put_nowait(event)


class _Outboxes:
    """One outbox per event loop (the app runs in one, uvicorn's; a test's client may run another)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._outboxes: dict[asyncio.AbstractEventLoop, _Outbox] = {}

    def get(self, loop: asyncio.AbstractEventLoop) -> _Outbox:
        with self._lock:
            return self._outboxes.setdefault(loop, _Outbox(loop))


def create_serving_app(engine: LazyEngine, locations: ModelLocations, token: str) -> FastAPI:
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    outboxes = _Outboxes()

    def resolve(model: str, tenant: str) -> tuple[str, Any]:
        return resolve_model(engine, locations, model, tenant)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "loaded_models": len(engine.loaded_models)}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        if not secrets.compare_digest(request.headers.get("authorization", ""), f"Bearer {token}"):
            return _error(401, "This is a worker's serving endpoint; call the API.", code="invalid_api_key")
        tenant = request.headers.get(TENANT_HEADER, "")
        try:
            body = ChatCompletionCreate.model_validate_json(await request.body())
        except ValidationError as error:
            return _error(400, str(error), code="invalid_request")
        events: asyncio.Queue = asyncio.Queue()
        outbox = outboxes.get(asyncio.get_running_loop())

        def emit(event) -> None:
            outbox.put(events, event)

        try:
            key, load = await run_in_threadpool(resolve, body.model, tenant)
            handle = await run_in_threadpool(engine.submit, key, load, body, emit)
        except ServingError as error:
            return _error(error.status_code, error.message, error.param, error.code)
        except TrainingFailure as failure:
            log.warning("serving: could not load %s: %s", body.model, failure)
            return _error(500, f"The model '{body.model}' could not be loaded.", "model", "model_load_failed")
        reply_id, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
        if body.stream:
            stream = _stream(events, body, reply_id, created)
            return StreamingResponse(
                _cancelling(stream, handle.cancelled), media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )  # fmt: skip
        try:
            return await _complete(events, body, reply_id, created)
        finally:
            handle.cancelled.set()

    return app


async def _cancelling(stream: AsyncIterator[bytes], cancelled: threading.Event) -> AsyncIterator[bytes]:
    """The stream; a client gone before its end stops the request's decoding."""
    try:
        async for chunk in stream:
            yield chunk
    finally:
        cancelled.set()


async def _complete(events: asyncio.Queue, body: ChatCompletionCreate, reply_id: str, created: int):
    texts = [""] * body.choices
    reasons: list[str | None] = [None] * body.choices
    while True:
        kind, first, second = await events.get()
        if kind == "delta":
            texts[first] += second
        elif kind == "finish":
            reasons[first] = second
        elif kind == "error":
            return _error(first, second, code="generation_failed")
        elif kind == "usage":
            break
    choices = [
        {"index": i, "message": {"role": "assistant", "content": text, "refusal": None},
         "finish_reason": reason, "logprobs": None}
        for i, (text, reason) in enumerate(zip(texts, reasons, strict=True))
    ]  # fmt: skip
    usage = {"prompt_tokens": first, "completion_tokens": second, "total_tokens": first + second}
    return {"id": reply_id, "object": "chat.completion", "created": created, "model": body.model,
            "choices": choices, "usage": usage}  # fmt: skip


async def _stream(
    events: asyncio.Queue, body: ChatCompletionCreate, reply_id: str, created: int
) -> AsyncIterator[bytes]:
    """The reply's chunks. The events that queued up while the last write went out are sent together, one write,
    with each choice's text deltas among them joined into one chunk: while the server keeps up, every token is a
    chunk of its own, as soon as it is decoded; when it falls behind (many streams at once, each sending one
    chunk per decoding step), its writes per step stop growing with its backlog. Clients read a delta of several
    tokens as they read one (OpenAI's own streams have them)."""
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    head = {"id": reply_id, "object": "chat.completion.chunk", "created": created, "model": body.model}
    if include_usage:
        head["usage"] = None
    # A text delta's chunk, the most frequent by far, rendered from this prefix rather than a dict per chunk: the
    # same JSON as json.dumps of {**head, "choices": [choice]}.
    content_prefix = b"data: " + json.dumps(head)[:-1].encode() + b', "choices": [{"index": '

    def chunk(index: int, delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        return _sse({**head, "choices": [choice]})

    def content_chunk(index: int, text: str) -> bytes:
        return b'%s%d, "delta": {"content": %s}, "finish_reason": null, "logprobs": null}]}\n\n' % (
            content_prefix,
            index,
            json.dumps(text).encode(),
        )

    def render(batch: list[Event]) -> tuple[bytes, bool]:
        """The batch's chunks, and whether the reply ended with them."""
        out: list[bytes] = []
        texts: dict[int, str] = {}  # each choice's deltas not yet rendered, joined

        def flush_texts() -> None:
            out.extend(content_chunk(index, text) for index, text in texts.items())
            texts.clear()

        for kind, first, second in batch:
            if kind == "delta":
                texts[first] = texts.get(first, "") + second
                continue
            flush_texts()  # a choice's finish comes after its text
            if kind == "finish":
                out.append(chunk(first, {}, second))
            elif kind == "error":
                body_error = {"message": second, "type": "server_error", "param": None,
                              "code": "generation_failed"}  # fmt: skip
                out.append(_sse({"error": body_error}))
                return b"".join(out), True
            elif kind == "usage":
                if include_usage:
                    usage = {
                        "prompt_tokens": first,
                        "completion_tokens": second,
                        "total_tokens": first + second,
                    }
                    out.append(_sse({**head, "choices": [], "usage": usage}))
                out.append(_sse("[DONE]"))
                return b"".join(out), True
        flush_texts()
        return b"".join(out), False

    yield b"".join(chunk(index, {"role": "assistant", "content": ""}) for index in range(body.choices))
    while True:
        batch = [await events.get()]
        while not events.empty():
            batch.append(events.get_nowait())
        data, ended = render(batch)
        yield data
        if ended:
            return


class ServingServer:
    """The engine and its HTTP server, in threads of the worker process."""

    def __init__(self, settings: Settings, locations: ModelLocations):
        self.engine = LazyEngine(
            settings.serving_idle_s, settings.serving_max_batch, settings.serving_max_len
        )
        self.token = secrets.token_hex(24)
        family = socket.AF_INET6 if ":" in settings.serving_host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((settings.serving_host, settings.serving_port))
        # Listening from here on, before uvicorn's thread starts: a request sent as soon as the URL is known (the
        # worker advertises it at once) waits in the backlog until the server accepts it, rather than being refused
        # while the thread starts (the API skips a refusing worker: a 503 for a server that was up).
        self._socket.listen(2048)
        port = self._socket.getsockname()[1]
        host = settings.serving_public_host or settings.serving_host
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        app = create_serving_app(self.engine, locations, self.token)
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._socket]},
            name="fusetune-serving-http",
            daemon=True,
        )

    def start(self) -> ServingServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self.engine.stop()
        self._thread.join(timeout=10)
        self._socket.close()
