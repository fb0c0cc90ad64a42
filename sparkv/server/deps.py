"""FastAPI dependencies of the routes: the app's :class:`~sparkv.server.state.ServerState`, the
request's tenant, validated path parameters, and the lookups every context route shares
(:func:`require_manifest`, :func:`chunk_entry`)."""

from __future__ import annotations

from typing import Annotated, Any

from sparkv.extras import SERVER_MODULES, require_all

require_all(SERVER_MODULES, feature="the REST server (sparkv.server.deps)")

from anyio import to_thread
from fastapi import Depends, Path, Request

from sparkv.server import schemas
from sparkv.server.errors import ApiError
from sparkv.server.jobs import public_view
from sparkv.server.middleware import TENANT_SCOPE_KEY
from sparkv.server.state import FrameEntry, ParsedManifest, ServerState

__all__ = ["get_state", "get_tenant", "StateDep", "TenantDep", "ContextIdPath", "JobIdPath",
           "IndexPath", "require_manifest", "chunk_entry", "ServerState", "ParsedManifest",
           "FrameEntry"]


def get_state(request: Request) -> ServerState:
    """The app's state (``app.state.sparkv``)."""
    return request.app.state.sparkv


def get_tenant(request: Request) -> str:
    """The tenant :class:`~sparkv.server.middleware.AuthMiddleware` put in the scope."""
    tenant = request.scope.get(TENANT_SCOPE_KEY)
    if tenant is None:  # pragma: no cover - the middleware guarantees it under /v1/
        raise ApiError(401, "missing_api_key", "this endpoint needs an API key")
    return str(tenant)


StateDep = Annotated[ServerState, Depends(get_state)]
TenantDep = Annotated[str, Depends(get_tenant)]
ContextIdPath = Annotated[str, Path(pattern=schemas.CONTEXT_ID_PATTERN,
                                    description="context id (32 hex digits)")]
JobIdPath = Annotated[str, Path(pattern=schemas.JOB_ID_PATTERN,
                                description="job id (32 hex digits)")]
IndexPath = Annotated[schemas.PathIndex, Path(
    description="0-based index in [0, 2^31), plain decimal (0 or [1-9][0-9]*)")]


async def require_manifest(state: ServerState, tenant: str, context_id: str) -> ParsedManifest:
    """The context's manifest, or the 404 that says why there is none: ``context_pending``
    (with the job and its progress) while it is encoded, else ``context_not_found`` (with the
    last job's outcome when it failed or was cancelled). A job that finished between the two
    reads published the manifest before it said ``done``: it is read again then, so a
    context never reads as not found on its way from pending to complete."""
    parsed = await state.manifest(tenant, context_id)
    if parsed is not None:
        return parsed
    job = await to_thread.run_sync(state.jobs.for_context, tenant, context_id)
    if job is not None and job.get("state") == "done":
        parsed = await state.manifest(tenant, context_id)
        if parsed is not None:
            return parsed
    if job is not None and job.get("state") in ("queued", "running"):
        raise ApiError(404, "context_pending", f"context {context_id} is still being encoded",
                       job_id=job["job_id"], progress=public_view(job)["progress"])
    details: dict[str, Any] = {}
    if job is not None and job.get("state") in ("failed", "cancelled", "lost"):
        details = {"job_id": job["job_id"], "job_state": job["state"], "job_error": job["error"]}
    raise ApiError(404, "context_not_found", f"no context {context_id}", **details)


def chunk_entry(parsed: ParsedManifest, t: int, l: int, g: int,  # noqa: E741
                level: str) -> FrameEntry:
    """The manifest's entry of one frame, or a 404 naming what is out of range
    (``chunk_out_of_range`` with the coordinate and its bound, ``level_not_available``)."""
    entry = parsed.index.get((t, l, g, level))
    if entry is not None:
        return entry
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
    raise KeyError(f"the manifest of context {parsed.manifest.context_id} has no entry for "
                   f"{(t, l, g, level)} although it is in range")  # a bug: a 500
