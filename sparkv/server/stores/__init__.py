"""Stores, chosen by URL: ``file:///path`` (default) or ``redis://host:port/db``; each is a
:class:`Store` of three parts split by what they store (:class:`ChunkStore`: frames and token
ids; :class:`ManifestStore`; :class:`JobStore`), docs/server.md "The store"."""

from __future__ import annotations

import os
from urllib.parse import unquote, urlsplit

from sparkv.server.errors import StoreError
from sparkv.server.stores.base import (ChunkKey, ChunkStore, JobStore, ManifestStore, Store,
                                       ValueTooLarge)
from sparkv.server.stores.file_store import FileStore

SCHEMES = ("file", "redis", "rediss")


def file_path_of(url: str) -> str:
    """The directory of a ``file:`` URL: ``file:///abs``, ``file://./rel``, ``file:rel`` or a
    plain path."""
    parts = urlsplit(url)
    if parts.scheme in ("", "file") and parts.netloc in ("", "localhost"):
        path = unquote(parts.path)
    elif parts.scheme == "file" and parts.netloc in (".", ".."):
        path = parts.netloc + unquote(parts.path)
    else:
        raise StoreError(f"unsupported file store URL {url!r}: use file:///absolute/path or "
                         "file://./relative/path")
    if not path:
        raise StoreError(f"the file store URL {url!r} names no directory")
    return os.path.expanduser(path)


def open_store(url: str) -> Store:
    """Opens the store a URL names. Raises :class:`StoreError` for unknown schemes or bad URLs."""
    scheme = urlsplit(url).scheme
    if scheme in ("", "file"):
        return FileStore(file_path_of(url), url=url)
    if scheme in ("redis", "rediss"):
        from sparkv.server.stores.redis_store import RedisStore

        return RedisStore(url)
    raise StoreError(f"unsupported store URL scheme {scheme!r} in {url!r}; use one of "
                     f"{', '.join(s + '://' for s in SCHEMES)}")


__all__ = ["ChunkKey", "ChunkStore", "ManifestStore", "JobStore", "Store", "ValueTooLarge",
           "FileStore", "open_store", "file_path_of", "SCHEMES"]
