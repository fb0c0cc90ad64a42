"""The levels' layer-wise bits: the greedy allocation, the sensitivity measurement that feeds it
(``sparkv bench codec --measure-profile``) on the real SmolLM2, and the CacheGen-style coder the
benchmark compares the frames with."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from sparkv.bench import codec as bench_codec
from sparkv.codec import KVChunk, CodecError, decode, encode, levels
from sparkv.layout import ChunkGeometry


# ---- allocation ------------------------------------------------------------------------------
def brute_force(sens: list[float], total: int, lo: int, hi: int) -> float:
    return min(levels.predicted_loss(sens, o)
               for o in itertools.product(range(lo, hi + 1), repeat=len(sens)) if sum(o) == total)


@pytest.mark.parametrize("seed", range(12))
def test_allocation_is_optimal_and_within_bounds(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 6))
    sens = list(rng.exponential(1.0, n) * 10.0 ** rng.uniform(-2, 2, n))
    lo, hi = (-1, 2) if seed % 2 else (0, 2)
    total = int(rng.integers(lo * n, hi * n + 1))
    off = levels.allocate_offsets(sens, total, lo, hi)
    assert sum(off) == total and all(lo <= o <= hi for o in off)
    assert levels.predicted_loss(sens, off) == pytest.approx(brute_force(sens, total, lo, hi))


def test_allocation_favours_sensitive_tensors():
    # 6 bits to give from -1: three to the 100 (then capped), one each to the 1s, the last to
    # the first 1 (tie), none to the 0.01
    assert levels.allocate_offsets([100.0, 1.0, 0.01, 1.0], 2, -1, 2) == (2, 1, -1, 0)
    assert levels.allocate_offsets([0.0, 0.0, 0.0], 0, -1, 2) == (2, -1, -1)  # ties: lowest index


@pytest.mark.parametrize("args", [([1.0, 2.0], 5, -1, 2), ([1.0], -2, -1, 2), ([1.0], 0, 2, 1),
                                  ([-1.0, 1.0], 0, -1, 2), ([math.nan, 1.0], 0, -1, 2)])
def test_allocation_rejects_bad_input(args):
    with pytest.raises(CodecError):
        levels.allocate_offsets(*args)
    with pytest.raises(CodecError):
        levels.predicted_loss([1.0, 2.0], [0])


def test_shipped_offsets_are_the_allocation_of_the_shipped_sensitivities():
    sens = levels.PROFILE_SENSITIVITY_K + levels.PROFILE_SENSITIVITY_V
    assert len(sens) == 2 * levels.PROFILE_LAYERS
    assert levels.allocate_offsets(sens, levels.PROFILE_BUDGET, -1, 2) == (
        levels.PROFILE_K + levels.PROFILE_V)
    assert levels.allocate_offsets(sens, levels.PROFILE_BUDGET, 0, 2) == (
        levels.PROFILE_K_FLOOR + levels.PROFILE_V_FLOOR)
    # and they beat CacheGen's rule (K +1 in the first third, V +1 in the first 1/16) by far
    cachegen = tuple([1] * 10 + [0] * 20 + [1] * 2 + [0] * 28)
    assert sum(cachegen) == levels.PROFILE_BUDGET
    assert levels.predicted_loss(sens, levels.PROFILE_K + levels.PROFILE_V) < 0.5 * \
        levels.predicted_loss(sens, cachegen)


def test_shipped_profile_keeps_its_budget():
    for k, v in ((levels.PROFILE_K, levels.PROFILE_V),
                 (levels.PROFILE_K_FLOOR, levels.PROFILE_V_FLOOR)):
        assert sum(k) + sum(v) == levels.PROFILE_BUDGET
    assert all(-1 <= o <= 2 for o in levels.PROFILE_K + levels.PROFILE_V)
    assert all(0 <= o <= 2 for o in levels.PROFILE_K_FLOOR + levels.PROFILE_V_FLOOR)


# ---- the measurement, on the real model ------------------------------------------------------
@pytest.fixture(scope="module")
def lm():
    from sparkv.runtime.model import load_model

    return load_model()


def test_noise_variance_follows_the_codec():
    x = torch.randn(1, 2, 10, 4)
    var = bench_codec._noise_var(x, 4, 4, exact_first=True)
    assert torch.all(var[:, :, 0] == 0)  # the exact sink token has no noise
    rng = x[:, :, 1:4].amax(2) - x[:, :, 1:4].amin(2)  # first chunk without the sink
    assert torch.allclose(var[:, :, 2], (rng / 15) ** 2 / 12)
    rng = x[:, :, 8:].amax(2) - x[:, :, 8:].amin(2)  # last, short chunk
    assert torch.allclose(var[:, :, 9], (rng / 15) ** 2 / 12)
    assert torch.all(bench_codec._noise_var(x, 5, 4, True)[:, :, 1:] < var[:, :, 1:])


def test_measure_profile_on_smollm2(lm):
    res = bench_codec.measure_profile(lm, tokens=96, chunk_tokens=64, bits=4, questions=1,
                                      new_tokens=2, passkeys=0)
    n = lm.config.num_hidden_layers
    assert res["num_layers"] == n and res["contexts"]["natural"]["used"] == 1
    sens = res["sensitivity_k"] + res["sensitivity_v"]
    assert len(sens) == 2 * n and all(s >= 0 for s in sens)
    assert sum(sens) == pytest.approx(1.0)  # one kind of context, normalised
    assert max(sens) > 5 * min(s for s in sens if s > 0)  # far from uniform
    off = res["k_offsets"] + res["v_offsets"]
    assert sum(off) == res["budget"] == levels.PROFILE_BUDGET
    assert all(-1 <= o <= 2 for o in off)
    assert sum(res["k_offsets_floor"] + res["v_offsets_floor"]) == res["budget"]
    pl = res["predicted_loss"]
    # optimal for what it measured: no other allocation of the budget predicts less
    assert pl["measured"] <= pl["shipped"] + 1e-12 and pl["measured"] <= pl["cachegen_rule"]
    assert pl["measured"] < pl["uniform_base_bits"]
    assert res["shipped_k_offsets"] == list(levels.PROFILE_K)


# ---- the CacheGen-style peer coder -----------------------------------------------------------
def test_integer_cdfs_are_torchac_normalised():
    rng = np.random.default_rng(0)
    sym = rng.integers(0, 16, size=(200, 6)).astype(np.uint8)
    sym[:, 0] = 3  # one symbol only
    cdf = bench_codec._int_cdfs(sym, 16)
    assert cdf.shape == (6, 17) and np.all(np.diff(cdf.astype(np.int64), axis=1) >= 1)
    assert cdf[:, 0].tolist() == [0] * 6 and np.all(cdf[:, -1] == 65536)
    bits = bench_codec._ideal_bits(sym, cdf)
    hist = np.stack([np.bincount(sym[:, c], minlength=16) for c in range(6)]) / 200
    ent = -sum(float((p[p > 0] * np.log2(p[p > 0])).sum()) for p in hist) * 200
    assert ent <= bits <= ent * 1.01 + 200 * 6 * 0.01


@pytest.fixture(scope="module")
def q4_frames(lm) -> tuple[list[bytes], int]:
    """q4 frames of the first 2 layers of 128 tokens of real KV, in 64-token chunks."""
    from sparkv.runtime import reference_prefill, sample_context_ids, split_chunks

    ids = sample_context_ids(lm, 128)
    layers = reference_prefill(lm, ids)
    geo = ChunkGeometry.from_config(lm.config, len(ids), 64)
    frames, n = [], 0
    for cid, (k, v) in split_chunks(layers, geo).items():
        if cid.l < 2:
            c = KVChunk(cid, geo.token_range(cid.t)[0], k.contiguous(), v.contiguous(),
                        geo.num_layers)
            frames.append(encode(c, "q4"))
            n += c.num_values
    return frames, n


@pytest.mark.parametrize("with_torchac", [False, True])
def test_cachegen_style_on_the_same_symbols(q4_frames, monkeypatch, with_torchac):
    if with_torchac:
        if bench_codec._import_torchac()[0] is None:
            pytest.skip("torchac is not installed (bash bench/setup_torchac.sh)")
    else:
        monkeypatch.setattr(bench_codec, "_import_torchac", lambda: (None, "not here"))
    frames, n = q4_frames
    out = bench_codec._cachegen_style(frames, n)
    assert (out["torchac"] is not None) == with_torchac
    assert out["bytes"] > 0 and out["cdf_bits_per_value"] > 0
    ours = sum(len(f) for f in frames)
    # whole frames are compared: same headers, parameters and exact tokens on both sides
    assert out["bytes"] - out["cdf_bits_per_value"] * n / 8 < ours * 1.2
    if with_torchac:  # real streams, decoded and checked inside, within a few bytes of ideal
        assert out["stream_over_ideal"] < 0.01 and out["decode_mvps_cpu"] > 0
    for f in frames:
        decode(f)  # the frames themselves are untouched
