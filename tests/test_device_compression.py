"""LLMS with its compression on (issue 29, item 3): the service's default ratio comes from the
model's quality table; with tolerance compression below ratio 1.0 (fp, int8, int4 and int2
chunks) the budget is never exceeded, a swap out and back is exact at every level, and a restart
without a clean shutdown reopens every context whose call returned, its chunks at their levels."""

from __future__ import annotations

import pytest

from sparkv.device import ContextService
from sparkv.device.config import FALLBACK_RATIO, ServiceConfig, resolved_ratio
from sparkv.device.density import LADDER
from sparkv.device.flashio import ServiceFlash, read_token_chunk_record
from sparkv.device.loader import token_chunk_ids, working_nbytes
from sparkv.layout import ChunkGeometry
from sparkv.predictor.quality import QualityEntry, QualityTable, RetrievalScore
from sparkv.runtime.generate import sample_context_ids
from helpers import flash_profile, same_payloads

FAST_FLASH = flash_profile(fast=True)
LEVELS = {"fp", "int8", "k8v4", "int4", "int2"}
RATIO = 0.6          # low enough that the mix holds int4 (and int2) beside k8v4 (and the fp sink)


@pytest.fixture(scope="module")
def lm(tiny_llama):
    return tiny_llama          # a random-weight 3-layer Llama: real densities, cheap calls


@pytest.fixture(scope="module")
def doc(lm):
    return sample_context_ids(lm, 400)


def _entry(ratio: float, verdict: str, ladder: str | None = ",".join(LADDER)) -> QualityEntry:
    params: dict = {"ratio": ratio} if ladder is None else {"ratio": ratio, "ladder": ladder}
    return QualityEntry(f"device@{ratio:g}", {"passkey": RetrievalScore(10, 10, 10, 10)}, 20, 0.9,
                        0.995, 1e-4, 1000.0, {"verdict": verdict, "summary": verdict,
                                              "metrics": {}}, params)


def _payloads(svc: ContextService, cid: str) -> dict:
    """Every resident chunk's payload tensors (codes, scales and zeros, or fp values)."""
    C = svc.contexts[cid].memory
    out = {}
    g = C.geometry
    for t in range(g.num_token_chunks):
        for c in token_chunk_ids(g, t):
            p = C.state(c).payload
            if p is None:
                continue
            sides = []
            for x in (p.k, p.v):
                sides += [x] if p.level == "fp" else [x.codes, x.scale, x.zero]
            out[c] = (p.level, [s.clone() for s in sides])
    return out


def test_default_ratio_comes_from_the_quality_table(tmp_path):
    path = tmp_path / "t.json"
    cfg = ServiceConfig()
    assert cfg.ratio is None                                  # not set: the table decides
    assert resolved_ratio(cfg, "fp123", str(path)) == FALLBACK_RATIO   # no table
    QualityTable("fp123", "tiny", 1.0, [], [], {}, sections={"device": [
        _entry(1.0, "pass"), _entry(0.75, "pass"), _entry(0.5, "fail")]}).save(path)
    assert resolved_ratio(cfg, "fp123", str(path)) == 0.75
    assert resolved_ratio(ServiceConfig(ratio=0.9), "fp123", str(path)) == 0.9  # explicit wins
    assert resolved_ratio(ServiceConfig.preset("vllm-sq"), "fp123", str(path)) == 1.0


def test_a_table_measured_with_another_ladder_does_not_set_the_ratio(tmp_path):
    """Entries without k8v4 in their ladder judged other mixes at the same ratios: only the
    entries of the planner's own ladder count (none here: the fallback)."""
    path = tmp_path / "t.json"
    QualityTable("fp123", "tiny", 1.0, [], [], {}, sections={"device": [
        _entry(1.0, "pass", None), _entry(0.75, "pass", None),
        _entry(0.9, "pass", "int8,int4,int2"), _entry(0.8, "fail")]}).save(path)
    assert resolved_ratio(ServiceConfig(), "fp123", str(path)) == FALLBACK_RATIO
    QualityTable("fp123", "tiny", 1.0, [], [], {}, sections={"device": [
        _entry(1.0, "pass"), _entry(0.85, "pass"), _entry(0.75, "pass", None)]}).save(path)
    assert resolved_ratio(ServiceConfig(), "fp123", str(path)) == 0.85


