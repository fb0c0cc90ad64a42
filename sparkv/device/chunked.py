"""LLMS's way of keeping a context: a paged :class:`~sparkv.cache.ContextKV` cut into token
chunks (16 tokens across all layers, one KV group), each at its own level, resident, on flash or
absent.

* **create / adopt**: a new context's KV (its first prefill, or a KV made elsewhere) is folded into
  its memory layer by layer, each chunk at the level :class:`~sparkv.device.levels.LevelPolicy`
  gives it, and marked modified (written ahead of time when the call returns); an adopted KV
  also fills a working memory kept for the first call (``keep_working``) when that fits the
  budget as it is;
* **switch in**: a call runs over a dense fp working memory with spare slots. The context's kept
  working memory (``keep_working``), if still valid, is used as it is or grown layer by layer;
  else the missing chunks, the working memory and the new chunks are reserved, and the loader
  (:func:`sparkv.device.loader.load`) fills it: resident chunks dequantized, flash chunks read,
  some recomputed, pipelined layer by layer, the split chosen by
  :func:`sparkv.device.planner.plan_split` (or, given the server's copy, by
  :func:`sparkv.device.restore.restore_plan`: flash, server or recompute per chunk);
* **fold back**: the call's new tokens enter the memory at the levels their densities earn; the
  working memory is kept (``keep_working``, while valid) or freed;
* **evict**: token chunks are dropped, the modified ones written first
  (:meth:`~sparkv.device.swap.SwapStore.put_away`); **write ahead**: every modified chunk is
  written when a call returns (``aot``), so that a reclaim writes nothing.

Locks: as every :class:`~sparkv.device.keeper.Keeper` (its module docstring); the learned
recompute profile is updated only under the service's run lock.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from sparkv.cache import ContextKV, FlashRef, Source
from sparkv.cache.table import FLASH, RESIDENT
from sparkv.device.config import longest_context
from sparkv.device.errors import BudgetBusy, BudgetTooSmall
from sparkv.device.flashio import IOProfile, run_starts
from sparkv.device.hosttier import tier_holds
from sparkv.device.keeper import Keeper, SwitchIn, adopted_pages, adopted_runs
from sparkv.device.levels import LevelPolicy
from sparkv.device.loader import (LoadOptions, LoadRequest, LoadStats, fill_layers,
                                  grow_arena, load, paged_nbytes, token_chunk_run,
                                  working_nbytes)
from sparkv.device.planner import MissingChunk, RecomputeProfile, Split, plan_split
from sparkv.device.registry import DeviceContext
from sparkv.layout import ChunkGeometry


@dataclass(eq=False)
class ChunkKeeper(Keeper):
    """Contexts as chunks at levels (module docstring).

    Args (beyond :class:`~sparkv.device.keeper.Keeper`'s):
        levels: the chunks' levels.
        io, recompute: the flash read and recomputation cost models the split is planned by
            (``recompute`` learns from every load).

    Uses ``config.pipeline``, ``io_threads``, ``aot``, ``keep_working``, ``hot_margin_tokens``.
    """

    levels: LevelPolicy = field(kw_only=True)
    io: IOProfile = field(kw_only=True)
    recompute: RecomputeProfile = field(kw_only=True)

    # ---- a new context ---------------------------------------------------------------------------
    def create(self, ctx: DeviceContext) -> None:
        g = self.geometry(len(ctx.tokens))
        w = working_nbytes(g, 0, self.lm.dtype)
        W = self._prefill(ctx, g, 0, w + w // g.num_layers + 4096)
        self._fold_new(ctx, W)

    def _fold_new(self, ctx: DeviceContext, W: ContextKV) -> None:
        """A new context's memory made from its working memory, layer by layer (each layer of the
        working memory freed as soon as its chunks are in), at the chunks' levels: a layer's
        chunks converted at once per level and held as runs, as an import holds them
        (:func:`~sparkv.device.keeper.adopted_runs`; a chunk at a time it was 3,200 small
        quantizations and page writes for a 1,678-token SmolLM2 context)."""
        g = W.geometry
        ctx.levels = self.levels.assign(ctx, g)
        C = ContextKV(g, self.lm.dtype, self.lm.device, paged=True)
        with self.registry.lock:
            ctx.memory = C
        for l, runs in enumerate(adopted_runs(W, g, ctx.levels, self.lm.dtype)):  # noqa: E741
            C.hold(runs, Source.COMPUTED)
            self.budget.check()
            W.to_pages(l)    # W's chunk table is empty: this frees the layer's arena
        ctx.modified.update(range(g.num_token_chunks))
        self._discard(ctx, W)

    def adopt(self, ctx: DeviceContext, layers: Any) -> None:
        g = self.geometry(len(ctx.tokens))
        levels = self.levels.assign(ctx, g)
        self.budget.reserve(self.levels.chunks_nbytes(g, levels), ctx)
        C = ContextKV(g, self.lm.dtype, self.lm.device, paged=True)
        with self.registry.lock:
            ctx.memory = C
        ctx.levels = levels
        C.reserve_pages(adopted_pages(g, levels))        # the pools grow once
        try:
            for runs in adopted_runs(layers, g, levels, self.lm.dtype):  # copied into pages
                C.hold(runs, Source.INJECTED)
                self.budget.check()
            ctx.modified.update(range(g.num_token_chunks))
        finally:
            C.reserve_pages(None)
        if ctx.ahead:                 # a copy deleted within seconds keeps none
            self._keep_adopted(ctx, C)

    def _keep_adopted(self, ctx: DeviceContext, C: ContextKV) -> None:
        """An adopted context's working memory, filled from its memory ``C`` as a load fills
        one (the same values: an answer does not depend on whether it was kept), kept
        (``keep_working``) as a call's is when it returns, only when it fits the budget as it
        is (nothing is reclaimed for it): its first call then switches in without a fill."""
        g = C.geometry
        spare = self.config.hot_margin_tokens
        key = ctx.id + "#adopted"
        if not self.config.keep_working or not self.budget.try_claim(
                key, working_nbytes(g, spare, self.lm.dtype)):
            return
        W = ContextKV(g, self.lm.dtype, self.lm.device, spare_tokens=spare)
        with self.registry.lock:      # the claim becomes the memory's own count
            self.budget.hold(ctx.id, W)
            self.budget.unclaim(key)
        try:
            fill_layers(C, W, range(g.num_layers))
        except BaseException:
            self.budget.release(ctx.id, W)
            raise
        self.release(ctx, W)          # kept, as a call's working memory is

    # ---- switching in ----------------------------------------------------------------------------
    def switch_in(self, ctx: DeviceContext, spare: int, remote: Any = None) -> SwitchIn:
        return self._take_hot(ctx, spare) or self._load(ctx, spare, remote)

    def _load(self, ctx: DeviceContext, spare: int, remote: Any) -> SwitchIn:
        """Reserves, then loads the context's chunks into a new working memory."""
        C = ctx.memory
        assert C is not None
        g = C.geometry
        missing, resident, restore = missing_chunks(ctx, self.lm.dtype)
        fold = self.levels.new_chunk_bytes(g, spare)
        need = restore + working_nbytes(g, spare, self.lm.dtype) + fold
        spare, need = self._with_margin(g, spare, need)
        reclaim_s = self.budget.reserve(need, ctx)
        rp = None
        if (remote is not None and missing and len(remote.token_ids) == len(ctx.tokens)
                and list(remote.token_ids) == ctx.tokens):
            rp = self._restore_plan(ctx, remote)
            split = Split(rp.read, rp.recompute, rp.estimate_s, 0.0, 0.0, 0.0)
        else:
            split = plan_split(missing, g.num_tokens, resident, self.io, self.recompute,
                               allow_recompute=self.config.pipeline)
        W = ContextKV(g, self.lm.dtype, self.lm.device, spare_tokens=spare)
        self.budget.hold(ctx.id, W)
        self.budget.check()
        levels = ctx.levels
        request = LoadRequest(split.read, split.recompute, stream=rp.stream if rp else (),
                              remote=remote if rp else None,
                              remote_chunks=rp.server if rp else ())
        options = LoadOptions(pipeline=self.config.pipeline, io_threads=self.config.io_threads,
                              on_layer=self.budget.check, level_of=lambda t: levels[t])
        try:
            stats = load(self.lm, ctx.tokens, C, W, ctx.tier, request, options)
        except BaseException:               # failed or cancelled: nothing of it stays counted
            self.budget.release(ctx.id, W)
            raise
        stats.predicted_s = split.predicted_s
        stats.sources = _sources(levels, split.recompute, rp.stream if rp else ())
        if rp is not None:
            stats.notes.append(f"restore plan: {rp.counts()}")
        ctx.modified.update(split.recompute)
        ctx.modified.update(rp.stream if rp else ())
        if stats.faults:
            ctx.modified.update(range(g.num_token_chunks))
        self._learn(g, resident, stats)
        return SwitchIn(W, stats, split, reclaim_s, fold)

    def _learn(self, g: ChunkGeometry, resident: int, stats: LoadStats) -> None:
        """Counts what a load did and folds its timings into the recompute profile."""
        self.counters.loaded(stats)
        if stats.recomputed_chunks and not stats.faults:
            self.recompute.learn(stats.recomputed_chunks, g.num_tokens, stats.recompute_s)
        self.recompute.learn_fill(resident + stats.read_chunks * g.num_layers * g.num_groups,
                                  stats.fill_s)

    def _restore_plan(self, ctx: DeviceContext, remote: Any) -> Any:
        """The three-source restore plan of ``ctx`` from ``remote`` (server chunks), flash and
        recompute (:func:`sparkv.device.restore.restore_plan`)."""
        from sparkv.device.restore import restore_plan

        assert ctx.memory is not None
        gs = remote.geometry
        n = len(ctx.tokens)
        per = np.array([float(self.recompute.seconds([max(1, gs.chunk_len(t)
                                                              // self.config.chunk_tokens)],
                                                     n)[0]) / gs.num_layers
                        for t in range(gs.num_token_chunks)])
        t_comp = np.repeat(per[:, None], gs.num_layers, axis=1)
        return restore_plan(ctx.memory, self.io, gs, remote.sizes, t_comp, remote.link_Bps,
                            rtt_s=remote.rtt_s, align=ctx.tier.align)

    # ---- the kept working memory -----------------------------------------------------------------
    def _take_hot(self, ctx: DeviceContext, spare: int) -> SwitchIn | None:
        """The context's kept working memory, if it is still valid: used as it is when it has
        ``spare`` free slots, else grown layer by layer (a copy, no dequantization)."""
        W = ctx.hot
        if W is None:
            return None
        n = len(ctx.tokens)
        g = W.geometry
        if not _whole_working(W, n):
            self.drop_hot(ctx)
            return None
        t0 = time.perf_counter()
        ctx.hot = None                    # in use: the working memory of this call
        cap = min(st.capacity for st in W.layers if st is not None)
        stats = LoadStats(resident_chunks=g.num_token_chunks, notes=["hot working memory"],
                          sources={"working memory": g.num_token_chunks})
        if cap >= n + spare:
            reclaim_s = self.budget.reserve(self.levels.new_chunk_bytes(g, spare), ctx)
        else:
            grow = working_nbytes(g, spare, self.lm.dtype) - W.nbytes
            need = (max(0, grow) + W.nbytes // g.num_layers + 4096
                    + self.levels.new_chunk_bytes(g, spare))
            extra, need = self._with_margin(g, spare, need)
            try:
                reclaim_s = self.budget.reserve(need, ctx)
            except (BudgetTooSmall, BudgetBusy):
                ctx.hot = W
                self.drop_hot(ctx)
                return None
            W = self._grow(ctx, W, extra)
            stats.notes.append("grown")
        self.counters.hot_hit()
        stats.total_s = time.perf_counter() - t0
        return SwitchIn(W, stats, None, reclaim_s, self.levels.new_chunk_bytes(g, spare))

    def _grow(self, ctx: DeviceContext, old: ContextKV, extra: int) -> ContextKV:
        """``old`` (held by the budget) grown to ``extra`` spare slots, layer by layer: the
        account holds both only for one layer."""
        key = ctx.id + "#grow"
        W = grow_arena(old, extra, on_layer=self.budget.check,
                       adopt=lambda new: self.budget.hold(key, new))
        with self.registry.lock:
            self.budget.release(key)
            self.budget.hold(ctx.id, W)
        return W

    def _with_margin(self, g: ChunkGeometry, spare: int, need: int) -> tuple[int, int]:
        """A working memory that will be kept gets ``hot_margin_tokens`` more spare slots (so
        the next calls reuse it without growing), only if they fit the budget as it is now."""
        m = self.config.hot_margin_tokens if self.config.keep_working else 0
        if m <= 0:
            return spare, need
        more = (working_nbytes(g, spare + m, self.lm.dtype)
                - working_nbytes(g, spare, self.lm.dtype))
        if self.budget.fits(need + more):
            return spare + m, need + more
        return spare, need

    # ---- after a call ----------------------------------------------------------------------------
    def fold_back(self, ctx: DeviceContext, W: ContextKV, n_old: int) -> None:
        C = ctx.memory
        assert C is not None
        g_new = W.geometry
        if g_new.num_tokens > n_old:
            g_old = C.geometry
            last = g_old.num_token_chunks - 1
            if g_old.chunk_len(last) < g_old.chunk_tokens:   # it grows: its flash copy dies
                self.swap.forget_flash(ctx, [last])
            C.extend(g_new.num_tokens)
            ctx.levels = self.levels.assign(ctx, g_new)
            for t in range(n_old // g_new.chunk_tokens, g_new.num_token_chunks):
                C.hold([token_chunk_run(W, t, ctx.levels[t])], Source.APPENDED)
                ctx.modified.add(t)
                self.budget.check()
        self.release(ctx, W)

    def release(self, ctx: DeviceContext, W: ContextKV) -> None:
        """Keeps ``W`` as the context's hot working memory (``keep_working``, while it holds
        exactly the context's tokens), else frees it."""
        if self.config.keep_working and _whole_working(W, len(ctx.tokens)):
            with self.registry.lock:
                ctx.hot = W
            self.budget.check()
            return
        self._discard(ctx, W)

    def _discard(self, ctx: DeviceContext, W: ContextKV) -> None:
        self.budget.release(ctx.id)
        del W
        self.budget.check()

    def evict(self, ctx: DeviceContext, ts: Sequence[int]) -> int:
        freed, written = self.swap.put_away(ctx, list(ts))
        self.counters.evicted(len(ts), freed, written)
        return written

    def write_ahead(self, ctx: DeviceContext) -> int:
        if not self.config.aot or not ctx.ahead or ctx.memory is None or not ctx.modified:
            return 0
        written = self.swap.write_ahead(ctx)
        ctx.modified.clear()
        return written

    def drop_flash(self, ctx: DeviceContext) -> None:
        """Every chunk of ``ctx`` absent (dropped from RAM, its flash copies forgotten) and
        modified: the next call recomputes or restores them."""
        with self.registry.lock:
            self.drop_hot(ctx)
            if ctx.memory is None:
                return
            self.swap.forget(ctx)
            ctx.modified.update(range(ctx.memory.geometry.num_token_chunks))
            self.budget.check()

    def reopen(self, ctx: DeviceContext, levels: list[str]) -> None:
        """A memory of ``ctx``'s geometry holding its full token chunks' records on flash as
        clean copies (:meth:`~sparkv.device.swap.SwapStore.attach`; its partial last chunk
        absent), at ``levels`` (assigned by the policy when they are fewer than its chunks)."""
        g = self.geometry(len(ctx.tokens))
        ctx.levels = list(levels)
        ctx.modified.clear()
        if len(ctx.levels) < g.num_token_chunks:
            ctx.levels = self.levels.assign(ctx, g)
        C = ContextKV(g, self.lm.dtype, self.lm.device, paged=True)
        self.swap.attach(ctx, C, longest_context(self.config, self.lm.max_positions))
        with self.registry.lock:
            ctx.memory = C


def _sources(levels: Sequence[str], recompute: Sequence[int],
             streamed: Sequence[int]) -> dict[str, int]:
    """A load's token chunks by where their KV came from (:attr:`LoadStats.sources`): the
    ``recompute`` and ``streamed`` chunks, the others at their ``levels``."""
    made = {int(t): "recomputed" for t in recompute} | {int(t): "streamed" for t in streamed}
    return dict(Counter(made.get(t, lv) for t, lv in enumerate(levels)))


def _whole_working(W: ContextKV, n: int) -> bool:
    """Whether working memory ``W`` holds exactly ``n`` tokens, every layer dense and whole."""
    return (W.geometry.num_tokens == n and max(W.positions) == n
            and all(st is not None and not st.ragged for st in W.layers))


def missing_chunks(ctx: DeviceContext, dtype: Any) -> tuple[list[MissingChunk], int, int]:
    """The token chunks of ``ctx`` not wholly resident (with the reads their records add, their
    bytes and whether they are readable), the resident ``(t, l)`` chunks, and the bytes
    restoring the missing ones takes (from the chunk table by token chunk: no object per
    chunk)."""
    C = ctx.memory
    assert C is not None
    g = C.geometry
    rows = C.by_token()
    res = rows.residency == RESIDENT
    readable_chunk = (rows.residency == FLASH) & (rows.flash >= 0) & ~rows.dirty
    out: list[MissingChunk] = []
    refs: list[FlashRef | None] = [None] * g.num_token_chunks
    restore = 0
    for t in np.flatnonzero(~res.all(axis=1)).tolist():
        away = np.flatnonzero(~res[t])
        readable = bool(readable_chunk[t, away].all())
        ref = rows.ref(t, int(away[-1])) if readable else None
        miss = int(away.size)
        lv = ctx.levels[t] if t < len(ctx.levels) else "int8"
        held = tier_holds(ctx.tier, ref)       # read from host RAM: no flash read
        out.append(MissingChunk(t, lv, 1, ref.nbytes if ref is not None and not held else 0,
                                readable, miss, held))
        restore += miss * paged_nbytes(lv, g.chunk_len(t), g.heads_per_group, g.head_dim,
                                       dtype)
        refs[t] = None if held else ref
    starts = run_starts(refs, ctx.tier.align)
    for m in out:
        m.reads = 0 if m.held else starts[m.t] if m.readable else 1
    return out, int(res.sum()), restore
