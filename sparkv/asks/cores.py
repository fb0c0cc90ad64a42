"""The device's cores, shared by the asks running at once: :class:`CoreGate`, the compute worker
every ask's compute goes through, and :class:`AskLane`, one ask's way to it.

Without it, N asks are N threads running the model at once: each layer step of one ask waits
behind the others' OpenMP threads, every ask's TTFT grows by the others' whole work, and no
ask's plan knows the others exist. Here:

* **one unit of compute at a time**: a unit is a layer step (or a column of them), a forward pass
  of the question or of one answer token. The gate grants the cores to one unit at a time, in
  the order a policy ranks the waiting units (:mod:`sparkv.asks.orders`, ``sparkv device serve
  --ask-core-order``): ``turns`` (the order they asked: the asks **interleave their steps**,
  round robin, and progress together), ``oldest`` (the default: the oldest ask's unit first;
  work-conserving, the younger asks' units fill the cores while it waits for its link) or
  ``first-tokens`` (as ``oldest``, the asks still loading before those already answering);
* **the load**: what each ask's controller plans its remaining compute with
  (:attr:`ComputeEstimator.load <sparkv.scheduler.estimators.ComputeEstimator.load>`, fed by the
  engine at every look for a step: :mod:`sparkv.edge.lane`). Two measures (:meth:`AskLane.load`):

  - :meth:`CoreGate.busy_load`, for an ask the service's link plan schedules (its seat is
    planned): ``1 / (1 - U)``, ``U`` the share of the last ``window_s`` the cores ran units of
    the asks that go before it (:meth:`GrantOrder.before
    <sparkv.asks.orders.GrantOrder.before>`; ``oldest``: the older asks), at most
    :data:`MAX_BUSY`. Asks waiting for their link leave the cores idle, and an ask behind them
    sees it: it computes chunks rather than wait for the link (the device-wide split). The asks
    before it that compute raise its ``U``, so the next ask in line computes less;
  - :meth:`CoreGate.load`, for the other asks (an even share of everything, their plan starting
    from the asks running): the asks before it that used the cores in the last ``window_s``,
    counted, itself included;
* **batching** (``sparkv device serve --ask-batch on``): a unit that is one layer step
  (:meth:`AskLane.run_step`) takes along, in the same call, the layer steps other asks are
  waiting with at the same layer of the same model (:func:`~sparkv.runtime.stepper.together_key`;
  at most ``batch`` steps and ``batch_rows`` token rows a call, the riders picked in grant
  order): one set of GEMMs over all their rows, the attention of each over its own KV memory
  (:func:`~sparkv.runtime.stepper.run_steps_together`). The holder is the unit the order picks;
  riders only join it. Each rider's thread gets its own :class:`StepResult
  <sparkv.runtime.stepper.StepResult>` (seconds: the call's, shared) or the call's error; a
  rider whose ask was cancelled is not taken, and one cancelled during the call raises
  :class:`~sparkv.edge.lane.AskCancelled` in its own thread when the call ends;
* **answer tokens together** (``decode_batch``, ``sparkv device serve --ask-decode-batch``, on
  by default): a unit that is one answer token (:meth:`AskLane.run_decode`) takes along the
  answer tokens other asks are waiting with (at most ``decode_batch``, in grant order) and runs
  them as one forward pass of one row each
  (:func:`~sparkv.runtime.batchdecode.decode_together`): a decode pass on a CPU is bound by
  reading the weights, so K rows cost about one. Each rider's thread gets its own logits.
  An answer token whose turn came waits up to ``gather_s`` for the answering asks that are
  between two tokens (:meth:`CoreGate._gathering`): without it, two asks answering at once
  take turns, one pass each, for as long as both answer;
* **the cores kept a moment for the loading ask that just ran** (``regrant_s``): between two
  units an ask's thread picks its next step (its controller's look, a few milliseconds).
  Granted at once, a waiting unit of an ask ranked after it would take the cores in that gap
  every time, and the ask that goes first would wait for a whole unit of the other's after
  each of its own: in ``oldest`` order two loading asks interleaved one for one, round robin,
  and the oldest ask's first token came 0.8 s later than alone (docs/asks.md). So for
  ``regrant_s`` after a loading ask's unit ends, the units of the loading asks that rank
  strictly after it (:meth:`CoreGate._reserved`) are not granted: its next unit, asked for
  within that time, runs first. An ask that has nothing to run (waiting for its link) leaves
  the cores to the others after ``regrant_s``. Answer tokens are not concerned (an answering
  ask keeps nothing, and an answering ask's tokens are not held): an answer's passes are short
  and the others' tokens ride in them. Under ``turns``, where no ask ranks strictly first,
  nothing is kept;
* **cancellation**: :meth:`AskLane.cancel` makes the ask's next request for the cores raise
  :class:`~sparkv.edge.lane.AskCancelled` (a waiting request at once): the ask stops within one
  unit.

A unit's own time (what the controller learns the device's speed from) excludes the wait for the
gate; the wait is counted per lane (``waited_s``).

State: the queue of waiting units (and the layer steps or answer tokens they carry), the holder,
the lanes' last use, the spans the units ran in the last ``window_s``; one condition variable
guards all of it. A unit runs outside the lock.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import itertools
import threading
import time
import weakref
from typing import Any, Callable, Iterator

from sparkv.asks.orders import GRANT_ORDERS, GrantOrder, Waiting
from sparkv.edge.lane import AskCancelled, LinkTurn
from sparkv.layout import StepId

__all__ = ["CoreGate", "AskLane", "LOAD_WINDOW_S", "MAX_BUSY", "GRANT_ORDERS", "BATCH_STEPS",
           "DECODE_BATCH", "GATHER_S", "REGRANT_S"]

#: an ask that used the cores this recently counts in the load (seconds)
LOAD_WINDOW_S = 1.0
#: the largest share of the cores the asks before one can be seen to take in :meth:`CoreGate.
#: busy_load` (its load then 20: the cores all but never its)
MAX_BUSY = 0.95
#: how often a waiting unit looks at its lane's cancellation (seconds)
WAIT_S = 0.05
#: the most layer steps one call runs with batching on (the holder's and up to 3 riders')
BATCH_STEPS = 4
#: how long an answer token that may run waits for the answer tokens of other answering asks
#: between two of their tokens (they just gave the cores back), so all run as one pass
#: (:meth:`CoreGate._gathering`; seconds, real time)
GATHER_S = 0.03
#: how long the cores are kept for the ask whose unit just ended, against the units of asks
#: ranked after it (:meth:`CoreGate._reserved`; seconds, real time): its thread asks for its
#: next unit within 0.5-7 ms on this 2-core CPU (traced with two asks at once)
REGRANT_S = 0.01
#: the most answer tokens (one per ask) one forward pass runs: on this CPU a decode pass is
#: bound by reading the weights, so K rows cost about one (sparkv.runtime.batchdecode)
DECODE_BATCH = 8
#: the most token rows one batched call runs: measured on SmolLM2 (bench/batch_layer.py, 2-core
#: CPU), two steps as one call cost 0.78x two calls of 32 rows, 0.87-0.89x of 64, 0.92-0.95x of
#: 128, 0.93-0.99x of 256: past 256 rows a rider gains the cores little and delays the holder
#: by about its whole step
BATCH_ROWS = 256


class CoreGate:
    """One unit of compute at a time on the device's cores, granted in ``order`` (module
    docstring, :data:`GRANT_ORDERS`).

    Args:
        window_s: how recently an ask must have used the cores to count in :meth:`load`.
        order: a name in :data:`~sparkv.asks.orders.GRANT_ORDERS` (``oldest``, ``turns``,
            ``first-tokens``), or an order.
        batch: the most layer steps one call runs (module docstring; 1: no batching).
        batch_rows: the most token rows a call with riders runs.
        decode_batch: the most answer tokens (of as many asks) one forward pass runs (1: each
            its own pass).
        gather_s: how long an answer token that may run waits for the other answering asks'
            next tokens (:meth:`_gathering`; 0: never).
        regrant_s: how long the cores are kept for the ask whose unit just ended, against the
            units of the asks ranked after it (:meth:`_reserved`; 0: never).
        clock: the seconds the load's window and the units' spans are read on (a test's own).
    """

    def __init__(self, window_s: float = LOAD_WINDOW_S, order: str | GrantOrder = "oldest",
                 batch: int = BATCH_STEPS, batch_rows: int = BATCH_ROWS,
                 decode_batch: int = DECODE_BATCH, gather_s: float = GATHER_S,
                 regrant_s: float = REGRANT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(order, str):
            if order not in GRANT_ORDERS:
                raise ValueError(f"no grant order {order!r} (one of {', '.join(GRANT_ORDERS)})")
            order = GRANT_ORDERS[order]
        if batch < 1 or decode_batch < 1:
            raise ValueError(f"a call runs at least one unit (batch={batch}, "
                             f"decode_batch={decode_batch})")
        self.window_s, self.order, self.batch = window_s, order, batch
        self.batch_rows, self.decode_batch, self.gather_s = batch_rows, decode_batch, gather_s
        self.regrant_s = regrant_s
        self._clock = clock
        self._cv = threading.Condition()
        self._queue: list[Waiting] = []            # waiting units, arrival order
        self._holder: int | None = None            # the running unit's ticket
        self._tickets = itertools.count()
        self._lanes: dict[int, AskLane] = {}       # open lanes by id
        self._ids = itertools.count()
        self._rides: dict[int, _Ride] = {}         # what waiting units carry (steps, tokens)
        self.units = 0                             # units run since the start
        self.batched_units = 0                     # of them, run in another lane's call
        self._memories: weakref.WeakSet[Any] = weakref.WeakSet()   # the asks' KV memories
        # the units run in the last window: (start, end, the lane holding, whether answering)
        self._spans: collections.deque[tuple[float, float, int, bool]] = collections.deque()
        self._held: tuple[float, int, bool] = (0.0, -1, False)   # the running unit's, alike
        self._kept_for: tuple[int, float] = (-1, 0.0)   # the lane the cores are kept for, until

    def lane(self) -> "AskLane":
        """A new ask's lane (close it when the ask ends)."""
        with self._cv:
            lane = AskLane(self, next(self._ids))
            self._lanes[lane.id] = lane
            return lane

    def load(self, lane: "AskLane | None" = None) -> float:
        """The asks sharing the cores now: those holding or waiting for them, or that used them
        in the last ``window_s``. ``lane``'s load counts only the asks whose units go before
        its own (:meth:`GrantOrder.before <sparkv.asks.orders.GrantOrder.before>`; in
        ``oldest`` order the older asks), and itself (at least 1)."""
        now = self._clock()
        with self._cv:
            busy = [x for x in self._lanes.values()
                    if x.waiting or x.holding or now - x.last_used <= self.window_s]
            if lane is None:
                return float(max(1, len(busy)))
            return float(1 + sum(1 for x in busy if self._before(x.id, x.answering, lane)))

    def busy_load(self, lane: "AskLane | None" = None) -> float:
        """``1 / (1 - U)``: ``U`` the share of the last ``window_s`` the cores ran units of the
        asks before ``lane`` (:meth:`_before`; every ask without one), at most
        :data:`MAX_BUSY`. 1.0: the cores were the asks' after them (or idle)."""
        now = self._clock()
        since = now - self.window_s
        with self._cv:
            spans = list(self._spans)
            if self._holder is not None:
                spans.append((self._held[0], now, *self._held[1:]))
            busy = sum(max(0.0, min(end, now) - max(start, since))
                       for start, end, by, answering in spans
                       if lane is None or self._before(by, answering, lane))
        return 1.0 / (1.0 - min(busy / self.window_s, MAX_BUSY))

    def _before(self, lane_id: int, answering: bool, me: "AskLane") -> bool:
        """Whether the units of ask ``lane_id`` (``answering`` or not) go before ``me``'s."""
        return self.order.before(lane_id, answering, me.id, me.answering)

    def first(self, lane: "AskLane") -> bool:
        """Whether no open ask's units go before ``lane``'s (:meth:`_before`): a long unit of
        its own then keeps none waiting that should not wait."""
        with self._cv:
            return not any(self._before(x.id, x.answering, lane) for x in self._lanes.values())

    def _in_order(self) -> list[Waiting]:
        """The waiting units in the order they would be granted (the order's ranks)."""
        now = self._clock()
        return sorted(self._queue, key=lambda unit: self.order.rank(unit, now))

    def _next(self) -> int:
        """The ticket of the waiting unit to grant next (the queue is not empty)."""
        now = self._clock()
        return min(self._queue, key=lambda unit: self.order.rank(unit, now)).ticket

    def _gathering(self, ride: "_Ride | None") -> bool:
        """Whether ``ride``, an answer token whose turn it is, waits a moment for other asks'
        (under the lock). An answering ask that just gave the cores back (within ``gather_s``)
        and asks for nothing yet is between two tokens: its next one comes within
        milliseconds. Granting at once would run the two asks' tokens one pass each, in turn,
        for as long as both answer (each pass ends as the other's token arrives); waiting runs
        them as one pass, for about one's cost. At most ``gather_s`` (real time) from the moment
        the turn came, and not once the pass is full."""
        if ride is None or ride.item is None or self.decode_batch <= 1 or self.gather_s <= 0:
            return False
        t = time.monotonic()
        if ride.turn_at is None:
            ride.turn_at = t
        if t - ride.turn_at >= self.gather_s:
            return False
        tokens = sum(1 for r in self._rides.values() if r.item is not None)
        if tokens >= self.decode_batch:
            return False
        now = self._clock()
        # asking for nothing: no unit in the queue (a rider's lane counts ``waiting`` until its
        # thread wakes up after the pass, but its unit left the queue when it was taken)
        queued = {unit.lane for unit in self._queue}
        return any(x is not ride.lane and x.answering and not x.cancelled and not x.holding
                   and x.id not in queued and now - x.last_used <= self.gather_s
                   for x in self._lanes.values())

    def _reserved(self, lane: "AskLane") -> float:
        """How long ``lane``'s unit must still wait (under the lock; 0.0: not at all) because
        the cores are kept for the ask whose unit just ended (``regrant_s``, real time): an
        open, uncancelled ask ranked strictly before ``lane``'s, whose next unit is not queued
        yet (a queued one is granted by the order anyway), both asks still loading (an
        answering ask's tokens interleave with the others' units as before: kept for, it would
        hold a younger ask's first token behind its whole answer)."""
        by, until = self._kept_for
        left = until - time.monotonic()
        other = self._lanes.get(by)
        if (left <= 0 or other is None or other is lane or other.cancelled or other.waiting
                or other.answering or lane.answering
                or not self._before(other.id, other.answering, lane)
                or self.order.before(lane.id, lane.answering, other.id, other.answering)):
            return 0.0
        return left

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
        """``lanes`` (open), ``waiting`` (units), ``units`` (run so far), ``batched_units`` (of
        them, run in another lane's call), ``batch`` (the most steps a call runs), ``load``,
        ``busy_load`` (every ask's units counted), ``held_memories`` and ``held_bytes``
        (:meth:`held`)."""
        with self._cv:
            lanes, waiting, units = len(self._lanes), len(self._queue), self.units
            batched = self.batched_units
        memories, nbytes = self.held()
        return {"lanes": lanes, "waiting": waiting, "units": units, "batched_units": batched,
                "batch": self.batch, "load": self.load(), "busy_load": self.busy_load(),
                "held_memories": memories,
                "held_bytes": nbytes}

    # ---- the lanes' side -------------------------------------------------------------------
    def _run_step(self, lane: "AskLane", stepper: Any, step: StepId) -> Any:
        """``stepper.run_step(step)`` on ``lane``'s turn, in one call with the riders it takes
        along, or as a rider in another lane's call (module docstring). The runtime (torch) is
        imported on the first step: the CLI's parsers import this module and never torch."""
        from sparkv.runtime.stepper import run_steps_together, together_key

        key = together_key(stepper, step) if self.batch > 1 else None
        if key is None:
            with lane.hold():
                return stepper.run_step(step)
        ride = _Ride.of_step(lane, stepper, StepId(*step), key)
        riders = self._acquire(lane, ride)
        if ride.taken:
            return ride.outcome()
        try:
            if riders:
                results = run_steps_together([(r.stepper, r.step) for r in [ride, *riders]
                                              if r.step is not None])
            else:
                results = [stepper.run_step(step)]
        except BaseException as exc:
            self._release(lane, riders, error=exc)
            raise
        self._release(lane, riders, results[1:])
        return results[0]

    def _run_decode(self, lane: "AskLane", lm: Any, item: Any) -> Any:
        """The logits of ``item``'s answer token (a :class:`~sparkv.runtime.batchdecode.
        DecodeItem`) on ``lane``'s turn: one forward pass with the answer tokens of other asks
        waiting then (up to ``decode_batch``, in grant order), or as a rider in another lane's
        pass."""
        from sparkv.runtime.batchdecode import decode_together

        if self.decode_batch <= 1:
            with lane.hold():
                return decode_together(lm, [item])[0]
        ride = _Ride(lane, ("decode", id(lm.model)), rows=1, item=item)
        riders = self._acquire(lane, ride)
        if ride.taken:
            return ride.outcome()
        try:
            logits = decode_together(lm, [item, *(r.item for r in riders)])
        except BaseException as exc:
            self._release(lane, riders, error=exc)
            raise
        self._release(lane, riders, list(logits[1:]))
        return logits[0]

    def _acquire(self, lane: "AskLane", ride: "_Ride | None" = None) -> list["_Ride"]:
        """Waits for ``lane``'s turn and takes the cores; returns the riders taken along (for a
        ``ride``). A ride another lane's call took returns once that call ended
        (``ride.taken``)."""
        with self._cv:
            lane.check()
            ticket = next(self._tickets)
            unit = Waiting(ticket, lane.id, lane.answering, self._clock())
            self._queue.append(unit)
            if ride is not None:
                self._rides[ticket] = ride
                if ride.item is not None:
                    self._cv.notify_all()          # a token another one gathers for
            lane.waiting += 1
            t0 = time.monotonic()
            try:
                while not (ride is not None and ride.taken) and (
                        self._holder is not None or self._next() != ticket
                        or self._gathering(ride) or self._reserved(lane) > 0):
                    if lane.cancelled:
                        raise AskCancelled("the ask was cancelled")
                    wait = WAIT_S if ride is None or ride.turn_at is None else self.gather_s / 3
                    self._cv.wait(min(wait, self._reserved(lane) or wait))
            except BaseException:
                self._queue.remove(unit)
                self._rides.pop(ticket, None)
                self._cv.notify_all()
                raise
            finally:
                lane.waiting -= 1
            lane.waited_s += time.monotonic() - t0
            if ride is not None and ride.taken:
                while not ride.finished:
                    self._cv.wait(WAIT_S)
                return []
            self._queue.remove(unit)
            self._rides.pop(ticket, None)
            self._holder = ticket
            self._held = (self._clock(), lane.id, lane.answering)
            lane.holding = True
            self.units += 1
            return self._take_riders(ride) if ride is not None else []

    def _take_riders(self, ride: "_Ride") -> list["_Ride"]:
        """The waiting layer steps that go along with ``ride`` (under the lock): the same
        :func:`~sparkv.runtime.stepper.together_key`, other lanes not cancelled, steps that can
        run now; at most ``batch - 1``, and ``batch_rows`` rows in all, in grant order. Each
        leaves the queue."""
        if not ride.ready():
            return []   # the holder's own step raises, alone
        riders: list[_Ride] = []
        rows = ride.rows
        most = (self.decode_batch if ride.item is not None else self.batch) - 1
        for unit in self._in_order():
            if len(riders) >= most:
                break
            other = self._rides.get(unit.ticket)
            if (other is None or other.key != ride.key or other.lane is ride.lane
                    or rows + other.rows > self.batch_rows or other.lane.cancelled
                    or any(r.lane is other.lane for r in riders) or not other.ready()):
                continue
            rows += other.rows
            self._queue.remove(unit)
            del self._rides[unit.ticket]
            other.taken = True
            other.lane.holding = True
            riders.append(other)
        self.units += len(riders)
        self.batched_units += len(riders)
        return riders

    def _release(self, lane: "AskLane", riders: "list[_Ride] | tuple[()]" = (),
                 results: list[Any] | None = None,
                 error: BaseException | None = None) -> None:
        from sparkv.runtime.threads import release_pool

        release_pool()        # the next unit may run on another ask's thread (threads.py)
        with self._cv:
            self._holder = None
            now = self._clock()
            self._spans.append((self._held[0], now, *self._held[1:]))
            while self._spans and self._spans[0][1] < now - self.window_s:
                self._spans.popleft()
            for i, r in enumerate(riders):
                r.result = results[i] if results is not None and error is None else None
                r.error, r.finished = error, True
                r.lane.holding = False
                r.lane.units += 1
                r.lane.last_used = now
            lane.holding = False
            lane.units += 1
            lane.last_used = now
            self._kept_for = (lane.id, time.monotonic() + self.regrant_s)
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

    Its counters (``units``, ``waited_s``, ``waiting``, ``holding``, ``answering``,
    ``last_used``) change under
    the gate's lock. ``seat``: its seat in the service's link plan
    (:class:`~sparkv.asks.linkplan.LinkSeat`; ``None``: the link is its own to use)."""

    def __init__(self, gate: CoreGate, lane_id: int) -> None:
        self.gate, self.id = gate, lane_id
        self.seat: Any = None
        self.units = 0
        self.waited_s = 0.0
        self.waiting = 0
        self.holding = False
        self.answering = False          # its first token came (:meth:`answered`)
        self.last_used = -float("inf")
        self._cancelled = threading.Event()

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        self.gate._acquire(self)
        try:
            yield
        finally:
            self.gate._release(self)

    def run_step(self, stepper: Any, step: StepId) -> Any:
        """``stepper.run_step(step)`` on the lane's turn, perhaps in one call with other asks'
        steps at the same layer (:class:`CoreGate`'s batching)."""
        return self.gate._run_step(self, stepper, step)

    def run_decode(self, lm: Any, item: Any) -> Any:
        """The logits of an answer token on the lane's turn, perhaps in one forward pass with
        other asks' (:meth:`CoreGate._run_decode`)."""
        return self.gate._run_decode(self, lm, item)

    def acquire(self) -> None:
        """The cores, for a unit that ends with :meth:`release` (a forward hook's pair)."""
        self.gate._acquire(self)

    def release(self) -> None:
        self.gate._release(self)

    def answered(self) -> None:
        """The ask's first token came: its units are an answer's from now on (an order may
        rank them after the loading asks': :mod:`sparkv.asks.orders`)."""
        with self.gate._cv:
            self.answering = True

    def check(self) -> None:
        if self._cancelled.is_set():
            raise AskCancelled("the ask was cancelled")

    def load(self) -> float:
        """The cores' load this ask plans its compute with: :meth:`CoreGate.busy_load` when the
        link plan schedules it (its seat is planned), else :meth:`CoreGate.load`."""
        if self.seat is not None and self.seat.planned:
            return self.gate.busy_load(self)
        return self.gate.load(self)

    def first(self) -> bool:
        return self.gate.first(self)

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


class _Ride:
    """A unit a waiting lane carries that may run in another lane's call (a rider): a layer
    step (``stepper``, ``step``; :meth:`of_step`) or an answer token (``item``). The call hands
    it its ``result`` or ``error`` and sets ``finished`` (under the gate's lock). ``key``: what
    may go together; ``rows``: its token rows."""

    def __init__(self, lane: AskLane, key: Any, rows: int, stepper: Any = None,
                 step: StepId | None = None, item: Any = None) -> None:
        self.lane, self.key, self.rows = lane, key, rows
        self.stepper, self.step, self.item = stepper, step, item
        self.taken = False
        self.finished = False
        self.turn_at: float | None = None    # when it first could run (an answer token)
        self.result: Any = None
        self.error: BaseException | None = None

    @classmethod
    def of_step(cls, lane: AskLane, stepper: Any, step: StepId, key: Any) -> "_Ride":
        g = stepper.geometry       # the step's token rows (a step outside: runs alone, raises)
        rows = g.chunk_len(step.t) if 0 <= step.t < g.num_token_chunks else 1 << 30
        return cls(lane, key, rows, stepper=stepper, step=step)

    def ready(self) -> bool:
        """Whether it can run now (an answer token: always; a step whose stepper cannot say:
        no, it runs alone and raises there)."""
        if self.stepper is None:
            return True
        try:
            return bool(self.stepper.ready(self.step))
        except Exception:  # noqa: BLE001 - it runs alone and raises there
            return False

    def outcome(self) -> Any:
        """The rider's result in its own thread: the call's error, or ``AskCancelled`` when its
        ask was cancelled meanwhile."""
        if self.error is not None:
            raise self.error
        self.lane.check()
        assert self.result is not None
        return self.result
