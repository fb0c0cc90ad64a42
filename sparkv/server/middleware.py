"""Pure ASGI middleware of the server: metrics, gzip for JSON, API-key authentication and the
strict query check, around the plumbing both apps share (:mod:`sparkv.rest.middleware`: the
canonical path, the request body's deadline and size limit); :func:`install_middleware` adds
them in order.

Pure ASGI (no ``BaseHTTPMiddleware``) so that streamed responses pass through untouched and the
per-request cost stays a few microseconds.
"""

from __future__ import annotations

import gzip
import time
from collections import OrderedDict
from urllib.parse import parse_qsl
from typing import Callable

from sparkv.extras import SERVER_MODULES, require_all

require_all(SERVER_MODULES, feature="the REST server (sparkv.server.middleware)")

from anyio import to_thread
from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.datastructures import MutableHeaders
from starlette.routing import BaseRoute, Match, Router
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sparkv.protocol.errors import error_body
from sparkv.rest.limits import BodyLimits
from sparkv.rest.middleware import header, header_values, install_request_policy, send_json
from sparkv.rest.routing import flat_routes
from sparkv.server.config import ANONYMOUS_TENANT, Settings, hash_api_key
from sparkv.server.metrics import ServerMetrics

TENANT_SCOPE_KEY = "sparkv.tenant"
PROTECTED_PREFIX = "/v1/"


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


GZIP_LEVEL = 6
GZIP_THREAD_BYTES = 64 * 1024
"""Bodies at least this large are compressed in a worker thread, off the event loop."""
GZIP_CACHE_ENTRIES = 16
"""Compressed bodies kept per (path, strong ETag): a manifest is compressed once, not per GET."""
GZIP_MEDIA_TYPES = ("application/json",)
"""What :class:`GZipMiddleware` compresses (also ``*+json``); nothing else, frames above all."""


def accepts_gzip(accept_encoding: str | None) -> bool:
    """Whether an ``Accept-Encoding`` header allows gzip (RFC 9110 12.5.3).

    ``gzip`` (or ``x-gzip``) with a non-zero ``q`` allows it, ``gzip;q=0`` refuses it, and ``*``
    stands for every coding the header does not name. No header: no compression.
    """
    if not accept_encoding:
        return False
    star: bool | None = None
    for item in accept_encoding.split(","):
        coding, *params = (part.strip() for part in item.split(";"))
        q = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0  # a malformed weight counts as a refusal
        coding = coding.lower()
        if coding in ("gzip", "x-gzip"):
            return q > 0
        if coding == "*":
            star = q > 0
    return bool(star)


def _compressible(start: Message) -> bool:
    """A response start whose body :class:`GZipMiddleware` may compress: JSON, not already
    encoded, and a status with a whole body (no 204, 206 or 304)."""
    if start["status"] in (204, 206, 304) or start["status"] < 200:
        return False
    headers = MutableHeaders(raw=list(start["headers"]))
    if "content-encoding" in headers:
        return False
    media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
    return media in GZIP_MEDIA_TYPES or media.endswith("+json")


def _add_vary(headers: MutableHeaders, value: str) -> None:
    present = [v.strip().lower() for line in headers.getlist("vary") for v in line.split(",")
               if v.strip()]
    if value.lower() not in present and "*" not in present:
        headers.add_vary_header(value)


