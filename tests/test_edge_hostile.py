"""The edge against a hostile server: every body a server sends is bounded (in bytes, by what it
must hold) and every request ends by its deadline; a crafted manifest is a clear error.

A real server on a real loopback socket (a thread serving raw, crafted HTTP answers), the real
``EdgeClient`` / ``EdgeSession``, short configured caps and deadlines. Memory is measured as the
bytes the client read (its own count, and what the server managed to send), never wall clock
beyond generous bounds."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import socketserver
import struct
import threading
import time
import zlib
from collections import Counter
from typing import Callable

import pytest

from sparkv.edge import ApiError, AskError, EdgeClient, EdgeSession, HttpChunkSource, SourceError
from sparkv.edge.bounds import (BadEncoding, BoundedBody, ClientLimits, DeadlineExceeded,
                                ResponseTooLarge)
from sparkv.edge.transport import FetchItem
from sparkv.layout import ChunkGeometry, KVChunkId
from sparkv.protocol import Manifest, ManifestError
from sparkv.protocol.digests import tokens_bytes, tokens_digest
from sparkv.protocol.manifest import max_frame_bytes

CID = "ab" * 16
CAP = 256 << 10               # the manifest cap of these tests
ENDLESS = 40 << 20            # what an "endless" answer sends at most (an unfixed edge ends too)
KERNEL_SLACK = 16 << 20       # socket buffers between the server's sends and the client's reads
PIECE_SLACK = 64 << 10        # one read of the client beyond its cap
QUESTION = "What is this about?"


# ---- the hostile server ----------------------------------------------------------------------
class _Out:
    """The connection of one answer: counts what the server managed to send."""

    def __init__(self, sock: socket.socket, server: "Hostile", path: str) -> None:
        self.sock, self.server, self.path = sock, server, path

    def send(self, data: bytes) -> bool:
        """Sends ``data``; ``False`` once the client is gone or the server stops."""
        if self.server.stop.is_set():
            return False
        try:
            self.sock.sendall(data)
        except OSError:
            return False
        self.server.sent[self.path] += len(data)
        return True


Behaviour = Callable[[_Out], bool]   # returns whether the connection may serve another request


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        server: Hostile = self.server.hostile  # type: ignore[attr-defined]
        buf = b""
        while not server.stop.is_set():
            while b"\r\n\r\n" not in buf:
                try:
                    data = sock.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                buf += data
            head, _, buf = buf.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, target = lines[0].split(" ")[:2]
            length = next((int(x.split(":", 1)[1]) for x in lines[1:]
                           if x.lower().startswith("content-length:")), 0)
            while len(buf) < length:
                buf += sock.recv(65536)
            buf = buf[length:]
            path = target.split("?", 1)[0]
            server.hits[path] += 1
            behaviour = server.routes.get(path, not_found)
            if not behaviour(_Out(sock, server, path)):
                return


class Hostile:
    """A loopback HTTP server whose answers are the ``routes`` (path -> behaviour)."""

    def __init__(self) -> None:
        self.routes: dict[str, Behaviour] = {}
        self.sent: Counter[str] = Counter()
        self.hits: Counter[str] = Counter()
        self.stop = threading.Event()
        self._srv = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Handler)
        self._srv.daemon_threads = True
        self._srv.hostile = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self._srv.server_address[1]}"
        threading.Thread(target=self._srv.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self._srv.shutdown()
        self._srv.server_close()


def _head(status: int = 200, headers: dict[str, str] | None = None) -> bytes:
    lines = [f"HTTP/1.1 {status} X"] + [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def answer(body: bytes, status: int = 200, **headers: str) -> Behaviour:
    def run(out: _Out) -> bool:
        return out.send(_head(status, {"Content-Length": str(len(body)), **headers}) + body)
    return run


def not_found(out: _Out) -> bool:
    body = b'{"error": {"status": 404, "code": "context_not_found", "message": "no"}}'
    return answer(body, 404)(out)


def endless(piece: bytes, status: int = 200, prefix: bytes = b"", **headers: str) -> Behaviour:
    """A body without a length that never ends (until ENDLESS bytes or the client leaves)."""
    def run(out: _Out) -> bool:
        if not out.send(_head(status, {"Connection": "close", **headers}) + prefix):
            return False
        while out.server.sent[out.path] < ENDLESS and out.send(piece):
            pass
        return False
    return run


def drip(prefix: bytes, byte: bytes, period_s: float = 0.2, for_s: float = 120.0) -> Behaviour:
    """``prefix``, then one byte every ``period_s`` (for ``for_s`` seconds, or until the client
    leaves): the per-read timeout never fires."""
    def run(out: _Out) -> bool:
        if not out.send(prefix):
            return False
        end = time.monotonic() + for_s
        while time.monotonic() < end and out.send(byte):
            time.sleep(period_s)
        return False
    return run


@pytest.fixture
def hostile():
    srv = Hostile()
    yield srv
    srv.close()


# ---- crafted documents ------------------------------------------------------------------------
def crafted_manifest(tokens: list[int], *, fingerprint: str = "", num_tokens: int | None = None,
                     chunk_tokens: int = 32, layers: int = 2, kv_heads: int = 2,
                     head_dim: int = 16, heads_per_group: int = 0,
                     frame_bytes: int = 1000) -> bytes:
    """A manifest that parses (consistent sizes, fake checksums) with the given geometry."""
    n = len(tokens) if num_tokens is None else num_tokens
    geo = ChunkGeometry(n, chunk_tokens, layers, kv_heads, head_dim, heads_per_group)
    q = {"bits": 8, "coding": "plain"}
    level = {"bytes": frame_bytes, "checksum": "xxh3_128:" + "0" * 32,
             "frame_bytes": frame_bytes, "bits_per_value": 8.0, "k": q, "v": q}
    chunks = []
    for cid in geo.chunk_ids():
        start, end = geo.token_range(cid.t)
        chunks.append({"t": cid.t, "l": cid.l, "g": cid.g, "token_start": start,
                       "num_tokens": end - start, "levels": {"q8": level}})
    doc = {"format": "sparkv-manifest/1", "context_id": CID, "created_unix": 0.0,
           "model": {"name": "tiny", "fingerprint": fingerprint}, "num_tokens": n,
           "tokens_sha256": tokens_digest(tokens),
           "geometry": {**geo.to_dict(), "num_token_chunks": geo.num_token_chunks,
                        "num_groups": geo.num_groups, "num_chunks": geo.num_chunks},
           "levels": ["q8"], "frame_version": 1,
           "total_bytes": {"q8": frame_bytes * len(chunks)}, "chunks": chunks}
    return json.dumps(doc).encode()


TOKENS = list(range(10, 74))    # a 64-token context
MANIFEST_PATH = f"/v1/contexts/{CID}"
TOKENS_PATH = f"/v1/contexts/{CID}/tokens"


def _client(srv: Hostile, **limits: float) -> EdgeClient:
    return EdgeClient(srv.url, limits=ClientLimits(**{"manifest_bytes": CAP, **limits}))


def _bomb(decoded: int = ENDLESS) -> bytes:
    """gzip of ``decoded`` spaces (about a thousandth of that on the wire)."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = b" " * (1 << 20)
    return b"".join([z.compress(block) for _ in range(decoded >> 20)] + [z.flush()])


