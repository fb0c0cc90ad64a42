"""``POST /v1/responses``: the asks through OpenAI's Responses API, the newer interface the
``openai`` client (``client.responses.create``) and agent frameworks speak (docs/asks.md,
"OpenAI's Responses API").

A stock client asks about a server context unchanged::

    r = client.responses.create(model=CONTEXT_ID, input="What is it about?",
                                instructions="Answer in one sentence.",
                                extra_body={"sparkv": {"server": SERVER}})
    r.output_text

The request is read into a chat completion's parts (:mod:`sparkv.asks.respschemas`): the same
conversation after the context, tools, answer format and sampling, answered by one ask. The
answer is a ``response``: its ``output`` one ``message`` item (its ``output_text``) or the
``function_call`` items the model made; ``status`` ``incomplete`` (``incomplete_details.reason``
``max_output_tokens``) when it stopped at the cap; ``usage`` in the API's names. Streamed, the
API's semantic events (``response.created``, ``response.output_text.delta``, ...,
``response.completed``), each numbered by ``sequence_number``; a failure once streaming is one
``response.failed`` event.

A response is kept for its app unless ``store`` is false (:mod:`sparkv.asks.respkept`: ``GET``
and ``DELETE /v1/responses/{id}``, its input items), so the next request may name it as its
``previous_response_id`` instead of sending the conversation again (its instructions are not
carried over, as in OpenAI's API); an app may as well send the conversation as ``input``, its
earlier ``output`` items included, or name a ``conversation`` of the Conversations API
(:mod:`sparkv.asks.convroutes`). With ``background``, the request is answered at once with the
response ``queued`` (with ``stream``, its events) and the ask runs on, polled by ``GET``
(:mod:`sparkv.asks.respbackground`).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import Any, AsyncIterator

from sparkv.extras import require_all

require_all(("fastapi",), feature="the Responses route of the device service "
                                   "(sparkv.asks.responses)")

from fastapi import APIRouter, Request  # noqa: E402 - after the check
from fastapi.responses import JSONResponse

from sparkv.asks.answertext import AnswerText
from sparkv.asks.chat import (DEFAULT_MAX_TOKENS, asked, context_id_of, openai_responses,
                              with_tools)
from sparkv.asks.completion import Completion, EventStream, outcome
from sparkv.asks.convroutes import ConversationsDep, ConversationTurn, conversation_of
from sparkv.asks.convstore import ConversationStore
from sparkv.asks.respkept import (BackgroundDep, NoResponsesKept, ResponseKeeper, StoreDep,
                                  followed, previous)
from sparkv.asks.respschemas import ResponsesBody, identified
from sparkv.asks.respstore import ResponseStore, StoredResponse
from sparkv.asks.routes import AsksDep, ask_request
from sparkv.asks.schemas import SparkvFields
from sparkv.asks.service import AskService
from sparkv.asks.tickets import AskRequest, AskTicket
from sparkv.asks.truncation import truncated
from sparkv.device.app import CallerDep
from sparkv.protocol.errors import error_body
from sparkv.runtime.toolform import ToolCall, ToolSet
from sparkv.runtime.toolstream import CallPiece

__all__ = ["responses_router", "ResponseOf", "ResponseEvents", "StreamEvents", "respond",
           "request_ask"]

#: OpenAI's fields of how the answer's tokens are chosen, as the ask's fields
_SAMPLING = ("temperature", "top_p")


class ResponseOf:
    """One response's identity, what it echoes of its request, and its output items;
    ``keeper`` keeps it once answered (``None``: it is not kept), ``turn`` adds it to its
    conversation (``None``: it names none)."""

    def __init__(self, body: ResponsesBody, c: Completion,
                 keeper: ResponseKeeper | None = None,
                 turn: ConversationTurn | None = None) -> None:
        self.body, self.c, self.keeper, self.turn = body, c, keeper, turn
        self.dropped_turns = 0          # by truncation auto (sparkv.asks.truncation)
        self.final: str | None = None   # the status it was last kept with
        stamp = secrets.token_hex(16)
        self.id, self.msg_id = f"resp_{stamp}", f"msg_{stamp}"
        self.created_at = int(time.time())

    def pending(self, response: dict[str, Any]) -> None:
        """Keeps ``response`` as it stands (a background one, while it runs)."""
        if self.keeper is not None:
            self.keeper.pending(response)

    def forget(self) -> None:
        """Forgets this response if it was kept (a background one deleted while it ran)."""
        if self.keeper is not None:
            self.keeper.forget(self.id)

    async def answered(self, response: dict[str, Any]) -> dict[str, Any]:
        """``response`` (completed or incomplete), kept when it is to be."""
        self.final = response["status"]
        if self.keeper is not None:
            await self.keeper(response)
        if self.turn is not None:
            await self.turn(response)
        return response

    def events(self, ticket: AskTicket) -> AsyncIterator[bytes]:
        """The response's server-sent events as its ask's events come."""
        return StreamEvents(self).of(ticket)

    def shell(self, status: str, output: list[dict[str, Any]] | None = None,
              done: dict[str, Any] | None = None, error: dict[str, Any] | None = None
              ) -> dict[str, Any]:
        """The ``response`` object at ``status`` (with the answer's ``usage`` once done)."""
        b = self.body
        fmt = b.text.format.model_dump(by_alias=True) if b.text and b.text.format else None
        choice = b.tool_choice
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "error": error,
            "incomplete_details": ({"reason": "max_output_tokens"}
                                   if status == "incomplete" else None),
            "instructions": b.instructions, "max_output_tokens": self.c.max_tokens,
            "model": b.model, "output": output or [],
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id, "reasoning": None,
            "conversation": ({"id": b.conversation_id()} if b.conversation is not None
                             else None),
            "background": bool(b.background),
            "store": self.keeper is not None,
            "temperature": b.temperature, "top_p": b.top_p, "top_logprobs": b.top_logprobs,
            "text": {"format": fmt or {"type": "text"}},
            "truncation": b.truncation or "disabled",
            "tool_choice": (choice.model_dump() if choice is not None and
                            not isinstance(choice, str) else choice or "auto"),
            "tools": [{"strict": None, "description": None, "parameters": None,
                       **t.model_dump(exclude_none=True)} for t in b.tools or []],
            "metadata": b.metadata or {}, "user": b.user,
            "usage": self.usage(done) if done is not None else None,
            **({"sparkv": self.sparkv(done)} if done is not None else {}),
        }

    def sparkv(self, done: dict[str, Any]) -> dict[str, Any]:
        """The ``sparkv`` extension: the ask's, and with truncation auto the turns it
        dropped."""
        out = self.c.sparkv([done])
        if self.body.truncation == "auto":
            out["dropped_turns"] = self.dropped_turns
        return out

    def status(self, done: dict[str, Any]) -> str:
        """``incomplete`` at the cap, else ``completed``."""
        return "incomplete" if self.c.finish_reason(done) == "length" else "completed"

    def usage(self, done: dict[str, Any]) -> dict[str, Any]:
        u = self.c.usage([done])
        return {"input_tokens": u["prompt_tokens"],
                "input_tokens_details": {"cached_tokens":
                                         u["prompt_tokens_details"]["cached_tokens"],
                                         "cache_write_tokens": 0},
                "output_tokens": u["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u["total_tokens"]}

    def logprobs(self, tokens: list[dict[str, Any]]) -> list[dict[str, Any]]:
        lp = self.c.logprob_content(tokens)
        return lp["content"] if lp else []

    def text_part(self, text: str, tokens: list[dict[str, Any]]) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [],
                "logprobs": self.logprobs(tokens)}

    def message(self, status: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant",
                "content": parts}

    @staticmethod
    def call_item(j: int, call: ToolCall, status: str | None = None) -> dict[str, Any]:
        """The ``function_call`` item of ``call`` (the ``j``-th), ``completed`` or (cut off
        at the cap) ``incomplete`` unless ``status`` says (``in_progress``: no arguments)."""
        status = status or ("completed" if call.complete else "incomplete")
        return {"type": "function_call", "id": f"fc_{call.id.removeprefix('call_')}_{j}",
                "call_id": call.id, "name": call.name,
                "arguments": call.arguments if status != "in_progress" else "",
                "status": status}

    def output(self, done: dict[str, Any], tokens: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The answer's output items: its calls, else one message of its text."""
        calls = self.c.calls(done)
        if calls:
            return [self.call_item(j, call) for j, call in enumerate(calls)]
        return [self.message(self.status(done), [self.text_part(done["text"], tokens)])]


# ---- the whole response ------------------------------------------------------------------------
async def respond(ticket: AskTicket, r: ResponseOf, request: Request) -> Any:
    """The ``response`` (or the ask's error response)."""
    tokens: list[dict[str, Any]] = []
    try:
        done = await outcome(ticket, request, tokens)
    finally:
        ticket.cancel()
    if done["type"] == "error":
        err = done["error"]
        return JSONResponse(error_body(err["status"], err["code"], err["message"]),
                            status_code=err["status"] if err["status"] != 499 else 400)
    return await r.answered(r.shell(r.status(done), r.output(done, tokens), done))


# ---- streamed ----------------------------------------------------------------------------------
class ResponseEvents(EventStream):
    """The streamed response: ``response.created`` and ``response.in_progress``; the message's
    item and text part opened at its first shown text, a delta per token (text that may begin a
    tool call held back until it cannot), then its ``done`` events, or each call's item once the
    answer is calls; ``response.completed`` (or ``response.incomplete``, or on a failure
    ``response.failed``). However the response ends, the ask is cancelled."""

    def __init__(self, ticket: AskTicket, r: ResponseOf) -> None:
        super().__init__(StreamEvents(r).of(ticket), ticket.cancel)
        self.ticket = ticket


class StreamEvents:
    """One response's events, numbered, as its ask's events come."""

    def __init__(self, r: ResponseOf) -> None:
        self.r, self.seq = r, 0
        self.text = AnswerText(r.c)               # the text shown, or the calls
        self.opened = False
        self.tokens: list[dict[str, Any]] = []    # every token event
        self.calls: dict[int, ToolCall] = {}      # the calls shown, by place (no arguments)

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()

    def _item(self) -> dict[str, Any]:
        return {"item_id": self.r.msg_id, "output_index": 0}

    async def of(self, ticket: AskTicket) -> AsyncIterator[bytes]:
        """The events; a background response's begin ``queued`` (``response.queued``) and go
        ``in_progress`` (kept so) at the ask's first token or end, and its failure is kept."""
        r, waiting = self.r, bool(self.r.body.background)
        first = "queued" if waiting else "in_progress"
        yield self.event("response.created", response=r.shell(first))
        yield self.event(f"response.{first}", response=r.shell(first))
        events = ticket.aevents()
        try:
            async for ev in events:
                if waiting and ev["type"] != "queued":
                    waiting = False
                    r.pending(r.shell("in_progress"))
                    yield self.event("response.in_progress", response=r.shell("in_progress"))
                if ev["type"] == "token":
                    for out in self._token(ev):
                        yield out
                elif ev["type"] == "error":
                    err = ev["error"]
                    failed = r.shell("failed", error={"code": err["code"],
                                                      "message": err["message"]})
                    if r.body.background:
                        await r.answered(failed)
                    yield self.event("response.failed", response=failed)
                    return
                elif ev["type"] == "done":
                    async for out in self._finish(ev):
                        yield out
                    return
        finally:
            await events.aclose()

    async def _finish(self, done: dict[str, Any]) -> AsyncIterator[bytes]:
        """The output items' closing events, then (the response kept first, when it is to be)
        ``response.completed`` or ``response.incomplete``."""
        r, items = self.r, list[dict[str, Any]]()
        for out in self._done(done, items):
            yield out
        status = r.status(done)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield self.event(kind, response=await r.answered(r.shell(status, items, done)))

    def _opening(self) -> list[bytes]:
        if self.opened:
            return []
        self.opened = True
        r = self.r
        return [self.event("response.output_item.added", output_index=0,
                           item=r.message("in_progress", [])),
                self.event("response.content_part.added", **self._item(), content_index=0,
                           part=r.text_part("", []))]

    def _delta(self, text: str, tokens: list[dict[str, Any]]) -> list[bytes]:
        return self._opening() + [self.event("response.output_text.delta", **self._item(),
                                             content_index=0, delta=text,
                                             logprobs=self.r.logprobs(tokens))]

    def _token(self, ev: dict[str, Any]) -> list[bytes]:
        self.tokens.append(ev)
        events, pieces = self.text.token(ev)
        out = self._pieces(pieces)
        if events:
            out += self._delta("".join(e["text"] for e in events), events)
        return out

    def _pieces(self, pieces: list[CallPiece]) -> list[bytes]:
        """The events of the calls' pieces: a call's item added when it is named, its
        arguments' deltas as they come, their end and the item's when it closes."""
        r, out = self.r, []
        for p in pieces:
            where = {"output_index": p.place}
            if p.name is not None:
                self.calls[p.place] = call = ToolCall(p.id, p.name, "")
                out.append(self.event("response.output_item.added", **where,
                                      item=r.call_item(p.place, call, "in_progress")))
            call = self.calls[p.place]
            where["item_id"] = r.call_item(p.place, call)["id"]
            if p.arguments:
                out.append(self.event("response.function_call_arguments.delta", **where,
                                      delta=p.arguments))
            if p.done:
                out += self._call_done(p.place, where)
        return out

    def _call_done(self, j: int, where: dict[str, Any]) -> list[bytes]:
        """The closing events of the ``j``-th call (whole: its arguments' text kept by the
        reader)."""
        call = self.text.reader.calls()[j] if self.text.reader is not None else self.calls[j]
        return [self.event("response.function_call_arguments.done", **where, name=call.name,
                           arguments=call.arguments),
                self.event("response.output_item.done", output_index=j,
                           item=self.r.call_item(j, call))]

    def _done(self, done: dict[str, Any], items: list[dict[str, Any]]) -> list[bytes]:
        """The events that close the answer's output items (gathered into ``items``)."""
        r = self.r
        out = self._pieces(self.text.finish(done))
        calls = r.c.calls(done)
        if calls and not self.opened:
            for j, call in enumerate(calls):
                if not call.complete:               # cut off at the cap: its item ends so
                    out.append(self.event("response.output_item.done", output_index=j,
                                          item=r.call_item(j, call)))
                items.append(r.call_item(j, call))
        else:
            text, shown = done["text"], self.text.shown
            rest = text[len(shown):] if text.startswith(shown) else ""
            self.text.shown += rest
            out += self._delta(rest, self.text.held) if rest else self._opening()
            part = r.text_part(self.text.shown, self.tokens)
            item = r.message(r.status(done), [part])
            out += [self.event("response.output_text.done", **self._item(), content_index=0,
                               text=self.text.shown, logprobs=part["logprobs"]),
                    self.event("response.content_part.done", **self._item(), content_index=0,
                               part=part),
                    self.event("response.output_item.done", output_index=0, item=item)]
            items.append(item)
        return out


# ---- the route ---------------------------------------------------------------------------------
responses_router = APIRouter(tags=["openai"])


@responses_router.post("/v1/responses", responses=openai_responses(
    "a response (JSON), or with stream: server-sent response.* events"))
async def create_response(body: ResponsesBody, request: Request, asks: AsksDep,
                          caller: CallerDep, store: StoreDep, background: BackgroundDep,
                          conversations: ConversationsDep) -> Any:
    """OpenAI's response over an ask: ``model`` names the server context, ``instructions``
    and ``input`` are the conversation ending in the question (after the conversation of the
    ``previous_response_id``, or the items of the ``conversation``), ``extra_body={"sparkv":
    {...}}`` the rest of the ask."""
    ask, earlier, tools = request_ask(body, asks, caller, store, conversations)
    cid = body.conversation_id()
    items = [identified(i) for i in body.items()]
    keeper = (ResponseKeeper(store, caller, earlier, items)
              if body.store is not False and store.enabled else None)
    turn = ConversationTurn(conversations, caller, cid, items) if cid is not None else None
    dropped = 0
    if body.truncation == "auto":
        ask, dropped = await asyncio.to_thread(truncated, asks, caller, ask)
    r = ResponseOf(body, Completion(body.model, asks, ask, tools), keeper, turn)
    r.dropped_turns = dropped
    if body.background and keeper is None:
        raise NoResponsesKept("background is not taken: this service keeps no responses "
                              "(--responses-kept 0)")
    ticket = asks.submit(caller, ask)
    if body.background:
        queued = await background.start(caller, ticket, r, stream=bool(body.stream))
        log = background.logs.get(caller, r.id)
        return followed(log) if body.stream and log is not None else queued
    if body.stream:
        return ResponseEvents(ticket, r)
    return await respond(ticket, r, request)


def request_ask(body: ResponsesBody, asks: AskService, caller: str, store: ResponseStore,
                conversations: ConversationStore
                ) -> tuple[AskRequest, StoredResponse | None, ToolSet | None]:
    """The ask a request makes (its turns after the ``previous_response_id``'s conversation
    or the ``conversation``'s items), the kept response it continues and its tools."""
    tools, cid = body.tool_set(), body.conversation_id()
    earlier = previous(store, caller, body.previous_response_id)
    before = (conversation_of(conversations, caller, cid).items if cid is not None
              else earlier.conversation() if earlier else ())
    question = asked(body.turns(before), tools)
    fields = (body.sparkv or SparkvFields()).model_copy(update=_openai_fields(body))
    ask = with_tools(tools, ask_request(fields, asks, context_id_of(body.model, body.sparkv),
                                        question, body.max_output_tokens or DEFAULT_MAX_TOKENS,
                                        body.logprobs()))
    return ask, earlier, tools


def _openai_fields(body: ResponsesBody) -> dict[str, Any]:
    """The ask's fields the request sets (they override the ``sparkv`` extension's)."""
    out: dict[str, Any] = {k: getattr(body, k) for k in _SAMPLING
                           if getattr(body, k) is not None}
    fmt = body.text.response_format() if body.text else None
    if fmt is not None:
        out["response_format"] = fmt
    return out
