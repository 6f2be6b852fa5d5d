"""What the serving engine refuses, apart from the engine: the worker's HTTP server catches it without importing
the engine (and torch with it) before its first request."""

from __future__ import annotations


class ServingError(Exception):
    """A request the engine refuses: an HTTP status and a message the user can act on."""

    def __init__(self, status_code: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status_code, self.message, self.param, self.code = status_code, message, param, code
