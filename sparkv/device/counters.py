"""What the context service counts since it started (``GET /v1/stats``): one dataclass whose
fields only its own methods change.

Each method is one event of the service (a call returned, a load, an eviction, a kept working
memory used or freed, an ahead-of-time write) and adds what that event did; nothing else writes
a field, so every count has one place that increments it.

State: the counts. Lock: ``_lock`` guards every increment and :meth:`ServiceCounters.snapshot`
(a reclaim under the registry's lock and a call under the run lock may count at once).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sparkv.device.loader import LoadStats


@dataclass
class ServiceCounters:
    """The service's counts since it started (module docstring)."""

    calls: int = 0
    evicted_chunks: int = 0          # token chunks (whole contexts for the whole-context keepers)
    evicted_bytes: int = 0
    reclaim_written_bytes: int = 0   # written to flash to make room
    aot_written_bytes: int = 0       # written ahead of time, after each call
    read_bytes: int = 0              # read from flash by loads
    recomputed_chunks: int = 0
    read_chunks: int = 0
    host_chunks: int = 0             # of the chunks read back, those the host tier answered
    host_bytes: int = 0
    faults: int = 0                  # token chunks whose flash copy failed (then recomputed)
    hot_hits: int = 0                # calls that found their working memory kept
    hot_dropped: int = 0             # kept working memories freed
    streamed_chunks: int = 0         # token chunks restored from the server
    turn_waits: int = 0              # reservations that waited for a call's turn to end
    joined_reads: int = 0            # calls that read the working memory another switched in
    read_handoffs: int = 0           # openers that returned before their joiners
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def called(self) -> None:
        """A call returned."""
        with self._lock:
            self.calls += 1

    def loaded(self, stats: "LoadStats") -> None:
        """A load (or a whole context brought back) did ``stats``."""
        with self._lock:
            self.read_bytes += stats.bytes_read
            self.read_chunks += stats.read_chunks
            self.host_chunks += stats.host_chunks
            self.host_bytes += stats.host_bytes
            self.recomputed_chunks += stats.recomputed_chunks
            self.faults += stats.faults
            self.streamed_chunks += stats.streamed_chunks

    def brought_back(self, stats: "LoadStats") -> None:
        """A whole context was brought back (read whole, or recomputed): its bytes read and
        chunks recomputed (the whole-context keepers count no chunk reads)."""
        with self._lock:
            self.read_bytes += stats.bytes_read
            self.recomputed_chunks += stats.recomputed_chunks

    def evicted(self, chunks: int, freed: int, written: int) -> None:
        """A reclaim freed ``freed`` bytes of ``chunks`` token chunks (or one whole context),
        writing ``written`` bytes first."""
        with self._lock:
            self.evicted_chunks += chunks
            self.evicted_bytes += freed
            self.reclaim_written_bytes += written

    def hot_hit(self) -> None:
        """A call found its context's working memory kept."""
        with self._lock:
            self.hot_hits += 1

    def hot_freed(self) -> None:
        """A kept working memory was freed."""
        with self._lock:
            self.hot_dropped += 1

    def waited_for_turn(self) -> None:
        """A reservation found its memory held by calls in their turn and waited for one."""
        with self._lock:
            self.turn_waits += 1

    def joined_read(self) -> None:
        """A call joined the read turn another call on its context opened
        (:mod:`~sparkv.device.readturns`)."""
        with self._lock:
            self.joined_reads += 1

    def handed_off(self) -> None:
        """A read turn's opener returned while joiners still read; the turn's end was left to
        a thread of the service (:mod:`~sparkv.device.readturns`)."""
        with self._lock:
            self.read_handoffs += 1

    def wrote_ahead(self, nbytes: int) -> None:
        """A call's ahead-of-time swap-out wrote ``nbytes``."""
        with self._lock:
            self.aot_written_bytes += nbytes

    def snapshot(self) -> "ServiceCounters":
        """A copy of the counts now (a call's costs are the difference of two)."""
        with self._lock:
            return replace(self, _lock=threading.Lock())

    def since(self, before: "ServiceCounters") -> "ServiceCounters":
        """What was counted since ``before`` (a :meth:`snapshot`): the difference of each
        count."""
        now = self.snapshot()
        return ServiceCounters(**{f.name: getattr(now, f.name) - getattr(before, f.name)
                                  for f in fields(self) if f.name != "_lock"})

    def to_dict(self) -> dict[str, int]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "_lock"}

