"""Pure ASGI middleware: metrics, the request body limit and API-key authentication.

Pure ASGI (no ``BaseHTTPMiddleware``) so that streamed responses pass through untouched and the
per-request cost stays a few microseconds.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

from fastapi.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sparkv.server.config import ANONYMOUS_TENANT, hash_api_key
from sparkv.server.metrics import ServerMetrics

TENANT_SCOPE_KEY = "sparkv.tenant"
PROTECTED_PREFIX = "/v1/"


async def send_json(send: Send, status: int, body: dict[str, Any],
                    headers: dict[str, str] | None = None) -> None:
    data = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data, "more_body": False})


def error_body(status: int, code: str, message: str, **details: Any) -> dict[str, Any]:
    return {"error": {"status": status, "code": code, "message": message, **details}}


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return v.decode("latin-1")
    return None


class MetricsMiddleware:
    """Counts requests, response bytes and latency per route template."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500
        nbytes = 0

        async def counting_send(message: Message) -> None:
            nonlocal status, nbytes
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                nbytes += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            route = scope.get("route")
            label = getattr(route, "path", None) or "unmatched"
            m = self.metrics
            m.requests.labels(scope["method"], label, str(status)).inc()
            m.latency.labels(scope["method"], label).observe(time.perf_counter() - start)
            m.response_bytes.labels(label).inc(nbytes)


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than the server's limit of {limit} "
                              "bytes")
        self.limit = limit


class BodyLimitMiddleware:
    """Refuses request bodies over ``limit`` bytes with 413: at once when ``Content-Length`` says
    so, otherwise as soon as the streamed body crosses the limit."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                await send_json(send, 400, error_body(400, "bad_content_length",
                                                      "Content-Length is not a number"))
                return
            if int(declared) > self.limit:
                await send_json(send, 413, error_body(
                    413, "body_too_large", f"the request body ({int(declared)} bytes) is larger "
                    f"than the server's limit of {self.limit} bytes", limit=self.limit))
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


class AuthMiddleware:
    """Maps the API key of every ``/v1/`` request to its tenant, or answers 401.

    The key comes from ``Authorization: Bearer <key>`` or ``X-API-Key: <key>``; it is hashed and
    looked up among the configured hashes. Without a key the request is refused unless anonymous
    access is on (then it acts as tenant ``anonymous``). The tenant is put in the ASGI scope for
    the routes (``request.scope["sparkv.tenant"]``).
    """

    def __init__(self, app: ASGIApp, key_index: Callable[[], dict[str, str]],
                 allow_anonymous: Callable[[], bool], metrics: ServerMetrics) -> None:
        self.app = app
        self.key_index = key_index
        self.allow_anonymous = allow_anonymous
        self.metrics = metrics

    async def _refuse(self, send: Send, code: str, message: str) -> None:
        self.metrics.auth_failures.labels(code).inc()
        await send_json(send, 401, error_body(401, code, message),
                        {"WWW-Authenticate": 'Bearer realm="sparkv"'})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED_PREFIX):
            await self.app(scope, receive, send)
            return
        key = None
        auth = _header(scope, b"authorization")
        if auth is not None:
            scheme, _, value = auth.strip().partition(" ")
            if scheme.lower() != "bearer" or not value.strip():
                await self._refuse(send, "invalid_api_key", "the Authorization header must be "
                                   "'Bearer <api key>' (or send the key in X-API-Key)")
                return
            key = value.strip()
        else:
            key = _header(scope, b"x-api-key")
        if not key:
            if self.allow_anonymous():
                scope[TENANT_SCOPE_KEY] = ANONYMOUS_TENANT
                await self.app(scope, receive, send)
                return
            await self._refuse(send, "missing_api_key", "this endpoint needs an API key: send "
                               "'Authorization: Bearer <key>' or 'X-API-Key: <key>'")
            return
        tenant = self.key_index().get(hash_api_key(key))
        if tenant is None:
            await self._refuse(send, "invalid_api_key", "the API key is not valid")
            return
        scope[TENANT_SCOPE_KEY] = tenant
        await self.app(scope, receive, send)
