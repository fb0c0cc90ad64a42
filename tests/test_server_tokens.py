"""``GET /v1/contexts/{id}/tokens`` (the context's token ids) and gzip for JSON responses, against
real ``sparkv serve`` subprocesses on the file store and on a real Redis, plus the store-level
token-id contract on both stores."""

from __future__ import annotations

import gzip
import hashlib
import json

import httpx
import numpy as np
import pytest

from sparkv.server.middleware import accepts_gzip
from sparkv.server.stores import ChunkKey, open_store
from sparkv.server.process import ServerProcess, write_config
from helpers import (api_client, assert_error, create_context, shared_tiny_checkpoint,
                     start_tiny_server, stop_checked, tenant_fixture, wait_job)
from sparkv.protocol import split_records as parse_frame_stream

TEXT = ("Tokens travel with the context, so the edge can compute chunks itself. " * 6).strip()
IDS = [(i * 37 + 5) % 250 for i in range(70)]  # the tiny model's vocabulary is SmolLM2's (49152)
CID = "0123456789abcdef0123456789abcdef"


# ------------------------------------------------------------------------------------------------
# helpers and fixtures
# ------------------------------------------------------------------------------------------------
def client(server: ServerProcess, key: str) -> httpx.Client:
    return api_client(server, key)


def create(c: httpx.Client, **body) -> dict:
    return create_context(c, **body)


def raw_get(c: httpx.Client, url: str, accept_encoding: str, **kw) -> tuple[httpx.Response, bytes]:
    """A GET and its body exactly as sent (not decoded)."""
    with c.stream("GET", url, headers={"Accept-Encoding": accept_encoding, **kw}) as r:
        return r, b"".join(r.iter_raw())


def tokens_of(body: bytes) -> list[int]:
    assert len(body) % 4 == 0
    return np.frombuffer(body, dtype="<u4").astype(int).tolist()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_tiny_server(tmp_path_factory.mktemp("tokens"), encode_pause_s=0.01)
    yield srv
    stop_checked(srv)


alice = tenant_fixture("server", "alice")
bob = tenant_fixture("server", "bob")


@pytest.fixture(scope="module")
def ctx(alice):
    """A context created from token ids: (create response, manifest)."""
    out = create(alice, token_ids=IDS)
    return out, alice.get(out["manifest_url"]).json()


# ------------------------------------------------------------------------------------------------
# the tokens endpoint
# ------------------------------------------------------------------------------------------------
def test_tokens_round_trip_token_ids(alice, ctx):
    out, manifest = ctx
    r = alice.get(f"/v1/contexts/{out['context_id']}/tokens")
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/octet-stream"
    assert tokens_of(r.content) == IDS
    digest = hashlib.sha256(r.content).hexdigest()
    assert r.headers["x-sparkv-tokens-sha256"] == digest == manifest["tokens_sha256"]
    assert r.headers["x-sparkv-num-tokens"] == str(len(IDS)) == str(manifest["num_tokens"])
    assert r.headers["etag"] == f'"{digest}"'
    assert r.headers["cache-control"] == "private, max-age=31536000, immutable"
    assert int(r.headers["content-length"]) == 4 * len(IDS)
    assert "content-encoding" not in r.headers  # never compressed, even though httpx asks
    # conditional requests
    for tag in (r.headers["etag"], "W/" + r.headers["etag"], "*", f'"x", {r.headers["etag"]}'):
        nm = alice.get(f"/v1/contexts/{out['context_id']}/tokens",
                       headers={"If-None-Match": tag})
        assert nm.status_code == 304 and nm.content == b""
        assert nm.headers["etag"] == r.headers["etag"]
    assert alice.get(f"/v1/contexts/{out['context_id']}/tokens",
                     headers={"If-None-Match": '"other"'}).status_code == 200


def test_tokens_round_trip_text(alice):
    from transformers import AutoTokenizer

    out = create(alice, text=TEXT)
    r = alice.get(f"/v1/contexts/{out['context_id']}/tokens")
    assert r.status_code == 200
    ids = tokens_of(r.content)
    tok = AutoTokenizer.from_pretrained(str(shared_tiny_checkpoint()))
    assert ids == list(tok.encode(TEXT, add_special_tokens=False))
    assert tok.decode(ids) == TEXT
    assert len(ids) == out["num_tokens"]
    m = alice.get(out["manifest_url"]).json()
    assert r.headers["x-sparkv-tokens-sha256"] == m["tokens_sha256"]


