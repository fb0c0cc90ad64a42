"""Unit tests of the edge's logic: the link shaper's arithmetic and manifest validation."""

from __future__ import annotations

import pytest

from sparkv.edge.manifest import Manifest, ManifestError, tokens_digest
from sparkv.edge.shaper import LinkShaper
from sparkv.layout import ChunkGeometry
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
    assert sh._reserve(500_000, None) == pytest.approx(100.5)
    assert sh._reserve(500_000, None) == pytest.approx(101.0)      # queued behind the first
    clock.t = 105.0                                                 # idle link: no credit hoard
    assert sh._reserve(100_000, None) == pytest.approx(105.1)


def test_shaper_follows_rate_changes_and_rtt():
    clock = FakeClock()
    trace = Trace.from_rows([0.0, 1.0], [8.0, 80.0], loop=False)   # 1 MB/s, then 10 MB/s
    sh = LinkShaper(trace, rtt_s=0.05, clock=clock, burst_s=0.0)
    sh.start()
    nb = sh.request_started()
    assert nb == pytest.approx(100.05)
    # 0.95 s at 1 MB/s (950 kB), the remaining 1.05 MB at 10 MB/s
    assert sh._reserve(2_000_000, nb) == pytest.approx(101.0 + 0.105)


def test_shaper_burst_is_bounded():
    clock = FakeClock()
    sh = LinkShaper(Trace.constant(8.0), clock=clock, burst_s=0.01)
    sh.start()
    clock.t = 110.0
    # at most 10 ms of credit: 1 MB takes 0.99 s more, not 0
    assert sh._reserve(1_000_000, None) == pytest.approx(110.99)


def test_unlimited_shaper_never_waits():
    sh = LinkShaper.unlimited()
    assert sh.take(10 ** 9) == 0.0 and not sh.active and sh.rtt() == 0.0


def _doc(g: ChunkGeometry, tokens: list[int]) -> dict:
    chunks = [{"t": c.t, "l": c.l, "g": c.g,
               "levels": {"q5": {"bytes": 100 + c.t, "checksum": "xxh3_128:00"},
                          "raw": {"bytes": 1000, "checksum": "xxh3_128:11"}}}
              for c in g.chunk_ids()]
    return {"format": "sparkv-manifest/1", "context_id": "a" * 32,
            "model": {"name": "m", "fingerprint": "f00"}, "tokens_sha256": tokens_digest(tokens),
            "geometry": g.to_dict(), "levels": ["raw", "q5"], "chunks": chunks}


def test_manifest_parses_and_checks():
    g = ChunkGeometry(40, 16, 2, 3, 8)
    tokens = list(range(40))
    m = Manifest.parse(_doc(g, tokens))
    assert m.geometry == g and m.levels == ("raw", "q5")
    assert m.total_bytes("raw") == 1000 * g.num_chunks
    m.check_model("f00")
    m.check_tokens(tokens)
    with pytest.raises(ManifestError, match="encoded with model"):
        m.check_model("other", "x")
    with pytest.raises(ManifestError, match="tokens_sha256"):
        m.check_tokens(list(range(1, 41)))
    with pytest.raises(ManifestError, match="40 tokens"):
        m.check_tokens(tokens[:-1])


@pytest.mark.parametrize("breakage", ["format", "missing_chunk", "bad_size", "no_geometry",
                                      "bad_type"])
def test_malformed_manifests_are_clear_errors(breakage):
    g = ChunkGeometry(40, 16, 2, 3, 8)
    d = _doc(g, list(range(40)))
    if breakage == "format":
        d["format"] = "other/9"
    elif breakage == "missing_chunk":
        d["chunks"].pop()
    elif breakage == "bad_size":
        d["chunks"][0]["levels"]["q5"]["bytes"] = 0
    elif breakage == "no_geometry":
        del d["geometry"]
    else:
        d["chunks"][0]["t"] = "zero"
    with pytest.raises(ManifestError):
        Manifest.parse(d)
