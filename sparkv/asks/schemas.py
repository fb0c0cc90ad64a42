"""Request bodies and stream events of the asks routes (:mod:`sparkv.asks.routes`,
:mod:`sparkv.asks.chat`); pydantic models are the schema, docs/device-service.md ("Asks") has the
prose.

``POST /v1/asks`` takes an :class:`AskBody` and answers a stream of :data:`AskEvent` (JSON Lines:
``queued``, ``token`` ..., then ``done`` or ``error``). ``POST /v1/chat/completions`` takes an
OpenAI chat completion request (:class:`ChatBody`, the SparKV fields under its ``sparkv``
extension: :class:`SparkvFields`) and answers a ``chat.completion`` or, streamed, server-sent
``chat.completion.chunk`` events then ``[DONE]``; ``POST /v1/completions`` takes OpenAI's text
completion request (:class:`CompletionBody`) and answers a ``text_completion``, or its events.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, model_validator

from sparkv.device.schemas import (AppId, DoneEvent, LogitBias, Penalty, PromptText,
                                   PromptToken, TokenIds,
                                   ResponseFormat, SamplingFields, Seed, Temperature, TopP)
from sparkv.edge.options import AskOptions
from sparkv.protocol.manifest import CONTEXT_ID_PATTERN
from sparkv.rest.fields import JSON_INT, JSON_NUMBER
from sparkv.runtime.sampling import MAX_TOP_LOGPROBS
from sparkv.runtime.stops import MAX_STOP_CHARS, MAX_STOPS
from sparkv.runtime.toolform import MAX_CALLS, MAX_TOOLS, TOOL_NAME, Tool, ToolError, ToolSet
from sparkv.runtime.turns import ChatTurn, Conversation

__all__ = ["AskFields", "AskBody", "HistoryTurn", "SparkvFields", "ChatMessage", "ChatBody",
           "CompletionBody",
           "ToolSpec", "FunctionSpec", "NamedToolChoice", "ToolCallItem", "tool_set_of",
           "ContextModel", "ContextModelList", "KeptCopy", "QueuedEvent", "TokenEvent",
           "DoneEvent", "ErrorEvent", "AskEvent", "AskStats", "MAX_ANSWER_TOKENS"]

#: the longest answer an ask may ask for (tokens)
MAX_ANSWER_TOKENS = 4096
#: the most choices a chat completion may ask for (``n``; a text completion: in all its prompts)
MAX_CHOICES = 8
#: a server URL: http(s), an ASCII host (an IDN in its punycode form), at most 2 KiB
_URL = r"^https?://[A-Za-z0-9._~%:@\[\]-]+(/[A-Za-z0-9._~%!$&'()*+,;=:@/-]*)?$"
ServerUrl = Annotated[str, Field(pattern=_URL, max_length=2048)]
#: a name of a codec level, attention backend or decode policy
Name = Annotated[str, Field(pattern=r"^[a-z0-9_-]{1,32}$")]
#: an answer's length (tokens)
AnswerTokens = Annotated[int, Field(ge=1, le=MAX_ANSWER_TOKENS), JSON_INT]
Seconds = Annotated[float, JSON_NUMBER, Field(gt=0, le=86400, allow_inf_nan=False)]
Mbps = Annotated[float, JSON_NUMBER, Field(gt=0, le=1e6, allow_inf_nan=False)]
#: how many alternatives a token's log-probabilities list
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), JSON_INT]
#: a tool's name, and the longest arguments text an earlier call carries
ToolName = Annotated[str, Field(pattern=TOOL_NAME.pattern)]
MAX_ARGUMENT_CHARS = 1 << 16
#: a stop string
StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class AskFields(SamplingFields):
    """How an ask is answered: the server, its key, :class:`~sparkv.edge.options.AskOptions`'s
    fields (their defaults, but ``keep``: on), and whom a kept context is shared with."""

    model_config = ConfigDict(extra="forbid")

    server: ServerUrl | None = Field(default=None, description=(
        "the server holding the context (default: the service's --ask-server)"))
    api_key: Annotated[str, Field(max_length=512)] | None = Field(default=None, description=(
        "the server's API key (default: the service's $SPARKV_API_KEY)"))
    strategy: Literal["sparkv", "local", "stream", "hybrid"] = "sparkv"
    level: Name = "auto"
    quality_floor: Name | None = "auto"
    backend: Name = "auto"
    bandwidth_mbps: Mbps | None = Field(default=None, description=(
        "the link estimate to plan with; none: the link's share (the service's estimate over "
        "the asks on it)"))
    use_cache: StrictBool = True
    chat: StrictBool = True
    stop_at_eos: StrictBool = True
    keep: StrictBool = Field(default=True, description=(
        "keep the loaded context in the service (the asking app's), answer from it next time"))
    decode: Name = "full"
    ram_budget: Annotated[float, JSON_NUMBER, Field(gt=0, allow_inf_nan=False)] | None = None
    prelude: StrictBool | None = None
    ask_deadline_s: Seconds | None = None
    share: list[AppId | Literal["*"]] = Field(default_factory=list, max_length=64, description=(
        "the apps a context this ask keeps is shared with (* : every app)"))
    stop: list[StopText] = Field(default_factory=list, max_length=MAX_STOPS, description=(
        "stop strings: the answer ends where one first appears, its text before it"))

    def options(self, max_new_tokens: int) -> AskOptions:
        """The :class:`AskOptions` (raises ``AskError`` for a strategy or decode policy the
        edge does not know)."""
        fields = self.model_dump(include=set(AskFields.model_fields)
                                 - {"server", "api_key", "share", "response_format"})
        return AskOptions(max_new_tokens=max_new_tokens, **{**fields, **self.sampling_fields()})


class HistoryTurn(BaseModel):
    """One earlier turn of a conversation: the app's instructions (``system``), a question or
    an answer."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: PromptText = Field(min_length=1)


