"""The FastAPI app: ``create_app(settings)``. Endpoints are documented in docs/rest-api.md.

Routes read their collaborators (store, jobs, models, metrics) from :class:`ServerState` through
FastAPI dependencies; the tenant comes from :class:`~sparkv.server.middleware.AuthMiddleware`.
Store calls are synchronous and run in the thread pool; encoding runs in the job manager's own
threads, so the event loop only moves bytes.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections import OrderedDict
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any, AsyncIterator

from anyio import to_thread
from fastapi import Depends, FastAPI, Header, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from sparkv.codec import DEFAULT_LEVEL
from sparkv.layout import ChunkGeometry
from sparkv.server import schemas
from sparkv.server.config import Settings
from sparkv.protocol import Manifest
from sparkv.protocol.stream import (FRAME_MEDIA_TYPE, STREAM_MEDIA_TYPE, record_header,
                                    stream_length)
from sparkv.protocol.digests import checksum, etag_of
from sparkv.server.encoder import ContextSpec, canonical_levels, derive_context_id
from sparkv.server.errors import ApiError, StoreError
from sparkv.server.http import if_range_allows, none_match, not_modified_etag, parse_range
from sparkv.server.jobs import JobManager, SubmitResult, public_view
from sparkv.server.metrics import ServerMetrics
from sparkv.server.middleware import (TENANT_SCOPE_KEY, AuthMiddleware, BodyLimitMiddleware,
                                      GZipMiddleware, MetricsMiddleware, error_body)
from sparkv.server.models import ModelRegistry
from sparkv.server.stores import ChunkKey, ChunkStore, open_store

log = logging.getLogger("sparkv.server")


def _version() -> str:
    try:
        from sparkv import __version__

        return __version__
    except ImportError:  # a stale editable install can expose sparkv as a namespace package
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("sparkv")
        except PackageNotFoundError:
            return "unknown"


__version__ = _version()

TOKENS_MEDIA_TYPE = "application/octet-stream"
IMMUTABLE = "max-age=31536000, immutable"
MANIFEST_CACHE_ENTRIES = 256

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"model": schemas.ErrorResponse, "description": "missing or invalid API key"},
    422: {"model": schemas.ErrorResponse, "description": "the request does not match the schema"},
}

_CID = "$response.body#/context_id"
CREATED_LINKS = {  # OpenAPI links: what a client (or a stateful fuzzer) does next
    "GetManifest": {"operationId": "get_manifest", "parameters": {"context_id": _CID}},
    "GetJob": {"operationId": "get_job", "parameters": {"job_id": "$response.body#/job_id"}},
    "GetFirstChunk": {"operationId": "get_chunk",
                      "parameters": {"context_id": _CID, "t": 0, "l": 0, "g": 0}},
    "StreamChunks": {"operationId": "stream_chunks", "parameters": {"context_id": _CID}},
    "GetTokens": {"operationId": "get_tokens", "parameters": {"context_id": _CID}},
    "DeleteContext": {"operationId": "delete_context", "parameters": {"context_id": _CID}},
}


# ------------------------------------------------------------------------------------------------
# State
# ------------------------------------------------------------------------------------------------
@dataclass
class ParsedManifest:
    """A stored manifest, validated (:class:`~sparkv.protocol.Manifest`), with its chunk index:
    ``(t, l, g, level) -> (bytes, etag)``."""

    raw: bytes
    etag: str
    manifest: Manifest
    index: dict[tuple[int, int, int, str], tuple[int, str]]

    @property
    def geometry(self) -> ChunkGeometry:
        return self.manifest.chunk_geometry

    @property
    def levels(self) -> tuple[str, ...]:
        return tuple(self.manifest.levels)

    @property
    def encrypted(self) -> bool:
        return self.manifest.encrypted

    @property
    def num_tokens(self) -> int:
        return self.manifest.num_tokens

    @property
    def tokens_sha256(self) -> str:
        """SHA-256 (hex) of the token ids as little-endian ``u32`` values: the tokens' ETag."""
        return self.manifest.tokens_sha256

    @classmethod
    def parse(cls, raw: bytes) -> "ParsedManifest":
        m = Manifest.parse(raw)
        index = {k: (e.bytes, etag_of(e.checksum)) for k, e in m.index.items()}
        return cls(raw, etag_of(checksum(raw)), m, index)

    def cache_control(self) -> str:
        # Ciphertext may sit in shared caches; plaintext only in the client's own.
        return ("public, " if self.encrypted else "private, ") + IMMUTABLE


