"""A conversation's turns kept after a context (sparkv/device/tails.py): the store's rules, the
memory's appended rows, and a real conversation (SmolLM2) answered with and without them."""

from __future__ import annotations

import pytest
import torch

from sparkv.cache import ContextKV, KVMemoryError
from sparkv.device import ContextService
from sparkv.device.calls import run_turn
from sparkv.device.tails import MIN_REUSE, TailKey, TurnTails
from sparkv.layout import ChunkGeometry
from sparkv.runtime.generate import prompt_parts, reference_prefill, sample_context_ids
from sparkv.runtime.turns import ChatTurn, Conversation, suffix_ids
from helpers import flash_profile


def _rows(m: int, layers: int = 2, fill: float = 0.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.full((2, m, 4), fill), torch.full((2, m, 4), fill)) for _ in range(layers)]


ROW_BYTES = 2 * 2 * 2 * 4 * 4          # layers * (K, V) * heads * head_dim * fp32


# ---- the store ----------------------------------------------------------------------------------
def test_match_takes_the_longest_common_prefix_short_of_the_last_id():
    t, a = TurnTails(1 << 20), TailKey("a", 10)
    t.put(a, [1, 2, 3, 4, 5], _rows(5, fill=1.0))
    t.put(a, [1, 2, 9], _rows(3, fill=2.0))
    hit = t.match(a, [1, 2, 3, 4, 7, 8])
    assert hit is not None and hit.count == 4
    assert all(k.shape == (2, 4, 4) and float(k[0, 0, 0]) == 1.0 for k, _ in hit.take())
    assert t.match(a, [1, 2, 3]).count == 2               # at least one id is left to run
    assert t.match(a, [1, 2, 3, 4, 7], least=5) is None
    assert t.match(TailKey("a", 11), [1, 2, 3, 4, 7]) is None       # the context grew since
    assert t.match(TailKey("a", 10, "app:b"), [1, 2, 3, 4, 7]) is None   # another app's turns
    assert t.match(TailKey("b", 10), [1, 2, 3, 4, 7]) is None
    assert t.match(a, [5, 1, 2]) is None
    d = t.to_dict()
    assert (d["hits"], d["misses"], d["reused_tokens"]) == (2, 5, 6)


def test_a_tail_that_extends_another_replaces_it_and_a_context_keeps_a_few():
    t = TurnTails(1 << 20)
    t.put(TailKey("a", 0), [1, 2], _rows(2))
    t.put(TailKey("a", 0), [1, 2, 3], _rows(3))
    assert t.to_dict()["tails"] == 1 and t.nbytes == 3 * ROW_BYTES
    for i in range(TurnTails.PER_CONTEXT + 3):
        t.put(TailKey("a", 0), [100 + i, 1], _rows(2))
    assert t.to_dict()["tails"] == TurnTails.PER_CONTEXT
    assert t.match(TailKey("a", 0), [100, 1, 5]) is None            # the oldest went first
    assert t.match(TailKey("a", 0), [100 + TurnTails.PER_CONTEXT + 2, 1, 5]).count == 2


def test_the_capacity_bounds_the_bytes_least_recently_used_out():
    t = TurnTails(5 * ROW_BYTES)
    t.put(TailKey("a", 0), [1, 1], _rows(2))
    t.put(TailKey("b", 0), [2, 2], _rows(2))
    assert t.match(TailKey("a", 0), [1, 1, 0]) is not None          # "a" is now the most recent
    t.put(TailKey("c", 0), [3, 3], _rows(2))
    assert t.nbytes <= t.capacity and t.to_dict()["evictions"] == 1
    assert t.match(TailKey("b", 0), [2, 2, 0]) is None
    assert t.match(TailKey("a", 0), [1, 1, 0]) is not None
    assert not t.put(TailKey("d", 0), list(range(6)), _rows(6))     # larger than the whole store
    assert not TurnTails(0).put(TailKey("a", 0), [1], _rows(1))
    t.forget("a")
    assert t.match(TailKey("a", 0), [1, 1, 0]) is None and t.nbytes == 2 * ROW_BYTES
    t.put(TailKey("c", 0, "app:b"), [3, 3], _rows(2))
    t.forget("c")                                          # every app's tails of the context
    assert t.nbytes == 0
    with pytest.raises(ValueError):
        TurnTails(-1)
    with pytest.raises(ValueError, match="as many rows"):
        t.put(TailKey("e", 0), [1, 2, 3], _rows(2))


