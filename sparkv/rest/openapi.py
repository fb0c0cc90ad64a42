"""The statuses the shared plumbing answers, declared in an app's OpenAPI document: the schema
states every status an operation can return, including those answered before any route runs
(:mod:`sparkv.rest.middleware`, :mod:`sparkv.rest.handlers`)."""

from __future__ import annotations

from typing import Any, Mapping

from pydantic.json_schema import models_json_schema

from sparkv.protocol.errors import ErrorResponse

ERROR_REF = "#/components/schemas/{model}"

EVERY_OPERATION = {400: "a percent-encoded path (non_canonical_path), a malformed "
                        "Content-Length (bad_content_length) or body (malformed_json)"}
"""Statuses any request may get, whatever its operation."""

WITH_A_BODY = {408: "the request body did not arrive in time (body_timeout)",
               413: "the request body is over the size limit (body_too_large)"}
"""Statuses of an operation that reads a request body."""


def _error_schema(components: dict[str, Any]) -> dict[str, Any]:
    """``{"$ref": ...}`` to the one error shape, added to ``components`` when missing."""
    found = components.setdefault("schemas", {})
    if "ErrorResponse" not in found:
        _, top = models_json_schema([(ErrorResponse, "serialization")],
                                    ref_template=ERROR_REF)
        for name, body in top.get("$defs", {}).items():
            found.setdefault(name, body)
    return {"$ref": ERROR_REF.format(model="ErrorResponse")}


def declare_plumbing_errors(schema: dict[str, Any],
                            before_routes: Mapping[int, str] | None = None) -> dict[str, Any]:
    """Adds :data:`EVERY_OPERATION`, ``before_routes`` (what an app's own middleware answers
    every request: status -> description) and :data:`WITH_A_BODY` where an operation has a
    request body, to each operation's responses, unless it declares that status already. Returns
    ``schema``, changed in place."""
    ref = _error_schema(schema.setdefault("components", {}))
    for ops in schema.get("paths", {}).values():
        for op in ops.values():
            statuses = {**EVERY_OPERATION, **(before_routes or {})}
            if "requestBody" in op:
                statuses.update(WITH_A_BODY)
            responses = op.setdefault("responses", {})
            for status, description in statuses.items():
                responses.setdefault(str(status), {
                    "description": description,
                    "content": {"application/json": {"schema": ref}}})
    return schema
