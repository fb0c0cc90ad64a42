"""The OpenAPI document's extras: operation ids, documented error responses, links, the API-key
security schemes, and the stream request's body schema (that route reads its body itself, off the
event loop, so FastAPI does not see a body parameter)."""

from __future__ import annotations

from typing import Any

from sparkv.extras import SERVER_MODULES, require_all

require_all(SERVER_MODULES, feature="the REST server (sparkv.server.openapi)")

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic.json_schema import models_json_schema

from sparkv.rest.openapi import declare_plumbing_errors
from sparkv.server import schemas

COMPONENTS_REF = "#/components/schemas/{model}"

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"model": schemas.ErrorResponse, "description": "missing or invalid API key"},
    422: {"model": schemas.ErrorResponse, "description": "the request does not match the schema"},
}
"""Responses every ``/v1/`` operation may give."""


def error_responses(*statuses: int, **described: dict[str, Any]) -> dict[int | str, dict[str, Any]]:
    """:data:`ERROR_RESPONSES` plus an error body for each of ``statuses``."""
    out: dict[int | str, dict[str, Any]] = dict(ERROR_RESPONSES)
    for status in statuses:
        out[status] = {"model": schemas.ErrorResponse}
    return out


_CID = "$response.body#/context_id"
CREATED_LINKS = {  # what a client (or a stateful fuzzer) does next
    "GetManifest": {"operationId": "get_manifest", "parameters": {"context_id": _CID}},
    "GetJob": {"operationId": "get_job", "parameters": {"job_id": "$response.body#/job_id"}},
    "GetFirstChunk": {"operationId": "get_chunk",
                      "parameters": {"context_id": _CID, "t": 0, "l": 0, "g": 0}},
    "StreamChunks": {"operationId": "stream_chunks", "parameters": {"context_id": _CID}},
    "GetTokens": {"operationId": "get_tokens", "parameters": {"context_id": _CID}},
    "DeleteContext": {"operationId": "delete_context", "parameters": {"context_id": _CID}},
}
"""OpenAPI links of ``POST /v1/contexts``."""

STREAM_REQUEST_BODY: dict[str, Any] = {"requestBody": {
    "required": True,
    "content": {"application/json": {"schema": {"$ref": COMPONENTS_REF.format(
        model="StreamRequest")}}}}}
"""``openapi_extra`` of the stream route: its body is :class:`~sparkv.server.schemas.StreamRequest`."""


def operation_id(route: APIRoute) -> str:
    """A route's operationId: its function's name (``get_chunk``, ``stream_chunks``, ...)."""
    return route.name


def _body_schemas() -> dict[str, Any]:
    """JSON Schemas of the bodies routes read themselves, keyed by model name."""
    _, top = models_json_schema([(schemas.StreamRequest, "validation")],
                                ref_template=COMPONENTS_REF)
    return dict(top.get("$defs", {}))


def install_openapi(app: FastAPI) -> None:
    """Replaces ``app.openapi`` with a generator that adds the security schemes (the check itself
    is :class:`~sparkv.server.middleware.AuthMiddleware`'s), the stream body's schemas and the
    statuses of the shared plumbing (:func:`~sparkv.rest.openapi.declare_plumbing_errors`)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description,
                             routes=app.routes)
        components = schema.setdefault("components", {})
        found = components.setdefault("schemas", {})
        for name, body in _body_schemas().items():
            found.setdefault(name, body)
        components["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer",
                       "description": "Authorization: Bearer <api key>"},
            "apiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key"},
        }
        for path, ops in schema.get("paths", {}).items():
            if path.startswith("/v1/"):
                for op in ops.values():
                    op["security"] = [{"bearer": []}, {"apiKey": []}]
        app.openapi_schema = declare_plumbing_errors(schema)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
