"""Frames: ``GET /v1/contexts/{id}/chunks/{t}/{l}/{g}`` (one frame: ETag, 304, Range; its size
and checksum verified before it is sent) and ``POST /v1/contexts/{id}/stream`` (many frames in
one response, under the per-request size and per-tenant concurrency limits)."""

from __future__ import annotations

from typing import Annotated

from anyio import to_thread
from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import Response

from sparkv.codec import DEFAULT_LEVEL
from sparkv.protocol.stream import FRAME_MEDIA_TYPE, STREAM_MEDIA_TYPE
from sparkv.server import schemas
from sparkv.server.deps import (ContextIdPath, IndexPath, ParsedManifest, ServerState, StateDep,
                                TenantDep, chunk_entry, require_manifest)
from sparkv.server.errors import ApiError
from sparkv.server.frames import FrameCorrupt, corrupt_frame_error, read_verified_frame
from sparkv.server.http import if_range_allows, none_match, parse_range
from sparkv.server.openapi import STREAM_REQUEST_BODY, error_responses, operation_id
from sparkv.server.stores import ChunkKey
from sparkv.server.stream_request import (Item, ResponseCap, StreamPlan, build_plan,
                                          parse_stream_request)
from sparkv.server.streaming import FrameStream

router = APIRouter(tags=["chunks"], generate_unique_id_function=operation_id)


@router.get("/v1/contexts/{context_id}/chunks/{t}/{l}/{g}", response_class=Response,
            responses={**error_responses(404, 416, 503),
                       200: {"content": {FRAME_MEDIA_TYPE: {"schema": {
                           "type": "string", "format": "binary"}}},
                             "description": "the frame (or ciphertext)"},
                       206: {"description": "a byte range of the frame"},
                       304: {"description": "not modified"}})
async def get_chunk(context_id: ContextIdPath, t: IndexPath, l: IndexPath,  # noqa: E741
                    g: IndexPath, state: StateDep, tenant: TenantDep,
                    level: Annotated[schemas.LevelName, Query()] = DEFAULT_LEVEL,
                    if_none_match: Annotated[str | None, Header()] = None,
                    range: Annotated[str | None, Header()] = None,  # noqa: A002
                    if_range: Annotated[str | None, Header()] = None) -> Response:
    """One frame. The stored bytes are checked against the manifest's size and checksum before
    anything is sent (a range too: the whole frame is checked first); a damaged frame is 503
    ``frame_corrupt``, never a 200 or 206 under the manifest's ETag; so is a frame missing from
    the store or unreadable there while the context's manifest exists (404 once it is gone)."""
    parsed = await require_manifest(state, tenant, context_id)
    entry = chunk_entry(parsed, t, l, g, level)
    headers = {"ETag": entry.etag, "Cache-Control": parsed.cache_control(),
               "Accept-Ranges": "bytes"}
    if none_match(if_none_match, entry.etag):
        state.metrics.not_modified.inc()
        return Response(status_code=304, headers=headers)
    span = parse_range(range, entry.size) if if_range_allows(if_range, entry.etag) else None
    key = ChunkKey(t, l, g, level)
    try:
        data = await to_thread.run_sync(read_verified_frame, state.store.chunks, tenant,
                                        context_id, key, entry)
    except FrameCorrupt as exc:
        raise await corrupt_frame_error(state, "get", tenant, context_id, exc) from None
    status = 200
    if span is not None:
        start, end = span
        data = data[start:end]
        status = 206
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{entry.size}"
    state.metrics.frames_served.labels("get", level).inc()
    state.metrics.frame_bytes.labels("get").inc(len(data))
    return Response(data, status_code=status, media_type=FRAME_MEDIA_TYPE, headers=headers)


@router.post("/v1/contexts/{context_id}/stream", response_class=Response,
             openapi_extra=STREAM_REQUEST_BODY,
             responses={**error_responses(400, 404, 413, 429, 503),
                        200: {"content": {STREAM_MEDIA_TYPE: {"schema": {
                            "type": "string", "format": "binary"}}},
                              "description": "u32 little-endian length | frame, per item, in "
                                             "the requested order"}})
async def stream_chunks(context_id: ContextIdPath, request: Request, state: StateDep,
                        tenant: TenantDep) -> Response:
    """Many frames in one response, in the requested order (body: ``StreamRequest``).

    The tenant's stream slot is taken first (429 ``too_many_streams`` over
    ``max_streams_per_tenant``); the body is parsed, validated and planned in a worker thread
    (400/422, 404, 413 ``response_too_large`` over ``max_stream_bytes`` or
    ``max_stream_amplification`` times the body); the first batch is read before the response
    starts (503 ``store_unavailable``, 503 ``frame_corrupt``).
    """
    slot = state.streams.acquire(tenant)
    try:
        body = await request.body()
        items = await to_thread.run_sync(parse_stream_request, body,
                                         request.headers.get("content-type"),
                                         state.settings.max_stream_items)
        parsed = await require_manifest(state, tenant, context_id)
        plan = await _plan(state, parsed, items, len(body))
        del items
        headers = {"Cache-Control": "no-store", "X-Sparkv-Frames": str(plan.num_frames)}
        if parsed.encrypted:
            headers["X-Sparkv-Encrypted"] = "1"
        stream = FrameStream(state, tenant, context_id, plan, headers, slot)
        try:
            await stream.prefetch()
        except FrameCorrupt as exc:
            stream.discard()
            raise await corrupt_frame_error(state, "stream", tenant, context_id, exc) from None
        except BaseException:
            stream.discard()
            raise
        return stream
    except BaseException:
        slot.release()
        raise


async def _plan(state: ServerState, parsed: ParsedManifest, items: list[Item],
                body_bytes: int) -> StreamPlan:
    """The stream's plan (in a worker thread); a refusal for its size is counted."""
    settings = state.settings
    cap = ResponseCap(settings.max_stream_bytes, settings.max_stream_amplification)
    try:
        return await to_thread.run_sync(build_plan, parsed, items, cap, body_bytes,
                                        settings.stream_batch_bytes)
    except ApiError as exc:
        if exc.code == "response_too_large":
            state.metrics.streams_refused.labels("response_too_large").inc()
        raise