@dataclass
class ServerState:
    """What the routes need; one per app."""

    settings: Settings
    store: ChunkStore
    registry: ModelRegistry
    jobs: JobManager
    metrics: ServerMetrics
    manifests: "OrderedDict[tuple[str, str], tuple[float, ParsedManifest]]" = field(
        default_factory=OrderedDict)

    async def manifest(self, tenant: str, context_id: str) -> ParsedManifest | None:
        """The context's parsed manifest (cached ``manifest_cache_s`` seconds), or ``None``."""
        key = (tenant, context_id)
        hit = self.manifests.get(key)
        now = time.monotonic()
        if hit is not None and hit[0] > now:
            return hit[1]
        raw = await to_thread.run_sync(self.store.get_manifest, tenant, context_id)
        if raw is None:
            self.manifests.pop(key, None)
            return None
        parsed = await to_thread.run_sync(ParsedManifest.parse, raw)
        if self.settings.manifest_cache_s > 0:
            self.manifests[key] = (now + self.settings.manifest_cache_s, parsed)
            self.manifests.move_to_end(key)
            while len(self.manifests) > MANIFEST_CACHE_ENTRIES:
                self.manifests.popitem(last=False)
        return parsed

    def forget(self, tenant: str, context_id: str) -> None:
        self.manifests.pop((tenant, context_id), None)


def get_state(request: Request) -> ServerState:
    return request.app.state.sparkv


def get_tenant(request: Request) -> str:
    tenant = request.scope.get(TENANT_SCOPE_KEY)
    if tenant is None:  # pragma: no cover - the middleware guarantees it under /v1/
        raise ApiError(401, "missing_api_key", "this endpoint needs an API key")
    return tenant


StateDep = Annotated[ServerState, Depends(get_state)]
TenantDep = Annotated[str, Depends(get_tenant)]
ContextIdPath = Annotated[str, Path(pattern=schemas.CONTEXT_ID_PATTERN,
                                    description="context id (32 hex digits)")]
JobIdPath = Annotated[str, Path(pattern=schemas.JOB_ID_PATTERN,
                                description="job id (32 hex digits)")]
IndexPath = Annotated[int, Path(ge=0, le=schemas.MAX_INDEX)]


async def require_manifest(state: ServerState, tenant: str, context_id: str) -> ParsedManifest:
    parsed = await state.manifest(tenant, context_id)
    if parsed is not None:
        return parsed
    job = await to_thread.run_sync(state.jobs.for_context, tenant, context_id)
    if job is not None and job.get("state") in ("queued", "running"):
        raise ApiError(404, "context_pending", f"context {context_id} is still being encoded",
                       job_id=job["job_id"], progress=public_view(job)["progress"])
    details: dict[str, Any] = {}
    if job is not None and job.get("state") in ("failed", "cancelled"):
        details = {"job_id": job["job_id"], "job_state": job["state"], "job_error": job["error"]}
    raise ApiError(404, "context_not_found", f"no context {context_id}", **details)


def chunk_entry(parsed: ParsedManifest, t: int, l: int, g: int, level: str  # noqa: E741
                ) -> tuple[int, str]:
    """``(size, etag)`` of one frame, or a 404 naming what is out of range."""
    geo = parsed.geometry
    for name, value, bound in (("t", t, geo.num_token_chunks), ("l", l, geo.num_layers),
                               ("g", g, geo.num_groups)):
        if not 0 <= value < bound:
            raise ApiError(404, "chunk_out_of_range",
                           f"{name}={value} is out of range: this context has {name} in "
                           f"[0, {bound})", coordinate=name, value=value, bound=bound)
    if level not in parsed.levels:
        raise ApiError(404, "level_not_available",
                       f"level {level!r} was not encoded for this context; it has "
                       f"{', '.join(parsed.levels)}", levels=list(parsed.levels))
    return parsed.index[(t, l, g, level)]


# ------------------------------------------------------------------------------------------------
# Stream response
# ------------------------------------------------------------------------------------------------
class StreamBroken(RuntimeError):
    """A frame named by the manifest could not be read while streaming."""


