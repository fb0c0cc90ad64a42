"""Background encode jobs: a thread pool off the event loop, progress, persistence and resume.

Every job is a record in the store (``store.jobs.put``), written when it is queued, when its phase
changes, every couple of seconds while it runs, and when it ends. When the server starts,
:meth:`JobManager.start` looks at every unfinished record left by a previous process:

* its context's manifest exists -> the job had finished publishing: marked ``done``;
* the context was encrypted -> its key lived only in the dead process's memory: marked ``failed``
  with that reason, and its partial chunks are deleted;
* otherwise it is queued again (``resumed``): frames already stored are reused, the rest encoded,
  and the manifest published last. After ``max_job_attempts`` interrupted attempts it fails.

So after a crash a context is either complete or absent with a failed job saying why; a manifest
never points to missing chunks (the manifest is written last, see :mod:`sparkv.server.stores`).

A context has at most one active job. Deleting a context cancels its job; the job checks the
cancellation under the manager's lock before publishing, so a deleted context never reappears.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

from sparkv.server.config import Settings
from sparkv.protocol.crypto import FrameCipher, new_key
from sparkv.server.encoder import (ContextSpec, JobCancelled, backfill_tokens,
                                   discard_unpublished, encode_context)
from sparkv.server.errors import ApiError, StoreError
from sparkv.server.metrics import ServerMetrics
from sparkv.server.models import ModelRegistry
from sparkv.server.ordered_pool import auto_threads
from sparkv.server.stores.base import Store

log = logging.getLogger("sparkv.server.jobs")

ACTIVE_STATES = ("queued", "running")
FINAL_STATES = ("done", "failed", "cancelled", "lost")
"""``lost``: only in a cluster, a job whose queue entry a Redis without persistence lost
(:mod:`sparkv.server.queued_jobs`)."""
PERSIST_EVERY_S = 2.0
DELETED_MID_ENCODE = "the context was deleted while it was being encoded"
KEY_LOST = ("the server stopped before this job finished; the context's encryption key was held only in "
            "the server's memory (it is never stored), so the job cannot resume: create the "
            "context again to get a new key")

PUBLIC_FIELDS = ("job_id", "context_id", "state", "phase", "done", "total", "error", "attempts",
                 "resumed", "created_unix", "started_unix", "finished_unix", "num_tokens",
                 "model", "levels", "encrypted", "timings")


def public_view(record: dict[str, Any]) -> dict[str, Any]:
    """A job record as clients see it (no token ids, no tenant)."""
    out = {k: record.get(k) for k in PUBLIC_FIELDS}
    total = record.get("total") or 0
    out["progress"] = {"done": record.get("done", 0), "total": total,
                       "fraction": (record.get("done", 0) / total) if total else 0.0}
    out["timings"] = record.get("timings") or {}
    return out


def as_deleted(record: dict[str, Any]) -> dict[str, Any]:
    """An active job's record once its context was deleted: ``cancelled``, with the reason. The
    job itself stops at its next frame (a prefill may take seconds), but the context is gone at
    once: its manifest answers 404 ``context_not_found``, not ``context_pending``."""
    return {**record, "state": "cancelled", "error": DELETED_MID_ENCODE}


class QueueHealth(NamedTuple):
    """Whether submitted jobs get run (``GET /healthz``'s ``queue`` and ``queue_reason``)."""

    state: str
    """``ok`` or ``degraded``."""
    reason: str | None = None
    """``no_worker`` (no worker heartbeat is live), ``queue_unreachable``; ``None`` when ok."""


@dataclass
class SubmitResult:
    """What ``submit`` did: ``status`` is ``done`` (already encoded), ``queued`` or ``running``;
    ``key`` is the new context key (encrypted contexts, only when this call created the job)."""

    status: str
    job: dict[str, Any] | None
    created: bool
    key: bytes | None = None


class _Job:
    def __init__(self, record: dict[str, Any], key: bytes | None) -> None:
        self.record = record
        self.key = key
        self.cancel = threading.Event()
        self.last_persist = 0.0

    @property
    def spec(self) -> ContextSpec:
        return ContextSpec.from_record(self.record["spec"])


class JobManager:
    """Runs encode jobs on ``settings.encode_workers`` threads. See the module docstring."""

    def __init__(self, store: Store, registry: ModelRegistry, settings: Settings,
                 metrics: ServerMetrics | None = None) -> None:
        self.store = store
        self.registry = registry
        self.settings = settings
        self.metrics = metrics or ServerMetrics()
        self._pool = ThreadPoolExecutor(settings.encode_workers,
                                        thread_name_prefix="sparkv-encode")
        self._lock = threading.Lock()
        self._active: dict[tuple[str, str], _Job] = {}
        self._latest: dict[tuple[str, str], tuple[float, str]] = {}
        self._closed = False
        self._stopping = threading.Event()

    # --- persistence --------------------------------------------------------------------------
    def _persist(self, job: _Job) -> None:
        rec = job.record
        rec["updated_unix"] = time.time()
        try:
            self.store.jobs.put(rec["tenant"], rec["job_id"], json.dumps(rec).encode())
        except StoreError:
            log.exception("cannot persist job %s", rec["job_id"])
        job.last_persist = time.monotonic()

    def _load(self, tenant: str, job_id: str) -> dict[str, Any] | None:
        raw = self.store.jobs.get(tenant, job_id)
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            log.warning("job record %s/%s is not JSON; ignored", tenant, job_id)
            return None

    def _remember(self, rec: dict[str, Any]) -> None:
        key = (rec["tenant"], rec["context_id"])
        stamp = float(rec.get("created_unix") or 0.0)
        if key not in self._latest or self._latest[key][0] <= stamp:
            self._latest[key] = (stamp, rec["job_id"])

    # --- startup ------------------------------------------------------------------------------
    def start(self) -> None:
        """Recovers the jobs a previous process left unfinished (see the module docstring)."""
        now = time.time()
        for tenant, job_id in self.store.jobs.ids():
            rec = self._load(tenant, job_id)
            if rec is None:
                continue
            if rec.get("state") in FINAL_STATES:
                finished = float(rec.get("finished_unix") or rec.get("created_unix") or now)
                if now - finished > self.settings.job_retention_s:
                    self.store.jobs.delete(tenant, job_id)
                else:
                    self._remember(rec)
                continue
            self._remember(rec)
            job = _Job(rec, None)
            cid = rec["context_id"]
            if self.store.manifests.get(tenant, cid) is not None:
                self._finish(job, "done", None)
            elif rec["spec"].get("encrypted"):
                self.store.delete_context(tenant, cid)
                self._finish(job, "failed", KEY_LOST)
            elif not self.settings.resume_jobs:
                self.store.delete_context(tenant, cid)
                self._finish(job, "failed", "the server restarted during this job and "
                                            "resume_jobs is off; create the context again")
            elif int(rec.get("attempts", 0)) >= self.settings.max_job_attempts:
                self.store.delete_context(tenant, cid)
                self._finish(job, "failed", f"gave up after {rec.get('attempts')} attempts: the "
                                            "server stopped during each of them")
            else:
                rec.update(state="queued", phase="queued", resumed=True, error=None)
                with self._lock:
                    self._active[(tenant, cid)] = job
                self.metrics.jobs.labels("resumed").inc()
                self.metrics.jobs_active.inc()
                self._persist(job)
                log.info("resuming job %s (context %s, attempt %d)", job_id, cid,
                         int(rec.get("attempts", 0)) + 1)
                self._pool.submit(self._run, job)

    def shutdown(self, wait: bool = False, timeout: float = 5.0) -> None:
        """Stops taking jobs and interrupts running ones at their next frame. Interrupted and
        queued jobs stay ``queued`` in the store, so the next start resumes them (encrypted ones
        fail: their key goes with this process)."""
        self._closed = True
        self._stopping.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if wait:
            deadline = time.monotonic() + timeout
            while self.active_count() and time.monotonic() < deadline:
                time.sleep(0.05)

    # --- queries ------------------------------------------------------------------------------
    def active_count(self) -> int:
        with self._lock:
            return len(self._active)

    def queue_health(self) -> QueueHealth:
        """Always ok: this process's own threads run its jobs."""
        return QueueHealth("ok")

    def active_jobs(self, tenant: str) -> list[dict[str, Any]]:
        """Snapshots of the tenant's queued and running jobs (not those of deleted contexts)."""
        with self._lock:
            return [dict(j.record) for (t, _), j in self._active.items()
                    if t == tenant and not j.cancel.is_set()]

    def get(self, tenant: str, job_id: str) -> dict[str, Any] | None:
        """The job's record (live if active) or ``None`` (unknown, or another tenant's)."""
        with self._lock:
            for job in self._active.values():
                if job.record["job_id"] == job_id:
                    return dict(job.record) if job.record["tenant"] == tenant else None
        rec = self._load(tenant, job_id)
        if rec is None or rec.get("tenant") != tenant:
            return None
        return rec

    def for_context(self, tenant: str, context_id: str) -> dict[str, Any] | None:
        """The latest job of a context (active or finished), or ``None``. An active job whose
        context was deleted is ``cancelled`` already (:func:`as_deleted`)."""
        with self._lock:
            job = self._active.get((tenant, context_id))
            if job is not None:
                return as_deleted(job.record) if job.cancel.is_set() else dict(job.record)
            latest = self._latest.get((tenant, context_id))
        return self.get(tenant, latest[1]) if latest else None

    # --- submit / cancel ----------------------------------------------------------------------
    def submit(self, spec: ContextSpec, context_id: str, total: int) -> SubmitResult:
        """Queues an encode unless the context exists or is being encoded (see SubmitResult).

        Raises:
            ApiError: 409 ``context_busy`` while the context is being deleted; 503
                ``too_many_jobs`` when the queue is full.
        """
        tenant = spec.tenant
        with self._lock:
            job = self._active.get((tenant, context_id))
            if job is not None:
                if job.cancel.is_set():
                    raise ApiError(409, "context_busy", "this context is being deleted; retry in "
                                   "a moment", headers={"Retry-After": "1"})
                if job.record["state"] == "done":      # published, its job not yet let go
                    backfill_tokens(self.store.chunks, spec, context_id)
                return SubmitResult(job.record["state"], dict(job.record), False)
            if self.store.manifests.get(tenant, context_id) is not None:
                backfill_tokens(self.store.chunks, spec, context_id)
                latest = self._latest.get((tenant, context_id))
                rec = self._load(tenant, latest[1]) if latest else None
                return SubmitResult("done", rec, False)
            if len(self._active) >= self.settings.max_queued_jobs or self._closed:
                raise ApiError(503, "too_many_jobs", f"{len(self._active)} encode jobs are queued "
                               "or running; retry later", headers={"Retry-After": "5"})
            now = time.time()
            rec = {
                "job_id": secrets.token_hex(16), "tenant": tenant, "context_id": context_id,
                "state": "queued", "phase": "queued", "done": 0, "total": total, "error": None,
                "attempts": 0, "resumed": False, "created_unix": now, "started_unix": None,
                "finished_unix": None, "num_tokens": spec.num_tokens, "model": spec.model,
                "levels": list(spec.levels), "encrypted": spec.encrypted, "timings": {},
                "spec": spec.to_record(),
            }
            key = new_key() if spec.encrypted else None
            job = _Job(rec, key)
            self._active[(tenant, context_id)] = job
            self._remember(rec)
            self._persist(job)
        self.metrics.jobs.labels("submitted").inc()
        self.metrics.jobs_active.inc()
        self._pool.submit(self._run, job)
        return SubmitResult("queued", dict(rec), True, key)

    def delete_context(self, tenant: str, context_id: str) -> bool:
        """Cancels the context's job (if any) and deletes what is stored. ``True`` if anything
        existed."""
        with self._lock:
            job = self._active.get((tenant, context_id))
            if job is not None:
                job.cancel.set()  # under the lock: the job cannot publish after this
        existed = self.store.delete_context(tenant, context_id)
        return existed or job is not None

    # --- running ------------------------------------------------------------------------------
    def _finish(self, job: _Job, state: str, error: str | None) -> None:
        rec = job.record
        rec.update(state=state, phase="finished", error=error, finished_unix=time.time())
        job.key = None  # an encrypted context's key is forgotten here
        self._persist(job)
        self.metrics.jobs.labels(state).inc()

    def _progress(self, job: _Job, phase: str, done: int, total: int) -> None:
        job.record.update(phase=phase, done=done, total=total)
        if time.monotonic() - job.last_persist > PERSIST_EVERY_S:
            self._persist(job)

    def _run(self, job: _Job) -> None:
        rec = job.record
        tenant, cid = rec["tenant"], rec["context_id"]
        spec = job.spec
        t0 = time.perf_counter()
        try:
            if job.cancel.is_set() or self._stopping.is_set():
                raise JobCancelled()
            rec.update(state="running", phase="loading_model", started_unix=time.time(),
                       attempts=int(rec.get("attempts", 0)) + 1)
            self._persist(job)
            entry = self.registry.get(spec.model)
            cipher = FrameCipher(job.key, cid) if spec.encrypted and job.key else None
            if spec.encrypted and cipher is None:
                raise RuntimeError(KEY_LOST)
            manifest, stats = encode_context(
                entry, spec, cid, self.store.chunks, cipher=cipher,
                progress=lambda phase, d, t: self._progress(job, phase, d, t),
                should_stop=lambda: job.cancel.is_set() or self._stopping.is_set(),
                pause_s=self.settings.encode_pause_s,
                reuse_stored=bool(rec.get("resumed")),
                threads=auto_threads(self.settings.encode_threads, self.settings.encode_workers))
            rec["timings"] = {"prefill_s": stats.prefill_s, "codec_s": stats.codec_s,
                              "describe_s": stats.describe_s, "encrypt_s": stats.encrypt_s,
                              "store_s": stats.store_s, "encode_total_s": stats.total_s,
                              "frames_encoded": stats.frames_encoded,
                              "frames_reused": stats.frames_reused}
            with self._lock:
                if job.cancel.is_set():
                    raise JobCancelled()
                self.store.manifests.put(tenant, cid, manifest)
            m = self.metrics
            m.encode_tokens.inc(spec.num_tokens if stats.prefill_s else 0)
            for lv, n in stats.frames_by_level.items():
                m.encode_frames.labels(lv).inc(n)
            m.encode_phase_seconds.labels("prefill").inc(stats.prefill_s)
            m.encode_phase_seconds.labels("codec").inc(stats.codec_s)
            m.encode_phase_seconds.labels("describe").inc(stats.describe_s)
            m.encode_phase_seconds.labels("encrypt").inc(stats.encrypt_s)
            m.encode_phase_seconds.labels("store").inc(stats.store_s)
            rec["done"] = rec["total"]
            self._finish(job, "done", None)
        except JobCancelled:
            if job.cancel.is_set():
                discard_unpublished(self.store, tenant, cid)
                self._finish(job, "cancelled", DELETED_MID_ENCODE)
            elif spec.encrypted:  # shutting down: the key cannot outlive this process
                discard_unpublished(self.store, tenant, cid)
                self._finish(job, "failed", KEY_LOST)
            else:  # shutting down: leave it queued; the next start resumes it
                rec.update(state="queued", phase="interrupted")
                self._persist(job)
        except ApiError as exc:
            discard_unpublished(self.store, tenant, cid)
            self._finish(job, "failed", exc.message)
        except Exception as exc:  # noqa: BLE001 - a job's failure is reported, not raised
            if job.cancel.is_set():  # e.g. its files vanished under it: that was the delete
                discard_unpublished(self.store, tenant, cid)
                self._finish(job, "cancelled", DELETED_MID_ENCODE)
                return
            log.exception("encode job %s failed", rec["job_id"])
            discard_unpublished(self.store, tenant, cid)
            self._finish(job, "failed", f"{type(exc).__name__}: {exc}")
        finally:
            self.metrics.job_seconds.observe(time.perf_counter() - t0)
            self.metrics.jobs_active.dec()
            with self._lock:
                if self._active.get((tenant, cid)) is job:
                    del self._active[(tenant, cid)]
