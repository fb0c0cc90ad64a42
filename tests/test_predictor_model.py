"""Latency model: learns, round-trips, falls back on another device; the Roofline's counts."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from sparkv.layout import ChunkGeometry
from sparkv.predictor import (DeviceMismatchWarning, LatencyModel, ModelArch, Roofline, Sample,
                              StepFeatures, causal_blocks, device_fingerprint, load_predictor,
                              mape, step_work)

ARCH = ModelArch(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, num_layers=2)
META = {"model": "synthetic", "model_fingerprint": "f00", "arch": ARCH.to_dict(),
        "num_layers": 2, "device": "cpu", "fingerprint": device_fingerprint("cpu", threads=1),
        "utilisation_source": "cpu-psutil", "config": {"threads": 1}}


def synthetic_ms(n, k, s, u, sparse):
    """A smooth nonlinear 'device': dense part ~ n, attention ~ s, slowdown ~ 1/(1.2-U)."""
    return (2.0 + 0.01 * n + 0.004 * s * (1.0 + 0.3 * sparse)) / (1.2 - u) ** 1.3


def synthetic_samples(m: int, seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(m):
        T = int(rng.choice([128, 256, 512, 1024]))
        t = int(rng.integers(0, 8))
        n, k = T, (t + 1) * T
        causal = int(causal_blocks(n, k)[0])
        sparse = bool(rng.random() < 0.7)
        s = float(causal if not sparse else max(1, rng.uniform(0.2, 1.0) * causal))
        u = float(rng.uniform(0.0, 0.95))
        ms = float(synthetic_ms(n, k, s, u, sparse) * rng.lognormal(0.0, 0.03))
        out.append(Sample(t, 0, "attention", T, n, t * T, k, s, causal, s / causal, u, ms,
                          "block_sparse" if sparse else "dense", 0.95 if sparse else None, 0.0,
                          1, 1.0, "cpu-psutil", "cpu"))
        if rng.random() < 0.1:
            out.append(Sample(0, 1, "projection", T, n, 0, n, 0.0, 0, 0.0, u,
                              0.3 + 0.002 * n * (1 + u), "none", None, 0.0, 1, 1.0,
                              "cpu-psutil", "cpu"))
    return out


@pytest.fixture(scope="module")
def trained():
    samples = synthetic_samples(700)
    model = LatencyModel(max_iter=1500).fit(samples, META)
    return model, samples


def test_mlp_beats_a_constant_on_held_out_data(trained):
    model, samples = trained
    assert len(model.test_index) == round(0.2 * len(samples))
    assert not set(model.train_index) & set(model.test_index)
    test = [samples[i] for i in model.test_index if samples[i].kind == "attention"]
    train = [samples[i] for i in model.train_index if samples[i].kind == "attention"]
    y = np.array([s.ms for s in test])
    err_mlp = mape(model.predict_ms(StepFeatures.from_samples(test)), y)
    err_const = mape(np.full(len(y), np.mean([s.ms for s in train])), y)
    assert err_mlp < 0.25 * err_const, (err_mlp, err_const)
    assert err_mlp < 10.0
    assert model.info["test_mape_attention"] == pytest.approx(err_mlp)


def test_fast_path_matches_vectorised_prediction(trained):
    model, _ = trained
    f = StepFeatures.single(512, 2048, 40.0, 0.3, True)
    assert model.predict_one_ms(512, 2048, 40.0, 0.3, True) == pytest.approx(
        float(model.predict_ms(f)[0]), rel=1e-12)


def test_save_load_roundtrip_identical(trained, tmp_path):
    model, samples = trained
    path = model.save(tmp_path / "m.json")
    back = LatencyModel.load(path)
    f = StepFeatures.from_samples(samples)
    assert np.array_equal(model.predict_ms(f), back.predict_ms(f))
    assert back.density_prior == model.density_prior
    assert back.fingerprint == META["fingerprint"]
    doc = json.loads(path.read_text())
    assert doc["format"] == "sparkv-latency-model/1"
    assert [len(layer["bias"]) for layer in doc["layers"]] == [48, 24, 1]


def test_load_predictor_same_device_returns_the_mlp(trained, tmp_path):
    model, _ = trained
    path = model.save(tmp_path / "m.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeviceMismatchWarning)
        loaded = load_predictor(path, threads=1)
    assert isinstance(loaded, LatencyModel)


def test_load_predictor_other_device_warns_and_falls_back(trained, tmp_path):
    model, _ = trained
    path = model.save(tmp_path / "m.json")
    doc = json.loads(path.read_text())
    doc["info"]["fingerprint"] = dict(doc["info"]["fingerprint"], cpu="Other CPU 9000",
                                      cuda="NVIDIA Jetson Orin")
    path.write_text(json.dumps(doc))
    with pytest.warns(DeviceMismatchWarning, match="Falling back to the Roofline"):
        loaded = load_predictor(path, threads=1)
    assert isinstance(loaded, Roofline)
    assert loaded.arch == ARCH
    assert loaded.peak_flops > 0 and loaded.peak_bandwidth > 0
    geo = ChunkGeometry(1000, 256, 2, 2, 16)
    t_comp = loaded.t_comp(geo, utilisation=0.0)
    assert t_comp.shape == (4, 2) and np.all(t_comp > 0)


def test_load_predictor_other_thread_count_falls_back(trained, tmp_path):
    model, _ = trained
    path = model.save(tmp_path / "m.json")
    with pytest.warns(DeviceMismatchWarning, match="threads: 1 != 7"):
        assert isinstance(load_predictor(path, threads=7), Roofline)


def test_t_comp_matrix(trained):
    model, _ = trained
    geo = ChunkGeometry(1000, 256, 2, 2, 16)  # 4 token chunks, the last one ragged (232)
    tc = model.t_comp(geo, utilisation=0.2)
    assert tc.shape == (4, 2) and np.all(tc > 0)
    # the attention column grows with t (more keys), the projection column does not depend on t
    assert np.all(np.diff(tc[:3, 0]) > 0)
    assert tc[0, 1] == pytest.approx(tc[1, 1])
    assert tc[0, 1] < tc[0, 0]
    assert model.step_seconds(2, 0, geo, utilisation=0.2) == pytest.approx(tc[2, 0])
    # known active blocks are used as given; busier device -> slower
    s = np.full((4, 2), np.nan)
    s[3, 0] = 1.0
    assert model.t_comp(geo, active_blocks=s, utilisation=0.2)[3, 0] < tc[3, 0]
    assert np.all(model.t_comp(geo, utilisation=0.9)[:, 0] > tc[:, 0])


def test_roofline_flops_match_a_hand_count():
    h, hq, hkv, d, inter = 64, 4, 2, 16, 128
    n, prefix = 128, 256
    k = prefix + n
    proj = 2 * n * h * (hq * d) + 2 * 2 * n * h * (hkv * d) + 2 * n * (hq * d) * h
    mlp = 3 * 2 * n * h * inter
    pairs = n * prefix + n * (n + 1) // 2  # 32768 + 8256
    attn = 4 * d * hq * pairs
    flops, nbytes = step_work(ARCH, n, k)
    assert float(flops) == proj + mlp + attn == 19_939_328
    weights = h * hq * d + 2 * h * hkv * d + hq * d * h + 3 * h * inter + 2 * h
    assert float(nbytes) == 4 * (weights + 2 * n * h + 2 * n * hkv * d + 2 * hkv * d * k)
    # block-sparse: s blocks of 128x64 pairs per query head
    flops_s, _ = step_work(ARCH, n, k, active_blocks=3.0)
    assert float(flops_s) == proj + mlp + 4 * d * hq * 3 * 128 * 64
    # projection-only last layer: K and V projections
    flops_p, bytes_p = step_work(ARCH, n, k, projection_only=True)
    assert float(flops_p) == 2 * 2 * n * h * hkv * d
    assert float(bytes_p) == 4 * (2 * h * hkv * d + h + n * h + 2 * n * hkv * d)
    roof = Roofline(ARCH, peak_flops=1e9, peak_bandwidth=1e12)
    f = StepFeatures.single(n, k, None, 0.0, sparse=False)
    assert float(roof.predict_ms(f)[0]) == pytest.approx(19_939_328 / 1e9 * 1e3)


def test_causal_blocks_match_the_runtime():
    from sparkv.runtime.attention import causal_block_count

    for n in (1, 64, 100, 128, 129, 1024):
        for prefix in (0, 63, 64, 500, 3072):
            assert int(causal_blocks(n, n + prefix)[0]) == causal_block_count(n, n + prefix,
                                                                              prefix)


def test_fit_needs_samples():
    with pytest.raises(ValueError):
        LatencyModel().fit(synthetic_samples(3))
