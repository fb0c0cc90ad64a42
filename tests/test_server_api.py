"""The REST API against a real uvicorn on a real loopback port (``sparkv serve`` subprocesses).

A tiny random Llama (with SmolLM2's tokenizer) is used wherever the model's quality does not
matter; the end-to-end test uses the bundled SmolLM2 and checks that the ``raw`` chunks assemble
into exactly the server's prefill.
"""

from __future__ import annotations

import json
import random
import re
import socket
import time

import httpx
import pytest
import torch

from sparkv.codec import CodecError, decode, get_level
from sparkv.protocol.crypto import FrameCipher, key_from_text
from sparkv.server.process import (HOST, RedisProcess, ServerProcess, redis_server_available,
                                   write_config)
from helpers import (FLOAT32_SERVER, api_client, assert_error, create_context,
                     shared_tiny_checkpoint, start_tiny_server, stop_checked, tenant_fixture,
                     wait_job)
from sparkv.protocol import split_records as parse_frame_stream

TEXT = ("The quick brown fox jumps over the lazy dog. " * 12).strip()


# ------------------------------------------------------------------------------------------------
# fixtures and helpers
# ------------------------------------------------------------------------------------------------
def client(server: ServerProcess, key: str | None) -> httpx.Client:
    return api_client(server, key)


def create(c: httpx.Client, **body) -> dict:
    return create_context(c, **body)


def all_items(manifest: dict) -> list[tuple[int, int, int, str]]:
    return [(c["t"], c["l"], c["g"], lv) for c in manifest["chunks"] for lv in manifest["levels"]]


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    server = start_tiny_server(tmp_path_factory.mktemp("api"), max_context_tokens=512)
    yield server
    stop_checked(server)


alice = tenant_fixture("tiny_server", "alice")
bob = tenant_fixture("tiny_server", "bob")


@pytest.fixture(scope="module")
def ctx(alice):
    """One encoded context of alice's: (create response, manifest)."""
    out = create(alice, text=TEXT, levels=["raw", "q8", "q5"])
    m = alice.get(out["manifest_url"]).json()
    return out, m


# ------------------------------------------------------------------------------------------------
# end to end with the real model
# ------------------------------------------------------------------------------------------------
def test_end_to_end_smollm2_raw_equals_the_servers_prefill(smollm2, tmp_path):
    from sparkv.runtime import reference_prefill, sample_text

    text = sample_text()[:1200]
    keys = write_config(tmp_path / "s.yaml", ["alice"], default_levels=["raw", "q5"],
                        default_chunk_tokens=64)
    with ServerProcess(tmp_path / "s.yaml", f"file://{tmp_path}/store",
                       log_path=tmp_path / "server.log", env=FLOAT32_SERVER) as server, \
            client(server, keys["alice"]) as c:
        r = c.post("/v1/contexts", json={"text": text})
        assert r.status_code == 202, r.text
        created = r.json()
        assert r.headers["location"] == created["manifest_url"]
        job = wait_job(c, created["job_id"])
        assert job["state"] == "done" and job["error"] is None
        assert job["progress"]["done"] == job["progress"]["total"] == created["num_chunks"] * 2

        manifest = c.get(created["manifest_url"]).json()
        ids = smollm2.encode_text(text)
        assert manifest["num_tokens"] == len(ids) == created["num_tokens"]
        geo = manifest["geometry"]
        assert (geo["num_layers"], geo["num_kv_heads"], geo["head_dim"]) == (30, 3, 64)
        assert len(manifest["chunks"]) == geo["num_chunks"] == created["num_chunks"]
        for chunk in manifest["chunks"]:
            for lv in ("raw", "q5"):
                e = chunk["levels"][lv]
                assert e["bytes"] > 0 and e["checksum"].startswith("xxh3_128:")
                if lv == "raw":
                    assert e["k"]["bits"] == e["v"]["bits"] == 0
            q5 = chunk["levels"]["q5"]
            k_bits, v_bits = get_level("q5").bits(chunk["l"], geo["num_layers"])
            assert (q5["k"]["bits"], q5["v"]["bits"]) == (k_bits, v_bits)   # the layer's bits
            assert 0 < q5["entropy_bits_per_value"] <= max(k_bits, v_bits)
            assert q5["bytes"] < chunk["levels"]["raw"]["bytes"] / 3

        # every chunk fetched and decoded; raw assembles into exactly the server's prefill
        prev = torch.get_num_threads()
        torch.set_num_threads(1)  # the server's thread count: same kernels, same bits
        try:
            ref = reference_prefill(smollm2, ids)
        finally:
            torch.set_num_threads(prev)
        n = len(ids)
        k_raw = [torch.full((1, 3, n, 64), float("nan")) for _ in range(30)]
        v_raw = [torch.full((1, 3, n, 64), float("nan")) for _ in range(30)]
        for chunk in manifest["chunks"]:
            t, layer, g = chunk["t"], chunk["l"], chunk["g"]
            s, e = chunk["token_start"], chunk["token_start"] + chunk["num_tokens"]
            for lv in ("raw", "q5"):
                r = c.get(f"/v1/contexts/{created['context_id']}/chunks/{t}/{layer}/{g}",
                          params={"level": lv})
                assert r.status_code == 200
                assert len(r.content) == chunk["levels"][lv]["bytes"]
                dec = decode(r.content)
                assert tuple(dec.id) == (t, layer, g) and dec.token_start == s
                if lv == "raw":
                    k_raw[layer][0, :, s:e] = dec.k
                    v_raw[layer][0, :, s:e] = dec.v
                else:  # quantized: within half a step of the prefill
                    for x, refx, which in ((dec.k, ref[layer][0], "k"),
                                           (dec.v, ref[layer][1], "v")):
                        bound = chunk["levels"][lv][which]["step_max"] / 2 + 1e-5
                        assert float((x - refx[0, :, s:e]).abs().max()) <= bound
        for layer in range(30):
            assert torch.equal(k_raw[layer], ref[layer][0]), f"K of layer {layer} differs"
            assert torch.equal(v_raw[layer], ref[layer][1]), f"V of layer {layer} differs"

        # the same request again: the same context, nothing encoded twice
        again = c.post("/v1/contexts", json={"text": text})
        assert again.status_code == 200
        assert again.json()["context_id"] == created["context_id"]
        assert again.json()["status"] == "done"
        assert again.json()["job_id"] == created["job_id"]
        metrics = c.get("/metrics").text
        assert 'sparkv_jobs_total{event="submitted"} 1.0' in metrics
    assert "Traceback" not in server.log()


