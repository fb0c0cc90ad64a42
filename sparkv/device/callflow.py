"""The order of one call of the context service, and the model lock it runs under:
:class:`CallFlow`.

A call, its context's lock held and the model lock (``run``) taken (:mod:`sparkv.device.service`
checks its arguments and takes them):

1. **switches its context in**: the keeper reserves what it needs, in the reservation line's
   order (:meth:`CallFlow.reserving`), and fills a working memory;
2. **runs its turn** (:func:`~sparkv.device.calls.run_turn`) with the model lock given back
   (:meth:`CallFlow.turn`), so calls on other contexts switch in, run and fold meanwhile; a
   call that leaves its context as it was opens a read turn that others join
   (:mod:`~sparkv.device.readturns`; :meth:`CallFlow.joined` is a joiner's call);
3. **folds** its new tokens back (a growing call) or releases the working memory;
4. **writes ahead** and journals the context (:meth:`CallFlow.after_call`), a read turn's
   opener whose joiners still read handing that end to a thread of its own.

State: the model lock, the turns running without it, the reservations waiting for a turn's
end, and the open read turns.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, TypeVar

import torch

from sparkv.cache import ContextKV
from sparkv.device.calls import CallResult, run_turn
from sparkv.device.config import ServiceConfig
from sparkv.device.counters import ServiceCounters
from sparkv.device.errors import BudgetBusy, DeviceError, FlashFull
from sparkv.device.inputs import check_length
from sparkv.device.journal import Journal, commit, revert
from sparkv.device.keeper import Keeper, SwitchIn
from sparkv.device.loader import LoadStats
from sparkv.device.prompts import turn_ids
from sparkv.device.readturns import ReadTurn, ReadTurns
from sparkv.device.registry import ContextRegistry, DeviceContext
from sparkv.device.swap import SwapStore
from sparkv.device.tails import MIN_REUSE, Rows, TailKey, TurnTails
from sparkv.device.waitline import RESERVATION_ORDERS
from sparkv.layout import ChunkGeometry
from sparkv.runtime import promptscore

if TYPE_CHECKING:
    from sparkv.device.remote import RemoteSource
    from sparkv.runtime.model import LoadedModel
    from sparkv.runtime.sampling import Sampling

__all__ = ["CallFlow"]

log = logging.getLogger("sparkv.device")

_T = TypeVar("_T")


class CallFlow:
    """One call's order over the service's parts (module docstring).

    ``run``: the model lock: what touches the memory runs one at a time under it (new contexts,
    a call's switch-in and fold-back); ``turns``: the calls running their turn without it;
    ``reads``: the open read turns."""

    def __init__(self, lm: LoadedModel, config: ServiceConfig, registry: ContextRegistry,
                 keeper: Keeper, counters: ServiceCounters, tails: TurnTails,
                 journal: Journal | None, swap: SwapStore, vocab: int, max_tokens: int) -> None:
        self.lm, self.config, self.registry, self.keeper = lm, config, registry, keeper
        self.account = keeper.budget
        self.counters, self.tails, self.journal, self.swap = counters, tails, journal, swap
        self.vocab, self.max_tokens = vocab, max_tokens
        self.run = threading.Lock()
        self._turn_ended = threading.Condition(self.run)
        self.turns = 0              # calls running their turn, the model lock given back
        # reservations waiting for a turn's end, in the configured order
        self._line = RESERVATION_ORDERS[config.reservation_order](
            self._turn_ended, BudgetBusy, lambda: self.turns)
        self.reads = ReadTurns()     # calls reading one working memory at once
        self._readers = itertools.count()
        g = ChunkGeometry.from_config(lm.config, 1, config.chunk_tokens)
        self._per_token_bytes = (2 * g.num_layers * g.num_kv_heads * g.head_dim
                                 * torch.empty((), dtype=lm.dtype).element_size())

    def waiting(self) -> int:
        """Reservations waiting for a turn's end."""
        return len(self._line)

    # ---- what a call runs ------------------------------------------------------------------------
    def turn_ids(self, ctx: DeviceContext, prompt: str | None,
                 prompt_ids: Sequence[int] | None, max_new: int) -> list[int]:
        """The ids a call on ``ctx`` runs (its pending tokens first), checked."""
        ids = turn_ids(self.lm, ctx.pending, prompt, prompt_ids, chatml=bool(self.lm.chatml),
                       eos=self.lm.eos_ids if ctx.pending else ())
        if not ids:
            raise DeviceError("the prompt is empty")
        check_length(len(ctx.tokens), len(ids) + max_new, self.max_tokens,
                     f"context {ctx.id}, with a {len(ids)}-token prompt and "
                     f"{max_new} new tokens,")
        return ids

    def reuses_prompts(self) -> bool:
        """Whether a call may reuse (and keep) a kept tail's KV for its prompt: the tails have
        room, and the calling thread scores no prompt (its every token runs:
        :mod:`sparkv.runtime.promptscore`)."""
        return self.tails.capacity > 0 and promptscore.active() is None

    def reads_shared(self, grow: bool, max_new: int) -> bool:
        """Whether a call reads a working memory with others (:mod:`~sparkv.device.readturns`):
        it leaves its context as it was and answers, turns run without the model lock, and
        ``config.shared_reads``."""
        cfg = self.config
        return not grow and max_new > 0 and cfg.overlap_turns and cfg.shared_reads

    # ---- one call --------------------------------------------------------------------------------
    def call(self, ctx: DeviceContext, ids: list[int], max_new: int, grow: bool,
             stop_at_eos: bool, remote: RemoteSource | None = None, stop: Sequence[str] = (),
             turn_scope: str = "", sampling: Sampling | None = None,
             holds: contextlib.ExitStack | None = None) -> CallResult:
        """One call holding ``ctx``'s lock and the model (``holds``: what holds them; a read
        turn's opener whose joiners still read hands them to :meth:`_finish_read`)."""
        t0 = time.perf_counter()
        n = len(ctx.tokens)
        before = self.counters.snapshot()
        sampling = sampling.with_seed() if sampling is not None else None   # to report it
        tails = not grow and max_new > 0 and self.reuses_prompts()
        where = TailKey(ctx.id, n, turn_scope)
        known = self.tails.match(where, ids, MIN_REUSE) if tails else None
        fork = 0 if grow else self._per_token_bytes * (len(ids) + max_new)
        sw = self.reserving(lambda: self._switch_in(ctx, len(ids) + max_new + 1, remote, fork),
                            ctx)
        counted = self.counters.since(before)   # the switch's: other calls count meanwhile
        switch_s = time.perf_counter() - t0
        in_turn = contextlib.ExitStack()     # the turn (the model given back), the read turn
        in_turn.callback(self.account.unclaim, _fork_key(ctx))
        read: ReadTurn | None = None
        try:
            if self.config.overlap_turns:
                in_turn.enter_context(self.turn(ctx.id, sw.fold_bytes if grow else 0))
            if self.reads_shared(grow, max_new):
                read = in_turn.enter_context(self.reads.opened(
                    ctx.id, sw.working, n, ids, turn_scope, sw.stats.sources if sw.stats else None))
            turn = run_turn(self.lm, sw.working, n, ids, max_new, grow=grow,
                            stop_at_eos=stop_at_eos, stop=stop, known=known,
                            keep_tail=tails, sampling=sampling,
                            reserve=len(ids) + max_new, share=self._sharer(read))
        except BaseException:        # failed or cancelled: its working memory is given back
            in_turn.close()          # (once the joiners left)
            self.keeper.abandon(ctx, sw.working)
            raise
        first_s = switch_s + turn.first_token_s if max_new > 0 else time.perf_counter() - t0
        if turn.tail is not None:
            self.tails.put(where, ids + turn.tokens[:-1], turn.tail)
        timing = (t0, switch_s, first_s)
        if read is not None and holds is not None and self.reads.close(read):
            self._hand_off(ctx, sw.working, turn.density, read, in_turn, holds)
            self.counters.called()
            return self._result(ctx, turn, sw, counted, timing, stop, sampling)
        in_turn.close()
        self._fold(ctx, sw.working, turn, n, ids, grow, read)
        t_aot = time.perf_counter()
        aot_bytes = self._after_call_or_revert(ctx)
        aot_s = time.perf_counter() - t_aot
        self.counters.called()
        return self._result(ctx, turn, sw, counted, timing, stop, sampling, aot_s, aot_bytes)

    def _switch_in(self, ctx: DeviceContext, spare: int, remote: RemoteSource | None,
                   fork: int) -> SwitchIn:
        """``ctx`` switched in for a call whose prompt and answer take ``spare`` slots. A call
        that grows its context takes them in its working memory; one that leaves it as it was
        (``fork``: its fork's bytes, :func:`run_turn` without ``grow``) keeps them in its fork,
        so its working memory needs none (a kept one is used as it is, never grown for it):
        the fork's bytes are reserved and claimed until its turn ends."""
        if not fork:
            return self.keeper.switch_in(ctx, spare, remote)
        self.account.reserve(fork, ctx)
        self.account.claim(_fork_key(ctx), fork)
        try:
            return self.keeper.switch_in(ctx, 0, remote)
        except BaseException:
            self.account.unclaim(_fork_key(ctx))
            raise

    def _fold(self, ctx: DeviceContext, working: ContextKV, turn: Any, n: int, ids: list[int],
              grow: bool, read: ReadTurn | None) -> None:
        """A returned turn's end: a growing call's prompt and answer folded into ``ctx``; else
        the turn's (and its joiners') densities added and the working memory released."""
        if grow:
            self.tails.forget(ctx.id)
            added = ids + turn.tokens[:-1]
            ctx.add_density(turn.density, n + len(added))
            ctx.grow(added, turn.tokens[-1:])
            self.keeper.fold_back(ctx, working, n)
        else:
            for density in [turn.density, *(read.densities if read is not None else ())]:
                ctx.add_density(density, n)
            self.keeper.release(ctx, working)
        self.registry.touch(ctx)

    def _result(self, ctx: DeviceContext, turn: Any, sw: SwitchIn, counted: ServiceCounters,
                timing: tuple[float, float, float], stop: Sequence[str],
                sampling: Sampling | None, aot_s: float = 0.0, aot_bytes: int = 0
                ) -> CallResult:
        """A switched-in call's result (``turn``: what :func:`run_turn` returned; ``timing``:
        the call's start, its switch's and its first token's seconds)."""
        t0, switch_s, first_s = timing
        return CallResult.of(self.lm, ctx.id, turn.tokens, sw, len(ctx.tokens),
                             counted, switch_s=switch_s,
                             first_token_s=first_s, total_s=time.perf_counter() - t0,
                             aot_s=aot_s, aot_bytes=aot_bytes, stop=stop,
                             turn_tokens_reused=turn.reused,
                             seed=sampling.seed if sampling and not sampling.greedy else None)

    # ---- read turns ------------------------------------------------------------------------------
    def _hand_off(self, ctx: DeviceContext, working: ContextKV, density: Any, read: ReadTurn,
                  in_turn: contextlib.ExitStack, holds: contextlib.ExitStack) -> None:
        """A read turn's opener, joiners still reading: its turn's end (:meth:`_finish_read`)
        goes to a thread of its own, with what holds the context and the model; with no
        thread to be had, the opener ends it itself (it then waits for them, as before)."""
        args = (ctx, working, density, read, in_turn, holds.pop_all())
        try:
            threading.Thread(target=self._finish_read, args=args, daemon=True,
                             name=f"sparkv-read-end-{ctx.id}").start()
        except RuntimeError:            # "can't start new thread"
            self._finish_read(*args)
            return
        self.counters.handed_off()

    def _finish_read(self, ctx: DeviceContext, working: ContextKV, density: Any,
                     read: ReadTurn, in_turn: contextlib.ExitStack,
                     holds: contextlib.ExitStack) -> None:
        """The end of a read turn whose opener returned while joiners still read (on a thread
        of its own): once they left, the densities go to the context, the working memory is
        released, the context written ahead and journaled, and its lock and the model given
        back (``holds``). Errors are logged: the answers are out already."""
        try:
            in_turn.close()                   # waits for the joiners; the model again
            for d in [density, *read.densities]:
                ctx.add_density(d, read.n)
            self.keeper.release(ctx, working)
            self.registry.touch(ctx)
            self._after_call_or_revert(ctx)
        except BaseException:  # noqa: BLE001 - nobody to raise to: the calls have returned
            log.exception("the end of a read turn of context %s failed", ctx.id)
        finally:
            holds.close()

    def joined(self, read: ReadTurn, ctx: DeviceContext, prompt: str | None,
               prompt_ids: Sequence[int] | None, max_new: int, stop_at_eos: bool,
               stop: Sequence[str], turn_scope: str, sampling: Sampling | None
               ) -> CallResult | None:
        """A call that joined ``read`` (:mod:`~sparkv.device.readturns`): its own turn over the
        working memory another call on its context switched in, its question's KV the opener's
        where their prompts begin alike (and a kept tail's where longer); its fork's bytes
        claimed in the account meanwhile. ``None`` (it left the turn) when they do not fit in
        the budget now: it waits for the context's lock instead."""
        t0 = time.perf_counter()
        density = None
        key = f"{ctx.id}/read/{next(self._readers)}"
        try:
            ids = self.turn_ids(ctx, prompt, prompt_ids, max_new)
            if not self.account.try_claim(key, self._per_token_bytes * (len(ids) + max_new)):
                return None
            sampling = sampling.with_seed() if sampling is not None else None
            where = TailKey(ctx.id, read.n, turn_scope)
            tails = self.reuses_prompts()
            known = self.tails.match(where, ids, MIN_REUSE) if tails else None
            if promptscore.active() is None:     # a scored prompt runs whole
                known = self.reads.question_rows(read, ids, turn_scope, MIN_REUSE,
                                                 known.count if known else 0) or known
            turn = run_turn(self.lm, read.working, read.n, ids, max_new, grow=False,
                            stop_at_eos=stop_at_eos, stop=stop, known=known, keep_tail=tails,
                            sampling=sampling, reserve=len(ids) + max_new)
            density = turn.density
        finally:
            self.account.unclaim(key)
            self.reads.leave(read, density)
        if turn.tail is not None:
            self.tails.put(where, ids + turn.tokens[:-1], turn.tail)
        self.registry.touch(ctx)
        self.counters.joined_read()
        self.counters.called()
        loaded = LoadStats(sources=dict(read.sources))     # what the opener's load read
        return CallResult.of(self.lm, ctx.id, turn.tokens,
                             SwitchIn(read.working, loaded, None, 0.0),
                             read.n, ServiceCounters(), switch_s=0.0,
                             first_token_s=turn.first_token_s, total_s=time.perf_counter() - t0,
                             aot_s=0.0, aot_bytes=0, stop=stop, turn_tokens_reused=turn.reused,
                             seed=sampling.seed if sampling and not sampling.greedy else None,
                             joined=True)

    def _sharer(self, read: ReadTurn | None) -> Callable[[Rows], None] | None:
        """What a read turn's opener hands its question's KV to (its joiners wait for it)."""
        if read is None:
            return None
        return lambda rows: self.reads.share(read, rows)

    # ---- the model lock --------------------------------------------------------------------------
    @contextlib.contextmanager
    def turn(self, ctx_id: str, fold_bytes: int) -> Iterator[None]:
        """A call's turn (the model over its own working memory; its context stays in use, so
        nothing of it is reclaimed): the model lock is given back for the block, so other calls
        switch in, run their turns (their answer tokens batched with this one's where the asks'
        cores batch them) and fold back meanwhile. ``fold_bytes`` (what its fold-back may add,
        reserved at its switch-in) stay claimed meanwhile, so no other reservation takes them."""
        self.turns += 1
        self.account.claim(ctx_id, fold_bytes)
        self.run.release()
        try:
            yield
        finally:
            self.run.acquire()
            self.account.unclaim(ctx_id)
            self.turns -= 1
            self._turn_ended.notify_all()

    def reserving(self, take: Callable[[], _T], ctx: DeviceContext | None = None) -> _T:
        """``take()`` (the model lock held) in its turn of the line (``config.reservation_order``,
        :mod:`sparkv.device.waitline`): while calls running their turn hold the memory it needs
        (:class:`BudgetBusy` while any runs), or while earlier reservations wait for theirs, it
        waits for a turn to end, ``ctx`` (a call's context) reclaimable meanwhile, as a call
        waiting for the model. With no turn running, :class:`BudgetBusy` is raised as it comes."""
        def wait() -> None:
            self.counters.waited_for_turn()
            with self.registry.waiting_for(ctx):
                self._turn_ended.wait()

        return self._line.take(take, wait)

    # ---- after a call ----------------------------------------------------------------------------
    def after_call(self, ctx: DeviceContext) -> int:
        """Swaps the context out ahead of time and journals it (:func:`~sparkv.device.journal.
        commit`); returns the bytes written ahead of time."""
        written = commit(ctx, self.keeper, self.journal, self.swap.health, self.lm.fingerprint)
        self.counters.wrote_ahead(written)
        return written

    def _after_call_or_revert(self, ctx: DeviceContext) -> int:
        """:meth:`after_call`; on a full flash the context goes back to its journaled state
        (:func:`~sparkv.device.journal.revert`) before :class:`FlashFull` is raised."""
        try:
            return self.after_call(ctx)
        except FlashFull:
            assert self.journal is not None          # commit() raises only with a journal
            revert(ctx, self.journal, self.registry, self.keeper, self.swap, self.vocab)
            raise


def _fork_key(ctx: DeviceContext) -> str:
    """The account's key of the fork bytes a call on ``ctx`` claims
    (:meth:`CallFlow._switch_in`)."""
    return ctx.id + "#fork"
