"""The kept responses' routes of OpenAI's Responses API (docs/asks.md, "Kept responses and
previous_response_id"), over the service's :class:`~sparkv.asks.respstore.ResponseStore`:

=======  ======================================  =============================================
method   path                                    answer
=======  ======================================  =============================================
GET      ``/v1/responses/{id}``                  the ``response``, as it was answered (or as
                                                 it stands: a background one still running);
                                                 with ``stream=true``, a streamed background
                                                 response's events after ``starting_after``
DELETE   ``/v1/responses/{id}``                  ``{"id", "object": "response", "deleted"}``
POST     ``/v1/responses/{id}/cancel``           the background response, ``cancelled``
GET      ``/v1/responses/{id}/input_items``      the input items it answered (a ``list``:
                                                 ``limit``, ``order``, ``after``, ``before``)
=======  ======================================  =============================================

An id the app did not make (another app's, one deleted or evicted, or one never made) is a 404
``response_not_found``; as a ``previous_response_id`` it is a 400
``previous_response_not_found``. :class:`ResponseKeeper` keeps a response of ``POST
/v1/responses`` once answered, and :func:`previous` finds the one a request continues.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Any, Literal, Sequence

from sparkv.extras import require_all

require_all(("fastapi",), feature="the kept responses' routes of the device service "
                                   "(sparkv.asks.respkept)")

from fastapi import APIRouter, Depends, Path, Query, Request  # noqa: E402 - after the check
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from sparkv.asks.respbackground import BackgroundResponses
from sparkv.asks.resplog import EventLog
from sparkv.asks.respschemas import InputItem, as_input, identified, listed
from sparkv.asks.respstore import ResponseStore, StoredResponse, stored_response
from sparkv.device.app import CallerDep, error_responses
from sparkv.device.errors import DeviceError

log = logging.getLogger("sparkv.asks")

__all__ = ["kept_router", "ResponseKeeper", "previous", "get_store", "StoreDep",
           "get_background", "BackgroundDep", "UnknownResponse", "UnknownPrevious",
           "PreviousNotDone", "NotRunning", "NoResponsesKept", "EventsNotKept", "followed",
           "between", "page_of", "CANCEL_WAIT_S"]

ResponseId = Annotated[str, Path(min_length=1, max_length=256)]
#: how long a cancel waits for the response to stop before answering it as it stands (s)
CANCEL_WAIT_S = 30.0


class UnknownResponse(DeviceError, status=404, code="response_not_found"):
    """No response of this app with this id (never made, not kept, deleted or evicted)."""


class UnknownPrevious(DeviceError, status=400, code="previous_response_not_found"):
    """``previous_response_id`` names no response this app kept."""


class PreviousNotDone(DeviceError, status=400, code="previous_response_not_done"):
    """``previous_response_id`` names a response still running, failed or cancelled."""


class NotRunning(DeviceError, status=400, code="response_not_running"):
    """A cancel of a response that is not a running background response."""


class EventsNotKept(DeviceError, status=400, code="response_events_not_kept"):
    """A stream of a response whose events are not kept (not a streamed background one, or
    one that ended too long ago)."""


#: the statuses of a response another may continue
_CONTINUED = ("completed", "incomplete")


class NoResponsesKept(DeviceError, status=400, code="responses_not_kept"):
    """The service keeps no responses (``--responses-kept 0``): a ``previous_response_id``
    cannot be taken."""


def get_store(request: Request) -> ResponseStore:
    """The app's kept responses (``app.state.responses``)."""
    return request.app.state.responses


StoreDep = Annotated[ResponseStore, Depends(get_store)]


def get_background(request: Request) -> BackgroundResponses:
    """The app's running background responses (``app.state.background``)."""
    return request.app.state.background


BackgroundDep = Annotated[BackgroundResponses, Depends(get_background)]


def previous(store: ResponseStore, caller: str, rid: str | None) -> StoredResponse | None:
    """The kept response ``rid`` of ``caller`` a request continues (``None``: it names none);
    :class:`UnknownPrevious` when there is none such."""
    if rid is None:
        return None
    if not store.enabled:
        raise NoResponsesKept("previous_response_id is not taken: this service keeps no "
                              "responses (--responses-kept 0); send the conversation as input")
    kept = store.get(caller, rid)
    if kept is None:
        raise UnknownPrevious(f"Previous response with id {rid!r} not found.")
    status = kept.response.get("status")
    if status not in _CONTINUED:
        raise PreviousNotDone(f"Previous response with id {rid!r} is {status}: only a "
                              "completed or incomplete response is continued")
    return kept


class ResponseKeeper:
    """Keeps a response of ``caller`` once answered: the ``items`` its request added, its
    output, and the ``earlier`` response it continued; its file (when the store has files) is
    written before the answer is sent."""

    def __init__(self, store: ResponseStore, caller: str, earlier: StoredResponse | None,
                 items: Sequence[InputItem]) -> None:
        self.store, self.caller, self.earlier = store, caller, earlier
        self.items = tuple(identified(i) for i in items)

    def kept(self, response: dict[str, Any]) -> StoredResponse | None:
        """What the store keeps of ``response`` (``None``, said in the log, when its output
        cannot be read back as input: the answer stands, unkept)."""
        try:
            output = tuple(as_input(response["output"]))
        except ValidationError as e:
            log.warning("response %s is not kept: its output is no input (%s)",
                        response["id"], e)
            return None
        return stored_response(response, self.items, output, self.earlier)

    async def __call__(self, response: dict[str, Any]) -> None:
        kept, rid = self.kept(response), response["id"]
        if kept is not None:
            kept = self.store.put(self.caller, rid, kept)
        if kept is not None and self.store.files is not None:
            await asyncio.to_thread(self.store.persist, self.caller, rid, kept)

    def forget(self, rid: str) -> None:
        """Forgets the response ``rid`` (its file too)."""
        self.store.delete(self.caller, rid)

    def pending(self, response: dict[str, Any]) -> None:
        """Keeps ``response`` as it stands while it runs (in memory: a background response's
        ``queued`` or ``in_progress``)."""
        kept = self.kept(response)
        if kept is not None:
            self.store.put(self.caller, response["id"], kept)


