"""A server killed (SIGKILL) in the middle of encode jobs and started again: every context is
then complete (its job resumed) or absent with a failed job and a reason; a manifest never names a
missing chunk. The server also keeps answering while it encodes."""

from __future__ import annotations

import time

import httpx

from sparkv.codec import decode
from sparkv.protocol.digests import checksum
from sparkv.server.stores import ChunkKey, open_store
from sparkv.server.process import ServerProcess, write_config
from helpers import shared_tiny_checkpoint

TEXT = " ".join(f"word{i}" for i in range(120))


def _job(c: httpx.Client, job_id: str) -> dict:
    r = c.get(f"/v1/jobs/{job_id}")
    assert r.status_code == 200, r.text
    return r.json()


def _wait(c: httpx.Client, job_id: str, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = _job(c, job_id)
        if job["state"] not in ("queued", "running"):
            return job
        time.sleep(0.05)
    raise TimeoutError(job_id)


def _assert_store_consistent(store_url: str, tenant: str) -> None:
    """Every visible context's manifest names only chunks that are stored, with its checksum."""
    import json

    store = open_store(store_url)
    for cid in store.manifests.contexts(tenant):
        m = json.loads(store.manifests.get(tenant, cid))
        for c in m["chunks"]:
            for lv, e in c["levels"].items():
                data = store.chunks.get(tenant, cid, ChunkKey(c["t"], c["l"], c["g"], lv))
                assert data is not None, (cid, c["t"], c["l"], lv)
                assert checksum(data) == e["checksum"]


def test_kill_mid_encode_then_restart(tmp_path):
    tiny = shared_tiny_checkpoint()
    keys = write_config(tmp_path / "s.yaml", ["alice"], models={"tiny": str(tiny)},
                        default_model="tiny", default_levels=["raw", "q5"],
                        default_chunk_tokens=16, encode_workers=2, encode_pause_s=0.04)
    store_url = f"file://{tmp_path}/store"
    headers = {"Authorization": f"Bearer {keys['alice']}"}
    server = ServerProcess(tmp_path / "s.yaml", store_url, log_path=tmp_path / "log1").start()
    try:
        with httpx.Client(base_url=server.url, headers=headers, timeout=30) as c:
            plain = c.post("/v1/contexts", json={"text": TEXT}).json()
            secret = c.post("/v1/contexts", json={"text": TEXT, "encrypt": True}).json()
            assert plain["status"] == secret["status"] == "queued"
            assert secret["encryption_key"]
            total = plain["num_chunks"] * 2
            # the server answers while it encodes (a /healthz between two job polls that both
            # say "running"; the client's timeout is only a hang guard), and progress moves
            seen = []
            answered_mid_encode = 0
            deadline = time.monotonic() + 60
            while True:
                before = _job(c, plain["job_id"])
                assert c.get("/healthz").status_code == 200
                jp, js = _job(c, plain["job_id"]), _job(c, secret["job_id"])
                if before["state"] == jp["state"] == "running":
                    answered_mid_encode += 1
                seen.append(jp["progress"]["done"])
                if (answered_mid_encode and jp["state"] == js["state"] == "running"
                        and 4 <= jp["progress"]["done"] < total
                        and 1 <= js["progress"]["done"] < total):
                    break
                assert jp["state"] in ("queued", "running") and time.monotonic() < deadline, jp
                time.sleep(0.02)
            assert seen == sorted(seen)
            pending = c.get(plain["manifest_url"])
            assert pending.status_code == 404
            assert pending.json()["error"]["code"] == "context_pending"
            assert pending.json()["error"]["job_id"] == plain["job_id"]
        server.kill()  # SIGKILL: no cleanup at all

        # half-encoded contexts are invisible in the store
        store = open_store(store_url)
        assert store.manifests.contexts("alice") == []
        assert store.manifests.get("alice", plain["context_id"]) is None
        assert 0 < len(store.chunks.keys("alice", plain["context_id"])) < total

        server = ServerProcess(tmp_path / "s.yaml", store_url,
                               log_path=tmp_path / "log2").start()
        with httpx.Client(base_url=server.url, headers=headers, timeout=30) as c:
            jp = _wait(c, plain["job_id"])
            assert jp["state"] == "done", jp
            assert jp["resumed"] is True and jp["attempts"] == 2
            assert jp["timings"]["frames_reused"] >= 4
            assert jp["timings"]["frames_reused"] + jp["timings"]["frames_encoded"] == total
            m = c.get(plain["manifest_url"]).json()
            for ch in m["chunks"]:
                for lv in m["levels"]:
                    r = c.get(f"/v1/contexts/{plain['context_id']}/chunks/{ch['t']}/{ch['l']}/0",
                              params={"level": lv})
                    assert r.status_code == 200
                    assert checksum(r.content) == ch["levels"][lv]["checksum"]
                    assert tuple(decode(r.content).id) == (ch["t"], ch["l"], 0)

            js = _wait(c, secret["job_id"])
            assert js["state"] == "failed"
            assert "encryption key" in js["error"] and "create the context again" in js["error"]
            r = c.get(secret["manifest_url"])
            assert r.status_code == 404
            err = r.json()["error"]
            assert err["code"] == "context_not_found" and err["job_state"] == "failed"
            assert "encryption key" in err["job_error"]
            assert store.chunks.keys("alice", secret["context_id"]) == set()

            # creating it again works, with a new key
            again = c.post("/v1/contexts", json={"text": TEXT, "encrypt": True}).json()
            assert again["context_id"] == secret["context_id"] and again["encryption_key"]
            assert again["job_id"] != secret["job_id"]
            assert _wait(c, again["job_id"])["state"] == "done"
            metrics = c.get("/metrics").text
            assert 'sparkv_jobs_total{event="resumed"} 1.0' in metrics

            # deleting a context while it is encoded cancels its job and leaves nothing behind
            other = c.post("/v1/contexts", json={"text": TEXT + " more"}).json()
            while _job(c, other["job_id"])["progress"]["done"] < 3:
                time.sleep(0.02)
            assert c.delete(other["manifest_url"]).status_code == 204
            busy = c.post("/v1/contexts", json={"text": TEXT + " more"})
            assert busy.status_code in (202, 409)  # 409 while the cancelled job winds down
            if busy.status_code == 409:
                assert busy.json()["error"]["code"] == "context_busy"
            job = _wait(c, other["job_id"])
            assert job["state"] == "cancelled" and "deleted" in job["error"]
            if busy.status_code == 202:  # the job had ended already: a new one was queued
                _wait(c, busy.json()["job_id"])
            else:
                assert c.get(other["manifest_url"]).status_code == 404
                assert store.chunks.keys("alice", other["context_id"]) == set()
            # a graceful stop (SIGTERM) mid-encode leaves the job queued for the next start
            last = c.post("/v1/contexts", json={"text": TEXT + " last"}).json()
            while _job(c, last["job_id"])["progress"]["done"] < 2:
                time.sleep(0.02)
        server.stop()
        assert "Application shutdown complete" in server.log()  # graceful, not killed
        import json
        rec = json.loads(store.jobs.get("alice", last["job_id"]))
        assert rec["state"] == "queued" and rec["phase"] == "interrupted"
        assert store.manifests.get("alice", last["context_id"]) is None
        server = ServerProcess(tmp_path / "s.yaml", store_url,
                               log_path=tmp_path / "log3").start()
        with httpx.Client(base_url=server.url, headers=headers, timeout=30) as c:
            job = _wait(c, last["job_id"])
            assert job["state"] == "done" and job["resumed"] and job["timings"]["frames_reused"]
        _assert_store_consistent(store_url, "alice")
    finally:
        server.stop()
    assert "Traceback" not in server.log()