# ---- the memory's appended rows -----------------------------------------------------------------
@pytest.mark.parametrize("ragged", [False, True])
def test_appended_rows_are_what_was_appended_and_append_takes_them_back(ragged):
    geo = ChunkGeometry(40, 16, 2, 2, 8)
    mem = ContextKV(geo, spare_tokens=8)
    for cid in geo.chunk_ids():
        mem.put(cid, torch.randn(*geo.chunk_shape(cid)), torch.randn(*geo.chunk_shape(cid)))
    if ragged:
        mem.prune_layer(1, [torch.arange(0, 40, 2), torch.arange(0, 40, 3)])
    new = [(torch.randn(2, 5, 8), torch.randn(2, 5, 8)) for _ in range(2)]
    for layer, (k, v) in enumerate(new):
        mem.append(layer, k, v)
    rows = mem.appended(5)
    assert all(torch.equal(a, b) for (k, v), (rk, rv) in zip(new, rows)
               for a, b in ((k, rk), (v, rv)))
    assert [k.shape for k, _ in mem.appended(3)] == [(2, 3, 8)] * 2
    with pytest.raises(KVMemoryError):
        mem.appended(6)
    mem.truncate()
    for layer, (k, v) in enumerate(rows):               # appended again: the same rows
        mem.append(layer, k, v)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(rows, mem.appended(5)))


# ---- a real conversation ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lm(smollm2):
    return smollm2


@pytest.fixture(scope="module")
def context(lm):
    head, _ = prompt_parts(lm, sample_context_ids(lm, 200), "x")
    return head, reference_prefill(lm, head)


QUESTIONS = ("What is this text about?", "Who is in it?", "What happens next?")


def _converse(svc: ContextService, sid: str, lm, sampling=None, questions=QUESTIONS,
              max_new: int = 12) -> list:
    history: list[ChatTurn] = []
    out = []
    for q in questions:
        conv = Conversation.of(q, history)
        res = svc.call(sid, prompt_ids=suffix_ids(lm, conv), max_new_tokens=max_new, grow=False,
                       sampling=sampling)
        out.append(res)
        history = [*conv.turns, ChatTurn("assistant", res.text)]
    return out


def test_a_conversation_reuses_its_turns_and_answers_as_it_would_without(lm, context, tmp_path):
    head, kv = context
    answers = {}
    for cap in (0, 64 << 20):
        svc = ContextService(lm, 256 << 20, tmp_path / str(cap), turn_cache_bytes=cap,
                             io_profile=flash_profile(fast=True))
        try:
            sid = svc.import_context(head, kv)
            answers[cap] = _converse(svc, sid, lm)
            assert svc.describe(sid).tokens == len(head)   # the context is as it was
            stats = svc.stats()["turn_cache"]
            if cap:
                assert stats["hits"] == 2 and stats["tails"] == 1
                again = svc.call(sid, prompt_ids=suffix_ids(lm, Conversation.of(
                    QUESTIONS[1], [ChatTurn("user", QUESTIONS[0]),
                                   ChatTurn("assistant", answers[0][0].text)])),
                    max_new_tokens=2, grow=False, turn_scope="app:b")
                assert again.turn_tokens_reused == 0                   # another app's turns
                svc.call(sid, prompt_ids=[lm.encode_text("ok")[0]], max_new_tokens=2, grow=True)
                assert svc.stats()["turn_cache"]["tails"] == 0      # it grew: forgotten
        finally:
            svc.close()
    assert [r.tokens for r in answers[0]] == [r.tokens for r in answers[64 << 20]]
    reused = [r.turn_tokens_reused for r in answers[64 << 20]]
    assert reused[0] == 0 and all(r >= MIN_REUSE for r in reused[1:])
    assert reused[2] > reused[1]            # the third ask reuses the first two turns
    assert all(r.turn_tokens_reused == 0 for r in answers[0])


