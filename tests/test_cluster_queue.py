"""The cluster's parts without nginx: the Redis Streams job queue (at-least-once delivery, claims
of abandoned jobs, heartbeats that detect a takeover), two API replicas' job managers agreeing on
every answer, an in-process worker on the bundled SmolLM2 (encode, resume with reuse, cancel), the
configuration switch, and docker-compose.yml's cluster services."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import yaml

from sparkv.server.commands import SERVE_ENV
from sparkv.server.config import load_settings
from sparkv.server.encoder import ContextSpec
from sparkv.server.errors import ApiError, ConfigError
from sparkv.server.queue import RedisJobQueue
from sparkv.server.queued_jobs import QueuedJobManager
from sparkv.server.stores import ChunkKey, open_store

ROOT = Path(__file__).resolve().parent.parent


def _spec(tenant: str = "alice", n: int = 40, encrypted: bool = False) -> ContextSpec:
    return ContextSpec(tenant, "smollm2-135m-instruct", tuple(range(100, 100 + n)), 16, ("q8",),
                       0, encrypted)


@pytest.fixture
def url(redis_url, request):
    return f"{redis_url}?prefix=q{abs(hash(request.node.name)) % 10**9}"


def _settings(url: str, **kw):
    return load_settings(None, store=url, job_queue="redis", queue_claim_idle_s=0.5, **kw)


def test_config_switch():
    with pytest.raises(ConfigError, match="job_queue"):
        load_settings(None, store="file:///tmp/x", job_queue="redis")
    with pytest.raises(ConfigError, match="job_queue"):
        load_settings(None, job_queue="rabbit")
    s = load_settings(None, store="file:///tmp/x", job_queue="redis://127.0.0.1:1/0")
    assert s.job_queue.startswith("redis://")
    assert load_settings(None).job_queue == "local"


def test_two_replicas_agree_and_dedupe(url):
    s = _settings(url)
    store = open_store(url)
    a = QueuedJobManager(store, None, s)  # type: ignore[arg-type]
    b = QueuedJobManager(open_store(url), None, s)  # type: ignore[arg-type]
    a.start()
    first = a.submit(_spec(), "a" * 32, 3)
    assert first.status == "queued" and first.created
    again = b.submit(_spec(), "a" * 32, 3)  # the other replica: the same job, not a second one
    assert not again.created and again.job["job_id"] == first.job["job_id"]
    assert a.active_count() == b.active_count() == 1
    assert b.get("alice", first.job["job_id"])["state"] == "queued"
    assert b.get("bob", first.job["job_id"]) is None  # another tenant's job is not found
    assert b.for_context("alice", "a" * 32)["job_id"] == first.job["job_id"]
    assert [j["job_id"] for j in b.active_jobs("alice")] == [first.job["job_id"]]
    with pytest.raises(ApiError) as e:
        a.submit(_spec(encrypted=True), "b" * 32, 3)
    assert e.value.status == 400 and e.value.code == "encryption_unsupported"
    # deleting through one replica flags the job; a new submit meanwhile is 409
    assert b.delete_context("alice", "a" * 32)
    with pytest.raises(ApiError) as e:
        a.submit(_spec(), "a" * 32, 3)
    assert e.value.status == 409


def test_abandoned_entry_is_claimed_and_takeover_detected(url):
    q1 = RedisJobQueue(url, claim_idle_s=0.3)
    q2 = RedisJobQueue(url, claim_idle_s=0.3)
    q1.enqueue("alice", "c" * 32)
    got = q1.take("w1", block_ms=100)
    assert got is not None and got[2] == "c" * 32
    assert q2.take("w2", block_ms=100) is None  # pending under w1, not yet idle long enough
    assert q1.heartbeat("w1", got[0])
    time.sleep(0.5)  # w1 "died": no heartbeat
    taken = q2.take("w2", block_ms=100)
    assert taken is not None and taken[0] == got[0]
    assert not q1.heartbeat("w1", got[0])  # w1 learns it lost the job
    assert q2.heartbeat("w2", got[0])
    q2.ack(got[0])
    assert q2.depth() == 0
    time.sleep(0.4)
    assert q1.take("w1", block_ms=100) is None  # acknowledged: never delivered again


@pytest.fixture(scope="module")
def registry():
    from sparkv.server.models import ModelRegistry

    return ModelRegistry({"smollm2-135m-instruct": None}, 4096, "cpu", "auto")


def test_worker_encodes_resumes_and_cancels(url, registry):
    from sparkv.server.worker import EncodeWorker

    s = _settings(url)
    store = open_store(url)
    api = QueuedJobManager(store, registry, s)
    api.start()
    spec = _spec(n=40)
    cid = "d" * 32
    res = api.submit(spec, cid, 3 * 30)
    job_id = res.job["job_id"]
    # a worker died during a first attempt (its record says so)
    rec = json.loads(store.jobs.get("alice", job_id))
    rec["attempts"] = 1
    store.jobs.put("alice", job_id, json.dumps(rec).encode())
    w = EncodeWorker(s, store, registry, name="w-test")
    got = w.queue.take(w.name, block_ms=100)
    assert got is not None
    assert w.run_entry(*got) == "done"
    final = api.get("alice", job_id)
    assert final["state"] == "done" and final["attempts"] == 2 and final["resumed"]
    assert final["worker"] == "w-test" and api.active_count() == 0
    m = json.loads(store.manifests.get("alice", cid))
    assert all(store.chunks.get("alice", cid, ChunkKey(c["t"], c["l"], c["g"], "q8"))
               for c in m["chunks"])
    # a resubmit of an existing context queues nothing
    assert api.submit(spec, cid, 90).status == "done"
    # encoding is deterministic: deleted and encoded again, every frame is the same
    store.jobs.delete("alice", job_id)
    spec2 = _spec(n=40)
    manifest = store.manifests.get("alice", cid)
    assert api.delete_context("alice", cid)
    res2 = api.submit(spec2, cid, 90)
    assert res2.status == "queued"
    assert w.run_entry(*w.queue.take(w.name, block_ms=100)) == "done"
    again = json.loads(store.manifests.get("alice", cid))
    assert again["chunks"] == json.loads(manifest)["chunks"]  # the same frames, checksums
    # cancel: the context is deleted before a worker gets to it
    cid3 = "e" * 32
    res3 = api.submit(_spec(n=24), cid3, 60)
    assert api.delete_context("alice", cid3)
    assert w.run_entry(*w.queue.take(w.name, block_ms=100)) == "cancelled"
    assert store.manifests.get("alice", cid3) is None and not store.chunks.keys("alice", cid3)
    assert api.get("alice", res3.job["job_id"])["state"] == "cancelled"


def test_worker_reuses_frames_of_an_interrupted_attempt(url, registry):
    from sparkv.server.worker import EncodeWorker

    s = _settings(url, encode_pause_s=0.02)  # slow enough to be stopped midway
    store = open_store(url)
    api = QueuedJobManager(store, registry, s)
    spec = _spec(n=32)
    cid = "f" * 32
    job_id = api.submit(spec, cid, 2 * 30).job["job_id"]
    w = EncodeWorker(s, store, registry, name="w1")
    entry = w.queue.take(w.name, block_ms=100)
    real = w.queue.is_cancelled

    def stop_midway(jid: str) -> bool:  # SIGTERM-like stop after some frames
        if len(store.chunks.keys("alice", cid)) >= 12:
            w.stopping.set()
        return real(jid)

    w.queue.is_cancelled = stop_midway  # type: ignore[method-assign]
    assert w.run_entry(*entry) == "requeued"
    partial = len(store.chunks.keys("alice", cid))
    assert partial >= 12 and store.manifests.get("alice", cid) is None  # nothing visible
    assert api.get("alice", job_id)["state"] == "queued"
    w2 = EncodeWorker(s, store, registry, name="w2")
    assert w2.run_entry(*w2.queue.take(w2.name, block_ms=100)) == "done"
    rec = api.get("alice", job_id)
    assert rec["timings"]["frames_reused"] >= partial and rec["attempts"] == 2


def test_compose_cluster_services():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"nginx", "api", "worker", "redis"} <= set(services)
    for name in ("nginx", "api", "worker", "redis"):
        hc = services[name]["healthcheck"]
        assert hc["test"] and hc["retries"] >= 1
    assert "replicas" in services["api"]["deploy"] and "replicas" in services["worker"]["deploy"]
    known = set(SERVE_ENV.values()) | {"SPARKV_WORKER_HEARTBEAT_FILE"}
    for name in ("api", "worker"):
        env = services[name]["environment"]
        assert set(env) <= known, set(env) - known
        assert env["SPARKV_JOB_QUEUE"] == "redis" and env["SPARKV_STORE"].startswith("redis://redis:")
    assert services["worker"]["command"] == ["worker"]
    assert "ports" not in services["api"]  # replicas are reached through nginx only
    # nginx fills every placeholder of deploy/nginx.conf
    template = (ROOT / "deploy" / "nginx.conf").read_text()
    placeholders = set(re.findall(r"@([A-Z_]+)@", template))
    command = " ".join(services["nginx"]["command"])
    assert placeholders and all(f"@{p}@" in command for p in placeholders)
    assert any("deploy/nginx.conf" in v for v in services["nginx"]["volumes"])
    assert services["nginx"]["depends_on"]["api"]["condition"] == "service_healthy"
