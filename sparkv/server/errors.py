"""Errors of the server and its stores.

Every error a client can cause is an :class:`~sparkv.protocol.errors.ApiError` (the wire's shared
error, re-exported here) with an HTTP status, a stable machine code and a message for people; the
app renders all of them (and FastAPI's own validation errors) as

    {"error": {"status": 400, "code": "unknown_model", "message": "...", ...details}}

Store problems are :class:`StoreError` (a 503 when they reach a request).
"""

from __future__ import annotations

from sparkv.errors import SparkvError
from sparkv.protocol.errors import ApiError

__all__ = ["ServerError", "ConfigError", "StoreError", "ApiError"]


class ServerError(SparkvError):
    """Base class of the server's errors."""


class ConfigError(ServerError):
    """The configuration file or a command-line option is invalid."""


class StoreError(ServerError):
    """A chunk store cannot be opened, read or written."""
