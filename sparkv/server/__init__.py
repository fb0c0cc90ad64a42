"""The sparkv server: pre-encodes contexts and serves their KV chunks over HTTP.

    from sparkv.server import create_app, load_settings
    app = create_app(load_settings("server.yaml"))

``sparkv serve`` runs it under uvicorn; ``sparkv encode`` runs the same encoder offline. See
docs/rest-api.md (the HTTP contract) and docs/server.md (stores, configuration, encryption, TLS,
container).
"""

from typing import TYPE_CHECKING, Any

from sparkv.server.config import Settings, hash_api_key, load_settings, new_api_key
from sparkv.server.errors import ApiError, ConfigError, ServerError, StoreError
from sparkv.server.stores import ChunkKey, FileStore, Store, open_store

if TYPE_CHECKING:
    from fastapi import FastAPI


def create_app(settings: Settings, **kwargs: Any) -> "FastAPI":
    """The FastAPI app (see :func:`sparkv.server.app.create_app`; imported lazily: FastAPI and
    torch load on the first call)."""
    from sparkv.server.app import create_app as _create

    return _create(settings, **kwargs)


__all__ = ["create_app", "Settings", "load_settings", "hash_api_key", "new_api_key", "ApiError",
           "ConfigError", "ServerError", "StoreError", "ChunkKey", "Store", "FileStore",
           "open_store"]
