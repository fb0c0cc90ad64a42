"""Issue 42's findings on the REST server, each against a real ``sparkv serve`` on loopback:

* M2: a frame file is checked (a regular file inside the store, no larger than its manifest
  entry) before it is read: a 3 GB sparse file, a symlink to ``/dev/zero``, a symlink to a copy
  of the frame outside the store, a FIFO are each 503 ``frame_corrupt`` at once, the server's
  peak RSS does not grow by the file, and SIGTERM still stops it (before: the 3 GB file took the
  RSS from 1.6 to 4.6 GB, ``/dev/zero`` was a 500 ``MemoryError``, the FIFO hung the request and
  then the server did not stop);
* L3: two ``X-API-Key`` or two ``Authorization`` headers are 401 ``conflicting_api_keys`` (the
  first one won);
* L4: a percent-encoded path (an encoded id, ``%2F`` for a separator) is 400
  ``non_canonical_path``, a DELETE through one deletes nothing (they were answered 200, and the
  DELETE worked);
* L9: a 405 names the allowed methods (``Allow``; TRACE had none);
* L10: ``sparkv encode --tenant bob``, bob not in the config, is one error line, exit 2, nothing
  stored (it wrote a context no key could reach);
* L11: ``sparkv serve`` on a port in use is one ``sparkv: error:`` line and exit 2 (was
  uvicorn's "Application startup complete", ``[Errno 98]``, exit 3).

Hang guards bound every wait; nothing asserts wall-clock time.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest

from sparkv.server.process import HOST, write_config
from helpers import (api_client, assert_error, create_context, start_tiny_server, stop_checked,
                     tenant_fixture)

GUARD_S = 30.0
IDS = [(i * 29 + 3) % 250 for i in range(96)]  # 3 token chunks of T = 32, 2 layers
RSS_SLACK_KB = 64 * 1024
"""How much the server's peak RSS may grow while it refuses a hostile frame file (a 3 GB file
grew it by 3 GB before)."""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_tiny_server(tmp_path_factory.mktemp("hostile"), default_levels=["raw"])
    yield srv
    stop_checked(srv)


alice = tenant_fixture("server", "alice", GUARD_S)


@pytest.fixture(scope="module")
def ctx(alice):
    return create_context(alice, token_ids=IDS)["context_id"]


def peak_rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))


def chunk_url(cid: str, t: int) -> str:
    return f"/v1/contexts/{cid}/chunks/{t}/0/0"


# ---- M2 ----------------------------------------------------------------------------------------
def _sparse_3gb(path, _):
    with open(path, "wb") as f:
        f.truncate(3 * 10**9)


def _to_dev_zero(path, _):
    path.symlink_to("/dev/zero")


def _to_a_copy_outside(path, good):
    outside = path.parents[5] / f"outside-{path.name}"  # beside the store
    outside.write_bytes(good)  # the right bytes: still not served through a symlink
    path.symlink_to(outside)


def _fifo(path, _):
    os.mkfifo(path)


@pytest.mark.parametrize("plant", [_sparse_3gb, _to_dev_zero, _to_a_copy_outside, _fifo],
                         ids=["3gb-sparse", "symlink-dev-zero", "symlink-outside", "fifo"])
def test_a_hostile_frame_file_is_refused_unread(tmp_path, plant):
    srv = start_tiny_server(tmp_path, default_levels=["raw"])
    try:
        with api_client(srv, srv.keys["alice"], GUARD_S) as c:
            cid = create_context(c, token_ids=IDS)["context_id"]
            path = srv.store_dir / "tenants" / "alice" / "contexts" / cid / "chunks" / "1.0.0.raw"
            good = path.read_bytes()
            path.unlink()
            plant(path, good)
            before = peak_rss_kb(srv.proc.pid)
            err = assert_error(c.get(chunk_url(cid, 1), params={"level": "raw"}), 503,
                               "frame_corrupt")
            assert (err["t"], err["l"], err["level"]) == (1, 0, "raw")
            assert_error(c.post(f"/v1/contexts/{cid}/stream",
                                json={"level": "raw", "chunks": [{"t": 1, "l": 0}]}),
                         503, "frame_corrupt")
            assert peak_rss_kb(srv.proc.pid) - before < RSS_SLACK_KB
            assert c.get(chunk_url(cid, 0), params={"level": "raw"}).status_code == 200
        srv.proc.send_signal(signal.SIGTERM)
        # it stops (uvicorn ends by raising the signal again); a FIFO read used to keep it up
        assert srv.proc.wait(GUARD_S) in (0, -signal.SIGTERM)
    finally:
        srv.stop()
    assert "Traceback" not in srv.log()


def test_a_fifo_in_the_manifests_place_is_a_503_not_a_hang(server, alice):
    cid = create_context(alice, token_ids=[(x + 5) % 250 for x in IDS])["context_id"]
    manifest = server.store_dir / "tenants" / "alice" / "contexts" / cid / "manifest.json"
    manifest.unlink()
    os.mkfifo(manifest)
    assert_error(alice.get(f"/v1/contexts/{cid}"), 503, "store_unavailable")
    manifest.unlink()


# ---- L3 ----------------------------------------------------------------------------------------
def test_two_key_headers_are_refused_not_guessed(server, ctx):
    key, other = server.keys["alice"], server.keys["bob"]
    url = f"{server.url}/v1/contexts/{ctx}"
    cases = [[("X-API-Key", key), ("X-API-Key", other)],
             [("X-API-Key", key), ("X-API-Key", key)],
             [("Authorization", f"Bearer {key}"), ("Authorization", f"Bearer {other}")],
             [("Authorization", f"Bearer {key}"), ("Authorization", f"Bearer {key}")]]
    with httpx.Client(timeout=GUARD_S) as c:
        for headers in cases:
            r = c.get(url, headers=httpx.Headers(headers))
            assert_error(r, 401, "conflicting_api_keys")
            assert r.headers["www-authenticate"].startswith("Bearer")
        assert c.get(url, headers={"X-API-Key": key}).status_code == 200  # one is fine


# ---- L4 ----------------------------------------------------------------------------------------
def test_percent_encoded_paths_are_refused(server, alice, ctx):
    encoded_id = "%" + format(ord(ctx[0]), "02X") + ctx[1:]
    for path in (f"/v1/contexts/{encoded_id}", f"/v1/contexts/{ctx}%2Ftokens",
                 f"/v1/contexts/{ctx}%2Fchunks%2F0%2F0%2F0", f"/v1/contexts/{ctx}/chunks/%30/0/0",
                 "/v1/%63ontexts", "/health%7A"):
        assert_error(alice.get(path), 400, "non_canonical_path")
    assert_error(alice.delete(f"/v1/contexts/{encoded_id}"), 400, "non_canonical_path")
    assert alice.get(f"/v1/contexts/{ctx}").status_code == 200  # not deleted
    spec = alice.get("/openapi.json").json()
    for ops in spec["paths"].values():  # the schema states this 400 on every operation
        for op in ops.values():
            assert "400" in op["responses"]


# ---- L9 ----------------------------------------------------------------------------------------
def test_a_405_names_the_allowed_methods(alice, ctx):
    for method, path, allowed in (("TRACE", f"/v1/contexts/{ctx}", {"GET", "DELETE"}),
                                  ("PUT", "/v1/contexts", {"GET", "POST"}),
                                  ("TRACE", "/healthz", {"GET"})):
        r = alice.request(method, path)
        assert_error(r, 405, "method_not_allowed")
        assert {m.strip() for m in r.headers["allow"].split(",")} == allowed


# ---- L10 ---------------------------------------------------------------------------------------
def test_encode_refuses_a_tenant_no_key_reaches(server, tmp_path):
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(IDS))
    before = sorted(p.name for p in (server.store_dir / "tenants").iterdir())
    for extra in (["--tenant", "mallory"], []):  # not configured; anonymous with two tenants
        p = subprocess.run([sys.executable, "-m", "sparkv.cli", "encode", str(ids), "--token-ids",
                            "--config", str(server.config_path), "--store",
                            f"file://{server.store_dir}", *extra],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 2, p.stderr
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("sparkv: error: tenant "), lines
        assert "alice, bob" in lines[0]
    assert sorted(p.name for p in (server.store_dir / "tenants").iterdir()) == before


# ---- L11 ---------------------------------------------------------------------------------------
def test_serve_on_a_port_in_use_is_one_error_line(tmp_path):
    write_config(tmp_path / "server.yaml", ["alice"])
    with socket.socket() as busy:
        busy.bind((HOST, 0))
        busy.listen(1)
        p = subprocess.run([sys.executable, "-m", "sparkv.cli", "serve", "--host", HOST,
                            "--port", str(busy.getsockname()[1]), "--config",
                            str(tmp_path / "server.yaml"), "--store",
                            f"file://{tmp_path}/store"],
                           capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    out = (p.stdout + p.stderr).strip().splitlines()
    assert len(out) == 1 and out[0].startswith("sparkv: error: cannot listen on "), out
    assert "in use" in out[0] and "startup" not in p.stderr.lower()
