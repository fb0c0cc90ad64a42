"""Answer tokens of several contexts as one forward pass (sparkv/runtime/batchdecode.py,
sparkv/cache/batch.py) and through the device service's compute worker (CoreGate.run_decode):
each row gets the logits its own pass gives (within float32 rounding) and its own memory takes
its token, whatever the contexts' lengths and forms (dense, paged int8). Logic tests on a tiny
random Llama: no timing."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from sparkv.asks.cores import CoreGate
from sparkv.cache import SparkvCache
from sparkv.cache.batch import BatchCache
from sparkv.runtime.batchdecode import DecodeItem, decode_step, decode_together, decoding_through
from sparkv.runtime.generate import context_memory, greedy_generate, reference_prefill

GUARD_S = 30.0
LENGTHS = (37, 64, 50)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _caches(lm, int8: bool = True) -> list[SparkvCache]:
    """One cache per context of LENGTHS; the second at int8 in pages (when ``int8``)."""
    caches = []
    for i, n in enumerate(LENGTHS):
        mem = context_memory(lm, reference_prefill(lm, _ids(n, i)), n)
        if int8 and i == 1:
            for cid in mem.geometry.chunk_ids():
                mem.set_level(cid, "int8")
        caches.append(SparkvCache(mem))
    return caches


def test_a_batch_pass_gives_each_context_the_logits_of_its_own_pass(tiny_llama):
    alone, together = _caches(tiny_llama), _caches(tiny_llama)
    tokens = [3, 17, 99]
    for step in range(3):                      # each step reads what the last one appended
        want = [decode_together(tiny_llama, [DecodeItem(c, t, n + step)])[0]
                for c, t, n in zip(alone, tokens, LENGTHS)]
        got = decode_together(tiny_llama, [DecodeItem(c, t, n + step)
                                           for c, t, n in zip(together, tokens, LENGTHS)])
        assert got.shape == (3, 128)
        for i in range(3):
            torch.testing.assert_close(got[i], want[i], atol=1e-4, rtol=1e-4)
        tokens = [int(w.argmax()) for w in want]
        assert tokens == [int(g.argmax()) for g in got]
    for a, b in zip(alone, together):
        assert a.layers[0].get_seq_length() == b.layers[0].get_seq_length()


def test_a_batch_refuses_what_it_cannot_run(tiny_llama):
    with pytest.raises(ValueError):
        BatchCache([])
    with pytest.raises(ValueError):
        decode_together(tiny_llama, [])
    cache = BatchCache(_caches(tiny_llama, int8=False)[:2])
    with pytest.raises(ValueError):            # two tokens per row: a prefill, not a decode step
        cache.layers[0].update(torch.zeros(2, 2, 2, 16), torch.zeros(2, 2, 2, 16))


def _start_behind(gate: CoreGate, holder, answer, n: int) -> list[threading.Thread]:
    """Starts ``answer(i)`` for ``i < n`` on threads while ``holder`` holds the cores, and
    gives them back once all ``n`` wait for them."""
    threads = [threading.Thread(target=answer, args=(i,)) for i in range(n)]
    with holder.hold():
        for th in threads:
            th.start()
        deadline = time.monotonic() + GUARD_S
        while gate.stats()["waiting"] < n:
            assert time.monotonic() < deadline, "the answers never waited"
            time.sleep(0.005)
    return threads


def test_a_threads_answer_tokens_follow_its_route(tiny_llama):
    seen: list[int] = []

    def route(lm, item):
        seen.append(item.position)
        return decode_together(lm, [item])[0]

    cache = _caches(tiny_llama, int8=False)[0]
    with decoding_through(route):
        decode_step(tiny_llama, DecodeItem(cache, 5, LENGTHS[0]))
    decode_step(tiny_llama, DecodeItem(cache, 6, LENGTHS[0] + 1))   # the route ended
    assert seen == [LENGTHS[0]]


def test_the_gate_runs_the_answer_tokens_waiting_together_as_one_pass(tiny_llama):
    gate = CoreGate(order="oldest")
    holder = gate.lane()
    lanes = [gate.lane() for _ in LENGTHS]
    alone, together = _caches(tiny_llama), _caches(tiny_llama)
    want = [decode_together(tiny_llama, [DecodeItem(c, 7, n)])[0]
            for c, n in zip(alone, LENGTHS)]
    got: dict[int, torch.Tensor] = {}

    def answer(i: int) -> None:
        got[i] = lanes[i].run_decode(tiny_llama, DecodeItem(together[i], 7, LENGTHS[i]))

    threads = _start_behind(gate, holder, answer, 3)    # the cores are taken: all three wait
    for th in threads:
        th.join(GUARD_S)
    assert gate.batched_units == 2 and gate.units == 1 + 3   # the holder's, then one pass of 3
    for i in range(3):
        torch.testing.assert_close(got[i], want[i], atol=1e-4, rtol=1e-4)


def test_two_asks_answering_at_once_share_their_passes_rather_than_take_turns(tiny_llama):
    """Each ask asks for its next token only once its last one came back, so the other's
    token is always the one waiting: granted at once, they would take turns, one pass each.
    The gate waits for an answering ask between two tokens (``gather_s``), and the two run as
    one pass from the second token on. Each keeps the tokens' logits it gets alone."""
    tokens = 5
    gate = CoreGate(order="oldest", gather_s=GUARD_S)
    holder = gate.lane()
    lanes = [gate.lane() for _ in range(2)]
    alone, together = _caches(tiny_llama, int8=False)[:2], _caches(tiny_llama, int8=False)[:2]
    want = [[decode_together(tiny_llama, [DecodeItem(c, 7, n + t)])[0] for t in range(tokens)]
            for c, n in zip(alone, LENGTHS)]
    got: dict[int, list[torch.Tensor]] = {0: [], 1: []}

    def answer(i: int) -> None:
        lanes[i].answered()
        for t in range(tokens):
            got[i].append(lanes[i].run_decode(tiny_llama,
                                              DecodeItem(together[i], 7, LENGTHS[i] + t)))
        lanes[i].close()                       # the ask ended: no one waits for its token

    threads = _start_behind(gate, holder, answer, 2)    # both first tokens wait: together
    for th in threads:
        th.join(GUARD_S * 2)
        assert not th.is_alive()
    assert gate.units == 1 + 2 * tokens
    assert gate.batched_units == tokens        # every pass ran both asks' tokens
    for i in range(2):
        for t in range(tokens):
            torch.testing.assert_close(got[i][t], want[i][t], atol=1e-4, rtol=1e-4)


def test_a_bound_asks_answer_is_the_one_it_gets_alone(tiny_llama):
    from sparkv.asks import forward

    forward.install(tiny_llama.model)
    n, question = LENGTHS[0], [5, 9, 11]
    kv = reference_prefill(tiny_llama, _ids(n, 0))
    want = greedy_generate(tiny_llama, kv, n, question, max_new_tokens=6, stop_at_eos=False)
    lane = CoreGate().lane()
    reported: list[int] = []
    with forward.bound(lane, lambda t, lp: reported.append(t)):
        got = greedy_generate(tiny_llama, kv, n, question, max_new_tokens=6, stop_at_eos=False)
    assert got.tokens == want.tokens == reported
    assert lane.units == 6 and lane.answering  # the question's pass, then five answer tokens
