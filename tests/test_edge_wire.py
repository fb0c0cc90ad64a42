"""The lean HTTP/1.1 client of the chunk stream (sparkv.edge.wire), against a real socket server
that answers each request with scripted bytes: framing, keep-alive, and broken servers."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Callable

import pytest

from sparkv.edge.wire import (HEAD_LIMIT, LINE_LIMIT, ConnectionPool, Endpoint, Preconnect,
                              WireError)

Script = Callable[[int, int], bytes]      # (connection number, request number on it) -> answer


def _chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


OK_CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + _chunked(b"ab", b"cdef")
OK_LENGTH = b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nabcdef"


class Server:
    """Answers request ``k`` of connection ``c`` with ``script(c, k)``; ``b""``: closes the
    connection without answering; ``close_after``: closes it after each answer. Records each
    request's head and body."""

    def __init__(self, script: Script, close_after: bool = False) -> None:
        self.script, self.close_after = script, close_after
        self.requests: list[tuple[bytes, bytes]] = []
        self.connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn, self.connections = self.connections, self.connections + 1
        k = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                self.requests.append((head, await reader.readexactly(length)))
                answer = self.script(conn, k)
                k += 1
                if not answer:
                    break
                writer.write(answer)
                await writer.drain()
                if self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def _with_server(script: Script, body: Callable[[ConnectionPool, Server], object],
                       close_after: bool) -> None:
    srv = Server(script, close_after)
    server = await asyncio.start_server(srv.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = ConnectionPool(Endpoint("127.0.0.1", port), connect_timeout_s=2.0, head_timeout_s=2.0)
    try:
        await asyncio.wait_for(body(pool, srv), 10.0)   # a hang fails the test, not the suite
    finally:
        await pool.aclose()
        server.close()
        await server.wait_closed()


def run(script: Script, body: Callable[[ConnectionPool, Server], object], close_after: bool = False) -> None:
    asyncio.run(_with_server(script, body, close_after))


async def _read_all(resp, piece: int = 3) -> bytes:
    out = bytearray()
    while data := await resp.read(piece):
        out += data
    return bytes(out)


@pytest.mark.parametrize("answer", [OK_CHUNKED, OK_LENGTH], ids=["chunked", "length"])
def test_a_body_is_read_whole_and_the_connection_reused(answer):
    async def body(pool, srv):
        for _ in range(3):
            resp = await pool.post("/v1/x/stream", b'{"a": 1}', {"Authorization": "Bearer k"})
            assert resp.status == 200 and await _read_all(resp) == b"abcdef"
            assert resp.complete
            await resp.aclose()
        assert srv.connections == 1 and pool.connections == 1
        head, sent = srv.requests[0]
        assert head.startswith(b"POST /v1/x/stream HTTP/1.1\r\n") and sent == b'{"a": 1}'
        assert b"Authorization: Bearer k\r\n" in head and b"Accept-Encoding: identity" in head
    run(lambda c, k: answer, body)


def test_a_body_to_the_connection_end_is_read_and_not_reused():
    answer = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nabcdef"

    async def body(pool, srv):
        for _ in range(2):
            resp = await pool.post("/", b"{}", {})
            assert await _read_all(resp, 4) == b"abcdef"
            await resp.aclose()
        assert srv.connections == 2
    run(lambda c, k: answer, body, close_after=True)


@pytest.mark.parametrize("close_after", [False, True], ids=["on-next-request", "when-idle"])
def test_an_idle_connection_the_server_closed_is_replaced(close_after):
    """The server answers one request per connection and closes it: while it is idle (the pool
    sees the end and opens a fresh one), or only when the next request comes (that request
    fails before any byte of its answer and goes once more on a fresh connection)."""
    async def body(pool, srv):
        for _ in range(3):
            resp = await pool.post("/", b"{}", {})
            assert await _read_all(resp) == b"abcdef"
            await resp.aclose()
            await asyncio.sleep(0.05)          # the server's close reaches the client
        assert srv.connections == 3 and pool.connections == 3
    run(lambda c, k: OK_LENGTH if k == 0 else b"", body, close_after)


def test_closing_a_nearly_read_body_drains_it_and_a_far_one_closes_the_connection():
    big = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + _chunked(b"x" * 100_000)

    async def body(pool, srv):
        resp = await pool.post("/", b"{}", {})
        assert await resp.read(6) == b"ab" and await resp.read(6) == b"cdef"
        await resp.aclose()                    # only the last-chunk marker is left: drained
        assert resp.complete
        resp = await pool.post("/", b"{}", {})
        await resp.read(10)
        await resp.aclose()                    # ~100 kB left: the connection is closed
        assert not resp.complete
        resp = await pool.post("/", b"{}", {})
        assert len(await _read_all(resp, 1 << 16)) == 100_000
        await resp.aclose()
        assert srv.connections == 2
    run(lambda c, k: OK_CHUNKED if (c, k) == (0, 0) else big, body)


@pytest.mark.parametrize("answer,what", [
    (b"HTTP/1.1 2x0 OK\r\nContent-Length: 0\r\n\r\n", "status line"),
    (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "header line"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n", "content-length"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", "transfer-encoding"),
    (b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 3\r\n\r\nabc", "encoded"),
    (b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 200 + b"\r\n", "header lines"),
    (b"HTTP/1.1 200 OK\r\nX: " + b"y" * HEAD_LIMIT + b"\r\n\r\n", "head over"),
    (b"HTTP/1.1 200 OK\r\nX: " + b"y" * (2 * LINE_LIMIT), "head over"),
], ids=["status", "header", "length", "te", "encoding", "many", "long-head", "endless-head"])
def test_a_malformed_head_is_a_malformed_error(answer, what):
    async def body(pool, srv):
        with pytest.raises(WireError, match=what) as err:
            await pool.post("/", b"{}", {})
        assert err.value.malformed
    run(lambda c, k: answer, body)


@pytest.mark.parametrize("chunks,what", [
    (b"zz\r\nab\r\n0\r\n\r\n", "hexadecimal"),
    (b"2\r\nabXY0\r\n\r\n", "CRLF"),
    (b"1" * 40 + b"\r\n", "digits"),
    (b"f" * (2 * LINE_LIMIT), "too long"),
], ids=["hex", "crlf", "digits", "endless-size"])
def test_malformed_chunk_framing_is_a_malformed_error(chunks, what):
    answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks

    async def body(pool, srv):
        resp = await pool.post("/", b"{}", {})
        with pytest.raises(WireError, match=what) as err:
            await _read_all(resp, 1 << 16)
        assert err.value.malformed
        await resp.aclose()
    run(lambda c, k: answer, body)


def test_a_cut_body_is_an_error_and_not_an_end():
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"

    async def body(pool, srv):
        resp = await pool.post("/", b"{}", {})
        with pytest.raises(WireError, match="cut") as err:
            await _read_all(resp)
        assert not err.value.malformed
        await resp.aclose()
    run(lambda c, k: answer, body, close_after=True)


def test_an_error_body_is_read_only_in_part():
    answer = b"HTTP/1.1 500 Oops\r\nContent-Length: 1000000\r\n\r\n" + b"e" * 1_000_000

    async def body(pool, srv):
        resp = await pool.post("/", b"{}", {})
        assert resp.status == 500
        assert await resp.read_capped(1000, 2.0) == b"e" * 1000
        await resp.aclose()
    run(lambda c, k: answer, body)


def test_a_silent_server_times_out_and_a_refused_port_fails():
    pool_timeout = ConnectionPool(Endpoint("127.0.0.1", 1), connect_timeout_s=1.0, head_timeout_s=1.0)

    async def refused():
        with pytest.raises(WireError, match="connection failed"):
            await pool_timeout.post("/", b"{}", {})

    async def silent():
        closed = asyncio.Event()

        async def silent_until_closed(reader, writer):
            try:
                await reader.read()              # the client gives up and closes
            finally:
                writer.close()
                closed.set()
        srv = await asyncio.start_server(silent_until_closed, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        pool = ConnectionPool(Endpoint("127.0.0.1", port), connect_timeout_s=1.0, head_timeout_s=0.3)
        try:
            with pytest.raises(WireError, match="no response head"):
                await pool.post("/", b"{}", {})
            await asyncio.wait_for(closed.wait(), 10)   # the client's close reached the server
        finally:
            srv.close()
            await srv.wait_closed()
    asyncio.run(refused())
    asyncio.run(silent())


def test_a_header_with_a_line_break_is_refused_before_sending():
    pool = ConnectionPool(Endpoint("127.0.0.1", 1), connect_timeout_s=1.0, head_timeout_s=1.0)
    with pytest.raises(ValueError, match="line break"):
        asyncio.run(pool.post("/", b"{}", {"X-Key": "a\r\nInjected: 1"}))


def test_endpoints_of_urls():
    import ssl

    tls = ssl.create_default_context()
    assert Endpoint.of("http://h:8080/x", lambda: tls) == Endpoint("h", 8080)
    e = Endpoint.of("https://[::1]/x", lambda: tls)
    assert (e.host, e.port, e.tls, e.host_header) == ("::1", 443, tls, "[::1]")
    assert Endpoint("h", 80).host_header == "h" and Endpoint("h", 81).host_header == "h:81"
    with pytest.raises(ValueError):
        Endpoint.of("ftp://h/x", lambda: tls)


def test_a_proxied_url_goes_through_httpx(monkeypatch):
    from sparkv.edge.http_source import HttpChunkSource, proxied

    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy",
                 "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    assert not proxied("http://10.0.0.5:8080/v1/x")
    monkeypatch.setenv("HTTP_PROXY", "http://proxy:3128")
    assert proxied("http://10.0.0.5:8080/v1/x") and not proxied("https://10.0.0.5/v1/x")
    assert HttpChunkSource("http://10.0.0.5:8080", "c" * 16).proxied
    monkeypatch.setenv("NO_PROXY", "10.0.0.5")
    assert not proxied("http://10.0.0.5:8080/v1/x")


# ---- TLS --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1: (cert file, key file)."""
    from helpers import self_signed_cert

    return tuple(str(p) for p in self_signed_cert(tmp_path_factory.mktemp("tls")))


async def _tls_server(cert, answer: bytes):
    import ssl

    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(*cert)
    srv = Server(lambda c, k: answer)
    server = await asyncio.start_server(srv.handle, "127.0.0.1", 0, ssl=ctx)
    return server, srv, server.sockets[0].getsockname()[1]


def test_a_body_over_tls_is_read_and_an_untrusted_server_refused(cert):
    """Over TLS the client verifies the server: with the certificate trusted the body is read
    and the connection reused; with the default trust store the handshake fails (an error,
    never an unverified connection)."""
    import ssl

    async def main():
        server, srv, port = await _tls_server(cert, OK_CHUNKED)
        try:
            trusted = ConnectionPool(Endpoint("127.0.0.1", port, ssl.create_default_context(cafile=cert[0])),
                           connect_timeout_s=5.0, head_timeout_s=5.0)
            for _ in range(2):
                resp = await trusted.post("/s", b"{}", {})
                assert await _read_all(resp) == b"abcdef"
                await resp.aclose()
            assert trusted.connections == 1
            await trusted.aclose()
            untrusted = ConnectionPool(Endpoint("127.0.0.1", port, ssl.create_default_context()),
                             connect_timeout_s=5.0, head_timeout_s=5.0)
            with pytest.raises(WireError, match="connection failed"):
                await untrusted.post("/s", b"{}", {})
        finally:
            server.close()
            await server.wait_closed()
    asyncio.run(asyncio.wait_for(main(), 20.0))


def test_the_chunk_source_streams_frames_over_https(cert, monkeypatch):
    """The HTTP chunk source end to end over TLS (its one verifying context, trusting the test
    certificate through ``SSL_CERT_FILE``): two frames requested, both read whole, in order."""
    from sparkv.edge import bounds, http_source
    from sparkv.edge.transport import FetchItem
    from sparkv.layout import KVChunkId
    from sparkv.protocol.stream import record_header

    frames = [b"\x01" * 70_000, b"\x02" * 10]
    body = b"".join(record_header(len(f)) + f for f in frames)
    answer = (b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body)) + body
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
                 "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SSL_CERT_FILE", cert[0])
    bounds.tls_context.cache_clear()

    async def main():
        server, srv, port = await _tls_server(cert, answer)
        source = http_source.HttpChunkSource(f"https://127.0.0.1:{port}", "c" * 16)
        try:
            items = [FetchItem(KVChunkId(t, 0, 0), "q8", len(f)) for t, f in enumerate(frames)]
            stream = await source.open(items)
            got: dict[int, bytearray] = {}
            async for piece in stream:
                got.setdefault(piece.index, bytearray()).extend(piece.data)
            await stream.aclose()
            assert [bytes(got[i]) for i in range(2)] == frames
            head, sent = srv.requests[0]
            assert head.startswith(b"POST /v1/contexts/" + b"c" * 16 + b"/stream HTTP/1.1")
        finally:
            await source.aclose()
            server.close()
            await server.wait_closed()
    try:
        asyncio.run(asyncio.wait_for(main(), 20.0))
    finally:
        bounds.tls_context.cache_clear()


# ---- a connection opened ahead (Preconnect) -----------------------------------------------------
async def _serving(handle):
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def _pool(port: int, ahead, tls=None) -> ConnectionPool:
    return ConnectionPool(Endpoint("127.0.0.1", port, tls), connect_timeout_s=2.0,
                          head_timeout_s=2.0, ahead=ahead)


@contextlib.asynccontextmanager
async def _opened_ahead(server, port: int, count: int = 2, tls=None):
    """``(Preconnect, pool adopting it)`` to ``server`` on ``port``; closes both and the server."""
    ahead = Preconnect(Endpoint("127.0.0.1", port), 2.0, count=count)
    pool = _pool(port, ahead, tls)
    try:
        yield ahead, pool
    finally:
        await pool.aclose()
        server.close()
        await server.wait_closed()


def _within_20s(main) -> None:
    asyncio.run(asyncio.wait_for(main(), 20.0))


async def _post_twice(pool: ConnectionPool) -> None:
    for _ in range(2):
        resp = await pool.post("/", b"{}", {})
        assert await _read_all(resp) == b"abcdef"
        await resp.aclose()


def test_a_connection_opened_ahead_is_adopted_by_the_first_request():
    """The first request goes over the connection a thread opened before the pool's loop
    existed; the second reuses it: one connection in all, seen by the server too."""
    async def main():
        srv = Server(lambda c, k: OK_LENGTH)
        async with _opened_ahead(*await _serving(srv.handle), count=1) as (ahead, pool):
            await _post_twice(pool)
            assert (pool.adopted, pool.connections, srv.connections) == (1, 1, 1)
            assert ahead.taken == 1 and ahead.spent
    _within_20s(main)


def test_a_connection_opened_ahead_that_the_server_closed_is_replaced():
    """The server closes the first connection at once (an idle timeout, a restart): the pool
    sees it closed and connects afresh; the request is answered, nothing adopted."""
    async def main():
        srv = Server(lambda c, k: OK_LENGTH)
        accepted: list[int] = []

        async def handle(reader, writer):
            accepted.append(1)
            if len(accepted) == 1:
                writer.close()
                return
            await srv.handle(reader, writer)
        async with _opened_ahead(*await _serving(handle), count=1) as (ahead, pool):
            while not accepted:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)                 # the close reaches the client
            await _post_twice(pool)
            assert (pool.adopted, pool.connections, len(accepted)) == (0, 1, 2)
            assert not ahead.taken
    _within_20s(main)


