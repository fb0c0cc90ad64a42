"""A context's paged chunks: :class:`PagedChunks` - its block table over the page pools, and
every bulk operation on them as one array operation per run and level.

A **run** is any set of chunks, given as ``t, l, g`` int arrays; its entries travel as
:class:`~sparkv.cache.payload.ChunkRun` (the payload layout, chunk after chunk). Per level present
in a run, each operation is a fixed number of tensor operations, whatever the number of chunks:

* :meth:`PagedChunks.write` (put many chunks): allocate the pages, one ``index_copy_`` per pool
  tensor (rows -> page slots, :func:`~sparkv.cache.blocks.row_slots`), one table assignment;
* :meth:`PagedChunks.place`: :meth:`~PagedChunks.write` of a run whose rows its caller writes
  straight into the new pages (a swap-in from a read buffer: no copy of the run first);
* :meth:`PagedChunks.read` (get many chunks, export): one ``index_select`` per pool tensor;
* :meth:`PagedChunks.relevel` (compress / decompress): read, convert the run's rows at once
  (:func:`~sparkv.cache.payload.values_at_level`), write;
* :meth:`PagedChunks.prune`: read a layer's runs, keep rows by a per-head position mask, write;
* :meth:`PagedChunks.free`: return the pages to their pools.

After each operation a private pool a quarter free (and at least a block) is compacted, so its
tensors stay near the pages held.

The account is the pages this context holds (``nbytes``), per level.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from sparkv.cache.blocks import BlockTable, page_fill, pages_for, row_slots
from sparkv.cache.levels import LEVELS, QuantizedTensor
from sparkv.cache.pages import BLOCK_PAGES, PagePool, PagePools
from sparkv.cache.payload import ChunkRun
from sparkv.cache.ids import chunk_array
from sparkv.layout import ChunkGeometry, KVChunkId

Run = tuple[np.ndarray, np.ndarray, np.ndarray]
#: a run's rows: ``[R, D]`` fp values or quantized rows
Rows = torch.Tensor | QuantizedTensor
#: writes a run's rows into the ``(k, v)`` it is given (:meth:`PagedChunks.place`)
Fill = Callable[[Rows, Rows], None]


def run_of(cids: Sequence[KVChunkId]) -> Run:
    """``(t, l, g)`` arrays of a list of chunk ids."""
    a = chunk_array(cids)
    return a[:, 0], a[:, 1], a[:, 2]


class PagedChunks:
    """The paged chunks of one context (module docstring).

    Args:
        geometry: the context's.
        pools: page pools to allocate from (shared with other contexts); ``None``: a private
            set, compacted as pages are freed.
        dtype, device: of a private set's fp pages.
    """

    def __init__(self, geometry: ChunkGeometry, pools: PagePools | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        self.private = pools is None
        self.pools = pools if pools is not None else PagePools(geometry.head_dim, dtype, device)
        self.table = BlockTable(geometry)
        self.held = {lv: 0 for lv in LEVELS}
        self.dtype = self.pools.dtype

    def grow(self, num_token_chunks: int) -> None:
        self.table.grow(num_token_chunks)

    # ---- the account -----------------------------------------------------------------------------
    def nbytes(self, level: str | None = None) -> int:
        """Bytes of the pages held (at ``level``, or all)."""
        levels = LEVELS if level is None else (level,)
        return sum(self.held[lv] * self.pools[lv].page_bytes for lv in levels)

    def recount(self) -> int:
        """:meth:`nbytes` recounted from the block table."""
        return sum(n * self.pools[lv].page_bytes for lv, n in self.table.pages_held().items())

    def bytes_by_token(self) -> np.ndarray:
        """Bytes of pages held per token chunk (``[Tc]``)."""
        per = np.array([self.pools[lv].page_bytes for lv in LEVELS], dtype=np.int64)
        return self.table.pages_by_token() @ per

    def generation(self) -> int:
        """Changes when a pool's tensors are reallocated (their views go stale)."""
        return self.pools.generation()

    # ---- bulk operations -------------------------------------------------------------------------
    def held_level(self, t: np.ndarray, l: np.ndarray, g: np.ndarray  # noqa: E741
                   ) -> np.ndarray:
        """Per chunk, the level index its pages are at (-1: no pages)."""
        return self.table.level[t, l, g]

    def write(self, t: np.ndarray, l: np.ndarray, g: np.ndarray, run: ChunkRun  # noqa: E741
              ) -> None:
        """Holds ``run`` (its chunks are ``t, l, g``) in new pages of its level, in place of
        whatever pages those chunks had. Raises
        :class:`~sparkv.cache.pages.PagePoolFull` (changing nothing) past the pools' budget."""
        self._place(t, l, g, run.level, run.counts,
                    lambda pool, slots: pool.write_rows(slots, run.k, run.v, run.pos))

    def place(self, t: np.ndarray, l: np.ndarray, g: np.ndarray, level: str,  # noqa: E741
              counts: np.ndarray, pos: torch.Tensor, fill: Fill) -> tuple[Rows, Rows]:
        """:meth:`write` of a run whose values ``fill(k, v)`` writes straight into the new pages
        (``k``, ``v``: views of the pool's rows, or new tensors copied in after when the pages
        are not consecutive): no copy of the run before. Returns ``(k, v)`` as written (views:
        valid until the chunks' pages change)."""
        out: list[tuple[Rows, Rows]] = []

        def put(pool: PagePool, slots: torch.Tensor) -> None:
            views = pool.row_views(slots)
            k, v = views if views is not None else pool.empty_rows(int(slots.numel()))
            fill(k, v)
            if views is None:
                pool.write_rows(slots, k, v, pos)
            else:
                pool.write_pos(slots, pos)
            out.append((k, v))

        self._place(t, l, g, level, counts, put)
        return out[0]

    def _place(self, t: np.ndarray, l: np.ndarray, g: np.ndarray, level: str,  # noqa: E741
               counts: np.ndarray, put: Callable[[PagePool, torch.Tensor], None]) -> None:
        """New pages of ``level`` for the chunks ``t, l, g`` (in place of theirs), their rows
        written by ``put(pool, slots)``; a ``put`` that raises frees them again."""
        flat = np.asarray(counts, dtype=np.int64).reshape(-1)
        n = int(pages_for(flat).sum())
        self.pools.check(level, n, self._pages_of(t, l, g))
        self.free(t, l, g, compact=False)
        ids = self.pools.alloc(level, n)
        pool = self.pools[level]
        try:
            put(pool, row_slots(flat, ids))
        except BaseException:
            pool.free(ids)
            raise
        pool.set_fill(ids, page_fill(flat))
        self.table.assign(t, l, g, level, counts, ids)
        self.held[level] += n
        self._compact()

    def read(self, t: np.ndarray, l: np.ndarray, g: np.ndarray  # noqa: E741
             ) -> list[tuple[np.ndarray, ChunkRun]]:
        """Copies of the chunks' entries: per level held, ``(which, run)`` with ``which`` the
        positions in ``t, l, g`` of the run's chunks (chunks with no pages are left out)."""
        out = []
        lv = self.table.level[t, l, g]
        for code in np.unique(lv[lv >= 0]):
            which = np.flatnonzero(lv == code)
            counts, ids = self.table.page_ids(t[which], l[which], g[which])
            k, v, pos = self.pools[LEVELS[int(code)]].read_rows(row_slots(counts, ids))
            cids = list(map(KVChunkId, t[which].tolist(), l[which].tolist(),
                            g[which].tolist()))
            out.append((which, ChunkRun(cids, LEVELS[int(code)], counts.astype(np.int64), pos,
                                        k, v, self.dtype)))
        return out

    def relevel(self, t: np.ndarray, l: np.ndarray, g: np.ndarray, level: str  # noqa: E741
                ) -> None:
        """The chunks' pages re-held at ``level`` (one conversion per level they are at)."""
        for which, run in self.read(t, l, g):
            if run.level != level:
                self.write(t[which], l[which], g[which], run.at_level(level))

    def free(self, t: np.ndarray, l: np.ndarray, g: np.ndarray,  # noqa: E741
             compact: bool = True) -> int:
        """Returns the chunks' pages to their pools; the bytes freed."""
        freed = 0
        for level, ids in self.table.release(t, l, g).items():
            self.pools[level].free(ids)
            self.held[level] -= int(ids.size)
            freed += int(ids.size) * self.pools[level].page_bytes
        if compact:
            self._compact()
        return freed

    def prune(self, l: int, keep: torch.Tensor) -> np.ndarray:  # noqa: E741
        """Keeps, in every chunk of layer ``l`` with pages, only the rows whose position is
        marked in ``keep`` (bool ``[H, positions]``, per KV head). Returns the chunks' new counts
        ``[Tc * G, Hg]`` (table order: token chunk major)."""
        g = self.table
        tc, groups = g.level.shape[0], g.level.shape[2]
        t = np.repeat(np.arange(tc), groups)
        gg = np.tile(np.arange(groups), tc)
        ll = np.full_like(t, l)
        for which, run in self.read(t, ll, gg):
            st, _, sh = g.spans(t[which], ll[which], gg[which])
            head = torch.from_numpy(np.repeat(sh, run.counts.reshape(-1)))
            pos = run.pos.long().cpu()
            mask = keep[head, pos.clamp(max=keep.shape[1] - 1)] & (pos < keep.shape[1])
            seg = torch.from_numpy(np.repeat(np.arange(st.size), run.counts.reshape(-1)))
            counts = torch.bincount(seg[mask], minlength=st.size).numpy().reshape(run.counts.shape)
            rows = torch.nonzero(mask).view(-1).to(run.pos.device)
            k, v = _take(run.k, rows), _take(run.v, rows)
            self.write(t[which], ll[which], gg[which],
                       ChunkRun(run.cids, run.level, counts, run.pos[rows], k, v, run.dtype))
        return g.count[:, l].reshape(tc, groups, -1).reshape(tc * groups, -1).copy()

    # ---- layers (attention) ----------------------------------------------------------------------
    def layer_pages(self, l: int) -> list[tuple[np.ndarray, np.ndarray]]:  # noqa: E741
        """Per KV head of layer ``l``: page ids in position order and their levels."""
        return self.table.layer_pages(l)

    # ---- internals -------------------------------------------------------------------------------
    def _pages_of(self, t: np.ndarray, l: np.ndarray, g: np.ndarray  # noqa: E741
                  ) -> dict[str, int]:
        lv = self.table.level[t, l, g]
        out = {}
        for code in np.unique(lv[lv >= 0]):
            counts, _ = self.table.page_ids(t[lv == code], l[lv == code], g[lv == code])
            out[LEVELS[int(code)]] = int(pages_for(counts.reshape(-1)).sum())
        return out

    def _compact(self) -> None:
        """A private pool a quarter (and a block) free is compacted; the table follows."""
        if not self.private:
            return
        for level in LEVELS:
            pool = self.pools[level]
            if pool.capacity - max(pool.held, pool.expect) >= max(BLOCK_PAGES,
                                                                  pool.capacity // 4):
                src, dst = pool.compact()
                self.table.remap(level, src, dst)


def _take(x: torch.Tensor | QuantizedTensor, rows: torch.Tensor) -> torch.Tensor | QuantizedTensor:
    if isinstance(x, QuantizedTensor):
        return QuantizedTensor(x.codes[rows], x.scale[rows], x.zero[rows], x.bits, x.dim)
    return x[rows]