# ------------------------------------------------------------------------------------------------
# contexts, jobs, manifests
# ------------------------------------------------------------------------------------------------
def test_create_from_token_ids_and_dedupe(alice, ctx):
    created, manifest = ctx
    assert created["status"] in ("queued", "running", "done")
    assert manifest["context_id"] == created["context_id"]
    assert manifest["levels"] == ["raw", "q8", "q5"]  # canonical order
    # the same content in another order of levels or as token ids is the same context
    tok = [1, 2, 3]
    a = alice.post("/v1/contexts", json={"token_ids": tok, "levels": ["q5", "raw"]})
    b = alice.post("/v1/contexts", json={"token_ids": tok, "levels": ["raw", "q5", "q5"]})
    assert a.status_code == 202 and b.status_code in (200, 202)
    assert a.json()["context_id"] == b.json()["context_id"]
    assert a.json()["job_id"] == b.json()["job_id"]
    assert wait_job(alice, a.json()["job_id"])["state"] == "done"
    # other parameters make another context
    c = alice.post("/v1/contexts", json={"token_ids": tok, "levels": ["raw"]})
    assert c.json()["context_id"] != a.json()["context_id"]
    d = alice.post("/v1/contexts", json={"token_ids": tok, "levels": ["q5", "raw"],
                                         "chunk_tokens": 16})
    assert d.json()["context_id"] != a.json()["context_id"]


def test_concurrent_identical_requests_share_one_job(alice):
    import concurrent.futures as cf

    body = {"token_ids": list(range(40, 90)), "levels": ["q4"]}
    with cf.ThreadPoolExecutor(6) as pool:
        rs = list(pool.map(lambda _: alice.post("/v1/contexts", json=body), range(6)))
    assert {r.json()["context_id"] for r in rs} == {rs[0].json()["context_id"]}
    assert len({r.json()["job_id"] for r in rs}) == 1
    assert wait_job(alice, rs[0].json()["job_id"])["state"] == "done"


def test_job_progress_fields(alice, ctx):
    created, _ = ctx
    job = alice.get(f"/v1/jobs/{created['job_id']}").json()
    assert job["progress"] == {"done": job["progress"]["total"], "total": job["progress"]["total"],
                               "fraction": 1.0}
    assert job["context_id"] == created["context_id"] and job["attempts"] == 1
    assert "token_ids" not in json.dumps(job) and "tenant" not in job
    assert set(job["timings"]) >= {"prefill_s", "codec_s", "store_s"}


