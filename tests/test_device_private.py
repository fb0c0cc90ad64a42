"""The device service is private by default (issue 26): its swap dir and files belong to its user
only, the app answers only loopback Host names and (over TCP) the bearer token, bad input is a
4xx JSON error, a refused create costs the other contexts nothing, a context that cannot be
reopened is listed as damaged and can be deleted, and ratio 1.0 keeps every chunk at int8.

In-process tests use the tiny random Llama (no tokenizer: token ids); the real processes are in
tests/test_device_serve.py."""

from __future__ import annotations

import json
import os
import stat

import pytest
from fastapi.testclient import TestClient

from sparkv.device import BudgetTooSmall, ContextDamaged, ContextService, DeviceError
from sparkv.device.access import bearer_token, ensure_token, loopback_host, read_token
from sparkv.device.app import create_app
from sparkv.device.density import plan_levels
from sparkv.device.private import bind_unix_socket
from helpers import flash_profile

FAST_FLASH = flash_profile(fast=True)
DOC = [(7 * i + 3) % 120 + 1 for i in range(70)]


@pytest.fixture(autouse=True)
def usual_umask():
    """The usual umask (022), so that only the code's own modes make files private."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def _svc(lm, path, budget=64 << 20, **kw):
    kw.setdefault("io_profile", FAST_FLASH)
    return ContextService(lm, budget, path, **kw)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _error(r, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["status"] == status and err["message"]
    if code is not None:
        assert err["code"] == code
    return err


# ---- modes and ownership -------------------------------------------------------------------------
def test_swap_dir_is_0700_and_every_file_0600(tiny_llama, tmp_path):
    swap = tmp_path / "swap"
    swap.mkdir(mode=0o755)                       # an existing, wider swap dir is narrowed
    svc = _svc(tiny_llama, swap, io_profile=None)          # measures and writes io-profile.json
    cid = svc.new_context(system_ids=DOC)
    svc.call(cid, prompt_ids=[5, 6, 7], max_new_tokens=4)
    svc.swap_out(cid)
    files = [p for p in swap.rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert "io-profile.json" in names and f"{cid}.json" in names
    assert any(n.endswith(".skvs") for n in names)          # a segment of token chunk records
    for p in [swap, *(p for p in swap.rglob("*") if p.is_dir())]:
        assert _mode(p) == 0o700, p
        assert os.stat(p).st_uid == os.geteuid()
    for p in files:
        assert _mode(p) == 0o600, p
        assert os.stat(p).st_uid == os.geteuid()


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory of another user needs root")
def test_a_swap_dir_of_another_user_is_refused(tiny_llama, tmp_path):
    swap = tmp_path / "planted"
    swap.mkdir(mode=0o777)
    os.chown(swap, 65534, 65534)                 # nobody's
    with pytest.raises(DeviceError, match="belongs to uid 65534"):
        _svc(tiny_llama, swap)


def test_the_socket_is_0600_or_0660_for_a_group(tmp_path):
    path = tmp_path / "s.sock"
    sock = bind_unix_socket(path)
    assert stat.S_ISSOCK(os.lstat(path).st_mode) and _mode(path) == 0o600
    sock.close()
    sock = bind_unix_socket(path, group=str(os.getgid()))    # a stale socket is replaced
    assert _mode(path) == 0o660 and os.stat(path).st_gid == os.getgid()
    sock.close()
    (tmp_path / "file").write_text("mine")
    with pytest.raises(DeviceError, match="not a socket"):
        bind_unix_socket(tmp_path / "file")
    assert (tmp_path / "file").read_text() == "mine"
    with pytest.raises(DeviceError, match="no group"):
        bind_unix_socket(tmp_path / "g.sock", group="no-such-group-here")
    assert not (tmp_path / "g.sock").exists()


def test_the_token_file_is_made_once_0600(tmp_path):
    path = tmp_path / "dir" / "token"
    token = ensure_token(path)
    assert _mode(path) == 0o600 and read_token(path) == token and len(token) >= 40
    assert ensure_token(path) == token                        # the same on the next start
    os.chmod(path, 0o644)                                     # readable by others: replaced
    fresh = ensure_token(path)
    assert fresh != token and _mode(path) == 0o600
    assert read_token(tmp_path / "missing") is None


# ---- Host names and the bearer token -------------------------------------------------------------
def test_host_and_token_parsing():
    for host in ("localhost", "localhost:8400", "127.0.0.1", "127.0.0.1:1", "[::1]", "[::1]:80",
                 "LocalHost"):
        assert loopback_host(host), host
    for host in (None, "", "evil.example", "localhost.evil.example", "127.0.0.2", "localhost.",
                 "localhost:", "localhost:x", "[::2]", "sparkv-device"):
        assert not loopback_host(host), host
    assert bearer_token(["Bearer abc"]) == "abc"
    for values in ([], ["Bearer  abc"], ["bearer abc"], ["Bearer"], ["Bearer "], ["Bearer a b"],
                   ["Basic abc"], ["Bearer abc", "Bearer abc"], [" Bearer abc"]):
        assert bearer_token(values) is None, values


class _Service:
    """The least of a service the access checks need."""

    contexts: dict = {}

    def list(self):
        return []

    def damaged_list(self):
        return []

    def health(self):
        return {"ok": True, "contexts": 0}


def test_a_foreign_host_gets_421_on_every_transport():
    for token in (None, "t0k3n-t0k3n-t0k3n-t0k3n-t0k3n-t0k3n-xx"):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        with TestClient(create_app(_Service(), token=token), base_url="http://localhost",
                        headers=headers) as c:
            assert c.get("/healthz").status_code == 200
            assert c.get("/v1/contexts", headers={"Host": "127.0.0.1:8400"}).status_code == 200
            assert c.get("/healthz", headers={"Host": "[::1]"}).status_code == 200
            for host in ("evil.example", "evil.example:8400", "localhost.evil.example"):
                _error(c.get("/v1/contexts", headers={"Host": host}), 421, "misdirected_request")


def test_tcp_needs_the_bearer_token():
    token = "t0k3n-t0k3n-t0k3n-t0k3n-t0k3n-t0k3n-xx"
    with TestClient(create_app(_Service(), token=token), base_url="http://localhost") as c:
        r = c.get("/v1/contexts")
        _error(r, 401, "missing_token")
        assert r.headers["www-authenticate"].startswith("Bearer")
        for bad in ("Bearer wrong", f"Bearer  {token}", f"bearer {token}", f"Bearer {token} ",
                    f"Basic {token}", token, "Bearer "):
            _error(c.get("/v1/contexts", headers={"Authorization": bad}), 401, "invalid_token")
        _error(c.get("/healthz"), 401, "missing_token")
        _error(c.get("/openapi.json"), 401, "missing_token")
        ok = c.get("/v1/contexts", headers={"Authorization": f"Bearer {token}"})
        assert ok.status_code == 200 and ok.json() == {"contexts": [], "damaged": []}


# ---- bad inputs: 4xx JSON, never a 500 -----------------------------------------------------------
def test_bad_inputs_are_4xx_json(tiny_llama, tmp_path):
    svc = _svc(tiny_llama, tmp_path / "swap")
    cid = svc.new_context(system_ids=DOC)
    vocab = svc.vocab
    with TestClient(create_app(svc), base_url="http://localhost",
                    raise_server_exceptions=False) as c:
        call = f"/v1/contexts/{cid}/call"
        for ids in ([vocab], [10 ** 6]):  # outside the vocabulary: the service's 400
            err = _error(c.post(call, json={"prompt_ids": ids}), 400, "bad_request")
            assert "not a token id" in err["message"]
            _error(c.post("/v1/contexts", json={"system_ids": ids}), 400, "bad_request")
        for ids in ([-1], [1, 2, 1 << 40], [True], ["5"]):  # not a JSON token id: 422, as the
            _error(c.post(call, json={"prompt_ids": ids}), 422, "invalid_request")  # server
            _error(c.post("/v1/contexts", json={"system_ids": ids}), 422, "invalid_request")
        r = c.post(call, json={"prompt_ids": [10 ** 30]})
        _error(r, 400 if r.status_code == 400 else 422)
        for t in ("1e308", "Infinity", "-Infinity", "NaN", "-1", "1e6"):
            body = b'{"prompt_ids": [5], "timeout_s": ' + t.encode() + b"}"
            _error(c.post(call, content=body, headers={"content-type": "application/json"}),
                   422, "invalid_request")
        for field, path in (("prompt", call), ("system_prompt", "/v1/contexts")):
            body = b'{"' + field.encode() + b'": "a \\ud800 b"}'
            err = _error(c.post(path, content=body, headers={"content-type": "application/json"}),
                         422, "invalid_request")
            assert "unicode" in err["message"].lower()
        assert c.post(call, json={"prompt_ids": [5, 6], "max_new_tokens": 2,
                                  "timeout_s": 5}).status_code == 200
        assert len(c.get("/v1/contexts").json()["contexts"]) == 1
    # the Python API refuses the same, with the same errors
    for kw in ({"prompt_ids": [vocab]}, {"prompt_ids": [-3]}, {"prompt_ids": [1.5]},
               {"prompt": "x\udfff"}, {"prompt_ids": [5], "timeout_s": float("inf")},
               {"prompt_ids": [5], "timeout_s": float("nan")},
               {"prompt_ids": [5], "timeout_s": 1e308}):
        with pytest.raises(DeviceError):
            svc.call(cid, max_new_tokens=2, **kw)
    with pytest.raises(DeviceError):
        svc.new_context(system_ids=[vocab + 5])
    with pytest.raises(DeviceError):
        svc.import_context([vocab], [])
    assert [d.id for d in svc.list()] == [cid]


# ---- a refused create evicts nothing -------------------------------------------------------------
def test_a_refused_create_evicts_nothing(tiny_llama, tmp_path):
    svc = _svc(tiny_llama, tmp_path / "swap", budget=200_000)
    a = svc.new_context(system_ids=DOC)
    svc.call(a, prompt_ids=[9, 10, 11], max_new_tokens=3)
    before = svc.describe(a)
    assert before.hot and before.chunks.resident > 0
    used, counters = svc.used_bytes(), svc.counters.snapshot()
    with pytest.raises(BudgetTooSmall):
        svc.new_context(system_ids=[(5 * i) % 120 + 1 for i in range(1500)])
    after = svc.describe(a)
    assert after.hot and after.chunks == before.chunks
    assert after.bytes == before.bytes
    assert svc.used_bytes() == used
    assert svc.counters.hot_dropped == counters.hot_dropped
    assert svc.counters.evicted_bytes == counters.evicted_bytes
    assert [d.id for d in svc.list()] == [a]


# ---- a context that cannot be reopened is listed as damaged and deletable ------------------------
def test_a_truncated_journal_is_listed_as_damaged_and_deletable(tiny_llama, tmp_path):
    swap = tmp_path / "swap"
    svc = _svc(tiny_llama, swap)
    good, cut, bad_ids = (svc.new_context(system_ids=DOC[:40 + 10 * i]) for i in range(3))
    for cid in (good, cut, bad_ids):
        svc.call(cid, prompt_ids=[3, 4], max_new_tokens=2)
    record = swap / "journal" / f"{cut}.json"
    data = record.read_bytes()
    record.write_bytes(data[:len(data) // 2])                    # cut short
    doc = json.loads((swap / "journal" / f"{bad_ids}.json").read_text())
    doc["tokens"][3] = svc.vocab + 7                            # an id the model cannot embed
    (swap / "journal" / f"{bad_ids}.json").write_text(json.dumps(doc))
    orphan = swap / "contexts" / "00ff00ff00ff00ff"            # files, no record
    orphan.mkdir()
    (orphan / "0.skvt").write_bytes(b"SKVT")
    del svc

    again = _svc(tiny_llama, swap)
    assert [d.id for d in again.list()] == [good]
    damaged = {d.id: d for d in again.damaged_list()}
    assert set(damaged) == {cut, bad_ids, orphan.name}
    assert all(d.to_dict()["state"] == "damaged" and d.reason for d in damaged.values())
    assert "cannot be read" in damaged[cut].reason
    assert "not a token id" in damaged[bad_ids].reason
    assert again.stats()["damaged"] == 3
    with pytest.raises(ContextDamaged):
        again.call(cut, prompt_ids=[3], max_new_tokens=1)
    with TestClient(create_app(again), base_url="http://localhost") as c:
        listed = c.get("/v1/contexts").json()
        assert [d["id"] for d in listed["contexts"]] == [good]
        assert {d["id"] for d in listed["damaged"]} == set(damaged)
        _error(c.get(f"/v1/contexts/{cut}"), 409, "context_damaged")
        _error(c.post(f"/v1/contexts/{cut}/call", json={"prompt_ids": [3]}), 409,
               "context_damaged")
        for cid in damaged:
            assert c.delete(f"/v1/contexts/{cid}").status_code == 204
        assert c.get("/v1/contexts").json()["damaged"] == []
        _error(c.delete(f"/v1/contexts/{cut}"), 404, "unknown_context")
    for cid in damaged:
        assert not (swap / "journal" / f"{cid}.json").exists()
        assert not (swap / "contexts" / cid).exists()
    assert (swap / "contexts" / good).is_dir()
    third = _svc(tiny_llama, swap)
    assert third.damaged_list() == [] and [d.id for d in third.list()] == [good]
    assert third.call(good, prompt_ids=[3], max_new_tokens=1).context_tokens > 0


# ---- ratio 1.0 is every chunk at int8 ------------------------------------------------------------
def test_ratio_one_is_all_int8_whatever_the_densities():
    for dens in ([1.0, 1.0, 0.0, 0.0], [0.0] * 5, [3.0, 1e-18, 0.0, 2.0]):
        assert set(plan_levels(dens, 1.0).levels) == {"int8"}, dens
        mix = plan_levels(dens, 1.0, protect=[0], fp_ratio=3.7)
        assert mix.levels[0] == "fp" and set(mix.levels[1:]) == {"int8"}
    # below 1.0 the densest still keep the most bits
    assert plan_levels([3.0, 2.0, 1.0, 0.0], 0.85).levels[0] == "int8"


def test_service_chunks_at_ratio_one_are_fp_or_int8(tiny_llama, tmp_path):
    svc = _svc(tiny_llama, tmp_path / "swap")
    cid = svc.new_context(system_ids=DOC)
    for i in range(3):
        svc.call(cid, prompt_ids=[11 + i, 12, 13], max_new_tokens=5)
    assert set(svc.describe(cid).levels) <= {"fp", "int8"}
