"""The link probe: how a controller whose plan keeps the link idle keeps measuring it.

A plan made while the link was in a deep fade computes everything (or nearly everything) and
gives the link nothing to do; without traffic the controller never sees the link recover, and
the plan stays dead although streaming would now be faster. :class:`LinkProbe` is the policy
that keeps a small, bounded amount of work on such a link (docs/scheduler.md, "Probe and
hand-back"):

* a probe is one layer step from the TAIL of the compute order, handed to the link at its
  cheapest level (the work the compute path would reach last, so a probe that never arrives
  costs the compute path nothing until its very end, when the step moves back);
* at most one probe is in flight, and only while the link has nothing else to do;
* the bytes requested by probes stay within a token bucket: ``burst_bytes`` plus ``rate_Bps``
  per second of the load (the first probe is always allowed, whatever its size). On a dead link
  this bounds what the probes ask for, including probes cancelled and sent again;
* once a probe's bytes flow at a good rate, the controller's ordinary rebalancing hands work
  back to the link (whole token-chunk columns from the tail:
  :class:`~sparkv.scheduler.rules.ToStream`).

The rule that makes probes is :class:`~sparkv.scheduler.rules.ProbeIdleLink`; this module is its
state, one per load (:attr:`LoadState.probe <sparkv.scheduler.state.LoadState>`). The simulator
and the edge engine both drive the same controller, so the policy is the same in both.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LinkProbe:
    """Token-bucket bound and bookkeeping of the link probe (module docstring).

    Args:
        rate_Bps: probe bytes allowed per second of the load, on average.
        burst_bytes: probe bytes allowed at once (the bucket's depth).

    Times are seconds since the load began (the controller's clock minus its start).
    """

    rate_Bps: float = 1_000_000.0
    burst_bytes: float = 512_000.0
    spent_bytes: float = 0.0
    sent: int = 0
    in_flight: set[int] = field(default_factory=set)   # dense chunk ids of probes in flight

    def budget(self, t: float) -> float:
        """Probe bytes allowed by time ``t`` (s), in total."""
        return self.burst_bytes + self.rate_Bps * max(0.0, t)

    def allows(self, t: float, nbytes: float) -> bool:
        """Whether a probe of ``nbytes`` may be requested at time ``t``: none in flight, and
        within the bucket (the first probe always)."""
        if self.in_flight:
            return False
        return self.sent == 0 or self.spent_bytes + nbytes <= self.budget(t)

    def record(self, chunks: list[int], nbytes: float) -> None:
        """A probe of ``chunks`` (``nbytes`` together) was handed to the link."""
        self.sent += 1
        self.spent_bytes += nbytes
        self.in_flight.update(chunks)

    def settle(self, c: int) -> None:
        """Chunk ``c`` is no longer a probe in flight (received, cancelled or computed)."""
        self.in_flight.discard(c)
