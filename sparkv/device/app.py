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
PUT      ``/v1/contexts/{id}/share``       ``ShareBody`` -> ``ContextInfo``
GET      ``/v1/stats``                     ``ServiceStats``
GET      ``/healthz``                      ``ServiceHealth``
=======  ================================  ==============================================

The app is assembled like the REST server's (:mod:`sparkv.server.app`): one ``APIRouter`` per
resource, the service reaching the routes as a dependency (:func:`get_service`, from
``app.state.service``), and the HTTP plumbing both apps share (:mod:`sparkv.rest`): every error
in the wire's one JSON shape (:func:`sparkv.protocol.error_body`)::

    {"error": {"status": 404, "code": "unknown_context", "message": "..."}}

with the status and code of the :mod:`sparkv.device.errors` class: 404 unknown context, 409 busy
(a call with ``timeout_s`` that could not get the lock) or damaged (a context that could not be
reopened), 413 prompt too long, 503 ``budget_busy`` with ``Retry-After`` (the context fits the
budget, but the memory it needs is held by contexts in use now), 507 ``budget_too_small`` (it
never fits) or ``flash_full`` (the flash had no room: nothing was kept, nothing kept was lost),
400 anything else the service refuses (a token id outside the vocabulary, ...). The shared
plumbing answers the rest as the server does: a body that is not JSON is a 400
``malformed_json``; one that does not match the schema (a lone surrogate, an infinite or too long
timeout) a 422 ``invalid_request`` with ``details`` (``[{loc, msg, type}]``); a percent-encoded
path a 400 ``non_canonical_path``; a body over ``max_body_bytes`` a 413 ``body_too_large``, one
slower than ``body_timeout_s`` a 408 ``body_timeout``; an unknown path a 404 ``not_found``, a
method a path lacks a 405 with ``Allow``; anything unexpected a 500 ``internal_error``.

Before any route, :class:`~sparkv.device.access.AccessGuard` answers 421 to a Host that is not
loopback and, when the app has a ``token`` (``serve --port``), 401 to a request without
``Authorization: Bearer <token>``; it names the app making the request
(:mod:`sparkv.device.identity`). An app sees only its own contexts and those shared with it
(:mod:`sparkv.device.owners`): another's is 404 ``unknown_context``, as if it did not exist; one
shared with it but not its own is 403 ``not_owner`` to delete or share.

More routers (the asks of :mod:`sparkv.asks`) join through ``create_app(routers=...)``.