class AskBody(AskFields):
    """``POST /v1/asks``: a question about a server context (after ``history``, when given)."""

    context_id: str = Field(pattern=CONTEXT_ID_PATTERN, description="the context's id on the server")
    question: PromptText = Field(min_length=1)
    history: list[HistoryTurn] = Field(default_factory=list, max_length=255, description=(
        "the conversation before the question: instructions first, then questions and answers "
        "(docs/asks.md, 'A conversation after the context')"))
    max_new_tokens: AnswerTokens = Field(default=64)
    logprobs: TopLogprobs | None = Field(default=None, description=(
        "each token event carries its token's log-probability (logprob) and this many most "
        "likely alternatives (top_logprobs); none: neither"))
    prompt_logprobs: TopLogprobs | None = Field(default=None, description=(
        "the done event's prompt lists each question token with its log-probability after "
        "what comes before it and this many most likely alternatives; none: no prompt"))

    def asked(self) -> "str | Conversation":
        """The question, or the conversation it ends (:class:`ConversationError` for turns that
        are none)."""
        if not self.history:
            return self.question
        return Conversation.of(self.question, [ChatTurn(t.role, t.content) for t in self.history])


class SparkvFields(AskFields):
    """The ``sparkv`` extension of a chat completion request (``extra_body={"sparkv": {...}}``
    in the ``openai`` client): the server context (``context_id``, else the request's
    ``model``) and how the ask is answered."""

    context_id: str | None = Field(default=None, pattern=CONTEXT_ID_PATTERN)


class _TextPart(BaseModel):
    type: Literal["text"]
    text: str


class _CalledFunction(BaseModel):
    name: ToolName
    arguments: Annotated[str, Field(max_length=MAX_ARGUMENT_CHARS)]


class ToolCallItem(BaseModel):
    """A call an assistant's message made (OpenAI's ``tool_calls`` item)."""

    id: Annotated[str, Field(min_length=1, max_length=256)]
    type: Literal["function"] = "function"
    function: _CalledFunction