class GZipMiddleware:
    """Gzip-compresses JSON responses of at least ``minimum_size`` bytes for clients whose
    ``Accept-Encoding`` allows it.

    Only ``application/json`` (and ``*+json``) bodies sent in one message are candidates, which is
    how every JSON response of the app is sent; everything else (frames, the frame stream with its
    exact ``Content-Length``, token ids, ``/metrics``) passes through untouched, message by
    message, so streaming is unaffected. A candidate gets ``Vary: Accept-Encoding`` whether or not
    this client accepts gzip (caches must key on it). A compressed response gets
    ``Content-Encoding: gzip``, its new ``Content-Length``, and its ``ETag`` weakened
    (``"x"`` -> ``W/"x"``): a strong tag names one exact byte sequence, and the compressed body is
    another one. ``If-None-Match`` compares weakly, so either form of the tag still gets a 304.
    Compression is deterministic (``mtime`` 0) and runs in a worker thread for large bodies
    (a manifest of an 8K-token context is megabytes: tens of milliseconds); the compressed bodies
    of the last few responses with a strong ETag (the manifests) are kept, keyed by path and ETag
    (a content hash), so revisiting one costs nothing.
    """

    def __init__(self, app: ASGIApp, minimum_size: int = 1024, level: int = GZIP_LEVEL,
                 cache_entries: int = GZIP_CACHE_ENTRIES) -> None:
        self.app = app
        self.minimum_size = minimum_size
        self.level = level
        self.cache_entries = cache_entries
        self._cache: OrderedDict[tuple[str, str], tuple[int, bytes]] = OrderedDict()

    def _gzip(self, body: bytes) -> bytes:
        return gzip.compress(body, compresslevel=self.level, mtime=0)

    async def _compress(self, body: bytes, key: tuple[str, str] | None) -> bytes:
        """``body`` gzip-compressed; ``key`` (path, strong ETag) names these exact bytes (a strong
        ETag means byte-for-byte identical), so a cached result is reused."""
        if key is not None:
            hit = self._cache.get(key)
            if hit is not None and hit[0] == len(body):
                self._cache.move_to_end(key)
                return hit[1]
        if len(body) >= GZIP_THREAD_BYTES:
            out = await to_thread.run_sync(self._gzip, body)
        else:
            out = self._gzip(body)
        if key is not None and self.cache_entries > 0:
            self._cache[key] = (len(body), out)
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_entries:
                self._cache.popitem(last=False)
        return out

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.minimum_size <= 0:
            await self.app(scope, receive, send)
            return
        accepts = accepts_gzip(header(scope, b"accept-encoding"))
        held: Message | None = None
        passthrough = False

        async def gzip_send(message: Message) -> None:
            nonlocal held, passthrough
            if passthrough:
                await send(message)
                return
            if message["type"] == "http.response.start":
                if _compressible(message):
                    held = message  # decided with the first body message
                else:
                    passthrough = True
                    await send(message)
                return
            if message["type"] != "http.response.body" or held is None:
                await send(message)  # pragma: no cover - nothing else comes before the body
                return
            start, held, passthrough = held, None, True
            body = message.get("body", b"")
            if message.get("more_body", False) or len(body) < self.minimum_size:
                await send(start)  # streamed or small: as it is
                await send(message)
                return
            headers = MutableHeaders(raw=list(start["headers"]))
            _add_vary(headers, "Accept-Encoding")
            if accepts:
                etag = headers.get("etag")
                key = (scope["path"], etag) if etag and not etag.startswith("W/") else None
                body = await self._compress(body, key)
                headers["content-encoding"] = "gzip"
                headers["content-length"] = str(len(body))
                if key is not None:
                    headers["etag"] = "W/" + key[1]
            await send({**start, "headers": headers.raw})
            await send({"type": "http.response.body", "body": body, "more_body": False})

        await self.app(scope, receive, gzip_send)


