"""Asks through the device service, every part real: ``sparkv serve`` processes holding the
contexts (the tiny random Llama with SmolLM2's tokenizer), ``sparkv device serve`` on its Unix
socket running the same model, the answers streamed over HTTP.

What is asserted: the answer streams token by token and ends with its breakdown; the loaded
context is kept and answers the next ask from memory; apps see only their own kept contexts
until they share them; concurrent asks get the tokens each gets alone; a full queue answers 429
with Retry-After; a client that goes away cancels its ask and its memory is freed; admission is
first come, first served under a steady stream; a server that dies mid-ask fails over only that
ask; a cancelled ask stops within one unit of compute (in process, counting its units); the
unchanged `openai` client asks through /v1/chat/completions, streamed and not, with usage, and a
conversation (instructions, an earlier turn) as an in-process session answers it, stop strings,
sampled answers (a seed repeats one, the token events are the tokens drawn), the Responses API
(the chat's answer, its events, JSON, function calls), the model list (an app's kept
contexts only, until shared), and text completions (the ask with chat off, echo, several prompts,
legacy logprobs, refusals); 40 asks
from 8 clients that go away at random leave none stuck or lost and no memory held."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from sparkv.device.client import DeviceProcess
from sparkv.device.errors import DeviceError, QueueFull, UnknownContext
from sparkv.device.schemas import DoneEvent
from sparkv.device.tails import MIN_REUSE
from sparkv.edge.client import EdgeClient
from sparkv.runtime.generate import sample_text
from helpers import shared_tiny_checkpoint, start_tiny_server, stop_checked

GUARD_S = 300.0          # hang guards only (never a timing assertion)
#: asks in the random-disconnect stress, over 8 clients (issue 45's full run:
#: SPARKV_STRESS_ASKS=1000; 40 in the suite)
STRESS_ASKS = max(8, int(os.environ.get("SPARKV_STRESS_ASKS", "40")) // 8 * 8)
TEXTS = {"a": sample_text()[:3000], "b": sample_text()[3000:6000], "c": sample_text()[6000:9000]}
LONG = dict(strategy="local", max_new_tokens=3000, stop_at_eos=False, keep=False)


def _until(cond, what: str, guard_s: float = GUARD_S) -> None:
    deadline = time.monotonic() + guard_s
    while not cond():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny server with three contexts, and a device service of the same model (2 slots, a
    queue of 2) on its socket."""
    tmp = tmp_path_factory.mktemp("asks")
    srv = start_tiny_server(tmp)
    key = srv.keys["alice"]
    client = EdgeClient(srv.url, key, timeout_s=120)
    ctx = {name: client.create_context(text=text, levels=["raw", "q5"], chunk_tokens=32)
           for name, text in TEXTS.items()}
    client.close()
    dev = DeviceProcess(tmp / "dev", 200, model=str(shared_tiny_checkpoint()),
                        extra_args=["--ask-slots", "2", "--ask-queue", "2"]).start()
    yield {"srv": srv, "key": key, "ctx": ctx, "dev": dev, "tmp": tmp}
    dev.stop()
    log = dev.log()
    stop_checked(srv)
    assert "Traceback" not in log, log[-4000:]


def _forged(token: str) -> str:
    """``token`` with its last character changed (never to itself: a MAC ending in the
    replacement would be the real token, a 1-in-16 flake)."""
    return token[:-1] + ("1" if token[-1] == "0" else "0")


def _openai(openai, dev, app: str):
    """The unchanged ``openai`` client asking the device service as ``app`` (on its socket),
    and the HTTP client under it."""
    http = httpx.Client(transport=httpx.HTTPTransport(uds=str(dev.socket)), timeout=GUARD_S)
    return openai.OpenAI(base_url="http://localhost/v1", api_key=dev.app_token(app),
                         http_client=http, max_retries=0), http


def _local(world) -> dict:
    """The ``sparkv`` fields of an exact, local, dense ask about the world's server."""
    return {"server": world["srv"].url, "api_key": world["key"], "strategy": "local",
            "stop_at_eos": False, "keep": False, "backend": "dense", "level": "raw"}


def _ask(world, c, name: str, question: str = "What is it about?", **fields):
    return c.ask(world["ctx"][name], question, server=world["srv"].url, api_key=world["key"],
                 **fields)


# ---- one ask: streamed, then kept -------------------------------------------------------------------
def test_an_ask_streams_its_tokens_then_its_breakdown_and_the_next_is_answered_from_memory(world):
    dev = world["dev"]
    streamed: list[dict] = []
    with dev.client() as c:
        first = _ask(world, c, "a", strategy="stream", level="raw", max_new_tokens=12,
                     stop_at_eos=False, on_token=streamed.append)
        assert [e["token"] for e in streamed] == first.tokens and len(first.tokens) == 12
        assert "".join(e["text"] for e in streamed) == first.text
        bd = first.stats
        assert bd["new_tokens"] == 12 and bd["context_tokens"] > 0
        assert bd["strategy"] == "stream" and bd["ttft_s"] > 0 and bd["bytes_streamed"] > 0
        assert bd["chunks_streamed"] > 0 and bd["levels"] == {"raw": bd["chunks_streamed"]}
        assert bd["fallback"] == {} and first.first_token_s > 0
        kept = first.kept_id
        assert kept and c.describe(kept)["owner"] == "user"
        carried = c.ask_stats()["link_bytes"]
        again = _ask(world, c, "a", strategy="stream", level="raw", max_new_tokens=12,
                     stop_at_eos=False)
        assert again.stats["strategy"] == "kept" and again.kept_id == kept
        assert again.stats["bytes_streamed"] == 0
        assert c.ask_stats()["link_bytes"] == carried          # 0 bytes crossed the link
    # the CLI: the answer printed as it streams, the done event with --json
    out = subprocess.run([sys.executable, "-m", "sparkv.cli", "device", "ask", "--socket",
                          str(dev.socket), "--server", world["srv"].url, "--context",
                          world["ctx"]["a"], "--max-new-tokens", "12", "--json",
                          "What is it about?"], capture_output=True, text=True, timeout=GUARD_S,
                         env={**os.environ, "SPARKV_API_KEY": world["key"]})
    assert out.returncode == 0, out.stderr
    done = json.loads(out.stdout)
    assert done["type"] == "done" and done["kept_id"] == kept
    assert done["text"] and done["stats"]["new_tokens"] == len(done["tokens"]) == 12
    assert "answer" not in done and "breakdown" not in done


# ---- apps ------------------------------------------------------------------------------------------
def test_an_app_cannot_read_call_or_delete_another_apps_kept_context_until_shared(world):
    dev = world["dev"]
    with dev.client(app="notes") as a, dev.client(app="mail") as b, dev.client() as user:
        mine = _ask(world, a, "b", max_new_tokens=4)
        kept = mine.kept_id
        assert kept and a.describe(kept)["owner"] == "app:notes"
        for peer in (b, user):
            with pytest.raises(UnknownContext):
                peer.describe(kept)
            with pytest.raises(UnknownContext):
                peer.call(kept, "hi", max_new_tokens=2, grow=False)
            with pytest.raises(UnknownContext):
                peer.delete(kept)
            assert kept not in {x["id"] for x in peer.list()}
        theirs = _ask(world, b, "b", max_new_tokens=4)       # mail loads its own copy
        assert theirs.stats["strategy"] != "kept" and theirs.kept_id != kept
        a.share(kept, ["app:mail"])
        assert b.describe(kept)["shared_with"] == ["app:mail"]
        assert b.call(kept, "hi", max_new_tokens=2, grow=False).context_id == kept
        with pytest.raises(Exception) as err:                 # shared is not owned
            b.delete(kept)
        assert getattr(err.value, "status", None) == 403
        b.delete(theirs.kept_id)                           # its own copy it may delete
        follow = _ask(world, b, "b", max_new_tokens=4)        # now answered from notes' copy
        assert follow.stats["strategy"] == "kept" and follow.kept_id == kept
        # an unknown or forged token is refused on the socket too
        r = httpx.Client(transport=httpx.HTTPTransport(uds=str(dev.socket)),
                         base_url="http://localhost").get(
            "/v1/asks", headers={"Authorization": "Bearer " + _forged(dev.app_token("notes"))})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_token"


# ---- concurrency -----------------------------------------------------------------------------------
def test_concurrent_asks_each_get_the_tokens_they_get_alone(world):
    dev = world["dev"]
    jobs = [("a", "stream", "What is it about?"), ("b", "local", "Who wrote it?"),
            ("c", "sparkv", "Summarize it."), ("a", "hybrid", "Name one thing in it.")]
    with dev.client() as c:
        alone = [_ask(world, c, n, q, strategy=s, max_new_tokens=10, stop_at_eos=False,
                      keep=False, backend="dense", level="raw").tokens for n, s, q in jobs]
    together: list = [None] * len(jobs)

    def run(i: int) -> None:
        n, s, q = jobs[i]
        with dev.client() as ci:
            together[i] = _ask(world, ci, n, q, strategy=s, max_new_tokens=10,
                               stop_at_eos=False, keep=False, backend="dense", level="raw")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(GUARD_S)
    assert [r.tokens for r in together] == alone
    assert max(r.started for r in together) > 2            # 2 slots: some waited


def test_concurrent_sparkv_asks_on_the_link_plan_get_the_tokens_they_get_alone(world):
    """SparKV asks at once are planned on the one link (the default ``oldest`` link plan: each
    streams on its turn, its controller computing what waiting would delay): each still gets
    exactly the tokens it gets alone, and every seat leaves the plan with its ask."""
    dev = world["dev"]
    jobs = [("a", "Who wrote it?"), ("b", "Summarize it."), ("c", "What is it about?")]
    fields = dict(strategy="sparkv", max_new_tokens=10, stop_at_eos=False, keep=False,
                  backend="dense", level="raw")
    with dev.client() as c:
        alone = [_ask(world, c, n, q, **fields).tokens for n, q in jobs]
    together: list = [None] * len(jobs)

    def run(i: int) -> None:
        with dev.client() as ci:
            together[i] = _ask(world, ci, jobs[i][0], jobs[i][1], **fields)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(GUARD_S)
    assert [r.tokens for r in together] == alone
    with dev.client() as c:
        plan = c.ask_stats()["link_plan"]
    assert plan["policy"] == "oldest" and plan["asks"] == 0 and plan["pending_bytes"] == 0


def test_a_full_queue_answers_429_and_a_client_that_leaves_cancels_its_ask(world):
    dev = world["dev"]
    with dev.client() as c:
        before = c.ask_stats()
    streams, first_events = [], []
    clients = [dev.client() for _ in range(4)]
    try:
        for cl in clients:                                    # 2 running + 2 waiting
            it = cl.ask_events(world["ctx"]["c"], "Go on.", server=world["srv"].url,
                               api_key=world["key"], **LONG)
            first_events.append(next(it))
            streams.append(it)
        assert [e["type"] for e in first_events[2:]] == ["queued", "queued"]
        with dev.client() as c:
            with pytest.raises(QueueFull) as err:
                _ask(world, c, "c", **LONG)
            assert err.value.status == 429 and err.value.retry_after_s >= 1
            r = httpx.Client(transport=httpx.HTTPTransport(uds=str(dev.socket)),
                             base_url="http://localhost").post(
                "/v1/asks", json={"context_id": world["ctx"]["c"], "question": "x",
                                  "server": world["srv"].url, "api_key": world["key"]})
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["code"] == "queue_full"
            _until(lambda: c.ask_stats()["cores"]["held_memories"] >= 1, "a running ask's KV")
    finally:
        for it in streams:
            it.close()                                        # the clients go away
        for cl in clients:
            cl.close()
    with dev.client() as c:
        _until(lambda: c.ask_stats()["running"] == 0, "every ask ended")
        stats = c.ask_stats()
        assert stats["waiting"] == 0 and stats["cancelled"] - before["cancelled"] == 4
        assert stats["refused"] - before["refused"] == 2 and stats["done"] == before["done"]
        _until(lambda: c.ask_stats()["cores"]["held_memories"] == 0, "their memory freed")
        assert c.ask_stats()["cores"]["held_bytes"] == 0


