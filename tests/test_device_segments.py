"""LLMS's contiguous swap layout (issue 29): a batch of a context's token chunks is one segment file
of aligned SKVT records, read back in runs of adjacent records (one request each).

Segments round-trip bit for bit at every level (against the per-chunk files of the baselines), a
switch reads once per run (counted on the tier), damaged records are recomputed with the answer
unchanged, a reopened service re-attaches the records of every segment (newest per chunk), a
segment whose records are all dead is deleted, and the planner counts reads, not chunk files."""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest
import torch

from sparkv.cache import ChunkPayload, ContextKV, FlashRef, Residency, Source
from sparkv.cache.payload import contiguous_positions
from sparkv.device import ContextService
from sparkv.device.config import ServiceConfig
from sparkv.device.flashio import (IOProfile, ServiceFlash, plan_runs,
                                   read_token_chunk_record, run_starts, walk_segment)
from sparkv.device.loader import FileReads, LoadOptions, LoadRequest, load, token_chunk_ids
from sparkv.device.planner import MissingChunk, RecomputeProfile, plan_split
from sparkv.device.registry import DeviceContext
from sparkv.device.swap import SwapStore
from sparkv.layout import ChunkGeometry
from helpers import flash_profile, same_payloads

FAST_FLASH = flash_profile(fast=True)
DOC = [(7 * i + 3) % 120 + 1 for i in range(150)]
#: 10 token chunks of 3 layers, 2 KV heads of 32 dims (one group), the last one partial
GEO = ChunkGeometry(16 * 9 + 7, 16, 3, 2, 32, 2)
LEVELS = ["fp", "int8", "int4", "int2", "k8v4"]
NO_MODEL = types.SimpleNamespace(device=torch.device("cpu"))   # loads that recompute nothing


def _context(root: Path, contiguous: bool, seed: int = 0) -> tuple[SwapStore, DeviceContext]:
    """A context of :data:`GEO` whose chunks cycle through every level, all modified."""
    swap = SwapStore(root, contiguous=contiguous)
    ctx = DeviceContext("c0ffee", list(range(GEO.num_tokens)), None, swap.tier("c0ffee"))
    C = ContextKV(GEO, torch.float32, "cpu", paged=True)
    gen = torch.Generator().manual_seed(seed)
    for t in range(GEO.num_token_chunks):
        n = GEO.chunk_len(t)
        for cid in token_chunk_ids(GEO, t):
            k, v = (torch.randn(2 * n, 32, generator=gen) for _ in range(2))
            p = ChunkPayload(cid, "fp", [n] * 2, contiguous_positions([n] * 2, t * 16), k, v,
                             torch.float32)
            lv = LEVELS[t % 5]
            C.put_payload(p if lv == "fp" else p.at_level(lv), Source.COMPUTED)
    ctx.memory = C
    ctx.modified.update(range(GEO.num_token_chunks))
    return swap, ctx


def _payloads(C: ContextKV) -> dict:
    out = {}
    for cid, p in C.resident_payloads().items():
        out[cid] = (p.level, [x for s in (p.k, p.v) for x in
                              ([s] if p.level == "fp" else [s.codes, s.scale, s.zero])])
    return out


def _read_all(ctx: DeviceContext) -> tuple[ContextKV, object]:
    W = ContextKV(GEO, torch.float32, "cpu", spare_tokens=8)
    stats = load(NO_MODEL, ctx.tokens, ctx.memory, W, ctx.tier,
                 LoadRequest(read=range(GEO.num_token_chunks)), LoadOptions(pipeline=False))
    return W, stats