def test_the_default_capacity_holds_2048_tokens_of_the_models_kv(lm, tmp_path):
    from sparkv.device.tails import DEFAULT_FLOOR_BYTES, default_capacity

    assert default_capacity(1000) == DEFAULT_FLOOR_BYTES          # a tiny model: the floor
    assert default_capacity(114_688) == 2048 * 114_688            # a 3B model at fp16
    svc = ContextService(lm, 256 << 20, tmp_path, io_profile=flash_profile(fast=True))
    try:
        per_token = 2 * 30 * 3 * 64 * 4                           # SmolLM2 at fp32: 46 KB
        assert svc.tails.capacity == svc.config.turn_cache_bytes == 2048 * per_token
        assert svc.stats()["turn_cache"]["capacity"] == 2048 * per_token
    finally:
        svc.close()


def test_a_sampled_conversation_repeats_with_its_seed_whether_its_turns_are_kept_or_not(
        lm, context, tmp_path):
    """The turn cache changes what runs, not what is drawn: a seeded conversation answers the
    same tokens with and without it; another seed answers others; a call without a seed
    reports the one it drew."""
    from sparkv.runtime.sampling import Sampling

    head, kv = context
    answers = {}
    for cap in (0, 64 << 20):
        svc = ContextService(lm, 256 << 20, tmp_path / str(cap), turn_cache_bytes=cap,
                             io_profile=flash_profile(fast=True))
        try:
            sid = svc.import_context(head, kv)
            answers[cap] = _converse(svc, sid, lm, Sampling(0.9, 0.95, 0, 5), QUESTIONS[:2], 8)
            if cap:
                ask = dict(prompt_ids=suffix_ids(lm, Conversation.of(QUESTIONS[0])),
                           max_new_tokens=8, grow=False)
                other = svc.call(sid, sampling=Sampling(0.9, 0.95, 0, 6), **ask)
                drawn = svc.call(sid, sampling=Sampling(0.9), **ask)
        finally:
            svc.close()
    kept, bare = answers[64 << 20], answers[0]
    assert [r.tokens for r in kept] == [r.tokens for r in bare]
    assert other.tokens != kept[0].tokens
    assert isinstance(drawn.seed, int) and drawn.stats["seed"] == drawn.seed
    assert all(r.seed == 5 for r in kept) and kept[1].turn_tokens_reused >= MIN_REUSE


def test_a_failed_turn_leaves_the_working_memory_as_it_was(lm, context, monkeypatch):
    head, kv = context
    from sparkv.device import calls
    from sparkv.runtime.generate import context_memory

    mem = context_memory(lm, [(k.clone(), v.clone()) for k, v in kv], len(head))
    tails = TurnTails(64 << 20)
    ids = lm.encode_text(" and then there were forty more words in the question, " * 2)
    turn = run_turn(lm, mem, len(head), ids, 4, grow=False, stop_at_eos=False, keep_tail=True)
    assert turn.tail is not None and set(mem.positions) == {len(head)}
    tails.put(TailKey("c", len(head)), ids + turn.tokens[:-1], turn.tail)

    def boom(*a, **kw):
        raise RuntimeError("the model failed")

    monkeypatch.setattr(calls, "_generate", boom)
    with pytest.raises(RuntimeError):
        run_turn(lm, mem, len(head), ids + [11], 4, grow=False, stop_at_eos=False,
                 known=tails.match(TailKey("c", len(head)), ids + [11]), keep_tail=True)
    assert set(mem.positions) == {len(head)}
    with pytest.raises(ValueError, match="grows"):
        run_turn(lm, mem, len(head), ids, 4, grow=True, stop_at_eos=False, keep_tail=True)


