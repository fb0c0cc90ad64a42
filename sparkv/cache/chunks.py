"""The chunk-level memory of one context: :class:`ChunkMemory` (the data of
:class:`~sparkv.cache.memory.ContextKV`, docs/kv-memory.md).

What the memory knows of each chunk - residency, level, source, entries kept per head, its flash
copy - is a row of arrays (:class:`~sparkv.cache.table.ChunkTable`). Each layer holds its resident
entries in one of two forms:

* **arena** (:class:`~sparkv.cache.layer.LayerStore`): the layer's fp entries in one place, dense
  (slot = position: what loading and generation use, with no copy) or ragged (per head, explicit
  positions: after pruning an arena). Every chunk of an arena layer is resident at ``fp``.
* **paged** (``PAGED``): each resident chunk's entries in fixed-size pages of the pool of its
  level (:mod:`sparkv.cache.pages`), found through the block table
  (:class:`~sparkv.cache.paged.PagedChunks`), so a run of chunks can be re-levelled, written to
  flash or dropped with one array operation per level, without touching the others.

The account (:attr:`ChunkMemory.nbytes`) is the arenas' bytes plus the pages held; it equals
:meth:`ChunkMemory.recount` (recounted from the tensors and the block table: tested).

Thread safety: chunk writes from several threads (a decode worker, a compute thread, readers)
are safe: dense arena writes touch disjoint slots, everything else runs under the memory's lock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

from sparkv.cache.arena import arena_run
from sparkv.cache.ids import ChunkIds
from sparkv.cache.layer import KVMemoryError, LayerStore
from sparkv.cache.levels import LEVELS, Residency, Source
from sparkv.cache.pages import PagePools
from sparkv.cache.paged import PagedChunks, run_of
from sparkv.cache.payload import ChunkPayload, ChunkRun, contiguous_positions
from sparkv.cache.table import ABSENT, RESIDENT, ChunkState, ChunkTable, TokenRows
from sparkv.layout import ChunkGeometry, KVChunkId

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]

#: a layer's form: an fp arena, or pages (``PAGED``: each chunk on its own)
ARENA = "arena"
PAGED = "paged"


@dataclass
class MemoryAccount:
    """Bytes held, by form: the arenas, and the pages held per level."""

    arena: int = 0
    resident: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.arena + sum(self.resident.values())


class HeldChunks:
    """What one context holds and where: the chunk table (:attr:`table`), the paged chunks
    over the page pools (:attr:`paged`), the arenas (:attr:`layers`, :attr:`mode`) and the
    account, and chunk reads. :class:`ChunkMemory` adds chunk writes;
    :class:`~sparkv.cache.memory.ContextKV` the operations (forms, levels, tiers, attention,
    growth).

    Args:
        geometry: how the context is cut into chunks.
        dtype, device: of the fp entries (the model's).
        spare_tokens: extra dense slots per layer for tokens appended later (appending past them
            grows the arena by an eighth, at least 64 slots).
        paged: every layer starts paged, with no arena (a context service building a memory
            chunk by chunk, or reopening one from flash).
        pools: page pools shared with other contexts (``None``: the memory's own).
    """

    def __init__(self, geometry: ChunkGeometry, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", *, spare_tokens: int = 0,
                 paged: bool = False, pools: PagePools | None = None,
                 lazy: bool = False) -> None:
        self.geometry = geometry
        self.dtype, self.device = dtype, torch.device(device)
        cap = geometry.num_tokens + max(0, int(spare_tokens))
        self.layers: list[LayerStore | None] = [
            None if paged else
            LayerStore(geometry.num_kv_heads, geometry.head_dim, cap, dtype, self.device,
                       lazy=lazy)
            for _ in range(geometry.num_layers)]
        self.mode = [PAGED if paged else ARENA] * geometry.num_layers
        self.table = ChunkTable(geometry)
        self.paged = PagedChunks(geometry, pools, dtype, self.device)
        self._lock = threading.RLock()
        self.positions = [geometry.num_tokens] * geometry.num_layers  # positions seen per layer
        self._arena_bytes = sum(x.nbytes for x in self.layers if x is not None)
        self._version = [0] * geometry.num_layers  # bumped when a layer's entries change

    # ---- the chunk table -------------------------------------------------------------------------
    def state(self, cid: KVChunkId) -> ChunkState:
        """A snapshot of the chunk's row (its ``payload`` reads a paged chunk's entries); a chunk
        outside the geometry is absent."""
        if self.table.indices([cid])[0] < 0:
            return ChunkState()
        with self._lock:
            read = (lambda: self.read(cid)) if self.mode[cid.l] == PAGED else None
            return self.table.state(self.table.index(cid), read)

    def chunk_ids(self) -> Iterator[KVChunkId]:
        return self.geometry.chunk_ids()

    def residency(self, cid: KVChunkId) -> Residency:
        return self.state(cid).residency

    def token_residency(self) -> tuple[int, int, int]:
        """Token chunks ``(resident, flash, absent)``, from the table's column at once: a token
        chunk is resident when every chunk of it (each layer and group) is, absent when any is,
        else on flash."""
        g = self.geometry
        with self._lock:
            rows = self.table.residency.reshape(g.num_token_chunks, -1)
            resident = int((rows == RESIDENT).all(axis=1).sum())
            absent = int((rows == ABSENT).any(axis=1).sum())
        return resident, g.num_token_chunks - resident - absent, absent

    def level(self, cid: KVChunkId) -> str:
        return self.state(cid).level

    def source(self, cid: KVChunkId) -> str | None:
        st = self.state(cid)
        return None if st.source is None else str(st.source)

    def has(self, cid: KVChunkId) -> bool:
        """Whether ``cid`` is resident (at any level)."""
        return not self.missing([cid])

    def missing(self, cids: Iterable[KVChunkId]) -> list[KVChunkId]:
        ids = cids if isinstance(cids, ChunkIds) else list(cids)
        return [c for c, r in zip(ids, self.resident(ids)) if not r]

    def resident(self, cids: Sequence[KVChunkId]) -> np.ndarray:
        """Whether each of ``cids`` is resident (bool per chunk)."""
        with self._lock:
            return self.table.is_resident(self.table.indices(cids))

    def is_complete(self) -> bool:
        with self._lock:
            return bool((self.table.residency == RESIDENT).all())

    def sources(self) -> dict[KVChunkId, str]:
        with self._lock:
            return self.table.sources()

    def by_token(self) -> TokenRows:
        """The chunk table's rows by token chunk (a copy: residency, level, dirty, flash copy)."""
        with self._lock:
            return self.table.by_token()

    def kept(self, cid: KVChunkId) -> tuple[int, ...]:
        """Entries kept per head of the chunk's group."""
        with self._lock:
            return tuple(int(c) for c in self.table.counts[self.table.index(cid)])

    # ---- the account -----------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes held: the arenas' tensors and the pages held (kept as they change)."""
        with self._lock:
            return self._arena_bytes + self.paged.nbytes()

    @property
    def reserved_bytes(self) -> int:
        """Bytes the tensors take: the arenas' and the page pools' capacity."""
        with self._lock:
            return self._arena_bytes + self.paged.pools.reserved_bytes

    def account(self) -> MemoryAccount:
        with self._lock:
            return MemoryAccount(self._arena_bytes, {lv: self.paged.nbytes(lv) for lv in LEVELS})

    def resident_bytes_by_token(self) -> dict[int, int]:
        """Bytes of pages held per token chunk ``t`` (token chunks holding none left out)."""
        with self._lock:
            per = self.paged.bytes_by_token()
        return {int(t): int(b) for t, b in enumerate(per) if b}

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held: the arenas' and the page pools' (:attr:`reserved_bytes`)."""
        with self._lock:
            return [t for x in self.layers if x is not None for t in x.tensors()] + \
                [t for p in self.paged.pools.pools.values() for t in p.tensors()]

    def recount(self) -> int:
        """:attr:`nbytes` recounted: the arenas' tensors plus the block table's pages."""
        with self._lock:
            return sum(x.nbytes for x in self.layers if x is not None) + self.paged.recount()

    def reserve_pages(self, pages: dict[str, int] | None) -> None:
        """Room in the page pools for ``pages`` (level -> pages) more than held now, each pool
        reallocated once at most (a load about to swap in many runs), kept until
        ``reserve_pages(None)``; the account (pages held) is unchanged."""
        with self._lock:
            for level, pool in self.paged.pools.pools.items():
                pool.reserve((pages or {}).get(level, 0))

    def arena_resized(self, l: int, before: int) -> None:  # noqa: E741
        """Layer ``l``'s arena, ``before`` bytes, may have grown: the account follows."""
        with self._lock:
            store = self.layers[l]
            self._arena_bytes += (store.nbytes if store is not None else 0) - before

    def mark_changed(self, layers: Iterable[int]) -> None:
        """The layers' entries changed (:meth:`layer_version`)."""
        with self._lock:
            for l in set(int(x) for x in layers):  # noqa: E741
                self._version[l] += 1

    def set_arena(self, l: int, store: LayerStore | None) -> LayerStore | None:  # noqa: E741
        """Installs ``store`` as layer ``l``'s arena (``None``: the layer is paged); returns the
        one it replaces, the account following. For a caller building an arena itself (growing
        a working memory layer by layer); the chunk table is unchanged."""
        with self._lock:
            old = self.layers[l]
            self.layers[l] = store
            self.mode[l] = ARENA if store is not None else PAGED
            self._arena_bytes += (store.nbytes if store is not None else 0) \
                - (old.nbytes if old is not None else 0)
            self.mark_changed([l])
            return old

    def regrow(self, geometry: ChunkGeometry) -> None:
        """The context now has ``geometry``'s tokens (more): new chunks are absent, every layer
        has seen its positions (:mod:`~sparkv.cache.growth`)."""
        with self._lock:
            self.geometry = geometry
            self.table.grow(geometry)
            self.paged.grow(geometry.num_token_chunks)
            self.positions = [geometry.num_tokens] * geometry.num_layers

    # ---- reads -----------------------------------------------------------------------------------
    def read(self, cid: KVChunkId) -> ChunkPayload:
        """A copy of the chunk's entries as held (its level, its kept subset). Raises when the
        chunk is not resident."""
        return self.read_runs([cid])[0].payloads()[0]

    def read_runs(self, cids: Sequence[KVChunkId]) -> list[ChunkRun]:
        """Copies of resident chunks' entries: one run per level of the paged ones (a gather
        per pool tensor), one per arena layer of the others (a gather per arena tensor)."""
        with self._lock:
            missing = self.missing(cids)
            if missing:
                raise KVMemoryError(f"{missing[0]} is not resident ({self.residency(missing[0])})")
            runs, paged = [], [c for c in cids if self.layers[c.l] is None]
            for l in sorted({c.l for c in cids if self.layers[c.l] is not None}):  # noqa: E741
                store = self.layers[l]
                assert store is not None
                runs.append(arena_run(store, self.geometry, l,
                                      [(c.t, c.g) for c in cids if c.l == l]))
            return runs + [run for _, run in self.paged.read(*run_of(paged))] if paged else runs

    def read_paged(self, t: np.ndarray, l: np.ndarray, g: np.ndarray  # noqa: E741
                   ) -> list[tuple[np.ndarray, ChunkRun]]:
        """Copies of paged chunks' entries, given as ``t, l, g`` arrays: per level held,
        ``(which, run)`` with ``which`` the positions in ``t, l, g`` of the run's chunks (one
        gather per pool tensor; chunks without pages - not resident, or in an arena - left
        out)."""
        with self._lock:
            return self.paged.read(np.asarray(t), np.asarray(l), np.asarray(g))

    def resident_payloads(self) -> dict[KVChunkId, ChunkPayload]:
        """Copies of every resident paged chunk's entries (one gather per level)."""
        with self._lock:
            idx = np.flatnonzero(self.table.residency == RESIDENT)
            t, l, g = self.table.chunk_of(idx)  # noqa: E741
            keep = np.array([self.layers[x] is None for x in l.tolist()], dtype=bool)
            runs = self.paged.read(t[keep], l[keep], g[keep]) if keep.any() else []
        return {p.cid: p for _, run in runs for p in run.payloads()}


class ChunkMemory(HeldChunks):
    """:class:`HeldChunks` with chunk writes: whole fp chunks into their layer's arena or pages,
    payloads and runs at any level into pages, a layer's arena moved into pages."""

    # ---- writes ----------------------------------------------------------------------------------
    def put(self, cid: KVChunkId, k: torch.Tensor, v: torch.Tensor,
            source: Source | str = Source.INJECTED, overwrite: bool = True,
            non_blocking: bool = False) -> bool:
        """Writes a whole chunk (``[Hg, n_t, D]``, every token of its range, fp). Returns whether
        it was written (``overwrite=False`` keeps a chunk already resident). ``non_blocking``:
        an asynchronous host-to-device copy from pinned memory on the current CUDA stream (the
        caller synchronises that stream before anyone reads the chunk)."""
        k, v = _check_chunk(self.geometry, cid, k, v)
        source, (t0, t1) = Source(source), self.geometry.token_range(cid.t)
        while True:       # again when the layer changed form while it was written
            with self._lock:
                if not overwrite and self.has(cid):
                    return False
                store = self.layers[cid.l]
                if store is None:
                    n = [t1 - t0] * int(k.shape[0])
                    self.hold([ChunkRun([cid], "fp", np.array([n]), contiguous_positions(n, t0),
                                        k.reshape(-1, k.shape[2]), v.reshape(-1, v.shape[2]),
                                        self.dtype)], source)
                    return True
            if self._write_arena(store, cid, k, v, source, non_blocking):
                return True

    def _write_arena(self, store: LayerStore, cid: KVChunkId, k: torch.Tensor, v: torch.Tensor,
                     source: Source, non_blocking: bool) -> bool:
        """Writes a whole chunk into its layer's arena ``store`` and marks it resident; ``False``
        when the layer left that arena meanwhile (another thread moved it into pages: a
        compressed chunk streamed into a layer being computed), so that the chunk, not resident
        when the arena's entries were moved, is written again into the layer's new form. A
        dense write runs outside the lock (chunks of one layer are written in parallel); a
        ragged one moves entries, so under it."""
        (t0, _), h0 = self.geometry.token_range(cid.t), cid.g * k.shape[0]
        before = store.nbytes
        k, v = k.to(self.dtype), v.to(self.dtype)
        if not store.ragged:
            store.write_dense(h0, h0 + k.shape[0], t0, k, v, non_blocking)
        with self._lock:
            if self.layers[cid.l] is not store:
                return False
            if store.ragged:
                store.write_ragged(h0, t0, k, v)
            self.arena_resized(cid.l, before)
            self.table.set_resident(np.array([self.table.index(cid)]), "fp", source)
        return True

    def put_payload(self, payload: ChunkPayload, source: Source | str = Source.INJECTED) -> None:
        """Places a chunk's entries as they are (any level, any kept subset), in pages."""
        self.put_payloads([payload], source)

    def put_payloads(self, payloads: Sequence[ChunkPayload],
                     source: Source | str = Source.INJECTED) -> None:
        """:meth:`put_payload` for many chunks: one page write per level."""
        self.hold(self.runs(payloads), Source(source))

    def runs(self, payloads: Sequence[ChunkPayload]) -> list[ChunkRun]:
        """``payloads`` as runs, one per level (checked against the geometry)."""
        by_level: dict[str, list[ChunkPayload]] = {}
        for p in payloads:
            self.geometry.check(p.cid)
            by_level.setdefault(p.level, []).append(p)
        return [ChunkRun.join(ps) for ps in by_level.values()]

    def hold(self, runs: Sequence[ChunkRun], source: Source | None, clean: bool = False) -> None:
        """Holds ``runs`` in pages (their layers paged first): resident at the runs' levels,
        from ``source`` (``None``: keep each chunk's, ``restored`` if it had none); ``clean``:
        equal to their flash copies."""
        with self._lock:
            for run in runs:
                t, l, g = run_of(run.cids)  # noqa: E741
                for layer in sorted(set(l.tolist())):
                    self.to_pages(layer)
                idx = self.table.indices(run.cids)
                self.paged.write(t, l, g, run)
                self.table.set_resident(idx, run.level, source, run.counts)
                if clean:
                    self.table.mark_clean(idx)
                self.mark_changed(np.unique(l).tolist())

    def put_step_output(self, t: int, l: int, k: torch.Tensor, v: torch.Tensor,  # noqa: E741
                        source: Source | str = Source.COMPUTED) -> None:
        """Writes every group of step ``(t, l)`` from ``[1, H, n_t, D]`` tensors, keeping chunks
        already resident (a streamed chunk is not overwritten)."""
        for g in range(self.geometry.num_groups):
            h0, h1 = self.geometry.head_range(g)
            self.put(KVChunkId(t, l, g), k[0, h0:h1], v[0, h0:h1], source, overwrite=False)

    def to_pages(self, l: int) -> None:  # noqa: E741
        """Moves layer ``l``'s resident entries into fp pages (one gather, one page write) and
        frees its arena. A layer already paged is left as it is (its version unchanged)."""
        with self._lock:
            store = self.layers[l]
            if store is None:
                return
            rows = self.table.layer_rows(l)
            held = rows[self.table.is_resident(rows)]
            if held.size:
                t, _, g = self.table.chunk_of(held)
                run = arena_run(store, self.geometry, l, list(zip(t.tolist(), g.tolist())))
                self.paged.write(t, np.full_like(t, l), g, run)   # counts as the table's
            self.set_arena(l, None)


def _check_chunk(g: ChunkGeometry, cid: KVChunkId, k: torch.Tensor, v: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        g.check(cid)
    except IndexError as e:
        raise KVMemoryError(f"{cid}: {e}") from None
    if k.dim() == 4 and k.shape[0] == 1:
        k, v = k[0], v[0]
    want = g.chunk_shape(cid)
    if tuple(k.shape) != want or tuple(v.shape) != want:
        raise KVMemoryError(f"{cid}: expected K/V of shape {want}, got {tuple(k.shape)} and "
                            f"{tuple(v.shape)}")
    return k, v
