"""AskOptions (sparkv.edge.options): the policy of one ask, and ``EdgeSession.ask``'s keyword
overrides of it. The last test answers locally with the real SmolLM2 (no server)."""

from __future__ import annotations

import dataclasses

import pytest

from sparkv.edge import AskError, AskOptions, EdgeSession, chat_context, question_suffix
from sparkv.runtime.generate import reference_generate, sample_context_ids


def test_defaults_are_what_ask_did_with_no_arguments():
    o = AskOptions()
    assert (o.strategy, o.level, o.quality_floor, o.backend) == ("sparkv", "auto", "auto", "auto")
    assert (o.max_new_tokens, o.bandwidth_mbps, o.use_cache, o.chat) == (32, None, True, True)
    assert (o.engine_config, o.controller, o.stop_at_eos, o.keep) == (None, None, True, False)
    assert (o.decode, o.ram_budget, o.prelude, o.plan_receive_tax) == ("full", None, None, False)
    assert o.runs_prelude and not AskOptions(strategy="stream").runs_prelude
    assert not AskOptions(prelude=False).runs_prelude
    assert not o.uses_decode_policy and AskOptions(ram_budget=0.5).uses_decode_policy


def test_the_asks_time_limit_defaults_to_a_multiple_of_the_local_estimate():
    from sparkv.edge.options import ASK_DEADLINE_FACTOR, ASK_DEADLINE_SLACK_S

    assert AskOptions().ask_deadline_s is None
    assert AskOptions().time_limit_s(15.0) == ASK_DEADLINE_FACTOR * 15.0 + ASK_DEADLINE_SLACK_S
    assert AskOptions(ask_deadline_s=5.0).time_limit_s(100.0) == 5.0
    assert AskOptions(ask_deadline_s=float("inf")).time_limit_s(1.0) == float("inf")
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(AskError, match="ask_deadline_s"):
            AskOptions(ask_deadline_s=bad)


def test_resolve_applies_overrides_and_names_unknown_keywords():
    base = AskOptions(strategy="stream", level="q8")
    got = AskOptions.resolve(base, {"level": "raw", "max_new_tokens": 4})
    assert (got.strategy, got.level, got.max_new_tokens) == ("stream", "raw", 4)
    assert base.level == "q8"                                  # the caller's object is kept
    assert AskOptions.resolve(base, {}) is base
    assert AskOptions.resolve(None, {}) == AskOptions()
    with pytest.raises(TypeError, match="'strat'"):
        AskOptions.resolve(None, {"strat": "local"})
    with pytest.raises(TypeError, match="AskOptions"):
        AskOptions.resolve("local", {})                        # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.level = "raw"                                     # type: ignore[misc]


def test_invalid_policies_raise_ask_error():
    with pytest.raises(AskError, match="unknown strategy"):
        AskOptions(strategy="fastest")
    with pytest.raises(AskError, match="unknown decode policy"):
        AskOptions(decode="everything")
    with pytest.raises(AskError, match="unknown strategy"):
        AskOptions.resolve(AskOptions(), {"strategy": "fastest"})


def test_sampling_options_are_checked_and_a_missing_seed_is_drawn_once():
    assert AskOptions().sampling.greedy and AskOptions().seeded() == AskOptions()
    for bad in (dict(temperature=3.0), dict(top_p=-1.0), dict(top_k=-2), dict(seed=1 << 70)):
        with pytest.raises(AskError, match=next(iter(bad))):
            AskOptions(**bad)
    hot = AskOptions(temperature=0.8, top_p=0.9)
    seeded = hot.seeded()
    assert hot.seed is None and isinstance(seeded.seed, int) and seeded.seeded() is seeded
    assert (seeded.sampling.temperature, seeded.sampling.top_p) == (0.8, 0.9)
    assert AskOptions(temperature=0.8, seed=3).seeded().seed == 3


