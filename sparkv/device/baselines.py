"""Baselines of the context-switching benchmark that do not manage chunks (LLMS section 4).

Both keep each live context as one dense fp arena (a :class:`~sparkv.cache.ContextKV` in its
arena form, the layout generation uses, spare slots included) and evict **whole contexts**, least
recently used first, under the same budget and account as the service:

* :class:`LMKService` (low-memory killer): an evicted context is killed (its KV freed, its token
  ids kept, as the app keeps its text); calling it again recomputes it from its tokens (the
  service's batched full prefill).
* :class:`SwapService` (whole-context swapping): an evicted context is written to flash as one
  file (every layer's K and V, one durable write, on the critical path: the context changed since
  it was read); calling it again reads the file back.

An arena out of spare slots grows layer by layer (:func:`~sparkv.device.loader.grow_arena`): the
account never holds two copies of a context beyond one layer, so both run under the same budget
as the chunked systems without a second working memory.

The chunked baselines (VLLM-S, VLLM-SQ) and the LLMS ablations are :class:`ContextService`
policies (:meth:`ServiceConfig.preset`).
"""

from __future__ import annotations

import struct
import time
from typing import Any, Sequence

import torch

from sparkv.cache import ContextKV, FlashRef
from sparkv.device.errors import BudgetTooSmall
from sparkv.device.loader import (LoadOptions, LoadRequest, LoadStats, grow_arena, load,
                                  working_nbytes)
from sparkv.device.service import Context, ContextService, ServiceConfig
from sparkv.layout import ChunkGeometry

_MAGIC = b"SKVW"


