"""One context's KV memory: :class:`ContextKV` (docs/kv-memory.md).

The context is cut into chunks ``(t, l, g)`` (:class:`~sparkv.layout.ChunkGeometry`). What the
memory knows of each chunk - residency, level, source, entries kept per head, its flash copy - is
a row of arrays (:class:`~sparkv.cache.table.ChunkTable`). Each layer holds its resident entries
in one of two forms:

* **arena** (:class:`~sparkv.cache.layer.LayerStore`): the layer's fp entries in one place, dense
  (slot = position: what loading and generation use, with no copy) or ragged (per head, explicit
  positions: after pruning an arena). Every chunk of an arena layer is resident at ``fp``.
* **paged** (``PAGED``): each resident chunk's entries in fixed-size pages of the pool of its
  level (:mod:`sparkv.cache.pages`), found through the block table
  (:class:`~sparkv.cache.paged.PagedChunks`), so a run of chunks can be re-levelled, written to
  flash or dropped with one array operation per level, without touching the others. Chunk
  operations switch a layer to this form; :meth:`ContextKV.materialize` switches it back.

The account (:attr:`ContextKV.nbytes`) is the arenas' bytes plus the pages held; it equals
:meth:`ContextKV.recount` (recounted from the tensors and the block table: tested).

Thread safety: chunk writes from several threads (a decode worker, a compute thread, readers)
are safe: dense arena writes touch disjoint slots, everything else runs under the memory's lock.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from sparkv.cache import forms, growth, tiers
from sparkv.cache.arena import arena_entries, layer_heads
from sparkv.cache.chunks import ARENA, PAGED, ChunkMemory, LayerKV
from sparkv.cache.flash import FlashRef, FlashTier
from sparkv.cache.layer import HeadEntries, KVMemoryError
from sparkv.cache.levels import Source
from sparkv.cache.paged import Fill
from sparkv.cache.payload import ChunkPayload, ChunkRun
from sparkv.cache.hostmem import host_addressable
from sparkv.cache.qattend import PagedAttention, TorchPagedAttention
from sparkv.layout import KVChunkId


class ContextKV(ChunkMemory):
    """The KV memory of one context (module docstring): a :class:`~sparkv.cache.chunks.ChunkMemory`
    (the chunk table, the pages, the arenas, the account, chunk reads and writes) with its
    operations: the layer forms (:mod:`~sparkv.cache.forms`), the tier moves
    (:mod:`~sparkv.cache.tiers`), attention (:mod:`~sparkv.cache.qattend`) and growth
    (:mod:`~sparkv.cache.growth`), each run under the memory's lock.

    Args:
        geometry: how the context is cut into chunks.
        dtype, device: of the fp entries (the model's).
        spare_tokens: extra dense slots per layer for tokens appended later (appending past them
            grows the arena by an eighth, at least 64 slots).
        paged: every layer starts paged, with no arena (a context service building a memory
            chunk by chunk, or reopening one from flash).
        pools: page pools shared with other contexts (``None``: the memory's own).
        lazy: the dense arenas take memory page by page as chunks are written
            (:mod:`~sparkv.cache.zeroed`; an edge ask's memory, filled over seconds), instead of
            all at once (``torch.zeros``: a switch's working memory, filled at once by several
            threads, whose page faults would cost more than the zeroing).
    """

    # ---- forms, levels, tiers (sparkv/cache/forms.py, tiers.py) ----------------------------------
    def materialize(self, l: int, spare_tokens: int = 0) -> None:  # noqa: E741
        """Moves paged layer ``l`` into an fp arena (dense when every head keeps every token, else
        ragged); every chunk must be resident; quantized ones are dequantized."""
        with self._lock:
            if self.layers[l] is None:
                forms.materialize(self, l, spare_tokens)

    def prune_layer(self, l: int, keep: Sequence[torch.Tensor], spare_tokens: int = 0  # noqa: E741
                    ) -> None:
        """Keeps, per KV head of layer ``l``, only the entries at positions ``keep[h]`` (real
        memory): the layer becomes a ragged arena sized to what it keeps, plus ``spare_tokens``
        per head (a paged layer is materialized first)."""
        with self._lock:
            forms.prune_layer(self, l, keep, spare_tokens)

    def prune_pages(self, l: int, keep: Sequence[torch.Tensor]) -> None:  # noqa: E741
        """:meth:`prune_layer` in pages: the layer stays paged, each chunk at its level (one
        pass per level)."""
        with self._lock:
            forms.prune_pages(self, l, keep)

    def set_level(self, cid: KVChunkId, level: str) -> int:
        """Re-holds a resident chunk at ``level`` (``int8``/``int4``/``int2`` from fp or from an
        int8 base; ``fp`` dequantizes). Returns the bytes freed (negative: grown)."""
        return self.set_levels([cid], level)

    def set_levels(self, cids: Sequence[KVChunkId], level: str) -> int:
        """:meth:`set_level` for many chunks, one conversion per level they are at; refuses
        (changing nothing) a chunk not resident or a level it cannot reach."""
        with self._lock:
            return tiers.set_levels(self, cids, level)

    def swap_out(self, cid: KVChunkId, tier: FlashTier, *, keep_resident: bool = False,
                 name: str | None = None) -> int:
        """Writes the chunk (at its level) to ``tier`` unless an up-to-date copy is there;
        unless ``keep_resident``, frees its pages (residency ``flash``). Returns the bytes
        written (0 for a clean chunk)."""
        with self._lock:
            return tiers.swap_out(self, cid, tier, keep_resident, name)

    def swap_in(self, cid: KVChunkId, tier: FlashTier) -> int:
        """Reads a flash chunk back (checksum-checked) and holds it resident at its stored
        level. Returns the bytes read."""
        return tiers.swap_in(self, cid, tier)

    def swap_in_payload(self, payload: ChunkPayload, ref: FlashRef | None = None) -> None:
        """Holds ``payload``, just read from the chunk's flash copy (``ref``; default the copy
        recorded), resident and clean: what :meth:`swap_in` does after its read."""
        self.swap_in_runs([ChunkRun.join([payload])], None if ref is None else [ref])

    def swap_in_runs(self, runs: Sequence[ChunkRun], refs: Sequence[FlashRef] | None = None
                     ) -> None:
        """Holds runs of chunks just read from their flash copies (``refs``: one per chunk, in
        the runs' order; default the copies recorded) resident and clean: one page write per
        run (a run of token chunk records at one level is one)."""
        with self._lock:
            tiers.swap_in_runs(self, runs, refs)

    def swap_in_placed(self, cids: Sequence[KVChunkId], level: str, counts: np.ndarray,
                       pos: torch.Tensor, fill: Fill) -> ChunkRun:
        """:meth:`swap_in_runs` of one run (chunks ``cids`` at ``level``, ``counts`` per head,
        positions ``pos``, each with its flash copy recorded) whose rows ``fill(k, v)`` writes
        straight into the new pages (a read buffer's records: no copy of the run first; ``k``,
        ``v`` are views of the pool's rows, or new tensors copied in after when the pages are
        not consecutive). Returns the run as held (views of the pages: valid until the chunks'
        pages change)."""
        with self._lock:
            return tiers.swap_in_placed(self, cids, level, counts, pos, fill)

    def drop(self, cid: KVChunkId) -> int:
        """Frees the chunk's RAM copy: ``flash`` when a clean flash copy exists, else ``absent``
        (to be recomputed or fetched). Returns the bytes freed."""
        return self.drop_many([cid])

    def drop_many(self, cids: Sequence[KVChunkId]) -> int:
        """:meth:`drop` for many chunks (one page release per level)."""
        with self._lock:
            return tiers.drop(self, cids)

    def attach_flash(self, cid: KVChunkId, ref: FlashRef, level: str,
                     source: Source | str = Source.RESTORED) -> None:
        """Records a clean copy of ``cid`` (every token, at ``level``) in ``ref`` (a context
        reopened after a restart): a chunk not resident becomes ``flash``."""
        self.attach_flash_many([cid], [ref], [level], source)

    def attach_flash_many(self, cids: Sequence[KVChunkId], refs: Sequence[FlashRef],
                          levels: Sequence[str], source: Source | str = Source.RESTORED) -> None:
        """:meth:`attach_flash` for many chunks (one table update per level: a token chunk
        record's chunks share its ref)."""
        with self._lock:
            tiers.attach_flash(self, cids, refs, levels, source)

    def forget_flash(self, cid: KVChunkId, tier: FlashTier | None = None) -> None:
        """Deletes the chunk's flash copy (if any)."""
        with self._lock:
            tiers.forget_flash(self, cid, tier)

    def chunk_view(self, cid: KVChunkId) -> tuple[torch.Tensor, torch.Tensor]:
        """Writable ``[Hg, n_t, D]`` views of a chunk's slots (dense arena layers only)."""
        store = self.layers[cid.l]
        if store is None or store.ragged:
            raise KVMemoryError(f"layer {cid.l} is not a dense arena: no slots to view")
        (t0, t1), (h0, h1) = self.geometry.token_range(cid.t), self.geometry.head_range(cid.g)
        before = store.nbytes
        view = store.dense_view(h0, h1, t0, t1)
        self.arena_resized(cid.l, before)
        return view

    def layer_kv(self) -> LayerKV:
        """Per layer ``(K, V)`` ``[1, H, N, D]`` views (every layer dense, every chunk resident)."""
        missing = self.missing(self.geometry.chunk_ids())
        if missing:
            raise KVMemoryError(f"{len(missing)} chunks are still missing, first {missing[0]}")
        if not all(self.is_dense(l) for l in range(self.geometry.num_layers)):  # noqa: E741
            raise KVMemoryError("a layer is not dense: use attention views, not layer_kv()")
        return [s.prefix(self.geometry.num_tokens) for s in self.layers]  # type: ignore

    def is_dense(self, l: int) -> bool:  # noqa: E741
        store = self.layers[l]
        return self.mode[l] == ARENA and store is not None and not store.ragged

    # ---- attention -------------------------------------------------------------------------------
    def layer_entries(self, l: int, stop: int | None = None  # noqa: E741
                      ) -> list[HeadEntries]:
        """Per KV head, layer ``l``'s entries with positions below ``stop``, in position order,
        in fp (views of an arena, else copies, dequantized). Raises when a chunk below ``stop``
        is not resident."""
        stop = self.positions[l] if stop is None else stop
        store = self.layers[l]
        if store is not None:
            return arena_entries(store, stop)
        cids = [c for c in forms.layer_cids(self, l) if c.t * self.geometry.chunk_tokens < stop]
        self._require(cids, l)
        return layer_heads(self.read_runs(cids), self.geometry, self.dtype, self.device, stop)

    def _require(self, cids: Sequence[KVChunkId], l: int) -> None:  # noqa: E741
        missing = self.missing(cids)
        if missing:
            raise KVMemoryError(f"{missing[0]} is not resident ({self.residency(missing[0])}); "
                                f"restore it before attending over layer {l}")

    def layer_version(self, l: int) -> int:  # noqa: E741
        """Changes whenever layer ``l``'s entries change or the page pools are reallocated (a
        :meth:`resident_attention` is stale then)."""
        with self._lock:
            return self._version[l] + self.paged.generation()

    def resident_attention(self, l: int) -> PagedAttention | TorchPagedAttention:  # noqa: E741
        """Attention over paged layer ``l`` as held (one kernel call per layer on the CPU: see
        sparkv/cache/qattend.py); references the pools. Raises when a chunk is not resident."""
        if self.mode[l] != PAGED:
            raise KVMemoryError(f"layer {l} is an arena: attend its tensors directly")
        self._require(forms.layer_cids(self, l), l)
        if not host_addressable(self.device) or self.dtype != torch.float32:
            return TorchPagedAttention(lambda: [(e.k, e.v, e.pos) for e in self.layer_entries(l)])
        with self._lock:
            return PagedAttention(self.paged.pools, self.paged.layer_pages(l),
                                  self.geometry.head_dim)

    # ---- growth (sparkv/cache/growth.py) ---------------------------------------------------------
    def append(self, l: int, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # noqa: E741
        """Appends ``[H, q, D]`` new entries to layer ``l`` at the next positions (in place in
        an arena; a paged layer is materialized first). Returns their positions."""
        with self._lock:
            return growth.append(self, l, k, v)

    def appended(self, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the first ``count`` appended entries (positions ``N .. N+count``, not yet
        committed), per layer ``(K, V)`` ``[H, count, D]``: what :meth:`append` takes back."""
        with self._lock:
            return growth.appended(self, count)

    def truncate(self) -> None:
        """Forgets every appended entry not committed (generation over a context that must stay
        as it was: a reference, a benchmark)."""
        with self._lock:
            growth.truncate(self)

    def extend(self, num_tokens: int) -> list[KVChunkId]:
        """Grows a context whose every layer is paged to ``num_tokens`` tokens: the new chunks
        are absent; a partial last token chunk is reset (freed, its flash copy forgotten).
        Returns the chunks reset."""
        with self._lock:
            return growth.extend(self, num_tokens)

    def commit_appended(self) -> int:
        """Makes the appended tokens part of the context: the geometry grows, the new chunks are
        resident, source ``appended``. Returns the new token count."""
        with self._lock:
            return growth.commit_appended(self)


