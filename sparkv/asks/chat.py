"""``POST /v1/chat/completions``: the asks through OpenAI's chat completion API, the interface
llama.cpp's server, Ollama and vLLM give apps (docs/device-service.md, "OpenAI-compatible").

A stock client asks about a server context unchanged::

    client = OpenAI(base_url="http://127.0.0.1:8079/v1", api_key=APP_TOKEN)
    r = client.chat.completions.create(
        model=CONTEXT_ID,                                   # the server context
        messages=[{"role": "user", "content": "What is it about?"}],
        extra_body={"sparkv": {"server": "http://127.0.0.1:8080", "strategy": "sparkv"}})

* ``model`` names the server context (its 32-hex id), unless ``sparkv.context_id`` does; the
  ``sparkv`` extension object (``extra_body``) carries the ask's other fields
  (:class:`~sparkv.asks.schemas.SparkvFields`: the server, its key, the ``AskOptions``, ``share``);
  without a server the service's ``--ask-server`` is used;
* ``messages``: the conversation, its last message the user's question: ``system`` (or
  ``developer``) messages first are the app's instructions, ``user`` and ``assistant`` messages
  the earlier turns (:mod:`sparkv.runtime.turns` renders them after the context, whose own
  system turn is the server's); a user's or system message with no text (an assistant's may be
  empty) or a last message that is neither the user's nor a tool's result is 400
  ``unsupported_messages``;
* ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (:mod:`sparkv.runtime.toolform`): the
  model is told the tools after the app's instructions; the answer's form holds it to whole
  calls of them (``auto``: text or calls); calls come back as the message's ``tool_calls``
  (``finish_reason`` ``tool_calls``; streamed, one ``delta.tool_calls`` chunk once the answer is
  whole, text that may begin a call held back until it cannot). An assistant's earlier
  ``tool_calls`` and the ``tool`` messages answering them are turns of the conversation;
* ``logit_bias``, ``frequency_penalty`` and ``presence_penalty`` adjust the logits; the answer
  is greedy without ``temperature`` (or at 0), else sampled (``top_p``, ``seed``;
  ``sparkv.top_k`` too: :mod:`sparkv.runtime.sampling`; the seed drawn when none is given is
  in ``sparkv.stats.seed``), at most
  ``max_completion_tokens`` (or ``max_tokens``; default 256) tokens, ending before a ``stop``
  string (:mod:`sparkv.runtime.stops`; streamed, what may begin one is held back);
* ``stream``: server-sent ``chat.completion.chunk`` events (the role, then the text as it is
  generated, then the ``finish_reason``; with ``stream_options.include_usage`` a last chunk with
  ``usage``), then ``data: [DONE]``; a failure once streaming is one ``data: {"error": ...}``
  event (what the ``openai`` client raises as an ``APIError``);
* ``n``: up to 8 choices (sampled: an ask each, choice i with the request's seed plus i;
  greedy: one ask, its answer every choice; :mod:`sparkv.asks.completion`);
* ``logprobs``: the answer's tokens (``choices[0].logprobs.content``: ``token``, ``logprob``,
  ``bytes``, and ``top_logprobs`` alternatives, at most 20), each token's log-probability under
  the model (before temperature), streamed with the chunk of its token;
* ``usage``: ``prompt_tokens`` (the context's tokens plus the question's), ``completion_tokens``
  (the answer's), ``total_tokens``, ``prompt_tokens_details.cached_tokens`` (the prompt's tokens
  whose KV the service's memory held: a kept context's, and earlier turns of the conversation
  kept by :mod:`sparkv.device.tails`); ``sparkv`` in the answer: the ask's ``stats`` and kept id.

Refusals before the answer starts are the service's errors (429 ``queue_full`` with
``Retry-After``, which the ``openai`` client retries; 401; 400; 404 ``unknown_model``; 422).
A client that goes away cancels the ask.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sparkv.extras import require_all

require_all(("fastapi",), feature="the OpenAI-compatible route of the device service "
                                   "(sparkv.asks.chat)")

from fastapi import APIRouter, Request  # noqa: E402 - after the check

from sparkv.asks.completion import ChoiceStream, Choices, Completion, answer
from sparkv.asks.routes import AsksDep, ask_request
from sparkv.asks.schemas import ChatBody, ChatMessage, CompletionBody, SparkvFields
from sparkv.asks.tickets import AskRequest
from sparkv.device.app import CallerDep, error_responses
from sparkv.device.errors import DeviceError
from sparkv.protocol.manifest import CONTEXT_ID_PATTERN
from sparkv.runtime.formparts import FormError
from sparkv.runtime.toolform import ToolSet, call_text, response_text
from sparkv.runtime.turns import ChatTurn, Conversation, ConversationError

__all__ = ["chat_router", "DEFAULT_MAX_TOKENS", "UnknownModel", "UnsupportedMessages",
           "asked", "context_id_of", "with_tools", "openai_fields", "openai_responses"]

#: the answer's cap when the request names none (tokens)
DEFAULT_MAX_TOKENS = 256


class UnsupportedMessages(DeviceError, status=400, code="unsupported_messages"):
    """The messages are no conversation to answer: one with no text, calls made by another
    than the assistant, or a last message that is not the user's (or a tool's result)."""


class UnknownModel(DeviceError, status=404, code="unknown_model"):
    """``model`` names no server context (and ``sparkv.context_id`` none either)."""


#: OpenAI's roles -> a turn's (``developer`` is the newer name of ``system``)
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def _question(body: ChatBody) -> str | Conversation:
    """The lone user message's text, or the messages as a conversation."""
    return asked([_turn(i, m) for i, m in enumerate(body.messages)], body.tool_set())


