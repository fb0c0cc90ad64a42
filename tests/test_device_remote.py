"""The server stream as the context service's third source (issue 13, item 7): a context the device
lost entirely (RAM and flash) is restored from a real ``sparkv serve`` process and answers exactly
as one never evicted; the restore plan picks flash, server or recompute by predicted cost; and the
token chunk files of the flash tier round-trip and refuse damage."""

from __future__ import annotations

import pytest
import torch

from sparkv.cache import ChunkPayload, PayloadError
from sparkv.cache.payload import contiguous_positions
from sparkv.device import ContextService
from sparkv.device.density import OLD_LADDER, plan_levels
from sparkv.device.flashio import pack_token_chunk, read_token_chunk_record
from sparkv.device.loader import dequantize_fast
from sparkv.device.registry import ResidencyCounts
from sparkv.device.remote import RemoteSource, ServerStream
from sparkv.layout import KVChunkId
from sparkv.runtime.generate import sample_context_ids
from helpers import flash_profile

FAST_FLASH = flash_profile(fast=True)


@pytest.fixture(scope="module")
def lm(smollm2):
    return smollm2


@pytest.mark.parametrize("level", ["fp", "int8", "int4", "int2"])
def test_token_chunk_file_round_trips_and_refuses_damage(level):
    g = torch.Generator().manual_seed(3)
    ps = []
    for l in range(4):  # noqa: E741
        k, v = torch.randn(48, 64, generator=g), torch.randn(48, 64, generator=g)
        p = ChunkPayload(KVChunkId(7, l, 0), "fp", [16] * 3, contiguous_positions([16] * 3, 112),
                         k, v, torch.float32)
        ps.append(p if level == "fp" else p.at_level(level))
    data = pack_token_chunk(list(reversed(ps)))          # any order in, layer-major out
    f = read_token_chunk_record(data, 7)
    assert [p.cid for p in f.payloads] == [p.cid for p in ps]
    for a, b in zip(ps, f.payloads):
        assert a.level == b.level and a.nbytes == b.nbytes and torch.equal(a.pos, b.pos)
        assert all(torch.equal(x, y) for x, y in zip(a.fp(), b.fp()))
    # the stacked values dequantize to the payloads' own values, bit for bit
    k_all = f.k if level == "fp" else dequantize_fast(f.k)
    assert torch.equal(k_all.view(4, 48, 64)[2], ps[2].fp()[0])
    for cut in (data[:-1], data[:20], data[:100] + bytes([data[100] ^ 1]) + data[101:]):
        with pytest.raises(PayloadError):
            read_token_chunk_record(cut, 7)
    with pytest.raises(PayloadError):
        read_token_chunk_record(data, 8)                    # another chunk's file


def test_levels_keep_sinks_and_the_densest_at_fp_within_the_ratio():
    d = [0.9, 0.1, 0.5, 0.05, 0.8, 0.3, 0.2, 0.6, 0.02, 0.4]
    # ratio 1: every unprotected chunk at int8, the sink chunk (0) at fp outside the ratio
    m = plan_levels(d, 1.0, protect=[0], fp_ratio=3.7)
    assert m.levels[0] == "fp" and m.counts() == {"fp": 1, "int8": 9, "k8v4": 0, "int4": 0,
                                                "int2": 0}
    # the densest fp chunks are paid inside the ratio: the sparsest drop to int4 / int2
    m = plan_levels(d, 1.0, protect=[0], fp_fraction=0.12, fp_ratio=3.7)
    assert m.levels[4] == "fp" and m.counts()["fp"] == 2          # 0.8: the densest unprotected
    assert m.levels[8] in ("int4", "int2") and m.levels[3] in ("int4", "int2")
    assert (m.ratio * 10 - 3.7) / 9 <= 1.0 + 1e-9                 # the unprotected within 1.0
    # a ratio the fp chunks cannot fit: given up
    assert plan_levels(d, 0.3, fp_fraction=0.5, fp_ratio=3.7).counts()["fp"] == 0
    # above 1: what is left once all are int8 sends the densest to fp
    m = plan_levels(d, 1.6, fp_ratio=3.7)
    assert m.counts()["fp"] == 2 and m.levels[0] == m.levels[4] == "fp" and m.ratio <= 1.6
    # without fp options: the densest keep the most bits
    m = plan_levels(d, 0.85)
    assert m.counts()["fp"] == 0 and m.levels[0] == "int8" and m.levels[8] == "k8v4"
    m = plan_levels(d, 0.75, ladder=OLD_LADDER)
    assert m.levels[0] == "int8" and m.levels[8] == "int4"


def _dense_from_server(remote: ServerStream, n: int):
    """Every layer's K/V ``[1, H, n, D]`` assembled from the server's frames (what the edge's
    first ask loads)."""
    g = remote.geometry
    layers = [[torch.zeros(1, g.num_kv_heads, n, g.head_dim) for _ in range(2)]
              for _ in range(g.num_layers)]
    chunks = [(cid, "raw") for cid in sorted(remote.sizes, key=lambda c: (c.t, c.l, c.g))]
    for cid, start, k, v in remote.fetch(chunks):
        h0, h1 = g.head_range(cid.g)
        layers[cid.l][0][0, h0:h1, start:start + k.shape[1]] = k
        layers[cid.l][1][0, h0:h1, start:start + k.shape[1]] = v
    return [(k, v) for k, v in layers]


