"""`bench contexts`' summary of a system's calls: mean, median and p99 switch times, and the
ratios to LLMS on the mean and on the median (a pure function of the recorded calls)."""

import math

from sparkv.bench.contexts import _ratios, summarise


def _row(system, switch_ms):
    return {"system": system, "switch_ms": switch_ms, "first_token_ms": [1.0] * len(switch_ms),
            "passkey_hits": [1] * len(switch_ms), "answers": ["a"] * len(switch_ms),
            "stats": {}}


def test_the_summary_has_the_median_beside_the_mean_and_both_ratios():
    llms = summarise(_row("llms", [10.0, 20.0, 30.0, 1000.0]), None)
    sq = summarise(_row("vllm-sq", [40.0, 50.0, 70.0, 80.0]), None)
    assert llms["mean_switch_ms"] == 265.0 and llms["median_switch_ms"] == 25.0
    assert llms["p99_switch_ms"] == 1000.0
    results = {"patterns": {"random": {"rows": [llms, sq],
                                       "unlimited": summarise(_row("unlimited", [1.0]), None)}}}
    r = _ratios(results, {})["random"]
    # one slow call makes LLMS's mean worse than VLLM-SQ's while its median is better
    assert r["mean_switch_vllm-sq_over_llms"] < 1.0
    assert math.isclose(r["median_switch_vllm-sq_over_llms"], 60.0 / 25.0)


def test_the_table_prints_the_median_column(capsys):
    import argparse

    from sparkv.bench.contexts import _print

    stats = {"peak_bytes": 1e6, "reclaim_written_bytes": 0.0, "read_chunks": 0,
             "recomputed_chunks": 0}
    rows = [summarise({**_row(s, [10.0, 30.0]), "stats": stats}, None)
            for s in ("llms", "vllm-sq")]
    unlimited = summarise({**_row("unlimited", [5.0]), "stats": stats}, None)
    results = {"patterns": {"random": {"rows": rows + [{"system": "swap", "refused": "x"}],
                                       "unlimited": unlimited}},
               "budget_bytes": 1e6, "settings": {"budget_of_total_kv": 0.25}, "sweep": {},
               "ratios": {}}
    _print(results, argparse.Namespace(contexts=2, calls=2, limit_ms=200.0))
    out = capsys.readouterr().out
    assert "median ms" in out and "refused" in out
