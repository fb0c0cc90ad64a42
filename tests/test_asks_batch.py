"""Batching the same layer of several asks into one call: :func:`run_steps_together` gives each
context the K/V, hidden states and answer its own steps give, and the device's compute gate
(:class:`CoreGate`) takes the waiting asks' steps at the holder's layer along in its call, each
rider getting its own result, a cancelled rider raising in its own thread only, different layers
never together. The tiny random Llama (fp32): logic and numbers, no timing."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from sparkv.asks.cores import CoreGate
from sparkv.edge.lane import AskCancelled, LaneStepper
from sparkv.layout import StepId
from sparkv.runtime import LayerStepper, MissingDependencyError, greedy_generate
from sparkv.runtime.stepper import run_steps_together, together_key

GUARD_S = 60.0   # hang guard of a thread join (never a timing assertion)
T = 32
TOL = 1e-5       # fp32 rounding: the GEMMs see more rows


def _ids(lm, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, lm.config.vocab_size, (n,), generator=g).tolist()


def _until(cond, what: str) -> None:
    deadline = time.monotonic() + GUARD_S
    while not cond():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.005)


def _max_err(a, b) -> float:
    return max(max(float((x - y).abs().max()), float((u - w).abs().max()))
               for (x, u), (y, w) in zip(a, b))


def _contexts(lm, full_last_layer: bool = False):
    """Three contexts of different lengths (ragged last chunks), each twice: one stepper run
    alone, one for the batched run."""
    ids = [_ids(lm, n, seed) for n, seed in ((100, 1), (70, 2), (130, 3))]
    make = lambda: [LayerStepper(lm, x, T, full_last_layer=full_last_layer) for x in ids]  # noqa: E731
    return ids, make(), make()


# ---- the batched layer function -------------------------------------------------------------------
@pytest.mark.parametrize("full_last_layer", [False, True])
def test_steps_run_together_give_each_context_what_its_own_steps_give(tiny_llama,
                                                                       full_last_layer):
    lm = tiny_llama
    L = lm.config.num_hidden_layers
    ids, alone, together = _contexts(lm, full_last_layer)
    question = _ids(lm, 6, 9)
    for st in alone:
        st.complete()
    # layer by layer, each context at its own chunk (they differ: the same layer only matters)
    chunks = [st.geometry.num_token_chunks for st in together]
    for t in range(max(chunks)):
        for l in range(L):  # noqa: E741
            pairs = [(st, StepId(t, l)) for st, n in zip(together, chunks) if t < n]
            results = run_steps_together(pairs)
            assert [r.step for r in results] == [s for _, s in pairs]
            assert len({r.seconds for r in results}) == 1        # the call's time, shared
            if l < L - 1 or full_last_layer:
                assert all(r.stats is not None for r in results)
    for x, a, b in zip(ids, alone, together):
        assert b.kv.is_complete() and b.done == a.done
        assert _max_err(b.kv.layer_kv(), a.kv.layer_kv()) <= TOL
        ga = greedy_generate(lm, a.kv, len(x), question, 8, stop_at_eos=False)
        gb = greedy_generate(lm, b.kv, len(x), question, 8, stop_at_eos=False)
        assert gb.tokens == ga.tokens
        assert float((gb.first_logits - ga.first_logits).abs().max()) <= TOL


def test_the_hidden_state_each_step_keeps_is_its_own(tiny_llama):
    lm = tiny_llama
    _, alone, together = _contexts(lm)
    for st in alone:
        st.run_step(StepId(0, 0))
        st.run_step(StepId(1, 0))
    run_steps_together([(st, StepId(0, 0)) for st in together])
    run_steps_together([(st, StepId(1, 0)) for st in together])
    for a, b in zip(alone, together):
        for t in (0, 1):
            ya, yb = a._hidden[StepId(t, 0)], b._hidden[StepId(t, 0)]
            assert ya.shape == yb.shape and float((ya - yb).abs().max()) <= TOL


def test_steps_that_cannot_go_together_are_refused_before_anything_runs(tiny_llama):
    lm = tiny_llama
    _, _, (a, b, c) = _contexts(lm)
    with pytest.raises(ValueError, match="different models, layers"):
        run_steps_together([(a, StepId(0, 0)), (b, StepId(0, 1))])
    with pytest.raises(ValueError, match="two steps of one stepper"):
        run_steps_together([(a, StepId(0, 0)), (a, StepId(1, 0))])
    with pytest.raises(MissingDependencyError, match=r"step\(t=1, l=0\)"):
        run_steps_together([(a, StepId(0, 0)), (b, StepId(1, 0))])   # b's chunk 0 is missing
    assert not a.done and not b.done                                  # nothing ran
    assert together_key(a, StepId(0, 1)) != together_key(b, StepId(0, 0))
    assert together_key(a, StepId(3, 1)) == together_key(c, StepId(0, 1))

    class Slow(LayerStepper):
        pass

    assert together_key(Slow(lm, [1, 2, 3], T), StepId(0, 0)) is None   # runs alone


def test_a_layer_with_forward_hooks_runs_its_steps_alone(tiny_llama):
    """A press's hooks on a layer would see several contexts' rows as one: that layer's steps get
    no key (they run alone); the other layers still go together, and removing the hook brings
    the key back."""
    lm = tiny_llama
    _, _, (a, b, _) = _contexts(lm)
    attn = lm.decoder.layers[1].self_attn
    for add_hook in (lambda: attn.register_forward_hook(lambda *args: None),
                     lambda: attn.register_forward_pre_hook(lambda *args: None)):
        handle = add_hook()
        try:
            assert together_key(a, StepId(0, 1)) is None
            assert together_key(a, StepId(0, 0)) == together_key(b, StepId(0, 0)) is not None
        finally:
            handle.remove()
        assert together_key(a, StepId(0, 1)) == together_key(b, StepId(0, 1)) is not None
    # a hook marked rows-safe (the device service's density hook: a no-op on every thread but
    # a recording one) leaves batching on
    from sparkv.runtime.hooks import rows_safe

    handle = attn.register_forward_hook(rows_safe(lambda *args: None))
    try:
        assert together_key(a, StepId(0, 1)) == together_key(b, StepId(0, 1)) is not None
    finally:
        handle.remove()


# ---- the gate: riders join the holder's call ------------------------------------------------------
def _queue_steps(gate, blocker, jobs):
    """Starts one thread per ``(lane, stepper, step)`` while ``blocker`` holds the cores, waits
    until all are queued, then lets the cores go. Returns each thread's result or exception."""
    out: list = [None] * len(jobs)

    def run(i: int) -> None:
        lane, stepper, step = jobs[i]
        try:
            out[i] = LaneStepper(stepper, lane).run_step(step)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    with blocker.hold():
        for i, th in enumerate(threads):
            th.start()
            _until(lambda: gate.stats()["waiting"] == i + 1, f"unit {i} waits")
    for th in threads:
        th.join(GUARD_S)
        assert not th.is_alive()
    return out