# ---- the client: size ------------------------------------------------------------------------
def test_a_gzip_bomb_manifest_stops_at_the_cap(hostile):
    bomb = _bomb()
    assert len(bomb) < CAP   # small on the wire, 40 MiB un-gzipped
    hostile.routes[MANIFEST_PATH] = answer(bomb, **{"Content-Encoding": "gzip"})
    with _client(hostile) as client, pytest.raises(ResponseTooLarge) as e:
        client.manifest(CID)
    assert e.value.limit == CAP and e.value.received <= CAP + 1
    assert "limit" in str(e.value) and MANIFEST_PATH in str(e.value)


@pytest.mark.parametrize("encoding", ["identity", "gzip"])
def test_an_endless_manifest_stops_at_the_cap(hostile, encoding):
    if encoding == "gzip":   # a gzip stream that never ends: stored blocks of JSON-ish text
        z = zlib.compressobj(1, zlib.DEFLATED, 31)   # (as large un-gzipped as on the wire, so
        start = z.compress(b'{"a": "') + z.flush(zlib.Z_SYNC_FLUSH)   # an unfixed edge ends)
        more = b"\x00" + struct.pack("<HH", 65535, 0) + b"y" * 65535
        assert zlib.decompressobj(31).decompress(start + more) == b'{"a": "' + b"y" * 65535
        hostile.routes[MANIFEST_PATH] = endless(more, prefix=start,
                                                **{"Content-Encoding": "gzip"})
    else:
        hostile.routes[MANIFEST_PATH] = endless(b"x" * 65536, prefix=b'{"a": "')
    with _client(hostile) as client, pytest.raises(ResponseTooLarge) as e:
        client.manifest(CID)
    assert e.value.received <= CAP + 1 and e.value.wire_bytes <= CAP + 1024 + PIECE_SLACK
    assert hostile.sent[MANIFEST_PATH] < CAP + KERNEL_SLACK < ENDLESS