class FrameStream(StreamingResponse):
    """Length-prefixed frames read in batches (the next batch is read while this one is sent).

    Each record is ``u32 little-endian length | frame``. ``Content-Length`` is exact, so a
    client detects a cut stream. If the client closes early the response stops and is counted
    in ``sparkv_streams_aborted_total``.
    """

    def __init__(self, state: ServerState, tenant: str, context_id: str,
                 plan: list[tuple[ChunkKey, int]], headers: dict[str, str]) -> None:
        self.state = state
        self.tenant = tenant
        self.context_id = context_id
        self.plan = plan
        self.completed = False
        self._first: list[bytes | None] | None = None
        total = stream_length(size for _, size in plan)
        headers = {**headers, "Content-Length": str(total)}
        super().__init__(self._body(), media_type=STREAM_MEDIA_TYPE, headers=headers)

    def _batches(self) -> list[list[tuple[ChunkKey, int]]]:
        limit = self.state.settings.stream_batch_bytes
        out: list[list[tuple[ChunkKey, int]]] = [[]]
        size = 0
        for item in self.plan:
            if out[-1] and size + item[1] > limit:
                out.append([])
                size = 0
            out[-1].append(item)
            size += item[1]
        return out

    def _read(self, batch: list[tuple[ChunkKey, int]]) -> list[bytes | None]:
        return self.state.store.get_chunks(self.tenant, self.context_id, [k for k, _ in batch])

    async def prefetch(self) -> None:
        """Reads the first batch before the response starts, so that a store outage answers
        503 ``store_unavailable`` (a retryable status) instead of a cut stream."""
        self._first = await to_thread.run_sync(self._read, self._batches()[0])

    async def _body(self) -> AsyncIterator[bytes]:
        cid = self.context_id
        metrics = self.state.metrics
        read = self._read

        batches = self._batches()
        if self._first is not None:
            pending: asyncio.Future[list[bytes | None]] = asyncio.get_running_loop().create_future()
            pending.set_result(self._first)
            self._first = None
        else:
            pending = asyncio.ensure_future(to_thread.run_sync(read, batches[0]))
        try:
            for i, batch in enumerate(batches):
                frames = await pending
                if i + 1 < len(batches):
                    pending = asyncio.ensure_future(to_thread.run_sync(read, batches[i + 1]))
                parts: list[bytes] = []
                per_level: dict[str, int] = {}
                nbytes = 0
                for (key, size), data in zip(batch, frames):
                    if data is None or len(data) != size:
                        metrics.stream_errors.inc()
                        raise StreamBroken(f"frame {key.name()} of context {cid} is missing or "
                                           "has the wrong size in the store; stream cut")
                    parts.append(record_header(size))
                    parts.append(data)
                    per_level[key.level] = per_level.get(key.level, 0) + 1
                    nbytes += size
                yield b"".join(parts)
                for lv, n in per_level.items():
                    metrics.frames_served.labels("stream", lv).inc(n)
                metrics.frame_bytes.labels("stream").inc(nbytes)
            self.completed = True
        finally:
            if not pending.done():
                pending.cancel()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.completed:
                self.state.metrics.streams_aborted.inc()
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------------------
# App
# ------------------------------------------------------------------------------------------------
def _error(status: int, code: str, message: str, headers: dict[str, str] | None = None,
           **details: Any) -> JSONResponse:
    return JSONResponse(error_body(status, code, message, **details), status_code=status,
                        headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, list[dict[str, Any]]]:
    details = []
    for e in exc.errors():
        loc = ".".join(str(x) for x in e.get("loc", ()))
        details.append({"loc": loc, "msg": e.get("msg", ""), "type": e.get("type", "")})
    first = "; ".join(f"{d['loc']}: {d['msg']}" for d in details[:3])
    more = f" (and {len(details) - 3} more)" if len(details) > 3 else ""
    return f"invalid request: {first}{more}", details


def _status_code_name(status: int) -> str:
    return {400: "bad_request", 404: "not_found", 405: "method_not_allowed",
            413: "body_too_large", 415: "unsupported_media_type"}.get(status, f"http_{status}")


