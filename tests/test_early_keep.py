"""An ask that loaded a context other asks of its app wait for keeps it at its answer's first
token (sparkv.asks.kept, "kept early when awaited"): the waiting asks read the kept copy while it
answers from its own cache.

What is asserted: the table counts the asks waiting for a load, and only while they wait (found,
or cancelled); ``early=False`` never says awaited; through a real in-process ask service over a
real tiny server, three sampled choices about a context their app has not kept: the loader keeps
it at its first token (``kept_early_s``; that token streamed already), the two others are
answered from the kept copy, its answer's turn is kept after it, and the context is kept once;
with ``early_keep=False`` the same choices keep it after the answer and draw the same tokens;
with ``keep`` off (sparkv.asks.choicecopy) the choices still load it once, through a copy of
their own that is gone at the request's end (and one a crash left, at the next start)."""

from __future__ import annotations

import threading
import time

import pytest

from helpers import shared_tiny_checkpoint, start_tiny_server, stop_checked

GUARD_S = 300.0          # hang guards only (never a timing assertion)


def _until(cond, what: str, guard_s: float = GUARD_S) -> None:
    deadline = time.monotonic() + guard_s
    while not cond():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.02)


class _Service:
    """What :class:`~sparkv.asks.kept.AppContexts` reads of the context service: its list."""

    lm = None

    def __init__(self) -> None:
        self.contexts: list = []

    def labelled(self, label: str) -> list[str]:
        return [c.id for c in self.contexts if c.label == label]


def _views(table, n: int):
    from sparkv.asks.kept import AppContexts
    from sparkv.device.owners import ContextOwners

    svc, cancels = _Service(), [threading.Event() for _ in range(n)]
    return svc, cancels, [AppContexts(svc, ContextOwners(), "app", (), table, c)
                          for c in cancels]


