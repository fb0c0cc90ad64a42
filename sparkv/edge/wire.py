"""A lean HTTP/1.1 client for the chunk stream: one POST, a streamed body, keep-alive.

The link thread reads every streamed chunk through this client (:mod:`sparkv.edge.http_source`).
On a 2-core device the link's own CPU slows the layer steps beside it about twice its time (the
steps' OpenMP team waits at every barrier for the core the link thread took:
``bench/contention.py``); through ``httpx`` (httpcore, anyio, h11) a received q8 chunk cost the
link thread ~1.0 ms, about half of it in those layers. Here a body read is one
``asyncio.StreamReader.read`` of what is buffered, and the HTTP framing (``Content-Length``,
``Transfer-Encoding: chunked`` or to the connection's end) is parsed in place.

Scope: ``http://`` and ``https://`` (the process's verifying TLS context), no proxies (the
chunk source keeps ``httpx`` where the environment names one), no redirects (the caller reports
a 3xx), no compression (the request asks for ``identity``; a compressed answer is refused).

Bounds (a hostile or broken server): a response head of at most :data:`HEAD_LIMIT` bytes and
:data:`MAX_HEADERS` lines, a chunk-size line within :data:`LINE_LIMIT`; a malformed head or
chunk framing is a :class:`WireError`; reads carry the caller's timeouts. A connection is reused
only after its response was read to the end; a reused (or opened-ahead) connection that fails
before any byte of the answer (the server closed it while idle) is retried once on a fresh one.

Connections opened ahead (:class:`Preconnect`: by plain threads, while the ask fetches its
manifest and plans, before the load's event loop exists) are adopted by the pool's next connects:
the load's first requests pay no TCP handshake (one round trip each; TLS's own handshake still
runs on the loop). One the server closed meanwhile is dropped for a fresh connection.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, TypeVar
from urllib.parse import urlsplit

T = TypeVar("T")

#: the most header lines a response may have
MAX_HEADERS = 100
#: the most bytes a response's head (status line and headers) may take
HEAD_LIMIT = 64 << 10
#: the stream reader's buffer limit: the most bytes a chunk-size line, or a head before it is
#: refused, may take; the transport reads ahead up to twice this (fewer, larger socket reads:
#: the link thread's CPU per chunk 0.70 -> 0.65 ms against a 64 KiB limit, session 72)
LINE_LIMIT = 1 << 20
#: idle connections kept per pool
MAX_IDLE = 4
#: the most bytes a body read asks the kernel to gather before it reports the socket readable
#: (``SO_RCVLOWAT``): over a shaped path the bytes come a few packets at a time, and each
#: report cost the link thread a read, a ``data_received`` and a waiter's wake-up
LOW_WATER_MAX = 64 << 10
#: the longest a read waits for its low water: then it takes what is there (a slow link's bytes
#: stay visible to the link's rate samples and silence rules as they come)
LOW_WATER_WAIT_S = 0.05
#: how long closing a response may wait for the rest of a body it has nearly read
DRAIN_S = 0.05


class WireError(Exception):
    """A request failed on the wire: refused, reset or cut, or a malformed answer (``malformed``:
    the server broke HTTP's framing; ``stale``: a reused idle connection failed before any byte
    of the answer, as one the server closed while idle does)."""

    def __init__(self, reason: str, malformed: bool = False, stale: bool = False) -> None:
        super().__init__(reason)
        self.reason, self.malformed, self.stale = reason, malformed, stale


async def within(aw: Awaitable[T], seconds: float) -> T:
    """``await aw`` with a timeout (``asyncio.TimeoutError``), without a task per call on
    3.11+."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(seconds):
            return await aw
    return await asyncio.wait_for(aw, seconds)  # pragma: no cover - Python 3.10


@dataclass(frozen=True)
class Endpoint:
    """Where a pool connects: ``host:port``, over TLS when ``tls`` is set."""

    host: str
    port: int
    tls: ssl.SSLContext | None = None

    @classmethod
    def of(cls, url: str, tls: Callable[[], ssl.SSLContext]) -> "Endpoint":
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        secure = parts.scheme == "https"
        return cls(parts.hostname, parts.port or (443 if secure else 80),
                   tls() if secure else None)

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.tls is not None else 80
        return host if self.port == default else f"{host}:{self.port}"