def create_app(settings: Settings, store: ChunkStore | None = None,
               registry: ModelRegistry | None = None) -> FastAPI:
    """The sparkv server app.

    Args:
        settings: see :class:`~sparkv.server.config.Settings`.
        store: a store to use instead of opening ``settings.store``.
        registry: a model registry to use instead of building one from ``settings.models``.
    """
    metrics = ServerMetrics()
    store = store or open_store(settings.store)
    registry = registry or ModelRegistry(settings.models, settings.max_context_tokens)
    jobs = JobManager(store, registry, settings, metrics)
    state = ServerState(settings, store, registry, jobs, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await to_thread.run_sync(jobs.start)
        if settings.preload_models:
            for name in registry.names():
                await to_thread.run_sync(registry.get, name)
        yield
        await to_thread.run_sync(jobs.shutdown, True)
        store.close()

    app = FastAPI(
        title="sparkv server", version=__version__, lifespan=lifespan,
        generate_unique_id_function=lambda route: route.name,  # operationId = function name
        description="Pre-encodes the KV cache of long contexts and serves its chunks. "
                    "See docs/rest-api.md.")
    app.state.sparkv = state

    # --- errors -------------------------------------------------------------------------------
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, details = _validation_message(exc)
        return _error(422, "invalid_request", message, details=details)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, _status_code_name(exc.status_code), str(exc.detail),
                      headers=getattr(exc, "headers", None))

    @app.exception_handler(StoreError)
    async def _store(request: Request, exc: StoreError) -> JSONResponse:
        metrics.store_errors.inc()
        log.error("store error: %s", exc)
        return _error(503, "store_unavailable", str(exc), headers={"Retry-After": "5"})

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return _error(500, "internal_error", f"internal error ({type(exc).__name__})")

    # --- public endpoints ---------------------------------------------------------------------
    @app.get("/healthz", response_model=schemas.Health, tags=["ops"],
             responses={503: {"model": schemas.Health}})
    async def healthz(state: StateDep) -> Any:
        body = {"status": "ok", "version": __version__, "store": state.store.url,
                "jobs_active": state.jobs.active_count()}
        try:
            await to_thread.run_sync(state.store.ping)
        except StoreError as exc:
            return JSONResponse({**body, "status": "unavailable", "error": str(exc)},
                                status_code=503)
        return body

    @app.get("/metrics", tags=["ops"], response_class=Response,
             responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text"}})
    async def prometheus(state: StateDep) -> Response:
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    # --- /v1 ----------------------------------------------------------------------------------
    @app.get("/v1/models", response_model=schemas.ModelList, tags=["models"],
             responses=ERROR_RESPONSES)
    async def list_models(state: StateDep, tenant: TenantDep) -> Any:
        return {"models": [{"name": n, "default": n == state.settings.default_model,
                            "loaded": state.registry.is_loaded(n)}
                           for n in state.registry.names()]}

    @app.post("/v1/contexts", status_code=202, response_model=schemas.ContextCreated,
              tags=["contexts"],
              responses={**ERROR_RESPONSES,
                         202: {"links": CREATED_LINKS},
                         200: {"model": schemas.ContextCreated, "links": CREATED_LINKS,
                               "description": "already encoded (nothing queued)"},
                         400: {"model": schemas.ErrorResponse}, 409: {"model": schemas.ErrorResponse},
                         413: {"model": schemas.ErrorResponse}, 503: {"model": schemas.ErrorResponse}})
    async def create_context(body: schemas.CreateContext, state: StateDep,
                             tenant: TenantDep) -> Any:
        result, spec, cid, num_chunks = await to_thread.run_sync(
            _submit, state, tenant, body)
        rec = result.job
        job_id = rec["job_id"] if rec else None
        out = {
            "context_id": cid, "job_id": job_id, "status": result.status,
            "model": spec.model, "num_tokens": spec.num_tokens, "num_chunks": num_chunks,
            "levels": list(spec.levels), "chunk_tokens": spec.chunk_tokens,
            "encrypted": spec.encrypted, "encryption_key": None,
            "manifest_url": f"/v1/contexts/{cid}",
            "job_url": f"/v1/jobs/{job_id}" if job_id else None,
        }
        if result.key is not None:
            from sparkv.protocol.crypto import key_to_text

            out["encryption_key"] = key_to_text(result.key)
        status = 200 if result.status == "done" else 202
        headers = {"Location": out["manifest_url"], "Cache-Control": "no-store"}
        return JSONResponse(out, status_code=status, headers=headers)

    @app.get("/v1/contexts", response_model=schemas.ContextList, tags=["contexts"],
             responses=ERROR_RESPONSES)
    async def list_contexts(state: StateDep, tenant: TenantDep) -> Any:
        ids = await to_thread.run_sync(state.store.list_contexts, tenant)
        pending = [{"context_id": j["context_id"], "job_id": j["job_id"], "state": j["state"]}
                   for j in state.jobs.active_jobs(tenant)]
        return {"contexts": ids, "pending": pending}

    @app.get("/v1/jobs/{job_id}", response_model=schemas.JobInfo, tags=["jobs"],
             responses={**ERROR_RESPONSES, 404: {"model": schemas.ErrorResponse}})
    async def get_job(job_id: JobIdPath, state: StateDep, tenant: TenantDep) -> Any:
        rec = await to_thread.run_sync(state.jobs.get, tenant, job_id)
        if rec is None:
            raise ApiError(404, "job_not_found", f"no job {job_id}")
        return JSONResponse(public_view(rec), headers={"Cache-Control": "no-store"})

    @app.get("/v1/contexts/{context_id}", tags=["contexts"], response_class=Response,
             responses={**ERROR_RESPONSES, 200: {"model": schemas.Manifest},
                        304: {"description": "not modified"},
                        404: {"model": schemas.ErrorResponse}})
    async def get_manifest(context_id: ContextIdPath, state: StateDep, tenant: TenantDep,
                           if_none_match: Annotated[str | None, Header()] = None) -> Response:
        parsed = await require_manifest(state, tenant, context_id)
        headers = {"ETag": parsed.etag, "Cache-Control": "private, no-cache"}
        if state.settings.gzip_min_bytes > 0:
            headers["Vary"] = "Accept-Encoding"
        # The ETag is strong (the manifest's bytes); GZipMiddleware weakens it on a compressed
        # 200, and a 304 echoes the form the client holds.
        tag = not_modified_etag(if_none_match, parsed.etag)
        if tag is not None:
            return Response(status_code=304, headers={**headers, "ETag": tag})
        return Response(parsed.raw, media_type="application/json", headers=headers)

    @app.get("/v1/contexts/{context_id}/tokens", tags=["contexts"], response_class=Response,
             responses={**ERROR_RESPONSES,
                        200: {"content": {TOKENS_MEDIA_TYPE: {"schema": {
                            "type": "string", "format": "binary"}}},
                              "description": "the token ids, little-endian u32 each"},
                        304: {"description": "not modified"},
                        404: {"model": schemas.ErrorResponse}})
    async def get_tokens(context_id: ContextIdPath, state: StateDep, tenant: TenantDep,
                         if_none_match: Annotated[str | None, Header()] = None) -> Response:
        parsed = await require_manifest(state, tenant, context_id)
        found = await to_thread.run_sync(_read_tokens, state.store, tenant, context_id)
        if found is None:
            state.forget(tenant, context_id)
            await require_manifest(state, tenant, context_id)  # 404 if it was deleted meanwhile
            raise ApiError(404, "tokens_not_available",
                           f"context {context_id} was encoded before the server kept token ids; "
                           "send the request that created it (POST /v1/contexts) again: nothing "
                           "is encoded again, only its token ids are stored")
        data, digest = found
        if (parsed.tokens_sha256 and digest != parsed.tokens_sha256) or \
                len(data) != 4 * parsed.num_tokens:
            log.error("the stored token ids of context %s do not match its manifest (sha256 "
                      "%s, %d bytes; the manifest says %s, %d tokens)", context_id, digest,
                      len(data), parsed.tokens_sha256, parsed.num_tokens)
            raise ApiError(500, "tokens_corrupt", f"the stored token ids of context {context_id} "
                           "do not match its manifest's tokens_sha256")
        headers = {"ETag": f'"{digest}"', "Cache-Control": "private, " + IMMUTABLE,
                   "X-Sparkv-Tokens-Sha256": digest, "X-Sparkv-Num-Tokens": str(len(data) // 4)}
        if none_match(if_none_match, headers["ETag"]):
            state.metrics.not_modified.inc()
            return Response(status_code=304, headers=headers)
        return Response(data, media_type=TOKENS_MEDIA_TYPE, headers=headers)

    @app.delete("/v1/contexts/{context_id}", status_code=204, tags=["contexts"],
                response_class=Response,
                responses={**ERROR_RESPONSES, 404: {"model": schemas.ErrorResponse}})
    async def delete_context(context_id: ContextIdPath, state: StateDep,
                             tenant: TenantDep) -> Response:
        existed = await to_thread.run_sync(state.jobs.delete_context, tenant, context_id)
        state.forget(tenant, context_id)
        if not existed:
            raise ApiError(404, "context_not_found", f"no context {context_id}")
        return Response(status_code=204)

    @app.get("/v1/contexts/{context_id}/chunks/{t}/{l}/{g}", tags=["chunks"],
             response_class=Response,
             responses={**ERROR_RESPONSES,
                        200: {"content": {FRAME_MEDIA_TYPE: {"schema": {
                            "type": "string", "format": "binary"}}},
                              "description": "the frame (or ciphertext)"},
                        206: {"description": "a byte range of the frame"},
                        304: {"description": "not modified"},
                        404: {"model": schemas.ErrorResponse},
                        416: {"model": schemas.ErrorResponse}})
    async def get_chunk(context_id: ContextIdPath, t: IndexPath, l: IndexPath,  # noqa: E741
                        g: IndexPath, state: StateDep, tenant: TenantDep,
                        level: Annotated[schemas.LevelName, Query()] = DEFAULT_LEVEL,  # type: ignore[valid-type]
                        if_none_match: Annotated[str | None, Header()] = None,
                        range: Annotated[str | None, Header()] = None,  # noqa: A002
                        if_range: Annotated[str | None, Header()] = None) -> Response:
        parsed = await require_manifest(state, tenant, context_id)
        size, etag = chunk_entry(parsed, t, l, g, level)
        headers = {"ETag": etag, "Cache-Control": parsed.cache_control(),
                   "Accept-Ranges": "bytes"}
        if none_match(if_none_match, etag):
            state.metrics.not_modified.inc()
            return Response(status_code=304, headers=headers)
        key = ChunkKey(t, l, g, level)
        span = parse_range(range, size) if if_range_allows(if_range, etag) else None
        if span is not None:
            start, end = span
            data = await to_thread.run_sync(state.store.get_chunk_range, tenant, context_id, key,
                                            start, end)
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        else:
            data = await to_thread.run_sync(state.store.get_chunk, tenant, context_id, key)
            status = 200
        if data is None:
            state.forget(tenant, context_id)  # deleted meanwhile
            raise ApiError(404, "context_not_found", f"no context {context_id}")
        state.metrics.frames_served.labels("get", level).inc()
        state.metrics.frame_bytes.labels("get").inc(len(data))
        return Response(data, status_code=status, media_type=FRAME_MEDIA_TYPE, headers=headers)

    @app.post("/v1/contexts/{context_id}/stream", tags=["chunks"], response_class=Response,
              responses={**ERROR_RESPONSES,
                         200: {"content": {STREAM_MEDIA_TYPE: {"schema": {
                             "type": "string", "format": "binary"}}},
                               "description": "u32 little-endian length | frame, per item, in "
                                              "the requested order"},
                         400: {"model": schemas.ErrorResponse},
                         404: {"model": schemas.ErrorResponse},
                         413: {"model": schemas.ErrorResponse}})
    async def stream_chunks(context_id: ContextIdPath, body: schemas.StreamRequest,
                            state: StateDep, tenant: TenantDep) -> Response:
        if len(body.chunks) > state.settings.max_stream_items:
            raise ApiError(400, "too_many_items", f"{len(body.chunks)} items; at most "
                           f"{state.settings.max_stream_items} per stream request")
        parsed = await require_manifest(state, tenant, context_id)
        plan: list[tuple[ChunkKey, int]] = []
        for i, item in enumerate(body.chunks):
            lv = item.level or body.level
            try:
                size, _ = chunk_entry(parsed, item.t, item.l, item.g, lv)
            except ApiError as exc:
                raise ApiError(400, exc.code, f"chunks[{i}]: {exc.message}", index=i,
                               **exc.details) from None
            plan.append((ChunkKey(item.t, item.l, item.g, lv), size))
        headers = {"Cache-Control": "no-store", "X-Sparkv-Frames": str(len(plan))}
        if parsed.encrypted:
            headers["X-Sparkv-Encrypted"] = "1"
        stream = FrameStream(state, tenant, context_id, plan, headers)
        await stream.prefetch()
        return stream

    _add_security_schemes(app)
    _install(app, settings, metrics)
    return app


def _install(app: FastAPI, settings: Settings, metrics: ServerMetrics) -> None:
    """Adds the middleware, outermost first: metrics (which counts the bytes sent, compressed),
    gzip (JSON only), body limit, authentication."""
    index = settings.key_index()
    app.add_middleware(AuthMiddleware, key_index=lambda: index,  # type: ignore[arg-type]
                       allow_anonymous=lambda: settings.allow_anonymous, metrics=metrics)
    app.add_middleware(BodyLimitMiddleware, limit=settings.max_body_bytes)  # type: ignore[arg-type]
    app.add_middleware(GZipMiddleware,  # type: ignore[arg-type]
                       minimum_size=settings.gzip_min_bytes)
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # type: ignore[arg-type]


def _add_security_schemes(app: FastAPI) -> None:
    """Documents the API-key schemes in OpenAPI (the check itself is AuthMiddleware's)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, description=app.description,
                             routes=app.routes)
        schema.setdefault("components", {})["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer",
                       "description": "Authorization: Bearer <api key>"},
            "apiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key"},
        }
        for path, ops in schema.get("paths", {}).items():
            if path.startswith("/v1/"):
                for op in ops.values():
                    op["security"] = [{"bearer": []}, {"apiKey": []}]
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _read_tokens(store: ChunkStore, tenant: str, context_id: str) -> tuple[bytes, str] | None:
    """The stored token ids and their SHA-256 (hex), or ``None`` (runs in the thread pool)."""
    data = store.get_tokens(tenant, context_id)
    return None if data is None else (data, hashlib.sha256(data).hexdigest())


def _submit(state: ServerState, tenant: str, body: schemas.CreateContext
            ) -> tuple[SubmitResult, ContextSpec, str, int]:
    """Resolves the model, tokenizes, validates and submits (runs in the thread pool)."""
    s = state.settings
    entry = state.registry.get(body.model or s.default_model)
    if body.text is not None:
        if entry.lm.tokenizer is None:
            raise ApiError(400, "no_tokenizer", f"model {entry.name!r} has no tokenizer: send "
                           "token_ids instead of text")
        ids = entry.lm.encode_text(body.text)
        if not ids:
            raise ApiError(400, "empty_context", "the text tokenizes to no tokens")
    else:
        ids = list(body.token_ids or [])
        bad = next((i for i, x in enumerate(ids) if not 0 <= x < entry.vocab_size), None)
        if bad is not None:
            raise ApiError(400, "token_out_of_range",
                           f"token_ids[{bad}] = {ids[bad]} is not in [0, {entry.vocab_size}) "
                           f"(the vocabulary of {entry.name!r})", index=bad)
    if len(ids) > entry.max_tokens:
        raise ApiError(400, "context_too_long",
                       f"the context has {len(ids)} tokens; model {entry.name!r} on this server "
                       f"accepts at most {entry.max_tokens}", num_tokens=len(ids),
                       max_tokens=entry.max_tokens)
    try:
        levels = canonical_levels(body.levels or s.default_levels)
    except ValueError as exc:  # pragma: no cover - the schema already restricts names
        raise ApiError(400, "unknown_level", str(exc)) from None
    chunk_tokens = body.chunk_tokens or s.default_chunk_tokens
    try:
        geometry = ChunkGeometry.from_config(entry.lm.config, len(ids), chunk_tokens,
                                             body.heads_per_group)
    except ValueError as exc:
        raise ApiError(400, "bad_geometry", str(exc)) from None
    spec = ContextSpec(tenant, entry.name, tuple(ids), chunk_tokens, levels,
                       body.heads_per_group, body.encrypt)
    cid = derive_context_id(spec, entry.fingerprint, entry.tokenizer_id)
    result = state.jobs.submit(spec, cid, geometry.num_chunks * len(levels))
    return result, spec, cid, geometry.num_chunks
