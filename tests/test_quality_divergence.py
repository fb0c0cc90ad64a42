"""Where a QA answer leaves the dense reference, and whether dense itself was a near-tie there
(``sparkv bench quality``'s ``divergence_pos`` / ``ref_margin_at_divergence`` / ``near_tie``,
docs/quality.md "Why greedy answers diverge")."""

from __future__ import annotations

import pytest
import torch

from sparkv.bench.quality import (NEAR_TIE_LOGITS, Config, aggregate, divergence,
                                  reference_margins, table_text, verdicts)


def test_divergence_position_and_margin():
    margins = [1.0, 0.01, 2.0, 0.3]
    assert divergence([1, 2, 3, 4], [1, 2, 3, 4], margins) == \
        {"divergence_pos": None, "ref_margin_at_divergence": None, "near_tie": False}
    d = divergence([1, 2, 3, 4], [1, 9, 3, 4], margins)
    assert d == {"divergence_pos": 1, "ref_margin_at_divergence": 0.01, "near_tie": True}
    d = divergence([1, 2, 3, 4], [1, 2, 7, 7], margins)
    assert d["divergence_pos"] == 2 and d["ref_margin_at_divergence"] == 2.0 and not d["near_tie"]
    # a shorter answer (stopped early) diverges where it stops; no margins: no tie judgement
    d = divergence([1, 2, 3, 4], [1, 2], None)
    assert d == {"divergence_pos": 2, "ref_margin_at_divergence": None, "near_tie": False}
    assert divergence([1, 2], [5], [NEAR_TIE_LOGITS])["near_tie"] is False  # strictly below


def test_reference_margins_are_the_full_forward_top2_gaps(smollm2):
    from sparkv.runtime.generate import greedy_generate, reference_prefill

    lm = smollm2
    ctx = lm.encode_text("The grass is green. The sky is blue. The pass key is 31415. " * 6)
    q = lm.encode_text("\nWhat is the pass key?")
    kv = reference_prefill(lm, ctx)
    ref = greedy_generate(lm, kv, len(ctx), q, 8, stop_at_eos=False)
    m = reference_margins(lm, kv, len(ctx), q, ref.tokens)
    assert len(m) == len(ref.tokens) and all(x >= 0 for x in m)
    # the same gaps from one plain forward of the whole prompt
    ids = torch.tensor([ctx + q + ref.tokens[:-1]])
    with torch.inference_mode():
        logits = lm.model(input_ids=ids).logits[0, len(ctx) + len(q) - 1:].float()
    top = logits.topk(2, dim=-1).values
    assert m == pytest.approx((top[:, 0] - top[:, 1]).tolist(), abs=2e-3)
    # the reference's own argmax is its token (greedy), and the cache is left as it was
    assert logits.argmax(-1).tolist() == ref.tokens
    assert reference_margins(lm, kv, len(ctx), q, ref.tokens) == pytest.approx(m, abs=1e-6)
    assert reference_margins(lm, kv, len(ctx), q, []) == []


def _qa(probe, config, greedy, pos=None, margin=None, group="strategy", **kw):
    r = {"family": "qa", "size": None, "tokens": 2500, "context": "qa-x", "probe": probe,
         "config": config, "group": "dense" if config == "dense" else group,
         "strategy": None, "level": None, "backend": None, "link": None, "error": None,
         "answer": "", "score": 0.0, "correct": False, "greedy_agreement": greedy,
         "teacher_forced": 1.0, "first_token_kl": 0.0, "mb": 1.0, "ttft_s": 1.0,
         "fallback": {}, "divergence_pos": pos, "ref_margin_at_divergence": margin,
         "near_tie": margin is not None and margin < NEAR_TIE_LOGITS}
    r.update(kw)
    return r


def test_aggregate_counts_divergences_and_near_ties():
    rows = [_qa(f"q{i}", "dense", 1.0) for i in range(4)]
    rows += [_qa("q0", "default@20mbps", 1.0),
             _qa("q1", "default@20mbps", 0.25, 8, 0.004),      # a near-tie of dense
             _qa("q2", "default@20mbps", 0.5, 16, 0.8),        # a real divergence
             _qa("q3", "default@20mbps", 0.0, 0, None, error="RuntimeError: x")]  # not counted
    res = aggregate(rows, [Config("dense", "dense"),
                           Config("default@20mbps", "strategy", "default", link="20")])
    r = next(x for x in res if x["config"] == "default@20mbps")
    assert (r["divergences"], r["near_tie_divergences"], r["errors"]) == (2, 1, 1)
    v = verdicts(res)["default@20mbps"]
    assert (v["qa_divergences"], v["qa_near_tie_divergences"]) == (2, 1)
    assert "div 2 (1 tie)" in table_text(res)