def test_a_flood_of_empty_gzip_blocks_stops_at_the_cap(hostile):
    """Deflate blocks that decode to nothing: the wire bytes are bounded too."""
    z = zlib.compressobj(1, zlib.DEFLATED, 31)
    start = z.compress(b"{") + z.flush(zlib.Z_SYNC_FLUSH)
    empty = b"\x00\x00\x00\xff\xff" * 8192    # empty stored blocks: 5 bytes, nothing decoded
    assert zlib.decompressobj(31).decompress(start + empty) == b"{"
    hostile.routes[MANIFEST_PATH] = endless(empty, prefix=start, **{"Content-Encoding": "gzip"})
    with _client(hostile) as client, pytest.raises(ResponseTooLarge) as e:
        client.manifest(CID)
    assert e.value.received <= 1 and e.value.wire_bytes <= CAP + 1024 + PIECE_SLACK


def test_endless_tokens_stop_at_four_bytes_a_token(hostile):
    hostile.routes[MANIFEST_PATH] = answer(crafted_manifest(TOKENS))
    hostile.routes[TOKENS_PATH] = endless(b"\x01\x00\x00\x00" * 16384)
    with _client(hostile) as client, pytest.raises(ResponseTooLarge) as e:
        client.tokens(CID)
    assert e.value.limit == 4 * len(TOKENS) + 4096
    assert e.value.wire_bytes <= e.value.limit + PIECE_SLACK
    assert hostile.sent[TOKENS_PATH] < KERNEL_SLACK < ENDLESS


def test_a_frame_is_bounded_by_its_manifest_size_and_not_retried(hostile):
    hostile.routes[MANIFEST_PATH] = answer(crafted_manifest(TOKENS, frame_bytes=5000))
    hostile.routes[f"/v1/contexts/{CID}/chunks/0/1/0"] = endless(b"\0" * 65536)
    with _client(hostile) as client:
        with pytest.raises(ResponseTooLarge) as e:
            client.frame(CID, 0, 1, 0, "q8")
        assert e.value.limit == 5000 and client.frame_retries == 0
    assert hostile.hits[f"/v1/contexts/{CID}/chunks/0/1/0"] == 1


def test_an_endless_error_body_is_read_only_in_part(hostile):
    hostile.routes[MANIFEST_PATH] = endless(b"e" * 65536, status=500,
                                            prefix=b'{"error": {"code": "x", "message": "')
    with _client(hostile) as client, pytest.raises(ApiError) as e:
        client.manifest(CID)
    assert e.value.status == 500   # the server's error, from the part that was read
    assert hostile.sent[MANIFEST_PATH] < KERNEL_SLACK < ENDLESS


def test_json_answers_are_bounded(hostile):
    hostile.routes["/healthz"] = endless(b" " * 65536, prefix=b"{")
    with _client(hostile, json_bytes=4096) as client, pytest.raises(ResponseTooLarge):
        client.health()


