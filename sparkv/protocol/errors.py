"""The errors of the wire contract, shared by the server and the edge.

* :class:`ProtocolError`: bytes or a document that do not follow the contract (a malformed
  manifest, a cut stream record, a frame that does not authenticate).
* :class:`ApiError`: an error answered over HTTP. The server raises it in its routes and renders it
  as the one JSON error shape; the edge's client raises the same class from such a response, so a
  caller on either side sees ``status``, ``code`` and ``message`` alike.
* :class:`ServerUnavailable`: the server cannot be reached at all (no HTTP answer).

The JSON shape of every error (docs/rest-api.md, "Errors")::

    {"error": {"status": 404, "code": "context_not_found", "message": "...", ...details}}
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict

from sparkv.errors import SparkvError


class ProtocolError(SparkvError):
    """Bytes or a document that break the wire contract."""


class ManifestError(ProtocolError):
    """A manifest is malformed, inconsistent, or does not fit this device (model, tokens)."""


class RecordError(ProtocolError):
    """A stream body that is not a sequence of ``u32 little-endian length | frame`` records (or
    whose records do not have the sizes the manifest promised)."""


class DecryptionError(ProtocolError):
    """A frame does not authenticate under the key (wrong key, wrong chunk, or tampered), or a
    key is malformed."""


class ServerUnavailable(SparkvError):
    """The server cannot be reached (connection refused, reset, timed out): no HTTP answer.

    Attributes:
        silent: the server took the request but sent nothing back in time (a read timeout): it
            may be alive and busy, where a refused or reset connection says it is down.
    """

    def __init__(self, message: str, *, silent: bool = False) -> None:
        super().__init__(message)
        self.silent = silent


class ApiError(SparkvError):
    """An error answered over HTTP.

    Attributes:
        status: the HTTP status code.
        code: a short stable identifier (``snake_case``), documented in docs/rest-api.md.
        message: what went wrong, for people.
        details: extra JSON fields placed beside ``code`` and ``message``.
        headers: extra response headers (``WWW-Authenticate`` on 401, ``Retry-After`` on 503).
    """

    def __init__(self, status: int, code: str, message: str, *,
                 headers: dict[str, str] | None = None, **details: Any) -> None:
        super().__init__(f"server error {status} {code}: {message}")
        self.status = int(status)
        self.code = code
        self.message = message
        self.details = details
        self.headers = headers or {}

    @property
    def retryable(self) -> bool:
        """5xx (and 429): the same request may succeed later or on another replica."""
        return self.status >= 500 or self.status == 429

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.code, self.message, **self.details)

    @classmethod
    def from_response(cls, status: int, body: bytes) -> "ApiError":
        """The error a response carries (its JSON error body, or the start of its text)."""
        try:
            err = json.loads(body.decode("utf-8", "replace")).get("error", {})
            details = {k: v for k, v in err.items() if k not in ("status", "code", "message")}
            return cls(status, str(err.get("code", "http_error")), str(err.get("message", "")),
                       **details)
        except (ValueError, AttributeError):
            return cls(status, "http_error", body[:200].decode("utf-8", "replace"))


def error_body(status: int, code: str, message: str, **details: Any) -> dict[str, Any]:
    """The one JSON shape of an error response."""
    return {"error": {"status": status, "code": code, "message": message, **details}}


class ErrorDetail(BaseModel):
    """``error`` of an error response (some codes add fields: docs/rest-api.md)."""

    model_config = ConfigDict(extra="allow")
    status: int
    code: str
    message: str


class ErrorResponse(BaseModel):
    """Every error response's body."""

    error: ErrorDetail
