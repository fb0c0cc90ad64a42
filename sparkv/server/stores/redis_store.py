"""``redis://host:port/db``: the store's three parts (:class:`RedisChunks`,
:class:`RedisManifests`, :class:`RedisJobs`) in one Redis database, over one :class:`RedisKeys`.

Keys (``P`` is the prefix, ``sparkv`` unless the URL says ``?prefix=...``)::

    P:t:<tenant>:c:<context_id>:k:<t>.<l>.<g>.<level>   a frame (string)
    P:t:<tenant>:c:<context_id>:idx                       set of the context's frame names
    P:t:<tenant>:c:<context_id>:tok                       token ids (string, u32 LE each)
    P:t:<tenant>:c:<context_id>:m                         the manifest (string), written last
    P:t:<tenant>:ctx                                      set of visible context ids
    P:t:<tenant>:j:<job_id>                               a job record
    P:jobs                                                set of "<tenant>/<job_id>"

A Redis ``SET`` is atomic, so a frame is seen whole or not at all; a frame and its index entry are
written in one ``MULTI`` transaction. The token ids are one string outside the frame index (so
``keys`` does not see them). The manifest is written after every chunk and the token ids
(the encoder's order); durability across a Redis restart is Redis's own (use ``appendonly yes``,
as docker-compose.yml does). Deleting a context removes the manifest and the visibility entry in
one transaction, then the token ids and the frames. A read with ``max_bytes`` asks for the
value's length and at most ``max_bytes + 1`` of its bytes in one round trip (``STRLEN``,
``GETRANGE``): a larger value is never transferred.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, TypeVar
from sparkv.server.errors import StoreError
from sparkv.server.stores.base import (ChunkKey, ChunkStore, JobStore, ManifestStore, Store,
                                       ValueTooLarge, check_names)
from sparkv.server.stores.redis_url import parse_redis_url

_DELETE_BATCH = 512
_T = TypeVar("_T")


class RedisKeys:
    """The connection, the key prefix and the key names the three parts share.

    Args:
        url: ``redis://[user:password@]host:port/db[?prefix=NAME]`` (``rediss://`` for TLS).
    """

    def __init__(self, url: str, client: Any = None) -> None:
        from sparkv.extras import require

        redis = require("redis", feature="the Redis store and queue")

        self._redis = redis
        target = parse_redis_url(url)
        self.prefix = target.prefix
        self.url = target.public  # no password
        try:
            self.client: Any = client or redis.Redis.from_url(
                target.connect, socket_connect_timeout=5, socket_timeout=30,
                health_check_interval=30)
        except (ValueError, redis.RedisError) as exc:
            raise StoreError(f"bad Redis URL {self.url}: {exc}") from exc

    def context(self, tenant: str, context_id: str) -> str:
        return f"{self.prefix}:t:{tenant}:c:{context_id}"

    def visible(self, tenant: str) -> str:
        return f"{self.prefix}:t:{tenant}:ctx"

    def job(self, tenant: str, job_id: str) -> str:
        return f"{self.prefix}:t:{tenant}:j:{job_id}"

    def call(self, what: str, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)``; a Redis error is a :class:`StoreError` naming ``what``."""
        try:
            return fn(*args)
        except self._redis.RedisError as exc:
            raise StoreError(f"Redis {self.url}: cannot {what}: {exc}") from exc

    def close(self) -> None:
        try:
            self.client.close()
        except self._redis.RedisError:
            pass


