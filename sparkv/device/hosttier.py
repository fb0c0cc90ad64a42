"""The host-RAM tier: copies of flash records kept in host memory, between the device's KV memory
and flash (issue 46, Deliver 4).

With the model on a GPU, a context's pages live in GPU memory (the service's budget); what does
not fit goes to flash as token chunk records (:mod:`sparkv.device.flashio`). Host RAM is the tier
between: every record the service writes (write-through) or reads back from flash (read-through)
is also kept here, up to ``capacity`` bytes, least recently used first out. A switch-in then
reads the records it holds from RAM (one copy to the device) instead of flash; the planner
counts them as free reads (:func:`sparkv.device.chunked.missing_chunks`), and the loader reads
only the others from flash (:class:`sparkv.device.loader.FileReads`).

Flash stays the record of truth: a record is on flash before (or as) it is held here, so dropping
it from RAM loses nothing, and nothing is written back. A held copy is exactly its flash record's
bytes (checked like one when read: checksum, header, geometry). It is dropped when its record
dies (:meth:`ServiceFlash.delete`, a segment pruned, a context removed) and replaced when a chunk
file is written again, so a copy is never staler than its file.

On the CPU the device's memory is host RAM already, so the service keeps no host tier unless
asked (``--host-tier-mb``); flash reads stay honest (``O_DIRECT``) whatever this tier holds.

Locks: one lock guards the map and the counters: the loader's reader threads read and fill it
while the service's thread writes and kills records.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any, Sequence

#: a held record: its file and offset
Key = tuple[str, int]


def tier_holds(tier: Any, ref: Any) -> bool:
    """Whether flash tier ``tier`` (a :class:`~sparkv.device.flashio.ServiceFlash` with a host
    tier; any other tier has none) has a host copy of record ``ref`` now."""
    host = getattr(tier, "host", None)
    return host is not None and ref is not None and host.holds(ref.path, ref.offset, ref.nbytes)


@dataclass
class HostTierStats:
    """What the tier holds and did (bytes, records; hits and misses of :meth:`HostTier.get`)."""

    capacity_bytes: int = 0
    bytes: int = 0
    records: int = 0
    peak_bytes: int = 0
    hits: int = 0
    hit_bytes: int = 0
    misses: int = 0
    puts: int = 0
    evictions: int = 0
    dropped: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class HostTier:
    """Copies of flash records in host RAM, at most ``capacity`` bytes (module docstring)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("the host tier's capacity is a number of bytes >= 0")
        self.capacity = int(capacity)
        self._held: OrderedDict[Key, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self._stats = HostTierStats(capacity_bytes=self.capacity)

    def put(self, path: str, offset: int, data: bytes) -> bool:
        """Holds ``data`` as the record at ``(path, offset)`` (replacing a copy held there), the
        least recently used out first; ``False`` when it is larger than the whole tier."""
        n = len(data)
        with self._lock:
            self._remove((path, offset))
            if n > self.capacity:
                return False
            st = self._stats
            while st.bytes + n > self.capacity:
                _, old = self._held.popitem(last=False)
                st.bytes -= len(old)
                st.evictions += 1
            self._held[(path, offset)] = bytes(data)
            st.bytes += n
            st.records = len(self._held)
            st.peak_bytes = max(st.peak_bytes, st.bytes)
            st.puts += 1
            return True

    def get(self, path: str, offset: int, nbytes: int) -> bytes | None:
        """The record held at ``(path, offset)`` when it has ``nbytes`` bytes (now the most
        recently used), else ``None`` (a miss)."""
        found = self.get_run([(path, offset, nbytes)])
        return None if found is None else found[0]

    def get_run(self, keys: Sequence[tuple[str, int, int]]) -> list[bytes] | None:
        """The records ``(path, offset, nbytes)`` of one run, all of them (each now among the
        most recently used, a hit each), or ``None`` when one is not held (a miss each: the run
        is read from flash; the held ones are neither used nor counted as hits)."""
        with self._lock:
            found = [self._held.get((path, offset)) for path, offset, _ in keys]
            if any(d is None or len(d) != n for d, (_, _, n) in zip(found, keys)):
                self._stats.misses += len(keys)
                return None
            for path, offset, nbytes in keys:
                self._held.move_to_end((path, offset))
                self._stats.hit_bytes += nbytes
            self._stats.hits += len(keys)
            return found  # type: ignore[return-value]  # none is None here

    def holds(self, path: str, offset: int, nbytes: int) -> bool:
        """Whether :meth:`get` would find the record now (no counting, no reordering)."""
        with self._lock:
            data = self._held.get((path, offset))
            return data is not None and len(data) == nbytes

    def drop(self, path: str, offset: int | None = None) -> int:
        """Drops the copy of the record at ``offset`` of ``path`` (every record of the file
        when ``offset`` is ``None``); returns how many were held."""
        with self._lock:
            if offset is not None:
                return int(self._remove((path, offset)))
            return sum(self._remove(k) for k in [k for k in self._held if k[0] == path])

    def drop_under(self, root: str | os.PathLike[str]) -> int:
        """Drops every copy of a file under directory ``root`` (a context removed)."""
        prefix = os.path.join(os.fspath(root), "")
        with self._lock:
            return sum(self._remove(k) for k in [k for k in self._held
                                                 if k[0].startswith(prefix)])

    def stats(self) -> HostTierStats:
        with self._lock:
            return HostTierStats(**asdict(self._stats))

    def _remove(self, key: Key) -> bool:
        data = self._held.pop(key, None)
        if data is None:
            return False
        self._stats.bytes -= len(data)
        self._stats.records = len(self._held)
        self._stats.dropped += 1
        return True


def default_capacity(device_type: str, budget_bytes: int,
                     meminfo: str | os.PathLike[str] = "/proc/meminfo") -> int:
    """The host tier's size when none is asked: none on the CPU (the device's memory is host RAM
    already); on a GPU four times the service's budget, at most a quarter of the memory
    available now (``MemAvailable``)."""
    if device_type == "cpu":
        return 0
    avail = None
    try:
        with open(meminfo, encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        avail = None
    want = 4 * int(budget_bytes)
    return want if avail is None else min(want, avail // 4)