def test_an_asks_turn_kept_with_its_context_is_reused_and_rows_of_another_shape_refused(
        lm, context, tmp_path):
    """What the edge hands over with a context it keeps (``keep_turns``): the rows of its
    question and answer, checked against the model's shape, reused by the next question."""
    from sparkv.device.errors import DeviceError
    from sparkv.edge.kept import appended_turn
    from sparkv.runtime.generate import context_memory, greedy_generate

    head, kv = context
    mem = context_memory(lm, [(k.clone(), v.clone()) for k, v in kv], len(head))
    first = Conversation.of(QUESTIONS[0])
    gen = greedy_generate(lm, mem, len(head), suffix_ids(lm, first), 12, truncate=False)
    turn = appended_turn(mem, suffix_ids(lm, first), gen.tokens)
    assert turn is not None and set(mem.positions) == {len(head)}      # truncated
    svc = ContextService(lm, 256 << 20, tmp_path / "svc", io_profile=flash_profile(fast=True))
    try:
        sid = svc.import_context(head, mem)
        with pytest.raises(DeviceError, match="layers of"):
            svc.keep_turns(sid, turn[0][:-1], turn[1])
        assert svc.keep_turns(sid, *turn, turn_scope="app:a")
        nxt = Conversation.of(QUESTIONS[1], [*first.turns, ChatTurn("assistant", gen.text)])
        res = svc.call(sid, prompt_ids=suffix_ids(lm, nxt), max_new_tokens=4, grow=False,
                       turn_scope="app:a")
        assert res.turn_tokens_reused >= len(suffix_ids(lm, first))
    finally:
        svc.close()


def test_a_question_kept_with_its_context_at_the_first_token_is_reused_by_the_same_question(
        lm, context, tmp_path):
    """An ask kept at its answer's first token hands its question's KV over with the context
    (``import_context(turn=...)``, :func:`sparkv.edge.kept.question_turn`): the same question in
    the same app then runs only its last token and answers what it answers without them; the
    loaded cache stays as it was (its question's rows are copied, not truncated)."""
    from sparkv.edge.kept import question_turn
    from sparkv.runtime.generate import context_memory, greedy_generate

    head, kv = context
    mem = context_memory(lm, [(k.clone(), v.clone()) for k, v in kv], len(head))
    q = suffix_ids(lm, Conversation.of("Which names does this text give, and what does it "
                                       "say about each of them in the end?"))
    assert len(q) > MIN_REUSE and question_turn(mem, q) is None      # nothing appended yet
    turns = []
    greedy_generate(lm, mem, len(head), q, 3, truncate=False,
                    after_first=lambda: turns.append(question_turn(mem, q)))
    assert turns[0] is not None and turns[0][0] == q and set(mem.positions) != {len(head)}
    mem.truncate()
    answers = {}
    for scope in ("app:a", "app:b"):
        svc = ContextService(lm, 256 << 20, tmp_path / scope, io_profile=flash_profile(fast=True))
        try:
            sid = svc.import_context(head, mem, turn=turns[0], turn_scope="app:a")
            answers[scope] = svc.call(sid, prompt_ids=q, max_new_tokens=6, grow=False,
                                      turn_scope=scope)
        finally:
            svc.close()
    assert answers["app:a"].turn_tokens_reused == len(q) - 1
    assert answers["app:b"].turn_tokens_reused == 0                 # another app's question
    assert answers["app:a"].tokens == answers["app:b"].tokens


def test_a_question_a_head_does_not_hold_whole_is_not_handed_over():
    """``question_turn`` of a cache whose heads do not all hold the question (or that holds
    something else) is ``None``: the context is kept without it, the ask does not fail."""
    from types import SimpleNamespace

    from sparkv.edge.kept import question_turn

    def refuse(count):
        raise KVMemoryError("a head does not hold every appended token")

    kv = SimpleNamespace(positions=[13, 13], geometry=SimpleNamespace(num_tokens=10),
                         appended=refuse)
    assert question_turn(kv, [1, 2, 3]) is None
    assert question_turn(kv, [1, 2]) is None                      # 3 appended, not 2
    assert question_turn(kv, []) is None