@pytest.mark.parametrize("order", ["oldest", "turns"])
def test_waiting_steps_at_the_holders_layer_ride_in_its_call_and_get_their_own_results(
        tiny_llama, order):
    lm = tiny_llama
    gate = CoreGate(order=order)
    blocker = gate.lane()
    _, alone, together = _contexts(lm)
    lanes = [gate.lane() for _ in together]
    for st in alone:
        st.run_step(StepId(0, 0))
    out = _queue_steps(gate, blocker, [(ln, st, StepId(0, 0)) for ln, st in zip(lanes, together)])
    assert [r.step for r in out] == [StepId(0, 0)] * 3
    stats = gate.stats()
    assert stats["batched_units"] == 2 and stats["units"] == 4 and stats["batch"] == 4
    assert [ln.units for ln in lanes] == [1, 1, 1] and not any(ln.holding for ln in lanes)
    for a, b in zip(alone, together):
        assert _max_err([_chunk(b)], [_chunk(a)]) <= TOL
        assert float((b._hidden[StepId(0, 0)] - a._hidden[StepId(0, 0)]).abs().max()) <= TOL


def _chunk(st):
    """Step (0, 0)'s K/V of ``st``."""
    from sparkv.layout import KVChunkId

    p = st.kv.read(KVChunkId(0, 0, 0))
    return p.k, p.v


