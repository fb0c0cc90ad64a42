"""Fast switching in the context service (issue 13): the batched, uint8 dequantization equals the
KV memory's own bit for bit; a kept (hot) working memory answers exactly as a fresh load and is
dropped first under pressure, inside the budget; the whole-context baselines grow their arena
layer by layer without a second copy."""

from __future__ import annotations

import pytest
import torch

from sparkv.cache import ContextKV, dequantize
from sparkv.cache.levels import quantize
from sparkv.device import ContextService
from sparkv.device.config import ServiceConfig
from sparkv.device.loader import dequantize_fast, fill_layer, fill_layers, working_nbytes
from sparkv.layout import ChunkGeometry
from sparkv.runtime.generate import sample_context_ids
from helpers import CHAT_TURNS, flash_profile

FAST_FLASH = flash_profile(fast=True)
TURNS = CHAT_TURNS


@pytest.fixture(scope="module")
def lm(smollm2):
    return smollm2


@pytest.fixture(scope="module")
def doc(lm):
    return sample_context_ids(lm, 120)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_fast_dequantization_is_bit_exact(bits):
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(97, 64, generator=g) * 3 + 1
    q = quantize(x, bits)
    assert torch.equal(dequantize_fast(q), dequantize(q, torch.float32))


def test_batched_fill_equals_per_layer_fill(lm, doc, tmp_path):
    svc = ContextService(lm, 256 << 20, tmp_path / "s", io_profile=FAST_FLASH, ratio=0.5,
                         journal=False)
    cid = svc.new_context(system_ids=doc[:90])
    C = svc.contexts[cid].memory
    assert {"int8", "int4", "int2"} & set(svc.contexts[cid].levels)
    a = ContextKV(C.geometry, lm.dtype, spare_tokens=3)
    b = ContextKV(C.geometry, lm.dtype, spare_tokens=3)
    L = C.geometry.num_layers
    assert fill_layers(C, a, range(L)) == sum(fill_layer(C, b, l) for l in range(L))
    for l in range(L):  # noqa: E741
        assert torch.equal(a.layers[l].k, b.layers[l].k)
        assert torch.equal(a.layers[l].v, b.layers[l].v)


def test_hot_working_memory_answers_as_a_fresh_load(lm, doc, tmp_path):
    """fp chunks: a kept working memory holds exactly what a load would rebuild."""
    out = {}
    for keep in (True, False):
        svc = ContextService(lm, 256 << 20, tmp_path / f"k{keep}", io_profile=FAST_FLASH,
                             compression="fp", keep_working=keep, journal=False)
        a = svc.new_context(system_ids=doc[:60])
        b = svc.new_context(system_ids=doc[30:90])
        toks = []
        for i, cid in enumerate([a, a, b, a, b, b]):
            r = svc.call(cid, TURNS[i % len(TURNS)], max_new_tokens=5)
            toks.append(r.tokens)
        out[keep] = (toks, svc.stats())
    assert out[True][0] == out[False][0]
    assert out[True][1]["hot_hits"] >= 3 and out[False][1]["hot_hits"] == 0


def test_hot_working_memory_is_dropped_first_within_the_budget(lm, doc, tmp_path):
    g = ChunkGeometry.from_config(lm.config, 140, 16)
    budget = working_nbytes(g, 0, lm.dtype) + (1 << 20)      # one working memory at a time
    svc = ContextService(lm, budget, tmp_path / "t", io_profile=FAST_FLASH, journal=False)
    a = svc.new_context(system_ids=doc[:50])
    b = svc.new_context(system_ids=doc[50:100])
    for cid in [a, a, b, a, b]:
        svc.call(cid, "Say OK.", max_new_tokens=2)
        assert svc.used_bytes() <= budget
        hot = [c.id for c in svc.contexts.values() if c.hot is not None]
        assert hot in ([], [cid])                         # only the last one is kept
    st = svc.stats()
    assert st["budget_violations"] == 0 and st["peak_bytes"] <= budget
    assert st["hot_hits"] >= 1 and st["hot_dropped"] >= 1


