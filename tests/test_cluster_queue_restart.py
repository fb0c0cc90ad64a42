"""The job queue survives its Redis: a real ``redis-server`` without persistence restarted on the
same port under a running worker (the same worker runs the next job; the jobs the restart lost
are reported ``lost``, not left ``queued``, and can be submitted again), ``/healthz`` saying the
queue is degraded while no worker is alive, the queue's epoch checks, and the backoff (without
sleeping)."""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Callable

import pytest

from sparkv.server.backoff import Backoff, Outage
from sparkv.server.config import load_settings
from sparkv.server.encoder import ContextSpec
from sparkv.server.process import RedisProcess, redis_server_available, write_config
from sparkv.server.queue import QueueError, QueueReset, RedisJobQueue
from sparkv.server.queued_jobs import QueuedJobManager
from sparkv.server.stores import open_store
from sparkv.server.worker import EncodeWorker

DEADLINE_S = 120.0  # a hang guard, not a timing assertion


def _wait(what: str, cond: Callable[[], Any], timeout: float = DEADLINE_S) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def redis_proc(tmp_path):
    """A redis-server of this test's own, in memory only, to be restarted."""
    if not redis_server_available():
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    proc = RedisProcess(tmp_path / "redis").start()
    yield proc
    proc.stop()


def _restart(proc: RedisProcess) -> None:
    """Stops redis-server and starts a new one on the same port: it comes back empty."""
    proc.stop()
    proc.start()


def _spec(n: int = 40, first: int = 100) -> ContextSpec:
    return ContextSpec("alice", "smollm2-135m-instruct", tuple(range(first, first + n)), 16,
                       ("q8",), 0, False)


# --- backoff, without sleeping -----------------------------------------------------------------
def test_backoff_doubles_up_to_its_cap():
    b = Backoff()
    assert [b.delay(n) for n in range(1, 10)] == [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0]
    assert b.delay(10**6) == 5.0  # no overflow however long the outage
    assert Backoff(base_s=1.0, cap_s=2.5).delay(3) == 2.5


def test_an_outage_is_logged_once(caplog):
    now = [100.0]
    outage = Outage("the job queue", logging.getLogger("t.outage"), clock=lambda: now[0])
    outage.recovered()  # no outage: nothing logged
    with caplog.at_level(logging.WARNING, logger="t.outage"):
        delays = []
        for _ in range(20):
            delays.append(outage.failed(QueueError("connection refused")))
            now[0] += delays[-1]
        assert delays[:3] == [0.1, 0.2, 0.4] and max(delays) == 5.0
        outage.recovered()
        outage.recovered()
        assert outage.failed(QueueError("again")) == 0.1  # a new outage starts over
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert "connection refused" in lines[0] and "at most 5.0 s" in lines[0]
    assert "recovered after" in lines[1] and "(20 failed tries)" in lines[1]
    assert "again" in lines[2]


class _DownQueue:
    """A queue whose Redis is down for ``failures`` reads, then answers (and stops the worker)."""

    def __init__(self, worker_box: list, failures: int) -> None:
        self.box, self.failures, self.reads = worker_box, failures, 0
        self.beats: list[str] = []
        self.gone: list[str] = []

    def take(self, consumer: str, block_ms: int = 1000) -> None:
        self.reads += 1
        if self.reads <= self.failures:
            raise QueueError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
        self.box[0].stopping.set()
        return None

    def worker_alive(self, name: str) -> None:
        self.beats.append(name)

    def worker_gone(self, name: str) -> None:
        self.gone.append(name)


def test_the_worker_backs_off_and_logs_once_per_outage(caplog):
    box: list = []
    queue = _DownQueue(box, failures=9)
    slept: list[float] = []
    w = EncodeWorker(load_settings(None), None, None, queue=queue,  # type: ignore[arg-type]
                     name="w", sleep=slept.append)
    box.append(w)
    with caplog.at_level(logging.WARNING, logger="sparkv.server.worker"):
        assert w.run() == 0
    assert slept == [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0]  # bounded, never real
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "Connection refused" in lines[0] and "recovered" in lines[1]
    assert queue.beats == ["w"]  # a heartbeat only once a read worked
    assert queue.gone == ["w"]  # stopping ends the heartbeat at once


