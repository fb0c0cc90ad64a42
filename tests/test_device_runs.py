"""A switch's fill as array operations per run and level (issue 43): the readers swap a run of
token chunk records into the context's pages with one page write per level and write them into
the working memory with one dequantization per level; the resident chunks are filled straight
from the pages; swap-out and ahead-of-time writes pack records from the pages with one gather
per level and update the chunk table once per record. Every case checks the values bit for bit
against the chunks' own payloads."""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest
import torch

from sparkv.cache import ChunkPayload, ContextKV, KVMemoryError, Residency, Source, dequantize
from sparkv.cache.payload import contiguous_positions
from sparkv.cache.payload import ChunkRun
from sparkv.device.flashio import (check_records, join_records, pack_token_chunk,
                                   pack_token_chunk_run, read_token_chunk_record)
from sparkv.cache.pages import BLOCK_PAGES
from sparkv.device.loader import (FileReads, LoadOptions, LoadRequest, fill_layers, flash_refs,
                                  load, pages_to_read, put_token_chunk, token_chunk_ids)
from sparkv.device.registry import DeviceContext
from sparkv.device.swap import SwapStore
from sparkv.layout import ChunkGeometry, KVChunkId

#: 10 token chunks (the last partial) of 3 layers, 4 KV heads of 32 dims in 2 groups
GEO = ChunkGeometry(16 * 9 + 7, 16, 3, 4, 32, 2)
LEVELS = ["fp", "int8", "int4", "int2", "k8v4"]
NO_MODEL = types.SimpleNamespace(device=torch.device("cpu"))   # loads that recompute nothing


def _payload(cid: KVChunkId, gen: torch.Generator, level: str) -> ChunkPayload:
    n = GEO.chunk_len(cid.t)
    hg = GEO.heads_per_group
    k, v = (torch.randn(hg * n, 32, generator=gen) for _ in range(2))
    p = ChunkPayload(cid, "fp", [n] * hg, contiguous_positions([n] * hg, cid.t * 16), k, v,
                     torch.float32)
    return p if level == "fp" else p.at_level(level)


def _context(root: Path) -> tuple[SwapStore, DeviceContext]:
    """A context of :data:`GEO`, token chunk ``t`` at ``LEVELS[t % 5]``, all modified."""
    swap = SwapStore(root, contiguous=True)
    ctx = DeviceContext("c0ffee", list(range(GEO.num_tokens)), None, swap.tier("c0ffee"))
    C = ContextKV(GEO, torch.float32, "cpu", paged=True)
    gen = torch.Generator().manual_seed(0)
    C.put_payloads([_payload(cid, gen, LEVELS[t % 5]) for t in range(GEO.num_token_chunks)
                    for cid in token_chunk_ids(GEO, t)], Source.COMPUTED)
    ctx.memory = C
    ctx.modified.update(range(GEO.num_token_chunks))
    return swap, ctx


def _fp(p: ChunkPayload) -> tuple[torch.Tensor, torch.Tensor]:
    if p.level == "fp":
        return p.k, p.v
    return dequantize(p.k, torch.float32), dequantize(p.v, torch.float32)


def _expect_working(C: ContextKV, W: ContextKV, ts: list[int]) -> None:
    """``W``'s slots of token chunks ``ts`` equal ``C``'s chunks dequantized, bit for bit."""
    for t in ts:
        t0, t1 = GEO.token_range(t)
        for cid in token_chunk_ids(GEO, t):
            k, v = _fp(C.read(cid))
            h0, h1 = GEO.head_range(cid.g)
            store = W.layers[cid.l]
            assert torch.equal(store.k[0, h0:h1, t0:t1].reshape(-1, 32), k), cid
            assert torch.equal(store.v[0, h0:h1, t0:t1].reshape(-1, 32), v), cid


