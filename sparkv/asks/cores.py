"""The device's cores, shared by the asks running at once: :class:`CoreGate`, the compute worker
every ask's compute goes through, and :class:`AskLane`, one ask's way to it.

Without it, N asks are N threads running the model at once: each layer step of one ask waits
behind the others' OpenMP threads, every ask's TTFT grows by the others' whole work, and no
ask's plan knows the others exist. Here:

* **one unit of compute at a time**: a unit is a layer step (or a column of them), a forward pass
  of the question or of one answer token. The gate grants the cores to one unit at a time, in
  one of two orders (:data:`GRANT_ORDERS`, ``sparkv device serve --ask-core-order``):

  - ``turns``: the order the units asked for them. An ask that finished a unit and wants the
    next goes to the back, behind the others waiting: the asks running at once **interleave
    their steps** (round robin), none waits more than one unit of each of the others per unit of
    its own, and they progress together (each one's first token comes near the end of the
    whole batch's work);
  - ``oldest``: the waiting unit of the oldest ask (the first to start) first. Work-conserving:
    while it waits for its link, the younger asks' units fill the cores; its first token comes
    first, then the next one's, as serving them one by one would, without idling the cores;
* **the load**: :meth:`CoreGate.load` counts the asks that used the cores in the last
  ``window_s``; each ask's controller plans its remaining compute with it
  (:attr:`ComputeEstimator.load <sparkv.scheduler.estimators.ComputeEstimator.load>`, fed by the
  engine at every look for a step: :mod:`sparkv.edge.lane`), and its plan starts from it;
* **cancellation**: :meth:`AskLane.cancel` makes the ask's next request for the cores raise
  :class:`~sparkv.edge.lane.AskCancelled` (a waiting request at once): the ask stops within one
  unit.

A unit's own time (what the controller learns the device's speed from) excludes the wait for the
gate; the wait is counted per lane (``waited_s``).

State: the queue of waiting units, the holder, the lanes' last use; one condition variable
guards all of it. A unit runs outside the lock.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import threading
import time
import weakref
from typing import Any, Iterator

from sparkv.edge.lane import AskCancelled, LinkTurn

__all__ = ["CoreGate", "AskLane", "LOAD_WINDOW_S", "GRANT_ORDERS"]

#: an ask that used the cores this recently counts in the load (seconds)
LOAD_WINDOW_S = 1.0
#: how often a waiting unit looks at its lane's cancellation (seconds)
WAIT_S = 0.05
#: the orders the gate grants waiting units in: ``turns`` (the order they asked: the asks
#: progress together, round robin) or ``oldest`` (the unit of the oldest ask first, by lane:
#: the others fill the cores while it waits for its link; its first token comes first)
GRANT_ORDERS = ("turns", "oldest")


class CoreGate:
    """One unit of compute at a time on the device's cores, granted in ``order`` (module
    docstring, :data:`GRANT_ORDERS`).

    Args:
        window_s: how recently an ask must have used the cores to count in :meth:`load`.
        order: ``oldest`` (the oldest ask's unit first) or ``turns`` (arrival order).
    """

    def __init__(self, window_s: float = LOAD_WINDOW_S, order: str = "oldest") -> None:
        if order not in GRANT_ORDERS:
            raise ValueError(f"no grant order {order!r} (one of {', '.join(GRANT_ORDERS)})")
        self.window_s, self.order = window_s, order
        self._cv = threading.Condition()
        self._queue: list[tuple[int, int]] = []    # waiting units: (ticket, lane id), arrival order
        self._holder: int | None = None            # the running unit's ticket
        self._tickets = itertools.count()
        self._lanes: dict[int, AskLane] = {}       # open lanes by id
        self._ids = itertools.count()
        self.units = 0                             # units granted since the start
        self._memories: weakref.WeakSet[Any] = weakref.WeakSet()   # the asks' KV memories

    def lane(self) -> "AskLane":
        """A new ask's lane (close it when the ask ends)."""
        with self._cv:
            lane = AskLane(self, next(self._ids))
            self._lanes[lane.id] = lane
            return lane

    def load(self, lane: "AskLane | None" = None) -> float:
        """The asks sharing the cores now: those holding or waiting for them, or that used them
        in the last ``window_s``; ``lane`` counts as one of them in any case (at least 1). In
        ``oldest`` order, ``lane``'s load counts only the asks older than it (the others yield
        to it)."""
        now = time.monotonic()
        with self._cv:
            busy = {i for i, x in self._lanes.items()
                    if x.waiting or x.holding or now - x.last_used <= self.window_s}
            if lane is not None:
                busy.add(lane.id)
                if self.order == "oldest":
                    busy = {i for i in busy if i <= lane.id}
            return float(max(1, len(busy)))

    def _next(self) -> int:
        """The ticket of the waiting unit to grant next (the queue is not empty)."""
        if self.order == "oldest":
            return min(self._queue, key=lambda unit: (unit[1], unit[0]))[0]
        return self._queue[0][0]

    def held(self) -> tuple[int, int]:
        """``(memories, bytes)``: the asks' KV memories still alive (an ended ask's are freed
        with it: a memory still counted after its ask ended is a leak) and their bytes. A full
        collection runs first: an ended ask's memory can sit in a reference cycle (its engine's
        threads ended after the ask's own collection, which moved it to the oldest generation),
        garbage that an idle service would otherwise count for a long time."""
        gc.collect()
        with self._cv:
            memories = list(self._memories)
        return len(memories), sum(int(getattr(m, "nbytes", 0)) for m in memories)

    def stats(self) -> dict[str, float | int]:
        """``lanes`` (open), ``waiting`` (units), ``units`` (granted so far), ``load``,
        ``held_memories`` and ``held_bytes`` (:meth:`held`)."""
        with self._cv:
            lanes, waiting, units = len(self._lanes), len(self._queue), self.units
        memories, nbytes = self.held()
        return {"lanes": lanes, "waiting": waiting, "units": units, "load": self.load(),
                "held_memories": memories, "held_bytes": nbytes}

    # ---- the lanes' side -------------------------------------------------------------------
    def _acquire(self, lane: "AskLane") -> None:
        with self._cv:
            lane.check()
            ticket = next(self._tickets)
            unit = (ticket, lane.id)
            self._queue.append(unit)
            lane.waiting += 1
            t0 = time.monotonic()
            try:
                while self._holder is not None or self._next() != ticket:
                    if lane.cancelled:
                        raise AskCancelled("the ask was cancelled")
                    self._cv.wait(WAIT_S)
            except BaseException:
                self._queue.remove(unit)
                self._cv.notify_all()
                raise
            finally:
                lane.waiting -= 1
            self._queue.remove(unit)
            self._holder = ticket
            lane.holding = True
            lane.waited_s += time.monotonic() - t0
            self.units += 1

    def _release(self, lane: "AskLane") -> None:
        with self._cv:
            self._holder = None
            lane.holding = False
            lane.units += 1
            lane.last_used = time.monotonic()
            self._cv.notify_all()

    def _close(self, lane: "AskLane") -> None:
        with self._cv:
            self._lanes.pop(lane.id, None)
            self._cv.notify_all()

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()


class AskLane:
    """One ask's lane to the cores (:class:`sparkv.edge.lane.Lane`): :meth:`hold` for each unit
    of compute, :meth:`cancel` from any thread. Made by :meth:`CoreGate.lane`.

    Its counters (``units``, ``waited_s``, ``waiting``, ``holding``, ``last_used``) change under
    the gate's lock. ``seat``: its seat in the service's link plan
    (:class:`~sparkv.asks.linkplan.LinkSeat`; ``None``: the link is its own to use)."""

    def __init__(self, gate: CoreGate, lane_id: int) -> None:
        self.gate, self.id = gate, lane_id
        self.seat: Any = None
        self.units = 0
        self.waited_s = 0.0
        self.waiting = 0
        self.holding = False
        self.last_used = -float("inf")
        self._cancelled = threading.Event()

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        self.gate._acquire(self)
        try:
            yield
        finally:
            self.gate._release(self)

    def acquire(self) -> None:
        """The cores, for a unit that ends with :meth:`release` (a forward hook's pair)."""
        self.gate._acquire(self)

    def release(self) -> None:
        self.gate._release(self)

    def check(self) -> None:
        if self._cancelled.is_set():
            raise AskCancelled("the ask was cancelled")

    def load(self) -> float:
        return self.gate.load(self)

    def link_turn(self, pending_bytes: float) -> LinkTurn:
        """The ask's turn on the link (its seat's; always go without one)."""
        return LinkTurn() if self.seat is None else self.seat.turn(pending_bytes)

    def attach(self, memory: Any) -> None:
        with self.gate._cv:
            self.gate._memories.add(memory)

    def cancel(self) -> None:
        """Cancels the ask: its next unit (and one waiting now) raises ``AskCancelled``."""
        self._cancelled.set()
        self.gate._wake()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def close(self) -> None:
        """The ask ended: the lane no longer counts in the load."""
        self.gate._close(self)