kept_router = APIRouter(tags=["openai"])


def _kept(store: ResponseStore, caller: str, rid: str) -> StoredResponse:
    kept = store.get(caller, rid)
    if kept is None:
        raise UnknownResponse(f"Response with id {rid!r} not found.")
    return kept


def followed(log: EventLog, after: int = -1) -> StreamingResponse:
    """The events of ``log`` after the one numbered ``after``, as server-sent events (a
    reader that leaves does not stop the response)."""
    return StreamingResponse(log.follow(after), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@kept_router.get("/v1/responses/{response_id}", responses=error_responses(400, 404))
def get_response(response_id: ResponseId, store: StoreDep, caller: CallerDep,
                 background: BackgroundDep, stream: bool = False,
                 starting_after: Annotated[int | None, Query(ge=0)] = None,
                 include_obfuscation: bool | None = None) -> Any:
    """A kept response of this app, as it was answered; with ``stream``, a streamed background
    response's events after the one numbered ``starting_after`` (all without it), as they
    come until it ends (``include_obfuscation``: taken, no padding is added)."""
    kept = _kept(store, caller, response_id)
    if not stream:
        return kept.response
    log = background.logs.get(caller, response_id)
    if log is None:
        raise EventsNotKept(f"Response with id {response_id!r} cannot be streamed: only a "
                            "background response asked with stream is, while it runs and for "
                            "a while after it ends; retrieve it without stream")
    return followed(log, -1 if starting_after is None else starting_after)


@kept_router.delete("/v1/responses/{response_id}", responses=error_responses(404))
def delete_response(response_id: ResponseId, store: StoreDep, caller: CallerDep,
                    background: BackgroundDep) -> dict[str, Any]:
    """Forgets a kept response of this app (held, found by no id, while kept responses
    continue it; a background one still running is cancelled)."""
    background.forget(caller, response_id)
    if not store.delete(caller, response_id):
        raise UnknownResponse(f"Response with id {response_id!r} not found.")
    return {"id": response_id, "object": "response", "deleted": True}


@kept_router.post("/v1/responses/{response_id}/cancel", responses=error_responses(400, 404))
async def cancel_response(response_id: ResponseId, store: StoreDep, caller: CallerDep,
                          background: BackgroundDep) -> Any:
    """Cancels a background response of this app still running: the response, ``cancelled``
    (400 ``response_not_running`` once it ended, or for one that was not in the background)."""
    kept = _kept(store, caller, response_id)
    task = background.task(response_id)
    if not background.cancel(caller, response_id) or task is None:
        raise NotRunning(f"Response with id {response_id!r} is not a running background "
                         f"response (status: {kept.response.get('status')})")
    await asyncio.wait({task}, timeout=CANCEL_WAIT_S)   # it stops within a unit of compute
    return _kept(store, caller, response_id).response


@kept_router.get("/v1/responses/{response_id}/input_items", responses=error_responses(404))
def list_input_items(response_id: ResponseId, store: StoreDep, caller: CallerDep,
                     limit: Annotated[int, Query(ge=1, le=100)] = 20,
                     order: Literal["asc", "desc"] = "desc",
                     after: Annotated[str | None, Query(max_length=256)] = None,
                     before: Annotated[str | None, Query(max_length=256)] = None
                     ) -> dict[str, Any]:
    """The input items a kept response answered (a previous response's conversation first),
    newest first unless ``order`` is ``asc``; a page of ``limit`` after the item ``after``
    (before the item ``before``)."""
    items = [listed(i) for i in _kept(store, caller, response_id).input_items()]
    return page_of(items, limit, order, after, before)


def page_of(items: list[dict[str, Any]], limit: int, order: str, after: str | None = None,
            before: str | None = None) -> dict[str, Any]:
    """A ``list`` page of ``items`` (listed, oldest first): newest first unless ``order`` is
    ``asc``, ``limit`` of them after the item ``after`` (before the item ``before``)."""
    if order == "desc":
        items = items[::-1]
    items = between(items, after, before)
    page = items[:limit]
    return {"object": "list", "data": page, "has_more": len(items) > limit,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None}


def between(items: list[dict[str, Any]], after: str | None,
            before: str | None) -> list[dict[str, Any]]:
    """The items after the one ``after`` names and before the one ``before`` names (an id
    not among them is a 400)."""
    ids = [i["id"] for i in items]
    for name, rid in (("after", after), ("before", before)):
        if rid is not None and rid not in ids:
            raise DeviceError(f"{name}: no item {rid!r} among these")
    lo = ids.index(after) + 1 if after is not None else 0
    hi = ids.index(before) if before is not None else len(items)
    return items[lo:hi]
