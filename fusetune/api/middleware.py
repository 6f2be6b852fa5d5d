"""ASGI middleware: request-size limit and read timeout while the body streams in, and Prometheus request
metrics."""

from __future__ import annotations

import asyncio
import json
import time

from prometheus_client import CollectorRegistry, Counter, Histogram

from fusetune.api.errors import error_body

# Multipart framing around the file itself (boundaries, part headers, the purpose field).
MULTIPART_OVERHEAD_BYTES = 64 * 1024


class BodySizeLimit:
    """Refuses a request body over the limit with a 413 as soon as the limit is crossed, before it is buffered.

    A Content-Length over the limit is refused at the app's first read of the body, before any byte is read; a
    chunked body is counted as it arrives and cut off at the limit. Either way the request has been routed, so
    the request metrics count the 413 under its route.
    """

    def __init__(self, app, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        received = 0
        too_large = False
        rejected = False

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

        async def guarded_send(message):
            nonlocal rejected
            if not too_large:
                return await send(message)
            if not rejected:
                rejected = True
                await self._reject(send)

        await self.app(scope, counting_receive, guarded_send)

    async def _reject(self, send):
        limit = self.max_body_bytes - MULTIPART_OVERHEAD_BYTES
        body = json.dumps(error_body(413, f"Request body is larger than the upload limit of {limit} bytes.", "file",
                                     "file_too_large")).encode()  # fmt: skip
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})


class BodyReadTimeout:
    """Answers 408 and closes the connection when a request body stops arriving: no bytes for `timeout_s`.

    uvicorn bounds idle keep-alive connections but not a body that stalls mid-upload, which held a request (and
    its temporary file) open for as long as the client liked. The wait is per read, so a slow but moving upload
    of any size goes through.
    """

    def __init__(self, app, timeout_s: float):
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        body_done = timed_out = rejected = False

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

        async def guarded_send(message):
            nonlocal rejected
            if not timed_out:
                return await send(message)
            if not rejected:
                rejected = True
                await self._reject(send)

        await self.app(scope, timed_receive, guarded_send)

    async def _reject(self, send):
        message = f"The request body stalled: no bytes for {self.timeout_s:g} s."
        body = json.dumps(error_body(408, message, None, "request_timeout")).encode()
        await send({"type": "http.response.start", "status": 408,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})


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
