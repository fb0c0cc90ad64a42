"""Planners: one small class per policy, one registry (:data:`PLANNERS`)."""

from __future__ import annotations

from typing import Any

from sparkv.scheduler.planners.base import Planner, PlannerError
from sparkv.scheduler.planners.baselines import LocalOnly, StreamOnly, StrongHybrid
from sparkv.scheduler.planners.greedy import Greedy
from sparkv.scheduler.planners.milp import Milp
from sparkv.scheduler.planners.portfolio import Portfolio

#: registry name -> planner class
PLANNERS: dict[str, type[Planner]] = {
    Greedy.name: Greedy,
    Milp.name: Milp,
    LocalOnly.name: LocalOnly,
    StreamOnly.name: StreamOnly,
    StrongHybrid.name: StrongHybrid,
    Portfolio.name: Portfolio,
}


def get_planner(name: str, **params: Any) -> Planner:
    """``get_planner("greedy", w_tail=0.0)`` -> a configured planner."""
    try:
        cls = PLANNERS[name]
    except KeyError:
        raise PlannerError(f"unknown planner {name!r}; known: {sorted(PLANNERS)}") from None
    return cls(**params)


__all__ = ["PLANNERS", "Greedy", "LocalOnly", "Milp", "Planner", "PlannerError", "Portfolio", "StreamOnly",
           "StrongHybrid", "get_planner"]
