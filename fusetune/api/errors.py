"""One error shape everywhere: ``{"error": {"message", "type", "param", "code"}}`` (the OpenAI API's).

An unexpected exception is a 500 in the same shape. Its body names a request id and nothing of the exception;
the server log has the traceback under that id, and Prometheus counts it by exception type.
"""

from __future__ import annotations

import logging
import secrets

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter
from python_multipart.multipart import DEFAULT_MAX_HEADER_SIZE
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.formparsers import MultiPartException

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
}


class ApiError(Exception):
    """An error the user can act on: the message names the field, the line or the limit."""

    def __init__(self, status_code: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code


def not_found(kind: str, object_id: str, param: str | None = None) -> ApiError:
    code = kind.replace("-", "_").replace(" ", "_") + "_not_found"
    return ApiError(404, f"No {kind} with id '{object_id}'.", param=param, code=code)


def error_body(status_code: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    error_type = _TYPE_BY_STATUS.get(
        status_code, "server_error" if status_code >= 500 else "invalid_request_error"
    )
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


# The names pydantic gives the members of a union in an error's location ("n_epochs", "int" for a value of
# `int | Literal["auto"]`): a type, not a field of the request, so not part of the parameter a client fixes.
_UNION_MEMBER_TYPES = {"int", "float", "str", "bool", "list", "dict", "none", "bytes"}


def _is_union_member(part: object) -> bool:
    text = str(part)
    return text in _UNION_MEMBER_TYPES or any(c in text for c in "[]'-")


def _param_from_loc(loc: tuple) -> str | None:
    # ("body", "hyperparameters", "n_epochs", "int") -> "hyperparameters.n_epochs"; a discriminated union's tag
    # ("type='string_check'", fusetune/spec/graders.py) names the member, not a field: ("grader", tag, "operation")
    # -> "grader.operation"
    skipped = ("body", "query", "path", "header")
    parts = [str(p) for p in loc if p not in skipped and not str(p).startswith("type='")]
    while parts and _is_union_member(parts[-1]):
        parts.pop()
    return ".".join(parts) or None


# A file's stored name (files.filename) is at most this long.
MAX_FILENAME_CHARS = 255


def _multipart_header_too_long(exc: StarletteHTTPException) -> bool:
    """Whether Starlette's "Invalid multipart data." came from a part's header over python-multipart's limit:
    a long filename reaches it first, and the parser's own reason is lost in Starlette's message."""
    parse_error = exc.__context__
    return isinstance(parse_error, MultiPartException) and "header size" in str(parse_error.__cause__)


def new_request_id() -> str:
    return f"req_{secrets.token_hex(8)}"


def install_error_handlers(app: FastAPI, registry: CollectorRegistry) -> None:
    unexpected_errors = Counter("fusetune_http_unexpected_errors_total",
                                "Requests answered 500 because of an unexpected exception, by its type",
                                ["exception"], registry=registry)  # fmt: skip

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(
            error_body(exc.status_code, exc.message, exc.param, exc.code), status_code=exc.status_code
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        param = _param_from_loc(tuple(first.get("loc", ())))
        message = "; ".join(
            f"{_param_from_loc(tuple(e.get('loc', ()))) or 'body'}: {e.get('msg', 'invalid')}"
            for e in errors[:10]
        )
        return JSONResponse(error_body(400, message, param, "invalid_request"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if _multipart_header_too_long(exc):
            message = (
                "Invalid multipart data: a part's header is longer than the form parser's limit of "
                f"{DEFAULT_MAX_HEADER_SIZE:,} bytes. A file's name may be at most {MAX_FILENAME_CHARS} characters."
            )
            return JSONResponse(error_body(400, message, "file", "invalid_filename"), status_code=400)
        return JSONResponse(
            error_body(exc.status_code, str(exc.detail), None, None),
            status_code=exc.status_code,
            headers=exc.headers,
        )

    # Starlette runs this handler outermost, after the exception went up through every middleware (the request
    # metrics count it as a 500 there), and re-raises it once the response is sent, for the server to log too.
    @app.exception_handler(Exception)
    async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        request_id = new_request_id()
        log.error("request %s (%s %s) failed", request_id, request.method, request.url.path, exc_info=exc)
        unexpected_errors.labels(type(exc).__name__).inc()
        message = f"Internal server error (request id {request_id}); the server's log has the details."
        return JSONResponse(
            error_body(500, message, None, "internal_error"),
            status_code=500,
            headers={REQUEST_ID_HEADER: request_id},
        )