class Preconnect:
    """TCP connections to ``endpoint`` opened ahead, each by a thread of its own: the pool that
    will use them lives on an event loop that does not exist yet. A pool given them adopts one
    at each new connection it needs, while any is left (:meth:`take`); whoever made them closes
    those no pool took (:meth:`close`, idempotent). Two by default: a load's first request, and
    the next one it opens while the first drains (``sparkv.edge.link``), which would otherwise
    pay a handshake of its own."""

    def __init__(self, endpoint: Endpoint, timeout_s: float, count: int = 2) -> None:
        self.endpoint = endpoint
        self.started_at = time.perf_counter()    # when the connects began
        self._lock = threading.Lock()
        self._ready: list[socket.socket] = []
        self._pending = count              # connects not finished
        self._over = False                 # closed: a late connection is closed
        self.taken = 0                     # connections pools adopted
        for _ in range(count):
            try:
                threading.Thread(target=self._open, args=(timeout_s,), name="sparkv-preconnect",
                                 daemon=True).start()
            except RuntimeError:           # no thread to be had: one connection fewer
                with self._lock:
                    self._pending -= 1

    def _open(self, timeout_s: float) -> None:
        try:
            sock: socket.socket | None = socket.create_connection(
                (self.endpoint.host, self.endpoint.port), timeout=timeout_s)
        except OSError:
            sock = None
        with self._lock:
            self._pending -= 1
            keep = sock is not None and not self._over
            if keep:
                assert sock is not None
                self._ready.append(sock)
        if sock is not None and not keep:
            sock.close()

    async def take(self, timeout_s: float) -> socket.socket | None:
        """On the pool's loop: a connection, once one is open (polled for at most
        ``timeout_s``) and the server has not closed it; ``None`` when none is left (or none
        opened in time, or the one that did was closed)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            with self._lock:
                sock = self._ready.pop(0) if self._ready else None
                left = not self._over and self._pending > 0
            if sock is not None or not left or loop.time() >= deadline:
                break
            await asyncio.sleep(POLL_S)
        if sock is not None and not _still_open(sock):
            sock.close()
            return None
        if sock is not None:
            self.taken += 1
        return sock

    @property
    def spent(self) -> bool:
        """Whether no connection is left to take."""
        with self._lock:
            return self._over or (not self._ready and self._pending == 0)

    def close(self) -> None:
        with self._lock:
            socks, self._ready, self._over = self._ready, [], True
        for sock in socks:
            sock.close()


#: how often a pool looks whether a connection opened ahead is open yet
POLL_S = 0.005


def _still_open(sock: socket.socket) -> bool:
    """Whether an idle connection is open: nothing to read yet (a server says nothing before
    a request; an end of stream or an error means it closed)."""
    try:
        sock.setblocking(False)
        sock.recv(1, socket.MSG_PEEK)     # returned: an end of stream, or bytes unasked for
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


class _Conn:
    """One TCP (or TLS) connection; ``opened_at``: when its connect began (``perf_counter``)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 opened_at: float) -> None:
        self.reader, self.writer = reader, writer
        self.opened_at = opened_at
        self.reused = False           # taken from the pool's idle ones
        self.adopted = False          # opened ahead (Preconnect), idle until its first request
        self._low_water = 1           # the socket's SO_RCVLOWAT (0: not settable here)

    def low_water(self, n: int) -> int:
        """Has the kernel report the socket readable once ``n`` bytes (1 to
        :data:`LOW_WATER_MAX`) are queued, or at its end or an error (``SO_RCVLOWAT``; Linux
        reports it at once when what is queued already meets a lowered mark). A caller never
        asks for more than is due, or the last bytes would wait for a timeout, and lowers it
        again after :data:`LOW_WATER_WAIT_S` (:meth:`Response._gathered`). Nothing where the
        option cannot be set. Returns the mark now in effect (0: none can be set)."""
        n = max(1, min(int(n), LOW_WATER_MAX))
        if n == self._low_water or not self._low_water:
            return self._low_water
        sock = self.writer.get_extra_info("socket")
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, n)
        except (AttributeError, OSError):     # no socket, no such option, refused: as before
            self._low_water = 0
            return 0
        self._low_water = n
        return n

    def usable(self) -> bool:
        return not (self.writer.is_closing() or self.reader.at_eof())

    def close(self) -> None:
        try:
            self.writer.close()
        except Exception:  # noqa: BLE001 - closing a broken connection
            pass


