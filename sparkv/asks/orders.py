"""The orders the device's cores go to the asks' units in (``sparkv device serve
--ask-core-order``): one small class each, behind :data:`GRANT_ORDERS`.

:class:`~sparkv.asks.cores.CoreGate` grants the waiting unit an order ranks first, and asks the
order which asks' units go before an ask's (what that ask's load counts, and whether it may run
a long unit):

* ``turns`` (:class:`Turns`): the order the units asked for the cores. The asks running at once
  interleave their units (round robin) and progress together;
* ``oldest`` (:class:`Oldest`, the service's default: :data:`DEFAULT_ORDER`): the unit of the oldest ask (the first to start)
  first. Work-conserving: while it waits for its link, the younger asks' units fill the cores;
  its first token comes first, then the next one's, as serving them one by one would;
* ``first-tokens`` (:class:`FirstTokens`): as ``oldest``, except that the units of asks still
  before their first token (loading, the question's forward pass) go before those of asks
  already answering (one answer token each). An answering ask's unit that waited
  ``answer_wait_s`` goes first (no answer starves while others load). What the first tokens
  gain, the answers' later tokens pay: a prefill-first order, as vLLM's first scheduler had.
  The answer tokens it defers wait together, and the gate runs them as one forward pass
  (:meth:`CoreGate.run_decode <sparkv.asks.cores.CoreGate._run_decode>`): on this CPU eight
  cost about two. Measured (docs/asks.md, 8 asks over one 80 Mbit/s link): SparKV's p50 TTFT
  6.30 s against ``oldest``'s 7.88 at 1K, 11.29 against 13.54 at 2K, the makespans alike; but
  the rest of an answer (7 tokens) took 5.32 s at the p50 against 0.86 s, so the median ask's
  whole answer came later (about 11 s against 8). Since answering asks share their passes
  (session 56, docs/asks.md "Run: answer tokens that share their passes"): p50 TTFT 7.85 and
  8.15 s against ``oldest``'s 8.5-11.6 s over five runs, the whole 8-token answer at about the
  same time (~14 s), but eight loaded contexts held at once (RSS at N = 8 1.36-1.38x N = 1,
  against 1.17-1.26x). Hence not the default: an option for apps that want the first token
  above all.

An ask is *answering* once its first token came (:meth:`AskLane.answered
<sparkv.asks.cores.AskLane.answered>`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

__all__ = ["GRANT_ORDERS", "GrantOrder", "Waiting", "Turns", "Oldest", "FirstTokens",
           "ANSWER_WAIT_S", "DEFAULT_ORDER"]

#: the device service's order (``sparkv device serve --ask-core-order``'s default)
DEFAULT_ORDER = "oldest"
#: ``first-tokens``: an answer token's unit that waited this long goes first (seconds)
ANSWER_WAIT_S = 1.0


class Waiting(NamedTuple):
    """A unit waiting for the cores: its ticket (arrival order), its ask's lane id, whether that
    ask is answering, and when the unit began to wait."""

    ticket: int
    lane: int
    answering: bool
    since: float


class GrantOrder(Protocol):
    """Which waiting unit gets the cores, and which asks go before an ask."""

    def rank(self, unit: Waiting, now: float) -> tuple[float, ...]:
        """The unit's rank key: the smallest is granted first."""
        ...

    def before(self, lane: int, answering: bool, me: int, me_answering: bool) -> bool:
        """Whether the units of ask ``lane`` (``answering`` or not) go before those of ask
        ``me`` (``me_answering`` or not)."""
        ...


@dataclass(frozen=True)
class Turns:
    """The order the units asked for the cores (round robin across asks)."""

    def rank(self, unit: Waiting, now: float) -> tuple[float, ...]:
        return (float(unit.ticket),)

    def before(self, lane: int, answering: bool, me: int, me_answering: bool) -> bool:
        return lane != me


@dataclass(frozen=True)
class Oldest:
    """The oldest ask's unit first."""

    def rank(self, unit: Waiting, now: float) -> tuple[float, ...]:
        return (float(unit.lane), float(unit.ticket))

    def before(self, lane: int, answering: bool, me: int, me_answering: bool) -> bool:
        return lane < me


@dataclass(frozen=True)
class FirstTokens:
    """First tokens first: the units of asks still loading (oldest first), then the answering
    asks' (oldest first); an answering ask's unit that waited ``answer_wait_s`` goes first."""

    answer_wait_s: float = ANSWER_WAIT_S

    def rank(self, unit: Waiting, now: float) -> tuple[float, ...]:
        if not unit.answering:
            tier = 1.0
        else:                        # an answer token: after the loading asks' units, unless late
            tier = 0.0 if now - unit.since >= self.answer_wait_s else 2.0
        return (tier, float(unit.lane), float(unit.ticket))

    def before(self, lane: int, answering: bool, me: int, me_answering: bool) -> bool:
        if lane == me:
            return False
        if answering == me_answering:
            return lane < me
        return not answering     # a loading ask's units go before an answering one's


#: ``sparkv device serve --ask-core-order``: name -> order
GRANT_ORDERS: dict[str, GrantOrder] = {
    "oldest": Oldest(),
    "turns": Turns(),
    "first-tokens": FirstTokens(),
}
