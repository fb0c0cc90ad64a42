"""The device service's HTTP app over a scripted service (no model): each route answers what the
service returns, unchanged; every error has the wire's one JSON shape; the client turns it into
the device error of its status with the server's message."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from sparkv.device import BudgetTooSmall, ContextBusy, DeviceError, UnknownContext
from sparkv.device.app import create_app
from sparkv.device.client import response_error
from sparkv.device.loader import LoadStats
from sparkv.device.registry import ContextSummary, ResidencyCounts
from sparkv.device.service import CallResult
from sparkv.runtime.sampling import Sampling

SUMMARY = ContextSummary("0123456789abcdef", tokens=40, calls=2, bytes=12345,
                         chunks=ResidencyCounts(resident=2, flash=1, absent=0),
                         levels={"fp": 1, "int8": 2}, last_used=7, busy=False, hot=True,
                         system_prompt=None, label="s/c")
INFO = {"id": "0123456789abcdef", "tokens": 40, "calls": 2, "bytes": 12345,
        "chunks": {"resident": 2, "flash": 1, "absent": 0}, "levels": {"fp": 1, "int8": 2},
        "last_used": 7, "busy": False, "hot": True, "system_prompt": None, "label": "s/c",
        "created_unix": 0.0}
STATS = {"policy": "llms", "device": "cpu",
         "host_tier": {"capacity_bytes": 100, "bytes": 10, "records": 1, "peak_bytes": 20,
                       "hits": 2, "hit_bytes": 10, "misses": 0, "puts": 3, "evictions": 0,
                       "dropped": 1},
         "turn_cache": {"capacity": 64, "bytes": 8, "tails": 1, "hits": 1, "misses": 2,
                        "reused_tokens": 40, "evictions": 0},
         "budget_bytes": 40000000, "used_bytes": 123, "peak_bytes": 456,
         "budget_violations": 0, "contexts": 1, "resident_bytes_by_level": {"int8": 100},
         "io_profile": {"read_Bps": 5e8, "per_file_s": 2e-4, "threads": 4, "source": "default"},
         "recompute_scale": 1.25, "reopened": 0, "damaged": 0, "calls": 3, "evicted_chunks": 4,
         "evicted_bytes": 5, "reclaim_written_bytes": 0, "aot_written_bytes": 6, "read_bytes": 7,
         "recomputed_chunks": 8, "read_chunks": 9, "host_chunks": 2, "host_bytes": 10,
         "faults": 0, "hot_hits": 1, "hot_dropped": 0, "streamed_chunks": 0,
         "turns_running": 0, "reservations_waiting": 0, "turn_waits": 0, "joined_reads": 0,
         "read_handoffs": 0}


#: a context as the routes describe it: the service's description and its owner (an app's view)
OWNED = {**INFO, "owner": "user", "shared_with": []}

HEALTH = {"ok": True, "contexts": 1,
          "flash": {"state": "ok", "path": "/data/flash", "mount": "/data", "free_bytes": 10,
                    "total_bytes": 20, "reason": None}}


class ScriptedService:
    """What the app calls of a ContextService, answering fixed values."""

    def __init__(self) -> None:
        self.contexts = {INFO["id"]: object()}
        self.seen: list[tuple] = []

    def _known(self, ctx_id: str) -> None:
        if ctx_id not in self.contexts:
            raise UnknownContext(f"no context {ctx_id!r}")

    def new_context(self, system_prompt=None, *, system_ids=None, label=None) -> str:
        if system_ids is not None and len(system_ids) > 100:
            raise BudgetTooSmall("too big for the budget")
        self.seen.append(("new", system_prompt, system_ids) + ((label,) if label else ()))
        return INFO["id"]

    def describe(self, ctx_id: str) -> ContextSummary:
        self._known(ctx_id)
        return SUMMARY

    def list(self) -> list[ContextSummary]:
        return [SUMMARY]

    def damaged_list(self) -> list:
        return []

    def stats(self) -> dict:
        return dict(STATS)

    def health(self) -> dict:
        return dict(HEALTH)

    def delete(self, ctx_id: str) -> None:
        self._known(ctx_id)
        self.seen.append(("delete", ctx_id))

    def call(self, ctx_id, prompt, max_new_tokens, *, prompt_ids=None, grow=True,
             timeout_s=None, turn_scope="", sampling=None) -> CallResult:
        self._known(ctx_id)
        if timeout_s == 0:
            raise ContextBusy("the context is busy")
        self.seen.append(("call", ctx_id, prompt, max_new_tokens, prompt_ids, grow, timeout_s,
                          turn_scope))
        self.sampled = sampling
        return CallResult(ctx_id, "Paris.", [11, 12], 0.002, reclaim_s=0.0005, load_s=0.0015,
                          first_token_s=0.25, total_s=0.5, aot_s=0.01, context_tokens=60,
                          bytes_evicted=0, bytes_written_at_reclaim=0, bytes_written_aot=64,
                          load=LoadStats(read_chunks=1, notes=["x"]), plan=None)


@pytest.fixture
def app_client():
    svc = ScriptedService()
    with TestClient(create_app(svc), base_url="http://localhost",
                    raise_server_exceptions=False) as c:
        yield c, svc


def _same_json(got, want) -> None:
    """Equal values and equal JSON text (int stays int, key order kept)."""
    assert got == want
    assert json.dumps(got) == json.dumps(want)


def test_routes_answer_what_the_service_returns(app_client):
    c, svc = app_client
    _same_json(c.get("/healthz").json(), HEALTH)
    r = c.post("/v1/contexts", json={"system_prompt": "be brief"})
    assert r.status_code == 201
    assert c.post("/v1/contexts", json={"label": "mine"}).status_code == 201
    assert svc.seen.pop() == ("new", None, None, "mine")
    for bad in ("", "a#b", "x" * 101, "tab\there"):            # 422 before the service
        assert c.post("/v1/contexts", json={"label": bad}).status_code == 422
    _same_json(r.json(), OWNED)
    _same_json(c.get("/v1/contexts").json(), {"contexts": [OWNED], "damaged": []})
    _same_json(c.get(f"/v1/contexts/{INFO['id']}").json(), OWNED)
    _same_json(c.get("/v1/stats").json(), STATS)
    r = c.post(f"/v1/contexts/{INFO['id']}/call", json={"prompt": "capital?",
                                                         "max_new_tokens": 5})
    want = CallResult(INFO["id"], "Paris.", [11, 12], 0.002, reclaim_s=0.0005, load_s=0.0015,
                      first_token_s=0.25, total_s=0.5, aot_s=0.01, context_tokens=60,
                      bytes_evicted=0, bytes_written_at_reclaim=0, bytes_written_aot=64,
                      load=LoadStats(read_chunks=1, notes=["x"]), plan=None).to_dict()
    _same_json(r.json(), want)
    assert set(want) == {"context_id", "text", "tokens", "stats"}
    assert want["stats"]["ttft_s"] == 0.25 and want["stats"]["new_tokens"] == 2
    assert svc.sampled == Sampling()                                            # greedy
    c.post(f"/v1/contexts/{INFO['id']}/call", json={
        "prompt": "q", "temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": -3,
        "frequency_penalty": 0.5, "presence_penalty": -0.5, "logit_bias": {"7": -100}})
    assert svc.sampled == Sampling(0.7, 0.9, 40, -3, 0.5, -0.5, ((7, -100.0),))
    for bad in ({"temperature": 2.5}, {"top_p": 1.1}, {"top_k": -1}, {"seed": 1.5},
                {"seed": 1 << 64}, {"temperature": "hot"}, {"frequency_penalty": 3},
                {"logit_bias": {"x": 1}}, {"logit_bias": {"7": 101}},
                {"logit_bias": {"7": False}}, {"logit_bias": {"7": "5"}},    # JSON numbers only
                {"temperature": True}, {"top_p": "0.5"}, {"presence_penalty": False},
                {"timeout_s": True}):
        r = c.post(f"/v1/contexts/{INFO['id']}/call", json={"prompt": "q", **bad})
        assert r.status_code == 422 and next(iter(bad)) in r.text
    r = c.delete(f"/v1/contexts/{INFO['id']}")
    assert r.status_code == 204 and r.content == b""
    assert ("call", INFO["id"], "capital?", 5, None, True, None, "user") in svc.seen   # whose turns


def _error(r, status: int, code: str) -> dict:
    assert r.status_code == status
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert err["status"] == status and err["code"] == code and err["message"]
    return err


def test_every_error_has_the_one_json_shape(app_client):
    c, _ = app_client
    cid = INFO["id"]
    err = _error(c.get("/v1/contexts/ffffffffffffffff"), 404, "unknown_context")
    assert "ffffffffffffffff" in err["message"]
    _error(c.post(f"/v1/contexts/{cid}/call", json={"max_new_tokens": 4}), 400, "bad_request")
    _error(c.post("/v1/contexts", json={"system_prompt": "a", "system_ids": [1]}), 400,
           "bad_request")
    _error(c.post(f"/v1/contexts/{cid}/call", json={"prompt": "hi", "timeout_s": 0}), 409,
           "context_busy")
    _error(c.post("/v1/contexts", json={"system_ids": list(range(200))}), 507,
           "budget_too_small")
    err = _error(c.post(f"/v1/contexts/{cid}/call", json={"prompt": "hi", "max_new_tokens": -1}),
                 422, "invalid_request")
    assert err["message"].startswith("invalid request: body.max_new_tokens")
    assert err["details"][0]["loc"] == "body.max_new_tokens"
    # the JSON-body policy both apps share: not JSON is 400, JSON off the schema 422
    _error(c.post("/v1/contexts", content=b"{not json", headers={"content-type":
                                                                  "application/json"}),
           400, "malformed_json")
    _error(c.post("/v1/contexts", content=b"[" * 60000, headers={"content-type":
                                                                  "application/json"}),
           400, "malformed_json")
    _error(c.get("/v1/nothing"), 404, "not_found")
    r = c.put("/v1/stats")
    _error(r, 405, "method_not_allowed")
    assert r.headers["allow"] == "GET"
    _error(c.request("TRACE", "/v1/stats"), 405, "method_not_allowed")
    _error(c.get(f"/v1/contexts/{cid[:4]}%{ord(cid[4]):02X}{cid[5:]}"), 400,
           "non_canonical_path")


def test_openapi_names_a_model_for_every_answer(app_client):
    c, _ = app_client
    paths = c.get("/openapi.json").json()["paths"]
    assert set(paths) == {"/v1/contexts", "/v1/contexts/{ctx_id}", "/v1/contexts/{ctx_id}/call",
                          "/v1/contexts/{ctx_id}/share", "/v1/stats", "/healthz"}
    for path, ops in paths.items():
        for method, op in ops.items():
            for status, resp in op["responses"].items():
                if status == "204":
                    continue
                schema = resp["content"]["application/json"]["schema"]
                assert "$ref" in schema, (method, path, status)


@pytest.mark.parametrize("status,cls", [(404, UnknownContext), (409, ContextBusy),
                                        (507, BudgetTooSmall), (400, DeviceError),
                                        (500, DeviceError)])
def test_client_reads_the_error_body(status, cls):
    body = json.dumps({"error": {"status": status, "code": "some_code",
                                 "message": "what went wrong"}}).encode()
    exc = response_error(status, body)
    assert type(exc) is cls
    assert str(exc) == f"what went wrong (HTTP {status})"
    assert exc.status == status and exc.code == "some_code"


def test_client_shows_a_body_that_is_not_the_error_shape():
    exc = response_error(502, b"Bad Gateway")
    assert type(exc) is DeviceError and str(exc) == "Bad Gateway (HTTP 502)"
    assert exc.code == "http_error"
