"""The sparkv server: pre-encodes contexts and serves their KV chunks over HTTP.

    from sparkv.server import create_app, load_settings
    app = create_app(load_settings("server.yaml"))

``sparkv serve`` runs it under uvicorn; ``sparkv encode`` runs the same encoder offline. See
docs/rest-api.md (the HTTP contract) and docs/server.md (stores, configuration, encryption, TLS,
container).
"""

from sparkv.server.config import Settings, hash_api_key, load_settings, new_api_key
from sparkv.server.errors import ApiError, ConfigError, ServerError, StoreError
from sparkv.server.stores import ChunkKey, FileStore, Store, open_store


def create_app(settings: Settings, **kwargs):  # noqa: ANN001, ANN201 - lazy: FastAPI + torch
    """The FastAPI app (see :func:`sparkv.server.app.create_app`)."""
    from sparkv.server.app import create_app as _create

    return _create(settings, **kwargs)


__all__ = ["create_app", "Settings", "load_settings", "hash_api_key", "new_api_key", "ApiError",
           "ConfigError", "ServerError", "StoreError", "ChunkKey", "Store", "FileStore",
           "open_store"]
