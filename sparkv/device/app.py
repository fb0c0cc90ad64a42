"""The local service apps talk to: a small FastAPI app over a :class:`ContextService`
(docs/device-service.md, "REST API").

=======  ================================  ==============================================
method   path                              body -> answer (:mod:`sparkv.device.schemas`)
=======  ================================  ==============================================
POST     ``/v1/contexts``                  ``NewContext`` -> 201 ``ContextInfo``
POST     ``/v1/contexts/{id}/call``        ``CallBody`` -> ``CallReply``
DELETE   ``/v1/contexts/{id}``             204 (a damaged context too)
GET      ``/v1/contexts``                  ``DeviceContextList`` (and the damaged ones)
GET      ``/v1/contexts/{id}``             ``ContextInfo``
GET      ``/v1/stats``                     ``ServiceStats``
GET      ``/healthz``                      ``ServiceHealth``
=======  ================================  ==============================================

The app is assembled like the REST server's (:mod:`sparkv.server.app`): one ``APIRouter`` per
resource, the service reaching the routes as a dependency (:func:`get_service`, from
``app.state.service``), and every error in the wire's one JSON shape
(:func:`sparkv.protocol.error_body`)::

    {"error": {"status": 404, "code": "unknown_context", "message": "..."}}

with the status and code of the :mod:`sparkv.device.errors` class: 404 unknown context, 409 busy
(a call with ``timeout_s`` that could not get the lock) or damaged (a context that could not be
reopened), 413 prompt too long, 503 ``budget_busy`` with ``Retry-After`` (the context fits the
budget, but the memory it needs is held by contexts in use now), 507 ``budget_too_small`` (it
never fits) or ``flash_full`` (the flash had no room: nothing was kept, nothing kept was lost),
400 anything else the service refuses (a token id outside the vocabulary, ...); a body that does
not match the schema (or is not JSON, or holds a lone surrogate, an infinite or too long
timeout) is a 422 ``invalid_request`` with ``details`` (``[{loc, msg, type}]``); an unknown path
a 404 ``not_found``; anything unexpected a 500 ``internal_error``.

Before any route, :class:`~sparkv.device.access.AccessGuard` answers 421 to a Host that is not
loopback and, when the app has a ``token`` (``serve --port``), 401 to a request without
``Authorization: Bearer <token>``.

The routes are plain functions, run in FastAPI's thread pool: the service's calls block (a call
holds its context's lock while it generates).
"""

from __future__ import annotations

from typing import Annotated, Any

from sparkv.extras import require_all

require_all(("fastapi",), feature="the device service's HTTP app (sparkv.device.app)")

from fastapi import APIRouter, Depends, FastAPI, Request  # noqa: E402 - after the extra's check
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as _StarletteHTTPException

from sparkv.device.access import AccessGuard
from sparkv.device.errors import BudgetBusy, DeviceError
from sparkv.device.schemas import (CallBody, CallReply, ContextInfo, DeviceContextList, ErrorResponse,
                                   ServiceHealth, NewContext, ServiceStats)
from sparkv.device.service import ContextService
from sparkv.protocol.errors import error_body

__all__ = ["create_app", "get_service", "ServiceDep", "ROUTERS"]


# ---- the dependency ------------------------------------------------------------------------------
def get_service(request: Request) -> ContextService:
    """The app's service (``app.state.service``)."""
    return request.app.state.service  # type: ignore[no-any-return]