def _margin(n: int) -> int:
    return max(64, n // 8)


class LMKService(ContextService):
    """Contexts as whole fp arenas, killed under pressure, recomputed when called again."""

    kind = "lmk"

    def __init__(self, model: Any, memory_budget_bytes: int, swap_dir: Any, **kw: Any) -> None:
        kw.setdefault("config", ServiceConfig(name=self.kind, compression="fp", aot=False,
                                              eviction="lru", journal=False))
        super().__init__(model, memory_budget_bytes, swap_dir, **kw)
        self.swapped: dict[str, FlashRef] = {}

    # ---- eviction: whole contexts, LRU -----------------------------------------------------------
    def _victims(self, active: Context) -> list[tuple[Context, int, int]]:
        out = [(c.last_used, c) for c in self.contexts.values()
               if c is not active and c.memory is not None and not c.deleted
               and not c.lock.locked()]
        out.sort(key=lambda x: x[0])
        return [(c, -1, c.memory.nbytes) for _, c in out if c.memory is not None]

    def _evict(self, ctx: Context, ts: Sequence[int]) -> None:
        mem = ctx.memory
        assert mem is not None
        freed = mem.nbytes
        self._put_away(ctx, mem)
        with self._mem:
            ctx.memory = None
        self.counters["evicted_chunks"] += 1
        self.counters["evicted_bytes"] += freed

    def _put_away(self, ctx: Context, mem: ContextKV) -> None:
        """LMK: nothing (killed)."""

    def _bring_back(self, ctx: Context, W: ContextKV) -> LoadStats:
        """LMK: recompute every chunk from the tokens."""
        g = W.geometry
        return load(self.lm, ctx.tokens, W, W, ctx.tier,
                    LoadRequest(recompute=range(g.num_token_chunks)),
                    LoadOptions(on_layer=self._check, store_recomputed=False))

    # ---- switching in ----------------------------------------------------------------------------
    def _prepare(self, ctx: Context, spare: int, remote: Any = None):
        n = len(ctx.tokens)
        g = ChunkGeometry.from_config(self.lm.config, n, self.config.chunk_tokens)
        mem = ctx.memory
        stats = LoadStats()
        reclaim_s = 0.0
        t0 = time.perf_counter()
        if mem is not None and _capacity(mem) >= n + spare:
            W = mem
            with self._mem:
                ctx.memory = None
                self._working[ctx.id] = W
            stats.resident_chunks = g.num_token_chunks
        elif mem is not None:
            # resident but out of spare slots: grow layer by layer (grow_arena), so the old and
            # the new arena never coexist beyond one layer: reserve the growth plus one layer
            extra = spare + _margin(n)
            grow = working_nbytes(g, extra, self.lm.dtype) - mem.nbytes
            reclaim_s = self._reserve(max(0, grow) + mem.nbytes // g.num_layers + 4096, ctx)

            def adopt(W: ContextKV) -> None:
                with self._mem:
                    self._working[ctx.id] = W

            W = grow_arena(mem, extra, on_layer=self._check, adopt=adopt)
            with self._mem:
                ctx.memory = None
            del mem
            stats.resident_chunks = g.num_token_chunks
        else:
            extra = spare + _margin(n)
            reclaim_s = self._reserve(working_nbytes(g, extra, self.lm.dtype), ctx)
            W = ContextKV(g, self.lm.dtype, self.lm.device, spare_tokens=extra)
            with self._mem:
                self._working[ctx.id] = W
            self._check()
            stats = self._bring_back(ctx, W)
        stats.total_s = time.perf_counter() - t0
        self.counters["recomputed_chunks"] += stats.recomputed_chunks
        self.counters["read_bytes"] += stats.bytes_read
        return W, stats, None, reclaim_s

    def _create(self, ctx: Context) -> None:
        n = len(ctx.tokens)
        g = ChunkGeometry.from_config(self.lm.config, n, self.config.chunk_tokens)
        extra = _margin(n)
        self._reserve(working_nbytes(g, extra, self.lm.dtype), ctx)
        W = ContextKV(g, self.lm.dtype, self.lm.device, spare_tokens=extra)
        with self._mem:
            self._working[ctx.id] = W
        self._check()
        from sparkv.device.density import DensityRecorder, recording
        rec = DensityRecorder(n)
        with recording(rec):
            load(self.lm, ctx.tokens, W, W, ctx.tier,
                 LoadRequest(recompute=range(g.num_token_chunks)),
                 LoadOptions(on_layer=self._check, store_recomputed=False))
        ctx.add_density(rec, n)
        self._finish(ctx, W, n)

    def import_context(self, token_ids: Sequence[int], layers: Any, **kw: Any) -> str:
        import uuid

        from sparkv.device.service import _dense_range
        from sparkv.device.flashio import ServiceFlash
        ids = list(token_ids)
        n = len(ids)
        ctx_id = uuid.uuid4().hex[:16]
        ctx = Context(ctx_id, ids, kw.get("system_prompt"),
                      ServiceFlash(self.swap_dir / "contexts" / ctx_id))
        g = ChunkGeometry.from_config(self.lm.config, n, self.config.chunk_tokens)
        with ctx.lock, self._run:
            with self._mem:
                self.contexts[ctx_id] = ctx
            extra = _margin(n)
            self._reserve(working_nbytes(g, extra, self.lm.dtype), ctx)
            W = ContextKV(g, self.lm.dtype, self.lm.device, spare_tokens=extra)
            for l in range(g.num_layers):  # noqa: E741
                if isinstance(layers, ContextKV):
                    k, v = _dense_range(layers, l, 0, n)
                else:
                    k, v = layers[l][0][0], layers[l][1][0]
                st = W.layers[l]
                assert st is not None and st.k is not None and st.v is not None
                st.k[0, :, :n] = k
                st.v[0, :, :n] = v
                st.end = n
            with self._mem:
                ctx.memory = W
            self._check()
            ctx.last_used = self._tick()
        return ctx_id

    def _finish(self, ctx: Context, W: ContextKV, n_old: int) -> None:
        with self._mem:
            self._working.pop(ctx.id, None)
            ctx.memory = W
        self._check()

    def _discard(self, ctx: Context, W: ContextKV) -> None:
        self._finish(ctx, W, len(ctx.tokens))

    def _after_call(self, ctx: Context) -> int:
        return 0

    def _reopen(self) -> int:
        return 0


class SwapService(LMKService):
    """Contexts as whole fp arenas, swapped to flash as one file each under pressure."""

    kind = "swap"

    def _put_away(self, ctx: Context, mem: ContextKV) -> None:
        n = len(ctx.tokens)
        parts = [_MAGIC, struct.pack("<II", n, mem.geometry.num_layers)]
        for l in range(mem.geometry.num_layers):  # noqa: E741
            st = mem.layers[l]
            assert st is not None and st.k is not None and st.v is not None
            parts.append(st.k[0, :, :n].contiguous().numpy().tobytes())
            parts.append(st.v[0, :, :n].contiguous().numpy().tobytes())
        blob = b"".join(parts)
        old = self.swapped.pop(ctx.id, None)
        if old is not None:
            ctx.tier.delete(old)
        self.swapped[ctx.id] = ctx.tier.write("context.kv", blob)
        self.counters["reclaim_written_bytes"] += len(blob)

    def _bring_back(self, ctx: Context, W: ContextKV) -> LoadStats:
        ref = self.swapped.get(ctx.id)
        if ref is None:
            return super()._bring_back(ctx, W)
        t0 = time.perf_counter()
        data = ctx.tier.read(ref)
        read_s = time.perf_counter() - t0
        n, L = struct.unpack_from("<II", data, 4)
        if data[:4] != _MAGIC or n != len(ctx.tokens):
            raise BudgetTooSmall("the swapped context file does not match the context")
        g = W.geometry
        per = g.num_kv_heads * n * g.head_dim
        arr = torch.frombuffer(bytearray(data), dtype=torch.float32, offset=12)  # one copy
        for l in range(L):  # noqa: E741
            st = W.layers[l]
            assert st is not None and st.k is not None and st.v is not None
            k = arr[2 * l * per:(2 * l + 1) * per]
            v = arr[(2 * l + 1) * per:(2 * l + 2) * per]
            st.k[0, :, :n] = k.view(g.num_kv_heads, n, g.head_dim)
            st.v[0, :, :n] = v.view(g.num_kv_heads, n, g.head_dim)
            st.end = n
            self._check()
        return LoadStats(read_chunks=g.num_token_chunks, files_read=1, bytes_read=len(data),
                         io_s=read_s, pipelined=False)


def _capacity(mem: ContextKV) -> int:
    st = mem.layers[0]
    return 0 if st is None else st.capacity
