"""Request and response bodies of the REST API (pydantic models are the schema; see
docs/rest-api.md for the prose)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Any, Literal, Optional

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, field_validator,
                      model_validator)

from sparkv.codec import DEFAULT_LEVEL, LEVEL_ORDER
from sparkv.protocol.errors import ErrorDetail, ErrorResponse
from sparkv.protocol.manifest import CONTEXT_NAME_PATTERN, MAX_NAME_CHARS, Manifest
from sparkv.rest.fields import JSON_INT, one_of

__all__ = ["ErrorDetail", "ErrorResponse", "Manifest"]  # the wire's own models, shown in OpenAPI

if TYPE_CHECKING:
    LevelName = str           # a Literal of LEVEL_ORDER, made at run time (no static spelling)
else:
    LevelName = Literal[tuple(LEVEL_ORDER)]
LEVEL_NAMES = frozenset(LEVEL_ORDER)
CONTEXT_ID_PATTERN = r"^[0-9a-f]{32}$"
JOB_ID_PATTERN = r"^[0-9a-f]{32}$"
MAX_INDEX = 2**31 - 1
_CANONICAL_DECIMAL = re.compile(r"0|[1-9][0-9]{0,9}")


def _canonical_decimal(value: Any) -> Any:
    """A path segment as a plain decimal: ``0`` or ``[1-9][0-9]*`` (no sign, no leading zeros,
    no spaces, no fraction), so that one frame has exactly one URL (one cache key)."""
    if isinstance(value, str) and not _CANONICAL_DECIMAL.fullmatch(value):
        raise ValueError("must be a plain decimal integer: 0 or [1-9][0-9]* (no sign, leading "
                         "zeros, spaces or fraction)")
    return int(value) if isinstance(value, str) else value


TokenId = Annotated[int, Field(ge=0, le=MAX_INDEX), JSON_INT]
ChunkTokens = Annotated[int, Field(ge=16, le=65536), JSON_INT]
HeadsPerGroup = Annotated[int, Field(ge=0, le=4096), JSON_INT]
ChunkIndex = Annotated[int, Field(ge=0, le=MAX_INDEX), JSON_INT]
PathIndex = Annotated[Annotated[int, Field(ge=0, le=MAX_INDEX)],
                      BeforeValidator(_canonical_decimal)]
"""``t``, ``l``, ``g`` in a URL path: canonical decimal in ``[0, 2^31)``."""


class CreateContext(BaseModel):
    """``POST /v1/contexts``: exactly one of ``text`` and ``token_ids``."""

    model_config = ConfigDict(extra="forbid",
                              json_schema_extra=one_of({"text": "string", "token_ids": "array"}))

    text: Optional[str] = Field(None, min_length=1, description="the context as text (tokenized "
                                "with the model's tokenizer, no special tokens added)")
    token_ids: Optional[list[TokenId]] = Field(
        None, min_length=1, description="the context as token ids (each in [0, vocab_size))")
    model: Optional[str] = Field(None, min_length=1, max_length=200,
                                 description="a model name from GET /v1/models (default: the "
                                             "server's default model)")
    levels: Optional[list[LevelName]] = Field(
        None, min_length=1, max_length=32,
        description="bitrate levels to encode (default: the server's default levels)")
    chunk_tokens: Optional[ChunkTokens] = Field(
        None, description="T, tokens per token chunk")
    heads_per_group: HeadsPerGroup = Field(
        0, description="KV heads per group (0: every KV head in one group)")
    encrypt: StrictBool = Field(False, description="AES-256-GCM-encrypt the stored frames with a "
                                "new per-context key, returned once in this response")
    press: Optional[str] = Field(
        None, min_length=3, max_length=64, examples=["adakv:0.5", "snapkv:20%", "dynamickv:256t"],
        description="compress the context with a KV press, question-agnostically, before "
                    "encoding: NAME:RATIO, NAME:PCT% or NAME:TOKENSt, optionally @repeat (a fixed "
                    "probe question as the window instead of the context's last 32 tokens; "
                    "docs/presses.md); the frames then hold only the kept entries and the "
                    "manifest their positions")

    name: Optional[str] = Field(
        None, min_length=1, max_length=MAX_NAME_CHARS, pattern=CONTEXT_NAME_PATTERN,
        examples=["warranty manual"],
        description="a label for the context, listed by GET /v1/contexts; not part of its id "
                    "(the same text under another name is the same context, and keeps its first "
                    "name)")

    @model_validator(mode="after")
    def _one_source(self) -> "CreateContext":
        if (self.text is None) == (self.token_ids is None):
            raise ValueError("give exactly one of 'text' and 'token_ids'")
        return self

    @field_validator("press")
    @classmethod
    def _press_spec(cls, value: Optional[str]) -> Optional[str]:
        if value is None:
            return None
        from sparkv.presses import PressError, canonical_spec

        try:
            return canonical_spec(value)
        except PressError as e:
            raise ValueError(str(e)) from None


class ContextCreated(BaseModel):
    context_id: str
    name: Optional[str] = Field(None, description="the context's name: the one given when it was "
                                "first created (null: none)")
    job_id: Optional[str]
    status: Literal["queued", "running", "done"]
    model: str
    num_tokens: int
    num_chunks: int
    levels: list[str]
    chunk_tokens: int
    encrypted: bool
    press: Optional[str] = Field(None, description="the press spec (canonical), if compressed")
    quality_warning: Optional[str] = Field(
        None, description="set when the press fails this model's quality table (its answers are "
                          "inferior to the uncompressed context's with 95% confidence; "
                          "docs/quality.md): the context is stored anyway; also sent as the "
                          "X-Sparkv-Quality-Warning header")
    encryption_key: Optional[str] = Field(None, description="base64url AES-256 key; present only "
                                          "in the response that created the job")
    manifest_url: str
    job_url: Optional[str]


class Progress(BaseModel):
    done: int
    total: int
    fraction: float


class JobInfo(BaseModel):
    job_id: str
    context_id: str
    state: Literal["queued", "running", "done", "failed", "cancelled", "lost"] = Field(
        description="lost: a cluster's queue lost the job (its Redis restarted without its "
                    "data; see error): submit the context again")
    phase: Optional[str]
    progress: Progress
    error: Optional[str]
    attempts: int
    resumed: bool
    created_unix: float
    started_unix: Optional[float]
    finished_unix: Optional[float]
    num_tokens: int
    model: str
    levels: list[str]
    encrypted: bool
    timings: dict[str, float]


class StreamItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    t: ChunkIndex
    l: ChunkIndex  # noqa: E741
    g: ChunkIndex = 0
    level: Optional[LevelName] = Field(None, description="default: the request's level")


class StreamRequest(BaseModel):
    """``POST /v1/contexts/{id}/stream``: the frames to send, in this order."""

    model_config = ConfigDict(extra="forbid")

    chunks: list[StreamItem] = Field(min_length=1)
    level: LevelName = Field(DEFAULT_LEVEL, description="level of items that name none")


class ListedContext(BaseModel):
    """One complete context of ``GET /v1/contexts``: what its manifest says (every field but
    ``context_id`` is null when the stored manifest cannot be read)."""

    context_id: str
    name: Optional[str] = Field(description="the label given when it was created, or null")
    num_tokens: Optional[int]
    model: Optional[str] = Field(description="the server's model name")
    levels: Optional[list[str]]
    press: Optional[str] = Field(None, description="the press spec, if compressed")
    encrypted: Optional[bool]
    created_unix: Optional[float]


class PendingContext(BaseModel):
    """A context whose encode job is queued or running."""

    context_id: str
    job_id: str
    state: str = Field(description="queued or running")


class ContextList(BaseModel):
    """``GET /v1/contexts``: the tenant's complete contexts, sorted by id, and those being
    encoded."""

    contexts: list[ListedContext]
    pending: list[PendingContext]


class ServedModel(BaseModel):
    """One model this server can encode with (`GET /v1/models`)."""

    name: str
    default: bool
    loaded: bool


class ModelList(BaseModel):
    models: list[ServedModel]


class Health(BaseModel):
    """``GET /healthz``: liveness; the store's and the job queue's state are reported without
    any detail (no URL, path or error text: those go to the server's log)."""

    status: Literal["ok", "unavailable"]
    version: str
    store: Literal["ok", "unavailable"]
    jobs_active: int
    queue: Literal["ok", "degraded"] = Field(
        "ok", description="degraded: submitted jobs are not being run (see queue_reason); the "
                          "replica still serves encoded contexts, so the status stays 200")
    queue_reason: Optional[Literal["no_worker", "queue_unreachable"]] = Field(
        None, description="no_worker: no encode worker's heartbeat is live; queue_unreachable: "
                          "the job queue's Redis cannot be reached")
