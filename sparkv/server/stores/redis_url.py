"""A ``redis://`` (or ``rediss://``) URL as the store and the job queue read it, parsed once.

``redis://[user:password@]host:port/db[?prefix=NAME&...]``: ``prefix`` (default ``sparkv``)
starts every key sparkv writes, so several deployments can share one Redis database; the other
query parameters are redis-py's own (``socket_timeout=...``) and are passed on.
"""

from __future__ import annotations

from typing import NamedTuple
from urllib.parse import parse_qs, urlsplit, urlunsplit

DEFAULT_PREFIX = "sparkv"


class RedisUrl(NamedTuple):
    """The parts of a Redis URL sparkv uses."""

    connect: str
    """What redis-py connects to: the URL with its credentials, without ``prefix``."""
    public: str
    """What logs and errors may show: scheme, host, port and database, no credentials."""
    prefix: str
    """The key prefix."""


def parse_redis_url(url: str) -> RedisUrl:
    """Splits ``url`` into :class:`RedisUrl` (a malformed URL is redis-py's to refuse when it
    connects)."""
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    prefix = (query.pop("prefix", [DEFAULT_PREFIX]) or [DEFAULT_PREFIX])[0]
    rest = "&".join(f"{k}={v}" for k, vs in query.items() for v in vs)
    connect = urlunsplit((parts.scheme, parts.netloc, parts.path, rest, ""))
    netloc = (parts.hostname or "") + (f":{parts.port}" if parts.port else "")
    public = urlunsplit((parts.scheme, netloc, parts.path, "", ""))
    return RedisUrl(connect, public, prefix)