ServiceDep = Annotated[ContextService, Depends(get_service)]


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses``: the error body for each of ``statuses``."""
    return {status: {"model": ErrorResponse} for status in statuses}


# ---- the routes ----------------------------------------------------------------------------------
contexts_router = APIRouter(tags=["contexts"])
service_router = APIRouter(tags=["service"])


def _busy(exc: BudgetBusy) -> JSONResponse:
    """503 with ``Retry-After``: the memory a context needs is held by contexts in use."""
    return JSONResponse(error_body(exc.status, exc.code, str(exc)), status_code=exc.status,
                        headers=exc.headers)


@contexts_router.post("/v1/contexts", status_code=201, response_model=ContextInfo,
                      responses=_errors(400, 413, 422, 503, 507))
def new_context(body: NewContext, service: ServiceDep) -> ContextInfo | JSONResponse:
    """Makes a context holding the system prompt (its KV computed now)."""
    if body.system_prompt is not None and body.system_ids is not None:
        raise DeviceError("give system_prompt or system_ids, not both")
    try:
        cid = service.new_context(body.system_prompt, system_ids=body.system_ids)
    except BudgetBusy as e:
        return _busy(e)
    return ContextInfo.model_validate({"id": cid, **service.describe(cid)})


@contexts_router.post("/v1/contexts/{ctx_id}/call", response_model=CallReply,
                      responses=_errors(400, 404, 409, 413, 422, 503, 507))
def call_context(ctx_id: str, body: CallBody, service: ServiceDep) -> CallReply | JSONResponse:
    """Answers a prompt in the context (which grows by the prompt and the answer)."""
    if (body.prompt is None) == (body.prompt_ids is None):
        raise DeviceError("give exactly one of prompt and prompt_ids")
    try:
        res = service.call(ctx_id, body.prompt, body.max_new_tokens,
                           prompt_ids=body.prompt_ids, grow=body.grow, timeout_s=body.timeout_s)
    except BudgetBusy as e:
        return _busy(e)
    return CallReply.model_validate({
        **res.to_dict(), "switch_ms": res.switch_s * 1e3,
        "first_token_ms": res.first_token_s * 1e3, "total_ms": res.total_s * 1e3})


@contexts_router.delete("/v1/contexts/{ctx_id}", status_code=204, response_class=Response,
                        responses=_errors(404))
def delete_context(ctx_id: str, service: ServiceDep) -> Response:
    """Deletes the context: its memory, its flash files and its journal record (of a damaged
    context, what is left of them)."""
    service.delete(ctx_id)
    return Response(status_code=204)


@contexts_router.get("/v1/contexts", response_model=DeviceContextList)
def list_contexts(service: ServiceDep) -> DeviceContextList:
    """Every context, and those that could not be reopened (``damaged``)."""
    return DeviceContextList.model_validate({"contexts": service.list(),
                                             "damaged": service.damaged_list()})


@contexts_router.get("/v1/contexts/{ctx_id}", response_model=ContextInfo,
                     responses=_errors(404, 409))
def describe_context(ctx_id: str, service: ServiceDep) -> ContextInfo:
    """One context: tokens, bytes, chunks by residency, level mix, busy."""
    return ContextInfo.model_validate(service.describe(ctx_id))


@service_router.get("/v1/stats", response_model=ServiceStats)
def get_stats(service: ServiceDep) -> ServiceStats:
    """The budget, the bytes used and their peak, evictions, I/O, profiles."""
    return ServiceStats.model_validate(service.stats())


@service_router.get("/healthz", response_model=ServiceHealth)
def healthz(service: ServiceDep) -> ServiceHealth:
    """Liveness, how many contexts the service holds, and the flash's state (``degraded``
    since a write found it full)."""
    return ServiceHealth.model_validate(service.health())


ROUTERS = (contexts_router, service_router)


# ---- errors --------------------------------------------------------------------------------------
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}
"""Codes of the framework's own HTTP errors (routing)."""


def error_response(status: int, code: str, message: str, **details: Any) -> JSONResponse:
    """A JSON error response (:func:`sparkv.protocol.error_body`)."""
    return JSONResponse(error_body(status, code, message, **details), status_code=status)


def install_error_handlers(app: FastAPI) -> None:
    """Renders :class:`DeviceError`, validation errors, the framework's HTTP errors and anything
    unexpected (500) in the one JSON error shape."""

    @app.exception_handler(DeviceError)
    async def _device(request: Request, exc: DeviceError) -> JSONResponse:
        return error_response(exc.status, exc.code, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = [{"loc": ".".join(str(x) for x in e.get("loc", ())), "msg": e.get("msg", ""),
                     "type": e.get("type", "")} for e in exc.errors()]
        said = "; ".join(f"{p['loc']}: {p['msg']}" for p in problems[:3])
        return error_response(422, "invalid_request", f"invalid request: {said}",
                              details=problems)

    @app.exception_handler(_StarletteHTTPException)
    async def _http(request: Request, exc: _StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        return error_response(status, _HTTP_CODES.get(status, f"http_{status}"), str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        # Starlette raises the exception again after this answer: the server logs its traceback
        return error_response(500, "internal_error", f"internal error ({type(exc).__name__})")


# ---- the app -------------------------------------------------------------------------------------
def create_app(service: ContextService, token: str | None = None) -> FastAPI:
    """The device service's app over ``service``: loopback Host names only, and with ``token``
    (TCP) every request must carry ``Authorization: Bearer <token>``
    (:class:`~sparkv.device.access.AccessGuard`)."""
    app = FastAPI(title="sparkv device context service", version="1")
    app.state.service = service
    for router in ROUTERS:
        app.include_router(router)
    install_error_handlers(app)
    app.add_middleware(AccessGuard, token=token)  # type: ignore[arg-type]
    return app
