"""The FastAPI app: ``create_app(settings)``. Endpoints are documented in docs/rest-api.md.

The app is assembled from parts, one responsibility each:

* :mod:`~sparkv.server.state`: what the routes share (store, jobs, models, metrics, the manifest
  cache, the per-tenant stream slots);
* :mod:`~sparkv.server.routes`: one ``APIRouter`` per resource, with their dependencies in
  :mod:`~sparkv.server.deps`;
* :mod:`~sparkv.server.handlers`: the JSON error shape of every error;
* :mod:`~sparkv.server.middleware`: metrics, gzip, the body deadline and limit, authentication;
* :mod:`~sparkv.server.openapi`: operation ids, security schemes and body schemas.

Store calls are synchronous and run in the thread pool; encoding runs in the job manager's own
threads, so the event loop only moves bytes.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import AsyncIterator, Callable

from sparkv.extras import SERVER_MODULES, require_all

require_all(SERVER_MODULES, feature="the REST server (sparkv.server.app)")

from anyio import to_thread  # noqa: E402 - after the check that names the missing extra
from fastapi import FastAPI  # noqa: E402

from sparkv.server.config import Settings
from sparkv.server.handlers import install_error_handlers
from sparkv.server.middleware import install_middleware
from sparkv.server.models import ModelRegistry
from sparkv.server.openapi import install_openapi, operation_id
from sparkv.server.routes import ROUTERS
from sparkv.server.state import ServerState
from sparkv.server.stores import Store
from sparkv.server.version import __version__

__all__ = ["create_app", "__version__"]

DESCRIPTION = ("Pre-encodes the KV cache of long contexts and serves its chunks. "
               "See docs/rest-api.md.")


def lifespan(state: ServerState) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """Startup (resume jobs, optionally load every model) and shutdown (stop the jobs
    gracefully, close the store)."""

    @asynccontextmanager
    async def run(app: FastAPI) -> AsyncIterator[None]:
        await to_thread.run_sync(state.jobs.start)
        if state.settings.preload_models:
            for name in state.registry.names():
                await to_thread.run_sync(state.registry.get, name)
        yield
        await to_thread.run_sync(state.jobs.shutdown, True)
        state.store.close()

    return run


def create_app(settings: Settings, store: Store | None = None,
               registry: ModelRegistry | None = None) -> FastAPI:
    """The sparkv server app.

    Args:
        settings: see :class:`~sparkv.server.config.Settings`.
        store: a store to use instead of opening ``settings.store``.
        registry: a model registry to use instead of building one from ``settings.models``.
    """
    state = ServerState.build(settings, store, registry)
    app = FastAPI(title="sparkv server", version=__version__, description=DESCRIPTION,
                  lifespan=lifespan(state), redirect_slashes=False,
                  generate_unique_id_function=operation_id)
    app.state.sparkv = state
    for router in ROUTERS:
        app.include_router(router)
    install_error_handlers(app, state.metrics)
    install_middleware(app, settings, state.metrics)
    install_openapi(app)
    return app
