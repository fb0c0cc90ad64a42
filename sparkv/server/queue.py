"""The shared encode-job queue of a cluster (``job_queue: redis``): Redis Streams with a consumer
group. :class:`RedisJobQueue` is every Redis operation of it; the API replicas' side is
:class:`~sparkv.server.queued_jobs.QueuedJobManager`, the workers' :mod:`sparkv.server.worker`.

Keys (``P`` is the store's prefix, ``sparkv`` unless the URL says ``?prefix=...``)::

    P:q:stream                 the stream of jobs (fields ``tenant``, ``job_id``); group ``workers``
    P:q:epoch                  the queue's epoch: a random id written whenever the group is created
    P:q:active:<tenant>        hash context id -> job id of its queued or running job
    P:q:latest:<tenant>        hash context id -> job id of its latest job (any state)
    P:q:cancel:<job_id>        set while the job's context is being deleted (expires in a day)
    P:q:workers                hash worker name -> last heartbeat (unix seconds)
    P:q:worker:<name>          a live worker's heartbeat (expires after WORKER_TTL_S)

Delivery is at least once. A worker reads a job with ``XREADGROUP`` (the entry becomes *pending*
under its name), heartbeats it while it encodes (``XCLAIM`` of its own entry, which resets the
entry's idle time, only while it still owns it) and ``XACK``s it when the job is final. A worker
that dies stops heartbeating; after ``queue_claim_idle_s`` another worker takes the entry over with
``XAUTOCLAIM`` and resumes the job: the frames already stored are reused (they are written whole,
in one transaction each), the rest encoded, the manifest published last. Running a job twice is
harmless (frames are deterministic and content-addressed; the manifest is the same bytes).

**Surviving Redis.** A Redis that restarts without persistence comes back empty: no stream, no
group, no epoch. Every call that finds the group missing (``NOGROUP``) or the connection broken
forgets that the group exists; the next :meth:`RedisJobQueue.ensure_group` creates the stream, the
group and a new epoch in one script. The epoch tells who needs to know that the queue lost its
entries: a job is submitted in one epoch (its record says ``queue_epoch``) and lives only as long
as that epoch does; submitting checks the epoch and adds the entry in one script, and a worker's
heartbeat fails with :class:`QueueReset` once the epoch changed. A Redis that keeps its data
(``appendonly yes``) keeps its epoch: nothing is lost, nothing is reported lost.

The job records themselves (state, phase, progress) stay where the single-process server keeps
them, in the store (``store.jobs.put``), so any replica answers ``GET /v1/jobs/{id}`` with what the
worker wrote last (at least every :data:`PERSIST_EVERY_S` seconds).
"""

from __future__ import annotations

import secrets
import time
from typing import Any, NamedTuple

from sparkv.server.config import Settings
from sparkv.server.errors import StoreError
from sparkv.server.stores.redis_url import parse_redis_url

GROUP = "workers"
PERSIST_EVERY_S = 0.5
CANCEL_TTL_S = 24 * 3600
WORKER_TTL_S = 15.0
"""A worker's heartbeat key expires this long after its last beat: ``/healthz`` says the queue is
degraded (``no_worker``) at most this long after the last worker died (at once when it stops)."""
ENCRYPTED_REFUSED = ("encrypted contexts need the in-process job queue (job_queue: local): their "
                     "key lives only in the memory of the process that encodes them, and a "
                     "cluster's workers are other processes; send encrypt=false, or use a "
                     "single-process server for encrypted contexts")
RESUBMIT = "; submit the context again (the same POST /v1/contexts) to encode it"
LOST_IN_QUEUE = ("the job queue's Redis restarted without its data and lost this job before it "
                 "finished" + RESUBMIT)
"""The ``error`` of a job whose queue entry was lost (its record says ``"state": "lost"``)."""

# Creates the stream and the group; a new epoch when the group is new (or the epoch is missing).
_ENSURE_GROUP = """
local ok = redis.pcall('XGROUP', 'CREATE', KEYS[1], ARGV[1], '0', 'MKSTREAM')
if type(ok) == 'table' and ok.err then
  if not string.find(ok.err, 'BUSYGROUP', 1, true) then return redis.error_reply(ok.err) end
  local cur = redis.call('GET', KEYS[2])
  if cur then return cur end
end
redis.call('SET', KEYS[2], ARGV[2])
return ARGV[2]
"""
# Heartbeat: -1 when the epoch changed; else re-claim our own pending entry (resets its idle
# time) only if we still own it (1), 0 when another worker has it.
_HEARTBEAT = """
if ARGV[4] ~= '' and redis.call('GET', KEYS[2]) ~= ARGV[4] then return -1 end
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if p[1] == nil or p[1][2] ~= ARGV[3] then return 0 end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, ARGV[2], 'JUSTID')
return 1
"""
# Submit in the given epoch: claim the context's active slot, record the latest job, add the entry.
_SUBMIT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {'reset', ''} end
if redis.call('HSETNX', KEYS[2], ARGV[2], ARGV[3]) == 0 then
  return {'busy', redis.call('HGET', KEYS[2], ARGV[2])}
