"""The request body of ``POST /v1/responses`` (OpenAI's Responses API:
:mod:`sparkv.asks.responses`); pydantic models are the schema, docs/asks.md ("OpenAI's
Responses API") has the prose.

A request is read into what a chat completion is made of: the turns (:class:`ResponsesBody.turns`,
the ``instructions`` first, then a previous response's conversation when one is named, then each
``input`` item a turn: messages, the model's earlier ``function_call`` items and the
``function_call_output`` items answering them), the tools (a
:class:`~sparkv.runtime.toolform.ToolSet`) and the answer's format (``text.format`` as a chat's
``response_format``). What the service cannot do is refused when the request is read (a 422
naming it): input images and files, ``conversation`` with ``previous_response_id``,
``background`` without ``store``, reasoning effort.

Input items are read leniently about the fields a response's own output items carry (``status``,
``annotations``, ``logprobs``, ...), so an app may send ``response.output`` back as input, as
OpenAI's examples do; the request's own fields are checked strictly (an unknown one is a 422).
An item's ``id`` is kept: a stored response lists its input items by it (:func:`listed`, new
ones given one by :func:`identified`).
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any, Literal, Sequence, Union

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, PrivateAttr, StrictBool, Tag,
                      TypeAdapter, model_validator)

from sparkv.asks.schemas import (MAX_ARGUMENT_CHARS, AnswerTokens, SparkvFields, ToolName,
                                 TopLogprobs, tool_set_of)
from sparkv.device.schemas import (PromptText, ResponseFormat, Temperature, TopP)
from sparkv.runtime.toolform import MAX_TOOLS, Tool, ToolSet, call_text, response_text
from sparkv.runtime.turns import ChatTurn

__all__ = ["ResponsesBody", "InputItem", "InputMessage", "FunctionCallItem",
           "FunctionCallOutputItem", "FunctionTool", "NamedFunction", "TextConfig",
           "LOGPROBS_INCLUDE", "as_input", "identified", "listed"]

#: the ``include`` entry that asks for the answer's log-probabilities
LOGPROBS_INCLUDE = "message.output_text.logprobs"
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
CallId = Annotated[str, Field(min_length=1, max_length=256)]
ItemId = Annotated[str, Field(min_length=1, max_length=256)]


class _Item(BaseModel):
    """An input item: fields an output item adds (``status``, ``annotations``, ...) are let
    through; its ``id`` is kept (a stored response's input items are listed by it)."""

    model_config = ConfigDict(extra="ignore")

    id: ItemId | None = None


class InputTextPart(_Item):
    """A message's text (``input_text``; ``output_text`` in an assistant's earlier answer)."""

    type: Literal["input_text", "output_text"]
    text: PromptText


class InputMessage(_Item):
    """A message: the app's instructions (``system``/``developer``), a question, or an earlier
    answer; its content a text or text parts (images and files are not taken)."""

    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: PromptText | Annotated[list[InputTextPart], Field(max_length=256)]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionCallItem(_Item):
    """A call the model made in an earlier response (its ``function_call`` output item)."""

    type: Literal["function_call"]
    call_id: CallId
    name: ToolName
    arguments: Annotated[str, Field(max_length=MAX_ARGUMENT_CHARS)]


class FunctionCallOutputItem(_Item):
    """A call's result, as the app ran it (``call_id``: the call's)."""

    type: Literal["function_call_output"]
    call_id: CallId | None = None
    output: PromptText | Annotated[list[InputTextPart], Field(max_length=256)]

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(p.text for p in self.output)


def _item_type(v: Any) -> str:
    """An item's kind (a message may leave ``type`` out, as OpenAI's "easy" messages do)."""
    if isinstance(v, dict):
        return str(v.get("type", "message"))
    return str(getattr(v, "type", "message"))


InputItem = Annotated[Union[Annotated[InputMessage, Tag("message")],
                            Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")]],
                      Discriminator(_item_type)]


class FunctionTool(BaseModel):
    """One of ``tools``: a function (the Responses API's flat form of a chat's tool)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: ToolName
    description: Annotated[str, Field(max_length=4096)] | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None

    def tool(self) -> Tool:
        return Tool(self.name, self.description or "", self.parameters, bool(self.strict))


class NamedFunction(BaseModel):
    """``tool_choice`` naming the one function the answer calls."""

    type: Literal["function"]
    name: ToolName


class _JsonSchemaText(BaseModel):
    """``text.format`` ``json_schema``: flat (a chat's ``response_format`` nests it)."""

    model_config = ConfigDict(populate_by_name=True)

    type: Literal["json_schema"]
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: StrictBool | None = None


class _PlainFormat(BaseModel):
    type: Literal["text", "json_object"]


class TextConfig(BaseModel):
    """``text``: the answer's ``format`` (text, ``json_object`` or ``json_schema``, as a chat's
    ``response_format``: docs/asks.md, "JSON answers"); ``verbosity`` is taken and changes
    nothing."""

    format: Annotated[_PlainFormat | _JsonSchemaText, Field(discriminator="type")] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    _format: ResponseFormat | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _compiled(self) -> "TextConfig":
        """The format as a chat's ``response_format`` (a schema compiled when read)."""
        f = self.format
        if isinstance(f, _JsonSchemaText):
            spec = {"name": f.name, "schema": f.schema_, "description": f.description,
                    "strict": f.strict}
            self._format = _FORMAT.validate_python({"type": "json_schema", "json_schema": spec})
        elif f is not None:
            self._format = _FORMAT.validate_python({"type": f.type})
        return self

    def response_format(self) -> ResponseFormat | None:
        return self._format


_FORMAT: TypeAdapter[ResponseFormat] = TypeAdapter(ResponseFormat)


class ConversationRef(BaseModel):
    """``conversation`` as an object: its ``id``."""

    id: ItemId


class _Reasoning(BaseModel):
    effort: None = None
    summary: None = None


#: request fields whose use is refused, and why
_REFUSED = {
    "prompt": "stored prompts are not kept here: send the instructions and input",
}
_TEXT_PARTS = ("input_text", "output_text")
_ITEMS = ("message", "function_call", "function_call_output")


def _not_taken(data: dict[str, Any]) -> str | None:
    """Why a request asks what the service does not do (``None``: it does not)."""
    for key, why in _REFUSED.items():
        if data.get(key):
            return f"{key} is not taken: {why}"
    if data.get("background") is True and data.get("store") is False:
        return "background is not taken with store false: a background response is kept"
    if data.get("conversation") and data.get("previous_response_id"):
        return ("conversation is not taken with previous_response_id: a response continues "
                "one or the other")
    reasoning = data.get("reasoning")
    if isinstance(reasoning, dict) and any(v is not None for v in reasoning.values()):
        return "reasoning is not taken: the model does not reason apart from its answer"
    for i, t in enumerate(data.get("tools") or []):
        if isinstance(t, dict) and t.get("type") != "function":
            return f"tools[{i}]: {t.get('type')!r} tools are not taken (functions only)"
    items = data.get("input")
    return _item_problem(items) if isinstance(items, list) else None


def _item_problem(items: list[Any]) -> str | None:
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")
        if kind not in _ITEMS:
            return f"input[{i}]: {kind!r} items are not taken ({', '.join(_ITEMS)} are)"
        parts = item.get("content") if kind == "message" else item.get("output")
        for part in parts if isinstance(parts, list) else []:
            if isinstance(part, dict) and part.get("type") not in _TEXT_PARTS:
                return (f"input[{i}]: {part.get('type')!r} content is not taken "
                        "(text only: input_text)")
    return None


class _StreamOptions(BaseModel):
    include_obfuscation: StrictBool = False


class ResponsesBody(BaseModel):
    """``POST /v1/responses``: OpenAI's response request about a server context (``model``),
    the fields a stock client sends for text, JSON and function calls; without ``temperature``
    answers are greedy."""

    model_config = ConfigDict(extra="forbid")

    model: Annotated[str, Field(min_length=1, max_length=256)] = Field(description=(
        "the server context's id (or any name when sparkv.context_id gives it)"))
    input: PromptText | Annotated[list[InputItem], Field(min_length=1, max_length=256)]
    instructions: PromptText | None = Field(default=None, description=(
        "the app's instructions: a system message before the input"))
    stream: StrictBool = False
    stream_options: _StreamOptions | None = Field(default=None, description=(
        "taken; events carry no obfuscation padding"))
    max_output_tokens: AnswerTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_logprobs: TopLogprobs | None = None
    include: Annotated[list[Literal["message.output_text.logprobs"]],
                       Field(max_length=1)] | None = Field(default=None, description=(
        "message.output_text.logprobs: the answer's tokens with their log-probabilities"))
    text: TextConfig | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool | None = None
    store: StrictBool | None = Field(default=None, description=(
        "keep the response (default true) for GET /v1/responses/{id} and a later "
        "previous_response_id, in the service's memory and flash until deleted or evicted"))
    previous_response_id: ItemId | None = Field(default=None, description=(
        "a stored response of this app: its input and output come before this input "
        "(its instructions do not)"))
    background: StrictBool | None = Field(default=None, description=(
        "answer at once with the response queued (with stream: its events); the ask runs on "
        "whether or not the app stays connected, and GET /v1/responses/{id} gives it when "
        "done (with stream=true: its events again, after starting_after)"))
    conversation: ItemId | ConversationRef | None = Field(default=None, description=(
        "a conversation of this app (POST /v1/conversations): the response comes after its "
        "items, and its input and output are added to it once answered"))
    prompt: None = None
    truncation: Literal["auto", "disabled"] | None = Field(default=None, description=(
        "auto: a conversation past the model's positions loses its oldest turns until it "
        "fits (the instructions stay); disabled (the default): it is refused, 413"))
    reasoning: _Reasoning | None = None
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    safety_identifier: Annotated[str, Field(max_length=256)] | None = None
    prompt_cache_key: Annotated[str, Field(max_length=256)] | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = Field(default=None, description=(
        "taken; the service's memory keeps the KV it holds as its own rules say"))
    prompt_cache_options: Annotated[dict[str, Any], Field(max_length=8)] | None = None
    max_tool_calls: Annotated[int, Field(ge=1)] | None = Field(default=None, description=(
        "taken: it bounds calls to built-in tools, and there are none here"))
    service_tier: Annotated[str, Field(max_length=32)] | None = None
    sparkv: SparkvFields | None = None
    _tools: ToolSet | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _taken(cls, data: Any) -> Any:
        """What the service does not do, refused by name before the fields are read."""
        if isinstance(data, dict):
            problem = _not_taken(data)
            if problem:
                raise ValueError(problem)
        return data

    @model_validator(mode="after")
    def _tool_set(self) -> "ResponsesBody":
        """The tools and the choice, checked when the request is read."""
        choice = self.tool_choice
        name = choice.name if isinstance(choice, NamedFunction) else choice
        self._tools = tool_set_of([t.tool() for t in self.tools or []], name,
                                  self.parallel_tool_calls)
        return self

    def tool_set(self) -> ToolSet | None:
        """The request's tools and how the answer may use them (``None``: no tools)."""
        return self._tools

    def logprobs(self) -> int | None:
        """How many alternatives each token lists (``None``: no log-probabilities): asked by
        ``include`` or by ``top_logprobs``."""
        if not self.include and self.top_logprobs is None:
            return None
        return self.top_logprobs or 0

    def conversation_id(self) -> str | None:
        """The id of the conversation the response belongs to (``None``: none)."""
        c = self.conversation
        return c.id if isinstance(c, ConversationRef) else c

    def items(self) -> list[InputItem]:
        """The input as items (a text is one user message)."""
        if isinstance(self.input, str):
            return [InputMessage(role="user", content=self.input)]
        return list(self.input)

    def turns(self, earlier: Sequence[InputItem] = ()) -> list[ChatTurn]:
        """The instructions, the ``earlier`` items (a previous response's conversation) and
        the input as turns: an assistant's message and the calls after it are one turn (the
        calls written as the model writes them), a call's result is the user's turn."""
        out = [ChatTurn("system", self.instructions)] if self.instructions else []
        for item in [*earlier, *self.items()]:
            if isinstance(item, FunctionCallOutputItem):
                out.append(ChatTurn("user", response_text(item.text())))
            elif isinstance(item, FunctionCallItem):
                call = call_text(item.name, item.arguments)
                if out and out[-1].role == "assistant":
                    last = out.pop()
                    call = "\n".join(t for t in (last.text.strip(), call) if t)
                out.append(ChatTurn("assistant", call))
            else:
                out.append(ChatTurn(_ROLES[item.role], item.text()))
        return out


_INPUT_ITEMS: TypeAdapter[list[InputItem]] = TypeAdapter(list[InputItem])
#: an item's id's prefix, by its type
_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def as_input(output: list[dict[str, Any]]) -> list[InputItem]:
    """A response's ``output`` items as input items (what an app sends back)."""
    return _INPUT_ITEMS.validate_python(output)


def identified(item: InputItem) -> InputItem:
    """``item`` with an id (a new one, by its type, if it had none)."""
    if item.id is not None:
        return item
    return item.model_copy(update={"id": f"{_ID_PREFIX[item.type]}_{secrets.token_hex(12)}"})


def listed(item: InputItem) -> dict[str, Any]:
    """``item`` as the API lists a response's input items (text as parts, a status)."""
    if isinstance(item, InputMessage):
        kind = "output_text" if item.role == "assistant" else "input_text"
        part: dict[str, Any] = {"type": kind, "text": item.text()}
        if kind == "output_text":
            part["annotations"] = []
        return {"id": item.id, "type": "message", "role": item.role, "status": "completed",
                "content": [part]}
    out = item.model_dump(exclude_none=True)
    if isinstance(item, FunctionCallOutputItem):
        out["output"] = item.text()
    return {**out, "status": "completed"}