def test_no_ask_starves_admission_is_first_come_first_served(world):
    dev = world["dev"]
    stop = threading.Event()
    submitted: list[tuple[float, DoneEvent]] = []

    def steady() -> None:                                     # asks back to back, all along
        with dev.client() as cs:
            while not stop.is_set():
                t = time.monotonic()
                try:
                    done = _ask(world, cs, "b", max_new_tokens=30, stop_at_eos=False,
                                keep=False, strategy="local")
                except QueueFull:
                    continue
                submitted.append((t, done))

    streams = [threading.Thread(target=steady) for _ in range(3)]
    for th in streams:
        th.start()
    try:
        _until(lambda: len(submitted) >= 2, "the stream flows")
        t_mine = time.monotonic()
        with dev.client() as c:
            while True:
                try:
                    mine = _ask(world, c, "c", max_new_tokens=30, stop_at_eos=False,
                                keep=False, strategy="local")
                    break
                except QueueFull:
                    t_mine = time.monotonic()
    finally:
        stop.set()
        for th in streams:
            th.join(GUARD_S)
    later = [d.started for t, d in submitted if t > t_mine + 0.5]
    assert mine.started < min(later, default=mine.started + 1)


def test_a_server_that_dies_mid_ask_fails_over_only_that_ask(world, tmp_path):
    """Two servers, one shaped link of 8 Mbit/s; the one server dies while both asks stream."""
    import random

    other = start_tiny_server(tmp_path, tenants=("alice",))
    rng = random.Random(0)
    ids = [rng.randrange(200, 40000) for _ in range(3000)]
    dev = DeviceProcess(tmp_path / "dev", 200, model=str(shared_tiny_checkpoint()),
                        extra_args=["--link-mbps", "8", "--link-rtt-ms", "5"]).start()
    try:
        cids = {}
        for name, s in (("dies", other), ("lives", world["srv"])):
            with EdgeClient(s.url, s.keys["alice"], timeout_s=120) as ec:
                cids[name] = ec.create_context(token_ids=ids, levels=["raw"], chunk_tokens=32)
        with dev.client() as c:
            alone = c.ask(cids["lives"], "What?", server=world["srv"].url, api_key=world["key"],
                          strategy="local", max_new_tokens=8, stop_at_eos=False, keep=False,
                          backend="dense").tokens
        out: dict = {}

        def run(name: str, s) -> None:
            with dev.client() as ci:
                out[name] = ci.ask(cids[name], "What?", server=s.url, api_key=s.keys["alice"],
                                   strategy="stream", level="raw", max_new_tokens=8,
                                   stop_at_eos=False, keep=False, backend="dense")

        threads = [threading.Thread(target=run, args=("dies", other)),
                   threading.Thread(target=run, args=("lives", world["srv"]))]
        for th in threads:
            th.start()
        with dev.client() as c:
            _until(lambda: c.ask_stats()["link_bytes"] > 400_000, "both asks stream")
        other.kill()                                           # SIGKILL mid-ask
        for th in threads:
            th.join(GUARD_S)
        assert out["dies"].stats["fallback"] and out["dies"].stats["chunks_computed"] > 0
        assert out["lives"].stats["fallback"] == {}
        assert out["lives"].stats["chunks_computed"] == 0
        assert out["dies"].tokens == alone == out["lives"].tokens
    finally:
        dev.stop()
        other.stop()
    assert "Traceback" not in dev.log(), dev.log()[-3000:]


# ---- in process: a cancelled ask stops within one unit and frees its memory -----------------------
def test_a_cancelled_ask_stops_within_one_unit_and_frees_its_memory(world, tmp_path):
    from sparkv.asks import AskRequest, AskService
    from sparkv.device import ContextService
    from sparkv.device.owners import ContextOwners
    from sparkv.edge.options import AskOptions
    from sparkv.runtime.model import load_model

    lm = load_model(str(shared_tiny_checkpoint()), progress=False)
    svc = ContextService(lm, 200_000_000, tmp_path / "svc")
    asks = AskService(svc, ContextOwners(), slots=2, queue=2)
    try:
        for phase in ("answer", "load"):
            opts = AskOptions(strategy="local", max_new_tokens=3000, stop_at_eos=False,
                              keep=False, backend="dense")
            ticket = asks.submit("user", AskRequest(world["srv"].url, world["ctx"]["c"],
                                                    "Go on.", world["key"], opts))
            if phase == "answer":
                seen = 0
                for event in ticket.events(timeout_s=GUARD_S):
                    seen += event["type"] == "token"
                    if seen == 3:
                        break
            else:
                _until(lambda: ticket.lane is not None and ticket.lane.units >= 2, "loading")
            lane = ticket.lane
            ticket.cancel()
            at_cancel = lane.units + lane.holding
            # the answer may have run ahead of this reader before the cancel (a loaded machine):
            # what counts is what it makes after it
            tokens_at_cancel = len(ticket.streamed)
            outcome = ticket.wait(GUARD_S)
            assert outcome["type"] == "error" and outcome["error"]["status"] == 499
            assert lane.units <= at_cancel + 1, (phase, lane.units, at_cancel)
            if phase == "answer":
                assert len(ticket.streamed) <= tokens_at_cancel + 2
            assert asks.wait_idle(GUARD_S)
            assert asks.gate.held() == (0, 0), phase          # freed by the service itself
        assert asks.stats()["cancelled"] == 2 and asks.stats()["running"] == 0
    finally:
        asks.close()
        svc.close()


def test_a_warmed_service_makes_no_step_cost_model_or_client_inside_its_first_ask(
        world, tmp_path, monkeypatch):
    """``AskService.warm`` (the service's start) makes the edge's step-cost model and the default
    server's client; the first ask, on its own thread, finds both made and measures nothing
    inside its time to the first token. A default server no client can address is said then,
    not in every ask."""
    from sparkv.asks import AskRequest, AskService
    from sparkv.asks.service import BadServerUrl
    from sparkv.device import ContextService
    from sparkv.device.owners import ContextOwners
    from sparkv.edge import planning
    from sparkv.edge.options import AskOptions
    from sparkv.runtime.model import load_model

    made: list[str] = []
    load = planning._load_cost_model
    monkeypatch.setattr(planning, "_COST_MODELS", {})
    monkeypatch.setattr(planning, "_load_cost_model",
                        lambda lm: made.append(threading.current_thread().name) or load(lm))
    lm = load_model(str(shared_tiny_checkpoint()), progress=False)
    svc = ContextService(lm, 200_000_000, tmp_path / "svc")
    asks = AskService(svc, ContextOwners(), slots=1, queue=1,
                      default_server=world["srv"].url + "/", default_api_key=world["key"])
    try:
        assert asks.warm() > 0 and made == [threading.current_thread().name]
        assert "token_bytes" in lm.extra               # a JSON answer's vocabulary, made
        clients = dict(asks._clients)
        assert list(clients) == [(world["srv"].url, world["key"])]
        opts = AskOptions(strategy="sparkv", max_new_tokens=2, keep=False)
        done = asks.ask("user", AskRequest(world["srv"].url, world["ctx"]["a"], "What is it?",
                                           world["key"], opts), GUARD_S)
        assert done["type"] == "done" and len(made) == 1, (done, made)
        assert asks._clients == clients           # the ask took the warmed client
        bad = AskService(svc, ContextOwners(), slots=1, queue=1,
                         default_server="http://xn--a.com:80")
        with pytest.raises(BadServerUrl, match="not a server URL"):
            bad.warm()
        bad.close()
    finally:
        asks.close()
        svc.close()


def test_every_ask_computes_on_the_services_threads_whatever_a_decoder_set_last(
        world, tmp_path, monkeypatch):
    """An ask's thread computes with the service's thread count, even after another thread set
    the process-wide count to 1 (an engine's frame decoders do, at their start): a new thread's
    count is that value at its first kernel, and every ask after the first streaming one ran on
    one thread."""
    import torch

    from sparkv.asks import AskRequest, AskService
    from sparkv.device import ContextService
    from sparkv.device.owners import ContextOwners
    from sparkv.edge.options import AskOptions
    from sparkv.runtime import batchdecode
    from sparkv.runtime.model import load_model
    from sparkv.runtime.threads import use_threads

    seen: list[int] = []
    together = batchdecode.decode_together
    monkeypatch.setattr(batchdecode, "decode_together",
                        lambda lm, items: seen.append(torch.get_num_threads())
                        or together(lm, items))
    lm = load_model(str(shared_tiny_checkpoint()), progress=False)
    svc = ContextService(lm, 200_000_000, tmp_path / "svc")
    before = torch.get_num_threads()
    svc.threads = 2                                  # the service's count
    asks = AskService(svc, ContextOwners(), slots=1, queue=1)
    try:
        decoder = threading.Thread(target=use_threads, args=(1,))    # as a frame decoder does
        decoder.start()
        decoder.join()
        opts = AskOptions(strategy="local", max_new_tokens=3, stop_at_eos=False, keep=False)
        done = asks.ask("user", AskRequest(world["srv"].url, world["ctx"]["a"], "What is it?",
                                           world["key"], opts), GUARD_S)
        assert done["type"] == "done" and seen and set(seen) == {2}, (done, seen)
    finally:
        asks.close()
        svc.close()
        torch.set_num_threads(before)


