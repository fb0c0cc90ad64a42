"""Hardening of the REST server, each against a real ``sparkv serve`` process on loopback:

* a chunk GET verifies the stored frame (size and checksum) before sending it: a damaged frame is
  503 ``frame_corrupt`` (also for a range), never a 200 under the manifest's ETag; the stream
  endpoint keeps sending same-size frames (the edge verifies them) and cuts on a wrong size;
* a stream response is capped in bytes (413 ``response_too_large``) and each tenant in concurrent
  streams (429 ``too_many_streams``); stalled streams (clients that never read) hold bounded
  memory, leave the event loop free, and give their slot back when the client disconnects;
* no trailing-slash redirects; path integers only in canonical decimal;
* a request body has a deadline (408 ``body_timeout``, connection closed);
* ``/healthz`` names no store URL, path or error;
* OpenAPI bounds are ``minimum``/``maximum``;
* bad JSON (400 ``malformed_json``), a bad ``Content-Length`` (400 ``bad_content_length`` in
  JSON, from the HTTP layer) and two different keys (401 ``conflicting_api_keys``).

No test asserts wall-clock time: timeouts are hang guards only (the machine may be loaded).
"""

from __future__ import annotations

import json
import socket
import struct
import time
from pathlib import Path

import httpx
import pytest

from sparkv.protocol import split_records
from sparkv.protocol.digests import checksum
from sparkv.server.process import HOST, ServerProcess
from helpers import (api_client, assert_error, create_context, start_tiny_server, stop_checked,
                     tenant_fixture)

GUARD_S = 30.0
"""Hang guard for anything that waits (never a performance bound)."""
BODY_TIMEOUT_S = 3.0
IDS = [(i * 53 + 11) % 250 for i in range(96)]  # 3 token chunks of T = 32, 2 layers
MAX_STREAM_BYTES = 256 * 1024 * 1024  # the default
STREAMS_PER_TENANT = 8  # the default
BATCH_BYTES = 1 << 20  # the default stream_batch_bytes


# ------------------------------------------------------------------------------------------------
# helpers and fixtures
# ------------------------------------------------------------------------------------------------
def client(server: ServerProcess, key: str | None) -> httpx.Client:
    return api_client(server, key, GUARD_S)


def create(c: httpx.Client, **body) -> tuple[str, dict]:
    out = create_context(c, **body)
    return out["context_id"], c.get(out["manifest_url"]).json()


def metric(c: httpx.Client, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in c.get("/metrics").text.splitlines():
        if line.startswith("#") or not (line.startswith(name + " ") or
                                        line.startswith(name + "{")):
            continue
        head, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + GUARD_S
    while not predicate():
        assert time.monotonic() < deadline, f"hang guard: {what}"
        time.sleep(0.05)


def raw_request(port: int, data: bytes, *, read_to_eof: bool = True
                ) -> tuple[int, dict[str, str], bytes, bool]:
    """Sends raw bytes; returns ``(status, headers, body, closed)`` of the answer. ``closed``:
    the server closed the connection after it (read to EOF; hang-guarded)."""
    with socket.create_connection((HOST, port), timeout=GUARD_S) as s:
        s.sendall(data)
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
        head, _, body = buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in
                   (line.partition(":") for line in lines[1:])}
        n = int(headers.get("content-length", "0"))
        while len(body) < n:
            chunk = s.recv(65536)
            if not chunk:
                break
            body += chunk
        closed = False
        if read_to_eof:
            rest = s.recv(65536)
            closed = rest == b""
        return status, headers, body, closed


def stream_request(cid: str, key: str, items: list[dict], level: str = "raw") -> bytes:
    body = json.dumps({"level": level, "chunks": items}).encode()
    return (f"POST /v1/contexts/{cid}/stream HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def stalled_stream(port: int, request: bytes) -> socket.socket:
    """A client that sends a stream request and never reads (a small receive buffer, so the
    kernel absorbs little of the response)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(GUARD_S)
    s.connect((HOST, port))
    s.sendall(request)
    return s


def abort(s: socket.socket) -> None:
    """Closes with a reset (SO_LINGER 0), as a crashed client would."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_tiny_server(tmp_path_factory.mktemp("hardening"), max_body_bytes=4 << 20,
                            body_timeout_s=BODY_TIMEOUT_S)
    yield srv
    stop_checked(srv)


