"""The start-up overlap (sparkv.edge.prelude): layer steps computed while the manifest and the plan
are on their way are handed to the plan and the engine as done, never computed twice, and the
answer is the dense reference's. A real server process on loopback, the real SmolLM2."""

from __future__ import annotations

import threading
import time

import pytest

from sparkv.edge import EdgeSession, LinkShaper, chat_context, question_suffix
from sparkv.edge import session as session_module
from sparkv.protocol.errors import ApiError
from sparkv.edge.prelude import Prelude, prelude_units
from sparkv.layout import StepId
from sparkv.runtime.attention import get_backend
from sparkv.runtime.generate import reference_generate, sample_context_ids
from sparkv.runtime.stepper import LayerStepper
from sparkv.scheduler.controller import Controller, ControllerConfig
from sparkv.scheduler.planners import get_planner
from sparkv.server.process import ServerProcess
from tests.sched_helpers import tiny_instance

QUESTION = "What does the text say about warranty?"
NEW = 12


@pytest.fixture(scope="module")
def served(smollm2, tmp_path_factory):
    """A server with one 700-token context in 256-token chunks, created by ``session`` (which
    therefore holds its tokens, as a device that has the document does)."""
    d = tmp_path_factory.mktemp("prelude")
    lm = smollm2
    doc = chat_context(lm, sample_context_ids(lm, 700))
    srv = ServerProcess(None, f"file://{d}/store", log_path=d / "server.log").start()
    try:
        session = EdgeSession.connect(srv.url, model=lm)
        cid = session.client.create_context(token_ids=doc, levels=["raw", "q8"], chunk_tokens=256)
        # plain transformers' answer on the full prompt, the one every exact ask must give
        ref = reference_generate(lm, doc + question_suffix(lm, QUESTION), NEW)
        yield {"server": srv, "lm": lm, "doc": doc, "cid": cid, "session": session, "ref": ref}
        session.close()
    finally:
        srv.stop()


def _ask(session, cid, **kw):
    return session.ask(cid, QUESTION, level="raw", backend="dense", max_new_tokens=NEW,
                       stop_at_eos=False, use_cache=False, **kw)


def test_prelude_steps_are_used_once_and_the_answer_is_exact(served):
    """A slow link at the start (the manifest takes a while): the steps computed meanwhile count
    for the plan, the engine never runs them again, every chunk is in place once, and the tokens
    equal plain transformers' on the full prompt."""
    session, cid = served["session"], served["cid"]
    ref = served["ref"]
    session.client.shaper = LinkShaper.constant(0.3, 40.0)
    try:
        _ask(session, cid)   # the client now holds the manifest: its geometry is known
        res = _ask(session, cid)
    finally:
        session.client.shaper = LinkShaper.unlimited()
    bd = res.breakdown
    assert res.tokens == ref
    assert bd.prelude_steps > 0, "the 0.3 Mbit/s manifest left the compute thread no time?"
    # no fault; on a loaded machine the load outlasts the dead-link verdict's 4 s, and a link
    # of 0.3 Mbit/s planned at the 50 Mbit/s prior is rightly given up (docs/scheduler.md)
    assert set(bd.fallback) <= {"slow_link"}, bd.fallback
    assert bd.chunks_streamed + bd.chunks_computed == res.instance.num_chunks
    # the engine ran none of the prelude's steps again: they are its first units' steps, and the
    # engine's own steps are disjoint from them
    order = [s for u in prelude_units(res.instance.geometry) for s in u]
    pre = set(order[:bd.prelude_steps])
    assert not pre & set(res.load.steps)
    assert bd.steps_computed == len(res.load.steps) + bd.prelude_steps
    # the plan knew: the instance predicts no time for them
    for s in pre:
        assert res.instance.t_comp[s.t, s.l] < 1e-5


def test_prelude_off_and_baselines_compute_nothing_before_the_plan(served):
    session, cid = served["session"], served["cid"]
    assert _ask(session, cid, prelude=False).breakdown.prelude_steps == 0
    assert _ask(session, cid, strategy="hybrid").breakdown.prelude_steps == 0


