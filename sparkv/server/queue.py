"""The shared encode-job queue of a cluster (``job_queue: redis``): Redis Streams with a consumer
group, and :class:`QueuedJobManager`, the API replicas' side of it.

Keys (``P`` is the store's prefix, ``sparkv`` unless the URL says ``?prefix=...``)::

    P:q:stream                 the stream of jobs (fields ``tenant``, ``job_id``); group ``workers``
    P:q:active:<tenant>        hash context id -> job id of its queued or running job
    P:q:latest:<tenant>        hash context id -> job id of its latest job (any state)
    P:q:cancel:<job_id>        set while the job's context is being deleted (expires in a day)
    P:q:workers                hash worker name -> last heartbeat (unix seconds)

Delivery is at least once. A worker reads a job with ``XREADGROUP`` (the entry becomes *pending*
under its name), heartbeats it while it encodes (``XCLAIM`` of its own entry, which resets the
entry's idle time, only while it still owns it) and ``XACK``s it when the job is final. A worker
that dies stops heartbeating; after ``queue_claim_idle_s`` another worker takes the entry over with
``XAUTOCLAIM`` and resumes the job: the frames already stored are reused (they are written whole,
in one transaction each), the rest encoded, the manifest published last. Running a job twice is
harmless (frames are deterministic and content-addressed; the manifest is the same bytes).

The job records themselves (state, phase, progress) stay where the single-process server keeps
them, in the store (``put_job``), so any replica answers ``GET /v1/jobs/{id}`` with what the
worker wrote last (at least every :data:`PERSIST_EVERY_S` seconds).
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from typing import Any
from urllib.parse import parse_qs, urlsplit, urlunsplit

from sparkv.server.config import Settings
from sparkv.server.encoder import ContextSpec, backfill_tokens
from sparkv.server.errors import ApiError, StoreError
from sparkv.server.jobs import SubmitResult
from sparkv.server.metrics import ServerMetrics
from sparkv.server.models import ModelRegistry
from sparkv.server.stores.base import ChunkStore

log = logging.getLogger("sparkv.server.queue")

GROUP = "workers"
PERSIST_EVERY_S = 0.5
CANCEL_TTL_S = 24 * 3600
ENCRYPTED_REFUSED = ("encrypted contexts need the in-process job queue (job_queue: local): their "
                     "key lives only in the memory of the process that encodes them, and a "
                     "cluster's workers are other processes; send encrypt=false, or use a "
                     "single-process server for encrypted contexts")

# Heartbeat: re-claim our own pending entry (resets its idle time) only if we still own it.
_HEARTBEAT = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if p[1] == nil or p[1][2] ~= ARGV[3] then return 0 end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, ARGV[2], 'JUSTID')
return 1
"""
# Release a context's active-job slot only if it still names this job.
_RELEASE = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  return redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
"""


class QueueError(StoreError):
    """The queue's Redis cannot be reached or answered an error."""


def queue_url(settings: Settings) -> str:
    """The Redis URL of the job queue: ``job_queue`` itself, or the store's for ``redis``."""
    if settings.job_queue == "local":
        raise QueueError("job_queue is 'local': there is no shared queue")
    return settings.store if settings.job_queue == "redis" else settings.job_queue