def test_manifest_lists_every_chunk_with_sizes_entropy_quant_and_checksums(ctx):
    created, m = ctx
    geo = m["geometry"]
    assert geo["num_chunks"] == geo["num_token_chunks"] * geo["num_layers"] * geo["num_groups"]
    assert {(c["t"], c["l"], c["g"]) for c in m["chunks"]} == {
        (t, layer, 0) for t in range(geo["num_token_chunks"]) for layer in range(geo["num_layers"])}
    for c in m["chunks"]:
        assert set(c["levels"]) == {"raw", "q8", "q5"}
        assert c["levels"]["raw"]["entropy_bits_per_value"] is None
        for lv in ("q8", "q5"):
            e = c["levels"][lv]
            assert e["k"]["bits"] >= int(lv[1:]) and e["k"]["coding"] in ("huffman", "constant")
            assert e["k"]["axis"] in ("channel", "token") and e["k"]["step_max"] > 0
            assert 0 < e["entropy_bits_per_value"] <= e["k"]["bits"]
        assert c["levels"]["q5"]["bytes"] < c["levels"]["q8"]["bytes"] < c["levels"]["raw"]["bytes"]
    for lv in m["levels"]:
        assert m["total_bytes"][lv] == sum(c["levels"][lv]["bytes"] for c in m["chunks"])
    assert m["encryption"] is None


def listed_ids(c: httpx.Client) -> list[str]:
    return [x["context_id"] for x in c.get("/v1/contexts").json()["contexts"]]


def test_list_contexts_and_models(alice, bob, ctx):
    created, m = ctx
    assert created["context_id"] in listed_ids(alice)
    assert created["context_id"] not in listed_ids(bob)
    entry = next(x for x in alice.get("/v1/contexts").json()["contexts"]
                 if x["context_id"] == created["context_id"])
    assert entry == {"context_id": created["context_id"], "name": None,
                     "num_tokens": m["num_tokens"], "model": "tiny", "levels": ["raw", "q8", "q5"],
                     "press": None, "encrypted": False, "created_unix": m["created_unix"]}
    models = alice.get("/v1/models").json()["models"]
    assert models == [{"name": "tiny", "default": True, "loaded": True}]


# ------------------------------------------------------------------------------------------------
# auth and tenant isolation
# ------------------------------------------------------------------------------------------------
def test_missing_and_wrong_keys_are_401(tiny_server, ctx):
    created, _ = ctx
    cid = created["context_id"]
    urls = [("GET", f"/v1/contexts/{cid}"), ("GET", f"/v1/contexts/{cid}/chunks/0/0/0"),
            ("GET", "/v1/contexts"), ("GET", f"/v1/jobs/{created['job_id']}"),
            ("GET", "/v1/models"), ("DELETE", f"/v1/contexts/{cid}")]
    with httpx.Client(base_url=tiny_server.url) as anon:
        for method, url in urls:
            err = assert_error(anon.request(method, url), 401, "missing_api_key")
            assert "API key" in err["message"]
        r = anon.post("/v1/contexts", json={"text": "x"})
        assert_error(r, 401, "missing_api_key")
        assert r.headers["www-authenticate"].startswith("Bearer")
        # malformed body without a key: still 401, nothing else is revealed
        assert_error(anon.post("/v1/contexts", content=b"{nope"), 401)
        for headers in ({"Authorization": "Bearer skv_wrong"}, {"X-API-Key": "skv_wrong"},
                        {"Authorization": "Basic YWxpY2U6eA=="},
                        {"Authorization": f"Token {tiny_server.keys['alice']}"}):
            assert_error(anon.get(f"/v1/contexts/{cid}", headers=headers), 401,
                         "invalid_api_key")
        # the X-API-Key header works too; public endpoints need no key
        ok = anon.get(f"/v1/contexts/{cid}", headers={"X-API-Key": tiny_server.keys["alice"]})
        assert ok.status_code == 200
        assert anon.get("/healthz").status_code == 200
        assert anon.get("/metrics").status_code == 200
        assert anon.get("/openapi.json").status_code == 200


def test_another_tenants_ids_are_404(bob, ctx):
    created, m = ctx
    cid = created["context_id"]
    assert_error(bob.get(f"/v1/contexts/{cid}"), 404, "context_not_found")
    assert_error(bob.get(f"/v1/contexts/{cid}/chunks/0/0/0", params={"level": "raw"}), 404,
                 "context_not_found")
    assert_error(bob.post(f"/v1/contexts/{cid}/stream", json={"chunks": [{"t": 0, "l": 0}]}),
                 404, "context_not_found")
    assert_error(bob.get(f"/v1/jobs/{created['job_id']}"), 404, "job_not_found")
    assert_error(bob.delete(f"/v1/contexts/{cid}"), 404, "context_not_found")
    # bob encoding the same text gets his own context, and alice's is intact
    mine = bob.post("/v1/contexts", json={"text": TEXT, "levels": ["raw", "q8", "q5"]}).json()
    assert mine["context_id"] != cid
    assert wait_job(bob, mine["job_id"])["state"] == "done"


# ------------------------------------------------------------------------------------------------
# chunk GET: ETag, 304, Range
# ------------------------------------------------------------------------------------------------
def chunk_url(cid: str, t: int, layer: int, g: int = 0) -> str:
    return f"/v1/contexts/{cid}/chunks/{t}/{layer}/{g}"