def asked(turns: list[ChatTurn], tools: ToolSet | None) -> str | Conversation:
    """The lone user turn's text, or the turns as a conversation (instructions, the tools,
    earlier questions, answers, calls and results, then the question:
    :mod:`sparkv.runtime.turns`); :class:`UnsupportedMessages` for turns that are none."""
    turns = list(turns)
    if tools is not None:                        # after the app's instructions
        lead = next((i for i, t in enumerate(turns) if t.role != "system"), len(turns))
        turns.insert(lead, ChatTurn("system", tools.instructions()))
    try:
        conv = Conversation(tuple(turns))
    except ConversationError as e:
        raise UnsupportedMessages(f"{e}; the context is the server's, named by 'model'"
                                  ) from None
    return conv.question if len(turns) == 1 else conv


def _turn(i: int, m: ChatMessage) -> ChatTurn:
    """Message ``i`` as a turn: a tool's result is the user's turn, an assistant's calls are
    written as the model writes them."""
    if m.role == "tool":
        return ChatTurn("user", response_text(m.text()))
    if not m.tool_calls:
        return ChatTurn(_ROLES[m.role], m.text())
    if m.role != "assistant":
        raise UnsupportedMessages(f"message {i}: a {m.role!r} message makes no tool calls (an "
                                  "assistant's does)")
    calls = [call_text(c.function.name, c.function.arguments) for c in m.tool_calls]
    return ChatTurn("assistant", "\n".join(([m.text()] if m.text().strip() else []) + calls))


#: OpenAI's fields of how the answer's tokens are chosen
_SAMPLING = ("temperature", "top_p", "seed", "frequency_penalty", "presence_penalty",
             "logit_bias", "response_format")


def openai_fields(body: ChatBody | CompletionBody) -> dict[str, Any]:
    """The ask's fields that OpenAI's request sets (they override the ``sparkv`` extension's):
    ``stop`` and :data:`_SAMPLING`."""
    out: dict[str, Any] = {k: getattr(body, k, None) for k in _SAMPLING
                           if getattr(body, k, None) is not None}
    if body.stop is not None:
        out["stop"] = [body.stop] if isinstance(body.stop, str) else body.stop
    return out


def _logprobs(body: ChatBody) -> int | None:
    """How many alternatives each token's log-probabilities list (``None``: no logprobs)."""
    if not body.logprobs:
        if body.top_logprobs:
            raise DeviceError("top_logprobs needs logprobs: true")
        return None
    return body.top_logprobs or 0


def _max_tokens(body: ChatBody) -> int:
    return body.max_completion_tokens or body.max_tokens or DEFAULT_MAX_TOKENS


def context_id_of(model: str, fields: SparkvFields | None) -> str:
    """The server context asked about: ``sparkv.context_id``, else ``model``
    (:class:`UnknownModel` unless it is a context's id)."""
    import re

    cid = fields.context_id if fields and fields.context_id else model
    if not re.fullmatch(CONTEXT_ID_PATTERN.strip("^$"), cid):
        raise UnknownModel(f"model {model!r} is not a server context's id (32 hex digits); "
                           "name the context in 'model' or in sparkv.context_id")
    return cid


def with_tools(tools: ToolSet | None, ask: AskRequest) -> AskRequest:
    """``ask`` with the answer's form of ``tools`` (and its ``response_format``)."""
    if tools is None:
        return ask
    try:
        form = tools.form(ask.options.form)
    except FormError as e:
        raise DeviceError(f"tools: {e}") from None
    return dataclasses.replace(ask, options=dataclasses.replace(ask.options, form=form))


chat_router = APIRouter(tags=["openai"])


def openai_responses(answer: str) -> dict[int | str, dict[str, Any]]:
    """An OpenAI route's OpenAPI ``responses``: its errors, and 200 as ``answer`` (JSON, or
    server-sent events with ``stream``)."""
    return {**error_responses(400, 404, 422, 429, 502, 503),
            200: {"description": answer,
                  "content": {"text/event-stream": {"schema": {"type": "string"}}}}}


@chat_router.post("/v1/chat/completions", responses=openai_responses(
    "a chat.completion (JSON), or with stream: server-sent chat.completion.chunk events, "
    "then [DONE]"))
async def chat_completions(body: ChatBody, request: Request, asks: AsksDep,
                           caller: CallerDep) -> Any:
    """OpenAI's chat completion over an ask: ``model`` names the server context, the messages
    are the question (the last user message) and what came before it, ``extra_body={"sparkv":
    {...}}`` the rest of the ask."""
    question = _question(body)
    cid = context_id_of(body.model, body.sparkv)
    fields = body.sparkv or SparkvFields()
    fields = fields.model_copy(update=openai_fields(body))
    ask = with_tools(body.tool_set(), ask_request(fields, asks, cid, question,
                                                  _max_tokens(body), _logprobs(body)))
    c = Completion(body.model, asks, ask, body.tool_set())
    choices = Choices.submit(asks, caller, ask, body.n)
    if body.stream:
        include = bool(body.stream_options and body.stream_options.include_usage)
        return ChoiceStream(choices, c, include)
    return await answer(choices, c, request, body.n)