class RedisJobQueue:
    """Redis Streams operations of the job queue (see the module docstring).

    Args:
        url: ``redis://host:port/db[?prefix=NAME]``.
        claim_idle_s: how long an entry's worker may stay silent before another claims it.
    """

    def __init__(self, url: str, claim_idle_s: float = 5.0, client: Any | None = None) -> None:
        import redis

        self._redis = redis
        parts = urlsplit(url)
        query = parse_qs(parts.query)
        self.prefix = (query.pop("prefix", ["sparkv"]) or ["sparkv"])[0]
        rest = "&".join(f"{k}={v}" for k, vs in query.items() for v in vs)
        clean = urlunsplit((parts.scheme, parts.netloc, parts.path, rest, ""))
        self.url = urlunsplit((parts.scheme, (parts.hostname or "") +
                               (f":{parts.port}" if parts.port else ""), parts.path, "", ""))
        self.claim_idle_ms = int(claim_idle_s * 1000)
        try:
            self.client = client or redis.Redis.from_url(clean, socket_connect_timeout=5,
                                                         socket_timeout=30)
        except (ValueError, redis.RedisError) as exc:
            raise QueueError(f"bad queue URL {self.url}: {exc}") from exc
        self.stream = f"{self.prefix}:q:stream"
        self._heartbeat = self.client.register_script(_HEARTBEAT)
        self._release = self.client.register_script(_RELEASE)
        self._group_ready = False

    def _call(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, **kw)
        except self._redis.RedisError as exc:
            raise QueueError(f"job queue {self.url}: cannot {what}: {exc}") from exc

    def _key(self, kind: str, name: str) -> str:
        return f"{self.prefix}:q:{kind}:{name}"

    # --- group --------------------------------------------------------------------------------
    def ensure_group(self) -> None:
        """Creates the stream and its consumer group (idempotent)."""
        if self._group_ready:
            return
        try:
            self.client.xgroup_create(self.stream, GROUP, id="0", mkstream=True)
        except self._redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise QueueError(f"job queue {self.url}: cannot create the group: {exc}") from exc
        except self._redis.RedisError as exc:
            raise QueueError(f"job queue {self.url}: cannot create the group: {exc}") from exc
        self._group_ready = True

    # --- contexts -----------------------------------------------------------------------------
    def claim_context(self, tenant: str, context_id: str, job_id: str) -> str:
        """Makes ``job_id`` the context's active job unless one is; returns the active job id."""
        key = self._key("active", tenant)

        def run() -> str:
            if self.client.hsetnx(key, context_id, job_id):
                return job_id
            cur = self.client.hget(key, context_id)
            return cur.decode() if cur else self.claim_context(tenant, context_id, job_id)

        return str(self._call("claim a context", run))

    def release_context(self, tenant: str, context_id: str, job_id: str) -> None:
        """Frees the context's active slot if it still names ``job_id``."""
        self._call("release a context", self._release,
                   keys=[self._key("active", tenant)], args=[context_id, job_id])

    def active_job(self, tenant: str, context_id: str) -> str | None:
        v = self._call("read the active job", self.client.hget, self._key("active", tenant),
                       context_id)
        return v.decode() if v else None

    def active_jobs(self, tenant: str) -> dict[str, str]:
        """``{context id: job id}`` of the tenant's queued and running jobs."""
        raw = self._call("list active jobs", self.client.hgetall, self._key("active", tenant))
        return {k.decode(): v.decode() for k, v in raw.items()}

    def set_latest(self, tenant: str, context_id: str, job_id: str) -> None:
        self._call("record the latest job", self.client.hset, self._key("latest", tenant),
                   context_id, job_id)

    def latest_job(self, tenant: str, context_id: str) -> str | None:
        v = self._call("read the latest job", self.client.hget, self._key("latest", tenant),
                       context_id)
        return v.decode() if v else None

    # --- cancellation -------------------------------------------------------------------------
    def cancel(self, job_id: str) -> None:
        self._call("cancel a job", self.client.set, self._key("cancel", job_id), b"1",
                   ex=CANCEL_TTL_S)

    def is_cancelled(self, job_id: str) -> bool:
        return bool(self._call("read a cancellation", self.client.exists,
                               self._key("cancel", job_id)))

    # --- the stream ---------------------------------------------------------------------------
    def enqueue(self, tenant: str, job_id: str) -> str:
        """Adds a job to the stream; returns the entry id."""
        self.ensure_group()
        mid = self._call("enqueue a job", self.client.xadd, self.stream,
                         {"tenant": tenant, "job_id": job_id})
        return mid.decode() if isinstance(mid, bytes) else str(mid)

    def depth(self) -> int:
        """Entries not yet acknowledged (waiting or being worked on)."""
        return int(self._call("count queued jobs", self.client.xlen, self.stream) or 0)

    def take(self, consumer: str, block_ms: int = 1000) -> tuple[str, str, str] | None:
        """The next job for ``consumer``: an abandoned entry (silent for ``claim_idle_s``) first,
        else a new one (blocking up to ``block_ms``). ``(entry id, tenant, job id)`` or ``None``."""
        self.ensure_group()
        res = self._call("claim abandoned jobs", self.client.xautoclaim, self.stream, GROUP,
                         consumer, self.claim_idle_ms, start_id="0-0", count=1)
        entries = res[1] if res and len(res) > 1 else []
        entries = [e for e in entries if e and e[1]]
        if not entries:
            got = self._call("read the queue", self.client.xreadgroup, GROUP, consumer,
                             {self.stream: ">"}, count=1, block=block_ms)
            entries = got[0][1] if got else []
        if not entries:
            return None
        mid, fields = entries[0]
        mid = mid.decode() if isinstance(mid, bytes) else str(mid)
        f = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes)
                                                              else v) for k, v in fields.items()}
        return mid, f.get("tenant", ""), f.get("job_id", "")

    def heartbeat(self, consumer: str, entry_id: str) -> bool:
        """Resets the entry's idle time; ``False`` when another worker has taken it over."""
        return bool(self._call("heartbeat", self._heartbeat, keys=[self.stream],
                               args=[GROUP, entry_id, consumer]))

    def ack(self, entry_id: str) -> None:
        """The job is final: removes its entry."""
        def run() -> None:
            pipe = self.client.pipeline(transaction=True)
            pipe.xack(self.stream, GROUP, entry_id)
            pipe.xdel(self.stream, entry_id)
            pipe.execute()

        self._call("acknowledge a job", run)

    def requeue(self, entry_id: str, tenant: str, job_id: str) -> None:
        """Gives a job back at once (a worker stopping gracefully): ack it and add it again."""
        def run() -> None:
            pipe = self.client.pipeline(transaction=True)
            pipe.xack(self.stream, GROUP, entry_id)
            pipe.xdel(self.stream, entry_id)
            pipe.xadd(self.stream, {"tenant": tenant, "job_id": job_id})
            pipe.execute()

        self._call("requeue a job", run)

    def worker_seen(self, name: str) -> None:
        self._call("record a worker", self.client.hset, f"{self.prefix}:q:workers", name,
                   f"{time.time():.3f}")

    def workers(self) -> dict[str, float]:
        """Worker name -> last heartbeat (unix seconds)."""
        raw = self._call("list workers", self.client.hgetall, f"{self.prefix}:q:workers")
        return {k.decode(): float(v) for k, v in raw.items()}

    def close(self) -> None:
        try:
            self.client.close()
        except self._redis.RedisError:
            pass


