"""Calls that leave their context as it was read one working memory at once
(sparkv/cache/fork.py, sparkv/device/readturns.py): a fork answers exactly as the memory's own
cache does and never writes the memory, in every form (dense, ragged, paged int8), forks of one
memory decode together row by row, and the context service's non-growing calls on one context
join the read turn open: one switch-in, each call's own answer, the account and the context as
they were. Logic tests on a tiny random Llama and the real SmolLM2; no timing."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from sparkv.cache import SparkvCache
from sparkv.cache.fork import ForkCache
from sparkv.device.readturns import ReadTurn, ReadTurns
from sparkv.runtime.batchdecode import DecodeItem, decode_together
from sparkv.runtime.generate import (context_memory, generate_over, greedy_generate,
                                     reference_prefill, sample_context_ids)
from sparkv.runtime.sampling import Sampling

GUARD_S = 300.0
N = 70


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _memory(lm, form: str):
    mem = context_memory(lm, reference_prefill(lm, _ids(N, 1)), N)
    if form == "int8":
        for cid in mem.geometry.chunk_ids():
            mem.set_level(cid, "int8")
    elif form == "ragged":
        keep = [torch.arange(0, N, 2 if h else 3) for h in range(mem.geometry.num_kv_heads)]
        mem.prune_layer(1, keep)
    return mem


def _snapshot(mem) -> list[torch.Tensor]:
    return [e.k.clone() for layer in range(mem.geometry.num_layers)
            for e in mem.layer_entries(layer)]


# ---- the fork ------------------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["dense", "ragged", "int8"])
def test_a_fork_answers_as_the_memory_does_and_leaves_it_as_it_was(tiny_llama, form):
    lm, question = tiny_llama, _ids(9, 2)
    want = greedy_generate(lm, _memory(lm, form), N, question, 12, stop_at_eos=False)
    mem = _memory(lm, form)
    before, positions = _snapshot(mem), list(mem.positions)
    fork = ForkCache(mem)
    got = generate_over(lm, fork, N, question, 12, stop_at_eos=False)
    assert got.tokens == want.tokens
    torch.testing.assert_close(got.first_logits, want.first_logits, atol=1e-4, rtol=1e-4)
    assert list(mem.positions) == positions
    for a, b in zip(before, _snapshot(mem)):
        assert torch.equal(a, b)
    rows = fork.rows()          # the question and the answer less its last token, every layer
    assert len(rows) == mem.geometry.num_layers
    assert {k.shape[1] for k, _ in rows} == {len(question) + 11}
    assert fork.extra_nbytes() > 0


def test_a_fork_takes_known_rows_as_if_it_had_run_them(tiny_llama):
    lm, question = tiny_llama, _ids(10, 3)
    mem = _memory(lm, "dense")
    first = ForkCache(mem)
    want = generate_over(lm, first, N, question, 6, stop_at_eos=False)
    known = [(k[:, :4], v[:, :4]) for k, v in first.rows()]
    again = ForkCache(mem, reserve=16)
    assert again.append_rows(known) == 4
    got = generate_over(lm, again, N + 4, question[4:], 6, stop_at_eos=False)
    assert got.tokens == want.tokens
    with pytest.raises(ValueError):
        again.append_rows(known[:1])


def test_forks_of_one_memory_decode_together_each_as_alone(tiny_llama):
    lm = tiny_llama
    mem = _memory(lm, "int8")
    alone, together = [ForkCache(mem) for _ in range(3)], [ForkCache(mem) for _ in range(3)]
    for forks in (alone, together):      # each fork its own question
        for i, f in enumerate(forks):
            generate_over(lm, f, N, _ids(5 + i, 10 + i), 1)
    tokens = [5, 6, 7]
    starts = [N + 5 + i for i in range(3)]
    for step in range(3):
        want = [decode_together(lm, [DecodeItem(f, t, s + step)])[0]
                for f, t, s in zip(alone, tokens, starts)]
        got = decode_together(lm, [DecodeItem(f, t, s + step)
                                   for f, t, s in zip(together, tokens, starts)])
        for i in range(3):
            torch.testing.assert_close(got[i], want[i], atol=1e-4, rtol=1e-4)
        tokens = [int(w.argmax()) for w in want]
    assert [f.layers[0].get_seq_length() for f in together] == [N + 5 + i + 3 for i in range(3)]


def test_a_fork_of_a_dense_memory_gives_the_density_hook_its_keys(tiny_llama):
    mem = _memory(tiny_llama, "dense")
    fork = ForkCache(mem)
    assert fork.layers[0].keys is None                 # nothing run yet
    generate_over(tiny_llama, fork, N, _ids(4, 5), 1)
    keys = fork.layers[0].keys
    assert keys is not None and keys.shape[2] == N + 4
    assert torch.equal(keys[:, :, :N], SparkvCache(mem).memory.layers[0].prefix(N)[0])
    assert ForkCache(_memory(tiny_llama, "int8")).layers[0].keys is None


# ---- read turns ----------------------------------------------------------------------------------
def test_a_waiting_call_joins_the_read_turn_open_or_gets_the_lock():
    reads, lock = ReadTurns(), threading.Lock()
    assert reads.hold_or_join(lock, "c", 1.0) is True         # nothing open: the lock
    assert reads.hold_or_join(lock, "c", 0.05) is False       # held, nothing open: too late
    with reads.opened("c", object(), 5) as turn:               # type: ignore[arg-type]
        got = reads.hold_or_join(lock, "c", None)
        assert got is turn and turn.readers == 2 and turn.joined == 1
        assert isinstance(turn, ReadTurn)
        reads.leave(turn)
        assert turn.readers == 1
        assert reads.hold_or_join(threading.Lock(), "other", 0.05) is True   # its own lock
        assert reads.hold_or_join(lock, "c", None) is turn
        left = threading.Event()

        def leave_later() -> None:
            time.sleep(0.05)
            reads.leave(turn, "density")
            left.set()

        threading.Thread(target=leave_later).start()
    assert left.is_set()                      # the opener waited for its joiner
    assert turn.readers == 1 and turn.densities == ["density"]
    assert reads.open_count() == 0
    with pytest.raises(RuntimeError):
        with reads.opened("c", object(), 5):                  # type: ignore[arg-type]
            with reads.opened("c", object(), 5):              # type: ignore[arg-type]
                pass


def test_a_joiner_takes_the_openers_question_rows_once_shared():
    reads = ReadTurns()
    ids = list(range(40))
    rows = [(torch.zeros(2, 40, 4), torch.zeros(2, 40, 4))]
    with reads.opened("c", object(), 5, ids, "app:a") as turn:    # type: ignore[arg-type]
        assert reads.question_rows(turn, ids, "app:b", 16) is None       # another app's
        assert reads.question_rows(turn, ids[:10] + [99] * 30, "app:a", 16) is None  # too short
        assert reads.question_rows(turn, ids, "app:a", 16, beyond=39) is None   # has them
        got: dict[str, object] = {}
        waiter = threading.Thread(target=lambda: got.update(
            hit=reads.question_rows(turn, ids + [7], "app:a", 16)))
        waiter.start()
        time.sleep(0.05)
        assert waiter.is_alive()                  # it waits for the opener's question
        reads.share(turn, rows)
        waiter.join(GUARD_S)
        hit = got["hit"]
        assert hit.count == 40 and hit.take()[0][0].shape == (2, 40, 4)
        assert reads.question_rows(turn, ids, "app:a", 16).count == 39  # its last one runs
        assert reads.question_rows(turn, ids[:6], "app:a", 16).count == 5   # the whole prompt
    with reads.opened("c", object(), 5, ids, "app:a") as turn:    # type: ignore[arg-type]
        waiter = threading.Thread(target=lambda: got.update(
            none=reads.question_rows(turn, ids, "app:a", 16)))
        waiter.start()
    waiter.join(GUARD_S)                          # closed without sharing: it stops waiting
    assert not waiter.is_alive() and got["none"] is None


def _service(lm, tmp_path, **kw):
    from helpers import flash_profile

    from sparkv.device import ContextService

    return ContextService(lm, 256 << 20, tmp_path / "svc", io_profile=flash_profile(fast=True),
                          **kw)


def _opener_waits(svc, cid: str, joiners: int, monkeypatch, failing: str = "") -> None:
    """The service's turns: on the thread named ``opener``, waiting until ``joiners`` calls
    joined its read turn; on the thread named ``failing``, raising."""
    from sparkv.device import callflow as flow_module

    real = flow_module.run_turn

    def turn(*args, **kw):
        name = threading.current_thread().name
        if name == "opener":
            deadline = time.monotonic() + GUARD_S
            while svc.flow.reads._open[cid].joined < joiners:
                assert time.monotonic() < deadline, "the other calls never joined"
                time.sleep(0.01)
        if name == failing:
            raise RuntimeError(f"the {name}'s turn failed")
        return real(*args, **kw)

    monkeypatch.setattr(flow_module, "run_turn", turn)


def _opener_first(svc, call, others: list[str]) -> None:
    """Runs ``call(name)`` on a thread named ``opener``, then (once its read turn is open) on
    one thread per name of ``others``; waits for all."""
    opener = threading.Thread(target=call, args=("opener",), name="opener")
    opener.start()
    while svc.flow.reads.open_count() == 0 and opener.is_alive():
        time.sleep(0.005)
    threads = [threading.Thread(target=call, args=(n,), name=n) for n in others]
    for th in threads:
        th.start()
    for th in [opener, *threads]:
        th.join(GUARD_S)
    for ctx in svc.registry.live():     # a handed-off read turn's end gives the lock back last
        assert ctx.lock.acquire(timeout=GUARD_S)
        ctx.lock.release()


@pytest.mark.parametrize("turn_cache", [None, 0])
def test_calls_on_one_context_join_one_read_turn_and_answer_as_alone(smollm2, tmp_path,
                                                                     monkeypatch, turn_cache):
    """Four sampled calls at once: the first switches in and holds its turn until the other
    three joined; each answers what it answers alone with its seed, the joiners switched
    nothing in (and, with no kept turns, ran only the last token of their question: the
    opener's rows gave the rest), and the account, the context and its densities are whole
    afterwards."""
    lm = smollm2
    svc = _service(lm, tmp_path, turn_cache_bytes=turn_cache)
    cid = svc.new_context(system_ids=sample_context_ids(lm, 100))
    q = "What is the text about?"
    names = ["opener", "c1", "c2", "c3"]
    sampling = {n: Sampling(temperature=0.9, seed=11 + i) for i, n in enumerate(names)}
    alone = {n: svc.call(cid, q, max_new_tokens=6, grow=False, sampling=sampling[n])
             for n in names}
    tokens = svc.describe(cid).tokens
    _opener_waits(svc, cid, 3, monkeypatch)
    out: dict[str, object] = {}

    def call(name: str) -> None:
        out[name] = svc.call(cid, q, max_new_tokens=6, grow=False, sampling=sampling[name])

    _opener_first(svc, call, names[1:])
    assert sorted(out) == sorted(names)
    for i, n in enumerate(names):
        assert out[n].tokens == alone[n].tokens and out[n].seed == 11 + i
    assert [out[n].joined for n in names] == [False, True, True, True]
    assert all(out[n].switch_s == 0.0 and out[n].load_s == 0.0 for n in names[1:])
    opened = out["opener"].load.sources                    # what the joiners read came from
    assert opened and all(v > 0 for v in opened.values())
    assert all(out[n].load.sources == opened and out[n].load.reads == 0 for n in names[1:])
    if turn_cache == 0:
        assert out["opener"].turn_tokens_reused == 0
        reused = {out[n].turn_tokens_reused for n in names[1:]}
        assert len(reused) == 1 and reused.pop() > 4      # the question but its last token
    assert svc.account.claims == {} and svc.flow.reads.open_count() == 0
    assert svc.describe(cid).tokens == tokens and svc.describe(cid).calls == 4 + 4   # joiners too
    st = svc.stats()
    assert st["budget_violations"] == 0 and st["joined_reads"] == 3
    grown = svc.call(cid, "Thanks.", max_new_tokens=3)           # the context still grows
    assert grown.context_tokens > tokens


def test_a_growing_call_waits_for_the_read_turn_and_does_not_join(smollm2, tmp_path,
                                                                  monkeypatch):
    from sparkv.device import callflow as flow_module

    lm = smollm2
    svc = _service(lm, tmp_path)
    cid = svc.new_context(system_ids=sample_context_ids(lm, 80))
    real, in_turn, release = flow_module.run_turn, threading.Event(), threading.Event()

    def held(*args, **kw):
        if threading.current_thread().name == "reader":
            in_turn.set()
            assert release.wait(GUARD_S)
        return real(*args, **kw)

    monkeypatch.setattr(flow_module, "run_turn", held)
    out: dict[str, object] = {}
    reader = threading.Thread(target=lambda: out.update(
        r=svc.call(cid, "Why?", max_new_tokens=3, grow=False)), name="reader")
    reader.start()
    assert in_turn.wait(GUARD_S)
    with pytest.raises(Exception) as busy:                     # a growing call: the lock
        svc.call(cid, "Go on.", max_new_tokens=3, timeout_s=0.1)
    assert getattr(busy.value, "code", "") == "context_busy"
    release.set()
    reader.join(GUARD_S)
    assert not out["r"].joined
    assert svc.call(cid, "Go on.", max_new_tokens=3).context_tokens > 80


@pytest.mark.parametrize("failing", ["opener", "joiner"])
def test_a_read_turn_whose_opener_or_joiner_fails_leaves_the_other_whole(smollm2, tmp_path,
                                                                        monkeypatch, failing):
    """The opener's turn fails after a joiner joined: the working memory is given back only
    once the joiner answered (as alone). Or the joiner's turn fails: the opener answers as
    alone. Either way no claim is left and the context answers again."""
    svc = _service(smollm2, tmp_path)
    cid = svc.new_context(system_ids=sample_context_ids(smollm2, 90))
    want = svc.call(cid, "What happens?", max_new_tokens=4, grow=False).tokens
    _opener_waits(svc, cid, 1, monkeypatch, failing)
    out: dict[str, object] = {}

    def call(name: str) -> None:
        try:
            out[name] = svc.call(cid, "What happens?", max_new_tokens=4, grow=False).tokens
        except RuntimeError as e:
            out[name] = str(e)

    _opener_first(svc, call, ["joiner"])
    survivor = "joiner" if failing == "opener" else "opener"
    assert out[failing] == f"the {failing}'s turn failed" and out[survivor] == want
    assert svc.account.claims == {} and svc.flow.reads.open_count() == 0
    monkeypatch.undo()
    assert svc.call(cid, "What happens?", max_new_tokens=4, grow=False).tokens == want
    assert svc.stats()["budget_violations"] == 0


def test_an_opener_answers_without_waiting_for_its_joiner(smollm2, tmp_path, monkeypatch):
    """The opener's turn ends while a joiner still reads (held until the opener returned, a
    longer answer): the opener returns at once, and the service ends the read turn once the
    joiner left: its densities and the opener's in the context, the working memory released,
    no claim left, the lock free, the context answers and grows."""
    from sparkv.device import callflow as flow_module

    svc = _service(smollm2, tmp_path)
    cid = svc.new_context(system_ids=sample_context_ids(smollm2, 90))
    lengths = {"opener": 3, "joiner": 8}
    want = {n: svc.call(cid, "What happens?", max_new_tokens=m, grow=False).tokens
            for n, m in lengths.items()}
    ctx = svc.registry.get(cid)
    calls, mass = svc.describe(cid).calls, ctx.mass.clone()
    real, returned = flow_module.run_turn, threading.Event()

    def turn(*args, **kw):
        name = threading.current_thread().name
        while name == "opener" and svc.flow.reads._open[cid].joined < 1:
            time.sleep(0.01)
        if name == "joiner":
            assert returned.wait(GUARD_S), "the opener waited for its joiner"
        return real(*args, **kw)

    monkeypatch.setattr(flow_module, "run_turn", turn)
    out: dict[str, object] = {}

    def call(name: str) -> None:
        out[name] = svc.call(cid, "What happens?", max_new_tokens=lengths[name], grow=False)
        if name == "opener":
            returned.set()

    _opener_first(svc, call, ["joiner"])
    assert {n: out[n].tokens for n in lengths} == want and out["joiner"].joined
    st = svc.stats()
    assert st["read_handoffs"] == 1 and st["joined_reads"] == 1
    assert svc.account.claims == {} and svc.flow.reads.open_count() == 0 and not ctx.lock.locked()
    assert svc.describe(cid).calls == calls + 2
    assert float((ctx.mass - mass).sum()) > 0             # the turn's densities reached it
    monkeypatch.undo()
    assert svc.call(cid, "What happens?", max_new_tokens=3, grow=False).tokens == want["opener"]
    assert svc.call(cid, "Thanks.", max_new_tokens=3).context_tokens > 90
    assert svc.stats()["budget_violations"] == 0


def test_a_joiner_whose_fork_does_not_fit_the_budget_waits_for_the_lock(smollm2, tmp_path,
                                                                       monkeypatch):
    """When a joiner's fork bytes do not fit in the budget now (``try_claim`` says no), it
    leaves the read turn and waits for the context's lock: it answers after the opener, as
    alone, switched in itself, and nothing is over the budget."""
    svc = _service(smollm2, tmp_path)
    cid = svc.new_context(system_ids=sample_context_ids(smollm2, 90))
    want = svc.call(cid, "Who is it about?", max_new_tokens=4, grow=False).tokens
    monkeypatch.setattr(svc.account, "try_claim", lambda key, nbytes: False)
    _opener_waits(svc, cid, 1, monkeypatch)
    out: dict[str, object] = {}

    def call(name: str) -> None:
        out[name] = svc.call(cid, "Who is it about?", max_new_tokens=4, grow=False)

    _opener_first(svc, call, ["second"])
    assert [out[k].tokens for k in ("opener", "second")] == [want, want]
    assert not out["second"].joined and svc.stats()["joined_reads"] == 0
    assert svc.account.claims == {} and svc.stats()["budget_violations"] == 0


def test_a_claim_that_does_not_fit_is_refused_and_one_that_fits_is_counted(smollm2, tmp_path):
    svc = _service(smollm2, tmp_path)
    acc = svc.account
    used = acc.used()
    assert acc.try_claim("big", acc.limit - used + 1) is False and acc.claims == {}
    assert acc.try_claim("fits", 1000) is True and acc.used() == used + 1000
    acc.unclaim("fits")
    assert acc.claims == {} and acc.used() == used
