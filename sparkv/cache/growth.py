"""A context that grows, for :class:`~sparkv.cache.memory.ContextKV` (it calls these): tokens
appended by generation (:func:`append`, :func:`truncate`, :func:`commit_appended`) and a context
extended by tokens computed elsewhere (:func:`extend`). The geometry changes only through
:meth:`ContextKV.regrow <sparkv.cache.memory.ContextKV.regrow>`.
"""

from __future__ import annotations

import numpy as np
import torch

from sparkv.cache.chunks import ChunkMemory
from sparkv.cache.forms import materialize
from sparkv.cache.layer import KVMemoryError
from sparkv.cache.levels import Source
from sparkv.cache.paged import run_of
from sparkv.layout import ChunkGeometry, KVChunkId



def _grown(g: ChunkGeometry, num_tokens: int) -> ChunkGeometry:
    return ChunkGeometry(num_tokens, g.chunk_tokens, g.num_layers, g.num_kv_heads, g.head_dim,
                         g.heads_per_group)


def append(mem: ChunkMemory, l: int, k: torch.Tensor, v: torch.Tensor  # noqa: E741
           ) -> torch.Tensor:
    """:meth:`ContextKV.append <sparkv.cache.memory.ContextKV.append>` (under the lock)."""
    q = int(k.shape[1])
    start = mem.positions[l]
    positions = torch.arange(start, start + q, device=mem.device)
    store = mem.layers[l]
    if store is None:
        materialize(mem, l, spare_tokens=max(q, 64))
        store = mem.layers[l]
    assert store is not None
    before = store.nbytes
    store.append(k.to(mem.dtype), v.to(mem.dtype), positions)
    mem.arena_resized(l, before)
    mem.positions[l] = start + q
    return positions


def appended(mem: ChunkMemory, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:meth:`ContextKV.appended <sparkv.cache.memory.ContextKV.appended>` (under the lock)."""
    n = mem.geometry.num_tokens
    if count < 0 or any(p < n + count for p in mem.positions):
        raise KVMemoryError(f"the memory holds fewer than {count} appended tokens")
    rows: list[tuple[torch.Tensor, torch.Tensor]] = []
    for store in mem.layers:
        if store is None:
            raise KVMemoryError("appended tokens live in arena layers")
        if not store.ragged:
            k, v = store.prefix(n + count)
            rows.append((k[0, :, n:].clone(), v[0, :, n:].clone()))
            continue
        heads = [store.read_range(h, n, n + count) for h in range(store.num_heads)]
        if any(int(e.pos.numel()) != count for e in heads):
            raise KVMemoryError("a head does not hold every appended token")
        rows.append((torch.stack([e.k for e in heads]), torch.stack([e.v for e in heads])))
    return rows


def truncate(mem: ChunkMemory) -> None:
    """:meth:`ContextKV.truncate <sparkv.cache.memory.ContextKV.truncate>` (under the lock)."""
    n = mem.geometry.num_tokens
    for l, store in enumerate(mem.layers):  # noqa: E741
        if mem.positions[l] <= n:
            continue
        if store is not None and store.ragged:
            for h in range(store.num_heads):
                store.length[h] = int(store.positions_in(h, 0, n).numel())
        elif store is not None:
            store.end = min(store.end, n)
        mem.positions[l] = n


def extend(mem: ChunkMemory, num_tokens: int) -> list[KVChunkId]:
    """:meth:`ContextKV.extend <sparkv.cache.memory.ContextKV.extend>` (under the lock)."""
    old = mem.geometry
    if num_tokens < old.num_tokens:
        raise KVMemoryError(f"cannot shrink a context from {old.num_tokens} to {num_tokens} "
                            "tokens")
    if num_tokens == old.num_tokens:
        return []
    if any(s is not None for s in mem.layers):
        raise KVMemoryError("extend() grows paged layers; arena layers grow by appending "
                            "(commit_appended)")
    if max(mem.positions) > old.num_tokens:
        raise KVMemoryError("the memory holds appended tokens not committed")
    reset: list[KVChunkId] = []
    t = old.num_token_chunks - 1
    if old.chunk_len(t) < old.chunk_tokens:
        reset = [KVChunkId(t, l, g) for l in range(old.num_layers)  # noqa: E741
                 for g in range(old.num_groups)]
        mem.paged.free(*run_of(reset))
    mem.regrow(_grown(old, num_tokens))
    if reset:
        mem.table.reset(mem.table.indices(reset))
        mem.mark_changed(range(old.num_layers))
    return reset


def commit_appended(mem: ChunkMemory) -> int:
    """:meth:`ContextKV.commit_appended <sparkv.cache.memory.ContextKV.commit_appended>` (under
    the lock)."""
    n = min(mem.positions)
    old = mem.geometry
    if n <= old.num_tokens:
        return old.num_tokens
    if max(mem.positions) != n:
        raise KVMemoryError(f"layers have seen different positions {set(mem.positions)}")
    if any(s is None for s in mem.layers):
        raise KVMemoryError("appended tokens live in arena layers")
    new = _grown(old, n)
    mem.regrow(new)
    table = mem.table
    for l, store in enumerate(mem.layers):  # noqa: E741
        assert store is not None
        for t in range(old.num_token_chunks - 1, new.num_token_chunks):
            t0, t1 = new.token_range(t)
            for gg in range(new.num_groups):
                h0, h1 = new.head_range(gg)
                i = np.array([table.index(KVChunkId(t, l, gg))])
                counts = np.array([[t1 - t0] * (h1 - h0)])
                if store.ragged:
                    counts = np.array([[store.positions_in(h, t0, t1).numel()
                                        for h in range(h0, h1)]])
                if not table.is_resident(i)[0]:
                    table.set_resident(i, "fp", Source.APPENDED, counts)
                else:
                    table.set_counts(i, counts)
    return n
