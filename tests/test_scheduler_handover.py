"""A load that changes plans while it runs (sparkv.scheduler.handover, Controller.adopt): the
work under way stays, the new plan takes the rest, and the load stays executable (the
simulator checks every step's inputs and raises on a deadlock)."""

from __future__ import annotations

import pytest

from sched_helpers import tiny_instance
from sparkv.layout import KVChunkId, StepId
from sparkv.scheduler.controller import Controller, ControllerConfig
from sparkv.scheduler.handover import handover
from sparkv.scheduler.instance import synthetic_instance
from sparkv.scheduler.plan import Plan
from sparkv.scheduler.planners import get_planner
from sparkv.scheduler.planners.portfolio import Portfolio
from sparkv.scheduler.simulator import simulate
from sparkv.scheduler.trace import Trace, adversarial_traces

L = 4


def _plan(inst, computed: list[tuple[int, int]]) -> Plan:
    """Computes ``computed`` (in order), streams every other chunk at the cheapest level."""
    compute = [StepId(t, l) for t, l in computed]
    stream = [c for c in inst.geometry.chunk_ids() if StepId(c.t, c.l) not in set(compute)]
    return Plan(compute, stream, {c: inst.levels[0].name for c in stream})


def _c(inst, t: int, l: int, g: int = 0) -> int:  # noqa: E741
    return inst.chunk_index(KVChunkId(t, l, g))


def _s(inst, t: int, l: int) -> int:  # noqa: E741
    return inst.step_index(StepId(t, l))


def test_work_under_way_stays_and_a_carried_step_is_computed_only_when_needed():
    inst = tiny_instance([[0.01] * L] * 3)
    new = _plan(inst, [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)])
    available = [False] * inst.num_chunks
    available[_c(inst, 0, 0)] = True                    # arrived over the link
    requested = {_c(inst, 0, 1), _c(inst, 2, 3), _c(inst, 1, 1)}
    # (0, 1)'s bytes are arriving, (0, 3) was received and is being decoded; (1, 1) and
    # (2, 3) were requested, nothing of them arrived yet
    started = {_c(inst, 0, 1), _c(inst, 0, 3)}
    rest = handover(inst, new, settled_steps=set(), requested=requested, started=started,
                    available=available)
    # (0, 3) is carried and nothing above it needs it: dropped; (0, 1) and (0, 0) are carried
    # but (0, 2) needs their hidden states: recomputed, the fetch of (0, 1) cancelled; (1, 1)
    # had not begun: the new plan computes it, its fetch is cancelled
    assert rest.compute == [_s(inst, t, l) for t, l in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]]
    assert rest.cancel == [_c(inst, 0, 1), _c(inst, 1, 1)]
    # the plan's stream order, less what the link carries already ((2, 3) stays in flight)
    assert rest.stream == [_c(inst, t, l) for t, l in [(1, 2), (1, 3), (2, 0), (2, 1), (2, 2)]]
    assert all(rest.levels[c] == 0 for c in rest.stream)


def test_settled_steps_stay_and_a_dropped_steps_other_groups_join_the_link():
    inst = tiny_instance([[0.01] * L] * 2, groups=2)
    new = _plan(inst, [(0, 0), (0, 1), (1, 0), (1, 1)])
    available = [False] * inst.num_chunks
    for g in range(2):
        available[_c(inst, 0, 0, g)] = True             # computed (settled below)
    on_link = {_c(inst, 1, 1, 0)}                       # half of (1, 1) arriving
    rest = handover(inst, new, settled_steps={_s(inst, 0, 0)}, requested=on_link,
                    started=on_link, available=available)
    assert rest.compute == [_s(inst, 0, 1), _s(inst, 1, 0)]
    assert rest.cancel == []
    # the plan's streamed chunks, then (1, 1)'s other group at its cheapest level
    assert rest.stream[-1] == _c(inst, 1, 1, 1)
    assert set(rest.stream[:-1]) == {_c(inst, t, l, g) for t in range(2) for l in (2, 3)
                                     for g in range(2)}


