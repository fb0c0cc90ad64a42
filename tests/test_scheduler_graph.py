"""The dependency graph and the plan validator: hand-made good and bad plans."""

from __future__ import annotations

import pytest

from sparkv.layout import ChunkGeometry, KVChunkId, StepId
from sparkv.scheduler import (DepState, Plan, PlanError, layer_dependency, plan_problems,
                              token_dependencies, validate_plan)
from sched_helpers import TWO_LEVELS, tiny_instance

C, S = KVChunkId, StepId


def plan(compute, stream, level="q5"):
    stream = [C(*c) for c in stream]
    return Plan([S(*s) for s in compute], stream, {c: level for c in stream})


@pytest.fixture
def inst():
    # 3 token chunks x 3 layers (layer 2 is the last: projection only)
    return tiny_instance([[1, 1, 0.1], [2, 2, 0.1], [3, 3, 0.1]])


def test_dependencies_follow_the_real_data_flow():
    geom = ChunkGeometry(48, 16, 3, 2, 4, 1)
    assert layer_dependency(S(2, 0)) is None
    assert layer_dependency(S(2, 1)) == S(2, 0)
    # attention at (2, 1) reads every earlier token chunk of layer 1, all groups
    assert token_dependencies(S(2, 1), geom) == [C(0, 1, 0), C(0, 1, 1), C(1, 1, 0), C(1, 1, 1)]
    # the last layer is projection only: no token dependency
    assert token_dependencies(S(2, 2), geom) == []


def test_depstate_needs_every_earlier_token_chunk():
    dep = DepState(3, 2, 1)
    assert dep.ready(0)                       # (0, 0)
    assert not dep.ready(2 * 2 + 0)           # (2, 0) needs KV(0, 0) and KV(1, 0)
    dep.add_chunk(1 * 2 + 0)                  # KV(1, 0) streamed, KV(0, 0) still missing
    assert not dep.ready(2 * 2 + 0)
    dep.mark_computed(0)                      # (0, 0) computed
    assert dep.ready(2 * 2 + 0)
    assert dep.ready(1)                       # (0, 1): last layer, needs Y[0, 0] only
    assert not dep.ready(2 * 2 + 1)           # (2, 1) needs Y[0, 2]
    assert "Y[l=0, t=2]" in dep.missing_for(2 * 2 + 1)[0]


def test_good_plans_pass(inst):
    validate_plan(plan([(t, l) for t in range(3) for l in range(3)], []), inst)
    validate_plan(plan([], [(t, l, 0) for t in range(3) for l in range(3)]), inst)
    # compute token chunk 2's layer 0 over streamed KV(0..1, 0); the last layer over a streamed
    # prefix needs nothing but its own Y
    validate_plan(plan([(2, 0), (2, 1), (2, 2)],
                       [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 2, 0), (1, 2, 0)]), inst)