class ChatMessage(BaseModel):
    """One message of the conversation: an assistant's may hold the calls it made, a ``tool``
    message a call's result (``tool_call_id``: the call's)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: PromptText | list[_TextPart] | None = None
    tool_calls: Annotated[list[ToolCallItem], Field(max_length=MAX_CALLS)] | None = None
    tool_call_id: Annotated[str, Field(max_length=256)] | None = None
    name: Annotated[str, Field(max_length=256)] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionSpec(BaseModel):
    """A tool's function: its name, what it does, its arguments' JSON Schema; ``strict``: the
    schema must be enforced whole (else a schema the form cannot enforce takes any object)."""

    name: ToolName
    description: Annotated[str, Field(max_length=4096)] = ""
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


def tool_set_of(tools: list[Tool], choice: str | None, parallel: bool | None
                ) -> ToolSet | None:
    """A request's tools and ``tool_choice`` (``None``: no tools asked for; a choice of none,
    auto or nothing without tools); ``ValueError`` naming what cannot be (a validator's
    refusal, a 422)."""
    if not tools and choice in (None, "none", "auto"):
        return None
    try:
        return ToolSet(tools, choice or "auto", parallel is not False)
    except ToolError as e:
        raise ValueError(str(e)) from None


class ToolSpec(BaseModel):
    """One of ``tools`` (OpenAI's function tool)."""

    type: Literal["function"]
    function: FunctionSpec

    def tool(self) -> Tool:
        f = self.function
        return Tool(f.name, f.description, f.parameters, bool(f.strict))


class _NamedFunction(BaseModel):
    name: ToolName


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming the one tool the answer calls."""

    type: Literal["function"]
    function: _NamedFunction


class _StreamOptions(BaseModel):
    include_usage: StrictBool = False


class ChatBody(BaseModel):
    """``POST /v1/chat/completions`` (OpenAI's chat completion request, the fields a stock
    client sends for a conversation about the context; without ``temperature`` answers are
    greedy, as ``temperature`` 0 gives)."""

    model_config = ConfigDict(extra="forbid")

    model: Annotated[str, Field(min_length=1, max_length=256)] = Field(description=(
        "the server context's id (or any name when sparkv.context_id gives it)"))
    messages: list[ChatMessage] = Field(min_length=1, max_length=256)
    stream: StrictBool = False
    stream_options: _StreamOptions | None = None
    max_tokens: AnswerTokens | None = None
    max_completion_tokens: AnswerTokens | None = None
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOPS)] | None = Field(
        default=None, description="up to 4 stop strings: the answer ends before the first")
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES), JSON_INT] = Field(default=1, description=(
        "choices: each sampled with its own seed (greedy: the same answer, computed once)"))
    temperature: Temperature | None = Field(default=None, description=(
        "0 or none: greedy; else the answer is sampled (docs/asks.md, 'Sampling')"))
    top_p: TopP | None = None
    seed: Seed | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    logprobs: StrictBool | None = Field(default=None, description=(
        "the answer's tokens with their log-probabilities (choices[0].logprobs.content)"))
    top_logprobs: TopLogprobs | None = Field(default=None, description=(
        "with logprobs: this many most likely alternatives per token"))
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: LogitBias | None = None
    response_format: ResponseFormat | None = Field(default=None, description=(
        "text, json_object or json_schema (docs/asks.md, 'JSON answers')"))
    tools: Annotated[list[ToolSpec], Field(max_length=MAX_TOOLS)] | None = Field(
        default=None, description="functions the model may call (docs/asks.md, 'Tool calls')")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None, description=("none, auto (the default with tools), required, or the "
                                   "one function to call"))
    parallel_tool_calls: StrictBool | None = Field(default=None, description=(
        "whether an answer may make several calls (default: true)"))
    store: StrictBool | None = None
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    service_tier: Annotated[str, Field(max_length=32)] | None = None
    sparkv: SparkvFields | None = None
    _tools: ToolSet | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _tool_set(self) -> "ChatBody":
        """The tools and the choice, checked when the request is read."""
        choice = self.tool_choice
        name = choice.function.name if isinstance(choice, NamedToolChoice) else choice
        self._tools = tool_set_of([t.tool() for t in self.tools or []], name,
                                  self.parallel_tool_calls)
        return self

    def tool_set(self) -> ToolSet | None:
        """The request's tools and how the answer may use them (``None``: no tools)."""
        return self._tools


class CompletionBody(BaseModel):
    """``POST /v1/completions`` (OpenAI's text completion request, the "legacy" completions of
    llama.cpp's server, vLLM and lm-evaluation-harness): each ``prompt``'s text continues the
    context as it is, with no chat template; ``n`` choices of each."""

    model_config = ConfigDict(extra="forbid")

    model: Annotated[str, Field(min_length=1, max_length=256)] = Field(description=(
        "the server context's id (or any name when sparkv.context_id gives it)"))
    prompt: (PromptText | Annotated[list[PromptText], Field(min_length=1, max_length=MAX_CHOICES)]
             | TokenIds | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_CHOICES)]
             ) = Field(description=(
        "the text after the context, or several (their choices in prompt order); or the "
        "model's token ids, run as they are (a list of them, or several lists)"))
    suffix: PromptText | None = Field(default=None, description=(
        "not supported (the answer continues the prompt): none or empty"))
    max_tokens: Annotated[int, Field(ge=0, le=MAX_ANSWER_TOKENS), JSON_INT] = Field(
        default=16, description="the answer's cap (tokens); 0 with echo: the prompt alone")
    stream: StrictBool = False
    stream_options: _StreamOptions | None = None
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOPS)] | None = Field(
        default=None, description="up to 4 stop strings: the answer ends before the first")
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES), JSON_INT] = Field(default=1, description=(
        "choices of each prompt: each sampled with its own seed (greedy: the same answer)"))
    best_of: Annotated[int, Field(ge=1, le=MAX_CHOICES), JSON_INT] | None = Field(
        default=None, description="none, or n (every choice computed is returned)")
    echo: StrictBool = Field(default=False, description=(
        "each choice's text begins with its prompt (with logprobs: so do its logprobs)"))
    logprobs: TopLogprobs | None = Field(default=None, description=(
        "each answer token's log-probability and this many most likely alternatives "
        "(choices[i].logprobs: tokens, token_logprobs, top_logprobs, text_offset); with echo "
        "the prompt's tokens first (the first one's null)"))
    temperature: Temperature | None = Field(default=None, description=(
        "0 or none: greedy; else the answer is sampled (docs/asks.md, 'Sampling')"))
    top_p: TopP | None = None
    seed: Seed | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: LogitBias | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    sparkv: SparkvFields | None = None

    @model_validator(mode="after")
    def _supported(self) -> "CompletionBody":
        """What this service cannot answer, refused when the request is read."""
        if not all(self.prompts()):
            raise ValueError("an empty prompt: the answer continues a prompt's text after the "
                             "context")
        if self.suffix:
            raise ValueError("suffix (text after the insertion) is not supported: the answer "
                             "continues the prompt")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported: every choice computed is "
                             "returned")
        if self.max_tokens == 0 and (not self.echo or self.stream):
            raise ValueError("max_tokens 0 answers the prompt alone: it needs echo, without "
                             "stream")
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise ValueError(f"{len(self.prompts())} prompts of n = {self.n} choices each: at "
                             f"most {MAX_CHOICES} choices in all")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts, in order: texts, or token id lists."""
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return list(p)


class KeptCopy(BaseModel):
    """What the service holds of a listed context: its own id, the server, its tokens."""

    kept_id: str
    server: str
    tokens: int


class ContextModel(BaseModel):
    """One context an app may ask about, as OpenAI's model object (``id``: the server
    context's id, what a chat completion's ``model`` takes)."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(description="when the service kept it (Unix seconds)")
    owned_by: str = Field(description="the app that kept it")
    sparkv: KeptCopy


