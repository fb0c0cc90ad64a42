"""Chunk ids in arrays: :class:`ChunkIds`, and :func:`chunk_array` of any list of chunk ids.

A switch's fill handles a 4K-token context's ~23,000 chunks in runs of a few hundred; as lists
of :class:`~sparkv.layout.KVChunkId` tuples each run was made tuple by tuple and turned into
``(t, l, g)`` arrays three or four times on its way into the pages (~1.5 ms of the interpreter
per 2 MiB read, ~40 ms of a 4K switch, with the interpreter's lock held while the reader
threads wait). :class:`ChunkIds` is such a list made from, and holding, its array: an immutable
sequence of chunk ids (indexing, slicing, iteration, ``in``, equality with a list) whose
:func:`chunk_array` is the array itself.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterable, Iterator, Sequence, overload

import numpy as np

from sparkv.layout import KVChunkId

__all__ = ["ChunkIds", "chunk_array", "concat"]


class ChunkIds(Sequence[KVChunkId]):
    """An immutable sequence of chunk ids kept as one ``[n, 3]`` int64 array of ``(t, l, g)``
    (:attr:`array`, read-only). Items are :class:`~sparkv.layout.KVChunkId`, made when read."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        a = np.ascontiguousarray(array, dtype=np.int64).reshape(-1, 3)
        if a is array:
            a = a.view()
        a.flags.writeable = False
        self.array: np.ndarray = a

    @classmethod
    def of(cls, cids: Iterable[KVChunkId]) -> "ChunkIds":
        """The chunk ids ``cids`` (any iterable of ``(t, l, g)``)."""
        return cids if isinstance(cids, ChunkIds) else cls(chunk_array(cids))

    @classmethod
    def grid(cls, t: np.ndarray, layers: int, groups: int) -> "ChunkIds":
        """Every ``(layer, group)`` of each token chunk in ``t``, layer-major within a token
        chunk (the order of a token chunk's record)."""
        t = np.asarray(t, dtype=np.int64)
        m = layers * groups
        i = np.arange(m, dtype=np.int64)
        a = np.empty((t.size, m, 3), dtype=np.int64)
        a[:, :, 0] = t[:, None]
        a[:, :, 1] = i // groups
        a[:, :, 2] = i % groups
        return cls(a)

    def __len__(self) -> int:
        return int(self.array.shape[0])

    @overload
    def __getitem__(self, i: int) -> KVChunkId: ...

    @overload
    def __getitem__(self, i: slice) -> "ChunkIds": ...

    def __getitem__(self, i: int | slice) -> "KVChunkId | ChunkIds":
        if isinstance(i, slice):
            return ChunkIds(self.array[i])
        t, l, g = self.array[i].tolist()  # noqa: E741
        return KVChunkId(t, l, g)

    def __iter__(self) -> Iterator[KVChunkId]:
        return itertools.starmap(KVChunkId, self.array.tolist())

    def __contains__(self, cid: object) -> bool:
        if not isinstance(cid, tuple) or len(cid) != 3:
            return False
        return bool((self.array == np.asarray(cid, dtype=np.int64)).all(axis=1).any())

    def take(self, which: np.ndarray) -> "ChunkIds":
        """The ids at positions (or where the bool mask) ``which``."""
        return ChunkIds(self.array[which])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ChunkIds):
            return bool(np.array_equal(self.array, other.array))
        if isinstance(other, (list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ChunkIds({list(self)!r})"


def chunk_array(cids: Iterable[KVChunkId] | Any) -> np.ndarray:
    """``[n, 3]`` int64 ``(t, l, g)`` of chunk ids (a :class:`ChunkIds`' own array; else one pass,
    no tuple per chunk)."""
    if isinstance(cids, ChunkIds):
        return cids.array
    return np.fromiter(itertools.chain.from_iterable(cids), dtype=np.int64).reshape(-1, 3)


def concat(parts: Sequence[Sequence[KVChunkId]]) -> Sequence[KVChunkId]:
    """The chunk ids of ``parts`` one after the other (one array when all are :class:`ChunkIds`,
    else a list)."""
    arrays = [p.array for p in parts if isinstance(p, ChunkIds)]
    if parts and len(arrays) == len(parts):
        return ChunkIds(np.concatenate(arrays))
    return [c for p in parts for c in p]
