"""Instances: construction from mappings (the engine's path), validation, the synthetic profile."""

from __future__ import annotations

import os

import numpy as np
import pytest

from sparkv.layout import ChunkGeometry, KVChunkId, StepId
from sparkv.scheduler import (DEFAULT_LEVELS, Instance, InstanceError, StreamLevel, synthetic_instance,
                              validate_plan, Greedy)
from sparkv.scheduler.instance import MBPS


def test_from_mappings_matches_the_arrays():
    geom = ChunkGeometry(40, 16, 2, 2, 4, 1)        # 3 token chunks (the last has 8 tokens)
    sizes = {cid: {"q8": 800 + cid.t, "q4": 400 + cid.t} for cid in geom.chunk_ids()}
    del sizes[KVChunkId(2, 1, 1)]["q8"]             # a level not encoded for one chunk
    t_comp = {s: 0.1 * (s.t + 1) if s.l == 0 else 0.01 for s in geom.step_ids()}
    inst = Instance.from_mappings(geom, sizes, t_comp, 1000.0, t_proc=0.002, rtt_s=0.01,
                                  t_suffix_s=0.05, quality_floor="q4")
    assert [lv.name for lv in inst.levels] == ["q8", "q4"]   # levels nobody has are dropped
    assert inst.bytes_of(KVChunkId(1, 0, 1), "q8") == 801
    assert inst.chunk_bytes[inst.chunk_index(KVChunkId(2, 1, 1)), 0] == -1
    assert inst.comp_time(StepId(2, 0)) == pytest.approx(0.3)
    assert inst.t_stream(KVChunkId(0, 0, 0)) == pytest.approx(0.4)   # q4, max(0.4, 0.002)
    assert inst.chunk_id(inst.chunk_index(KVChunkId(2, 1, 1))) == KVChunkId(2, 1, 1)
    plan = Greedy().plan(inst)
    validate_plan(plan, inst)
    # decode that does not overlap transfers: the paper's sum
    serial = inst.replace(decode_overlaps=False)
    assert serial.t_stream(KVChunkId(0, 0, 0)) == pytest.approx(0.402)


def test_instance_validation():
    geom = ChunkGeometry(32, 16, 2, 1, 4)
    ok = dict(geometry=geom, levels=(StreamLevel("a", 0),), chunk_bytes=np.ones((4, 1)),
              t_proc=np.zeros((4, 1)), t_comp=np.ones((2, 2)), bandwidth_Bps=1.0)
    Instance(**ok)
    with pytest.raises(InstanceError, match="chunk_bytes has shape"):
        Instance(**{**ok, "chunk_bytes": np.ones((3, 1))})
    with pytest.raises(InstanceError, match="t_comp"):
        Instance(**{**ok, "t_comp": -np.ones((2, 2))})
    with pytest.raises(InstanceError, match="bandwidth"):
        Instance(**{**ok, "bandwidth_Bps": 0.0})
    with pytest.raises(InstanceError, match="quality floor 'zz'"):
        Instance(**{**ok, "quality_floor": "zz"})
    with pytest.raises(InstanceError, match=r"chunk\(t=1, l=1, g=0\) has no level"):
        nb = np.ones((4, 1))
        nb[3, 0] = -1
        Instance(**{**ok, "chunk_bytes": nb, "quality_floor": None})


def test_synthetic_profile_is_smollm2_on_this_cpu():
    inst = synthetic_instance(8 * 1024, bandwidth_mbps=100, heterogeneity=0.0)
    assert inst.L == 30 and inst.G == 1 and inst.n_t == 8
    # ~70 ms per layer step at t = 0, rising with the prefix; the last layer is a projection
    assert inst.t_comp[0, 0] == pytest.approx(0.0697, abs=0.002)
    assert inst.t_comp[7, 0] > 1.9 * inst.t_comp[0, 0]
    assert inst.t_comp[0, 29] < 0.01
    # dense prefill (sum of all steps) near the measured 1K 2.2 s, 2K 3.8 s, 4K 10.2 s, 8K 25.9 s
    for k, measured in ((1, 2.2), (2, 3.8), (4, 10.2), (8, 25.9)):
        total = synthetic_instance(k * 1024, heterogeneity=0.0).t_comp.sum()
        assert total == pytest.approx(measured, rel=0.2)
    # fp16 KV: 30 * 3 * 64 * 2 * 2 = 23,040 bytes per token; q5 about 4x smaller
    raw = inst.level_index("raw")
    q5 = inst.level_index("q5")
    assert inst.chunk_bytes[:, raw].sum() == 23040 * 8 * 1024
    ratio = inst.chunk_bytes[:, raw].sum() / inst.chunk_bytes[:, q5].sum()
    assert 3.5 < ratio < 4.5
    assert inst.bandwidth_Bps == 100 * MBPS
    assert [lv.name for lv in DEFAULT_LEVELS] == ["raw", "q8", "q6", "q5", "q4", "q3"]
    # the cheapest allowed level is the floor (q5) when nothing cheaper is allowed
    assert {inst.levels[i].name for i in inst.cheapest_level} == {"q5"}


def test_seeded_instances_and_traces_are_the_same_bits_on_every_cpu():
    """A seeded instance, trace and compute noise come out bit for bit the same whether numpy
    runs its AVX512 code or not (``np.exp`` there is ulps from the scalar ``exp``; the digest
    of tests/test_scheduler_digest.py then failed on AVX512 machines only)."""
    import math
    import subprocess
    import sys

    from sparkv.scheduler.instance import portable_exp

    x = np.random.default_rng(0).normal(0.0, 3.0, size=(5, 7))
    assert portable_exp(x).shape == (5, 7)
    assert portable_exp(x).ravel().tolist() == [math.exp(v) for v in x.ravel().tolist()]
    code = ("import hashlib\nfrom sparkv.scheduler import synthetic_instance, ComputeNoise\n"
            "from sparkv.scheduler.trace import adversarial_trace, make_sample_trace\n"
            "i = synthetic_instance(4096, heterogeneity=0.5, seed=3)\n"
            "t = make_sample_trace('wifi', seed=3).mbps + adversarial_trace(3).mbps\n"
            "parts = [i.t_comp, i.chunk_bytes, ComputeNoise(sigma=0.3, seed=3).step_factors(50)]\n"
            "h = hashlib.sha256(b''.join(p.tobytes() for p in parts) + repr(t).encode())\n"
            "print(h.hexdigest())")
    digests = set()
    for disabled in ("", "X86_V4 AVX512_ICL AVX512_SPR"):
        env = {**os.environ, "NPY_DISABLE_CPU_FEATURES": disabled}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        digests.add(out.stdout)
    assert len(digests) == 1
