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
them), each its app's alone. With :class:`~sparkv.asks.resplogfiles.EventFiles`, each log is
also a file on the device's flash, so a restarted service streams them again
(:meth:`EventLogs.load`): a log cut short (the service stopped before its response ended, or
a power cut took its tail) reads on to the response as it was answered (a stopped one's
failure).

One event loop: the logs are written and read by the service's loop only.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any, AsyncIterator, Callable

from sparkv.asks.respfiles import STOPPED
from sparkv.asks.resplogfiles import (EventFile, EventFiles, ReadLog, end_event,
                                      ends_stream)

_logger = logging.getLogger("sparkv.asks")

__all__ = ["EventLog", "EventLogs", "FINISHED_LOGS", "FINISHED_LOG_BYTES"]

#: how many ended responses' events are kept for readers coming back
FINISHED_LOGS = 32
#: and their bytes at most
FINISHED_LOG_BYTES = 16_000_000


class EventLog:
    """One streamed background response's events (module docstring), of the app ``caller``."""

    def __init__(self, caller: str, file: EventFile | None = None) -> None:
        self.caller, self.file = caller, file
        self.events: list[bytes] = []
        self.nbytes = 0
        self.ended = False
        self._grown = asyncio.Event()

    def add(self, event: bytes) -> None:
        """Adds the next event (to its file too); wakes the readers."""
        self.events.append(event)
        self.nbytes += len(event)
        if self.file is not None and not self.file.add(event):
            self.file = None                    # said in the log: in memory only
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
        response ends. A reader given none by then (it asked after the last event, or after
        events a power cut took: :mod:`sparkv.asks.resplogfiles`) is given the last, when that
        is the event the stream ends with: every reader learns how the response ended."""
        start = i = max(after + 1, 0)
        while True:
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.ended:
                if i == start and self.events and ends_stream(self.events[-1]):
                    yield self.events[-1]
                return
            await self._grown.wait()


class EventLogs:
    """The logs of the streamed background responses running now and of the last that ended
    (module docstring)."""

    def __init__(self, finished: int = FINISHED_LOGS,
                 finished_bytes: int = FINISHED_LOG_BYTES,
                 files: EventFiles | None = None) -> None:
        self.max_finished, self.max_finished_bytes = finished, finished_bytes
        self.files = files
        self._running: dict[str, EventLog] = {}
        self._finished: OrderedDict[str, EventLog] = OrderedDict()

    def open(self, caller: str, rid: str) -> EventLog:
        """A new log for ``caller``'s response ``rid``, running (its file opened)."""
        file = self.files.open(caller, rid) if self.files is not None else None
        self._running[rid] = log = EventLog(caller, file)
        return log

    def end(self, rid: str, keep: bool = True) -> None:
        """Ends the log of ``rid``; kept for readers coming back (its file marked whole) unless
        ``keep`` is false (the response was deleted) or it is bigger than all the ended logs
        may be (its file removed)."""
        log = self._running.pop(rid, None)
        if log is None:
            return
        log.end()
        kept = keep and log.nbytes <= self.max_finished_bytes
        if log.file is not None:
            if kept:
                log.file.end()
            else:
                log.file.remove()
            log.file = None
        if kept:
            self._finished[rid] = log
            self._trim()

    def forget(self, caller: str, rid: str) -> None:
        """Drops ``caller``'s ended log of ``rid`` (the response was deleted), its file too."""
        log = self._finished.get(rid)
        if log is not None and log.caller == caller:
            self._drop(rid)

    def get(self, caller: str, rid: str) -> EventLog | None:
        """``caller``'s log of ``rid`` (``None``: none such, another app's, or no longer
        kept)."""
        log = self._running.get(rid) or self._finished.get(rid)
        return log if log is not None and log.caller == caller else None

    def close(self) -> None:
        """Ends every log (the service is stopping): their readers stop; their files stay as
        they stand, read back by the next service as logs cut short."""
        for log in self._running.values():
            if log.file is not None:
                log.file.stop()
                log.file = None
            log.end()
        self._running.clear()
        if self.files is not None:
            self.files.close()

    def load(self, kept: Callable[[str, str], dict[str, Any] | None]) -> int:
        """Reads the files back (oldest first, within the bounds): the log of each response
        still kept (``kept(app, id)``: its response object, ``None`` when it is not), one cut
        short ended as its response ended (:func:`~sparkv.asks.resplogfiles.end_event`: one the
        service stopped with its ``response.failed``); the others' files removed. Returns how
        many."""
        if self.files is None:
            return 0
        for got in self.files.read_all(self.max_finished_bytes):
            response = kept(got.app, got.rid)
            events = _read_back(got, response)
            if events is None:
                self.files.remove(got.rid)
                continue
            if not got.ended:
                self.files.rewrite(got.app, got.rid, events)
            log = EventLog(got.app)
            for event in events:
                log.add(event)
            log.end()
            self._finished[got.rid] = log
            self._trim()
        return len(self._finished)

    def _drop(self, rid: str) -> None:
        del self._finished[rid]
        if self.files is not None:
            self.files.remove(rid)

    def _trim(self) -> None:
        total = sum(log.nbytes for log in self._finished.values())
        while self._finished and (len(self._finished) > self.max_finished
                                  or total > self.max_finished_bytes):
            rid, log = next(iter(self._finished.items()))
            self._drop(rid)
            total -= log.nbytes


def _read_back(got: ReadLog, response: dict[str, Any] | None) -> list[bytes] | None:
    """The events of a log read back (one cut short ended as its response ended), or ``None``
    when its response is no longer kept."""
    if response is None:
        return None
    if got.ended:
        return got.events
    last = end_event(len(got.events), response)
    if response.get("error") != STOPPED:
        _logger.warning("the events of %s were cut short (a power cut?): they end with the "
                        "response as it was answered", got.rid)
    return got.events if last is None else [*got.events, last]
