"""The asks routes of the device service (docs/device-service.md, "Asks"), on the same socket
and under the same access rules as its contexts API (:mod:`sparkv.device.app`):

=======  ====================  ==============================================================
method   path                  body -> answer (:mod:`sparkv.asks.schemas`)
=======  ====================  ==============================================================
POST     ``/v1/asks``          ``AskBody`` -> 200 JSON Lines of ``AskEvent`` (``queued``,
                               ``token`` ..., ``done`` or ``error``); 400 ``bad_ask``, 429
                               ``queue_full`` (``Retry-After``), 503 ``shutting_down``
GET      ``/v1/asks``          ``AskStats``
=======  ====================  ==============================================================

The ask is submitted before the stream begins, so a refusal is a plain error status; once
streaming, a failure is the stream's ``error`` event. When the client goes away (it closes the
connection), the ask is cancelled: it stops within one unit of compute and frees what it held.
"""

from __future__ import annotations

from typing import Annotated, AsyncIterator

from sparkv.extras import require_all

require_all(("fastapi",), feature="the asks routes of the device service (sparkv.asks.routes)")

from fastapi import APIRouter, Depends, Request  # noqa: E402 - after the check
from pydantic import TypeAdapter

from sparkv.asks.schemas import AskBody, AskEvent, AskFields, AskStats
from sparkv.asks.service import AskService
from sparkv.asks.tickets import AskRequest, AskTicket
from sparkv.device.app import CallerDep, error_responses
from sparkv.device.errors import DeviceError
from sparkv.device.inputs import check_token_ids, vocab_size
from sparkv.runtime.turns import Conversation, ConversationError, TokenPrompt

__all__ = ["asks_router", "get_asks", "AsksDep", "ask_request", "SERVED_STATUSES"]

#: an event of the stream, as its route checks it
EVENT: TypeAdapter[AskEvent] = TypeAdapter(AskEvent)
#: what POST /v1/asks answers before its stream (besides the plumbing's)
SERVED_STATUSES = (400, 422, 429, 503)


def get_asks(request: Request) -> AskService:
    """The app's ask service (``app.state.asks``)."""
    return request.app.state.asks


AsksDep = Annotated[AskService, Depends(get_asks)]


def ask_request(fields: AskFields, asks: AskService, context_id: str,
                question: str | Conversation | TokenPrompt, max_new_tokens: int,
                logprobs: int | None = None, prompt_logprobs: int | None = None
                ) -> AskRequest:
    """The :class:`AskRequest` of a body (the service's default server and key filled in;
    ``logprobs``, ``prompt_logprobs``: :attr:`AskRequest.logprobs`, its ``prompt_logprobs``);
    :class:`DeviceError` (400) for options the edge refuses, a question it cannot ask (no text,
    a conversation with ``chat`` off) or no server."""
    from sparkv.edge.planning import AskError
    from sparkv.edge.prompts import check_question

    server = fields.server or asks.default_server
    if server is None:
        raise DeviceError("name the server holding the context ('server'): this service has "
                          "no default (sparkv device serve --ask-server)")
    try:
        options = fields.options(max_new_tokens)
        check_question(question, options.chat)       # refused here, not once admitted
    except AskError as e:
        raise DeviceError(str(e)) from None
    if options.logit_bias:
        check_token_ids([t for t, _ in options.logit_bias], vocab_size(asks.lm),
                        "logit_bias's ids")
    if isinstance(question, TokenPrompt):
        check_token_ids(question.ids, vocab_size(asks.lm), "the prompt's token ids")
    return AskRequest(server, context_id, question, fields.api_key or asks.default_api_key,
                      options, fields.share, logprobs, prompt_logprobs)


async def submitted(body: AskBody, asks: AsksDep, caller: CallerDep
                    ) -> AsyncIterator[AskTicket]:
    """The caller's ask, submitted (a refusal is raised before any byte of the answer); when
    the response ends, however it ends, the ask is cancelled unless it finished."""
    try:
        question = body.asked()
    except ConversationError as e:
        raise DeviceError(str(e)) from None
    ticket = asks.submit(caller, ask_request(body, asks, body.context_id, question,
                                             body.max_new_tokens, body.logprobs,
                                             body.prompt_logprobs))
    try:
        yield ticket
    finally:
        ticket.cancel()


asks_router = APIRouter(tags=["asks"])


@asks_router.post("/v1/asks", responses=error_responses(*SERVED_STATUSES))
async def post_ask(ticket: Annotated[AskTicket, Depends(submitted)]) -> AsyncIterator[AskEvent]:
    """Answers a question about a server context through the device's one model, link and
    memory: the answer's tokens as they are generated, then its ``done`` event (``text``,
    ``tokens``, ``stats``), as JSON Lines."""
    async for event in ticket.aevents():
        yield EVENT.validate_python(event)


@asks_router.get("/v1/asks", response_model=AskStats)
def get_ask_stats(asks: AsksDep, request: Request) -> AskStats:
    """The asks running and waiting, the cores' load, the counts since the start, the kept
    responses and conversations."""
    store = getattr(request.app.state, "responses", None)
    background = getattr(request.app.state, "background", None)
    conversations = getattr(request.app.state, "conversations", None)
    kept = store.stats() if store is not None else None
    if kept is not None and background is not None:
        kept["background_running"] = background.running()
    return AskStats.model_validate({
        **asks.stats(), "kept_responses": kept,
        "conversations": conversations.stats() if conversations is not None else None})