alice = tenant_fixture("server", "alice", GUARD_S)
bob = tenant_fixture("server", "bob", GUARD_S)


@pytest.fixture(scope="module")
def ctx(alice):
    """alice's context: (context id, manifest)."""
    return create(alice, token_ids=IDS)


def chunk_url(cid: str, t: int | str, layer: int | str, g: int | str = 0) -> str:
    return f"/v1/contexts/{cid}/chunks/{t}/{layer}/{g}"


def frame_path(server: ServerProcess, tenant: str, cid: str, t: int, layer: int,
               level: str) -> Path:
    return server.store_dir / "tenants" / tenant / "contexts" / cid / "chunks" / \
        f"{t}.{layer}.0.{level}"


# ------------------------------------------------------------------------------------------------
# (a) damaged frames
# ------------------------------------------------------------------------------------------------
def test_damaged_frames_are_never_served_by_get(server, alice):
    cid, m = create(alice, token_ids=[(x + 7) % 250 for x in IDS])
    flipped = frame_path(server, "alice", cid, 1, 0, "raw")
    cut = frame_path(server, "alice", cid, 2, 1, "q5")
    entry = m["chunks"][[(c["t"], c["l"]) for c in m["chunks"]].index((1, 0))]["levels"]["raw"]
    etag = '"' + entry["checksum"].split(":")[1] + '"'
    good = alice.get(chunk_url(cid, 1, 0), params={"level": "raw"})
    assert good.status_code == 200 and good.headers["etag"] == etag
    assert checksum(good.content) == entry["checksum"]

    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit: same size, wrong checksum
    flipped.write_bytes(bytes(data))
    cut.write_bytes(cut.read_bytes()[:-1])  # truncated
    before = metric(alice, "sparkv_frames_corrupt_total", endpoint="get")

    for url, level in ((chunk_url(cid, 1, 0), "raw"), (chunk_url(cid, 2, 1), "q5")):
        for headers in ({}, {"Range": "bytes=0-9"}, {"Range": "bytes=-16"},
                        {"Range": "bytes=0-9", "If-Range": etag}):
            r = alice.get(url, params={"level": level}, headers=headers)
            err = assert_error(r, 503, "frame_corrupt")
            assert "etag" not in r.headers and "content-range" not in r.headers
            assert (err["t"], err["level"]) == ((1, "raw") if level == "raw" else (2, "q5"))
            assert "retry-after" not in r.headers  # the damage persists: retrying will not help
    assert metric(alice, "sparkv_frames_corrupt_total", endpoint="get") == before + 8
    # a client that holds the good frame may still revalidate it
    assert alice.get(chunk_url(cid, 1, 0), params={"level": "raw"},
                     headers={"If-None-Match": etag}).status_code == 304
    # the other frames are fine
    assert alice.get(chunk_url(cid, 1, 0), params={"level": "q5"}).status_code == 200
    assert "frame_corrupt" in server.log() and str(server.store_dir) not in json.dumps(err)

    # the stream endpoint keeps sending a same-size frame (the edge verifies each frame and
    # recomputes a damaged chunk) ...
    r = alice.post(f"/v1/contexts/{cid}/stream",
                   json={"level": "raw", "chunks": [{"t": 0, "l": 0}, {"t": 1, "l": 0}]})
    assert r.status_code == 200
    frames = split_records(r.content)
    assert len(frames) == 2 and frames[1] == bytes(data)
    assert checksum(frames[1]) != entry["checksum"]
    # ... and cuts the stream on a frame of the wrong size: fewer bytes than Content-Length
    cut_before = metric(alice, "sparkv_stream_errors_total")
    body = {"level": "q5", "chunks": [{"t": 0, "l": 0}, {"t": 2, "l": 1}, {"t": 0, "l": 1}]}
    with pytest.raises(httpx.HTTPError):
        with alice.stream("POST", f"/v1/contexts/{cid}/stream", json=body) as s:
            assert s.status_code == 200
            got = b"".join(s.iter_raw())
            assert len(got) < int(s.headers["content-length"])
    assert metric(alice, "sparkv_stream_errors_total") == cut_before + 1
    assert alice.get("/healthz").status_code == 200


