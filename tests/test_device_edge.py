"""SparKV joins the context service: ``EdgeSession.ask(keep=True)`` against a real ``sparkv serve``
keeps the loaded cache as a service context; a second ask about it streams nothing."""

from __future__ import annotations

import httpx
import pytest

from sparkv.device import ContextService
from sparkv.device.client import DeviceClient
from sparkv.runtime.generate import sample_context_ids


@pytest.fixture(scope="module")
def lm(smollm2):
    return smollm2


# ---- SparKV joins: a second ask about a resident context streams 0 bytes -------------------------
def test_second_ask_about_a_kept_context_streams_nothing(lm, tmp_path):
    from sparkv.edge import EdgeSession, LinkShaper, chat_context
    from sparkv.server.process import ServerProcess

    ids = chat_context(lm, sample_context_ids(lm, 700))
    srv = ServerProcess(None, f"file://{tmp_path}/store", log_path=tmp_path / "server.log").start()
    service = ContextService(lm, 256 << 20, tmp_path / "kept", compression="fp")
    shaper = LinkShaper.constant(200.0, 2.0)
    try:
        session = EdgeSession.connect(srv.url, model=lm, shaper=shaper, context_service=service,
                                      timeout_s=120.0)
        cid = session.client.create_context(token_ids=ids, levels=["raw", "q8"], chunk_tokens=256)
        q = "What does the text say about warranty?"
        first = session.ask(cid, q, strategy="stream", level="raw", backend="dense",
                            max_new_tokens=12, keep=True)
        taken = shaper.bytes_taken
        assert taken > 0 and first.breakdown.bytes_streamed > 0 and first.kept_id
        assert service.describe(first.kept_id).tokens == len(ids)
        # lost from RAM and flash while the server still holds it: the kept ask restores the
        # missing chunks from the server (or recomputes them, by predicted cost), same answer
        service.drop_flash(first.kept_id)
        lost = session.ask(cid, q, strategy="stream", level="raw", backend="dense",
                           max_new_tokens=12, keep=True)
        assert lost.kept_id == first.kept_id and lost.tokens == first.tokens
        assert lost.breakdown.strategy == "kept"
        assert lost.breakdown.chunks_streamed + lost.breakdown.chunks_computed > 0
        assert (lost.breakdown.chunks_streamed > 0) == (lost.breakdown.bytes_streamed > 0)
        src = lost.breakdown.memory_sources            # what filled the kept ask's memory
        assert src.get("streamed", 0) == lost.breakdown.chunks_streamed
        assert src.get("recomputed", 0) == lost.breakdown.chunks_computed
        taken = shaper.bytes_taken
    finally:
        srv.stop()                            # the server is gone: the next ask cannot stream
    second = session.ask(cid, q, strategy="stream", level="raw", backend="dense",
                         max_new_tokens=12, keep=True)
    assert shaper.bytes_taken == taken        # 0 bytes crossed the link
    assert second.breakdown.bytes_streamed == 0 and second.kept_id == first.kept_id
    assert second.tokens == first.tokens      # kept at fp: the same answer
    assert second.breakdown.strategy == "kept" and second.breakdown.chunks_computed == 0
    assert "working memory" in second.breakdown.memory_sources      # the last call's, kept
    # swapped out, then asked again: restored from flash, still nothing streamed
    service.swap_out(first.kept_id)
    third = session.ask(cid, q, strategy="stream", level="raw", backend="dense",
                        max_new_tokens=12, keep=True)
    assert shaper.bytes_taken == taken and third.tokens == first.tokens
    assert service.stats()["read_chunks"] + service.stats()["recomputed_chunks"] > 0
    # the session without a service cannot keep
    session.context_service = None
    with pytest.raises(Exception, match="context service"):
        session.ask(cid, q, keep=True)
    session.close()
    with DeviceClient(tmp_path / "no.sock", timeout_s=1) as c:   # no service there: clear error
        with pytest.raises(httpx.HTTPError):
            c.health()
