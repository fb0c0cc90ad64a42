"""The on-device context service (LLMS, issue 13) with the real SmolLM2, real flash files and a real
``sparkv device serve`` process: swapping is exact, interleaved partial recomputation equals a full
prefill, the budget holds at every step, ahead-of-time swap-out empties the reclaim path, the
LCTRU order, crash recovery, and the REST service's errors."""

from __future__ import annotations

import random

import pytest
import torch

from sparkv.cache import ContextKV, Residency, Source
from sparkv.device import BudgetTooSmall, ContextService, PromptTooLong, UnknownContext
from sparkv.device.budget import eviction_policy
from sparkv.device.flashio import ServiceFlash
from sparkv.device.loader import (LoadOptions, LoadRequest, chunk_payload, load,
                                  token_chunk_ids)
from sparkv.device.service import ServiceConfig
from sparkv.layout import ChunkGeometry, KVChunkId
from sparkv.runtime.generate import greedy_generate, sample_context_ids
from sparkv.runtime.hfcache import output_cache
from helpers import CHAT_TURNS, flash_profile

FAST_FLASH = flash_profile(fast=True)
#: how long a test waits for another thread before it says it is stuck (a guard, not a timing:
#: a loaded machine answers a short call well within it)
WAIT_S = 300
SLOW_FLASH = flash_profile(fast=False)
TURNS = CHAT_TURNS


@pytest.fixture(scope="module")
def lm(smollm2):
    return smollm2


@pytest.fixture(scope="module")
def doc(lm):
    return sample_context_ids(lm, 120)


def _svc(lm, tmp_path, budget=256 << 20, name="svc", **kw):
    kw.setdefault("io_profile", FAST_FLASH)
    return ContextService(lm, budget, tmp_path / name, **kw)


def _resident(svc, cid):
    return svc.describe(cid).chunks


# ---- 1. swapped out and back == never swapped ------------------------------------------------------
def test_swapped_out_and_back_answers_exactly_as_never_swapped(lm, doc, tmp_path):
    ref = _svc(lm, tmp_path, name="ref", compression="fp")
    swp = _svc(lm, tmp_path, name="swp", compression="fp")
    a, b = ref.new_context(system_ids=doc), swp.new_context(system_ids=doc)
    for i, turn in enumerate(TURNS):
        ra = ref.call(a, turn, max_new_tokens=12)
        written = swp.swap_out(b)
        chunks = _resident(swp, b)
        assert chunks.resident == 0 and chunks.flash > 0
        assert swp.used_bytes() == 0
        rb = swp.call(b, turn, max_new_tokens=12)
        assert rb.tokens == ra.tokens, (i, turn)
        assert rb.load.read_chunks > 0 and rb.load.recomputed_chunks == 0
        # LLMS's segments: adjacent records are read together (fewer reads than chunks; the
        # chunk-file layout of the baselines read one file per chunk)
        assert 1 <= rb.load.files_read <= rb.load.reads < rb.load.read_chunks
        assert written == 0          # ahead-of-time swap-out: every chunk was already on flash
    assert ref.describe(a).tokens == swp.describe(b).tokens
    assert ref.counters.read_chunks == 0