def test_a_connection_opened_ahead_that_fails_before_its_answer_is_retried_on_a_fresh_one():
    """Closed by the server as the request arrives (an idle timeout that won the race): as a
    reused idle connection would be, the request goes once more on a fresh connection."""
    async def main():
        srv = Server(lambda c, k: b"" if c == 0 else OK_LENGTH)
        async with _opened_ahead(*await _serving(srv.handle), count=1) as (ahead, pool):
            await _post_twice(pool)
            assert (pool.adopted, pool.connections, srv.connections) == (1, 2, 2)
            assert len(srv.requests) == 3           # the first one twice
    _within_20s(main)


def test_two_connections_opened_ahead_carry_a_request_and_the_one_opened_beside_it():
    """The link opens its next request while the first one's body is still being read: both
    go over connections opened ahead, none is opened on the loop."""
    async def main():
        srv = Server(lambda c, k: OK_LENGTH)
        async with _opened_ahead(*await _serving(srv.handle)) as (ahead, pool):
            first = await pool.post("/", b"{}", {})
            second = await pool.post("/", b"{}", {})      # the first one not read yet
            for resp in (first, second):
                assert await _read_all(resp) == b"abcdef"
                await resp.aclose()
            await _post_twice(pool)                        # the idle ones are reused
            assert (pool.adopted, pool.connections, srv.connections) == (2, 2, 2)
            assert ahead.taken == 2 and ahead.spent
    _within_20s(main)


