"""What a context knows of each chunk, in arrays: :class:`ChunkTable` and its snapshot
:class:`ChunkState`.

One row per chunk ``(t, l, g)`` (index ``(t * L + l) * G + g``: the order of
``ChunkGeometry.chunk_ids``, so a grown context appends rows)::

    residency  int8   [n]       0 absent, 1 resident, 2 flash (Residency, in that order)
    level      int8   [n]       index in LEVELS of the level held (resident) or stored (flash); -1
    source     int8   [n]       index in Source; -1 none
    quality    int8   [n]       the lowest level the entries went through (index in QUALITY_ORDER)
    dirty      bool   [n]       changed since its flash copy was written
    counts     int32  [n, Hg]   entries kept per head of the group (the chunk's length: all)
    flash      int32  [n]       index of the flash copy's file in ``files`` (-1: none)
    offset, nbytes  int64 [n]   the copy's range in that file

Bulk updates take index arrays (a run of chunks is one assignment per field). The table is not
thread safe by itself: :class:`~sparkv.cache.memory.ContextKV` calls it under its lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np

from sparkv.cache.flash import FlashRef
from sparkv.cache.ids import chunk_array
from sparkv.cache.levels import LEVELS, QUALITY_ORDER, Residency, Source
from sparkv.layout import ChunkGeometry, KVChunkId

RESIDENCY = (Residency.ABSENT, Residency.RESIDENT, Residency.FLASH)
SOURCES = tuple(Source)
ABSENT, RESIDENT, FLASH = 0, 1, 2


@dataclass
class ChunkState:
    """A snapshot of one chunk's row of the table.

    Attributes:
        residency: where its entries are.
        level: the level they are held at (resident) or stored at (flash); ``""`` when absent.
        source: how they were made.
        counts: entries kept per head of the group (``None``: all of the chunk's tokens).
        flash: the file holding them, when written to the flash tier.
        dirty: changed since the flash copy was written (a reclaim would have to write it).
        quality: the lowest level the entries ever went through (``fp`` if never quantized).
        read: reads the entries as held (a copy: :meth:`ContextKV.read
            <sparkv.cache.memory.ContextKV.read>`), for :attr:`payload`.
    """

    residency: Residency = Residency.ABSENT
    level: str = ""
    source: Source | None = None
    counts: tuple[int, ...] | None = None
    flash: FlashRef | None = None
    dirty: bool = True
    quality: str = "fp"
    read: Callable[[], Any] | None = None

    @property
    def payload(self) -> Any:
        """The entries as held now (a :class:`~sparkv.cache.payload.ChunkPayload` copy), or
        ``None`` when not resident."""
        if self.residency != Residency.RESIDENT or self.read is None:
            return None
        return self.read()


@dataclass
class TokenRows:
    """The chunk table's rows by token chunk (:meth:`ChunkTable.by_token`): per token chunk
    ``t``, its chunks ``(l, g)`` layer-major, ``[Tc, L * G]`` each (copies)."""

    residency: np.ndarray
    level: np.ndarray
    dirty: np.ndarray
    flash: np.ndarray
    offset: np.ndarray
    nbytes: np.ndarray
    files: list[str]

    def ref(self, t: int, j: int) -> FlashRef | None:
        """The flash copy of chunk ``j`` (layer-major) of token chunk ``t``."""
        f = int(self.flash[t, j])
        return None if f < 0 else FlashRef(self.files[f], int(self.nbytes[t, j]),
                                           int(self.offset[t, j]))


def _rank(level: str) -> int:
    """A level's quality (index in QUALITY_ORDER)."""
    return QUALITY_ORDER.index(level)


class ChunkTable:
    """The chunk table of one context (module docstring)."""

    def __init__(self, geometry: ChunkGeometry) -> None:
        self.geometry = geometry
        self.files: list[str] = []
        self._file_index: dict[str, int] = {}
        n, hg = geometry.num_chunks, geometry.heads_per_group
        self.residency = np.zeros(n, np.int8)
        self.level = np.full(n, -1, np.int8)
        self.source = np.full(n, -1, np.int8)
        self.quality = np.zeros(n, np.int8)
        self.dirty = np.ones(n, bool)
        self.counts = self._full_counts(geometry, 0, n)
        self.flash = np.full(n, -1, np.int32)
        self.offset = np.zeros(n, np.int64)
        self.nbytes = np.zeros(n, np.int64)
        assert self.counts.shape == (n, hg)

    @staticmethod
    def _full_counts(g: ChunkGeometry, a: int, b: int) -> np.ndarray:
        return ChunkTable._counts_at(g, np.arange(a, b))

    @staticmethod
    def _counts_at(g: ChunkGeometry, idx: np.ndarray) -> np.ndarray:
        """Every token of rows ``idx``, per head (``[len(idx), Hg]``)."""
        t = np.asarray(idx, dtype=np.int64) // (g.num_layers * g.num_groups)
        length = np.minimum(g.chunk_tokens, g.num_tokens - t * g.chunk_tokens)
        return np.repeat(length[:, None], g.heads_per_group, axis=1).astype(np.int32)

    # ---- indices ---------------------------------------------------------------------------------
    def index(self, cid: KVChunkId) -> int:
        g = self.geometry
        return (cid.t * g.num_layers + cid.l) * g.num_groups + cid.g

    def indices(self, cids: Iterable[KVChunkId]) -> np.ndarray:
        """Row indices of ``cids``; -1 for a chunk outside the geometry."""
        g = self.geometry
        a = chunk_array(cids)
        ok = ((a >= 0).all(axis=1) & (a[:, 0] < g.num_token_chunks) & (a[:, 1] < g.num_layers)
              & (a[:, 2] < g.num_groups))
        return np.where(ok, (a[:, 0] * g.num_layers + a[:, 1]) * g.num_groups + a[:, 2], -1)

    def chunk_of(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(t, l, g)`` arrays of row indices."""
        g = self.geometry
        idx = np.asarray(idx, dtype=np.int64)
        return idx // (g.num_layers * g.num_groups), (idx // g.num_groups) % g.num_layers, \
            idx % g.num_groups

    def layer_rows(self, l: int) -> np.ndarray:  # noqa: E741
        """Row indices of layer ``l``'s chunks (token chunk major)."""
        g = self.geometry
        t = np.arange(g.num_token_chunks)[:, None]
        return ((t * g.num_layers + l) * g.num_groups + np.arange(g.num_groups)[None, :]
                ).reshape(-1)

    def grow(self, geometry: ChunkGeometry) -> None:
        """Rows for a context grown to ``geometry`` (the new chunks absent; a last token chunk
        that grew keeps its row, with its full count updated)."""
        old, n = self.geometry.num_chunks, geometry.num_chunks
        self.geometry = geometry
        extra = n - old
        if extra > 0:
            for name, fill in (("residency", 0), ("level", -1), ("source", -1), ("quality", 0),
                               ("dirty", True), ("flash", -1), ("offset", 0), ("nbytes", 0)):
                a = getattr(self, name)
                setattr(self, name, np.concatenate([a, np.full(extra, fill, a.dtype)]))
            self.counts = np.concatenate([self.counts, self._full_counts(geometry, old, n)])

    # ---- reads -----------------------------------------------------------------------------------
    def state(self, i: int, read: Callable[[], Any] | None = None) -> ChunkState:
        lv = int(self.level[i])
        src = int(self.source[i])
        counts = tuple(int(c) for c in self.counts[i])
        full = self._full_counts(self.geometry, i, i + 1)[0]
        return ChunkState(RESIDENCY[int(self.residency[i])], LEVELS[lv] if lv >= 0 else "",
                          SOURCES[src] if src >= 0 else None,
                          None if counts == tuple(int(c) for c in full) else counts,
                          self.ref(i), bool(self.dirty[i]), QUALITY_ORDER[int(self.quality[i])],
                          read)

    def ref(self, i: int) -> FlashRef | None:
        f = int(self.flash[i])
        if f < 0:
            return None
        return FlashRef(self.files[f], int(self.nbytes[i]), int(self.offset[i]))

    def by_token(self) -> "TokenRows":
        """A copy of the columns a token chunk's records need, ``[Tc, L * G]`` each."""
        g = self.geometry
        shape = (g.num_token_chunks, g.num_layers * g.num_groups)
        def rows(a: np.ndarray) -> np.ndarray:
            return a.reshape(shape).copy()

        return TokenRows(rows(self.residency), rows(self.level), rows(self.dirty),
                         rows(self.flash), rows(self.offset), rows(self.nbytes), list(self.files))

    def sources(self) -> dict[KVChunkId, str]:
        """The source of every resident chunk that has one."""
        idx = np.flatnonzero((self.residency == RESIDENT) & (self.source >= 0))
        t, l, g = self.chunk_of(idx)  # noqa: E741
        return {KVChunkId(int(a), int(b), int(c)): str(SOURCES[int(s)])
                for a, b, c, s in zip(t, l, g, self.source[idx])}

    def is_resident(self, idx: np.ndarray) -> np.ndarray:
        """Per row index, whether it is resident (-1, outside the geometry: not)."""
        idx = np.asarray(idx, dtype=np.int64)
        return (idx >= 0) & (self.residency[np.maximum(idx, 0)] == RESIDENT)

    # ---- writes ----------------------------------------------------------------------------------
    def set_resident(self, idx: np.ndarray, level: str, source: Source | None,
                     counts: np.ndarray | None = None) -> None:
        """Rows ``idx`` resident at ``level`` (dirty; ``source`` ``None`` keeps each row's, or
        ``restored`` for a row without one);
        ``counts`` ``[len(idx), Hg]`` (``None``: every token of each chunk). A source other than
        ``restored`` starts the quality afresh."""
        lv = LEVELS.index(level)
        self.residency[idx] = RESIDENT
        self.level[idx] = lv
        if source is not None:
            self.source[idx] = SOURCES.index(source)
            if source != Source.RESTORED:
                self.quality[idx] = 0
        else:
            none = idx[self.source[idx] < 0]
            self.source[none] = SOURCES.index(Source.RESTORED)
        self.quality[idx] = np.maximum(self.quality[idx], _rank(level))
        self.dirty[idx] = True
        self.counts[idx] = self._counts_at(self.geometry, idx) if counts is None else counts

    def set_counts(self, idx: np.ndarray, counts: np.ndarray) -> None:
        self.counts[idx] = counts
        self.dirty[idx] = True

    def set_level(self, idx: np.ndarray, level: str) -> None:
        lv = LEVELS.index(level)
        self.level[idx] = lv
        self.quality[idx] = np.maximum(self.quality[idx], _rank(level))
        self.dirty[idx] = True

    def mark_clean(self, idx: np.ndarray) -> None:
        """Rows ``idx`` equal their flash copies."""
        self.dirty[idx] = False

    def set_flash(self, idx: np.ndarray, refs: list[FlashRef], clean: bool = True) -> None:
        """Rows ``idx`` have the flash copies ``refs`` (clean unless ``clean=False``)."""
        self.flash[idx] = [self._file(r.path) for r in refs]
        self.offset[idx] = [r.offset for r in refs]
        self.nbytes[idx] = [r.nbytes for r in refs]
        if clean:
            self.dirty[idx] = False

    def _file(self, path: str) -> int:
        i = self._file_index.get(path)
        if i is None:
            i = self._file_index[path] = len(self.files)
            self.files.append(path)
        return i

    def set_on_flash(self, idx: np.ndarray, level: str, source: Source) -> None:
        """Rows ``idx`` (not resident) are on flash at ``level``, every token, from ``source``."""
        lv = LEVELS.index(level)
        self.residency[idx] = FLASH
        self.level[idx] = lv
        self.source[idx] = SOURCES.index(source)
        self.quality[idx] = _rank(level)
        self.counts[idx] = self._counts_at(self.geometry, idx)

    def evict(self, idx: np.ndarray) -> None:
        """Rows ``idx`` no longer resident: ``flash`` where a clean copy exists, else absent."""
        keep = (self.flash[idx] >= 0) & ~self.dirty[idx]
        self.residency[idx] = np.where(keep, FLASH, ABSENT)
        self.level[idx] = np.where(keep, self.level[idx], -1)

    def forget_flash(self, idx: np.ndarray) -> None:
        """Rows ``idx`` have no flash copy any more (a flash-only chunk becomes absent)."""
        self.flash[idx] = -1
        on_flash = self.residency[idx] == FLASH
        self.residency[idx[on_flash]] = ABSENT
        self.level[idx[on_flash]] = -1

    def reset(self, idx: np.ndarray) -> None:
        """Rows ``idx`` back to a new chunk's (absent, no copy, every token)."""
        self.residency[idx] = ABSENT
        self.level[idx] = self.source[idx] = -1
        self.quality[idx] = 0
        self.dirty[idx] = True
        self.flash[idx] = -1
        self.counts[idx] = self._counts_at(self.geometry, idx)
