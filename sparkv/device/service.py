"""The on-device context service (LLMS): many contexts under a memory budget, switched fast.

    svc = ContextService(lm, memory_budget_bytes=64_000_000, swap_dir="/data/sparkv-device")
    cid = svc.new_context("You are a helpful assistant.")
    out = svc.call(cid, "Remember the pass key 7191.", max_new_tokens=32)
    print(out.text, out.switch_s)
    svc.delete(cid)

A **context** is its token ids (kept resident: recomputation needs them) and its KV memory ``C``,
a paged :class:`~sparkv.cache.ContextKV` cut into token chunks of 16 tokens across all layers,
each at its own level (int8 / k8v4 / int4 / int2 from an int8 base, or fp), resident, on flash, or
absent. A call:

1. **locks** the context (a second call on it waits; the eviction never touches a locked context);
2. **switches it in** (the switching latency, timed): its keeper reserves what it needs, reclaiming
   other contexts' memory by the eviction policy, and fills a working memory (a dense fp arena
   with spare slots) from resident chunks, flash reads and recomputation
   (:mod:`sparkv.device.loader`, the split from :mod:`sparkv.device.planner`);
3. **runs** the prompt and decodes the answer over the working memory, recording the density of
   every key the new rows attend (:mod:`sparkv.device.calls`): its *turn*, during which the
   model lock is given back (the context stays in use), so calls on other contexts switch in,
   run and fold meanwhile, and their answer tokens ride one pass where the asks' cores batch
   them;
4. **folds** the new tokens back: its new chunks enter ``C`` at the levels their densities earn;
5. **swaps out ahead of time** every chunk it modified (token chunk records, one grouped durable
   write: one segment file, or one file per token chunk for the chunk-swapping baselines;
   :mod:`sparkv.device.flashio`), so that a later reclaim writes nothing; then journals the
   context and returns.

With ``keep_working`` the call's working memory is kept after it returns while the budget has
room: a later call on the same context uses it as it is. Kept working memories are reclaimed
before any chunk; dropping one writes nothing.

This module is the service's public API; the order of a call (steps 2-5, the model lock, the
calls that read one working memory) is :mod:`~sparkv.device.callflow`'s. The work is done by
the parts:
:mod:`~sparkv.device.registry` (contexts, ids, locks, clock, damaged ones),
:mod:`~sparkv.device.budget` (the account, reservations, eviction policies),
:mod:`~sparkv.device.keeper` (the only owner of a context's memory: :mod:`~sparkv.device.chunked`
for LLMS, :mod:`~sparkv.device.baselines` for whole arenas), :mod:`~sparkv.device.counters`,
:mod:`~sparkv.device.levels`, :mod:`~sparkv.device.swap` (flash files),
:mod:`~sparkv.device.journal` (crash recovery), :mod:`~sparkv.device.calls` (the model run and
the result), :mod:`~sparkv.device.prompts` and :mod:`~sparkv.device.inputs` (turns and checks),
:mod:`~sparkv.device.config` (the policies: LLMS, its ablations, every baseline). A call given a
``remote`` (the server's copy, :mod:`sparkv.device.remote`) may restore missing chunks from it
too (:func:`sparkv.device.restore.restore_plan`).
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import logging
import uuid
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, TypeVar, cast

import torch

from sparkv.cache import ContextKV, LayerKV
from sparkv.device.baselines import BRING_BACK, WholeKeeper
from sparkv.device.callflow import CallFlow
from sparkv.device.chunked import ChunkKeeper
from sparkv.device.config import ServiceConfig, longest_context, resolved_ratio
from sparkv.device.counters import ServiceCounters
from sparkv.device.density import install_hooks
from sparkv.device.errors import ContextBusy, DeviceError
from sparkv.device.flashio import IOProfile, ServiceFlash, load_io_profile
from sparkv.device.hosttier import HostTier, HostTierStats
from sparkv.device.inputs import check_call, check_length, check_token_ids, vocab_size
from sparkv.device.flashlock import FlashDirLock
from sparkv.device.journal import Journal, reopen
from sparkv.device.keeper import Keeper
from sparkv.device.levels import LevelPolicy
from sparkv.device.loader import working_nbytes
from sparkv.device.planner import RecomputeProfile, recompute_cost_model
from sparkv.device.private import check_path, private_dir
from sparkv.device.readturns import ReadTurn
from sparkv.device.prompts import system_turn_ids
from sparkv.device.registry import ContextRegistry, ContextSummary, DamagedContext, DeviceContext
from sparkv.device.swap import SwapStore
from sparkv.device.tails import Rows, TailKey, TurnTails, default_capacity
from sparkv.device.calls import CallResult
from sparkv.layout import ChunkGeometry
from sparkv.runtime.threads import release_pool, use_threads

if TYPE_CHECKING:
    from sparkv.device.remote import RemoteSource
    from sparkv.predictor.cost import StepCostModel
    from sparkv.runtime.model import LoadedModel
    from sparkv.runtime.sampling import Sampling

__all__ = ["ContextService", "ServiceConfig", "CallResult"]

log = logging.getLogger("sparkv.device")

_T = TypeVar("_T", bound=Callable[..., Any])


def _on_own_threads(method: _T) -> _T:
    """A method that computes does it on the service's thread count (:attr:`ContextService.
    threads`: a request's worker thread would otherwise take the process-wide count, which an
    ask's frame decoders set to 1) and frees the thread's idle OpenMP workers after (they would
    slow the next computation on another thread: :mod:`sparkv.runtime.threads`)."""
    @functools.wraps(method)
    def run(self: "ContextService", *args: Any, **kwargs: Any) -> Any:
        use_threads(self.threads)
        try:
            return method(self, *args, **kwargs)
        finally:
            release_pool()
    return cast(_T, run)


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
    :class:`~sparkv.device.budget.MemoryBudget`), ``keeper``, ``swap``, ``host`` (the
    :class:`~sparkv.device.hosttier.HostTier` of ``config.host_tier_bytes``, else ``None``),
    ``journal``, ``counters`` (:class:`~sparkv.device.counters.ServiceCounters`), ``tails``
    (:class:`~sparkv.device.tails.TurnTails`: recent turns' KV, reused by the next call of the
    same conversation; ``config.turn_cache_bytes``).

    ``swap_dir`` is private to this user (``0700``, its files ``0600``:
    :mod:`sparkv.device.private`); one that another user controls (it, or a directory on its
    path) is refused, and so is one another process serves (:mod:`sparkv.device.flashlock`:
    :meth:`close` gives it back). Contexts that cannot be
    reopened from it are listed by :meth:`damaged_list`, refused by :meth:`call` and
    :meth:`describe` (:class:`~sparkv.device.errors.ContextDamaged`), removed by :meth:`delete`.

    Locks: each context's lock for a call on it (:mod:`sparkv.device.registry`); the model lock
    (``flow.run``, :class:`~sparkv.device.callflow.CallFlow`) makes what touches the memory one
    at a time: new contexts, and a call's switch-in and fold-back (their locking and argument
    checks run concurrently). A call's turn runs without it; a reservation that finds the
    memory it needs held by calls in their turn waits for one to end
    (:meth:`CallFlow.reserving <sparkv.device.callflow.CallFlow.reserving>`) rather than failing
    busy.
    """

    def __init__(self, model: LoadedModel | str | None, memory_budget_bytes: int,
                 swap_dir: str | Path, *, config: ServiceConfig | None = None,
                 io_profile: IOProfile | None = None, cost_model: StepCostModel | None = None,
                 **overrides: Any) -> None:
        from sparkv.runtime.model import LoadedModel, load_model

        self.lm = model if isinstance(model, LoadedModel) else load_model(model)
        #: the torch threads its calls compute with, set on the calling thread by each
        #: (:func:`_on_own_threads`)
        self.threads = max(1, torch.get_num_threads())
        cfg = config or ServiceConfig()
        cfg = replace(cfg, **overrides) if overrides else cfg
        ratio = resolved_ratio(cfg, self.lm.fingerprint)
        self.config = replace(cfg, ratio=ratio, turn_cache_bytes=self._turn_cache_bytes(cfg))
        self.counters = ServiceCounters()
        self.registry = ContextRegistry()
        self.contexts = self.registry.contexts
        self.damaged = self.registry.damaged
        check_path(swap_dir, "the flash dir", leaf_mode=False)
        self.swap_dir = private_dir(swap_dir)
        self.flash_lock = FlashDirLock(self.swap_dir)
        self.host = HostTier(self.config.host_tier_bytes) if self.config.host_tier_bytes else None
        self.tails = TurnTails(self.config.turn_cache_bytes or 0)
        self.swap = SwapStore(self.swap_dir, contiguous=self.config.contiguous, host=self.host)
        self.journal = (Journal(self.swap_dir / "journal", self.lm.compute.name)
                        if self.config.journal else None)
        install_hooks(self.lm.model)
        self.vocab = vocab_size(self.lm)
        self.max_tokens = longest_context(self.config, self.lm.max_positions)
        probe = ServiceFlash(self.swap_dir / "probe")
        self.io = io_profile or load_io_profile(self.swap_dir, probe, self.config.io_threads,
                                                measure=self.config.measure_io)
        g1 = ChunkGeometry.from_config(self.lm.config, 1, self.config.chunk_tokens)
        self.recompute = RecomputeProfile(cost_model or recompute_cost_model(self.lm),
                                          g1.num_layers, self.config.chunk_tokens)
        self.levels = LevelPolicy(self.config.compression, ratio,
                                  self.config.fp_fraction, self.config.fp_protect, self.lm.dtype)
        self.keeper = self._keeper(memory_budget_bytes)
        self.account = self.keeper.budget
        self.flow = CallFlow(self.lm, self.config, self.registry, self.keeper, self.counters,
                             self.tails, self.journal, self.swap, self.vocab, self.max_tokens)
        self.reopened = self._reopen()

    def _keeper(self, budget_bytes: int) -> Keeper:
        """The keeper of ``config.put_away`` (chunks, or whole contexts killed or swapped), with
        its budget."""
        parts = (self.lm, self.config, self.registry, self.swap, self.counters, budget_bytes)
        if self.config.put_away == "chunks":
            return ChunkKeeper(*parts, levels=self.levels, io=self.io, recompute=self.recompute)
        return WholeKeeper(*parts, bring_back=BRING_BACK[self.config.put_away](self.swap))

    def _reopen(self) -> int:
        if self.journal is None:
            return 0
        found = reopen(self.journal, self.lm, self.config.chunk_tokens, self.swap, self.keeper)
        for ctx in found:
            self.registry.add(ctx)
        self.registry.add_damaged(self.journal.damaged)
        return len(found)

    def close(self) -> None:
        """Gives the flash dir's lock back (:mod:`sparkv.device.flashlock`): once done with the
        service, so that another process may serve the flash dir."""
        self.flash_lock.release()

    def health(self) -> dict[str, Any]:
        """``{ok, contexts, flash}`` (``GET /healthz``; ``flash``: :class:`~sparkv.device.
        flashio.FlashHealth`, degraded since a write found the flash full)."""
        return {"ok": True, "contexts": len(self.contexts), "flash": self.swap.health.to_dict()}

    @property
    def _chatml(self) -> bool:
        return bool(self.lm.chatml)

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
    @_on_own_threads
    def new_context(self, system_prompt: str | None = None, *,
                    system_ids: Sequence[int] | None = None, label: str | None = None) -> str:
        """Makes a context holding the system prompt (its KV computed now); returns its id.
        ``label``: a name listed with it (journaled, so it survives a restart)."""
        ids = system_turn_ids(self.lm, system_prompt, system_ids, vocab=self.vocab,
                              chatml=self._chatml)
        check_length(0, len(ids) + 1, self.max_tokens,
                     f"a context of this {len(ids)}-token system prompt")
        ctx = self._new(ids, system_prompt)
        ctx.label = label
        with ctx.lock, self.flow.run, self._adding(ctx):
            self.flow.reserving(lambda: self.keeper.create(ctx))
        return ctx.id

    def _new(self, ids: list[int], system_prompt: str | None) -> DeviceContext:
        ctx_id = uuid.uuid4().hex[:16]
        return DeviceContext(ctx_id, ids, system_prompt, self.swap.tier(ctx_id))

    @contextlib.contextmanager
    def _adding(self, ctx: DeviceContext) -> Iterator[None]:
        """Registers a new context for the block; then it becomes the most recently used and is
        swapped out ahead of time and journaled like any returned call. On any failure (a full
        flash too) it is unregistered, its memory freed and its flash directory removed."""
        self.registry.add(ctx)
        try:
            yield
            self.registry.touch(ctx, called=False)
            self.flow.after_call(ctx)
        except BaseException:
            self.registry.remove(ctx.id)
            self.keeper.discard(ctx)
            self.swap.remove(ctx)
            raise

    @_on_own_threads
    def import_context(self, token_ids: Sequence[int], layers: ContextKV | LayerKV, *,
                       density: tuple[torch.Tensor, torch.Tensor] | None = None,
                       system_prompt: str | None = None, label: str | None = None,
                       turn: tuple[Sequence[int], Rows] | None = None,
                       turn_scope: str = "", ahead: bool = True) -> str:
        """Adopts a context whose KV was made elsewhere (the edge's loaded cache, a benchmark's
        prefill): ``layers`` is a :class:`ContextKV` holding every chunk (any chunk size) or per
        layer ``(K, V)`` ``[1, H, N, D]``. ``density``: per-token ``(mass, rows)`` if known (else
        the levels assume equal densities until calls measure them). ``label``: a name to find it
        by later (:meth:`find`; journaled, so it survives a restart). ``turn``: ids and their
        KV computed after the context, kept as a tail of ``turn_scope`` (:meth:`keep_turns`)
        before the context can be found by its label. ``ahead``: written to flash ahead of
        time (after the import and each call) as every context is; ``False``: only when its
        chunks are reclaimed (a copy deleted within seconds: the writes would be wasted)."""
        ids = check_token_ids(token_ids, self.vocab, "token_ids")
        if isinstance(layers, ContextKV) and layers.geometry.num_tokens != len(ids):
            raise DeviceError(f"the memory holds {layers.geometry.num_tokens} tokens, "
                              f"the context has {len(ids)}")
        ctx = self._new(ids, system_prompt)
        ctx.label, ctx.ahead = label, ahead
        # never inference tensors in the memory (an ask keeps its cache at its first answer
        # token, inside its generation's inference mode): they are written in place outside it
        with ctx.lock, self.flow.run, self._adding(ctx), torch.inference_mode(False):
            if density is not None:
                ctx.set_density(*density)
            self.flow.reserving(lambda: self.keeper.adopt(ctx, layers))
            if turn is not None:
                self.keep_turns(ctx.id, *turn, turn_scope=turn_scope)
        return ctx.id

    @_on_own_threads
    def call(self, ctx_id: str, prompt: str | None = None, max_new_tokens: int = 32, *,
             prompt_ids: Sequence[int] | None = None, grow: bool = True, stop_at_eos: bool = True,
             timeout_s: float | None = None, remote: RemoteSource | None = None,
             stop: Sequence[str] = (), turn_scope: str = "",
             sampling: Sampling | None = None) -> CallResult:
        """Runs ``prompt`` in context ``ctx_id`` and returns the answer.

        Args:
            prompt: the user's turn (wrapped in the chat template for chat models).
            prompt_ids: raw token ids to append instead of a text prompt.
            max_new_tokens: answer length; 0 appends the prompt without generating.
            grow: keep the prompt and the answer in the context (a chat); ``False`` answers over
                the context and leaves it as it was (a question about a document).
            timeout_s: how long to wait for a busy context (``None``: wait; then 409).
            stop: stop strings: the answer ends at the token that completes one, its text
                before it (:class:`~sparkv.runtime.stops.StopStrings`).
            remote: a :class:`~sparkv.device.remote.RemoteSource` holding this context (the
                server's copy, :class:`~sparkv.device.remote.ServerStream`): missing chunks may
                then come from it too, the restore planned by
                :func:`~sparkv.device.restore.restore_plan` (flash, server or recompute per
                chunk, by predicted cost). Used only while the context holds exactly the
                remote's tokens (``grow=False`` calls, as ``ask`` makes).
            turn_scope: whose turns these are (an app): a ``grow=False`` call reuses the KV of
                turns that an earlier call of the same scope ran after this context
                (:mod:`~sparkv.device.tails`), never another scope's.
            sampling: how each answer token is chosen (default: greedy); a sampled call
                without a seed draws one (:attr:`CallResult.seed`).
        """
        ctx = self.registry.get(ctx_id)
        prompt_ids, timeout_s = check_call(prompt, prompt_ids, max_new_tokens, timeout_s,
                                           vocab=self.vocab, most=self.config.max_new_tokens)
        if sampling is not None:
            check_token_ids([t for t, _ in sampling.logit_bias], self.vocab, "logit_bias's ids")
        flow = self.flow
        held = False
        if flow.reads_shared(grow, max_new_tokens):
            got = flow.reads.hold_or_join(ctx.lock, ctx.id, timeout_s)
            if got is False:
                raise ContextBusy(f"context {ctx.id} is running another call")
            if isinstance(got, ReadTurn):
                res = flow.joined(got, ctx, prompt, prompt_ids, max_new_tokens, stop_at_eos,
                                  stop, turn_scope, sampling)
                if res is not None:
                    return res
            held = got is True
        with contextlib.ExitStack() as holds:      # a read turn's opener may hand them off
            holds.enter_context(self.registry.holding(ctx, timeout_s, held=held))
            ids = flow.turn_ids(ctx, prompt, prompt_ids, max_new_tokens)
            holds.enter_context(self.registry.running(ctx, flow.run))
            return flow.call(ctx, ids, max_new_tokens, grow, stop_at_eos, remote, stop,
                             turn_scope, sampling, holds)

    def _turn_cache_bytes(self, cfg: ServiceConfig) -> int:
        """``cfg.turn_cache_bytes``, its ``None`` resolved for this model
        (:func:`~sparkv.device.tails.default_capacity`)."""
        if cfg.turn_cache_bytes is not None:
            return cfg.turn_cache_bytes
        g = ChunkGeometry.from_config(self.lm.config, 1, cfg.chunk_tokens)
        element = torch.empty((), dtype=self.lm.dtype).element_size()
        return default_capacity(2 * g.num_layers * g.num_kv_heads * g.head_dim * element)

    def keep_turns(self, ctx_id: str, token_ids: Sequence[int], rows: Rows, *,
                   turn_scope: str = "") -> bool:
        """Keeps ``rows`` (per layer ``(K, V)`` ``[kv_heads, len(token_ids), head_dim]``), the KV
        of ``token_ids`` computed after context ``ctx_id`` as it is now (an ask's question and
        answer over the cache it then imported), as a tail of ``turn_scope``
        (:mod:`~sparkv.device.tails`); returns whether it is kept (not when larger than the
        turn cache). :class:`DeviceError` for rows of another shape."""
        ctx = self.registry.get(ctx_id)
        ids = check_token_ids(token_ids, self.vocab, "token_ids")
        g = ChunkGeometry.from_config(self.lm.config, 1, self.config.chunk_tokens)
        shape = (g.num_kv_heads, len(ids), g.head_dim)
        if len(rows) != g.num_layers or any(tuple(t.shape) != shape for kv in rows for t in kv):
            raise DeviceError(f"a turn's rows are {g.num_layers} layers of {shape} (K, V)")
        rows = [(k.to("cpu", self.lm.dtype), v.to("cpu", self.lm.dtype)) for k, v in rows]
        return self.tails.put(TailKey(ctx_id, len(ctx.tokens), turn_scope), ids, rows)

    def delete(self, ctx_id: str) -> None:
        """Deletes a context: its memory, its flash files and its journal record (of a damaged
        context, whatever is left of them)."""
        if self.registry.pop_damaged(ctx_id):
            self._remove_files(ctx_id)
            return
        ctx = self.registry.get(ctx_id)
        with ctx.lock:
            self.registry.remove(ctx_id)
            self.keeper.discard(ctx)
            self.tails.forget(ctx_id)
            self._remove_files(ctx_id)

    def _remove_files(self, ctx_id: str) -> None:
        self.swap.remove_id(ctx_id)
        if self.journal is not None:
            self.journal.remove(ctx_id)

    def awaited(self, label: str) -> bool:
        """Whether callers wait for a context labelled ``label`` to be imported: never here (the
        asks' loads are awaited in :class:`~sparkv.asks.kept.AppContexts`)."""
        return False

    def find(self, label: str) -> str | None:
        """The id of the (most recently used) context imported with ``label``, or ``None``."""
        return next(iter(self.labelled(label)), None)

    def labelled(self, label: str) -> builtins.list[str]:
        """The ids of the live contexts imported with ``label``, the most recently used first
        (cheap: no context is described, as :meth:`list` does)."""
        return [c.id for c in self.registry.labelled(label)]

    def swap_out(self, ctx_id: str) -> int:
        """Reclaims every resident chunk of a context now (an app sent to the background, a
        test): clean chunks are dropped, modified ones written. Returns the bytes written."""
        ctx = self.registry.get(ctx_id)
        with ctx.lock:
            return self.keeper.swap_out(ctx)

    def drop_flash(self, ctx_id: str) -> None:
        """Drops a context's chunks from RAM **and** flash (a device reclaiming flash space, or
        flash lost): every chunk is absent; the next call recomputes them, or restores them
        from a remote source (:meth:`call`'s ``remote``). Its tokens and journal stay."""
        ctx = self.registry.get(ctx_id)
        with ctx.lock:
            self.keeper.drop_flash(ctx)

    @contextlib.contextmanager
    def locked(self, ctx_id: str) -> Iterator[DeviceContext]:
        """Holds a context's lock (as a running call does): nothing of it is evicted meanwhile."""
        ctx = self.registry.get(ctx_id)
        with ctx.lock:
            yield ctx

    def list(self) -> builtins.list[ContextSummary]:
        with self.registry.lock:
            return [c.describe() for c in self.registry.live()]

    def damaged_list(self) -> builtins.list[DamagedContext]:
        """The contexts that could not be reopened (:meth:`delete` removes one)."""
        return self.registry.damaged_list()

    def describe(self, ctx_id: str) -> ContextSummary:
        return self.registry.get(ctx_id).describe()

    def stats(self) -> dict[str, Any]:
        """The budget's account, the contexts, the profiles and the counters (``GET
        /v1/stats``)."""
        with self.registry.lock:
            host = self.host.stats() if self.host is not None else HostTierStats()
            return {"policy": self.config.name, "device": str(self.lm.device),
                    "host_tier": host.to_dict(), "turn_cache": self.tails.to_dict(),
                    **self.account.stats(), "contexts": len(self.contexts),
                    "damaged": len(self.registry.damaged),
                    "io_profile": self.io.to_dict(), "recompute_scale": self.recompute.scale,
                    "reopened": self.reopened, "turns_running": self.flow.turns,
                    "reservations_waiting": self.flow.waiting(),
                    **self.counters.to_dict()}

    def text(self, ctx_id: str) -> str:
        """The context's text so far (its token ids decoded)."""
        ctx = self.registry.get(ctx_id)
        return self.lm.decode_tokens(ctx.tokens + ctx.pending)
