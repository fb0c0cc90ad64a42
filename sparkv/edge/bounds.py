"""What the edge accepts from a server, in bytes and in seconds (docs/edge.md, "Bounds").

A server is a peer, not a friend: every body the :class:`~sparkv.edge.client.EdgeClient` reads has
a size limit derived from what it must hold, and every request a total deadline.

* :class:`ClientLimits`: the configured bounds (the manifest's size, JSON answers, error bodies,
  the context's tokens, the request deadline), with documented defaults.
* :class:`BoundedBody`: collects one body under its limit, un-gzipping incrementally
  (``zlib.decompressobj`` with ``max_length``): a gzip bomb stops at the limit, whatever its ratio.
* :class:`DeadlineBackend`: an ``httpcore`` network backend whose every connect, read and write
  waits at most until the calling thread's deadline, so a server that drips its status line,
  headers or body one byte at a time cannot hold a request past its deadline (a per-read timeout
  never fires on a drip). :func:`deadline_transport` is the ``httpx`` transport over it.
* :class:`ResponseTooLarge`, :class:`DeadlineExceeded` and :class:`BadEncoding`: all are
  :class:`~sparkv.protocol.errors.ServerUnavailable` (the server gave no usable answer), so an ask
  falls back to local compute wherever it would for a server out of reach.
* :func:`answer_error`: the :class:`~sparkv.protocol.errors.ApiError` of an answer that is not a
  2xx: the server's error, or a redirect, which the edge never follows (it says so and where the
  redirect points). :func:`refuses_credentials`: a 401 or 403, a configuration error that an ask
  ends with, whatever the device holds (never a fallback).
* :func:`out_of_vocabulary`: token ids the model has no embedding for (the client refuses a
  server's, the session a caller's, before anything indexes an embedding table with them).
"""

from __future__ import annotations

import ssl
import threading
import time
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterable, Iterator, Sequence

import httpcore
import httpx
import numpy as np

from sparkv.protocol.errors import ApiError, ServerUnavailable

__all__ = ["ClientLimits", "BoundedBody", "DeadlineBackend", "Deadline", "DeadlineExceeded",
           "ResponseTooLarge", "BadEncoding", "deadline_transport", "tokens_limit",
           "answer_error", "refuses_credentials", "out_of_vocabulary"]

MiB = 1 << 20
#: bytes a token-id body may carry beyond its ``4 * num_tokens`` (framing slack)
TOKENS_SLACK = 4096
#: the largest piece written to a socket at once (each piece waits at most until the deadline)
WRITE_PIECE = 64 << 10


@dataclass(frozen=True)
class ClientLimits:
    """The bounds of :class:`~sparkv.edge.client.EdgeClient` (bytes, seconds).

    Attributes:
        manifest_bytes: the manifest's decoded size (16 MiB; a compressed 8K-token context at
            ``T = 256`` with five levels measured 3.5 MB, 10.1 MB at one KV head per group:
            docs/edge.md, "Bounds").
        json_bytes: any other JSON answer (health, a created context, a job): 1 MiB.
        error_bytes: the part of an error body that is read (64 KiB; the rest is not read).
        max_context_tokens: the most tokens a manifest may declare (1,048,576); the session
            also refuses more than the model's positions. The token-id body's limit is
            ``4 * num_tokens`` plus 4 KiB of slack (:func:`tokens_limit`), a frame's the
            manifest's size for it.
        deadline_s: every request's total time, connecting to the last body byte (60 s).
    """

    manifest_bytes: int = 16 * MiB
    json_bytes: int = 1 * MiB
    error_bytes: int = 64 << 10
    max_context_tokens: int = 1 << 20
    deadline_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("manifest_bytes", "json_bytes", "error_bytes", "max_context_tokens"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"ClientLimits.{name} must be positive")
        if not self.deadline_s > 0:
            raise ValueError("ClientLimits.deadline_s must be positive")


def tokens_limit(num_tokens: int) -> int:
    """The byte limit of the token-id body of a context of ``num_tokens`` tokens (``u32`` each)."""
    return 4 * int(num_tokens) + TOKENS_SLACK


class ResponseTooLarge(ServerUnavailable):
    """A response body (as sent, or un-gzipped) over its limit: reading stopped there.

    Attributes:
        limit: the limit (bytes). received: the body bytes held when reading stopped (at most
            ``limit + 1``). wire_bytes: the bytes read from the connection by then.
    """

    def __init__(self, message: str, *, limit: int, received: int, wire_bytes: int) -> None:
        super().__init__(message)
        self.limit, self.received, self.wire_bytes = int(limit), int(received), int(wire_bytes)


class DeadlineExceeded(ServerUnavailable):
    """A request did not complete (connect, send, every header and body byte) in its deadline."""


class BadEncoding(ServerUnavailable):
    """A gzip body that does not decode, or ends inside its gzip stream."""


