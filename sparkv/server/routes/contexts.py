"""Contexts: ``POST /v1/contexts`` (encode in the background), ``GET /v1/contexts`` (list),
``GET /v1/contexts/{id}`` (the manifest), ``GET /v1/contexts/{id}/tokens`` (the token ids) and
``DELETE /v1/contexts/{id}``."""

from __future__ import annotations

import hashlib
import logging
from typing import Annotated, Any

from anyio import to_thread
from fastapi import APIRouter, Header
from fastapi.responses import JSONResponse, Response

from sparkv.layout import ChunkGeometry
from sparkv.protocol.crypto import key_to_text
from sparkv.protocol.errors import ManifestError
from sparkv.server import schemas
from sparkv.server.deps import ContextIdPath, StateDep, TenantDep, require_manifest
from sparkv.server.encoder import (ContextSpec, canonical_levels, derive_context_id,
                                   frame_cap_error)
from sparkv.server.errors import ApiError
from sparkv.server.http import none_match, not_modified_etag
from sparkv.server.jobs import SubmitResult
from sparkv.server.openapi import CREATED_LINKS, error_responses, operation_id
from sparkv.server.state import IMMUTABLE, ServerState
from sparkv.server.stores import ChunkStore

log = logging.getLogger("sparkv.server")

TOKENS_MEDIA_TYPE = "application/octet-stream"
#: the header that repeats ``quality_warning`` (a press that fails the model's quality table)
QUALITY_WARNING_HEADER = "X-Sparkv-Quality-Warning"

router = APIRouter(tags=["contexts"], generate_unique_id_function=operation_id)


@router.post("/v1/contexts", status_code=202, response_model=schemas.ContextCreated,
             responses={**error_responses(400, 409, 413, 503),
                        202: {"links": CREATED_LINKS},
                        200: {"model": schemas.ContextCreated, "links": CREATED_LINKS,
                              "description": "already encoded (nothing queued)"}})
async def create_context(body: schemas.CreateContext, state: StateDep,
                         tenant: TenantDep) -> JSONResponse:
    """Queues an encode job (202), or answers 200 when the context is already encoded."""
    result, spec, cid, num_chunks, warning = await to_thread.run_sync(submit_context, state,
                                                                      tenant, body)
    rec = result.job
    job_id = rec["job_id"] if rec else None
    name = spec.name
    if result.status == "done":           # named when it was first created
        parsed = await state.manifest(tenant, cid)
        name = parsed.manifest.name if parsed is not None else name
    elif rec is not None:                 # a job already under way keeps its own name
        name = rec.get("spec", {}).get("name") or name
    out = {
        "context_id": cid, "name": name, "job_id": job_id, "status": result.status,
        "model": spec.model, "num_tokens": spec.num_tokens, "num_chunks": num_chunks,
        "levels": list(spec.levels), "chunk_tokens": spec.chunk_tokens,
        "encrypted": spec.encrypted, "press": spec.press, "quality_warning": warning,
        "encryption_key": None,
        "manifest_url": f"/v1/contexts/{cid}",
        "job_url": f"/v1/jobs/{job_id}" if job_id else None,
    }
    if result.key is not None:
        out["encryption_key"] = key_to_text(result.key)
    status = 200 if result.status == "done" else 202
    headers = {"Location": f"/v1/contexts/{cid}", "Cache-Control": "no-store"}
    if warning is not None:
        headers[QUALITY_WARNING_HEADER] = warning
    return JSONResponse(out, status_code=status, headers=headers)


@router.get("/v1/contexts", response_model=schemas.ContextList, responses=error_responses())
async def list_contexts(state: StateDep, tenant: TenantDep) -> Any:
    """The tenant's complete contexts (id, name, token count, ... from each manifest, sorted by
    id), and those with a queued or running job."""
    ids = await to_thread.run_sync(state.store.manifests.contexts, tenant)
    contexts = [await context_summary(state, tenant, cid) for cid in ids]
    pending = [{"context_id": j["context_id"], "job_id": j["job_id"], "state": j["state"]}
               for j in state.jobs.active_jobs(tenant)]
    return {"contexts": [c for c in contexts if c is not None], "pending": pending}


async def context_summary(state: ServerState, tenant: str, context_id: str
                          ) -> dict[str, Any] | None:
    """What ``GET /v1/contexts`` lists of one context: its manifest's id, name, token count,
    model, levels, press, encryption and creation time; only the id when the stored manifest
    cannot be read (logged); ``None`` when it was deleted meanwhile."""
    try:
        parsed = await state.manifest(tenant, context_id)
    except ManifestError as e:
        log.error("context %s of tenant %s: its stored manifest is unreadable (%s)", context_id,
                  tenant, e)
        return {"context_id": context_id, "name": None, "num_tokens": None, "model": None,
                "levels": None, "press": None, "encrypted": None, "created_unix": None}
    if parsed is None:
        return None
    m = parsed.manifest
    return {"context_id": context_id, "name": m.name, "num_tokens": m.num_tokens,
            "model": m.model.name, "levels": list(m.levels),
            "press": m.press.spec if m.press is not None else None,
            "encrypted": m.encrypted, "created_unix": m.created_unix}


