"""One context's KV memory: :class:`ContextKV` (docs/kv-memory.md).

The context is cut into chunks ``(t, l, g)`` (:class:`~sparkv.layout.ChunkGeometry`). Every chunk
has a **residency** (resident at a level, on flash, absent), a **source** (computed, streamed, ...)
and, per KV head of its group, how many entries it keeps (a pruned head keeps fewer). Each layer
holds its resident entries in one of two forms:

* **arena** (:class:`~sparkv.cache.layer.LayerStore`): the layer's fp entries in one place, dense
  (slot = position: what loading and generation use, with no copy) or ragged (per head, explicit
  positions: after pruning). Every chunk of an arena layer is resident at ``fp``.
* **per-chunk**: each resident chunk owns its entries (:class:`~sparkv.cache.payload.ChunkPayload`)
  at its own level, so one chunk can be quantized, written to flash or dropped without touching
  the others. Chunk operations switch a layer to this form; :meth:`ContextKV.materialize` switches
  it back.

The memory account (:attr:`ContextKV.nbytes`) is kept as tensors are allocated and freed, and
equals the bytes of the tensors :meth:`ContextKV.tensors` lists (tested).

Thread safety: chunk writes from several threads (a decode worker, a compute thread) are safe;
they touch disjoint slots and the chunk table is guarded by a lock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import torch

from sparkv.cache.flash import FlashRef, FlashTier
from sparkv.cache.layer import HeadEntries, KVMemoryError, LayerStore
from sparkv.cache.levels import LEVELS, Residency, Source
from sparkv.cache.payload import (ChunkPayload, PayloadError, contiguous_positions, from_bytes,
                                  to_bytes)
from sparkv.cache.qattend import ResidentAttention, entries_per_head, rows_for
from sparkv.layout import ChunkGeometry, KVChunkId

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]

ARENA = "arena"
PER_CHUNK = "per-chunk"


@dataclass
class ChunkState:
    """What the memory knows of one chunk.

    Attributes:
        residency: where its entries are.
        level: the level they are held at (resident) or stored at (flash); ``""`` when absent.
        source: how they were made.
        counts: entries kept per head of the group (``None``: all of the chunk's tokens).
        payload: the entries, when resident in a per-chunk layer.
        flash: the file holding them, when written to the flash tier.
        dirty: changed since the flash copy was written (a reclaim would have to write it).
        quality: the lowest level the entries ever went through (``fp`` if never quantized).
    """

    residency: Residency = Residency.ABSENT
    level: str = ""
    source: Source | None = None
    counts: tuple[int, ...] | None = None
    payload: ChunkPayload | None = None
    flash: FlashRef | None = None
    dirty: bool = True
    quality: str = "fp"
    payload_bytes: int = 0    # ``payload.nbytes``, counted once when the payload is held


@dataclass
class MemoryAccount:
    """Bytes held, by form."""

    arena: int = 0
    resident: dict[str, int] = field(default_factory=dict)   # level -> per-chunk bytes

    @property
    def total(self) -> int:
        return self.arena + sum(self.resident.values())


def _lower_quality(a: str, b: str) -> str:
    return a if LEVELS.index(a) >= LEVELS.index(b) else b


class ContextKV:
    """The KV memory of one context (module docstring).

    Args:
        geometry: how the context is cut into chunks.
        dtype, device: of the fp entries (the model's).
        spare_tokens: extra dense slots per layer for tokens appended later (decoding grows the
            arena by an eighth, at least 64 slots, when they run out).
    """

    def __init__(self, geometry: ChunkGeometry, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", *, spare_tokens: int = 0,
                 per_chunk: bool = False) -> None:
        self.geometry = geometry
        self.dtype, self.device = dtype, torch.device(device)
        cap = geometry.num_tokens + max(0, int(spare_tokens))
        # per_chunk: every layer starts in the per-chunk form, with no arena allocated (a
        # context service building a memory chunk by chunk, or reopening one from flash)
        self.layers: list[LayerStore | None] = [
            None if per_chunk else
            LayerStore(geometry.num_kv_heads, geometry.head_dim, cap, dtype, self.device)
            for _ in range(geometry.num_layers)]
        self.mode = [PER_CHUNK if per_chunk else ARENA] * geometry.num_layers
        self._chunks: dict[KVChunkId, ChunkState] = {}
        self._lock = threading.RLock()
        self.positions = [geometry.num_tokens] * geometry.num_layers  # positions seen per layer
        self._arena_bytes = sum(x.nbytes for x in self.layers if x is not None)
        self._resident_bytes: dict[str, int] = {}
        self._layer_version = [0] * geometry.num_layers  # bumped when a layer's entries change

    # ---- chunk table -----------------------------------------------------------------------------
    def state(self, cid: KVChunkId) -> ChunkState:
        with self._lock:
            return self._chunks.get(cid) or ChunkState()

    def chunk_ids(self) -> Iterator[KVChunkId]:
        return self.geometry.chunk_ids()

    def residency(self, cid: KVChunkId) -> Residency:
        return self.state(cid).residency

    def level(self, cid: KVChunkId) -> str:
        return self.state(cid).level

    def has(self, cid: KVChunkId) -> bool:
        """Whether ``cid`` is resident (at any level)."""
        with self._lock:
            st = self._chunks.get(cid)
            return st is not None and st.residency == Residency.RESIDENT

    def missing(self, cids: Iterable[KVChunkId]) -> list[KVChunkId]:
        with self._lock:
            return [c for c in cids if not (c in self._chunks and self._chunks[c].residency
                                            == Residency.RESIDENT)]

    def is_complete(self) -> bool:
        return not self.missing(self.geometry.chunk_ids())

    def source(self, cid: KVChunkId) -> str | None:
        st = self.state(cid)
        return None if st.source is None else str(st.source)

    def sources(self) -> dict[KVChunkId, str]:
        with self._lock:
            return {c: str(s.source) for c, s in self._chunks.items()
                    if s.residency == Residency.RESIDENT and s.source is not None}

    # ---- accounting ------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of every tensor the memory holds (kept as they are allocated and freed)."""
        with self._lock:
            return self._arena_bytes + sum(self._resident_bytes.values())

    def resident_bytes_by_token(self) -> dict[int, int]:
        """Resident payload bytes per token chunk index ``t`` (summed over layers and groups;
        token chunks with nothing resident are left out). One pass over the chunk table."""
        out: dict[int, int] = {}
        with self._lock:
            for cid, st in self._chunks.items():
                if st.residency == Residency.RESIDENT and st.payload is not None:
                    out[cid.t] = out.get(cid.t, 0) + st.payload_bytes
        return out

    def resident_payloads(self) -> dict[KVChunkId, ChunkPayload]:
        """A snapshot of every resident chunk's payload (per-chunk layers), in one pass."""
        with self._lock:
            return {cid: st.payload for cid, st in self._chunks.items()
                    if st.residency == Residency.RESIDENT and st.payload is not None}

    def account(self) -> MemoryAccount:
        with self._lock:
            return MemoryAccount(self._arena_bytes, dict(self._resident_bytes))

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held (arenas and resident chunk payloads)."""
        with self._lock:
            out = [t for x in self.layers if x is not None for t in x.tensors()]
            for st in self._chunks.values():
                if st.payload is not None and st.residency == Residency.RESIDENT:
                    out.extend(st.payload.tensors())
            return out

    def recount(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def _arena_changed(self, l: int, before: int) -> None:  # noqa: E741
        store = self.layers[l]
        self._arena_bytes += (store.nbytes if store is not None else 0) - before

    def _hold(self, st: ChunkState, payload: ChunkPayload | None) -> None:
        """Replaces ``st``'s payload, keeping the account."""
        for p in (st.payload, payload):
            if p is not None:
                self._layer_version[p.cid.l] += 1
        if st.payload is not None:
            self._resident_bytes[st.level] = self._resident_bytes.get(st.level, 0) \
                - st.payload_bytes
        st.payload = payload
        st.payload_bytes = payload.nbytes if payload is not None else 0
        if payload is not None:
            self._resident_bytes[payload.level] = self._resident_bytes.get(payload.level, 0) \
                + st.payload_bytes

    # ---- writes ----------------------------------------------------------------------------------
    def _check_chunk(self, cid: KVChunkId, k: torch.Tensor, v: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.geometry
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

    def put(self, cid: KVChunkId, k: torch.Tensor, v: torch.Tensor,
            source: Source | str = Source.INJECTED, overwrite: bool = True,
            non_blocking: bool = False) -> bool:
        """Writes a whole chunk (``[Hg, n_t, D]``, every token of its range, fp). Returns whether
        it was written (``overwrite=False`` keeps a chunk already resident). ``non_blocking``:
        an asynchronous host-to-device copy from pinned memory on the current CUDA stream (the
        caller synchronises that stream before anyone reads the chunk)."""
        k, v = self._check_chunk(cid, k, v)
        source = Source(source)
        with self._lock:
            st = self._chunks.get(cid)
            if not overwrite and st is not None and st.residency == Residency.RESIDENT:
                return False
            if st is None:
                st = self._chunks[cid] = ChunkState()
            mode = self.mode[cid.l]
            store = self.layers[cid.l]
            ragged = store is not None and store.ragged
        g = self.geometry
        t0, t1 = g.token_range(cid.t)
        h0, h1 = g.head_range(cid.g)
        if mode == ARENA and not ragged:
            assert store is not None
            before = store.nbytes
            store.write_dense(h0, h1, t0, k if k.dtype == self.dtype else k.to(self.dtype),
                              v if v.dtype == self.dtype else v.to(self.dtype), non_blocking)
            with self._lock:
                self._arena_changed(cid.l, before)
                self._set_resident(st, "fp", source, None, None)
            return True
        if mode == ARENA:
            assert store is not None
            before = store.nbytes
            pos = torch.arange(t0, t1, device=self.device)
            for i, h in enumerate(range(h0, h1)):
                store.remove_range(h, t0, t1)
                store.insert(h, HeadEntries(k[i], v[i], pos))
            with self._lock:
                self._arena_changed(cid.l, before)
                self._set_resident(st, "fp", source, (t1 - t0,) * (h1 - h0), None)
            return True
        n = t1 - t0
        payload = ChunkPayload(cid, "fp", [n] * (h1 - h0), contiguous_positions([n] * (h1 - h0),
                                                                                  t0),
                               k.reshape(-1, g.head_dim).to(self.dtype).clone(),
                               v.reshape(-1, g.head_dim).to(self.dtype).clone(), self.dtype)
        with self._lock:
            self._set_resident(st, "fp", source, None, payload)
        return True

    def put_payload(self, payload: ChunkPayload, source: Source | str = Source.INJECTED) -> None:
        """Places a chunk's entries as they are (any level, any kept subset): the layer is
        in the per-chunk form first if needed."""
        cid = payload.cid
        self.geometry.check(cid)
        self.to_per_chunk(cid.l)
        with self._lock:
            st = self._chunks.setdefault(cid, ChunkState())
            counts = tuple(payload.counts)
            full = counts == (self.geometry.chunk_len(cid.t),) * len(counts)
            self._set_resident(st, payload.level, Source(source), None if full else counts,
                               payload)

    def _set_resident(self, st: ChunkState, level: str, source: Source,
                      counts: tuple[int, ...] | None, payload: ChunkPayload | None) -> None:
        self._hold(st, payload)
        st.residency = Residency.RESIDENT
        st.level = level
        st.source = source
        st.counts = counts
        st.dirty = True
        st.quality = "fp" if source != Source.RESTORED else st.quality
        if level != "fp":
            st.quality = _lower_quality(st.quality, level)

    def put_step_output(self, t: int, l: int, k: torch.Tensor, v: torch.Tensor,  # noqa: E741
                        source: Source | str = Source.COMPUTED) -> None:
        """Writes every group of step ``(t, l)`` from ``[1, H, n_t, D]`` tensors, keeping chunks
        already resident (a streamed chunk is not overwritten)."""
        for g in range(self.geometry.num_groups):
            h0, h1 = self.geometry.head_range(g)
            self.put(KVChunkId(t, l, g), k[0, h0:h1], v[0, h0:h1], source, overwrite=False)

    # ---- reads -----------------------------------------------------------------------------------
    def read(self, cid: KVChunkId) -> ChunkPayload:
        """The chunk's entries as held (a copy for arena layers; the payload itself for
        per-chunk ones). Raises when the chunk is not resident."""
        with self._lock:
            st = self._chunks.get(cid)
            if st is None or st.residency != Residency.RESIDENT:
                raise KVMemoryError(f"{cid} is not resident ({self.residency(cid)})")
            if st.payload is not None:
                return st.payload
            store = self.layers[cid.l]
        assert store is not None
        g = self.geometry
        t0, t1 = g.token_range(cid.t)
        h0, h1 = g.head_range(cid.g)
        heads = [store.read_range(h, t0, t1) for h in range(h0, h1)]
        return ChunkPayload(cid, "fp", [int(x.pos.numel()) for x in heads],
                            torch.cat([x.pos for x in heads]).to(torch.int32),
                            torch.cat([x.k for x in heads]), torch.cat([x.v for x in heads]),
                            self.dtype)

    def chunk_view(self, cid: KVChunkId) -> tuple[torch.Tensor, torch.Tensor]:
        """Writable ``[Hg, n_t, D]`` views of a chunk's slots (dense arena layers only; a decoder
        may write into them, then :meth:`mark_resident`)."""
        if self.mode[cid.l] != ARENA:
            raise KVMemoryError(f"layer {cid.l} is in the per-chunk form: no slots to view")
        store = self.layers[cid.l]
        assert store is not None
        g = self.geometry
        t0, t1 = g.token_range(cid.t)
        h0, h1 = g.head_range(cid.g)
        before = store.nbytes
        view = store.dense_view(h0, h1, t0, t1)
        with self._lock:
            self._arena_changed(cid.l, before)
        return view

    def layer_kv(self) -> LayerKV:
        """Per layer ``(K, V)`` ``[1, H, N, D]`` views (every layer dense, every chunk resident)."""
        missing = self.missing(self.geometry.chunk_ids())
        if missing:
            raise KVMemoryError(f"{len(missing)} chunks are still missing, first {missing[0]}")
        out = []
        n = self.geometry.num_tokens
        for l, store in enumerate(self.layers):  # noqa: E741
            if self.mode[l] != ARENA or store is None or store.ragged:
                raise KVMemoryError(f"layer {l} is not dense: use attention views, not layer_kv()")
            out.append(store.prefix(n))
        return out

    # ---- forms -----------------------------------------------------------------------------------
    def to_per_chunk(self, l: int) -> None:  # noqa: E741
        """Moves layer ``l``'s resident entries into per-chunk payloads (frees its arena)."""
        with self._lock:
            if self.mode[l] == PER_CHUNK:
                return
            store = self.layers[l]
            assert store is not None
            g = self.geometry
            for t in range(g.num_token_chunks):
                for gg in range(g.num_groups):
                    cid = KVChunkId(t, l, gg)
                    st = self._chunks.get(cid)
                    if st is None or st.residency != Residency.RESIDENT:
                        continue
                    p = self.read(cid)
                    counts = tuple(p.counts)
                    full = counts == (g.chunk_len(t),) * len(counts)
                    self._hold(st, p)
                    st.counts = None if full else counts
            before = store.nbytes
            self.layers[l] = None
            self._arena_bytes -= before
            self.mode[l] = PER_CHUNK

    def set_arena(self, l: int, store: LayerStore | None) -> None:  # noqa: E741
        """Makes ``store`` layer ``l``'s arena (``None`` frees it), keeping the account: how an
        arena is rebuilt layer by layer elsewhere (the device loader's ``grow_arena``). The
        chunk table is left as it is."""
        with self._lock:
            old = self.layers[l]
            before = old.nbytes if old is not None else 0
            self.layers[l] = store
            self.mode[l] = ARENA
            self._arena_changed(l, before)

    def materialize(self, l: int, spare_tokens: int = 0) -> None:  # noqa: E741
        """Moves layer ``l`` back into an fp arena (dense when every head keeps every token,
        ragged otherwise). Every chunk of the layer must be resident; quantized chunks are
        dequantized (their :attr:`ChunkState.quality` remembers it)."""
        with self._lock:
            if self.mode[l] == ARENA:
                return
            g = self.geometry
            cids = [KVChunkId(t, l, gg) for t in range(g.num_token_chunks)
                    for gg in range(g.num_groups)]
            missing = self.missing(cids)
            if missing:
                raise KVMemoryError(f"layer {l} cannot be materialized: {len(missing)} chunks are "
                                    f"not resident, first {missing[0]}")
            dense = all(self._chunks[c].counts is None for c in cids)
            cap = g.num_tokens + max(0, spare_tokens)
            store = LayerStore(g.num_kv_heads, g.head_dim, cap if dense else 0, self.dtype,
                               self.device)
            if dense:
                for c in cids:
                    p = self._chunks[c].payload
                    assert p is not None
                    k, v = p.fp()
                    t0, _ = g.token_range(c.t)
                    h0, h1 = g.head_range(c.g)
                    n = g.chunk_len(c.t)
                    store.write_dense(h0, h1, t0, k.view(h1 - h0, n, -1), v.view(h1 - h0, n, -1))
            else:
                heads: list[list[HeadEntries]] = [[] for _ in range(g.num_kv_heads)]
                for c in cids:
                    p = self._chunks[c].payload
                    assert p is not None
                    k, v = p.fp()
                    h0, _ = g.head_range(c.g)
                    for i, sl in enumerate(p.head_slices()):
                        heads[h0 + i].append(HeadEntries(k[sl], v[sl], p.pos[sl].long()))
                store.to_ragged([torch.zeros(0, dtype=torch.long)] * g.num_kv_heads)
                for h, parts in enumerate(heads):
                    if parts:
                        store.insert(h, HeadEntries(torch.cat([x.k for x in parts]),
                                                    torch.cat([x.v for x in parts]),
                                                    torch.cat([x.pos for x in parts])))
            for c in cids:
                st = self._chunks[c]
                self._hold(st, None)
                st.level = "fp"
            self.layers[l] = store
            self._arena_bytes += store.nbytes
            self.mode[l] = ARENA

    # ---- pruning ---------------------------------------------------------------------------------
    def prune_layer(self, l: int, keep: Sequence[torch.Tensor], spare_tokens: int = 0  # noqa: E741
                    ) -> None:
        """Keeps, per KV head of layer ``l``, only the entries at positions ``keep[h]`` (real
        memory: the layer becomes a ragged arena sized to what it keeps)."""
        g = self.geometry
        if len(keep) != g.num_kv_heads:
            raise KVMemoryError(f"keep lists {len(keep)} heads; the model has {g.num_kv_heads}")
        self.materialize(l)
        with self._lock:
            missing = self.missing(KVChunkId(t, l, gg) for t in range(g.num_token_chunks)
                                   for gg in range(g.num_groups))
            if missing:
                raise KVMemoryError(f"layer {l} cannot be pruned: {missing[0]} is not resident")
            store = self.layers[l]
            assert store is not None
            before = store.nbytes
            keep = [torch.as_tensor(x, dtype=torch.long).sort().values for x in keep]
            for h, x in enumerate(keep):
                if x.numel() and (int(x[0]) < 0 or int(x[-1]) >= self.positions[l]):
                    raise KVMemoryError(f"head {h}: positions to keep must be in "
                                        f"[0, {self.positions[l]})")
            store.to_ragged(keep, spare=spare_tokens)
            self._arena_changed(l, before)
            for t in range(g.num_token_chunks):
                t0, t1 = g.token_range(t)
                for gg in range(g.num_groups):
                    h0, h1 = g.head_range(gg)
                    counts = tuple(int(((keep[h] >= t0) & (keep[h] < t1)).sum())
                                   for h in range(h0, h1))
                    st = self._chunks[KVChunkId(t, l, gg)]
                    st.counts = None if counts == (t1 - t0,) * (h1 - h0) else counts
                    st.dirty = True

    def kept(self, cid: KVChunkId) -> tuple[int, ...]:
        """Entries kept per head of the chunk's group."""
        st = self.state(cid)
        if st.counts is not None:
            return st.counts
        g = self.geometry
        return (g.chunk_len(cid.t),) * g.heads_per_group

    # ---- levels and tiers ------------------------------------------------------------------------
    def set_level(self, cid: KVChunkId, level: str) -> int:
        """Re-holds a resident chunk at ``level`` (``int8``/``int4``/``int2`` from fp or from an
        int8 base; ``fp`` dequantizes). Returns the bytes freed (negative: grown)."""
        if level not in LEVELS:
            raise KVMemoryError(f"unknown level {level!r}; known: {', '.join(LEVELS)}")
        self.to_per_chunk(cid.l)
        with self._lock:
            st = self._chunks.get(cid)
            if st is None or st.residency != Residency.RESIDENT or st.payload is None:
                raise KVMemoryError(f"{cid} is not resident")
            if st.level == level:
                return 0
            before = st.payload.nbytes
            try:
                new = st.payload.at_level(level)
            except PayloadError as e:
                raise KVMemoryError(f"{cid}: {e}") from None
            self._hold(st, new)
            st.level = level
            st.dirty = True
            if level != "fp":
                st.quality = _lower_quality(st.quality, level)
            return before - new.nbytes

    def swap_out(self, cid: KVChunkId, tier: FlashTier, *, keep_resident: bool = False,
                 name: str | None = None) -> int:
        """Writes the chunk's payload (at its level) to ``tier`` unless an up-to-date copy is
        there already; unless ``keep_resident``, frees the RAM copy (residency ``flash``).
        Returns the bytes written (0 for a clean chunk)."""
        self.to_per_chunk(cid.l)
        with self._lock:
            st = self._chunks.get(cid)
            if st is None or st.residency != Residency.RESIDENT or st.payload is None:
                raise KVMemoryError(f"{cid} is not resident: nothing to swap out")
            written = 0
            if st.dirty or st.flash is None:
                data = to_bytes(st.payload)
                if st.flash is not None:
                    tier.delete(st.flash)
                st.flash = tier.write(name or f"{cid.t}.{cid.l}.{cid.g}.skvc", data)
                st.dirty = False
                written = len(data)
            if not keep_resident:
                level = st.level
                self._hold(st, None)
                st.residency = Residency.FLASH
                st.level = level
            return written

    def swap_in(self, cid: KVChunkId, tier: FlashTier) -> int:
        """Reads a flash chunk back (checksum-checked) and holds it resident at its stored level.
        Returns the bytes read."""
        with self._lock:
            st = self._chunks.get(cid)
            if st is None or st.flash is None:
                raise KVMemoryError(f"{cid} has no flash copy")
            ref = st.flash
        data = tier.read(ref)
        self.swap_in_payload(from_bytes(data, expect=cid))
        return len(data)

    def swap_in_payload(self, payload: ChunkPayload, ref: FlashRef | None = None) -> None:
        """Holds ``payload``, just read from the chunk's flash copy (``ref``: where it was read;
        default the copy already recorded), resident and clean: what :meth:`swap_in` does after
        its read, for a caller that reads many chunks' payloads at once (one file per token
        chunk)."""
        cid = payload.cid
        self.geometry.check(cid)
        self.to_per_chunk(cid.l)
        with self._lock:
            st = self._chunks.setdefault(cid, ChunkState())
            if ref is not None:
                st.flash = ref
            if st.flash is None:
                raise KVMemoryError(f"{cid} has no flash copy")
            quality = st.quality
            source = st.source or Source.RESTORED
            self._set_resident(st, payload.level, source, st.counts, payload)
            st.quality = quality
            st.dirty = False

    def drop(self, cid: KVChunkId) -> int:
        """Frees the chunk's RAM copy: ``flash`` when a clean flash copy exists, else ``absent``
        (to be recomputed or fetched). Returns the bytes freed."""
        self.to_per_chunk(cid.l)
        with self._lock:
            st = self._chunks.get(cid)
            if st is None or st.residency != Residency.RESIDENT:
                return 0
            freed = st.payload_bytes if st.payload is not None else 0
            self._hold(st, None)
            if st.flash is not None and not st.dirty:
                st.residency = Residency.FLASH
            else:
                st.residency, st.level = Residency.ABSENT, ""
            return freed

    def attach_flash(self, cid: KVChunkId, ref: FlashRef, level: str,
                     source: Source | str = Source.RESTORED) -> None:
        """Records that a clean copy of ``cid`` (every token of its range, at ``level``) is in
        the flash file ``ref`` (a context reopened from its flash tier after a restart): a
        chunk not resident becomes ``flash``; its file is checked when swapped in."""
        if level not in LEVELS:
            raise KVMemoryError(f"unknown level {level!r}; known: {', '.join(LEVELS)}")
        self.geometry.check(cid)
        with self._lock:
            st = self._chunks.setdefault(cid, ChunkState())
            st.flash = ref
            st.dirty = False
            if st.residency != Residency.RESIDENT:
                st.residency, st.level = Residency.FLASH, level
                st.source, st.counts = Source(source), None
                st.quality = _lower_quality("fp", level)

    def forget_flash(self, cid: KVChunkId, tier: FlashTier | None = None) -> None:
        """Deletes the chunk's flash copy (if any)."""
        with self._lock:
            st = self._chunks.get(cid)
            if st is None or st.flash is None:
                return
            if tier is not None:
                tier.delete(st.flash)
            st.flash = None
            if st.residency == Residency.FLASH:
                st.residency, st.level = Residency.ABSENT, ""

    # ---- attention -------------------------------------------------------------------------------
    def layer_entries(self, l: int, stop: int | None = None  # noqa: E741
                      ) -> list[HeadEntries]:
        """Per KV head, the resident entries of layer ``l`` with positions below ``stop``, in
        position order, in fp (copies; quantized chunks dequantized). Raises when a chunk below
        ``stop`` is not resident."""
        g = self.geometry
        stop = self.positions[l] if stop is None else stop
        store = self.layers[l]
        if self.mode[l] == ARENA and store is not None:
            if store.ragged:
                out = []
                for h in range(g.num_kv_heads):
                    e = store.head(h)
                    n = int(torch.searchsorted(e.pos, torch.tensor(stop, device=e.pos.device)))
                    out.append(HeadEntries(e.k[:n], e.v[:n], e.pos[:n]))
                return out
            k, v = store.prefix(stop)
            pos = torch.arange(stop, device=self.device)
            return [HeadEntries(k[0, h], v[0, h], pos) for h in range(g.num_kv_heads)]
        parts: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = [
            [] for _ in range(g.num_kv_heads)]
        for t in range(g.num_token_chunks):
            t0, _ = g.token_range(t)
            if t0 >= stop:
                break
            for gg in range(g.num_groups):
                cid = KVChunkId(t, l, gg)
                st = self.state(cid)
                if st.residency != Residency.RESIDENT or st.payload is None:
                    raise KVMemoryError(f"{cid} is not resident ({st.residency}); restore it "
                                        f"before attending over layer {l}")
                k, v = st.payload.fp()
                h0, _ = g.head_range(gg)
                for i, sl in enumerate(st.payload.head_slices()):
                    pos = st.payload.pos[sl].long()
                    keep = pos < stop
                    parts[h0 + i].append((k[sl][keep], v[sl][keep], pos[keep]))
        out = []
        for h in range(g.num_kv_heads):
            if parts[h]:
                out.append(HeadEntries(torch.cat([p[0] for p in parts[h]]).to(self.dtype),
                                       torch.cat([p[1] for p in parts[h]]).to(self.dtype),
                                       torch.cat([p[2] for p in parts[h]])))
            else:
                z = torch.zeros(0, g.head_dim, dtype=self.dtype, device=self.device)
                out.append(HeadEntries(z, z.clone(), torch.zeros(0, dtype=torch.long)))
        return out

    def layer_version(self, l: int) -> int:  # noqa: E741
        """A number that changes whenever a chunk payload of layer ``l`` is replaced, dropped or
        re-levelled (a cached :meth:`resident_attention` is stale once it changes)."""
        with self._lock:
            return self._layer_version[l]

    def resident_attention(self, l: int) -> ResidentAttention:  # noqa: E741
        """Attention over per-chunk layer ``l``'s resident chunks as held (quantized ones read
        in place by the fused kernel, fp ones by torch: sparkv/cache/qattend.py). It references
        the payloads (no copy); rebuild it when :meth:`layer_version` changes. Raises when a
        chunk of the layer is not resident."""
        g = self.geometry
        if self.mode[l] != PER_CHUNK:
            raise KVMemoryError(f"layer {l} is an arena: attend its tensors directly")
        quantized: dict[str, tuple[list[ChunkPayload], list[int]]] = {}
        fp: tuple[list[ChunkPayload], list[int]] = ([], [])
        with self._lock:
            for t in range(g.num_token_chunks):
                for gg in range(g.num_groups):
                    cid = KVChunkId(t, l, gg)
                    st = self._chunks.get(cid) or ChunkState()
                    if st.residency != Residency.RESIDENT or st.payload is None:
                        raise KVMemoryError(f"{cid} is not resident ({st.residency}); restore "
                                            f"it before attending over layer {l}")
                    h0, _ = g.head_range(gg)
                    if st.payload.level != "fp":
                        ps, hs = quantized.setdefault(st.payload.level, ([], []))
                        ps.append(st.payload)
                        hs.append(h0)
                        continue
                    fp[0].append(st.payload)
                    fp[1].append(h0)
        heads = entries_per_head(*fp, g.num_kv_heads) if fp[0] else None
        rows = rows_for(self.device)
        return ResidentAttention([rows(ps, hs, g.num_kv_heads)
                                  for ps, hs in quantized.values()], heads)

    def is_dense(self, l: int) -> bool:  # noqa: E741
        store = self.layers[l]
        return self.mode[l] == ARENA and store is not None and not store.ragged

    # ---- growth (decoding) -----------------------------------------------------------------------
    def append(self, l: int, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # noqa: E741
        """Appends ``[H, q, D]`` new entries to layer ``l`` at the next positions (in place in
        an arena layer; a per-chunk layer is materialized first). Returns their positions."""
        q = int(k.shape[1])
        with self._lock:
            start = self.positions[l]
            positions = torch.arange(start, start + q, device=self.device)
        if self.mode[l] != ARENA:
            self.materialize(l, spare_tokens=max(q, 64))
        store = self.layers[l]
        assert store is not None
        before = store.nbytes
        store.append(k.to(self.dtype), v.to(self.dtype), positions)
        with self._lock:
            self._arena_changed(l, before)
            self.positions[l] = start + q
        return positions

    def truncate(self) -> None:
        """Forgets every appended entry not committed (positions past the context's tokens):
        generation over a context that must stay as it was (a reference, a benchmark)."""
        n = self.geometry.num_tokens
        with self._lock:
            for l, store in enumerate(self.layers):  # noqa: E741
                if self.positions[l] <= n:
                    continue
                if store is not None and store.ragged:
                    for h in range(store.num_heads):
                        store.length[h] = int(store.positions_in(h, 0, n).numel())
                elif store is not None:
                    store.end = min(store.end, n)
                self.positions[l] = n

    def extend(self, num_tokens: int) -> list[KVChunkId]:
        """Grows a context whose every layer is in the per-chunk form to ``num_tokens`` tokens
        (how a context service appends a call's tokens computed elsewhere): the new chunks are
        absent, to be put; a last token chunk that was partial is reset to absent (its RAM copy
        freed, its flash copy forgotten: it now covers more tokens). Returns the chunks reset."""
        with self._lock:
            old = self.geometry
            if num_tokens < old.num_tokens:
                raise KVMemoryError(f"cannot shrink a context from {old.num_tokens} to "
                                    f"{num_tokens} tokens")
            if num_tokens == old.num_tokens:
                return []
            if any(m != PER_CHUNK for m in self.mode):
                raise KVMemoryError("extend() grows per-chunk layers; arena layers grow by "
                                    "appending (commit_appended)")
            if max(self.positions) > old.num_tokens:
                raise KVMemoryError("the memory holds appended tokens not committed")
            reset: list[KVChunkId] = []
            t = old.num_token_chunks - 1
            if old.chunk_len(t) < old.chunk_tokens:
                for l in range(old.num_layers):  # noqa: E741
                    for gg in range(old.num_groups):
                        cid = KVChunkId(t, l, gg)
                        st = self._chunks.pop(cid, None)
                        if st is not None and st.payload is not None:
                            self._hold(st, None)
                        reset.append(cid)
            self.geometry = ChunkGeometry(num_tokens, old.chunk_tokens, old.num_layers,
                                          old.num_kv_heads, old.head_dim, old.heads_per_group)
            self.positions = [num_tokens] * old.num_layers
            return reset

    def commit_appended(self) -> int:
        """Makes the appended tokens part of the context: the geometry grows to the positions
        every layer has seen, and the new (or grown) chunks are resident, source ``appended``.
        Returns the new token count."""
        with self._lock:
            n = min(self.positions)
            old = self.geometry
            if n <= old.num_tokens:
                return old.num_tokens
            if max(self.positions) != n:
                raise KVMemoryError(f"layers have seen different positions {set(self.positions)}")
            new = ChunkGeometry(n, old.chunk_tokens, old.num_layers, old.num_kv_heads,
                                old.head_dim, old.heads_per_group)
            self.geometry = new
            for t in range(old.num_token_chunks - 1, new.num_token_chunks):
                for l in range(new.num_layers):  # noqa: E741
                    for gg in range(new.num_groups):
                        cid = KVChunkId(t, l, gg)
                        st = self._chunks.setdefault(cid, ChunkState())
                        if self.mode[l] != ARENA:
                            raise KVMemoryError("appended tokens live in arena layers")
                        store = self.layers[l]
                        assert store is not None
                        counts = None
                        if store.ragged:
                            t0, t1 = new.token_range(t)
                            h0, h1 = new.head_range(gg)
                            c = tuple(int(store.positions_in(h, t0, t1).numel())
                                      for h in range(h0, h1))
                            counts = None if c == (t1 - t0,) * (h1 - h0) else c
                        if st.residency != Residency.RESIDENT:
                            self._set_resident(st, "fp", Source.APPENDED, counts, None)
                        else:
                            st.counts, st.dirty = counts, True
            return n