def test_a_stream_error_body_is_read_only_in_part(hostile):
    """``POST .../stream`` answered 503 with an endless body: a retryable SourceError, after
    reading at most 64 KiB of it."""
    hostile.routes[f"/v1/contexts/{CID}/stream"] = endless(b"e" * 65536, status=503)
    source = HttpChunkSource(hostile.url, CID)

    async def run() -> None:
        try:
            await source.open([FetchItem(KVChunkId(0, 0, 0), "q8", 1000)])
        finally:
            await source.aclose()

    with pytest.raises(SourceError) as e:
        asyncio.run(run())
    assert not e.value.fatal
    assert hostile.sent[f"/v1/contexts/{CID}/stream"] < KERNEL_SLACK < ENDLESS


# ---- the client: time ------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["body", "headers"])
def test_a_dripped_manifest_ends_at_the_deadline(hostile, where):
    """One byte every 0.2 s (a per-read timeout of 10 s never fires): the 1 s deadline ends
    the request, whether the drip is in the body or in the status line and headers."""
    if where == "body":
        route = drip(_head(200, {"Content-Length": "1000000"}) + b"{", b" ")
    else:
        route = drip(b"HTTP/1.1 200 OK\r\nX-Pad: ", b"a")
    hostile.routes[MANIFEST_PATH] = route
    t0 = time.monotonic()
    with _client(hostile, deadline_s=1.0) as client, pytest.raises(DeadlineExceeded) as e:
        client.manifest(CID)
    assert time.monotonic() - t0 < 30.0   # generous: the drip itself goes on for 120 s
    assert "deadline" in str(e.value) and "1 s" in str(e.value)


def test_a_fresh_deadline_for_each_request(hostile):
    """The deadline is per request: a slow-ish but finishing answer after a fast one passes."""
    body = crafted_manifest(TOKENS)
    hostile.routes[MANIFEST_PATH] = answer(body)
    hostile.routes[TOKENS_PATH] = answer(tokens_bytes(TOKENS))
    with _client(hostile, deadline_s=5.0) as client:
        assert client.manifest(CID).num_tokens == len(TOKENS)
        assert client.tokens(CID) == TOKENS


# ---- the manifest: geometry ------------------------------------------------------------------
def test_manifests_declaring_more_tokens_than_the_client_accepts(hostile):
    body = crafted_manifest(TOKENS, num_tokens=1 << 24, chunk_tokens=1 << 24)
    hostile.routes[MANIFEST_PATH] = answer(body)
    with _client(hostile) as client, pytest.raises(ManifestError, match="at most 1048576"):
        client.manifest(CID)


def test_frames_larger_than_their_chunk_could_need_are_refused():
    m = Manifest.parse(crafted_manifest(TOKENS, frame_bytes=1 << 30))
    with pytest.raises(ManifestError, match="declares 1073741824 bytes"):
        m.check_geometry(num_layers=2, num_kv_heads=2, head_dim=16)
    ok = Manifest.parse(crafted_manifest(TOKENS, frame_bytes=max_frame_bytes(32, 2, 16)))
    ok.check_geometry(num_layers=2, num_kv_heads=2, head_dim=16, max_tokens=64)
    with pytest.raises(ManifestError, match="at most 63"):
        ok.check_geometry(num_layers=2, num_kv_heads=2, head_dim=16, max_tokens=63)


# ---- BoundedBody -----------------------------------------------------------------------------
def test_bounded_body_gunzips_members_and_refuses_damage():
    two = gzip.compress(b"abc") + gzip.compress(b"def")
    body = BoundedBody(100, "x", gzip=True)
    for i in range(len(two)):          # byte by byte: members split anywhere
        body.feed(two[i:i + 1])
    assert body.body() == b"abcdef"
    cut = BoundedBody(1000, "x", gzip=True)
    cut.feed(gzip.compress(b"abcdef" * 100)[:-6])
    with pytest.raises(BadEncoding, match="ended inside"):
        cut.body()
    with pytest.raises(BadEncoding, match="does not decode"):
        BoundedBody(100, "x", gzip=True).feed(b"\x1f\x8b\x08\x00" + b"\xff" * 40)
    part = BoundedBody(4, "x", truncate=True)
    part.feed(b"abcdefgh")
    assert part.full and part.body() == b"abcd"


