"""Baselines of the context-switching benchmark that do not manage chunks (LLMS section 4).

Both keep each live context as one dense fp arena (a :class:`~sparkv.cache.ContextKV` in its
arena form, the layout generation uses, spare slots included) and evict **whole contexts**, least
recently used first (:class:`~sparkv.device.budget.WholeContextLRU`), under the same budget and
account as the service. They are configurations of :class:`~sparkv.device.ContextService`,
``ServiceConfig.preset("lmk")`` and ``ServiceConfig.preset("swap")``, kept by a
:class:`WholeKeeper` with a :class:`BringBack` policy (:data:`BRING_BACK`):

* ``lmk`` (low-memory killer, :class:`Kill`): an evicted context is killed (its KV freed, its token
  ids kept, as the app keeps its text); calling it again recomputes it from its tokens (the
  service's batched full prefill).
* ``swap`` (whole-context swapping, :class:`WholeFile`): an evicted context is written to flash
  as one file (every layer's K and V, one durable write, on the critical path: the context
  changed since it was read); calling it again reads the file back.

An arena out of spare slots grows layer by layer (:func:`~sparkv.device.loader.grow_arena`): the
account never holds two copies of a context beyond one layer, so both run under the same budget
as the chunked systems without a second working memory.

The chunked baselines (VLLM-S, VLLM-SQ) and the LLMS ablations are other presets of the same
service (:meth:`~sparkv.device.config.ServiceConfig.preset`), kept by
:class:`~sparkv.device.chunked.ChunkKeeper`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, ClassVar, Sequence

from sparkv.cache import ContextKV, LayerKV
from sparkv.device.errors import DeviceError
from sparkv.device.keeper import Keeper, SwitchIn, layer_kv
from sparkv.device.loader import (LoadOptions, LoadRequest, LoadStats, grow_arena, load,
                                  working_nbytes)
from sparkv.device.registry import DeviceContext
from sparkv.device.swap import SwapStore
from sparkv.layout import ChunkGeometry

if TYPE_CHECKING:
    from sparkv.device.remote import RemoteSource
    from sparkv.runtime.model import LoadedModel


def _margin(n: int) -> int:
    """Spare slots an arena of ``n`` tokens gets beyond a call's."""
    return max(64, n // 8)


class BringBack(ABC):
    """What an evicted whole context becomes, and how it comes back (over the swap space)."""

    name: ClassVar[str]

    def __init__(self, swap: SwapStore) -> None:
        self.swap = swap

    @abstractmethod
    def put_away(self, ctx: DeviceContext, mem: ContextKV) -> int:
        """``ctx``'s arena ``mem`` is about to be freed; returns the bytes written."""

    @abstractmethod
    def bring_back(self, lm: LoadedModel, ctx: DeviceContext, W: ContextKV,
                   on_layer: Callable[[], object]) -> LoadStats:
        """Fills arena ``W`` with ``ctx``'s tokens' K/V (``on_layer`` after each layer)."""


def recompute_all(lm: LoadedModel, ctx: DeviceContext, W: ContextKV,
                  on_layer: Callable[[], object]) -> LoadStats:
    """Every chunk of ``ctx`` recomputed from its tokens into arena ``W``."""
    return load(lm, ctx.tokens, W, W, ctx.tier,
                LoadRequest(recompute=range(W.geometry.num_token_chunks)),
                LoadOptions(on_layer=on_layer, store_recomputed=False))


class Kill(BringBack):
    """LMK: nothing is kept; the context is recomputed from its tokens."""

    name = "kill"

    def put_away(self, ctx: DeviceContext, mem: ContextKV) -> int:
        return 0

    def bring_back(self, lm: LoadedModel, ctx: DeviceContext, W: ContextKV,
                   on_layer: Callable[[], object]) -> LoadStats:
        return recompute_all(lm, ctx, W, on_layer)


class WholeFile(BringBack):
    """Whole-context swapping: one file per context, read back whole (recomputed if it has
    none)."""

    name = "file"

    def put_away(self, ctx: DeviceContext, mem: ContextKV) -> int:
        return self.swap.write_whole(ctx, mem)

    def bring_back(self, lm: LoadedModel, ctx: DeviceContext, W: ContextKV,
                   on_layer: Callable[[], object]) -> LoadStats:
        stats = self.swap.read_whole(ctx, W, on_layer)
        return stats if stats is not None else recompute_all(lm, ctx, W, on_layer)


#: the bring-back policies by ``ServiceConfig.put_away`` name
BRING_BACK: dict[str, type[BringBack]] = {p.name: p for p in (Kill, WholeFile)}


@dataclass(eq=False)
class WholeKeeper(Keeper):
    """Contexts as whole fp arenas (module docstring). The arena of a context is its ``memory``
    between calls, and the working memory (held by the budget, ``memory`` empty) during one.
    ``bring_back``: what an evicted context becomes and how it comes back."""

    bring_back: BringBack = field(kw_only=True)

    def create(self, ctx: DeviceContext) -> None:
        n = len(ctx.tokens)
        g = self.geometry(n)
        W = self._prefill(ctx, g, _margin(n), working_nbytes(g, _margin(n), self.lm.dtype))
        self.fold_back(ctx, W, n)

    def adopt(self, ctx: DeviceContext, layers: ContextKV | LayerKV) -> None:
        n = len(ctx.tokens)
        g = self.geometry(n)
        extra = _margin(n)
        self.budget.reserve(working_nbytes(g, extra, self.lm.dtype), ctx)
        W = ContextKV(g, self.lm.dtype, self.lm.device, spare_tokens=extra)
        for l in range(g.num_layers):  # noqa: E741
            k, v = layer_kv(layers, l, 0, n)
            st = W.layers[l]
            assert st is not None and st.k is not None and st.v is not None
            st.k[0, :, :n] = k
            st.v[0, :, :n] = v
            st.end = n
        with self.registry.lock:
            ctx.memory = W
        self.budget.check()

    def switch_in(self, ctx: DeviceContext, spare: int,
                  remote: RemoteSource | None = None) -> SwitchIn:
        """The context's arena as the working memory: as it is if it has ``spare`` free slots,
        grown layer by layer if not, brought back (:class:`BringBack`) if it was evicted."""
        n = len(ctx.tokens)
        g = self.geometry(n)
        mem = ctx.memory
        t0 = time.perf_counter()
        reclaim_s = 0.0
        if mem is not None and _capacity(mem) >= n + spare:
            W = mem
            with self.registry.lock:
                ctx.memory = None
                self.budget.hold(ctx.id, W)
            stats = LoadStats(resident_chunks=g.num_token_chunks)
        elif mem is not None:
            # out of spare slots: grown layer by layer, so the old and the new arena never
            # coexist beyond one layer: reserve the growth plus one layer
            extra = spare + _margin(n)
            grow = working_nbytes(g, extra, self.lm.dtype) - mem.nbytes
            reclaim_s = self.budget.reserve(max(0, grow) + mem.nbytes // g.num_layers + 4096,
                                            ctx)
            W = grow_arena(mem, extra, on_layer=self.budget.check,
                           adopt=lambda new: self.budget.hold(ctx.id, new))
            with self.registry.lock:
                ctx.memory = None
            del mem
            stats = LoadStats(resident_chunks=g.num_token_chunks)
        else:
            W, stats, reclaim_s = self._bring_back(ctx, g, spare)
        stats.total_s = time.perf_counter() - t0
        self.counters.brought_back(stats)
        return SwitchIn(W, stats, None, reclaim_s)

    def _bring_back(self, ctx: DeviceContext, g: ChunkGeometry, spare: int
                    ) -> tuple[ContextKV, LoadStats, float]:
        extra = spare + _margin(g.num_tokens)
        reclaim_s = self.budget.reserve(working_nbytes(g, extra, self.lm.dtype), ctx)
        W = ContextKV(g, self.lm.dtype, self.lm.device, spare_tokens=extra)
        self.budget.hold(ctx.id, W)
        self.budget.check()
        try:
            return W, self.bring_back.bring_back(self.lm, ctx, W, self.budget.check), reclaim_s
        except BaseException:               # failed or cancelled: nothing of it stays counted
            self.budget.release(ctx.id, W)
            raise

    def fold_back(self, ctx: DeviceContext, W: ContextKV, n_old: int) -> None:
        """The working memory becomes the context's arena again."""
        with self.registry.lock:
            self.budget.release(ctx.id)
            ctx.memory = W
        self.budget.check()

    def release(self, ctx: DeviceContext, W: ContextKV) -> None:
        self.fold_back(ctx, W, len(ctx.tokens))

    def abandon(self, ctx: DeviceContext, W: ContextKV) -> None:
        """The arena back while it holds exactly the context's tokens; else freed (the next call
        brings the context back)."""
        n = len(ctx.tokens)
        if W.geometry.num_tokens == n and max(W.positions) == n:
            self.fold_back(ctx, W, n)
            return
        self.budget.release(ctx.id, W)
        self.budget.check()

    def evict(self, ctx: DeviceContext, ts: Sequence[int]) -> int:
        """Evicts the whole context (``ts`` aside): put away, then freed."""
        mem = ctx.memory
        assert mem is not None
        freed = mem.nbytes
        written = self.bring_back.put_away(ctx, mem)
        with self.registry.lock:
            ctx.memory = None
        self.counters.evicted(1, freed, written)
        return written

    def write_ahead(self, ctx: DeviceContext) -> int:
        """Nothing: a whole context is written when it is evicted."""
        return 0

    def drop_flash(self, ctx: DeviceContext) -> None:
        """The arena freed and its whole-context file forgotten: the next call recomputes it."""
        with self.registry.lock:
            ctx.memory = None
        self.swap.forget_whole(ctx)

    def reopen(self, ctx: DeviceContext, levels: list[str]) -> None:
        raise DeviceError("whole contexts are not journaled: nothing to reopen")


def _capacity(mem: ContextKV) -> int:
    st = mem.layers[0]
    return 0 if st is None else st.capacity