# ------------------------------------------------------------------------------------------------
# (b) stream limits, stalled streams
# ------------------------------------------------------------------------------------------------
def test_stream_response_size_cap(alice, ctx):
    cid, m = ctx
    raw = m["chunks"][0]["levels"]["raw"]["bytes"]
    n = MAX_STREAM_BYTES // (4 + raw) + 1  # one record over the cap, under max_stream_items
    before = metric(alice, "sparkv_streams_refused_total", reason="response_too_large")
    r = alice.post(f"/v1/contexts/{cid}/stream",
                   json={"level": "raw", "chunks": [{"t": 0, "l": 0}] * n})
    err = assert_error(r, 413, "response_too_large")
    assert err["limit"] == MAX_STREAM_BYTES and str(MAX_STREAM_BYTES) in err["message"]
    assert err["bytes"] == n * (4 + raw)
    assert metric(alice, "sparkv_streams_refused_total",
                  reason="response_too_large") == before + 1
    # exactly at the cap is fine (read lazily, so the test does not move 256 MiB)
    with alice.stream("POST", f"/v1/contexts/{cid}/stream",
                      json={"level": "raw", "chunks": [{"t": 0, "l": 0}] * (n - 1)}) as s:
        assert s.status_code == 200
        assert int(s.headers["content-length"]) == (n - 1) * (4 + raw) <= MAX_STREAM_BYTES
    # too many items is refused before the items are even validated
    err = assert_error(alice.post(f"/v1/contexts/{cid}/stream",
                                  json={"chunks": [{"t": "x"}] * 65537}), 400, "too_many_items")
    assert err["limit"] == 65536
    wait_until(lambda: metric(alice, "sparkv_streams_active") == 0, "the streams to end")