# ---- OpenAI-compatible: the unchanged openai package against the running service ------------------
def test_the_openai_client_asks_through_chat_completions_streamed_and_not(world):
    openai = pytest.importorskip("openai")
    dev = world["dev"]
    oa, http = _openai(openai, dev, "chat")
    sparkv = _local(world)
    cid, question = world["ctx"]["a"], "What is it about?"
    with dev.client() as c:
        alone = _ask(world, c, "a", question, max_new_tokens=8, **{k: v for k, v in sparkv.items()
                                                                   if k not in ("server", "api_key")})
    try:
        r = oa.chat.completions.create(model=cid, max_tokens=8, extra_body={"sparkv": sparkv},
                                       messages=[{"role": "user", "content": question}])
        assert r.object == "chat.completion" and r.choices[0].finish_reason == "length"
        assert r.choices[0].message.content == alone.text
        assert r.usage.completion_tokens == 8
        assert r.usage.prompt_tokens > alone.stats["context_tokens"]   # + the question
        assert r.usage.total_tokens == r.usage.prompt_tokens + 8
        chunks = list(oa.chat.completions.create(
            model=cid, max_tokens=8, stream=True, stream_options={"include_usage": True},
            extra_body={"sparkv": sparkv}, messages=[{"role": "user", "content": question}]))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text == alone.text
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == 8
        assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
        assert chunks[-1].model_extra["sparkv"]["stats"]["strategy"] == "local"
        # a stop string (the tiny random model answers newlines): the answer ends at it and
        # its text before it, streamed or not
        assert alone.text.startswith("\n\n")
        kw = dict(model=cid, max_tokens=8, stop=["\n\n", "never"], extra_body={"sparkv": sparkv},
                  messages=[{"role": "user", "content": question}])
        cut = oa.chat.completions.create(**kw)
        assert cut.choices[0].message.content == "" and cut.choices[0].finish_reason == "stop"
        assert 0 < cut.usage.completion_tokens <= 2
        chunks = list(oa.chat.completions.create(stream=True, **kw))
        assert not any(ch.choices[0].delta.content for ch in chunks if ch.choices)
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
        # what stock clients send at their no-op values is taken
        noop = oa.chat.completions.create(
            model=cid, max_tokens=8, messages=[{"role": "user", "content": question}],
            frequency_penalty=0, presence_penalty=0, logprobs=False, temperature=0, top_p=1,
            response_format={"type": "text"}, store=False, extra_body={"sparkv": sparkv})
        assert noop.choices[0].message.content == alone.text
        with pytest.raises(openai.UnprocessableEntityError, match="needs tools"):
            oa.chat.completions.create(model=cid, messages=[{"role": "user", "content": "q"}],
                                       tool_choice="required", extra_body={"sparkv": sparkv})
        with pytest.raises(openai.NotFoundError):                     # no such context
            oa.chat.completions.create(model="not-a-context", extra_body={"sparkv": sparkv},
                                       messages=[{"role": "user", "content": question}])
        with pytest.raises(openai.BadRequestError, match="last message must be the user's"):
            oa.chat.completions.create(model=cid, extra_body={"sparkv": sparkv}, messages=[
                {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
        with pytest.raises(openai.BadRequestError, match="unknown attention backend"):
            oa.chat.completions.create(model=cid, messages=[{"role": "user", "content": question}],
                                       extra_body={"sparkv": {**sparkv, "backend": "4y"}})
        paths = http.get("http://localhost/openapi.json").json()["paths"]   # the schema says it
        assert {"/v1/asks", "/v1/chat/completions", "/v1/contexts/{ctx_id}/share"} <= set(paths)
        assert {"429", "503"} <= set(paths["/v1/asks"]["post"]["responses"])
    finally:
        oa.close()


def test_a_sampled_answer_repeats_with_its_seed_and_streams_the_tokens_it_drew(world):
    """``temperature`` samples: one seed gives one answer (streamed or not, and from the
    service's memory as from a load), another seed another; without a seed the ask draws one and
    reports it, and asking again with it gives the same answer; the token events are the tokens
    drawn."""
    openai = pytest.importorskip("openai")
    dev = world["dev"]
    oa, http = _openai(openai, dev, "sampler")
    opts = {"strategy": "local", "stop_at_eos": False, "backend": "dense", "level": "raw"}
    sparkv = {"server": world["srv"].url, "api_key": world["key"], "keep": False, **opts}
    cid, question = world["ctx"]["c"], "What is it about?"

    def chat(**kw):
        r = oa.chat.completions.create(model=cid, max_tokens=10, extra_body={"sparkv": sparkv},
                                       messages=[{"role": "user", "content": question}], **kw)
        return r.choices[0].message.content, r.model_extra["sparkv"]["stats"]

    try:
        greedy, st = chat()
        assert "seed" not in st or st["seed"] is None
        eleven, st = chat(temperature=1.0, seed=11)
        assert st["seed"] == 11 and eleven != greedy
        assert chat(temperature=1.0, seed=11)[0] == eleven
        assert chat(temperature=1.0, seed=12)[0] != eleven
        chunks = oa.chat.completions.create(model=cid, max_tokens=10, stream=True, seed=11,
                                            temperature=1.0, extra_body={"sparkv": sparkv},
                                            messages=[{"role": "user", "content": question}])
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == eleven
        drawn, st = chat(temperature=1.0)
        assert isinstance(st["seed"], int) and chat(temperature=1.0, seed=st["seed"])[0] == drawn
        with pytest.raises(openai.UnprocessableEntityError, match="temperature"):
            chat(temperature=2.5)
        with pytest.raises(openai.BadRequestError, match="logit_bias"):
            chat(logit_bias={"999999999": 5})
        with pytest.raises(openai.UnprocessableEntityError, match="presence_penalty"):
            chat(presence_penalty=2.5)
    finally:
        oa.close()
    with dev.client() as c:         # POST /v1/asks, kept: a load, then from memory
        for strategy in ("local", "kept"):
            streamed: list[dict] = []
            done = _ask(world, c, "c", question, max_new_tokens=10, temperature=1.3, top_k=40,
                        seed=5, on_token=streamed.append, **{**opts, "stop_at_eos": False})
            assert done.stats["strategy"] == strategy and done.stats["seed"] == 5
            assert [e["token"] for e in streamed] == done.tokens and len(done.tokens) == 10
            assert "".join(e["text"] for e in streamed) == done.text
        # a bias and penalties adjust the logits, greedy or not: a bias of 100 makes every
        # token that one; a penalty stops the greedy answer repeating its first token
        kw = dict(max_new_tokens=8, keep=False, **{**opts, "stop_at_eos": False})
        greedy = _ask(world, c, "c", question, **kw)
        assert _ask(world, c, "c", question, logit_bias={"42": 100}, **kw).tokens == [42] * 8
        first = greedy.tokens[0]
        assert greedy.tokens.count(first) > 1           # the tiny model repeats itself
        fresh = _ask(world, c, "c", question, frequency_penalty=2.0, presence_penalty=2.0,
                     logit_bias={str(first): 5}, **kw)
        assert fresh.tokens[0] == first and fresh.tokens.count(first) < greedy.tokens.count(first)


def test_n_choices_are_sampled_each_with_its_own_seed_and_greedy_ones_computed_once(world):
    """``n``: sampled, choice i is the answer of seed + i (streamed or not, its chunks under its
    index); greedy, every choice is the one answer, asked once; usage counts every choice."""
    openai = pytest.importorskip("openai")
    dev = world["dev"]
    oa, http = _openai(openai, dev, "chooser")
    opts = {"strategy": "local", "stop_at_eos": False, "backend": "dense", "level": "raw",
            "keep": False}
    kw = dict(model=world["ctx"]["a"], max_tokens=6,
              messages=[{"role": "user", "content": "What is it about?"}],
              extra_body={"sparkv": {"server": world["srv"].url, "api_key": world["key"],
                                     **opts}})
    try:
        r = oa.chat.completions.create(n=3, temperature=1.0, seed=40, **kw)
        texts = [ch.message.content for ch in r.choices]
        assert [ch.index for ch in r.choices] == [0, 1, 2] and len(set(texts)) > 1
        assert r.usage.completion_tokens == 18
        per = r.model_extra["sparkv"]["choices"]
        assert [p["stats"]["seed"] for p in per] == [40, 41, 42]
        one = oa.chat.completions.create(temperature=1.0, seed=41, **kw)
        assert one.choices[0].message.content == texts[1]
        chunks = list(oa.chat.completions.create(n=3, temperature=1.0, seed=40, stream=True,
                                                 stream_options={"include_usage": True}, **kw))
        got = ["", "", ""]
        for ch in chunks:
            for c in ch.choices:
                got[c.index] += c.delta.content or ""
        assert got == texts and chunks[-1].usage.completion_tokens == 18
        finished = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason]
        assert finished == ["length"] * 3
        greedy = oa.chat.completions.create(n=2, **kw)
        assert greedy.choices[0].message.content == greedy.choices[1].message.content
        assert "choices" not in greedy.model_extra["sparkv"]             # one ask
        assert greedy.usage.completion_tokens == 12
        with pytest.raises(openai.UnprocessableEntityError, match="body.n"):
            oa.chat.completions.create(n=9, **kw)
    finally:
        oa.close()


def test_logprobs_come_with_each_token_streamed_or_not_and_on_the_asks_token_events(world):
    """``logprobs``/``top_logprobs``: each answer token with its log-probability and the most
    likely alternatives (greedy: the token is the first of them); the same streamed; POST
    /v1/asks's token events carry them; ``top_logprobs`` alone is refused."""
    openai = pytest.importorskip("openai")
    dev = world["dev"]
    oa, http = _openai(openai, dev, "prober")
    opts = {"strategy": "local", "stop_at_eos": False, "backend": "dense", "level": "raw",
            "keep": False}
    kw = dict(model=world["ctx"]["c"], max_tokens=6, logprobs=True, top_logprobs=3,
              messages=[{"role": "user", "content": "What is it about?"}],
              extra_body={"sparkv": {"server": world["srv"].url, "api_key": world["key"],
                                     **opts}})
    try:
        r = oa.chat.completions.create(**kw)
        content = r.choices[0].logprobs.content
        assert len(content) == r.usage.completion_tokens == 6
        for t in content:
            alts = [a.logprob for a in t.top_logprobs]
            assert len(alts) == 3 and alts == sorted(alts, reverse=True) and alts[0] <= 0
            assert t.token == t.top_logprobs[0].token and t.logprob == alts[0]   # greedy
            assert bytes(t.bytes).decode() == t.token
        chunks = list(oa.chat.completions.create(stream=True, **kw))
        streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs
                    for t in ch.choices[0].logprobs.content]
        assert [t.token for t in streamed] == [t.token for t in content]
        assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content],
                                                              abs=1e-4)
        plain = oa.chat.completions.create(**{**kw, "logprobs": None, "top_logprobs": None})
        assert plain.choices[0].logprobs is None
        with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
            oa.chat.completions.create(**{**kw, "logprobs": None})
        with pytest.raises(openai.UnprocessableEntityError, match="top_logprobs"):
            oa.chat.completions.create(**{**kw, "top_logprobs": 21})
    finally:
        oa.close()
    events: list[dict] = []
    with dev.client() as c:
        done = _ask(world, c, "c", max_new_tokens=4, logprobs=2, on_token=events.append, **opts)
    assert [e["token"] for e in events] == done.tokens
    assert all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0 for e in events)
    assert [e["token"] for e in events] == [e["top_logprobs"][0]["token"] for e in events]


#: a schema whose values are short whatever the model (the tiny random one here): booleans,
#: an enum, null
CHOICE = {"type": "object", "additionalProperties": False, "required": ["ok", "pick"],
          "properties": {"ok": {"type": "boolean"}, "pick": {"enum": ["red", "green", 7]},
                         "none": {"type": "null"}}}


def _pick_model() -> type:
    """A pydantic model whose values are short whatever the model: what an app hands the
    ``openai`` client's ``parse()``."""
    import enum
    from typing import Annotated, Literal, Optional

    from pydantic import BaseModel, Field

    class Color(str, enum.Enum):
        red = "red"
        green = "green"

    class Inner(BaseModel):
        flag: bool
        note: Optional[None]

    class Pick(BaseModel):
        ok: bool
        color: Color
        kind: Literal["a", "b"]
        inner: Inner
        flags: Annotated[list[Inner], Field(max_length=2)]      # maxItems: a short list

    return Pick