# ---- the session and the CLI (a tiny model) ----------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    from sparkv.runtime.model import load_model
    from tests.helpers import shared_tiny_checkpoint

    path = shared_tiny_checkpoint()
    return load_model(str(path), progress=False), str(path)


def _session(srv: Hostile, lm, **limits: float) -> EdgeSession:
    return EdgeSession(_client(srv, **limits), lm)


def _ask(session: EdgeSession, **kw):
    return session.ask(CID, QUESTION, max_new_tokens=2, use_cache=False, stop_at_eos=False,
                       **kw)


@pytest.mark.parametrize("fault", ["endless", "bomb", "drip"])
def test_a_hostile_manifest_falls_back_to_local_compute(hostile, tiny, fault):
    """The device holds the document: a manifest over its cap or past its deadline is a server
    out of reach, and the answer is computed locally."""
    lm, _ = tiny
    hostile.routes[MANIFEST_PATH] = {
        "endless": endless(b"x" * 65536, prefix=b'{"a": "'),
        "bomb": answer(_bomb(), **{"Content-Encoding": "gzip"}),
        "drip": drip(_head(200, {"Content-Length": "1000000"}), b" ")}[fault]
    with _session(hostile, lm, deadline_s=1.0) as session:
        # the manifest's bound is what is tested: with the prelude the tiny model's whole
        # context is computed at once, and the ask does not wait past a slow start for it
        res = _ask(session, token_ids=TOKENS, prelude=False)
    assert res.tokens and res.breakdown.chunks_streamed == 0
    want = "DeadlineExceeded" if fault == "drip" else "ResponseTooLarge"
    assert want in res.breakdown.fallback["server"]
    assert hostile.sent[MANIFEST_PATH] < CAP + KERNEL_SLACK


def test_endless_tokens_with_strategy_local_is_a_clear_error(hostile, tiny):
    lm, _ = tiny
    hostile.routes[MANIFEST_PATH] = answer(crafted_manifest(TOKENS, fingerprint=lm.fingerprint))
    hostile.routes[TOKENS_PATH] = endless(b"\x01\x00\x00\x00" * 16384)
    with _session(hostile, lm) as session, pytest.raises(AskError) as e:
        _ask(session, strategy="local")
    assert isinstance(e.value.__cause__, ResponseTooLarge)
    assert "limit" in str(e.value) and "not on this device" in str(e.value)
    assert hostile.sent[TOKENS_PATH] < KERNEL_SLACK < ENDLESS


ABSURD = {
    "num_kv_heads": dict(kv_heads=3000, heads_per_group=3000),
    "head_dim": dict(head_dim=4096),
    "num_layers": dict(layers=3),
    "num_tokens": dict(chunk_tokens=8192),   # 8192 tokens: the model has 4096 positions
    "frame": dict(frame_bytes=1 << 30),
}


@pytest.mark.parametrize("what", sorted(ABSURD))
def test_absurd_geometry_is_a_manifest_error_before_the_tokens(hostile, tiny, what):
    lm, _ = tiny
    tokens = list(range(10, 8202)) if what == "num_tokens" else TOKENS   # their digest matches
    hostile.routes[MANIFEST_PATH] = answer(crafted_manifest(tokens, fingerprint=lm.fingerprint,
                                                            **ABSURD[what]))
    hostile.routes[TOKENS_PATH] = answer(tokens_bytes(tokens))
    with _session(hostile, lm) as session, pytest.raises(ManifestError) as e:
        _ask(session, strategy="local")
    want = {"num_tokens": "at most 4096", "frame": "a frame of"}.get(what, f"geometry.{what}")
    assert want in str(e.value)
    assert hostile.hits[TOKENS_PATH] == 0    # refused before its token ids were asked for