def test_a_prelude_of_another_geometry_is_discarded(served):
    """Without a cached manifest the prelude guesses the default chunking (512 tokens); the
    context uses 256: its work is dropped and the load starts afresh, with the exact answer."""
    lm, cid = served["lm"], served["cid"]
    ref = served["ref"]
    fresh = EdgeSession.connect(served["server"].url, model=lm,
                                shaper=LinkShaper.constant(0.3, 40.0))
    try:
        res = fresh.ask(cid, QUESTION, level="raw", backend="dense", max_new_tokens=NEW,
                        stop_at_eos=False, token_ids=served["doc"])
    finally:
        fresh.close()
    assert res.tokens == ref
    assert res.breakdown.prelude_steps == 0
    assert set(res.breakdown.fallback) <= {"slow_link"}, res.breakdown.fallback   # (above)


def test_prelude_runs_in_local_prefill_order_and_stops(smollm2):
    """Layer by layer over a block of token chunks, one span a layer; stopped, it finishes the
    span in progress (promised) and nothing after it."""
    ids = sample_context_ids(smollm2, 300)
    stepper = LayerStepper(smollm2, ids, 128, backend=get_backend("dense"))
    pre = Prelude(lambda: stepper, stepper.geometry, ids).start()
    deadline = time.monotonic() + 120
    while len(stepper.done) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    promised = pre.request_stop()
    res = pre.join()
    assert res.ok and len(res.steps) >= 6
    T = stepper.geometry.num_token_chunks                    # 3 chunks of 300 tokens: one block
    assert res.steps == [StepId(i % T, i // T) for i in range(len(res.steps))]
    assert set(res.steps) == set(stepper.done) == set(promised)
    n = len(res.steps)
    time.sleep(0.05)
    assert len(stepper.done) == n   # stopped for good


def test_prelude_runs_on_the_calling_thread_until_another_stops_it(smollm2):
    """``run`` computes on the caller's thread; a stop asked from another thread ends it after
    the span in progress, which the stop promised."""
    ids = sample_context_ids(smollm2, 300)
    stepper = LayerStepper(smollm2, ids, 128, backend=get_backend("dense"))
    threads: set = set()
    span = stepper.run_span

    def recording_span(t0, t1, l):  # noqa: E741
        threads.add(threading.current_thread())
        return span(t0, t1, l)

    stepper.run_span = recording_span
    pre = Prelude(lambda: stepper, stepper.geometry, ids)
    promised: list = []

    def stop_later() -> None:
        deadline = time.monotonic() + 120
        while len(stepper.done) < 6 and time.monotonic() < deadline:
            time.sleep(0.005)
        promised.append(pre.request_stop())

    stopper = threading.Thread(target=stop_later)
    stopper.start()
    res = pre.run()
    stopper.join()
    assert threads == {threading.current_thread()}
    assert res.ok and len(res.steps) >= 6 and set(res.steps) == set(stepper.done) == promised[0]
    assert res.steps == [s for u in prelude_units(stepper.geometry) for s in u][:len(res.steps)]
    assert pre.join() is res


def test_an_interrupt_inside_the_prelude_is_raised_on_the_calling_thread(smollm2):
    ids = sample_context_ids(smollm2, 300)
    stepper = LayerStepper(smollm2, ids, 128, backend=get_backend("dense"))

    def interrupted(t0, t1, l):  # noqa: E741
        raise KeyboardInterrupt

    stepper.run_span = interrupted
    pre = Prelude(lambda: stepper, stepper.geometry, ids)
    with pytest.raises(KeyboardInterrupt):
        pre.run()
    assert isinstance(pre.join().error, KeyboardInterrupt) and not stepper.done


def test_the_asks_prelude_runs_on_the_asking_thread(served, monkeypatch):
    """The ask's prelude computes on the thread that asked (no ``sparkv-prelude`` thread), the
    manifest is fetched beside it, and the answer is exact."""
    session, cid = served["session"], served["cid"]
    ref = served["ref"]
    calls: list = []
    span = LayerStepper.run_span

    def recording_span(self, t0, t1, l):  # noqa: E741
        calls.append(threading.current_thread().name)
        return span(self, t0, t1, l)

    monkeypatch.setattr(LayerStepper, "run_span", recording_span)
    session.client.shaper = LinkShaper.constant(0.3, 40.0)
    try:
        _ask(session, cid)   # the client now holds the manifest: its geometry is known
        calls.clear()
        res = _ask(session, cid)
    finally:
        session.client.shaper = LinkShaper.unlimited()
    assert res.tokens == ref and res.breakdown.prelude_steps > 0
    assert "sparkv-prelude" not in calls
    me = threading.current_thread().name
    units = prelude_units(res.instance.geometry)
    n_units = next(i + 1 for i in range(len(units))
                   if sum(len(u) for u in units[:i + 1]) >= res.breakdown.prelude_steps)
    assert calls[:n_units] == [me] * n_units


def test_a_failed_manifest_fetch_stops_the_prelude_and_is_raised(served):
    """A context the server does not know (404): the ask raises the server's error at once; the
    prelude started on the device's tokens stops after its span in progress."""
    lm = served["lm"]
    fresh = EdgeSession.connect(served["server"].url, model=lm)
    try:
        with pytest.raises(ApiError):
            fresh.ask("0" * 32, QUESTION, level="raw", backend="dense", max_new_tokens=NEW,
                      token_ids=served["doc"])
    finally:
        fresh.close()


def test_layer_spans_are_blocks_of_chunks_layer_by_layer():
    """The prelude's order (``ChunkGeometry.layer_spans``): at most ``span_tokens`` tokens a call
    (one chunk at least), the first block's layers
    before the next block's: every step once, each call's dependencies done before it."""
    from sparkv.layout import ChunkGeometry

    g = ChunkGeometry(num_tokens=1000, chunk_tokens=128, num_layers=3, num_kv_heads=2,
                      head_dim=8)                           # 8 chunks, the last of 104 tokens
    units = g.layer_spans(300)
    assert [tuple(s.t for s in u) for u in units[:4]] == [(0, 1), (0, 1), (0, 1), (2, 3)]
    assert [u[0].l for u in units] == [0, 1, 2] * 4
    steps = [s for u in units for s in u]
    assert sorted(steps) == sorted(g.step_ids()) and len(set(steps)) == len(steps)
    done: set = set()
    for u in units:
        assert all(s.l == u[0].l for s in u)
        assert all(StepId(t, s.l) in done for s in u for t in range(u[0].t))  # earlier blocks
        assert all(StepId(s.t, s.l - 1) in done for s in u if s.l)  # the hidden input
        done.update(u)
    assert [len(u) for u in g.layer_spans(64)] == [1] * 24   # a chunk at least


def test_controller_takes_done_steps_out_of_both_queues():
    inst = tiny_instance([[0.1] * 4] * 3, groups=2)
    plan = get_planner("stream").plan(inst)          # everything on the link
    done = [StepId(0, 0), StepId(0, 1)]
    ctl = Controller(plan, inst, ControllerConfig.static(), done_steps=done)
    fetched = []
    while (f := ctl.next_fetch(0.0)) is not None:
        fetched.append(f.cid)
    assert len(fetched) == inst.num_chunks - 2 * inst.G
    assert all(StepId(c.t, c.l) not in done for c in fetched)
    for c in fetched:
        ctl.chunk_arrived(c, 0.1)
    assert ctl.done


def test_a_prelude_that_cannot_build_its_stepper_is_dropped(served, monkeypatch):
    """Building the stepper fails on the prelude's thread (out of memory, say): the load makes
    its own and the answer is exact; the failure is reported."""
    session, cid = served["session"], served["cid"]
    ref = served["ref"]
    _ = session.cost_model   # measured once per model (with a stepper): not the one that fails
    calls = {"n": 0}

    from sparkv.runtime import stepper as stepper_mod

    orig = stepper_mod.LayerStepper

    class Failing(orig):
        def __init__(self, *a, **kw):
            calls["n"] += 1
            if calls["n"] == 1:
                raise MemoryError("injected")
            super().__init__(*a, **kw)

    monkeypatch.setattr(stepper_mod, "LayerStepper", Failing)
    res = _ask(session, cid)
    assert res.tokens == ref and res.breakdown.prelude_steps == 0
    assert "MemoryError" in res.breakdown.fallback.get("prelude", "")


def test_the_simulators_prelude_mirrors_the_edges():
    """``sparkv.scheduler.whatif`` simulates the prelude with the edge's constants."""
    from sparkv.edge import planning, prelude, results
    from sparkv.scheduler import whatif

    assert whatif.PRELUDE_SPAN_TOKENS == prelude.SPAN_TOKENS
    assert whatif.PRELUDE_STEP_S == results.PRELUDE_STEP_S
    assert whatif.PRELUDE_STRATEGIES == planning.PRELUDE_STRATEGIES
    assert set(whatif.STRATEGIES) == set(planning.STRATEGIES)


def _blocking_span(monkeypatch, started: threading.Event, fail: bool = False) -> list:
    """``LayerStepper.run_span`` on the asking thread waits (at most 20 s) for the load's link
    to start before computing (``fail``: then raises); returns ``(thread, link started?)`` per
    span."""
    me = threading.current_thread()
    span = LayerStepper.run_span
    seen: list = []

    def waiting_span(self, t0, t1, l):  # noqa: E741
        if threading.current_thread() is me and not seen:
            seen.append(started.wait(20.0))
            if fail:
                raise RuntimeError("injected span failure")
        return span(self, t0, t1, l)

    monkeypatch.setattr(LayerStepper, "run_span", waiting_span)
    return seen


def _recording_link_start(monkeypatch, started: threading.Event) -> list:
    from sparkv.edge.link import Link

    start = Link.start
    threads: list = []

    def recording(self):
        threads.append(threading.current_thread().name)
        started.set()
        return start(self)

    monkeypatch.setattr(Link, "start", recording)
    return threads


def test_the_link_starts_while_the_prelude_finishes_its_span(served, monkeypatch):
    """The plan is made while the prelude's first span is in progress: the plan's thread starts
    the load's link at once (the span in progress does not hold it back), the engine takes the
    prelude's steps as done, and the answer is exact."""
    session, cid = served["session"], served["cid"]
    ref = served["ref"]
    _ask(session, cid)   # the client now holds the manifest: its geometry is known
    started = threading.Event()
    seen = _blocking_span(monkeypatch, started)
    threads = _recording_link_start(monkeypatch, started)
    res = _ask(session, cid)
    assert seen == [True], "the link waited for the prelude's span"
    assert threads == ["sparkv-plan"]
    bd = res.breakdown
    assert res.tokens == ref and bd.prelude_steps > 0 and bd.chunks_streamed > 0
    assert bd.chunks_streamed + bd.chunks_computed == res.instance.num_chunks
    assert not set(bd.fallback) - {"slow_link"}, bd.fallback


def test_a_span_that_fails_after_the_link_started_is_computed_by_the_load(served, monkeypatch):
    """The prelude's span in progress fails once the plan's thread has started the link: the
    steps it promised are computed by the load (or streamed), the failure is reported and the
    answer is exact."""
    session, cid = served["session"], served["cid"]
    ref = served["ref"]
    _ask(session, cid)
    started = threading.Event()
    seen = _blocking_span(monkeypatch, started, fail=True)
    _recording_link_start(monkeypatch, started)
    res = _ask(session, cid)
    assert seen == [True]
    assert res.tokens == ref and res.breakdown.prelude_steps == 0
    assert "injected span failure" in res.breakdown.fallback.get("prelude", "")
    assert (res.breakdown.chunks_streamed + res.breakdown.chunks_computed
            == res.instance.num_chunks)


def test_an_early_link_is_taken_or_never_started():
    """``_EarlyLink``: a plan dropped by the asking thread never starts its link; one whose link
    started cannot be dropped (it is taken); an ask that fails stops a started link."""
    from sparkv.edge.session import _EarlyLink

    class FakeEngine:
        aborted = 0

        def abort(self):
            self.aborted += 1

    dropped = _EarlyLink()
    assert dropped.drop()
    dropped.begin(lambda: pytest.fail("a dropped plan started its link"))
    assert dropped.engine is None
    taken, eng = _EarlyLink(), FakeEngine()
    taken.begin(lambda: eng)
    assert not taken.drop() and taken.engine is eng
    taken.abandon()
    assert eng.aborted == 1 and taken.engine is None
    none = _EarlyLink()
    none.begin(lambda: None)        # the plan streams nothing: no early link, may be dropped
    assert none.drop()


def test_the_loads_first_connection_is_opened_at_the_asks_start(served, monkeypatch):
    """An ask that may stream opens its load's first connection while it fetches the manifest
    and plans, and the load's first request adopts it (no TCP handshake on the load's path);
    a local ask opens none. The answers are exact."""
    from sparkv.edge.client import EdgeClient

    session, cid = served["session"], served["cid"]
    ref = served["ref"]
    made: list = []
    preconnect = EdgeClient.preconnect

    def recording(self, *a, **kw):
        made.append(preconnect(self, *a, **kw))
        return made[-1]

    monkeypatch.setattr(EdgeClient, "preconnect", recording)
    res = _ask(session, cid, strategy="stream")
    assert res.tokens == ref and res.breakdown.chunks_streamed > 0
    assert len(made) == 1 and made[0] is not None and made[0].taken
    assert _ask(session, cid, strategy="local").tokens == ref and len(made) == 1


def _first_plans_stream_all(monkeypatch, rule: tuple) -> list:
    """The portfolio's first plan streams every chunk bottom up (no full plan does: on a loaded
    machine the full plan may stream everything, top down), its handover rule answers ``rule``,
    a core counts as spare, the prelude's first span waits for the load's link (it cannot
    compute the whole context first), and the load does not re-plan at the link's measured
    rate (a plan it would take instead of the full one: tests/test_scheduler_replan.py).
    Returns the first plans made."""
    from sparkv.scheduler.planners.base import make_plan
    from sparkv.scheduler.planners.baselines import token_chunks_streamed
    from sparkv.scheduler.planners.portfolio import Portfolio

    firsts: list = []

    def stream_all(self, inst):
        firsts.append(make_plan(inst, [], token_chunks_streamed(inst, range(inst.n_t),
                                                                top_down=False)))
        return firsts[-1]

    monkeypatch.setattr(Portfolio, "first", stream_all)
    monkeypatch.setattr(Portfolio, "hands_over", lambda self, *a: rule)
    monkeypatch.setattr(session_module, "_core_spare", lambda device: True)
    monkeypatch.setattr(session_module, "replanner", lambda strategy: None)
    started = threading.Event()
    _blocking_span(monkeypatch, started)
    _recording_link_start(monkeypatch, started)
    return firsts


def test_the_load_starts_by_the_first_plan_and_takes_the_full_one_when_ready(served,
                                                                             monkeypatch):
    """sparkv's load starts by the portfolio's first plan (here made to stream every chunk bottom
    up) while the greedy plans; the full plan is handed to the running
    load (here whatever the rule says). The ask reports the plan the load ended with, and the
    answer is exact."""
    session, cid = served["session"], served["cid"]
    ref = served["ref"]
    _ask(session, cid)   # the client now holds the manifest: its geometry is known
    firsts = _first_plans_stream_all(monkeypatch, rule=(True, {}))
    session.client.shaper = LinkShaper.constant(20.0, 20.0)
    try:
        res = _ask(session, cid)
    finally:
        session.client.shaper = LinkShaper.unlimited()
    assert res.tokens == ref and len(firsts) == 1
    hand = [m for m in res.load.migrations if m.direction == "handover"]
    assert len(hand) == 1, (res.plan.info, res.breakdown.fallback, res.load.ready_s)
    assert res.plan is not firsts[0] and "portfolio" in res.plan.info
    bd = res.breakdown
    assert bd.chunks_streamed + bd.chunks_computed == res.instance.num_chunks
    assert not set(bd.fallback) - {"slow_link"}, bd.fallback


@pytest.mark.parametrize("replanned, why", [({"taken": True}, "re-planned"),
                                             ({"taken": False}, "load done"),
                                             (None, "load done")])
def test_a_full_plan_the_load_refuses_is_recorded_as_not_taken(monkeypatch, replanned, why):
    """The rule takes the full plan, but the running load refuses it (it re-planned at the
    link's measured rate, or it is done): the first plan's ``info["handover"]`` says so, not
    ``taken``."""
    from types import SimpleNamespace

    def judged(planned):
        planned.plan.info["handover"] = {"full": "greedy", "taken": True, "simulated_s": {}}
        return "the full plan"

    monkeypatch.setattr(session_module, "_judged_full", judged)
    planned = SimpleNamespace(plan=SimpleNamespace(info={}))
    engine = SimpleNamespace(adopt=lambda plan: False, ctl=SimpleNamespace(replanned=replanned))
    session_module.EdgeSession._hand_over(None, planned, engine)
    assert planned.plan.info["handover"] == {"full": "greedy", "taken": False,
                                             "simulated_s": {}, "ignored": why}


def test_a_full_plan_the_rule_declines_leaves_the_load_to_its_first_plan(served, monkeypatch):
    """The full plan differs from the first, but the portfolio's rule (the controller-aware
    simulation) declines it: no handover, the ask reports the first plan with the decision in
    its ``info["handover"]``, and the answer is exact."""
    session, cid = served["session"], served["cid"]
    ref = served["ref"]
    _ask(session, cid)
    firsts = _first_plans_stream_all(monkeypatch, rule=(False, {"first": 1.0}))
    res = _ask(session, cid)
    assert res.tokens == ref and len(firsts) == 1
    assert not [m for m in res.load.migrations if m.direction == "handover"]
    assert res.plan is firsts[0]
    assert res.plan.info.get("handover", {}).get("taken") is False, (res.plan.info, res.breakdown.fallback, res.breakdown.planning_s)


def test_without_a_spare_core_the_first_plan_is_the_plan(served, monkeypatch):
    """On a CPU whose every core runs the compute's threads the full plan is never made (it
    would take the load's cycles): the load keeps the first plan, the greedy never runs, and
    the answer is exact."""
    from sparkv.scheduler.planners.greedy import Greedy

    session, cid = served["session"], served["cid"]
    ref = served["ref"]
    _ask(session, cid)
    monkeypatch.setattr(session_module, "_core_spare", lambda device: False)
    monkeypatch.setattr(Greedy, "_plan", lambda self, inst: pytest.fail("the greedy ran"))
    res = _ask(session, cid)
    assert res.tokens == ref and "handover" not in res.plan.info
    assert res.plan.info["portfolio"]["chosen"] != "greedy"
    assert not [m for m in res.load.migrations if m.direction == "handover"]


def test_on_a_host_bound_device_the_first_plan_is_the_plan(served, monkeypatch):
    """On a GPU (forced here: ``SPARKV_HOST_BOUND=1``) the full plan is never made (its Python
    would starve the prelude's or the load's launches: the H200's run 3), even with a core
    spare: the greedy never runs, the load keeps its first plan (here all-local), the answer is
    exact."""
    from sparkv.scheduler.planners.baselines import LocalOnly
    from sparkv.scheduler.planners.greedy import Greedy
    from sparkv.scheduler.planners.portfolio import Portfolio

    session, cid = served["session"], served["cid"]
    ref = served["ref"]
    _ask(session, cid)
    monkeypatch.setenv("SPARKV_HOST_BOUND", "1")
    monkeypatch.setattr(session_module, "_core_spare", lambda device: True)
    monkeypatch.setattr(Portfolio, "first", lambda self, inst: LocalOnly().plan(inst))
    monkeypatch.setattr(Greedy, "_plan", lambda self, inst: pytest.fail("the greedy ran"))
    res = _ask(session, cid)
    assert res.tokens == ref and "handover" not in res.plan.info
    assert not res.plan.stream_order


def test_where_a_full_plan_follows(monkeypatch):
    import torch

    cpu = torch.device("cpu")
    for spare, bound, want in ((True, "0", True), (True, "1", False), (False, "0", False)):
        monkeypatch.setattr(session_module, "_core_spare", lambda device, s=spare: s)
        monkeypatch.setenv("SPARKV_HOST_BOUND", bound)
        assert session_module._full_plan_follows(cpu) is want, (spare, bound)
    monkeypatch.delenv("SPARKV_HOST_BOUND")
    from sparkv.runtime.device import host_bound

    assert not host_bound(cpu) and host_bound(torch.device("cuda"))
