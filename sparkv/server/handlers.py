"""Exception handlers: every error the app answers has one JSON shape
(``{"error": {"status", "code", "message", ...}}``, docs/rest-api.md "Errors").

The handlers both apps share (:mod:`sparkv.rest.handlers`: :class:`ApiError`, the JSON-body
policy, the framework's HTTP errors, 500) and the server's own: :class:`StoreError` is a 503
``store_unavailable`` with ``Retry-After``, its reason logged, never sent."""

from __future__ import annotations

import logging

from sparkv.extras import SERVER_MODULES, require_all

require_all(SERVER_MODULES, feature="the REST server (sparkv.server.handlers)")

from fastapi import FastAPI, Request  # noqa: E402 - after the check that names the extra
from fastapi.responses import JSONResponse

from sparkv.rest.handlers import error_response, install_error_handlers as install_shared
from sparkv.server.errors import StoreError
from sparkv.server.metrics import ServerMetrics

log = logging.getLogger("sparkv.server")

STORE_RETRY_AFTER_S = 5


def install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Registers the shared handlers and :class:`StoreError`'s (503, counted and logged)."""
    install_shared(app, log)

    @app.exception_handler(StoreError)
    async def _store(request: Request, exc: StoreError) -> JSONResponse:
        metrics.store_errors.inc()
        log.error("store error: %s", exc)
        return error_response(503, "store_unavailable", "the chunk store cannot be reached; "
                              "retry later", headers={"Retry-After": str(STORE_RETRY_AFTER_S)})
