"""The host-RAM tier between the device's KV memory and flash (issue 46, Deliver 4;
sparkv/device/hosttier.py), with the real SmolLM2 and real flash files: a switch-in reads the
records it holds from RAM and only the others from flash, the planner counts them as free reads,
answers are the ones without it, it never holds more than its capacity, and a copy is never
staler than its flash record (records killed, chunk files rewritten, contexts deleted)."""

from __future__ import annotations

import random

import pytest

from sparkv.device import ContextService
from sparkv.device.hosttier import HostTier, default_capacity
from sparkv.runtime.generate import sample_context_ids
from helpers import CHAT_TURNS, flash_profile

FAST_FLASH = flash_profile(fast=True)
SLOW_FLASH = flash_profile(fast=False)


# ---- the tier alone --------------------------------------------------------------------------------
def test_the_least_recently_used_copies_go_first_and_the_capacity_holds():
    h = HostTier(100)
    assert h.put("a", 0, b"x" * 40) and h.put("a", 64, b"y" * 40)
    assert h.get("a", 0, 40) == b"x" * 40              # now the most recently used
    assert h.put("b", 0, b"z" * 40)                    # evicts ("a", 64)
    assert h.get("a", 64, 40) is None and h.holds("a", 0, 40) and h.holds("b", 0, 40)
    assert h.get("a", 0, 39) is None                   # another size: not that record
    assert not h.put("c", 0, b"w" * 101)               # larger than the tier
    st = h.stats()
    assert st.bytes == 80 <= st.capacity_bytes and st.records == 2 and st.evictions == 1
    assert st.hits == 1 and st.misses == 2


def test_a_copy_is_replaced_or_dropped_with_its_record():
    h = HostTier(1 << 20)
    h.put("/f/ctx/seg1", 0, b"old")
    h.put("/f/ctx/seg1", 0, b"new")                    # a chunk file written again
    assert h.get("/f/ctx/seg1", 0, 3) == b"new" and h.stats().bytes == 3
    h.put("/f/ctx/seg1", 4096, b"r2")
    h.put("/f/ctx2/seg1", 0, b"other")
    assert h.drop("/f/ctx/seg1", 0) == 1 and not h.holds("/f/ctx/seg1", 0, 3)
    assert h.drop_under("/f/ctx") == 1                 # not /f/ctx2
    assert h.holds("/f/ctx2/seg1", 0, 5) and h.stats().bytes == 5
    assert h.drop("/f/ctx2/seg1") == 1 and h.stats().bytes == 0
    with pytest.raises(ValueError):
        HostTier(-1)


def test_the_default_capacity_is_none_on_the_cpu_and_bounded_by_free_memory(tmp_path):
    info = tmp_path / "meminfo"
    info.write_text("MemTotal: 100 kB\nMemAvailable:    4000 kB\n")
    assert default_capacity("cpu", 10**9, info) == 0
    assert default_capacity("cuda", 100, info) == 400
    assert default_capacity("cuda", 10**9, info) == 1000 * 1024
    assert default_capacity("cuda", 100, tmp_path / "missing") == 400


# ---- in the service --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def doc(smollm2):
    return sample_context_ids(smollm2, 300)


def _svc(lm, tmp_path, name, host=0, **kw):
    kw.setdefault("io_profile", FAST_FLASH)
    return ContextService(lm, 256 << 20, tmp_path / name, journal=False, ratio=0.6,
                          host_tier_bytes=host, **kw)


def _held_equal_their_files(svc) -> None:
    """Every copy the host tier holds is its live record's bytes on flash."""
    live = {(ref.path, ref.offset) for ctx in svc.contexts.values() if ctx.memory is not None
            for ref in _refs(ctx.memory)}
    for (path, off), data in list(svc.host._held.items()):
        assert (path, off) in live, (path, off)
        with open(path, "rb") as f:
            f.seek(off)
            assert f.read(len(data)) == data


def _refs(C):
    rows = C.by_token()
    return {ref for t in range(rows.flash.shape[0]) for j in range(rows.flash.shape[1])
            if (ref := rows.ref(t, j)) is not None}


def test_a_switch_reads_what_the_host_tier_holds_from_ram(smollm2, doc, tmp_path):
    ref = _svc(smollm2, tmp_path, "ref")
    svc = _svc(smollm2, tmp_path, "host", host=64 << 20)
    a, b = ref.new_context(system_ids=doc), svc.new_context(system_ids=doc)
    for turn in CHAT_TURNS[:2]:
        ref.swap_out(a)
        want = ref.call(a, turn, max_new_tokens=8)
        svc.swap_out(b)
        got = svc.call(b, turn, max_new_tokens=8)
        assert got.tokens == want.tokens
        assert want.load.read_chunks > 0 and want.load.host_chunks == 0 and want.load.reads > 0
        # written ahead (write-through): every record comes back from RAM, none from flash
        assert got.load.read_chunks == want.load.read_chunks == got.load.host_chunks
        assert got.load.reads == 0 and got.load.bytes_read == 0
    st = svc.stats()
    assert st["host_tier"]["hits"] == st["host_chunks"] > 0
    assert st["host_tier"]["bytes"] <= 64 << 20 and st["device"] == "cpu"
    _held_equal_their_files(svc)
    svc.delete(b)
    assert svc.host.stats().bytes == 0                # a deleted context's copies are gone


