"""One chat completion's answer (:mod:`sparkv.asks.chat`): its choices' asks, then either the
``chat.completion`` or its server-sent ``chat.completion.chunk`` events.

* :class:`Completion`: the identity every chunk repeats, a choice's ``finish_reason`` and
  ``logprobs``, the ``usage``;
* :class:`Choices`: the tickets answering the request's ``n`` choices: one ask per sampled
  choice (each its own seed: the request's plus the choice's index, else each draws one; the
  asks share one admission slot and start together), one ask for every choice of a greedy
  request (its choices are the same answer);
* :func:`answer` (the whole completion) and :class:`ChoiceStream` (the events: each choice's
  chunks as its tokens come, interleaved, then ``usage`` and ``[DONE]``). A client that goes
  away cancels every choice's ask; a choice that fails ends the completion with its error.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator, Callable, Sequence

from sparkv.extras import require_all

require_all(("fastapi",), feature="the OpenAI-compatible route of the device service "
                                   "(sparkv.asks.completion)")

from fastapi import Request  # noqa: E402 - after the check
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from sparkv.asks.answertext import AnswerText
from sparkv.asks.schemas import MAX_CHOICES
from sparkv.asks.tickets import AskRequest, AskTicket
from sparkv.protocol.errors import error_body
from sparkv.runtime.sampling import SEED_RANGE
from sparkv.runtime.stops import StopStrings
from sparkv.runtime.toolform import ToolCall, ToolSet
from sparkv.runtime.toolstream import CallPiece, CallReader

__all__ = ["Completion", "Choices", "ChoiceStream", "EventStream", "answer", "outcome",
           "prompt_counts",
           "DISCONNECT_POLL_S", "MAX_CHOICES"]

#: how often a non-streamed completion looks whether its client is still there (s)
DISCONNECT_POLL_S = 0.25


class Choices:
    """The asks answering ``n`` choices: ``tickets[i]`` answers the choices ``indexes[i]``."""

    def __init__(self, tickets: Sequence[AskTicket], indexes: Sequence[Sequence[int]]) -> None:
        self.tickets, self.indexes = list(tickets), [list(ix) for ix in indexes]

    @classmethod
    def submit(cls, asks: Any, caller: str, ask: AskRequest, n: int) -> "Choices":
        """Submits the asks of ``n`` choices of ``ask``: one, greedy; else one each, sharing
        one slot (refused together)."""
        if n == 1 or ask.options.sampling.greedy:
            return cls([asks.submit(caller, ask)], [list(range(n))])
        return cls(asks.submit_group(caller, [_nth_choice(ask, i) for i in range(n)]),
                   [[i] for i in range(n)])

    @classmethod
    def submit_each(cls, asks: Any, caller: str, each: Sequence[AskRequest], n: int
                    ) -> "Choices":
        """Submits the asks of ``n`` choices of each of ``each`` (choice ``p * n + i`` is the
        ``i``-th of ``each[p]``): one ask for every choice of one, greedy, else one a choice;
        several share one slot (refused together)."""
        if len(each) == 1:
            return cls.submit(asks, caller, each[0], n)
        if n == 1 or each[0].options.sampling.greedy:
            return cls(asks.submit_group(caller, each),
                       [[p * n + i for i in range(n)] for p in range(len(each))])
        return cls(asks.submit_group(caller, [_nth_choice(a, i) for a in each for i in range(n)]),
                   [[j] for j in range(len(each) * n)])

    def cancel(self) -> None:
        for t in self.tickets:
            t.cancel()

    def per_choice(self, done: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each choice's ``done`` event, in choice order, of the asks' ``done`` events."""
        out: list[dict[str, Any]] = [{}] * sum(len(ix) for ix in self.indexes)
        for event, indexes in zip(done, self.indexes):
            for i in indexes:
                out[i] = event
        return out


def _nth_choice(ask: AskRequest, i: int) -> AskRequest:
    """The ask of a sampled request's choice ``i``: its seed the request's plus ``i``."""
    import dataclasses

    opts = ask.options
    return dataclasses.replace(ask, options=dataclasses.replace(
        opts, seed=None if opts.seed is None else _nth_seed(opts.seed, i)))


def _nth_seed(seed: int, i: int) -> int:
    """Choice ``i``'s seed: the request's plus ``i``, wrapped into :data:`SEED_RANGE`."""
    lo, hi = SEED_RANGE
    return lo + (seed - lo + i) % (hi - lo + 1)


