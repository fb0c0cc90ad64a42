"""In-process link emulation: a token bucket whose rate follows a bandwidth trace.

The client's readers call :meth:`LinkShaper.take` (blocking) or :meth:`LinkShaper.atake` (asyncio)
with the size of every piece they read from a socket *before* using it; the call returns when the
emulated link would have delivered those bytes. Because the reader stops reading, TCP flow control
throttles the sender too, so the whole path behaves like a link of the trace's rate.

Model (the same as the simulator's link, :mod:`sparkv.scheduler.simulator`):

* the link delivers bytes at ``trace.rate_Bps(t)``, ``t`` seconds after :meth:`LinkShaper.start`;
* a virtual clock ``v`` marks when the bytes taken so far have been delivered; a piece of ``n``
  bytes is delivered at ``trace.transfer_end(max(v, now - burst_s), n)``: a link idle for a while
  may deliver up to ``burst_s`` worth of rate at once (the bucket's depth), never more;
* every request pays one round trip before its first byte: :meth:`request_started` returns the
  earliest time a response byte may be taken (``now + rtt``), which readers pass as ``not_before``;
* a new connection pays one round trip more before its first request (TCP's handshake): the HTTP
  chunk source adds what is left of it when the request is sent (all of it on a connection opened
  for the request, none on one opened ahead a round trip before:
  :class:`~sparkv.edge.wire.Preconnect`). TLS's handshake is not emulated; the simulator's link
  has no handshake.

The shaper is shared by all readers of one client (thread-safe): concurrent responses share the
link's rate, as on a real link. ``LinkShaper.unlimited()`` shapes nothing (a real shaped path, or
loopback, does the work).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from sparkv.scheduler.trace import Trace


@dataclass
class LinkShaper:
    """Token-bucket emulation of a link following ``trace`` (``None``: unlimited).

    Attributes:
        trace: bandwidth (and optional RTT) over time; loops when the trace says so.
        rtt_s: round trip added before each response's first byte when the trace has no RTT column.
        burst_s: bucket depth in seconds of the current rate.
        clock: the time source (seconds, monotonic); tests may replace it.
    """

    trace: Trace | None = None
    rtt_s: float = 0.0
    burst_s: float = 0.005
    clock: Callable[[], float] = time.perf_counter
    _t0: float | None = field(default=None, init=False, repr=False)
    _virtual: float = field(default=0.0, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    bytes_taken: int = field(default=0, init=False)
    waited_s: float = field(default=0.0, init=False)

    @classmethod
    def unlimited(cls) -> "LinkShaper":
        return cls(None)

    @classmethod
    def constant(cls, mbps: float, rtt_ms: float = 0.0) -> "LinkShaper":
        return cls(Trace.constant(mbps), rtt_s=rtt_ms / 1e3)

    @property
    def active(self) -> bool:
        return self.trace is not None

    def _now(self) -> float:
        return float(self.clock())

    def start(self) -> None:
        """Trace time 0 is now (called once when a request begins; later calls are no-ops)."""
        with self._lock:
            if self._t0 is None:
                self._t0 = self._now()
                self._virtual = 0.0

    def elapsed(self) -> float:
        """Seconds of trace time since :meth:`start` (starts the clock if needed)."""
        self.start()
        assert self._t0 is not None
        return self._now() - self._t0

    def rtt(self) -> float:
        if self.trace is None:
            return 0.0
        return self.trace.rtt_s(self.elapsed(), self.rtt_s)

    def request_started(self) -> float:
        """A request was sent now: the clock time (``clock()``) before which no response byte of it
        may be taken (one RTT later)."""
        return self._now() + self.rtt()

    def rate_Bps(self) -> float:  # noqa: N802
        """The link's rate now (``inf`` when unlimited)."""
        if self.trace is None:
            return math.inf
        return self.trace.rate_Bps(self.elapsed())

    def _reserve(self, nbytes: int, not_before: float | None) -> tuple[float, float]:
        """Books ``nbytes`` on the link; returns the clock times their first byte crosses it
        (never before now: the bytes are here now) and they are all delivered."""
        now = self._now()
        if self.trace is None:
            due = max(now, not_before or 0.0)
            return due, due
        self.start()
        assert self._t0 is not None
        with self._lock:
            t_now = now - self._t0
            begin = max(self._virtual, t_now - self.burst_s)
            if not_before is not None:
                begin = max(begin, not_before - self._t0)
            end = self.trace.transfer_end(begin, float(nbytes)) if nbytes > 0 else begin
            self._virtual = end
            self.bytes_taken += nbytes
        return max(now, begin + self._t0), end + self._t0

    def take(self, nbytes: int, not_before: float | None = None) -> float:
        """Blocks until ``nbytes`` more bytes have crossed the emulated link; returns the clock
        time (``clock()``) their first byte crossed it: a response's first piece is read whole
        (up to 64 KiB), and the time it is in by counts its transfer, not just the round trip
        (session 80: 50-78 ms for a manifest at 10 Mbit/s over 20 ms of emulated RTT)."""
        first, due = self._reserve(nbytes, not_before)
        self._sleep_until(due)
        return first

    def _sleep_until(self, due: float) -> None:
        wait = due - self._now()
        if wait > 0:
            time.sleep(wait)
            with self._lock:
                self.waited_s += wait

    async def atake(self, nbytes: int, not_before: float | None = None) -> float:
        """:meth:`take` for asyncio readers."""
        first, due = self._reserve(nbytes, not_before)
        wait = due - self._now()
        if wait > 0:
            await asyncio.sleep(wait)
            with self._lock:
                self.waited_s += wait
        return first
