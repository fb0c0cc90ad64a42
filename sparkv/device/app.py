"""The local service apps talk to: a small FastAPI app over a :class:`ContextService`.

=======  ================================  ==============================================
method   path                              what
=======  ================================  ==============================================
POST     ``/v1/contexts``                  new context ``{system_prompt?, system_ids?}`` -> 201 ``{id}``
POST     ``/v1/contexts/{id}/call``        ``{prompt | prompt_ids, max_new_tokens, grow}`` -> the answer
DELETE   ``/v1/contexts/{id}``             204
GET      ``/v1/contexts``                  every context (tokens, bytes, residency, levels)
GET      ``/v1/contexts/{id}``             one context
GET      ``/v1/stats``                     budget, bytes used and peak, evictions, I/O, profiles
GET      ``/healthz``                      ``{"ok": true, "contexts": n}``
=======  ================================  ==============================================

Errors are JSON ``{"error": {"code": ..., "message": ...}}`` with the status of the
:mod:`sparkv.device.errors` class: 404 unknown context, 409 busy (a call with ``timeout_s``
that could not get the lock), 413 prompt too long, 507 budget too small for the context,
400 anything else the service refuses; a malformed body is FastAPI's 422.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from sparkv.device.errors import DeviceError
from sparkv.device.service import ContextService

#: the longest prompt text a request may carry (characters; token limits are the service's)
MAX_PROMPT_CHARS = 1 << 20


class NewContext(BaseModel):
    system_prompt: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    system_ids: list[int] | None = None


class CallBody(BaseModel):
    prompt: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    prompt_ids: list[int] | None = None
    max_new_tokens: int = Field(default=32, ge=0)
    grow: bool = True
    timeout_s: float | None = Field(default=None, ge=0)


def create_app(service: ContextService) -> FastAPI:
    app = FastAPI(title="sparkv device context service", version="1")
    app.state.service = service

    @app.exception_handler(DeviceError)
    async def _device_error(request: Request, exc: DeviceError) -> JSONResponse:
        return JSONResponse({"error": {"code": exc.code, "message": str(exc)}},
                            status_code=exc.status)

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        return {"ok": True, "contexts": len(service.contexts)}

    @app.post("/v1/contexts", status_code=201)
    def new_context(body: NewContext) -> dict[str, Any]:
        if body.system_prompt is not None and body.system_ids is not None:
            raise DeviceError("give system_prompt or system_ids, not both")
        cid = service.new_context(body.system_prompt, system_ids=body.system_ids)
        return {"id": cid, **service.describe(cid)}

    @app.post("/v1/contexts/{ctx_id}/call")
    def call(ctx_id: str, body: CallBody) -> dict[str, Any]:
        if (body.prompt is None) == (body.prompt_ids is None):
            raise DeviceError("give exactly one of prompt and prompt_ids")
        res = service.call(ctx_id, body.prompt, body.max_new_tokens, prompt_ids=body.prompt_ids,
                           grow=body.grow, timeout_s=body.timeout_s)
        d = res.to_dict()
        d["switch_ms"] = res.switch_s * 1e3
        d["first_token_ms"] = res.first_token_s * 1e3
        d["total_ms"] = res.total_s * 1e3
        return d

    @app.delete("/v1/contexts/{ctx_id}", status_code=204)
    def delete(ctx_id: str) -> Response:
        service.delete(ctx_id)
        return Response(status_code=204)

    @app.get("/v1/contexts")
    def list_contexts() -> dict[str, Any]:
        return {"contexts": service.list()}

    @app.get("/v1/contexts/{ctx_id}")
    def describe(ctx_id: str) -> dict[str, Any]:
        return service.describe(ctx_id)

    @app.get("/v1/stats")
    def stats() -> dict[str, Any]:
        return service.stats()

    return app
