"""The paged KV memory (sparkv/cache/pages.py, blocks.py, paged.py): pages round-trip bit for bit
against the payload layout at every level (ragged, pruned and empty heads), bulk operations equal
their chunk-by-chunk versions, the page budget is never exceeded, and compaction keeps every
chunk's entries."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from sparkv.cache import (ChunkPayload, ContextKV, FlashTier, KVMemoryError, PagePool,
                          PagePoolFull, PagePools, Source, to_bytes)
from sparkv.cache.blocks import page_fill, row_slots
from sparkv.cache.levels import reachable
from sparkv.cache.pages import BLOCK_PAGES, PAGE_TOKENS
from sparkv.cache.payload import contiguous_positions
from sparkv.layout import ChunkGeometry, KVChunkId

D = 64
T = 64
GEO = ChunkGeometry(5 * T - 20, T, 2, 4, D, 2)       # 5 token chunks (the last short), 2 groups
COUNTS = [0, 1, 15, 16, 17, 33, 40, T]               # per head: empty, partial and full pages


def _payload(cid: KVChunkId, level: str, seed: int, dtype=torch.float32,
             counts: list[int] | None = None) -> ChunkPayload:
    """A chunk keeping ``counts`` random positions per head (ragged), at ``level``."""
    g = torch.Generator().manual_seed(seed)
    t0, t1 = GEO.token_range(cid.t)
    if counts is None:
        counts = [min(random.Random(seed + h).choice(COUNTS), t1 - t0)
                  for h in range(GEO.heads_per_group)]
    pos = torch.cat([torch.sort(torch.randperm(t1 - t0, generator=g)[:n]).values + t0
                     for n in counts]).to(torch.int32)
    n = sum(counts)
    k = (torch.randn(n, D, generator=g) * 3).to(dtype)
    v = torch.randn(n, D, generator=g).to(dtype)
    return ChunkPayload(cid, "fp", counts, pos, k, v, dtype).at_level(level)


def _same(a: ChunkPayload, b: ChunkPayload) -> None:
    """Bit for bit: the byte form holds every field (counts, positions, values or codes, scales
    and zeros)."""
    assert a.cid == b.cid and a.level == b.level and list(a.counts) == list(b.counts)
    assert to_bytes(a) == to_bytes(b)


@pytest.mark.parametrize("level,dtype", [("fp", torch.float32), ("fp", torch.float16),
                                         ("fp", torch.bfloat16), ("int8", torch.float32),
                                         ("int4", torch.float32), ("int2", torch.float32),
                                         ("k8v4", torch.float32)])
def test_pages_round_trip_bit_for_bit(level, dtype):
    mem = ContextKV(GEO, dtype, paged=True)
    payloads = [_payload(cid, level, seed=i, dtype=dtype) for i, cid in enumerate(GEO.chunk_ids())]
    mem.put_payloads(payloads, Source.STREAMED)
    for p in payloads:
        _same(mem.read(p.cid), p)
        assert mem.kept(p.cid) == tuple(p.counts)
    runs = mem.read_runs([p.cid for p in payloads])              # one gather per level
    got = {q.cid: q for run in runs for q in run.payloads()}
    for p in payloads:
        _same(got[p.cid], p)
    # the pages held: ceil(count / 16) per head, and the account is their bytes
    pages = sum(-(-c // PAGE_TOKENS) for p in payloads for c in p.counts)
    assert mem.nbytes == mem.recount() == pages * mem.paged.pools[level].page_bytes


def test_mixed_levels_and_relevel_runs_equal_chunk_by_chunk():
    one, bulk = (ContextKV(GEO, paged=True) for _ in range(2))
    payloads = [_payload(cid, "fp", seed=i) for i, cid in enumerate(GEO.chunk_ids())]
    one.put_payloads(payloads)
    bulk.put_payloads(payloads)
    cids = list(GEO.chunk_ids())
    for step, (level, sel) in enumerate([("int8", cids[::2]), ("k8v4", cids[1::3]),
                                         ("int4", cids[::3]), ("int2", cids[1::4]),
                                         ("fp", cids[::5])]):
        sel = [c for c in sel if reachable(one.level(c), level)]
        for c in sel:
            one.set_level(c, level)
        bulk.set_levels(sel, level)
        for c in cids:
            _same(bulk.read(c), one.read(c))
    assert bulk.nbytes == one.nbytes == bulk.recount()


def test_pruned_pages_keep_their_levels_and_exactly_the_kept_rows():
    mem = ContextKV(GEO, paged=True)
    full = [_payload(cid, "fp", seed=i, counts=[GEO.chunk_len(cid.t)] * 2)
            for i, cid in enumerate(GEO.chunk_ids())]
    mem.put_payloads(full)
    layer1 = [c for c in GEO.chunk_ids() if c.l == 1]
    mem.set_levels(layer1[::2], "int8")
    mem.set_levels(layer1[1::3], "int4")
    before = {c: mem.read(c) for c in layer1}
    g = torch.Generator().manual_seed(7)
    keep = [torch.randperm(GEO.num_tokens, generator=g)[:n] for n in (0, 30, 150, GEO.num_tokens)]
    mem.prune_pages(1, keep)
    assert mem.layers[1] is None                                  # still paged
    for c in layer1:
        p, q = before[c], mem.read(c)
        assert q.level == p.level
        rows = torch.cat([torch.isin(p.pos[sl].long(), keep[c.g * 2 + i])
                          for i, sl in enumerate(p.head_slices())])
        want = ChunkPayload(c, p.level, [int(rows[sl].sum()) for sl in p.head_slices()],
                            p.pos[rows], *(_rows(x, rows) for x in (p.k, p.v)), p.dtype)
        _same(q, want)
    assert mem.nbytes == mem.recount()


def _rows(x, rows):
    from sparkv.cache.levels import QuantizedTensor

    if isinstance(x, QuantizedTensor):
        return QuantizedTensor(x.codes[rows], x.scale[rows], x.zero[rows], x.bits, x.dim)
    return x[rows]


def test_arena_pages_and_back_are_exact():
    g = torch.Generator().manual_seed(3)
    mem = ContextKV(GEO)
    for cid in GEO.chunk_ids():
        n = GEO.chunk_len(cid.t)
        mem.put(cid, torch.randn(2, n, D, generator=g), torch.randn(2, n, D, generator=g))
    dense = [(k.clone(), v.clone()) for k, v in mem.layer_kv()]
    for l in range(GEO.num_layers):  # noqa: E741
        mem.to_pages(l)                       # one gather, one page write
        mem.materialize(l)                   # one read, one scatter
    for (k, v), (k0, v0) in zip(mem.layer_kv(), dense):
        assert torch.equal(k, k0) and torch.equal(v, v0)


def test_paging_a_paged_layer_changes_nothing():
    """to_pages moves an arena into pages once (the layer's version moves); on a layer already
    paged it is a no-op: the version stays, so nothing built over the layer is rebuilt."""
    g = torch.Generator().manual_seed(4)
    mem = ContextKV(GEO)
    for cid in GEO.chunk_ids():
        n = GEO.chunk_len(cid.t)
        mem.put(cid, torch.randn(2, n, D, generator=g), torch.randn(2, n, D, generator=g))
    v0 = mem.layer_version(0)
    mem.to_pages(0)
    v1 = mem.layer_version(0)
    assert v1 != v0 and mem.layers[0] is None
    before = [(e.k.clone(), e.v.clone()) for e in mem.layer_entries(0)]
    mem.to_pages(0)
    assert mem.layer_version(0) == v1
    for e, (k, v) in zip(mem.layer_entries(0), before):
        assert torch.equal(e.k, k) and torch.equal(e.v, v)


def test_the_page_budget_is_never_exceeded(tmp_path):
    """Two contexts share pools under a byte budget: every operation either fits or raises
    PagePoolFull and changes nothing; the pages held never pass the budget."""
    geo = ChunkGeometry(4 * T, T, 2, 2, D, 1)
    probe = PagePools(D)
    budget = 60 * probe["fp"].page_bytes            # 64 fp pages fill one context
    pools = PagePools(D, limit_bytes=budget)
    mems = [ContextKV(geo, paged=True, pools=pools) for _ in range(2)]
    tier = FlashTier(tmp_path)
    rng = random.Random(5)
    refused = 0
    for step in range(150):
        mem = rng.choice(mems)
        cid = rng.choice(list(geo.chunk_ids()))
        op = rng.choice(["put", "put", "level", "drop", "swap", "in"])
        table = {c: mem.state(c).residency for c in geo.chunk_ids()}
        held = pools.held_bytes
        try:
            if op == "put":
                mem.put(cid, torch.randn(1, T, D), torch.randn(1, T, D))
            elif op == "level":
                mem.set_level(cid, rng.choice(["int8", "int4", "fp"]))
            elif op == "drop":
                mem.drop(cid)
            elif op == "swap":
                mem.swap_out(cid, tier, name=f"{id(mem)}.{cid.t}.{cid.l}.{cid.g}")
            else:
                mem.swap_in(cid, tier)
        except PagePoolFull:
            refused += 1
            assert pools.held_bytes == held
            assert {c: mem.state(c).residency for c in geo.chunk_ids()} == table
        except KVMemoryError:
            pass
        assert pools.held_bytes <= budget
        assert pools.held_bytes == sum(m.nbytes for m in mems) == sum(m.recount() for m in mems)
    assert refused > 0                        # the budget was reached


def test_compaction_keeps_every_chunk(tmp_path):
    """Random puts, levels and drops on a memory with its own pools (compacted as pages are
    freed): every resident chunk still reads what was put, and the pools stay near the pages
    held."""
    mem = ContextKV(GEO, paged=True)
    want: dict[KVChunkId, ChunkPayload] = {}
    rng = random.Random(11)
    cids = list(GEO.chunk_ids())
    for step in range(200):
        cid = rng.choice(cids)
        op = rng.choice(["put", "put", "level", "drop"])
        if op == "put":
            p = _payload(cid, rng.choice(["fp", "int8", "int4"]), seed=step)
            mem.put_payload(p)
            want[cid] = p
        elif op == "level" and cid in want and want[cid].level in ("fp", "int8"):
            level = rng.choice(["int8", "int4", "int2", "k8v4"])
            mem.set_level(cid, level)
            want[cid] = want[cid].at_level(level)
        elif op == "drop":
            mem.drop(cid)
            want.pop(cid, None)
        for c, p in want.items():
            _same(mem.read(c), p)
        for pool in mem.paged.pools.pools.values():   # compacted once a quarter free
            assert pool.capacity - pool.held < max(BLOCK_PAGES, pool.capacity // 4)
    assert mem.nbytes == mem.recount()


def test_pool_allocates_lowest_first_grows_by_blocks_and_refuses_double_frees():
    pool = PagePool("int4", D)
    a = pool.alloc(10)
    assert a.tolist() == list(range(10)) and pool.capacity == BLOCK_PAGES
    pool.free(a[2:5])
    assert pool.alloc(2).tolist() == [2, 3]
    b = pool.alloc(BLOCK_PAGES)                            # grows by whole blocks
    assert pool.capacity % BLOCK_PAGES == 0 and pool.held == 10 - 3 + 2 + BLOCK_PAGES
    with pytest.raises(KVMemoryError, match="does not hold"):
        pool.free(np.array([pool.capacity - 1]))            # never allocated
    with pytest.raises(KVMemoryError, match="does not hold"):
        pool.free(np.array([0, 0]))                         # twice
    pool.free(b)
    src, dst = pool.compact()
    assert pool.capacity == BLOCK_PAGES and pool.held == 9 and len(src) == len(dst)
    limited = PagePool("fp", D, limit_pages=3)
    limited.alloc(3)
    with pytest.raises(PagePoolFull):
        limited.alloc(1)


def test_a_pool_grown_in_inference_mode_compacts_outside_it():
    """The model fills the memory under ``torch.inference_mode``; pruning (which frees and
    compacts) runs outside it: the pool's tensors must stay writable in both."""
    pool = PagePool("fp", D)
    with torch.inference_mode():
        ids = pool.alloc(3 * BLOCK_PAGES)
        slots = torch.from_numpy(ids[-1:] * PAGE_TOKENS)
        pool.write_rows(slots, torch.ones(1, D), torch.ones(1, D), torch.zeros(1))
    assert not any(t.is_inference() for t in pool.tensors())
    pool.free(ids[:-1])
    src, dst = pool.compact()
    assert src.tolist() == [ids[-1]] and pool.capacity == BLOCK_PAGES
    assert pool.array("k")[int(dst[0]), 0].eq(1).all()


def test_row_slots_and_fills():
    counts = np.array([0, 1, 16, 17, 40])
    ids = np.arange(100, 100 + 0 + 1 + 1 + 2 + 3)
    slots = row_slots(counts, ids).numpy()
    assert slots[0] == 100 * 16                                     # the 1-row span
    assert (slots[1:17] == 101 * 16 + np.arange(16)).all()          # a full page
    assert slots[17 + 16] == 103 * 16                               # the 17th row: next page
    assert page_fill(counts).tolist() == [1, 16, 16, 1, 16, 16, 8]


def test_a_token_chunk_exports_and_imports_as_one_run(tmp_path):
    """A token chunk at one level (every (l, g), layer-major: a device record's layout) is one
    run out of the pages and one run back in, resident and clean."""
    mem = ContextKV(GEO, paged=True)
    mem.put_payloads([_payload(cid, "int4", seed=i, counts=[GEO.chunk_len(cid.t)] * 2)
                      for i, cid in enumerate(GEO.chunk_ids())])
    tier = FlashTier(tmp_path)
    t2 = [KVChunkId(2, l, g) for l in range(GEO.num_layers)  # noqa: E741
          for g in range(GEO.num_groups)]
    refs = []
    for c in t2:
        mem.swap_out(c, tier, keep_resident=True)
        refs.append(mem.state(c).flash)
    (run,) = mem.read_runs(t2)                                   # one gather: one level
    assert run.cids == t2 and run.rows == sum(sum(mem.kept(c)) for c in t2)
    before = {c: mem.read(c) for c in t2}
    mem.drop_many(t2)
    assert mem.missing(t2) == t2
    mem.swap_in_runs([run], refs)
    for c in t2:
        _same(mem.read(c), before[c])
        assert mem.swap_out(c, tier) == 0                        # clean: nothing to write
    with pytest.raises(KVMemoryError, match="one flash ref per chunk"):
        mem.swap_in_runs([run], refs[:1])


@pytest.mark.parametrize("level", ["fp", "int8", "int4"])
def test_a_run_placed_straight_into_the_pages_equals_its_write(tmp_path, monkeypatch, level):
    """``swap_in_placed`` (rows written by the caller into the new pages: views of the pool's
    rows when the pages are consecutive, else a temporary copied in) holds the chunks exactly
    as they were; a fill that raises holds nothing and frees its pages."""
    mem = ContextKV(GEO, paged=True)
    mem.put_payloads([_payload(cid, level, seed=i, counts=[GEO.chunk_len(cid.t)] * 2)
                      for i, cid in enumerate(GEO.chunk_ids())])
    tier = FlashTier(tmp_path)
    every = list(GEO.chunk_ids())
    before = {c: mem.read(c) for c in every}
    by_t = {t: [KVChunkId(t, l, g) for l in range(GEO.num_layers)  # noqa: E741
                for g in range(GEO.num_groups)] for t in range(GEO.num_token_chunks)}
    for c in every:
        mem.swap_out(c, tier, keep_resident=True)
    runs = {t: mem.read_runs(cids)[0] for t, cids in by_t.items()}
    mem.drop_many(every)
    pool = mem.paged.pools[level]
    views: list[bool] = []
    row_views = pool.row_views
    monkeypatch.setattr(pool, "row_views", lambda s: views.append(row_views(s) is not None)
                        or row_views(s))

    def place(t: int) -> None:
        run, cids = runs[t], by_t[t]
        held = mem.nbytes
        with pytest.raises(RuntimeError, match="refused"):
            mem.swap_in_placed(cids, level, run.counts, run.pos,
                               lambda k, v: (_ for _ in ()).throw(RuntimeError("refused")))
        assert mem.nbytes == held == mem.recount() and mem.missing(cids) == cids

        def fill(k, v):
            for dst, src in ((k, run.k), (v, run.v)):
                for a, b in zip(dst.tensors() if level != "fp" else [dst],
                                src.tensors() if level != "fp" else [src]):
                    a.copy_(b)

        got = mem.swap_in_placed(cids, level, run.counts, run.pos, fill)
        assert got.cids == cids and got.rows == run.rows
        for c in cids:
            _same(mem.read(c), before[c])
            assert mem.swap_out(c, tier) == 0                    # clean: nothing to write
        assert mem.nbytes == mem.recount()

    for t in range(GEO.num_token_chunks):       # an empty pool: consecutive pages, the last
        place(t)                                # chunk short (partial pages: a temporary)
    assert views[-1] is False and any(views)
    mem.drop_many(by_t[2])
    pool.free(pool.alloc(3)[1:2])               # free pages apart: not consecutive
    views.clear()
    place(2)
    assert not any(views)


@pytest.mark.parametrize("head_dim", [64, 30])
def test_the_byte_counts_per_level_are_the_pages_and_payloads_held(head_dim):
    """The service's budget arithmetic (``paged_nbytes``, ``payload_nbytes``) counts what a page
    and a payload of each level hold, k8v4's K and V at their own widths included."""
    from sparkv.cache.levels import LEVELS
    from sparkv.device.loader import paged_nbytes, payload_nbytes

    for level in LEVELS:
        pool = PagePool(level, head_dim)
        assert paged_nbytes(level, PAGE_TOKENS, 1, head_dim, torch.float32) == pool.page_bytes
        p = ChunkPayload(KVChunkId(0, 0, 0), "fp", [5, 4], contiguous_positions([5, 4], 0),
                         torch.randn(9, head_dim), torch.randn(9, head_dim)).at_level(level)
        assert payload_nbytes(level, 9, head_dim, torch.float32) == p.nbytes
