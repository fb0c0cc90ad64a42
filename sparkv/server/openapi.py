"""The OpenAPI document's extras: operation ids, documented error responses, links, the API-key
security schemes, the stream request's body schema (that route reads its body itself, off the
event loop, so FastAPI does not see a body parameter), and what this server's models and presses
allow (:func:`state_model_limits`): a request the document allows is one the server accepts."""

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
from sparkv.server.models import ModelFacts, ModelRegistry

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


def _string_branch(prop: dict[str, Any]) -> dict[str, Any]:
    """The non-null branch of an ``Optional`` property's schema (``anyOf: [X, null]``)."""
    for branch in prop.get("anyOf", [prop]):
        if branch.get("type") != "null":
            return branch
    return prop


def press_pattern() -> str:
    """A pattern every string of which is a press spec the server takes (its canonical
    spellings: a press name, a ratio in (0, 1], a percentage, or tokens, and ``@repeat``)."""
    from sparkv.presses.registry import PRESSES, PROBES

    names = "|".join(sorted(PRESSES, key=len, reverse=True))
    budgets = r"0\.[0-9]{0,5}[1-9]|1|[1-9][0-9]?%|100%|[1-9][0-9]{0,5}t"
    windows = "|".join(PROBES)
    return f"^({names}):({budgets})(@({windows}))?$"


def state_model_limits(schema: dict[str, Any], facts: dict[str, ModelFacts | None]) -> None:
    """Writes what the configured models allow into ``CreateContext``: ``model`` is one of their
    names; when every model's limits are known (:meth:`ModelRegistry.facts`), a token id is
    below the largest vocabulary, ``token_ids`` at most the longest context, and
    ``heads_per_group`` 0 or a divisor of a model's KV heads (exact with one model; with several
    the loosest of them); ``press`` a canonical spec (:func:`press_pattern`)."""
    props = schema["components"]["schemas"]["CreateContext"]["properties"]
    _string_branch(props["model"])["enum"] = sorted(facts)
    _string_branch(props["press"])["pattern"] = press_pattern()
    known = [f for f in facts.values() if f is not None]
    if not known or len(known) < len(facts):
        return
    ids = _string_branch(props["token_ids"])
    ids["maxItems"] = max(f.max_tokens for f in known)
    ids["items"]["maximum"] = max(f.vocab_size for f in known) - 1
    divisors = {d for f in known for d in range(1, f.kv_heads + 1) if f.kv_heads % d == 0}
    props["heads_per_group"]["enum"] = [0, *sorted(divisors)]


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
        registry: ModelRegistry = app.state.sparkv.registry
        state_model_limits(schema, {name: registry.facts(name) for name in registry.names()})
        app.openapi_schema = declare_plumbing_errors(schema)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