def new_record(spec: ContextSpec, context_id: str, total: int) -> dict[str, Any]:
    """A fresh ``queued`` job record (the same fields as the in-process manager's)."""
    return {
        "job_id": secrets.token_hex(16), "tenant": spec.tenant, "context_id": context_id,
        "state": "queued", "phase": "queued", "done": 0, "total": total, "error": None,
        "attempts": 0, "resumed": False, "created_unix": time.time(), "started_unix": None,
        "finished_unix": None, "num_tokens": spec.num_tokens, "model": spec.model,
        "levels": list(spec.levels), "encrypted": spec.encrypted, "timings": {},
        "spec": spec.to_record(),
    }


class QueuedJobManager:
    """The API replicas' job manager with ``job_queue: redis``: the same methods as
    :class:`~sparkv.server.jobs.JobManager`, but jobs go to the shared queue (run by
    ``sparkv worker``) and every answer comes from Redis, so any replica gives the same one."""

    def __init__(self, store: ChunkStore, registry: ModelRegistry, settings: Settings,
                 metrics: ServerMetrics | None = None, queue: RedisJobQueue | None = None) -> None:
        self.store = store
        self.registry = registry
        self.settings = settings
        self.metrics = metrics or ServerMetrics()
        self.queue = queue or RedisJobQueue(queue_url(settings), settings.queue_claim_idle_s)
        self._closed = False

    def _load(self, tenant: str, job_id: str) -> dict[str, Any] | None:
        raw = self.store.get_job(tenant, job_id)
        if raw is None:
            return None
        try:
            rec = json.loads(raw)
        except ValueError:
            return None
        return rec if isinstance(rec, dict) else None

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Creates the queue's group; recovery is the workers' (they claim abandoned jobs)."""
        self.queue.ensure_group()

    def shutdown(self, wait: bool = False, timeout: float = 5.0) -> None:
        self._closed = True
        self.queue.close()

    # --- queries ------------------------------------------------------------------------------
    def active_count(self) -> int:
        """Jobs in the shared queue (every replica sees the same number)."""
        try:
            return self.queue.depth()
        except QueueError:
            return 0

    def active_jobs(self, tenant: str) -> list[dict[str, Any]]:
        out = []
        for cid, job_id in self.queue.active_jobs(tenant).items():
            rec = self._load(tenant, job_id)
            out.append(rec or {"job_id": job_id, "context_id": cid, "state": "queued"})
        return out

    def get(self, tenant: str, job_id: str) -> dict[str, Any] | None:
        rec = self._load(tenant, job_id)
        if rec is None or rec.get("tenant") != tenant:
            return None
        return rec

    def for_context(self, tenant: str, context_id: str) -> dict[str, Any] | None:
        job_id = (self.queue.active_job(tenant, context_id) or
                  self.queue.latest_job(tenant, context_id))
        return self.get(tenant, job_id) if job_id else None

    # --- submit / cancel ----------------------------------------------------------------------
    def submit(self, spec: ContextSpec, context_id: str, total: int) -> SubmitResult:
        """Queues an encode unless the context exists or has an active job (see
        :class:`~sparkv.server.jobs.SubmitResult`).

        Raises:
            ApiError: 400 ``encryption_unsupported`` (encrypted contexts need ``job_queue:
                local``); 409 ``context_busy`` while the context is being deleted; 503
                ``too_many_jobs`` when the queue is full.
        """
        tenant = spec.tenant
        if spec.encrypted:
            raise ApiError(400, "encryption_unsupported", ENCRYPTED_REFUSED)
        active = self.queue.active_job(tenant, context_id)
        if active is not None:
            return self._existing(tenant, active)
        if self.store.get_manifest(tenant, context_id) is not None:
            backfill_tokens(self.store, spec, context_id)
            latest = self.queue.latest_job(tenant, context_id)
            return SubmitResult("done", self.get(tenant, latest) if latest else None, False)
        depth = self.queue.depth()
        if depth >= self.settings.max_queued_jobs or self._closed:
            raise ApiError(503, "too_many_jobs", f"{depth} encode jobs are queued or running; "
                           "retry later", headers={"Retry-After": "5"})
        rec = new_record(spec, context_id, total)
        job_id = rec["job_id"]
        self.store.put_job(tenant, job_id, json.dumps(rec).encode())
        winner = self.queue.claim_context(tenant, context_id, job_id)
        if winner != job_id:  # another replica queued it a moment ago
            self.store.delete_job(tenant, job_id)
            return self._existing(tenant, winner)
        self.queue.set_latest(tenant, context_id, job_id)
        self.queue.enqueue(tenant, job_id)
        self.metrics.jobs.labels("submitted").inc()
        return SubmitResult("queued", dict(rec), True, None)

    def _existing(self, tenant: str, job_id: str) -> SubmitResult:
        if self.queue.is_cancelled(job_id):
            raise ApiError(409, "context_busy", "this context is being deleted; retry in a "
                           "moment", headers={"Retry-After": "1"})
        rec = self.get(tenant, job_id)
        return SubmitResult(str((rec or {}).get("state", "queued")), rec, False)

    def delete_context(self, tenant: str, context_id: str) -> bool:
        """Flags the context's job (if any) as cancelled, then deletes what is stored. The
        worker stops at its next frame, removes what it wrote and never publishes."""
        job_id = self.queue.active_job(tenant, context_id)
        if job_id is not None:
            self.queue.cancel(job_id)
        existed = self.store.delete(tenant, context_id)
        return existed or job_id is not None
