"""The on-device context service (LLMS): many contexts under a memory budget, switched fast.

    svc = ContextService(lm, memory_budget_bytes=64_000_000, swap_dir="/data/sparkv-device")
    cid = svc.new_context("You are a helpful assistant.")
    out = svc.call(cid, "Remember the pass key 7191.", max_new_tokens=32)
    print(out.text, out.switch_s)
    svc.delete(cid)

A **context** is its token ids (kept resident: recomputation needs them) and its KV memory ``C``, a
segmented :class:`~sparkv.cache.ContextKV` cut into chunks of 16 tokens across all layers (one KV
group), each token chunk at its own level (int8 / int4 / int2 from an int8 base, or fp), resident,
on flash, or absent. A call:

1. **locks** the context (a second call on it waits; the eviction never touches a locked context);
2. **switches it in** (the switching latency, timed): reclaims memory from other contexts by the
   eviction policy until its missing chunks, its working memory and its new chunks fit the
   budget, then loads it (:mod:`sparkv.device.loader`): resident chunks dequantized into the
   working memory, flash chunks read and some recomputed, pipelined layer by layer, the split
   chosen by :mod:`sparkv.device.planner` from this device's I/O and recompute profiles;
3. **runs** the prompt and decodes the answer over the working memory (a dense fp arena with
   spare slots: generation appends in place), with the attention hooks recording the density
   of every key the new rows attend (:mod:`sparkv.device.density`);
4. **folds** the new tokens back: the context grows by the prompt and the answer, its new chunks
   enter ``C`` at the levels their densities earn (the densest keep the most bits, the mix meets
   the global ratio);
5. **swaps out ahead of time** every chunk it modified (one file per token chunk holding every
   layer, :mod:`sparkv.device.flashio`; one grouped, durable write), so that a later reclaim of
   this context writes nothing; then journals the context and returns.

With ``keep_working`` (LLMS's presets) the call's working memory is kept after it returns while
the budget has room: a later call on the same context uses it as it is (no load, no
dequantization). Kept working memories are reclaimed before any chunk, least recently used first;
dropping one writes nothing (the context's chunks hold everything).

This module is the service's public API and the order of a call; the work is done by its parts:

* :mod:`~sparkv.device.registry`: the contexts, their ids, locks and clock (the lock discipline);
* :mod:`~sparkv.device.budget`: the budget's account, reservations and the eviction policies;
* :mod:`~sparkv.device.keeper`: how a context's KV is kept between calls, in two forms:
  :mod:`~sparkv.device.chunked` (LLMS: chunks at levels; steps 2, 4 and 5 above) and
  :mod:`~sparkv.device.baselines` (whole arenas, killed or swapped whole);
* :mod:`~sparkv.device.levels`: the chunks' levels (``compression``);
* :mod:`~sparkv.device.swap`: every context's flash files;
* :mod:`~sparkv.device.journal`: the crash journal and the reopening of its contexts;
* :mod:`~sparkv.device.prompts`: chat formatting;
* :mod:`~sparkv.device.config`: the policies (:class:`ServiceConfig`, its presets: LLMS, its
  ablations and every baseline of the benchmark).

A call given a ``remote`` (the server's copy, :mod:`sparkv.device.remote`) restores missing
chunks from flash, the server or by recompute, planned by
:func:`sparkv.device.restore.restore_plan`.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from sparkv.cache import ContextKV, Residency
from sparkv.device.baselines import BRING_BACK, WholeKeeper
from sparkv.device.budget import MemoryBudget, eviction_policy
from sparkv.device.chunked import ChunkKeeper
from sparkv.device.config import ServiceConfig, resolved_ratio
from sparkv.device.density import DensityRecorder, install_hooks, recording
from sparkv.device.errors import (ContextBusy, ContextDamaged, DeviceError, PromptTooLong,
                                  UnknownContext)
from sparkv.device.flashio import IOProfile, ServiceFlash, load_io_profile
from sparkv.device.inputs import check_text, check_timeout, check_token_ids, vocab_size
from sparkv.device.journal import DamagedContext, Journal, reopen
from sparkv.device.keeper import Keeper
from sparkv.device.levels import LevelPolicy
from sparkv.device.loader import token_chunk_ids, working_nbytes
from sparkv.device.planner import RecomputeProfile, recompute_cost_model
from sparkv.device.private import private_dir
from sparkv.device.prompts import system_text, turn_ids, uses_chatml
from sparkv.device.registry import ContextRegistry, DeviceContext
from sparkv.device.swap import SwapStore
from sparkv.generation import base_stats
from sparkv.layout import ChunkGeometry
from sparkv.runtime.hfcache import model_call

__all__ = ["ContextService", "ServiceConfig", "CallResult"]


@dataclass
class CallResult:
    """What one call returned and what it cost (seconds); a
    :class:`~sparkv.generation.Generation` (``text``, ``tokens``, ``stats``)."""

    context_id: str
    text: str
    tokens: list[int]
    switch_s: float               # switching latency: reclaim + load, until the context is ready
    reclaim_s: float = 0.0
    load_s: float = 0.0
    first_token_s: float = 0.0    # from the call to the first answer token
    total_s: float = 0.0
    aot_s: float = 0.0            # the ahead-of-time swap-out after the answer
    context_tokens: int = 0       # after the call
    bytes_evicted: int = 0
    bytes_written_at_reclaim: int = 0
    bytes_written_aot: int = 0
    load: dict[str, Any] = field(default_factory=dict)
    plan: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @property
    def stats(self) -> dict[str, Any]:
        """``ttft_s`` (= ``first_token_s``), ``new_tokens``, then every cost of :meth:`to_dict`
        (``switch_s``, ``load_s``, ``total_s``, bytes, the load and plan records)."""
        costs = {k: v for k, v in self.to_dict().items() if k not in ("text", "tokens")}
        return {**base_stats(self.first_token_s, self.tokens), **costs}


class ContextService:
    """Many contexts of one model under one KV-memory budget (module docstring).

    Args:
        model: a :class:`~sparkv.runtime.model.LoadedModel`, a checkpoint path or name, or
            ``None`` for the bundled SmolLM2.
        memory_budget_bytes: the most bytes every context's KV memory together may hold (the
            memories' own account, working memories included).
        swap_dir: the flash tier and the journal; contexts journaled there are reopened.
        config: the policies (default: full LLMS); keyword overrides apply on top.
        io_profile: ``T_IO`` (default: the flash profile + a per-file latency measured once).

    Parts (public, for tests and tools): ``registry``, ``account`` (the
    :class:`~sparkv.device.budget.MemoryBudget`), ``keeper``, ``swap``, ``journal``.

    ``swap_dir`` is private to this user (``0700``, its files ``0600``:
    :mod:`sparkv.device.private`); one another user owns is refused. Contexts that cannot be
    reopened from it are kept in ``damaged`` (id -> :class:`~sparkv.device.journal.
    DamagedContext`): listed by :meth:`damaged_list`, refused by :meth:`call` and
    :meth:`describe` (:class:`~sparkv.device.errors.ContextDamaged`), removed by :meth:`delete`.

    Locks: each context's lock for a call on it (:mod:`sparkv.device.registry`); ``_run`` makes
    calls and new contexts run the model one at a time (their locking and argument checks run
    concurrently).
    """

    def __init__(self, model: Any, memory_budget_bytes: int, swap_dir: str | Path, *,
                 config: ServiceConfig | None = None, io_profile: IOProfile | None = None,
                 cost_model: Any = None, **overrides: Any) -> None:
        from sparkv.runtime.model import LoadedModel, load_model

        self.lm = model if isinstance(model, LoadedModel) else load_model(model)
        cfg = config or ServiceConfig()
        cfg = replace(cfg, **overrides) if overrides else cfg
        self.config = replace(cfg, ratio=resolved_ratio(cfg, self.lm.fingerprint))
        self.counters: dict[str, float] = {
            "calls": 0, "evicted_chunks": 0, "evicted_bytes": 0, "reclaim_written_bytes": 0,
            "aot_written_bytes": 0, "read_bytes": 0, "recomputed_chunks": 0, "read_chunks": 0,
            "faults": 0, "hot_hits": 0, "hot_dropped": 0, "streamed_chunks": 0}
        self.registry = ContextRegistry()
        self.contexts = self.registry.contexts
        self.account = MemoryBudget(memory_budget_bytes, self.registry,
                                    eviction_policy(self.config.eviction),
                                    lambda ctx, ts: self.keeper.evict(ctx, ts), self.counters)
        self.swap_dir = private_dir(swap_dir)
        self.swap = SwapStore(self.swap_dir, contiguous=self.config.contiguous)
        self.journal = Journal(self.swap_dir / "journal") if self.config.journal else None
        install_hooks(self.lm.model)
        self.vocab = vocab_size(self.lm)
        self.max_tokens = self.config.max_context_tokens or self.lm.max_positions or (1 << 15)
        probe = ServiceFlash(self.swap_dir / "probe")
        self.io = io_profile or load_io_profile(self.swap_dir, probe, self.config.io_threads,
                                                measure=self.config.measure_io)
        g1 = ChunkGeometry.from_config(self.lm.config, 1, self.config.chunk_tokens)
        self.recompute = RecomputeProfile(cost_model or recompute_cost_model(self.lm),
                                          g1.num_layers, self.config.chunk_tokens)
        self.levels = LevelPolicy(self.config.compression, self.config.ratio,
                                  self.config.fp_fraction, self.config.fp_protect, self.lm.dtype)
        self.keeper = self._keeper()
        self._run = threading.Lock()
        self.damaged: dict[str, DamagedContext] = {}
        self.reopened = self._reopen()

    def _keeper(self) -> Keeper:
        """The keeper of ``config.put_away`` (chunks, or whole contexts killed or swapped)."""
        parts = (self.lm, self.config, self.registry, self.account, self.swap, self.counters)
        if self.config.put_away == "chunks":
            return ChunkKeeper(*parts, levels=self.levels, io=self.io, recompute=self.recompute)
        return WholeKeeper(*parts, bring_back=BRING_BACK[self.config.put_away](self.swap))

    def _reopen(self) -> int:
        if self.journal is None:
            return 0
        found = reopen(self.journal, self.lm, self.config.chunk_tokens, self.swap, self.levels)
        for ctx in found:
            self.registry.add(ctx)
        self.damaged = {d.id: d for d in self.journal.damaged}
        return len(found)

    @cached_property
    def _chatml(self) -> bool:
        return uses_chatml(self.lm.tokenizer)

    def _eos(self) -> set[int]:
        from sparkv.runtime.generate import eos_ids
        return eos_ids(self.lm)

    # ---- accounting ------------------------------------------------------------------------------
    @property
    def budget(self) -> int:
        """The budget in bytes (settable)."""
        return self.account.limit

    @budget.setter
    def budget(self, nbytes: int) -> None:
        self.account.limit = int(nbytes)

    def used_bytes(self) -> int:
        """Bytes every context's KV memory holds now (their own accounts)."""
        return self.account.used()

    def min_budget(self, tokens: int = 128) -> int:
        """The smallest budget that runs one context of ``tokens`` tokens with as many tokens
        of prompt and answer (its memory at fp, its working memory)."""
        g = ChunkGeometry.from_config(self.lm.config, tokens, self.config.chunk_tokens)
        return 2 * working_nbytes(g, tokens, self.lm.dtype)

    # ---- the API ---------------------------------------------------------------------------------
    def new_context(self, system_prompt: str | None = None, *,
                    system_ids: Sequence[int] | None = None) -> str:
        """Makes a context holding the system prompt (its KV computed now); returns its id."""
        check_text(system_prompt, "the system prompt")
        if system_ids is not None:
            ids = check_token_ids(system_ids, self.vocab, "system_ids")
        elif self.lm.tokenizer is None:
            raise DeviceError("this model has no tokenizer: pass system_ids")
        else:
            ids = self.lm.encode_text(system_text(system_prompt, self._chatml))
        if not ids:
            raise DeviceError("a context needs at least one token (give a system prompt)")
        if len(ids) + 1 > self.max_tokens:
            raise PromptTooLong(f"the system prompt has {len(ids)} tokens; contexts hold at most "
                                f"{self.max_tokens}")
        ctx = self._new(ids, system_prompt)
        with ctx.lock, self._run, self._adding(ctx):
            self.keeper.create(ctx)
        return ctx.id

    def _new(self, ids: list[int], system_prompt: str | None) -> DeviceContext:
        ctx_id = uuid.uuid4().hex[:16]
        return DeviceContext(ctx_id, ids, system_prompt, self.swap.tier(ctx_id))

    @contextlib.contextmanager
    def _adding(self, ctx: DeviceContext) -> Iterator[None]:
        """Registers a new context for the block. On any failure it is unregistered and its
        flash directory removed; on success it becomes the most recently used and is swapped
        out ahead of time like any returned call."""
        self.registry.add(ctx)
        try:
            yield
        except BaseException:
            self.registry.remove(ctx.id)
            self.swap.remove(ctx)
            raise
        ctx.last_used = self.registry.tick()
        self._after_call(ctx)

    def import_context(self, token_ids: Sequence[int], layers: Any, *,
                       density: tuple[torch.Tensor, torch.Tensor] | None = None,
                       system_prompt: str | None = None, label: str | None = None) -> str:
        """Adopts a context whose KV was made elsewhere (the edge's loaded cache, a benchmark's
        prefill): ``layers`` is a :class:`ContextKV` holding every chunk (any chunk size) or per
        layer ``(K, V)`` ``[1, H, N, D]``. ``density``: per-token ``(mass, rows)`` if known (else
        the levels assume equal densities until calls measure them). ``label``: a name to find it
        by later (:meth:`find`; journaled, so it survives a restart)."""
        ids = check_token_ids(token_ids, self.vocab, "token_ids")
        n = len(ids)
        if isinstance(layers, ContextKV) and layers.geometry.num_tokens != n:
            raise DeviceError(f"the memory holds {layers.geometry.num_tokens} tokens, "
                              f"the context has {n}")
        ctx = self._new(ids, system_prompt)
        ctx.label = label
        with ctx.lock, self._run, self._adding(ctx):
            if density is not None:
                ctx.mass = density[0].double()[:n].clone()
                ctx.rows = density[1].double()[:n].clone()
            self.keeper.adopt(ctx, layers)
        return ctx.id

    def call(self, ctx_id: str, prompt: str | None = None, max_new_tokens: int = 32, *,
             prompt_ids: Sequence[int] | None = None, grow: bool = True, stop_at_eos: bool = True,
             timeout_s: float | None = None, remote: Any = None) -> CallResult:
        """Runs ``prompt`` in context ``ctx_id`` and returns the answer.

        Args:
            prompt: the user's turn (wrapped in the chat template for chat models).
            prompt_ids: raw token ids to append instead of a text prompt.
            max_new_tokens: answer length; 0 appends the prompt without generating.
            grow: keep the prompt and the answer in the context (a chat); ``False`` answers over
                the context and leaves it as it was (a question about a document).
            timeout_s: how long to wait for a busy context (``None``: wait; then 409).
            remote: a :class:`~sparkv.device.remote.RemoteSource` holding this context (the
                server's copy, :class:`~sparkv.device.remote.ServerStream`): missing chunks may
                then come from it too, the restore planned by
                :func:`~sparkv.device.restore.restore_plan` (flash, server or recompute per
                chunk, by predicted cost). Used only while the context holds exactly the
                remote's tokens (``grow=False`` calls, as ``ask`` makes).
        """
        ctx = self._context(ctx_id)
        if max_new_tokens < 0 or max_new_tokens > self.config.max_new_tokens:
            raise DeviceError(f"max_new_tokens must be in [0, {self.config.max_new_tokens}]")
        check_text(prompt)
        if prompt_ids is not None:
            prompt_ids = check_token_ids(prompt_ids, self.vocab, "prompt_ids")
        timeout_s = check_timeout(timeout_s)
        if not ctx.lock.acquire(timeout=-1 if timeout_s is None else timeout_s):
            raise ContextBusy(f"context {ctx_id} is running another call")
        try:
            if ctx.deleted:
                raise UnknownContext(f"no context {ctx_id!r}")
            ids = turn_ids(self.lm, ctx.pending, prompt, prompt_ids, chatml=self._chatml,
                           eos=self._eos() if ctx.pending else ())
            if not ids:
                raise DeviceError("the prompt is empty")
            if len(ctx.tokens) + len(ids) + max_new_tokens > self.max_tokens:
                raise PromptTooLong(
                    f"context {ctx_id} holds {len(ctx.tokens)} tokens; with a {len(ids)}-token "
                    f"prompt and {max_new_tokens} new tokens it would exceed the longest context "
                    f"allowed ({self.max_tokens} tokens)")
            with self._run:
                return self._call(ctx, ids, max_new_tokens, grow, stop_at_eos, remote)
        finally:
            ctx.lock.release()

    def delete(self, ctx_id: str) -> None:
        """Deletes a context: its memory, its flash files and its journal record (of a damaged
        context, whatever is left of them)."""
        with self.registry.lock:
            damaged = self.damaged.pop(ctx_id, None)
        if damaged is not None:
            self.swap.remove_id(ctx_id)
            if self.journal is not None:
                self.journal.remove(ctx_id)
            return
        ctx = self.registry.get(ctx_id)
        with ctx.lock:
            with self.registry.lock:
                ctx.deleted = True
                self.account.drop_hot(ctx)
                self.registry.remove(ctx_id)
                ctx.memory = None
            self.swap.remove(ctx)
            if self.journal is not None:
                self.journal.remove(ctx_id)

    @staticmethod
    def server_stream(client: Any, context_id: str, **kwargs: Any) -> Any:
        """The server's copy of ``context_id`` through ``client`` (an ``EdgeClient``), made
        lazily, for :meth:`call`'s ``remote`` (:func:`sparkv.device.remote.server_stream`)."""
        from sparkv.device.remote import server_stream

        return server_stream(client, context_id, **kwargs)

    def find(self, label: str) -> str | None:
        """The id of the (most recently used) context imported with ``label``, or ``None``."""
        ctx = self.registry.find(label)
        return ctx.id if ctx is not None else None

    def swap_out(self, ctx_id: str) -> int:
        """Reclaims every resident chunk of a context now (an app sent to the background, a
        test): clean chunks are dropped, modified ones written. Returns the bytes written."""
        ctx = self._context(ctx_id)
        with ctx.lock, self.registry.lock:
            self.account.drop_hot(ctx)
            if ctx.memory is None:
                return 0
            before = self.counters["reclaim_written_bytes"]
            self.keeper.evict(ctx, range(ctx.memory.geometry.num_token_chunks))
            self.account.check()
            return int(self.counters["reclaim_written_bytes"] - before)

    def drop_flash(self, ctx_id: str) -> None:
        """Drops a context's chunks from RAM **and** flash (a device reclaiming flash space, or
        flash lost): every chunk is absent; the next call recomputes them, or restores them
        from a remote source (:meth:`call`'s ``remote``). Its tokens and journal stay."""
        ctx = self._context(ctx_id)
        with ctx.lock, self.registry.lock:
            self.account.drop_hot(ctx)
            if ctx.memory is None:
                return
            self.swap.forget(ctx)
            self.account.check()

    @contextlib.contextmanager
    def locked(self, ctx_id: str) -> Iterator[DeviceContext]:
        """Holds a context's lock (as a running call does): nothing of it is evicted meanwhile."""
        ctx = self._context(ctx_id)
        with ctx.lock:
            yield ctx

    def list(self) -> list[dict[str, Any]]:
        with self.registry.lock:
            return [self._describe(c) for c in self.registry.live()]

    def damaged_list(self) -> list[dict[str, str]]:
        """The contexts that could not be reopened: ``{id, state: "damaged", reason}`` each
        (:meth:`delete` removes one)."""
        with self.registry.lock:
            return [d.to_dict() for d in self.damaged.values()]

    def describe(self, ctx_id: str) -> dict[str, Any]:
        return self._describe(self._context(ctx_id))

    def _context(self, ctx_id: str) -> DeviceContext:
        """The live context ``ctx_id``: :class:`ContextDamaged` if it could not be reopened,
        :class:`UnknownContext` if there is none."""
        with self.registry.lock:
            damaged = self.damaged.get(ctx_id)
        if damaged is not None:
            raise ContextDamaged(f"context {ctx_id} could not be reopened: {damaged.reason}; "
                                 "delete it")
        return self.registry.get(ctx_id)

    def _describe(self, c: DeviceContext) -> dict[str, Any]:
        res = fl = ab = 0
        if c.memory is not None:
            g = c.memory.geometry
            for t in range(g.num_token_chunks):
                r = [c.memory.residency(cid) for cid in token_chunk_ids(g, t)]
                if all(x == Residency.RESIDENT for x in r):
                    res += 1
                elif any(x == Residency.ABSENT for x in r):
                    ab += 1
                else:
                    fl += 1
        mix: dict[str, int] = {}
        for lv in c.levels:
            mix[lv] = mix.get(lv, 0) + 1
        return {"id": c.id, "tokens": len(c.tokens), "calls": c.calls,
                "bytes": c.memory.nbytes if c.memory is not None else 0,
                "chunks": {"resident": res, "flash": fl, "absent": ab}, "levels": mix,
                "last_used": c.last_used, "busy": c.lock.locked(), "hot": c.hot is not None,
                "system_prompt": c.system_prompt, "label": c.label}

    def stats(self) -> dict[str, Any]:
        with self.registry.lock:
            levels: dict[str, int] = {}
            for c in self.contexts.values():
                if c.memory is not None:
                    for lv, b in c.memory.account().resident.items():
                        levels[lv] = levels.get(lv, 0) + b
            return {"policy": self.config.name, "budget_bytes": self.budget,
                    "used_bytes": self.account.used(), "peak_bytes": self.account.peak_bytes,
                    "budget_violations": self.account.violations,
                    "contexts": len(self.contexts), "damaged": len(self.damaged),
                    "resident_bytes_by_level": levels,
                    "io_profile": self.io.to_dict(),
                    "recompute_scale": self.recompute.scale, "reopened": self.reopened,
                    **self.counters}

    def text(self, ctx_id: str) -> str:
        """The context's text so far (its token ids decoded)."""
        ctx = self._context(ctx_id)
        return self.lm.decode_tokens(ctx.tokens + ctx.pending)

    # ---- one call --------------------------------------------------------------------------------
    def _call(self, ctx: DeviceContext, ids: list[int], max_new: int, grow: bool,
              stop_at_eos: bool, remote: Any = None) -> CallResult:
        t0 = time.perf_counter()
        n = len(ctx.tokens)
        spare = len(ids) + max_new + 1
        before = dict(self.counters)
        sw = self.keeper.switch_in(ctx, spare, remote)
        switch_s = time.perf_counter() - t0
        rec = DensityRecorder(n + spare)
        with recording(rec):
            tokens, first_s = self._generate(sw.working, n, ids, max_new, grow, stop_at_eos)
        first_s = switch_s + first_s if max_new > 0 else time.perf_counter() - t0
        if grow:
            added = ids + (tokens[:-1] if tokens else [])
            ctx.add_density(rec, n + len(added))
            ctx.tokens = ctx.tokens + added
            ctx.pending = tokens[-1:] if tokens else []
            self.keeper.fold_back(ctx, sw.working, n)
        else:
            ctx.add_density(rec, n)
            self.keeper.release(ctx, sw.working)
        ctx.calls += 1
        ctx.last_used = self.registry.tick()
        t_aot = time.perf_counter()
        aot_bytes = self._after_call(ctx)
        aot_s = time.perf_counter() - t_aot
        self.counters["calls"] += 1
        eos = self._eos()
        text = self.lm.decode_tokens([t for t in tokens if t not in eos]) if tokens else ""
        return CallResult(
            ctx.id, text, tokens, switch_s, reclaim_s=sw.reclaim_s,
            load_s=sw.stats.total_s if sw.stats else 0.0, first_token_s=first_s,
            total_s=time.perf_counter() - t0, aot_s=aot_s, context_tokens=len(ctx.tokens),
            bytes_evicted=int(self.counters["evicted_bytes"] - before["evicted_bytes"]),
            bytes_written_at_reclaim=int(self.counters["reclaim_written_bytes"]
                                         - before["reclaim_written_bytes"]),
            bytes_written_aot=aot_bytes, load=sw.stats.to_dict() if sw.stats else {},
            plan=sw.split.__dict__ if sw.split else {})

    def _generate(self, W: ContextKV, n: int, ids: list[int], max_new: int, grow: bool,
                  stop_at_eos: bool) -> tuple[list[int], float]:
        """Runs ``ids`` after the ``n`` tokens of working memory ``W`` and decodes up to
        ``max_new`` tokens (``W`` keeps them if ``grow``); returns them and the seconds to the
        first one (0 when nothing is decoded)."""
        from sparkv.cache import SparkvCache
        from sparkv.runtime.generate import greedy_generate

        if max_new > 0:
            gen = greedy_generate(self.lm, W, n, ids, max_new, stop_at_eos=stop_at_eos, keep=grow)
            return gen.tokens, gen.first_token_s
        with torch.inference_mode():
            cache = SparkvCache(W)
            x = torch.tensor([ids], dtype=torch.long, device=self.lm.device)
            pos = torch.arange(n, n + len(ids), device=self.lm.device)
            model_call(self.lm.model, input_ids=x, cache=cache, position_ids=pos[None],
                          cache_position=pos, use_cache=True, logits_to_keep=1)
            if grow:
                cache.commit()
            else:
                W.truncate()
        return [], 0.0

    def _after_call(self, ctx: DeviceContext) -> int:
        """Swaps the context out ahead of time (``aot``) and journals it; returns the bytes
        written ahead of time."""
        written = self.keeper.write_ahead(ctx)
        self.counters["aot_written_bytes"] += written
        if self.journal is not None:
            self.journal.write(ctx.id, ctx.record(self.lm.fingerprint))
        return written