@pytest.mark.parametrize("compute,stream,message", [
    ([(0, 0), (0, 1), (0, 2)], [(1, 0, 0), (1, 1, 0), (1, 2, 0), (2, 0, 0), (2, 1, 0)],
     r"chunk\(t=2, l=2, g=0\) is neither streamed nor computed"),
    ([(0, 0), (0, 1), (0, 2)], [(0, 1, 0)] + [(t, l, 0) for t in (1, 2) for l in range(3)],
     r"chunk\(t=0, l=1, g=0\) is both streamed and produced by computed step\(t=0, l=1\)"),
    ([(0, 1), (0, 2)], [(0, 0, 0)] + [(t, l, 0) for t in (1, 2) for l in range(3)],
     r"step\(t=0, l=1\) needs Y\[l=0, t=0\] but step\(t=0, l=0\) is not computed"),
    ([(0, 1), (0, 0), (0, 2)], [(t, l, 0) for t in (1, 2) for l in range(3)],
     r"step\(t=0, l=1\) at compute position 0 needs Y\[l=0, t=0\] from step\(t=0, l=0\), "
     r"which is computed later \(position 1\)"),
    ([(1, 0), (0, 0), (0, 1), (0, 2), (1, 1), (1, 2)], [(2, l, 0) for l in range(3)],
     r"step\(t=1, l=0\) at compute position 0 attends over KV\(t=0, l=0\).*computed later.*"
     r"deadlock"),
    # the last layer is projection only, but it still needs Y[L-2, t] from a computed step
    ([(0, 0), (0, 2)], [(0, 1, 0)] + [(t, l, 0) for t in (1, 2) for l in range(3)],
     r"step\(t=0, l=2\) needs Y\[l=1, t=0\] but step\(t=0, l=1\) is not computed"),
    ([(0, 0), (0, 0)], [], r"step\(t=0, l=0\) appears twice in the compute order"),
    ([], [(0, 0, 0), (0, 0, 0)], r"chunk\(t=0, l=0, g=0\) appears twice in the stream order"),
    ([(3, 0)], [], r"step\(t=3, l=0\)|not a step of this context"),
])
def test_bad_plans_are_rejected_with_a_clear_message(inst, compute, stream, message):
    with pytest.raises(PlanError, match=message):
        validate_plan(plan(compute, stream), inst)


def test_levels_are_checked():
    inst = tiny_instance([[1, 0.1], [1, 0.1]], levels=TWO_LEVELS, floor="hi")
    good = plan([], [(t, l, 0) for t in range(2) for l in range(2)], level="hi")
    validate_plan(good, inst)
    low = plan([], [(t, l, 0) for t in range(2) for l in range(2)], level="lo")
    with pytest.raises(PlanError, match=r"streamed at level 'lo', below the quality floor 'hi'"):
        validate_plan(low, inst)
    unknown = plan([], [(t, l, 0) for t in range(2) for l in range(2)], level="q9")
    with pytest.raises(PlanError, match=r"unknown level 'q9'"):
        validate_plan(unknown, inst)
    missing = plan([], [(t, l, 0) for t in range(2) for l in range(2)], level="hi")
    del missing.levels[C(1, 1, 0)]
    with pytest.raises(PlanError, match=r"chunk\(t=1, l=1, g=0\) is streamed but has no level"):
        validate_plan(missing, inst)


def test_groups_a_computed_step_covers_every_group():
    inst = tiny_instance([[1, 0.1], [1, 0.1]], groups=2)
    validate_plan(plan([(0, 0), (0, 1)], [(1, l, g) for l in range(2) for g in range(2)]), inst)
    # streaming only one group of (1, 0) leaves the other uncovered
    bad = plan([(0, 0), (0, 1)], [(1, 0, 0), (1, 1, 0), (1, 1, 1)])
    with pytest.raises(PlanError, match=r"chunk\(t=1, l=0, g=1\) is neither streamed nor computed"):
        validate_plan(bad, inst)
    # computing (1, 0) needs both groups of KV(0, 0): one streamed, one missing
    bad2 = plan([(1, 0), (1, 1)], [(0, 0, 0), (0, 1, 0), (0, 1, 1)])
    problems = plan_problems(bad2, inst)
    assert any("chunk(t=0, l=0, g=1) is neither streamed nor computed" in p for p in problems)


def test_problems_are_all_listed(inst):
    problems = plan_problems(plan([], []), inst)
    assert len(problems) == 9
    with pytest.raises(PlanError, match=r"and 4 more"):
        validate_plan(plan([], []), inst)


def test_plan_json_roundtrip(inst):
    p = plan([(0, 0), (0, 1), (0, 2)], [(t, l, 0) for t in (1, 2) for l in range(3)])
    p.info = {"x": 1}
    q = Plan.from_dict(p.to_dict())
    assert q.compute_order == p.compute_order and q.stream_order == p.stream_order
    assert q.levels == p.levels and q.info == {"x": 1}
    validate_plan(q, inst)
