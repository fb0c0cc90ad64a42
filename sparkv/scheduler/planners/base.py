"""The planner interface and helpers every planner shares."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Iterable, Sequence

import numpy as np

from sparkv.errors import SparkvError
from sparkv.scheduler.instance import Instance
from sparkv.scheduler.plan import Plan


class PlannerError(SparkvError):
    """A planner could not produce a plan (e.g. the MILP found no solution in its time limit)."""


class Planner(ABC):
    """``plan(instance) -> Plan``. Parameters go to the constructor (scikit-learn style)."""

    name: ClassVar[str] = ""

    def plan(self, inst: Instance) -> Plan:
        """Plans ``inst``; the returned plan records the planner name and wall time taken."""
        t0 = time.perf_counter()
        plan = self._plan(inst)
        plan.plan_time_s = time.perf_counter() - t0
        plan.planner = self.name
        return plan

    @abstractmethod
    def _plan(self, inst: Instance) -> Plan: ...

    def params(self) -> dict[str, Any]:
        """Constructor parameters, for reports."""
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"


def stream_order_for_compute(inst: Instance, compute: Sequence[int],
                             stream: Iterable[int]) -> list[int]:
    """Reorders streamed chunk ids so that chunks computed steps attend over come first, in the
    order the compute thread needs them; the others keep their relative order after them."""
    L, G, n_t = inst.L, inst.G, inst.n_t
    pos = {s: i for i, s in enumerate(compute)}
    inf = len(compute) + 1
    # first_need[t][l]: smallest compute position of a step (t'' > t, l) (attends over (t, l))
    first_need = [[inf] * L for _ in range(n_t)]
    for l in range(L - 1):  # noqa: E741 - last layer attends over nothing
        best = inf
        for t in range(n_t - 1, -1, -1):
            first_need[t][l] = best
            p = pos.get(t * L + l)
            if p is not None and p < best:
                best = p
    stream = list(stream)
    keyed = []
    for i, c in enumerate(stream):
        s = c // G
        t, l = divmod(s, L)
        keyed.append((first_need[t][l], i, c))
    keyed.sort()
    return [c for _, _, c in keyed]


def make_plan(inst: Instance, compute: Sequence[int], stream: Sequence[int],
              level_idx: Sequence[int] | np.ndarray | dict[int, int] | None = None,
              **kw: Any) -> Plan:
    """Builds a :class:`Plan` from dense ids (steps, chunks, level indices per chunk id)."""
    if level_idx is None:
        level_idx = inst.cheapest_level
    names = [lv.name for lv in inst.levels]
    return Plan(
        compute_order=[inst.step_id(s) for s in compute],
        stream_order=[inst.chunk_id(c) for c in stream],
        levels={inst.chunk_id(c): names[int(level_idx[c])] for c in stream},
        **kw,
    )