def test_adopting_a_plan_before_anything_ran_queues_it_as_a_fresh_load_would():
    inst = synthetic_instance(2048, chunk_tokens=512, seed=1)
    first, full = Portfolio().first(inst), Portfolio().plan(inst)
    assert full.info["portfolio"]["chosen"] == "greedy"
    fresh = Controller(full, inst, ControllerConfig())
    ctl = Controller(first, inst, ControllerConfig())
    ctl.adopt(full, 0.0)
    assert ctl.state.compute.order == fresh.state.compute.order
    assert ctl.state.link.order == fresh.state.link.order
    assert ctl.state.link.level == fresh.state.link.level
    assert ctl.state.stage_s == fresh.state.stage_s
    assert [m.direction for m in ctl.migrations] == ["handover"]


@pytest.mark.parametrize("heads_per_group", [0, 1])
def test_a_handover_at_any_time_completes_and_at_the_start_equals_the_full_plan(heads_per_group):
    """Starting by the portfolio's first plan and taking its full plan at time 0 runs exactly
    as the full plan would; at any later time (before, during or after the paths meet) and in
    either direction the load completes, every step after its inputs (the simulator raises
    otherwise), on constant and adversarial links, adaptive or static."""
    for seed in range(2):
        inst = synthetic_instance(2048, chunk_tokens=512, seed=seed,
                                  heads_per_group=heads_per_group)
        first, full = Portfolio().first(inst), Portfolio().plan(inst)
        assert full.info["portfolio"]["chosen"] == "greedy"   # the plans differ
        for trace in [Trace.constant(30), Trace.constant(150), *adversarial_traces(2)]:
            ideal = simulate(full, inst, trace, controller=ControllerConfig())
            at0 = simulate(first, inst, trace, controller=ControllerConfig(),
                           handover=(0.0, full))
            assert at0.ttft_s == ideal.ttft_s
            for at in (0.05, 0.3, 1.0, 5.0):
                for cfg in (ControllerConfig(), ControllerConfig.static()):
                    for a, b in ((first, full), (full, first)):
                        tl = simulate(a, inst, trace, controller=cfg, handover=(at, b))
                        moves = [m.direction for m in tl.migrations]
                        assert moves.count("handover") == (1 if at < tl.ready_s else 0)


def test_a_handover_cancels_the_fetch_of_a_step_it_computes():
    """The first plan streams everything; the new one computes every step. A fetch in flight
    at the handover is cancelled (the simulator aborts it) and the rest is computed."""
    inst = tiny_instance([[0.01] * L] * 2, bw=10_000.0)
    stream_all = get_planner("stream").plan(inst)
    local = get_planner("local").plan(inst)
    tl = simulate(stream_all, inst, Trace.constant(0.08), controller=ControllerConfig.static(),
                  handover=(0.05, local))
    hand = [m for m in tl.migrations if m.direction == "handover"]
    assert len(hand) == 1 and len(hand[0].cancelled) == 1
    assert any(x.cancelled for x in tl.transfers)
    assert tl.computed_steps == inst.num_steps


def test_the_portfolio_hands_over_only_what_the_controller_aware_simulation_prefers():
    """The greedy's plan beats the structured split by the static estimate, but under the
    adaptive controller both reach the first token within the margin: no handover. Under the
    static executor (the plan as written) the same greedy plan wins by more: handed over."""
    inst = synthetic_instance(2048, chunk_tokens=512, seed=0)
    p = Portfolio()
    first, full = p.first(inst), p.plan(inst)
    assert full.estimated_ttft_s < first.estimated_ttft_s * (1 - p.robust_margin)
    take, sim = p.hands_over(first, full, inst, ControllerConfig())
    assert not take and abs(sim["full"] / sim["first"] - 1) < p.robust_margin
    take, sim = p.hands_over(first, full, inst, ControllerConfig.static())
    assert take and sim["full"] < sim["first"]