# ---- the layout ----------------------------------------------------------------------------------
def test_segment_round_trip_equals_the_per_chunk_files_bit_for_bit(tmp_path):
    seg_swap, seg = _context(tmp_path / "seg", contiguous=True)
    file_swap, per = _context(tmp_path / "files", contiguous=False)
    before = _payloads(seg.memory)
    assert {lv for lv, _ in before.values()} == set(LEVELS)
    assert seg_swap.write_ahead(seg) > 0 and file_swap.write_ahead(per) > 0
    names = sorted(p.name for p in seg.tier.root.iterdir())
    assert names == ["seg-00000001.skvs"]                  # one write ahead: one segment
    assert len(list(per.tier.root.glob("*.skvt"))) == GEO.num_token_chunks
    # the records: ascending token chunks at aligned offsets, each the chunk file's bytes
    records = list(walk_segment(seg.tier.root / names[0], seg.tier.align))
    assert [int(h["t"]) for _, h in records] == list(range(GEO.num_token_chunks))
    for (ref, _), t in zip(records, range(GEO.num_token_chunks)):
        assert ref.offset % seg.tier.align == 0
        assert seg.memory.state(token_chunk_ids(GEO, t)[0]).flash == ref
        assert seg.tier.read(ref) == (per.tier.root / f"{t}.skvt").read_bytes()
    for swap, ctx in ((seg_swap, seg), (file_swap, per)):
        freed, written = swap.put_away(ctx, range(GEO.num_token_chunks))
        assert freed > 0 and written == 0 and not ctx.memory.resident_payloads()
    W_seg, s_seg = _read_all(seg)
    W_per, s_per = _read_all(per)
    assert s_seg.read_chunks == s_per.read_chunks == GEO.num_token_chunks
    assert s_seg.faults == s_per.faults == 0
    for l in range(GEO.num_layers):  # noqa: E741
        assert torch.equal(W_seg.layers[l].k, W_per.layers[l].k)
        assert torch.equal(W_seg.layers[l].v, W_per.layers[l].v)
    same_payloads(_payloads(seg.memory), before)                   # swapped back in, bit for bit
    same_payloads(_payloads(per.memory), before)


def test_a_switch_reads_once_per_run(tmp_path):
    swap, ctx = _context(tmp_path / "seg", contiguous=True)
    swap.write_ahead(ctx)
    swap.put_away(ctx, range(GEO.num_token_chunks))
    tier = ctx.tier
    r0 = tier.reads
    _, stats = _read_all(ctx)
    assert tier.reads - r0 == stats.reads == 1 and stats.files_read == 1     # one run: one read
    # capped runs: as many reads as runs, every record still read
    refs = {t: ctx.memory.state(token_chunk_ids(GEO, t)[0]).flash
            for t in range(GEO.num_token_chunks)}
    cap = 8 * tier.align
    runs = plan_runs(refs, tier.align, cap)
    assert 1 < len(runs) < GEO.num_token_chunks
    assert all(r.nbytes <= cap or len(r.records) == 1 for r in runs)   # a larger record alone
    assert sorted(t for r in runs for t, _ in r.records) == list(range(GEO.num_token_chunks))
    swap.put_away(ctx, range(GEO.num_token_chunks))
    W = ContextKV(GEO, torch.float32, "cpu")
    reads = FileReads(ctx.memory, W, tier, refs, threads=4, run_bytes=cap)
    r0 = tier.reads
    reads.start()
    reads.close()
    assert tier.reads - r0 == reads.reads == len(runs) and not reads.failed
    # a gap (a chunk not read) splits a run; per-chunk files are a read each
    gap = {t: r for t, r in refs.items() if t != 4}
    assert len(plan_runs(gap, tier.align)) == 2
    fswap, per = _context(tmp_path / "files", contiguous=False)
    fswap.write_ahead(per)
    fswap.put_away(per, range(GEO.num_token_chunks))
    r0 = per.tier.reads
    _, stats = _read_all(per)
    assert per.tier.reads - r0 == stats.reads == GEO.num_token_chunks


def test_run_starts_and_the_planner_count_reads_not_chunks():
    seg = [FlashRef("s", 5000, i * 8192) for i in range(4)]
    assert run_starts(seg, 4096) == [1, 0, 0, 0]
    assert run_starts([seg[0], None, seg[2], seg[3]], 4096) == [1, 0, 1, 0]
    assert run_starts(seg, 4096, cap=2 * 8192) == [1, 0, 1, 0]
    files = [FlashRef(f"{i}.skvt", 5000) for i in range(4)]
    assert run_starts(files, 4096) == [1, 1, 1, 1]
    io = IOProfile(read_Bps=1e9, per_file_s=1e-3, threads=1)
    assert io.seconds(2, 0) == pytest.approx(2e-3)

    class Flat:                        # every recomputation costs 1 s: the planner reads all
        def predict_ms(self, f):
            return np.full(len(f.query_tokens), 1e3)

    re = RecomputeProfile(Flat(), 1, 16)
    for reads, want in (([1, 0, 0, 0], 1e-3), ([1, 1, 1, 1], 4e-3)):
        missing = [MissingChunk(t, "int8", r, 0, True) for t, r in enumerate(reads)]
        split = plan_split(missing, 64, 0, io, re)
        assert split.read == [0, 1, 2, 3] and split.io_s == pytest.approx(want)
    # a suffix that starts inside a run still pays one read for its first chunk
    cheap = RecomputeProfile(Flat(), 1, 16)
    cheap.scale = 1e-6
    missing = [MissingChunk(t, "int8", r, 0, True) for t, r in enumerate([1, 0, 0, 0])]
    split = plan_split(missing, 64, 0, IOProfile(read_Bps=1e9, per_file_s=10.0, threads=1), cheap)
    assert split.read == [] and split.recompute == [0, 1, 2, 3]