@pytest.mark.parametrize("fault", ["geometry", "drip", "bomb"])
def test_the_cli_exits_2_with_one_line(hostile, tiny, fault, capsys):
    from sparkv.cli import main

    lm, path = tiny
    hostile.routes[MANIFEST_PATH] = {
        "geometry": answer(crafted_manifest(TOKENS, fingerprint=lm.fingerprint, kv_heads=3000,
                                            heads_per_group=3000)),
        "drip": drip(_head(200, {"Content-Length": "1000000"}), b" "),
        "bomb": answer(_bomb(), **{"Content-Encoding": "gzip"})}[fault]
    rc = main(["ask", QUESTION, "--server", hostile.url, "--context", CID, "--model", path,
               "--no-cache", "--no-prelude", "--max-new-tokens", "2", "--deadline-s", "1",
               "--max-manifest-mb", "1"])
    err = capsys.readouterr().err.strip()     # (after the model's loading progress bar)
    last = err.splitlines()[-1]
    assert rc == 2 and last.startswith("sparkv: error:") and "Traceback" not in err, err
    assert {"geometry": "num_kv_heads", "drip": "deadline", "bomb": "limit"}[fault] in last


def test_a_job_poll_that_times_out_is_retried_and_a_silent_server_is_an_error(monkeypatch):
    """A poll answered late (a server busy encoding) is retried; past the deadline the
    unreachable server is raised, not waited on."""
    from sparkv.edge.client import ServerUnavailable

    client = EdgeClient("http://127.0.0.1:9", timeout_s=0.5)
    answers = [ServerUnavailable("ReadTimeout"), ServerUnavailable("ReadTimeout"),
               {"state": "done"}]

    def fake_json(method, path, **kw):
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a

    monkeypatch.setattr(client, "_json", fake_json)
    assert client._poll_job("j1", time.monotonic() + 60) == {"state": "done"}
    answers[:] = [ServerUnavailable("down")] * 3
    with pytest.raises(ServerUnavailable):
        client._poll_job("j1", time.monotonic() - 1)        # the deadline has passed
    assert len(answers) == 2                                  # one try, no wait