class _Writes:
    """Counts the page writes of a memory (``C.paged.write`` and ``C.paged.place``): the
    chunks of each."""

    def __init__(self, C: ContextKV, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[int] = []
        self.placed = 0
        write, place = C.paged.write, C.paged.place

        def counted_write(t, l, g, run):  # noqa: E741
            self.calls.append(len(run.cids))
            return write(t, l, g, run)

        def counted_place(t, l, g, *rest):  # noqa: E741
            self.calls.append(len(t))
            self.placed += 1
            return place(t, l, g, *rest)

        monkeypatch.setattr(C.paged, "write", counted_write)
        monkeypatch.setattr(C.paged, "place", counted_place)


def test_records_round_trip_as_runs_bit_for_bit():
    gen = torch.Generator().manual_seed(1)
    for level in LEVELS:
        ps = [_payload(cid, gen, level) for cid in token_chunk_ids(GEO, 3)]
        data = pack_token_chunk(list(reversed(ps)))
        run = read_token_chunk_record(bytearray(data), 3).run()
        assert pack_token_chunk_run(run) == data            # the run's rows are the record's
        assert run.cids == [p.cid for p in ps]
        for a, b in zip(run.payloads(), ps):
            assert a.counts == b.counts and torch.equal(a.pos, b.pos)
            for x, y in ((a.k, b.k), (a.v, b.v)):
                if level == "fp":
                    assert torch.equal(x, y)
                else:
                    assert torch.equal(x.codes, y.codes) and torch.equal(x.scale, y.scale)
                    assert torch.equal(x.zero, y.zero)


def _same_run(a: ChunkRun, b: ChunkRun) -> None:
    assert a.cids == b.cids and a.level == b.level and a.dtype == b.dtype
    assert np.array_equal(a.counts, b.counts) and torch.equal(a.pos, b.pos)
    for x, y in ((a.k, b.k), (a.v, b.v)):
        if a.level == "fp":
            assert x.dtype == y.dtype and torch.equal(x, y)
        else:
            assert (x.bits, x.dim) == (y.bits, y.dim)
            assert torch.equal(x.codes, y.codes) and torch.equal(x.scale, y.scale)
            assert torch.equal(x.zero, y.zero)


def test_a_run_of_records_joins_bit_for_bit_and_bad_ones_fail_alone():
    """A run read into one buffer (records padded to 512 bytes, the last token chunk partial):
    ``check_records`` + ``join_records`` equal the records unpacked one by one and joined, at
    every level and for fp16 values; a damaged record, one of another token chunk and one past
    the buffer fail alone."""
    gen = torch.Generator().manual_seed(2)
    for level in LEVELS:
        for dtype in ([torch.float32, torch.float16] if level == "fp" else [torch.float32]):
            buf, spans = bytearray(), []
            for t in (6, 7, 8, 9):
                ps = [_payload(cid, gen, level) for cid in token_chunk_ids(GEO, t)]
                if dtype != torch.float32:
                    ps = [ChunkPayload(p.cid, p.level, p.counts, p.pos, p.k.to(dtype),
                                       p.v.to(dtype), dtype) for p in ps]
                rec = pack_token_chunk(ps)
                spans.append((t, len(buf), len(rec)))
                buf += rec + bytes(-len(rec) % 512)
            heads, bad = check_records(bytes(buf), spans)
            assert [h.t for h in heads] == [6, 7, 8, 9] and not bad
            one = [read_token_chunk_record(bytearray(buf[a:a + n]), t).run() for t, a, n in spans]
            # a run joins records of one length: the full ones, then the partial last one
            _same_run(join_records(bytes(buf), heads[:3]), ChunkRun.cat(one[:3]))
            _same_run(join_records(bytes(buf), heads[3:]), one[3])
            damaged = bytearray(buf)
            damaged[spans[1][1] + 100] ^= 0xFF
            t2, a2, n2 = spans[2]
            heads, bad = check_records(bytes(damaged), [spans[0], spans[1], (5, a2, n2),
                                                        (t2, a2, n2 - 1),
                                                        (9, len(buf), spans[3][2])])
            assert [h.t for h in heads] == [6] and bad == [7, 5, t2, 9]


def test_a_run_of_records_is_one_page_write_per_level(tmp_path, monkeypatch):
    swap, ctx = _context(tmp_path)
    C = ctx.memory
    before = {cid: C.read(cid) for cid in GEO.chunk_ids()}
    assert swap.write_ahead(ctx) > 0
    swap.put_away(ctx, range(GEO.num_token_chunks))
    assert not C.resident_payloads()
    refs, absent = flash_refs(C, range(GEO.num_token_chunks), [])
    assert sorted(refs) == list(range(GEO.num_token_chunks)) and not absent
    W = ContextKV(GEO, torch.float32, "cpu", spare_tokens=4)
    writes = _Writes(C, monkeypatch)
    reads = FileReads(C, W, ctx.tier, refs, threads=1)
    assert len(reads.runs) == 1                          # one segment, adjacent records
    reads.start()
    reads.close()
    assert not reads.failed and reads.reads == 1
    per_chunk = GEO.num_layers * GEO.num_groups
    # one page write per level present (5), not one per chunk (60), each straight from the
    # read buffer into the pages
    assert sorted(writes.calls) == sorted(
        per_chunk * sum(1 for t in range(GEO.num_token_chunks) if t % 5 == i) for i in range(5))
    assert writes.placed == 5
    for cid, p in before.items():
        st = C.state(cid)
        assert st.residency == Residency.RESIDENT and not st.dirty and st.level == p.level
        q = C.read(cid)
        assert q.counts == p.counts and torch.equal(q.pos, p.pos)
        assert all(torch.equal(a, b) for a, b in zip(_fp(q), _fp(p)))
    _expect_working(C, W, list(range(GEO.num_token_chunks)))


def test_resident_chunks_fill_straight_from_the_pages(tmp_path, monkeypatch):
    _, ctx = _context(tmp_path)
    C = ctx.memory
    W = ContextKV(GEO, torch.float32, "cpu", spare_tokens=4)
    skip = {2, 5}
    assert fill_layers(C, W, range(GEO.num_layers), skip) == \
        (GEO.num_token_chunks - len(skip)) * GEO.num_layers * GEO.num_groups
    _expect_working(C, W, [t for t in range(GEO.num_token_chunks) if t not in skip])
    for l in range(GEO.num_layers):  # noqa: E741   # skipped chunks untouched
        for t in skip:
            a, b = GEO.token_range(t)
            assert not W.layers[l].k[0, :, a:b].any()
    W2 = ContextKV(GEO, torch.float32, "cpu")
    fill_layers(C, W2, range(GEO.num_layers), only={1, 3, 9})        # index_copy_ paths
    _expect_working(C, W2, [1, 3, 9])
    C.prune_pages(1, [torch.arange(0, GEO.num_tokens, 2)] * GEO.num_kv_heads)
    with pytest.raises(KVMemoryError, match="pruned"):
        fill_layers(C, W, range(GEO.num_layers))


def test_a_partly_resident_token_chunk_keeps_its_resident_chunks(tmp_path, monkeypatch):
    swap, ctx = _context(tmp_path)
    C = ctx.memory
    swap.write_ahead(ctx)
    ids = token_chunk_ids(GEO, 5)
    keep = C.read(ids[0])
    C.drop_many(ids[1:])                                # chunk (5, 0, 0) (fp) stays resident
    refs, _ = flash_refs(C, [5], [])
    W = ContextKV(GEO, torch.float32, "cpu")
    writes = _Writes(C, monkeypatch)
    reads = FileReads(C, W, ctx.tier, refs, threads=1)
    reads.start()
    reads.close()
    assert not reads.failed and writes.calls == [len(ids) - 1]
    assert all(C.residency(c) == Residency.RESIDENT for c in ids)
    assert torch.equal(C.read(ids[0]).k, keep.k)
    _expect_working(C, W, [5])


def test_a_record_without_a_recorded_copy_fails_alone(tmp_path):
    swap, ctx = _context(tmp_path)
    C = ctx.memory
    swap.write_ahead(ctx)
    swap.put_away(ctx, range(GEO.num_token_chunks))
    refs, _ = flash_refs(C, range(GEO.num_token_chunks), [])
    for cid in token_chunk_ids(GEO, 6):              # its copy forgotten, the file still there
        C.table.forget_flash(np.array([C.table.index(cid)]))
    W = ContextKV(GEO, torch.float32, "cpu")
    reads = FileReads(C, W, ctx.tier, refs, threads=1)
    reads.start()
    reads.close()
    assert reads.failed == {6}
    _expect_working(C, W, [t for t in range(GEO.num_token_chunks) if t != 6])


def test_ahead_of_time_writes_pack_from_pages_and_skip_mixed_levels(tmp_path):
    swap, ctx = _context(tmp_path)
    C = ctx.memory
    C.set_level(KVChunkId(5, 2, 1), "int4")            # token chunk 5 (int8): now two levels
    assert swap.write_ahead(ctx) > 0
    for t in range(GEO.num_token_chunks):
        states = [C.state(c) for c in token_chunk_ids(GEO, t)]
        if t == 5:                                      # not one level: not written, modified
            assert all(st.flash is None and st.dirty for st in states)
            continue
        (ref,) = {st.flash for st in states}            # one record per token chunk
        assert not any(st.dirty for st in states)
        f = read_token_chunk_record(ctx.tier.read(ref), t)
        assert f.level == LEVELS[t % 5]
        for cid, got in zip(f.cids(), f.run().payloads()):
            assert all(torch.equal(a, b) for a, b in zip(_fp(got), _fp(C.read(cid))))
    # writing again writes nothing (every written chunk clean)
    assert swap.write_token_chunks(ctx, range(GEO.num_token_chunks)) == 0


def test_recomputed_token_chunks_enter_the_memory_at_their_level(tmp_path):
    _, ctx = _context(tmp_path)
    C = ctx.memory
    W = ContextKV(GEO, torch.float32, "cpu")
    fill_layers(C, W, range(GEO.num_layers))
    D = ContextKV(GEO, torch.float32, "cpu", paged=True)
    D.put_payload(C.read(token_chunk_ids(GEO, 2)[0]))   # one chunk already held: kept
    for t in (2, 9):
        put_token_chunk(D, W, t, "int8", Source.COMPUTED)
    for cid in token_chunk_ids(GEO, 2)[1:] + token_chunk_ids(GEO, 9):
        k = W.layers[cid.l].k[0, slice(*GEO.head_range(cid.g)), slice(*GEO.token_range(cid.t))]
        want = ChunkPayload(cid, "fp", [GEO.chunk_len(cid.t)] * 2,
                            contiguous_positions([GEO.chunk_len(cid.t)] * 2, cid.t * 16),
                            k.reshape(-1, 32).clone(), k.reshape(-1, 32).clone(),
                            torch.float32).at_level("int8")
        got = D.read(cid)
        assert got.level == "int8" and torch.equal(got.k.codes, want.k.codes)
        assert torch.equal(got.k.scale, want.k.scale)
    assert D.read(token_chunk_ids(GEO, 2)[0]).level == C.level(token_chunk_ids(GEO, 2)[0])


def test_a_load_reallocates_each_pool_once_at_most(tmp_path):
    swap, ctx = _context(tmp_path)
    C = ctx.memory
    swap.write_ahead(ctx)
    swap.put_away(ctx, range(GEO.num_token_chunks))
    assert C.paged.pools.reserved_bytes <= 4 * BLOCK_PAGES * max(
        p.page_bytes for p in C.paged.pools.pools.values())     # compacted after the drops
    refs, _ = flash_refs(C, range(GEO.num_token_chunks), [])
    want = pages_to_read(C, refs)
    assert sum(want.values()) == GEO.num_chunks * GEO.heads_per_group
    gens = {lv: p.generation for lv, p in C.paged.pools.pools.items()}
    W = ContextKV(GEO, torch.float32, "cpu")
    load(NO_MODEL, ctx.tokens, C, W, ctx.tier, LoadRequest(read=range(GEO.num_token_chunks)),
         LoadOptions(pipeline=False, io_threads=4))
    for lv, p in C.paged.pools.pools.items():
        assert p.generation - gens[lv] <= 1 and p.expect == 0
        assert p.held == want.get(lv, 0)
    assert C.nbytes == C.recount()
    _expect_working(C, W, list(range(GEO.num_token_chunks)))


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("dim", [64, 31, 30])
def test_the_dequantization_kernel_equals_dequantize_at_any_head_dim(bits, dim):
    """The numba kernel reads a byte at a time (two int4 or four int2 values per byte); a head
    dimension that does not fill its last byte takes the per-value tail. Bit for bit
    :func:`dequantize` at every level and width."""
    from sparkv.cache.levels import quantize
    from sparkv.device.dequant import dequantize_into

    gen = torch.Generator().manual_seed(dim * bits)
    hg, n, T, ts = 2, 5, 8, [0, 2, 3]
    x = quantize(torch.randn(len(ts) * hg * n, dim, generator=gen) * 3, bits)
    dst = torch.zeros(hg, 4 * T, dim)
    dequantize_into(dst, x, 0, ts, n, T)
    want = dequantize(x, torch.float32).view(len(ts), hg, n, dim)
    for i, t in enumerate(ts):
        assert torch.equal(dst[:, t * T:t * T + n], want[i]), (i, t)
    untouched = [p for p in range(4 * T) if not any(t * T <= p < t * T + n for t in ts)]
    assert not dst[:, untouched].any()
