"""The cluster of deploy/cluster.sh on loopback (2 API replicas, 2 encode workers, redis-server,
nginx; the bundled SmolLM2): frames through nginx's cache are the stored bytes and never another
tenant's, a damaged frame is never cached, a replica killed under load costs no client-visible
error, a worker killed mid-encode leaves its job to the other one (which reuses its frames) and no
partial context is ever visible. Skips when nginx or redis-server is missing."""

from __future__ import annotations

import json
import random
import threading
import time

import httpx
import pytest

from sparkv.edge.client import EdgeClient
from sparkv.protocol.digests import checksum
from sparkv.server.cluster import LocalCluster, cluster_available
from sparkv.server.process import write_config
from sparkv.server.stores import ChunkKey, open_store

pytestmark = pytest.mark.skipif(cluster_available() is not None,
                                reason=str(cluster_available()))

TEXT = " ".join(f"item{i} is {i * 7 % 13}" for i in range(30))
LONG_TEXT = " ".join(f"entry{i} holds {i * 11 % 17}" for i in range(45))
BYPASS = {"X-Sparkv-Cache-Bypass": "1"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cluster")
    keys = write_config(tmp / "s.yaml", ["alice", "bob"], default_levels=["q8"],
                        default_chunk_tokens=64, queue_claim_idle_s=2.0, manifest_cache_s=1.0,
                        encode_pause_s=0.03, max_job_attempts=3)
    c = LocalCluster(tmp / "c", tmp / "s.yaml", api_replicas=2, workers=2)
    c.start()
    c.keys = keys  # type: ignore[attr-defined]
    yield c
    c.stop()


def _wait_job(c: httpx.Client, job_id: str, timeout: float = 240.0) -> dict:
    deadline = time.monotonic() + timeout  # a hang guard, not a timing assertion
    while time.monotonic() < deadline:
        job = c.get(f"/v1/jobs/{job_id}").json()
        if job["state"] not in ("queued", "running"):
            return job
        time.sleep(0.1)
    raise TimeoutError(job_id)


def _assert_consistent(store, tenant: str, cid: str) -> dict:
    """The manifest names only stored frames, each with its checksum."""
    m = json.loads(store.manifests.get(tenant, cid))
    for ch in m["chunks"]:
        for lv, e in ch["levels"].items():
            data = store.chunks.get(tenant, cid, ChunkKey(ch["t"], ch["l"], ch["g"], lv))
            assert data is not None and checksum(data) == e["checksum"], (ch["t"], ch["l"], lv)
    return m


@pytest.fixture(scope="module")
def context(cluster):
    """An encoded context of alice: (context id, manifest)."""
    h = {"Authorization": f"Bearer {cluster.keys['alice']}"}
    with httpx.Client(base_url=cluster.url, headers=h, timeout=60) as c:
        r = c.post("/v1/contexts", json={"text": TEXT})
        assert r.status_code == 202, r.text
        job = _wait_job(c, r.json()["job_id"])
        assert job["state"] == "done", job
        cid = r.json()["context_id"]
        # progress and state are the same on every replica (they live in Redis)
        for port in cluster.api_ports:
            other = httpx.get(f"http://127.0.0.1:{port}/v1/jobs/{job['job_id']}", headers=h)
            assert other.json()["state"] == "done"
        return cid, c.get(f"/v1/contexts/{cid}").json()


def _frame_url(cid: str, ch: dict) -> str:
    return f"/v1/contexts/{cid}/chunks/{ch['t']}/{ch['l']}/{ch['g']}?level=q8"


def test_cached_frame_is_byte_identical_and_per_tenant(cluster, context):
    cid, manifest = context
    store = open_store(cluster.redis_url)
    alice = {"Authorization": f"Bearer {cluster.keys['alice']}"}
    bob = {"Authorization": f"Bearer {cluster.keys['bob']}"}
    ch = manifest["chunks"][1]
    stored = store.chunks.get("alice", cid, ChunkKey(ch["t"], ch["l"], ch["g"], "q8"))
    first = httpx.get(cluster.url + _frame_url(cid, ch), headers=alice)
    second = httpx.get(cluster.url + _frame_url(cid, ch), headers=alice)
    assert first.status_code == second.status_code == 200
    assert first.headers["x-cache-status"] == "MISS" and second.headers["x-cache-status"] == "HIT"
    assert first.content == second.content == stored
    assert second.headers["etag"] == first.headers["etag"]
    # a conditional GET is answered from the cache with the frame's ETag
    nm = httpx.get(cluster.url + _frame_url(cid, ch),
                   headers={**alice, "If-None-Match": first.headers["etag"]})
    assert nm.status_code == 304
    # bob (another key, either header form, or no key at all) never gets alice's cached frame
    for headers in (bob, {"X-API-Key": cluster.keys["bob"]}, {}):
        r = httpx.get(cluster.url + _frame_url(cid, ch), headers=headers)
        assert r.status_code in (401, 404), r.status_code
        assert r.content != stored and r.headers.get("x-cache-status") != "HIT"


def test_damaged_frame_is_never_cached(cluster, context):
    cid, manifest = context
    store = open_store(cluster.redis_url)
    alice = {"Authorization": f"Bearer {cluster.keys['alice']}"}
    ch = manifest["chunks"][2]
    key = ChunkKey(ch["t"], ch["l"], ch["g"], "q8")
    good = store.chunks.get("alice", cid, key)
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0x40
    store.chunks.put("alice", cid, key, bytes(bad))
    try:
        for _ in range(3):
            r = httpx.get(cluster.url + _frame_url(cid, ch), headers=alice)
            assert r.status_code == 503 and r.json()["error"]["code"] == "frame_corrupt"
            assert r.headers.get("x-cache-status") != "HIT"
    finally:
        store.chunks.put("alice", cid, key, good)
    r = httpx.get(cluster.url + _frame_url(cid, ch), headers=alice)
    assert r.status_code == 200 and r.content == good  # nothing of the 503 was kept


def test_kill_worker_mid_encode(cluster):
    """The job completes on the other worker, reusing the frames the dead one stored; no
    manifest is visible before it is complete."""
    h = {"Authorization": f"Bearer {cluster.keys['alice']}"}
    store = open_store(cluster.redis_url)
    seen: list[tuple[int, str]] = []
    stop = threading.Event()
    with httpx.Client(base_url=cluster.url, headers=h, timeout=60) as c:
        r = c.post("/v1/contexts", json={"text": LONG_TEXT})
        assert r.status_code == 202, r.text
        cid, job_id, total = r.json()["context_id"], r.json()["job_id"], r.json()["num_chunks"]

        def watch() -> None:  # polls the manifest through nginx the whole time
            with httpx.Client(base_url=cluster.url, headers=h, timeout=30) as w:
                while not stop.is_set():
                    m = w.get(f"/v1/contexts/{cid}")
                    if m.status_code == 200:
                        seen.append((200, "complete" if len(m.json()["chunks"]) == total and
                                     all(store.chunks.get("alice", cid, ChunkKey(
                                         x["t"], x["l"], x["g"], "q8")) is not None
                                         for x in m.json()["chunks"]) else "partial"))
                    else:
                        seen.append((m.status_code, m.json()["error"]["code"]))
                    time.sleep(0.05)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            job = c.get(f"/v1/jobs/{job_id}").json()
            if job["state"] == "running" and job["progress"]["done"] >= 10:
                break
            assert job["state"] in ("queued", "running"), job
            time.sleep(0.05)
        rec = json.loads(store.jobs.get("alice", job_id))
        victim = rec["worker"]
        stored_before = len(store.chunks.keys("alice", cid))
        cluster.kill(victim)  # SIGKILL mid-encode
        assert stored_before >= 10
        job = _wait_job(c, job_id)
        stop.set()
        watcher.join(10)
    assert job["state"] == "done", job
    assert job["attempts"] >= 2 and job["resumed"]
    assert job["timings"]["frames_reused"] >= stored_before  # the dead worker's frames
    final = json.loads(store.jobs.get("alice", job_id))
    assert final["worker"] != victim
    _assert_consistent(store, "alice", cid)
    assert seen and all(s in ((404, "context_pending"), (200, "complete")) for s in seen), \
        set(seen)
    assert (200, "complete") in seen or job["state"] == "done"


def test_kill_replica_under_load(cluster, context):
    """Frame reads through nginx while one API replica is SIGKILLed: none fails."""
    cid, manifest = context
    key = cluster.keys["alice"]
    chunks = manifest["chunks"]
    errors: list[str] = []
    ok = {"before": 0, "after": 0}
    killed = threading.Event()
    stop = threading.Event()
    lock = threading.Lock()
    clients: list[EdgeClient] = []

    def load(seed: int, bypass: bool) -> None:
        rng = random.Random(seed)
        client = EdgeClient(cluster.url, key, timeout_s=30)
        if bypass:  # half the readers skip the cache, so the replicas carry real load
            client._http.headers.update(BYPASS)
        clients.append(client)
        while not stop.is_set():
            ch = rng.choice(chunks)
            try:
                data = client.frame(cid, ch["t"], ch["l"], ch["g"], "q8", shaped=False)
                if checksum(data) != ch["levels"]["q8"]["checksum"]:
                    raise AssertionError("checksum mismatch")
                with lock:
                    ok["after" if killed.is_set() else "before"] += 1
            except Exception as e:  # noqa: BLE001 - every failure is counted
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")
        client.close()

    threads = [threading.Thread(target=load, args=(i, i % 2 == 0), daemon=True)
               for i in range(8)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    cluster.kill("api-1")
    killed.set()
    time.sleep(3.0)
    stop.set()
    for t in threads:
        t.join(30)
    assert not errors, errors[:5]
    assert ok["before"] > 0 and ok["after"] > 0, ok
    # the survivor answers everything, including uncached reads
    r = httpx.get(cluster.url + _frame_url(cid, chunks[0]),
                  headers={"Authorization": f"Bearer {key}", **BYPASS})
    assert r.status_code == 200
