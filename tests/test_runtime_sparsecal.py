"""Block-sparse accuracy: the self-similarity filter, every-block-kept == dense, calibrated
per-layer thresholds meeting their error bound, and their per-model store."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from sparkv.runtime import BlockSparseAttention, DenseAttention, LayerStepper, SparsityConfig
from sparkv.runtime.selfsim import block_similarity, not_self_similar, self_similarity
from sparkv.runtime.sparsecal import calibrate_thresholds, measure_errors, relative_l1
from sparkv.runtime.thresholds import (LayerThresholds, SparseThresholds, ThresholdsError,
                                       load_thresholds, parse_thresholds, save_thresholds,
                                       thresholds_path)


def structured_qkv(nq, nk, hq=4, hkv=2, d=32, seed=0, dtype=torch.float32):
    """Random q/k/v whose blocks mix coherent and incoherent stretches."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hq, nq, d, generator=g)
    k = torch.randn(1, hkv, nk, d, generator=g)
    # every other 64-key block and 128-query block is nearly constant (self-similar)
    for j in range(0, nk, 128):
        k[:, :, j:j + 64] = k[:, :, j:j + 1] + 0.05 * k[:, :, j:j + 64]
    for i in range(0, nq, 256):
        q[:, :, i:i + 128] = q[:, :, i:i + 1] + 0.05 * q[:, :, i:i + 128]
    v = torch.randn(1, hkv, nk, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def test_self_similarity_is_the_mean_pairwise_cosine():
    x = torch.randn(1, 2, 21, 8)
    sims = self_similarity(x, 8)  # groups of 8, 8 and 5 tokens
    for h in range(2):
        for gi, (a, b) in enumerate([(0, 8), (8, 16), (16, 21)]):
            u = F.normalize(x[0, h, a:b], dim=-1)
            cos = u @ u.T
            n = b - a
            want = (cos.sum() - cos.diagonal().sum()) / (n * (n - 1))
            assert float(sims[0, h, gi]) == pytest.approx(float(want), abs=1e-5)
    assert float(self_similarity(x[:, :, :1], 4)[0, 0, 0]) == 1.0
    # a block is as coherent as its least coherent pooled group
    per_block = block_similarity(x, 16, 8)
    assert torch.allclose(per_block[..., 0], sims[..., :2].amin(-1))


@pytest.mark.parametrize("estimator", ["qpool", "meansim"])
@pytest.mark.parametrize("sim", [0.2, 0.5, (0.1, 0.9, 0.3, 0.6)])
def test_filter_never_skips_a_block_it_marks_not_self_similar(estimator, sim):
    q, k, _ = structured_qkv(512, 1024 + 512)
    cfg = SparsityConfig(estimator=estimator, cdf_threshold=0.3, sim_threshold=sim, min_keys=0,
                         dense_below=0)
    be = BlockSparseAttention(cfg)
    mask = be.predict_mask(q, k, 1024, 0.2)
    q_sub, k_sub = (32, 8) if estimator == "qpool" else (128, 64)
    must = not_self_similar(q, k, sim, 128, 64, q_sub, k_sub)
    _, _, _, visible, _ = be._geometry(512, 1536, 1024, q.device)
    must = must & visible
    assert must.any() and (~must & visible).any()  # the data has both kinds of blocks
    assert bool((mask | ~must).all())
    assert float(mask.float().sum()) < float(visible.sum()) * 4  # still sparse somewhere


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_every_block_kept_equals_dense(dtype, atol):
    q, k, v = structured_qkv(384, 1024 + 384, dtype=dtype)
    ref, _ = DenseAttention().attend(q, k, v, 1024, 0.2)
    per_head_dense = SparsityConfig(cdf_threshold=(1.0, 1.0, 1.0, 1.0), min_keys=0, dense_below=0)
    for cfg in (SparsityConfig(force_dense=True), per_head_dense):
        out, stats = BlockSparseAttention(cfg).attend(q, k, v, 1024, 0.2)
        assert out.dtype == dtype
        torch.testing.assert_close(out, ref, atol=atol, rtol=0)
        assert stats.density == pytest.approx(1.0)


def test_sparse_runs_in_bf16_close_to_fp32():
    q, k, v = structured_qkv(256, 1024 + 256)
    cfg = SparsityConfig(cdf_threshold=0.8, min_keys=0, dense_below=0)
    be = BlockSparseAttention(cfg)
    mask = be.predict_mask(q, k, 1024, 0.2)
    out32, _ = be.attend(q, k, v, 1024, 0.2, mask=mask)
    out16, stats = be.attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), 1024, 0.2, mask=mask)
    assert out16.dtype == torch.bfloat16 and stats.density < 1.0
    assert float(relative_l1(out16, out32).max()) < 0.02


