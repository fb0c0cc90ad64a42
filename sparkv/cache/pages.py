"""Fixed-size pages of KV entries, one pool per resident level: :class:`PagePool`,
:class:`PagePools`.

A **page** holds up to :data:`PAGE_TOKENS` entries (rows) of one KV head of one layer at one level,
each row one token's ``head_dim`` values of K and of V, with its position; a page belongs to one
chunk ``(t, l, g)`` and one head of its group (:mod:`sparkv.cache.blocks` says which). A pool keeps
every page of its level in a few large tensors, indexed by page id::

    fp    k, v     [capacity, 16, D]  model dtype
    intB  k, v     [capacity, 16, W]  uint8 codes (W = ceil(D * B / 8), packed as levels.py packs;
                                      k8v4: K's W at 8 bits, V's at 4)
          k_scale, k_zero, v_scale, v_zero  [capacity, 16]  float16
    all   pos      [capacity, 16]     int32 (the rows' positions; ascending within a page)
          fill     [capacity]         int32 (rows used: 16 but in a head's last page)

**The page size.** 16 tokens: a 16-token chunk (the smallest ``T``, ``MIN_CHUNK_TOKENS``) is one
page per head and every ``T`` the layout allows (multiples of 16: 64, 256, 1024) fills whole pages;
a pruned head (any count) wastes less than one page, 15 rows at most; a fp32 page of ``D = 64``
is 4 KiB of K, and 16 rows are 4 groups of the attention kernel's 4-row step.

**Allocation** is a free list (lowest free ids first, so held pages stay packed at the bottom); a
pool grows by whole blocks of :data:`BLOCK_PAGES` pages (an eighth of its capacity, at least one
block), never per page; a grown pool copies its pages into the larger tensors once, and its
``generation`` changes (views of the old tensors are stale). ``limit_pages`` (``PagePools``'
``limit_bytes``) bounds the pages held: an allocation past it raises :class:`PagePoolFull` and
changes nothing. :meth:`PagePool.compact` moves held pages into the lowest free ids and releases
the capacity above them (its owner renumbers its block table with the moves).

The account of a pool is the pages it holds (``held``, ``held * page_bytes``); its capacity
(``reserved_bytes``) is what the tensors take.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from sparkv.cache.hostmem import host_addressable, staging
from sparkv.cache.layer import KVMemoryError
from sparkv.cache.levels import LEVELS, SIDE_BITS, QuantizedTensor

#: rows (tokens of one KV head) per page
PAGE_TOKENS = 16
#: pages per growth step (and the granularity of a pool's capacity)
BLOCK_PAGES = 64

_Q_FIELDS = ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero", "pos", "fill")
_FP_FIELDS = ("k", "v", "pos", "fill")


class PagePoolFull(KVMemoryError):
    """An allocation would hold more pages than the pool's limit."""


