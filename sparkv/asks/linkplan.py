"""The device's one link, planned across the asks running at once: :class:`LinkPlan`.

Without a plan every ask plans with an even share of the link and streams whenever its own
controller says so: the asks' responses share the link byte by byte, every one of them finishes
streaming near the end of the whole batch's bytes, and N asks' first tokens all come at about
the batch's makespan (measured: 8 SparKV asks over one 20 Mbit/s link, p50 26.96 s for a
31.73 s makespan). Serving them one after another on the link instead gives the k-th its first
token after about k asks' worth of bytes: the median halves for the same makespan.

The plan is one owner of what each ask still has to stream; a **policy** (one small class behind
:data:`LINK_PLANS`, ``sparkv device serve --ask-link-plan``) ranks the asks that join it, and

* **the link's turn**: an ask sends a request only when the asks ranked before it have at most
  ``lead_bytes`` left to arrive (the next request then opens about an RTT before the link would
  idle); a request already sent goes on;
* **an ask not heard from yet holds its place**: an ask's seat opens when it starts, but it
  says what it has to stream only at its first turn, once its manifest is read and its plan
  made (tens of milliseconds). Until then, for at most ``report_grace_s`` after its seat
  opened, the asks that arrived after it do not get the link: two asks started together would
  otherwise both stream, whichever planned first, the older one measuring half the link and
  planning for it (traced: the younger's first request, 1.1 MB, went out 40 ms before the
  older's first turn). An ask answered from its kept context, or waiting for another ask's
  load of it, says at once that it streams nothing;
* **the bytes ahead**: each ask's controller plans its remaining link time with the bytes of the
  asks ranked before it (:attr:`LinkEstimator.ahead_bytes
  <sparkv.scheduler.estimators.LinkEstimator.ahead_bytes>`): an ask far back on the link finds
  its link behind and its controller moves chunks to local compute (the cores the asks ahead of
  it leave free, :class:`~sparkv.asks.cores.CoreGate` in ``oldest`` order); as the asks ahead
  finish, its link share grows and its controller streams again. Which chunks stream and which
  are computed is thus decided per ask and per chunk, seeing every ask's outstanding bytes.

Policies: ``even`` (no plan: main's behaviour before the plan, every ask fetches freely and
plans with an even share), ``oldest`` (the default: the link to the oldest ask first, the order
the cores are granted in, so one ask at a time has both), ``shortest`` (shortest remaining
first: the ask with the fewest bytes still to stream first, arrival order on a tie). ``oldest``
and ``shortest`` plan the asks of adaptive strategies (``sparkv``: its controller re-plans per
chunk with the bytes ahead); ``oldest-all`` plans every strategy's asks (a measurement: what the
order alone gives the baselines).

State: one entry per open seat (its arrival, its bytes still to arrive); one lock guards them.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from sparkv.edge.lane import LinkTurn

__all__ = ["LINK_PLANS", "LinkPlan", "LinkPolicy", "LinkSeat", "EvenShare", "OldestFirst",
           "ShortestFirst", "LEAD_BYTES", "REPORT_GRACE_S"]

#: an ask may send its next request when the asks ranked before it have at most this many bytes
#: left to arrive (about an RTT of a 20 Mbit/s link: the request opens as theirs drain)
LEAD_BYTES = 64 << 10
#: how long after its seat opened an ask not heard from yet keeps the asks that arrived after it
#: off the link (seconds; module docstring)
REPORT_GRACE_S = 0.5


@dataclass
class SeatEntry:
    """One ask's place in the plan: its arrival (``order``), its bytes still to arrive, when its
    seat opened and whether it said its bytes yet (``heard``)."""

    order: int
    pending_bytes: float = 0.0
    opened: float = 0.0
    heard: bool = False


class LinkPolicy(Protocol):
    """Which asks join the link plan, and in which order they get the link."""

    def joins(self, strategy: str) -> bool:
        """Whether an ask of ``strategy`` is planned (else it fetches freely, as alone)."""
        ...

    def key(self, entry: SeatEntry) -> tuple[float, ...]:
        """The ask's rank key: the smallest key gets the link first."""
        ...


@dataclass(frozen=True)
class EvenShare:
    """No plan: every ask fetches whenever its controller says, and the link's bytes are shared
    as they come (each ask plans with an even share of the link's estimate)."""

    def joins(self, strategy: str) -> bool:
        return False

    def key(self, entry: SeatEntry) -> tuple[float, ...]:
        return (float(entry.order),)


@dataclass(frozen=True)
class OldestFirst:
    """The link to the oldest ask first (the cores' ``oldest`` order): the asks of
    ``strategies`` (``None``: every strategy) are planned."""

    strategies: tuple[str, ...] | None = ("sparkv",)

    def joins(self, strategy: str) -> bool:
        return self.strategies is None or strategy in self.strategies

    def key(self, entry: SeatEntry) -> tuple[float, ...]:
        return (float(entry.order),)


