"""Where a context's paged entries are: :class:`BlockTable`, and the row <-> page-slot arithmetic.

A paged chunk ``(t, l, g)`` keeps, per KV head ``h`` of its group, ``count[t, l, h]`` entries in
``ceil(count / 16)`` pages of one pool (its level), in position order: rows ``0 .. 15`` of the
first page, then the next page, the last page partly filled. In arrays (no object per chunk)::

    pages  int32 [Tc, L, H, ceil(T / 16)]   page ids, -1 where none
    count  int32 [Tc, L, H]                 entries held
    level  int8  [Tc, L, G]                 the pool holding the chunk's pages (index in LEVELS),
                                            -1: none

A **run** of chunks is given as three int arrays ``t, l, g`` (``m`` chunks); its **spans** are
its ``(chunk, head)`` pairs in payload order (chunk after chunk, the group's heads in order), and
its rows are the spans' entries one after the other: the row order of
:class:`~sparkv.cache.payload.ChunkRun`. :func:`row_slots` maps those rows to page slots
(``page * 16 + row``) with a few array operations, whatever the counts (ragged, pruned, empty).
"""

from __future__ import annotations

import numpy as np
import torch

from sparkv.cache.levels import LEVELS
from sparkv.cache.pages import PAGE_TOKENS
from sparkv.layout import ChunkGeometry

P = PAGE_TOKENS


def pages_for(counts: np.ndarray) -> np.ndarray:
    """Pages each span of ``counts`` entries takes."""
    return (np.asarray(counts, dtype=np.int64) + P - 1) // P


