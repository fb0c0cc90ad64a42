"""Moving chunks between tiers, for :class:`~sparkv.cache.memory.ContextKV` (which calls these
under its lock): down and up the resident levels (:func:`set_levels`, one conversion per level a
run is at), to and from the flash tier (:func:`swap_out`, :func:`swap_in`,
:func:`swap_in_runs`), out of RAM (:func:`drop`), and the flash copies' records
(:func:`attach_flash`, :func:`forget_flash`). They work through the memory's chunk table and
paged chunks, and put entries into pages with :meth:`ContextKV.hold
<sparkv.cache.memory.ContextKV.hold>`.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from sparkv.cache.chunks import ChunkMemory
from sparkv.cache.flash import FlashRef, FlashTier
from sparkv.cache.ids import ChunkIds
from sparkv.cache.layer import KVMemoryError
from sparkv.cache.levels import LEVELS, Source, reachable
from sparkv.cache.paged import Fill, run_of
from sparkv.cache.payload import ChunkRun, PayloadError, from_bytes, to_bytes
from sparkv.cache.table import RESIDENT
from sparkv.layout import KVChunkId


def set_levels(mem: ChunkMemory, cids: Sequence[KVChunkId], level: str) -> int:
    """:meth:`ContextKV.set_levels <sparkv.cache.memory.ContextKV.set_levels>`."""
    if level not in LEVELS:
        raise KVMemoryError(f"unknown level {level!r}; known: {', '.join(LEVELS)}")
    missing = mem.missing(cids)
    if missing:
        raise KVMemoryError(f"{missing[0]} is not resident")
    for layer in sorted({c.l for c in cids}):
        mem.to_pages(layer)
    idx = mem.table.indices(cids)
    held = mem.table.level[idx]
    for code in np.unique(held):
        if not reachable(LEVELS[int(code)], level):
            bad = cids[int(np.flatnonzero(held == code)[0])]
            raise KVMemoryError(f"{bad}: cannot go from {LEVELS[int(code)]} to {level}: lower "
                                "levels come from fp or the int8 base")
    change = held != LEVELS.index(level)
    if not change.any():
        return 0
    cids = [c for c, x in zip(cids, change) if x]
    idx = idx[change]
    before = mem.paged.nbytes()
    t, ll, g = run_of(cids)
    try:
        mem.paged.relevel(t, ll, g, level)
    except PayloadError as e:  # pragma: no cover - reachable() refuses these first
        raise KVMemoryError(str(e)) from None
    mem.table.set_level(idx, level)
    mem.mark_changed(np.unique(ll).tolist())
    return before - mem.paged.nbytes()


def swap_out(mem: ChunkMemory, cid: KVChunkId, tier: FlashTier, keep_resident: bool,
             name: str | None) -> int:
    """:meth:`ContextKV.swap_out <sparkv.cache.memory.ContextKV.swap_out>`."""
    mem.to_pages(cid.l)
    i = mem.table.index(cid)
    if mem.table.residency[i] != RESIDENT:
        raise KVMemoryError(f"{cid} is not resident: nothing to swap out")
    written = 0
    old = mem.table.ref(i)
    if mem.table.dirty[i] or old is None:
        data = to_bytes(mem.read(cid))
        if old is not None:
            tier.delete(old)
        ref = tier.write(name or f"{cid.t}.{cid.l}.{cid.g}.skvc", data)
        mem.table.set_flash(np.array([i]), [ref])
        written = len(data)
    if not keep_resident:
        drop(mem, [cid])
    return written


def swap_in(mem: ChunkMemory, cid: KVChunkId, tier: FlashTier) -> int:
    """:meth:`ContextKV.swap_in <sparkv.cache.memory.ContextKV.swap_in>`."""
    ref = mem.table.ref(mem.table.index(cid))
    if ref is None:
        raise KVMemoryError(f"{cid} has no flash copy")
    data = tier.read(ref)
    swap_in_runs(mem, [ChunkRun.join([from_bytes(data, expect=cid)])])
    return len(data)


def swap_in_runs(mem: ChunkMemory, runs: Sequence[ChunkRun],
                 refs: Sequence[FlashRef] | None = None) -> None:
    """:meth:`ContextKV.swap_in_runs <sparkv.cache.memory.ContextKV.swap_in_runs>`."""
    _flash_copies(mem, [c for run in runs for c in run.cids], refs)
    mem.hold(runs, None, clean=True)


def _flash_copies(mem: ChunkMemory, cids: Sequence[KVChunkId],
                  refs: Sequence[FlashRef] | None) -> None:
    """Records ``refs`` as the chunks' flash copies, or (``None``) checks that each has one."""
    if refs is not None and len(refs) != len(cids):
        raise KVMemoryError("one flash ref per chunk")
    idx = mem.table.indices(cids)
    if (idx < 0).any():
        mem.geometry.check(cids[int(np.flatnonzero(idx < 0)[0])])   # raises, naming it
    if refs is None:
        nocopy = np.flatnonzero(mem.table.flash[idx] < 0)
        if nocopy.size:
            raise KVMemoryError(f"{cids[int(nocopy[0])]} has no flash copy")
    else:
        mem.table.set_flash(idx, list(refs))