def test_the_openai_client_gets_json_of_the_schema_it_asks_for(world):
    """response_format json_schema and json_object: the answer is JSON of the form, streamed or
    not, sampled or greedy, and ends when the value is whole; a schema the service cannot
    enforce is a 422 naming what it does not take. POST /v1/asks and a kept context's call
    take the same field."""
    openai = pytest.importorskip("openai")
    rs = pytest.importorskip("jsonschema_rs")
    dev = world["dev"]
    oa, _ = _openai(openai, dev, "json")
    sparkv = {"server": world["srv"].url, "api_key": world["key"], "strategy": "local",
              "keep": True, "backend": "dense", "level": "raw"}
    fmt = {"type": "json_schema", "json_schema": {"name": "choice", "schema": CHOICE,
                                                  "strict": True}}
    kw = dict(model=world["ctx"]["b"], max_tokens=400, extra_body={"sparkv": sparkv},
              messages=[{"role": "user", "content": "Answer in JSON."}])
    try:
        r = oa.chat.completions.create(response_format=fmt, **kw)
        assert r.choices[0].finish_reason == "stop"
        value = json.loads(r.choices[0].message.content)
        assert rs.is_valid(CHOICE, value) and list(value) == ["ok", "pick", "none"]
        chunks = list(oa.chat.completions.create(response_format=fmt, stream=True, **kw))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks
                       if ch.choices) == r.choices[0].message.content
        for seed in (1, 2):
            drawn = oa.chat.completions.create(response_format=fmt, temperature=1.0, seed=seed,
                                               **kw)
            assert rs.is_valid(CHOICE, json.loads(drawn.choices[0].message.content))
        obj = oa.chat.completions.create(response_format={"type": "json_object"},
                                         **{**kw, "max_tokens": 24})
        text = obj.choices[0].message.content
        assert text.lstrip().startswith("{")
        if obj.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
        # the client's parse(): a pydantic model's schema ($defs, $refs, an enum, Optional)
        parsed = oa.chat.completions.parse(response_format=_pick_model(), **kw)
        assert parsed.choices[0].finish_reason == "stop"
        pick = parsed.choices[0].message.parsed
        assert pick.color.value in ("red", "green") and pick.inner.note is None
        for bad, says in [({"type": "string"}, "top level must be an object"),
                          ({"type": "object", "properties": {"a": {"type": "string",
                                                                   "format": "email"}}},
                           "format 'email' is not supported")]:
            with pytest.raises(openai.UnprocessableEntityError, match=says):
                oa.chat.completions.create(response_format={
                    "type": "json_schema", "json_schema": {"name": "x", "schema": bad}}, **kw)
    finally:
        oa.close()
    with dev.client() as c:
        done = _ask(world, c, "b", "Answer in JSON.", max_new_tokens=400,
                    response_format=fmt, strategy="local", backend="dense", level="raw")
        assert rs.is_valid(CHOICE, json.loads(done.text))
        called = c.call(done.kept_id, "And again?", 400, grow=False, response_format=fmt)
        assert rs.is_valid(CHOICE, json.loads(called.text))
    # the CLI: --json-schema FILE, and --logit-bias banning the greedy answer's first token
    schema = world["tmp"] / "choice.json"
    schema.write_text(json.dumps(CHOICE))

    def cli(*flags: str) -> dict:
        out = subprocess.run([sys.executable, "-m", "sparkv.cli", "device", "ask", "--socket",
                              str(dev.socket), "--server", world["srv"].url, "--context",
                              world["ctx"]["b"], "--max-new-tokens", "400", "--json", *flags,
                              "Answer in JSON."], capture_output=True, text=True,
                             timeout=GUARD_S, env={**os.environ, "SPARKV_API_KEY": world["key"]})
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    got = cli("--json-schema", str(schema))
    assert rs.is_valid(CHOICE, json.loads(got["text"]))
    banned = cli("--json-schema", str(schema), "--logit-bias", f"{got['tokens'][0]}=-100")
    assert banned["tokens"][0] != got["tokens"][0]
    assert rs.is_valid(CHOICE, json.loads(banned["text"]))


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                           "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                           "parameters": WEATHER, "strict": True}},
         {"type": "function", "function": {"name": "note", "description": "Notes a text",
                                           "parameters": {"type": "object", "properties": {
                                               "text": {"type": "string", "maxLength": 8}}}}}]


def _weather_model() -> type:
    from typing import Literal

    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        city: str = Field(max_length=16)
        unit: Literal["C", "F"]

    return Weather


def test_the_openai_client_calls_tools_and_is_answered_after_their_results(world):
    """tools with tool_choice required or named: the answer is whole calls whose arguments
    their schemas take, streamed or not (streamed: named first, then the arguments as the
    model writes them), greedy or sampled; the calls and the tools' results go
    back as messages and the next answer is text; what cannot be is a 4xx naming it."""
    openai = pytest.importorskip("openai")
    rs = pytest.importorskip("jsonschema_rs")
    oa, _ = _openai(openai, world["dev"], "tools")
    sparkv = {"server": world["srv"].url, "api_key": world["key"], "strategy": "local",
              "keep": True, "backend": "dense", "level": "raw"}
    question = [{"role": "user", "content": "What is the weather in Oslo?"}]
    kw = dict(model=world["ctx"]["b"], max_tokens=400, extra_body={"sparkv": sparkv},
              tools=TOOLS, parallel_tool_calls=False)     # one call: its length is bounded
    schemas = {"get_weather": WEATHER, "note": TOOLS[1]["function"]["parameters"]}

    def valid(calls) -> None:
        assert calls
        for call in calls:
            assert call.type == "function" and call.id.startswith("call_")
            assert rs.is_valid(schemas[call.function.name], json.loads(call.function.arguments))

    try:
        r = oa.chat.completions.create(messages=question, tool_choice="required", **kw)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        valid(choice.message.tool_calls)
        named = oa.chat.completions.create(messages=question,
                                           tool_choice={"type": "function",
                                                        "function": {"name": "get_weather"}},
                                           **kw)
        calls = named.choices[0].message.tool_calls
        valid(calls)
        assert [c.function.name for c in calls] == ["get_weather"]
        chunks = list(oa.chat.completions.create(messages=question, stream=True,
                                                 tool_choice="required", **kw))
        deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
        assert not any(d.content for d in deltas)
        pieces = [tc for d in deltas for tc in d.tool_calls or []]
        streamed: dict[int, list[str]] = {}         # the client's accumulation, by index
        for tc in pieces:
            if tc.id is not None:
                assert tc.index not in streamed and tc.type == "function"
                streamed[tc.index] = [tc.id, tc.function.name, ""]
            streamed[tc.index][2] += tc.function.arguments or ""
        assert [tuple(streamed[k][1:]) for k in sorted(streamed)] == [
            (t.function.name, t.function.arguments) for t in choice.message.tool_calls]
        assert len(pieces) > len(streamed)          # the arguments came as the model wrote
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
        drawn = oa.chat.completions.create(messages=question, tool_choice="required", n=2,
                                           temperature=1.0, seed=3, **kw)
        for ch in drawn.choices:
            valid(ch.message.tool_calls)
        # parallel calls allowed: the random model may write calls until the cap (then the
        # last is cut off, finish_reason length); those it made whole are valid, none twice
        several = oa.chat.completions.create(messages=question, tool_choice="required",
                                             **{**kw, "parallel_tool_calls": True})
        finish, made = several.choices[0].finish_reason, several.choices[0].message.tool_calls
        assert finish in ("tool_calls", "length")
        if made:
            for call in made[:-1] if finish == "length" else made:
                valid([call])
            whole = [(c.function.name, c.function.arguments) for c in made]
            assert len(set(whole)) == len(whole)
        # the client's parse() with a pydantic model as a strict tool: parsed arguments
        tool = openai.pydantic_function_tool(_weather_model(), name="get_weather")
        parsed = oa.chat.completions.parse(messages=question, tool_choice="required",
                                           **{**kw, "tools": [tool]})
        args = parsed.choices[0].message.tool_calls[0].function.parsed_arguments
        assert args.unit in ("C", "F") and len(args.city) <= 16
        # the calls and a result back: the next answer (tool_choice none) is text
        follow = [*question, {"role": "assistant", "content": None,
                              "tool_calls": [c.model_dump() for c in calls]},
                  {"role": "tool", "tool_call_id": calls[0].id, "content": "Sunny, 21 C"}]
        after = oa.chat.completions.create(messages=follow, tool_choice="none",
                                           **{**kw, "max_tokens": 8})
        assert after.choices[0].message.tool_calls is None
        assert after.choices[0].finish_reason in ("stop", "length")
        auto = oa.chat.completions.create(messages=follow, **{**kw, "max_tokens": 8})
        if auto.choices[0].message.tool_calls is None:
            assert not auto.choices[0].message.content.lstrip().startswith("<tool_call>")
        for bad, error, says in [
                ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
                 openai.UnprocessableEntityError, "not one of the tools"),
                ({"tools": [*TOOLS, TOOLS[0]]}, openai.UnprocessableEntityError, "one name"),
                ({"tools": [{"type": "function", "function": {
                    "name": "t", "strict": True, "parameters": {
                        "type": "object", "properties": {"n": {"minimum": 1}}}}}]},
                 openai.UnprocessableEntityError, "minimum")]:
            with pytest.raises(error, match=says):
                oa.chat.completions.create(messages=question, **{**kw, **bad})
    finally:
        oa.close()


