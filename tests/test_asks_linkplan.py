"""The device's link plan across asks (sparkv/asks/linkplan.py), its logic alone: given the asks'
bytes still to stream, which may send a request now and how many bytes of the others the link
carries before each. No model, no link, no timing."""

from __future__ import annotations

import pytest

from sparkv.asks.cores import CoreGate
from sparkv.asks.linkplan import LINK_PLANS, LinkPlan, OldestFirst, ShortestFirst
from sparkv.edge.lane import LinkTurn

MB = 1e6


def test_oldest_first_gives_the_link_to_the_oldest_planned_ask_and_counts_the_bytes_ahead():
    plan = LinkPlan("oldest", lead_bytes=0.0)
    a, b, c = (plan.seat(i, "sparkv") for i in range(3))
    assert a.turn(4 * MB) == LinkTurn(0.0, True)
    assert b.turn(3 * MB) == LinkTurn(4 * MB, False)
    assert c.turn(2 * MB) == LinkTurn(7 * MB, False)
    assert [s.rank() for s in (a, b, c)] == [0, 1, 2]
    # the oldest has streamed everything it wanted: the next one's turn, nothing ahead of it
    a.turn(0.0)
    assert b.turn(3 * MB) == LinkTurn(0.0, True)
    assert c.turn(2 * MB) == LinkTurn(3 * MB, False)
    # an ask that ends leaves the plan
    b.close()
    assert c.turn(2 * MB) == LinkTurn(0.0, True)
    assert plan.stats()["asks"] == 2 and plan.stats()["refused"] == 3


def test_the_next_ask_may_open_its_request_while_the_ones_ahead_drain_their_last_bytes():
    plan = LinkPlan("oldest", lead_bytes=64_000)
    a, b = plan.seat(0, "sparkv"), plan.seat(1, "sparkv")
    a.turn(1 * MB)
    assert not b.turn(1 * MB).go
    a.turn(50_000)                        # less than the lead left to arrive
    assert b.turn(1 * MB) == LinkTurn(50_000, True)


def test_shortest_first_gives_the_link_to_the_fewest_bytes_left():
    plan = LinkPlan(ShortestFirst(), lead_bytes=0.0)
    old, young = plan.seat(0, "sparkv"), plan.seat(1, "sparkv")
    old.turn(6 * MB)
    assert young.turn(1 * MB) == LinkTurn(0.0, True)
    assert old.turn(6 * MB) == LinkTurn(1 * MB, False)
    young.turn(0.0)                       # done: the old one's turn
    assert old.turn(6 * MB) == LinkTurn(0.0, True)
    # a tie goes to the older ask
    young.turn(6 * MB)
    assert old.turn(6 * MB).go and not young.turn(6 * MB).go


def test_only_the_policys_strategies_are_planned_and_even_plans_nobody():
    plan = LinkPlan("oldest", lead_bytes=0.0)
    hybrid, sparkv = plan.seat(0, "hybrid"), plan.seat(1, "sparkv")
    assert not hybrid.planned and sparkv.planned
    hybrid.turn(9 * MB)
    assert hybrid.turn(9 * MB) == LinkTurn()          # free, nothing ahead
    assert sparkv.turn(1 * MB) == LinkTurn(0.0, True)  # the unplanned ask's bytes do not count
    even = LinkPlan("even")
    seats = [even.seat(i, "sparkv") for i in range(3)]
    assert not any(s.planned for s in seats)
    assert all(s.turn(5 * MB) == LinkTurn() for s in seats) and even.stats()["asks"] == 0
    assert LinkPlan("oldest-all").seat(0, "hybrid").planned
    assert OldestFirst(strategies=None).joins("local")


def test_an_unknown_plan_is_refused():
    with pytest.raises(ValueError, match="no link plan"):
        LinkPlan("fastest")
    assert set(LINK_PLANS) == {"even", "oldest", "shortest", "oldest-all"}


def test_an_asks_lane_answers_with_its_seats_turn():
    gate, plan = CoreGate(order="oldest"), LinkPlan("oldest", lead_bytes=0.0)
    first, second = gate.lane(), gate.lane()
    assert second.link_turn(1 * MB) == LinkTurn()      # no seat: the link is its own
    first.seat = plan.seat(first.id, "sparkv")
    second.seat = plan.seat(second.id, "sparkv")
    first.link_turn(2 * MB)
    assert second.link_turn(1 * MB) == LinkTurn(2 * MB, False)


def test_an_ask_not_heard_from_yet_keeps_the_later_asks_off_the_link_for_a_while():
    now = [0.0]
    plan = LinkPlan("oldest", lead_bytes=0.0, report_grace_s=0.5, clock=lambda: now[0])
    old, young = plan.seat(0, "sparkv"), plan.seat(1, "sparkv")
    # the young ask planned first: it may not stream before the old one said its bytes
    assert young.turn(1 * MB) == LinkTurn(0.0, False)
    assert old.turn(0.0) == LinkTurn(0.0, True)       # the old one streams nothing
    assert young.turn(1 * MB) == LinkTurn(0.0, True)
    # an ask never heard from (answered from memory, say) holds nobody past the grace
    late = plan.seat(2, "sparkv")
    latest = plan.seat(3, "sparkv")
    assert not latest.turn(1 * MB).go
    now[0] = 0.6
    young.turn(0.0)
    assert latest.turn(1 * MB) == LinkTurn(0.0, True)
    assert late.planned


def test_under_shortest_first_only_older_asks_not_heard_from_hold_the_link():
    plan = LinkPlan(ShortestFirst(), lead_bytes=0.0, report_grace_s=3600.0)
    old, young = plan.seat(0, "sparkv"), plan.seat(1, "sparkv")
    assert old.turn(6 * MB).go                # the young one, not heard from yet, holds nothing
    assert young.turn(1 * MB) == LinkTurn(0.0, True)
    assert old.turn(6 * MB) == LinkTurn(1 * MB, False)