def test_a_lost_context_is_restored_from_the_server_exactly(lm, tmp_path):
    from sparkv.edge import EdgeClient, chat_context
    from sparkv.server.process import ServerProcess

    ids = chat_context(lm, sample_context_ids(lm, 180))
    q = lm.encode_text("<|im_start|>user\nWhat is the text about?<|im_end|>\n"
                       "<|im_start|>assistant\n")
    srv = ServerProcess(None, f"file://{tmp_path}/store", log_path=tmp_path / "server.log").start()
    try:
        with EdgeClient(srv.url, timeout_s=120.0) as client:
            cid = client.create_context(token_ids=ids, levels=["raw", "q8"], chunk_tokens=64)
            fast = ServerStream(client, cid, levels=["raw"], link_Bps=1e10)
            assert isinstance(fast, RemoteSource) and fast.token_ids == ids
            layers = _dense_from_server(fast, len(ids))
            svc = ContextService(lm, 256 << 20, tmp_path / "svc", compression="fp",
                                 io_profile=FAST_FLASH, keep_working=False)
            ref = svc.import_context(ids, layers)            # never evicted
            lost = svc.import_context(ids, layers)
            want = svc.call(ref, prompt_ids=q, max_new_tokens=12, grow=False)
            nt = svc.describe(lost).chunks.resident

            # lost entirely (RAM and flash): restored from the server, the same answer
            svc.drop_flash(lost)
            assert svc.describe(lost).chunks == ResidencyCounts(resident=0, flash=0, absent=nt)
            tier = svc.contexts[lost].tier
            assert not list(tier.root.iterdir()) and not tier.live_records()
            frames = fast.stats.frames
            got = svc.call(lost, prompt_ids=q, max_new_tokens=12, grow=False, remote=fast)
            assert got.load.streamed_chunks == nt
            assert got.load.recomputed_chunks == 0 and got.load.read_chunks == 0
            assert got.tokens == want.tokens
            assert fast.stats.frames - frames == len(fast.sizes)     # every server chunk, once
            # streamed chunks are swapped out ahead of time like any other (one segment)
            assert sum(tier.live_records().values()) == nt and len(tier.segments()) == 1

            # by predicted cost: over a link of 1 kB/s recomputing wins
            svc.drop_flash(lost)
            slow = ServerStream(client, cid, levels=["raw"], link_Bps=1e3)
            res = svc.call(lost, prompt_ids=q, max_new_tokens=4, grow=False, remote=slow)
            assert res.load.recomputed_chunks == nt and res.load.streamed_chunks == 0
            assert slow.stats.frames == 0
            # swapped out (a clean flash copy): flash beats a slow link
            svc.swap_out(lost)
            res = svc.call(lost, prompt_ids=q, max_new_tokens=4, grow=False, remote=slow)
            assert res.load.read_chunks == nt and res.load.streamed_chunks == 0, res.load
    finally:
        srv.stop()
    # the server is gone: a restore that planned to stream recomputes what did not arrive
    svc.drop_flash(lost)
    res = svc.call(lost, prompt_ids=q, max_new_tokens=12, grow=False, remote=fast)
    assert res.load.faults == nt and res.load.recomputed_chunks == nt, res.load
    assert svc.stats()["budget_violations"] == 0


def test_a_server_frame_with_non_finite_values_is_refused():
    """The server source decodes frames as finite KV: a valid raw frame holding a NaN is a
    failed fetch (the loader then recomputes what is missing), never values in the memory."""
    from types import SimpleNamespace

    from sparkv.codec import KVChunk, encode
    from sparkv.device import DeviceError
    from sparkv.layout import ChunkGeometry

    geo = ChunkGeometry(num_layers=1, num_kv_heads=1, heads_per_group=1, head_dim=8,
                        num_tokens=16, chunk_tokens=16)
    cid = KVChunkId(0, 0, 0)
    k, v = torch.zeros(1, 16, 8), torch.zeros(1, 16, 8)
    v[0, 4, 2] = float("nan")
    frame = encode(KVChunk(cid, 0, k, v, 1), "raw")
    manifest = SimpleNamespace(compressed=False, encrypted=False, chunk_geometry=geo,
                               sizes={cid: {"raw": len(frame)}}, levels=["raw"])
    client = SimpleNamespace(manifest=lambda _id: manifest, tokens=lambda _id: [1] * 16,
                             frame=lambda *a: frame, last_download=None, last_first_byte_s=0.0)
    src = ServerStream(client, "ab" * 16, link_Bps=1e6)
    with pytest.raises(DeviceError, match="non-finite"):
        list(src.fetch([(cid, "raw")]))
