"""``sparkv device serve`` as a real process: SIGKILL crash recovery and the REST errors."""

from __future__ import annotations

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
                assert r["context_tokens"] > 0
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
                assert r["text"] is not None and r["context_tokens"] > before[cid]
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
        r = h.post(f"http://x/v1/contexts/{cid}/call",
                   json={"prompt": "hi", "max_new_tokens": -1})
    assert r.status_code == 422
    assert len(c.list()) == n                          # nothing half-made stays
