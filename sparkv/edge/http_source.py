"""The HTTP :class:`~sparkv.edge.transport.ChunkSource`: ``POST /v1/contexts/{id}/stream``.

Requests go over :mod:`sparkv.edge.wire`, a lean HTTP/1.1 client with a keep-alive pool per load
(the next batch's request is sent while the current one drains; its first connection may have
been opened ahead, :class:`~sparkv.edge.wire.Preconnect`): the link thread's CPU per
received chunk is what the layer steps beside it lose on a 2-core device (docs/edge.md "The
receive path"). Where the environment routes the server's URL through a proxy
(``HTTP_PROXY``/``HTTPS_PROXY``/``ALL_PROXY``, not bypassed by ``NO_PROXY``), ``httpx`` carries
the requests instead (it speaks to proxies). A response is parsed record by record with
:class:`~sparkv.protocol.stream.RecordReader`, which checks each record's length against the
manifest's size for that item (sizes the session bounds by the model:
:meth:`~sparkv.protocol.Manifest.check_geometry`); of an error response only the first 64 KiB are
read, and the link bounds a request's time (``open_timeout_s``, the stall rule). Every body byte
passes through the :class:`~sparkv.edge.shaper.LinkShaper` before it is handed on, in pieces of
about 50 ms of the emulated rate (4-64 KiB), so a slow link delivers a steady trickle rather than
rare large pieces.
"""

from __future__ import annotations

import json
import math
import time
import urllib.request
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence
from urllib.parse import urlsplit

import httpx

from sparkv.edge.bounds import answer_error, refuses_credentials, tls_context
from sparkv.edge.shaper import LinkShaper
from sparkv.edge.transport import ChunkStream, FetchItem, SourceError
from sparkv.edge.wire import ConnectionPool, Endpoint, Preconnect, Response, WireError
from sparkv.protocol.errors import RecordError
from sparkv.protocol.stream import RecordPiece, RecordReader

MIN_PIECE = 4 << 10
MAX_PIECE = 64 << 10
PIECE_SECONDS = 0.05
#: the part of an error response's body that is read (the error's JSON is far smaller)
ERROR_BYTES = 64 << 10


class HttpChunkSource:
    """Frames of context ``context_id`` from the server at ``base_url``.

    Args:
        base_url: e.g. ``http://127.0.0.1:8080``.
        context_id: the context whose chunks are fetched.
        headers: sent with every request (the API key).
        shaper: link emulation every body byte passes through (default: none).
        connect_timeout_s: connecting; read_timeout_s: the longest silence within a response.
    """

    def __init__(self, base_url: str, context_id: str, headers: dict[str, str] | None = None, *,
                 shaper: LinkShaper | None = None, connect_timeout_s: float = 3.0,
                 read_timeout_s: float = 10.0, ahead: Preconnect | None = None) -> None:
        self.url = f"{base_url.rstrip('/')}/v1/contexts/{context_id}/stream"
        self.headers = {**(headers or {}), "Accept-Encoding": "identity"}
        self.shaper = shaper or LinkShaper.unlimited()
        self.connect_timeout_s, self.read_timeout_s = connect_timeout_s, read_timeout_s
        #: whether requests go through ``httpx`` (the environment names a proxy for the URL)
        self.proxied = proxied(self.url)
        self._client: httpx.AsyncClient | None = None
        self._pool: ConnectionPool | None = None
        self._ahead = ahead           # connections opened ahead (sparkv.edge.wire.Preconnect)
        self.requests = 0
        self._head_s = math.inf       # the shortest wait of a request for its response's head

    def start(self) -> None:
        self.shaper.start()

    def rtt_s(self) -> float:
        """The emulated round trip; on a real link (no shaper) the shortest time a request of
        this source waited for its response's head (0 before the first): what the link opens
        the next request ahead by, and where a response's first rate sample starts."""
        if self.shaper.active:
            return self.shaper.rtt()
        return self._head_s if math.isfinite(self._head_s) else 0.0

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                headers=self.headers, verify=tls_context(),
                timeout=httpx.Timeout(self.read_timeout_s, connect=self.connect_timeout_s),
                limits=httpx.Limits(max_connections=4, max_keepalive_connections=4))
        return self._client

    def _wire(self) -> ConnectionPool:
        if self._pool is None:
            self._pool = ConnectionPool(Endpoint.of(self.url, tls_context),
                                        connect_timeout_s=self.connect_timeout_s,
                                        head_timeout_s=self.read_timeout_s, ahead=self._ahead)
            self._ahead = None
        return self._pool

    async def open(self, items: Sequence[FetchItem]) -> ChunkStream:
        body: dict[str, Any] = {"chunks": [
            {"t": it.cid.t, "l": it.cid.l, "g": it.cid.g, "level": it.level} for it in items]}
        not_before = self.shaper.request_started()
        self.requests += 1
        reader = RecordReader([it.nbytes for it in items])
        sent = time.perf_counter()
        stream = await (self._open_httpx(body, reader, not_before) if self.proxied
                        else self._open_wire(body, reader, not_before, sent))
        self._head_s = min(self._head_s, time.perf_counter() - sent)
        return stream

    async def _open_wire(self, body: dict[str, Any], reader: RecordReader,
                         not_before: float, sent: float) -> ChunkStream:
        try:
            resp = await self._wire().post(urlsplit(self.url).path, json.dumps(body).encode(),
                                           self.headers)
        except WireError as e:
            raise SourceError(f"request failed: {e.reason}") from e
        if resp.status != 200:
            data = await resp.read_capped(ERROR_BYTES, self.read_timeout_s)
            await resp.aclose()
            self._refuse(resp.status, data, resp.headers.get("location"))
        return _WireStream(resp, reader, self.shaper, not_before + self._handshake_s(resp, sent))

    def _handshake_s(self, resp: Response, sent: float) -> float:
        """What is left at ``sent`` of the emulated TCP handshake of ``resp``'s connection, on
        its first request (one round trip from when its connect began: a connection opened
        ahead has paid it, or part of it, before the request); 0 on a reused connection."""
        opened_at = resp.opened_at
        if not self.shaper.active or opened_at is None:
            return 0.0
        return max(0.0, opened_at + self.shaper.rtt() - sent)

    async def _open_httpx(self, body: dict[str, Any], reader: RecordReader,
                          not_before: float) -> ChunkStream:
        client = self._http()
        try:
            resp = await client.send(client.build_request("POST", self.url, json=body),
                                     stream=True)
        except (httpx.TransportError, OSError) as e:
            raise SourceError(f"request failed: {type(e).__name__}: {e}") from e
        if resp.status_code != 200:
            self._refuse(resp.status_code, await _error_body(resp),
                         resp.headers.get("location"))
        return _HttpStream(resp, reader, self.shaper, not_before)

    def _refuse(self, status: int, body: bytes, location: str | None) -> None:
        """Raises the :class:`SourceError` of an answer that is not 200."""
        err = answer_error(status, body, location, f"POST {self.url}")
        raise SourceError(str(err), fatal=not err.retryable,
                          refused=err if refuses_credentials(err) else None) from err

    async def aclose(self) -> None:
        if self._ahead is not None:   # never requested through the pool (or proxied)
            self._ahead.close()
            self._ahead = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        if self._pool is not None:
            await self._pool.aclose()
            self._pool = None