def swap_in_placed(mem: ChunkMemory, cids: Sequence[KVChunkId], level: str, counts: np.ndarray,
                   pos: torch.Tensor, fill: Fill) -> ChunkRun:
    """:meth:`ContextKV.swap_in_placed <sparkv.cache.memory.ContextKV.swap_in_placed>`:
    :meth:`~sparkv.cache.chunks.ChunkMemory.hold` of one run, its rows written by ``fill``."""
    _flash_copies(mem, cids, None)
    t, l, g = run_of(cids)  # noqa: E741
    for layer in sorted(set(l.tolist())):
        mem.to_pages(layer)
    idx = mem.table.indices(cids)
    k, v = mem.paged.place(t, l, g, level, counts, pos, fill)
    mem.table.set_resident(idx, level, None, counts)
    mem.table.mark_clean(idx)
    mem.mark_changed(np.unique(l).tolist())
    return ChunkRun(cids if isinstance(cids, ChunkIds) else list(cids), level, counts, pos, k, v,
                    mem.dtype)


def drop(mem: ChunkMemory, cids: Sequence[KVChunkId]) -> int:
    """Frees the chunks' RAM copies: ``flash`` where a clean flash copy exists, else ``absent``.
    Returns the bytes freed."""
    for layer in sorted({c.l for c in cids}):
        mem.to_pages(layer)
    idx = mem.table.indices(cids)
    res = mem.table.is_resident(idx)
    if not res.any():
        return 0
    t, ll, g = run_of([c for c, r in zip(cids, res) if r])
    freed = mem.paged.free(t, ll, g)
    mem.table.evict(idx[res])
    mem.mark_changed(np.unique(ll).tolist())
    return freed


def attach_flash(mem: ChunkMemory, cids: Sequence[KVChunkId], refs: Sequence[FlashRef],
                 levels: Sequence[str], source: Source | str) -> None:
    """:meth:`ContextKV.attach_flash_many <sparkv.cache.memory.ContextKV.attach_flash_many>`:
    one table update per level."""
    if not (len(cids) == len(refs) == len(levels)):
        raise KVMemoryError("one flash ref and one level per chunk")
    for level in set(levels):
        if level not in LEVELS:
            raise KVMemoryError(f"unknown level {level!r}; known: {', '.join(LEVELS)}")
    for cid in cids:
        mem.geometry.check(cid)
    idx = mem.table.indices(cids)
    mem.table.set_flash(idx, list(refs))
    away = ~mem.table.is_resident(idx)
    lv = np.array(levels, dtype=object)
    for level in set(levels):
        sel = away & (lv == level)
        if sel.any():
            mem.table.set_on_flash(idx[sel], level, Source(source))


def forget_flash(mem: ChunkMemory, cid: KVChunkId, tier: FlashTier | None) -> None:
    """:meth:`ContextKV.forget_flash <sparkv.cache.memory.ContextKV.forget_flash>`."""
    i = mem.table.index(cid)
    ref = mem.table.ref(i)
    if ref is None:
        return
    if tier is not None:
        tier.delete(ref)
    mem.table.forget_flash(np.array([i]))
