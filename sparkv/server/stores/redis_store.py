"""``redis://host:port/db``: frames and manifests in a Redis database.

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
``list_chunks`` does not see them). The manifest is written after every chunk and the token ids
(the encoder's order); durability across a Redis restart is Redis's own (use ``appendonly yes``,
as docker-compose.yml does). ``delete`` removes the manifest, the visibility entry and the token
ids in one transaction, then the frames.
"""

from __future__ import annotations

from typing import Iterable
from sparkv.server.errors import StoreError
from sparkv.server.stores.base import ChunkKey, ChunkStore, check_names
from sparkv.server.stores.redis_url import parse_redis_url

_DELETE_BATCH = 512


class RedisStore(ChunkStore):
    """A :class:`ChunkStore` in Redis. See the module docstring.

    Args:
        url: ``redis://[user:password@]host:port/db[?prefix=NAME]`` (``rediss://`` for TLS).
    """

    def __init__(self, url: str, client: object | None = None) -> None:
        from sparkv.extras import require

        redis = require("redis", feature="the Redis store and queue")

        self._redis = redis
        target = parse_redis_url(url)
        self.prefix = target.prefix
        self.url = target.public  # no password
        try:
            self.client = client or redis.Redis.from_url(
                target.connect, socket_connect_timeout=5, socket_timeout=30, health_check_interval=30)
        except (ValueError, redis.RedisError) as exc:
            raise StoreError(f"bad Redis URL {self.url}: {exc}") from exc

    # --- keys ---------------------------------------------------------------------------------
    def _ctx(self, tenant: str, context_id: str) -> str:
        return f"{self.prefix}:t:{tenant}:c:{context_id}"

    def _call(self, what: str, fn, *args):  # type: ignore[no-untyped-def]
        try:
            return fn(*args)
        except self._redis.RedisError as exc:
            raise StoreError(f"Redis {self.url}: cannot {what}: {exc}") from exc

    # --- chunks -------------------------------------------------------------------------------
    def put_chunk(self, tenant: str, context_id: str, key: ChunkKey, data: bytes) -> None:
        check_names(tenant, context_id, key)
        base = self._ctx(tenant, context_id)

        def run() -> None:
            pipe = self.client.pipeline(transaction=True)
            pipe.set(f"{base}:k:{key.name()}", bytes(data))
            pipe.sadd(f"{base}:idx", key.name())
            pipe.execute()

        self._call(f"write chunk {key.name()}", run)

    def get_chunk(self, tenant: str, context_id: str, key: ChunkKey) -> bytes | None:
        check_names(tenant, context_id, key)
        return self._call("read a chunk", self.client.get,
                          f"{self._ctx(tenant, context_id)}:k:{key.name()}")

    def get_chunks(self, tenant: str, context_id: str, keys: Iterable[ChunkKey]
                   ) -> list[bytes | None]:
        check_names(tenant, context_id)
        keys = list(keys)
        if not keys:
            return []
        for k in keys:
            check_names(tenant, None, k)
        base = self._ctx(tenant, context_id)
        return self._call("read chunks", self.client.mget, [f"{base}:k:{k.name()}" for k in keys])

    def get_chunk_range(self, tenant: str, context_id: str, key: ChunkKey, start: int,
                        end: int) -> bytes | None:
        check_names(tenant, context_id, key)
        name = f"{self._ctx(tenant, context_id)}:k:{key.name()}"

        def run() -> bytes | None:
            pipe = self.client.pipeline(transaction=False)
            pipe.exists(name)
            pipe.getrange(name, max(0, start), end - 1)
            exists, data = pipe.execute()
            return data if exists and end > start else (b"" if exists else None)

        return self._call("read a chunk range", run)

    def list_chunks(self, tenant: str, context_id: str) -> set[ChunkKey]:
        check_names(tenant, context_id)
        names = self._call("list chunks", self.client.smembers,
                           f"{self._ctx(tenant, context_id)}:idx")
        out = set()
        for n in names:
            try:
                out.add(ChunkKey.parse(n.decode()))
            except ValueError:
                continue
        return out

    # --- token ids ----------------------------------------------------------------------------
    def put_tokens(self, tenant: str, context_id: str, data: bytes) -> None:
        check_names(tenant, context_id)
        self._call("write the token ids", self.client.set,
                   f"{self._ctx(tenant, context_id)}:tok", bytes(data))

    def get_tokens(self, tenant: str, context_id: str) -> bytes | None:
        check_names(tenant, context_id)
        return self._call("read the token ids", self.client.get,
                          f"{self._ctx(tenant, context_id)}:tok")

    def has_tokens(self, tenant: str, context_id: str) -> bool:
        check_names(tenant, context_id)
        return bool(self._call("look up the token ids", self.client.exists,
                               f"{self._ctx(tenant, context_id)}:tok"))

    # --- manifests ----------------------------------------------------------------------------
    def put_manifest(self, tenant: str, context_id: str, data: bytes) -> None:
        check_names(tenant, context_id)

        def run() -> None:
            pipe = self.client.pipeline(transaction=True)
            pipe.set(f"{self._ctx(tenant, context_id)}:m", bytes(data))
            pipe.sadd(f"{self.prefix}:t:{tenant}:ctx", context_id)
            pipe.execute()

        self._call("write a manifest", run)

    def get_manifest(self, tenant: str, context_id: str) -> bytes | None:
        check_names(tenant, context_id)
        return self._call("read a manifest", self.client.get, f"{self._ctx(tenant, context_id)}:m")

    def list_contexts(self, tenant: str) -> list[str]:
        check_names(tenant)
        ids = self._call("list contexts", self.client.smembers, f"{self.prefix}:t:{tenant}:ctx")
        return sorted(i.decode() for i in ids)

    def delete(self, tenant: str, context_id: str) -> bool:
        check_names(tenant, context_id)
        base = self._ctx(tenant, context_id)

        def run() -> bool:
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(f"{base}:m")
            pipe.srem(f"{self.prefix}:t:{tenant}:ctx", context_id)
            pipe.delete(f"{base}:tok")
            removed, _, removed_tokens = pipe.execute()
            names = [n.decode() for n in self.client.smembers(f"{base}:idx")]
            for i in range(0, len(names), _DELETE_BATCH):
                batch = names[i:i + _DELETE_BATCH]
                pipe = self.client.pipeline(transaction=True)
                pipe.delete(*[f"{base}:k:{n}" for n in batch])
                pipe.srem(f"{base}:idx", *batch)
                pipe.execute()
            self.client.delete(f"{base}:idx")
            return bool(removed or removed_tokens or names)

        return self._call(f"delete {context_id}", run)

    # --- jobs ---------------------------------------------------------------------------------
    def put_job(self, tenant: str, job_id: str, data: bytes) -> None:
        check_names(tenant, job_id=job_id)

        def run() -> None:
            pipe = self.client.pipeline(transaction=True)
            pipe.set(f"{self.prefix}:t:{tenant}:j:{job_id}", bytes(data))
            pipe.sadd(f"{self.prefix}:jobs", f"{tenant}/{job_id}")
            pipe.execute()

        self._call("write a job", run)

    def get_job(self, tenant: str, job_id: str) -> bytes | None:
        check_names(tenant, job_id=job_id)
        return self._call("read a job", self.client.get, f"{self.prefix}:t:{tenant}:j:{job_id}")

    def list_jobs(self) -> list[tuple[str, str]]:
        names = self._call("list jobs", self.client.smembers, f"{self.prefix}:jobs")
        out = []
        for n in sorted(x.decode() for x in names):
            tenant, _, job_id = n.partition("/")
            out.append((tenant, job_id))
        return out

    def delete_job(self, tenant: str, job_id: str) -> None:
        check_names(tenant, job_id=job_id)

        def run() -> None:
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(f"{self.prefix}:t:{tenant}:j:{job_id}")
            pipe.srem(f"{self.prefix}:jobs", f"{tenant}/{job_id}")
            pipe.execute()

        self._call("delete a job", run)

    def ping(self) -> None:
        self._call("ping", self.client.ping)

    def close(self) -> None:
        try:
            self.client.close()
        except self._redis.RedisError:
            pass
