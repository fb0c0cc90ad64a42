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
    # need[t * L + l]: smallest compute position of a step (t'' > t, l) (attends over (t, l));
    # the last layer attends over nothing
    need = [inf] * (n_t * L)
    for l in range(L - 1):  # noqa: E741
        best = inf
        for s in range((n_t - 1) * L + l, -1, -L):
            need[s] = best
            p = pos.get(s)
            if p is not None and p < best:
                best = p
    stream = list(stream)
    keys = [need[c] for c in stream] if G == 1 else [need[c // G] for c in stream]
    # a stable sort: chunks that no computed step waits for keep their relative order
    return [stream[i] for i in sorted(range(len(stream)), key=keys.__getitem__)]


def make_plan(inst: Instance, compute: Sequence[int], stream: Sequence[int],
              level_idx: Sequence[int] | np.ndarray | dict[int, int] | None = None,
              **kw: Any) -> Plan:
    """Builds a :class:`Plan` from dense ids (steps, chunks, level indices per chunk id)."""
    if level_idx is None:
        level_idx = inst.cheapest_level
    names = [lv.name for lv in inst.levels]
    steps, chunks = inst.dense_ids()
    stream_order = [chunks[c] for c in stream]
    return Plan(
        compute_order=[steps[s] for s in compute],
        stream_order=stream_order,
        levels={cid: names[int(level_idx[c])] for c, cid in zip(stream, stream_order)},
        **kw,
    )
