"""Unit tests of the edge's logic: the link shaper's arithmetic (manifest validation is the
protocol's: tests/test_protocol.py)."""

from __future__ import annotations

import time

import pytest

from sparkv.edge.shaper import LinkShaper
from sparkv.scheduler.trace import Trace


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_shaper_delivers_at_the_trace_rate():
    clock = FakeClock()
    sh = LinkShaper(Trace.constant(8.0), clock=clock, burst_s=0.0)   # 1 MB/s
    sh.start()
    assert sh._reserve(500_000, None) == pytest.approx((100.0, 100.5))
    assert sh._reserve(500_000, None) == pytest.approx((100.5, 101.0))   # queued behind it
    clock.t = 105.0                                                 # idle link: no credit hoard
    assert sh._reserve(100_000, None) == pytest.approx((105.0, 105.1))


def test_shaper_follows_rate_changes_and_rtt():
    clock = FakeClock()
    trace = Trace.from_rows([0.0, 1.0], [8.0, 80.0], loop=False)   # 1 MB/s, then 10 MB/s
    sh = LinkShaper(trace, rtt_s=0.05, clock=clock, burst_s=0.0)
    sh.start()
    nb = sh.request_started()
    assert nb == pytest.approx(100.05)
    # 0.95 s at 1 MB/s (950 kB), the remaining 1.05 MB at 10 MB/s
    # its first byte crosses one RTT after the request, not when the piece is in
    assert sh._reserve(2_000_000, nb) == pytest.approx((100.05, 101.0 + 0.105))


def test_shaper_burst_is_bounded():
    clock = FakeClock()
    sh = LinkShaper(Trace.constant(8.0), clock=clock, burst_s=0.01)
    sh.start()
    clock.t = 110.0
    # at most 10 ms of credit: 1 MB takes 0.99 s more, not 0
    assert sh._reserve(1_000_000, None) == pytest.approx((110.0, 110.99))   # not 109.99


def test_unlimited_shaper_never_waits():
    sh = LinkShaper.unlimited()
    before = time.perf_counter()
    assert before <= sh.take(10 ** 9) <= time.perf_counter()     # crossed now: no wait
    assert sh.waited_s == 0.0 and not sh.active and sh.rtt() == 0.0


def test_chunk_sources_and_server_clients_share_one_tls_context(monkeypatch):
    """httpx builds a verifying TLS context (the CA bundle loaded: 20-30 ms of CPU) for every
    client it makes; each load's chunk source makes one, beside the load's first layer steps,
    and a device service makes a server client inside its first ask to each server. The
    sources and the clients share the process's one context instead (the lean client's and
    httpx's), still a verifying one."""
    import ssl

    import httpx

    from sparkv.edge import bounds
    from sparkv.edge.client import EdgeClient
    from sparkv.edge.http_source import HttpChunkSource

    built: list[ssl.SSLContext] = []
    real = httpx.create_ssl_context

    def counting(*args, **kwargs):
        built.append(real(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(httpx, "create_ssl_context", counting)
    bounds.tls_context.cache_clear()
    try:
        sources = [HttpChunkSource("https://127.0.0.1:9", "c" * 16) for _ in range(3)]
        for s in sources:
            s._http()                                  # a proxied link's httpx client
            assert s._wire().endpoint.tls is built[0]  # the lean client's connections
        clients = [EdgeClient(f"https://127.0.0.{i}:9") for i in (1, 2)]
        for c in clients:
            c.close()
        assert len(built) == 1
        assert built[0].verify_mode == ssl.CERT_REQUIRED and built[0].check_hostname
    finally:
        bounds.tls_context.cache_clear()


def test_a_download_rate_leaves_out_its_first_read():
    """A body's first read was in by its first-byte time: its bytes have no time of their own.
    The 4K manifest step (67 kB, 64 KiB of it in the first read through the shaper) read a
    10 Mbit/s link at 268-427 Mbit/s when they were counted; a tail too short to time gives no
    rate (the plan keeps its prior)."""
    from sparkv.edge.client import RATE_TAIL_BYTES, Fetched

    manifest = Fetched(b"", seconds=0.0773, first_read_s=0.0753, headers={},
                       wire_bytes=66951, first_piece_bytes=65536)
    assert manifest.rate_Bps() is None
    big = Fetched(b"", seconds=0.50, first_read_s=0.10, headers={},
                  wire_bytes=65536 + 400_000, first_piece_bytes=65536)
    assert big.rate_Bps() == pytest.approx(1_000_000)          # 400 kB over 0.4 s
    short = Fetched(b"", seconds=0.2, first_read_s=0.1, headers={},
                    wire_bytes=1000 + RATE_TAIL_BYTES - 1, first_piece_bytes=1000)
    assert short.rate_Bps() is None
    instant = Fetched(b"", seconds=0.1, first_read_s=0.1, headers={},
                      wire_bytes=200_000, first_piece_bytes=1000)
    assert instant.rate_Bps() is None


def test_a_shaped_bodys_first_byte_is_timed_when_it_crossed_the_link():
    """A 200 kB body over an emulated 10 Mbit/s link with 20 ms of RTT, from a real loopback
    server: its first read (64 KiB) is in one RTT and 52 ms of transfer after the request, but
    its first byte crossed the link one RTT after it. The client's round trip (what the plan
    takes as ``rtt_s``) is the first byte's time, not the first read's."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from sparkv.edge.client import EdgeClient

    class Body(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", str(200_000))
            self.end_headers()
            self.wfile.write(bytes(200_000))

        def log_message(self, *a) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Body)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        with EdgeClient(f"http://127.0.0.1:{srv.server_address[1]}",
                        shaper=LinkShaper.constant(10.0, rtt_ms=20.0)) as client:
            got = client._request("GET", "/body", limit=1 << 20)
    finally:
        srv.shutdown()
        srv.server_close()
    assert len(got.body) == 200_000 and got.first_piece_bytes > 0
    assert got.first_read_s >= 0.020 + got.first_piece_bytes / 1.25e6    # emulated: a floor
    assert 0.020 <= got.first_byte_s < got.first_read_s
    assert client.last_first_byte_s == got.first_byte_s
    assert client.last_download is got and got.rate_Bps() is not None