@router.get("/v1/contexts/{context_id}", response_class=Response,
            responses={**error_responses(404), 200: {"model": schemas.Manifest},
                       304: {"description": "not modified"}})
async def get_manifest(context_id: ContextIdPath, state: StateDep, tenant: TenantDep,
                       if_none_match: Annotated[str | None, Header()] = None) -> Response:
    """The manifest (ETag, ``If-None-Match`` -> 304)."""
    parsed = await require_manifest(state, tenant, context_id)
    headers = {"ETag": parsed.etag, "Cache-Control": "private, no-cache"}
    if state.settings.gzip_min_bytes > 0:
        headers["Vary"] = "Accept-Encoding"
    # The ETag is strong (the manifest's bytes); GZipMiddleware weakens it on a compressed
    # 200, and a 304 echoes the form the client holds.
    tag = not_modified_etag(if_none_match, parsed.etag)
    if tag is not None:
        state.metrics.not_modified.inc()
        return Response(status_code=304, headers={**headers, "ETag": tag})
    return Response(parsed.raw, media_type="application/json", headers=headers)


@router.get("/v1/contexts/{context_id}/tokens", response_class=Response,
            responses={**error_responses(404),
                       200: {"content": {TOKENS_MEDIA_TYPE: {"schema": {
                           "type": "string", "format": "binary"}}},
                             "description": "the token ids, little-endian u32 each"},
                       304: {"description": "not modified"}})
async def get_tokens(context_id: ContextIdPath, state: StateDep, tenant: TenantDep,
                     if_none_match: Annotated[str | None, Header()] = None) -> Response:
    """The context's token ids, checked against the manifest's ``tokens_sha256``."""
    parsed = await require_manifest(state, tenant, context_id)
    found = await to_thread.run_sync(read_tokens, state.store.chunks, tenant, context_id)
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


@router.delete("/v1/contexts/{context_id}", status_code=204, response_class=Response,
               responses=error_responses(404))
async def delete_context(context_id: ContextIdPath, state: StateDep,
                         tenant: TenantDep) -> Response:
    """Deletes the context (cancelling its job): 204, or 404 when nothing existed."""
    existed = await to_thread.run_sync(state.jobs.delete_context, tenant, context_id)
    state.forget(tenant, context_id)
    if not existed:
        raise ApiError(404, "context_not_found", f"no context {context_id}")
    return Response(status_code=204)


# ------------------------------------------------------------------------------------------------
# helpers (run in the thread pool)
# ------------------------------------------------------------------------------------------------
def read_tokens(chunks: ChunkStore, tenant: str, context_id: str) -> tuple[bytes, str] | None:
    """The stored token ids and their SHA-256 (hex), or ``None``."""
    data = chunks.get_tokens(tenant, context_id)
    return None if data is None else (data, hashlib.sha256(data).hexdigest())


def submit_context(state: ServerState, tenant: str, body: schemas.CreateContext
                   ) -> tuple[SubmitResult, ContextSpec, str, int, str | None]:
    """Resolves the model, tokenizes, validates and submits: ``(result, spec, context id,
    number of (t, l, g) chunks, quality warning)``; the warning (:func:`press_quality_warning`)
    is ``None`` unless the press fails the model's quality table."""
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
    too_large = frame_cap_error(geometry, entry.lm.dtype.itemsize, body.encrypt,
                                s.max_frame_bytes)
    if too_large is not None:
        raise ApiError(400, "frame_too_large", too_large[0], limit=s.max_frame_bytes,
                       bytes=too_large[1])
    if body.press and len(ids) < 2:
        raise ApiError(400, "context_too_short", "a press needs a context of at least 2 tokens")
    spec = ContextSpec(tenant, entry.name, tuple(ids), chunk_tokens, levels,
                       body.heads_per_group, body.encrypt, body.press, body.name)
    cid = derive_context_id(spec, entry.fingerprint, entry.tokenizer_id)
    result = state.jobs.submit(spec, cid, geometry.num_chunks * len(levels))
    return result, spec, cid, geometry.num_chunks, press_quality_warning(entry.fingerprint,
                                                                         body.press)


def press_quality_warning(model_fingerprint: str, press: str | None) -> str | None:
    """A press whose verdict in the model's quality table is ``fail`` is accepted with this
    warning (the client decides; docs/quality.md, "Presses"); ``None`` for no press, a press that
    passes or is undecided, or no row (as before)."""
    if not press:
        return None
    from sparkv.predictor.quality import press_warning

    warning = press_warning(model_fingerprint, press)
    if warning is not None:
        log.warning("%s", warning)
    return warning
