"""``sparkv worker``: an encode worker of a cluster, consuming the shared Redis Streams queue
(:mod:`sparkv.server.queue`).

One job at a time: take an entry (an abandoned one first), run the job with the server's own
encoder (:func:`~sparkv.server.encoder.encode_context`, always reusing frames already stored),
heartbeat the entry while encoding, publish the manifest last, write the final record, then
``XACK``. What a job's record says, in order:

* already final (a duplicate delivery) -> acknowledged, nothing done;
* submitted in another queue epoch (the queue's Redis lost its data since) -> ``lost``;
* its context's manifest exists -> ``done``;
* ``attempts >= max_job_attempts`` (it was interrupted that often) -> ``failed``, partial frames
  removed;
* otherwise ``running`` (``attempts`` + 1, ``resumed`` when it is not the first attempt), progress
  written to the store every :data:`~sparkv.server.queue.PERSIST_EVERY_S` seconds.

A deleted context (cancel flag) stops the job at its next frame; its frames are removed and it is
never published (the flag is checked again right after publishing, and the context deleted if the
delete raced with the publish). SIGTERM stops at the next frame and gives the job back to the queue
at once; SIGKILL leaves it pending until another worker claims it (``queue_claim_idle_s``).

**Redis outages.** A call to the queue or the store that fails is retried with a bounded
exponential backoff (:mod:`sparkv.server.backoff`: 0.1 s doubling up to 5 s), logged once when
the outage starts and once when it ends. A Redis that comes back empty has lost the stream and its
group: the next read creates them again (and a new epoch, :mod:`sparkv.server.queue`), so the
same worker goes on with the jobs submitted after the restart. A job running when its queue epoch
changed stops at its next frame and is recorded ``lost``; it is never published (the epoch is
checked right before and right after the manifest is written). A job that fails on a store or queue
error otherwise stays pending and is claimed again (the attempt counts).

The worker proves it is alive by a heartbeat key with a TTL (``P:q:worker:<name>``,
:data:`~sparkv.server.queue.WORKER_TTL_S`), written after each successful read of the queue and
while a job runs; ``GET /healthz`` of the API replicas reports the queue ``degraded`` when none is
live. A worker that stops deletes its key.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from typing import Any, Callable

from sparkv.server.backoff import Outage
from sparkv.server.config import Settings
from sparkv.server.encoder import (ContextSpec, JobCancelled, ProgressFn,
                                   discard_unpublished, encode_context)
from sparkv.server.errors import ApiError, StoreError
from sparkv.server.jobs import FINAL_STATES
from sparkv.server.models import ModelRegistry
from sparkv.server.ordered_pool import auto_threads
from sparkv.server.queue import (ENCRYPTED_REFUSED, LOST_IN_QUEUE, PERSIST_EVERY_S, WORKER_TTL_S,
                                 QueueEntry, QueueError, QueueReset, RedisJobQueue, queue_url)
from sparkv.server.stores.base import Store

log = logging.getLogger("sparkv.server.worker")


class _TakenOver(Exception):
    """Another worker took this job over (this one was too slow to heartbeat)."""


class _EpochChanged(Exception):
    """The queue's epoch is no longer the job's: its entry is gone with a restarted Redis."""


class EncodeWorker:
    """Takes jobs from the queue and runs them. See the module docstring.

    One job at a time, on the thread that calls :meth:`run`; while a job encodes, its
    :class:`_JobWatch` heartbeats the entry on a thread of its own. :attr:`stopping` (an
    :class:`threading.Event`) may be set from any thread or a signal handler; everything else
    (the outage states included) is touched by the running thread only. No lock.

    Args:
        name: this worker's consumer name (unique per process; default host-pid-random).
        sleep: waits out a backoff delay (default: :attr:`stopping`'s ``wait``, so a stop ends
            the wait); tests pass a fake.
    """

    def __init__(self, settings: Settings, store: Store, registry: ModelRegistry,
                 queue: RedisJobQueue | None = None, name: str | None = None,
                 sleep: Callable[[float], object] | None = None) -> None:
        self.settings = settings
        self.store = store
        self.registry = registry
        self.queue = queue or RedisJobQueue(queue_url(settings), settings.queue_claim_idle_s)
        self.name = name or f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"
        self.stopping = threading.Event()
        self.jobs_done = 0
        self.outage = Outage("reading the job queue", log)
        self.job_outage = Outage("running jobs (the store or the queue)", log)
        self._sleep = sleep or self.stopping.wait
        #: touched at least every second while the worker can read the queue (a container's
        #: health check)
        self.heartbeat_file = os.environ.get("SPARKV_WORKER_HEARTBEAT_FILE") or None

    def _alive(self) -> None:
        self.queue.worker_alive(self.name)
        if self.heartbeat_file:
            try:
                with open(self.heartbeat_file, "a"):
                    os.utime(self.heartbeat_file)
            except OSError:
                log.warning("cannot touch %s", self.heartbeat_file)

    # --- records ------------------------------------------------------------------------------
    def _load(self, tenant: str, job_id: str) -> dict[str, Any] | None:
        try:
            raw = self.store.jobs.get(tenant, job_id)
            rec = json.loads(raw) if raw is not None else None
        except ValueError:
            log.exception("cannot read job %s/%s", tenant, job_id)
            return None
        return rec if isinstance(rec, dict) else None

    def _persist(self, rec: dict[str, Any]) -> None:
        rec["updated_unix"] = time.time()
        rec["worker"] = self.name
        self.store.jobs.put(rec["tenant"], rec["job_id"], json.dumps(rec).encode())

    def _finish(self, rec: dict[str, Any], state: str, error: str | None) -> None:
        rec.update(state=state, phase="finished", error=error, finished_unix=time.time())
        self._persist(rec)
        self.queue.release_context(rec["tenant"], rec["context_id"], rec["job_id"])

    def _fail(self, rec: dict[str, Any], error: str) -> str:
        """Removes the job's unpublished frames and records it ``failed``; returns ``failed``."""
        discard_unpublished(self.store, rec["tenant"], rec["context_id"])
        self._finish(rec, "failed", error)
        return "failed"

    # --- the loop -----------------------------------------------------------------------------
    def run(self, max_jobs: int | None = None, idle_exit_s: float | None = None) -> int:
        """Takes and runs jobs until :attr:`stopping` is set (or ``max_jobs`` ran, or nothing
        came for ``idle_exit_s``). Returns the number of jobs handled. A failing queue or store
        is waited out (see the module docstring); the worker's heartbeat ends when it returns."""
        idle_since = time.monotonic()
        handled = 0
        try:
            while not self.stopping.is_set():
                got = self._next()
                if got is None:
                    if idle_exit_s is not None and time.monotonic() - idle_since > idle_exit_s:
                        break
                    continue
                self._handle(got)
                handled += 1
                idle_since = time.monotonic()
                if max_jobs is not None and handled >= max_jobs:
                    break
        finally:
            self._leave()
        return handled

    def _next(self) -> QueueEntry | None:
        """The next entry (``None`` when none came, or after waiting out a failure)."""
        try:
            got = self.queue.take(self.name, block_ms=500)
            self._alive()  # only after a read that worked: a live heartbeat means a consumer
        except QueueError as exc:
            self._sleep(self.outage.failed(exc))
            return None
        self.outage.recovered()
        return got

    def _handle(self, got: QueueEntry) -> None:
        try:
            self.run_entry(*got)
        except StoreError as exc:  # the entry stays pending: claimed again later
            self._sleep(self.job_outage.failed(exc))
            return
        self.job_outage.recovered()

    def _leave(self) -> None:
        try:
            self.queue.worker_gone(self.name)
        except QueueError:
            pass  # its heartbeat key expires by itself

    def run_entry(self, entry_id: str, tenant: str, job_id: str) -> str:
        """Runs one queue entry; returns what happened (the job's final state, ``requeued``,
        ``taken_over`` or ``skipped``)."""
        rec = self._load(tenant, job_id) if tenant and job_id else None
        if rec is None or rec.get("state") in FINAL_STATES:
            self.queue.ack(entry_id)  # unknown job, or a duplicate delivery of a finished one
            return "skipped"
        cid = rec["context_id"]
        epoch = self.queue.current_epoch()
        if rec.setdefault("queue_epoch", epoch) != epoch:  # given back after a restart: too late
            self._finish(rec, "lost", LOST_IN_QUEUE)
            self.queue.ack(entry_id)
            return "lost"
        if self.queue.is_cancelled(job_id):
            discard_unpublished(self.store, tenant, cid)
            self._finish(rec, "cancelled", "the context was deleted before it was encoded")
            self.queue.ack(entry_id)
            return "cancelled"
        if self.store.manifests.get(tenant, cid) is not None:
            self._finish(rec, "done", None)
            self.queue.ack(entry_id)
            return "done"
        attempts = int(rec.get("attempts", 0))
        if attempts >= self.settings.max_job_attempts:
            self._fail(rec, f"gave up after {attempts} attempts: the worker stopped during "
                            "each of them")
            self.queue.ack(entry_id)
            return "failed"
        return self._encode(entry_id, rec)

    def _encode(self, entry_id: str, rec: dict[str, Any]) -> str:
        """Runs the job with its entry watched (:class:`_JobWatch`) and records how it ended;
        acknowledges the entry unless the job was taken over, given back or lost with its entry.
        A store or queue error leaves the entry pending (raised) unless the epoch changed."""
        cid, job_id = rec["context_id"], rec["job_id"]
        watch = _JobWatch(self.queue, self.name, entry_id, job_id, rec["queue_epoch"],
                          self.stopping, self.settings.queue_claim_idle_s, on_beat=self._alive)
        watch.start()
        t0 = time.perf_counter()
        try:
            outcome = self._run_job(rec, watch, t0)
        except (JobCancelled, _TakenOver, _EpochChanged) as exc:
            outcome = self._stopped(entry_id, rec, watch, exc)
        except ApiError as exc:
            outcome = self._fail(rec, exc.message)
        except StoreError:
            if not watch.reset.is_set():
                raise
            outcome = self._stopped(entry_id, rec, watch, _EpochChanged())
        except Exception as exc:  # noqa: BLE001 - a job's failure is recorded, not raised
            log.exception("encode job %s failed", job_id)
            outcome = self._fail(rec, f"{type(exc).__name__}: {exc}")
        finally:
            watch.stop()
        if outcome in ("taken_over", "requeued", "lost"):  # not finished here: no ack
            return outcome
        self.queue.ack(entry_id)
        self.jobs_done += 1
        log.info("job %s (context %s): %s in %.1f s", job_id, cid, outcome,
                 time.perf_counter() - t0)
        return outcome

    def _same_epoch(self, rec: dict[str, Any]) -> bool:
        return bool(self.queue.current_epoch() == rec["queue_epoch"])

    def _run_job(self, rec: dict[str, Any], watch: "_JobWatch", t0: float) -> str:
        """Encodes the job's context, publishes its manifest and records the job ``done``.
        Raises :class:`JobCancelled`, :class:`_TakenOver` or :class:`_EpochChanged` when it
        stopped before publishing (or withdrew what it published)."""
        tenant, cid, job_id = rec["tenant"], rec["context_id"], rec["job_id"]
        spec = ContextSpec.from_record(rec["spec"])
        if spec.encrypted:
            raise ApiError(400, "encryption_unsupported", ENCRYPTED_REFUSED)
        rec.update(state="running", phase="loading_model", started_unix=time.time(),
                   attempts=int(rec.get("attempts", 0)) + 1, resumed=bool(rec.get("attempts")))
        self._persist(rec)
        entry = self.registry.get(spec.model)
        manifest, stats = encode_context(entry, spec, cid, self.store.chunks,
                                         progress=self._progress_writer(rec),
                                         should_stop=watch.should_stop,
                                         pause_s=self.settings.encode_pause_s, reuse_stored=True,
                                         threads=auto_threads(self.settings.encode_threads))
        if watch.lost.is_set():
            raise _TakenOver()
        if watch.reset.is_set() or not self._same_epoch(rec):
            raise _EpochChanged()
        if self.queue.is_cancelled(job_id):
            raise JobCancelled()
        self.store.manifests.put(tenant, cid, manifest)  # last: the context becomes visible
        if self.queue.is_cancelled(job_id):  # a delete raced with the publish
            self.store.delete_context(tenant, cid)
            raise JobCancelled()
        if not self._same_epoch(rec):  # Redis restarted during the publish: frames may be gone
            self.store.delete_context(tenant, cid)
            raise _EpochChanged()
        rec["timings"] = {"prefill_s": stats.prefill_s, "codec_s": stats.codec_s,
                          "describe_s": stats.describe_s, "store_s": stats.store_s,
                          "encode_total_s": stats.total_s, "frames_encoded": stats.frames_encoded,
                          "frames_reused": stats.frames_reused,
                          "wall_s": time.perf_counter() - t0}
        rec["done"] = rec["total"]
        self._finish(rec, "done", None)
        return "done"

    def _progress_writer(self, rec: dict[str, Any]) -> ProgressFn:
        """The job's progress callback: updates ``rec`` and persists it at most every
        :data:`~sparkv.server.queue.PERSIST_EVERY_S` seconds."""
        last = [0.0]

        def progress(phase: str, done: int, total: int) -> None:
            rec.update(phase=phase, done=done, total=total)
            if time.monotonic() - last[0] > PERSIST_EVERY_S:
                last[0] = time.monotonic()
                self._persist(rec)

        return progress

    def _stopped(self, entry_id: str, rec: dict[str, Any], watch: "_JobWatch",
                 exc: Exception) -> str:
        """A job that stopped before publishing: ``taken_over`` (another worker has it: nothing
        recorded), ``lost`` (the queue's epoch changed: recorded ``lost``, its frames left alone,
        since a resubmitted job may be writing them now), ``cancelled`` (its context was deleted:
        frames removed) or ``requeued`` (this worker is stopping: the job goes back to the queue
        now, its frames stay for reuse)."""
        tenant, cid, job_id = rec["tenant"], rec["context_id"], rec["job_id"]
        if isinstance(exc, _TakenOver) or watch.lost.is_set():
            log.warning("job %s was taken over by another worker; leaving it", job_id)
            return "taken_over"
        if isinstance(exc, _EpochChanged) or watch.reset.is_set():
            log.warning("job %s: the job queue lost its entry (Redis restarted without its "
                        "data); recorded lost", job_id)
            self._finish(rec, "lost", LOST_IN_QUEUE)
            return "lost"
        if self.queue.is_cancelled(job_id):
            discard_unpublished(self.store, tenant, cid)
            self._finish(rec, "cancelled", "the context was deleted while it was being encoded")
            return "cancelled"
        rec.update(state="queued", phase="interrupted")
        self._persist(rec)
        self.queue.requeue(entry_id, tenant, job_id)
        return "requeued"