def test_stalled_streams_hold_bounded_memory_and_free_their_slots(server, alice, bob, ctx):
    cid_a, m = ctx
    cid_b, _ = create(bob, token_ids=IDS)  # bob's own context
    raw = max(c["levels"]["raw"]["bytes"] for c in m["chunks"])
    items = [{"t": c["t"], "l": c["l"]} for c in m["chunks"]] * 2000  # 12,000 frames, ~100 MB
    requested = len(items) * (4 + raw)
    aborted0 = metric(alice, "sparkv_streams_aborted_total")
    served0 = metric(alice, "sparkv_frame_bytes_served_total", endpoint="stream")
    socks = {"alice": [], "bob": []}
    try:
        for tenant, cid in (("alice", cid_a), ("bob", cid_b)):
            req = stream_request(cid, server.keys[tenant], items)
            for _ in range(STREAMS_PER_TENANT):
                socks[tenant].append(stalled_stream(server.port, req))
        bound = 16 * 2 * (BATCH_BYTES + raw)  # per stream: the batch being sent, one read ahead
        peak = 0.0

        def all_started() -> bool:
            nonlocal peak
            peak = max(peak, metric(alice, "sparkv_stream_buffered_bytes"))
            return metric(alice, "sparkv_streams_active") == 16

        wait_until(all_started, "16 stalled streams to start")
        for _ in range(10):  # the bound holds at every moment
            peak = max(peak, metric(alice, "sparkv_stream_buffered_bytes"))
            time.sleep(0.05)
        assert 0 < peak <= bound, (peak, bound)
        # the event loop is free: health, a manifest and metrics answer (hang guard only)
        h = alice.get("/healthz")
        assert h.status_code == 200 and h.json()["status"] == "ok"
        assert alice.get(f"/v1/contexts/{cid_a}").status_code == 200
        # the streams are stalled, not finished: little of what they asked for was sent (what
        # was, the kernel's socket buffers took)
        served = metric(alice, "sparkv_frame_bytes_served_total", endpoint="stream") - served0
        assert served < 16 * requested / 2, (served, 16 * requested)
        # a ninth stream per tenant is refused, with Retry-After
        for c, cid in ((alice, cid_a), (bob, cid_b)):
            r = c.post(f"/v1/contexts/{cid}/stream", json={"chunks": [{"t": 0, "l": 0}]})
            err = assert_error(r, 429, "too_many_streams")
            assert err["limit"] == STREAMS_PER_TENANT and int(r.headers["retry-after"]) >= 1
        assert metric(alice, "sparkv_streams_refused_total", reason="too_many_streams") >= 2

        # alice's clients go away: their slots come back, bob's streams stay
        for s in socks.pop("alice"):
            abort(s)
        wait_until(lambda: metric(alice, "sparkv_streams_active") == 8, "alice's slots back")
        r = alice.post(f"/v1/contexts/{cid_a}/stream", json={"chunks": [{"t": 0, "l": 0}]})
        assert r.status_code == 200 and len(split_records(r.content)) == 1
        assert_error(bob.post(f"/v1/contexts/{cid_b}/stream",
                              json={"chunks": [{"t": 0, "l": 0}]}), 429, "too_many_streams")
        for s in socks.pop("bob"):
            abort(s)
        wait_until(lambda: metric(alice, "sparkv_streams_active") == 0, "every slot back")
        wait_until(lambda: metric(alice, "sparkv_stream_buffered_bytes") == 0,
                   "the buffered frames released")
        assert metric(alice, "sparkv_streams_aborted_total") == aborted0 + 16
        assert bob.post(f"/v1/contexts/{cid_b}/stream",
                        json={"chunks": [{"t": 0, "l": 0}]}).status_code == 200
    finally:
        for group in socks.values():
            for s in group:
                abort(s)


# ------------------------------------------------------------------------------------------------
# (c) no slash redirects, (d) canonical path integers
# ------------------------------------------------------------------------------------------------
def test_trailing_slashes_are_404_not_redirects(alice, ctx):
    cid, _ = ctx
    for url in ("/v1/contexts/", f"/v1/contexts/{cid}/", f"/v1/contexts/{cid}/tokens/",
                chunk_url(cid, 0, 0) + "/", "/v1/models/", "/healthz/", "/metrics/"):
        r = alice.get(url, follow_redirects=False)
        assert_error(r, 404, "not_found")
        assert "location" not in r.headers
    r = alice.post(f"/v1/contexts/{cid}/stream/", json={"chunks": [{"t": 0, "l": 0}]},
                   follow_redirects=False)
    assert_error(r, 404, "not_found")


def test_path_integers_are_canonical_decimal(alice, ctx):
    cid, _ = ctx
    assert alice.get(chunk_url(cid, 0, 1, 0), params={"level": "raw"}).status_code == 200
    for bad in ("+1", "01", "00", "%201", "1%20", "1.0", "1e0", "0x1", "-0", "%D9%A1",
                "2147483648", "99999999999999999999"):
        for url in (chunk_url(cid, bad, 0), chunk_url(cid, 0, bad), chunk_url(cid, 0, 0, bad)):
            err = assert_error(alice.get(url, params={"level": "raw"}), 422, "invalid_request")
            assert err["details"][0]["loc"].startswith("path."), err
    # the largest index is a valid URL (and out of this context's range)
    assert_error(alice.get(chunk_url(cid, 2**31 - 1, 0)), 404, "chunk_out_of_range")


