"""The quality decision rule (sparkv/bench/verdict.py) on synthetic answer rows: a clearly worse
configuration fails, an equal one passes, a tiny sample is undecided and says how many more tasks
it needs; the exact retrieval bounds' edge cases; determinism for a seed."""

from __future__ import annotations

import math
import random

import pytest

from sparkv.bench.verdict import (FAIL, MIN_PAIRED, PASS, RETRIEVAL_MIN_RELATIVE, UNDECIDED,
                                  Verdict, bootstrap_mean_interval, clopper_pearson, decide,
                                  decide_all, paired_mean_verdict, retrieval_verdict)


def _qa_rows(config: str, n: int, tf: float, kl: float, greedy: float, seed: int = 0,
             group: str = "level", jitter: float = 0.0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        rows.append({"probe": f"qa/q{i}", "family": "qa", "config": "dense", "group": "dense",
                     "correct": False, "error": None, "teacher_forced": 1.0,
                     "greedy_agreement": 1.0, "first_token_kl": 0.0})
        rows.append({"probe": f"qa/q{i}", "family": "qa", "config": config, "group": group,
                     "correct": False, "error": None,
                     "teacher_forced": min(1.0, tf + rng.uniform(-jitter, jitter)),
                     "greedy_agreement": greedy, "first_token_kl": kl})
    return rows


def _retrieval_rows(config: str, n: int, dense_ok: int, kept: int,
                    group: str = "level") -> list[dict]:
    rows = []
    for i in range(n):
        d_ok = i < dense_ok
        rows.append({"probe": f"passkey-2048-{i}", "family": "passkey", "config": "dense",
                     "group": "dense", "correct": d_ok, "error": None})
        rows.append({"probe": f"passkey-2048-{i}", "family": "passkey", "config": config,
                     "group": group, "correct": i < kept, "error": None})
    return rows


def test_clearly_worse_configuration_fails():
    rows = _qa_rows("stream@q2", 40, tf=0.8, kl=0.2, greedy=0.2, jitter=0.05)
    rows += _retrieval_rows("stream@q2", 40, dense_ok=40, kept=20)
    v = decide(rows, "stream@q2", seed=1)
    assert v.verdict == FAIL
    assert {m for m, x in v.metrics.items() if x.verdict == FAIL} == {
        "retrieval_relative", "teacher_forced_drop", "first_token_kl", "greedy_drop"}
    assert v.summary().startswith("FAIL")


def test_equal_configuration_passes():
    rows = _qa_rows("stream@q8", 60, tf=1.0, kl=1e-5, greedy=1.0)
    rows += _retrieval_rows("stream@q8", 90, dense_ok=90, kept=90)
    v = decide(rows, "stream@q8", seed=0)
    assert v.verdict == PASS and v.need_more is None and v.summary() == "pass"
    tf = v.metrics["teacher_forced_drop"]
    assert tf.estimate == 0.0 and tf.interval == (0.0, 0.0) and tf.n == 60
    assert v.metrics["retrieval_relative"].interval[0] >= RETRIEVAL_MIN_RELATIVE


def test_small_loss_within_the_margin_passes_with_enough_questions():
    rows = _qa_rows("stream@q6", 80, tf=0.995, kl=1e-4, greedy=0.9, jitter=0.005)
    v = decide(rows, "stream@q6", seed=3)
    assert v.verdict == PASS
    assert v.metrics["greedy_drop"].gates is False


def test_tiny_sample_is_undecided_and_says_how_many_more():
    rows = _qa_rows("stream@q5", 3, tf=1.0, kl=0.0, greedy=1.0)
    rows += _retrieval_rows("stream@q5", 3, dense_ok=3, kept=3)
    v = decide(rows, "stream@q5")
    assert v.verdict == UNDECIDED
    assert v.metrics["teacher_forced_drop"].need_more == MIN_PAIRED - 3
    # all kept: 59 dense-correct tasks clear 0.95, so 56 more
    assert v.metrics["retrieval_relative"].need_more == 56
    assert v.need_more == 56
    assert "56 more dense-correct retrieval tasks" in v.summary()
    assert f"{MIN_PAIRED - 3} more QA questions" in v.summary()


def test_noisy_estimate_near_the_margin_needs_more_from_the_spread():
    rows = _qa_rows("local/block_sparse", 25, tf=0.99, kl=0.0, greedy=0.8, jitter=0.04, seed=5)
    m = decide(rows, "local/block_sparse", seed=0).metrics["teacher_forced_drop"]
    assert m.verdict == UNDECIDED and m.need_more is not None and m.need_more > 0


def test_greedy_only_fails_never_passes():
    # teacher-forced and KL pass; greedy agreement is far off: the guard fails it
    rows = _qa_rows("press", 40, tf=1.0, kl=0.0, greedy=0.1)
    v = decide(rows, "press")
    assert v.verdict == FAIL and v.metrics["greedy_drop"].verdict == FAIL
    # greedy alone (no primary metric measured) never passes
    only = [dict(r, teacher_forced=None, first_token_kl=None) for r in
            _qa_rows("x", 40, 1.0, 0.0, 1.0)]
    v = decide(only, "x")
    assert v.verdict == UNDECIDED and "no primary metric" in v.summary()


def test_exact_bounds_edge_cases():
    assert clopper_pearson(0, 0) == (0.0, 1.0)
    lo, hi = clopper_pearson(30, 30)                       # all kept: lower = 0.05 ** (1/30)
    assert hi == 1.0 and math.isclose(lo, 0.05 ** (1 / 30), rel_tol=1e-9)
    lo, hi = clopper_pearson(0, 10)                        # none kept: upper = 1 - 0.05 ** (1/10)
    assert lo == 0.0 and math.isclose(hi, 1 - 0.05 ** (1 / 10), rel_tol=1e-9)
    lo, hi = clopper_pearson(5, 10)
    assert 0.2 < lo < 0.5 < hi < 0.8 and math.isclose(lo, 1 - hi, rel_tol=1e-9)
    with pytest.raises(ValueError):
        clopper_pearson(3, 2)
    # dense answered nothing: the family says nothing
    m = retrieval_verdict(0, 0)
    assert m.verdict == UNDECIDED and m.estimate is None and m.n == 0 and m.need_more == 59
    assert retrieval_verdict(59, 59).verdict == PASS
    assert retrieval_verdict(58, 58).verdict == UNDECIDED
    assert retrieval_verdict(0, 10).verdict == FAIL
    # below the margin: more tasks at this rate would never pass
    assert retrieval_verdict(85, 90).need_more is None


def test_errors_count_as_wrong():
    rows = _retrieval_rows("c", 60, 60, 60)
    for r in rows:
        if r["config"] == "c" and r["probe"].endswith(("-1", "-2", "-3", "-4")):
            r["error"] = "RuntimeError: boom"
    v = decide(rows, "c")
    assert v.errors == 4 and v.metrics["retrieval_relative"].estimate == 56 / 60


def test_deterministic_for_a_seed_and_round_trips():
    rows = _qa_rows("stream@q5", 30, tf=0.99, kl=3e-4, greedy=0.8, jitter=0.02, seed=2)
    a = decide(rows, "stream@q5", seed=7)
    b = decide(rows, "stream@q5", seed=7)
    assert a.to_dict() == b.to_dict()
    assert bootstrap_mean_interval([0.1, 0.2, 0.4], seed=1) == \
        bootstrap_mean_interval([0.1, 0.2, 0.4], seed=1)
    assert Verdict.from_dict(a.to_dict()).to_dict() == a.to_dict()


def test_decide_all_any_group_and_no_dense():
    rows = _qa_rows("adakv:0.5", 25, 0.7, 0.3, 0.1, group="press")
    rows += [r for r in _qa_rows("bf16", 25, 1.0, 0.0, 1.0, group="dtype")
             if r["config"] != "dense"]
    out = decide_all(rows, seed=0)
    assert list(out) == ["adakv:0.5", "bf16"]
    assert out["adakv:0.5"].group == "press" and out["adakv:0.5"].verdict == FAIL
    assert out["bf16"].group == "dtype" and out["bf16"].verdict == PASS
    with pytest.raises(ValueError, match="no answers"):
        decide(rows, "nothing")
    assert paired_mean_verdict("kl", [], 0.01).verdict == UNDECIDED