def test_tokens_of_another_tenant_or_unknown_are_404(server, alice, bob, ctx):
    out, _ = ctx
    url = f"/v1/contexts/{out['context_id']}/tokens"
    assert_error(bob.get(url), 404, "context_not_found")
    assert_error(alice.get(f"/v1/contexts/{'f' * 32}/tokens"), 404, "context_not_found")
    assert alice.get("/v1/contexts/NOT-AN-ID/tokens").status_code == 422
    r = httpx.get(f"{server.url}{url}")  # no key
    assert_error(r, 401, "missing_api_key")


def test_pending_context_then_delete_mid_encode(alice, server):
    # 512 tokens, T=16, 2 layers, every level: 448 frames at 10 ms each -> seconds of encoding
    ids = [(i * 11 + 3) % 300 for i in range(512)]
    r = alice.post("/v1/contexts", json={"token_ids": ids, "chunk_tokens": 16,
                                         "levels": ["raw", "q8", "q6", "q5", "q4", "q3", "q2"]})
    assert r.status_code == 202, r.text
    out = r.json()
    url = f"/v1/contexts/{out['context_id']}/tokens"
    err = assert_error(alice.get(url), 404, "context_pending")
    assert err["job_id"] == out["job_id"] and "progress" in err
    assert alice.delete(out["manifest_url"]).status_code == 204
    # gone at once, while the job winds down (it stops at its next frame)
    err = assert_error(alice.get(out["manifest_url"]), 404, "context_not_found")
    assert err["job_state"] == "cancelled" and "deleted" in err["job_error"]
    assert_error(alice.get(url), 404, "context_not_found")
    assert out["context_id"] not in [p["context_id"] for p in
                                     alice.get("/v1/contexts").json()["pending"]]
    assert wait_job(alice, out["job_id"])["state"] == "cancelled"
    assert_error(alice.get(url), 404, "context_not_found")
    cdir = server.store_dir / "tenants" / "alice" / "contexts" / out["context_id"]
    assert not cdir.exists()  # nothing left behind, token ids included


def test_delete_removes_the_tokens(alice, server):
    out = create(alice, token_ids=IDS[:40])
    url = f"/v1/contexts/{out['context_id']}/tokens"
    cdir = server.store_dir / "tenants" / "alice" / "contexts" / out["context_id"]
    assert (cdir / "tokens.u32").read_bytes() == alice.get(url).content
    # the token ids are beside the chunks, not among them
    store = open_store(f"file://{server.store_dir}")
    m = alice.get(out["manifest_url"]).json()
    assert store.chunks.keys("alice", out["context_id"]) == {
        ChunkKey(c["t"], c["l"], c["g"], lv) for c in m["chunks"] for lv in m["levels"]}
    assert alice.delete(out["manifest_url"]).status_code == 204
    assert_error(alice.get(url), 404, "context_not_found")
    assert not cdir.exists()
    assert store.chunks.get_tokens("alice", out["context_id"]) is None


def test_context_without_tokens_then_backfilled_by_the_same_request(alice, server):
    body = {"token_ids": IDS[:50], "levels": ["q5"]}
    out = create(alice, **body)
    url = f"/v1/contexts/{out['context_id']}/tokens"
    tokens_file = (server.store_dir / "tenants" / "alice" / "contexts" / out["context_id"]
                   / "tokens.u32")
    tokens_file.unlink()  # as a context encoded before the server kept token ids
    err = assert_error(alice.get(url), 404, "tokens_not_available")
    assert "POST /v1/contexts" in err["message"]
    assert alice.get(out["manifest_url"]).status_code == 200  # the context itself is fine
    again = alice.post("/v1/contexts", json=body)
    assert again.status_code == 200 and again.json()["status"] == "done"  # nothing re-encoded
    r = alice.get(url)
    assert r.status_code == 200 and tokens_of(r.content) == IDS[:50]


