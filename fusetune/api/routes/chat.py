"""/v1/chat/completions: OpenAI's chat completions on a base model or one of the tenant's fine-tuned models.

The API holds no model: it checks that the tenant may call the model, then forwards the request to a worker's
chat completions server (fusetune/serving, found through the worker's row) and passes its answer through, a
server-sent event stream included. Workers that are not training are asked first; one that is refuses (it gave
its devices to training), and the next is asked.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
from fastapi import APIRouter
from fastapi.responses import Response, StreamingResponse

from fusetune.api.deps import ReadsDep, SettingsDep, TenantDep
from fusetune.api.errors import ApiError, not_found
from fusetune.capacity import workers_alive_since
from fusetune.catalog import base_model_location
from fusetune.db import queries
from fusetune.spec.chat import TENANT_HEADER, ChatCompletionCreate

router = APIRouter(prefix="/v1/chat", tags=["chat"])

# Generation may take minutes between two bytes of a non-streamed reply: no read timeout.
UPSTREAM_TIMEOUT = httpx.Timeout(connect=5.0, read=None, write=30.0, pool=5.0)


@router.post("/completions")
async def create_chat_completion(
    body: ChatCompletionCreate, settings: SettingsDep, reads: ReadsDep, tenant: TenantDep
) -> Response:
    model = body.model
    if base_model_location(settings, model) is None and not await reads(
        lambda connection: queries.callable_fine_tuned_model(connection, model, tenant)
    ):
        raise not_found("model", model, param="model")
    workers = await reads(
        lambda connection: queries.serving_workers(connection, workers_alive_since(settings))
    )
    content = body.model_dump_json(exclude_none=True)
    for url, token, _training in workers:
        client = httpx.AsyncClient(timeout=UPSTREAM_TIMEOUT)
        request = client.build_request(
            "POST", f"{url}/v1/chat/completions", content=content,
            headers={"Authorization": f"Bearer {token}", TENANT_HEADER: tenant,
                     "Content-Type": "application/json"},
        )  # fmt: skip
        try:
            upstream = await client.send(request, stream=True)
        except httpx.TransportError:  # a worker gone since its last heartbeat
            await client.aclose()
            continue
        if upstream.status_code == 503:  # training there: the next worker
            await upstream.aclose()
            await client.aclose()
            continue
        if upstream.status_code != 200 or not body.stream:
            payload = await upstream.aread()
            await upstream.aclose()
            await client.aclose()
            return Response(payload, status_code=upstream.status_code, media_type="application/json")
        return StreamingResponse(
            _relay(upstream, client), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
    raise ApiError(503, "No worker can serve chat completions now: none is up, or every one is training a job. "
                   "Retry later.", code="no_serving_worker")  # fmt: skip


async def _relay(upstream: httpx.Response, client: httpx.AsyncClient) -> AsyncIterator[bytes]:
    """The worker's event stream as it comes; a client gone closes the worker's stream, which stops decoding."""
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    finally:
        await upstream.aclose()
        await client.aclose()
