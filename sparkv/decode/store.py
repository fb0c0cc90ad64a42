"""The flash side of a clustered KV policy: page files with honest I/O and the cluster layout.

**Pages.** Each layer has one file of 4 KiB pages (:class:`PageFile`). A page holds the entries
of one unit (a cluster, or for ``nocluster`` a run of consecutive positions of one head), each
entry a record ``k | v`` in the model's dtype (512 bytes for SmolLM2: 8 per page). Reads and writes
are whole pages through the flash backend (:mod:`sparkv.fileio`): ``O_DIRECT`` (aligned
buffers, the file system's alignment read at run time; the page cache never answers) or, where the
file system refuses it, through the page cache with ``fdatasync`` and ``posix_fadvise(DONTNEED)``
(writes too where the alignment does not divide a page; reads then take the aligned span). Every
written page's XXH64 is kept in RAM and checked on read. **A page is written at most once** (a
second write raises): nothing on flash is ever rewritten in place.

**Dual-head pools** (:class:`ClusterStore`, ``dual_head=True``)::

    layer file:  | pool 0                            | pool 1                            | ...
                 | A0 A1 A2 -->    (free)    <-- B1 B0 | C0 C1 -->    (free)      <-- D0 |
                   cluster A grows right     cluster B grows left

    prefill: clusters in co-retrieval order c0 c1 c2 c3 ... -> pools (c0|c1) (c2|c3) ...
             so c1 and c2 are physically adjacent and c0, c1 share a pool
    split:   the half with more flushed entries stays at its head (its moved-out entries become
             dead slots); the other half is written to a migrant pool (paired with the next
             migrant of the same head)
    full:    a cluster meeting its partner continues in a migrant pool (two runs until compacted)

A cluster's newest entries wait in a per-cluster **page-aligned write buffer** (its tail, in RAM)
until a whole page can be written; the tails of a layer are capped (``write_buffer`` entries per
head). Past the cap, with ``pack_tails`` (dual-head layout), the oldest entries of the fullest
tails are packed into one **full shared tail page** (several clusters' entries in one page,
written once, never rewritten: each cluster's addresses point into it and the other clusters'
slots are dead slots to its reads), so decoding writes no padding. Without it, the fullest tail
(least padding; ties: the least recently appended) is written as a padded page at its own head,
which is where write amplification came from.

``dual_head=False`` packs clusters back to back with no room to grow: a cluster that needs a page
is relocated whole (its live entries and the new page rewritten at the end of the file; read first
if not in RAM) - the "strictly contiguous layout" the dual-head layout avoids.

The pages themselves (pools, heads, extents) are handed out by
:class:`~sparkv.decode.units.PageLayout`; :class:`ClusterStore` writes and reads them.

**Accounting** (:class:`IOStats`): read operations, bytes (including dead slots and padding of
the pages read) and the live entries they carried, by reason; pages written (physical bytes) and
the logical bytes the policy asked to write (new entries, split migrations): write amplification
is their ratio.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections import defaultdict
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from sparkv.decode.rows import RowArena, Rows
from sparkv.decode.units import PageLayout, Unit
from sparkv.fileio import FlashError, FlashIO, checksum, verify
from sparkv.fileio import delete as delete_file

#: the layout's page (bytes): the unit of a unit's records, of the write-once rule and of the
#: checksums, 4 KiB as the paper's flash page. A format constant, not the OS page nor the
#: ``O_DIRECT`` alignment, which the backend reads at run time.
PAGE = 4096

READ_REASONS = ("retrieve", "prefetch", "split", "overflow", "relocate")


class IOStats:
    """Flash counters shared by the page files of one policy (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.read_ops: dict[str, int] = defaultdict(int)
        self.read_bytes: dict[str, int] = defaultdict(int)
        self.read_entries: dict[str, int] = defaultdict(int)
        self.read_s: dict[str, float] = defaultdict(float)
        self.read_calls: dict[str, int] = defaultdict(int)     # requests (one per fetch)
        self.write_ops: dict[str, int] = defaultdict(int)
        self.write_bytes: dict[str, int] = defaultdict(int)     # physical (whole pages)
        self.logical_bytes: dict[str, int] = defaultdict(int)   # what the policy asked to write
        self.write_s = 0.0

    def count_read(self, reason: str, ops: int, nbytes: int, entries: int, seconds: float) -> None:
        with self._lock:
            self.read_calls[reason] += 1
            self.read_ops[reason] += ops
            self.read_bytes[reason] += nbytes
            self.read_entries[reason] += entries
            self.read_s[reason] += seconds

    def count_write(self, reason: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.write_ops[reason] += 1
            self.write_bytes[reason] += nbytes
            self.write_s += seconds

    def count_logical(self, reason: str, nbytes: int) -> None:
        with self._lock:
            self.logical_bytes[reason] += nbytes

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"read_calls": dict(self.read_calls), "read_ops": dict(self.read_ops), "read_bytes": dict(self.read_bytes),
                    "read_entries": dict(self.read_entries), "read_s": dict(self.read_s),
                    "write_ops": dict(self.write_ops), "write_bytes": dict(self.write_bytes),
                    "logical_bytes": dict(self.logical_bytes), "write_s": self.write_s}


class PageFile:
    """A file of :data:`PAGE`-byte pages, each written at most once, read past the page cache
    (the flash backend's :class:`~sparkv.fileio.FlashFile`) and checked against the XXH64
    recorded when it was written.

    Args:
        path: the file (created, or truncated).
        io: the policy's counters.
        direct: try ``O_DIRECT`` (writes go through the page cache, ``fdatasync``-ed and
            dropped, where the alignment does not divide :data:`PAGE`).
        executor: the I/O thread writes run on (None: on the caller's thread).
        align: the ``O_DIRECT`` alignment in bytes; ``None`` reads the file system's.

    State and locks: ``hashes`` (page -> XXH64) and ``pages_written`` are updated under
    ``_wlock`` by the writing thread; ``_pending`` (page -> the future of its write on
    ``executor``) under ``_plock``; ``_errors`` collects failed writes (appended by their done
    callbacks, raised by :meth:`flush`). A read first waits for the pending writes of its pages,
    so it never sees a page half written. The file's descriptors are fixed until :meth:`close`.
    """

    def __init__(self, path: str | os.PathLike[str], io: IOStats, direct: bool = True,
                 executor: Executor | None = None, align: int | None = None) -> None:
        self.path = Path(path)
        self.io = io
        self.flash = FlashIO(self.path.parent, direct, align).open(self.path, create=True)
        self.hashes: dict[int, int] = {}          # page -> xxh64 of what was written
        self.pages_written = 0
        self._wlock = threading.Lock()
        #: writes run on ``executor`` (the policy's I/O thread) when given: a read first waits for
        #: the pending writes of its pages
        self.executor = executor
        self._pending: dict[int, Future] = {}
        self._plock = threading.Lock()
        self._errors: list[BaseException] = []

    @property
    def direct(self) -> bool:
        """Whether pages go to flash with ``O_DIRECT`` (False once the file system refused it)."""
        return self.flash.io.direct

    def write(self, first: int, data: bytes | bytearray | memoryview, reason: str) -> None:
        """Writes whole pages ``first ..`` (``len(data)`` a multiple of the page); on the I/O
        thread when there is one."""
        n = len(data)
        if n % PAGE or n == 0:
            raise FlashError(f"page writes must be whole pages, got {n} bytes")
        pages = n // PAGE
        with self._wlock:
            for p in range(first, first + pages):
                if p in self.hashes:
                    raise FlashError(f"{self.path.name}: page {p} was already written; pages are "
                                     "never rewritten")
            view = memoryview(data)
            for i in range(pages):
                self.hashes[first + i] = checksum(view[i * PAGE:(i + 1) * PAGE])
            self.pages_written += pages
        if self.executor is None:
            self._pwrite(first, data, reason)
            return
        fut = self.executor.submit(self._pwrite, first, bytes(data), reason)
        span = range(first, first + pages)
        with self._plock:
            for p in span:
                self._pending[p] = fut
        fut.add_done_callback(functools.partial(self._done, span))

    def _done(self, span: range, fut: Future) -> None:
        with self._plock:
            for p in span:
                if self._pending.get(p) is fut:
                    del self._pending[p]
        exc = fut.exception()
        if exc is not None:
            self._errors.append(exc)

    def _wait(self, first: int, pages: int) -> None:
        with self._plock:
            futs = {self._pending[p] for p in range(first, first + pages) if p in self._pending}
        for f in futs:
            f.result()

    def flush(self) -> None:
        """Waits for every pending write (raises the first error)."""
        with self._plock:
            futs = set(self._pending.values())
        for f in futs:
            f.result()
        if self._errors:
            raise self._errors[0]

    def _pwrite(self, first: int, data: bytes | bytearray | memoryview, reason: str) -> None:
        t0 = time.perf_counter()
        try:
            self.flash.pwrite(first * PAGE, data)
        except OSError as e:
            raise FlashError(f"cannot write {self.path}: {e}") from e
        self.io.count_write(reason, len(data), time.perf_counter() - t0)

    def read(self, first: int, pages: int) -> bytes:
        """Pages ``first .. first+pages`` (pages never written read as zeros, unchecked); a page
        that differs from what was written raises :class:`~sparkv.fileio.ChecksumError`."""
        self._wait(first, pages)
        n = pages * PAGE
        try:
            data = self.flash.pread(first * PAGE, n)
        except OSError as e:
            raise FlashError(f"cannot read {self.path}: {e}") from e
        if len(data) < n:
            data += bytes(n - len(data))
        view = memoryview(data)
        for i in range(pages):
            h = self.hashes.get(first + i)
            if h is not None:
                verify(view[i * PAGE:(i + 1) * PAGE], h, f"{self.path.name}: page {first + i}")
        return data

    def close(self, remove: bool = True) -> None:
        if not self.flash.closed:
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - closing: the file goes anyway
                pass
            self.flash.close()
        if remove:
            delete_file(self.path)


# ---- records ---------------------------------------------------------------------------------------
class Records:
    """Entry records ``k | v`` of one layer: packing into pages and back."""

    def __init__(self, head_dim: int, dtype: torch.dtype) -> None:
        self.d = head_dim
        self.dtype = dtype
        self.entry_bytes = 2 * head_dim * torch.empty(0, dtype=dtype).element_size()
        if self.entry_bytes > PAGE:
            raise ValueError(f"an entry of {self.entry_bytes} bytes does not fit a page")
        self.per_page = PAGE // self.entry_bytes

    def pages_for(self, n: int) -> int:
        return -(-n // self.per_page)

    def pack(self, k: torch.Tensor, v: torch.Tensor) -> bytes:
        """``ceil(n / per_page)`` pages holding these entries in order (the last one padded)."""
        n = int(k.shape[0])
        pages = self.pages_for(n)
        rec = torch.zeros(pages * self.per_page, 2 * self.d, dtype=self.dtype)
        rec[:n, :self.d] = k
        rec[:n, self.d:] = v
        raw = rec.view(torch.uint8).view(pages, self.per_page * self.entry_bytes)
        if self.per_page * self.entry_bytes < PAGE:
            full = torch.zeros(pages, PAGE, dtype=torch.uint8)
            full[:, :raw.shape[1]] = raw
            raw = full
        return raw.numpy().tobytes()

    def unpack(self, data: bytes, pages: int) -> torch.Tensor:
        """``[pages * per_page, 2D]`` records of pages read."""
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(pages, PAGE)
        raw = raw[:, :self.per_page * self.entry_bytes].contiguous()
        return raw.view(self.dtype).view(pages * self.per_page, 2 * self.d)


def runs_of(pages: Iterable[int], gap: int = 0) -> list[tuple[int, int]]:
    """Sorted unique pages -> ``(first, count)`` runs; runs at most ``gap`` pages apart merge
    (the gap is read too)."""
    out: list[tuple[int, int]] = []
    for p in sorted(set(pages)):
        if out and p <= out[-1][0] + out[-1][1] + gap:
            first, _ = out[-1]
            out[-1] = (first, p - first + 1)
        else:
            out.append((p, 1))
    return out


#: k [n, D], v [n, D], pos [n]: a tuple, or a run of the row arena that reads as one
FlushedData = tuple[torch.Tensor, torch.Tensor, np.ndarray] | Rows


class ClusterStore:
    """The clusters of one layer on flash (module docstring)."""

    def __init__(self, path: str | os.PathLike[str], heads: int, head_dim: int,
                 dtype: torch.dtype, io: IOStats, *, max_cluster: int, dual_head: bool = True,
                 write_buffer: int = 32, merge_gap: int = 1, direct: bool = True,
                 executor: Executor | None = None, pack_tails: bool = True) -> None:
        self.file = PageFile(path, io, direct, executor)
        self.io = io
        self.rec = Records(head_dim, dtype)
        self.heads, self.d, self.dtype = heads, head_dim, dtype
        self.dual_head = dual_head
        #: past the write-buffer cap, pack tails into full shared pages (dual-head layout) instead
        #: of writing the fullest tail as a padded page
        self.pack_tails = pack_tails
        self.tail_pages = 0
        self.layout = PageLayout(dual_head, 2 * self.rec.pages_for(max_cluster))
        self.tail_cap = max(1, write_buffer) * heads
        self.merge_gap = merge_gap
        self.units: dict[int, Unit] = {}
        self._next_uid = 0
        self.tail_entries = 0
        self.clock = 0
        #: units that may hold a tail (a superset: pruned lazily), so capping the write buffers
        #: does not scan every unit of the layer
        self.tailed: dict[int, Unit] = {}
        #: RAM lookup of a unit's flushed entries (the policy's cache / this step's reads)
        self.ram_lookup: Callable[[int], FlushedData | None] = lambda uid: None
        #: told when a unit's flushed part changes: (uid, data or None to forget)
        self.on_flushed: Callable[[int, FlushedData | None], None] = lambda uid, data: None
        #: where read entries go (runs of rows, sparkv.decode.rows), or None: tensors of their own
        self.arena: RowArena | None = None

    # ---- units -------------------------------------------------------------------------------------
    def new_unit(self, head: int) -> Unit:
        u = Unit(self._next_uid, head)
        self._next_uid += 1
        self.units[u.uid] = u
        return u

    # ---- writes ------------------------------------------------------------------------------------
    def _write(self, u: Unit, k: torch.Tensor, v: torch.Tensor, pos: np.ndarray, reason: str,
               pages: list[int] | None = None) -> None:
        """Writes entries (whole pages, the last padded) for ``u``; records their addresses."""
        n = int(k.shape[0])
        if n == 0:
            return
        npages = self.rec.pages_for(n)
        if pages is None:
            pages = self.layout.take(u, npages)
        data = self.rec.pack(k, v)
        # pages are ascending; write each contiguous run in one operation
        i = 0
        while i < npages:
            j = i
            while j + 1 < npages and pages[j + 1] == pages[j] + 1:
                j += 1
            self.file.write(pages[i], data[i * PAGE:(j + 1) * PAGE], reason)
            i = j + 1
        pp = self.rec.per_page
        slots = np.array([pages[e // pp] * pp + e % pp for e in range(n)], dtype=np.int64)
        u.addr = np.concatenate([u.addr, slots])
        u.pos = np.concatenate([u.pos, np.asarray(pos, dtype=np.int64)])
        u.pages.extend(pages)

    def place(self, head: int, groups: Sequence[FlushedData]) -> list[int]:
        """Prefill placement of one head's clusters, in the given (co-retrieval) order: pairs
        share dual-head pools (or, packed, follow each other). Partial last pages are written
        padded. Returns the new units' ids."""
        units = [self.new_unit(head) for _ in groups]
        pages = self.layout.prefill(units, [self.rec.pages_for(int(g[0].shape[0])) for g in groups])
        for u, (k, v, pos), p in zip(units, groups, pages):
            self._write(u, k, v, pos, "prefill", p)
        return [u.uid for u in units]

    def create(self, head: int, k: torch.Tensor, v: torch.Tensor, pos: np.ndarray,
               reason: str = "migrate") -> Unit:
        """A new unit from entries in RAM (a split half, a local cluster): whole pages written now
        (logical bytes: ``reason``), the rest kept as its tail."""
        u = self.new_unit(head)
        self.layout.home(u)
        self.add(u, k, v, pos, reason)
        return u

    def add(self, u: Unit, k: torch.Tensor, v: torch.Tensor, pos: np.ndarray,
            reason: str = "append") -> None:
        """Appends entries to ``u``'s write buffer; every full page is written."""
        n = int(k.shape[0])
        if n == 0:
            return
        self.clock += 1
        u.last_append = self.clock
        pos = np.asarray(pos, dtype=np.int64)
        k = k.to(self.dtype).reshape(n, self.d)
        v = v.to(self.dtype).reshape(n, self.d)
        if u.tail_k is None or u.tail_v is None or u.tail == 0:
            tk, tv, tp = k, v, pos
        else:
            tk, tv, tp = torch.cat([u.tail_k, k]), torch.cat([u.tail_v, v]), \
                np.concatenate([u.tail_pos, pos])
        self.tail_entries -= u.tail
        pp = self.rec.per_page
        full = (tk.shape[0] // pp) * pp
        if full:
            self.io.count_logical(reason, full * self.rec.entry_bytes)
            self._flush(u, tk[:full], tv[:full], tp[:full], reason)
        u.tail_k, u.tail_v, u.tail_pos = tk[full:].clone(), tv[full:].clone(), tp[full:].copy()
        self.tail_entries += u.tail
        if u.tail:
            self.tailed[u.uid] = u
        self._cap_tails()

    def _flush(self, u: Unit, k: torch.Tensor, v: torch.Tensor, pos: np.ndarray,
               reason: str) -> None:
        """Writes entries to ``u``'s flushed part, relocating it first in the packed layout."""
        before = self.ram_lookup(u.uid)
        if self.dual_head:
            self._write(u, k, v, pos, reason)
        else:
            self._relocate(u, extra=(k, v, pos), reason=reason)
        # keep a cached copy of the flushed part current
        if before is not None and self.dual_head:
            bk, bv, bp = before
            self.on_flushed(u.uid, (torch.cat([bk, k]), torch.cat([bv, v]),
                                    np.concatenate([bp, pos])))

    def _relocate(self, u: Unit, extra: FlushedData | None, reason: str) -> None:
        """Packed layout: rewrites ``u``'s live flushed entries (plus ``extra``) as one exact
        extent at the end of the file; the old pages are dead."""
        data = self.ram_lookup(u.uid) if u.flushed else None
        in_ram = data is not None
        if data is None and u.flushed:
            data = self.fetch([u.uid], "relocate")[u.uid]
        parts_k, parts_v, parts_p = [], [], []
        if data is not None:
            parts_k.append(data[0])
            parts_v.append(data[1])
            parts_p.append(data[2])
        if extra is not None:
            parts_k.append(extra[0])
            parts_v.append(extra[1])
            parts_p.append(np.asarray(extra[2], dtype=np.int64))
        if not parts_k:
            return
        k, v, pos = torch.cat(parts_k), torch.cat(parts_v), np.concatenate(parts_p)
        u.addr = np.zeros(0, np.int64)
        u.pos = np.zeros(0, np.int64)
        u.pages = []
        npages = self.rec.pages_for(int(k.shape[0]))
        first = self.layout.alloc(npages)
        self._write(u, k, v, pos, "relocate", list(range(first, first + npages)))
        if in_ram:
            self.on_flushed(u.uid, (k, v, pos))

    def flush_tail(self, u: Unit, reason: str = "cold") -> None:
        """Writes ``u``'s partial tail as a padded page (a cold cluster's direct write)."""
        if u.tail == 0 or u.tail_k is None or u.tail_v is None:
            return
        k, v, pos = u.tail_k, u.tail_v, u.tail_pos
        self.tail_entries -= u.tail
        u.tail_k = u.tail_v = None
        u.tail_pos = np.zeros(0, np.int64)
        self.io.count_logical(reason, int(k.shape[0]) * self.rec.entry_bytes)
        self._flush(u, k, v, pos, reason)

    def _cap_tails(self) -> None:
        while self.tail_entries > self.tail_cap:
            victims = self.tails()
            if not victims:
                break
            if self.pack_tails and self.dual_head and self.tail_entries >= self.rec.per_page:
                self.pack_tail_page(victims)
                continue
            # the fullest tail pads its page least (ties: the least recently appended)
            self.flush_tail(max(victims, key=lambda u: (u.tail, -u.last_append)))

    def pack_tail_page(self, victims: list[Unit] | None = None, reason: str = "tailpack") -> int:
        """Writes one **full** shared tail page: the oldest tail entries of the fullest tails
        (ties: the least recently appended) until the page is full, several clusters in one page.
        Each entry is written once and stays there (its cluster's address points into the shared
        page; other clusters' slots in it are dead slots for a read of this cluster), so a
        page-aligned flush costs no padding. Returns the entries written (0 when the tails hold
        fewer than a page)."""
        pp = self.rec.per_page
        if victims is None:
            victims = self.tails()
        if sum(u.tail for u in victims) < pp:
            return 0
        victims = sorted(victims, key=lambda u: (-u.tail, u.last_append))
        take: list[tuple[Unit, int]] = []
        left = pp
        for u in victims:
            n = min(u.tail, left)
            take.append((u, n))
            left -= n
            if not left:
                break
        page = self.layout.alloc(1)
        k = torch.cat([u.tail_k[:n] for u, n in take])  # type: ignore[index]
        v = torch.cat([u.tail_v[:n] for u, n in take])  # type: ignore[index]
        self.file.write(page, self.rec.pack(k, v), reason)
        self.io.count_logical(reason, pp * self.rec.entry_bytes)
        self.tail_pages += 1
        slot = 0
        for u, n in take:
            before = self.ram_lookup(u.uid)
            assert u.tail_k is not None and u.tail_v is not None
            tk, tv, tp = u.tail_k[:n], u.tail_v[:n], u.tail_pos[:n]
            u.addr = np.concatenate([u.addr, page * pp + slot + np.arange(n, dtype=np.int64)])
            u.pos = np.concatenate([u.pos, tp])
            u.pages.append(page)
            slot += n
            u.tail_k, u.tail_v, u.tail_pos = u.tail_k[n:], u.tail_v[n:], u.tail_pos[n:]
            self.tail_entries -= n
            if before is not None:
                bk, bv, bp = before
                self.on_flushed(u.uid, (torch.cat([bk, tk]), torch.cat([bv, tv]),
                                        np.concatenate([bp, tp])))
        return pp

    def tails(self) -> list[Unit]:
        """The live units holding a write-buffer tail (in RAM)."""
        out = []
        for uid in list(self.tailed):
            u = self.tailed[uid]
            if u.alive and u.tail:
                out.append(u)
            else:
                del self.tailed[uid]
        return out

    def remove(self, u: Unit, positions: np.ndarray) -> None:
        """Takes entries out of ``u`` (a split): flushed ones become dead slots, tail ones are
        dropped from the write buffer."""
        positions = np.asarray(positions, dtype=np.int64)
        if u.flushed:
            keep = ~np.isin(u.pos, positions)
            u.addr, u.pos = u.addr[keep], u.pos[keep]
        if u.tail:
            keep = ~np.isin(u.tail_pos, positions)
            self.tail_entries -= u.tail
            assert u.tail_k is not None and u.tail_v is not None
            kt = torch.from_numpy(keep)
            u.tail_k, u.tail_v, u.tail_pos = u.tail_k[kt], u.tail_v[kt], u.tail_pos[keep]
            self.tail_entries += u.tail

    def retire(self, u: Unit) -> None:
        """Forgets ``u`` (its pages stay written, dead)."""
        self.tail_entries -= u.tail
        u.alive = False
        self.units.pop(u.uid, None)
        self.on_flushed(u.uid, None)

    def needs_compaction(self, u: Unit) -> bool:
        """Dead slots outnumber live ones, or the flushed part spans several runs."""
        if not u.flushed:
            return False
        dead = len(u.pages) * self.rec.per_page - u.flushed
        return dead > max(u.flushed, self.rec.per_page) or len(runs_of(u.pages)) > 1

    def compact(self, u: Unit, data: FlushedData) -> None:
        """Rewrites ``u``'s live flushed entries (in RAM: ``data``) at a fresh head; the old
        pages are dead (nothing is rewritten in place)."""
        if self.dual_head:
            u.pool = None
            self.layout.home(u)
            k, v, pos = data
            u.addr = np.zeros(0, np.int64)
            u.pos = np.zeros(0, np.int64)
            u.pages = []
            self._write(u, k, v, pos, "compact")
            self.on_flushed(u.uid, (k, v, pos))
        else:
            self._relocate(u, None, "compact")

    # ---- reads -------------------------------------------------------------------------------------
    def plan(self, uids: Iterable[int]) -> list[tuple[int, int]]:
        pp = self.rec.per_page
        pages: set[int] = set()
        for uid in uids:
            u = self.units[uid]
            if u.flushed:
                pages.update((u.addr // pp).tolist())
        return runs_of(pages, self.merge_gap)

    def fetch(self, uids: Iterable[int], reason: str) -> dict[int, FlushedData]:
        """The flushed entries of these units, read from flash (whole pages, runs merged)."""
        uids = [u for u in dict.fromkeys(uids) if self.units[u].flushed]
        if not uids:
            return {}
        runs = self.plan(uids)
        return self.read_runs(uids, runs, reason)

    def read_runs(self, uids: list[int], runs: list[tuple[int, int]], reason: str
                  ) -> dict[int, FlushedData]:
        """Reads ``runs`` and cuts ``uids``' entries out of them (safe on another thread as long
        as those units do not change meanwhile)."""
        pp = self.rec.per_page
        t0 = time.perf_counter()
        firsts = np.array([r[0] for r in runs], dtype=np.int64)
        bufs = [self.rec.unpack(self.file.read(first, n), n) for first, n in runs]
        seconds = time.perf_counter() - t0
        out: dict[int, FlushedData] = {}
        entries = 0
        d = self.d
        # one buffer for every run; a unit's entries are gathered with one index tensor, grouped
        # by run (ascending) and in address order within a run
        allrec = bufs[0] if len(bufs) == 1 else torch.cat(bufs)
        base = np.cumsum([0] + [n * pp for _, n in runs[:-1]]).astype(np.int64)
        for uid in uids:
            u = self.units[uid]
            which = np.searchsorted(firsts, u.addr // pp, side="right") - 1
            gidx = base[which] + u.addr - firsts[which] * pp
            if len(runs) > 1:
                o = np.argsort(which, kind="stable")
                gidx, upos = gidx[o], u.pos[o]
            else:
                upos = u.pos.copy()
            if self.arena is not None:
                out[uid] = self.arena.put_records(allrec, torch.from_numpy(gidx), upos)
            else:
                recs = allrec[torch.from_numpy(gidx)]
                out[uid] = (recs[:, :d], recs[:, d:], upos)
            entries += u.flushed
        self.io.count_read(reason, len(runs), sum(n for _, n in runs) * PAGE, entries, seconds)
        return out

    def close(self, remove: bool = True) -> None:
        self.file.close(remove)


class TokenStore:
    """``nocluster``: each head's entries in position order (a region of the layer file per
    head); a unit is one page of consecutive positions (uid = its page in the file); the partial
    last page of each head is its tail (RAM)."""

    def __init__(self, path: str | os.PathLike[str], heads: int, head_dim: int,
                 dtype: torch.dtype, io: IOStats, *, max_positions: int, merge_gap: int = 0,
                 direct: bool = True, executor: Executor | None = None) -> None:
        self.file = PageFile(path, io, direct, executor)
        self.io = io
        self.rec = Records(head_dim, dtype)
        self.heads, self.d, self.dtype = heads, head_dim, dtype
        self.region = self.rec.pages_for(max_positions)
        self.merge_gap = merge_gap
        self.count = [0] * heads                       # entries flushed per head
        self.tail_k: list[torch.Tensor] = [torch.zeros(0, head_dim, dtype=dtype)] * heads
        self.tail_v: list[torch.Tensor] = [torch.zeros(0, head_dim, dtype=dtype)] * heads

    @property
    def tail_entries(self) -> int:
        return sum(int(t.shape[0]) for t in self.tail_k)

    def uid_of(self, head: int, position: int) -> int:
        return head * self.region + position // self.rec.per_page

    def flushed(self, head: int) -> int:
        return self.count[head]

    def add(self, head: int, k: torch.Tensor, v: torch.Tensor, reason: str = "append") -> None:
        """Appends (positions continue from what the head holds); full pages are written."""
        tk = torch.cat([self.tail_k[head], k.to(self.dtype)])
        tv = torch.cat([self.tail_v[head], v.to(self.dtype)])
        pp = self.rec.per_page
        full = (tk.shape[0] // pp) * pp
        if full:
            first = self.uid_of(head, self.count[head])
            self.file.write(first, self.rec.pack(tk[:full], tv[:full]), reason)
            if reason != "prefill":
                self.io.count_logical(reason, full * self.rec.entry_bytes)
            self.count[head] += full
        self.tail_k[head], self.tail_v[head] = tk[full:].clone(), tv[full:].clone()

    def plan(self, uids: Iterable[int]) -> list[tuple[int, int]]:
        return runs_of(uids, self.merge_gap)

    def fetch(self, uids: Iterable[int], reason: str) -> dict[int, FlushedData]:
        uids = list(dict.fromkeys(uids))
        if not uids:
            return {}
        return self.read_runs(uids, self.plan(uids), reason)

    def read_runs(self, uids: list[int], runs: list[tuple[int, int]], reason: str
                  ) -> dict[int, FlushedData]:
        """Token pages ``uids`` -> ``(k, v, pos)``, read as ``runs``."""
        pp = self.rec.per_page
        want = set(uids)
        t0 = time.perf_counter()
        out: dict[int, FlushedData] = {}
        for first, n in runs:
            recs = self.rec.unpack(self.file.read(first, n), n)
            for i in range(n):
                uid = first + i
                if uid in want:
                    r = recs[i * pp:(i + 1) * pp]
                    p0 = (uid % self.region) * pp
                    out[uid] = (r[:, :self.d], r[:, self.d:], np.arange(p0, p0 + pp))
        self.io.count_read(reason, len(runs), sum(n for _, n in runs) * PAGE,
                           len(want) * pp, time.perf_counter() - t0)
        return out

    def close(self, remove: bool = True) -> None:
        self.file.close(remove)