class BoundedBody:
    """One response body, collected under ``limit`` bytes (decoded), un-gzipped incrementally.

    Wire bytes are bounded too (by the same limit plus 1 KiB: gzip never legitimately inflates
    a body that much, and a stream of empty deflate blocks must not run forever).

    State: the decoded pieces and the wire and decoded counts, of one request on one thread (no
    lock).
    """

    def __init__(self, limit: int, what: str, *, gzip: bool = False,
                 truncate: bool = False) -> None:
        self.limit, self.what, self.truncate = int(limit), what, truncate
        self._z: Any = zlib.decompressobj(wbits=31) if gzip else None
        self._parts: list[bytes] = []
        self.size = 0
        self.wire_bytes = 0
        self.full = False   # truncate: the limit was reached, the rest is not wanted

    def feed(self, piece: bytes) -> None:
        """Takes ``piece`` as read from the connection; raises :class:`ResponseTooLarge` (or,
        with ``truncate``, sets :attr:`full` and keeps the first ``limit`` bytes)."""
        self.wire_bytes += len(piece)
        if self._z is None:
            self._add(piece)
        else:
            self._inflate(piece)
        if self.wire_bytes > self.limit + 1024 and not self.full:
            if self.truncate:
                self.full = True
            else:
                self._over("the server sent more than")

    def _inflate(self, data: bytes) -> None:
        try:
            while data and not self.full:
                out = self._z.decompress(data, self.limit - self.size + 1)
                self._add(out)
                data = self._z.unconsumed_tail
                if self._z.eof:   # a gzip member ended: another may follow
                    data = self._z.unused_data + data
                    self._z = zlib.decompressobj(wbits=31) if data else self._z
        except zlib.error as e:
            raise BadEncoding(f"{self.what}: the gzip body does not decode: {e}") from None

    def _add(self, data: bytes) -> None:
        if not data:
            return
        if self.size + len(data) > self.limit:
            if not self.truncate:
                self._parts.append(data[:self.limit + 1 - self.size])
                self.size = min(self.size + len(data), self.limit + 1)
                self._over("the body un-gzips to more than" if self._z is not None
                           else "the server sent more than")
            data, self.full = data[:self.limit - self.size], True
        self._parts.append(data)
        self.size += len(data)

    def _over(self, how: str) -> None:
        raise ResponseTooLarge(f"{self.what}: {how} its {_size(self.limit)} limit; stopped "
                               "reading there", limit=self.limit,
                               received=self.size, wire_bytes=self.wire_bytes)

    def body(self) -> bytes:
        """The whole body (the response ended); raises :class:`BadEncoding` for a gzip body
        that stopped inside its stream."""
        if self._z is not None and not self._z.eof and not self.full and self.wire_bytes:
            raise BadEncoding(f"{self.what}: the gzip body ended inside its stream")
        return b"".join(self._parts)


def _size(n: int) -> str:
    return f"{n / MiB:g} MiB" if n >= MiB else f"{n} bytes"


