"""Chunk ids in arrays (sparkv.cache.ids): a run's ids made from, and kept as, one ``(t, l, g)``
array behave as the list of :class:`~sparkv.layout.KVChunkId` they replace, so the memory's bulk
operations take them without a pass over tuples."""

from __future__ import annotations

import numpy as np
import pytest

from sparkv.cache.ids import ChunkIds, chunk_array, concat
from sparkv.layout import KVChunkId


def _as_list(ts, layers, groups):
    return [KVChunkId(t, i // groups, i % groups) for t in ts for i in range(layers * groups)]


def test_a_grid_is_the_records_chunks_in_their_order():
    ids = ChunkIds.grid(np.array([4, 2, 9]), 5, 3)
    want = _as_list([4, 2, 9], 5, 3)
    assert len(ids) == len(want) and list(ids) == want and ids == want
    assert ids[0] == want[0] and ids[-1] == want[-1] and type(ids[7]) is KVChunkId
    assert ids[3:11] == want[3:11] and isinstance(ids[3:11], ChunkIds)
    assert KVChunkId(2, 4, 1) in ids and KVChunkId(3, 0, 0) not in ids and "x" not in ids
    assert np.array_equal(chunk_array(ids), chunk_array(want))
    assert chunk_array(ids) is ids.array                     # no pass over tuples


def test_ids_are_immutable_and_compare_by_value():
    ids = ChunkIds.of(_as_list([1], 2, 2))
    with pytest.raises(ValueError):
        ids.array[0, 0] = 7
    assert ids == ChunkIds(np.array([[1, 0, 0], [1, 0, 1], [1, 1, 0], [1, 1, 1]]))
    assert ids != _as_list([2], 2, 2) and ids != ChunkIds.of([])
    assert ChunkIds.of(ids) is ids
    with pytest.raises(TypeError):
        hash(ids)
    assert ids.take(np.array([False, True, False, True])) == [KVChunkId(1, 0, 1),
                                                               KVChunkId(1, 1, 1)]


def test_concat_keeps_arrays_when_it_can():
    a, b = ChunkIds.grid(np.array([0]), 2, 1), ChunkIds.grid(np.array([1]), 2, 1)
    both = concat([a, b])
    assert isinstance(both, ChunkIds) and both == list(a) + list(b)
    mixed = concat([a, list(b)])
    assert isinstance(mixed, list) and mixed == list(a) + list(b)