# ---- lifetime ------------------------------------------------------------------------------------
def _touch(C: ContextKV, ts: range) -> None:
    """Token chunks ``ts`` modified (the same payloads put again: dirty)."""
    for t in ts:
        for cid in token_chunk_ids(C.geometry, t):
            C.put_payload(C.state(cid).payload, Source.COMPUTED)


def test_a_segment_whose_records_are_all_dead_is_deleted(tmp_path):
    swap, ctx = _context(tmp_path, contiguous=True)
    C = ctx.memory
    swap.write_ahead(ctx)
    first = ctx.tier.root / "seg-00000001.skvs"
    assert ctx.tier.live_records() == {first.name: GEO.num_token_chunks}
    # chunks 0-4 re-written (modified, then put away): a second segment; the first keeps 5-9
    _touch(C, range(5))
    swap.put_away(ctx, range(5))
    assert ctx.tier.live_records() == {first.name: 5, "seg-00000002.skvs": 5}
    # the rest re-written: the first segment has no live record left, and is gone
    _touch(C, range(5, GEO.num_token_chunks))
    swap.write_token_chunks(ctx, range(5, GEO.num_token_chunks))
    assert not first.exists()
    assert sorted(p.name for p in ctx.tier.root.iterdir()) == ["seg-00000002.skvs",
                                                               "seg-00000003.skvs"]
    # inside a batch the dead segment goes only once the batch is durable
    with ctx.tier.batch():
        swap.forget_flash(ctx, range(5))
        assert (ctx.tier.root / "seg-00000002.skvs").exists()
    assert not (ctx.tier.root / "seg-00000002.skvs").exists()
    # dropped from flash: nothing left
    swap.forget(ctx)
    assert list(ctx.tier.root.iterdir()) == [] and ctx.tier.live_records() == {}
    assert all(C.residency(c) == Residency.ABSENT for c in GEO.chunk_ids())


def test_a_grown_contexts_partial_chunk_record_dies(tiny_llama, tmp_path):
    svc = ContextService(tiny_llama, 64 << 20, tmp_path / "s", io_profile=FAST_FLASH)
    cid = svc.new_context(system_ids=DOC[:70])               # 5 chunks, the last partial
    tier = svc.contexts[cid].tier
    for i in range(4):
        svc.call(cid, prompt_ids=[5 + i, 6, 7], max_new_tokens=4)
        C = svc.contexts[cid].memory
        live = sum(tier.live_records().values())
        assert live == C.geometry.num_token_chunks           # one live record per chunk
        refs = {C.state(token_chunk_ids(C.geometry, t)[0]).flash
                for t in range(C.geometry.num_token_chunks)}
        assert {Path(r.path).name for r in refs} == set(tier.live_records())
        assert sorted(p.name for p in tier.root.iterdir()) == sorted(tier.live_records())


# ---- damage and reopening ------------------------------------------------------------------------
def _answers(svc, cid, n=3):
    return [svc.call(cid, prompt_ids=[9 + i, 10, 11], max_new_tokens=5, grow=False).tokens
            for i in range(n)]


