"""The cluster cache: flushed cluster entries kept in RAM under a byte budget.

Two replacement policies over the same store:

* ``dynakv`` - **size- and frequency-aware GreedyDual** (GDSF) with a **reserved space for
  updated clusters**. Every cached cluster has a priority ``H = L + sqrt(f) * cost(size) / size``
  with ``cost = op_cost + size * byte_cost`` (the flash cost model: a read operation costs about
  as much as 145 KB of bandwidth here) and ``f`` the times it was retrieved (remembered after an
  eviction, so a cluster that keeps coming back is kept longer), reset on every hit; the lowest
  ``H`` is evicted and ``L`` rises to it. A small cluster saves a whole read operation for few
  bytes, so it stays longer (principle 1 of the paper); a cluster touched recently has a higher
  ``H`` (recency). Unlike LRU it does not thrash when a step's clusters over all layers exceed
  the cache (LRU then evicts each cluster just before its next use). A cluster just updated (a new entry
  joined it, or it was just made by a split) is **reserved**: it is never evicted while reserved;
  the reserved space is ``reserve_frac`` of the capacity, and when a newer update needs room the
  oldest reservation ends (the cluster stays cached, as an ordinary one). That is principle 2:
  updated clusters are retrieved again soon.
* ``lru`` - least recently used, nothing reserved, sizes ignored.

Keys are ``(layer, uid)``; values ``(k, v, pos)`` of a cluster's flushed entries. The cache is
shared by the decoding thread and the upkeep thread (:mod:`sparkv.decode.upkeep`): every method
that reads or changes more than one field holds the cache's lock.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import threading
from collections import OrderedDict
from typing import Any, Callable, Hashable

import numpy as np

from sparkv.decode.rows import Rows


def data_bytes(data: Any) -> int:
    if isinstance(data, Rows):                     # n rows of k, v and an int64 position
        return data.n * data.arena.row_bytes
    k, v, pos = data
    return (k.numel() * k.element_size() + v.numel() * v.element_size()
            + int(np.asarray(pos).nbytes))


def _locked(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def run(self: "ClusterCache", *args: Any, **kw: Any) -> Any:
        with self.lock:
            return method(self, *args, **kw)
    return run


class ClusterCache:
    """Clusters in RAM (module docstring). ``capacity`` in bytes (None: unbounded)."""

    def __init__(self, capacity: int | None, policy: str = "dynakv", *,
                 op_cost_s: float = 80e-6, byte_cost_s: float = 0.55e-9,
                 reserve_frac: float = 0.05) -> None:
        if policy not in ("dynakv", "lru"):
            raise ValueError(f"unknown replacement policy {policy!r}")
        self.capacity = capacity
        self.policy = policy
        self.op_cost, self.byte_cost = op_cost_s, byte_cost_s
        self.reserve_cap = None if capacity is None else int(reserve_frac * capacity)
        self.items: dict[Hashable, tuple[Any, int]] = {}
        self.bytes = 0
        self.peak_bytes = 0
        # lru
        self._order: OrderedDict[Hashable, None] = OrderedDict()
        # greedy-dual
        self._h: dict[Hashable, float] = {}
        self._heap: list[tuple[float, int, Hashable]] = []
        self._seq = itertools.count()
        self.L = 0.0
        self.freq: dict[Hashable, int] = {}     # retrievals per key (kept after eviction)
        self.ever: set[Hashable] = set()         # keys cached at some time (first uses: stats)
        # reservations (dynakv): key -> order of reservation
        self.reserved: OrderedDict[Hashable, None] = OrderedDict()
        self.reserved_bytes = 0
        self.evictions = 0
        self.evicted_reserved = 0            # must stay 0 (tested)
        self.rejected = 0
        self.lock = threading.RLock()

    # ---- queries ---------------------------------------------------------------------------------
    def __contains__(self, key: Hashable) -> bool:
        return key in self.items

    def __len__(self) -> int:
        return len(self.items)

    def peek(self, key: Hashable) -> Any:
        item = self.items.get(key)
        return None if item is None else item[0]

    @_locked
    def get(self, key: Hashable) -> Any:
        """The cached value (a hit refreshes its priority), or None."""
        item = self.items.get(key)
        if item is None:
            return None
        self.freq[key] = self.freq.get(key, 1) + 1
        self._touch(key, item[1])
        return item[0]

    @_locked
    def get_sized(self, key: Hashable) -> tuple[Any, int] | None:
        """:meth:`get`, with the value's size: ``(value, nbytes)`` or None."""
        item = self.items.get(key)
        if item is None:
            return None
        self.freq[key] = self.freq.get(key, 1) + 1
        self._touch(key, item[1])
        return item

    def is_reserved(self, key: Hashable) -> bool:
        return key in self.reserved

    # ---- priority --------------------------------------------------------------------------------
    def _touch(self, key: Hashable, nbytes: int) -> None:
        if self.policy == "lru":
            self._order[key] = None
            self._order.move_to_end(key)
            return
        f = math.sqrt(self.freq.get(key, 1))
        h = self.L + f * (self.op_cost + nbytes * self.byte_cost) / max(1, nbytes)
        self._h[key] = h
        heapq.heappush(self._heap, (h, next(self._seq), key))
        if len(self._heap) > 4 * len(self._h) + 64:      # drop stale entries
            self._heap = [(hh, next(self._seq), kk) for kk, hh in self._h.items()]
            heapq.heapify(self._heap)

    # ---- changes ---------------------------------------------------------------------------------
    @_locked
    def put(self, key: Hashable, value: Any, nbytes: int | None = None) -> bool:
        """Caches ``value`` (replacing an older one), evicting as needed. Returns whether it is
        cached (a value that cannot fit beside the reserved ones is not)."""
        nbytes = data_bytes(value) if nbytes is None else nbytes
        if key in self.items:
            self._drop(key)
        if self.capacity is not None:
            if nbytes > self.capacity - self.reserved_bytes:
                self.rejected += 1
                return False
            self._make_room(nbytes)
        self.items[key] = (value, nbytes)
        self.ever.add(key)
        self.bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        if key in self.reserved:
            self.reserved_bytes += nbytes
        self._touch(key, nbytes)
        return True

    @_locked
    def update(self, key: Hashable, value: Any) -> None:
        """Replaces a cached value in place (its cluster changed); no-op if not cached."""
        if key not in self.items:
            return
        reserved = key in self.reserved
        self.put(key, value)
        if reserved and key not in self.items:
            self.reserved.pop(key, None)

    @_locked
    def remove(self, key: Hashable) -> None:
        """Forgets ``key`` (its cluster is gone or changed identity)."""
        if key in self.items:
            self._drop(key)
        self.reserved.pop(key, None)
        self.freq.pop(key, None)

    @_locked
    def reserve(self, key: Hashable) -> None:
        """Marks a cached cluster as just updated (dynakv only): never evicted while reserved."""
        if self.policy != "dynakv" or key not in self.items:
            return
        if key in self.reserved:
            self.reserved.move_to_end(key)
            return
        nbytes = self.items[key][1]
        self.reserved[key] = None
        self.reserved_bytes += nbytes
        while self.reserve_cap is not None and self.reserved_bytes > self.reserve_cap \
                and len(self.reserved) > 1:
            old = next(iter(self.reserved))
            if old == key:
                break
            self._unreserve(old)

    def _unreserve(self, key: Hashable) -> None:
        if key in self.reserved:
            self.reserved.pop(key)
            if key in self.items:
                self.reserved_bytes -= self.items[key][1]

    def _drop(self, key: Hashable) -> None:
        _, nbytes = self.items.pop(key)
        self.bytes -= nbytes
        if key in self.reserved:
            self.reserved_bytes -= nbytes
        self._order.pop(key, None)
        self._h.pop(key, None)

    def _make_room(self, nbytes: int) -> None:
        assert self.capacity is not None
        aside: list[tuple[float, int, Hashable]] = []
        while self.bytes + nbytes > self.capacity:
            victim = self._victim(aside)
            if victim is None:
                break
            if victim in self.reserved:         # never: reserved keys are skipped
                self.evicted_reserved += 1
            self._drop(victim)
            self.evictions += 1
        for entry in aside:
            heapq.heappush(self._heap, entry)

    def _victim(self, aside: list[tuple[float, int, Hashable]]) -> Hashable | None:
        if self.policy == "lru":
            for key in self._order:
                if key not in self.reserved:
                    return key
            return None
        while self._heap:
            h, seq, key = heapq.heappop(self._heap)
            if key not in self.items or self._h.get(key) != h:
                continue                         # stale heap entry
            if key in self.reserved:
                aside.append((h, seq, key))
                continue
            self.L = h
            return key
        return None

    @_locked
    def stats(self) -> dict[str, float]:
        return {"bytes": self.bytes, "peak_bytes": self.peak_bytes, "items": len(self.items),
                "evictions": self.evictions, "evicted_reserved": self.evicted_reserved,
                "reserved_bytes": self.reserved_bytes, "rejected": self.rejected}
