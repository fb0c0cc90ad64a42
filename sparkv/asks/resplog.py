"""The events of a streamed background response (``background`` with ``stream``: docs/asks.md,
"Background responses"), kept so an app may leave and come back to them: ``GET
/v1/responses/{id}?stream=true&starting_after=N`` (``client.responses.retrieve(id,
stream=True, starting_after=N)``) goes on from the event after the one numbered ``N``, as
OpenAI's API resumes a background stream.

An :class:`EventLog` holds one response's server-sent events in order (an event's
``sequence_number`` is its place), and any number of readers follow it
(:meth:`EventLog.follow`), each from where it left, until the response ends. A reader that
leaves does not stop the response. :class:`EventLogs` holds the logs of the responses running
now and of the last :data:`FINISHED_LOGS` that ended (at most :data:`FINISHED_LOG_BYTES` of
them), each its app's alone.

One event loop: the logs are written and read by the service's loop only.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import AsyncIterator

__all__ = ["EventLog", "EventLogs", "FINISHED_LOGS", "FINISHED_LOG_BYTES"]

#: how many ended responses' events are kept for readers coming back
FINISHED_LOGS = 32
#: and their bytes at most
FINISHED_LOG_BYTES = 16_000_000


class EventLog:
    """One streamed background response's events (module docstring), of the app ``caller``."""

    def __init__(self, caller: str) -> None:
        self.caller = caller
        self.events: list[bytes] = []
        self.nbytes = 0
        self.ended = False
        self._grown = asyncio.Event()

    def add(self, event: bytes) -> None:
        """Adds the next event; wakes the readers."""
        self.events.append(event)
        self.nbytes += len(event)
        self._wake()

    def end(self) -> None:
        """The response ended: readers stop after its last event."""
        self.ended = True
        self._wake()

    def _wake(self) -> None:
        grown, self._grown = self._grown, asyncio.Event()
        grown.set()

    async def follow(self, after: int = -1) -> AsyncIterator[bytes]:
        """The events after the one numbered ``after`` (``-1``: all), as they come, until the
        response ends."""
        i = max(after + 1, 0)
        while True:
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.ended:
                return
            await self._grown.wait()


class EventLogs:
    """The logs of the streamed background responses running now and of the last that ended
    (module docstring)."""

    def __init__(self, finished: int = FINISHED_LOGS,
                 finished_bytes: int = FINISHED_LOG_BYTES) -> None:
        self.max_finished, self.max_finished_bytes = finished, finished_bytes
        self._running: dict[str, EventLog] = {}
        self._finished: OrderedDict[str, EventLog] = OrderedDict()

    def open(self, caller: str, rid: str) -> EventLog:
        """A new log for ``caller``'s response ``rid``, running."""
        self._running[rid] = log = EventLog(caller)
        return log

    def end(self, rid: str, keep: bool = True) -> None:
        """Ends the log of ``rid``; kept for readers coming back unless ``keep`` is false
        (the response was deleted) or it is bigger than all the ended logs may be."""
        log = self._running.pop(rid, None)
        if log is None:
            return
        log.end()
        if keep and log.nbytes <= self.max_finished_bytes:
            self._finished[rid] = log
            self._trim()

    def forget(self, caller: str, rid: str) -> None:
        """Drops ``caller``'s ended log of ``rid`` (the response was deleted)."""
        log = self._finished.get(rid)
        if log is not None and log.caller == caller:
            del self._finished[rid]

    def get(self, caller: str, rid: str) -> EventLog | None:
        """``caller``'s log of ``rid`` (``None``: none such, another app's, or no longer
        kept)."""
        log = self._running.get(rid) or self._finished.get(rid)
        return log if log is not None and log.caller == caller else None

    def close(self) -> None:
        """Ends every log (the service is stopping): their readers stop."""
        for rid in list(self._running):
            self.end(rid, keep=False)

    def _trim(self) -> None:
        total = sum(log.nbytes for log in self._finished.values())
        while self._finished and (len(self._finished) > self.max_finished
                                  or total > self.max_finished_bytes):
            _, log = self._finished.popitem(last=False)
            total -= log.nbytes
