"""Request and response bodies of the device service's HTTP API (:mod:`sparkv.device.app`);
pydantic models are the schema, docs/device-service.md has the prose.

The response models mirror what :class:`~sparkv.device.service.ContextService` returns (its
``describe``, ``stats`` and :class:`~sparkv.device.service.CallResult`); they allow extra fields,
so a field the service adds reaches the client unchanged. Errors are the wire's one shape,
:class:`~sparkv.protocol.errors.ErrorResponse`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, StrictBool

from sparkv.device.identity import APP_ID_PATTERN
from sparkv.device.inputs import MAX_TIMEOUT_S, text_problem
from sparkv.protocol.errors import ErrorDetail, ErrorResponse
from sparkv.rest.fields import JSON_INT, JSON_NUMBER, at_most_one_of, one_of
from sparkv.runtime.jsonform import FormError, JsonForm
from sparkv.runtime.sampling import (MAX_BIAS, MAX_PENALTY, MAX_TEMPERATURE, SEED_RANGE,
                                     Sampling)

__all__ = ["MAX_PROMPT_CHARS", "MAX_PROMPT_IDS", "NewContext", "CallBody", "ServiceHealth",
           "ChunkCounts", "FlashInfo", "ContextInfo", "DamagedContextInfo", "DeviceContextList",
           "CallReply", "DoneEvent", "ShareBody", "AppId", "PromptText", "SamplingFields",
           "Temperature", "TopP", "TopK", "Seed", "Penalty", "LogitBias",
           "ResponseFormat", "PromptToken", "ScoredToken",
           "IOProfileInfo", "ServiceStats", "ErrorDetail", "ErrorResponse"]

#: the longest prompt text a request may carry (characters; token limits are the service's)
MAX_PROMPT_CHARS = 1 << 20
#: the most token ids a request may carry (the service's longest context is far shorter)
MAX_PROMPT_IDS = 1 << 20


def _unicode(text: str) -> str:
    problem = text_problem(text)
    if problem is not None:
        raise ValueError(f"the text {problem}")
    return text


#: prompt text: at most :data:`MAX_PROMPT_CHARS` characters of valid Unicode (no lone surrogate)
PromptText = Annotated[str, Field(max_length=MAX_PROMPT_CHARS), AfterValidator(_unicode)]
#: a caller's label of a context: 1-100 characters, no control character and no '#' (the edge's
#: kept contexts are labelled SERVER#CONTEXT_ID: a label never looks like one)
Label = Annotated[str, Field(min_length=1, max_length=100, pattern=r"^[^\x00-\x1f\x7f#]+$")]
#: token ids: at most :data:`MAX_PROMPT_IDS` JSON integers, none negative (never a bool or a
#: string: the server's JSON policy, :mod:`sparkv.rest.fields`); their upper bound is the
#: model's vocabulary (the service checks it; the app's OpenAPI states it)
TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=2**31 - 1), JSON_INT]],
                     Field(max_length=MAX_PROMPT_IDS)]


#: an app as share lists name it: ``user``, ``uid:N``, ``app:NAME`` (sparkv.device.identity)
AppId = Annotated[str, Field(pattern=APP_ID_PATTERN, max_length=40)]


#: sampling's knobs (:class:`~sparkv.runtime.sampling.Sampling`)
Temperature = Annotated[float, JSON_NUMBER, Field(ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)]
TopP = Annotated[float, JSON_NUMBER, Field(ge=0, le=1, allow_inf_nan=False)]
TopK = Annotated[int, Field(ge=0, le=1 << 20), JSON_INT]
Seed = Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1]), JSON_INT]
Penalty = Annotated[float, JSON_NUMBER, Field(ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)]
#: OpenAI's logit_bias: token ids (as JSON's string keys) to a bias (a JSON number: ``false``
#: is refused, not read as 0)
LogitBias = Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")],
                           Annotated[float, JSON_NUMBER, Field(ge=-MAX_BIAS, le=MAX_BIAS,
                                                               allow_inf_nan=False)]],
                      Field(max_length=1024)]


class TextFormat(BaseModel):
    """``response_format`` ``{"type": "text"}``: any text (the default)."""

    type: Literal["text"]

    def form(self) -> JsonForm | None:
        return None


class JsonObjectFormat(BaseModel):
    """``{"type": "json_object"}``: the answer is a JSON object (OpenAI's JSON mode)."""

    type: Literal["json_object"]

    def form(self) -> JsonForm | None:
        return JsonForm.any_object()


class JsonSchemaSpec(BaseModel):
    """OpenAI's ``json_schema``: a name and the schema the answer follows."""

    model_config = ConfigDict(populate_by_name=True)

    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: Annotated[str, Field(max_length=4096)] | None = None
    schema_: dict[str, Any] = Field(alias="schema", description=(
        "a JSON Schema whose top level is an object (docs/asks.md, 'JSON answers')"))
    strict: StrictBool | None = Field(default=None, description=(
        "taken at either value: the answer always follows the schema"))


class JsonSchemaFormat(BaseModel):
    """``{"type": "json_schema", "json_schema": {...}}``: the answer is a JSON value of the
    schema (OpenAI's structured outputs), checked when the request is read."""

    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec
    _form: JsonForm | None = PrivateAttr(default=None)

    def model_post_init(self, context: Any) -> None:
        try:
            self._form = JsonForm.from_schema(self.json_schema.schema_, self.json_schema.name)
        except FormError as e:
            raise ValueError(str(e)) from None

    def form(self) -> JsonForm | None:
        return self._form


#: OpenAI's ``response_format``: what the answer's text must be
ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat,
                           Field(discriminator="type")]