def bearer_key(authorization: str) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` value, or ``None`` unless the value is
    exactly the scheme (case-insensitive, RFC 9110 11.1), one space and a key of printable ASCII
    without spaces: ``Bearer  <key>`` (two spaces), a tab, or a key with a space in it are
    refused, never trimmed into a key."""
    scheme, sep, key = authorization.partition(" ")
    if scheme.lower() != "bearer" or not sep or not key or " " in key \
            or not (key.isascii() and key.isprintable()):
        return None
    return key


Refusal = tuple[str, str]
"""``(code, message)`` of a 401."""


def request_key(scope: Scope) -> tuple[str | None, Refusal | None]:
    """The API key a request carries (``None``: none), or why it is refused: an
    ``Authorization`` that is not exactly ``Bearer <key>`` (``invalid_api_key``), or more than
    one key (``conflicting_api_keys``: two ``Authorization`` or two ``X-API-Key`` headers, even
    equal ones, or both headers with different keys). Which of two keys counts is never
    guessed."""
    auths = header_values(scope, b"authorization")
    header_keys = header_values(scope, b"x-api-key")
    if len(auths) > 1 or len(header_keys) > 1:
        return None, ("conflicting_api_keys", "the request carries more than one "
                      "Authorization or X-API-Key header; send the key once")
    header_key = header_keys[0].strip() if header_keys else None
    if not auths:
        return header_key or None, None
    key = bearer_key(auths[0])
    if key is None:
        return None, ("invalid_api_key", "the Authorization header must be 'Bearer <api key>' "
                      "with one space and nothing else (or send the key in X-API-Key)")
    if header_key and header_key != key:
        return None, ("conflicting_api_keys", "the request carries two different API keys "
                      "(Authorization: Bearer and X-API-Key); send one")
    return key, None


class AuthMiddleware:
    """Maps the API key of every ``/v1/`` request to its tenant, or answers 401.

    The key comes from ``Authorization: Bearer <key>`` (exactly: :func:`bearer_key`) or
    ``X-API-Key: <key>``, once (:func:`request_key`: both headers only with the same key, never
    a header twice); it is hashed and looked up among the configured hashes. Without a key the
    request is refused unless anonymous access is on (then it acts as tenant ``anonymous``). The
    tenant is put in the ASGI scope for the routes (``request.scope["sparkv.tenant"]``).
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
        key, refusal = request_key(scope)
        if refusal is not None:
            await self._refuse(send, *refusal)
            return
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


def query_names(route: BaseRoute) -> frozenset[str]:
    """The query parameters a route reads (its own and its dependencies'); none for a route that
    is not a FastAPI ``APIRoute`` (the docs pages)."""
    names: set[str] = set()
    stack = [route.dependant] if isinstance(route, APIRoute) else []
    while stack:
        dependant = stack.pop()
        names.update(field.alias for field in dependant.query_params)
        stack.extend(dependant.dependencies)
    return frozenset(names)


class QueryMiddleware:
    """One strict reading of the query string, before any route sees it.

    The query is parsed once, as the routes parse it (``parse_qsl``, names percent-decoded and
    compared exactly, so case-sensitively), and refused with 400 when a name appears twice
    (``repeated_query_parameter``: which one counts would be a guess, and a cache in front may
    guess otherwise) or when the matched route does not read it (``unknown_query_parameter``,
    with the ones it reads). A request that matches no route passes on to its 404 or 405.

    State: the query names of each route, computed on first use (the routes never change after
    the app is built; the event loop is the only user, so no lock).
    """

    def __init__(self, app: ASGIApp, router: Router) -> None:
        self.app = app
        self.router = router
        self._routes: list[tuple[BaseRoute, frozenset[str]]] | None = None

    def _allowed(self, scope: Scope) -> frozenset[str] | None:
        if self._routes is None:
            self._routes = [(r, query_names(r)) for r in flat_routes(self.router.routes)]
        for route, names in self._routes:
            if route.matches(scope)[0] == Match.FULL:
                return names
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        query = scope.get("query_string", b"") if scope["type"] == "http" else b""
        if not query:
            await self.app(scope, receive, send)
            return
        seen: set[str] = set()
        allowed = self._allowed(scope)
        for name, _ in parse_qsl(query.decode("latin-1"), keep_blank_values=True):
            if name in seen:
                await send_json(send, 400, error_body(
                    400, "repeated_query_parameter", f"the query parameter {name!r} is given "
                    "more than once; give it once", parameter=name))
                return
            seen.add(name)
            if allowed is not None and name not in allowed:
                await send_json(send, 400, error_body(
                    400, "unknown_query_parameter", f"this endpoint has no query parameter "
                    f"{name!r} (names are case-sensitive); it reads: "
                    f"{', '.join(sorted(allowed)) or 'none'}", parameter=name,
                    allowed=sorted(allowed)))
                return
        await self.app(scope, receive, send)


def install_middleware(app: FastAPI, settings: Settings, metrics: ServerMetrics) -> None:
    """Adds the middleware, outermost first: metrics (which counts the bytes sent, compressed),
    gzip (JSON only), the shared request policy (the canonical path, the body deadline and size
    limit: :func:`~sparkv.rest.middleware.install_request_policy`), authentication, the query
    check."""
    app.add_middleware(QueryMiddleware, router=app.router)
    index = settings.key_index()
    app.add_middleware(AuthMiddleware, key_index=lambda: index,
                       allow_anonymous=lambda: settings.allow_anonymous, metrics=metrics)
    install_request_policy(app, BodyLimits(settings.max_body_bytes, settings.body_timeout_s),
                           on_body_timeout=metrics.body_timeouts.inc)
    app.add_middleware(GZipMiddleware,
                       minimum_size=settings.gzip_min_bytes)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
