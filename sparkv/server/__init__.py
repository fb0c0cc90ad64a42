"""The sparkv server: pre-encodes contexts and serves their KV chunks over HTTP.

    from sparkv.server import create_app, load_settings
    app = create_app(load_settings("server.yaml"))

``sparkv serve`` runs it under uvicorn; ``sparkv encode`` runs the same encoder offline. See
docs/rest-api.md (the HTTP contract) and docs/server.md (stores, configuration, encryption, TLS,
container).
"""

from typing import TYPE_CHECKING, Any

from sparkv.lazy import lazy_exports

if TYPE_CHECKING:
    from fastapi import FastAPI

    from sparkv.server.config import Settings, hash_api_key, load_settings, new_api_key
    from sparkv.server.errors import ApiError, ConfigError, ServerError, StoreError
    from sparkv.server.stores import ChunkKey, FileStore, Store, open_store

#: name -> the module that defines it (imported on first use: :mod:`sparkv.lazy`)
_EXPORTS: dict[str, str] = {
    "Settings": "sparkv.server.config",
    "hash_api_key": "sparkv.server.config",
    "load_settings": "sparkv.server.config",
    "new_api_key": "sparkv.server.config",
    "ApiError": "sparkv.server.errors",
    "ConfigError": "sparkv.server.errors",
    "ServerError": "sparkv.server.errors",
    "StoreError": "sparkv.server.errors",
    "ChunkKey": "sparkv.server.stores",
    "FileStore": "sparkv.server.stores",
    "Store": "sparkv.server.stores",
    "open_store": "sparkv.server.stores",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())


def create_app(settings: "Settings", **kwargs: Any) -> "FastAPI":
    """The FastAPI app (see :func:`sparkv.server.app.create_app`; imported lazily: FastAPI and
    torch load on the first call)."""
    from sparkv.server.app import create_app as _create

    return _create(settings, **kwargs)


__all__ = ["create_app", "Settings", "load_settings", "hash_api_key", "new_api_key", "ApiError",
           "ConfigError", "ServerError", "StoreError", "ChunkKey", "Store", "FileStore",
           "open_store"]