end
redis.call('HSET', KEYS[3], ARGV[2], ARGV[3])
return {'queued', redis.call('XADD', KEYS[4], '*', 'tenant', ARGV[4], 'job_id', ARGV[3])}
"""
# Release a context's active-job slot only if it still names this job.
_RELEASE = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  return redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
"""
# Live workers: names in the hash whose heartbeat key still exists (the others are forgotten).
_LIVE_WORKERS = """
local alive = 0
for _, name in ipairs(redis.call('HKEYS', KEYS[1])) do
  if redis.call('EXISTS', ARGV[1] .. name) == 1 then alive = alive + 1
  else redis.call('HDEL', KEYS[1], name) end
end
return alive
"""


class QueueError(StoreError):
    """The queue's Redis cannot be reached or answered an error."""


class GroupMissing(QueueError):
    """The stream or its consumer group is gone (``NOGROUP``: Redis restarted empty)."""


class QueueReset(QueueError):
    """The queue's epoch changed: the entries of the epoch a job was submitted in are gone."""


class QueueEntry(NamedTuple):
    """One delivery of a job: the stream entry's id, the job's tenant and id."""

    entry_id: str
    tenant: str
    job_id: str


def queue_url(settings: Settings) -> str:
    """The Redis URL of the job queue: ``job_queue`` itself, or the store's for ``redis``."""
    if settings.job_queue == "local":
        raise QueueError("job_queue is 'local': there is no shared queue")
    return settings.store if settings.job_queue == "redis" else settings.job_queue


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class RedisJobQueue:
    """Redis Streams operations of the job queue (see the module docstring).

    State: the redis client (thread-safe, a connection pool) and :attr:`_group_ready`, a flag
    that only avoids re-running the group script on every call; any thread may clear it (a
    ``NOGROUP`` or connection error) or set it. A stale value costs one extra script call or one
    :class:`GroupMissing`, never a wrong answer. No lock.

    Args:
        url: ``redis://host:port/db[?prefix=NAME]``.
        claim_idle_s: how long an entry's worker may stay silent before another claims it.
    """

    def __init__(self, url: str, claim_idle_s: float = 5.0, client: Any | None = None) -> None:
        from sparkv.extras import require

        redis = require("redis", feature="the Redis store and queue")
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._redis = redis
        target = parse_redis_url(url)
        self.prefix = target.prefix
        self.url = target.public  # no password
        self.claim_idle_ms = int(claim_idle_s * 1000)
        try:  # one quick retry (a connection the server closed); outages are the callers' backoff
            self.client = client or redis.Redis.from_url(
                target.connect, socket_connect_timeout=5, socket_timeout=30,
                retry=Retry(NoBackoff(), 1))
        except (ValueError, redis.RedisError) as exc:
            raise QueueError(f"bad queue URL {self.url}: {exc}") from exc
        self.stream = f"{self.prefix}:q:stream"
        self.epoch_key = f"{self.prefix}:q:epoch"
        self._scripts = {name: self.client.register_script(src) for name, src in (
            ("group", _ENSURE_GROUP), ("heartbeat", _HEARTBEAT), ("submit", _SUBMIT),
            ("release", _RELEASE), ("live", _LIVE_WORKERS))}
        self._group_ready = False

    def _call(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        """Runs one Redis call; a Redis error becomes a :class:`QueueError` (:class:`GroupMissing`
        for ``NOGROUP``), and a missing group or a broken connection makes the next
        :meth:`ensure_group` run its script again."""
        try:
            return fn(*args, **kw)
        except self._redis.RedisError as exc:
            nogroup = "NOGROUP" in str(exc)
            if nogroup or isinstance(exc, (self._redis.ConnectionError,
                                           self._redis.TimeoutError)):
                self._group_ready = False
            kind = GroupMissing if nogroup else QueueError
            raise kind(f"job queue {self.url}: cannot {what}: {exc}") from exc

    def _script(self, name: str, what: str, keys: list[str], args: list[Any]) -> Any:
        return self._call(what, self._scripts[name], keys=keys, args=args)

    def _key(self, kind: str, name: str) -> str:
        return f"{self.prefix}:q:{kind}:{name}"

    # --- group and epoch ----------------------------------------------------------------------
    def ensure_group(self) -> None:
        """Creates the stream, its consumer group and, with a new group, a new epoch (one script,
        idempotent; skipped while the group is known to exist)."""
        if not self._group_ready:
            self._create_group()

    def _create_group(self) -> str:
        epoch = _text(self._script("group", "create the group", [self.stream, self.epoch_key],
                                   [GROUP, secrets.token_hex(8)]))
        self._group_ready = True
        return epoch

    def current_epoch(self) -> str:
        """The queue's epoch; creates the group (and a new epoch) when Redis lost them."""
        value = self._call("read the epoch", self.client.get, self.epoch_key)
        return _text(value) if value is not None else self._create_group()

    # --- contexts -----------------------------------------------------------------------------
    def release_context(self, tenant: str, context_id: str, job_id: str) -> None:
        """Frees the context's active slot if it still names ``job_id``."""
        self._script("release", "release a context", [self._key("active", tenant)],
                     [context_id, job_id])

    def active_job(self, tenant: str, context_id: str) -> str | None:
        v = self._call("read the active job", self.client.hget, self._key("active", tenant),
                       context_id)
        return v.decode() if v else None

    def active_jobs(self, tenant: str) -> dict[str, str]:
        """``{context id: job id}`` of the tenant's queued and running jobs."""
        raw = self._call("list active jobs", self.client.hgetall, self._key("active", tenant))
        return {k.decode(): v.decode() for k, v in raw.items()}

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
    def submit(self, tenant: str, context_id: str, job_id: str, epoch: str) -> str | None:
        """Queues the context's job in ``epoch``, in one script: claims the context's active
        slot, records it as the latest job and adds the entry. Returns ``None`` when queued, else
        the job id that already holds the slot.

        Raises:
            QueueReset: the queue's epoch is no longer ``epoch`` (read it again and retry).
        """
        self.ensure_group()
        status, value = self._script(
            "submit", "queue a job", [self.epoch_key, self._key("active", tenant),
                                      self._key("latest", tenant), self.stream],
            [epoch, context_id, job_id, tenant])
        status = _text(status)
        if status == "reset":
            self._group_ready = False
            raise QueueReset(f"job queue {self.url}: the epoch changed while queueing a job")
        return None if status == "queued" else _text(value)

    def enqueue(self, tenant: str, job_id: str) -> str:
        """Adds a job to the stream (no epoch check, no context slot); returns the entry id."""
        self.ensure_group()
        return _text(self._call("enqueue a job", self.client.xadd, self.stream,
                                {"tenant": tenant, "job_id": job_id}))

    def depth(self) -> int:
        """Entries not yet acknowledged (waiting or being worked on)."""
        return int(self._call("count queued jobs", self.client.xlen, self.stream) or 0)

    def take(self, consumer: str, block_ms: int = 1000) -> QueueEntry | None:
        """The next job for ``consumer``: an abandoned entry (silent for ``claim_idle_s``) first,
        else a new one (blocking up to ``block_ms``), or ``None``. A missing group (Redis came
        back empty) is created again and the read retried once."""
        try:
            self.ensure_group()
            return self._take(consumer, block_ms)
        except GroupMissing:
            self.ensure_group()
            return self._take(consumer, block_ms)

    def _take(self, consumer: str, block_ms: int) -> QueueEntry | None:
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
        f = {_text(k): _text(v) for k, v in fields.items()}
        return QueueEntry(_text(mid), f.get("tenant", ""), f.get("job_id", ""))

    def heartbeat(self, consumer: str, entry_id: str, epoch: str | None = None) -> bool:
        """Resets the entry's idle time; ``False`` when another worker has taken it over.

        Raises:
            QueueReset: ``epoch`` is given and the queue's epoch is another (the entry is gone).
        """
        got = int(self._script("heartbeat", "heartbeat", [self.stream, self.epoch_key],
                               [GROUP, entry_id, consumer, epoch or ""]))
        if got < 0:
            raise QueueReset(f"job queue {self.url}: the epoch changed; entry {entry_id} is gone")
        return bool(got)

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

    # --- workers ------------------------------------------------------------------------------
    def worker_alive(self, name: str, ttl_s: float = WORKER_TTL_S) -> None:
        """The worker's heartbeat: its key (expiring after ``ttl_s``) and its name in the index."""
        def run() -> None:
            pipe = self.client.pipeline(transaction=True)
            pipe.hset(f"{self.prefix}:q:workers", name, f"{time.time():.3f}")
            pipe.set(self._key("worker", name), b"1", px=max(1, int(ttl_s * 1000)))
            pipe.execute()

        self._call("record a worker", run)

    def worker_gone(self, name: str) -> None:
        """A worker stopping: its heartbeat ends now, not when its key expires."""
        def run() -> None:
            pipe = self.client.pipeline(transaction=True)
            pipe.hdel(f"{self.prefix}:q:workers", name)
            pipe.delete(self._key("worker", name))
            pipe.execute()

        self._call("forget a worker", run)

    def live_workers(self) -> int:
        """Workers whose heartbeat has not expired (dead ones are dropped from the index)."""
        return int(self._script("live", "count live workers", [f"{self.prefix}:q:workers"],
                                [self._key("worker", "")]))

    def workers(self) -> dict[str, float]:
        """Worker name -> last heartbeat (unix seconds)."""
        raw = self._call("list workers", self.client.hgetall, f"{self.prefix}:q:workers")
        return {k.decode(): float(v) for k, v in raw.items()}

    def close(self) -> None:
        try:
            self.client.close()
        except self._redis.RedisError:
            pass
