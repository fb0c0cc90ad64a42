"""A layer's retrievable units and where their pages go: :class:`Unit`, :class:`Pool` and
:class:`PageLayout` (the layouts of :mod:`sparkv.decode.store`'s module docstring).

:class:`PageLayout` hands out the pages of one layer file: with ``dual_head``, a pool of pages
per pair of clusters (one grows right from the pool's start, the other left from its end; a
cluster meeting its partner, or a migrant, gets a fresh head: the free right head of its KV
head's open pool, else the left head of a new pool); without it, exact extents at the end of
the file. It only counts pages: :class:`~sparkv.decode.store.ClusterStore` writes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class Pool:
    """``size`` pages from ``first``: the left head grows up from ``first``, the right head down
    from ``first + size - 1``."""

    first: int
    size: int
    lnext: int = 0
    rnext: int = 0
    owners: list[int | None] = field(default_factory=lambda: [None, None])

    def __post_init__(self) -> None:
        self.lnext = self.first
        self.rnext = self.first + self.size - 1

    def free(self) -> int:
        return self.rnext - self.lnext + 1

    def take(self, side: int, n: int) -> list[int] | None:
        """``n`` pages at ``side``'s head (ascending), or None when they do not fit."""
        if n > self.free():
            return None
        if side == 0:
            pages = list(range(self.lnext, self.lnext + n))
            self.lnext += n
        else:
            pages = list(range(self.rnext - n + 1, self.rnext + 1))
            self.rnext -= n
        return pages


@dataclass
class Unit:
    """One retrievable unit (a cluster) of one head.

    ``addr``/``pos``: the flushed live entries (slot address ``page * per_page + slot`` and
    position); ``tail_*``: entries not yet on flash (the write buffer); ``pages``: every page
    written for it (dead slots included).
    """

    uid: int
    head: int
    addr: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    pos: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    tail_k: torch.Tensor | None = None
    tail_v: torch.Tensor | None = None
    tail_pos: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    pool: Pool | None = None
    side: int = 0
    pages: list[int] = field(default_factory=list)
    last_append: int = 0
    alive: bool = True

    @property
    def flushed(self) -> int:
        return int(self.addr.shape[0])

    @property
    def tail(self) -> int:
        return int(self.tail_pos.shape[0])

    @property
    def size(self) -> int:
        return self.flushed + self.tail


class PageLayout:
    """The pages of one layer file (module docstring).

    Args:
        dual_head: pools of two growing heads; else exact extents, back to back.
        pool_pages: a migrant pool's pages (room for two clusters of ``max_cluster`` entries).
    """

    def __init__(self, dual_head: bool, pool_pages: int) -> None:
        self.dual_head = dual_head
        self.pool_pages = pool_pages
        self.next_page = 0
        self._open: dict[int, Pool] = {}       # head -> pool whose right head awaits a migrant

    def alloc(self, pages: int) -> int:
        """``pages`` fresh pages at the end of the file; the first."""
        first = self.next_page
        self.next_page += pages
        return first

    def prefill(self, units: list[Unit], npages: list[int]) -> list[list[int]]:
        """The pages of one KV head's prompt clusters ``units`` (``npages`` each), in their
        (co-retrieval) order: pairs share dual-head pools (the last unpaired one's right head
        awaits a migrant), or, packed, follow each other."""
        out = []
        pool: Pool | None = None
        for i, u in enumerate(units):
            n = npages[i]
            if not self.dual_head:
                first = self.alloc(n)
                out.append(list(range(first, first + n)))
                continue
            if i % 2 == 0:
                nxt = npages[i + 1] if i + 1 < len(units) else 0
                size = max(self.pool_pages, n + nxt)
                pool = Pool(self.alloc(size), size)
                pool.owners[0] = u.uid
                u.pool, u.side = pool, 0
                if i + 1 == len(units):
                    self._open[u.head] = pool      # its right head awaits a migrant
            else:
                assert pool is not None
                pool.owners[1] = u.uid
                u.pool, u.side = pool, 1
            pages = pool.take(u.side, n)
            assert pages is not None
            out.append(pages)
        return out

    def home(self, u: Unit) -> None:
        """Gives ``u`` a fresh head: the free right head of its head's open pool, else the left
        head of a new pool (which becomes the open one)."""
        if not self.dual_head:
            u.pool, u.side = None, 0
            return
        pool = self._open.get(u.head)
        if pool is not None and pool.owners[1] is None and pool.rnext == pool.first + pool.size - 1:
            pool.owners[1] = u.uid
            u.pool, u.side = pool, 1
            self._open.pop(u.head, None)
            return
        pool = Pool(self.alloc(self.pool_pages), self.pool_pages)
        pool.owners[0] = u.uid
        u.pool, u.side = pool, 0
        self._open[u.head] = pool

    def take(self, u: Unit, n: int) -> list[int]:
        """``n`` pages for ``u`` at its head (dual-head layout)."""
        if u.pool is None:
            self.home(u)
        assert u.pool is not None
        pages = u.pool.take(u.side, n)
        if pages is None:            # met its partner: continue in a migrant pool
            self.home(u)
            pages = u.pool.take(u.side, n)
            if pages is None:        # bigger than a whole pool: an extent of its own
                first = self.alloc(n)
                pages = list(range(first, first + n))
        return pages
