"""Riding out an outage of a peer (the job queue's Redis): a bounded exponential backoff
(:class:`Backoff`) and :class:`Outage`, which turns a run of failures into one warning when it
starts and one line when it ends, instead of a line per retry.

Neither sleeps by itself: :meth:`Outage.failed` returns the delay and the caller waits it (a worker
waits on its stop event, so a SIGTERM ends the wait); the clock is injectable, so both are tested
without real time passing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

BACKOFF_BASE_S = 0.1
"""The first retry's delay."""
BACKOFF_CAP_S = 5.0
"""No retry waits longer than this (documented in docs/cluster.md)."""


@dataclass(frozen=True)
class Backoff:
    """Delays of successive retries: ``base_s * factor ** n``, at most ``cap_s``."""

    base_s: float = BACKOFF_BASE_S
    cap_s: float = BACKOFF_CAP_S
    factor: float = 2.0

    def delay(self, failures: int) -> float:
        """The wait after the ``failures``-th failure in a row (1 for the first)."""
        if failures < 1:
            return 0.0
        exp = min(failures - 1, 64)  # 2**64 * base is far past any cap: no float overflow
        return float(min(self.cap_s, self.base_s * self.factor ** exp))


class Outage:
    """The failures of one kind of call in a row (``what``, e.g. "the job queue").

    :meth:`failed` counts a failure and returns how long to wait before retrying (a
    :class:`Backoff`); the first failure of an outage is logged as a warning with its error, the
    others are not. :meth:`recovered` ends the outage with one line saying how long it lasted and
    how many retries it took (nothing when there was no outage).

    State: the failure count and the outage's start; used by one thread only (no lock).
    """

    def __init__(self, what: str, logger: logging.Logger, backoff: Backoff | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.what = what
        self.log = logger
        self.backoff = backoff or Backoff()
        self.clock = clock
        self.failures = 0
        self._since = 0.0

    @property
    def ongoing(self) -> bool:
        return self.failures > 0

    def failed(self, exc: BaseException) -> float:
        """Records a failure; returns the delay before the next try."""
        if self.failures == 0:
            self._since = self.clock()
            self.log.warning("%s failed: %s; retrying with backoff (at most %.1f s apart) and "
                             "logging nothing more until it recovers", self.what, exc,
                             self.backoff.cap_s)
        self.failures += 1
        return self.backoff.delay(self.failures)

    def recovered(self) -> None:
        """A call succeeded: ends the outage (logged once)."""
        if self.failures:
            self.log.warning("%s recovered after %.1f s (%d failed tries)", self.what,
                             self.clock() - self._since, self.failures)
            self.failures = 0