# ---- requests ------------------------------------------------------------------------------------
class SamplingFields(BaseModel):
    """How an answer's tokens are chosen (defaults: greedy; docs/asks.md, "Sampling")."""

    temperature: Temperature = Field(default=0.0, description="0: greedy; else sampled")
    top_p: TopP = 1.0
    top_k: TopK = Field(default=0, description="sample from this many most likely tokens (0: all)")
    seed: Seed | None = Field(default=None, description=(
        "the draws' seed when sampling (none: one drawn, reported in the stats' seed)"))
    frequency_penalty: Penalty = Field(default=0.0, description=(
        "taken off a token's logit per time the answer holds it"))
    presence_penalty: Penalty = Field(default=0.0, description=(
        "taken off a token's logit once the answer holds it"))
    logit_bias: LogitBias = Field(default_factory=dict, description=(
        "token id -> bias added to its logit (-100: never)"))
    response_format: ResponseFormat | None = Field(default=None, description=(
        "text (the default), json_object or json_schema: the answer is always that JSON "
        "(docs/asks.md, 'JSON answers')"))

    def sampling_fields(self) -> dict[str, Any]:
        """The :class:`Sampling` fields (``logit_bias`` keyed by token id, ``form`` compiled
        from ``response_format``)."""
        out = self.model_dump(include=set(SamplingFields.model_fields) - {"response_format"})
        out["logit_bias"] = tuple((int(k), v) for k, v in self.logit_bias.items())
        out["form"] = self.response_format.form() if self.response_format else None
        return out

    def sampling(self) -> Sampling:
        return Sampling(**self.sampling_fields())


class NewContext(BaseModel):
    """``POST /v1/contexts``: the system prompt as text or token ids (at most one; neither: the
    service's default system prompt)."""

    model_config = ConfigDict(json_schema_extra=at_most_one_of(
        {"system_prompt": "string", "system_ids": "array"}))

    system_prompt: PromptText | None = None
    system_ids: TokenIds | None = None
    label: Label | None = Field(None, description="a name for it, listed with it "
                                "(`sparkv device create --label`)")


class CallBody(SamplingFields):
    """``POST /v1/contexts/{id}/call``: exactly one of ``prompt`` and ``prompt_ids``; the
    answer greedy unless ``temperature`` says otherwise."""

    model_config = ConfigDict(json_schema_extra=one_of({"prompt": "string",
                                                        "prompt_ids": "array"}))

    prompt: PromptText | None = None
    prompt_ids: TokenIds | None = None
    max_new_tokens: Annotated[int, Field(ge=0, le=2**31 - 1), JSON_INT] = Field(default=32)
    grow: StrictBool = Field(default=True,
                             description="keep the prompt and the answer in the context")
    timeout_s: Annotated[float, JSON_NUMBER] | None = Field(
        default=None, ge=0, le=MAX_TIMEOUT_S, allow_inf_nan=False,
        description=("wait at most this long for the context's lock (else 409 context_busy); "
                     "none: wait"))


class ShareBody(BaseModel):
    """``PUT /v1/contexts/{id}/share``: the apps the context is shared with from now on
    (replacing the list; ``["*"]``: every app; ``[]``: its owner's only)."""

    apps: list[AppId | Literal["*"]] = Field(max_length=64)


