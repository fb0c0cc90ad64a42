"""Pure ASGI middleware both apps put in front of their routes: one canonical URL per resource,
a size limit and a deadline for every request body (:func:`install_request_policy` adds them).

Pure ASGI (no ``BaseHTTPMiddleware``) so that streamed responses pass through untouched and the
per-request cost stays a few microseconds. Each refusal is the wire's one JSON error shape
(:func:`sparkv.protocol.errors.error_body`):

=====================================================  ======  ========================
what                                                   status  ``code``
=====================================================  ======  ========================
a percent-encoded path (``/v1/contexts/%61b...``,      400     ``non_canonical_path``
``...%2Fchunks``): every resource has exactly one URL
``Content-Length`` that is not a number                400     ``bad_content_length``
a body over ``max_body_bytes`` (declared or streamed)  413     ``body_too_large``
a body not complete ``body_timeout_s`` after the       408     ``body_timeout``
headers
=====================================================  ======  ========================

After a 413 or a 408 the connection is closed (``Connection: close``): the rest of the body is
never read.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from sparkv.extras import require_all

require_all(("fastapi",), feature="the HTTP apps (sparkv.rest.middleware)")

import anyio  # noqa: E402 - after the check that names the extra
from fastapi import FastAPI
from fastapi.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sparkv.protocol.errors import error_body
from sparkv.rest.limits import BodyLimits

__all__ = ["BodyLimits", "BodyLimitMiddleware", "BodyTimeoutMiddleware", "BodyTimeout",
           "BodyTooLarge", "CanonicalPathMiddleware", "install_request_policy", "send_json",
           "header", "header_values"]

CLOSE = {"Connection": "close"}
"""The header of a refusal after which the connection is closed (the rest of a body is not
read: a client cannot make the server drain gigabytes it refused)."""


async def send_json(send: Send, status: int, body: dict[str, Any],
                    headers: dict[str, str] | None = None) -> None:
    """Sends a whole JSON response."""
    data = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data, "more_body": False})


def header_values(scope: Scope, name: bytes) -> list[str]:
    """Every value of the request header ``name`` (lower case), in order."""
    return [v.decode("latin-1") for k, v in scope.get("headers", ()) if k == name]


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of the request header ``name`` (lower case), or ``None``."""
    values = header_values(scope, name)
    return values[0] if values else None


class CanonicalPathMiddleware:
    """Refuses a request whose path holds a percent-encoded byte (400 ``non_canonical_path``).

    No path of either API needs one (ids are hex, indexes decimal, names ``[a-z0-9_-]``), and
    the server decodes them before routing: ``/v1/contexts/%61...`` and ``...%2Fchunks%2F0...``
    would otherwise name the same resource as the plain spelling, a second URL (a second cache
    key) for one frame, and a way around any path rule of a proxy in front."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and b"%" in (scope.get("raw_path") or b""):
            await send_json(send, 400, error_body(
                400, "non_canonical_path", "the path is percent-encoded; every resource has "
                "exactly one URL, spelled without percent-encoding"))
            return
        await self.app(scope, receive, send)


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` when a streamed body crosses the limit (413 ``body_too_large``)."""

    code = "body_too_large"

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than the limit of {limit} bytes",
                         headers=CLOSE)
        self.limit = limit
        self.details = {"limit": limit}


class BodyTimeout(HTTPException):
    """Raised from ``receive`` when the body has not arrived within the deadline (408
    ``body_timeout``; ``Connection: close`` makes the HTTP server close the connection)."""

    code = "body_timeout"

    def __init__(self, timeout_s: float) -> None:
        super().__init__(408, f"the request body did not arrive completely within "
                              f"{timeout_s:g} s", headers=CLOSE)
        self.details = {"timeout_s": timeout_s}


class BodyTimeoutMiddleware:
    """Gives every request body a deadline: ``timeout_s`` from the moment the request's headers
    reached the app. A read of the body that would wait past it raises :class:`BodyTimeout`
    (rendered as 408 ``body_timeout``, and the connection is closed), so a client that sends a
    partial body (or none, after announcing one) cannot hold a request open. Once the body is
    complete, ``receive`` is not timed (a stream response waits on it for the disconnect).
    ``on_timeout`` is called on each refusal (the server counts them)."""

    def __init__(self, app: ASGIApp, timeout_s: float,
                 on_timeout: Callable[[], None] | None = None) -> None:
        self.app = app
        self.timeout_s = timeout_s
        self.on_timeout = on_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = anyio.current_time() + self.timeout_s
        complete = False

        async def timed_receive() -> Message:
            nonlocal complete
            if complete:
                return await receive()
            with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    complete = True
                return message
            if self.on_timeout is not None:
                self.on_timeout()
            raise BodyTimeout(self.timeout_s)

        await self.app(scope, timed_receive, send)


class BodyLimitMiddleware:
    """Refuses request bodies over ``limit`` bytes with 413: at once when ``Content-Length`` says
    so (nothing of the body is read), otherwise as soon as the streamed body crosses the limit."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = header(scope, b"content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                await send_json(send, 400, error_body(400, "bad_content_length",
                                                      "Content-Length is not a number"))
                return
            if int(declared) > self.limit:
                await send_json(send, 413, error_body(
                    413, "body_too_large", f"the request body ({int(declared)} bytes) is larger "
                    f"than the limit of {self.limit} bytes", limit=self.limit), CLOSE)
                return
        seen = 0
        limit = self.limit

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, limited_receive, send)


def install_request_policy(app: FastAPI, limits: BodyLimits,
                           on_body_timeout: Callable[[], None] | None = None) -> None:
    """Adds, outermost first: the canonical-path check, the body deadline, the body size limit.
    Each ``add_middleware`` wraps what was added before it, so an app adds its own inner
    middleware (authentication) first, then calls this, then its outer middleware."""
    app.add_middleware(BodyLimitMiddleware, limit=limits.max_body_bytes)
    app.add_middleware(BodyTimeoutMiddleware, timeout_s=limits.body_timeout_s,
                       on_timeout=on_body_timeout)
    app.add_middleware(CanonicalPathMiddleware)
