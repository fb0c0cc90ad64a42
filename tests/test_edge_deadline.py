"""The whole ask is bounded (issue 42, M1): a server that answers every frame request slowly,
each just inside its per-request deadlines, cannot keep an ask going. The ask's own time limit
ends the link and the rest is computed locally; a link far below the plan's estimate is
declared dead by the controller before that.

A real ``sparkv serve`` (the tiny model) behind a real loopback proxy that delays each stream
response just under the engine's open timeout, then drips it in small pieces (never silent long
enough for the read timeout or the stall rule). The real ``EdgeSession``, short configured
deadlines. Outcomes asserted: the fallback named, the answer equal to a local-only ask, and the
time only against generous bounds."""

from __future__ import annotations

import http.client
import socket
import socketserver
import threading
import time
from collections import Counter
from urllib.parse import urlsplit

import pytest

from helpers import shared_tiny_checkpoint, start_tiny_server, stop_checked

from sparkv.edge import EdgeClient, EdgeSession
from sparkv.edge.bounds import ClientLimits
from sparkv.edge.engine import EngineConfig

QUESTION = "What is this about?"
OPEN_TIMEOUT_S = 1.0            # the engine's per-request deadlines in these tests
HEAD_DELAY_S = 0.8              # each stream response starts just under OPEN_TIMEOUT_S ...
PIECE, PERIOD_S = 256, 0.1      # ... then drips 256 B every 0.1 s (2.5 kB/s, 0.02 Mbit/s)
GENEROUS_S = 120.0              # an unbounded ask drips for many minutes
DRIP_MBPS = PIECE * 8 / PERIOD_S / 1e6


