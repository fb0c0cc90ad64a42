"""``sparkv worker``: an encode worker of a cluster, consuming the shared Redis Streams queue
(:mod:`sparkv.server.queue`).

One job at a time: take an entry (an abandoned one first), run the job with the server's own
encoder (:func:`~sparkv.server.encoder.encode_context`, always reusing frames already stored),
heartbeat the entry while encoding, publish the manifest last, write the final record, then
``XACK``. What a job's record says, in order:

* already final (a duplicate delivery) -> acknowledged, nothing done;
* its context's manifest exists -> ``done``;
* ``attempts >= max_job_attempts`` (it was interrupted that often) -> ``failed``, partial frames
  removed;
* otherwise ``running`` (``attempts`` + 1, ``resumed`` when it is not the first attempt), progress
  written to the store every :data:`~sparkv.server.queue.PERSIST_EVERY_S` seconds.

A deleted context (cancel flag) stops the job at its next frame; its frames are removed and it is
never published (the flag is checked again right after publishing, and the context deleted if the
delete raced with the publish). SIGTERM stops at the next frame and gives the job back to the queue
at once; SIGKILL leaves it pending until another worker claims it (``queue_claim_idle_s``).
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

from sparkv.server.config import Settings
from sparkv.server.encoder import (ContextSpec, JobCancelled, ProgressFn,
                                   discard_unpublished, encode_context)
from sparkv.server.errors import ApiError, StoreError
from sparkv.server.models import ModelRegistry
from sparkv.server.queue import (ENCRYPTED_REFUSED, PERSIST_EVERY_S, QueueError, RedisJobQueue,
                                 queue_url)
from sparkv.server.stores.base import ChunkStore

log = logging.getLogger("sparkv.server.worker")

FINAL_STATES = ("done", "failed", "cancelled")


class _Lost(Exception):
    """Another worker took this job over (this one was too slow to heartbeat)."""


class EncodeWorker:
    """Takes jobs from the queue and runs them. See the module docstring.

    One job at a time, on the thread that calls :meth:`run`; while a job encodes, its
    :class:`_JobWatch` heartbeats the entry on a thread of its own. :attr:`stopping` (an
    :class:`threading.Event`) may be set from any thread or a signal handler; everything else is
    touched by the running thread only. No lock.

    Args:
        name: this worker's consumer name (unique per process; default host-pid-random).
    """

    def __init__(self, settings: Settings, store: ChunkStore, registry: ModelRegistry,
                 queue: RedisJobQueue | None = None, name: str | None = None) -> None:
        self.settings = settings
        self.store = store
        self.registry = registry
        self.queue = queue or RedisJobQueue(queue_url(settings), settings.queue_claim_idle_s)
        self.name = name or f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"
        self.stopping = threading.Event()
        self.jobs_done = 0
        #: touched at least every second while the worker lives (a container's health check)
        self.heartbeat_file = os.environ.get("SPARKV_WORKER_HEARTBEAT_FILE") or None

    def _alive(self) -> None:
        self.queue.worker_seen(self.name)
        if self.heartbeat_file:
            try:
                with open(self.heartbeat_file, "a"):
                    os.utime(self.heartbeat_file)
            except OSError:
                log.warning("cannot touch %s", self.heartbeat_file)

    # --- records ------------------------------------------------------------------------------
    def _load(self, tenant: str, job_id: str) -> dict[str, Any] | None:
        try:
            raw = self.store.get_job(tenant, job_id)
            rec = json.loads(raw) if raw is not None else None
        except (StoreError, ValueError):
            log.exception("cannot read job %s/%s", tenant, job_id)
            return None
        return rec if isinstance(rec, dict) else None

    def _persist(self, rec: dict[str, Any]) -> None:
        rec["updated_unix"] = time.time()
        rec["worker"] = self.name
        self.store.put_job(rec["tenant"], rec["job_id"], json.dumps(rec).encode())

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
        came for ``idle_exit_s``). Returns the number of jobs handled."""
        self.queue.ensure_group()
        idle_since = time.monotonic()
        handled = 0
        while not self.stopping.is_set():
            try:
                self._alive()
                got = self.queue.take(self.name, block_ms=500)
            except QueueError:
                log.exception("the queue cannot be read; retrying in 1 s")
                self.stopping.wait(1.0)
                continue
            if got is None:
                if idle_exit_s is not None and time.monotonic() - idle_since > idle_exit_s:
                    break
                continue
            try:
                self.run_entry(*got)
            except (StoreError, QueueError):  # the entry stays pending: claimed again later
                log.exception("job %s: the store or the queue failed; retrying in 1 s", got[2])
                self.stopping.wait(1.0)
            handled += 1
            idle_since = time.monotonic()
            if max_jobs is not None and handled >= max_jobs:
                break
        return handled

    def run_entry(self, entry_id: str, tenant: str, job_id: str) -> str:
        """Runs one queue entry; returns what happened (the job's final state, ``requeued``,
        ``lost`` or ``skipped``)."""
        rec = self._load(tenant, job_id) if tenant and job_id else None
        if rec is None or rec.get("state") in FINAL_STATES:
            self.queue.ack(entry_id)  # unknown job, or a duplicate delivery of a finished one
            return "skipped"
        cid = rec["context_id"]
        if self.queue.is_cancelled(job_id):
            discard_unpublished(self.store, tenant, cid)
            self._finish(rec, "cancelled", "the context was deleted before it was encoded")
            self.queue.ack(entry_id)
            return "cancelled"
        if self.store.get_manifest(tenant, cid) is not None:
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
        acknowledges the entry unless the job was lost or given back."""
        cid, job_id = rec["context_id"], rec["job_id"]
        watch = _JobWatch(self.queue, self.name, entry_id, job_id, self.stopping,
                          self.settings.queue_claim_idle_s, on_beat=self._alive)
        watch.start()
        t0 = time.perf_counter()
        try:
            outcome = self._run_job(rec, watch, t0)
        except (JobCancelled, _Lost) as exc:
            outcome = self._stopped(entry_id, rec, watch, isinstance(exc, _Lost))
        except ApiError as exc:
            outcome = self._fail(rec, exc.message)
        except Exception as exc:  # noqa: BLE001 - a job's failure is recorded, not raised
            log.exception("encode job %s failed", job_id)
            outcome = self._fail(rec, f"{type(exc).__name__}: {exc}")
        finally:
            watch.stop()
        if outcome in ("lost", "requeued"):  # not finished here: no ack
            return outcome
        self.queue.ack(entry_id)
        self.jobs_done += 1
        log.info("job %s (context %s): %s in %.1f s", job_id, cid, outcome,
                 time.perf_counter() - t0)
        return outcome

    def _run_job(self, rec: dict[str, Any], watch: "_JobWatch", t0: float) -> str:
        """Encodes the job's context, publishes its manifest and records the job ``done``.
        Raises :class:`JobCancelled` or :class:`_Lost` when it stopped before publishing."""
        tenant, cid, job_id = rec["tenant"], rec["context_id"], rec["job_id"]
        spec = ContextSpec.from_record(rec["spec"])
        if spec.encrypted:
            raise ApiError(400, "encryption_unsupported", ENCRYPTED_REFUSED)
        rec.update(state="running", phase="loading_model", started_unix=time.time(),
                   attempts=int(rec.get("attempts", 0)) + 1, resumed=bool(rec.get("attempts")))
        self._persist(rec)
        entry = self.registry.get(spec.model)
        manifest, stats = encode_context(entry, spec, cid, self.store,
                                         progress=self._progress_writer(rec),
                                         should_stop=watch.should_stop,
                                         pause_s=self.settings.encode_pause_s, reuse_stored=True)
        if watch.lost.is_set():
            raise _Lost()
        if self.queue.is_cancelled(job_id):
            raise JobCancelled()
        self.store.put_manifest(tenant, cid, manifest)  # last: the context becomes visible
        if self.queue.is_cancelled(job_id):  # a delete raced with the publish
            self.store.delete(tenant, cid)
            raise JobCancelled()
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
                 lost: bool) -> str:
        """A job that stopped before publishing: ``lost`` (another worker has it: nothing
        recorded), ``cancelled`` (its context was deleted: frames removed) or ``requeued`` (this
        worker is stopping: the job goes back to the queue now, its frames stay for reuse)."""
        tenant, cid, job_id = rec["tenant"], rec["context_id"], rec["job_id"]
        if lost or watch.lost.is_set():
            log.warning("job %s was taken over by another worker; leaving it", job_id)
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
    it every ``claim_idle_s / 4`` s, at least 0.1 s, and sets :attr:`lost` when another worker has
    taken it over), its cancellation (the queue's flag, read at most every 0.2 s) and the
    worker's ``stopping``.

    State: :attr:`lost` and the thread's stop event are :class:`threading.Event` s (shared with
    the heartbeat thread); the cached cancel flag is read and written by the job's thread only
    (:meth:`should_stop`). No lock.
    """

    def __init__(self, queue: RedisJobQueue, worker_name: str, entry_id: str, job_id: str,
                 stopping: threading.Event, claim_idle_s: float,
                 on_beat: Callable[[], None]) -> None:
        self.queue, self.worker_name = queue, worker_name
        self.entry_id, self.job_id = entry_id, job_id
        self.stopping = stopping
        self.every_s = max(0.1, claim_idle_s / 4)
        self.on_beat = on_beat
        self.lost = threading.Event()
        self._beat_stop = threading.Event()
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
                if not self.queue.heartbeat(self.worker_name, self.entry_id):
                    self.lost.set()
                    return
                self.on_beat()
            except QueueError:
                log.warning("heartbeat of job %s failed", self.job_id)

    def should_stop(self) -> bool:
        """True when the worker stops, the job was lost, or its context was deleted."""
        if self.stopping.is_set() or self.lost.is_set():
            return True
        now = time.monotonic()
        if now - self._cancel_checked[0] > 0.2:
            self._cancel_checked = (now, self.queue.is_cancelled(self.job_id))
        return bool(self._cancel_checked[1])


def install_signal_handlers(worker: EncodeWorker) -> None:
    """SIGTERM / SIGINT: stop at the next frame and give the current job back."""
    def handler(signum: int, frame: object) -> None:
        log.info("signal %d: stopping after the current frame", signum)
        worker.stopping.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