def test_budget_is_never_exceeded_with_compression_on(lm, doc, tmp_path):
    svc = ContextService(lm, 1 << 30, tmp_path / "s", io_profile=FAST_FLASH, journal=False,
                         ratio=RATIO)
    assert svc.config.ratio == RATIO
    ids = [svc.new_context(system_ids=doc[i * 110:i * 110 + 100]) for i in range(3)]
    levels = {lv for c in ids for lv in svc.contexts[c].levels}
    assert {"int4", "k8v4"} <= levels, levels                # compression is on
    # room for one call's working memory and about half of the contexts' chunks
    g = ChunkGeometry.from_config(lm.config, 140, svc.config.chunk_tokens)
    svc.budget = svc.used_bytes() // 2 + working_nbytes(g, 60, lm.dtype)
    svc.account.peak_bytes = 0                    # the high-water mark under this budget only
    for k in (0, 1, 2, 0, 2, 1):
        svc.call(ids[k], prompt_ids=doc[350:356], max_new_tokens=2)
    st = svc.stats()
    assert st["budget_violations"] == 0
    assert 0 < st["peak_bytes"] <= svc.budget
    assert svc.used_bytes() <= svc.budget


@pytest.fixture(scope="module")
def seen_levels():
    return set()


@pytest.mark.parametrize("ratio", [0.4, 0.6, 0.9])   # int4 + int2, k8v4 + int4, int8 + k8v4
def test_swap_out_and_back_is_exact_at_every_level(lm, doc, tmp_path, ratio, seen_levels):
    svc = ContextService(lm, 256 << 20, tmp_path / "s", io_profile=FAST_FLASH, journal=False,
                         ratio=ratio)
    cid = svc.new_context(system_ids=doc[:300])
    seen_levels.update(svc.contexts[cid].levels)
    if ratio == 0.9:
        assert seen_levels == LEVELS, seen_levels      # the three runs: every level
    before = _payloads(svc, cid)
    # every token chunk file read back holds its payloads bit for bit, at its level
    C = svc.contexts[cid].memory
    tier: ServiceFlash = svc.contexts[cid].tier
    for t in range(C.geometry.num_token_chunks - 1):           # the full chunks
        ids = token_chunk_ids(C.geometry, t)
        f = read_token_chunk_record(tier.read(C.state(ids[0]).flash), t)
        assert f.level == svc.contexts[cid].levels[t]
        same_payloads({p.cid: (p.level, [s for x in (p.k, p.v) for s in (
            [x] if p.level == "fp" else [x.codes, x.scale, x.zero])]) for p in f.payloads},
              {c: before[c] for c in ids})
    svc.swap_out(cid)
    assert not _payloads(svc, cid)                             # nothing left resident
    # the tiny model recomputes cheaper than it reads on a fast machine (a measured roofline):
    # make recomputing dear, so that the chunks come back from their files
    svc.recompute.scale = 1e6
    r = svc.call(cid, prompt_ids=doc[350:356], max_new_tokens=1, grow=False)
    assert r.load.read_chunks > 0, r.load
    same_payloads(_payloads(svc, cid), before)                         # back, exactly


def test_restart_reopens_every_returned_context_at_its_levels(lm, doc, tmp_path):
    swap = tmp_path / "s"
    svc = ContextService(lm, 256 << 20, swap, io_profile=FAST_FLASH, ratio=RATIO)
    ids = [svc.new_context(system_ids=doc[i * 130:i * 130 + 120]) for i in range(2)]
    for cid in ids:
        svc.call(cid, prompt_ids=doc[350:356], max_new_tokens=3)
    kept = {cid: (list(svc.contexts[cid].tokens), list(svc.contexts[cid].levels),
                  _payloads(svc, cid)) for cid in ids}
    # no shutdown: a second service on the same swap dir is what a restart after a crash sees
    again = ContextService(lm, 256 << 20, swap, io_profile=FAST_FLASH, ratio=RATIO)
    assert again.reopened == len(ids) and not again.damaged
    for cid, (tokens, levels, payloads) in kept.items():
        ctx = again.contexts[cid]
        assert ctx.tokens == tokens and ctx.levels == levels
        r = again.call(cid, prompt_ids=doc[360:364], max_new_tokens=1, grow=False)
        assert r.load.faults == 0
        full = {c: p for c, p in payloads.items()
                if c.t < ctx.memory.geometry.num_token_chunks - 1}
        same_payloads({c: p for c, p in _payloads(again, cid).items() if c in full}, full)