def _prompts(n=2, tokens=768):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (tokens,), generator=g).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def calibrated(tiny_llama):
    # max_density > 1: the candidates really run sparse (no dense route), so errors are real
    cfg = SparsityConfig(dense_below=256, min_keys=0, max_density=1.01)
    th = calibrate_thresholds(tiny_llama, _prompts(1), eps=0.05, chunk_tokens=256,
                              cdfs=(0.7, 0.9), sims=(0.1, 0.4), config=cfg)
    return th, cfg


def test_calibration_meets_its_error_bound_on_its_prompts(tiny_llama, calibrated):
    th, cfg = calibrated
    assert len(th.layers) == 3 and th.fingerprint == tiny_llama.fingerprint
    assert th.meta["verified"]
    measured = measure_errors(tiny_llama, _prompts(1), th, 256, cfg)
    assert set(measured) == {0, 1}  # the last layer's step is projection-only: no attention
    for layer, (err, density) in measured.items():
        assert err <= th.eps + 1e-6, (layer, err)
        assert 0.0 < density <= 1.0
        assert th.layers[layer].error == pytest.approx(err, abs=1e-6)


def test_thresholds_store_per_model(tiny_llama, calibrated, tmp_path, monkeypatch):
    monkeypatch.setenv("SPARKV_CACHE_DIR", str(tmp_path))
    th, _ = calibrated
    path = save_thresholds(th)
    assert path == thresholds_path(tiny_llama.fingerprint) and path.parent.name == "sparse"
    back = load_thresholds(tiny_llama.fingerprint)
    assert back is not None and back.layers == th.layers
    assert load_thresholds("another-model") is None
    # a backend without an explicit config picks them up for the model the stepper runs
    be = BlockSparseAttention()
    LayerStepper(tiny_llama, _prompts(1, 300)[0], 256, be)
    assert be.thresholds is not None
    layer0 = be.for_layer(0)
    assert layer0.config.sim_threshold == th.layers[0].sim
    # a RoPE-extended model (its own fingerprint, the base's weights) uses the base's
    from sparkv.runtime import LoadedModel
    ext = LoadedModel.from_model(tiny_llama.model, None, "tiny-extended")
    ext.extra["base_fingerprint"] = tiny_llama.fingerprint
    assert ext.fingerprint != tiny_llama.fingerprint
    be_ext = BlockSparseAttention()
    LayerStepper(ext, _prompts(1, 300)[0], 256, be_ext)
    assert be_ext.thresholds is not None
    assert be_ext.thresholds.fingerprint == tiny_llama.fingerprint
    # an explicit config wins over the store
    fixed = BlockSparseAttention(SparsityConfig(cdf_threshold=0.9))
    LayerStepper(tiny_llama, _prompts(1, 300)[0], 256, fixed)
    assert fixed.thresholds is None and fixed.for_layer(0) is fixed


def test_the_bundled_models_thresholds_ship_with_the_package(tmp_path, monkeypatch):
    """A machine that never calibrated uses the thresholds shipped for the bundled SmolLM2;
    its own calibration, once saved, wins."""
    from sparkv.runtime.thresholds import shipped_thresholds_path

    monkeypatch.setenv("SPARKV_CACHE_DIR", str(tmp_path))
    shipped = sorted(shipped_thresholds_path("x").parent.glob("sparse-thresholds-*.json"))
    assert shipped, "no thresholds shipped in sparkv/data"
    for path in shipped:
        fp = path.stem.removeprefix("sparse-thresholds-")
        th = load_thresholds(fp)
        assert th is not None and th.fingerprint == fp and len(th.layers) == 30
        own = SparseThresholds(fp, th.eps, [LayerThresholds([0.5], 0.1, 0.0, 0.1)] * 30)
        save_thresholds(own)
        assert load_thresholds(fp).layers[0].cdf == [0.5]


def test_bad_thresholds_are_rejected(tmp_path):
    with pytest.raises(ThresholdsError):
        parse_thresholds({"format": 1, "fingerprint": "x", "eps": 0.1,
                          "layers": [{"cdf": [1.5], "sim": 0.3}]})
    with pytest.raises(ThresholdsError):
        parse_thresholds({"format": 99})
    with pytest.raises(ThresholdsError):
        parse_thresholds([1, 2])
    bad = tmp_path / "t.json"
    bad.write_text("{not json")
    assert load_thresholds("x", bad) is None
    good = SparseThresholds("x", 0.1, [LayerThresholds(cdf=[0.9, 0.95], sim=0.3)])
    save_thresholds(good, bad)
    assert parse_thresholds(json.loads(bad.read_text())).layers[0].cdf == [0.9, 0.95]
    with pytest.raises(ValueError, match="one per query head"):
        BlockSparseAttention(SparsityConfig(cdf_threshold=(0.9, 0.9, 0.9), min_keys=0,
                                            dense_below=0)).predict_mask(
            *structured_qkv(256, 512)[:2], 256)