def row_slots(counts: np.ndarray, ids: np.ndarray) -> torch.Tensor:
    """Page slots (int64 ``[sum counts]``) of the rows of spans holding ``counts`` entries in
    the pages ``ids`` (each span's ``pages_for`` pages, concatenated in span order)."""
    counts = np.asarray(counts, dtype=np.int64).reshape(-1)
    total = int(counts.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.long)
    if not (counts % P).any():                      # whole pages: every row of each, in order
        return torch.from_numpy((np.asarray(ids, dtype=np.int64)[:, None] * P
                                 + np.arange(P)).reshape(-1))
    npg = pages_for(counts)
    seg = np.repeat(np.arange(counts.size), counts)
    e = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    page = np.asarray(ids, dtype=np.int64)[(np.cumsum(npg) - npg)[seg] + e // P]
    return torch.from_numpy(page * P + e % P)


def page_fill(counts: np.ndarray) -> np.ndarray:
    """Rows used in each page of spans holding ``counts`` entries (int32, span order)."""
    counts = np.asarray(counts, dtype=np.int64).reshape(-1)
    npg = pages_for(counts)
    seg = np.repeat(np.arange(counts.size), npg)
    j = np.arange(int(npg.sum())) - np.repeat(np.cumsum(npg) - npg, npg)
    return np.minimum(P, counts[seg] - j * P).astype(np.int32)


class BlockTable:
    """The block table of one context (module docstring). Not thread safe: its owner
    (:class:`~sparkv.cache.paged.PagedChunks`) calls it under the memory's lock."""

    def __init__(self, geometry: ChunkGeometry) -> None:
        g = geometry
        self.num_layers, self.num_heads, self.group = g.num_layers, g.num_kv_heads, \
            g.heads_per_group
        self.max_pages = -(-g.chunk_tokens // P)
        tc = g.num_token_chunks
        self.pages = np.full((tc, g.num_layers, g.num_kv_heads, self.max_pages), -1, np.int32)
        self.count = np.zeros((tc, g.num_layers, g.num_kv_heads), np.int32)
        self.level = np.full((tc, g.num_layers, g.num_groups), -1, np.int8)

    def grow(self, num_token_chunks: int) -> None:
        """Room for ``num_token_chunks`` token chunks (the new ones hold nothing)."""
        extra = num_token_chunks - self.pages.shape[0]
        if extra > 0:
            self.pages = np.concatenate([self.pages, np.full((extra, *self.pages.shape[1:]), -1,
                                                             np.int32)])
            self.count = np.concatenate([self.count, np.zeros((extra, *self.count.shape[1:]),
                                                              np.int32)])
            self.level = np.concatenate([self.level, np.full((extra, *self.level.shape[1:]), -1,
                                                             np.int8)])

    # ---- runs and spans -----------------------------------------------------------------------
    def spans(self, t: np.ndarray, l: np.ndarray, g: np.ndarray  # noqa: E741
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(t, l, h)`` of every span of the run (chunk-major, heads in group order)."""
        hg = self.group
        h = (np.asarray(g)[:, None] * hg + np.arange(hg)[None, :]).reshape(-1)
        return np.repeat(t, hg), np.repeat(l, hg), h

    def _mask(self, counts: np.ndarray) -> np.ndarray:
        return np.arange(self.max_pages)[None, :] < pages_for(counts)[:, None]

    def page_ids(self, t: np.ndarray, l: np.ndarray, g: np.ndarray  # noqa: E741
                 ) -> tuple[np.ndarray, np.ndarray]:
        """``(counts [m, Hg], page ids)`` of a run (ids concatenated in span order)."""
        st, sl, sh = self.spans(t, l, g)
        counts = self.count[st, sl, sh]
        ids = self.pages[st, sl, sh][self._mask(counts)]
        return counts.reshape(-1, self.group), ids.astype(np.int64)

    def assign(self, t: np.ndarray, l: np.ndarray, g: np.ndarray, level: str,  # noqa: E741
               counts: np.ndarray, ids: np.ndarray) -> None:
        """Records that the run's spans hold ``counts`` (``[m, Hg]``) entries in pages ``ids``
        (:func:`row_slots` order) of the ``level`` pool."""
        st, sl, sh = self.spans(t, l, g)
        c = np.asarray(counts, dtype=np.int64).reshape(-1)
        table = np.full((c.size, self.max_pages), -1, np.int32)
        table[self._mask(c)] = ids
        self.pages[st, sl, sh] = table
        self.count[st, sl, sh] = c
        self.level[t, l, g] = LEVELS.index(level)

    def release(self, t: np.ndarray, l: np.ndarray, g: np.ndarray  # noqa: E741
                ) -> dict[str, np.ndarray]:
        """Forgets the run's pages; returns them per level (the caller frees them). A run that
        holds none (a swap-in's chunks) is left as it is: its spans are already empty."""
        out: dict[str, np.ndarray] = {}
        lv = self.level[t, l, g]
        held = lv >= 0
        if not held.any():
            return out
        for code in np.unique(lv[held]):
            sel = lv == code
            _, ids = self.page_ids(t[sel], l[sel], g[sel])
            out[LEVELS[int(code)]] = ids
        st, sl, sh = self.spans(t, l, g)
        self.pages[st, sl, sh] = -1
        self.count[st, sl, sh] = 0
        self.level[t, l, g] = -1
        return out

    def remap(self, level: str, src: np.ndarray, dst: np.ndarray) -> None:
        """Page ids ``src`` of the ``level`` pool are now ``dst`` (a compaction)."""
        if not len(src):
            return
        lut = np.arange(max(int(np.max(src)), int(self.pages.max(initial=0))) + 1)
        lut[src] = dst
        code = LEVELS.index(level)
        mine = np.repeat(self.level == code, self.group, axis=2)[..., None] & (self.pages >= 0)
        self.pages[mine] = lut[self.pages[mine]]

    # ---- layer views -----------------------------------------------------------------------------
    def layer_pages(self, l: int) -> list[tuple[np.ndarray, np.ndarray]]:  # noqa: E741
        """Per KV head of layer ``l``, its page ids in position order (token chunk by token
        chunk) and each page's level (index in LEVELS)."""
        out = []
        for h in range(self.num_heads):
            ids = self.pages[:, l, h]
            lv = np.repeat(self.level[:, l, h // self.group][:, None], self.max_pages, axis=1)
            ok = ids >= 0
            out.append((ids[ok].astype(np.int64), lv[ok]))
        return out

    def pages_held(self) -> dict[str, int]:
        """Pages held per level (recounted from the table)."""
        npg = (self.pages >= 0).sum(axis=3)
        lv = np.repeat(self.level, self.group, axis=2)
        return {name: int(npg[lv == i].sum()) for i, name in enumerate(LEVELS)}

    def pages_by_token(self) -> np.ndarray:
        """Pages held per token chunk and level (``[Tc, len(LEVELS)]``)."""
        npg = (self.pages >= 0).sum(axis=3)
        lv = np.repeat(self.level, self.group, axis=2)
        out = np.zeros((npg.shape[0], len(LEVELS)), np.int64)
        for i in range(len(LEVELS)):
            out[:, i] = np.where(lv == i, npg, 0).sum(axis=(1, 2))
        return out