# --- the queue against a restarted redis-server --------------------------------------------------
def test_the_group_and_a_new_epoch_come_back_after_a_restart(redis_proc):
    url = f"{redis_proc.url}?prefix=g"
    q = RedisJobQueue(url, claim_idle_s=0.5)
    first = q.current_epoch()
    q.enqueue("alice", "a" * 32)
    _restart(redis_proc)
    assert q.take("w1", block_ms=50) is None  # NOGROUP is recovered inside take: no error
    second = q.current_epoch()
    assert second != first
    with pytest.raises(QueueReset):  # a submit in the old epoch never reaches the new stream
        q.submit("alice", "b" * 32, "c" * 32, first)
    assert q.depth() == 0 and q.active_job("alice", "b" * 32) is None
    assert q.submit("alice", "b" * 32, "c" * 32, second) is None
    got = q.take("w1", block_ms=50)
    assert got is not None and got.job_id == "c" * 32
    assert q.heartbeat("w1", got.entry_id, second)
    _restart(redis_proc)
    with pytest.raises(QueueReset):  # the running job learns that its entry is gone
        q.heartbeat("w1", got.entry_id, second)


def test_health_follows_the_worker_heartbeats(redis_proc):
    url = f"{redis_proc.url}?prefix=h"
    s = load_settings(None, store=url, job_queue="redis")
    api = QueuedJobManager(open_store(url), None, s)  # type: ignore[arg-type]
    api.start()
    assert api.queue_health() == ("degraded", "no_worker")
    api.queue.worker_alive("w1")
    assert api.queue_health() == ("ok", None)
    api.queue.worker_gone("w1")
    assert api.queue_health() == ("degraded", "no_worker")
    api.queue.worker_alive("w2", ttl_s=0.2)  # a worker that dies: its key expires
    _wait("the heartbeat to expire", lambda: api.queue_health() == ("degraded", "no_worker"))
    assert api.queue.workers() == {}  # and its name is forgotten
    api.queue.worker_alive("w3")
    redis_proc.stop()
    assert api.queue_health() == ("degraded", "queue_unreachable")
    redis_proc.start()
    assert api.queue_health() == ("degraded", "no_worker")  # the restart took w3's heartbeat


def test_lost_jobs_are_reported_lost_and_can_be_resubmitted(tmp_path, redis_proc):
    """A store that survives the restart (file://, the queue in its own Redis): the record stays,
    its epoch is stale -> lost on any replica. A store that is the restarted Redis: the record is
    gone; the replica that queued it records it lost, then every replica answers lost."""
    q_url = f"{redis_proc.url}?prefix=l"
    s = load_settings(None, store=f"file://{tmp_path}/store", job_queue=q_url)
    store = open_store(s.store)
    a, b = (QueuedJobManager(store, None, s) for _ in range(2))  # type: ignore[arg-type]
    a.start()
    kept = a.submit(_spec(), "a" * 32, 3).job
    s2 = load_settings(None, store=q_url, job_queue="redis")
    c, d = (QueuedJobManager(open_store(q_url), None, s2) for _ in range(2))  # type: ignore[arg-type]
    gone = c.submit(_spec(first=200), "b" * 32, 3).job
    _restart(redis_proc)
    for replica in (a, b):
        rec = replica.get("alice", kept["job_id"])
        assert rec["state"] == "lost" and "submit the context again" in rec["error"]
        assert replica.for_context("alice", "a" * 32) is None  # no active job holds the context
    assert d.get("alice", gone["job_id"]) is None  # d never knew it, and the record is gone
    assert c.queue_health().reason == "no_worker"  # c sees the new epoch: records its jobs lost
    for replica in (c, d):
        rec = replica.get("alice", gone["job_id"])
        assert rec["state"] == "lost" and "submit the context again" in rec["error"]
        assert rec["context_id"] == "b" * 32 and rec["total"] == 3
    again = b.submit(_spec(), "a" * 32, 3)  # the same POST again: a new job, queued
    assert again.created and again.status == "queued" and again.job["job_id"] != kept["job_id"]
    assert b.get("alice", again.job["job_id"])["state"] == "queued"
    assert d.submit(_spec(first=200), "b" * 32, 3).created