class _JobWatch:
    """What a running job watches between frames: its queue entry (a daemon thread heartbeats
    it every ``claim_idle_s / 4`` s, at most :data:`~sparkv.server.queue.WORKER_TTL_S` / 3 and at
    least 0.1 s; it sets :attr:`lost` when another worker has taken the entry over and
    :attr:`reset` when the queue's epoch is no longer the job's), its cancellation (the queue's
    flag, read at most every 0.2 s; while the queue cannot be read the last answer stands) and the
    worker's ``stopping``. A failing heartbeat is logged once per outage.

    State: :attr:`lost`, :attr:`reset` and the thread's stop event are :class:`threading.Event` s
    (shared with the heartbeat thread); the heartbeat's outage state is the heartbeat thread's
    own; the cached cancel flag is read and written by the job's thread only
    (:meth:`should_stop`). No lock.
    """

    def __init__(self, queue: RedisJobQueue, worker_name: str, entry_id: str, job_id: str,
                 epoch: str, stopping: threading.Event, claim_idle_s: float,
                 on_beat: Callable[[], None]) -> None:
        self.queue, self.worker_name = queue, worker_name
        self.entry_id, self.job_id, self.epoch = entry_id, job_id, epoch
        self.stopping = stopping
        self.every_s = max(0.1, min(claim_idle_s / 4, WORKER_TTL_S / 3))
        self.on_beat = on_beat
        self.lost = threading.Event()
        self.reset = threading.Event()
        self._beat_stop = threading.Event()
        self._outage = Outage(f"the heartbeat of job {job_id}", log)
        self._cancel_checked = (0.0, False)
        self._thread = threading.Thread(target=self._beat, name=f"sparkv-beat-{job_id[:8]}",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stops the heartbeat (waits up to 5 s for its thread)."""
        self._beat_stop.set()
        self._thread.join(5.0)

    def _beat(self) -> None:
        while not self._beat_stop.wait(self.every_s):
            try:
                if not self.queue.heartbeat(self.worker_name, self.entry_id, self.epoch):
                    self.lost.set()
                    return
                self.on_beat()
            except QueueReset:
                self.reset.set()
                return
            except QueueError as exc:
                self._outage.failed(exc)  # the beat keeps its own pace; only the log is once
                continue
            self._outage.recovered()

    def should_stop(self) -> bool:
        """True when the worker stops, the job was lost, or its context was deleted."""
        if self.stopping.is_set() or self.lost.is_set() or self.reset.is_set():
            return True
        now = time.monotonic()
        if now - self._cancel_checked[0] > 0.2:
            try:
                cancelled = self.queue.is_cancelled(self.job_id)
            except QueueError:  # unknown during an outage: go on (the heartbeat watches it)
                cancelled = self._cancel_checked[1]
            self._cancel_checked = (now, cancelled)
        return bool(self._cancel_checked[1])


def install_signal_handlers(worker: EncodeWorker) -> None:
    """SIGTERM / SIGINT: stop at the next frame and give the current job back."""
    def handler(signum: int, frame: object) -> None:
        log.info("signal %d: stopping after the current frame", signum)
        worker.stopping.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
