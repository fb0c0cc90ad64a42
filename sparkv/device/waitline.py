"""First come, first served for reservations that wait for a turn to end.

A call's reservation (a switch-in, a new or adopted context) that finds its memory held by
calls running their turn waits for one to end
(:meth:`~sparkv.device.callflow.CallFlow.reserving`). Before this line, a call arriving
meanwhile whose own reservation fitted took the memory at once, and the
waiting one retried at the next turn's end: a stream of small calls could keep a large one
waiting for ever. Here, once a reservation waits, later ones queue behind it and try only when
everything ahead of them has gone (taken its memory, or failed): the order of vLLM's
first-come-first-served scheduler, which schedules no later request while an earlier one does
not fit.

Every method is called with the condition's lock held (the service's model lock); each change
of the line notifies every waiter, so no wake-up is lost.

:class:`RetryLine` is the order before the line, kept for comparison (``ServiceConfig.
reservation_order = "retry"``, ``bench/reservation_order.py``): no queue, each waiting
reservation retries at every turn's end and whoever fits first takes the memory.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import TypeVar

_T = TypeVar("_T")


class WaitLine:
    """The queue of reservations waiting for the memory running turns hold.

    Args:
        turn_ended: the condition notified when a turn ends (its lock is the model lock).
        busy: what a reservation raises when running turns hold the memory it needs (the
            service's :class:`~sparkv.device.errors.BudgetBusy`).
        turns_running: how many turns run now.
    """

    def __init__(self, turn_ended: threading.Condition, busy: type[Exception],
                 turns_running: Callable[[], int]) -> None:
        self._cond = turn_ended
        self._busy, self._turns_running = busy, turns_running
        self._line: deque[object] = deque()

    def __len__(self) -> int:
        return len(self._line)

    def take(self, take: Callable[[], _T], wait: Callable[[], None]) -> _T:
        """``take()`` in its turn of the line.

        With nobody waiting, ``take()`` runs at once. When it raises ``busy`` while turns run, or
        when others already wait, the caller joins the line and ``wait()`` (which waits on the
        condition) until it is first; then ``take()`` again at each turn's end. ``busy`` is
        raised as it comes when no turn runs (nothing will free the memory)."""
        ticket: object | None = None
        try:
            while True:
                if ticket is None and self._line:   # others wait already: behind them
                    ticket = self._join()
                if ticket is None or self._line[0] is ticket:
                    got = self._attempt(take)
                    if got is not _BUSY:
                        return got  # type: ignore[return-value]
                    if ticket is None:
                        ticket = self._join()
                wait()
        finally:
            if ticket is not None:
                self._line.remove(ticket)
                self._cond.notify_all()    # the next in line tries now

    def _attempt(self, take: Callable[[], _T]) -> _T | object:
        """``take()``, or :data:`_BUSY` when it found its memory held by running turns; with
        no turn running, ``busy`` is raised."""
        try:
            return take()
        except self._busy:
            if self._turns_running() == 0:
                raise
        return _BUSY

    def _join(self) -> object:
        ticket = object()
        self._line.append(ticket)
        return ticket


class RetryLine(WaitLine):
    """No line: a reservation that waits retries at every turn's end, and a later call whose
    memory fits meanwhile takes it first (the order before :class:`WaitLine`)."""

    def take(self, take: Callable[[], _T], wait: Callable[[], None]) -> _T:
        while (got := self._attempt(take)) is _BUSY:
            wait()
        return got  # type: ignore[return-value]


#: what :meth:`WaitLine._attempt` returns when the memory is held by running turns
_BUSY = object()

#: ``ServiceConfig.reservation_order``: the lines by name
RESERVATION_ORDERS: dict[str, type[WaitLine]] = {"fcfs": WaitLine, "retry": RetryLine}
