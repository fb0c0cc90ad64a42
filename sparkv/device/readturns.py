"""Calls that leave their context as it was read one working memory at once: :class:`ReadTurns`.

A call with ``grow=False`` (a question about a document: the asks' calls, ``n`` sampled
choices of one question) only reads its working memory: its own tokens stay in a fork
(:class:`~sparkv.cache.fork.ForkCache`). So while one such call runs its turn over a working
memory it switched in (it *opens* a read turn), another such call on the same context *joins*
it: it takes no context lock, switches nothing in, and runs its own turn over the same memory
at once; the answer tokens of both ride one forward pass where the asks' cores batch them.

* :meth:`ReadTurns.opened`: a call holding the context's lock opens its read turn for a block;
  at the block's end nobody joins any more, and it waits until every joiner has left (the
  working memory is released only then). The service's opener closes it first
  (:meth:`ReadTurns.close`): when joiners still read, it returns its answer at once and a
  thread of the service ends the block once they left (releases the working memory, writes
  ahead, journals, gives the context's lock back), so an opener never waits for a joiner's
  answer;
* :meth:`ReadTurns.hold_or_join`: a call waiting for the context's lock joins the read turn
  opened meanwhile, or gets the lock;
* the opener **shares its question's KV** once its question's forward pass ran
  (:meth:`ReadTurns.share`): a joiner of the same scope (an app) whose prompt begins with the
  opener's waits for it and appends those rows instead of running them
  (:meth:`ReadTurns.question_rows`): the ``n`` sampled choices of one request run their
  question once;
* each joiner hands its turn's densities to the read turn (:meth:`ReadTurns.leave`); the opener
  adds them to the context with its own, as it holds the context.

A call that grows its context waits for the lock as before: at most until the read turn open
then and its joiners end (a read turn is open only during its opener's turn), never for a
stream of later readers.

State: the open read turns, by context id; one condition guards them and their joiners.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from sparkv.cache import ContextKV
from sparkv.device.tails import TailHit, common_prefix

__all__ = ["ReadTurn", "ReadTurns", "JOIN_POLL_S"]

#: how often a call waiting for its context's lock looks for a read turn to join (s)
JOIN_POLL_S = 0.02


@dataclass(eq=False)
class ReadTurn:
    """An open read turn: the working memory (``n`` tokens) its calls read, the opener's prompt
    and scope, where the working memory's token chunks came from (the opener's load's
    ``sources``: a joiner reports them as its own), how many read it now (the opener included),
    the densities the joiners that left recorded, and the opener's question rows once shared."""

    ctx_id: str
    working: ContextKV
    n: int
    ids: tuple[int, ...] = ()
    scope: str = ""
    sources: dict[str, int] = field(default_factory=dict)
    readers: int = 1
    joined: int = 0                                 # joiners so far
    densities: list[Any] = field(default_factory=list)
    rows: Any = None                                # the opener's question KV, per layer
    closed: bool = False


class ReadTurns:
    """The service's open read turns (module docstring)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._open: dict[str, ReadTurn] = {}

    @contextlib.contextmanager
    def opened(self, ctx_id: str, working: ContextKV, n: int, ids: Sequence[int] = (),
               scope: str = "", sources: dict[str, int] | None = None) -> Iterator[ReadTurn]:
        """Opens a read turn of ``ctx_id`` over ``working`` for the block (the caller holds the
        context's lock; ``ids``: its prompt, ``scope``: whose turns these are); on leaving,
        closes it and waits for its joiners to leave (``sources``: :attr:`ReadTurn.sources`)."""
        turn = ReadTurn(ctx_id, working, n, tuple(ids), scope, dict(sources or {}))
        with self._cv:
            if ctx_id in self._open:
                raise RuntimeError(f"context {ctx_id} already has a read turn open")
            self._open[ctx_id] = turn
        try:
            yield turn
        finally:
            self.close(turn)
            with self._cv:
                while turn.readers > 1:
                    self._cv.wait()

    def close(self, turn: ReadTurn) -> bool:
        """Nobody joins ``turn`` any more (its opener's turn ended); whether joiners still read
        it (its opener may then hand the turn's end to the last of them: the call flow's
        ``_finish_read``). Closing twice is a no-op."""
        with self._cv:
            if not turn.closed:
                turn.closed = True
                if self._open.get(turn.ctx_id) is turn:
                    del self._open[turn.ctx_id]
                self._cv.notify_all()             # joiners waiting for rows it never shared
            return turn.readers > 1

    def hold_or_join(self, lock: threading.Lock, ctx_id: str, timeout_s: float | None
                     ) -> ReadTurn | bool:
        """Joins ``ctx_id``'s read turn, or takes ``lock`` (the context's), whichever comes
        first within ``timeout_s`` (``None``: for ever): the joined turn (leave it with
        :meth:`leave`), ``True`` with the lock held, ``False`` if neither came in time."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            turn = self._join(ctx_id)
            if turn is not None:
                return turn
            wait = JOIN_POLL_S if deadline is None else min(JOIN_POLL_S,
                                                            deadline - time.monotonic())
            if lock.acquire(timeout=max(wait, 0.0)):
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def _join(self, ctx_id: str) -> ReadTurn | None:
        with self._cv:
            turn = self._open.get(ctx_id)
            if turn is not None:
                turn.readers += 1
                turn.joined += 1
            return turn

    def share(self, turn: ReadTurn, rows: Any) -> None:
        """The opener's question ran: ``rows`` (per layer ``(K, V)`` ``[Hkv, len(ids), D]``)
        are its KV, for joiners to append."""
        with self._cv:
            turn.rows = rows
            self._cv.notify_all()

    def question_rows(self, turn: ReadTurn, ids: Sequence[int], scope: str, least: int,
                      beyond: int = 0) -> TailHit | None:
        """The opener's question rows a joiner of ``scope`` with prompt ``ids`` appends: the
        common prefix, short of ``ids``' last (which runs for the first token's logits), once
        the opener shared them. ``None`` (without waiting) for another scope, a prefix of at
        most ``beyond`` tokens (what the joiner has already), or one shorter than ``least``
        that is not the whole prompt but its last; ``None`` too when the turn closed without
        sharing."""
        m = min(common_prefix(turn.ids, ids), len(ids) - 1)
        if scope != turn.scope or m <= max(beyond, 0) or (m < least and m < len(ids) - 1):
            return None
        with self._cv:
            while turn.rows is None and not turn.closed:
                self._cv.wait()
            return None if turn.rows is None else TailHit(turn.rows, m)

    def leave(self, turn: ReadTurn, density: Any = None) -> None:
        """A joiner is done with ``turn``; ``density`` (its turn's, if it ran) goes to the
        opener."""
        with self._cv:
            if density is not None:
                turn.densities.append(density)
            turn.readers -= 1
            self._cv.notify_all()

    def open_count(self) -> int:
        with self._cv:
            return len(self._open)
