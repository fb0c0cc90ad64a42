"""The step-cost model measured on the model's own steps (sparkv/predictor/measured.py): the
edge's fallback when no latency profile matches. Shapes of its predictions, never their speed."""

from __future__ import annotations

import numpy as np
import pytest

from sparkv.layout import ChunkGeometry
from sparkv.predictor.features import StepFeatures, causal_blocks
from sparkv.predictor.measured import MeasuredSteps


@pytest.fixture(scope="module")
def measured(tiny_llama):
    return MeasuredSteps.measure(tiny_llama, tokens=256, chunk_sizes=(32, 64), repeats=2,
                                 attention_keys=512)


def test_it_is_fitted_on_the_models_own_steps(measured, tiny_llama):
    c_step, c_token, c_pair = measured.coef
    assert min(c_step, c_token, c_pair) >= 0 and c_token + c_pair > 0
    assert measured.info["compute"] == "float32" and measured.info["steps"] > 0
    g = ChunkGeometry.from_config(tiny_llama.config, 1024, 128)
    t = measured.t_comp(g, sparse=False, utilisation=0.0)
    assert t.shape == (g.num_token_chunks, g.num_layers) and np.all(np.isfinite(t))
    attention = t[:, :-1]
    assert np.all(np.diff(attention[:, 0]) >= 0)          # later chunks see more keys
    assert np.all(t[:, -1] <= attention[:, 0])            # projection-only is the cheapest
    assert sum(measured.projection) > 0                    # timed, not a FLOP share of c_token


def test_calibrating_a_layer_runs_it_without_its_dependencies_and_marks_nothing(tiny_llama):
    import torch

    from sparkv.runtime import LayerStepper, sample_context_ids

    stepper = LayerStepper(tiny_llama, sample_context_ids(tiny_llama, 64), 32)
    last = stepper.geometry.num_layers - 1
    x = torch.randn(1, 32, tiny_llama.config.hidden_size)
    with torch.inference_mode():
        stepper.calibrate_layer(x, 0, last)
    assert not stepper.done and not stepper.kv.is_complete()


def test_block_sparse_uses_the_density_prior_past_dense_below():
    model = MeasuredSteps((1.0, 0.01, 1e-6), (0.0, 0.001), density=0.5, dense_below=2048)
    n, short, long_ = np.array([512.0]), np.array([2048.0]), np.array([8192.0])
    assert model.expected_active_blocks(n, short)[0] == causal_blocks(512, 2048)[0]
    assert model.expected_active_blocks(n, long_)[0] == pytest.approx(
        0.5 * causal_blocks(512, 8192)[0])
    dense = model.predict_ms(StepFeatures.single(512, 8192, sparse=False))[0]
    s = float(model.expected_active_blocks(n, long_)[0])
    sparse = model.predict_ms(StepFeatures.single(512, 8192, s, sparse=True))[0]
    assert sparse < dense


def test_the_edge_falls_back_to_it_without_a_profile(tiny_llama, tmp_path, monkeypatch):
    from sparkv.edge import planning

    monkeypatch.setenv("SPARKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(planning, "_COST_MODELS", {})
    assert isinstance(planning.device_cost_model(tiny_llama), MeasuredSteps)


def test_a_step_inside_a_span_pays_its_share_of_the_fixed_cost():
    """With spans of up to 8,192 tokens (a GPU's engine), a 1,024-token step pays an eighth of
    ``c_step`` (the per-call cost the span pays once); the per-token and per-pair terms stay."""
    model = MeasuredSteps((2.0, 0.001, 0.0), (0.0, 0.0005))
    f = StepFeatures.single(1024, 4096, sparse=False)
    alone = model.predict_ms(f)[0]
    spanned = model.with_spans(8192).predict_ms(f)[0]
    assert alone - spanned == pytest.approx(2.0 * (1 - 1024 / 8192))
    big = StepFeatures.single(16384, 16384, sparse=False)
    assert model.with_spans(8192).predict_ms(big)[0] == pytest.approx(model.predict_ms(big)[0])
    assert model.with_spans(None) == model


def test_the_edge_prices_spans_where_its_engine_runs_them(tiny_llama, tmp_path, monkeypatch):
    from sparkv.edge import planning

    monkeypatch.setenv("SPARKV_CACHE_DIR", str(tmp_path))
    for env, span in (("1", 8192), ("0", None)):
        monkeypatch.setenv("SPARKV_FUSED_SPANS", env)
        monkeypatch.setattr(planning, "_COST_MODELS", {})
        assert planning.device_cost_model(tiny_llama).span_tokens == span


def test_the_pair_cost_is_the_kernels_slope_not_its_fixed_cost(tiny_llama, monkeypatch):
    """A kernel whose call costs a fixed 0.1 ms besides 1e-6 ms a pair (a GPU's launch-bound
    small calls): ``c_pair`` is the 1e-6 and the 0.1 ms is reported, not spread over the pairs
    (per pair at 4K keys it priced the H200's 32K local prefill 2.3x too dear, run 3)."""
    from sparkv.predictor import measured as m
    from sparkv.predictor.features import visible_pairs

    monkeypatch.setitem(m.PAIR_KEYS_FACTOR, "cpu", 2)     # the GPU's rule, on this CPU
    monkeypatch.setattr(m, "_pair_ms", lambda lm, n, keys, r: 0.1 + 1e-6 * visible_pairs(n, keys))
    c_pair, fixed = m._pair_slope(tiny_llama, 256, 4096, 1)
    assert c_pair == pytest.approx(1e-6) and fixed == pytest.approx(0.1)
    # noise that inverts the two timings falls back to the long call's mean per pair
    monkeypatch.setattr(m, "_pair_ms", lambda lm, n, keys, r: 5.0 if keys == 4096 else 4.0)
    c_pair, fixed = m._pair_slope(tiny_llama, 256, 4096, 1)
    assert c_pair == pytest.approx(4.0 / float(visible_pairs(256, 8192))) and fixed == 0.0


def test_a_cpu_keeps_the_one_call_mean_and_a_gpu_times_two(tiny_llama, monkeypatch):
    from sparkv.predictor import measured as m
    from sparkv.predictor.features import visible_pairs

    seen = []
    monkeypatch.setattr(m, "_pair_ms", lambda lm, n, keys, r: seen.append(keys) or 3.0)
    assert m._pair_slope(tiny_llama, 256, 4096, 1) == (3.0 / visible_pairs(256, 4096), 0.0)
    assert seen == [4096] and m.PAIR_KEYS_FACTOR["cuda"] == 8