@dataclass
class Response:
    """A response whose head was read; its body is read with :meth:`read` (``b""`` at its end).

    Attributes:
        status: the status code.
        headers: the headers, names lowercased (the last of a repeated name).
    """

    status: int
    headers: dict[str, str]
    _conn: _Conn = field(repr=False)
    _pool: "ConnectionPool" = field(repr=False)
    _length: int | None = field(default=None, repr=False)   # bytes left; None: chunked or EOF
    _chunked: bool = field(default=False, repr=False)
    _chunk_left: int = field(default=0, repr=False)
    _keep: bool = field(default=True, repr=False)
    _done: bool = field(default=False, repr=False)
    _closed: bool = field(default=False, repr=False)

    @property
    def complete(self) -> bool:
        """Whether the body was read to its end."""
        return self._done

    @property
    def opened_at(self) -> float | None:
        """When the connection of this response began to connect (``perf_counter``), if this
        is its first request; ``None`` on a reused connection."""
        return None if self._conn.reused else self._conn.opened_at

    async def read(self, max_bytes: int, wait_for: int | None = None) -> bytes:
        """Up to ``max_bytes`` of the body (at least one unless it ended: then ``b""``).
        ``wait_for``: when nothing is buffered, wake for the socket once that many bytes (at
        most ``max_bytes``; default ``max_bytes``) are there, or all that is still due of the
        body (:meth:`_Conn.low_water`)."""
        if self._done:
            return b""
        want = max_bytes if wait_for is None else min(wait_for, max_bytes)
        try:
            if self._chunked:
                return await self._read_chunked(max_bytes, want)
            return await self._read_plain(max_bytes, want)
        except (ConnectionError, OSError, asyncio.IncompleteReadError, ssl.SSLError) as e:
            self._keep = False
            raise WireError(f"the body was cut: {type(e).__name__}: {e}") from e
        except asyncio.LimitOverrunError as e:
            self._keep = False
            raise WireError("a chunk-size line too long", malformed=True) from e

    async def _gathered(self, max_bytes: int, want: int) -> bytes:
        """``reader.read(max_bytes)`` woken once ``want`` bytes are there
        (:meth:`_Conn.low_water`), or after :data:`LOW_WATER_WAIT_S` with what is there."""
        conn = self._conn
        if conn.low_water(want) <= 1:
            return await conn.reader.read(max_bytes)
        timer = asyncio.get_running_loop().call_later(LOW_WATER_WAIT_S, conn.low_water, 1)
        try:
            return await conn.reader.read(max_bytes)
        finally:
            timer.cancel()

    async def _read_plain(self, max_bytes: int, want: int) -> bytes:
        reader = self._conn.reader
        if self._length is None:                       # to the connection's end
            self._conn.low_water(1)
            data = await reader.read(max_bytes)
            if not data:
                self._done, self._keep = True, False
            return data
        data = await self._gathered(min(max_bytes, self._length), min(want, self._length))
        if not data:
            raise asyncio.IncompleteReadError(b"", self._length)
        self._length -= len(data)
        if self._length == 0:
            self._done = True
        return data

    async def _read_chunked(self, max_bytes: int, want: int) -> bytes:
        reader = self._conn.reader
        if self._chunk_left == 0:
            self._conn.low_water(1)                    # a size line, trailers: a few bytes
            size = await self._chunk_size()
            if size == 0:
                await self._trailers()
                self._done = True
                return b""
            self._chunk_left = size
        data = await self._gathered(min(max_bytes, self._chunk_left),
                                    min(want, self._chunk_left))
        if not data:
            raise asyncio.IncompleteReadError(b"", self._chunk_left)
        self._chunk_left -= len(data)
        if self._chunk_left == 0:
            self._conn.low_water(1)
            if await reader.readexactly(2) != b"\r\n":
                raise self._malformed("a chunk not ended by CRLF")
        return data

    async def _chunk_size(self) -> int:
        line = await self._conn.reader.readuntil(b"\r\n")
        text = line[:-2].split(b";", 1)[0].strip()
        if not text or len(text) > 16:
            raise self._malformed(f"a chunk size of {len(text)} digits")
        try:
            return int(text, 16)
        except ValueError:
            raise self._malformed("a chunk size that is not hexadecimal") from None

    async def _trailers(self) -> None:
        for _ in range(MAX_HEADERS + 1):
            if await self._conn.reader.readuntil(b"\r\n") == b"\r\n":
                return
        raise self._malformed(f"more than {MAX_HEADERS} trailer lines")

    def _malformed(self, what: str) -> WireError:
        self._keep = False
        return WireError(f"malformed response: {what}", malformed=True)

    async def read_capped(self, limit: int, timeout_s: float) -> bytes:
        """The body's first ``limit`` bytes (the rest is not read), each read within
        ``timeout_s``; a failure ends the body where it stands."""
        out = bytearray()
        try:
            while len(out) < limit:
                data = await within(self.read(limit - len(out)), timeout_s)
                if not data:
                    break
                out += data
        except (WireError, asyncio.TimeoutError):
            pass
        return bytes(out[:limit])

    async def aclose(self) -> None:
        """Ends the response: its connection goes back to the pool when the body was read to
        its end, or its rest (a chunked body's last-chunk marker) is already on its way within
        :data:`DRAIN_S`; else the connection is closed."""
        if self._closed:
            return
        self._closed = True
        if not self._done and self._keep:
            try:
                await within(self._drain(), DRAIN_S)
            except (WireError, asyncio.TimeoutError):
                self._keep = False
        self._pool.release(self._conn, self._done and self._keep)

    async def _drain(self, limit: int = 256) -> None:
        """Reads the rest of a body known to be short (at most ``limit`` bytes left)."""
        left = self._chunk_left if self._chunked else (self._length or 0)
        if left > limit or (not self._chunked and self._length is None):
            raise WireError("too much of the body left")
        while not self._done:
            if not await self.read(limit):
                return