def test_steps_at_different_layers_never_ride_together(tiny_llama):
    lm = tiny_llama
    gate = CoreGate()
    blocker = gate.lane()
    _, _, (a, b, c) = _contexts(lm)
    a.run_step(StepId(0, 0))
    lanes = [gate.lane() for _ in range(3)]
    out = _queue_steps(gate, blocker, [(lanes[0], a, StepId(0, 1)), (lanes[1], b, StepId(0, 0)),
                                       (lanes[2], c, StepId(1, 0))])   # c's chunk 0 is missing
    assert [r.step for r in out[:2]] == [StepId(0, 1), StepId(0, 0)]
    assert isinstance(out[2], MissingDependencyError)   # raised in its own thread, alone
    assert gate.stats()["batched_units"] == 0


def test_with_batching_off_every_step_runs_alone(tiny_llama):
    gate = CoreGate(batch=1)
    blocker = gate.lane()
    _, _, steppers = _contexts(tiny_llama)
    out = _queue_steps(gate, blocker, [(gate.lane(), st, StepId(0, 0)) for st in steppers])
    assert [r.step for r in out] == [StepId(0, 0)] * 3
    assert gate.stats()["batched_units"] == 0 and gate.stats()["batch"] == 1
    with pytest.raises(ValueError):
        CoreGate(batch=0)


def test_a_rider_cancelled_while_waiting_or_during_the_call_raises_only_in_its_own_thread(
        tiny_llama):
    """Lane 1 is cancelled while it waits: it is not taken and raises. Lane 2 rides and is
    cancelled during the call (by the layer's attention): its step runs, its thread
    raises AskCancelled when the call ends. The holder (lane 0) gets its result."""
    lm = tiny_llama
    gate = CoreGate()
    blocker = gate.lane()
    _, alone, (a, b, c) = _contexts(lm)
    lanes = [gate.lane() for _ in range(3)]
    attn = lm.decoder.layers[0].self_attn
    real_forward = attn.forward     # cancelled during the call: an instance forward, not a
                                    # hook (a layer with hooks runs its steps alone)

    def cancelling(*args, **kwargs):
        lanes[2].cancel()
        return real_forward(*args, **kwargs)

    attn.forward = cancelling
    out: list = [None] * 3

    def run(i: int, stepper) -> None:
        try:
            out[i] = LaneStepper(stepper, lanes[i]).run_step(StepId(0, 0))
        except AskCancelled as exc:
            out[i] = exc

    try:
        threads = [threading.Thread(target=run, args=(i, st)) for i, st in enumerate((a, b, c))]
        with blocker.hold():
            for i, th in enumerate(threads):
                th.start()
                _until(lambda: gate.stats()["waiting"] == i + 1, f"unit {i} waits")
            lanes[1].cancel()
            _until(lambda: gate.stats()["waiting"] == 2, "the cancelled lane leaves the queue")
        for th in threads:
            th.join(GUARD_S)
    finally:
        del attn.forward
    assert out[0].step == StepId(0, 0)
    assert isinstance(out[1], AskCancelled) and isinstance(out[2], AskCancelled)
    assert StepId(0, 0) not in b.done and StepId(0, 0) in c.done      # c rode, b did not
    assert gate.stats()["batched_units"] == 1
    alone[0].run_step(StepId(0, 0))
    assert float((a._hidden[StepId(0, 0)] - alone[0]._hidden[StepId(0, 0)]).abs().max()) <= TOL


def test_a_call_takes_riders_only_up_to_its_rows(tiny_llama):
    """Chunks of 32 rows, a cap of 64: the holder takes one rider, the third step runs alone."""
    gate = CoreGate(batch_rows=2 * T)
    blocker = gate.lane()
    _, _, steppers = _contexts(tiny_llama)
    out = _queue_steps(gate, blocker, [(gate.lane(), st, StepId(0, 0)) for st in steppers])
    assert [r.step for r in out] == [StepId(0, 0)] * 3
    assert gate.stats()["batched_units"] == 1 and gate.stats()["units"] == 4
