"""The API replicas' job manager in a cluster (``job_queue: redis``): :class:`QueuedJobManager`
puts jobs on the shared queue (:mod:`sparkv.server.queue`) for ``sparkv worker`` and answers
every question from Redis, so any replica gives the same answer.

**Lost jobs.** A Redis without persistence that restarts comes back empty: the queue's entries
are gone, and so are the job records when the store is that same Redis. Such a job never runs; it
is reported ``lost`` (``GET /v1/jobs/{id}``: ``"state": "lost"``, the reason in ``error``) instead
of staying ``queued``. How the loss is seen:

* a job record says in which queue epoch it was submitted (``queue_epoch``); a record still
  ``queued`` or ``running`` whose epoch is not the queue's current one lost its entry
  (:func:`is_orphaned`). This covers a store that survived the restart (``file://``, or another
  Redis than the queue's);
* each replica also keeps its own record of the jobs it queued (:class:`JobLedger`, in memory,
  the newest :data:`LEDGER_SIZE`, without their token ids). A job whose record is gone from the
  store is ``lost`` when the replica that queued it is asked; when a replica sees the epoch
  change it writes ``lost`` records for its jobs whose records are gone, so every replica answers
  the same. A job queued by a replica that has restarted since is not known anywhere: 404.

A client resubmits a lost job by sending the same ``POST /v1/contexts`` again: the same body names
the same context, which has no active job any more, so a new job is queued.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections import OrderedDict
from typing import Any

from sparkv.server.config import Settings
from sparkv.server.encoder import ContextSpec, backfill_tokens
from sparkv.server.errors import ApiError, StoreError
from sparkv.server.jobs import ACTIVE_STATES, QueueHealth, SubmitResult, as_deleted
from sparkv.server.metrics import ServerMetrics
from sparkv.server.models import ModelRegistry
from sparkv.server.queue import (ENCRYPTED_REFUSED, LOST_IN_QUEUE, RESUBMIT, QueueError,
                                 QueueReset, RedisJobQueue, queue_url)
from sparkv.server.stores.base import Store

log = logging.getLogger("sparkv.server.queue")

LEDGER_SIZE = 4096
LOST_RECORD = ("this job's record is gone from the store (its Redis restarted without its data) "
               "and the job with it" + RESUBMIT)


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


def is_orphaned(rec: dict[str, Any], epoch: str) -> bool:
    """A queued or running job submitted in another queue epoch (records without an epoch, from
    before epochs existed, never are)."""
    queued_in = rec.get("queue_epoch")
    return rec.get("state") in ACTIVE_STATES and bool(queued_in) and queued_in != epoch


def as_lost(rec: dict[str, Any], reason: str) -> dict[str, Any]:
    """A copy of the record, ``lost`` for ``reason`` (its phase and progress as last written)."""
    return {**rec, "state": "lost", "error": reason}


class JobLedger:
    """The jobs this replica queued: their first record without the token ids, the newest
    ``size`` (see the module docstring).

    State: an ordered dict job id -> record, guarded by :attr:`_lock` (the manager's methods run
    on the server's thread pool); every method holds the lock for its whole body and calls
    nothing outside.
    """

    def __init__(self, size: int = LEDGER_SIZE) -> None:
        self.size = size
        self._jobs: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, rec: dict[str, Any]) -> None:
        kept = {k: v for k, v in rec.items() if k != "spec"}
        with self._lock:
            self._jobs[rec["job_id"]] = kept
            while len(self._jobs) > self.size:
                self._jobs.popitem(last=False)

    def get(self, tenant: str, job_id: str) -> dict[str, Any] | None:
        with self._lock:
            rec = self._jobs.get(job_id)
        return dict(rec) if rec is not None and rec.get("tenant") == tenant else None

    def forget(self, job_id: str) -> None:
        with self._lock:
            self._jobs.pop(job_id, None)

    def take_other_epochs(self, epoch: str) -> list[dict[str, Any]]:
        """Removes and returns the jobs queued in another epoch than ``epoch``."""
        with self._lock:
            gone = [j for j, r in self._jobs.items() if r.get("queue_epoch") != epoch]
            return [self._jobs.pop(j) for j in gone]

    def __len__(self) -> int:
        with self._lock:
            return len(self._jobs)


class QueuedJobManager:
    """The API replicas' job manager with ``job_queue: redis``: the same methods as
    :class:`~sparkv.server.jobs.JobManager`, but jobs go to the shared queue (run by
    ``sparkv worker``) and every answer comes from Redis, so any replica gives the same one.

    State: the queue and the store (thread-safe clients), :attr:`ledger` (its own lock) and
    :attr:`_epoch_seen`, the last queue epoch this replica reconciled its ledger with. Two threads
    seeing a new epoch at once may both reconcile: writing a ``lost`` record twice is harmless.
    """

    def __init__(self, store: Store, registry: ModelRegistry, settings: Settings,
                 metrics: ServerMetrics | None = None, queue: RedisJobQueue | None = None) -> None:
        self.store = store
        self.registry = registry
        self.settings = settings
        self.metrics = metrics or ServerMetrics()
        self.queue = queue or RedisJobQueue(queue_url(settings), settings.queue_claim_idle_s)
        self.ledger = JobLedger(max(LEDGER_SIZE, settings.max_queued_jobs))
        self._epoch_seen: str | None = None
        self._closed = False

    def _load(self, tenant: str, job_id: str) -> dict[str, Any] | None:
        raw = self.store.jobs.get(tenant, job_id)
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
        self._epoch_seen = self.queue.current_epoch()

    def shutdown(self, wait: bool = False, timeout: float = 5.0) -> None:
        self._closed = True
        self.queue.close()

    # --- lost jobs ----------------------------------------------------------------------------
    def _reconcile(self) -> str:
        """The queue's current epoch. When it changed since the last call, the jobs this replica
        queued in earlier epochs whose records are gone from the store are recorded ``lost``."""
        epoch = self.queue.current_epoch()
        if epoch == self._epoch_seen:
            return epoch
        lost = 0
        for rec in self.ledger.take_other_epochs(epoch):
            if self._load(rec["tenant"], rec["job_id"]) is None:
                self._write(as_lost(rec, LOST_RECORD))
                lost += 1
        if self._epoch_seen is not None:
            log.warning("the job queue's epoch changed (its Redis lost its data): %d job(s) this "
                        "replica queued are recorded lost", lost)
        self._epoch_seen = epoch
        return epoch

    def _write(self, rec: dict[str, Any]) -> None:
        self.store.jobs.put(rec["tenant"], rec["job_id"], json.dumps(rec).encode())

    def queue_health(self) -> QueueHealth:
        """``degraded`` while no worker's heartbeat is live (``no_worker``) or the queue cannot
        be reached (``queue_unreachable``, logged); also reconciles lost jobs."""
        try:
            alive = self.queue.live_workers()
            self._reconcile()
        except StoreError as exc:  # the queue's Redis (or, reconciling, the store's)
            log.warning("health check: the job queue cannot be reached: %s", exc)
            return QueueHealth("degraded", "queue_unreachable")
        return QueueHealth("ok") if alive else QueueHealth("degraded", "no_worker")

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
            if self.queue.is_cancelled(job_id):
                continue   # its context was deleted: the job is winding down
            rec = self.get(tenant, job_id)
            out.append(rec or {"job_id": job_id, "context_id": cid, "state": "queued"})
        return out

    def get(self, tenant: str, job_id: str) -> dict[str, Any] | None:
        """The job's record; ``lost`` (see the module docstring) when the queue lost it."""
        rec = self._load(tenant, job_id)
        if rec is None:
            kept = self.ledger.get(tenant, job_id)
            if kept is None:
                return None
            rec = as_lost(kept, LOST_RECORD)
            self._write(rec)  # every replica answers the same from now on
            self.ledger.forget(job_id)
            return rec
        if rec.get("tenant") != tenant:
            return None
        if rec.get("state") not in ACTIVE_STATES:
            self.ledger.forget(job_id)
        elif is_orphaned(rec, self._reconcile()):
            return as_lost(rec, LOST_IN_QUEUE)
        return rec

    def for_context(self, tenant: str, context_id: str) -> dict[str, Any] | None:
        """The latest job of a context, or ``None``; an active one whose context was deleted
        is ``cancelled`` already (:func:`~sparkv.server.jobs.as_deleted`)."""
        active = self.queue.active_job(tenant, context_id)
        job_id = active or self.queue.latest_job(tenant, context_id)
        rec = self.get(tenant, job_id) if job_id else None
        if (active and rec is not None and rec.get("state") in ACTIVE_STATES
                and self.queue.is_cancelled(active)):
            return as_deleted(rec)
        return rec

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
            res = self._existing(tenant, active)
            if res.status != "lost":
                return res
            self.queue.release_context(tenant, context_id, active)  # a lost job holds no slot
        if self.store.manifests.get(tenant, context_id) is not None:
            backfill_tokens(self.store.chunks, spec, context_id)
            latest = self.queue.latest_job(tenant, context_id)
            return SubmitResult("done", self.get(tenant, latest) if latest else None, False)
        depth = self.queue.depth()
        if depth >= self.settings.max_queued_jobs or self._closed:
            raise ApiError(503, "too_many_jobs", f"{depth} encode jobs are queued or running; "
                           "retry later", headers={"Retry-After": "5"})
        return self._queue(new_record(spec, context_id, total))

    def _queue(self, rec: dict[str, Any]) -> SubmitResult:
        """Writes the record and queues it in the current epoch (once more if the epoch changes
        in between)."""
        tenant, job_id = rec["tenant"], rec["job_id"]
        for _ in range(2):
            rec["queue_epoch"] = self._reconcile()
            self._write(rec)
            try:
                winner = self.queue.submit(tenant, rec["context_id"], job_id, rec["queue_epoch"])
                break
            except QueueReset:
                continue
        else:
            raise QueueError("the job queue's epoch keeps changing (its Redis restarts); retry")
        if winner is not None:  # another replica queued it a moment ago
            self.store.jobs.delete(tenant, job_id)
            return self._existing(tenant, winner)
        self.ledger.add(rec)
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
        existed = self.store.delete_context(tenant, context_id)
        return existed or job_id is not None