def test_the_table_counts_the_asks_waiting_for_a_load_while_they_wait():
    from types import SimpleNamespace

    from sparkv.asks.kept import KeepingTable
    from sparkv.edge.lane import AskCancelled

    table = KeepingTable()
    svc, cancels, (lead, a, b) = _views(table, 3)
    waits: list[str] = []
    a.streams_nothing = lambda: waits.append("a")   # the service tells its link plan
    assert lead.find("ctx") is None and not lead.awaited("ctx")       # the loader, alone
    out: dict[str, object] = {}

    def wait(name, view):
        try:
            out[name] = view.find("ctx")
        except AskCancelled as e:
            out[name] = e

    # daemon threads, cancelled on the way out: a failed assertion never leaves one waiting
    threads = [threading.Thread(target=wait, args=(n, v), daemon=True)
               for n, v in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    try:
        _until(lambda: table.waiting[("app", "ctx")] == 2, "two waiting")
        assert lead.awaited("ctx") and not lead.awaited("other")
        assert waits == ["a"]                      # once, as it began to wait
        cancels[1].set()                                   # one leaves: the count follows
        _until(lambda: "a" in out, "the cancelled one leaves")
        assert isinstance(out["a"], AskCancelled) and table.waiting[("app", "ctx")] == 1
        svc.contexts.append(SimpleNamespace(id="c1", label="ctx", last_used=1.0))
        lead.owners.claim("c1", "app", ())
        b.owners.claim("c1", "app", ())
        _until(lambda: "b" in out, "the other finds the kept copy")
    finally:
        for c in cancels:
            c.set()
        for t in threads:
            t.join(GUARD_S)
    assert out["b"] == "c1" and not table.waiting and not lead.awaited("ctx")
    off = KeepingTable(early=False)
    _, _, (lead2, c) = _views(off, 2)
    assert lead2.find("ctx") is None
    waiter = threading.Thread(target=c.find, args=("ctx",), daemon=True)
    waiter.start()
    _until(lambda: off.waiting[("app", "ctx")] == 1, "one waiting")
    assert not lead2.awaited("ctx")                     # early=False: only after the answer
    lead2.done()
    _until(lambda: not waiter.is_alive() or off.loading, "the waiter leads")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny server with one context, and the tiny model."""
    from sparkv.edge.client import EdgeClient
    from sparkv.runtime.generate import sample_text
    from sparkv.runtime.model import load_model

    tmp = tmp_path_factory.mktemp("early")
    srv = start_tiny_server(tmp)
    key = srv.keys["alice"]
    client = EdgeClient(srv.url, key, timeout_s=120)
    cid = client.create_context(text=sample_text()[:3000], levels=["raw", "q5"], chunk_tokens=32)
    client.close()
    lm = load_model(str(shared_tiny_checkpoint()), progress=False)
    yield {"srv": srv, "key": key, "cid": cid, "lm": lm, "tmp": tmp}
    stop_checked(srv)


def _choices(world, monkeypatch, early: bool, name: str, question: str = "What is it about?",
             **options) -> list[dict]:
    """Three sampled choices of one request (one admission group) about the world's context,
    not yet kept, through an in-process ask service: their done events and its kept contexts.
    The loader looks at the table only once both others wait (so that the run does not depend
    on how fast their threads start)."""
    from sparkv.asks import AskRequest, AskService
    from sparkv.device import ContextService
    from sparkv.device.owners import ContextOwners
    from sparkv.edge.kept import KeptAsks
    from sparkv.edge.options import AskOptions

    svc = ContextService(world["lm"], 200_000_000, world["tmp"] / name)
    asks = AskService(svc, ContextOwners(), slots=2, queue=2, early_keep=early)
    looked = KeptAsks.awaited
    streamed: list[int] = []          # the loader's tokens out when it looked

    def awaited(self, context_id):
        _until(lambda: sum(asks._keeping.waiting.values()) == 2, "two choices waiting")
        ticket = asks._tickets[threading.current_thread().name.removeprefix("sparkv-")]
        streamed.append(len(ticket.streamed))
        return looked(self, context_id)

    monkeypatch.setattr(KeptAsks, "awaited", awaited)
    try:
        reqs = [AskRequest(world["srv"].url, world["cid"], question, world["key"],
                           AskOptions(strategy="local", backend="dense", level="raw",
                                      max_new_tokens=6, stop_at_eos=False,
                                      keep=options.get("keep", True), temperature=1.0,
                                      seed=40 + i, **{k: v for k, v in options.items()
                                                      if k != "keep"}))
                for i in range(3)]
        done = [t.wait(GUARD_S) for t in asks.submit_group("app", reqs)]
        assert asks.wait_idle(GUARD_S)                  # every runner's end done
        kept = svc.list()
        tails = [t.tokens for t in svc.tails._tails.values()]
        aot = svc.counters.aot_written_bytes
    finally:
        monkeypatch.setattr(KeptAsks, "awaited", looked)
        asks.close()
        svc.close()
    assert all(d["type"] == "done" for d in done), done
    return [*done, {"kept": kept, "tails": tails, "streamed": streamed, "aot": aot}]


def test_a_loader_others_wait_for_keeps_the_context_at_its_first_token(world, monkeypatch):
    *early, got = _choices(world, monkeypatch, True, "on")
    loader = [d for d in early if d["stats"]["strategy"] == "local"]
    readers = [d for d in early if d["stats"]["strategy"] == "kept"]
    assert len(loader) == 1 and len(readers) == 2, [d["stats"]["strategy"] for d in early]
    assert loader[0]["stats"]["kept_early_s"] is not None
    assert got["streamed"] == [1]        # looked once, its first token out: its TTFT unchanged
    assert len(got["kept"]) == 1                                    # kept once, by the loader
    assert {d["kept_id"] for d in early} == {got["kept"][0].id}
    ends = {tokens[-5:] for tokens in got["tails"]}        # the loader's turn, kept after it
    assert tuple(loader[0]["tokens"][:-1]) in ends
    *after, got_after = _choices(world, monkeypatch, False, "off")
    assert all(d["stats"].get("kept_early_s") is None for d in after)
    assert sorted(d["stats"]["strategy"] for d in after) == ["kept", "kept", "local"]
    # the same seeds draw the same tokens, kept early or after the answer
    assert [d["tokens"] for d in early] == [d["tokens"] for d in after]
    assert len(got_after["kept"]) == 1


LONG_QUESTION = ("Which of the people named in this text does the most, and what does each of "
                 "them do in the end?")


def test_the_other_choices_take_the_loaders_question_rows(world, monkeypatch):
    """Kept at the loader's first token, the context comes with the question's KV as the app's
    turn: the other choices run only their question's last token (as they do when the context
    is kept after the answer, with the loader's whole turn), and draw the same tokens."""
    from sparkv.edge.prompts import question_suffix

    n = len(question_suffix(world["lm"], LONG_QUESTION))
    assert n > 17
    *early, _ = _choices(world, monkeypatch, True, "rows-on", LONG_QUESTION)
    readers = [d for d in early if d["stats"]["strategy"] == "kept"]
    assert [d["stats"]["turn_tokens_reused"] for d in readers] == [n - 1, n - 1]
    *after, _ = _choices(world, monkeypatch, False, "rows-off", LONG_QUESTION)
    assert [d["tokens"] for d in early] == [d["tokens"] for d in after]


def test_a_loader_with_a_decode_policy_keeps_the_context_before_its_answer(world, monkeypatch):
    """Under a decode policy (DynaKV may drop the loaded cache's entries as it decodes) the
    loader keeps the context before its answer: whole, the others answer from it."""
    *done, got = _choices(world, monkeypatch, True, "policy", decode="dynakv")
    loader = [d for d in done if d["stats"]["strategy"] == "local"]
    assert len(loader) == 1 and loader[0]["stats"]["kept_early_s"] is not None
    assert got["streamed"] == [0]                   # looked before its first token
    assert sorted(d["stats"]["strategy"] for d in done) == ["kept", "kept", "local"]
    assert len(got["kept"]) == 1


def test_choices_that_keep_nothing_load_the_context_once_and_keep_nothing(world, monkeypatch):
    """A request of sampled choices with ``keep`` off (sparkv.asks.choicecopy): one choice
    loads, the others read its copy, which is gone at the request's end; the same tokens as the
    same request keeping the context."""
    *kept, got_kept = _choices(world, monkeypatch, True, "keep-on")
    *done, got = _choices(world, monkeypatch, True, "keep-off", keep=False)
    assert sorted(d["stats"]["strategy"] for d in done) == ["kept", "kept", "local"]
    assert all(d["kept_id"] is None and d["not_kept"] is None for d in done)
    assert got["kept"] == []
    assert got["tails"] == []                                   # its turn went with it
    assert got["aot"] == 0 < got_kept["aot"]           # the copy was never written to flash
    assert [d["tokens"] for d in done] == [d["tokens"] for d in kept]
    assert len(got_kept["kept"]) == 1


def test_a_choices_copy_a_crash_left_is_deleted_at_the_next_start(world, tmp_path):
    from sparkv.asks import AskService
    from sparkv.asks.choicecopy import MARK, ChoicesCopy
    from sparkv.device import ContextService
    from sparkv.device.owners import ContextOwners

    lm, ids = world["lm"], list(range(5, 45))
    svc = ContextService(lm, 200_000_000, tmp_path / "flash")
    owners = ContextOwners()
    try:
        left = svc.new_context(system_ids=ids, label=ChoicesCopy(2).label("srv#ctx"))
        mine = svc.new_context(system_ids=ids, label="srv#ctx")
        owners.claim(left, "app")
        assert MARK in svc.describe(left).label
        AskService(svc, owners, slots=1, queue=1).close()
        assert [c.id for c in svc.list()] == [mine]        # the app's own kept context stays
        assert not owners.visible(left, "app")
    finally:
        svc.close()


def test_an_ask_answered_from_its_kept_context_tells_the_link_plan_it_streams_nothing(
        world, monkeypatch):
    """Its seat is heard from at once (0 bytes), so it holds no later ask off the link
    (sparkv.asks.linkplan: an ask not heard from keeps the later ones off for a while)."""
    from sparkv.asks import AskRequest, AskService
    from sparkv.asks.linkplan import LinkPlan
    from sparkv.device import ContextService
    from sparkv.device.owners import ContextOwners
    from sparkv.edge.options import AskOptions

    heard: list[tuple[int, float]] = []
    turn = LinkPlan.turn

    def spy(self, seat_id, pending_bytes):
        heard.append((seat_id, float(pending_bytes)))
        return turn(self, seat_id, pending_bytes)

    monkeypatch.setattr(LinkPlan, "turn", spy)
    svc = ContextService(world["lm"], 200_000_000, world["tmp"] / "kept-heard")
    asks = AskService(svc, ContextOwners(), slots=2, queue=2)
    try:
        req = AskRequest(world["srv"].url, world["cid"], "What is it about?", world["key"],
                         AskOptions(strategy="sparkv", backend="dense", level="raw",
                                    max_new_tokens=2, keep=True))
        first = asks.submit("app", req).wait(GUARD_S)
        assert first["type"] == "done" and first["kept_id"], first
        loads = {seat for seat, _ in heard}
        again = asks.submit("app", req).wait(GUARD_S)
        assert asks.wait_idle(GUARD_S)
    finally:
        asks.close()
        svc.close()
    assert again["type"] == "done" and again["stats"]["strategy"] == "kept", again["stats"]
    kept_calls = [(seat, b) for seat, b in heard if seat not in loads]
    assert kept_calls and all(b == 0.0 for _, b in kept_calls)
