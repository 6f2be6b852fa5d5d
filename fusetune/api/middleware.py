"""ASGI middleware: request-size limit and read timeout while the body streams in, and Prometheus request
metrics."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from fusetune.api.errors import error_body

# Multipart framing around the file itself (boundaries, part headers, the purpose field).
MULTIPART_OVERHEAD_BYTES = 64 * 1024


def _answered_instead(send, cut_off: Callable[[], bool], reject: Callable[[Any], Awaitable[None]]):
    """The app's `send` while the body is whole; once `cut_off()` (the body guard ended the body early), what
    the app answers about the truncated request is dropped and `reject(send)` answers in its place, once."""
    rejected = False

    async def guarded_send(message):
        nonlocal rejected
        if not cut_off():
            return await send(message)
        if not rejected:
            rejected = True
            await reject(send)

    return guarded_send


async def _send_closing_error(send, status: int, error: dict) -> None:
    """A JSON error response that closes the connection (the rest of the body is not read)."""
    body = json.dumps(error).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})


class _RequestBodyGuard:
    """What both guards of a request body share: only requests that carry one (POST, PUT, PATCH) reach
    `_guard`; the rest go straight to the app."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        return await self._guard(scope, receive, send)

    async def _guard(self, scope, receive, send):
        raise NotImplementedError


class BodySizeLimit(_RequestBodyGuard):
    """Refuses a request body over the limit with a 413 as soon as the limit is crossed, before it is buffered.

    A Content-Length over the limit is refused at the app's first read of the body, before any byte is read; a
    chunked body is counted as it arrives and cut off at the limit. Either way the request has been routed, so
    the request metrics count the 413 under its route.
    """

    def __init__(self, app, max_body_bytes: int):
        super().__init__(app)
        self.max_body_bytes = max_body_bytes

    async def _guard(self, scope, receive, send):
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        received = 0
        too_large = False

        async def counting_receive():
            nonlocal received, too_large
            if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
                too_large = True
                return {"type": "http.request", "body": b"", "more_body": False}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    # The app's body parser turns exceptions into its own errors; cut the body off instead and
                    # answer 413 in place of whatever the app says about the truncated request.
                    too_large = True
                    return {"type": "http.request", "body": b"", "more_body": False}
            return message

        await self.app(scope, counting_receive, _answered_instead(send, lambda: too_large, self._reject))

    async def _reject(self, send):
        limit = self.max_body_bytes - MULTIPART_OVERHEAD_BYTES
        message = f"Request body is larger than the upload limit of {limit} bytes."
        await _send_closing_error(send, 413, error_body(413, message, "file", "file_too_large"))


class BodyReadTimeout(_RequestBodyGuard):
    """Answers 408 and closes the connection when a request body stops arriving: no bytes for `timeout_s`.

    uvicorn bounds idle keep-alive connections but not a body that stalls mid-upload, which held a request (and
    its temporary file) open for as long as the client liked. The wait is per read, so a slow but moving upload
    of any size goes through.
    """

    def __init__(self, app, timeout_s: float):
        super().__init__(app)
        self.timeout_s = timeout_s

    async def _guard(self, scope, receive, send):
        body_done = timed_out = False

        async def timed_receive():
            nonlocal body_done, timed_out
            if body_done:  # after the body, a read waits for the client to disconnect: no stall
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except TimeoutError:
                # As for a body over the size limit: end the body here and answer 408 in place of the app.
                timed_out = body_done = True
                return {"type": "http.request", "body": b"", "more_body": False}
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        await self.app(scope, timed_receive, _answered_instead(send, lambda: timed_out, self._reject))

    async def _reject(self, send):
        message = f"The request body stalled: no bytes for {self.timeout_s:g} s."
        await _send_closing_error(send, 408, error_body(408, message, None, "request_timeout"))


class RequestMetrics:
    """Counts requests and their latency per route template (not per URL, so ids don't explode the labels)."""

    def __init__(self, app, registry: CollectorRegistry):
        self.app = app
        self.requests = Counter("fusetune_http_requests_total", "HTTP requests", ["method", "route", "status"],
                                registry=registry)  # fmt: skip
        self.latency = Histogram("fusetune_http_request_duration_seconds", "HTTP request latency",
                                 ["method", "route"], registry=registry,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))  # fmt: skip

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = 500

        async def recording_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            self.requests.labels(scope["method"], template, str(status)).inc()
            self.latency.labels(scope["method"], template).observe(time.perf_counter() - start)