def test_a_url_that_cannot_be_opened_ahead_opens_nothing():
    """Opening ahead never fails an ask: a malformed URL (the ask's own requests say what is
    wrong with it), another scheme, or a proxied one (httpx carries those) opens nothing."""
    from sparkv.edge.http_source import preconnect

    assert preconnect("http://[::1", 1.0) is None
    assert preconnect("ftp://127.0.0.1/x", 1.0) is None


def test_a_connection_that_could_not_open_ahead_fails_as_a_fresh_one_does():
    async def main():
        ahead = Preconnect(Endpoint("127.0.0.1", 1), 1.0)
        pool = _pool(1, ahead)
        with pytest.raises(WireError, match="connection failed"):
            await pool.post("/", b"{}", {})
        assert ahead.taken == 0 and ahead.spent and pool.connections == 0
    _within_20s(main)


@pytest.mark.parametrize("wait", [True, False], ids=["open", "still-opening"])
def test_a_connection_opened_ahead_and_never_taken_is_closed(wait):
    """Closed by its maker (the ask ended without a load, or its pool never connected): the
    server sees the connection end, whether it had opened or was still opening."""
    async def main():
        ended = asyncio.Event()

        async def handle(reader, writer):
            await reader.read()                  # the end of the stream
            ended.set()
            writer.close()
        server, port = await _serving(handle)
        ahead = Preconnect(Endpoint("127.0.0.1", port), 2.0, count=1)
        if wait:
            while not ahead._ready:
                await asyncio.sleep(0.01)
        ahead.close()
        try:
            await asyncio.wait_for(ended.wait(), 10.0)
            assert not ahead.taken
        finally:
            server.close()
            await server.wait_closed()
    asyncio.run(asyncio.wait_for(main(), 20.0))