@pytest.mark.parametrize("damage", ["flip", "truncate", "torn"])
def test_damaged_segment_records_are_recomputed_and_answers_unchanged(tiny_llama, tmp_path,
                                                                      damage):
    ref = ContextService(tiny_llama, 64 << 20, tmp_path / "ref", io_profile=FAST_FLASH,
                         compression="fp", keep_working=False)
    svc = ContextService(tiny_llama, 64 << 20, tmp_path / "bad", io_profile=FAST_FLASH,
                         compression="fp", keep_working=False)
    a, b = ref.new_context(system_ids=DOC), svc.new_context(system_ids=DOC)
    want = _answers(ref, a, 1)
    svc.swap_out(b)
    tier = svc.contexts[b].tier
    (seg,) = tier.segments()
    records = list(walk_segment(seg, tier.align))
    n = len(records)
    data = bytearray(seg.read_bytes())
    if damage == "flip":                     # a byte of a middle record's body
        r = records[n // 2][0]
        data[r.offset + r.nbytes // 2] ^= 0x40
        bad = {n // 2}
    elif damage == "truncate":               # the file cut inside its last record
        r = records[-1][0]
        del data[r.offset + r.nbytes // 2:]
        bad = {n - 1}
    else:                                    # a torn tail: the last two records' bytes lost
        r = records[-2][0]
        data[r.offset + 100:] = bytes(len(data) - r.offset - 100)
        bad = {n - 2, n - 1}
    seg.write_bytes(bytes(data))
    svc.recompute.scale = 1e6                # read what can be read
    got = svc.call(b, prompt_ids=[9, 10, 11], max_new_tokens=5, grow=False)
    assert got.load.faults == len(bad), got.load
    assert got.load.read_chunks == n - len(bad)
    assert got.tokens == want[0]
    assert svc.stats()["budget_violations"] == 0


def test_reopen_reattaches_every_segments_records(tiny_llama, tmp_path):
    swap = tmp_path / "s"
    svc = ContextService(tiny_llama, 64 << 20, swap, io_profile=FAST_FLASH, compression="fp",
                         keep_working=False)
    cid = svc.new_context(system_ids=DOC[:96])               # 6 full chunks
    svc.call(cid, prompt_ids=[5, 6, 7], max_new_tokens=4)     # a second segment (the new tail)
    C = svc.contexts[cid].memory
    tier = svc.contexts[cid].tier
    # chunk 1 re-written alone: a third segment supersedes its record in the first
    for c in token_chunk_ids(C.geometry, 1):
        C.set_level(c, "int8")
    svc.swap_out(cid)
    assert len(tier.segments()) == 3
    svc.recompute.scale = 1e6                # read what can be read
    want = _answers(svc, cid, 1)
    assert len(tier.segments()) == 3         # nothing modified: nothing written
    kept = {c: C.state(c).flash for c in C.geometry.chunk_ids()}
    full = C.geometry.num_tokens // 16
    # a stray dead segment (no record the journal's context uses) and a damaged header
    stray = tier.root / "seg-00000099.skvs"
    stray.write_bytes(b"\0" * 8192)
    again = ContextService(tiny_llama, 64 << 20, swap, io_profile=FAST_FLASH, compression="fp",
                           keep_working=False)
    assert again.reopened == 1 and not again.damaged
    C2 = again.contexts[cid].memory
    for c in C2.geometry.chunk_ids():
        if c.t < full:
            assert C2.residency(c) == Residency.FLASH and C2.state(c).flash == kept[c], c
    assert C2.level(token_chunk_ids(C2.geometry, 1)[0]) == "int8"    # the newest record
    assert not stray.exists()
    assert sum(again.contexts[cid].tier.live_records().values()) == full
    again.recompute.scale = 1e6
    got = again.call(cid, prompt_ids=[9, 10, 11], max_new_tokens=5, grow=False)
    assert got.load.faults == 0 and got.load.read_chunks == full
    assert got.load.reads == 3            # chunk 0; 2-5 (1 died between); 1 (the newest)
    assert got.tokens == want[0]


def test_reopen_walks_past_a_damaged_header(tmp_path):
    swap, ctx = _context(tmp_path, contiguous=True)
    swap.write_ahead(ctx)
    (seg,) = ctx.tier.segments()
    records = list(walk_segment(seg, ctx.tier.align))
    data = bytearray(seg.read_bytes())
    data[records[3][0].offset] ^= 0xFF                      # "SKVT" of record 3 broken
    seg.write_bytes(bytes(data))
    walked = [int(h["t"]) for _, h in walk_segment(seg, ctx.tier.align)]
    assert walked == [t for t in range(GEO.num_token_chunks) if t != 3]
    # reopened: every other full chunk attached, 3 is not
    tier = ServiceFlash(ctx.tier.root)
    fresh = DeviceContext(ctx.id, ctx.tokens, None, tier)
    C = ContextKV(GEO, torch.float32, "cpu", paged=True)
    assert swap.attach(fresh, C) == GEO.num_token_chunks - 2    # 3 and the partial last
    assert C.residency(token_chunk_ids(GEO, 3)[0]) == Residency.ABSENT
    f = read_token_chunk_record(tier.read(C.state(token_chunk_ids(GEO, 5)[0]).flash), 5)
    assert f.level == LEVELS[5 % 5]


def test_the_baselines_keep_one_file_per_chunk(tiny_llama, tmp_path):
    svc = ContextService(tiny_llama, 64 << 20, tmp_path / "q",
                         config=ServiceConfig.preset("vllm-sq"), io_profile=FAST_FLASH)
    assert not svc.config.contiguous and not svc.swap.contiguous
    cid = svc.new_context(system_ids=DOC[:64])
    svc.swap_out(cid)
    names = sorted(p.name for p in svc.contexts[cid].tier.root.iterdir())
    assert names == [f"{t}.skvt" for t in range(4)]
    got = svc.call(cid, prompt_ids=[5, 6, 7], max_new_tokens=2, grow=False)
    assert got.load.reads == got.load.files_read == got.load.read_chunks == 4
