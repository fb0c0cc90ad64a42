"""The two paths' queues of one load: :class:`ComputeQueue` (layer steps for the compute thread)
and :class:`LinkQueue` (KV chunks for the link), each with the predicted work it holds.

Steps and chunks are dense ids of the :class:`~sparkv.scheduler.instance.Instance` (step
``t * L + l``, chunk ``step * G + g``). The :class:`~sparkv.scheduler.state.LoadState` owns one
of each; the rules move work between them through it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from sparkv.layout import KVChunkId


class ComputeQueue:
    """Layer steps for the compute thread.

    Attributes:
        order: the queued steps, in the order they are to run.
        on: per step, whether it is on the compute path (queued, running, committed or done).
        running: the step running now (``None``: the compute thread is free), since
            ``running_since`` (s).
        committed: steps handed out after ``running`` (a column), in order.
        queued_s, committed_s: predicted seconds of ``order`` and of ``committed``.
        run_quiet: the link has had nothing but a probe to do since the running run (a step,
            a span or a column) was handed out, as far as the controller saw (set by
            :meth:`Controller.next_steps <sparkv.scheduler.controller.Controller.next_steps>`,
            cleared by any step report that finds the link busy).
    """

    def __init__(self, t_comp: list[float], order: list[int], num_steps: int,
                 done: Iterable[int] = ()) -> None:
        """``t_comp``: predicted seconds per step; ``done``: steps computed before loading
        (on the compute path, not queued)."""
        self.t_comp = t_comp
        self.order = order
        self.on = [False] * num_steps
        for s in order:
            self.on[s] = True
        for s in done:
            self.on[s] = True
        self.running: int | None = None
        self.running_since = 0.0
        self.committed: list[int] = []
        self.committed_s = 0.0
        self.queued_s = float(sum(t_comp[s] for s in order))
        self.run_quiet = True   # the link has been quiet since the running run was handed out

    @property
    def idle(self) -> bool:
        """Nothing queued, running or committed."""
        return not self.order and self.running is None and not self.committed

    def start(self, run: list[int], now: float) -> None:
        """Steps ``run`` (taken out of :attr:`order`) are handed out: the first runs, the
        others are committed after it."""
        for s in run:
            self.queued_s -= self.t_comp[s]
        self.running, self.running_since = run[0], now
        self.committed = run[1:]
        self.committed_s = float(sum(self.t_comp[s] for s in self.committed))

    def next_committed(self, now: float) -> int:
        """The next committed step starts running."""
        s = self.committed.pop(0)
        self.committed_s -= self.t_comp[s]
        self.running, self.running_since = s, now
        return s

    def finished(self, s: int) -> None:
        """Step ``s`` was reported done (running, or committed and reported early)."""
        if self.running == s:
            self.running = None
        elif s in self.committed:
            self.committed.remove(s)
            self.committed_s -= self.t_comp[s]

    def insert_after(self, u: int, deps: set[int]) -> None:
        """Step ``u`` joins the queue after the last of ``deps`` still queued."""
        pos = 0
        for i, q in enumerate(self.order):
            if q in deps:
                pos = i + 1
        self.order.insert(pos, u)
        self.on[u] = True
        self.queued_s += self.t_comp[u]

    def leave(self, s: int) -> None:
        """Step ``s``, just taken out of :attr:`order`, leaves the compute path."""
        self.on[s] = False
        self.queued_s -= self.t_comp[s]

    def remaining(self, factor: float, now: float) -> float:
        """Seconds of work left: predicted seconds x ``factor`` (the compute estimator's),
        the running step's rest included."""
        comp = factor * (self.queued_s + self.committed_s)
        if self.running is not None:
            comp += max(0.0, factor * self.t_comp[self.running] - (now - self.running_since))
        return comp


@dataclass
class Inflight:
    """A fetch the link is receiving: level index, bytes, bytes received, when requested."""

    li: int
    nbytes: int
    received: float = 0.0
    requested_s: float = 0.0


class LinkQueue:
    """KV chunks for the link.

    Attributes:
        order: the queued chunks, in request order.
        on: per chunk, whether it is on the link (queued, in flight, received or arrived).
        level: per chunk, the level index it is (or would be) fetched at.
        inflight: requested chunks not yet received (insertion order: request order).
        received: chunks received and being decoded.
        cancels: in-flight fetches the driver is to abort (taken by ``take_cancellations``).
        queued_bytes, queued_min_bytes: bytes of ``order`` at its levels, and at the cheapest.
        queued_proc: decode seconds of ``order`` at its levels (``t_proc``; 0 without one).
    """

    def __init__(self, nbytes: np.ndarray, cheapest: list[int], level: list[int],
                 order: list[int], t_proc: np.ndarray | None = None) -> None:
        """``nbytes[chunk, level]``; ``cheapest``: each chunk's cheapest allowed level;
        ``level``: each chunk's planned level; ``t_proc[chunk, level]``: decode seconds (for
        :meth:`pending_proc`)."""
        self.nbytes, self.cheapest, self.level = nbytes, cheapest, level
        self.t_proc = t_proc if t_proc is not None else np.zeros(nbytes.shape)
        self.order = order
        self.on = [False] * len(level)
        for c in order:
            self.on[c] = True
        self.inflight: dict[int, Inflight] = {}
        self.received: set[int] = set()
        self.cancels: list[KVChunkId] = []
        self.queued_bytes = float(sum(int(nbytes[c, level[c]]) for c in order))
        self.queued_min_bytes = float(sum(int(nbytes[c, cheapest[c]]) for c in order))
        self.queued_proc = float(sum(float(self.t_proc[c, level[c]]) for c in order))

    def bytes_at(self, c: int, li: int) -> int:
        return int(self.nbytes[c, li])

    def cheapest_bytes(self, c: int) -> int:
        return int(self.nbytes[c, self.cheapest[c]])

    def pop(self, i: int) -> int:
        """Takes the ``i``-th queued chunk out of the queue (still on the link)."""
        c = self.order.pop(i)
        self._left(c)
        return c

    def _left(self, c: int) -> None:
        self.queued_bytes -= int(self.nbytes[c, self.level[c]])
        self.queued_min_bytes -= int(self.nbytes[c, self.cheapest[c]])
        self.queued_proc -= float(self.t_proc[c, self.level[c]])

    def remove(self, c: int) -> None:
        """Queued chunk ``c`` leaves the queue (and the link: the caller clears :attr:`on`)."""
        self.order.remove(c)
        self._left(c)

    def append_cheapest(self, c: int) -> None:
        """Chunk ``c`` joins the queue at its cheapest level."""
        self.level[c] = self.cheapest[c]
        self.order.append(c)
        self.on[c] = True
        self.enqueued(c)

    def enqueued(self, c: int) -> None:
        """Chunk ``c`` was appended to :attr:`order` at its :attr:`level`: the totals."""
        self.queued_bytes += int(self.nbytes[c, self.level[c]])
        self.queued_min_bytes += int(self.nbytes[c, self.cheapest[c]])
        self.queued_proc += float(self.t_proc[c, self.level[c]])

    def pending_bytes(self) -> float:
        """Bytes still to arrive: the queue's and the rest of every in-flight fetch."""
        return self.queued_bytes + sum(max(0.0, f.nbytes - f.received)
                                       for f in self.inflight.values())

    def pending_proc(self) -> float:
        """Decode seconds still ahead: the queue's, every in-flight fetch's and every received
        chunk's (at the levels they are fetched at)."""
        tp, level = self.t_proc, self.level
        return (self.queued_proc + sum(float(tp[c, f.li]) for c, f in self.inflight.items())
                + sum(float(tp[c, level[c]]) for c in self.received))

    def done_after(self) -> dict[int, float]:
        """Per in-flight chunk, the bytes the link delivers until it is complete: its own and
        every in-flight byte ahead of it (a batch is read in order: the last chunk of a batch
        a fade caught is far away even when it is small)."""
        out: dict[int, float] = {}
        ahead = 0.0
        for c, f in self.inflight.items():
            ahead += max(0.0, f.nbytes - f.received)
            out[c] = ahead
        return out