def preconnect(base_url: str, connect_timeout_s: float) -> Preconnect | None:
    """Connections to the server at ``base_url`` opened now (:class:`Preconnect`), for a
    source's ``ahead``; ``None`` where the stream goes through a proxy (``httpx`` carries it)
    or the URL is not a well-formed http(s) one (the ask's own requests say what is wrong with
    it): opening ahead never fails an ask."""
    try:
        if proxied(base_url):
            return None
        return Preconnect(Endpoint.of(base_url, tls_context), connect_timeout_s)
    except ValueError:
        return None


def proxied(url: str) -> bool:
    """Whether the environment routes ``url`` through a proxy (``*_PROXY``, not bypassed by
    ``NO_PROXY``), as ``httpx`` would."""
    proxies = urllib.request.getproxies_environment()
    scheme = urlsplit(url).scheme
    if not (proxies.get(scheme) or proxies.get("all")):
        return False
    host = urlsplit(url).netloc
    return not urllib.request.proxy_bypass(host)


async def _error_body(resp: httpx.Response, limit: int = ERROR_BYTES) -> bytes:
    """The first ``limit`` bytes of an error response's body (the rest is not read); the
    response is closed."""
    data = bytearray()
    try:
        async for raw in resp.aiter_raw():
            data += raw
            if len(data) >= limit:
                break
    except (httpx.TransportError, OSError):
        pass
    finally:
        await resp.aclose()
    return bytes(data[:limit])


def _piece_bytes(shaper: LinkShaper) -> int:
    """The bytes handed on at once: about :data:`PIECE_SECONDS` of the emulated rate."""
    rate = shaper.rate_Bps()
    if rate == float("inf"):
        return MAX_PIECE
    return int(min(MAX_PIECE, max(MIN_PIECE, rate * PIECE_SECONDS)))


class _ShapedStream:
    """A response's body handed on in pieces, each through the shaper, then parsed into
    records; a subclass reads the pieces (:meth:`_pieces`) and names its transport's errors."""

    errors: tuple[type[Exception], ...] = ()

    def __init__(self, resp: Any, reader: RecordReader, shaper: LinkShaper,
                 not_before: float) -> None:
        self.resp, self.reader, self.shaper, self.not_before = resp, reader, shaper, not_before

    def _pieces(self) -> AsyncIterator[bytes]:
        raise NotImplementedError

    async def __aiter__(self) -> AsyncIterator[RecordPiece]:
        try:
            async for piece in self._pieces():
                await self.shaper.atake(len(piece), self.not_before)
                for rec in self.reader.feed(piece):
                    yield rec
            self.reader.finish()
        except RecordError as e:
            cut = "ended" in str(e)
            raise SourceError(f"stream {'cut' if cut else 'malformed'}: {e}",
                              fatal=not cut) from e
        except self.errors as e:
            reason = e.reason if isinstance(e, WireError) else f"{type(e).__name__}: {e}"
            raise SourceError(f"stream failed: {reason}") from e

    async def aclose(self) -> None:
        await self.resp.aclose()


class _WireStream(_ShapedStream):
    """A response read over :mod:`sparkv.edge.wire`: a piece per read."""

    errors = (WireError,)
    resp: Response

    async def _pieces(self) -> AsyncIterator[bytes]:
        # a read wakes once a piece's bytes are there, or the current frame's last ones (so
        # that a frame is handed on as soon as it is whole): a few wake-ups a frame instead of
        # one per few packets of a shaped path
        read: Callable[[int, int], Awaitable[bytes]] = self.resp.read
        while piece := await read(_piece_bytes(self.shaper), self.reader.due()):
            yield piece


class _HttpStream(_ShapedStream):
    """A response read through ``httpx`` (a proxied link): its reads cut into pieces."""

    errors = (httpx.TransportError, OSError)
    resp: httpx.Response

    async def _pieces(self) -> AsyncIterator[bytes]:
        async for raw in self.resp.aiter_raw():
            pos = 0
            while pos < len(raw):
                piece = raw[pos:pos + _piece_bytes(self.shaper)]
                pos += len(piece)
                yield piece