def test_a_connection_opened_ahead_carries_tls(cert):
    """Over TLS the adopted connection's handshake runs on the pool's loop, verifying the
    server as a fresh connection does."""
    import ssl

    async def main():
        server, srv, port = await _tls_server(cert, OK_LENGTH)
        trusted = ssl.create_default_context(cafile=cert[0])
        async with _opened_ahead(server, port, count=1, tls=trusted) as (ahead, pool):
            await _post_twice(pool)
            assert (pool.adopted, pool.connections, srv.connections) == (1, 1, 1)
    _within_20s(main)


def _paced(*parts: bytes, pause_s: float = 0.2):
    """A handler that answers each request with ``parts``, ``pause_s`` apart."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                await reader.readexactly(length)
                for i, part in enumerate(parts):
                    if i:
                        await asyncio.sleep(pause_s)
                    writer.write(part)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
    return handle


def _low_water(resp) -> int:
    import socket

    sock = resp._conn.writer.get_extra_info("socket")
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)


@pytest.mark.parametrize("chunked", [False, True], ids=["length", "chunked"])
def test_a_read_waits_in_the_kernel_for_its_bytes_but_never_past_the_body(chunked):
    """``read(n, wait_for)`` has the kernel report the socket once ``wait_for`` bytes are there
    (SO_RCVLOWAT, probed while the read waits; a shaped path's packets otherwise woke the link
    thread a few at a time), never more than the body still owes (50,000 bytes here); the body
    comes whole, and the next answer's head on the same connection is read at once (a hang
    fails within 10 s)."""
    from sparkv.edge.wire import LOW_WATER_MAX

    body = bytes(range(250)) * 200                        # 50,000 bytes
    if chunked:
        answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + _chunked(body)
    else:
        answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    start = answer.index(body)                       # the head (and the chunk's size line)

    async def main():
        server, port = await _serving(_paced(answer[:start], answer[start:start + 30_000],
                                             answer[start + 30_000:]))
        pool = ConnectionPool(Endpoint("127.0.0.1", port), connect_timeout_s=2.0,
                              head_timeout_s=2.0)
        try:
            for _ in range(2):                       # the second on the same connection
                resp = await pool.post("/", b"{}", {})
                probed: list[int] = []
                # before the read's own wait ends (LOW_WATER_WAIT_S), whatever the load
                asyncio.get_running_loop().call_later(0.01, lambda: probed.append(
                    _low_water(resp)))
                got = await resp.read(LOW_WATER_MAX, LOW_WATER_MAX)
                assert probed == [len(body)]
                got += await _read_all(resp, LOW_WATER_MAX)
                assert got == body and resp.complete
                await resp.aclose()
            assert pool.connections == 1
        finally:
            await pool.aclose()
            server.close()
            await server.wait_closed()
    asyncio.run(asyncio.wait_for(main(), 10.0))


def test_a_connection_without_a_settable_low_water_reads_as_before():
    from sparkv.edge.wire import _Conn

    class Writer:
        def get_extra_info(self, name):
            return None                              # no socket (a transport without one)

    conn = _Conn(None, Writer(), 0.0)                # type: ignore[arg-type]
    conn.low_water(1000)
    conn.low_water(2000)                             # asked once, then not again
    assert conn._low_water == 0


def test_a_read_that_waits_for_its_bytes_takes_what_came_after_a_short_wait():
    """A slow link's bytes are not held back until a low water mark fills: after
    ``LOW_WATER_WAIT_S`` the read takes what is there (here 100 bytes that came 1 s before the
    rest; the link's rate samples and silence rule see them as they come)."""
    from sparkv.edge.wire import LOW_WATER_MAX

    body = b"x" * 100_000
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    start = answer.index(body)

    async def main():
        server, port = await _serving(_paced(answer[:start], answer[start:start + 100],
                                             answer[start + 100:], pause_s=1.0))
        pool = ConnectionPool(Endpoint("127.0.0.1", port), connect_timeout_s=2.0,
                              head_timeout_s=3.0)
        try:
            resp = await pool.post("/", b"{}", {})
            assert await resp.read(LOW_WATER_MAX, LOW_WATER_MAX) == b"x" * 100
            assert await _read_all(resp, LOW_WATER_MAX) == body[100:]
            await resp.aclose()
        finally:
            await pool.aclose()
            server.close()
            await server.wait_closed()
    asyncio.run(asyncio.wait_for(main(), 10.0))
