"""``sparkv bench dynakv``'s settings, targets and quality verdict on synthetic rows (no model)."""

from __future__ import annotations

import argparse

import pytest

from sparkv.bench.dynakv import _quality, _settings, _targets


def _args(**kw) -> argparse.Namespace:
    base = dict(quick=False, max_new_tokens=1024, prompt_tokens=None,
                decode_budgets="0.25,0.1", policies="local,dynakv")
    base.update(kw)
    return argparse.Namespace(**base)


def test_the_default_workload_is_the_issues_and_quick_is_small():
    assert _settings(_args()) == ([4096, 8192], 1024, [0.25, 0.1], ["local", "dynakv"])
    assert _settings(_args(quick=True))[:2] == ([1024], 64)
    assert _settings(_args(prompt_tokens="2048"))[0] == [2048]
    with pytest.raises(SystemExit):
        _settings(_args(prompt_tokens="4k"))
    with pytest.raises(SystemExit):
        _settings(_args(policies="dynakv,bogus"))


def _row(policy: str, budget, tps: float, recall: float = 0.9, agreement: float = 0.95,
         passkey: float = 1.0) -> dict:
    return {"policy": policy, "budget_frac": budget, "tokens_per_s": tps, "recall": recall,
            "agreement": agreement, "passkey": passkey, "write_amplification": 1.0,
            "critical_read_ops_per_token": 1.0, "prompt_tokens": 4096}


def test_targets_compare_dynakv_with_local_and_full_kv():
    rows = [_row("full", None, 10.0, 1.0, 1.0), _row("local", 0.1, 8.0, 0.89),
            _row("dynakv", 0.1, 11.0)]
    t = _targets(rows, [0.1])["0.1"]
    assert t["latency_local_over_dynakv"] == pytest.approx(11 / 8) and t["latency_met"]
    assert t["speed_vs_full"] == pytest.approx(1.1) and t["speed_vs_full_met"]
    assert t["passkey_met"]


def test_the_quality_verdict_is_undecided_on_two_workloads_and_fails_a_lost_passkey():
    rows = [_row("full", None, 10.0, 1.0, 1.0), _row("dynakv", 0.1, 11.0, agreement=0.99)]
    rows += [dict(r, prompt_tokens=8192) for r in rows]
    q = _quality(rows, [0.1])
    assert q["dynakv@0.1"]["verdict"] == "undecided"
    lost = [dict(r, passkey=0.0) if r["policy"] == "dynakv" else r for r in rows]
    assert _quality(lost, [0.1])["dynakv@0.1"]["verdict"] in ("fail", "undecided")
    assert "retrieval_relative" in _quality(lost, [0.1])["dynakv@0.1"]["metrics"]
