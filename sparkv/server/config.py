"""Server settings: a YAML (or JSON) config file, overridden by environment and command line.

The file format is documented in docs/server.md and deploy/server-config.example.yaml. Unknown keys
are errors (a typo must not silently disable a limit). API keys appear only as hashes
(``sha256:<hex>``); :func:`hash_api_key` computes them and ``sparkv apikey`` prints a new key with
its line for the file.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from sparkv.rest.limits import (DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S,
                                DEFAULT_MAX_BODY_BYTES)
from sparkv.server.errors import ConfigError

TENANT_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
KEY_HASH = re.compile(r"^sha256:[0-9a-f]{64}$")
ANONYMOUS_TENANT = "anonymous"
DEFAULT_STORE = "file://./sparkv-store"
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"


def hash_api_key(key: str) -> str:
    """The form an API key is stored in: ``sha256:<hex of SHA-256(key as UTF-8)>``.

    Keys are random 256-bit tokens (see :func:`new_api_key`), so a fast hash is enough: there is
    nothing to brute-force that a slow hash would protect.
    """
    return "sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_api_key() -> str:
    """A fresh API key: ``skv_`` and 43 URL-safe characters (256 random bits)."""
    return "skv_" + secrets.token_urlsafe(32)


class TenantConfig(BaseModel):
    """One tenant: the hashes of its API keys."""

    model_config = ConfigDict(extra="forbid")
    keys: list[str] = Field(default_factory=list)

    @field_validator("keys")
    @classmethod
    def _hashes_only(cls, keys: list[str]) -> list[str]:
        for k in keys:
            if not KEY_HASH.match(k):
                raise ValueError("keys must be hashes 'sha256:<64 hex digits>' (run `sparkv apikey`"
                                 " to make a key and its hash); plain keys are never stored")
        return keys


class Settings(BaseModel):
    """Everything the server needs. Field docs are the config file's reference (docs/server.md)."""

    model_config = ConfigDict(extra="forbid")

    store: str = DEFAULT_STORE
    """Chunk store URL: ``file:///path`` or ``redis://host:port/db``."""
    tenants: dict[str, TenantConfig] = Field(default_factory=dict)
    allow_anonymous: bool = False
    """Requests without a key act as tenant ``anonymous`` (only for loopback demos)."""
    models: dict[str, str | None] = Field(
        default_factory=lambda: dict[str, str | None]({DEFAULT_MODEL_NAME: None}))
    """Model name -> local checkpoint path (``null``: the bundled SmolLM2)."""
    default_model: str = DEFAULT_MODEL_NAME
    default_levels: list[str] = Field(default_factory=lambda: ["q8", "q6", "q5", "q4", "q3"])
    default_chunk_tokens: int = Field(256, ge=16, le=65536)
    max_context_tokens: int = Field(32768, ge=1)
    """Upper bound on a context's tokens (the model's own maximum applies as well)."""
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=1024)
    max_stream_items: int = Field(1 << 16, ge=1)
    """Items (frames) per stream request; beyond, 400 ``too_many_items``."""
    max_stream_bytes: int = Field(256 * 1024 * 1024, ge=4096)
    """Bytes one stream response may hold (its records: 4-byte prefixes and frames); beyond, 413
    ``response_too_large`` (items may repeat, so a small request could otherwise ask for
    gigabytes)."""
    max_stream_amplification: int = Field(65536, ge=1)
    """A stream response may hold at most this many bytes per byte of its request body (and
    always one frame, whatever the body): a small request cannot ask for a large response.
    An edge names a frame in at least 33 bytes, so keep it at least ``max_frame_bytes / 32``."""
    max_frame_bytes: int = Field(2 * 1024 * 1024, ge=4096)
    """The largest frame the server stores: ``POST /v1/contexts`` refuses (400
    ``frame_too_large``) a context whose largest chunk's raw frame would be larger, before
    anything is encoded."""
    max_streams_per_tenant: int = Field(8, ge=1, le=4096)
    """Stream responses one tenant may have in progress at once; beyond, 429
    ``too_many_streams`` with ``Retry-After``."""
    body_timeout_s: float = Field(DEFAULT_BODY_TIMEOUT_S, gt=0.0, le=3600.0)
    """A request body must arrive completely within this many seconds of the request's headers;
    otherwise 408 ``body_timeout`` and the connection is closed."""
    header_timeout_s: float = Field(DEFAULT_HEADER_TIMEOUT_S, gt=0.0, le=3600.0)
    """A request's headers must arrive completely within this many seconds of its first byte
    (of the connection, for its first request); otherwise the connection is closed (after a 408
    ``header_timeout`` when part of a request arrived). ``sparkv serve`` only (the HTTP layer)."""
    max_queued_jobs: int = Field(64, ge=1)
    encode_workers: int = Field(1, ge=1, le=16)
    encode_threads: int = Field(0, ge=0, le=64)
    """Threads each encode job codes its frames on (0: auto, the cores shared among
    ``encode_workers``, at most 8). The codec releases the GIL, so frames code in parallel."""
    torch_threads: int = Field(0, ge=0)
    """Threads PyTorch uses for prefill (0: its default, every core)."""
    device: str = "auto"
    """Where models prefill: ``cpu``, ``cuda[:N]`` or ``auto`` (the GPU when there is one). The
    codec and the stores always run on the CPU."""
    dtype: str = "auto"
    """Compute configuration: ``auto`` (bfloat16 on a GPU; on the CPU a bf16 configuration with
    AVX512-BF16/AMX where the model's quality table passes it, else float32: docs/dtypes.md),
    ``float32``, ``bfloat16``, ``float16``, or ``mixed``, ``int4``, ... (the manifest names it)."""
    encode_pause_s: float = Field(0.0, ge=0.0, le=10.0)
    """Sleep after each encoded frame, leaving CPU to serving (and making crash tests slow enough)."""
    resume_jobs: bool = True
    job_queue: str = "local"
    """Where encode jobs run: ``local`` (threads of this process) or ``redis`` (a shared Redis
    Streams queue consumed by ``sparkv worker`` processes; the store must then be ``redis://``),
    or a ``redis://`` URL of the queue's own Redis. See docs/cluster.md."""
    queue_claim_idle_s: float = Field(5.0, ge=0.5, le=3600.0)
    """With ``job_queue: redis``: a job whose worker sent no heartbeat for this long (the worker
    died) is claimed by another worker, which resumes it."""
    max_job_attempts: int = Field(3, ge=1)
    job_retention_s: float = Field(7 * 24 * 3600.0, ge=0.0)
    preload_models: bool = False
    manifest_cache_s: float = Field(5.0, ge=0.0)
    """How long a parsed manifest is reused before the store is read again."""
    stream_batch_bytes: int = Field(1 << 20, ge=4096)
    """The stream endpoint reads frames in batches of about this many bytes; a stream holds at
    most two batches (or one frame, when a frame is larger) at once."""
    gzip_min_bytes: int = Field(1024, ge=0)
    """JSON responses of at least this many bytes are gzip-compressed for clients that accept it
    (0: never compress). Frames, streams and token ids are never compressed."""
    log_level: str = "info"

    @field_validator("tenants")
    @classmethod
    def _tenant_names(cls, tenants: dict[str, TenantConfig]) -> dict[str, TenantConfig]:
        seen: dict[str, str] = {}
        for name, cfg in tenants.items():
            if not TENANT_NAME.match(name):
                raise ValueError(f"tenant name {name!r} must match {TENANT_NAME.pattern}")
            for h in cfg.keys:
                if h in seen:
                    raise ValueError(f"the same key hash is listed for tenants {seen[h]!r} and "
                                     f"{name!r}")
                seen[h] = name
        return tenants

    @field_validator("job_queue")
    @classmethod
    def _job_queue(cls, value: str) -> str:
        if value not in ("local", "redis") and not value.startswith(("redis://", "rediss://")):
            raise ValueError("job_queue must be 'local', 'redis' or a redis:// URL")
        return value

    @field_validator("default_levels")
    @classmethod
    def _levels(cls, levels: list[str]) -> list[str]:
        from sparkv.codec import LEVELS

        bad = [x for x in levels if x not in LEVELS]
        if bad or not levels:
            raise ValueError(f"unknown levels {bad}; known: {', '.join(LEVELS)}")
        return levels

    def check(self) -> "Settings":
        """Cross-field checks (raises :class:`ConfigError`)."""
        if self.default_model not in self.models:
            raise ConfigError(f"default_model {self.default_model!r} is not among models "
                              f"({', '.join(self.models) or 'none'})")
        if not self.models:
            raise ConfigError("no models configured")
        if self.job_queue == "redis" and not self.store.startswith(("redis://", "rediss://")):
            raise ConfigError("job_queue: redis uses the store's Redis, but the store is "
                              f"{self.store.split('://')[0]}://; use a redis:// store or give "
                              "job_queue a redis:// URL")
        return self

    def key_index(self) -> dict[str, str]:
        """``{key hash: tenant}``."""
        return {h: name for name, cfg in self.tenants.items() for h in cfg.keys}


def load_settings(path: str | os.PathLike[str] | None = None, **overrides: Any) -> Settings:
    """Reads a config file (YAML or JSON; ``None``: defaults) and applies ``overrides`` (keys whose
    value is ``None`` are ignored). Raises :class:`ConfigError` with the offending field."""
    data: dict[str, Any] = {}
    if path:
        from sparkv.extras import require

        yaml = require("yaml", feature="the server's config file")

        p = Path(path)
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"cannot read the config file {p}: {exc}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p} is not valid YAML: {exc}") from exc
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: the top level must be a mapping")
        data.update(loaded)
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return Settings(**data).check()
    except ValidationError as exc:
        where = f" in {path}" if path else ""
        msgs = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"invalid server configuration{where}: {msgs}") from None
