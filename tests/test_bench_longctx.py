"""``sparkv bench ttft`` past the model's window and with fair baselines: which model a sweep runs
(the long-context mode, labelled in the results), the growth report, the LP bound beside every
point, and one dtype and attention backend for every strategy."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from sparkv.bench.longctx import (GROWTH_TARGET, LongContextError, extended_positions,
                                  growth_lines, growth_report, long_context_model)
from sparkv.bench.ttft import STRATEGY_ORDER, _aggregate, fair_baselines, result_config

SIZES = [2048, 4096, 8192, 16384]


def test_auto_extends_only_past_the_window():
    assert long_context_model(None, 8192, [2048, 4096, 8192]) is None
    assert long_context_model("/m", 8192, [4096]) == "/m"
    assert long_context_model(None, 8192, SIZES) == "rope-extended:16384"
    assert long_context_model("/m", 8192, SIZES) == "rope-extended:16384:/m"
    assert long_context_model(None, 8192, [4096, 20000]) == "rope-extended:24576"
    # a model already extended runs as it is
    assert long_context_model("rope-extended:16384", 8192, SIZES) == "rope-extended:16384"


def test_the_other_modes():
    assert long_context_model(None, 8192, [4096], "rope") == "rope-extended:16384"
    assert (long_context_model(None, 8192, SIZES, "random")
            == "rope-extended:16384:random:smollm2-135m")
    assert (long_context_model("random:llama-3.2-1b", 131072, [4096], "random")
            == "rope-extended:262144:random:llama-3.2-1b")
    assert long_context_model(None, 8192, [4096], "off") is None
    with pytest.raises(LongContextError, match="16384 tokens exceed the model's 8192"):
        long_context_model(None, 8192, SIZES, "off")
    with pytest.raises(LongContextError, match="random"):
        long_context_model("/ckpt", 8192, SIZES, "random")
    with pytest.raises(LongContextError, match="choose one of"):
        long_context_model(None, 8192, SIZES, "yes")
    assert extended_positions(8192, 100) == 16384 and extended_positions(8192, 16385) == 24576


def _points() -> list[dict]:
    """TTFTs where sparkv grows linearly, local quadratically past 4K, hybrid in between."""
    ttft = {"local": lambda n: n / 1000 * (n / 4096), "hybrid": lambda n: n / 1000 * 1.2,
            "stream": lambda n: n / 800, "sparkv": lambda n: n / 1000 * 0.5}
    pts = []
    for n in SIZES:
        for link in (20.0, 50.0, "lte"):
            for s in STRATEGY_ORDER:
                hybrid = ttft["hybrid"](n) * (1.5 if n == 16384 and s == "hybrid" else 1.0)
                pts.append({"tokens": n, "link": link, "strategy": s,
                            "ttft_median_s": hybrid if s == "hybrid" else ttft[s](n),
                            "lp_bound_s": n / 1000 * 0.45 if link != "lte" else None})
    return pts


def test_growth_report_per_link():
    g = growth_report(_points(), SIZES, [20.0, 50.0, "lte"])
    assert g["base_tokens"] == 4096 and g["top_tokens"] == 16384 and g["target"] == GROWTH_TARGET
    assert [r["link"] for r in g["per_link"]] == [20.0, 50.0]     # constant links only
    row = g["per_link"][0]
    assert row["sparkv"] == pytest.approx(1.0) and row["met"] is True
    assert row["local"] == pytest.approx(4.0) and row["hybrid"] == pytest.approx(1.5)
    assert row["lp_bound"] == pytest.approx(1.0)
    assert row["sparkv_ms_per_token"] == {"4096": pytest.approx(0.5), "16384": pytest.approx(0.5)}
    text = "\n".join(growth_lines(g))
    assert "16384 vs 4096 tokens at 20.0 Mbit/s" in text and "sparkv 1.00x" in text
    assert growth_report(_points(), [4096], [20.0]) is None


def _run(n, link, strat, bound, dtype="bfloat16", backend="block_sparse"):
    return {"tokens": n, "link": link, "strategy": strat, "run": 0, "ttft_s": 1.0,
            "sim_ttft_s": float("nan"), "lp_bound_s": bound, "agreement": 1.0,
            "first_token_kl": 0.0, "mb": 0.0, "migrations": 0, "energy_j_estimate": 0.0,
            "fallback": {}, "dtype": dtype, "backend": backend}


def test_every_point_carries_the_lp_bound_and_its_window():
    runs = [_run(n, "any", "local", float("nan")) for n in (4096, 16384)]
    runs += [_run(n, 20.0, s, 0.5 + i * 0.01) for n in (4096, 16384)
             for i, s in enumerate(("stream", "hybrid", "sparkv"))]
    pts = _aggregate(runs, [(20.0, None)], native_positions=8192)
    assert len(pts) == 8
    for p in pts:       # local too: the link's bound, whichever strategy's instance gave it
        assert p["lp_bound_s"] == pytest.approx(0.51)
        assert p["vs_lp_bound"] == pytest.approx(1.0 / 0.51)
        assert p["in_window"] is (p["tokens"] <= 8192)
        assert (p["dtype"], p["backend"]) == ("bfloat16", "block_sparse")


def test_baselines_compute_as_sparkv_does(tiny_llama):
    fair = fair_baselines(tiny_llama)
    assert fair["dtype"] == "float32" and fair["requested"] == "auto"
    assert set(STRATEGY_ORDER) <= set(fair["applies_to"])
    from sparkv.edge.planning import default_backend
    from sparkv.runtime.attention import get_backend

    assert fair["option"] == default_backend(tiny_llama.base_fingerprint)
    assert fair["backend"] == get_backend(fair["option"]).name
    dense = fair_baselines(tiny_llama, "dense")
    assert (dense["option"], dense["backend"]) == ("dense", "dense")


def test_the_label_is_in_the_results_config(tiny_llama):
    args = argparse.Namespace(model="rope-extended:16384", sizes="4096,16384", func=None)
    tiny_llama.extra["label"] = "tiny [RoPE extended 8192 -> 16384 positions]"
    tiny_llama.extra["long_context"] = {"native_positions": 8192, "positions": 16384}
    try:
        cfg = result_config(args, tiny_llama, fair_baselines(tiny_llama))
    finally:
        del tiny_llama.extra["label"], tiny_llama.extra["long_context"]
    assert cfg["model_label"].startswith("tiny [RoPE extended")
    assert cfg["long_context"]["positions"] == 16384 and cfg["native_positions"] == 8192
    assert cfg["fair_baselines"]["dtype"] == "float32" and "func" not in cfg
    assert cfg["fair_baselines"]["compute"] == tiny_llama.compute.name
    json.dumps(cfg)


@pytest.mark.skipif(os.environ.get("SPARKV_SLOW_TESTS") != "1",
                    reason="runs the real benchmark (server process, every strategy): "
                           "set SPARKV_SLOW_TESTS=1")
def test_bench_ttft_past_the_window_end_to_end(tmp_path):
    """The real benchmark on a tiny checkpoint with a 512-position window, swept to 1024: the
    long mode engages, is labelled, every strategy ran in one dtype and backend, the LP bound
    sits beside every constant-link point and the growth report is there."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from sparkv.cli import main
    from sparkv.runtime.model import default_checkpoint

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
                      max_position_embeddings=512, eos_token_id=2, bos_token_id=1,
                      pad_token_id=2)
    ckpt = tmp_path / "tiny"
    LlamaForCausalLM(cfg).save_pretrained(ckpt)
    AutoTokenizer.from_pretrained(default_checkpoint()).save_pretrained(ckpt)
    out = tmp_path / "ttft.json"
    assert main(["bench", "ttft", "--model", str(ckpt), "--sizes", "256,1024",
                 "--chunk-tokens", "64", "--mbps", "20,50", "--trace", "none", "--runs", "1",
                 "--max-new-tokens", "4", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    cfg_out = doc["config"]
    assert cfg_out["model"] == f"rope-extended:1024:{ckpt}"
    assert "RoPE extended 512 -> 1024" in cfg_out["model_label"]
    assert {(r["dtype"], r["backend"]) for r in doc["runs"]} == {
        (cfg_out["fair_baselines"]["dtype"], cfg_out["fair_baselines"]["backend"])}
    assert {r["strategy"] for r in doc["runs"]} == set(STRATEGY_ORDER)
    # the co-located server's CPU per ask (it shares the device's cores here)
    assert all(isinstance(r["server_cpu_s"], float) and r["server_cpu_s"] >= 0
               for r in doc["runs"])
    assert all(p["lp_bound_s"] for p in doc["points"])
    # the simulator's reading with and without the receive tax the session believed
    planned = [r for r in doc["runs"] if r["strategy"] != "local"]
    assert planned and all(r["sim_taxed_ttft_s"] > 0 and r["receive_tax_prior"] >= 0
                           for r in planned)
    assert all("taxed_median_abs_error" in v for v in doc["targets"]["cost_model"].values())
    assert {p["tokens"]: p["in_window"] for p in doc["points"]} == {256: True, 1024: False}
    growth = doc["targets"]["growth"]
    assert growth["top_tokens"] == 1024 and len(growth["per_link"]) == 2
    assert (tmp_path / "ttft_growth.png").is_file()


def test_links_empty_mbps_keeps_only_the_traces():
    from sparkv.bench.ttft import _links

    only_trace = argparse.Namespace(traces=None, mbps="", trace=["lte"])
    assert [label for label, _ in _links(only_trace)] == ["lte"]
    default = argparse.Namespace(traces=None, mbps=None, trace=["none"])
    assert [label for label, _ in _links(default)] == [5.0, 20.0, 50.0, 100.0, 500.0]


def test_the_strategies_runs_are_interleaved_and_rotated():
    """Side by side under a drifting load: run by run, every strategy once, the order rotated;
    ``local`` alone where there is no link, never on a link."""
    from sparkv.bench.ttft import _interleaved

    order = _interleaved(["local", "hybrid", "sparkv"], False, 3)
    assert order == [(0, "hybrid"), (0, "sparkv"), (1, "sparkv"), (1, "hybrid"),
                     (2, "hybrid"), (2, "sparkv")]
    assert _interleaved(["local", "hybrid"], True, 2) == [(0, "local"), (1, "local")]
    assert _interleaved(["hybrid"], True, 2) == []


def test_a_process_cpu_time_is_read_from_proc_and_none_for_a_missing_process():
    import os
    import time

    from sparkv.bench.ttft import process_cpu_s

    before = process_cpu_s(os.getpid())
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    after = process_cpu_s(os.getpid())
    if before is None:                       # no /proc here
        pytest.skip("no /proc on this system")
    assert after is not None and after > before
    assert process_cpu_s(2 ** 22 + 12345) is None


def test_local_may_be_measured_beside_every_link():
    """``bench ttft --local per-link``: local runs in each link's rotation (paired), not alone."""
    from sparkv.bench.ttft import _interleaved

    order = _interleaved(["local", "hybrid", "sparkv"], False, 2, with_local=True)
    assert sorted(order) == sorted([(r, s) for r in range(2)
                                    for s in ("local", "hybrid", "sparkv")])
    assert order[:3] != order[3:] and {s for _, s in order[:3]} == {"local", "hybrid", "sparkv"}


def test_the_cost_model_reports_both_simulations_per_strategy():
    """Median and worst |measured / simulated - 1| per strategy, with the plans' instance and
    with the receive tax the session believed; a point without a simulation counts in neither."""
    from sparkv.bench.ttft import _cost_model_accuracy

    points = [{"strategy": "sparkv", "sim_error": 0.1, "sim_taxed_error": -0.02},
              {"strategy": "sparkv", "sim_error": 0.3, "sim_taxed_error": 0.04},
              {"strategy": "sparkv", "sim_error": 0.2, "sim_taxed_error": 0.01},
              {"strategy": "hybrid", "sim_error": -0.5, "sim_taxed_error": None},
              {"strategy": "local", "sim_error": float("nan"), "sim_taxed_error": None}]
    cm = _cost_model_accuracy(points)
    assert set(cm) == {"sparkv", "hybrid"}
    assert cm["sparkv"]["median_abs_error"] == 0.2 and cm["sparkv"]["max_abs_error"] == 0.3
    assert cm["sparkv"]["taxed_median_abs_error"] == 0.02
    assert cm["sparkv"]["taxed_max_abs_error"] == 0.04
    assert cm["hybrid"] == {"points": 1, "median_abs_error": 0.5, "max_abs_error": 0.5}


def test_each_point_says_its_compute_speed_against_locals():
    """``compute_vs_local``: a point's compute time per token-layer over local's at its size
    (the H200's streaming points computed 2.5-3.9x slower than local); ``None`` where either
    computed nothing."""
    runs = [dict(_run(4096, "any", "local", float("nan")), compute_us_per_token_layer=10.0)]
    runs += [dict(_run(4096, 20.0, s, 0.5), compute_us_per_token_layer=us)
             for s, us in (("stream", None), ("hybrid", 12.0), ("sparkv", 30.0))]
    got = {p["strategy"]: p["compute_vs_local"] for p in _aggregate(runs, [(20.0, None)])}
    assert got == {"local": pytest.approx(1.0), "stream": None, "hybrid": pytest.approx(1.2),
                   "sparkv": pytest.approx(3.0)}


def test_the_compute_rate_counts_the_steps_tokens():
    from types import SimpleNamespace

    from sparkv.bench.ttft import compute_rate_us
    from sparkv.layout import ChunkGeometry, StepId

    g = ChunkGeometry(1000, 512, 2, 1, 8)      # token chunks of 512 and 488 tokens
    steps = {StepId(0, 0): (0, 1), StepId(1, 0): (1, 2), StepId(1, 1): (2, 3)}
    res = SimpleNamespace(load=SimpleNamespace(steps=steps), instance=SimpleNamespace(geometry=g),
                          breakdown=SimpleNamespace(local_compute_s=0.1488, prelude_steps=0))
    assert compute_rate_us(res) == pytest.approx(0.1488e6 / (512 + 488 + 488))
    res.breakdown.prelude_steps = 2            # the prelude's, a full chunk each
    assert compute_rate_us(res) == pytest.approx(0.1488e6 / (512 + 488 + 488 + 1024))
    res.breakdown.local_compute_s = 0.0
    assert compute_rate_us(res) is None