def test_etag_and_304(alice, ctx):
    created, m = ctx
    cid = created["context_id"]
    entry = m["chunks"][1]["levels"]["q5"]
    url = chunk_url(cid, m["chunks"][1]["t"], m["chunks"][1]["l"])
    r = alice.get(url, params={"level": "q5"})
    assert r.status_code == 200
    etag = r.headers["etag"]
    assert etag == '"' + entry["checksum"].split(":")[1] + '"' and not etag.startswith("W/")
    assert "immutable" in r.headers["cache-control"]
    assert r.headers["cache-control"].startswith("private")
    assert r.headers["content-type"] == "application/vnd.sparkv.frame"
    assert r.headers["accept-ranges"] == "bytes"
    import xxhash
    assert xxhash.xxh3_128_hexdigest(r.content) == etag.strip('"')
    for inm in (etag, f"W/{etag}", f'"nope", {etag}', "*"):
        r304 = alice.get(url, params={"level": "q5"}, headers={"If-None-Match": inm})
        assert r304.status_code == 304 and r304.content == b""
        assert r304.headers["etag"] == etag and "immutable" in r304.headers["cache-control"]
    assert alice.get(url, params={"level": "q5"},
                     headers={"If-None-Match": '"other"'}).status_code == 200
    # another level of the same chunk has another ETag
    assert alice.get(url, params={"level": "q8"}).headers["etag"] != etag
    # the manifest is revalidated by ETag too, and its 304 is counted like a frame's
    mr = alice.get(f"/v1/contexts/{cid}")
    before = _metric(alice, "sparkv_not_modified_total")
    assert alice.get(f"/v1/contexts/{cid}",
                     headers={"If-None-Match": mr.headers["etag"]}).status_code == 304
    assert _metric(alice, "sparkv_not_modified_total") == before + 1


def test_range_requests(alice, ctx):
    created, m = ctx
    cid = created["context_id"]
    url = chunk_url(cid, 0, 1)
    full = alice.get(url, params={"level": "raw"}).content
    size = len(full)
    etag = alice.get(url, params={"level": "raw"}).headers["etag"]

    def rng(value: str, **headers):
        return alice.get(url, params={"level": "raw"}, headers={"Range": value, **headers})

    r = rng("bytes=0-9")
    assert r.status_code == 206 and r.content == full[:10]
    assert r.headers["content-range"] == f"bytes 0-9/{size}" and r.headers["etag"] == etag
    r = rng("bytes=100-")
    assert r.status_code == 206 and r.content == full[100:]
    r = rng("bytes=-64")
    assert r.status_code == 206 and r.content == full[-64:]
    assert r.headers["content-range"] == f"bytes {size - 64}-{size - 1}/{size}"
    r = rng(f"bytes=10-{size + 1000}")
    assert r.status_code == 206 and r.content == full[10:]
    # reassembling a frame from ranges gives the frame
    parts = [rng(f"bytes={a}-{min(a + 999, size - 1)}").content for a in range(0, size, 1000)]
    assert b"".join(parts) == full
    r = rng(f"bytes={size}-")
    err = assert_error(r, 416, "range_not_satisfiable")
    assert r.headers["content-range"] == f"bytes */{size}" and err["size"] == size
    assert rng("bytes=-0").status_code == 416
    # ignored: several ranges, other units, bad syntax, a stale If-Range
    for value in ("bytes=0-1,5-9", "items=0-1", "bytes=9-3", "bytes=abc"):
        r = rng(value)
        assert r.status_code == 200 and r.content == full, value
    assert rng("bytes=0-9", **{"If-Range": '"stale"'}).status_code == 200
    assert rng("bytes=0-9", **{"If-Range": etag}).status_code == 206


# ------------------------------------------------------------------------------------------------
# the stream endpoint
# ------------------------------------------------------------------------------------------------
def test_stream_keeps_the_requested_order(alice, ctx):
    created, m = ctx
    cid = created["context_id"]
    items = all_items(m)
    rnd = random.Random(4)
    order = items + rnd.sample(items, 5)  # with repeats
    rnd.shuffle(order)
    body = {"chunks": [{"t": t, "l": layer, "g": g, "level": lv} for t, layer, g, lv in order]}
    r = alice.post(f"/v1/contexts/{cid}/stream", json=body)
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/vnd.sparkv.frames"
    assert int(r.headers["x-sparkv-frames"]) == len(order)
    assert int(r.headers["content-length"]) == len(r.content)
    frames = parse_frame_stream(r.content)
    assert len(frames) == len(order)
    for (t, layer, g, lv), frame in zip(order, frames):
        assert frame == alice.get(chunk_url(cid, t, layer, g), params={"level": lv}).content
        dec = decode(frame)
        assert tuple(dec.id) == (t, layer, g)
    # the request's default level applies to items without one
    r = alice.post(f"/v1/contexts/{cid}/stream",
                   json={"level": "q8", "chunks": [{"t": 0, "l": 1}, {"t": 0, "l": 0,
                                                                       "level": "raw"}]})
    f = parse_frame_stream(r.content)
    assert f[0] == alice.get(chunk_url(cid, 0, 1), params={"level": "q8"}).content
    assert f[1] == alice.get(chunk_url(cid, 0, 0), params={"level": "raw"}).content