# --- the whole thing: API, a worker thread, a restart ---------------------------------------------
@pytest.fixture(scope="module")
def tiny_registry():
    from helpers import shared_tiny_checkpoint

    from sparkv.server.models import ModelRegistry

    return ModelRegistry({"tiny": str(shared_tiny_checkpoint())}, 4096, "cpu", "auto")


def _start(worker: EncodeWorker) -> threading.Thread:
    t = threading.Thread(target=worker.run, name=f"test-{worker.name}", daemon=True)
    t.start()
    return t


def test_the_queue_survives_a_redis_restart(tmp_path, redis_proc, tiny_registry):
    from fastapi.testclient import TestClient

    from sparkv.server.app import create_app

    keys = write_config(tmp_path / "s.yaml", ["alice"])
    s = load_settings(tmp_path / "s.yaml", store=redis_proc.url, job_queue="redis",
                      models={"tiny": None}, default_model="tiny", default_levels=["q8"],
                      default_chunk_tokens=16, queue_claim_idle_s=0.5, encode_pause_s=0.5)
    app = create_app(s, store=open_store(redis_proc.url), registry=tiny_registry)
    survivor = EncodeWorker(s, open_store(redis_proc.url), tiny_registry, name="survivor")
    with TestClient(app, headers={"Authorization": f"Bearer {keys['alice']}"}) as c:
        def health() -> tuple[int, str, Any]:
            r = c.get("/healthz")
            return r.status_code, r.json()["queue"], r.json()["queue_reason"]

        def job(job_id: str) -> dict:
            r = c.get(f"/v1/jobs/{job_id}")
            assert r.status_code == 200, r.text
            return r.json()

        def post(first: int, n: int) -> dict:
            r = c.post("/v1/contexts", json={"token_ids": list(range(first, first + n))})
            assert r.status_code == 202, r.text
            return r.json()

        assert health() == (200, "degraded", "no_worker")  # 200: frames are still served
        thread = _start(survivor)
        _wait("a live worker", lambda: health() == (200, "ok", None))
        slow = post(100, 128)  # 16 frames, 0.5 s apart: still running at the restart
        _wait("the slow job to run", lambda: job(slow["job_id"])["progress"]["done"] >= 1)
        waiting = post(300, 16)  # behind it in the queue
        assert job(waiting["job_id"])["state"] == "queued"
        _restart(redis_proc)
        for lost in (slow, waiting):
            rec = _wait("the job to be lost", lambda: (lambda j: j["state"] == "lost" and j)(
                job(lost["job_id"])))
            assert "submit the context again" in rec["error"]
        fresh = post(500, 16)
        done = _wait("the next job", lambda: (lambda j: j["state"] in ("done", "failed") and j)(
            job(fresh["job_id"])))
        assert done["state"] == "done", done
        assert thread.is_alive()  # the worker that saw the restart ran it: no new worker
        assert json.loads(app.state.sparkv.store.jobs.get("alice", fresh["job_id"]))[
            "worker"] == "survivor"
        assert c.get(fresh["manifest_url"]).status_code == 200
        again = post(300, 16)  # the lost job, resubmitted: the same context, a new job
        assert again["context_id"] == waiting["context_id"]
        assert again["job_id"] != waiting["job_id"]
        _wait("the resubmitted job", lambda: job(again["job_id"])["state"] == "done")
        assert c.get(slow["manifest_url"]).status_code == 404  # never published
        _wait("a live worker", lambda: health() == (200, "ok", None))
        survivor.stopping.set()
        thread.join(DEADLINE_S)
        assert health() == (200, "degraded", "no_worker")
        other = EncodeWorker(s, open_store(redis_proc.url), tiny_registry, name="other")
        thread = _start(other)
        _wait("a live worker again", lambda: health() == (200, "ok", None))
        other.stopping.set()
        thread.join(DEADLINE_S)
