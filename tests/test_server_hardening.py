"""Hardening of the REST server, each against a real ``sparkv serve`` process on loopback:

* a chunk GET verifies the stored frame (size and checksum) before sending it: a damaged frame is
  503 ``frame_corrupt`` (also for a range), never a 200 under the manifest's ETag; the stream
  endpoint keeps sending same-size frames (the edge verifies them), refuses a wrong size in its
  first batch (503) and cuts on one in a later batch;
* a stream response is capped in bytes (413 ``response_too_large``) and each tenant in concurrent
  streams (429 ``too_many_streams``); stalled streams (clients that never read) hold bounded
  memory, leave the event loop free, and give their slot back when the client disconnects;
* no trailing-slash redirects; path integers only in canonical decimal;
* a request body has a deadline (408 ``body_timeout``, connection closed);
* ``/healthz`` names no store URL, path or error;
* OpenAPI bounds are ``minimum``/``maximum``;
* bad JSON (400 ``malformed_json``), a bad ``Content-Length`` (400 ``bad_content_length`` in
  JSON, from the HTTP layer) and two different keys (401 ``conflicting_api_keys``);
* issue 26 (each of these failed before it): the frame cap at ``POST /v1/contexts`` (400
  ``frame_too_large``), a stream response proportionate to its request (413), a stalled stream
  bounded in bytes, not frames; query parameters read once, strictly (400 on a repeated or
  unknown one); deeply nested JSON (400, not a 500); a directory or a missing file in a frame's
  place (503 ``frame_corrupt``, never a 500 or a reset); a header deadline (408, closed) with
  either HTTP parser; ``Bearer`` with exactly one space.

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
from helpers import (api_client, assert_error, create_context, shared_tiny_checkpoint,
                     start_tiny_server, stop_checked, tenant_fixture)

GUARD_S = 30.0
"""Hang guard for anything that waits (never a performance bound)."""
BODY_TIMEOUT_S = 3.0
IDS = [(i * 53 + 11) % 250 for i in range(96)]  # 3 token chunks of T = 32, 2 layers
MAX_STREAM_BYTES = 256 * 1024 * 1024  # the default
STREAMS_PER_TENANT = 8  # the default
BATCH_BYTES = 1 << 20  # the default stream_batch_bytes
HEADER_TIMEOUT_S = 2.0
STRICT_FRAME_BYTES = 20000
STRICT_AMPLIFICATION = 512
STRICT_BATCH_BYTES = 4096
RAW_64 = 72 + 2 * (2 * 64 * 16 * 4)  # a raw frame of T = 64: 2 KV heads x 16 channels, fp32


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
                            body_timeout_s=BODY_TIMEOUT_S, header_timeout_s=HEADER_TIMEOUT_S)
    yield srv
    stop_checked(srv)


@pytest.fixture(scope="module")
def strict(tmp_path_factory):
    """A server with small frame, amplification and batch limits (raw frames of T = 64 fit
    ``max_frame_bytes``, of T = 128 do not; one frame is over ``2 x stream_batch_bytes``)."""
    srv = start_tiny_server(tmp_path_factory.mktemp("strict"), max_body_bytes=1 << 20,
                            default_levels=["raw"], default_chunk_tokens=64,
                            max_frame_bytes=STRICT_FRAME_BYTES,
                            max_stream_amplification=STRICT_AMPLIFICATION,
                            stream_batch_bytes=STRICT_BATCH_BYTES)
    yield srv
    stop_checked(srv)


strict_alice = tenant_fixture("strict", "alice", GUARD_S)


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


def later_batch(m: dict, level: str) -> list[dict]:
    """Items filling more than the first stream batch (``BATCH_BYTES``): an item after them is
    read after the response started."""
    size = m["chunks"][0]["levels"][level]["bytes"]
    return [{"t": 0, "l": 0}] * (BATCH_BYTES // size + 2)


def assert_cut(c: httpx.Client, cid: str, body: dict) -> None:
    """The stream starts (200) and is cut: fewer bytes than its Content-Length."""
    with pytest.raises(httpx.HTTPError):
        with c.stream("POST", f"/v1/contexts/{cid}/stream", json=body) as s:
            assert s.status_code == 200
            got = b"".join(s.iter_raw())
            assert len(got) < int(s.headers["content-length"])


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
    # ... refuses a frame of the wrong size in its first batch before the response starts ...
    body = {"level": "q5", "chunks": [{"t": 0, "l": 0}, {"t": 2, "l": 1}, {"t": 0, "l": 1}]}
    err = assert_error(alice.post(f"/v1/contexts/{cid}/stream", json=body), 503, "frame_corrupt")
    assert (err["t"], err["l"], err["level"]) == (2, 1, "q5")
    # ... and cuts the stream on one in a later batch: fewer bytes than Content-Length
    cut_before = metric(alice, "sparkv_stream_errors_total")
    assert_cut(alice, cid, {"level": "q5", "chunks": later_batch(m, "q5") + [{"t": 2, "l": 1}]})
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
    for bad in ("+1", "01", "00", "1.0", "1e0", "0x1", "-0", "2147483648",
                "99999999999999999999"):
        for url in (chunk_url(cid, bad, 0), chunk_url(cid, 0, bad), chunk_url(cid, 0, 0, bad)):
            err = assert_error(alice.get(url, params={"level": "raw"}), 422, "invalid_request")
            assert err["details"][0]["loc"].startswith("path."), err
    for bad in ("%201", "1%20", "%D9%A1"):  # percent-encoded: no second spelling of a URL
        for url in (chunk_url(cid, bad, 0), chunk_url(cid, 0, bad), chunk_url(cid, 0, 0, bad)):
            assert_error(alice.get(url, params={"level": "raw"}), 400, "non_canonical_path")
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
    # what the one configured model (tiny: 2 KV heads, SmolLM2's vocabulary, 4096 positions)
    # allows is stated, so a request the document allows is one the server takes (issue 42 L9)
    props = schemas["CreateContext"]["properties"]
    hpg = props["heads_per_group"]
    assert (hpg["minimum"], hpg["maximum"], hpg["enum"]) == (0, 4096, [0, 1, 2])
    ids = props["token_ids"]["anyOf"][0]
    config = json.loads((shared_tiny_checkpoint() / "config.json").read_text())
    assert (ids["items"]["minimum"], ids["items"]["maximum"]) == (0, config["vocab_size"] - 1)
    assert ids["maxItems"] == config["max_position_embeddings"] == 4096
    assert props["model"]["anyOf"][0]["enum"] == ["tiny"]
    assert "adakv" in props["press"]["anyOf"][0]["pattern"]
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


# ------------------------------------------------------------------------------------------------
# (i) issue 26: a bounded edge. Each test below fails on the code before it (c19a408).
# ------------------------------------------------------------------------------------------------
def test_a_context_whose_frames_exceed_the_cap_is_refused_before_encoding(strict, strict_alice):
    ids = [(i * 31 + 5) % 250 for i in range(200)]
    jobs0 = metric(strict_alice, "sparkv_jobs_total")
    r = strict_alice.post("/v1/contexts", json={"token_ids": ids, "chunk_tokens": 128})
    err = assert_error(r, 400, "frame_too_large")
    assert err["limit"] == STRICT_FRAME_BYTES and err["bytes"] == 72 + 2 * (2 * 128 * 16 * 4)
    assert "chunk_tokens" in err["message"]
    # nothing was queued or stored
    assert metric(strict_alice, "sparkv_jobs_total") == jobs0
    assert strict_alice.get("/v1/contexts").json() == {"contexts": [], "pending": []}
    # at T = 64 the raw frame fits; quantized levels are bounded by the raw frame too
    assert_error(strict_alice.post("/v1/contexts", json={
        "token_ids": ids, "chunk_tokens": 128, "levels": ["q4"]}), 400, "frame_too_large")
    cid, m = create(strict_alice, token_ids=ids)
    assert max(c["levels"]["raw"]["bytes"] for c in m["chunks"]) == RAW_64 <= STRICT_FRAME_BYTES


def test_a_stream_response_is_proportionate_to_its_request(strict, strict_alice):
    cid, m = create(strict_alice, token_ids=[(i * 7 + 3) % 250 for i in range(128)])
    url = f"/v1/contexts/{cid}/stream"
    body = json.dumps({"level": "raw", "chunks": [{"t": 0, "l": 0}] * 40},
                      separators=(",", ":")).encode()
    assert 40 * (4 + RAW_64) > STRICT_AMPLIFICATION * len(body)  # 593 bytes asking for 658 KB
    before = metric(strict_alice, "sparkv_streams_refused_total", reason="response_too_large")
    err = assert_error(strict_alice.post(url, content=body, headers=JSON), 413,
                       "response_too_large")
    assert err["limit"] == STRICT_AMPLIFICATION * len(body) and err["bytes"] == 40 * (4 + RAW_64)
    assert metric(strict_alice, "sparkv_streams_refused_total",
                  reason="response_too_large") == before + 1
    # one frame is always allowed, and a larger request may ask for more
    one = strict_alice.post(url, json={"level": "raw", "chunks": [{"t": 0, "l": 0}]})
    assert one.status_code == 200 and len(split_records(one.content)) == 1
    padded = body + b" " * (40 * (4 + RAW_64) // STRICT_AMPLIFICATION)
    r = strict_alice.post(url, content=padded, headers=JSON)
    assert r.status_code == 200 and len(split_records(r.content)) == 40


def test_a_stalled_stream_holds_bytes_not_frames(strict, strict_alice):
    cid, m = create(strict_alice, token_ids=[(i * 5 + 1) % 250 for i in range(128)])
    assert RAW_64 > 2 * STRICT_BATCH_BYTES  # every frame is a batch of its own
    items = [{"t": c["t"], "l": c["l"]} for c in m["chunks"]] * 500  # 2,000 frames, 33 MB
    body = json.dumps({"level": "raw", "chunks": items}).encode()
    body += b" " * (len(items) * (4 + RAW_64) // STRICT_AMPLIFICATION)
    request = (f"POST /v1/contexts/{cid}/stream HTTP/1.1\r\nHost: x\r\n"
               f"Authorization: Bearer {strict.keys['alice']}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
               ).encode() + body
    sock = stalled_stream(strict.port, request)
    try:
        wait_until(lambda: metric(strict_alice, "sparkv_streams_active") == 1, "the stream")
        wait_until(lambda: metric(strict_alice, "sparkv_frame_bytes_served_total",
                                  endpoint="stream") > 0, "the first frames sent")
        samples = []
        for _ in range(20):  # stalled: at most one frame held (never one read ahead)
            samples.append(metric(strict_alice, "sparkv_stream_buffered_bytes"))
            time.sleep(0.05)
        assert 0 < max(samples) <= max(2 * STRICT_BATCH_BYTES, RAW_64), samples
    finally:
        abort(sock)
    wait_until(lambda: metric(strict_alice, "sparkv_streams_active") == 0, "the slot back")
    wait_until(lambda: metric(strict_alice, "sparkv_stream_buffered_bytes") == 0, "released")


JSON = {"Content-Type": "application/json"}


def test_query_parameters_are_parsed_once_and_strictly(alice, ctx):
    cid, m = ctx
    url = chunk_url(cid, 0, 1)
    raw = alice.get(url, params={"level": "raw"})
    assert raw.status_code == 200
    for query, code in (("level=q5&level=raw", "repeated_query_parameter"),
                        ("level=raw&level=raw", "repeated_query_parameter"),
                        ("Level=q5", "unknown_query_parameter"),
                        ("level=q5&Level=raw", "unknown_query_parameter"),
                        ("level=q5&x=1", "unknown_query_parameter"),
                        ("LEVEL=raw", "unknown_query_parameter")):
        err = assert_error(alice.get(f"{url}?{query}"), 400, code)
        assert err["parameter"] in query
        if code == "unknown_query_parameter":
            assert err["allowed"] == ["level"]
    # values stay case-sensitive too; a percent-encoded name is the same name to the app
    assert_error(alice.get(f"{url}?level=RAW"), 422, "invalid_request")
    assert alice.get(f"{url}?%6Cevel=raw").content == raw.content
    # every endpoint: none of these reads a query parameter
    for path in (f"/v1/contexts/{cid}", "/v1/contexts", f"/v1/contexts/{cid}/tokens",
                 "/v1/models", "/healthz"):
        err = assert_error(alice.get(f"{path}?level=raw"), 400, "unknown_query_parameter")
        assert err["allowed"] == []
    assert_error(alice.post(f"/v1/contexts/{cid}/stream?level=raw",
                            json={"chunks": [{"t": 0, "l": 0}]}), 400, "unknown_query_parameter")


def test_deeply_nested_json_is_400_not_500(alice, ctx):
    cid, _ = ctx
    for body in (b"[" * 60000, b'{"chunks": ' + b"[" * 5000 + b"]" * 5000 + b"}"):
        for url in ("/v1/contexts", f"/v1/contexts/{cid}/stream"):
            r = alice.post(url, content=body, headers=JSON)
            assert r.status_code in (400, 422), (url, r.status_code, r.text)
            assert r.json()["error"]["code"] in ("malformed_json", "invalid_request")
    err = assert_error(alice.post(f"/v1/contexts/{cid}/stream", content=b"[" * 60000,
                                  headers=JSON), 400, "malformed_json")
    assert "nested" in err["message"]


def test_damaged_store_paths_are_frame_corrupt(server, alice):
    cid, m = create(alice, token_ids=[(x + 13) % 250 for x in IDS])
    url = f"/v1/contexts/{cid}/stream"
    before = metric(alice, "sparkv_frames_corrupt_total")
    # a directory where the frame file should be
    as_dir = frame_path(server, "alice", cid, 1, 1, "raw")
    as_dir.unlink()
    as_dir.mkdir()
    err = assert_error(alice.get(chunk_url(cid, 1, 1), params={"level": "raw"}), 503,
                       "frame_corrupt")
    assert (err["t"], err["l"], err["level"]) == (1, 1, "raw")
    err = assert_error(alice.post(url, json={"level": "raw", "chunks": [{"t": 1, "l": 1}]}),
                       503, "frame_corrupt")
    assert (err["t"], err["l"]) == (1, 1)
    assert_cut(alice, cid, {"level": "raw", "chunks": later_batch(m, "raw") + [{"t": 1, "l": 1}]})
    # a frame file missing while the manifest names it
    frame_path(server, "alice", cid, 2, 0, "q5").unlink()
    err = assert_error(alice.get(chunk_url(cid, 2, 0), params={"level": "q5"}), 503,
                       "frame_corrupt")
    assert (err["t"], err["l"], err["level"]) == (2, 0, "q5")
    assert_error(alice.post(url, json={"level": "q5", "chunks": [{"t": 2, "l": 0}]}), 503,
                 "frame_corrupt")
    assert metric(alice, "sparkv_frames_corrupt_total") == before + 4
    # the other frames are served; once the context is deleted, its frames are 404
    assert alice.get(chunk_url(cid, 0, 0), params={"level": "raw"}).status_code == 200
    assert alice.delete(f"/v1/contexts/{cid}").status_code == 204
    assert_error(alice.get(chunk_url(cid, 0, 0), params={"level": "raw"}), 404,
                 "context_not_found")
    assert "Traceback" not in server.log()


def _read_answer(s: socket.socket) -> bytes:
    """Everything the server sends until it closes (hang-guarded by the socket timeout)."""
    out = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            return out
        out += chunk


def _read_response(s: socket.socket) -> bytes:
    """One whole response with a ``content-length`` (its head and body may arrive in separate
    segments: on a loaded machine the first answer's body was read with the next answer)."""
    out = b""
    while b"\r\n\r\n" not in out:
        chunk = s.recv(65536)
        assert chunk, f"the connection closed inside a response's head: {out!r}"
        out += chunk
    head, _, body = out.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        chunk = s.recv(65536)
        assert chunk, "the connection closed inside a response's body"
        body += chunk
    assert len(body) == length, "more than one response arrived"
    return head + b"\r\n\r\n" + body


def test_headers_that_do_not_arrive_in_time_close_the_connection(server, alice):
    before = metric(alice, "sparkv_http_requests_total")
    with socket.create_connection((HOST, server.port), timeout=GUARD_S) as s:  # slowloris
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        answer = _read_answer(s)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower()
    err = json.loads(body)["error"]
    assert err["code"] == "header_timeout" and err["timeout_s"] == HEADER_TIMEOUT_S
    with socket.create_connection((HOST, server.port), timeout=GUARD_S) as s:  # sends nothing
        assert _read_answer(s) == b""
    with socket.create_connection((HOST, server.port), timeout=GUARD_S) as s:  # keep-alive
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        first = b""
        while b'"jobs_active"' not in first:
            first += s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        s.sendall(b"GET /healthz HTTP/1.1\r\nHo")
        assert _read_answer(s).startswith(b"HTTP/1.1 408")
    assert metric(alice, "sparkv_http_requests_total") == before + 2  # one healthz, one /metrics


def test_bearer_is_exactly_one_space_and_a_key(server, ctx):
    cid, _ = ctx
    key = server.keys["alice"]
    with httpx.Client(base_url=server.url, timeout=GUARD_S) as c:
        for value in (f"Bearer  {key}", f"Bearer\t{key}", f"Bearer {key} x", f"Bearer {key[:5]} "
                      f"{key[5:]}", f"Bearer{key}"):
            r = c.get(f"/v1/contexts/{cid}", headers={"Authorization": value})
            assert r.status_code == 401, (value, r.status_code)
            assert r.json()["error"]["code"] == "invalid_api_key"
        for value in (f"Bearer {key}", f"bearer {key}"):  # the scheme is case-insensitive
            assert c.get(f"/v1/contexts/{cid}",
                         headers={"Authorization": value}).status_code == 200


@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_both_http_parsers_have_the_header_deadline(parser):
    """The same deadline with either parser uvicorn may pick (in-process, a trivial app)."""
    import threading

    import uvicorn

    from sparkv.rest import http_protocol
    from sparkv.server.process import free_port

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    base = http_protocol._h11_class() if parser == "h11" else http_protocol._httptools_class()
    protocol = type(base.__name__, (base,), {"header_timeout_s": 1.0})
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host=HOST, port=port, http=protocol,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, "uvicorn to start")
        with socket.create_connection((HOST, port), timeout=GUARD_S) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
            answer = _read_answer(s)
        assert answer.startswith(b"HTTP/1.1 408") and b'"header_timeout"' in answer
        with socket.create_connection((HOST, port), timeout=GUARD_S) as s:
            assert _read_answer(s) == b""
        with socket.create_connection((HOST, port), timeout=GUARD_S) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _read_response(s).startswith(b"HTTP/1.1 200")
            s.sendall(b"GET / HT")
            assert _read_answer(s).startswith(b"HTTP/1.1 408")
    finally:
        server.should_exit = True
        thread.join(GUARD_S)
