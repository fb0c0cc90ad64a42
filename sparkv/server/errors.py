"""Errors of the server and its stores.

Every error a client can cause is an :class:`ApiError` with an HTTP status, a stable machine code
and a message for people; the app renders all of them (and FastAPI's own validation errors) as

    {"error": {"status": 400, "code": "unknown_model", "message": "...", ...details}}

Store problems are :class:`StoreError` (a 503 when they reach a request).
"""

from __future__ import annotations

from typing import Any

from sparkv.errors import SparkvError


class ServerError(SparkvError):
    """Base class of the server's errors."""


class ConfigError(ServerError):
    """The configuration file or a command-line option is invalid."""


class StoreError(ServerError):
    """A chunk store cannot be opened, read or written."""


class ApiError(ServerError):
    """An error answered to a client.

    Attributes:
        status: the HTTP status code.
        code: a short stable identifier (``snake_case``), documented in docs/rest-api.md.
        message: what went wrong, for people.
        details: extra JSON fields placed beside ``code`` and ``message``.
        headers: extra response headers (``WWW-Authenticate`` on 401).
    """

    def __init__(self, status: int, code: str, message: str, *,
                 headers: dict[str, str] | None = None, **details: Any) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.details = details
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"status": self.status, "code": self.code, "message": self.message,
                          **self.details}}
