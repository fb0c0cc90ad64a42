"""DynaKV's write amplification and read latency (sparkv.decode): shared tail pages instead of
padded flushes of the write buffers, and the prefetch margin below the selection cut-off.

Store-level checks use SmolLM2's geometry (64-dim fp32 records, 8 a page) on real page files;
the policy-level checks drive :class:`ClusteredKV` with tests/test_dynakv.py's drifting keys; the
tiny random Llama checks that neither change alters the output when the budget holds everything.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_dynakv_step import _drive, _make

from sparkv.decode import ClusteredKV, generate
from sparkv.decode.store import PAGE, ClusterStore, IOStats
from sparkv.runtime import greedy_generate, reference_prefill


def _cold(tmp_path, pack: bool, clusters: int = 12, steps: int = 120, seed: int = 3
          ) -> tuple[ClusterStore, IOStats, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """``clusters`` prefill clusters of 5 entries, then ``steps`` new entries spread over them at
    random (cold clusters: their tails rarely fill a page, so the write-buffer cap, 10 entries,
    forces flushes). Returns the store, its counters and position -> (k, v) of every entry."""
    io = IOStats()
    st = ClusterStore(tmp_path / f"cold{int(pack)}.pages", 1, 64, torch.float32, io,
                      max_cluster=64, dual_head=True, write_buffer=10, pack_tails=pack)
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    truth: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    groups = []
    for c in range(clusters):
        k, v = torch.randn(5, 64, generator=g), torch.randn(5, 64, generator=g)
        pos = np.arange(5 * c, 5 * c + 5)
        for i, p in enumerate(pos):
            truth[int(p)] = (k[i], v[i])
        groups.append((k, v, pos))
    uids = st.place(0, groups)
    p = 5 * clusters
    for _ in range(steps):
        k, v = torch.randn(1, 64, generator=g), torch.randn(1, 64, generator=g)
        st.add(st.units[int(rng.choice(uids))], k, v, np.array([p]))
        truth[p] = (k[0], v[0])
        p += 1
    st.file.flush()
    return st, io, truth


def _decode_wa(io: IOStats) -> tuple[int, int]:
    snap = io.snapshot()
    phys = sum(v for k, v in snap["write_bytes"].items() if k != "prefill")
    logical = sum(v for k, v in snap["logical_bytes"].items() if k != "prefill")
    return phys, logical


def test_shared_tail_pages_write_no_padding_where_padded_flushes_do(tmp_path):
    wa = {}
    for pack in (False, True):
        st, io, _ = _cold(tmp_path, pack)
        try:
            phys, logical = _decode_wa(io)
            wa[pack] = phys / logical
            snap = io.snapshot()
            if pack:
                assert snap["write_bytes"].get("tailpack", 0) > 0 and "cold" not in snap["write_bytes"]
                # every decode-time page is full: physical bytes equal the logical ones exactly
                assert phys == logical
                assert st.tail_pages * PAGE == snap["write_bytes"]["tailpack"]
            else:
                assert snap["write_bytes"].get("cold", 0) > 0
            # the write buffers stay under their cap either way
            assert st.tail_entries <= st.tail_cap
        finally:
            st.close()
    assert wa[True] == 1.0 and wa[False] > 1.1


def test_shared_tail_pages_never_rewrite_and_keep_every_entry(tmp_path):
    st, io, truth = _cold(tmp_path, pack=True)
    try:
        # each page written once: the file's record of written pages matches the bytes written,
        # and a second write of any page raises
        snap = io.snapshot()
        assert st.file.pages_written * PAGE == sum(snap["write_bytes"].values())
        assert len(st.file.hashes) == st.file.pages_written
        with pytest.raises(Exception, match="never rewritten"):
            st.file.write(next(iter(st.file.hashes)), bytes(PAGE), "test")
        # a shared page holds entries of several clusters
        shared = {}
        for u in st.units.values():
            for pg in set((u.addr // st.rec.per_page).tolist()):
                shared.setdefault(pg, set()).add(u.uid)
        assert any(len(owners) > 1 for owners in shared.values())
        # flushed (read back from flash) + tails partition every entry, with the right bytes
        got = st.fetch(list(st.units), "retrieve")
        seen: list[int] = []
        for uid, u in st.units.items():
            parts = []
            if uid in got:
                parts.append(got[uid])
            if u.tail:
                parts.append((u.tail_k, u.tail_v, u.tail_pos))
            for k, v, pos in parts:
                for i, p in enumerate(pos.tolist()):
                    tk, tv = truth[p]
                    assert torch.equal(k[i], tk) and torch.equal(v[i], tv)
                    seen.append(p)
        assert sorted(seen) == sorted(truth)
    finally:
        st.close()


def test_decoding_write_amplification_is_one_with_shared_tail_pages(tmp_path):
    wa = {}
    for pack in (False, True):
        # 32 records a page here (16-dim fp32): a cap of 2 x 16 entries per layer forces flushes
        kv, syn = _make(tmp_path, "dynakv", steps=60, queries=None, pack_tails=pack,
                        write_buffer=16)
        try:
            _drive(kv, syn, 60, lambda kv, t: kv.check())
            kv.flush()
            phys, logical = _decode_wa(kv.io)
            wa[pack] = phys / logical
            assert ("tailpack" in kv.io.snapshot()["write_bytes"]) == pack
        finally:
            kv.close()
    assert wa[True] == pytest.approx(1.0) and wa[False] > wa[True]


def test_the_prefetch_margin_stays_within_its_budget(tmp_path):
    margin = 10
    kv, syn = _make(tmp_path, "dynakv", queries=None, prefetch_margin=margin)
    checked = [0]

    def each(kv: ClusteredKV, t: int) -> None:
        for layer in kv.layers:
            near = layer.residency.near_cutoff(margin)
            by_head: dict[int, int] = {}
            for uid in near:
                u = layer.store.units[uid]
                assert u.flushed > 0 and (layer.l, uid) not in kv.cache
                by_head[u.head] = by_head.get(u.head, 0) + u.flushed
                # below the cut-off: not what that head selected
                assert uid not in layer.residency.last_selected[u.head]
            assert all(n <= margin for n in by_head.values())
            checked[0] += len(near)

    try:
        _drive(kv, syn, 24, each)
        # the fixed RAM reserves the margin's staging, and the staging peak stays within it
        per_layer = (kv.budget_for(kv.final_tokens) + margin) * kv.entry_bytes * kv.H
        assert kv.counters.staging_peak <= per_layer
        assert checked[0] > 0
        st = kv.io.snapshot()
        assert st["read_ops"].get("prefetch", 0) > 0
    finally:
        kv.close()


def test_the_prefetch_margin_moves_reads_off_the_critical_path(tmp_path):
    """Same stream, margin off vs on: with the margin, a smaller share of the selected clusters
    is read on the critical path. (The selections may differ slightly: a staged cluster is in RAM
    while the new entries join, so it can split at once instead of buffering.)"""
    res = {}
    for margin in (0, 24):
        misses = selected = staged = 0
        for seed in range(3):                  # three clusterings of the same stream
            kv, syn = _make(tmp_path, "dynakv", queries=None, prefetch_margin=margin,
                            ram_budget=30_000, seed=seed)
            try:
                _drive(kv, syn, 30, lambda kv, t: kv.check())
                c = kv.counters
                misses += c.misses
                selected += c.hits + c.prefetch_hits + c.misses
                staged += c.prefetch_hits
            finally:
                kv.close()
        res[margin] = (misses / selected, staged)
    assert res[24][1] > res[0][1] and res[24][0] < res[0][0]


@pytest.mark.parametrize("policy", ["dynakv", "local"])
def test_a_budget_holding_everything_still_decodes_like_full_kv(tiny_llama, tmp_path, policy):
    """Small write buffers (tails packed into shared pages) and a prefetch margin larger
    than any cluster change nothing when the budget holds everything."""
    torch.manual_seed(4)
    n = 80
    ids = torch.randint(0, 128, (n,)).tolist()
    with torch.inference_mode():
        layers = reference_prefill(tiny_llama, ids)
    question = [3, 9, 27]
    want = greedy_generate(tiny_llama, layers, n, question, max_new_tokens=24, stop_at_eos=False)
    got, st = generate(tiny_llama, layers, n, question, 24, kv_policy=policy, budget=1.0,
                       ram_budget=None, stop_at_eos=False, flash_dir=tmp_path, probe=True,
                       avg_cluster=8, max_cluster=16, recent=8, write_buffer=16,
                       prefetch_margin=64, pack_tails=True)
    assert got.tokens == want.tokens
    if policy == "dynakv":      # (local's waiting entries are not clustered within 24 tokens)
        assert st.reads["write_bytes"].get("tailpack", 0) > 0 and st.write_amplification == 1.0
    assert st.recall == pytest.approx(1.0, abs=1e-6)
    assert st.output_error < 1e-4


def test_generate_returns_its_stats_after_its_page_writes(tiny_llama, tmp_path, monkeypatch):
    """Page writes run on the policy's I/O thread; ``generate`` joins them before it reports:
    the physical bytes in its stats are the bytes that reached the page files. Each decode-time
    write is slowed here (a loaded disk), so that writes are still queued when decoding ends."""
    import threading
    import time

    from sparkv.decode.store import PageFile

    written: list[int] = []
    lock = threading.Lock()
    real = PageFile._pwrite

    def slow_pwrite(self, first, data, reason):
        if reason != "prefill":
            time.sleep(0.3)
        real(self, first, data, reason)
        with lock:
            written.append(len(data))

    monkeypatch.setattr(PageFile, "_pwrite", slow_pwrite)
    torch.manual_seed(4)
    n = 80
    ids = torch.randint(0, 128, (n,)).tolist()
    with torch.inference_mode():
        layers = reference_prefill(tiny_llama, ids)
    _, st = generate(tiny_llama, layers, n, [3, 9, 27], 24, kv_policy="dynakv", budget=1.0,
                     ram_budget=None, stop_at_eos=False, flash_dir=tmp_path, avg_cluster=8,
                     max_cluster=16, recent=8, write_buffer=16, pack_tails=True)
    with lock:
        on_disk = sum(written)
    assert st.reads["write_bytes"].get("tailpack", 0) > 0
    assert sum(st.reads["write_bytes"].values()) == on_disk
    assert st.prefill_write_bytes + st.flash_write_bytes == on_disk
    assert st.write_amplification == 1.0