def _metric(c: httpx.Client, name: str) -> float:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_stream_survives_an_early_close(tiny_server, alice, ctx):
    created, m = ctx
    cid = created["context_id"]
    raw = [it for it in all_items(m) if it[3] == "raw"]
    items = raw * (1200 // len(raw))  # ~10 MB of frames, a request body under the 64 KiB limit
    body = json.dumps({"chunks": [{"t": t, "l": layer, "g": g}
                                  for t, layer, g, lv in items], "level": "raw"}).encode()
    before = _metric(alice, "sparkv_streams_aborted_total")
    for _ in range(3):
        # a raw socket, so that the close is abrupt and early (after the first bytes)
        with socket.create_connection((HOST, tiny_server.port)) as s:
            req = (f"POST /v1/contexts/{cid}/stream HTTP/1.1\r\nHost: x\r\n"
                   f"Authorization: Bearer {tiny_server.keys['alice']}\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
            s.sendall(req.encode() + body)
            got = s.recv(65536)
            assert got.startswith(b"HTTP/1.1 200")
    deadline = time.monotonic() + 10
    while _metric(alice, "sparkv_streams_aborted_total") < before + 3:
        assert time.monotonic() < deadline, "the aborted streams were not noticed"
        time.sleep(0.05)
    # the server is fine: a complete stream and a GET right after
    r = alice.post(f"/v1/contexts/{cid}/stream", json={"chunks": [{"t": 0, "l": 0}]})
    assert r.status_code == 200 and len(parse_frame_stream(r.content)) == 1
    assert alice.get("/healthz").json()["status"] == "ok"


def test_stream_with_httpx_closed_after_first_frame(alice, ctx):
    created, m = ctx
    cid = created["context_id"]
    items = [it for it in all_items(m) if it[3] == "raw"] * 200
    req = {"chunks": [{"t": t, "l": layer, "g": g, "level": lv} for t, layer, g, lv in items]}
    with alice.stream("POST", f"/v1/contexts/{cid}/stream", json=req) as r:
        assert r.status_code == 200
        first = next(r.iter_bytes())
        assert len(first) > 4
    assert alice.get(f"/v1/contexts/{cid}").status_code == 200


# ------------------------------------------------------------------------------------------------
# bad input -> 4xx with a clear JSON error
# ------------------------------------------------------------------------------------------------
def test_bad_create_requests(alice):
    assert "unknown model" in assert_error(
        alice.post("/v1/contexts", json={"text": "hi", "model": "gpt-9"}), 400,
        "unknown_model")["message"]
    err = assert_error(alice.post("/v1/contexts", json={"token_ids": [5] * 600}), 400,
                       "context_too_long")
    assert err["max_tokens"] == 512 and err["num_tokens"] == 600
    assert_error(alice.post("/v1/contexts", json={"text": "word " * 700}), 400,
                 "context_too_long")
    for ids in (["a"], [-1], [1.5], [], "123", [[1]], [True]):
        assert_error(alice.post("/v1/contexts", json={"token_ids": ids}), 422, "invalid_request")
    err = assert_error(alice.post("/v1/contexts", json={"token_ids": [1, 2, 10**6]}), 400,
                       "token_out_of_range")
    assert err["index"] == 2
    assert_error(alice.post("/v1/contexts", json={"text": "a", "token_ids": [1]}), 422)
    assert_error(alice.post("/v1/contexts", json={}), 422)
    assert_error(alice.post("/v1/contexts", json={"text": "a", "levels": ["q9"]}), 422)
    assert_error(alice.post("/v1/contexts", json={"text": "a", "chunk_tokens": 8}), 422)
    assert_error(alice.post("/v1/contexts", json={"text": "a", "heads_per_group": 3}), 400,
                 "bad_geometry")
    assert_error(alice.post("/v1/contexts", json={"text": "a", "bogus": 1}), 422)
    assert_error(alice.post("/v1/contexts", content=b"{not json",
                            headers={"content-type": "application/json"}), 400,
                 "malformed_json")
    # a body over the configured limit (64 KiB here): declared, and streamed without a length
    err = assert_error(alice.post("/v1/contexts", json={"text": "x" * 70000}), 413,
                       "body_too_large")
    assert "65536" in err["message"]

    def chunks():
        for _ in range(20):
            yield b" " * 8192

    assert_error(alice.post("/v1/contexts", content=chunks(),
                            headers={"content-type": "application/json"}), 413)


def test_bad_chunk_requests(alice, ctx):
    created, m = ctx
    cid = created["context_id"]
    geo = m["geometry"]
    err = assert_error(alice.get(chunk_url(cid, geo["num_token_chunks"], 0)), 404,
                       "chunk_out_of_range")
    assert err["coordinate"] == "t" and err["bound"] == geo["num_token_chunks"]
    assert assert_error(alice.get(chunk_url(cid, 0, geo["num_layers"])), 404,
                        "chunk_out_of_range")["coordinate"] == "l"
    assert assert_error(alice.get(chunk_url(cid, 0, 0, 1)), 404,
                        "chunk_out_of_range")["coordinate"] == "g"
    err = assert_error(alice.get(chunk_url(cid, 0, 0), params={"level": "q3"}), 404,
                       "level_not_available")
    assert err["levels"] == ["raw", "q8", "q5"]
    assert "level" in assert_error(alice.get(chunk_url(cid, 0, 0), params={"level": "q99"}),
                                   422, "invalid_request")["message"]
    assert_error(alice.get(f"/v1/contexts/{cid}/chunks/-1/0/0"), 422)
    assert_error(alice.get(f"/v1/contexts/{cid}/chunks/x/0/0"), 422)
    assert_error(alice.get("/v1/contexts/not-an-id"), 422)
    assert_error(alice.get("/v1/contexts/" + "0" * 32), 404, "context_not_found")
    assert_error(alice.get("/v1/jobs/zzz"), 422)
    assert_error(alice.get("/v1/jobs/" + "0" * 32), 404, "job_not_found")
    assert_error(alice.get("/v1/nope"), 404, "not_found")
    assert_error(alice.put(f"/v1/contexts/{cid}"), 405, "method_not_allowed")
    # stream: the first bad item is named, nothing is streamed
    err = assert_error(alice.post(f"/v1/contexts/{cid}/stream", json={"chunks": [
        {"t": 0, "l": 0}, {"t": 0, "l": 99}]}), 404, "chunk_out_of_range")
    assert err["index"] == 1 and "chunks[1]" in err["message"]
    assert_error(alice.post(f"/v1/contexts/{cid}/stream", json={"chunks": [
        {"t": 0, "l": 0, "level": "q4"}]}), 404, "level_not_available")
    assert_error(alice.post(f"/v1/contexts/{cid}/stream", json={"chunks": []}), 422)
    assert_error(alice.post(f"/v1/contexts/{cid}/stream", json={"chunks": [{"t": "0", "l": 0}]}),
                 422)
    assert_error(alice.post(f"/v1/contexts/{cid}/stream",
                            json={"chunks": [{"t": 0, "l": 0, "level": "zz"}]}), 422)


# ------------------------------------------------------------------------------------------------
# delete, encryption, metrics, OpenAPI
# ------------------------------------------------------------------------------------------------
def test_delete(alice):
    out = create(alice, token_ids=list(range(100, 170)), levels=["q5"])
    cid = out["context_id"]
    assert alice.get(chunk_url(cid, 0, 0)).status_code == 200
    r = alice.delete(f"/v1/contexts/{cid}")
    assert r.status_code == 204 and r.content == b""
    assert_error(alice.get(f"/v1/contexts/{cid}"), 404, "context_not_found")
    assert_error(alice.get(chunk_url(cid, 0, 0)), 404, "context_not_found")
    assert_error(alice.delete(f"/v1/contexts/{cid}"), 404)
    assert cid not in listed_ids(alice)
    again = create(alice, token_ids=list(range(100, 170)), levels=["q5"])  # encodes anew
    assert again["context_id"] == cid and again["job_id"] != out["job_id"]
    assert alice.get(chunk_url(cid, 0, 0)).status_code == 200


def test_encrypted_context(alice, ctx):
    _, plain = ctx
    r = alice.post("/v1/contexts", json={"text": TEXT, "levels": ["raw", "q8", "q5"],
                                         "encrypt": True})
    assert r.status_code == 202
    out = r.json()
    key = key_from_text(out["encryption_key"])
    assert out["encrypted"] and out["context_id"] != plain["context_id"]
    assert wait_job(alice, out["job_id"])["state"] == "done"
    # the key is handed out once
    again = alice.post("/v1/contexts", json={"text": TEXT, "levels": ["raw", "q8", "q5"],
                                             "encrypt": True}).json()
    assert again["context_id"] == out["context_id"] and again["encryption_key"] is None
    m = alice.get(out["manifest_url"]).json()
    assert m["encryption"]["algorithm"] == "AES-256-GCM"
    cipher = FrameCipher(key, out["context_id"])
    cid = out["context_id"]
    for c in m["chunks"][:3]:
        for lv in m["levels"]:
            r = alice.get(chunk_url(cid, c["t"], c["l"]), params={"level": lv})
            assert r.headers["cache-control"].startswith("public")  # ciphertext may be cached
            data = r.content
            assert len(data) == c["levels"][lv]["bytes"] == c["levels"][lv]["frame_bytes"] + 28
            with pytest.raises(CodecError):
                decode(data)
            frame = cipher.open(data, c["t"], c["l"], c["g"], lv)
            assert len(frame) == c["levels"][lv]["frame_bytes"]
            dec = decode(frame)
            assert tuple(dec.id) == (c["t"], c["l"], c["g"])
            if lv == "raw":  # the same plaintext as the unencrypted context's
                assert frame == alice.get(chunk_url(plain["context_id"], c["t"], c["l"]),
                                          params={"level": "raw"}).content
            # a frame does not open as another chunk or level
            from sparkv.protocol.crypto import DecryptionError
            with pytest.raises(DecryptionError):
                cipher.open(data, c["t"], c["l"] + 1, c["g"], lv)
    s = alice.post(f"/v1/contexts/{cid}/stream", json={"chunks": [{"t": 0, "l": 0}]})
    assert s.headers["x-sparkv-encrypted"] == "1"
    assert cipher.open(parse_frame_stream(s.content)[0], 0, 0, 0, "q5")


def test_metrics_and_health(alice, ctx):
    text = alice.get("/metrics").text
    for name in ("sparkv_http_requests_total", "sparkv_http_request_duration_seconds_bucket",
                 "sparkv_http_response_bytes_total", "sparkv_frames_served_total",
                 "sparkv_jobs_total", "sparkv_jobs_active", "sparkv_encode_frames_total",
                 "sparkv_encode_phase_seconds_total", "sparkv_auth_failures_total"):
        assert name in text, name
    assert 'route="/v1/contexts/{context_id}/chunks/{t}/{l}/{g}"' in text
    h = alice.get("/healthz").json()
    assert h["status"] == "ok" and h["store"] == "ok"  # no URL or path: /healthz needs no key
    assert "file://" not in json.dumps(h)


def test_openapi_lists_every_endpoint(tiny_server):
    spec = httpx.get(f"{tiny_server.url}/openapi.json").json()
    paths = spec["paths"]
    assert set(paths) >= {"/v1/contexts", "/v1/jobs/{job_id}", "/v1/contexts/{context_id}",
                          "/v1/contexts/{context_id}/chunks/{t}/{l}/{g}",
                          "/v1/contexts/{context_id}/stream", "/healthz", "/metrics",
                          "/v1/models"}
    assert set(paths["/v1/contexts/{context_id}"]) == {"get", "delete"}
    assert "bearer" in spec["components"]["securitySchemes"]
    assert httpx.get(f"{tiny_server.url}/docs").status_code == 200


def test_offline_encoder_writes_what_the_server_serves(tiny_server, alice, tmp_path, capsys,
                                                       monkeypatch):
    from sparkv.cli import main

    monkeypatch.delenv("TQDM_DISABLE", raising=False)  # its bar is checked below

    text_file = tmp_path / "ctx.txt"
    text_file.write_text("An offline context. " * 20)
    argv = ["encode", str(text_file), "--config", str(tiny_server.config_path), "--store",
            f"file://{tiny_server.store_dir}", "--tenant", "alice", "--levels", "q5,raw", "--json",
            "--encode-threads", "3"]
    assert main(argv[:-1] + ["-1"]) == 2     # a bad thread count: the config's error
    capsys.readouterr()
    assert main(argv) == 0  # in this process: the same code as the `sparkv encode` command
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["status"] == "encoded" and out["frames"] > 0
    assert "100%" in captured.err and "frame" in captured.err  # the progress bar
    # the server derives the same id for the same request and finds it done: no job
    r = alice.post("/v1/contexts", json={"text": text_file.read_text(), "levels": ["raw", "q5"]})
    assert r.status_code == 200 and r.json()["status"] == "done"
    assert r.json()["context_id"] == out["context_id"]
    m = alice.get(f"/v1/contexts/{out['context_id']}").json()
    frames = parse_frame_stream(alice.post(
        f"/v1/contexts/{out['context_id']}/stream",
        json={"chunks": [{"t": c["t"], "l": c["l"]} for c in m["chunks"]]}).content)
    assert [tuple(decode(f).id) for f in frames] == [(c["t"], c["l"], 0) for c in m["chunks"]]
    # running it again does nothing
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "exists"


# ------------------------------------------------------------------------------------------------
# the whole server on Redis
# ------------------------------------------------------------------------------------------------
def test_server_on_redis(tmp_path):
    if not redis_server_available():
        pytest.skip("redis-server is not installed")
    redis = RedisProcess(tmp_path / "redis").start()
    try:
        keys = write_config(tmp_path / "s.yaml", ["alice", "bob"],
                            models={"tiny": str(shared_tiny_checkpoint())}, default_model="tiny",
                            default_levels=["raw", "q5"], default_chunk_tokens=32)
        with ServerProcess(tmp_path / "s.yaml", redis.url, log_path=tmp_path / "log") as server, \
                client(server, keys["alice"]) as c, client(server, keys["bob"]) as b:
            health = c.get("/healthz").json()
            assert health["store"] == "ok" and "redis://" not in json.dumps(health)
            out = create(c, text=TEXT)
            m = c.get(out["manifest_url"]).json()
            items = all_items(m)
            frames = parse_frame_stream(c.post(f"/v1/contexts/{out['context_id']}/stream", json={
                "chunks": [{"t": t, "l": layer, "g": g, "level": lv}
                           for t, layer, g, lv in items]}).content)
            for (t, layer, g, lv), f in zip(items, frames):
                r = c.get(chunk_url(out["context_id"], t, layer, g), params={"level": lv})
                assert r.content == f and decode(f).id == (t, layer, g)
                assert c.get(chunk_url(out["context_id"], t, layer, g), params={"level": lv},
                             headers={"If-None-Match": r.headers["etag"]}).status_code == 304
            r = c.get(chunk_url(out["context_id"], 0, 0), params={"level": "raw"},
                      headers={"Range": "bytes=8-15"})
            assert r.status_code == 206 and r.content == frames[items.index((0, 0, 0, "raw"))][8:16]
            assert_error(b.get(out["manifest_url"]), 404)
            assert c.delete(out["manifest_url"]).status_code == 204
            assert_error(c.get(out["manifest_url"]), 404)
    finally:
        redis.stop()


def test_a_context_keeps_its_first_name_and_the_list_reports_it(alice, bob):
    """``name`` labels a context (the manifest's, the list's); it is not part of the id: the same
    tokens under another name are the same context and keep the first name."""
    ids = list(range(300, 340))
    out = create(alice, token_ids=ids, levels=["q5"], name="warranty manual")
    assert out["name"] == "warranty manual"
    assert alice.get(out["manifest_url"]).json()["name"] == "warranty manual"
    again = alice.post("/v1/contexts", json={"token_ids": ids, "levels": ["q5"],
                                             "name": "another"})
    assert again.status_code == 200 and again.json()["context_id"] == out["context_id"]
    assert again.json()["name"] == "warranty manual"
    listed = {x["context_id"]: x for x in alice.get("/v1/contexts").json()["contexts"]}
    assert listed[out["context_id"]]["name"] == "warranty manual"
    assert listed[out["context_id"]]["num_tokens"] == 40
    assert out["context_id"] not in listed_ids(bob)
    for bad in ("", "x" * 101, "line\nbreak"):
        assert_error(alice.post("/v1/contexts", json={"token_ids": ids, "name": bad}), 422)
    assert alice.delete(f"/v1/contexts/{out['context_id']}").status_code == 204


def test_the_context_commands_create_list_describe_and_delete(tiny_server, tmp_path, capsys):
    """``sparkv context create FILE --name``, ``list``, ``describe``, ``delete`` against the
    server: the id alone on stdout, the list's name and token count, a second delete one line."""
    from sparkv.cli import main

    key = tiny_server.keys["alice"]
    where = ["--server", tiny_server.url, "--api-key", key]
    (tmp_path / "notes.txt").write_text("The warranty covers two years of repairs. " * 3)
    assert main(["context", "create", str(tmp_path / "notes.txt"), "--name", "notes",
                 *where]) == 0
    cid = capsys.readouterr().out.strip()
    assert re.fullmatch(r"[0-9a-f]{32}", cid)
    assert main(["context", "list", *where]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(cid))
    tokens = row.split()[2]
    assert row.split()[1] == "notes" and int(tokens) > 0 and row.split()[3] == "tiny"
    assert main(["context", "describe", cid, *where]) == 0
    described = capsys.readouterr().out
    assert f"name: notes\nnum_tokens: {tokens}\n" in described
    assert "levels: raw, q5\n" in described
    assert main(["context", "delete", cid, *where]) == 0
    assert capsys.readouterr().out == f"deleted {cid}\n"
    assert main(["context", "delete", cid, *where]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "context_not_found" in err, err
    assert main(["context", "list", "--server", tiny_server.url, "--api-key", "skv_wrong"]) == 2
    assert "401" in capsys.readouterr().err