# ------------------------------------------------------------------------------------------------
# (e) body deadline
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/contexts", "/v1/contexts/{cid}/stream"])
def test_a_body_that_does_not_arrive_is_408_and_closed(server, alice, ctx, path):
    cid, _ = ctx
    before = metric(alice, "sparkv_body_timeouts_total")
    head = (f"POST {path.format(cid=cid)} HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {server.keys['alice']}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n")
    status, headers, body, closed = raw_request(server.port, head.encode() + b'{"chunks": [')
    assert status == 408 and headers["content-type"].startswith("application/json")
    err = json.loads(body)["error"]
    assert err["code"] == "body_timeout" and err["status"] == 408
    assert err["timeout_s"] == BODY_TIMEOUT_S
    assert headers["connection"] == "close" and closed
    assert metric(alice, "sparkv_body_timeouts_total") == before + 1
    wait_until(lambda: metric(alice, "sparkv_streams_active") == 0, "the stream slot back")


# ------------------------------------------------------------------------------------------------
# (f) /healthz, (g) OpenAPI bounds
# ------------------------------------------------------------------------------------------------
HEALTH_FIELDS = {"status", "version", "store", "jobs_active", "queue", "queue_reason"}


def test_healthz_reveals_no_store_details(server, alice):
    h = httpx.get(f"{server.url}/healthz", timeout=GUARD_S)
    assert h.status_code == 200
    assert set(h.json()) == HEALTH_FIELDS
    assert h.json()["status"] == h.json()["store"] == h.json()["queue"] == "ok"
    assert "file:" not in h.text and str(server.store_dir) not in h.text
    # an unreachable store: 503 with a generic state, the reason only in the log
    away = server.store_dir.with_name("store-away")
    server.store_dir.rename(away)
    try:
        h = httpx.get(f"{server.url}/healthz", timeout=GUARD_S)
    finally:
        away.rename(server.store_dir)
    assert h.status_code == 503
    assert h.json()["status"] == h.json()["store"] == "unavailable"
    assert set(h.json()) == HEALTH_FIELDS
    assert str(server.store_dir) not in h.text and "writable" not in h.text
    assert "the store cannot be reached" in server.log()
    assert httpx.get(f"{server.url}/healthz", timeout=GUARD_S).status_code == 200


