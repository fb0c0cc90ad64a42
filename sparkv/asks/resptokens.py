"""``POST /v1/responses/input_tokens`` (``client.responses.input_tokens.count``; docs/asks.md,
"Counting a request's tokens"): how many input tokens a Responses request would count, without
asking it, so an app can budget the model's window before it sends a long conversation.

The request is read as ``POST /v1/responses`` reads it (its turns after the
``previous_response_id``'s conversation or the ``conversation``'s items, its tools; with
``truncation: "auto"`` cut to fit as the response would be), and counted as its ``usage``
counts ``input_tokens``: the context's tokens (the app's kept copy, else its manifest) and the
turns' tokens after it. Nothing is fetched but the manifest when the service does not have it,
and nothing is kept.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from sparkv.extras import require_all

require_all(("fastapi",), feature="the input tokens' route of the device service "
                                   "(sparkv.asks.resptokens)")

from fastapi import APIRouter  # noqa: E402 - after the check
from fastapi.responses import JSONResponse
from pydantic import ConfigDict, Field

from sparkv.asks.convroutes import ConversationsDep
from sparkv.asks.respkept import StoreDep
from sparkv.asks.responses import request_ask
from sparkv.asks.respschemas import ResponsesBody
from sparkv.asks.routes import AsksDep
from sparkv.asks.service import AskService, ask_error
from sparkv.asks.tickets import AskRequest
from sparkv.asks.truncation import truncated
from sparkv.device.app import CallerDep, error_responses
from sparkv.device.errors import DeviceError
from sparkv.edge.planning import AskError
from sparkv.edge.prompts import question_suffix
from sparkv.protocol.errors import error_body

__all__ = ["tokens_router", "InputTokensBody", "input_tokens"]


class InputTokensBody(ResponsesBody):
    """``POST /v1/responses/input_tokens``: a Responses request (``personality`` taken)."""

    model_config = ConfigDict(extra="forbid")

    personality: Annotated[str, Field(max_length=64)] | None = None


def input_tokens(asks: AskService, caller: str, ask: AskRequest) -> int:
    """The input tokens ``ask`` counts: its context's and its turns' (blocking: the manifest
    may be fetched; its failure raised, as the ask would meet it)."""
    try:
        suffix = question_suffix(asks.lm, ask.question, ask.options.chat)
    except AskError as e:
        raise DeviceError(str(e)) from None
    held = asks.context_tokens(caller, ask, strict=True)
    assert held is not None                  # strict: known, or its error raised
    return held + len(suffix)


tokens_router = APIRouter(tags=["openai"])


@tokens_router.post("/v1/responses/input_tokens",
                   responses=error_responses(400, 401, 403, 404, 502, 503))
async def count_input_tokens(body: InputTokensBody, asks: AsksDep, caller: CallerDep,
                             store: StoreDep, conversations: ConversationsDep) -> Any:
    """How many input tokens the response this request asks would count (``usage``'s
    ``input_tokens``), without asking it."""
    ask, _, _ = request_ask(body, asks, caller, store, conversations)
    try:
        if body.truncation == "auto":
            ask, _ = await asyncio.to_thread(truncated, asks, caller, ask)
        n = await asyncio.to_thread(input_tokens, asks, caller, ask)
    except DeviceError:
        raise
    except Exception as e:          # the server's answer about the context, as an ask says it
        status, code, message = ask_error(e)
        return JSONResponse(error_body(status, code, message), status_code=status)
    return {"object": "response.input_tokens", "input_tokens": n}