class RedisChunks(ChunkStore):
    """Frames (one string each, and an index set per context) and token ids (module
    docstring)."""

    def __init__(self, keys: RedisKeys) -> None:
        self.k = keys

    def put(self, tenant: str, context_id: str, key: ChunkKey, data: bytes, *,
            later: bool = False) -> None:
        # ``later`` changes nothing: a frame is as durable as Redis makes it once SET returns
        check_names(tenant, context_id, key)
        base = self.k.context(tenant, context_id)

        def run() -> None:
            pipe = self.k.client.pipeline(transaction=True)
            pipe.set(f"{base}:k:{key.name()}", bytes(data))
            pipe.sadd(f"{base}:idx", key.name())
            pipe.execute()

        self.k.call(f"write chunk {key.name()}", run)

    def get(self, tenant: str, context_id: str, key: ChunkKey,
            max_bytes: int | None = None) -> bytes | None:
        return self.get_many(tenant, context_id, [key], max_bytes)[0]

    def get_many(self, tenant: str, context_id: str, keys: Iterable[ChunkKey],
                 max_bytes: int | None = None) -> list[bytes | None]:
        check_names(tenant, context_id)
        keys = list(keys)
        if not keys:
            return []
        for k in keys:
            check_names(tenant, None, k)
        base = self.k.context(tenant, context_id)
        names = [f"{base}:k:{k.name()}" for k in keys]
        if max_bytes is None:
            got: list[bytes | None] = self.k.call("read chunks", self.k.client.mget, names)
            return got

        def run() -> list[tuple[int, int, bytes]]:
            pipe = self.k.client.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
                pipe.strlen(name)
                pipe.getrange(name, 0, max_bytes)
            got = pipe.execute()
            return [tuple(got[i:i + 3]) for i in range(0, len(got), 3)]

        out: list[bytes | None] = []
        for key, (exists, size, data) in zip(keys, self.k.call("read chunks", run)):
            if exists and size > max_bytes:
                raise ValueTooLarge(key, size, max_bytes)
            out.append(data if exists else None)
        return out

    def get_range(self, tenant: str, context_id: str, key: ChunkKey, start: int,
                  end: int) -> bytes | None:
        check_names(tenant, context_id, key)
        name = f"{self.k.context(tenant, context_id)}:k:{key.name()}"

        def run() -> bytes | None:
            pipe = self.k.client.pipeline(transaction=False)
            pipe.exists(name)
            pipe.getrange(name, max(0, start), end - 1)
            exists, data = pipe.execute()
            return data if exists and end > start else (b"" if exists else None)

        return self.k.call("read a chunk range", run)

    def keys(self, tenant: str, context_id: str) -> set[ChunkKey]:
        check_names(tenant, context_id)
        names = self.k.call("list chunks", self.k.client.smembers,
                            f"{self.k.context(tenant, context_id)}:idx")
        out = set()
        for n in names:
            try:
                out.add(ChunkKey.parse(n.decode()))
            except ValueError:
                continue
        return out

    def put_tokens(self, tenant: str, context_id: str, data: bytes) -> None:
        check_names(tenant, context_id)
        self.k.call("write the token ids", self.k.client.set,
                    f"{self.k.context(tenant, context_id)}:tok", bytes(data))

    def get_tokens(self, tenant: str, context_id: str) -> bytes | None:
        check_names(tenant, context_id)
        return self.k.call("read the token ids", self.k.client.get,
                           f"{self.k.context(tenant, context_id)}:tok")

    def has_tokens(self, tenant: str, context_id: str) -> bool:
        check_names(tenant, context_id)
        return bool(self.k.call("look up the token ids", self.k.client.exists,
                                f"{self.k.context(tenant, context_id)}:tok"))

    def delete(self, tenant: str, context_id: str) -> bool:
        check_names(tenant, context_id)
        base = self.k.context(tenant, context_id)
        client = self.k.client

        def run() -> bool:
            removed_tokens = client.delete(f"{base}:tok")
            names = [n.decode() for n in client.smembers(f"{base}:idx")]
            for i in range(0, len(names), _DELETE_BATCH):
                batch = names[i:i + _DELETE_BATCH]
                pipe = client.pipeline(transaction=True)
                pipe.delete(*[f"{base}:k:{n}" for n in batch])
                pipe.srem(f"{base}:idx", *batch)
                pipe.execute()
            client.delete(f"{base}:idx")
            return bool(removed_tokens or names)

        return self.k.call(f"delete {context_id}", run)