def test_offline_encoder_stores_the_tokens(server, alice, tmp_path, capsys):
    from sparkv.cli import main

    ids = [(i * 13 + 1) % 400 for i in range(45)]
    ids_file = tmp_path / "ids.json"
    ids_file.write_text(json.dumps(ids))
    argv = ["encode", str(ids_file), "--token-ids", "--config", str(server.config_path),
            "--store", f"file://{server.store_dir}", "--tenant", "alice", "--levels", "q5",
            "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["status"] == "encoded"
    url = f"/v1/contexts/{out['context_id']}/tokens"
    assert tokens_of(alice.get(url).content) == ids
    # a context encoded offline before token ids were kept: running it again adds them
    (server.store_dir / "tenants" / "alice" / "contexts" / out["context_id"]
     / "tokens.u32").unlink()
    assert_error(alice.get(url), 404, "tokens_not_available")
    assert main(argv) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["status"] == "exists" and again["tokens_added"] is True
    assert tokens_of(alice.get(url).content) == ids
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["tokens_added"] is False


# ------------------------------------------------------------------------------------------------
# gzip
# ------------------------------------------------------------------------------------------------
def test_manifest_is_gzip_compressed_when_accepted(alice, ctx):
    out, manifest = ctx
    url = out["manifest_url"]
    plain, plain_body = raw_get(alice, url, "identity")
    assert plain.status_code == 200 and "content-encoding" not in plain.headers
    assert plain.headers["vary"] == "Accept-Encoding"
    assert len(plain_body) > 1024 and json.loads(plain_body) == manifest
    etag = plain.headers["etag"]
    assert not etag.startswith("W/")

    zipped, zipped_body = raw_get(alice, url, "gzip")
    assert zipped.status_code == 200
    assert zipped.headers["content-encoding"] == "gzip"
    assert zipped.headers["vary"] == "Accept-Encoding"
    assert zipped.headers["content-type"] == "application/json"
    assert int(zipped.headers["content-length"]) == len(zipped_body) < len(plain_body) / 2
    assert gzip.decompress(zipped_body) == plain_body
    assert zipped.headers["etag"] == "W/" + etag  # another byte sequence: a weak tag
    assert zipped.headers["cache-control"] == plain.headers["cache-control"]
    # httpx's own Accept-Encoding and decoding
    assert alice.get(url).json() == manifest

    # either form of the tag revalidates; the 304 confirms the form the client holds
    for sent, accept, expect in ((etag, "gzip", etag), ("W/" + etag, "gzip", "W/" + etag),
                                 (etag, "identity", etag), ("W/" + etag, "identity", "W/" + etag)):
        r, body = raw_get(alice, url, accept, **{"If-None-Match": sent})
        assert r.status_code == 304 and body == b"", (sent, accept)
        assert r.headers["etag"] == expect and "content-encoding" not in r.headers
        assert r.headers["vary"] == "Accept-Encoding"

    # q-values and wildcards
    for header, compressed in (("gzip;q=0", False), ("deflate, gzip;q=0.5", True),
                               ("*", True), ("*;q=0", False), ("br", False),
                               ("identity, *;q=0.1", True), ("GZIP", True)):
        r, _ = raw_get(alice, url, header)
        assert (r.headers.get("content-encoding") == "gzip") is compressed, header


def test_small_json_is_not_compressed(alice):
    r, body = raw_get(alice, "/v1/models", "gzip")
    assert r.status_code == 200 and len(body) < 1024
    assert "content-encoding" not in r.headers and "vary" not in r.headers
    assert json.loads(body)["models"]


def test_frames_stream_and_tokens_are_never_compressed(alice, ctx):
    out, manifest = ctx
    cid = out["context_id"]
    items = [{"t": c["t"], "l": c["l"], "g": c["g"], "level": lv}
             for c in manifest["chunks"] for lv in manifest["levels"]]
    with alice.stream("POST", f"/v1/contexts/{cid}/stream", json={"chunks": items},
                      headers={"Accept-Encoding": "gzip"}) as s:
        assert s.status_code == 200
        assert "content-encoding" not in s.headers and "vary" not in s.headers
        assert s.headers["content-type"] == "application/vnd.sparkv.frames"
        body = b"".join(s.iter_raw())
    sizes = [manifest["chunks"][i // 2]["levels"][it["level"]]["bytes"]
             for i, it in enumerate(items)]
    assert int(s.headers["content-length"]) == len(body) == sum(4 + n for n in sizes)
    assert [len(f) for f in parse_frame_stream(body)] == sizes

    r, data = raw_get(alice, f"/v1/contexts/{cid}/chunks/0/0/0?level=raw", "gzip")
    assert r.status_code == 200 and len(data) > 1024
    assert "content-encoding" not in r.headers and not r.headers["etag"].startswith("W/")
    assert r.headers["content-type"] == "application/vnd.sparkv.frame"

    r, data = raw_get(alice, f"/v1/contexts/{cid}/tokens", "gzip")
    assert r.status_code == 200 and "content-encoding" not in r.headers
    assert tokens_of(data) == IDS


def test_error_shapes_and_body_limit_with_gzip(alice, server):
    # a large 422 is still the error shape once decoded
    r = alice.post("/v1/contexts", json={"token_ids": ["x"] * 40, "levels": ["zz"] * 10},
                   headers={"Accept-Encoding": "gzip"})
    err = assert_error(r, 422, "invalid_request")
    assert len(err["details"]) > 3
    # a body over max_body_bytes (64 KiB here) is still refused with 413 JSON
    big = b'{"token_ids": [' + b"1," * 40_000 + b"1]}"
    r = alice.post("/v1/contexts", content=big, headers={"Content-Type": "application/json",
                                                         "Accept-Encoding": "gzip"})
    assert_error(r, 413, "body_too_large")


@pytest.mark.parametrize("header,expected", [
    (None, False), ("", False), ("gzip", True), ("x-gzip", True), ("gzip;q=0", False),
    ("gzip; q=0.001", True), ("deflate", False), ("*", True), ("*;q=0", False),
    ("gzip;q=0, *", False), ("br, *;q=0.5", True), ("gzip;q=bad", False),
])
def test_accepts_gzip(header, expected):
    assert accepts_gzip(header) is expected


def _run_asgi(app, accept_encoding: str | None = "gzip", path: str = "/x") -> list[dict]:
    """Calls an ASGI app once; returns the messages it sent."""
    import asyncio

    headers = [(b"accept-encoding", accept_encoding.encode())] if accept_encoding else []
    scope = {"type": "http", "method": "GET", "path": path, "headers": headers}
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


def _app(content_type: bytes, parts: list[bytes], status: int = 200, etag: bytes | None = None):
    async def app(scope, receive, send):
        headers = [(b"content-type", content_type),
                   (b"content-length", str(sum(map(len, parts))).encode())]
        if etag:
            headers.append((b"etag", etag))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        for i, p in enumerate(parts):
            await send({"type": "http.response.body", "body": p,
                        "more_body": i + 1 < len(parts)})
    return app


def test_gzip_middleware_only_touches_whole_json_bodies():
    from sparkv.server.middleware import GZipMiddleware

    body = json.dumps({"x": list(range(2000))}).encode()
    # JSON in one message: compressed, tag weakened, Vary added
    sent = _run_asgi(GZipMiddleware(_app(b"application/json", [body], etag=b'"abc"')))
    h = dict(sent[0]["headers"])
    assert h[b"content-encoding"] == b"gzip" and h[b"etag"] == b'W/"abc"'
    assert h[b"vary"] == b"Accept-Encoding" and int(h[b"content-length"]) == len(sent[1]["body"])
    assert gzip.decompress(sent[1]["body"]) == body
    # not accepted: as it is, with Vary
    sent = _run_asgi(GZipMiddleware(_app(b"application/json", [body], etag=b'"abc"')), None)
    h = dict(sent[0]["headers"])
    assert b"content-encoding" not in h and h[b"etag"] == b'"abc"' and sent[1]["body"] == body
    # streamed JSON, frames, a 206: message by message, untouched
    for media, parts, status in ((b"application/json", [body[:5000], body[5000:]], 200),
                                 (b"application/vnd.sparkv.frames", [body, body], 200),
                                 (b"application/vnd.sparkv.frame", [body], 200),
                                 (b"application/octet-stream", [body], 200),
                                 (b"application/json", [body], 206)):
        sent = _run_asgi(GZipMiddleware(_app(media, parts, status)))
        assert all(k not in (b"content-encoding", b"vary") for k, _ in sent[0]["headers"])
        assert [m["body"] for m in sent[1:]] == parts  # the same messages, in order
    # the compressed form is cached per (path, strong ETag)
    mw = GZipMiddleware(_app(b"application/json", [body], etag=b'"abc"'))
    first = _run_asgi(mw)[1]["body"]
    assert list(mw._cache) == [("/x", '"abc"')]
    assert _run_asgi(mw)[1]["body"] is first
    # off
    sent = _run_asgi(GZipMiddleware(_app(b"application/json", [body]), minimum_size=0))
    assert b"content-encoding" not in dict(sent[0]["headers"])


# ------------------------------------------------------------------------------------------------
# the store contract for token ids, on both stores
# ------------------------------------------------------------------------------------------------
def test_store_tokens_contract(store):
    data = np.arange(1000, dtype="<u4").tobytes()
    assert store.chunks.get_tokens("alice", CID) is None
    assert not store.chunks.has_tokens("alice", CID)
    store.chunks.put("alice", CID, ChunkKey(0, 0, 0, "q5"), b"frame")
    store.chunks.put_tokens("alice", CID, data)
    assert store.chunks.get_tokens("alice", CID) == data and store.chunks.has_tokens("alice", CID)
    store.chunks.put_tokens("alice", CID, data[:8])  # replace
    assert store.chunks.get_tokens("alice", CID) == data[:8]
    assert store.chunks.keys("alice", CID) == {ChunkKey(0, 0, 0, "q5")}  # not a chunk
    assert store.manifests.contexts("alice") == []  # not visible before the manifest
    assert store.chunks.get_tokens("bob", CID) is None and not store.chunks.has_tokens("bob", CID)
    store.manifests.put("alice", CID, b"{}")
    assert store.manifests.contexts("alice") == [CID]
    assert store.delete_context("alice", CID) is True
    assert store.chunks.get_tokens("alice", CID) is None
    assert not store.chunks.has_tokens("alice", CID)
    assert store.chunks.keys("alice", CID) == set()
    # a context with nothing but its token ids is still deletable
    store.chunks.put_tokens("alice", CID, data)
    assert store.delete_context("alice", CID) is True
    assert store.chunks.get_tokens("alice", CID) is None
    assert store.delete_context("alice", CID) is False


def test_store_tokens_names_are_checked(store):
    from sparkv.server.errors import StoreError

    for tenant, cid in (("../x", CID), ("alice", "../../etc"), ("alice", "ABC")):
        with pytest.raises(StoreError):
            store.chunks.put_tokens(tenant, cid, b"1234")
        with pytest.raises(StoreError):
            store.chunks.get_tokens(tenant, cid)


# ------------------------------------------------------------------------------------------------
# the whole server on Redis
# ------------------------------------------------------------------------------------------------
def test_tokens_on_redis(tmp_path, redis_url):
    import redis as redis_lib

    keys = write_config(tmp_path / "s.yaml", ["alice", "bob"],
                        models={"tiny": str(shared_tiny_checkpoint())}, default_model="tiny",
                        default_levels=["raw", "q5"], default_chunk_tokens=32)
    prefix = "tokserver"
    with ServerProcess(tmp_path / "s.yaml", f"{redis_url}?prefix={prefix}",
                       log_path=tmp_path / "log") as server, \
            client(server, keys["alice"]) as c, client(server, keys["bob"]) as b:
        out = create(c, token_ids=IDS)
        cid = out["context_id"]
        url = f"/v1/contexts/{cid}/tokens"
        r = c.get(url)
        assert r.status_code == 200 and tokens_of(r.content) == IDS
        m = c.get(out["manifest_url"]).json()
        assert r.headers["x-sparkv-tokens-sha256"] == m["tokens_sha256"]
        assert_error(b.get(url), 404, "context_not_found")
        rd = redis_lib.Redis.from_url(redis_url)
        tok_key = f"{prefix}:t:alice:c:{cid}:tok"
        assert rd.get(tok_key) == r.content
        # a context without token ids
        rd.delete(tok_key)
        assert_error(c.get(url), 404, "tokens_not_available")
        assert c.post("/v1/contexts", json={"token_ids": IDS}).status_code == 200
        assert tokens_of(c.get(url).content) == IDS
        # gzip works the same on this store
        zipped, body = raw_get(c, out["manifest_url"], "gzip")
        assert zipped.headers["content-encoding"] == "gzip"
        assert json.loads(gzip.decompress(body)) == m
        assert c.delete(out["manifest_url"]).status_code == 204
        assert_error(c.get(url), 404, "context_not_found")
        assert rd.exists(tok_key) == 0
        assert rd.keys(f"{prefix}:t:alice:c:{cid}:*") == []
    assert "Traceback" not in server.log()
