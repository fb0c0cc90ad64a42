"""Stop strings (sparkv.runtime.stops, OpenAI's ``stop``): where an answer's text is cut, what a
stream may show while it grows, and that generation stops at the token that completes one (the
real SmolLM2: plain greedy generation, the context service's call, the edge's ask)."""

from __future__ import annotations

import tempfile

import pytest

from sparkv.edge import AskError, AskOptions, EdgeSession, chat_context, question_suffix
from sparkv.runtime.generate import greedy_generate, reference_prefill, sample_context_ids
from sparkv.runtime.stops import StopStrings

QUESTION = "What does the text say about warranty?"


def test_the_text_is_cut_before_the_first_stop_string_and_a_possible_start_is_held_back():
    s = StopStrings(["\n\n", "END", ""])
    assert s.strings == ("\n\n", "END") and s
    assert s.cut("one\n\ntwo END") == "one" and s.cut("oneEND\n\n") == "one"
    assert s.cut("no stop here") == "no stop here"
    assert s.shown("abc\n") == "abc" and s.shown("abc E") == "abc " and s.shown("abc EN") == "abc "
    assert s.shown("abc ENx") == "abc ENx" and s.shown("abc\n\nx") == "abc"
    grown = ["a", "ab", "abE", "abEN", "abENx", "abENx\n", "abENx\n\n", "abENx\n\nmore"]
    shown = [s.shown(t) for t in grown]                 # never shrinks: a stream only appends
    assert all(b.startswith(a) for a, b in zip(shown, shown[1:]))
    assert not StopStrings() and StopStrings("x").strings == ("x",)


def _unstopped(lm, n=24):
    ids = chat_context(lm, sample_context_ids(lm, 300))
    kv = reference_prefill(lm, ids)
    suffix = question_suffix(lm, QUESTION)
    return ids, kv, suffix, greedy_generate(lm, kv, len(ids), suffix, n, stop_at_eos=False)


def _stop_inside(text: str) -> str:
    words = [w for w in text.split(" ") if len(w) > 3]
    assert words, text
    return words[len(words) // 2]


def test_generation_stops_at_the_token_that_completes_a_stop_string(smollm2):
    lm = smollm2
    ids, kv, suffix, full = _unstopped(lm)
    stop = _stop_inside(full.text)
    got = greedy_generate(lm, kv, len(ids), suffix, 24, stop_at_eos=False, stop=[stop])
    assert got.text == full.text[:full.text.find(stop)]
    assert got.tokens == full.tokens[:len(got.tokens)] and len(got.tokens) < len(full.tokens)
    assert stop in lm.decode_tokens(got.tokens) and stop not in lm.decode_tokens(got.tokens[:-1])


def test_the_service_call_and_the_edge_ask_stop_the_same_way(smollm2):
    from sparkv.device import ContextService

    lm = smollm2
    ids, kv, suffix, full = _unstopped(lm)
    stop = _stop_inside(full.text)
    want = full.text[:full.text.find(stop)]
    opts = AskOptions(strategy="local", backend="dense", max_new_tokens=24, stop_at_eos=False,
                      stop=(stop,))
    with EdgeSession.connect("http://127.0.0.1:9", model=lm) as s:
        asked = s.ask("doc", QUESTION, opts, token_ids=ids)
    assert asked.text == want
    with tempfile.TemporaryDirectory() as d:
        svc = ContextService(lm, 256 << 20, d)
        try:
            cid = svc.import_context(ids, kv)
            called = svc.call(cid, prompt_ids=suffix, max_new_tokens=24, grow=False,
                              stop_at_eos=False, stop=[stop])
        finally:
            svc.close()
    assert called.text == want and called.tokens == asked.tokens


def test_stop_strings_are_checked_with_the_ask():
    with pytest.raises(AskError, match="at most 4 strings"):
        AskOptions(stop=("a", "b", "c", "d", "e"))
    with pytest.raises(AskError, match="at most 4 strings of at most 64"):
        AskOptions(stop=("x" * 65,))
    with pytest.raises(AskError, match="must be strings"):
        AskOptions(stop=(1,))                                   # type: ignore[arg-type]
    assert AskOptions(stop="\n").stop == ("\n",)                # type: ignore[arg-type]
