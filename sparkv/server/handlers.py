"""Exception handlers: every error the app answers has one JSON shape
(``{"error": {"status", "code", "message", ...}}``, docs/rest-api.md "Errors")."""

from __future__ import annotations

import logging
from typing import Any

from sparkv.extras import SERVER_MODULES, require_all

require_all(SERVER_MODULES, feature="the REST server (sparkv.server.handlers)")

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as _StarletteHTTPException

from sparkv.server.errors import ApiError, StoreError
from sparkv.server.metrics import ServerMetrics
from sparkv.server.middleware import error_body

log = logging.getLogger("sparkv.server")

STORE_RETRY_AFTER_S = 5

_STATUS_CODES = {400: "malformed_json", 404: "not_found", 405: "method_not_allowed",
                 408: "body_timeout", 413: "body_too_large", 415: "unsupported_media_type"}
"""Codes of the HTTP errors raised by the framework (routing, body reading) and the middleware.
A 400 here can only be FastAPI failing to parse a JSON body (e.g. bytes that are not UTF-8)."""


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None,
                   **details: Any) -> JSONResponse:
    """A JSON error response."""
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


def install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Registers the handlers of :class:`ApiError`, validation errors, framework HTTP errors,
    :class:`StoreError` (503) and anything else (500, logged with its traceback)."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        bad_json = next((e for e in exc.errors() if e.get("type") == "json_invalid"), None)
        if bad_json is not None:
            reason = (bad_json.get("ctx") or {}).get("error", "")
            return error_response(400, "malformed_json", "the request body is not valid JSON"
                                  + (f": {reason}" if reason else ""))
        message, details = validation_details(exc)
        return error_response(422, "invalid_request", message, details=details)

    @app.exception_handler(_StarletteHTTPException)
    async def _http(request: Request, exc: _StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        code = getattr(exc, "code", None) or _STATUS_CODES.get(status, f"http_{status}")
        message = str(exc.detail)
        if code == "malformed_json" and not getattr(exc, "code", None):
            message = f"the request body is not valid JSON ({message})"
        return error_response(status, code, message, headers=getattr(exc, "headers", None),
                              **getattr(exc, "details", {}))

    @app.exception_handler(StoreError)
    async def _store(request: Request, exc: StoreError) -> JSONResponse:
        metrics.store_errors.inc()
        log.error("store error: %s", exc)
        return error_response(503, "store_unavailable", "the chunk store cannot be reached; "
                              "retry later", headers={"Retry-After": str(STORE_RETRY_AFTER_S)})

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, "internal_error", f"internal error ({type(exc).__name__})")