class Completion:
    """One chat completion's identity and counts, what every chunk and the answer repeat, and
    their shapes (a text completion's: :class:`sparkv.asks.textcompletion.TextCompletion`)."""

    #: the whole answer's ``object``, and a streamed chunk's
    OBJECT = "chat.completion"
    CHUNK = "chat.completion.chunk"
    #: the ids' prefix
    PREFIX = "chatcmpl"

    def __init__(self, model: str, asks: Any, ask: AskRequest,
                 tools: ToolSet | None = None) -> None:
        self.id = f"{self.PREFIX}-{time.time_ns():x}"
        self.created = int(time.time())
        self.model = model
        self.max_tokens = ask.options.max_new_tokens
        self.stops = StopStrings(ask.options.stop)
        self.lm = asks.lm
        self.eos: set[int] = asks.eos
        self.logprobs = ask.logprobs is not None
        self.tools = tools

    def calls(self, done: dict[str, Any]) -> list[ToolCall]:
        """The tool calls a choice's answer makes (none: its text is the answer)."""
        if self.tools is None:
            return []
        if "_tool_calls" not in done:                # read once: each call keeps its id
            done["_tool_calls"] = self.tools.read(done["text"])
        return done["_tool_calls"]

    def message(self, done: dict[str, Any]) -> dict[str, Any]:
        """A choice's ``message``: its text, or its tool calls."""
        calls = self.calls(done)
        if not calls:
            return {"role": "assistant", "content": done["text"]}
        return {"role": "assistant", "content": None, "tool_calls": _call_items(calls)}

    def may_call(self, shown: str) -> bool:
        """Whether a streamed answer that begins with ``shown`` may still be tool calls."""
        return self.tools is not None and self.tools.may_call(shown)

    def begins_calls(self, text: str) -> bool:
        """Whether a streamed answer that begins with ``text`` is tool calls."""
        return self.tools is not None and self.tools.begins_calls(text)

    def call_reader(self) -> CallReader:
        """A reader of a streamed answer's calls (:meth:`begins_calls` first)."""
        assert self.tools is not None
        return self.tools.reader()

    def _token(self, token: int, logprob: float) -> dict[str, Any]:
        text = self.lm.decode_tokens([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def choice(self, i: int, done: dict[str, Any], events: list[dict[str, Any]]
               ) -> dict[str, Any]:
        """Choice ``i`` of the whole completion: its ask's ``done`` event and token
        ``events``."""
        return {"index": i, "message": self.message(done),
                "logprobs": self.logprob_content(events), "finish_reason": self.finish_reason(done)}

    def whole(self, choices: list[dict[str, Any] | None], done: Sequence[dict[str, Any]],
              per_choice: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """The whole completion of its ``choices`` (``done``: each ask's event;
        ``per_choice``: each choice's)."""
        return {"id": self.id, "object": self.OBJECT, "created": self.created,
                "model": self.model, "choices": choices, "usage": self.usage(per_choice),
                "sparkv": self.sparkv(done)}

    def opening(self, i: int) -> list[dict[str, Any]]:
        """The chunks a stream starts choice ``i`` with: its role."""
        return [self.chunk(i, {"role": "assistant", "content": ""})]

    def shown_logprobs(self, i: int, events: list[dict[str, Any]], before: str
                       ) -> dict[str, Any] | None:
        """Choice ``i``'s streamed ``logprobs`` of token ``events`` shown after the text
        ``before``."""
        return self.logprob_content(events)

    def prompt_chunks(self, event: dict[str, Any], indexes: list[int]) -> list[dict[str, Any]]:
        """The chunks an ask's first token ``event`` (with its question's scores) opens its
        choices ``indexes`` with: none here (a chat completion opens at the start)."""
        return []

    def logprob_content(self, events: list[dict[str, Any]]) -> dict[str, Any] | None:
        """A choice's ``logprobs`` of ``events`` (token events), ``None`` unless asked for."""
        if not self.logprobs:
            return None
        return {"content": [{**self._token(e["token"], e["logprob"]),
                             "top_logprobs": [self._token(a["token"], a["logprob"])
                                              for a in e["top_logprobs"]]} for e in events],
                "refusal": None}

    def usage(self, done: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """``usage`` of the choices' ``done`` events (the prompt counted once)."""
        prompt, cached = self.prompt_tokens(done)
        completion = sum(len(d["tokens"]) for d in done)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def prompt_tokens(self, done: Sequence[dict[str, Any]]) -> tuple[int, int]:
        """The prompt's tokens, counted once, and those of them the service's memory held, of
        the choices' ``done`` events."""
        return prompt_counts(done[0]["stats"])

    def finish_reason(self, done: dict[str, Any]) -> str:
        """``tool_calls`` for calls (``length`` when the cap cut the last off), ``stop`` at
        the end of sequence or a stop string, ``length`` at the cap."""
        calls = self.calls(done)
        if calls:
            return "tool_calls" if calls[-1].complete else "length"
        tokens = done["tokens"]
        if self.stops.hit(self.lm, tokens):
            return "stop"
        return ("length" if len(tokens) >= self.max_tokens
                and (not tokens or tokens[-1] not in self.eos) else "stop")

    def chunk(self, index: int, delta: dict[str, Any], finish: str | None = None,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": self.CHUNK, "created": self.created,
                "model": self.model, "choices": [{"index": index, "delta": delta,
                                                  "logprobs": logprobs,
                                                  "finish_reason": finish}]}

    def usage_chunk(self, done: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """The stream's last chunk (``stream_options.include_usage``): ``usage``, and the
        ``sparkv`` extension as a whole completion carries it."""
        return {"id": self.id, "object": self.CHUNK, "created": self.created,
                "model": self.model, "choices": [], "usage": self.usage(done),
                "sparkv": self.sparkv(done)}

    def sparkv(self, done: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """The ``sparkv`` extension: the first choice's ask (``kept_id``, ``stats``,
        ``first_token_s``), and with several asks, each one's under ``choices``."""
        def one(d: dict[str, Any]) -> dict[str, Any]:
            return {"kept_id": d["kept_id"], "stats": d["stats"],
                    "first_token_s": d["first_token_s"]}
        out = one(done[0])
        if len(done) > 1:
            out["choices"] = [one(d) for d in done]
        return out


def prompt_counts(stats: dict[str, Any]) -> tuple[int, int]:
    """An ask's prompt tokens (the context's and the question's) and those of them whose KV the
    service's memory held (a kept context's, a conversation's earlier turns), of its
    ``stats``."""
    cached = int(stats.get("turn_tokens_reused", 0))
    if stats.get("strategy") == "kept":
        cached += int(stats["context_tokens"])
    return int(stats["context_tokens"]) + int(stats["question_tokens"]), cached


# ---- the whole completion ------------------------------------------------------------------------
async def answer(choices: Choices, c: Completion, request: Request, n: int) -> Any:
    """The whole completion (:meth:`Completion.whole`), or the first failing choice's error
    response."""
    tokens: list[list[dict[str, Any]]] = [[] for _ in choices.tickets]
    try:
        done = await asyncio.gather(*(outcome(t, request, tk)
                                      for t, tk in zip(choices.tickets, tokens)))
    finally:
        choices.cancel()
    for event in done:
        if event["type"] == "error":
            err = event["error"]
            return JSONResponse(error_body(err["status"], err["code"], err["message"]),
                                status_code=err["status"] if err["status"] != 499 else 400)
    out: list[dict[str, Any] | None] = [None] * n
    for event, tk, indexes in zip(done, tokens, choices.indexes):
        for i in indexes:
            out[i] = c.choice(i, event, tk)
    return c.whole(out, done, choices.per_choice(done))


async def outcome(ticket: AskTicket, request: Request,
                   tokens: list[dict[str, Any]]) -> dict[str, Any]:
    """The ask's last event (its token events into ``tokens``); a client that goes away
    meanwhile cancels it. The wait for the next event is looked at every
    :data:`DISCONNECT_POLL_S` without being cancelled: cancelling it (``asyncio.wait_for``)
    would close the event generator, and the next look would find it ended (a 500 for every
    ask that went quiet that long)."""
    events = ticket.aevents()
    pending: asyncio.Future[dict[str, Any]] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({pending}, timeout=DISCONNECT_POLL_S)
            if not done:
                if await request.is_disconnected():
                    ticket.cancel()
                continue
            event, pending = pending.result(), None
            if event["type"] in ("done", "error"):
                return event
            if event["type"] == "token":
                tokens.append(event)
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        await events.aclose()


# ---- streamed ------------------------------------------------------------------------------------
def _sse(data: Any) -> bytes:
    return b"data: " + (data if isinstance(data, bytes) else json.dumps(data).encode()) + b"\n\n"


class EventStream(StreamingResponse):
    """Server-sent events that call ``cancel`` however the response ends (answered, failed,
    or its client gone): the asks behind them stop within one unit of compute."""

    def __init__(self, events: AsyncIterator[bytes], cancel: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.cancel = cancel

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.cancel()


class ChoiceStream(EventStream):
    """The streamed completion: every choice's role chunk, then each choice's chunks as its
    tokens come (interleaved), its finish, then ``usage`` when asked for and ``[DONE]``; a
    choice that fails ends the stream with one ``error`` event. However the response ends,
    every choice's ask is cancelled."""

    def __init__(self, choices: Choices, c: Completion, include_usage: bool) -> None:
        super().__init__(self._events(choices, c, include_usage), choices.cancel)
        self.choices = choices

    @staticmethod
    async def _events(choices: Choices, c: Completion,
                      include_usage: bool) -> AsyncIterator[bytes]:
        for ix in choices.indexes:
            for i in ix:
                for chunk in c.opening(i):
                    yield _sse(chunk)
        merged: asyncio.Queue[tuple[int, dict[str, Any]]] = asyncio.Queue()
        pumps = [asyncio.ensure_future(_pump(k, t, merged))
                 for k, t in enumerate(choices.tickets)]
        done: list[dict[str, Any] | None] = [None] * len(pumps)
        texts = [AnswerText(c) for _ in pumps]   # each ask's text, or calls, as they come
        try:
            while any(d is None for d in done):
                k, event = await merged.get()
                if event["type"] == "error":
                    err = event["error"]
                    yield _sse({"error": {"message": err["message"], "type": err["code"],
                                          "code": err["code"], "status": err["status"]}})
                    return
                for chunk in _choice_chunks(c, event, choices.indexes[k], texts[k]):
                    yield _sse(chunk)
                if event["type"] == "done":
                    done[k] = event
            if include_usage:
                yield _sse(c.usage_chunk(choices.per_choice([d for d in done if d is not None])))
            yield _sse(b"[DONE]")
        finally:
            for p in pumps:
                p.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)


async def _pump(k: int, ticket: AskTicket, into: asyncio.Queue[tuple[int, dict[str, Any]]]
                ) -> None:
    """Ticket ``k``'s token, done and error events into ``into``."""
    events = ticket.aevents()
    try:
        async for event in events:
            if event["type"] in ("token", "done", "error"):
                await into.put((k, event))
    finally:
        await events.aclose()


def _choice_chunks(c: Completion, event: dict[str, Any], indexes: list[int],
                   text: AnswerText) -> list[dict[str, Any]]:
    """The chunks of an ask's ``event`` for its choices ``indexes`` (``text``: the ask's
    answer so far)."""
    if event["type"] == "token":
        events, pieces = text.token(event)
        out = c.prompt_chunks(event, indexes) + _piece_chunks(c, pieces, indexes)
        if events:
            shown = "".join(e["text"] for e in events)
            before = text.shown[:len(text.shown) - len(shown)]
            lp = c.shown_logprobs(indexes[0], events, before)   # one ask's choices: one prompt
            out += [c.chunk(i, {"content": shown}, logprobs=lp) for i in indexes]
        return out
    pieces = text.finish(event)
    if c.calls(event):
        out = _piece_chunks(c, pieces, indexes)
    else:
        whole = event["text"]
        rest = whole[len(text.shown):] if whole.startswith(text.shown) else ""
        out = [c.chunk(i, {"content": rest}) for i in indexes] if rest else []  # held back
    return out + [c.chunk(i, {}, c.finish_reason(event)) for i in indexes]


def _piece_chunks(c: Completion, pieces: list[CallPiece],
                  indexes: list[int]) -> list[dict[str, Any]]:
    """A chunk for each call piece that shows something: a call's first names it (its
    ``id``, ``type`` and ``function.name``), the next add to its ``function.arguments``."""
    out = []
    for p in pieces:
        if p.name is not None:
            item = {"index": p.place, "id": p.id, "type": "function",
                    "function": {"name": p.name, "arguments": p.arguments}}
        elif p.arguments:
            item = {"index": p.place, "function": {"arguments": p.arguments}}
        else:
            continue
        out += [c.chunk(i, {"tool_calls": [item]}) for i in indexes]
    return out


def _call_items(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """OpenAI's ``tool_calls`` items."""
    return [{"id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}} for call in calls]