# ---- responses -----------------------------------------------------------------------------------
class _Reply(BaseModel):
    model_config = ConfigDict(extra="allow")


class FlashInfo(_Reply):
    """The flash's state: ``degraded`` since a write found it full (until one succeeds)."""

    state: str = Field(description="ok | degraded")
    path: str = Field(description="the flash dir")
    mount: str = Field(description="the mount point of its file system")
    free_bytes: int
    total_bytes: int
    reason: str | None = Field(default=None, description="why it is degraded")


class ServiceHealth(_Reply):
    """``GET /healthz``."""

    ok: bool
    contexts: int = Field(description="contexts the service holds")
    flash: FlashInfo | None = None


class ChunkCounts(_Reply):
    """Token chunks of a context by residency."""

    resident: int
    flash: int
    absent: int


class ContextInfo(_Reply):
    """One context: ``GET /v1/contexts/{id}``, ``POST /v1/contexts`` (201)."""

    id: str
    tokens: int = Field(description="tokens in the context")
    calls: int
    bytes: int = Field(description="bytes of its memory in RAM")
    chunks: ChunkCounts
    levels: dict[str, int] = Field(
        description="token chunks per level (fp, int8, k8v4, int4, int2)")
    last_used: int = Field(description="the service's clock at its last use")
    busy: bool = Field(description="a call holds its lock")
    hot: bool = Field(description="its working memory from the last call is kept")
    system_prompt: str | None
    label: str | None
    created_unix: float = Field(default=0.0, description="when it was made (Unix seconds)")
    owner: str | None = Field(default=None, description="the app that made or kept it")
    shared_with: list[str] = Field(default_factory=list,
                                   description="the apps it is shared with (* : every app)")


class DamagedContextInfo(_Reply):
    """A context the service could not reopen (its journal record or files are damaged): it
    takes no call; ``DELETE /v1/contexts/{id}`` removes what is left of it."""

    id: str
    state: str = Field(default="damaged")
    reason: str = Field(description="what could not be reopened")


class DeviceContextList(_Reply):
    """``GET /v1/contexts``: the contexts, and those that could not be reopened."""

    contexts: list[ContextInfo]
    damaged: list[DamagedContextInfo] = Field(default_factory=list)


class CallReply(_Reply):
    """``POST /v1/contexts/{id}/call``: the answer (a :class:`~sparkv.generation.Generation`:
    ``text``, ``tokens``, ``stats``), as :class:`~sparkv.device.calls.CallResult` gives it;
    :meth:`~sparkv.device.client.DeviceClient.call` returns it."""

    context_id: str
    text: str = Field(description="the answer, end of sequence left out")
    tokens: list[int] = Field(description="the answer's token ids")
    stats: dict[str, Any] = Field(description=(
        "what it cost: ttft_s (= first_token_s), new_tokens, switch_s (reclaim + load, until "
        "the context is ready), reclaim_s, load_s, first_token_s, total_s, aot_s (the "
        "ahead-of-time swap-out after the answer), context_tokens (after the call), "
        "bytes_evicted, bytes_written_at_reclaim, bytes_written_aot, turn_tokens_reused (the "
        "prompt's tokens whose KV an earlier call's turns gave: sparkv.device.tails), seed "
        "(a sampled answer's), joined (it read the working memory another call on the "
        "context had switched in, at once: sparkv.device.readturns), load "
        "(what the load did: "
        "sparkv.device.loader.LoadStats; empty when nothing was loaded), plan (the "
        "IO/recompute split; empty without one)"))


class ScoredToken(BaseModel):
    """A token and its log-probability under the model, after what comes before it."""

    token: int
    logprob: float


class PromptToken(BaseModel):
    """A question token, scored (``logprob`` ``None``: the first, after a context whose last
    position did not run on the device) with its most likely alternatives."""

    token: int
    logprob: float | None
    top_logprobs: list[ScoredToken] | None