class RedisManifests(ManifestStore):
    """Manifests (one string each) and each tenant's set of visible contexts."""

    def __init__(self, keys: RedisKeys) -> None:
        self.k = keys

    def put(self, tenant: str, context_id: str, data: bytes) -> None:
        check_names(tenant, context_id)

        def run() -> None:
            pipe = self.k.client.pipeline(transaction=True)
            pipe.set(f"{self.k.context(tenant, context_id)}:m", bytes(data))
            pipe.sadd(self.k.visible(tenant), context_id)
            pipe.execute()

        self.k.call("write a manifest", run)

    def get(self, tenant: str, context_id: str) -> bytes | None:
        check_names(tenant, context_id)
        return self.k.call("read a manifest", self.k.client.get,
                           f"{self.k.context(tenant, context_id)}:m")

    def contexts(self, tenant: str) -> list[str]:
        check_names(tenant)
        ids = self.k.call("list contexts", self.k.client.smembers, self.k.visible(tenant))
        return sorted(i.decode() for i in ids)

    def delete(self, tenant: str, context_id: str) -> bool:
        check_names(tenant, context_id)

        def run() -> bool:
            pipe = self.k.client.pipeline(transaction=True)
            pipe.delete(f"{self.k.context(tenant, context_id)}:m")
            pipe.srem(self.k.visible(tenant), context_id)
            removed, _ = pipe.execute()
            return bool(removed)

        return self.k.call(f"hide {context_id}", run)


class RedisJobs(JobStore):
    """Job records (one string each) and the set of every ``<tenant>/<job_id>``."""

    def __init__(self, keys: RedisKeys) -> None:
        self.k = keys
        self.index = f"{keys.prefix}:jobs"

    def put(self, tenant: str, job_id: str, data: bytes) -> None:
        check_names(tenant, job_id=job_id)

        def run() -> None:
            pipe = self.k.client.pipeline(transaction=True)
            pipe.set(self.k.job(tenant, job_id), bytes(data))
            pipe.sadd(self.index, f"{tenant}/{job_id}")
            pipe.execute()

        self.k.call("write a job", run)

    def get(self, tenant: str, job_id: str) -> bytes | None:
        check_names(tenant, job_id=job_id)
        return self.k.call("read a job", self.k.client.get,
                           self.k.job(tenant, job_id))

    def ids(self) -> list[tuple[str, str]]:
        names = self.k.call("list jobs", self.k.client.smembers, self.index)
        out = []
        for n in sorted(x.decode() for x in names):
            tenant, _, job_id = n.partition("/")
            out.append((tenant, job_id))
        return out

    def delete(self, tenant: str, job_id: str) -> None:
        check_names(tenant, job_id=job_id)

        def run() -> None:
            pipe = self.k.client.pipeline(transaction=True)
            pipe.delete(self.k.job(tenant, job_id))
            pipe.srem(self.index, f"{tenant}/{job_id}")
            pipe.execute()

        self.k.call("delete a job", run)


class RedisStore(Store):
    """A :class:`~sparkv.server.stores.base.Store` in Redis: its three parts over one
    :class:`RedisKeys`. See the module docstring.

    Args:
        url: ``redis://[user:password@]host:port/db[?prefix=NAME]`` (``rediss://`` for TLS).
        client: a redis-py client to use instead of connecting to ``url``.
    """

    def __init__(self, url: str, client: Any = None) -> None:
        self.keys = RedisKeys(url, client)
        super().__init__(RedisChunks(self.keys), RedisManifests(self.keys),
                         RedisJobs(self.keys), self.keys.url)

    @property
    def prefix(self) -> str:
        return self.keys.prefix

    def ping(self) -> None:
        self.keys.call("ping", self.keys.client.ping)

    def close(self) -> None:
        self.keys.close()