def test_the_openai_client_asks_through_the_responses_api_as_through_chat(world):
    """POST /v1/responses: the same answer as the chat completion of the same conversation
    (instructions as a system message), streamed as the API's numbered events whose deltas
    are the text; the cap makes it incomplete; logprobs, a JSON schema (the client's
    parse()), and function calls sent back with their results as input; what it does not do
    is a 422 naming it."""
    openai = pytest.importorskip("openai")
    rs = pytest.importorskip("jsonschema_rs")
    oa, http = _openai(openai, world["dev"], "responses")
    sparkv = _local(world)
    cid, question, rule = world["ctx"]["a"], "What is it about?", "Answer in one sentence."
    kw = dict(model=cid, extra_body={"sparkv": sparkv})
    try:
        chat = oa.chat.completions.create(max_tokens=8, messages=[
            {"role": "system", "content": rule}, {"role": "user", "content": question}], **kw)
        r = oa.responses.create(input=question, instructions=rule, max_output_tokens=8, **kw)
        assert r.object == "response" and r.id.startswith("resp_")
        assert r.output_text == chat.choices[0].message.content
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert r.output[0].type == "message" and r.output[0].status == "incomplete"
        assert (r.usage.input_tokens, r.usage.output_tokens) == (
            chat.usage.prompt_tokens, chat.usage.completion_tokens)
        assert r.instructions == rule and r.max_output_tokens == 8
        as_items = oa.responses.create(max_output_tokens=8, input=[
            {"role": "developer", "content": rule},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": question}]}], **kw)
        assert as_items.output_text == r.output_text
        events = list(oa.responses.create(input=question, instructions=rule,
                                          max_output_tokens=8, stream=True, **kw))
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
        assert events[-1].type == "response.incomplete"
        deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
        assert "".join(deltas) == r.output_text == events[-1].response.output_text
        done = [e for e in events if e.type == "response.output_text.done"]
        assert [e.text for e in done] == [r.output_text]
        lp = oa.responses.create(input=question, max_output_tokens=4, top_logprobs=2,
                                 include=["message.output_text.logprobs"], **kw)
        tokens = lp.output[0].content[0].logprobs
        assert len(tokens) == 4 and all(len(t.top_logprobs) == 2 for t in tokens)
        assert all(t.logprob <= 0 for t in tokens)
        parsed = oa.responses.parse(input=question, text_format=_pick_model(),
                                    max_output_tokens=200, **kw)
        if parsed.status == "completed":
            assert parsed.output_parsed.kind in ("a", "b")
        js = oa.responses.create(input=question, max_output_tokens=200, text={"format": {
            "type": "json_schema", "name": "choice", "schema": CHOICE, "strict": True}}, **kw)
        assert js.status == "completed" and rs.is_valid(CHOICE, json.loads(js.output_text))
        with oa.responses.stream(input=question, max_output_tokens=200, text={"format": {
                "type": "json_schema", "name": "choice", "schema": CHOICE, "strict": True}},
                **kw) as stream:       # the client's own reader (it reads completed ones)
            assert stream.get_final_response().output_text == js.output_text
        _responses_call_tools(oa, kw, question, rs)
        for bad, says in [({"input": [{"role": "user", "content": [
                              {"type": "input_image", "image_url": "http://x/y.png"}]}]},
                           "'input_image' content is not taken"),
                          ({"tools": [{"type": "web_search"}]}, "functions only"),
                          ({"tool_choice": "required"}, "needs tools")]:
            with pytest.raises(openai.UnprocessableEntityError, match=says):
                oa.responses.create(**{"input": question, **kw, **bad})
        with pytest.raises(openai.NotFoundError):
            oa.responses.create(input=question, **{**kw, "model": "not-a-context"})
        paths = http.get("http://localhost/openapi.json").json()["paths"]
        assert "/v1/responses" in paths
    finally:
        oa.close()


def _responses_call_tools(oa, kw, question: str, rs) -> None:
    """tool_choice required: the output is function_call items whose arguments the schema
    takes, streamed the same; sent back as input with their outputs, the next answer is a
    message."""
    tools = [{"type": "function", "name": "get_weather", "description": "The weather",
              "parameters": WEATHER, "strict": True}]
    kw = {**kw, "tools": tools, "parallel_tool_calls": False, "max_output_tokens": 400}
    r = oa.responses.create(input=question, tool_choice="required", **kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls == r.output and r.status == "completed"
    for call in calls:
        assert call.name == "get_weather" and call.call_id.startswith("call_")
        assert rs.is_valid(WEATHER, json.loads(call.arguments))
    events = list(oa.responses.create(input=question, tool_choice="required", stream=True,
                                      **kw))
    assert not [e for e in events if e.type == "response.output_text.delta"]
    streamed = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and "".join(deltas) == calls[0].arguments   # as the model wrote
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [(a.id, a.call_id, a.status) for a in added] == [(c.id, c.call_id, "in_progress")
                                                           for c in streamed]
    back = [{"role": "user", "content": question}, *[c.model_dump() for c in r.output],
            *[{"type": "function_call_output", "call_id": c.call_id, "output": "Sunny, 21 C"}
              for c in calls]]
    after = oa.responses.create(input=back, tool_choice="none",
                                **{**kw, "max_output_tokens": 8})
    assert [o.type for o in after.output] == ["message"]
    chained = oa.responses.create(input=back[1 + len(r.output):], previous_response_id=r.id,
                                  tool_choice="none", **{**kw, "max_output_tokens": 8})
    assert chained.output_text == after.output_text
    assert chained.usage.input_tokens == after.usage.input_tokens


def test_a_kept_response_is_continued_read_and_deleted_by_its_app_alone(world):
    """A response is kept for its app: the next names it as previous_response_id and gets
    the answer of the whole conversation sent as input; GET gives it back (a streamed one
    too), its input items are listed in pages; another app cannot read or continue it; a
    deleted one is gone while the response continuing it still goes on; store=False keeps
    none."""
    openai = pytest.importorskip("openai")
    oa, _ = _openai(openai, world["dev"], "keeper")
    other, _ = _openai(openai, world["dev"], "other")
    sparkv = _local(world)
    kw = dict(model=world["ctx"]["a"], extra_body={"sparkv": sparkv}, max_output_tokens=6,
              instructions="Answer in a few words.")
    try:
        r1 = oa.responses.create(input="What is it about?", **kw)
        assert r1.store is True
        r2 = oa.responses.create(input="Who wrote it?", previous_response_id=r1.id, **kw)
        assert r2.previous_response_id == r1.id
        whole = oa.responses.create(store=False, input=[
            {"role": "user", "content": "What is it about?"},
            *[o.model_dump() for o in r1.output], {"role": "user", "content": "Who wrote it?"}],
            **kw)
        assert r2.output_text == whole.output_text
        assert r2.usage.input_tokens == whole.usage.input_tokens
        got = oa.responses.retrieve(r1.id)
        assert (got.id, got.output_text, got.usage.output_tokens) == (
            r1.id, r1.output_text, r1.usage.output_tokens)
        items = oa.responses.input_items.list(r2.id)
        texts = [i.content[0].text for i in items.data]
        assert texts == ["Who wrote it?", r1.output_text, "What is it about?"]
        page = oa.responses.input_items.list(r2.id, limit=1, order="asc")
        assert page.has_more and [i.id for i in page.data] == [items.data[-1].id]
        rest = oa.responses.input_items.list(r2.id, order="asc", after=page.data[0].id)
        assert [i.id for i in rest.data] == [i.id for i in items.data[-2::-1]]
        for call in (lambda: other.responses.retrieve(r1.id),
                     lambda: other.responses.delete(r1.id)):
            with pytest.raises(openai.NotFoundError, match="not found"):
                call()
        with pytest.raises(openai.BadRequestError, match="not found"):
            other.responses.create(input="And?", previous_response_id=r1.id, **kw)
        oa.responses.delete(r1.id)
        with pytest.raises(openai.NotFoundError):
            oa.responses.retrieve(r1.id)
        r3 = oa.responses.create(input="When?", previous_response_id=r2.id, **kw)
        assert len(oa.responses.input_items.list(r3.id).data) == 5
        with pytest.raises(openai.NotFoundError):
            oa.responses.retrieve(whole.id)
        streamed = list(oa.responses.create(input="What is it about?", stream=True, **kw))
        final = streamed[-1].response
        assert oa.responses.retrieve(final.id).output_text == final.output_text
        with world["dev"].client() as c:
            kept = c.ask_stats()["kept_responses"]
        assert kept["responses"] >= 3 and kept["bytes"] > 0 and kept["apps"] >= 1
    finally:
        oa.close()
        other.close()


def _settled(oa, rid: str):
    """The background response ``rid`` once it stopped running."""
    out = []
    _until(lambda: out.append(oa.responses.retrieve(rid)) or out[-1].status not in (
        "queued", "in_progress"), f"background response {rid} ended")
    return out[-1]


def test_a_background_response_runs_on_and_is_polled_cancelled_or_deleted(world):
    """background: the request is answered at once, queued; polled, the response becomes the
    answer the same request gets in the foreground; a long one is in_progress, cannot be
    continued yet, and cancelled it is cancelled (a second cancel a 400); one deleted while it
    runs stops and is gone."""
    openai = pytest.importorskip("openai")
    oa, _ = _openai(openai, world["dev"], "poller")
    sparkv = _local(world)
    kw = dict(model=world["ctx"]["a"], extra_body={"sparkv": sparkv})
    try:
        fore = oa.responses.create(input="What is it about?", max_output_tokens=6, **kw)
        back = oa.responses.create(input="What is it about?", max_output_tokens=6,
                                   background=True, **kw)
        assert back.status == "queued" and back.background is True
        done = _settled(oa, back.id)
        assert done.status == "incomplete" and done.output_text == fore.output_text
        long = oa.responses.create(input="Tell it all.", max_output_tokens=3000,
                                   background=True, **kw)
        _until(lambda: oa.responses.retrieve(long.id).status == "in_progress",
               "the long one answering")
        with pytest.raises(openai.BadRequestError, match="in_progress"):
            oa.responses.create(input="And?", previous_response_id=long.id, **kw)
        stopped = oa.responses.cancel(long.id)
        assert stopped.status == "cancelled"
        assert oa.responses.retrieve(long.id).status == "cancelled"
        with pytest.raises(openai.BadRequestError, match="not a running background"):
            oa.responses.cancel(long.id)
        with pytest.raises(openai.BadRequestError, match="not a running background"):
            oa.responses.cancel(fore.id)
        gone = oa.responses.create(input="Tell it all.", max_output_tokens=3000,
                                   background=True, **kw)
        oa.responses.delete(gone.id)
        with world["dev"].client() as c:
            _until(lambda: c.ask_stats()["running"] == 0, "the deleted one stopped")
            _until(lambda: c.ask_stats()["kept_responses"]["background_running"] == 0,
                   "no background response running")
        with pytest.raises(openai.NotFoundError):
            oa.responses.retrieve(gone.id)
    finally:
        oa.close()


def _events(stream, leave_after: int | None = None) -> list:
    out = []
    for ev in stream:
        out.append(ev)
        if leave_after is not None and len(out) >= leave_after:
            break
    stream.close()
    return out


def test_a_streamed_background_response_is_read_on_from_where_the_app_left(world):
    """background with stream: the events come as a foreground stream's (queued first); the
    app leaves after a few and the response runs on; retrieve(stream=True, starting_after=N)
    gives the rest, numbered on, to the foreground's text; after it ended, all of them again.
    Cancelled while streamed, its stream ends and it is cancelled; a foreground response has
    no events to stream again (a 400)."""
    openai = pytest.importorskip("openai")
    oa, _ = _openai(openai, world["dev"], "streamer")
    sparkv = _local(world)
    kw = dict(model=world["ctx"]["a"], extra_body={"sparkv": sparkv})
    try:
        fore = oa.responses.create(input="What is it about?", max_output_tokens=6, **kw)
        first = _events(oa.responses.create(input="What is it about?", max_output_tokens=6,
                                            background=True, stream=True, **kw), 3)
        assert [e.type for e in first] == ["response.created", "response.queued",
                                           "response.in_progress"]
        rid = first[0].response.id
        assert first[0].response.status == "queued" and first[0].response.background
        rest = _events(oa.responses.retrieve(rid, stream=True, starting_after=2))
        seen = first + rest
        assert [e.sequence_number for e in seen] == list(range(len(seen)))
        assert seen[-1].type == "response.incomplete"
        text = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
        assert text == fore.output_text == seen[-1].response.output_text
        assert _settled(oa, rid).output_text == fore.output_text
        again = _events(oa.responses.retrieve(rid, stream=True))
        assert [e.type for e in again] == [e.type for e in seen]
        long = _events(oa.responses.create(input="Tell it all.", max_output_tokens=3000,
                                           background=True, stream=True, **kw), 4)
        lid = long[0].response.id
        later = oa.responses.retrieve(lid, stream=True, starting_after=3)
        assert oa.responses.cancel(lid).status == "cancelled"
        tail = _events(later)                       # it ends, with no answer's end
        assert not {e.type for e in tail} & {"response.completed", "response.incomplete",
                                             "response.failed"}
        assert oa.responses.retrieve(lid).status == "cancelled"
        with pytest.raises(openai.BadRequestError, match="cannot be streamed"):
            oa.responses.retrieve(fore.id, stream=True)
        with pytest.raises(openai.UnprocessableEntityError):
            oa.responses.retrieve(rid, stream=True, starting_after=-1)
    finally:
        oa.close()


def test_a_conversation_holds_its_responses_turns_as_the_api_keeps_them(world):
    """The Conversations API through the ``openai`` client: a response naming a conversation
    comes after its items, and its input and output are added to it; the second answer is the
    one the same turns sent whole get; items are listed, fetched, added and removed; the
    conversation is its app's alone, and conversation with previous_response_id is a 422."""
    openai = pytest.importorskip("openai")
    oa, _ = _openai(openai, world["dev"], "chatter")
    other, _ = _openai(openai, world["dev"], "stranger")
    sparkv = _local(world)
    kw = dict(model=world["ctx"]["a"], extra_body={"sparkv": sparkv}, max_output_tokens=5)
    first = {"role": "user", "content": "Read it closely."}
    try:
        conv = oa.conversations.create(items=[first], metadata={"topic": "the text"})
        assert conv.id.startswith("conv_") and conv.metadata == {"topic": "the text"}
        r1 = oa.responses.create(input="What is it about?", conversation=conv.id, **kw)
        assert r1.conversation.id == conv.id
        r2 = oa.responses.create(input="Who wrote it?", conversation={"id": conv.id}, **kw)
        items = oa.conversations.items.list(conv.id, order="asc").data
        assert [i.role for i in items] == ["user"] + ["user", "assistant"] * 2
        assert items[2].id == r1.output[0].id and items[4].content[0].text == r2.output_text
        whole = oa.responses.create(input=[first, {"role": "user", "content":
                                                   "What is it about?"}, *r1.output,
                                           {"role": "user", "content": "Who wrote it?"}], **kw)
        assert whole.output_text == r2.output_text
        assert whole.usage.input_tokens == r2.usage.input_tokens
        got = oa.conversations.items.retrieve(items[1].id, conversation_id=conv.id)
        assert got.content[0].text == "What is it about?"
        added = oa.conversations.items.create(conv.id, items=[{"role": "user",
                                                               "content": "A note."}])
        assert added.data[0].id and added.first_id == added.last_id == added.data[0].id
        assert oa.conversations.items.delete(items[0].id, conversation_id=conv.id).id == conv.id
        page = oa.conversations.items.list(conv.id, limit=2)
        assert [i.id for i in page.data] == [added.data[0].id, items[4].id]   # newest first
        assert oa.conversations.update(conv.id, metadata={"topic": "u"}).metadata == {
            "topic": "u"}
        with pytest.raises(openai.NotFoundError):
            other.conversations.retrieve(conv.id)
        with pytest.raises(openai.NotFoundError):
            other.responses.create(input="And?", conversation=conv.id, **kw)
        with pytest.raises(openai.NotFoundError):
            oa.conversations.items.retrieve("msg_none", conversation_id=conv.id)
        with pytest.raises(openai.UnprocessableEntityError, match="previous_response_id"):
            oa.responses.create(input="And?", conversation=conv.id,
                                previous_response_id=r2.id, **kw)
        for bad in (dict(items=[first] * 21), dict(metadata={f"k{i}": "v" for i in range(17)}),
                    dict(metadata={"k": "v" * 513})):
            with pytest.raises(openai.UnprocessableEntityError):
                oa.conversations.create(**bad)
        assert oa.conversations.delete(conv.id).deleted
        with pytest.raises(openai.NotFoundError):
            oa.responses.create(input="And?", conversation=conv.id, **kw)
    finally:
        oa.close()
        other.close()


def test_input_tokens_are_counted_as_the_response_would_count_them(world):
    """responses.input_tokens.count: before a response is asked, the input tokens its usage
    then says, for a lone question, instructions and earlier turns, a previous response, and
    a conversation; a context its server does not know is the 404 the ask would get."""
    openai = pytest.importorskip("openai")
    oa, _ = _openai(openai, world["dev"], "counter")
    sparkv = _local(world)
    kw = dict(model=world["ctx"]["b"], extra_body={"sparkv": sparkv})
    turns = [{"role": "user", "content": "What is it about?"},
             {"role": "assistant", "content": "A licence."},
             {"role": "user", "content": "Who wrote it?"}]
    try:
        conv = oa.conversations.create(items=turns[:2])
        asked = [dict(input="What is it about?"),
                 dict(input=turns, instructions="Answer in one word."),
                 dict(input="And when?", conversation=conv.id)]
        counts = [oa.responses.input_tokens.count(**a, **kw) for a in asked]
        made = [oa.responses.create(**a, max_output_tokens=3, **kw) for a in asked]
        assert counts[0].object == "response.input_tokens"
        assert [c.input_tokens for c in counts] == [r.usage.input_tokens for r in made]
        assert counts[1].input_tokens > counts[0].input_tokens
        later = dict(input="Why?", previous_response_id=made[1].id)
        count = oa.responses.input_tokens.count(**later, **kw).input_tokens
        assert count == oa.responses.create(**later, max_output_tokens=3,
                                             **kw).usage.input_tokens
        with pytest.raises(openai.BadRequestError):
            oa.responses.input_tokens.count(input="Q?", previous_response_id="resp_none", **kw)
        with pytest.raises(openai.APIStatusError) as e:
            oa.responses.input_tokens.count(input="Q?", model="f" * 32,
                                            extra_body={"sparkv": sparkv})
        assert e.value.status_code == 404            # as the ask itself would be
    finally:
        oa.close()


def test_truncation_auto_drops_the_oldest_turns_of_a_conversation_past_the_window(world):
    """A conversation past the model's 4,096 positions is a 413 as it stands; with truncation
    auto its oldest turns go until it fits, and the answer is the one the fitting turns get
    sent alone (the instructions kept)."""
    openai = pytest.importorskip("openai")
    oa, _ = _openai(openai, world["dev"], "talker")
    sparkv = _local(world)
    kw = dict(model=world["ctx"]["a"], extra_body={"sparkv": sparkv}, max_output_tokens=6,
              instructions="Answer plainly.")
    filler = sample_text()[9000:11400]
    items = [m for k in range(10) for m in (
        {"role": "user", "content": f"Part {k}: {filler}"},
        {"role": "assistant", "content": f"Noted part {k}."})]
    items.append({"role": "user", "content": "What is it about?"})
    try:
        with pytest.raises(openai.APIStatusError, match="prompt_too_long|at most") as e:
            oa.responses.create(input=items, **kw)
        assert e.value.status_code == 413
        r = oa.responses.create(input=items, truncation="auto", **kw)
        dropped = r.model_extra["sparkv"]["dropped_turns"]
        assert 0 < dropped < len(items) - 1 and dropped % 2 == 0 and r.truncation == "auto"
        alone = oa.responses.create(input=items[dropped:], **kw)
        assert (r.output_text, r.usage.input_tokens) == (alone.output_text,
                                                          alone.usage.input_tokens)
        assert r.usage.input_tokens + 6 <= 4096
    finally:
        oa.close()


def test_kept_responses_outlive_a_restart_of_the_service(world, tmp_path):
    """The kept responses are files in the flash dir: a restarted service gives one back,
    lists its input items and continues it as previous_response_id, as before the restart (the
    response it continued deleted: held for it alone), has its conversations, says a
    background one it stopped failed, streams a streamed background one's events again and
    one it stopped on to its failure; --responses-kept 0 keeps none and refuses a
    previous_response_id by name, --conversations-kept 0 makes no conversation."""
    openai = pytest.importorskip("openai")
    sparkv = _local(world)
    kw = dict(model=world["ctx"]["c"], extra_body={"sparkv": sparkv}, max_output_tokens=4)
    dev = DeviceProcess(tmp_path / "dev", 200, model=str(shared_tiny_checkpoint()),
                        extra_args=["--ask-slots", "1"]).start()
    try:
        oa, _ = _openai(openai, dev, "diary")
        r1 = oa.responses.create(input="What is it about?", **kw)
        r2 = oa.responses.create(input="Who wrote it?", previous_response_id=r1.id, **kw)
        conv = oa.conversations.create(metadata={"k": "v"})
        oa.responses.create(input="What is it about?", conversation=conv.id, **kw)
        streamed = _events(oa.responses.create(input="Who?", background=True, stream=True,
                                               **kw))
        first = _events(oa.responses.create(input="Tell it all.", background=True,
                                            stream=True, **{**kw, "max_output_tokens": 3000}),
                        3)                      # the app leaves; it runs on
        bg = first[0].response
        oa.responses.delete(r1.id)              # held: r2 continues it
        oa.close()
        dev.stop()                              # the background one stops unanswered
        files = sorted(p.name for p in (tmp_path / "dev" / "responses").glob("resp_*.json"))
        assert len(files) == 5 and f"{r1.id}.held.json" in files
        dev.start()
        oa, _ = _openai(openai, dev, "diary")
        with pytest.raises(openai.NotFoundError):
            oa.responses.retrieve(r1.id)
        stopped = oa.responses.retrieve(bg.id)
        assert stopped.status == "failed" and stopped.error.code == "service_stopped"
        again = _events(oa.responses.retrieve(streamed[0].response.id, stream=True))
        assert [e.model_dump() for e in again] == [e.model_dump() for e in streamed]
        rest = _events(oa.responses.retrieve(bg.id, stream=True, starting_after=2))
        assert [e.sequence_number for e in rest] == list(range(3, 3 + len(rest)))
        assert rest[-1].type == "response.failed"
        assert rest[-1].response.error.code == "service_stopped"
        assert oa.responses.retrieve(r2.id).output_text == r2.output_text
        assert [i.id for i in oa.responses.input_items.list(r2.id).data] == [
            i.id for i in reversed(oa.responses.input_items.list(r2.id, order="asc").data)]
        r3 = oa.responses.create(input="When?", previous_response_id=r2.id, **kw)
        assert len(oa.responses.input_items.list(r3.id).data) == 5
        assert oa.conversations.retrieve(conv.id).metadata == {"k": "v"}
        assert [i.role for i in oa.conversations.items.list(conv.id).data] == [
            "assistant", "user"]
        oa.close()
    finally:
        dev.stop()
    assert "Traceback" not in dev.log()
    off = DeviceProcess(tmp_path / "off", 200, model=str(shared_tiny_checkpoint()),
                        extra_args=["--ask-slots", "1", "--responses-kept", "0",
                                    "--conversations-kept", "0"]).start()
    try:
        oa, _ = _openai(openai, off, "diary")
        r = oa.responses.create(input="What is it about?", **kw)
        assert r.store is False
        with pytest.raises(openai.NotFoundError):
            oa.responses.retrieve(r.id)
        with pytest.raises(openai.BadRequestError, match="keeps no responses"):
            oa.responses.create(input="And?", previous_response_id=r.id, **kw)
        with pytest.raises(openai.BadRequestError, match="conversations-kept 0"):
            oa.conversations.create()
        oa.close()
    finally:
        off.stop()
    assert not (tmp_path / "off" / "responses").exists()
    assert not (tmp_path / "off" / "conversations").exists()
    assert not (tmp_path / "off" / "response_events").exists()


def test_the_openai_client_asks_a_conversation_as_an_in_process_session_does(world):
    """Instructions (``developer``), an earlier question and answer, then the question: the
    service answers the tokens an in-process session gives for the same turns over the same
    server, and counts them in ``usage``; a tool's message is refused before any work."""
    openai = pytest.importorskip("openai")
    from sparkv.edge import EdgeSession
    from sparkv.runtime.model import load_model
    from sparkv.runtime.turns import ChatTurn, Conversation, suffix_ids

    dev = world["dev"]
    oa, http = _openai(openai, dev, "chat")
    opts = {"strategy": "local", "stop_at_eos": False, "keep": False, "backend": "dense",
            "level": "raw"}
    sparkv = {"server": world["srv"].url, "api_key": world["key"], **opts}
    messages = [{"role": "developer", "content": "Answer in one word."},
                {"role": "user", "content": "What is it about?"},
                {"role": "assistant", "content": [{"type": "text", "text": "Freedom."}]},
                {"role": "user", "content": "Who wrote it?"}]
    conv = Conversation((ChatTurn("system", "Answer in one word."),
                         ChatTurn("user", "What is it about?"), ChatTurn("assistant", "Freedom."),
                         ChatTurn("user", "Who wrote it?")))
    cid = world["ctx"]["b"]
    lm = load_model(str(shared_tiny_checkpoint()), progress=False)
    with EdgeSession.connect(world["srv"].url, world["key"], model=lm) as s:
        alone = s.ask(cid, conv, max_new_tokens=8, **opts)
    try:
        r = oa.chat.completions.create(model=cid, max_tokens=8, messages=messages,
                                       extra_body={"sparkv": sparkv})
        assert r.choices[0].message.content == alone.text
        assert r.usage.prompt_tokens == alone.context_tokens + len(suffix_ids(lm, conv))
        with dev.client() as c:                       # POST /v1/asks: the same turns
            history = [{"role": t.role, "content": t.text} for t in conv.turns[:-1]]
            done = c.ask(cid, conv.question, server=world["srv"].url, api_key=world["key"],
                         max_new_tokens=8, history=history, **opts)
            assert done.text == alone.text
            with pytest.raises(DeviceError, match="has no text"):
                c.ask(cid, "Q?", server=world["srv"].url, api_key=world["key"],
                      history=[{"role": "system", "content": " "}], **opts)
        with pytest.raises(openai.BadRequestError, match="makes no tool calls"):
            oa.chat.completions.create(model=cid, extra_body={"sparkv": sparkv}, messages=[
                *messages[:3], {"role": "user", "content": "{}", "tool_calls": [
                    {"id": "x", "type": "function", "function": {"name": "f",
                                                                 "arguments": "{}"}}]},
                messages[3]])
        with pytest.raises(openai.BadRequestError, match="'chat' off"):
            oa.chat.completions.create(model=cid, messages=messages,
                                       extra_body={"sparkv": {**sparkv, "chat": False}})
    finally:
        oa.close()


def test_a_conversation_asked_from_memory_reuses_its_earlier_turns(world):
    """A chat app sends its whole conversation every time: the first request loads the context
    and keeps it with the turn it asked; from the second on, the service runs only what the last
    request did not hold, counts the rest in ``cached_tokens``, and answers the tokens an
    in-process session gives for the same turns."""
    openai = pytest.importorskip("openai")
    from sparkv.edge import EdgeSession
    from sparkv.runtime.model import load_model
    from sparkv.runtime.turns import ChatTurn, Conversation

    dev = world["dev"]
    oa, http = _openai(openai, dev, "talker")
    opts = {"strategy": "local", "stop_at_eos": False, "backend": "dense", "level": "raw"}
    cid = world["ctx"]["b"]
    messages: list[dict] = [{"role": "system", "content": "Answer plainly, in a few words."}]
    got = []
    try:
        for q in ("What is it about?", "Who wrote it?", "When was that?"):
            messages.append({"role": "user", "content": q})
            r = oa.chat.completions.create(
                model=cid, max_tokens=6, messages=messages,
                extra_body={"sparkv": {"server": world["srv"].url, "api_key": world["key"],
                                       "keep": True, **opts}})
            got.append(r)
            messages.append({"role": "assistant", "content": r.choices[0].message.content})
    finally:
        oa.close()
    stats = [r.model_extra["sparkv"]["stats"] for r in got]
    assert [s["strategy"] for s in stats] == ["local", "kept", "kept"]
    reused = [s["turn_tokens_reused"] for s in stats]
    assert reused[0] == 0 and 16 <= reused[1] < reused[2]
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in got]
    assert cached == [0, *(s["context_tokens"] + n for s, n in zip(stats[1:], reused[1:]))]
    conv = Conversation(tuple(ChatTurn(m["role"], m["content"]) for m in messages[:-1]))
    lm = load_model(str(shared_tiny_checkpoint()), progress=False)
    with EdgeSession.connect(world["srv"].url, world["key"], model=lm) as s:
        alone = s.ask(cid, conv, max_new_tokens=6, keep=False, **opts)
    assert got[2].choices[0].message.content == alone.text


def test_the_openai_client_lists_the_contexts_its_app_may_ask_about_from_memory(world):
    """``models.list()``: a context an app's ask kept is listed for it (its server context id,
    the kept id, the server) and for no other app until shared; ``models.retrieve`` finds it,
    and a name the service does not keep is 404."""
    openai = pytest.importorskip("openai")
    dev = world["dev"]
    http = httpx.Client(transport=httpx.HTTPTransport(uds=str(dev.socket)), timeout=GUARD_S)

    def client(app: str):
        return openai.OpenAI(base_url="http://localhost/v1", api_key=dev.app_token(app),
                             http_client=http, max_retries=0)

    mine, other = client("lister"), client("stranger")
    cid = world["ctx"]["c"]
    try:
        assert [m.id for m in mine.models.list()] == []
        mine.chat.completions.create(
            model=cid, max_tokens=2, messages=[{"role": "user", "content": "What is it?"}],
            extra_body={"sparkv": {"server": world["srv"].url, "api_key": world["key"],
                                   "strategy": "local", "keep": True}})
        listed = list(mine.models.list())
        assert [m.id for m in listed] == [cid] and listed[0].owned_by == "app:lister"
        kept = listed[0].model_extra["sparkv"]
        assert kept["server"] == world["srv"].url and kept["tokens"] > 0
        assert mine.models.retrieve(cid).model_extra["sparkv"]["kept_id"] == kept["kept_id"]
        assert [m.id for m in other.models.list()] == []               # not shared
        with pytest.raises(openai.NotFoundError):
            other.models.retrieve(cid)
        with dev.client(app="lister") as c:
            c.share(kept["kept_id"], ["app:stranger"])
        assert [m.id for m in other.models.list()] == [cid]
    finally:
        mine.close()
        other.close()


# ---- clients that go away at random: nothing stuck, lost or leaked ----------------------------------
def test_clients_that_disconnect_at_random_leave_no_ask_stuck_or_memory_held(world):
    import random

    dev = world["dev"]
    with dev.client() as c:
        before = c.ask_stats()
    rss_before = _rss_mb(dev.proc.pid)
    outcomes: list[str] = []

    refused: list[int] = []

    def one(ci, name: str, strategy: str, leave_after: int | None) -> str:
        events = ci.ask_events(world["ctx"][name], "Go on.", server=world["srv"].url,
                               api_key=world["key"], strategy=strategy, max_new_tokens=6,
                               stop_at_eos=False, keep=False)
        for i, event in enumerate(events):
            if event["type"] in ("done", "error"):
                return str(event["type"])
            if leave_after is not None and i + 1 >= leave_after:
                events.close()                                       # the client goes away
                return "left"
        return "ended without done"

    def client(seed: int) -> None:
        rng = random.Random(seed)
        with dev.client() as ci:
            for _ in range(STRESS_ASKS // 8):
                args = (rng.choice("abc"), rng.choice(["local", "stream"]),
                        rng.choice([1, 2, 4, None]))                 # None: reads to the end
                while True:                     # a refused ask is sent again, as Retry-After says
                    try:
                        outcomes.append(one(ci, *args))
                        break
                    except QueueFull:
                        refused.append(seed)
                        time.sleep(0.05)

    threads = [threading.Thread(target=client, args=(s,)) for s in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(GUARD_S * STRESS_ASKS / 40)
    assert not any(th.is_alive() for th in threads) and len(outcomes) == STRESS_ASKS
    assert "ended without done" not in outcomes
    with dev.client() as c:
        _until(lambda: c.ask_stats()["running"] == 0 and c.ask_stats()["waiting"] == 0,
               "every ask ended")
        s = c.ask_stats()
        admitted = s["asks"] - before["asks"]
        assert admitted == STRESS_ASKS
        ended = sum(s[k] - before[k] for k in ("done", "failed", "cancelled"))
        assert ended == admitted and s["failed"] == before["failed"]   # none lost, none failed
        assert s["done"] - before["done"] >= outcomes.count("done")
        _until(lambda: c.ask_stats()["cores"]["held_memories"] == 0, "their memory freed")
        assert c.ask_stats()["cores"]["held_bytes"] == 0 and c.stats()["budget_violations"] == 0
    print(f"stress: {STRESS_ASKS} asks from 8 clients: " + ", ".join(
        f"{outcomes.count(k)} {k}" for k in ("done", "left", "error"))
        + f"; {len(refused)} refusals (429) sent again; the service's RSS "
        f"{rss_before:.0f} MB before, {_rss_mb(dev.proc.pid):.0f} MB after")


def _rss_mb(pid: int) -> float:
    """A process's resident memory (``VmRSS``), MB: reported by the stress, never asserted."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def test_a_client_that_leaves_mid_request_body_leaves_no_traceback_on_the_server(world):
    """A cancelled ask can close its stream request before the server read its body: the server
    answers nobody (499), logs one line and no traceback (the module's teardown checks the
    server's log)."""
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(world["srv"].url)
    with socket.create_connection((url.hostname, url.port), timeout=GUARD_S) as s:
        s.sendall((f"POST /v1/contexts/{world['ctx']['a']}/stream HTTP/1.1\r\nHost: {url.netloc}"
                   f"\r\nAuthorization: Bearer {world['key']}\r\nContent-Type: application/json"
                   "\r\nContent-Length: 1000\r\n\r\n{\"items\": [").encode())
    _until(lambda: "the client went away during POST" in world["srv"].log(), "the server saw it")
    assert "Traceback" not in world["srv"].log()


# ---- text completions (POST /v1/completions: sparkv/asks/textcompletion.py) -------------------
@pytest.fixture(scope="module")
def texts(world):
    """The ``openai`` client of an app asking for text completions about context ``a``."""
    openai = pytest.importorskip("openai")
    oa, http = _openai(openai, world["dev"], "texts")
    yield {"oa": oa, "openai": openai, "http": http, "cid": world["ctx"]["a"],
           "fields": {**_local(world), "dev": world["dev"]}}
    http.close()


def _complete(texts, **kw):
    fields = {k: v for k, v in texts["fields"].items() if k != "dev"}
    return texts["oa"].completions.create(model=texts["cid"], extra_body={"sparkv": fields},
                                          **kw)


def _ask_raw(texts, question: str, n: int) -> dict:
    """The ``done`` event of the same question through ``POST /v1/asks`` with ``chat`` off."""
    fields = {k: v for k, v in texts["fields"].items() if k != "dev"}
    with texts["fields"]["dev"].client() as c:
        events = list(c.ask_events(texts["cid"], question, max_new_tokens=n, chat=False,
                                   **fields))
    return events[-1]


def test_a_text_completion_is_the_ask_with_chat_off(texts):
    r = _complete(texts, prompt=" The story", max_tokens=6)
    done = _ask_raw(texts, " The story", 6)
    assert done["type"] == "done"
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.model == texts["cid"]
    [choice] = r.choices
    assert choice.text == done["text"] and choice.index == 0
    assert choice.finish_reason == "length" and choice.logprobs is None
    stats = done["stats"]
    assert r.usage.prompt_tokens == stats["context_tokens"] + stats["question_tokens"]
    assert r.usage.completion_tokens == 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6


def test_echo_and_the_stream_add_up_to_the_whole_answer(texts):
    whole = _complete(texts, prompt=" Once", max_tokens=5, echo=True)
    assert whole.choices[0].text.startswith(" Once")
    assert whole.choices[0].text == " Once" + _ask_raw(texts, " Once", 5)["text"]
    chunks = list(_complete(texts, prompt=" Once", max_tokens=5, echo=True, stream=True,
                            stream_options={"include_usage": True}))
    *events, last = chunks
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    assert events[0].choices[0].text == " Once"              # the echo comes first
    assert "".join(c.choices[0].text for c in events) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in events][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in events[:-1])
    assert last.choices == [] and last.usage.completion_tokens == 5
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens


def test_several_prompts_answer_in_prompt_order_n_choices_each(texts):
    r = _complete(texts, prompt=[" Alpha", " Beta went"], n=2, max_tokens=4)
    a, b = (_complete(texts, prompt=p, max_tokens=4) for p in (" Alpha", " Beta went"))
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [a.choices[0].text] * 2 + [b.choices[0].text] * 2
    assert r.usage.prompt_tokens == a.usage.prompt_tokens + b.usage.prompt_tokens
    assert r.usage.completion_tokens == 4 * 4
    sampled = _complete(texts, prompt=[" Alpha", " Beta went"], n=2, max_tokens=4,
                        temperature=1.0, seed=11)
    again = _complete(texts, prompt=[" Alpha", " Beta went"], n=2, max_tokens=4,
                      temperature=1.0, seed=11)
    assert [c.text for c in sampled.choices] == [c.text for c in again.choices]   # seeded


def test_logprobs_are_the_legacy_lists_with_offsets_into_the_text(texts):
    r = _complete(texts, prompt=" The end", max_tokens=5, logprobs=2)
    [choice] = r.choices
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert len(lp.text_offset) == 5 and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(choice.text)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 2 and logprob <= 0
        assert max(top.values()) == pytest.approx(logprob)     # greedy: the likeliest token
        assert top[token] == pytest.approx(logprob)
    streamed = [c.choices[0].logprobs for c in _complete(texts, prompt=" The end", max_tokens=5,
                                                         logprobs=2, stream=True)
                if c.choices[0].logprobs is not None]
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    assert [t for s in streamed for t in s.tokens] == lp.tokens


@pytest.mark.parametrize("kw, says", [
    ({"prompt": "a", "suffix": "b"}, "suffix"),
    ({"prompt": "a", "best_of": 3}, "best_of"),
    ({"prompt": "a", "echo": True, "max_tokens": 0, "stream": True}, "without stream"),
    ({"prompt": "a", "max_tokens": 0}, "needs echo"),
    ({"prompt": ["a", "b", "c"], "n": 3}, "at most 8 choices"),
    ({"prompt": ""}, "empty prompt"),
    ({"prompt": []}, "empty prompt"),
    ({"prompt": [[5, 6], []]}, "empty prompt"),
])
def test_what_it_cannot_answer_is_refused_clearly(texts, kw, says):
    with pytest.raises(texts["openai"].UnprocessableEntityError) as e:
        _complete(texts, **{"max_tokens": 3, **kw})
    assert says in str(e.value)
    assert _complete(texts, prompt=" Still", max_tokens=2).choices[0].text   # still answers


def _scored(texts, prompt, **kw):
    """The prompt's scored ``logprobs`` (echo, one answer token shown unless ``max_tokens``)."""
    return _complete(texts, prompt=prompt, echo=True, logprobs=kw.pop("logprobs", 1),
                     max_tokens=kw.pop("max_tokens", 1), **kw)


@functools.lru_cache(maxsize=1)
def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(shared_tiny_checkpoint()))


def _ids(text: str) -> list[int]:
    """``text``'s token ids as the service tokenizes a prompt."""
    return list(_tokenizer().encode(text, add_special_tokens=False))


def test_echo_with_logprobs_scores_the_prompt_as_the_answer_was_scored(texts):
    """The prompt's tokens are scored in its own pass over the context: an answer's greedy
    tokens, asked again as the prompt's end (token ids), score as they were generated."""
    first = _complete(texts, prompt=" The story", max_tokens=6, logprobs=2)
    answer = _ask_raw(texts, " The story", 6)["tokens"]
    head = _ids(" The story")
    r = _scored(texts, [head + answer[:5]], logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(head) + 5 + 1             # the prompt, one answer
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    scored = lp.token_logprobs[len(head):len(head) + 5]
    assert scored == pytest.approx(first.choices[0].logprobs.token_logprobs[:5], abs=2e-3)
    for v, top in zip(scored, lp.top_logprobs[len(head):len(head) + 5]):
        assert max(top.values()) == pytest.approx(v, abs=1e-5)     # greedy tokens
    assert lp.tokens[:len(head) + 5] == [_tokenizer().decode([t]) for t in head + answer[:5]]
    text = r.choices[0].text
    assert text.startswith(" The story") and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(text)
    alone = _complete(texts, prompt=" The story", max_tokens=0, echo=True, logprobs=0)
    [c] = alone.choices
    assert c.text == " The story" and c.finish_reason == "length"
    assert alone.usage.completion_tokens == 0 and len(c.logprobs.tokens) == len(head)
    assert c.logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:len(head)], abs=1e-4)


def test_an_lm_eval_loglikelihood_request_reads_its_continuation(texts):
    """lm-evaluation-harness's request (token ids, echo, max_tokens 1, logprobs 1): the
    continuation's log-likelihood sums the scores after the context's tokens; the greedy
    continuation is greedy and likelier than another; the same request again and the prompt
    extended (a kept tail's KV not reused: every token runs) score the tokens they share
    alike."""
    ctx = _ids(" Once upon a time")
    greedy = _ask_raw(texts, " Once upon a time", 4)["tokens"]
    other = [greedy[0] + 7, greedy[1] + 11, greedy[2] + 13, greedy[3]]

    def loglikelihood(cont):
        r = _complete(texts, prompt=[ctx + cont], echo=True, max_tokens=1, logprobs=1,
                      temperature=0, seed=1234)
        lp = r.choices[0].logprobs
        got, tops = lp.token_logprobs[len(ctx):-1], lp.top_logprobs[len(ctx):-1]
        return sum(got), all(v == max(t.values()) for v, t in zip(got, tops)), lp
    best, is_greedy, lp = loglikelihood(greedy)
    worse, not_greedy, _ = loglikelihood(other)
    assert is_greedy and not not_greedy and best > worse
    again, _, _ = loglikelihood(greedy)
    assert again == pytest.approx(best, abs=1e-4)
    longer = _scored(texts, [ctx + greedy + other]).choices[0].logprobs
    n = len(ctx) + len(greedy)
    assert longer.token_logprobs[1:n] == pytest.approx(lp.token_logprobs[1:n], abs=1e-4)


def test_token_prompts_run_as_they_are_and_out_of_the_vocabulary_are_refused(texts):
    with pytest.raises(texts["openai"].BadRequestError) as e:
        _complete(texts, prompt=[[1, 2, 10 ** 9]], max_tokens=2)
    assert "not a token id" in str(e.value)
    odd = _ids(" went") + _ids(" home")          # not how " went home" tokenizes, maybe
    r = _complete(texts, prompt=[_ids(" The story"), odd], max_tokens=3, echo=True)
    assert r.choices[0].text == " The story" + _ask_raw(texts, " The story", 3)["text"]
    assert r.choices[1].text.startswith(" went home")


def test_a_prompt_asked_from_memory_is_scored_whole_as_it_was_over_the_stream(texts):
    """A kept context answers from the service's memory: there a prompt that begins with an
    earlier turn's (its KV kept as a tail) still runs whole, and scores as the ask that
    loaded the context scored it."""
    ctx = _ids(" It was late in the evening when the old sailor came back to the harbour, "
               "tired and cold, with a story that nobody in the village believed")
    assert len(ctx) > MIN_REUSE                  # long enough for a kept tail's reuse
    kept = {**texts["fields"], "keep": True}
    fields = {k: v for k, v in kept.items() if k != "dev"}

    def scored(prompt):
        r = texts["oa"].completions.create(model=texts["cid"], prompt=[prompt], echo=True,
                                           max_tokens=3, logprobs=1,
                                           extra_body={"sparkv": fields})
        return r.choices[0].logprobs.token_logprobs, r.sparkv["stats"]["strategy"]
    loaded, how = scored(ctx)
    again, how2 = scored(ctx)
    longer, how3 = scored(ctx + _ids(" that night"))
    assert how != "kept" and how2 == how3 == "kept"
    assert again[:len(ctx)] == pytest.approx(loaded[:len(ctx)], abs=2e-3)   # float32, another
    assert longer[:len(ctx)] == pytest.approx(again[:len(ctx)], abs=1e-4)   # kernel's order


def test_an_ask_scores_its_question_with_prompt_logprobs(texts):
    """``POST /v1/asks`` with ``prompt_logprobs``: the done event's ``prompt`` is the question's
    tokens, scored as the text completion scores them (the same pass), chat off or on."""
    fields = {k: v for k, v in texts["fields"].items() if k != "dev"}
    with texts["fields"]["dev"].client() as c:
        done = c.ask(texts["cid"], " The story", max_new_tokens=1, chat=False,
                     prompt_logprobs=2, **fields)
        chat = c.ask(texts["cid"], "What happens?", max_new_tokens=1, prompt_logprobs=0,
                     **fields)
        plain = c.ask(texts["cid"], " The story", max_new_tokens=1, chat=False, **fields)
    prompt = done.prompt
    assert [p.token for p in prompt] == _ids(" The story")
    assert prompt[0].logprob is None and prompt[0].top_logprobs is None
    assert all(len(p.top_logprobs) == 2 and p.logprob <= 0 for p in prompt[1:])
    same = _complete(texts, prompt=" The story", max_tokens=0, echo=True, logprobs=2)
    assert [p.logprob for p in prompt] == pytest.approx(
        same.choices[0].logprobs.token_logprobs, abs=1e-4)
    assert len(chat.prompt) == chat.stats["question_tokens"] > len(_ids("What happens?"))
    assert plain.prompt is None and plain.tokens == done.tokens


def test_text_offsets_point_at_each_tokens_text_with_characters_split_across_tokens():
    from sparkv.asks.textcompletion import text_offsets

    class Words:                                  # the tokenizer's decode, by bytes
        texts = {1: b"ab", 2: "\u00e9".encode()[:1], 3: "\u00e9".encode()[1:] + b"c",
                 4: " \u65e5".encode(), 5: b"!"}

        def decode_tokens(self, ids):
            return b"".join(self.texts[t] for t in ids).decode("utf-8", "replace")

    lm = Words()
    ids = [1, 2, 3, 4, 5, 1]
    offsets = text_offsets(lm, ids)
    text = lm.decode_tokens(ids)
    assert text == "ab\u00e9c \u65e5!ab"
    assert offsets == [0, 2, 3, 4, 6, 7]          # the split character counts at its start
    assert all(text[o:].startswith(lm.decode_tokens([t]).lstrip("\ufffd"))
               for o, t in zip(offsets, ids) if t != 3)


@pytest.mark.parametrize("decode", ["dynakv", "stream"])
def test_a_prompt_is_scored_under_a_decode_policy_as_under_full_decode(texts, decode):
    """A decode policy's prefill runs the question (sparkv.decode): its pass scores the prompt
    as the full decode's does."""
    ids = _ids(" The story went on and on")
    full = _scored(texts, [ids]).choices[0].logprobs.token_logprobs
    fields = {k: v for k, v in texts["fields"].items() if k != "dev"}
    r = texts["oa"].completions.create(model=texts["cid"], prompt=[ids], echo=True,
                                       max_tokens=1, logprobs=1,
                                       extra_body={"sparkv": {**fields, "decode": decode}})
    assert r.choices[0].logprobs.token_logprobs == pytest.approx(full, abs=1e-4)


def test_a_streamed_echo_carries_the_prompts_scores_then_the_answers(texts):
    whole = _scored(texts, " The story", max_tokens=4, logprobs=2)
    chunks = [c for c in _scored(texts, " The story", max_tokens=4, logprobs=2, stream=True)]
    first = chunks[0].choices[0]
    assert first.text == " The story"                    # the echo opens, with its scores
    head = len(_ids(" The story"))
    assert first.logprobs.token_logprobs == pytest.approx(
        whole.choices[0].logprobs.token_logprobs[:head], abs=1e-5)
    assert first.logprobs.text_offset == whole.choices[0].logprobs.text_offset[:head]
    lp = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [o for x in lp for o in x.text_offset] == whole.choices[0].logprobs.text_offset
    assert [t for x in lp for t in x.tokens] == whole.choices[0].logprobs.tokens
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