class DoneEvent(_Reply):
    """The end of an ask (``POST /v1/asks``, docs/asks.md): the answer in the one result shape
    (a :class:`~sparkv.generation.Generation`: ``text``, ``tokens``, ``stats``: the edge's
    ``AskResult.stats``), what became of the context, and the ask's times in the service
    (seconds from the submission); :meth:`~sparkv.device.client.DeviceClient.ask` returns it."""

    type: Literal["done"]
    id: str
    text: str
    tokens: list[int]
    stats: dict[str, Any] = Field(description=(
        "ttft_s, new_tokens, context_tokens, then the edge's breakdown: strategy, "
        "chunks_streamed, chunks_computed, bytes_streamed, levels, fallback, ..."))
    kept_id: str | None = Field(description="the service's id of the kept context")
    not_kept: str | None = Field(default=None, description="why the context was not kept")
    started: int = Field(description="its rank among the asks that ran (admission order)")
    queued_s: float = Field(description="waiting for a slot")
    first_token_s: float | None = Field(description="from the submission to the first token")
    total_s: float
    prompt: list[PromptToken] | None = Field(default=None, description=(
        "asked with prompt_logprobs: each question token's log-probability and alternatives"))


class IOProfileInfo(_Reply):
    """The flash profile the planner uses."""

    read_Bps: float
    per_file_s: float
    threads: int
    source: str


class HostTierInfo(_Reply):
    """The host-RAM tier between the device's memory and flash (docs/device-service.md)."""

    capacity_bytes: int = Field(description="0: no host tier (the default on the CPU)")
    bytes: int
    records: int
    peak_bytes: int
    hits: int = Field(description="records a load read from it instead of flash")
    hit_bytes: int
    misses: int
    puts: int
    evictions: int = Field(description="records dropped for room (flash keeps them)")
    dropped: int = Field(description="records dropped: their flash record died or was rewritten")


class TurnCacheInfo(_Reply):
    """The KV of recent turns after the contexts, reused by the next call of the same
    conversation (:mod:`sparkv.device.tails`, docs/device-service.md)."""

    capacity: int = Field(description="bytes it may hold (--turn-cache-mb); 0: off")
    bytes: int
    tails: int = Field(description="conversations' tails held")
    hits: int = Field(description="calls that reused a tail's rows")
    misses: int
    reused_tokens: int = Field(description="prompt tokens not run: their KV came from a tail")
    evictions: int = Field(description="tails dropped for room")


class ServiceStats(_Reply):
    """``GET /v1/stats``: the budget, the bytes, and the service's counters."""

    policy: str
    device: str = Field(description="where the model runs and the contexts' pages live")
    host_tier: HostTierInfo
    turn_cache: TurnCacheInfo
    budget_bytes: int
    used_bytes: int
    peak_bytes: int
    budget_violations: int
    contexts: int
    resident_bytes_by_level: dict[str, int]
    io_profile: IOProfileInfo
    recompute_scale: float = Field(description="measured / predicted recomputation time")
    reopened: int = Field(description="contexts reopened from the journal at start")
    damaged: int = Field(description=(
        "contexts that could not be reopened (listed by GET /v1/contexts, deletable)"))
    # counters since the service started
    calls: int
    evicted_chunks: int = Field(description=(
        "token chunks evicted (whole contexts under the context-swapping baselines)"))
    evicted_bytes: int
    reclaim_written_bytes: int = Field(description="written to flash to make room")
    aot_written_bytes: int = Field(description="written ahead of time, after each call")
    read_bytes: int = Field(description="read from flash by loads")
    recomputed_chunks: int = Field(description="token chunks recomputed by loads")
    read_chunks: int = Field(description="token chunks read back by loads (flash or host tier)")
    host_chunks: int = Field(description="of them, read from the host tier's copies")
    host_bytes: int
    faults: int = Field(description="token chunks whose flash copy failed (then recomputed)")
    hot_hits: int = Field(description="calls that found their working memory kept")
    hot_dropped: int = Field(description="kept working memories freed")
    streamed_chunks: int = Field(description="token chunks restored from the server")
    turns_running: int = Field(description=(
        "calls answering now without the model lock (docs/device-service.md, 'Calls at once')"))
    reservations_waiting: int = Field(description=(
        "calls waiting now, in arrival order, for memory held by calls answering "
        "(docs/device-service.md, 'Calls at once')"))
    turn_waits: int = Field(description=(
        "reservations that found their memory held by calls answering and waited for one"))
    joined_reads: int = Field(description=(
        "calls that left their context as it was and read the working memory another call on "
        "it had switched in, at once (docs/device-service.md, 'Calls at once')"))
    read_handoffs: int = Field(description=(
        "read turns whose opener answered while calls that joined it still read: it returned "
        "at once, and the service released the working memory once they left "
        "(docs/device-service.md, 'Calls that read one working memory')"))