The routes are plain functions, run in FastAPI's thread pool: the service's calls block (a call
holds its context's lock while it generates).
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Sequence

from sparkv.extras import require_all

require_all(("fastapi",), feature="the device service's HTTP app (sparkv.device.app)")

from fastapi import APIRouter, Depends, FastAPI, Path, Request  # noqa: E402 - after the check
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response

from sparkv.device.access import AccessGuard
from sparkv.device.errors import DeviceError, NotOwner, UnknownContext
from sparkv.device.identity import APP_SCOPE_KEY, USER
from sparkv.device.owners import OWNERS_FILE, ContextOwners
from sparkv.device.schemas import (CallBody, CallReply, ContextInfo, DeviceContextList, ErrorResponse,
                                   ServiceHealth, NewContext, ServiceStats, ShareBody)
from sparkv.device.service import ContextService
from sparkv.rest.handlers import error_response, install_error_handlers as install_shared
from sparkv.rest.limits import BodyLimits
from sparkv.rest.middleware import install_request_policy
from sparkv.rest.openapi import declare_plumbing_errors

__all__ = ["create_app", "get_service", "get_caller", "get_owners", "ServiceDep", "CallerDep",
           "OwnersDep", "ROUTERS", "visible_context", "error_responses"]

log = logging.getLogger("sparkv.device")


# ---- the dependency ------------------------------------------------------------------------------
def get_service(request: Request) -> ContextService:
    """The app's service (``app.state.service``)."""
    return request.app.state.service


def get_caller(request: Request) -> str:
    """The app making the request (set by :class:`~sparkv.device.access.AccessGuard`)."""
    return str(request.scope.get("state", {}).get(APP_SCOPE_KEY, USER))


def get_owners(request: Request) -> ContextOwners:
    """The app's owner records (``app.state.owners``)."""
    return request.app.state.owners


ServiceDep = Annotated[ContextService, Depends(get_service)]
CallerDep = Annotated[str, Depends(get_caller)]
OwnersDep = Annotated[ContextOwners, Depends(get_owners)]
ContextId = Annotated[str, Path(pattern=r"^[0-9a-f]{16}$", description="a context's id")]


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses``: the error body for each of ``statuses``."""
    return {status: {"model": ErrorResponse} for status in statuses}


def visible_context(owners: ContextOwners, ctx_id: str, caller: str) -> None:
    """:class:`UnknownContext` unless ``caller`` may see the context (its own, or shared with
    it): another app's context is answered as if it did not exist."""
    if not owners.visible(ctx_id, caller):
        raise UnknownContext(f"no context {ctx_id!r}")


def _owned_context(owners: ContextOwners, ctx_id: str, caller: str) -> None:
    """As :func:`visible_context`, and :class:`NotOwner` when it is only shared with
    ``caller``."""
    visible_context(owners, ctx_id, caller)
    if owners.owner(ctx_id) != caller:
        raise NotOwner(f"context {ctx_id} is shared with you; only its owner "
                       f"({owners.owner(ctx_id)}) may delete or share it")


def _info(service: ContextService, owners: ContextOwners, ctx_id: str) -> ContextInfo:
    return ContextInfo.model_validate({**service.describe(ctx_id).to_dict(),
                                       **owners.describe(ctx_id)})


# ---- the routes ----------------------------------------------------------------------------------
contexts_router = APIRouter(tags=["contexts"])
service_router = APIRouter(tags=["service"])


@contexts_router.post("/v1/contexts", status_code=201, response_model=ContextInfo,
                      responses=error_responses(400, 413, 422, 503, 507))
def new_context(body: NewContext, service: ServiceDep, caller: CallerDep,
                owners: OwnersDep) -> ContextInfo:
    """Makes a context holding the system prompt (its KV computed now), the caller's."""
    if body.system_prompt is not None and body.system_ids is not None:
        raise DeviceError("give system_prompt or system_ids, not both")
    cid = service.new_context(body.system_prompt, system_ids=body.system_ids, label=body.label)
    owners.claim(cid, caller)
    return _info(service, owners, cid)


@contexts_router.post("/v1/contexts/{ctx_id}/call", response_model=CallReply,
                      responses=error_responses(400, 404, 409, 413, 422, 503, 507))
def call_context(ctx_id: ContextId, body: CallBody, service: ServiceDep, caller: CallerDep,
                 owners: OwnersDep) -> CallReply:
    """Answers a prompt in the context (which grows by the prompt and the answer)."""
    visible_context(owners, ctx_id, caller)
    if (body.prompt is None) == (body.prompt_ids is None):
        raise DeviceError("give exactly one of prompt and prompt_ids")
    res = service.call(ctx_id, body.prompt, body.max_new_tokens,
                       prompt_ids=body.prompt_ids, grow=body.grow, timeout_s=body.timeout_s,
                       turn_scope=caller, sampling=body.sampling())
    return CallReply.model_validate(res.to_dict())


@contexts_router.delete("/v1/contexts/{ctx_id}", status_code=204, response_class=Response,
                        responses=error_responses(403, 404))
def delete_context(ctx_id: ContextId, service: ServiceDep, caller: CallerDep,
                   owners: OwnersDep) -> Response:
    """Deletes the context: its memory, its flash files and its journal record (of a damaged
    context, what is left of them). Its owner only."""
    _owned_context(owners, ctx_id, caller)
    service.delete(ctx_id)
    owners.forget(ctx_id)
    return Response(status_code=204)


@contexts_router.get("/v1/contexts", response_model=DeviceContextList)
def list_contexts(service: ServiceDep, caller: CallerDep,
                  owners: OwnersDep) -> DeviceContextList:
    """The caller's contexts and those shared with it, and those of them that could not be
    reopened (``damaged``)."""
    mine = [{**c.to_dict(), **owners.describe(c.id)} for c in service.list()
            if owners.visible(c.id, caller)]
    damaged = [d.to_dict() for d in service.damaged_list() if owners.visible(d.id, caller)]
    return DeviceContextList.model_validate({"contexts": mine, "damaged": damaged})


@contexts_router.get("/v1/contexts/{ctx_id}", response_model=ContextInfo,
                     responses=error_responses(404, 409))
def describe_context(ctx_id: ContextId, service: ServiceDep, caller: CallerDep,
                     owners: OwnersDep) -> ContextInfo:
    """One context: tokens, bytes, chunks by residency, level mix, busy, owner."""
    visible_context(owners, ctx_id, caller)
    return _info(service, owners, ctx_id)


@contexts_router.put("/v1/contexts/{ctx_id}/share", response_model=ContextInfo,
                     responses=error_responses(403, 404, 409, 422))
def share_context(ctx_id: ContextId, body: ShareBody, service: ServiceDep, caller: CallerDep,
                  owners: OwnersDep) -> ContextInfo:
    """Shares the context with the apps of ``apps`` (``*``: every app), replacing its share
    list (``[]``: private again). Its owner only."""
    _owned_context(owners, ctx_id, caller)
    service.describe(ctx_id)            # 404 for a deleted one, 409 for a damaged one
    owners.share(ctx_id, body.apps)
    return _info(service, owners, ctx_id)


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


GUARDED = {421: "the Host header is not loopback (misdirected_request)",
           401: "over TCP: no or a wrong bearer token (missing_token, invalid_token)"}
"""What :class:`~sparkv.device.access.AccessGuard` answers before any route."""


# ---- errors and the app --------------------------------------------------------------------------
def install_error_handlers(app: FastAPI) -> None:
    """The handlers both apps share (:mod:`sparkv.rest.handlers`: the JSON-body policy, the
    framework's HTTP errors, 500) and :class:`DeviceError`'s (its class's status, code and
    headers: ``Retry-After`` of a 503 ``budget_busy``)."""
    install_shared(app, log)

    @app.exception_handler(DeviceError)
    async def _device(request: Request, exc: DeviceError) -> JSONResponse:
        return error_response(exc.status, exc.code, str(exc), headers=exc.headers or None)


def state_vocabulary(schema: dict[str, Any], vocab: int | None) -> dict[str, Any]:
    """Writes the model's vocabulary into the schema: every token id of a request body is
    below ``vocab`` (nothing when it is unknown). Returns ``schema``."""
    if not isinstance(vocab, int):
        return schema
    for model, field in (("NewContext", "system_ids"), ("CallBody", "prompt_ids")):
        prop = schema["components"]["schemas"][model]["properties"][field]
        for branch in prop.get("anyOf", [prop]):
            if branch.get("type") == "array":
                branch["items"]["maximum"] = vocab - 1
    return schema


def create_app(service: ContextService, token: str | None = None,
               limits: BodyLimits = BodyLimits(), *, app_key: bytes | None = None,
               owners: ContextOwners | None = None,
               routers: Sequence[APIRouter] = ()) -> FastAPI:
    """The device service's app over ``service``: loopback Host names only, and with ``token``
    (TCP) every request must carry ``Authorization: Bearer <token>`` or an app token under
    ``app_key`` (:class:`~sparkv.device.access.AccessGuard`); request bodies within ``limits``
    (the shared request policy, :func:`~sparkv.rest.middleware.install_request_policy`).
    ``owners``: whose each context is (default: kept in the service's flash dir, else in
    memory); ``routers``:
    more routes (their dependencies find ``app.state``)."""
    app = FastAPI(title="sparkv device context service", version="1")
    app.state.service = service
    swap_dir = getattr(service, "swap_dir", None)      # none: a scripted service (tests)
    app.state.owners = owners or ContextOwners(swap_dir / OWNERS_FILE if swap_dir else None)
    for router in (*ROUTERS, *routers):
        app.include_router(router)
    install_error_handlers(app)
    app.add_middleware(AccessGuard, token=token, app_key=app_key)
    install_request_policy(app, limits)

    def openapi() -> dict[str, Any]:
        if not app.openapi_schema:
            schema = declare_plumbing_errors(get_openapi(
                title=app.title, version=app.version, routes=app.routes), GUARDED)
            app.openapi_schema = state_vocabulary(schema, getattr(service, "vocab", None))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