def test_ask_checks_its_options_before_anything_else():
    """An unknown keyword or a bad strategy fails before the model is loaded (the model given
    here does not exist) and before any request (no server listens)."""
    session = EdgeSession.connect("http://127.0.0.1:9", model="/nonexistent/model")
    with pytest.raises(TypeError, match="'max_tokens'"):
        session.ask("0" * 32, "hello?", max_tokens=4)
    with pytest.raises(AskError, match="unknown strategy"):
        session.ask("0" * 32, "hello?", strategy="fastest")
    # an unknown backend (the device service ran an ask with '4y' into a 500 and a traceback)
    with pytest.raises(AskError, match="unknown attention backend '4y'"):
        session.ask("0" * 32, "hello?", backend="4y")
    with pytest.raises(TypeError, match="AskOptions"):
        session.ask("0" * 32, "hello?", "local")               # type: ignore[arg-type]
    session.close()


def test_options_and_keywords_give_the_same_answer(smollm2):
    """A local ask (the device holds the tokens: no request) as an options object, as keywords,
    and as an options object with an override: the same tokens as plain transformers."""
    lm = smollm2
    ids = chat_context(lm, sample_context_ids(lm, 200))
    q = "What does the text say about warranty?"
    ref = reference_generate(lm, ids + question_suffix(lm, q), 4)
    opts = AskOptions(strategy="local", backend="dense", max_new_tokens=4, stop_at_eos=False)
    with EdgeSession.connect("http://127.0.0.1:9", model=lm) as s:
        a = s.ask("doc", q, opts, token_ids=ids)
        b = s.ask("doc", q, strategy="local", backend="dense", max_new_tokens=4,
                  stop_at_eos=False, token_ids=ids)
        c = s.ask("doc", q, opts, max_new_tokens=2, token_ids=ids)
    assert a.tokens == b.tokens == ref
    assert c.tokens == a.tokens[:2]
    assert a.breakdown.strategy == b.breakdown.strategy == "local"
    assert a.breakdown.to_dict().keys() == b.breakdown.to_dict().keys()
    assert a.context_tokens == len(ids) and not a.breakdown.fallback


class _Started(Exception):
    """The ask got past its checks to a load's first step."""


def test_an_ask_past_the_models_positions_is_refused_before_any_work(monkeypatch):
    """The device service's rule (PromptTooLong): context + question + answer within the model's
    positions, checked on token counts before the prelude or the plan (no long prefill here)."""
    from sparkv.device import PromptTooLong
    from sparkv.edge import EdgeClient
    from sparkv.edge.prelude import Prelude
    from sparkv.runtime.model import load_model
    from tests.helpers import shared_tiny_checkpoint

    lm = load_model(str(shared_tiny_checkpoint()), progress=False)
    limit, question, new = lm.max_positions, "What is it about?", 16
    room = limit - len(question_suffix(lm, question, True)) - new   # the longest context asked

    def started(*a, **k):
        raise _Started()

    monkeypatch.setattr(Prelude, "start", started)
    monkeypatch.setattr(EdgeSession, "_plan", started)
    with EdgeSession(EdgeClient("http://127.0.0.1:9"), lm) as session:   # never asked
        for prelude in (None, False):   # refused before the prelude starts, or the plan
            with pytest.raises(PromptTooLong, match=f"would hold {limit + 1} tokens; .* {limit}"):
                session.ask("c1", question, token_ids=[5] * (room + 1), strategy="local",
                            max_new_tokens=new, prelude=prelude)
        with pytest.raises(_Started):   # exactly at the limit: the ask goes on
            session.ask("c1", question, token_ids=[5] * room, strategy="local",
                        max_new_tokens=new, prelude=False)
        with pytest.raises(_Started):   # the prelude starts too
            session.ask("c1", question, token_ids=[5] * room, strategy="local",
                        max_new_tokens=new)
        # a refused ask that would stream leaves no connection opened ahead behind it
        made: list = []
        preconnect = EdgeClient.preconnect
        monkeypatch.setattr(EdgeClient, "preconnect",
                            lambda self, *a, **k: made.append(preconnect(self, *a, **k))
                            or made[-1])
        for prelude in (None, False):
            with pytest.raises(PromptTooLong):
                session.ask("c1", question, token_ids=[5] * (room + 1), strategy="sparkv",
                            max_new_tokens=new, prelude=prelude)
        assert all(p is None or p._over for p in made)   # closed, or never opened
