"""Admission control: at most ``slots`` asks run at once, at most ``queue`` more wait, in arrival
order; past that an ask is refused at once (429 ``queue_full`` with ``Retry-After``), never
queued without bound.

:meth:`Admission.enter` either gives the ask a :class:`Place` (running, or waiting in the queue)
or raises :class:`QueueFull`. A waiting place gets the next free slot in arrival order (first
come, first served: an ask waits at most for the asks ahead of it, so none starves under a steady
stream of others); :meth:`Place.wait` returns when it has one, or ``False`` when the ask was
cancelled meanwhile (it leaves the queue). :meth:`Place.leave` gives the slot (or the queue
place) back, once, whatever happened.

A **group** (:meth:`Admission.enter_group`: the ``n`` sampled choices of one request, which
read one working memory and ride the same passes) takes one slot, or one place in the queue,
for all its asks: they start together, and the slot is given back when the last of them leaves
(one cancelled while waiting leaves the group; the last leaves the queue).

``Retry-After`` is an estimate: the mean running time of the last asks times the asks ahead,
over the slots (at least 1 s).

State: the running count, the queue (of slots), the mean; one condition variable guards them.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

from sparkv.device.errors import QueueFull, ShuttingDown

__all__ = ["Admission", "Place"]


class _Slot:
    """What one slot (or queue place) holds: a group of asks (one, or a request's choices)."""

    def __init__(self, members: int) -> None:
        self.running = False
        self.members = members       # asks of the group that have not left


class Admission:
    """``slots`` running asks, ``queue`` waiting ones (module docstring)."""

    def __init__(self, slots: int, queue: int) -> None:
        if slots < 1 or queue < 0:
            raise ValueError(f"need at least one slot and a queue of 0 or more, not "
                             f"{slots} and {queue}")
        self.slots, self.queue = slots, queue
        self._cv = threading.Condition()
        self._running = 0
        self._waiting: deque[_Slot] = deque()
        self._mean_s = 5.0        # running time of an ask, before any has run
        self._closed = False
        self.refused = 0

    def enter(self) -> "Place":
        """A place for a new ask (running at once when a slot is free, else waiting); raises
        :class:`QueueFull` when the queue is full, :class:`ShuttingDown` once closed."""
        return self.enter_group(1)[0]

    def enter_group(self, members: int) -> list["Place"]:
        """Places for ``members`` asks that share one slot (module docstring), as
        :meth:`enter` gives one."""
        if members < 1:
            raise ValueError(f"a group has at least one ask, not {members}")
        with self._cv:
            if self._closed:
                raise ShuttingDown("the device service is stopping")
            slot = _Slot(members)
            if self._running < self.slots and not self._waiting:
                self._running += 1
                slot.running = True
            elif len(self._waiting) < self.queue:
                self._waiting.append(slot)
            else:
                self.refused += 1
                exc = QueueFull(f"{self.slots} asks are running and {len(self._waiting)} "
                                "waiting (the most the service queues): try again later")
                exc.retry_after_s = self._retry_after(len(self._waiting) + 1)
                raise exc
            return [Place(self, slot) for _ in range(members)]

    def _retry_after(self, ahead: int) -> int:
        return max(1, math.ceil(self._mean_s * ahead / self.slots))

    def stats(self) -> dict[str, int]:
        with self._cv:
            return {"slots": self.slots, "queue": self.queue, "running": self._running,
                    "waiting": len(self._waiting), "refused": self.refused}

    def close(self) -> None:
        """Takes no new ask (those admitted go on)."""
        with self._cv:
            self._closed = True

    # ---- a place's side --------------------------------------------------------------------
    def _wait(self, place: "Place", cancelled: threading.Event) -> bool:
        with self._cv:
            while not place.running:
                if cancelled.is_set():
                    self._gone(place)
                    return False
                self._cv.wait(0.05)
            return True

    def _leave(self, place: "Place", ran_s: float | None) -> None:
        with self._cv:
            if not place.left and place.running and ran_s is not None:
                self._mean_s = 0.8 * self._mean_s + 0.2 * ran_s
            self._gone(place)

    def _gone(self, place: "Place") -> None:
        """``place`` leaves (once; under the lock): its slot is given back, or leaves the
        queue, with the last of its group."""
        if place.left:
            return
        place.left = True
        slot = place.slot
        slot.members -= 1
        if slot.members == 0:
            if slot.running:
                self._running -= 1
            else:
                self._waiting.remove(slot)
            while self._waiting and self._running < self.slots:
                head = self._waiting.popleft()
                head.running = True
                self._running += 1
            self._cv.notify_all()

    def position(self, place: "Place") -> int:
        """How many slots wait ahead of ``place``'s, its own included (0 when it runs)."""
        with self._cv:
            return 0 if place.running else self._waiting.index(place.slot) + 1


class Place:
    """One ask's place: running, or waiting in the queue (:class:`Admission`); the asks of a
    group share one ``slot``."""

    def __init__(self, admission: Admission, slot: _Slot) -> None:
        self._admission = admission
        self.slot = slot
        self.left = False
        self._started: float | None = None

    @property
    def running(self) -> bool:
        return self.slot.running

    def wait(self, cancelled: threading.Event) -> bool:
        """Blocks until the ask may run (``True``), or until ``cancelled`` is set while it
        waits (``False``: it left the queue)."""
        ok = self._admission._wait(self, cancelled)
        if ok:
            self._started = time.monotonic()
        return ok

    def position(self) -> int:
        return self._admission.position(self)

    def leave(self) -> None:
        """Gives the slot or the queue place back (once)."""
        ran = time.monotonic() - self._started if self._started is not None else None
        self._admission._leave(self, ran)
