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
from sparkv.server.version import __version__

log = logging.getLogger("sparkv.server")

router = APIRouter(generate_unique_id_function=operation_id)


@router.get("/healthz", response_model=schemas.Health, tags=["ops"],
            responses={503: {"model": schemas.Health}})
async def healthz(state: StateDep) -> Any:
    """Liveness and a generic store state (``ok`` or ``unavailable``).

    Unauthenticated, so it names nothing about the deployment: no store URL, path or error text
    (a store failure is logged instead).
    """
    body = {"status": "ok", "version": __version__, "store": "ok",
            "jobs_active": state.jobs.active_count()}
    try:
        await to_thread.run_sync(state.store.ping)
    except StoreError as exc:
        log.warning("health check: the store cannot be reached: %s", exc)
        return JSONResponse({**body, "status": "unavailable", "store": "unavailable"},
                            status_code=503)
    return body


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
