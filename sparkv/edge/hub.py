"""What the parts of the overlap engine share: its knobs, the controller behind one lock, the
load's clock, and the progress signal (:mod:`sparkv.edge.engine` coordinates the parts).

The lock discipline of the whole engine starts here. The
:class:`~sparkv.scheduler.controller.Controller` is not thread-safe: every call to
:attr:`Hub.ctl` holds :attr:`Hub.cv`, whichever thread makes it (the compute worker, the link
loop, a decode worker). The same lock guards the fields the parts share (each part's docstring
names its own): a rule that reads the state of several parts (the stall rule, the idle rule)
reads it in one critical section. ``cv`` is a condition over a re-entrant lock, so a part that
holds it may call into another part that takes it again.

Who waits and who notifies:

* the compute worker waits on ``cv`` (50 ms at a time) when it has no step to run;
* the link loop waits on its own asyncio event (50 ms at a time) when it has nothing to fetch;
* :meth:`Hub.progress` (a step done, a frame decoded, the link dead) wakes both: it notifies
  ``cv`` and calls every waker registered with :meth:`Hub.on_progress` (the link's).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

from sparkv.errors import SparkvError
from sparkv.scheduler.controller import Controller


class EngineError(SparkvError):
    """The engine could not assemble the cache (a bug or an unrecoverable local failure)."""


@dataclass
class EngineConfig:
    """Knobs of the engine's two paths (seconds, bytes)."""

    batch_seconds: float = 0.25      # link time per request at the estimated rate
    batch_min_bytes: int = 256 << 10
    batch_max_items: int = 64
    lead_s: float = 0.02             # open the next request this long (+ RTT) before a batch drains
    sample_interval_s: float = 0.05  # rate samples (and silence ticks) to the controller
    retries: int = 2                 # failed requests retried before the link is declared dead
    retry_backoff_s: float = 0.05
    open_timeout_s: float = 10.0     # a request must start answering within this
    read_timeout_s: float = 10.0     # no byte for this long within a response: the request failed
    silence_grace_s: float = 0.25    # silence counts against the link beyond max(this, 3 RTT)
    stall_fallback_s: float = 1.5    # compute idle + this much credited silence: compute the rest
    decode_workers: int = 1
    #: received frames decoded by the compute thread between its calls instead of by
    #: ``decode_workers`` beside it (:class:`~sparkv.edge.frames.FrameDecoder`); ``None``: when
    #: the compute's OpenMP threads take every usable core of a CPU (``decode_in_turn``)
    decode_in_turn: bool | None = None


class Hub:
    """The controller behind the engine's lock, the load's clock and the progress signal.

    Attributes:
        ctl: the load's controller; call it only while holding ``cv``.
        cv: the engine's one lock (a condition over a re-entrant lock).
    """

    def __init__(self, ctl: Controller) -> None:
        self.ctl = ctl
        self.cv = threading.Condition(threading.RLock())
        self._t0 = 0.0
        self._wakers: list[Callable[[], None]] = []   # registered before any thread starts

    def start_clock(self) -> None:
        """Time 0 of the load (every time the parts record is seconds from here)."""
        self._t0 = time.perf_counter()

    def now(self) -> float:
        """Seconds since :meth:`start_clock`."""
        return time.perf_counter() - self._t0

    def on_progress(self, wake: Callable[[], None]) -> None:
        """``wake()`` is called at every :meth:`progress` (from any thread; it must not block)."""
        self._wakers.append(wake)

    def progress(self) -> None:
        """Something changed that may give a waiting part work; the caller holds ``cv``."""
        self.cv.notify_all()
        for wake in self._wakers:
            wake()