def _bound_keywords(node, where="") -> list[str]:
    """Paths of ``ge``/``le``/``gt``/``lt`` keywords anywhere in a schema document (the keys of a
    ``properties`` map are field names, not keywords)."""
    found = []
    if isinstance(node, dict):
        for k, v in node.items():
            if where.endswith("/properties"):
                found += _bound_keywords(v, f"{where}/{k}")
                continue
            if k in ("ge", "le", "gt", "lt"):
                found.append(f"{where}/{k}")
            found += _bound_keywords(v, f"{where}/{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found += _bound_keywords(v, f"{where}/{i}")
    return found


def test_openapi_bounds_are_minimum_and_maximum(server):
    spec = httpx.get(f"{server.url}/openapi.json", timeout=GUARD_S).json()
    assert _bound_keywords(spec) == []
    schemas = spec["components"]["schemas"]
    ct = schemas["CreateContext"]["properties"]["chunk_tokens"]
    ints = [s for s in ct.get("anyOf", [ct]) if s.get("type") == "integer"]
    assert len(ints) == 1 and ints[0]["minimum"] == 16 and ints[0]["maximum"] == 65536
    hpg = schemas["CreateContext"]["properties"]["heads_per_group"]
    assert (hpg["minimum"], hpg["maximum"]) == (0, 4096)
    tok = schemas["CreateContext"]["properties"]["token_ids"]["anyOf"][0]["items"]
    assert (tok["minimum"], tok["maximum"]) == (0, 2**31 - 1)
    for name in ("t", "l", "g"):
        item = schemas["StreamItem"]["properties"][name]
        assert (item["type"], item["minimum"], item["maximum"]) == ("integer", 0, 2**31 - 1)
    get_chunk = spec["paths"]["/v1/contexts/{context_id}/chunks/{t}/{l}/{g}"]["get"]
    for p in get_chunk["parameters"]:
        if p["name"] in ("t", "l", "g"):
            assert (p["schema"]["minimum"], p["schema"]["maximum"]) == (0, 2**31 - 1)
    stream = spec["paths"]["/v1/contexts/{context_id}/stream"]["post"]
    ref = stream["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert ref == "#/components/schemas/StreamRequest"
    assert {op["operationId"] for ops in spec["paths"].values() for op in ops.values()} == {
        "healthz", "prometheus", "list_models", "create_context", "list_contexts",
        "get_manifest", "get_tokens", "delete_context", "get_job", "get_chunk", "stream_chunks"}


# ------------------------------------------------------------------------------------------------
# (h) bad JSON, bad Content-Length, conflicting keys
# ------------------------------------------------------------------------------------------------
def test_malformed_json_is_400(alice, ctx):
    cid, _ = ctx
    for url in ("/v1/contexts", f"/v1/contexts/{cid}/stream"):
        for body in (b"{not json", b'{"chunks": [', b'{"text": "\xff\xfe"}', b"\x00"):
            err = assert_error(alice.post(url, content=body,
                                          headers={"Content-Type": "application/json"}),
                               400, "malformed_json")
            assert "JSON" in err["message"]
        # valid JSON that does not match the schema stays 422
        assert_error(alice.post(url, json={"chunks": "x", "text": 5}), 422, "invalid_request")
        assert_error(alice.post(url, json=[1, 2]), 422, "invalid_request")


@pytest.mark.parametrize("value", ["abc", "+5", "-1", "5, 5", "1e3", "99999999999999999999999"])
def test_a_bad_content_length_is_a_json_400(server, value):
    req = (f"POST /v1/contexts HTTP/1.1\r\nHost: x\r\n"
           f"Authorization: Bearer {server.keys['alice']}\r\n"
           f"Content-Type: application/json\r\nContent-Length: {value}\r\n\r\n{{}}")
    status, headers, body, closed = raw_request(server.port, req.encode())
    assert status == 400 and headers["content-type"] == "application/json"
    err = json.loads(body)["error"]
    assert err["status"] == 400 and err["code"] == "bad_content_length", err
    assert "Content-Length" in err["message"] and closed


def test_other_malformed_http_is_a_json_400(server):
    for req in (b"POST /v1/contexts HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                b"Content-Length: 3\r\n\r\n{}",
                b"POST /v1/contexts HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"zz\r\n"):
        status, headers, body, closed = raw_request(server.port, req)
        assert status == 400 and headers["content-type"] == "application/json" and closed
        assert json.loads(body)["error"]["code"] in ("bad_content_length", "malformed_http")
    status, _, body, closed = raw_request(server.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
                                                       b"Bad Header\r\n\r\n")
    assert status == 400 and json.loads(body)["error"]["code"] == "malformed_http" and closed


def test_two_different_api_keys_are_401(server, ctx):
    cid, _ = ctx
    a, b = server.keys["alice"], server.keys["bob"]
    with httpx.Client(base_url=server.url, timeout=GUARD_S) as c:
        for headers in ({"Authorization": f"Bearer {a}", "X-API-Key": b},
                        {"Authorization": f"Bearer {b}", "X-API-Key": a},
                        {"Authorization": f"Bearer {a}", "X-API-Key": "skv_other"},
                        {"Authorization": "Bearer skv_other", "X-API-Key": a}):
            r = c.get(f"/v1/contexts/{cid}", headers=headers)
            assert_error(r, 401, "conflicting_api_keys")
            assert r.headers["www-authenticate"].startswith("Bearer")
        # the same key twice is fine
        r = c.get(f"/v1/contexts/{cid}", headers={"Authorization": f"Bearer {a}",
                                                   "X-API-Key": a})
        assert r.status_code == 200
        assert metric(c, "sparkv_auth_failures_total", reason="conflicting_api_keys") == 4
