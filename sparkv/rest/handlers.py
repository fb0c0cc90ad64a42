"""The exception handlers both apps install: every error in the wire's one JSON shape
(:func:`sparkv.protocol.errors.error_body`), and one policy for request bodies.

===========================================  ========  ========================================
what                                         status    ``code``
===========================================  ========  ========================================
:class:`~sparkv.protocol.errors.ApiError`    its own   its own (with its headers and details)
a body that is not JSON (a syntax error,     400       ``malformed_json``
truncated, not UTF-8, nested too deeply)
JSON (or a path or query parameter) that     422       ``invalid_request`` with ``details``
does not match the schema                              (``[{loc, msg, type}]``)
the framework's HTTP errors (routing, body   theirs    :data:`HTTP_CODES`; a 405 with ``Allow``
reading, the middleware's)                             naming every method of the path
anything else                                500       ``internal_error`` (logged, traceback)
===========================================  ========  ========================================

Each app adds the handlers of its own errors (the server's ``StoreError``, the device service's
``DeviceError``) with ``app.exception_handler``.
"""

from __future__ import annotations

import logging
from typing import Any

from sparkv.extras import require_all

require_all(("fastapi",), feature="the HTTP apps (sparkv.rest.handlers)")

from fastapi import FastAPI, Request  # noqa: E402 - after the check that names the extra
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as _StarletteHTTPException

from sparkv.protocol.errors import ApiError, error_body
from sparkv.rest.routing import allowed_methods

HTTP_CODES = {400: "malformed_json", 404: "not_found", 405: "method_not_allowed",
              408: "body_timeout", 413: "body_too_large", 415: "unsupported_media_type"}
"""Codes of the HTTP errors the framework raises (routing, body reading) and the middleware's
(which name their own ``code`` where they have one). A framework 400 can only be a JSON body
FastAPI failed to parse (bytes that are not UTF-8, arrays nested deeper than the parser
recurses)."""


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None,
                   **details: Any) -> JSONResponse:
    """A JSON error response in the one shape."""
    return JSONResponse(error_body(status, code, message, **details), status_code=status,
                        headers=headers)


def validation_details(exc: RequestValidationError) -> tuple[str, list[dict[str, Any]]]:
    """A one-line message (the first three problems) and ``[{loc, msg, type}]`` of every one."""
    details = []
    for e in exc.errors():
        loc = ".".join(str(x) for x in e.get("loc", ()))
        details.append({"loc": loc, "msg": e.get("msg", ""), "type": e.get("type", "")})
    first = "; ".join(f"{d['loc']}: {d['msg']}" for d in details[:3])
    more = f" (and {len(details) - 3} more)" if len(details) > 3 else ""
    return f"invalid request: {first}{more}", details


def validation_response(exc: RequestValidationError) -> JSONResponse:
    """The JSON-body policy: a body that does not parse is 400 ``malformed_json``; a parsed body
    (or a parameter) that does not match the schema is 422 ``invalid_request``."""
    bad_json = next((e for e in exc.errors() if e.get("type") == "json_invalid"), None)
    if bad_json is not None:
        reason = (bad_json.get("ctx") or {}).get("error", "")
        return error_response(400, "malformed_json", "the request body is not valid JSON"
                              + (f": {reason}" if reason else ""))
    message, details = validation_details(exc)
    return error_response(422, "invalid_request", message, details=details)


def http_error_response(request: Request, exc: _StarletteHTTPException) -> JSONResponse:
    """A framework or middleware HTTP error (its ``code`` and ``details`` when it has them, its
    headers); a 405 names every method of the path in ``Allow``."""
    status = exc.status_code
    own_code = getattr(exc, "code", None)
    code = own_code or HTTP_CODES.get(status, f"http_{status}")
    message = str(exc.detail)
    if code == "malformed_json" and not own_code:
        message = f"the request body is not valid JSON ({message})"
    headers = dict(getattr(exc, "headers", None) or {})
    if status == 405:
        headers["Allow"] = ", ".join(allowed_methods(request.app.router.routes, request.scope))
    return error_response(status, code, message, headers=headers or None,
                          **getattr(exc, "details", {}))


def install_error_handlers(app: FastAPI, log: logging.Logger) -> None:
    """Registers the handlers of :class:`ApiError`, validation errors, the framework's HTTP errors
    and anything else (500, logged to ``log`` with its traceback)."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_response(exc)

    @app.exception_handler(_StarletteHTTPException)
    async def _http(request: Request, exc: _StarletteHTTPException) -> JSONResponse:
        return http_error_response(request, exc)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error on %s %s", request.method, request.url.path,
                  exc_info=(type(exc), exc, exc.__traceback__))
        return error_response(500, "internal_error", f"internal error ({type(exc).__name__})")
