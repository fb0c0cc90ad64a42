"""The REST API's routes, one :class:`fastapi.APIRouter` per resource (docs/rest-api.md):

* :mod:`~sparkv.server.routes.contexts`: create, list, manifest, token ids, delete;
* :mod:`~sparkv.server.routes.jobs`: an encode job's state;
* :mod:`~sparkv.server.routes.chunks`: one frame (``GET``), many frames (``POST .../stream``);
* :mod:`~sparkv.server.routes.ops`: ``/healthz``, ``/metrics``, ``/v1/models``.
"""

from __future__ import annotations

from sparkv.extras import SERVER_MODULES, require_all

require_all(SERVER_MODULES, feature="the REST server (sparkv.server.routes)")

from fastapi import APIRouter

from sparkv.server.routes import chunks, contexts, jobs, ops

ROUTERS: tuple[APIRouter, ...] = (ops.router, contexts.router, jobs.router, chunks.router)
"""Every router, in the order the app includes them."""

__all__ = ["ROUTERS"]
