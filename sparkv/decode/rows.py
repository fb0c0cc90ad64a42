"""The RAM side of a clustered policy's entries: :class:`RowArena` and :class:`Rows`.

Every cluster entry a clustered policy holds in RAM (the cluster cache, the prefetch staging, a
step's reads) lives in one **row arena**: three arrays, ``k, v [capacity, D]`` in the model's
dtype and ``pos [capacity]`` (int64), shared by every layer. A cluster's flushed entries are one
**run of consecutive rows** (its pages, as read from flash, cut to its live slots), so one
attention call per layer reads every selected cluster where it lies
(:func:`sparkv.decode.fused.fused_attention`), given only ``(head, first row, rows)`` per
cluster: no per-cluster tensor is concatenated or padded on the critical path.

**Allocation.** A run takes ``ceil(n / ROW_QUANTUM)`` quanta of rows: a free list per run size
(the exact size is reused first; a cluster's sizes repeat), else the top of the arena; the arena
doubles when full (the rows held are copied once; a run never moves otherwise). The arena's
account is the rows it holds (``held_rows``), rounded to the quantum.

**Ownership.** A :class:`Rows` is the handle of one run: it reads as the ``(k, v, pos)`` triple
the policy passes around (``k, v, pos = rows``; ``rows[0]``), as views of the arena, and returns
its run when the last reference to it goes (``__del__``). A run is written once, when it is
made, and never changes: a cluster that changes gets a new run. Views taken from a
:class:`Rows` must not outlive it (every consumer copies: ``torch.cat``, an index).
"""

from __future__ import annotations

import threading
from typing import Any, Iterator

import numpy as np
import torch

#: rows per allocation quantum (a run's rows are rounded up to it)
ROW_QUANTUM = 4


class RowArena:
    """Rows of K, V and positions in a few growing arrays (module docstring).

    Args:
        head_dim: D.
        dtype: the rows' dtype (the model's KV dtype).
        capacity: rows to start with (grows by doubling).
    """

    def __init__(self, head_dim: int, dtype: torch.dtype, capacity: int = 4096) -> None:
        self.d, self.dtype = int(head_dim), dtype
        cap = max(ROW_QUANTUM, -(-int(capacity) // ROW_QUANTUM) * ROW_QUANTUM)
        with torch.inference_mode(False):
            self.k = torch.zeros(cap, self.d, dtype=dtype)
            self.v = torch.zeros(cap, self.d, dtype=dtype)
        self.pos = np.zeros(cap, np.int64)
        self.top = 0
        self.held_rows = 0
        self.peak_rows = 0
        self.generation = 0
        self._free: dict[int, list[int]] = {}
        # re-entrant: a Rows may be collected (and release its run) inside an allocation
        self._lock = threading.RLock()

    @property
    def capacity(self) -> int:
        return int(self.k.shape[0])

    @property
    def row_bytes(self) -> int:
        return 2 * self.d * self.k.element_size() + 8

    @property
    def held_bytes(self) -> int:
        return self.held_rows * self.row_bytes

    def _alloc(self, size: int) -> int:
        """The first row of a run of ``size`` rows (a multiple of the quantum)."""
        free = self._free.get(size)
        if free:
            start = free.pop()
        else:
            if self.top + size > self.capacity:
                self._grow(self.top + size)
            start = self.top
            self.top += size
        self.held_rows += size
        self.peak_rows = max(self.peak_rows, self.held_rows)
        return start

    def _grow(self, need: int) -> None:
        cap = self.capacity
        while cap < need:
            cap *= 2
        with torch.inference_mode(False):
            k = torch.zeros(cap, self.d, dtype=self.dtype)
            v = torch.zeros(cap, self.d, dtype=self.dtype)
        k[:self.top] = self.k[:self.top]
        v[:self.top] = self.v[:self.top]
        pos = np.zeros(cap, np.int64)
        pos[:self.top] = self.pos[:self.top]
        self.k, self.v, self.pos = k, v, pos
        self.generation += 1

    def release(self, start: int, size: int) -> None:
        with self._lock:
            self._free.setdefault(size, []).append(start)
            self.held_rows -= size

    def put(self, k: torch.Tensor, v: torch.Tensor, pos: Any) -> "Rows":
        """A new run holding these entries (``k, v [n, D]``, ``pos [n]``), copied in."""
        n = int(k.shape[0])
        size = max(ROW_QUANTUM, -(-n // ROW_QUANTUM) * ROW_QUANTUM)
        with self._lock:
            start = self._alloc(size)
            if n:
                self.k[start:start + n] = k
                self.v[start:start + n] = v
                self.pos[start:start + n] = np.asarray(pos, dtype=np.int64)
        return Rows(self, start, n, size)

    def put_records(self, recs: torch.Tensor, index: torch.Tensor, pos: np.ndarray) -> "Rows":
        """A new run from records ``recs [m, 2D]`` (``k | v``, as read from flash) at ``index``."""
        n = int(index.shape[0])
        size = max(ROW_QUANTUM, -(-n // ROW_QUANTUM) * ROW_QUANTUM)
        d = self.d
        with self._lock:
            start = self._alloc(size)
            if n:
                sel = recs.index_select(0, index)
                self.k[start:start + n] = sel[:, :d]
                self.v[start:start + n] = sel[:, d:]
                self.pos[start:start + n] = pos
        return Rows(self, start, n, size)


class Rows:
    """One run of a :class:`RowArena`: reads as ``(k [n, D], v [n, D], pos [n])`` (views of the
    arena; module docstring) and returns its rows when collected."""

    __slots__ = ("arena", "start", "n", "size", "__weakref__")

    def __init__(self, arena: RowArena, start: int, n: int, size: int) -> None:
        self.arena, self.start, self.n, self.size = arena, start, n, size

    def __len__(self) -> int:
        return 3

    def __getitem__(self, i: int) -> Any:
        a, s, n = self.arena, self.start, self.n
        if i == 0 or i == -3:
            return a.k[s:s + n]
        if i == 1 or i == -2:
            return a.v[s:s + n]
        if i == 2 or i == -1:
            return a.pos[s:s + n]
        raise IndexError(i)

    def __iter__(self) -> Iterator[Any]:
        return iter((self[0], self[1], self[2]))

    def __del__(self) -> None:
        try:
            self.arena.release(self.start, self.size)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
