"""How the context service keeps a context's KV between calls: the interface its two forms share.

* :class:`~sparkv.device.chunked.ChunkKeeper` (LLMS, its ablations, VLLM-S / VLLM-SQ): a context
  is a paged :class:`~sparkv.cache.ContextKV` of 16-token chunks at their levels, evicted
  chunk by chunk, written as token chunk records, loaded back by reads and recomputation;
* :class:`~sparkv.device.baselines.WholeKeeper` (LMK, whole-context swapping): a context is one
  dense fp arena, evicted whole, killed or written as one file, brought back whole.

The keeper alone changes a context's ``memory``, ``hot`` (its kept working memory), ``levels``
and ``modified`` (the token chunks whose flash copy is stale or missing): the service, the swap
store and the journal read them. It makes the service's
:class:`~sparkv.device.budget.MemoryBudget` with itself as the budget's
:class:`~sparkv.device.budget.Evictor` (what a reservation reclaims through), and it counts what
it does in the service's :class:`~sparkv.device.counters.ServiceCounters`.

A keeper is given a context locked by its caller (its lock held for the whole operation) and
allocates only what it has reserved from the :class:`~sparkv.device.budget.MemoryBudget`
first, checking the account after every layer and chunk it adds. :meth:`Keeper.evict` and
:meth:`Keeper.drop_hot` are called by a reservation with the registry's lock held, on a context
nobody holds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np
import torch

from sparkv.cache import ContextKV, LayerKV
from sparkv.cache.levels import QuantizedTensor
from sparkv.cache.pages import PAGE_TOKENS
from sparkv.cache.payload import (ChunkPayload, ChunkRun, contiguous_positions, joined_rows,
                                  values_at_level)
from sparkv.device.budget import MemoryBudget, eviction_policy
from sparkv.device.config import ServiceConfig
from sparkv.device.counters import ServiceCounters
from sparkv.device.density import DensityRecorder, recording
from sparkv.device.errors import DeviceError
from sparkv.device.loader import LoadOptions, LoadRequest, LoadStats, load
from sparkv.device.planner import Split
from sparkv.device.registry import ContextRegistry, DeviceContext
from sparkv.device.swap import SwapStore
from sparkv.layout import ChunkGeometry, KVChunkId

if TYPE_CHECKING:
    from sparkv.device.remote import RemoteSource
    from sparkv.runtime.model import LoadedModel


@dataclass
class SwitchIn:
    """A context switched in: the working memory a call runs over, what loading it did, the
    IO/recompute split (chunked contexts that loaded), the seconds reclaiming took and the
    bytes its fold-back may add (reserved with it: claimed while its turn runs)."""

    working: ContextKV
    stats: LoadStats | None
    split: Split | None
    reclaim_s: float
    fold_bytes: int = 0     # what folding the call's new tokens back may add (reserved with it)


@dataclass(eq=False)
class Keeper(ABC):
    """One form of keeping contexts (module docstring).

    Args:
        lm: the :class:`~sparkv.runtime.model.LoadedModel`.
        config: the service's policies (``chunk_tokens``: a context's geometry).
        registry, swap: the service's contexts and swap space.
        counters: the service's counters (what was evicted, written, read, recomputed).
        budget_bytes: the memory budget's limit; the keeper makes the budget (``budget``,
            evicting by ``config.eviction`` through this keeper).
    """

    lm: LoadedModel
    config: ServiceConfig
    registry: ContextRegistry
    swap: SwapStore
    counters: ServiceCounters
    budget_bytes: int
    budget: MemoryBudget = field(init=False)

    def __post_init__(self) -> None:
        self.budget = MemoryBudget(self.budget_bytes, self.registry,
                                   eviction_policy(self.config.eviction), self)

    def geometry(self, n: int) -> ChunkGeometry:
        """The geometry of a context of ``n`` tokens."""
        return ChunkGeometry.from_config(self.lm.config, n, self.config.chunk_tokens)

    def drop_hot(self, ctx: DeviceContext) -> int:
        """Frees ``ctx``'s kept working memory (its chunks hold everything: nothing to write);
        returns the bytes freed."""
        W = ctx.hot
        if W is None:
            return 0
        with self.registry.lock:
            ctx.hot = None
            self.budget.release(ctx.id, W)
        self.counters.hot_freed()
        return W.nbytes

    def discard(self, ctx: DeviceContext) -> None:
        """Frees everything ``ctx`` holds in RAM, working memories included (it is deleted, not
        made, or put back to its journal record; its files are the swap store's)."""
        with self.registry.lock:
            self.drop_hot(ctx)
            self.budget.release(ctx.id)
            ctx.memory = None

    def swap_out(self, ctx: DeviceContext) -> int:
        """Reclaims all of ``ctx`` now (its kept working memory first); returns the bytes
        written."""
        with self.registry.lock:
            self.drop_hot(ctx)
            if ctx.memory is None:
                return 0
            written = self.evict(ctx, range(ctx.memory.geometry.num_token_chunks))
            self.budget.check()
            return written

    @abstractmethod
    def create(self, ctx: DeviceContext) -> None:
        """A new context's first prefill (its densities recorded), kept in this form."""

    @abstractmethod
    def adopt(self, ctx: DeviceContext, layers: ContextKV | LayerKV) -> None:
        """A new context's KV made elsewhere (:func:`layer_kv`'s ``layers``), kept in this form."""

    @abstractmethod
    def switch_in(self, ctx: DeviceContext, spare: int,
                  remote: RemoteSource | None = None) -> SwitchIn:
        """The working memory a call on ``ctx`` runs over, with ``spare`` free slots."""

    @abstractmethod
    def fold_back(self, ctx: DeviceContext, W: ContextKV, n_old: int) -> None:
        """After a call that grew ``ctx`` from ``n_old`` tokens: keeps its new tokens and
        releases the working memory."""

    @abstractmethod
    def release(self, ctx: DeviceContext, W: ContextKV) -> None:
        """After a call that left ``ctx`` as it was: releases the working memory."""

    def abandon(self, ctx: DeviceContext, W: ContextKV) -> None:
        """After a call whose turn failed (a cancelled ask): releases ``W``, kept only while it
        holds exactly ``ctx``'s tokens (a failed turn may have appended to it), else freed."""
        self.release(ctx, W)

    @abstractmethod
    def evict(self, ctx: DeviceContext, ts: Sequence[int]) -> int:
        """Reclaims token chunks ``ts`` of ``ctx`` (or all of it); returns the bytes written."""

    @abstractmethod
    def write_ahead(self, ctx: DeviceContext) -> int:
        """After a call: writes what a later reclaim would have to (bytes written)."""

    @abstractmethod
    def drop_flash(self, ctx: DeviceContext) -> None:
        """Drops ``ctx``'s KV from RAM and flash: the next call recomputes (or restores) it."""

    @abstractmethod
    def reopen(self, ctx: DeviceContext, levels: list[str]) -> None:
        """Gives ``ctx``, made from its journal record, the ``levels`` the record names and its
        memory: the records on flash it can attach (:func:`sparkv.device.journal.reopen`)."""

    def _prefill(self, ctx: DeviceContext, g: ChunkGeometry, spare: int,
                 reserve: int) -> ContextKV:
        """Reserves ``reserve`` bytes, then recomputes every chunk of ``ctx`` into a new working
        memory with ``spare`` free slots (held by the budget), recording its densities."""
        self.budget.reserve(reserve, ctx)
        W = ContextKV(g, self.lm.dtype, self.lm.device, spare_tokens=spare)
        self.budget.hold(ctx.id, W)
        self.budget.check()
        rec = DensityRecorder(g.num_tokens)
        with recording(rec):
            load(self.lm, ctx.tokens, W, W, ctx.tier,
                 LoadRequest(recompute=range(g.num_token_chunks)),
                 LoadOptions(on_layer=self.budget.check, store_recomputed=False))
        ctx.add_density(rec, g.num_tokens)
        return W


def layer_kv(layers: ContextKV | LayerKV, l: int, t0: int, t1: int  # noqa: E741
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``[H, t1-t0, D]`` K/V of positions ``t0..t1`` of layer ``l`` of ``layers``: a
    :class:`ContextKV` holding every chunk (any chunk size, dense or paged, never pruned), or
    per layer ``(K, V)`` ``[1, H, N, D]``."""
    if not isinstance(layers, ContextKV):
        return layers[l][0][0, :, t0:t1], layers[l][1][0, :, t0:t1]
    if layers.is_dense(l):
        store = layers.layers[l]
        assert store is not None and store.k is not None and store.v is not None
        return store.k[0, :, t0:t1], store.v[0, :, t0:t1]
    ks, vs = [], []
    for e in layers.layer_entries(l, stop=t1):
        keep = e.pos >= t0
        if int(keep.sum()) != t1 - t0:
            raise DeviceError("the memory to adopt is pruned: the context service keeps whole "
                              "chunks")
        ks.append(e.k[keep])
        vs.append(e.v[keep])
    return torch.stack(ks), torch.stack(vs)


def adopted_runs(layers: ContextKV | LayerKV, g: ChunkGeometry, levels: Sequence[str],
                 dtype: torch.dtype) -> Iterator[list[ChunkRun]]:
    """Every token chunk of a context being adopted (or of a new context's working memory,
    ``ChunkKeeper._fold_new``), as the service holds it, a layer at a time: per layer, one
    :class:`ChunkRun` per level (its chunks in order, every KV head in one group), copied
    from ``layers`` (:func:`layer_kv`) in ``dtype`` and quantized to ``levels[t]`` unless it is
    ``fp``. A run's tensors are its chunks' rows converted (an ``fp`` run's: views of its
    layer's rows where its chunks are consecutive, else one copy of them), for a memory that
    copies them into its pages at once (:meth:`ChunkMemory.hold
    <sparkv.cache.chunks.ChunkMemory.hold>`: one page write per layer and level).

    A layer's chunks are converted at once, one quantization per level of that level's rows
    only (each level quantizing the whole layer, then cut: 0.22 s against 0.12 s for 1,678
    tokens with int8 and k8v4 chunks, ``bench/adopt_convert.py``). Rows are quantized one
    by one, so the values are those of each chunk alone (per chunk and layer it was ~20 small
    tensor operations each, 1.2 s for a 2,048-token SmolLM2 context on a 2-core CPU); put a
    chunk at a time, its layers' payloads joined, it took 1,600 payloads and 53 page writes
    for the same context."""
    bounds = [g.token_range(t) for t in range(g.num_token_chunks)]
    hh = g.num_kv_heads
    by_level: dict[str, list[int]] = {}
    for t, level in enumerate(levels):
        by_level.setdefault(level, []).append(t)
    # a level's chunks' positions and counts are every layer's (runs never write them)
    shared = {lv: (torch.cat([contiguous_positions([t1 - t0] * hh, t0)
                              for t0, t1 in (bounds[t] for t in ts)]),
                   np.array([[bounds[t][1] - bounds[t][0]] * hh for t in ts], dtype=np.int64))
              for lv, ts in by_level.items()}
    for l in range(g.num_layers):  # noqa: E741
        k, v = layer_kv(layers, l, 0, g.num_tokens)
        k_rows = _chunk_rows(k, g.chunk_tokens, dtype)
        v_rows = _chunk_rows(v, g.chunk_tokens, dtype)
        runs = []
        for lv, ts in by_level.items():
            spans = [(hh * bounds[a][0], hh * bounds[b - 1][1]) for a, b in _spans(ts)]
            kl, vl = values_at_level(joined_rows(k_rows, spans), joined_rows(v_rows, spans),
                                     "fp", lv, dtype)         # only this level's rows
            pos, counts = shared[lv]
            runs.append(ChunkRun([KVChunkId(t, l, 0) for t in ts], lv, counts, pos, kl, vl,
                                 dtype))
        yield runs


def adopted_chunks(layers: ContextKV | LayerKV, g: ChunkGeometry, levels: Sequence[str],
                   dtype: torch.dtype, *, owned: bool = True) -> list[list[ChunkPayload]]:
    """:func:`adopted_runs` as payloads: per chunk ``t``, one payload per layer. ``owned``:
    each payload holds its own storage; else its tensors are views of its layer's converted
    rows (none of ``layers``')."""
    out: list[list[ChunkPayload]] = [[] for _ in range(g.num_token_chunks)]
    for runs in adopted_runs(layers, g, levels, dtype):
        for run in runs:
            for p in run.payloads():
                out[p.cid.t].append(_owned(p) if owned else p)   # layer after layer
    return out


def _owned(p: ChunkPayload) -> ChunkPayload:
    """``p`` holding its own storage (a chunk evicted later frees its bytes)."""
    def own(x: torch.Tensor | QuantizedTensor) -> torch.Tensor | QuantizedTensor:
        return x.taken(0, x.rows) if isinstance(x, QuantizedTensor) else x.clone()
    return ChunkPayload(p.cid, p.level, p.counts, p.pos.clone(), own(p.k), own(p.v), p.dtype)


def _spans(ts: Sequence[int]) -> list[tuple[int, int]]:
    """``ts`` (increasing) as ranges ``[a, b)`` of consecutive values."""
    spans: list[tuple[int, int]] = []
    for t in ts:
        if spans and spans[-1][1] == t:
            spans[-1] = (spans[-1][0], t + 1)
        else:
            spans.append((t, t + 1))
    return spans


def adopted_pages(g: ChunkGeometry, levels: Sequence[str]) -> dict[str, int]:
    """Pages, per level, the chunks of :func:`adopted_chunks` take (every layer, every KV head
    in one group)."""
    pages: dict[str, int] = {}
    for t, level in enumerate(levels):
        per = g.num_layers * g.num_kv_heads * -(-g.chunk_len(t) // PAGE_TOKENS)
        pages[level] = pages.get(level, 0) + per
    return pages


def _chunk_rows(x: torch.Tensor, chunk_tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """``[H, N, D]`` as ``[H * N, D]`` rows in ``dtype``, chunk after chunk (each chunk's heads
    one after another: the payloads' order), so chunk ``t``'s rows begin at ``H * t0``: one
    copy of the whole chunks and one of the last, shorter one."""
    h, n, d = x.shape
    full = n // chunk_tokens * chunk_tokens
    out = torch.empty(h * n, d, dtype=dtype, device=x.device)
    out[:h * full].view(full // chunk_tokens, h, chunk_tokens, d).copy_(
        x[:, :full].reshape(h, full // chunk_tokens, chunk_tokens, d).transpose(0, 1))
    out[h * full:].view(h, n - full, d).copy_(x[:, full:])
    return out
