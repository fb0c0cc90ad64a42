"""A layer's form changes and pruning, for :class:`~sparkv.cache.memory.ContextKV` (which calls
them under its lock): :func:`materialize` (pages -> arena; the way in is :meth:`ChunkMemory.to_pages
<sparkv.cache.chunks.ChunkMemory.to_pages>`),
:func:`prune_layer` (into a ragged arena), :func:`prune_pages` (in pages, at their levels). They
work through the memory's parts - its chunk table, its paged chunks,
:meth:`~sparkv.cache.chunks.ChunkMemory.set_arena` for the arenas - and each is a fixed number of
array operations per level, whatever the number of chunks.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from sparkv.cache.arena import arena_from_runs
from sparkv.cache.chunks import ChunkMemory
from sparkv.cache.layer import KVMemoryError
from sparkv.cache.paged import run_of
from sparkv.layout import KVChunkId


def layer_cids(mem: ChunkMemory, l: int) -> list[KVChunkId]:  # noqa: E741
    """Layer ``l``'s chunk ids, token chunk major."""
    g = mem.geometry
    return [KVChunkId(t, l, gg) for t in range(g.num_token_chunks) for gg in range(g.num_groups)]


def materialize(mem: ChunkMemory, l: int, spare_tokens: int = 0) -> None:  # noqa: E741
    """Moves paged layer ``l`` into a new fp arena (:func:`~sparkv.cache.arena.arena_from_runs`:
    one dequantization per level); every chunk of the layer must be resident."""
    cids = layer_cids(mem, l)
    missing = mem.missing(cids)
    if missing:
        raise KVMemoryError(f"layer {l} cannot be materialized: {len(missing)} chunks are "
                            f"not resident, first {missing[0]}")
    t, ll, g = run_of(cids)
    runs = [run for _, run in mem.paged.read(t, ll, g)]
    store = arena_from_runs(runs, mem.geometry, mem.dtype, mem.device, spare_tokens)
    mem.paged.free(t, ll, g)
    mem.table.set_level(mem.table.indices(cids), "fp")
    mem.set_arena(l, store)


def _keep_lists(mem: ChunkMemory, l: int, keep: Sequence[torch.Tensor]  # noqa: E741
                ) -> list[torch.Tensor]:
    """``keep`` checked (one sorted list per KV head, positions seen) with layer ``l``'s chunks
    all resident."""
    g = mem.geometry
    if len(keep) != g.num_kv_heads:
        raise KVMemoryError(f"keep lists {len(keep)} heads; the model has {g.num_kv_heads}")
    keep = [torch.as_tensor(x, dtype=torch.long).cpu().sort().values for x in keep]  # host lists
    n = mem.positions[l]
    for h, x in enumerate(keep):
        if x.numel() and (int(x[0]) < 0 or int(x[-1]) >= n):
            raise KVMemoryError(f"head {h}: positions to keep must be in [0, {n})")
    missing = mem.missing(layer_cids(mem, l))
    if missing:
        raise KVMemoryError(f"layer {l} cannot be pruned: {missing[0]} is not resident")
    return keep


def prune_layer(mem: ChunkMemory, l: int, keep: Sequence[torch.Tensor],  # noqa: E741
                spare_tokens: int = 0) -> None:
    """Layer ``l`` (materialized first if paged) becomes a ragged arena of the entries at
    positions ``keep[h]``, plus ``spare_tokens`` per head."""
    keep = _keep_lists(mem, l, keep)
    if mem.layers[l] is None:
        materialize(mem, l)
    store = mem.layers[l]
    assert store is not None
    g = mem.geometry
    new = store.pruned(keep, spare=spare_tokens)
    bins = [np.bincount(x.numpy() // g.chunk_tokens, minlength=g.num_token_chunks) for x in keep]
    counts = np.stack(bins, axis=1).reshape(g.num_token_chunks * g.num_groups, -1)
    mem.table.set_counts(mem.table.layer_rows(l), counts)
    mem.set_arena(l, new)


def prune_pages(mem: ChunkMemory, l: int, keep: Sequence[torch.Tensor]) -> None:  # noqa: E741
    """Layer ``l`` (paged first if an arena) keeps, in its pages and at their levels, only the
    entries at positions ``keep[h]`` (one pass per level: :meth:`PagedChunks.prune
    <sparkv.cache.paged.PagedChunks.prune>`)."""
    keep = _keep_lists(mem, l, keep)
    if mem.layers[l] is not None:
        mem.to_pages(l)
    mask = torch.zeros(mem.geometry.num_kv_heads, mem.positions[l], dtype=torch.bool)
    for h, x in enumerate(keep):
        mask[h, x] = True
    mem.table.set_counts(mem.table.layer_rows(l), mem.paged.prune(l, mask))
    mem.mark_changed([l])