class SlowProxy:
    """A loopback HTTP proxy in front of ``upstream``: every answer is relayed, the stream's
    slowly (module docstring). Counts requests per path and the stream bytes it sent."""

    def __init__(self, upstream: str) -> None:
        self.upstream = urlsplit(upstream)
        self.hits: Counter[str] = Counter()
        self.stream_bytes = 0
        self.stop = threading.Event()
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                proxy._serve(self.request)

        self._srv = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self._srv.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._srv.server_address[1]}"
        threading.Thread(target=self._srv.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self._srv.shutdown()
        self._srv.server_close()

    def _serve(self, sock: socket.socket) -> None:
        buf = b""
        while not self.stop.is_set():
            while b"\r\n\r\n" not in buf:
                data = sock.recv(65536)
                if not data:
                    return
                buf += data
            head, _, buf = buf.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, target = lines[0].split(" ")[:2]
            headers = dict(x.split(":", 1) for x in lines[1:] if ":" in x)
            headers = {k.strip(): v.strip() for k, v in headers.items()}
            length = int(headers.get("Content-Length", headers.get("content-length", "0")))
            while len(buf) < length:
                buf += sock.recv(65536)
            body, buf = buf[:length], buf[length:]
            path = target.split("?", 1)[0]
            self.hits[path] += 1
            status, rheaders, data = self._forward(method, target, headers, body)
            slow = path.endswith("/stream") and status == 200
            if not self._answer(sock, status, rheaders, data, slow):
                return

    def _forward(self, method: str, target: str, headers: dict[str, str],
                 body: bytes) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=60)
        try:
            keep = {k: v for k, v in headers.items()
                    if k.lower() not in ("host", "connection", "accept-encoding")}
            conn.request(method, target, body=body, headers=keep)
            r = conn.getresponse()
            relayed = {k: v for k, v in r.getheaders()
                       if k.lower() not in ("content-length", "transfer-encoding", "connection")}
            return r.status, relayed, r.read()
        finally:
            conn.close()

    def _answer(self, sock: socket.socket, status: int, headers: dict[str, str], data: bytes,
                slow: bool) -> bool:
        head = (f"HTTP/1.1 {status} X\r\nContent-Length: {len(data)}\r\n"
                + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode()
        try:
            if not slow:
                sock.sendall(head + data)
                return True
            time.sleep(HEAD_DELAY_S)
            sock.sendall(head)
            for pos in range(0, len(data), PIECE):
                if self.stop.is_set():
                    return False
                sock.sendall(data[pos:pos + PIECE])
                self.stream_bytes += len(data[pos:pos + PIECE])
                time.sleep(PERIOD_S)
            return True
        except OSError:
            return False     # the client gave the request up


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The tiny server with one raw-encoded context of 256 tokens, behind the slow proxy."""
    from sparkv.runtime.model import load_model

    srv = start_tiny_server(tmp_path_factory.mktemp("deadline"))
    try:
        key = srv.keys["alice"]
        tokens = [(7 * i + 3) % 200 + 10 for i in range(256)]
        with EdgeClient(srv.url, key) as client:
            cid = client.create_context(token_ids=tokens, levels=["raw"], chunk_tokens=32)
        lm = load_model(str(shared_tiny_checkpoint()), progress=False)
        proxy = SlowProxy(srv.url)
        yield {"proxy": proxy, "key": key, "cid": cid, "tokens": tokens, "lm": lm}
        proxy.close()
    finally:
        stop_checked(srv)


def _ask(served, **options):
    client = EdgeClient(served["proxy"].url, served["key"],
                        limits=ClientLimits(deadline_s=2 * OPEN_TIMEOUT_S))
    engine = EngineConfig(open_timeout_s=OPEN_TIMEOUT_S, read_timeout_s=OPEN_TIMEOUT_S)
    with EdgeSession(client, served["lm"]) as session:
        t0 = time.monotonic()
        res = session.ask(served["cid"], QUESTION, max_new_tokens=2, stop_at_eos=False,
                          use_cache=False, backend="dense", level="raw", engine_config=engine,
                          **options)
        return res, time.monotonic() - t0


@pytest.fixture(scope="module")
def local_answer(served):
    """The local-only ask (the manifest's geometry, nothing streamed)."""
    res, _ = _ask(served, strategy="local")
    assert not res.breakdown.fallback and res.breakdown.chunks_streamed == 0
    return res.tokens


def test_the_asks_time_limit_ends_a_slow_stream(served, local_answer):
    """The plan's estimate is the drip's own rate (so the link is not far below it and never
    dead): only the ask's 3 s limit ends the stream; the rest is computed locally."""
    before = served["proxy"].hits.copy()
    res, took = _ask(served, strategy="stream", bandwidth_mbps=DRIP_MBPS, ask_deadline_s=3.0)
    fallback = res.breakdown.fallback
    assert "deadline" in fallback and "3 s time limit passed" in fallback["deadline"], fallback
    assert "slow_link" not in fallback
    assert res.tokens == local_answer
    assert res.breakdown.chunks_computed > 0
    assert served["proxy"].hits - before, "the stream was never requested"
    assert took < GENEROUS_S


def test_a_link_far_below_its_estimate_is_dead(served, local_answer):
    """Planned at 100 Mbit/s, the link delivers 0.02: the controller declares it dead after
    4 s below a twentieth of the estimate and computes everything; the ask's (long) limit is
    never reached."""
    res, took = _ask(served, strategy="stream", bandwidth_mbps=100.0, ask_deadline_s=GENEROUS_S)
    fallback = res.breakdown.fallback
    assert "slow_link" in fallback and "against the plan's 100 Mbit/s" in fallback["slow_link"]
    assert "deadline" not in fallback
    assert any(m.direction == "dead_link" for m in res.load.migrations)
    assert res.tokens == local_answer
    assert took < GENEROUS_S


def test_the_default_limit_follows_the_local_estimate(served, local_answer):
    """Without ``ask_deadline_s`` the limit is 3x the local-prefill estimate + 10 s: the ask
    ends within it (plus the local compute), and the answer is the local one."""
    res, took = _ask(served, strategy="stream", bandwidth_mbps=DRIP_MBPS)
    assert "deadline" in res.breakdown.fallback, res.breakdown.fallback
    assert res.tokens == local_answer
    assert took < GENEROUS_S


def test_the_cli_flag_sets_the_limit(served, capsys):
    from sparkv.cli import main

    rc = main(["ask", QUESTION, "--server", served["proxy"].url, "--context", served["cid"],
               "--api-key", served["key"], "--model", str(shared_tiny_checkpoint()),
               "--strategy", "stream", "--level", "raw", "--no-cache", "--max-new-tokens", "2",
               "--ask-deadline-s", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "FELL BACK to local compute" in out and "2 s time limit passed" in out, out
