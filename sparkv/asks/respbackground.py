"""Background responses of OpenAI's Responses API (``background: true``; docs/asks.md,
"Background responses"): the request is answered at once with the response ``queued``; the ask
runs on in the service whether or not the app stays connected (a phone's app may be suspended
meanwhile), and the app polls ``GET /v1/responses/{id}`` until its status is ``completed``,
``incomplete``, ``failed`` or ``cancelled``; ``POST /v1/responses/{id}/cancel`` stops it.
With ``stream`` too, the request is answered by the response's events as they come, kept in
an :class:`~sparkv.asks.resplog.EventLog` so the app may leave and read on from where it left
(``GET /v1/responses/{id}?stream=true&starting_after=N``), and written to the device's flash
(:mod:`sparkv.asks.resplogfiles`), so a restarted service streams them again.

:class:`BackgroundResponses` runs them: the kept entry says ``queued`` (its file written:
:mod:`sparkv.asks.respfiles`), then ``in_progress`` at the answer's first token (in memory),
then the final response, kept as any response is. One the service stopped before it ended is
read back after a restart as ``failed`` (``error.code`` ``service_stopped``), not lost. How many
run at once is bounded by the asks' slots and queue (a full queue is a 429 before anything
starts).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Protocol

from sparkv.asks.resplog import EventLog, EventLogs
from sparkv.asks.resplogfiles import EventFiles
from sparkv.asks.tickets import AskTicket

log = logging.getLogger("sparkv.asks")

__all__ = ["BackgroundResponses", "Answering"]


class Answering(Protocol):
    """What a background response is made of (:class:`~sparkv.asks.responses.ResponseOf`)."""

    id: str
    #: the status it was last kept with (``None``: not yet)
    final: str | None

    def events(self, ticket: AskTicket) -> AsyncIterator[bytes]: ...

    def shell(self, status: str, output: list[dict[str, Any]] | None = None,
              done: dict[str, Any] | None = None, error: dict[str, Any] | None = None
              ) -> dict[str, Any]: ...

    def status(self, done: dict[str, Any]) -> str: ...

    def output(self, done: dict[str, Any],
               tokens: list[dict[str, Any]]) -> list[dict[str, Any]]: ...

    def pending(self, response: dict[str, Any]) -> None: ...

    async def answered(self, response: dict[str, Any]) -> dict[str, Any]: ...

    def forget(self) -> None: ...


@dataclass
class _Running:
    caller: str
    ticket: AskTicket
    cancelled: bool = False
    forgotten: bool = False
    log: EventLog | None = None
    task: "asyncio.Task[None] | None" = field(default=None, repr=False)


class BackgroundResponses:
    """The background responses running now, by id, and the events of the streamed ones
    (``logs``: module docstring)."""

    def __init__(self, files: EventFiles | None = None) -> None:
        self._running: dict[str, _Running] = {}
        self.logs = EventLogs(files=files)

    async def start(self, caller: str, ticket: AskTicket, r: Answering,
                    stream: bool = False) -> dict[str, Any]:
        """Starts ``r`` (asked by ``ticket``) in the background; returns it ``queued`` (kept
        so from now on, its file written: a restart before it ends reads it back failed).
        With ``stream``, its events are kept in ``logs`` as they come."""
        shell = await r.answered(r.shell("queued"))
        run = _Running(caller, ticket, log=self.logs.open(caller, r.id) if stream else None)
        self._running[r.id] = run
        run.task = asyncio.ensure_future(self._run(r, run))
        return shell

    def cancel(self, caller: str, rid: str) -> bool:
        """Cancels ``caller``'s running response ``rid``; ``False`` when none runs."""
        run = self._running.get(rid)
        if run is None or run.caller != caller:
            return False
        run.cancelled = True
        run.ticket.cancel()
        return True

    def forget(self, caller: str, rid: str) -> None:
        """Cancels ``caller``'s running response ``rid`` (if it runs) and keeps nothing of it
        (it was deleted)."""
        run = self._running.get(rid)
        if run is not None and run.caller == caller:
            run.forgotten = True
            self.cancel(caller, rid)
        self.logs.forget(caller, rid)

    def task(self, rid: str) -> "asyncio.Task[None] | None":
        """The task running response ``rid`` (``None``: none runs)."""
        run = self._running.get(rid)
        return run.task if run is not None else None

    def running(self) -> int:
        return len(self._running)

    def close(self) -> None:
        """Stops every running response (the service is stopping): its task first, so its
        file stays ``queued`` and is read back ``failed`` (:mod:`sparkv.asks.respfiles`)."""
        for run in list(self._running.values()):
            if run.task is not None:
                run.task.cancel()
            run.ticket.cancel()
        self.logs.close()

    async def _run(self, r: Answering, run: _Running) -> None:
        tokens: list[dict[str, Any]] = []
        try:
            if run.log is not None:
                await self._streamed(r, run, run.log)
            else:
                last = await self._answer(r, run.ticket, tokens)
                if not run.forgotten:
                    await r.answered(self._final(r, run, last, tokens))
            if run.forgotten:                   # deleted meanwhile, even while it was written
                r.forget()
        except asyncio.CancelledError:
            raise
        except Exception:                   # a bug must not leave the response queued forever
            log.exception("background response %s failed", r.id)
            r.pending(r.shell("failed", error={"code": "server_error",
                                               "message": "the service failed to answer"}))
        finally:
            run.ticket.cancel()
            self._running.pop(r.id, None)
            self.logs.end(r.id, keep=not run.forgotten)

    @staticmethod
    async def _streamed(r: Answering, run: _Running, log: EventLog) -> None:
        """Keeps the response's events in ``log`` as they come (it keeps its own states);
        cancelled, the log ends there and the response is kept ``cancelled``."""
        async for event in r.events(run.ticket):
            if not (run.cancelled or run.forgotten):
                log.add(event)
        if run.cancelled and not run.forgotten and r.final not in ("completed", "incomplete"):
            await r.answered(r.shell("cancelled"))

    @staticmethod
    async def _answer(r: Answering, ticket: AskTicket,
                      tokens: list[dict[str, Any]]) -> dict[str, Any]:
        """The ask's last event (its tokens into ``tokens``; ``in_progress`` at the first)."""
        async for ev in ticket.aevents():
            if ev["type"] == "token":
                if not tokens:
                    r.pending(r.shell("in_progress"))
                tokens.append(ev)
            elif ev["type"] in ("done", "error"):
                return ev
        return {"type": "error", "error": {"code": "cancelled", "message": "ended"}}

    @staticmethod
    def _final(r: Answering, run: _Running, last: dict[str, Any],
               tokens: list[dict[str, Any]]) -> dict[str, Any]:
        if last["type"] == "done":
            return r.shell(r.status(last), r.output(last, tokens), last)
        if run.cancelled:
            return r.shell("cancelled")
        err = last["error"]
        return r.shell("failed", error={"code": err["code"], "message": err["message"]})
