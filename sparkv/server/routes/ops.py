"""Operations: ``GET /healthz`` (no key), ``GET /metrics`` (no key) and ``GET /v1/models``."""

from __future__ import annotations

import logging
from typing import Any

from anyio import to_thread
from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from sparkv.server import schemas
from sparkv.server.deps import StateDep, TenantDep
from sparkv.server.errors import StoreError
from sparkv.server.openapi import ERROR_RESPONSES, operation_id
from sparkv.server.state import ServerState
from sparkv.server.version import __version__

log = logging.getLogger("sparkv.server")

router = APIRouter(generate_unique_id_function=operation_id)


@router.get("/healthz", response_model=schemas.Health, tags=["ops"],
            responses={503: {"model": schemas.Health}})
async def healthz(state: StateDep) -> Any:
    """Liveness, a generic store state (``ok`` or ``unavailable``: 503) and the job queue's
    (``queue``: ``ok`` or ``degraded`` with a ``queue_reason``; still 200, see docs/rest-api.md).

    Unauthenticated, so it names nothing about the deployment: no store URL, path or error text
    (a failure is logged instead). Every check runs off the event loop.
    """
    body, store_ok = await to_thread.run_sync(_probe, state)
    if not store_ok:
        return JSONResponse({**body, "status": "unavailable", "store": "unavailable"},
                            status_code=503)
    return body


def _probe(state: ServerState) -> tuple[dict[str, Any], bool]:
    """The health body (status ok) and whether the store answered (blocking: a thread's)."""
    queue = state.jobs.queue_health()
    body = {"status": "ok", "version": __version__, "store": "ok",
            "jobs_active": state.jobs.active_count(), "queue": queue.state,
            "queue_reason": queue.reason}
    try:
        state.store.ping()
    except StoreError as exc:
        log.warning("health check: the store cannot be reached: %s", exc)
        return body, False
    return body, True


@router.get("/metrics", tags=["ops"], response_class=Response,
            responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text"}})
async def prometheus(state: StateDep) -> Response:
    """Every metric in the Prometheus text format (docs/server.md, "Metrics")."""
    return Response(state.metrics.render(), media_type=state.metrics.content_type)


@router.get("/v1/models", response_model=schemas.ModelList, tags=["models"],
            responses=ERROR_RESPONSES)
async def list_models(state: StateDep, tenant: TenantDep) -> Any:
    """The models this server encodes with (and whether each is loaded)."""
    return {"models": [{"name": n, "default": n == state.settings.default_model,
                        "loaded": state.registry.is_loaded(n)}
                       for n in state.registry.names()]}