def _blocks(pages: int) -> int:
    return -(-pages // BLOCK_PAGES) * BLOCK_PAGES


class PagePool:
    """The pages of one resident level (see the module docstring).

    Args:
        level: one of :data:`~sparkv.cache.levels.LEVELS`.
        head_dim: D.
        dtype: of fp values (``level == "fp"``); quantized pools hold uint8 codes.
        device: where the tensors live.
        limit_pages: the most pages it may hold (``None``: no limit).
    """

    def __init__(self, level: str, head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", limit_pages: int | None = None) -> None:
        if level not in LEVELS:
            raise KVMemoryError(f"unknown level {level!r}; known: {', '.join(LEVELS)}")
        self.level, self.head_dim = level, int(head_dim)
        self.dtype = dtype if level == "fp" else torch.uint8
        self.device = torch.device(device)
        #: bits of K and of V (0: fp) and the row width of each side's tensor
        self.bits = dict(zip(("k", "v"), SIDE_BITS.get(level, (0, 0))))
        self.width = {side: self.head_dim if not b else -(-self.head_dim * b // 8)
                      for side, b in self.bits.items()}
        self.quantized = level != "fp"
        self.limit_pages = limit_pages
        self.capacity = 0
        self.held = 0
        self.expect = 0          # pages the owner expects to hold soon (reserve): kept by compact
        self.generation = 0
        self._used = np.zeros(0, dtype=bool)
        self.fields = _FP_FIELDS if level == "fp" else _Q_FIELDS
        self._arrays: dict[str, torch.Tensor] = {f: self._empty(f, 0) for f in self.fields}
        #: bytes one page takes in the pool's tensors (K, V, scales, zeros, positions, fill)
        self.page_bytes = sum(self._empty(f, 1).numel() * self._empty(f, 1).element_size()
                              for f in self.fields)

    # ---- the tensors -----------------------------------------------------------------------------
    def _empty(self, field: str, cap: int, zero: bool = True) -> torch.Tensor:
        P = PAGE_TOKENS
        shape: tuple[int, ...] = {"k": (cap, P, self.width["k"]), "v": (cap, P, self.width["v"]),
                                  "fill": (cap,)}.get(field, (cap, P))
        dtype = {"pos": torch.int32, "fill": torch.int32, "k": self.dtype,
                 "v": self.dtype}.get(field, torch.float16)
        # never an inference tensor: the pool is written in place in and outside inference mode
        with torch.inference_mode(False):
            make = torch.zeros if zero else torch.empty
            return make(shape, dtype=dtype, device=self.device)

    def array(self, field: str) -> torch.Tensor:
        """The pool's tensor ``field`` (``k``, ``v``, ``pos``, ``fill`` and, quantized, the
        scales and zeros), every page of the capacity."""
        return self._arrays[field]

    def tensors(self) -> list[torch.Tensor]:
        return list(self._arrays.values())

    @property
    def held_bytes(self) -> int:
        return self.held * self.page_bytes

    @property
    def reserved_bytes(self) -> int:
        return self.capacity * self.page_bytes

    # ---- the free list ---------------------------------------------------------------------------
    def alloc(self, n: int) -> np.ndarray:
        """``n`` free page ids (lowest first, int64), now held. Grows by whole blocks when needed;
        raises :class:`PagePoolFull` past ``limit_pages`` (nothing allocated)."""
        if n <= 0:
            return np.zeros(0, dtype=np.int64)
        if self.limit_pages is not None and self.held + n > self.limit_pages:
            raise PagePoolFull(f"the {self.level} pool holds {self.held} of its {self.limit_pages} "
                               f"pages: {n} more do not fit")
        free = np.flatnonzero(~self._used)
        if free.size < n:
            self._resize(max(self.capacity + n - free.size,
                             self.capacity + max(self.capacity // 8, BLOCK_PAGES)))
            free = np.flatnonzero(~self._used)
        ids = free[:n].astype(np.int64)
        self._used[ids] = True
        self.held += n
        return ids

    def free(self, ids: np.ndarray) -> None:
        """Returns pages to the free list (their contents are left as they are)."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size == 0:
            return
        if not bool(self._used[ids].all()) or np.unique(ids).size != ids.size:
            raise KVMemoryError(f"the {self.level} pool was asked to free pages it does not hold")
        self._used[ids] = False
        self.held -= int(ids.size)

    def reserve(self, pages: int) -> None:
        """Room for ``pages`` more pages than are held now, made with one reallocation at most
        (a load about to write many runs), and kept by :meth:`compact` until ``reserve(0)``."""
        pages = max(0, int(pages))
        self.expect = self.held + pages if pages else 0
        free = self.capacity - self.held
        if pages > free:
            self._resize(self.capacity + pages - free)

    def holds(self, ids: np.ndarray) -> bool:
        ids = np.asarray(ids, dtype=np.int64)
        return bool(ids.size == 0 or (ids.max() < self.capacity and self._used[ids].all()))

    def _resize(self, pages: int) -> None:
        """Capacity -> ``pages`` rounded up to whole blocks; pages below both are kept, the new
        ones left unwritten (a free page's contents are undefined, as a freed one's are: nothing
        reads a row past a page's fill - the attention kernels mask them, and codes are always
        finite - and alloc sets the fill)."""
        cap = _blocks(pages)
        keep = min(cap, self.capacity)
        for f, old in self._arrays.items():
            new = self._empty(f, cap, zero=False)
            new[:keep] = old[:keep]
            self._arrays[f] = new
        used = np.zeros(cap, dtype=bool)
        used[:keep] = self._used[:keep]
        self._used = used
        self.capacity = cap
        self.generation += 1

    def compact(self) -> tuple[np.ndarray, np.ndarray]:
        """Moves the held pages above ``held`` (rounded up to a block) into free ids below it and
        releases the capacity above. Returns ``(old ids, new ids)`` of the pages moved, for the
        owner's block table."""
        target = _blocks(max(self.held, self.expect))
        src = np.flatnonzero(self._used[target:]) + target
        dst = np.flatnonzero(~self._used[:target])[:src.size]
        if src.size:
            s = torch.from_numpy(src).to(self.device)
            d = torch.from_numpy(dst).to(self.device)
            for t in self._arrays.values():
                t.index_copy_(0, d, t.index_select(0, s))
            self._used[dst] = True
            self._used[src] = False
        if target < self.capacity:
            self._resize(target)
        return src, dst

    # ---- rows ------------------------------------------------------------------------------------
    def write_rows(self, slots: torch.Tensor, k: torch.Tensor | QuantizedTensor,
                   v: torch.Tensor | QuantizedTensor, pos: torch.Tensor) -> None:
        """Rows ``k``, ``v`` (``[R, D]`` fp, or quantized at this level) and ``pos`` ``[R]`` into
        the row slots ``slots`` (``page * 16 + row``, int64 ``[R]``): one copy per tensor (a
        slice copy when the slots are consecutive, as freshly allocated whole pages are, else an
        ``index_copy_``)."""
        a = self._arrays
        slots = slots.to(self.device)
        put = _writer(slots)
        put(a["pos"].view(-1), pos.to(self.device, torch.int32))
        for side, x in (("k", k), ("v", v)):
            if isinstance(x, QuantizedTensor):
                if x.bits != self.bits[side]:
                    raise KVMemoryError(f"int{x.bits} {side.upper()} rows do not go into the "
                                        f"{self.level} pool")
                put(a[side].view(-1, self.width[side]), x.codes.to(self.device))
                put(a[f"{side}_scale"].view(-1), x.scale.to(self.device))
                put(a[f"{side}_zero"].view(-1), x.zero.to(self.device))
            elif self.quantized:
                raise KVMemoryError(f"fp rows do not go into the {self.level} pool")
            else:
                put(a[side].view(-1, self.width[side]), x.to(self.device, self.dtype))

    def row_views(self, slots: torch.Tensor
                  ) -> tuple[torch.Tensor | QuantizedTensor, torch.Tensor | QuantizedTensor] | None:
        """Writable views ``(k, v)`` of the rows at ``slots`` in the layout :meth:`write_rows`
        takes, when the slots are consecutive and ascending (freshly allocated whole pages) and
        the pool is host memory the host may write in place
        (:func:`~sparkv.cache.hostmem.host_addressable`); else ``None``. Valid until the pool
        is reallocated (:attr:`generation`)."""
        a = _first(slots) if host_addressable(self.device) else None
        if a is None:
            return None
        a1 = a + int(slots.numel())
        out: list[torch.Tensor | QuantizedTensor] = []
        for side in ("k", "v"):
            codes = self._arrays[side].view(-1, self.width[side])[a:a1]
            out.append(codes if not self.quantized else QuantizedTensor(
                codes, self._arrays[f"{side}_scale"].view(-1)[a:a1],
                self._arrays[f"{side}_zero"].view(-1)[a:a1], self.bits[side], self.head_dim))
        return out[0], out[1]

    def empty_rows(self, n: int
                   ) -> tuple[torch.Tensor | QuantizedTensor, torch.Tensor | QuantizedTensor]:
        """New ``(k, v)`` of ``n`` rows in the layout :meth:`write_rows` takes (unwritten), in
        host memory (pinned for a GPU pool: :func:`~sparkv.cache.hostmem.staging`): what the
        host fills before one :meth:`write_rows`."""
        with torch.inference_mode(False):
            out: list[torch.Tensor | QuantizedTensor] = []
            for side in ("k", "v"):
                codes = staging((n, self.width[side]), self.dtype, self.device)
                out.append(codes if not self.quantized else QuantizedTensor(
                    codes, staging((n,), torch.float16, self.device),
                    staging((n,), torch.float16, self.device), self.bits[side], self.head_dim))
        return out[0], out[1]

    def write_pos(self, slots: torch.Tensor, pos: torch.Tensor) -> None:
        """Positions ``pos`` ``[R]`` into the row slots ``slots`` (the rows' values written in
        place through :meth:`row_views`)."""
        slots = slots.to(self.device)
        _writer(slots)(self._arrays["pos"].view(-1), pos.to(self.device, torch.int32))

    def read_rows(self, slots: torch.Tensor
                  ) -> tuple[torch.Tensor | QuantizedTensor, torch.Tensor | QuantizedTensor,
                             torch.Tensor]:
        """Copies of the rows at ``slots``: ``(k, v, pos)`` in the layout of
        :class:`~sparkv.cache.payload.ChunkPayload` (``[R, D]`` fp or quantized, int32 ``[R]``)."""
        a = self._arrays
        slots = slots.to(self.device)
        pos = a["pos"].view(-1).index_select(0, slots)
        out: list[torch.Tensor | QuantizedTensor] = []
        for side in ("k", "v"):
            codes = a[side].view(-1, self.width[side]).index_select(0, slots)
            if not self.quantized:
                out.append(codes)
                continue
            out.append(QuantizedTensor(codes, a[f"{side}_scale"].view(-1).index_select(0, slots),
                                       a[f"{side}_zero"].view(-1).index_select(0, slots),
                                       self.bits[side], self.head_dim))
        return out[0], out[1], pos

    def set_fill(self, ids: np.ndarray, fill: np.ndarray) -> None:
        self._arrays["fill"].index_copy_(0, torch.from_numpy(np.asarray(ids, np.int64))
                                         .to(self.device),
                                         torch.from_numpy(np.asarray(fill, np.int32))
                                         .to(self.device))


def _first(slots: torch.Tensor) -> int | None:
    """The first of ``slots`` when they are consecutive and ascending, else ``None``."""
    n = int(slots.numel())
    if not n:
        return None
    s = slots.numpy() if slots.device.type == "cpu" else slots.cpu().numpy()
    if int(s[-1]) - int(s[0]) == n - 1 and (n == 1 or bool((np.diff(s) == 1).all())):
        return int(s[0])
    return None


def _writer(slots: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], object]:
    """How rows go into the slots ``slots`` of a pool tensor's rows: one slice copy when they
    are consecutive and ascending (the same bits as the ``index_copy_`` otherwise used)."""
    a, n = _first(slots), int(slots.numel())
    if a is not None:
        return lambda dst, src: dst[a:a + n].copy_(src)
    return lambda dst, src: dst.index_copy_(0, slots, src)


class PagePools:
    """One :class:`PagePool` per resident level, for one context or shared by several (the
    device service's, as vLLM's block manager is). ``limit_bytes`` bounds the bytes of the pages
    held over every level: an allocation past it raises :class:`PagePoolFull`.

    Args:
        head_dim: D.
        dtype, device: of the fp pages (the model's).
        limit_bytes: the budget of pages held, all levels (``None``: none).
    """

    def __init__(self, head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", limit_bytes: int | None = None) -> None:
        self.head_dim, self.dtype, self.device = int(head_dim), dtype, torch.device(device)
        self.limit_bytes = limit_bytes
        self.pools = {lv: PagePool(lv, head_dim, dtype, device) for lv in LEVELS}

    def __getitem__(self, level: str) -> PagePool:
        try:
            return self.pools[level]
        except KeyError:
            raise KVMemoryError(f"unknown level {level!r}; known: {', '.join(LEVELS)}") from None

    @property
    def held_bytes(self) -> int:
        return sum(p.held_bytes for p in self.pools.values())

    @property
    def reserved_bytes(self) -> int:
        return sum(p.reserved_bytes for p in self.pools.values())

    def check(self, level: str, n: int, freed: dict[str, int] | None = None) -> None:
        """Raises :class:`PagePoolFull` unless ``n`` more pages of ``level`` fit the budget once
        the pages ``freed`` (level -> pages) are returned."""
        pool = self[level]
        back = sum(self[lv].page_bytes * k for lv, k in (freed or {}).items())
        if self.limit_bytes is not None and self.held_bytes - back + n * pool.page_bytes \
                > self.limit_bytes:
            raise PagePoolFull(f"{n} {level} pages ({n * pool.page_bytes} bytes) do not fit: "
                               f"{self.held_bytes - back} of {self.limit_bytes} bytes are held")

    def alloc(self, level: str, n: int) -> np.ndarray:
        """``n`` pages of ``level`` (:meth:`PagePool.alloc`), within ``limit_bytes``."""
        self.check(level, n)
        return self[level].alloc(n)

    def generation(self) -> int:
        """Changes whenever any pool's tensors are reallocated."""
        return sum(p.generation for p in self.pools.values())