def test_a_busy_server_is_polled_longer_than_a_down_one(monkeypatch):
    """A server that takes the poll but answers late (a read timeout: busy encoding on a
    loaded machine) is polled up to ``SILENT_POLL_S``; one that refuses the connection is
    reported down after three request timeouts (at least 30 s). A fake clock: no waiting."""
    import sparkv.edge.client as mod

    clock = [0.0]
    monkeypatch.setattr(mod.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(mod.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    client = EdgeClient("http://127.0.0.1:9", timeout_s=0.5)
    calls = []

    def silent_until(t_ok, silent):
        def fake_json(method, path, **kw):
            calls.append(clock[0])
            clock[0] += 0.5                                   # each poll waits its timeout
            if clock[0] < t_ok:
                raise mod.ServerUnavailable("ReadTimeout", silent=silent)
            return {"state": "running"}
        return fake_json

    monkeypatch.setattr(client, "_json", silent_until(200.0, silent=True))
    assert client._poll_job("j1", 1000.0) == {"state": "running"}   # 200 s late: still polled
    clock[0], calls[:] = 0.0, []
    monkeypatch.setattr(client, "_json", silent_until(200.0, silent=False))
    with pytest.raises(mod.ServerUnavailable):
        client._poll_job("j1", 1000.0)
    assert 30.0 <= calls[-1] < 32.0                           # down: given up after 30 s
    clock[0], calls[:] = 0.0, []
    monkeypatch.setattr(client, "_json", silent_until(1e9, silent=True))
    with pytest.raises(mod.ServerUnavailable):
        client._poll_job("j1", 1000.0)
    assert mod.SILENT_POLL_S <= calls[-1] < mod.SILENT_POLL_S + 2   # silent for good: bounded


# ---- what the edge refuses to paper over (issue 42: M7, L7, L8) --------------------------------
STREAM_PATH = f"/v1/contexts/{CID}/stream"


def _error(status: int, code: str) -> Behaviour:
    body = json.dumps({"error": {"status": status, "code": code, "message": "no"}}).encode()
    return answer(body, status)


def _cached_then(hostile: Hostile, client: EdgeClient, lm, then: Behaviour) -> None:
    """The server answers the manifest and the token ids (``client`` caches them), then
    answers every request with ``then``."""
    hostile.routes[MANIFEST_PATH] = answer(crafted_manifest(TOKENS, fingerprint=lm.fingerprint))
    hostile.routes[TOKENS_PATH] = answer(tokens_bytes(TOKENS))
    client.manifest(CID)
    client.tokens(CID)
    for path in (MANIFEST_PATH, TOKENS_PATH, STREAM_PATH):
        hostile.routes[path] = then


@pytest.mark.parametrize("status, code", [(401, "invalid_api_key"), (403, "forbidden")])
def test_a_refused_key_ends_the_ask_whatever_is_cached(hostile, tiny, status, code):
    """M7: a 401/403 is a configuration error, not a link fault: the cached manifest and token
    ids must not turn it into a slower all-local answer."""
    lm, _ = tiny
    with _session(hostile, lm) as session:
        _cached_then(hostile, session.client, lm, _error(status, code))
        with pytest.raises(ApiError) as e:
            session.ask(CID, QUESTION, max_new_tokens=2, stop_at_eos=False, strategy="stream")
    assert e.value.status == status and e.value.code == code
    assert hostile.hits[STREAM_PATH] == 1           # refused once: not retried, not fallen back


def test_a_link_fault_still_falls_back(hostile, tiny):
    """M7's other side: a 503 on the stream is the link's fault: the answer is computed."""
    lm, _ = tiny
    with _session(hostile, lm) as session:
        _cached_then(hostile, session.client, lm, _error(503, "store_unavailable"))
        res = session.ask(CID, QUESTION, max_new_tokens=2, stop_at_eos=False, strategy="stream")
    assert res.tokens and res.breakdown.chunks_streamed == 0
    assert "503" in res.breakdown.fallback["link"]


def _late(then: Behaviour, seconds: float = 60.0) -> Behaviour:
    """``then``, after ``seconds`` (or when the server stops)."""
    def run(out: _Out) -> bool:
        out.server.stop.wait(seconds)
        return then(out)
    return run


def test_a_manifest_later_than_the_whole_local_computation_is_not_waited_for(hostile, tiny):
    """The device holds the context's token ids; the manifest is asked again (``use_cache``
    off) and comes a minute late (a link in a deep fade at the start): the prelude computes
    every step meanwhile, and the ask answers from them at once, the same tokens as local
    prefill, saying why, with nothing requested from the stream."""
    lm, _ = tiny
    with _session(hostile, lm) as session:
        manifest = answer(crafted_manifest(TOKENS, fingerprint=lm.fingerprint))
        _cached_then(hostile, session.client, lm, _late(manifest))
        local = session.ask(CID, QUESTION, max_new_tokens=3, stop_at_eos=False,
                            strategy="local")
        res = session.ask(CID, QUESTION, max_new_tokens=3, stop_at_eos=False, use_cache=False)
    assert res.breakdown.strategy == "sparkv" and "manifest" in res.breakdown.fallback
    assert res.tokens == local.tokens and res.breakdown.prelude_steps > 0
    assert res.breakdown.steps_computed == res.breakdown.prelude_steps   # nothing after it
    assert res.breakdown.chunks_streamed == 0
    assert hostile.hits[MANIFEST_PATH] == 2 and hostile.hits[STREAM_PATH] == 0


def test_the_cli_exits_2_on_a_wrong_api_key_with_a_cached_context(hostile, tiny, tmp_path,
                                                                  monkeypatch, capsys):
    """M7 as the probe met it: ``sparkv ask --api-key WRONG`` with the manifest and the token
    ids in the edge's disk cache: one line naming the flag, exit 2 (was: exit 0 and a
    ``FELL BACK ... 401`` line)."""
    from sparkv.cli import main
    from sparkv.runtime.model import CACHE_ENV

    lm, path = tiny
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    with EdgeClient(hostile.url, cache_dir=tmp_path / "edge") as client:   # sparkv ask's
        _cached_then(hostile, client, lm, _error(401, "invalid_api_key"))
    rc = main(["ask", QUESTION, "--server", hostile.url, "--context", CID, "--model", path,
               "--api-key", "sk-wrong", "--strategy", "stream", "--no-prelude",
               "--max-new-tokens", "2"])
    err = capsys.readouterr().err.strip()
    last = err.splitlines()[-1]
    assert rc == 2 and last.startswith("sparkv: error:") and "Traceback" not in err, err
    assert "401" in last and "--api-key" in last
    assert hostile.hits[STREAM_PATH] == 1 and hostile.hits[MANIFEST_PATH] == 1   # from cache


def test_out_of_vocabulary_token_ids_are_a_manifest_error(hostile, tiny):
    """L7: token ids the model has no embedding for (with a digest that matches them) are
    refused when they arrive, naming the id; nothing is cached, nothing indexes out of range."""
    lm, _ = tiny
    vocab = lm.model.get_input_embeddings().num_embeddings
    bad = TOKENS[:10] + [vocab + 7] + TOKENS[11:]
    hostile.routes[MANIFEST_PATH] = answer(crafted_manifest(bad, fingerprint=lm.fingerprint))
    hostile.routes[TOKENS_PATH] = answer(tokens_bytes(bad))
    with _session(hostile, lm) as session:
        with pytest.raises(ManifestError) as e:
            _ask(session, strategy="local")
        assert session.client.known_tokens(CID) is None
    assert f"{vocab + 7}" in str(e.value) and "position 10" in str(e.value)
    assert f"{vocab}" in str(e.value)


def test_out_of_vocabulary_token_ids_given_by_the_caller_are_an_ask_error(hostile, tiny):
    lm, _ = tiny
    vocab = lm.model.get_input_embeddings().num_embeddings
    with _session(hostile, lm) as session, pytest.raises(AskError) as e:
        _ask(session, token_ids=TOKENS[:-1] + [vocab], strategy="local")
    assert f"{vocab}" in str(e.value) and "vocabulary" in str(e.value)
    assert hostile.hits[MANIFEST_PATH] == 0 and hostile.hits[TOKENS_PATH] == 0


def _redirect(out: _Out) -> bool:
    return out.send(_head(307, {"Location": "https://elsewhere.example/v1/x",
                                "Content-Length": "0"}))


def test_a_redirected_manifest_is_reported_as_a_redirect(hostile, tiny):
    """L8: a 307 on the manifest was 'malformed manifest: Invalid JSON: EOF'. The client does
    not follow redirects: the error says so, with the status and where it points."""
    lm, _ = tiny
    hostile.routes[MANIFEST_PATH] = _redirect
    with _client(hostile) as client, pytest.raises(ApiError) as e:
        client.manifest(CID)
    assert e.value.status == 307 and e.value.code == "redirect"
    assert "https://elsewhere.example/v1/x" in str(e.value)
    assert "does not follow redirects" in str(e.value)
    with _session(hostile, lm) as session, pytest.raises(ApiError) as e:
        _ask(session, token_ids=TOKENS)      # a configuration error: not a fallback
    assert e.value.status == 307


def test_a_redirected_stream_is_reported_as_a_redirect(hostile):
    hostile.routes[STREAM_PATH] = _redirect
    source = HttpChunkSource(hostile.url, CID)

    async def run() -> None:
        try:
            await source.open([FetchItem(KVChunkId(0, 0, 0), "q8", 1000)])
        finally:
            await source.aclose()

    with pytest.raises(SourceError) as e:
        asyncio.run(run())
    assert e.value.fatal and "307" in str(e.value) and "does not follow redirects" in str(e.value)


def test_a_create_answered_after_the_request_timeout_but_within_the_deadline_is_taken():
    """A server loads its model at its first use, inside ``POST /v1/contexts``: silence longer
    than the client's request timeout (seen: > 10 s on a loaded 2-core machine) is waited for up
    to the request's deadline; a GET stays bound by the timeout."""
    from sparkv.edge.client import ServerUnavailable

    srv = Hostile()
    body = json.dumps({"context_id": "c" * 64, "status": "done"}).encode()

    def slow(out: _Out) -> bool:
        threading.Event().wait(1.5)                  # 3 timeouts of silence, then the answer
        return answer(body)(out)

    srv.routes["/v1/contexts"] = slow
    try:
        with EdgeClient(srv.url, None, timeout_s=0.5,
                        limits=ClientLimits(deadline_s=30.0)) as client:
            assert client.create_context(token_ids=[1, 2, 3]) == "c" * 64
            with pytest.raises(ServerUnavailable):
                client.list_contexts()               # the same silence on a GET: an error
    finally:
        srv.close()
