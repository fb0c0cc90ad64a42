"""Request and response bodies of the REST API (pydantic models are the schema; see
docs/rest-api.md for the prose)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, model_validator)

from sparkv.codec import DEFAULT_LEVEL, LEVEL_ORDER
from sparkv.protocol.errors import ErrorDetail, ErrorResponse
from sparkv.protocol.manifest import Manifest

__all__ = ["ErrorDetail", "ErrorResponse", "Manifest"]  # the wire's own models, shown in OpenAPI

LevelName = Literal[tuple(LEVEL_ORDER)]  # type: ignore[valid-type]
CONTEXT_ID_PATTERN = r"^[0-9a-f]{32}$"
JOB_ID_PATTERN = r"^[0-9a-f]{32}$"
MAX_INDEX = 2**31 - 1


def _json_int(value: Any) -> int:
    """JSON Schema's integer: an int, or a float with no fraction (``3.0``); never a bool or a
    string (``"3"`` is malformed, not coerced)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("must be an integer")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError("must be an integer")
        return int(value)
    return value


JsonInt = Annotated[int, BeforeValidator(_json_int)]
TokenId = Annotated[JsonInt, Field(ge=0, le=MAX_INDEX)]


class CreateContext(BaseModel):
    """``POST /v1/contexts``: exactly one of ``text`` and ``token_ids``."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={
        "oneOf": [{"required": ["text"]}, {"required": ["token_ids"]}]})

    text: Optional[str] = Field(None, min_length=1, description="the context as text (tokenized "
                                "with the model's tokenizer, no special tokens added)")
    token_ids: Optional[list[TokenId]] = Field(
        None, min_length=1, description="the context as token ids (each in [0, vocab_size))")
    model: Optional[str] = Field(None, min_length=1, max_length=200,
                                 description="a model name from GET /v1/models (default: the "
                                             "server's default model)")
    levels: Optional[list[LevelName]] = Field(  # type: ignore[valid-type]
        None, min_length=1, max_length=32,
        description="bitrate levels to encode (default: the server's default levels)")
    chunk_tokens: Optional[JsonInt] = Field(None, ge=16, le=65536,
                                              description="T, tokens per token chunk")
    heads_per_group: JsonInt = Field(0, ge=0, le=4096, description="KV heads per group "
                                       "(0: every KV head in one group)")
    encrypt: StrictBool = Field(False, description="AES-256-GCM-encrypt the stored frames with a "
                                "new per-context key, returned once in this response")

    @model_validator(mode="after")
    def _one_source(self) -> "CreateContext":
        if (self.text is None) == (self.token_ids is None):
            raise ValueError("give exactly one of 'text' and 'token_ids'")
        return self


class ContextCreated(BaseModel):
    context_id: str
    job_id: Optional[str]
    status: Literal["queued", "running", "done"]
    model: str
    num_tokens: int
    num_chunks: int
    levels: list[str]
    chunk_tokens: int
    encrypted: bool
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
    state: Literal["queued", "running", "done", "failed", "cancelled"]
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

    t: JsonInt = Field(ge=0, le=MAX_INDEX)
    l: JsonInt = Field(ge=0, le=MAX_INDEX)  # noqa: E741
    g: JsonInt = Field(0, ge=0, le=MAX_INDEX)
    level: Optional[LevelName] = Field(None, description="default: the request's level")  # type: ignore[valid-type]


class StreamRequest(BaseModel):
    """``POST /v1/contexts/{id}/stream``: the frames to send, in this order."""

    model_config = ConfigDict(extra="forbid")

    chunks: list[StreamItem] = Field(min_length=1)
    level: LevelName = Field(DEFAULT_LEVEL, description="level of items that name none")  # type: ignore[valid-type]


class ContextList(BaseModel):
    contexts: list[str]
    pending: list[dict[str, Any]]


class ModelInfo(BaseModel):
    name: str
    default: bool
    loaded: bool


class ModelList(BaseModel):
    models: list[ModelInfo]


class Health(BaseModel):
    status: str
    version: str
    store: str
    jobs_active: int
    error: Optional[str] = None