def test_a_small_host_tier_answers_part_and_flash_the_rest(smollm2, doc, tmp_path):
    big = _svc(smollm2, tmp_path, "big")
    b = big.new_context(system_ids=doc)
    records = sum(r.nbytes for r in {(x.path, x.offset, x.nbytes): x
                                     for x in _refs(big.contexts[b].memory)}.values())
    cap = records // 3
    svc = _svc(smollm2, tmp_path, "small", host=cap)
    c = svc.new_context(system_ids=doc)
    svc.swap_out(c)
    r = svc.call(c, CHAT_TURNS[0], max_new_tokens=8)
    assert 0 < r.load.host_chunks < r.load.read_chunks and r.load.reads > 0
    big.swap_out(b)
    assert r.tokens == big.call(b, CHAT_TURNS[0], max_new_tokens=8).tokens
    st = svc.host.stats()
    assert st.peak_bytes <= cap and st.evictions > 0
    _held_equal_their_files(svc)


def test_the_planner_reads_held_records_where_flash_would_be_recomputed(smollm2, doc, tmp_path):
    """Slow flash: without the host tier the planner recomputes the swapped chunks; with it,
    the records it holds are free reads."""
    slow = _svc(smollm2, tmp_path, "slow", io_profile=SLOW_FLASH)
    held = _svc(smollm2, tmp_path, "held", host=64 << 20, io_profile=SLOW_FLASH)
    a, b = slow.new_context(system_ids=doc), held.new_context(system_ids=doc)
    slow.swap_out(a)
    held.swap_out(b)
    ra = slow.call(a, CHAT_TURNS[1], max_new_tokens=8)
    rb = held.call(b, CHAT_TURNS[1], max_new_tokens=8)
    assert ra.load.recomputed_chunks > 0 and ra.load.host_chunks == 0
    assert rb.load.recomputed_chunks == 0 and rb.load.host_chunks == rb.load.read_chunks > 0


@pytest.mark.parametrize("preset, budget_mb, host_mb", [
    ("llms", 8, 2),           # segments, int2-int8 records
    ("vllm-s", 16, 8)])       # one file per token chunk (rewritten in place), fp32 records
def test_copies_never_outlive_or_differ_from_their_records_over_a_random_trace(
        smollm2, doc, tmp_path, preset, budget_mb, host_mb):
    """Calls that grow the contexts (records killed and written again), swaps, deletes, under a
    budget that evicts: every held copy is its live record's bytes, within capacity, and the
    answers are those of the same trace without the tier."""
    from sparkv.device.service import ServiceConfig

    rng = random.Random(7)
    kw = {"journal": False, "ratio": 0.5, "fp_protect": 0} if preset == "llms" else {}
    cfg = ServiceConfig.preset(preset, **kw)
    runs = []
    for host in (0, host_mb << 20):
        svc = ContextService(smollm2, budget_mb << 20, tmp_path / f"{preset}-{host}",
                             config=cfg, io_profile=FAST_FLASH, host_tier_bytes=host)
        ids = [svc.new_context(system_ids=doc[i * 20:i * 20 + 40 + 10 * i]) for i in range(4)]
        rng.seed(7)
        out = []
        for step in range(10):
            cid = rng.choice(ids)
            out.append(svc.call(cid, rng.choice(CHAT_TURNS), max_new_tokens=4).tokens)
            if host:
                _held_equal_their_files(svc)
                assert svc.host.stats().peak_bytes <= host
        if host:
            st = svc.stats()
            assert st["host_chunks"] > 0 and st["evicted_chunks"] > 0, (st, svc.host.stats())
            svc.delete(ids[0])
            _held_equal_their_files(svc)
        runs.append(out)
        svc.close()
    assert runs[0] == runs[1]


def test_a_run_is_answered_whole_or_not_at_all_and_counted_so():
    """A run whose records are held but one (evicted since the load planned it) is read from
    flash: the held ones are not counted as hits, nor made the most recently used."""
    h = HostTier(120)
    for off in (0, 64, 128):
        h.put("s", off, bytes([off]) * 40)
    assert h.get_run([("s", 0, 40), ("s", 64, 40)]) == [b"\x00" * 40, b"\x40" * 40]
    assert h.stats().hits == 2
    assert h.get_run([("s", 128, 40), ("s", 192, 40)]) is None   # the second is not held
    st = h.stats()
    assert st.hits == 2 and st.misses == 2 and st.hit_bytes == 80
    h.put("t", 0, b"t" * 40)                   # evicts the least recently used: ("s", 128)
    assert not h.holds("s", 128, 40) and h.holds("s", 0, 40)