@dataclass(frozen=True)
class ShortestFirst(OldestFirst):
    """Shortest remaining first: the ask with the fewest bytes still to arrive gets the link
    first (arrival order on a tie)."""

    def key(self, entry: SeatEntry) -> tuple[float, ...]:
        return (entry.pending_bytes, float(entry.order))


#: ``sparkv device serve --ask-link-plan``: name -> policy
LINK_PLANS: dict[str, LinkPolicy] = {
    "even": EvenShare(),
    "oldest": OldestFirst(),
    "shortest": ShortestFirst(),
    "oldest-all": OldestFirst(strategies=None),
}


class LinkPlan:
    """The asks' turns on the one link (module docstring).

    Args:
        policy: a name in :data:`LINK_PLANS`, or a policy.
        lead_bytes: the bytes the asks ranked before one may still have to arrive when it may
            send its next request (:data:`LEAD_BYTES`).
        report_grace_s: how long after its seat opened an ask not heard from yet keeps the
            asks that arrived after it off the link (:data:`REPORT_GRACE_S`).
        clock: the seconds that grace is read on (a test's own).
    """

    def __init__(self, policy: str | LinkPolicy = "oldest", lead_bytes: float = LEAD_BYTES,
                 report_grace_s: float = REPORT_GRACE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(policy, str):
            if policy not in LINK_PLANS:
                raise ValueError(f"no link plan {policy!r} (one of {', '.join(LINK_PLANS)})")
            self.name, policy = policy, LINK_PLANS[policy]
        else:
            self.name = type(policy).__name__
        self.policy: LinkPolicy = policy
        self.lead_bytes = float(lead_bytes)
        self.report_grace_s, self._clock = float(report_grace_s), clock
        self._lock = threading.Lock()
        self._entries: dict[int, SeatEntry] = {}
        self._ids = itertools.count()
        self.refused = 0          # turns refused so far (an ask waited for the link)

    def seat(self, order: int, strategy: str) -> "LinkSeat":
        """A new ask's seat (close it when the ask ends): planned when the policy joins its
        ``strategy``, ranked by ``order`` (its arrival: the cores' lane id)."""
        if not self.policy.joins(strategy):
            return LinkSeat(self, None)
        with self._lock:
            seat_id = next(self._ids)
            self._entries[seat_id] = SeatEntry(order, opened=self._clock())
        return LinkSeat(self, seat_id)

    def turn(self, seat_id: int, pending_bytes: float) -> LinkTurn:
        """The planned ask ``seat_id`` has ``pending_bytes`` left to arrive: its turn."""
        with self._lock:
            me = self._entries.get(seat_id)
            if me is None:
                return LinkTurn()
            me.pending_bytes = max(0.0, float(pending_bytes))
            me.heard = True
            ahead = self._ahead(me)
            go = ahead <= self.lead_bytes and not self._unheard_before(me)
            if not go and me.pending_bytes > 0:
                self.refused += 1
            return LinkTurn(ahead, go)

    def rank(self, seat_id: int) -> int:
        """How many planned asks are ranked before ``seat_id`` now (0: first)."""
        with self._lock:
            me = self._entries.get(seat_id)
            if me is None:
                return 0
            mine = self.policy.key(me)
            return sum(1 for e in self._entries.values()
                       if e is not me and self.policy.key(e) < mine)

    def _ahead(self, me: SeatEntry) -> float:
        mine = self.policy.key(me)
        return sum(e.pending_bytes for e in self._entries.values()
                   if e is not me and self.policy.key(e) < mine)

    def _unheard_before(self, me: SeatEntry) -> bool:
        """Whether an ask that arrived before ``me`` has not said its bytes yet, its seat
        opened less than ``report_grace_s`` ago (arrival order whatever the policy: an unheard
        ask's rank under ``shortest`` is not known yet)."""
        now = self._clock()
        return any(not e.heard and now - e.opened < self.report_grace_s
                   for e in self._entries.values() if e.order < me.order)

    def close(self, seat_id: int) -> None:
        with self._lock:
            self._entries.pop(seat_id, None)

    def stats(self) -> dict[str, float | int | str]:
        """``policy``, ``asks`` (planned now), ``pending_bytes`` (theirs, all together),
        ``refused`` (turns refused so far)."""
        with self._lock:
            return {"policy": self.name, "asks": len(self._entries),
                    "pending_bytes": sum(e.pending_bytes for e in self._entries.values()),
                    "refused": self.refused}


class LinkSeat:
    """One ask's seat in a :class:`LinkPlan` (``id`` ``None``: not planned; its turn is always
    go, nothing ahead)."""

    def __init__(self, plan: LinkPlan, seat_id: int | None) -> None:
        self.plan, self.id = plan, seat_id

    @property
    def planned(self) -> bool:
        return self.id is not None

    def turn(self, pending_bytes: float) -> LinkTurn:
        return LinkTurn() if self.id is None else self.plan.turn(self.id, pending_bytes)

    def rank(self) -> int:
        return 0 if self.id is None else self.plan.rank(self.id)

    def close(self) -> None:
        if self.id is not None:
            self.plan.close(self.id)