def test_lmk_grows_its_arena_without_a_second_copy(lm, doc, tmp_path):
    """A whole-context baseline out of spare slots grows layer by layer: a budget of about one
    arena plus one layer holds (two arenas would not fit)."""
    n = 60
    g = ChunkGeometry.from_config(lm.config, n + 200, 16)
    budget = working_nbytes(g, 0, lm.dtype)
    svc = ContextService(lm, budget, tmp_path / "lmk", config=ServiceConfig.preset("lmk"))
    ref = ContextService(lm, 256 << 20, tmp_path / "ref", io_profile=FAST_FLASH,
                         compression="fp", journal=False)
    a, r = svc.new_context(system_ids=doc[:n]), ref.new_context(system_ids=doc[:n])
    grown = 0
    for i in range(4):
        before = svc.contexts[a].memory
        x = svc.call(a, TURNS[i], max_new_tokens=4)
        y = ref.call(r, TURNS[i], max_new_tokens=4)
        assert x.tokens == y.tokens
        grown += svc.contexts[a].memory is not before
    st = svc.stats()
    assert grown >= 1 and st["budget_violations"] == 0 and st["peak_bytes"] <= budget
    assert st["peak_bytes"] < 1.5 * svc.contexts[a].memory.nbytes


def test_whole_swap_reads_back_what_it_wrote(lm, doc, tmp_path):
    """The whole-context swap baseline (``preset("swap")``): under a budget of less than one
    arena per context, an evicted context is written as one file and read back, answering as
    never evicted; a call that leaves the context as it was keeps its arena as its memory."""
    g = ChunkGeometry.from_config(lm.config, 260, 16)
    svc = ContextService(lm, int(0.75 * working_nbytes(g, 0, lm.dtype)), tmp_path / "swap",
                         config=ServiceConfig.preset("swap"), io_profile=FAST_FLASH)
    ref = ContextService(lm, 256 << 20, tmp_path / "ref", io_profile=FAST_FLASH,
                         compression="fp", journal=False)
    a, b = svc.new_context(system_ids=doc[:60]), svc.new_context(system_ids=doc[60:120])
    ra, rb = ref.new_context(system_ids=doc[:60]), ref.new_context(system_ids=doc[60:120])
    for x, y in [(a, ra), (b, rb), (a, ra)]:
        assert svc.call(x, TURNS[0], max_new_tokens=4).tokens == \
            ref.call(y, TURNS[0], max_new_tokens=4).tokens
    st = svc.stats()
    assert st["reclaim_written_bytes"] > 0 and st["read_bytes"] > 0
    assert st["recomputed_chunks"] == 0 and st["budget_violations"] == 0
    svc.call(b, TURNS[1], max_new_tokens=2, grow=False)
    assert svc.contexts[b].memory is not None and not svc.account.working


def test_a_call_says_what_filled_its_working_memory(lm, doc, tmp_path):
    """``LoadStats.sources``: after a swap-out the chunks at their levels (or recomputed);
    the next call, the kept fp working memory."""
    from collections import Counter

    svc = ContextService(lm, 256 << 20, tmp_path / "src", io_profile=FAST_FLASH, ratio=0.5,
                         journal=False)
    cid = svc.new_context(system_ids=doc[:90])
    levels = Counter(svc.contexts[cid].levels)
    svc.swap_out(cid)
    loaded = svc.call(cid, TURNS[0], max_new_tokens=2).load
    assert loaded is not None and sum(loaded.sources.values()) == sum(levels.values())
    assert loaded.sources.get("recomputed", 0) == loaded.recomputed_chunks
    for lv, n in loaded.sources.items():
        assert lv == "recomputed" or n <= levels[lv], (lv, loaded.sources, levels)
    n = len(svc.contexts[cid].levels)
    again = svc.call(cid, TURNS[1], max_new_tokens=2).load
    assert again is not None and again.sources == {"working memory": n}


def test_a_call_that_leaves_its_context_never_grows_a_kept_working_memory(lm, doc, tmp_path,
                                                                           monkeypatch):
    """A ``grow=False`` call keeps its prompt and answer in its fork: a kept working memory
    with fewer spare slots than they take is used as it is (no copy), the fork's bytes claimed
    in the account during its turn and given back after it."""
    from sparkv.device import callflow

    svc = ContextService(lm, 256 << 20, tmp_path / "fork", io_profile=FAST_FLASH,
                         journal=False)
    cid = svc.new_context(system_ids=doc[:60])
    svc.call(cid, TURNS[0], max_new_tokens=2, grow=False)
    kept = svc.contexts[cid].hot
    assert kept is not None
    slots = min(st.capacity for st in kept.layers) - len(svc.contexts[cid].tokens)
    claims, real = [], callflow.run_turn

    def turn(*a, **kw):
        claims.append(dict(svc.account.claims))
        return real(*a, **kw)

    monkeypatch.setattr(callflow, "run_turn", turn)
    r = svc.call(cid, TURNS[1], max_new_tokens=slots + 8, grow=False, stop_at_eos=False)
    assert r.load.sources == {"working memory": r.load.resident_chunks}
    assert "grown" not in r.load.notes and svc.contexts[cid].hot is kept
    assert claims[0].get(cid + "#fork", 0) > 0 and svc.account.claims == {}