class Deadline:
    """The end (``time.monotonic()`` seconds) of one request's time; ``binding``: the last wait
    was cut to the time left (a timeout of that wait is the deadline's)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = float(seconds)
        self.end = time.monotonic() + self.seconds
        self.binding = False

    def left(self) -> float:
        return self.end - time.monotonic()

    def expired(self) -> bool:
        return self.left() <= 0


class DeadlineBackend(httpcore.NetworkBackend):
    """``httpcore``'s blocking backend, every wait cut at the calling thread's :class:`Deadline`.

    State: the deadline of the request running on each thread (a ``threading.local``, set by
    :meth:`within`); no lock: a thread reads and writes only its own. A connection made on one
    thread and reused on another honours the deadline of the thread that reads it.
    """

    def __init__(self) -> None:
        self._sync = httpcore.SyncBackend()
        self._local = threading.local()

    @contextmanager
    def within(self, seconds: float) -> Iterator[Deadline]:
        """Every connect, read and write of this thread ends by ``seconds`` from now."""
        outer = getattr(self._local, "deadline", None)
        self._local.deadline = dl = Deadline(seconds)
        try:
            yield dl
        finally:
            self._local.deadline = outer

    def timeout(self, timeout: float | None, error: type[Exception]) -> float | None:
        """``timeout`` cut to the time left; raises ``error`` when none is."""
        dl: Deadline | None = getattr(self._local, "deadline", None)
        if dl is None:
            return timeout
        left = dl.left()
        if left <= 0:
            dl.binding = True
            raise error(f"the request's {dl.seconds:g} s deadline passed")
        dl.binding = timeout is None or left < timeout
        return left if dl.binding else timeout

    def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                    local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        stream = self._sync.connect_tcp(host, port, self.timeout(timeout, httpcore.ConnectTimeout),
                                        local_address, socket_options)
        return _DeadlineStream(stream, self)

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[Any] | None = None
                            ) -> httpcore.NetworkStream:  # pragma: no cover - no unix sockets
        stream = self._sync.connect_unix_socket(
            path, self.timeout(timeout, httpcore.ConnectTimeout), socket_options)
        return _DeadlineStream(stream, self)

    def sleep(self, seconds: float) -> None:  # pragma: no cover - httpcore's retries only
        self._sync.sleep(seconds)


class _DeadlineStream(httpcore.NetworkStream):
    """A connection whose reads and writes wait at most until the deadline (see the backend)."""

    def __init__(self, inner: httpcore.NetworkStream, backend: DeadlineBackend) -> None:
        self._inner, self._backend = inner, backend

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, self._backend.timeout(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        for i in range(0, len(buffer), WRITE_PIECE):
            self._inner.write(buffer[i:i + WRITE_PIECE],
                              self._backend.timeout(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        inner = self._inner.start_tls(ssl_context, server_hostname,
                                      self._backend.timeout(timeout, httpcore.ConnectTimeout))
        return _DeadlineStream(inner, self._backend)

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _Transport(httpx.BaseTransport):
    """``httpx`` over an ``httpcore`` pool with the :class:`DeadlineBackend` (what
    ``httpx.HTTPTransport`` does, with its errors mapped to the ``httpx`` classes of the same
    name)."""

    def __init__(self, backend: DeadlineBackend) -> None:
        self._pool = httpcore.ConnectionPool(ssl_context=tls_context(),
                                             max_connections=100, max_keepalive_connections=20,
                                             keepalive_expiry=5.0, network_backend=backend)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        req = httpcore.Request(
            method=request.method,
            url=httpcore.URL(scheme=request.url.raw_scheme, host=request.url.raw_host,
                             port=request.url.port, target=request.url.raw_path),
            headers=request.headers.raw, content=request.stream, extensions=request.extensions)
        with _httpx_errors():
            resp = self._pool.handle_request(req)
        return httpx.Response(status_code=resp.status, headers=resp.headers,
                              stream=_ResponseStream(resp.stream), extensions=resp.extensions)

    def close(self) -> None:
        self._pool.close()


class _ResponseStream(httpx.SyncByteStream):
    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __iter__(self) -> Iterator[bytes]:
        with _httpx_errors():
            yield from self._inner

    def close(self) -> None:
        if hasattr(self._inner, "close"):
            self._inner.close()


@contextmanager
def _httpx_errors() -> Iterator[None]:
    """``httpcore`` errors as the ``httpx`` errors of the same name (``TransportError`` else)."""
    try:
        yield
    except httpcore.TimeoutException as e:
        raise getattr(httpx, type(e).__name__, httpx.TimeoutException)(str(e)) from e
    except (httpcore.NetworkError, httpcore.ProtocolError, httpcore.ProxyError,
            httpcore.UnsupportedProtocol) as e:
        raise getattr(httpx, type(e).__name__, httpx.TransportError)(str(e)) from e


@lru_cache(maxsize=1)
def tls_context() -> ssl.SSLContext:
    """The default verifying TLS context, made once per process: httpx builds one per client
    (loading the CA bundle: 20-30 ms of CPU even for plain HTTP, measured in every load's link
    thread and in a device service's first ask to each server)."""
    return httpx.create_ssl_context()


def deadline_transport(backend: DeadlineBackend) -> httpx.BaseTransport:
    """The ``httpx`` transport whose connections use ``backend``."""
    return _Transport(backend)


def answer_error(status: int, body: bytes, location: str | None, what: str) -> ApiError:
    """The error of an answer to ``what`` (``"GET /v1/..."``) that is not the one expected: for a
    3xx, a ``redirect`` error naming the status and its ``Location`` (the edge never follows a
    redirect: a moved server is a configuration to fix, not a document to parse); else the
    server's own (its JSON error body)."""
    if not 300 <= status < 400:
        return ApiError.from_response(status, body)
    where = f" to {location}" if location else " (no Location)"
    return ApiError(status, "redirect",
                    f"{what} was redirected{where}; the edge does not follow redirects: give the "
                    "server's own URL (--server)", location=location)


def refuses_credentials(err: ApiError) -> bool:
    """Whether ``err`` refuses this client's credentials (401: a missing or unknown key; 403: a
    key not allowed the request): a configuration error, never a reason to fall back."""
    return err.status in (401, 403)


def out_of_vocabulary(token_ids: Sequence[int], vocab_size: int) -> str | None:
    """``None`` when every id is in ``0 .. vocab_size - 1``; else what the first one outside is
    (``"token id 49159 at position 10 is outside the model's vocabulary of 49152 ids"``)."""
    ids = np.asarray(token_ids, dtype=np.int64)
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if bad.size == 0:
        return None
    i = int(bad[0])
    more = f" (and {bad.size - 1} more)" if bad.size > 1 else ""
    return (f"token id {int(ids[i])} at position {i} is outside the model's vocabulary of "
            f"{vocab_size} ids{more}")