class ConnectionPool:
    """Connections to one :class:`Endpoint`: POSTs with a streamed answer, idle connections
    kept for the next request (at most :data:`MAX_IDLE`)."""

    def __init__(self, endpoint: Endpoint, *, connect_timeout_s: float,
                 head_timeout_s: float, ahead: Preconnect | None = None) -> None:
        self.endpoint = endpoint
        self.connect_timeout_s, self.head_timeout_s = connect_timeout_s, head_timeout_s
        self._idle: list[_Conn] = []
        self._ahead = ahead           # connections opened ahead, adopted by the next connects
        self.connections = 0          # opened so far (adopted ones included)
        self.adopted = 0              # of those, opened ahead

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> Response:
        """Sends ``POST path`` with ``body``; returns the response once its head is read."""
        request = self._request(path, body, headers)
        conn = self._take_idle() or await self._connect()
        try:
            return await self._exchange(conn, request)
        except WireError as e:
            if not e.stale:
                raise
        # the server closed the idle (or opened-ahead) connection: once more on a fresh one
        return await self._exchange(await self._fresh(), request)

    def _request(self, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        lines = [f"POST {path} HTTP/1.1", f"Host: {self.endpoint.host_header}",
                 "Content-Type: application/json", f"Content-Length: {len(body)}",
                 "Accept-Encoding: identity", "User-Agent: sparkv-edge"]
        for name, value in headers.items():
            if name.lower() in ("host", "content-length", "content-type", "accept-encoding"):
                continue
            if any(c in name + value for c in "\r\n\0"):
                raise ValueError(f"header {name!r} has a line break in it")
            lines.append(f"{name}: {value}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body

    def _take_idle(self) -> _Conn | None:
        while self._idle:
            conn = self._idle.pop()
            if conn.usable():
                conn.reused = True
                return conn
            conn.close()
        return None

    async def _connect(self) -> _Conn:
        ahead = self._ahead
        sock = await ahead.take(self.connect_timeout_s) if ahead is not None else None
        if ahead is not None and (sock is None or ahead.spent):
            ahead.close()
            self._ahead = None
        if sock is not None:
            assert ahead is not None
            try:
                conn = await self._open(ahead.started_at, sock=sock)
            except WireError:
                sock.close()      # e.g. TLS refused on it: a fresh connection says so again
            else:
                conn.adopted = True
                self.adopted += 1
                return conn
        return await self._fresh()

    async def _fresh(self) -> _Conn:
        ep = self.endpoint
        return await self._open(time.perf_counter(), host=ep.host, port=ep.port)

    async def _open(self, opened_at: float, **where: object) -> _Conn:
        """A connection: to ``host`` and ``port``, or over a connected ``sock`` (whose connect
        began at ``opened_at``)."""
        ep = self.endpoint
        try:
            reader, writer = await within(asyncio.open_connection(
                **where, ssl=ep.tls, limit=LINE_LIMIT,      # type: ignore[arg-type]
                server_hostname=ep.host if ep.tls is not None else None),
                self.connect_timeout_s)
        except asyncio.TimeoutError as e:
            raise WireError(f"no connection within {self.connect_timeout_s:g} s") from e
        except (OSError, ssl.SSLError) as e:
            raise WireError(f"connection failed: {type(e).__name__}: {e}") from e
        self.connections += 1
        return _Conn(reader, writer, opened_at)

    async def _exchange(self, conn: _Conn, request: bytes) -> Response:
        try:
            conn.low_water(1)                          # a head of unknown length
            conn.writer.write(request)
            await conn.writer.drain()
            head = await within(conn.reader.readuntil(b"\r\n\r\n"), self.head_timeout_s)
        except asyncio.TimeoutError as e:
            conn.close()
            raise WireError(f"no response head within {self.head_timeout_s:g} s") from e
        except asyncio.LimitOverrunError as e:
            conn.close()
            raise WireError(f"a response head over {HEAD_LIMIT} bytes", malformed=True) from e
        except (ConnectionError, OSError, asyncio.IncompleteReadError, ssl.SSLError) as e:
            conn.close()
            stale = (conn.reused or conn.adopted) and not getattr(e, "partial", b"")
            raise WireError(f"request failed: {type(e).__name__}: {e}", stale=stale) from e
        try:
            return self._response(conn, head)
        except WireError:
            conn.close()
            raise

    def _response(self, conn: _Conn, head: bytes) -> Response:
        if len(head) > HEAD_LIMIT:
            raise WireError(f"a response head over {HEAD_LIMIT} bytes", malformed=True)
        lines = head[:-4].decode("latin-1").split("\r\n")
        version, status = _status_line(lines[0])
        if len(lines) - 1 > MAX_HEADERS:
            raise WireError(f"more than {MAX_HEADERS} header lines", malformed=True)
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip():
                raise WireError(f"a malformed header line {line[:40]!r}", malformed=True)
            headers[name.lower()] = value.strip()
        resp = Response(status, headers, conn, self)
        _framing(resp, version)
        return resp

    def release(self, conn: _Conn, reusable: bool) -> None:
        if reusable and conn.usable() and len(self._idle) < MAX_IDLE:
            self._idle.append(conn)
        else:
            conn.close()

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
        if self._ahead is not None:
            self._ahead.close()
            self._ahead = None


def _status_line(line: str) -> tuple[str, int]:
    parts = line.split(" ", 2)
    if len(parts) < 2 or parts[0] not in ("HTTP/1.1", "HTTP/1.0") or not (
            len(parts[1]) == 3 and parts[1].isdigit()):
        raise WireError(f"a malformed status line {line[:40]!r}", malformed=True)
    return parts[0], int(parts[1])


def _framing(resp: Response, version: str) -> None:
    """Sets how ``resp``'s body ends (chunked, a length, or the connection's end) and whether
    its connection may be reused."""
    h = resp.headers
    token = h.get("connection", "").lower()
    resp._keep = "close" not in token and (version == "HTTP/1.1" or "keep-alive" in token)
    if h.get("content-encoding", "identity").lower() not in ("identity", ""):
        raise WireError(f"a {h['content-encoding']!r}-encoded body (identity was asked)",
                        malformed=True)
    te = h.get("transfer-encoding", "").lower()
    if te:
        if te.rsplit(",", 1)[-1].strip() != "chunked":
            raise WireError(f"transfer-encoding {te!r}", malformed=True)
        resp._chunked = True
        return
    if "content-length" in h:
        value = h["content-length"]
        if not value.isdigit() or len(value) > 18:
            raise WireError(f"content-length {value[:20]!r}", malformed=True)
        resp._length = int(value)
        resp._done = resp._length == 0
        return
    resp._keep = False                                  # the body ends with the connection
