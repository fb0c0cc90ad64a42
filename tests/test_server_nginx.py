"""deploy/nginx.conf's frame cache in front of a real ``sparkv serve`` (the tiny model, a file
store; no Redis): the template rendered as deploy/cluster.sh renders it, with a short
``FRAME_CACHE_S``.

* the cache keys on exactly what the replica answers: a repeated, differently cased or
  percent-encoded ``level`` (``?level=q5&level=raw``, ``?Level=q4``) is never cached, and the
  replica refuses the repeated and unknown ones (400), so no request can store one level's frame
  under another level's key;
* a deleted context stops being served from the cache within ``FRAME_CACHE_S`` (plus the
  replica's ``manifest_cache_s``): entries are revalidated with ``If-None-Match``.

Skips when nginx is missing. Waits are hang guards, never timing assertions.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from sparkv.protocol.digests import checksum
from sparkv.server.cluster import nginx_path
from sparkv.server.process import HOST, free_port, terminate
from helpers import api_client, create_context, start_tiny_server, stop_checked

pytestmark = pytest.mark.skipif(nginx_path() is None, reason="nginx is not installed")

ROOT = Path(__file__).resolve().parents[1]
GUARD_S = 60.0
FRAME_CACHE_S = 2
IDS = [(i * 41 + 9) % 250 for i in range(64)]  # 2 token chunks of T = 32, 2 layers


def render_nginx(directory: Path, listen: str, upstream_port: int) -> Path:
    """deploy/nginx.conf with its placeholders filled (as deploy/cluster.sh fills them)."""
    for sub in ("logs", "tmp", "cache"):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    values = {"USER_LINE": "user root;" if os.geteuid() == 0 else "", "WORKERS": "1",
              "DIR": str(directory), "LISTEN": listen, "CACHE_MAX": "64m",
              "FRAME_CACHE_S": str(FRAME_CACHE_S),
              "UPSTREAMS": f"        server {HOST}:{upstream_port} max_fails=1 fail_timeout=3s;"}
    text = (ROOT / "deploy" / "nginx.conf").read_text()
    assert set(re.findall(r"@([A-Z_]+)@", text)) == set(values)
    for name, value in values.items():
        text = text.replace(f"@{name}@", value)
    out = directory / "nginx.conf"
    out.write_text(text)
    return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A tiny server behind nginx: ``(server, nginx base URL)``."""
    tmp = tmp_path_factory.mktemp("nginx")
    srv = start_tiny_server(tmp, manifest_cache_s=0.5)
    port = free_port()
    conf = render_nginx(tmp / "nginx", f"{HOST}:{port}", srv.port)
    log = open(tmp / "nginx-stderr.log", "wb")
    nginx = subprocess.Popen([nginx_path(), "-p", str(tmp / "nginx"), "-c", str(conf),
                              "-g", "daemon off;"], stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://{HOST}:{port}"
    deadline = time.monotonic() + GUARD_S
    while True:
        assert nginx.poll() is None, (tmp / "nginx-stderr.log").read_text()
        try:
            if httpx.get(f"{url}/nginx-health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "hang guard: nginx did not start"
        time.sleep(0.1)
    yield srv, url
    terminate(nginx)
    log.close()
    stop_checked(srv)


def frame_url(cid: str, t: int, layer: int) -> str:
    return f"/v1/contexts/{cid}/chunks/{t}/{layer}/0"


def test_a_level_is_never_cached_under_another_levels_key(stack):
    srv, url = stack
    with api_client(srv, srv.keys["alice"]) as direct:
        cid = create_context(direct, token_ids=IDS)["context_id"]
        m = direct.get(f"/v1/contexts/{cid}").json()
    want = {lv: m["chunks"][0]["levels"][lv]["checksum"] for lv in ("q5", "raw")}
    path = frame_url(cid, 0, 0)
    with httpx.Client(base_url=url, timeout=GUARD_S,
                      headers={"Authorization": f"Bearer {srv.keys['alice']}"}) as c:
        # the attempts come first: on a cache keyed on the first "level" argument (or on a
        # case-insensitive name) they would store the raw frame under the q5 key
        for query in ("level=q5&level=raw", "level=raw&level=q5", "Level=raw", "level=q5&Level=raw",
                      "LEVEL=raw&level=q5", "level=q5&x=1"):
            r = c.get(f"{path}?{query}")
            assert r.status_code == 400, (query, r.status_code)
            assert r.json()["error"]["code"] in ("repeated_query_parameter",
                                                 "unknown_query_parameter")
            assert r.headers["x-cache-status"] == "BYPASS"
        # a percent-encoded name is answered (the replica decodes it) but never cached
        for _ in range(2):
            r = c.get(f"{path}?%6Cevel=raw")
            assert r.status_code == 200 and r.headers["x-cache-status"] == "BYPASS"
            assert checksum(r.content) == want["raw"]
        for lv in ("q5", "raw", "q5", "raw"):
            r = c.get(f"{path}?level={lv}")
            assert r.status_code == 200 and checksum(r.content) == want[lv], lv
            assert r.headers["x-cache-status"] in ("MISS", "HIT", "REVALIDATED", "EXPIRED")
        # no level: the default (q5), under its own key
        r = c.get(path)
        assert r.status_code == 200 and checksum(r.content) == want["q5"]


def test_a_deleted_context_stops_being_served_from_the_cache(stack):
    srv, url = stack
    alice = {"Authorization": f"Bearer {srv.keys['alice']}"}
    with api_client(srv, srv.keys["alice"]) as direct:
        cid = create_context(direct, token_ids=[(x + 3) % 250 for x in IDS])["context_id"]
    path = f"{frame_url(cid, 1, 1)}?level=raw"
    with httpx.Client(base_url=url, timeout=GUARD_S, headers=alice) as c:
        first = c.get(path)
        second = c.get(path)
        assert first.status_code == second.status_code == 200
        assert second.headers["x-cache-status"] == "HIT" and second.content == first.content
        # once the entry is older than FRAME_CACHE_S it is revalidated (a 304 upstream)
        time.sleep(FRAME_CACHE_S + 1.1)  # nginx counts whole seconds
        again = c.get(path)
        assert again.status_code == 200 and again.content == first.content
        assert again.headers["x-cache-status"] == "REVALIDATED"
        assert c.delete(f"/v1/contexts/{cid}").status_code == 204
        deadline = time.monotonic() + GUARD_S  # the bound is FRAME_CACHE_S + manifest_cache_s
        while (r := c.get(path)).status_code == 200:
            assert time.monotonic() < deadline, "hang guard: the cache still serves the frame"
            time.sleep(0.2)
        assert r.status_code == 404 and r.json()["error"]["code"] == "context_not_found"
        assert c.get(path).status_code == 404  # and nothing of it is cached
