"""``sparkv device serve`` as a real process: SIGKILL crash recovery, the REST errors, and a
service private to its user (socket 0600, swap dir 0700, files 0600, loopback Host names only,
the bearer token over TCP, found by the clients)."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys

import httpx
import pytest

from sparkv.device import BudgetTooSmall, DeviceError, PromptTooLong, UnknownContext
from sparkv.device.client import DeviceClient, DeviceProcess
from sparkv.runtime.generate import sample_context_ids

TURNS = ["Remember the pass key 4417.", "What is the capital of France?", "What was the key?"]


@pytest.fixture(scope="module")
def lm(smollm2):
    return smollm2


# ---- a killed device serve reopens every returned context -----------------------------------------
def test_killed_device_serve_reopens_every_returned_context(lm, tmp_path):
    doc = sample_context_ids(lm, 200)
    swap = tmp_path / "swap"
    proc = DeviceProcess(swap, budget_mb=40, extra_args=["--chunk-tokens", "16"]).start()
    try:
        with proc.client() as c:
            ids = [c.new_context(system_ids=doc[i * 50:i * 50 + 60 + 10 * i]) for i in range(3)]
            ids.append(c.new_context("You are a terse assistant."))
            for i, cid in enumerate(ids):
                r = c.call(cid, TURNS[i % 2], max_new_tokens=6)
                assert r.stats["context_tokens"] > 0 and r.stats["new_tokens"] == len(r.tokens)
            _private(proc)
            before = {d["id"]: d["tokens"] for d in c.list()}
            c.delete(ids[3])                              # a deleted one stays deleted
            del before[ids[3]]
    finally:
        proc.kill()                                       # SIGKILL: no cleanup at all
    assert proc.proc.returncode == -9
    again = DeviceProcess(swap, budget_mb=40, extra_args=["--chunk-tokens", "16"]).start()
    try:
        with again.client() as c:
            after = {d["id"]: d["tokens"] for d in c.list()}
            assert after == before
            assert c.stats()["reopened"] == 3
            for cid in before:
                r = c.call(cid, TURNS[2], max_new_tokens=6)
                assert r.text is not None and r.stats["context_tokens"] > before[cid]
            assert c.stats()["read_chunks"] + c.stats()["recomputed_chunks"] > 0
            with pytest.raises(UnknownContext):
                c.call(ids[3], "hi")
            _rest_errors(c, again, next(iter(before)), sample_context_ids(lm, 1000))
    finally:
        again.stop()
    # a budget too small for even one context: serve refuses to start, with a clear message
    tiny = DeviceProcess(tmp_path / "t", budget_mb=0.5)
    with pytest.raises(DeviceError, match="cannot hold even one small context"):
        tiny.start()


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _private(proc: DeviceProcess) -> None:
    """The socket is 0600, the swap dir and its directories 0700, its files 0600, all this
    user's; a request naming another Host gets 421 even over the socket."""
    assert stat.S_ISSOCK(os.lstat(proc.socket).st_mode) and _mode(proc.socket) == 0o600
    assert _mode(proc.swap_dir) == 0o700
    files = [p for p in proc.swap_dir.rglob("*")
             if p.is_file() and p.name != proc.log_path.name and p != proc.socket]
    assert any(p.suffix == ".skvs" for p in files) and any(p.suffix == ".json" for p in files)
    for p in files:
        assert _mode(p) == 0o600 and os.stat(p).st_uid == os.geteuid(), p
    for p in proc.swap_dir.rglob("*"):
        if p.is_dir():
            assert _mode(p) == 0o700, p
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(proc.socket))) as h:
        r = h.get("http://evil.example/v1/contexts")
        assert r.status_code == 421 and r.json()["error"]["code"] == "misdirected_request"
        assert h.get("http://localhost/v1/contexts").status_code == 200


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tcp_serve_needs_the_token_its_clients_find(lm, tmp_path):
    """Over its port a request needs the token; the same service on its Unix socket as well
    (``--socket`` and ``--port`` at once) needs none: the socket's mode guards it."""
    sock = tmp_path / "run" / "device.sock"
    proc = DeviceProcess(tmp_path / "swap", budget_mb=40, port=_free_port(),
                         token_file=tmp_path / "conf" / "token",
                         extra_args=["--socket", str(sock), "--host-tier-mb", "8"]).start()
    try:
        assert _mode(proc.token_file) == 0o600
        token = proc.token_file.read_text().strip()
        with proc.client() as c:                                # reads the token file
            cid = c.new_context(system_ids=sample_context_ids(lm, 40))
            st = c.stats()                  # the host tier asked for, on the CPU (auto device)
            assert st["device"] == "cpu" and st["host_tier"]["capacity_bytes"] == 8_000_000
        with httpx.Client(base_url=proc.url) as h:
            r = h.get("/v1/contexts")
            assert r.status_code == 401 and r.json()["error"]["code"] == "missing_token"
            r = h.get("/v1/contexts", headers={"Authorization": "Bearer " + "x" * len(token)})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_token"
            r = h.get("/v1/contexts", headers={"Authorization": f"Bearer {token}",
                                               "Host": f"evil.example:{proc.port}"})
            assert r.status_code == 421
            r = h.get("/v1/contexts", headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 200 and r.json()["contexts"][0]["id"] == cid
        with pytest.raises(DeviceError) as e:
            with DeviceClient(url=proc.url, token_file=tmp_path / "none") as c:
                c.list()
        assert e.value.status == 401
        env = {**os.environ, "SPARKV_DEVICE_TOKEN_FILE": str(proc.token_file)}
        out = subprocess.run([sys.executable, "-m", "sparkv.cli", "device", "list", "--json",
                              "--url", proc.url], env=env, capture_output=True, timeout=300)
        assert out.returncode == 0, out.stderr.decode()
        assert [d["id"] for d in json.loads(out.stdout)] == [cid]
        _cli_on_the_socket(sock, tmp_path, cid)
    finally:
        proc.stop()


def _sparkv(*argv: str) -> str:
    out = subprocess.run([sys.executable, "-m", "sparkv.cli", *argv], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _cli_on_the_socket(sock, tmp_path, first: str) -> None:
    """``device create --system-file --label``, ``list`` (one line each: a long system prompt
    cut), ``describe`` (the whole prompt) through the socket, without a token."""
    with DeviceClient(sock) as c:
        assert [d["id"] for d in c.list()] == [first]
    prompt = "You are a careful assistant.\nAnswer in one short line, " + "always " * 30 + "."
    (tmp_path / "system.txt").write_text(prompt)
    cid = _sparkv("device", "create", "--system-file", str(tmp_path / "system.txt"),
                  "--label", "my notes", "--socket", str(sock)).strip()
    listed = _sparkv("device", "list", "--socket", str(sock)).splitlines()
    assert len(listed) == 4 and "always always" not in listed[0]     # header, rule, two rows
    row = next(line for line in listed if line.startswith(cid))
    assert "my notes" in row and "You are a careful assistant. Answer in one sh..." in row
    assert all(len(line) < 160 for line in listed)
    described = _sparkv("device", "describe", cid, "--socket", str(sock))
    assert f"id: {cid}\n" in described and "label: my notes\n" in described
    assert described.endswith(f"system_prompt:\n{prompt}\n")
    bad = subprocess.run([sys.executable, "-m", "sparkv.cli", "device", "create", "--label",
                          "a#b", "--socket", str(sock)], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and "is not a label" in bad.stderr


def _rest_errors(c: DeviceClient, proc: DeviceProcess, cid: str, doc: list[int]) -> None:
    """Bad input gets a clear 4xx (or 507 for a context the budget cannot hold)."""
    n = len(c.list())
    with pytest.raises(UnknownContext) as e:
        c.call("0123456789abcdef", "hi")
    assert e.value.status == 404
    with pytest.raises(PromptTooLong) as e:            # beyond the model's positions
        c.call(cid, prompt_ids=[1] * 9000, max_new_tokens=4)
    assert e.value.status == 413
    with pytest.raises(BudgetTooSmall) as e:           # one context above the budget
        c.new_context(system_ids=doc)
    assert e.value.status == 507
    with pytest.raises(DeviceError) as e:
        c.call(cid, max_new_tokens=4)                  # neither prompt nor ids
    assert e.value.status == 400
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(proc.socket))) as h:
        r = h.post(f"http://localhost/v1/contexts/{cid}/call",
                   json={"prompt": "hi", "max_new_tokens": -1})
    assert r.status_code == 422
    assert len(c.list()) == n                          # nothing half-made stays


# ---- a restart in another compute configuration recomputes the KV of the old one ------------------
def test_a_restart_with_another_dtype_recomputes_the_contexts_kv(tmp_path):
    """The journal names the compute configuration (--dtype) each context's KV was made in: a
    service restarted in another drops that KV (every chunk absent, none read from flash) and
    recomputes it at the next call, with a warning; a restart in the same one reopens it."""
    from tests.helpers import shared_tiny_checkpoint

    swap, model = tmp_path / "swap", str(shared_tiny_checkpoint())

    def serve(dtype: str, log: str) -> DeviceProcess:
        return DeviceProcess(swap, budget_mb=40, model=model, log_path=tmp_path / log,
                             extra_args=["--chunk-tokens", "16", "--dtype", dtype]).start()

    proc = serve("float32", "a.log")
    try:
        with proc.client() as c:
            cid = c.new_context(system_ids=list(range(300, 400)))
            c.call(cid, prompt_ids=list(range(500, 520)), max_new_tokens=4)
            held = c.describe(cid)["tokens"]
    finally:
        proc.stop()
    assert [p for p in (swap / "contexts" / cid).iterdir() if p.suffix in (".skvs", ".skvt")]
    record = json.loads((swap / "journal" / f"{cid}.json").read_text())
    assert record["compute"] == "float32"
    again = serve("bf16-weights", "b.log")
    try:
        with again.client() as c:
            assert [d["id"] for d in c.list()] == [cid] and c.damaged() == []
            chunks = c.describe(cid)["chunks"]
            assert chunks["resident"] == chunks["flash"] == 0 and chunks["absent"] > 0
            r = c.call(cid, prompt_ids=[9, 10], max_new_tokens=3, grow=False)
            assert len(r.tokens) == 3 and r.stats["context_tokens"] == held
            stats = c.stats()
            assert stats["read_chunks"] == 0 and stats["recomputed_chunks"] > 0
    finally:
        again.stop()
    assert (f"context {cid}: its KV was made in compute configuration float32, this service "
            "computes in bf16-weights") in again.log()
    assert json.loads((swap / "journal" / f"{cid}.json").read_text())["compute"] == "bf16-weights"
    third = serve("bf16-weights", "c.log")     # the same configuration: reopened as it is
    try:
        with third.client() as c:
            assert c.describe(cid)["chunks"]["flash"] > 0
    finally:
        third.stop()
    assert "its KV was made in compute configuration" not in third.log()
