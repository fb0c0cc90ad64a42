"""The recent-chunk rule (docs/quality.md "Why greedy answers diverge"): an opt-in floor for the
last token chunk, next to the question, one or more encoded levels above the quality floor.
Off by default; when on, no planner nor controller streams that chunk below it, even on a
deep fade, while the other chunks keep the plain floor."""

from __future__ import annotations

import numpy as np
import pytest

from sparkv.layout import ChunkGeometry
from sparkv.protocol import Manifest, checksum

LEVEL_BYTES = {"raw": 40, "q8": 12, "q6": 9, "q5": 8, "q4": 6, "q3": 5}


def _manifest(levels):
    g = ChunkGeometry(64, 16, 3, 2, 8)     # 4 token chunks, 3 layers, 2 groups
    tq = {"bits": 5, "coding": "huffman"}
    chunks = []
    for c in g.chunk_ids():
        start, end = g.token_range(c.t)
        entry = {lv: {"bytes": LEVEL_BYTES[lv] * 200, "frame_bytes": LEVEL_BYTES[lv] * 200,
                      "checksum": checksum(bytes([c.t, c.l, c.g]) + lv.encode()),
                      "bits_per_value": 5.0, "k": tq, "v": tq} for lv in levels}
        chunks.append({"t": c.t, "l": c.l, "g": c.g, "token_start": start,
                       "num_tokens": end - start, "levels": entry})
    return Manifest.build(context_id="c" * 32, model={"name": "m", "fingerprint": "fp1"},
                          token_ids=list(range(64)), geometry=g, levels=list(levels),
                          frame_version=1, chunks=chunks, created_unix=1.0)


def _instance(manifest, floor, boost, mbps=2.0):
    from sparkv.edge.planning import build_instance

    g = manifest.chunk_geometry
    t_comp = np.full((g.num_token_chunks, g.num_layers), 0.5)
    return build_instance(manifest, t_comp, mbps * 125_000, quality_floor=floor, rtt_s=0.02,
                          t_suffix_s=0.05, recent_boost=boost)


def test_recent_floor_above():
    from sparkv.edge.planning import recent_floor_above

    assert recent_floor_above(["raw", "q8", "q6", "q5"], "q6") == "q8"
    assert recent_floor_above(["raw", "q6", "q5"], "q6") == "raw"      # q8 not encoded
    assert recent_floor_above(["raw", "q8", "q6"], "q6", 2) == "raw"
    assert recent_floor_above(["raw", "q8", "q6"], "q6", 9) == "raw"   # capped at the best
    assert recent_floor_above(["q6", "q5"], "q6") is None              # nothing above: off
    assert recent_floor_above(["raw", "q8"], None) is None
    assert recent_floor_above(["raw", "q8", "q6"], "q6", 0) is None


def test_off_by_default_and_masks_only_the_last_token_chunk():
    m = _manifest(["raw", "q8", "q6", "q5", "q4"])
    plain = _instance(m, "q6", 0)
    assert plain.recent_floor is None
    inst = _instance(m, "q6", 1)
    assert inst.recent_floor == "q8" and inst.summary()["recent_floor"] == "q8"
    names = [lv.name for lv in inst.levels]
    last = inst.geometry.num_token_chunks - 1
    for c, cid in enumerate(inst.geometry.chunk_ids()):
        got = {names[i] for i in np.flatnonzero(inst.allowed_mask[c])}
        want = {"raw", "q8"} if cid.t == last else {"raw", "q8", "q6"}
        assert got == want, cid
        assert {names[i] for i in np.flatnonzero(plain.allowed_mask[c])} == {"raw", "q8", "q6"}
    # an explicit level list is its own floor: no rule
    from sparkv.edge.planning import AskError, build_instance

    g = m.chunk_geometry
    t_comp = np.full((g.num_token_chunks, g.num_layers), 0.5)
    one = build_instance(m, t_comp, 250_000, levels=["q4"], recent_boost=1)
    assert one.recent_floor is None
    with pytest.raises(AskError, match="recent_boost"):
        build_instance(m, t_comp, 250_000, quality_floor="q6", recent_boost=-1)


def test_no_plan_streams_the_last_chunk_below_its_floor():
    from sparkv.scheduler.controller import ControllerConfig
    from sparkv.scheduler.instance import InstanceError
    from sparkv.scheduler.planners import get_planner
    from sparkv.scheduler.simulator import simulate
    from sparkv.scheduler.trace import Trace

    inst = _instance(_manifest(["raw", "q8", "q6", "q5"]), "q6", 1)
    last = inst.geometry.num_token_chunks - 1
    seen_q6 = False
    for name, ctl in (("sparkv", ControllerConfig()), ("stream", ControllerConfig.cachegen()),
                      ("hybrid", ControllerConfig())):
        plan = get_planner(name).plan(inst)
        for trace in (None, Trace.sample("deep-fade")):
            tl = simulate(plan, inst, trace, controller=ctl)
            assert tl.transfers, name
            for x in tl.transfers:
                assert x.level != "q5", (name, x)
                if x.cid.t == last:
                    assert x.level in ("raw", "q8"), (name, x)
                seen_q6 |= x.level == "q6"
    assert seen_q6          # the other chunks still use the plain floor on a slow link
    with pytest.raises(InstanceError, match="recent floor"):
        inst.replace(recent_floor="q3")