# ---- 2. partial recomputation of interleaved chunks == full prefill --------------------------------
def test_partial_recompute_of_interleaved_chunks_equals_full_prefill(lm, doc, tmp_path):
    tokens = list(doc[:115])                                 # 8 chunks, the last one partial
    g = ChunkGeometry.from_config(lm.config, len(tokens), 16)
    tier = ServiceFlash(tmp_path / "tier")
    # reference: the model's own prefill (transformers, one forward pass)
    with torch.inference_mode():
        out = lm.model(input_ids=torch.tensor([tokens]), use_cache=True)
    pkv = output_cache(out)
    ref = [(pkv.layers[l].keys, pkv.layers[l].values) for l in range(g.num_layers)]

    # the service's full prefill (every chunk recomputed)
    full = ContextKV(g, lm.dtype, lm.device)
    load(lm, tokens, full, full, tier, LoadRequest(recompute=range(g.num_token_chunks)),
         LoadOptions(store_recomputed=False))
    for l in range(g.num_layers):  # noqa: E741
        st = full.layers[l]
        torch.testing.assert_close(st.k[:, :, :len(tokens)], ref[l][0], atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(st.v[:, :, :len(tokens)], ref[l][1], atol=2e-4, rtol=1e-4)

    # a context missing interleaved chunks (first, middle ones, the partial last), recomputed
    C = ContextKV(g, lm.dtype, lm.device, paged=True)
    missing = [0, 2, 3, 5, 7]
    for t in range(g.num_token_chunks):
        if t not in missing:
            for cid in token_chunk_ids(g, t):
                C.put_payload(chunk_payload(full, cid, "fp"), Source.COMPUTED)
    W = ContextKV(g, lm.dtype, lm.device, spare_tokens=32)
    stats = load(lm, tokens, C, W, tier, LoadRequest(recompute=missing),
                 LoadOptions(level_of=lambda t: "fp"))
    assert stats.recomputed_chunks == len(missing) and stats.resident_chunks == 0
    for l in range(g.num_layers):  # noqa: E741
        torch.testing.assert_close(W.layers[l].k[:, :, :len(tokens)], ref[l][0], atol=2e-4,
                                   rtol=1e-4)
        torch.testing.assert_close(W.layers[l].v[:, :, :len(tokens)], ref[l][1], atol=2e-4,
                                   rtol=1e-4)
    # the recomputed chunks joined C: it is whole again
    assert all(C.residency(c) == Residency.RESIDENT for c in g.chunk_ids())
    q = lm.encode_text("\nWhat is this text about?")
    a = greedy_generate(lm, W, len(tokens), q, 12)
    b = greedy_generate(lm, full, len(tokens), q, 12)
    with torch.inference_mode():
        r = lm.model.generate(torch.tensor([tokens + q]), max_new_tokens=12, do_sample=False)
    assert a.tokens == b.tokens == r[0, len(tokens) + len(q):].tolist()[:len(a.tokens)]


def test_service_recomputes_interleaved_chunks_when_flash_is_slow(lm, doc, tmp_path):
    """The planner's split, end to end: chunks on slow flash are recomputed (some interleaved
    with resident ones), and the answer is the never-swapped one."""
    ref = _svc(lm, tmp_path, name="ref", compression="fp")
    svc = _svc(lm, tmp_path, name="slow", compression="fp", io_profile=SLOW_FLASH)
    a, b = ref.new_context(system_ids=doc), svc.new_context(system_ids=doc)
    ctx = svc.contexts[b]
    g = ctx.memory.geometry
    with svc.registry.lock:
        svc.keeper.evict(ctx, [1, 3, 4, 6])                       # interleaved holes
    res = svc.call(b, TURNS[1], max_new_tokens=12)
    assert res.load.recomputed_chunks == 4 and res.load.read_chunks == 0
    assert res.tokens == ref.call(a, TURNS[1], max_new_tokens=12).tokens
    assert g.num_token_chunks > 6


# ---- 3. the budget over a random trace --------------------------------------------------------------
def test_budget_never_exceeded_over_a_random_trace(lm, doc, tmp_path):
    budget = int(7.5 * (1 << 20))
    # ratio 0.5 (no fp sink chunk): int2/int4/int8 chunks, so four contexts' chunks, a working
    # memory and the kept working memories compete for 7.5 MB
    svc = _svc(lm, tmp_path, budget=budget, io_profile=None, ratio=0.5, fp_protect=0)
    seen: list[int] = []
    own_check = svc.account.check

    def check() -> int:           # at every layer, chunk and allocation the service makes
        used = own_check()
        real = sum(c.memory.recount() for c in svc.contexts.values() if c.memory is not None)
        real += sum(w.recount() for w in svc.account.working.values())
        seen.append(real)
        assert real <= budget, f"{real} bytes held, budget {budget}"
        return used

    svc.account.check = check
    rng = random.Random(13)
    ids = [svc.new_context(system_ids=doc[i * 20:i * 20 + 40 + 10 * i]) for i in range(4)]
    for step in range(10):
        cid = rng.choice(ids)
        svc.call(cid, rng.choice(TURNS), max_new_tokens=rng.randint(1, 6))
        assert svc.used_bytes() <= budget
    st = svc.stats()
    assert st["budget_violations"] == 0 and st["peak_bytes"] <= budget
    assert st["evicted_chunks"] > 0                 # the budget really was tight
    assert len(seen) > 100 and max(seen) <= budget
    assert st["hot_hits"] > 0                       # kept working memories were used, in budget


def test_budget_too_small_and_bad_input(lm, doc, tmp_path):
    svc = _svc(lm, tmp_path, budget=1 << 20)
    with pytest.raises(BudgetTooSmall):
        svc.new_context(system_ids=doc)
    assert svc.list() == []
    big = _svc(lm, tmp_path, name="big", max_context_tokens=150)
    cid = big.new_context(system_ids=doc[:50])
    with pytest.raises(PromptTooLong):
        big.call(cid, prompt_ids=list(doc[:140]), max_new_tokens=20)
    with pytest.raises(UnknownContext):
        big.call("nope", "hi")
    big.delete(cid)
    with pytest.raises(UnknownContext):
        big.describe(cid)
    with pytest.raises(ValueError):
        ServiceConfig(compression="int3")


# ---- 4. ahead-of-time swap-out ----------------------------------------------------------------------
@pytest.mark.parametrize("aot", [True, False])
def test_aot_swap_out_makes_the_reclaim_write_nothing(lm, doc, tmp_path, aot):
    budget = 8 << 20
    svc = _svc(lm, tmp_path, budget=budget, compression="int8", aot=aot, eviction="lru")
    ids = [svc.new_context(system_ids=doc[i * 10:i * 10 + 60]) for i in range(4)]
    for cid in ids + ids:
        svc.call(cid, TURNS[0], max_new_tokens=4)
    st = svc.stats()
    assert st["evicted_bytes"] > 0
    if aot:
        assert st["reclaim_written_bytes"] == 0 and st["aot_written_bytes"] > 0
    else:
        assert st["reclaim_written_bytes"] > 0 and st["aot_written_bytes"] == 0


# ---- 5. LCTRU -----------------------------------------------------------------------------------------
def test_lctru_order_on_a_hand_made_case(lm, doc, tmp_path):
    svc = _svc(lm, tmp_path, compression="int8")
    a = svc.new_context(system_ids=doc[:48])      # 3 chunks
    b = svc.new_context(system_ids=doc[48:80])    # 2 chunks
    c = svc.new_context(system_ids=doc[80:96])    # 1 chunk, locked below
    A, B = svc.contexts[a], svc.contexts[b]
    A.levels, A.last_used = ["int2", "int8", "int4"], 1      # A: older
    B.levels, B.last_used = ["int8", "int2"], 2
    order = [(x.id, t) for x, t, _ in svc.account.victims(svc.contexts[c]) if x.id != c]
    # int8 sub-queue first (LRU inside: A before B), then int4, then int2
    assert order == [(a, 1), (b, 0), (a, 2), (a, 0), (b, 1)]
    svc.account.policy = eviction_policy("lru")
    assert [(x.id, t) for x, t, _ in svc.account.victims(svc.contexts[c]) if x.id != c] == \
        [(a, 0), (a, 1), (a, 2), (b, 0), (b, 1)]
    svc.account.policy = eviction_policy("lctru")
    # a locked context is never a victim
    with svc.locked(a):
        assert all(x.id != a for x, _, _ in svc.account.victims(svc.contexts[c]))
    # reclaiming a little more than one chunk takes exactly the first two of the queue
    first = svc.account.victims(svc.contexts[c])
    need = svc.budget - svc.used_bytes() + first[0][2] + 1
    svc.account.reserve(need, svc.contexts[c])
    gone = {(x, t) for x in (a, b) for t in range(3 if x == a else 2)
            if svc.contexts[x].memory.residency(KVChunkId(t, 0, 0)) != Residency.RESIDENT}
    assert gone == {(a, 1), (b, 0)}


# ---- misc: concurrency on different contexts, journal + reopen in-process ---------------------------
def test_calls_on_different_contexts_do_not_corrupt_each_other(lm, doc, tmp_path):
    import threading

    ref = _svc(lm, tmp_path, name="ref", compression="fp")
    svc = _svc(lm, tmp_path, name="mt", compression="fp", budget=12 << 20)
    want = {}
    ids = []
    for i in range(3):
        r = ref.new_context(system_ids=doc[i * 30:i * 30 + 40])
        want[i] = ref.call(r, TURNS[i], max_new_tokens=8).tokens
        ids.append(svc.new_context(system_ids=doc[i * 30:i * 30 + 40]))
    got: dict[int, list[int]] = {}

    def run(i: int) -> None:
        got[i] = svc.call(ids[i], TURNS[i], max_new_tokens=8).tokens

    ths = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    assert got == want
    assert svc.stats()["budget_violations"] == 0


@pytest.mark.parametrize("budget_mb", [32, 9])
def test_a_call_runs_while_another_is_in_its_turn_or_waits_for_the_memory_it_holds(
        lm, doc, tmp_path, monkeypatch, budget_mb):
    """A call gives the model lock back for its turn (the bytes its fold-back may add claimed
    meanwhile): a call on another context switches in, answers and folds back meanwhile (32 MB:
    room for both); where the memory it needs is held by the turn (9 MB), it waits for the turn
    to end, then answers, rather than failing busy. Either way its answer is the one it gives
    alone, and the budget holds."""
    import threading

    from sparkv.device import callflow as flow_module

    svc = _svc(lm, tmp_path, compression="fp", budget=budget_mb << 20)
    a, b = svc.new_context(system_ids=doc[:60]), svc.new_context(system_ids=doc[60:120])
    want = svc.call(b, TURNS[1], max_new_tokens=4, grow=False).tokens
    real, in_turn, b_done, b_waits = flow_module.run_turn, threading.Event(), \
        threading.Event(), threading.Event()

    class Waits(threading.Condition):           # a reservation waiting for a turn to end
        def wait(self, timeout=None):
            b_waits.set()
            return super().wait(timeout)

    svc.flow._turn_ended = Waits(svc.flow.run)
    seen: dict[str, object] = {}

    def turn(*args, **kw):
        if threading.current_thread().name == "a":
            seen["locked"] = svc.flow.run.locked()      # the model lock given back
            seen["claimed"] = svc.account.claims.get(a, 0) > 0   # its fold-back's bytes
            in_turn.set()
            seen["overlap"] = (b_done if budget_mb == 32 else b_waits).wait(WAIT_S)
        return real(*args, **kw)

    def call_b() -> None:
        assert in_turn.wait(WAIT_S)
        seen["b"] = svc.call(b, TURNS[1], max_new_tokens=4, grow=False).tokens
        b_done.set()

    monkeypatch.setattr(flow_module, "run_turn", turn)
    ths = [threading.Thread(target=lambda: svc.call(a, TURNS[0], max_new_tokens=4), name="a"),
           threading.Thread(target=call_b, name="b")]
    for t in ths:
        t.start()
    for t in ths:
        t.join(2 * WAIT_S)
    assert seen == {"locked": False, "claimed": True, "overlap": True, "b": want}
    assert b_waits.is_set() == (budget_mb == 9)
    assert svc.flow.turns == 0 and svc.account.claims == {}
    st = svc.stats()
    assert st["budget_violations"] == 0 and st["turns_running"] == 0
    assert (st["turn_waits"] > 0) == (budget_mb == 9)


@pytest.mark.parametrize("order_name", ["fcfs", "retry"])
def test_a_call_whose_memory_fits_waits_behind_one_already_waiting(lm, doc, tmp_path,
                                                                    monkeypatch, order_name):
    """First come, first served (``WaitLine``): while call ``a`` runs its turn, call ``b`` waits
    for the memory the turn holds; call ``c``, on a small context whose switch-in fits, arrives
    after ``b`` and waits behind it rather than overtaking it. When ``a``'s turn ends, ``b``
    switches in first, then ``c``; each answers as it does alone. The old order (``retry``,
    kept for comparison) lets ``c`` switch in and answer during ``a``'s turn, before ``b``."""
    import threading

    from sparkv.device import callflow as flow_module

    # 12 MB: b's switch-in does not fit beside a's turn, c's does (before the line, c answered
    # during a's turn and b after it)
    svc = _svc(lm, tmp_path, compression="fp", budget=12 << 20, reservation_order=order_name)
    a, b = svc.new_context(system_ids=doc[:60]), svc.new_context(system_ids=doc[60:120])
    c = svc.new_context(system_ids=doc[:4])
    want = {x: svc.call(x, TURNS[1], max_new_tokens=4, grow=False).tokens for x in (b, c)}
    waits = {name: threading.Event() for name in ("b", "c")}
    real_wait, real_turn = svc.flow._turn_ended.wait, flow_module.run_turn
    real_switch = svc.keeper.switch_in
    in_turn, release = threading.Event(), threading.Event()
    order: list[str] = []               # switch-ins in the order they took their memory

    def wait(timeout=None):
        waits.get(threading.current_thread().name, threading.Event()).set()
        return real_wait(timeout)

    def switch_in(*args, **kw):
        out = real_switch(*args, **kw)   # under the model lock: the order is the line's
        order.append(threading.current_thread().name)
        return out

    def turn(*args, **kw):
        if threading.current_thread().name == "a":
            in_turn.set()
            assert release.wait(WAIT_S)
        return real_turn(*args, **kw)

    monkeypatch.setattr(svc.flow._turn_ended, "wait", wait)
    monkeypatch.setattr(flow_module, "run_turn", turn)
    monkeypatch.setattr(svc.keeper, "switch_in", switch_in)
    got: dict[str, list[int]] = {}

    def call(name: str, ctx: str) -> None:
        got[name] = svc.call(ctx, TURNS[1], max_new_tokens=4, grow=False).tokens

    ths = {"a": threading.Thread(target=call, args=("a", a), name="a")}
    ths["a"].start()
    assert in_turn.wait(WAIT_S)
    for name, ctx in (("b", b), ("c", c)):
        ths[name] = threading.Thread(target=call, args=(name, ctx), name=name)
        ths[name].start()
        if name == "c" and order_name == "retry":
            ths[name].join(WAIT_S)           # c fits: it answers during a's turn
        else:
            assert waits[name].wait(WAIT_S)  # b: the memory is held; c: b waits ahead of it
    if order_name == "fcfs":
        assert order == ["a"] and svc.stats()["reservations_waiting"] == 2
    release.set()
    for th in ths.values():
        th.join(2 * WAIT_S)
    assert order == (["a", "b", "c"] if order_name == "fcfs" else ["a", "c", "b"])
    assert got["b"] == want[b] and got["c"] == want[c]
    st = svc.stats()
    assert st["budget_violations"] == 0 and st["turns_running"] == 0
    assert st["reservations_waiting"] == 0


@pytest.mark.parametrize("policy", ["llms", "swap"])
@pytest.mark.parametrize("grow", [False, True])
def test_a_turn_that_fails_gives_its_working_memory_back(lm, doc, tmp_path, monkeypatch, grow,
                                                         policy):
    """A call whose turn fails (a cancelled ask raises there) leaves nothing counted that no
    reservation may reclaim: its working memory is kept (LLMS: hot; a whole-context keeper: its
    arena) while it holds exactly the context's tokens, else freed; the next call answers as a
    service that never failed."""
    from sparkv.device import callflow as flow_module

    def config() -> ServiceConfig:
        return ServiceConfig.preset(policy, compression="fp")

    ref = _svc(lm, tmp_path, name="ref", config=config())
    svc = _svc(lm, tmp_path, config=config())
    r, a = ref.new_context(system_ids=doc[:60]), svc.new_context(system_ids=doc[:60])
    real = flow_module.run_turn
    calls = []

    def failing(*args, **kw):
        calls.append(1)
        out = real(*args, **kw)                     # it ran (W grew, or was truncated)
        if len(calls) == 1:
            raise RuntimeError("the ask was cancelled")
        return out

    monkeypatch.setattr(flow_module, "run_turn", failing)
    with pytest.raises(RuntimeError):
        svc.call(a, TURNS[0], max_new_tokens=4, grow=grow)
    ctx = svc.contexts[a]
    assert svc.account.working.get(a) in (None, ctx.hot)     # kept or freed, never pinned
    kept = ctx.hot if policy == "llms" else ctx.memory
    assert (kept is None) == grow                             # a grown W is not the context's
    want = ref.call(r, TURNS[1], max_new_tokens=6, grow=grow).tokens
    assert svc.call(a, TURNS[1], max_new_tokens=6, grow=grow).tokens == want
    assert svc.stats()["budget_violations"] == 0


def test_a_switch_in_that_fails_leaves_nothing_counted(lm, doc, tmp_path, monkeypatch):
    """A load that fails midway (a cancelled ask's recomputation, a flash error) frees the
    working memory it was filling; the next call loads again and answers."""
    from sparkv.device import chunked

    ref = _svc(lm, tmp_path, name="ref", compression="fp")
    svc = _svc(lm, tmp_path, compression="fp")
    r, a = ref.new_context(system_ids=doc[:60]), svc.new_context(system_ids=doc[:60])
    svc.swap_out(a)
    real = chunked.load

    def failing(*args, **kw):
        raise RuntimeError("the ask was cancelled")

    monkeypatch.setattr(chunked, "load", failing)
    with pytest.raises(RuntimeError):
        svc.call(a, TURNS[0], max_new_tokens=4, grow=False)
    assert a not in svc.account.working
    monkeypatch.setattr(chunked, "load", real)
    want = ref.call(r, TURNS[0], max_new_tokens=4, grow=False).tokens
    assert svc.call(a, TURNS[0], max_new_tokens=4, grow=False).tokens == want


def test_serial_turns_keep_the_model_lock_for_the_whole_call(lm, doc, tmp_path, monkeypatch):
    """``overlap_turns=False`` (``--serial-turns``, the comparison): a call's turn holds the
    model lock, as every call did before."""
    from sparkv.device import callflow as flow_module

    svc = _svc(lm, tmp_path, compression="fp", overlap_turns=False)
    a = svc.new_context(system_ids=doc[:40])
    real, locked = flow_module.run_turn, []

    def turn(*args, **kw):
        locked.append(svc.flow.run.locked())
        return real(*args, **kw)

    monkeypatch.setattr(flow_module, "run_turn", turn)
    svc.call(a, TURNS[0], max_new_tokens=2)
    assert locked == [True] and svc.flow.turns == 0


def test_a_restarted_service_reopens_its_contexts(lm, doc, tmp_path):
    svc = _svc(lm, tmp_path, name="j")
    cid = svc.new_context(system_ids=doc[:70])
    svc.call(cid, TURNS[0], max_new_tokens=6)
    n = svc.describe(cid).tokens
    again = _svc(lm, tmp_path, name="j")                # same swap dir, nothing in RAM
    assert again.reopened == 1 and again.describe(cid).tokens == n
    assert again.describe(cid).chunks.resident == 0
    res = again.call(cid, TURNS[3], max_new_tokens=6)
    assert res.load.read_chunks > 0 and res.tokens


def test_an_imported_context_takes_no_more_than_its_reservation(lm, tmp_path):
    """``adopt`` reserves what the context's chunks take, then fills them: the reservation must
    count whole pages (a partial last chunk, odd token counts), or a budget just fitting it is
    exceeded (seen: ``bench contexts`` at 25%, 145 KB over an 80 MB budget at an import)."""
    from sparkv.runtime.generate import reference_prefill

    for n in (37, 100, 131):                          # partial pages and a partial last chunk
        ids = sample_context_ids(lm, n)
        layers = reference_prefill(lm, ids)
        probe = _svc(lm, tmp_path, name=f"probe{n}", compression="fp")
        g = probe.keeper.geometry(len(ids))
        need = probe.keeper.levels.chunks_nbytes(g, ["fp"] * g.num_token_chunks)
        svc = _svc(lm, tmp_path, budget=need, name=f"tight{n}", compression="fp")
        svc.import_context(ids, layers)
        st = svc.stats()
        assert st["budget_violations"] == 0 and st["peak_bytes"] <= need, (n, st["peak_bytes"], need)


def test_a_call_on_a_new_thread_computes_on_the_services_threads(lm, tmp_path):
    """A request's worker thread computes with the service's thread count even after another
    thread set the process-wide count to 1 (an ask's frame decoders do): a new thread's count
    is that value at its first kernel."""
    import threading

    from sparkv.runtime.threads import use_threads

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    svc = _svc(lm, tmp_path)
    seen: dict[str, int] = {}

    def on_new_thread(what, fn):
        fn()
        seen[what] = torch.get_num_threads()

    try:
        assert svc.threads == 2
        for what, fn in (("decoder", lambda: use_threads(1)),
                         ("new", lambda: seen.setdefault("cid", svc.new_context("Be brief."))),
                         ("call", lambda: svc.call(seen["cid"], "Hi.", max_new_tokens=2))):
            t = threading.Thread(target=on_new_thread, args=(what, fn))
            t.start()
            t.join(WAIT_S)
        assert seen["decoder"] == 1 and seen["new"] == 2 and seen["call"] == 2, seen
    finally:
        svc.close()
        torch.set_num_threads(before)