class ContextModelList(BaseModel):
    """``GET /v1/models``: the contexts the calling app may ask about from the service's
    memory (OpenAI's model list)."""

    object: Literal["list"] = "list"
    data: list[ContextModel]


# ---- the events of POST /v1/asks -----------------------------------------------------------------
class _Event(BaseModel):
    model_config = ConfigDict(extra="allow")


class QueuedEvent(_Event):
    """The ask waits for a slot: ``position`` asks are ahead of it (or it is this far back)."""

    type: Literal["queued"]
    position: int


class _Alternative(BaseModel):
    token: int
    logprob: float


class TokenEvent(_Event):
    """An answer token, as generated: its id and the text it adds to the answer (empty while the
    answer ends inside a character); asked with ``logprobs``, its log-probability under the model
    and the most likely alternatives'."""

    type: Literal["token"]
    token: int
    text: str
    logprob: float | None = None
    top_logprobs: list[_Alternative] | None = None
    prompt: list[PromptToken] | None = Field(default=None, description=(
        "the first token's, asked with prompt_logprobs: the question's scored tokens"))


class _ErrorInfo(BaseModel):
    status: int
    code: str
    message: str


class ErrorEvent(_Event):
    """The ask failed after its stream began (the server refused it, it was cancelled: status
    499 ``cancelled``, ...): the wire's error shape."""

    type: Literal["error"]
    error: _ErrorInfo


AskEvent = Annotated[Union[QueuedEvent, TokenEvent, DoneEvent, ErrorEvent],
                     Field(discriminator="type")]


class AskStats(BaseModel):
    """``GET /v1/asks``: the admission (slots, queue, running, waiting, refused), the cores
    (lanes, waiting units, units run, ``batched_units``: of them, layer steps run in another
    ask's call, ``batch``: the most steps a call runs, ``load``: the asks using them,
    ``busy_load``: 1 / (1 - the share of the last second they ran), ``held_memories`` and
    ``held_bytes``: the KV memories the asks hold now), the counts since the start, the link's
    estimated rate (bytes/s) and the bytes it carried."""

    model_config = ConfigDict(extra="allow")

    slots: int
    queue: int
    running: int
    waiting: int
    refused: int
    cores: dict[str, float]
    asks: int
    done: int
    failed: int
    cancelled: int
    link_Bps: float | None
    link_bytes: int = Field(description="bytes the service's link carried")
    kept_responses: dict[str, int] | None = Field(default=None, description=(
        "the Responses API's kept responses: responses, held (deleted or expired, kept for "
        "those continuing them), bytes, apps, evicted, too_big, expired, kept_whole, "
        "background_running"))
    conversations: dict[str, int] | None = Field(default=None, description=(
        "the Conversations API's conversations: conversations, bytes, apps, evicted, "
        "items_dropped"))
