"""The parts of the device service's asks, each alone: the compute worker's gate (one unit at a
time, in arrival order, cancellation, the load), admission (slots, a bounded queue, 429), the
owners of contexts, app tokens and Unix peer credentials. Logic tests: no model, no timing."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from sparkv.asks.admission import Admission
from sparkv.asks.cores import CoreGate
from sparkv.device.errors import QueueFull, ShuttingDown
from sparkv.device.identity import USER, app_key, app_token, peer_app, token_app
from sparkv.device.owners import ContextOwners
from sparkv.edge.lane import AskCancelled, LaneStepper
from sparkv.rest.peer import peer_credentials

GUARD_S = 30.0   # hang guard of a thread join (never a timing assertion)


def _until(cond, what: str) -> None:
    deadline = time.monotonic() + GUARD_S
    while not cond():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.005)


# ---- the gate: one unit at a time, in arrival order ------------------------------------------------
def test_in_turns_the_gate_grants_units_in_arrival_order_one_at_a_time():
    gate = CoreGate(order="turns")
    first = gate.lane()
    order: list[str] = []
    running = [0]
    most = [0]

    def unit(name: str, lane) -> None:
        with lane.hold():
            running[0] += 1
            most[0] = max(most[0], running[0])
            order.append(name)
            running[0] -= 1

    threads = []
    with first.hold():                       # the cores are taken: everyone else queues
        for i, name in enumerate("abc"):
            th = threading.Thread(target=unit, args=(name, gate.lane()))
            th.start()
            threads.append(th)
            _until(lambda: gate.stats()["waiting"] == i + 1, f"{name} waits")
        assert gate.load() == 4.0            # the holder and three waiting asks
    for th in threads:
        th.join(GUARD_S)
    assert order == ["a", "b", "c"] and most[0] == 1
    assert gate.stats()["units"] == 4


def test_a_cancelled_lane_stops_waiting_and_takes_no_further_unit():
    gate = CoreGate()
    holder, waiter = gate.lane(), gate.lane()
    outcome: list[object] = []

    def wait_for_unit() -> None:
        try:
            with waiter.hold():
                outcome.append("ran")
        except AskCancelled as e:
            outcome.append(e)

    with holder.hold():
        th = threading.Thread(target=wait_for_unit)
        th.start()
        _until(lambda: gate.stats()["waiting"] == 1, "the second lane waits")
        waiter.cancel()
        th.join(GUARD_S)
        assert len(outcome) == 1 and isinstance(outcome[0], AskCancelled)
        assert gate.stats()["waiting"] == 0
    with pytest.raises(AskCancelled):        # and never gets the cores again
        with waiter.hold():
            pass
    holder.cancel()                          # a holder finishes its unit; its next one raises
    with pytest.raises(AskCancelled):
        holder.check()


def test_the_load_counts_the_asks_using_the_cores_and_forgets_closed_ones():
    gate = CoreGate(window_s=3600, order="turns")
    a, b = gate.lane(), gate.lane()
    assert a.load() == 1.0                   # alone (b never used the cores)
    with b.hold():
        pass
    assert a.load() == 2.0 and b.load() == 1.0   # a has not used them: b is alone on them
    b.close()
    assert a.load() == 1.0


class _Clock:
    """A clock a test moves by hand (the gate's load reads its window on it)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_busy_load_is_the_share_of_the_window_the_asks_before_one_ran():
    clock = _Clock()
    gate = CoreGate(window_s=1.0, order="oldest", clock=clock)
    old, young = gate.lane(), gate.lane()
    assert young.gate.busy_load(young) == 1.0          # nothing ran: the cores are free
    with old.hold():
        clock.now += 0.5                                # the old ask ran half the window
    assert gate.busy_load(young) == pytest.approx(2.0)
    assert gate.busy_load(old) == 1.0                   # the young ask ran nothing before it
    with young.hold():
        clock.now += 0.25
    assert gate.busy_load(old) == 1.0                   # younger units never count for the old
    assert gate.busy_load(young) == pytest.approx(1 / (1 - 0.5))   # its own do not count
    assert gate.busy_load() == pytest.approx(1 / (1 - 0.75))       # every unit, without a lane
    with old.hold():                                    # the running unit counts as it runs
        clock.now += 0.25
        assert gate.busy_load(young) == pytest.approx(1 / (1 - 0.75))
    clock.now += 5.0                                    # the window forgets
    assert gate.busy_load(young) == 1.0
    with old.hold():
        clock.now += 10.0                               # the cores all but never the young's
    assert gate.busy_load(young) == pytest.approx(1 / (1 - 0.95))


def test_in_turns_every_other_asks_units_count_in_the_busy_load():
    clock = _Clock()
    gate = CoreGate(window_s=2.0, order="turns", clock=clock)
    a, b = gate.lane(), gate.lane()
    with b.hold():
        clock.now += 1.0
    assert gate.busy_load(a) == pytest.approx(2.0) and gate.busy_load(b) == 1.0


def test_a_planned_ask_plans_with_the_busy_load_the_others_with_the_count():
    from sparkv.asks.linkplan import LinkPlan

    clock = _Clock()
    gate, plan = CoreGate(window_s=1.0, order="oldest", clock=clock), LinkPlan("oldest")
    old, planned, unplanned = gate.lane(), gate.lane(), gate.lane()
    planned.seat = plan.seat(planned.id, "sparkv")      # the link plan schedules it
    unplanned.seat = plan.seat(unplanned.id, "hybrid")  # not planned: an even share
    with old.hold():
        clock.now += 0.1                                # the old ask ran a tenth of the window
    assert planned.load() == pytest.approx(1 / 0.9)
    assert unplanned.load() == 2.0                      # itself and the old ask, counted


def test_only_the_first_ask_runs_a_column_of_layer_steps_as_one_unit():
    gate = CoreGate(order="oldest")
    old, young = gate.lane(), gate.lane()
    assert old.first() and not young.first()
    old.close()
    assert young.first()
    turns = CoreGate(order="turns")
    a, b = turns.lane(), turns.lane()
    assert not a.first() and not b.first()


def test_in_first_tokens_order_loading_asks_go_before_answering_ones_until_an_answer_waited():
    clock = _Clock()
    gate = CoreGate(window_s=3600, order="first-tokens", clock=clock)
    holder, answering, loading = gate.lane(), gate.lane(), gate.lane()
    answering.answered()                      # the older ask has its first token
    order: list[str] = []

    def unit(name: str, lane) -> None:
        with lane.hold():
            order.append(name)

    def queue_both() -> list[threading.Thread]:
        threads = []
        for name, lane in (("answering", answering), ("loading", loading)):
            th = threading.Thread(target=unit, args=(name, lane))
            th.start()
            threads.append(th)
            _until(lambda: gate.stats()["waiting"] == len(threads), f"{name} waits")
        return threads

    with holder.hold():
        threads = queue_both()
        assert loading.load() == 2.0 and answering.load() == 3.0   # holder and loading first
        assert not loading.first() and not answering.first()
    for th in threads:
        th.join(GUARD_S)
    assert order == ["loading", "answering"]  # in oldest order: answering, loading
    order.clear()
    with holder.hold():
        threads = queue_both()
        clock.now += 1.0                      # the answer's unit waited its limit: it goes first
    for th in threads:
        th.join(GUARD_S)
    assert order == ["answering", "loading"]
    holder.close()
    assert loading.first() and not answering.first()


def test_an_asks_first_forward_pass_makes_it_answering_and_its_chosen_tokens_are_reported():
    import torch

    from sparkv.runtime.sampling import Sampling, TokenChooser

    from sparkv.asks import forward

    class Out:
        def __init__(self) -> None:
            self.logits = torch.tensor([[[0.0, 3.0, 1.0]]])

    model = torch.nn.Module()
    model.forward = lambda *a, **k: Out()      # type: ignore[method-assign]
    forward.install(model)
    gate = CoreGate(order="first-tokens")
    lane, tokens = gate.lane(), []
    with forward.bound(lane, lambda t, lp: tokens.append(t)):
        assert not lane.answering
        out = model()
        assert lane.answering and tokens == []      # a pass chooses nothing: its chooser does
        choose = TokenChooser(Sampling(temperature=1.0, top_k=2, seed=3))
        drawn = choose(out.logits[0, -1])
        model()
        TokenChooser()(out.logits[0, -1])
    TokenChooser()(out.logits[0, -1])              # unbound: not the ask's
    assert drawn in (1, 2) and tokens == [drawn, 1] and lane.units == 2


def test_a_lane_stepper_runs_each_step_on_the_lane_and_counts_its_memory():
    gate = CoreGate()
    lane = gate.lane()

    class Memory:
        nbytes = 1234

    class Stepper:
        geometry = "g"

        def __init__(self):
            self.kv = Memory()

        def run_step(self, step):
            assert lane.holding
            return step

        def run_column(self, t, l0, l1):
            assert lane.holding
            return list(range(l0, l1))

        def run_span(self, t0, t1, l):  # noqa: E741
            assert lane.holding
            return list(range(t0, t1))

    stepper = LaneStepper(Stepper(), lane)
    assert stepper.run_step((0, 1)) == (0, 1) and stepper.geometry == "g"
    assert stepper.run_column(0, 0, 3) == [0, 1, 2] and lane.units == 2
    assert stepper.run_span(2, 5, 1) == [2, 3, 4] and lane.units == 3
    assert gate.held() == (1, 1234)
    del stepper
    assert gate.held() == (0, 0)             # no reference kept: freed with its ask


def test_a_span_is_one_unit_for_the_first_ask_and_step_by_step_for_the_others():
    gate = CoreGate(order="oldest")
    old, young = gate.lane(), gate.lane()

    class Memory:
        nbytes = 1

    class Stepper:
        def __init__(self, lane):
            self.kv, self.lane, self.calls = Memory(), lane, []

        def run_step(self, step):
            assert self.lane.holding
            self.calls.append(("step", tuple(step)))
            return step

        def run_span(self, t0, t1, l):  # noqa: E741
            assert self.lane.holding
            self.calls.append(("span", t0, t1, l))
            return list(range(t0, t1))

    first, second = Stepper(old), Stepper(young)
    LaneStepper(first, old).run_span(0, 3, 2)
    LaneStepper(second, young).run_span(0, 3, 2)
    assert first.calls == [("span", 0, 3, 2)] and old.units == 1
    assert second.calls == [("step", (t, 2)) for t in range(3)] and young.units == 3


# ---- admission: slots, a bounded queue, then 429 -----------------------------------------------
def test_admission_queues_in_order_then_refuses_with_retry_after():
    adm = Admission(slots=1, queue=2)
    run = adm.enter()
    w1, w2 = adm.enter(), adm.enter()
    assert run.running and not w1.running and (w1.position(), w2.position()) == (1, 2)
    with pytest.raises(QueueFull) as err:
        adm.enter()
    assert err.value.status == 429 and int(err.value.headers["Retry-After"]) >= 1
    gone = threading.Event()
    gone.set()
    assert w1.wait(gone) is False            # cancelled while waiting: it leaves the queue
    assert w2.position() == 1
    run.leave()
    assert w2.running and w2.wait(threading.Event())
    assert adm.stats() == {"slots": 1, "queue": 2, "running": 1, "waiting": 0, "refused": 1}
    w2.leave()
    w2.leave()                               # once
    assert adm.stats()["running"] == 0
    adm.close()
    with pytest.raises(ShuttingDown):
        adm.enter()


def test_a_group_of_asks_shares_one_slot_until_its_last_leaves():
    """A request's choices (``enter_group``) take one slot together, or one queue place, and
    give it back with the last of them; one cancelled while waiting leaves the group."""
    adm = Admission(slots=1, queue=1)
    group = adm.enter_group(3)
    assert all(p.running for p in group) and adm.stats()["running"] == 1
    later = adm.enter_group(2)                 # one queue place for both
    assert [p.position() for p in later] == [1, 1] and adm.stats()["waiting"] == 1
    with pytest.raises(QueueFull):
        adm.enter()
    gone = threading.Event()
    gone.set()
    assert later[0].wait(gone) is False        # cancelled: the other still waits
    assert adm.stats()["waiting"] == 1
    group[0].leave()
    group[1].leave()
    group[1].leave()                           # once
    assert not later[1].running                # one of the group still runs
    group[2].leave()
    assert later[1].running and later[1].wait(threading.Event())
    later[1].leave()
    assert adm.stats() == {"slots": 1, "queue": 1, "running": 0, "waiting": 0, "refused": 1}
    with pytest.raises(ValueError):
        adm.enter_group(0)


# ---- owners, app tokens, peer credentials --------------------------------------------------------
def test_owners_are_kept_on_disk_and_say_who_sees_what(tmp_path):
    path = tmp_path / "owners.json"
    owners = ContextOwners(path)
    owners.claim("c1", "app:a")
    owners.claim("c2", "app:b", ["app:a"])
    assert owners.visible("c1", "app:a") and not owners.visible("c1", "app:b")
    assert owners.visible("c2", "app:a") and owners.owner("c2") == "app:b"
    assert owners.visible("legacy", USER) and not owners.visible("legacy", "app:a")
    owners.share("c1", ["*"])
    again = ContextOwners(path)              # a restarted service
    assert again.visible("c1", "uid:1234") and again.describe("c2") == {
        "owner": "app:b", "shared_with": ["app:a"]}
    again.forget("c2")
    assert not ContextOwners(path).visible("c2", "app:a")
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_app_tokens_name_their_app_and_nothing_else(tmp_path):
    key = app_key(tmp_path)
    assert app_key(tmp_path) == key and oct((tmp_path / "apps.key").stat().st_mode & 0o777) == "0o600"
    token = app_token(key, "notes")
    assert token_app(key, token) == "app:notes"
    forged = token[:-1] + ("0" if token[-1] != "0" else "1")
    assert token_app(key, forged) is None
    assert token_app(app_key(tmp_path / "other"), token) is None     # another service's key
    assert token_app(key, token.replace("notes", "mail")) is None
    with pytest.raises(Exception, match="app's name"):
        app_token(key, "Not A Name")


def test_peer_credentials_name_the_connecting_user(tmp_path):
    path = str(tmp_path / "s.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(1)
    cli = socket.socket(socket.AF_UNIX)
    cli.connect(path)
    conn, _ = srv.accept()
    try:
        peer = peer_credentials(conn)
        assert peer is not None and (peer.pid, peer.uid) == (os.getpid(), os.geteuid())
        assert peer_app(peer.uid) == USER and peer_app(peer.uid + 1) == f"uid:{peer.uid + 1}"
    finally:
        for s in (conn, cli, srv):
            s.close()
    tcp = socket.socket()
    try:
        assert peer_credentials(tcp) is None
    finally:
        tcp.close()


def test_the_concurrency_benchmark_summarizes_each_batch_and_its_ratios():
    import argparse

    from sparkv.bench.concurrency import _point, _ratios

    args = argparse.Namespace(watts_compute=3.0, watts_decode=1.5, watts_radio=1.2, watts_idle=0.3)

    def done(ttft: float, mb: float) -> dict:
        return {"first_token_s": ttft, "total_s": ttft + 0.5, "queued_s": 0.0,
                "stats": {"bytes_streamed": int(mb * 1e6), "chunks_streamed": 1,
                              "chunks_computed": 2, "fallback": {}, "local_compute_s": 1.0,
                              "ttft_s": ttft}}

    points = []
    for strategy, ttfts in (("sparkv", {1: [1.0], 2: [1.2, 1.6]}),
                            ("hybrid", {1: [1.5], 2: [2.0, 3.0]})):
        for n, xs in ttfts.items():
            outs = [done(x, 2.0) for x in xs] + ([RuntimeError("gone")] if n == 2 else [])
            points.append(_point(strategy, n, {"outs": outs, "makespan_s": max(xs),
                                               "rss_peak_bytes": 2**30 * n}, args))
    two = points[1]
    assert two["ttft_p50_s"] == 1.2 and two["ttft_max_s"] == 1.6        # the nearest rank
    assert two["failed"] == ["RuntimeError: gone"]
    assert two["answer_s"] == pytest.approx([0.5, 0.5]) and two["answer_max_s"] == pytest.approx(0.5)
    assert two["mb_per_ask"] == 2.0 and two["energy_j_per_ask"] == pytest.approx(3.0 + 0.3 * 1.4)
    r = _ratios(points)
    assert r["n"] == 2 and r["hybrid_over_sparkv_p50"] == 2.0 / 1.2
    assert r["sparkv_p50_over_n_times_single"] == {2: 1.2 / 2.0}
    assert r["rss_top_over_rss_1"] == 2.0


def test_the_naive_comparison_summarizes_the_processes_and_compares_with_the_service():
    import argparse

    from sparkv.bench.naive import ask_argv, compare, naive_point

    outs = [{"stats": {"ttft_s": t, "bytes_streamed": 3_000_000}} for t in (2.0, 4.0, 3.0)]
    nav = naive_point("sparkv", 4, {"outs": outs + ["Traceback: model load failed"],
                                    "makespan_s": 12.0, "rss_peak_bytes": 4 * 2**30})
    assert nav["ttft_p50_s"] == 3.0 and nav["ttft_max_s"] == 4.0
    assert nav["failed"] == ["Traceback: model load failed"]
    assert nav["mb_per_ask"] == 3.0 and nav["rss_peak_mb"] == 4096
    svc = {"strategy": "sparkv", "n": 4, "makespan_s": 6.0, "ttft_p50_s": 1.5,
           "rss_peak_mb": 1024.0}
    c = compare(svc, nav)
    assert c["naive_over_service_makespan"] == 2.0 and c["naive_over_service_ttft_p50"] == 2.0
    assert c["naive_over_service_rss"] == 4.0
    assert compare({**svc, "makespan_s": 0.0}, nav)["naive_over_service_makespan"] is None
    # each naive app emulates no link of its own: the one veth shapes them all
    argv = ask_argv("http://10.213.0.2:18080", "a" * 32, "q?", "sparkv",
                    argparse.Namespace(max_new_tokens=8, model=None))
    assert "--mbps" not in argv and "--trace" not in argv
    assert argv[argv.index("--context") + 1] == "a" * 32


def test_in_oldest_order_the_oldest_asks_unit_goes_first_and_its_load_ignores_younger_asks():
    gate = CoreGate(window_s=3600, order="oldest")
    holder, old, young = gate.lane(), gate.lane(), gate.lane()
    order: list[str] = []

    def unit(name: str, lane) -> None:
        with lane.hold():
            order.append(name)

    threads = []
    with holder.hold():                       # the cores are taken: the young ask queues first
        for name, lane in (("young", young), ("old", old)):
            th = threading.Thread(target=unit, args=(name, lane))
            th.start()
            threads.append(th)
            _until(lambda: gate.stats()["waiting"] == len(threads), f"{name} waits")
        assert young.load() == 3.0 and old.load() == 2.0 and holder.load() == 1.0
    for th in threads:
        th.join(GUARD_S)
    assert order == ["old", "young"]          # in turns it would be young, old
    with pytest.raises(ValueError):
        CoreGate(order="random")


def _waiting_unit(gate: CoreGate, lane, order: list[str], name: str) -> threading.Thread:
    """A thread whose unit waits for ``lane``'s turn (started; waiting once this returns)."""
    waiting = gate.stats()["waiting"]

    def unit() -> None:
        with lane.hold():
            order.append(name)

    th = threading.Thread(target=unit)
    th.start()
    _until(lambda: gate.stats()["waiting"] == waiting + 1, f"{name} waits")
    return th


def _old_and_young(regrant_s: float):
    """An ``oldest`` gate keeping the cores ``regrant_s``, its two lanes, and a grant record."""
    gate = CoreGate(order="oldest", regrant_s=regrant_s)
    return gate, gate.lane(), gate.lane(), []


def test_the_cores_are_kept_for_the_older_ask_between_its_units():
    # its next unit comes a few milliseconds after its last: the younger ask's waiting unit
    # does not take the cores in that gap (with a long regrant_s the only way it could run
    # first is that bug, whatever the machine's speed)
    gate, old, young, order = _old_and_young(3600.0)
    with old.hold():
        th = _waiting_unit(gate, young, order, "young")
    time.sleep(0.2)                          # its thread picks its next unit (the young one's
    with old.hold():                         # chance to take the cores, were they not kept)
        order.append("old")
    assert order == ["old"] and th.is_alive()
    old.close()                              # an ended ask keeps nothing
    th.join(GUARD_S)
    assert order == ["old", "young"]


def test_kept_cores_go_to_the_others_when_the_ask_asks_for_nothing():
    gate, old, young, order = _old_and_young(0.05)
    with old.hold():
        th = _waiting_unit(gate, young, order, "young")
    th.join(GUARD_S)                         # the old ask waits for its link: nothing asked
    assert order == ["young"]
    # a cancelled ask keeps nothing either
    gate, old, young, _ = _old_and_young(3600.0)
    with old.hold():
        th = _waiting_unit(gate, young, order, "young again")
        old.cancel()
    th.join(GUARD_S)
    assert order == ["young", "young again"]


@pytest.mark.parametrize("order_name, keeper, answering", [
    ("turns", 0, ()),         # no ask ranks strictly first
    ("oldest", 1, ()),        # a young ask's units keep nothing from an older one's
    ("oldest", 0, (0,)),      # an answering ask keeps nothing: the others' first tokens go on
    ("oldest", 0, (1,)),      # and an answering ask's tokens are not held
])
def test_the_cores_are_kept_only_between_two_loading_asks_in_rank(order_name, keeper, answering):
    gate = CoreGate(order=order_name, regrant_s=3600.0)
    lanes = [gate.lane(), gate.lane()]
    for i in answering:
        lanes[i].answered()
    order: list[str] = []
    with lanes[keeper].hold():
        th = _waiting_unit(gate, lanes[1 - keeper], order, "other")
    th.join(GUARD_S)
    assert order == ["other"]


def test_a_server_url_no_client_can_reach_is_refused_by_the_schema_or_as_a_bad_ask():
    """The fuzzer found it: a host IDNA refuses made the ask's client constructor raise deep in
    httpx (a 500 and a traceback). The schema takes ASCII hosts only; what passes it and httpx
    still refuses (an IPv6 literal that is not one, a port that is not a number) is a 400 ``bad_server_url``."""
    from pydantic import ValidationError

    from sparkv.asks.schemas import AskBody
    from sparkv.asks.service import BadServerUrl, ask_error
    from sparkv.edge.client import EdgeClient

    for url in ("http://a\U000e6ced\U0002c00f", "http://exa mple", "ftp://x", "http://x/?q"):
        with pytest.raises(ValidationError):
            AskBody(context_id="a" * 32, question="q", server=url)
    AskBody(context_id="a" * 32, question="q", server="http://xn--bcher-kva.example:8080/api")
    # pass the schema, not httpx or the resolver (a label over 63 characters, an empty one:
    # found by the fuzzer again, raised by getaddrinfo mid-ask; an xn-- label that is no IDNA:
    # httpx raised a bare IDNA error)
    for url in ("http://[zz]", "http://x:abc", "http://" + "a" * 64 + ".example", "http://a..b",
                "http://xn--a.example"):
        AskBody(context_id="a" * 32, question="q", server=url)
        with pytest.raises(ValueError, match="not a server URL"):
            EdgeClient(url)
    assert ask_error(BadServerUrl("not a server URL"))[:2] == (400, "bad_server_url")


def test_a_quiet_ask_is_waited_for_past_the_disconnect_poll():
    """The non-streamed chat completion looks for a gone client every DISCONNECT_POLL_S; an ask
    quiet for longer (loading, a loaded machine) must still be waited for. Found at load 8:
    ``wait_for(anext(...))`` cancelled the wait, which closed the event generator, and the next
    look raised StopAsyncIteration (a 500). The ticket's events come from another thread, 3
    polls apart (a fake clock is not possible across threads: the gap is what is tested, not
    its length)."""
    import asyncio
    import threading

    from sparkv.asks import completion as chat
    from sparkv.asks.tickets import AskTicket

    class Request:
        looks = 0

        async def is_disconnected(self) -> bool:
            Request.looks += 1
            return False

    ticket = AskTicket("a1", "app", None, None, lambda ids: "")   # type: ignore[arg-type]
    gap = 3 * chat.DISCONNECT_POLL_S

    def later() -> None:
        threading.Event().wait(gap)
        ticket.put({"type": "token", "text": "x"})
        threading.Event().wait(gap)
        ticket.finish({"type": "done", "text": "x"})

    threading.Thread(target=later, daemon=True).start()
    event = asyncio.run(chat.outcome(ticket, Request(), []))  # type: ignore[arg-type]
    assert event == {"type": "done", "text": "x"}
    assert Request.looks >= 2                                  # it looked, and kept waiting


def test_the_device_priors_carry_what_streaming_costs_the_compute_path_from_ask_to_ask():
    """Each ask plans with the device's stream and receive taxes and hands back what its load
    taught its session (the taxes were never carried: every ask of the device service planned
    as if streaming cost its steps nothing)."""
    from types import SimpleNamespace

    from sparkv.asks.linkplan import LinkPlan, LinkSeat
    from sparkv.asks.service import AskService, _LinkShare
    from sparkv.edge.session import Priors

    svc = AskService.__new__(AskService)
    svc.priors, svc._link = Priors(stream_tax_s=0.003, receive_tax=0.25), _LinkShare()
    start = svc._plan_priors(2, LinkSeat(LinkPlan("oldest"), None))
    assert (start.stream_tax_s, start.receive_tax) == (0.003, 0.25)
    learned = SimpleNamespace(priors=Priors(stream_tax_s=0.004, receive_tax=0.3))
    svc._learn(learned, SimpleNamespace(load=None), 1.0)
    assert (svc.priors.stream_tax_s, svc.priors.receive_tax) == (0.004, 0.3)


def test_a_question_the_edge_cannot_ask_is_refused_before_it_is_admitted():
    """A blank question (chat on: before, it was asked and answered as an empty turn) and a
    conversation with ``chat`` off are 400s from the request's checks, not errors once queued;
    the chat route's messages map to turns (``developer`` is ``system``, a tool's result the
    user's), a last message that is not the user's is ``unsupported_messages``."""
    from types import SimpleNamespace
    from typing import Any

    from sparkv.asks.chat import UnsupportedMessages, _question
    from sparkv.asks.routes import ask_request
    from sparkv.asks.schemas import AskFields, ChatBody
    from sparkv.device.errors import DeviceError
    from sparkv.runtime.turns import ChatTurn, Conversation

    asks: Any = SimpleNamespace(default_server="http://127.0.0.1:9", default_api_key=None)
    conv = Conversation.of("Q2?", [ChatTurn("user", "Q1?"), ChatTurn("assistant", "A1.")])
    with pytest.raises(DeviceError, match="has no text"):
        ask_request(AskFields(), asks, "a" * 32, " \n", 8)
    with pytest.raises(DeviceError, match="'chat' off"):
        ask_request(AskFields(chat=False), asks, "a" * 32, conv, 8)
    assert ask_request(AskFields(chat=False), asks, "a" * 32, " ", 8).question == " "
    assert ask_request(AskFields(), asks, "a" * 32, conv, 8).question == conv

    def body(*msgs: tuple[str, str]) -> ChatBody:
        return ChatBody(model="a" * 32, messages=[{"role": r, "content": c} for r, c in msgs])

    assert _question(body(("user", "Q?"))) == "Q?"
    assert _question(body(("developer", "Be brief."), ("user", "Q?"))) == Conversation(
        (ChatTurn("system", "Be brief."), ChatTurn("user", "Q?")))
    assert _question(body(("user", "Q?"), ("tool", "{}"))).turns[-1] == ChatTurn(
        "user", "<tool_response>\n{}\n</tool_response>")     # a tool's result: the user's turn
    for msgs, match in (((("user", "Q?"), ("assistant", "A")), "last message must be the user's"),
                        ((("user", "  "),), "has no text")):
        with pytest.raises(UnsupportedMessages, match=match):
            _question(body(*msgs))


def test_a_tickets_token_events_hold_back_what_may_begin_a_stop_string():
    """With ``stop``, the text a token event adds never shows a stop string or a start of one
    that may still complete (the done event's text is the answer's, cut by the generation)."""
    from sparkv.asks.tickets import AskRequest, AskTicket
    from sparkv.edge.options import AskOptions

    letters = "ab\nc\n\nd"
    req = AskRequest("http://127.0.0.1:9", "a" * 32, "q",
                     options=AskOptions(keep=True, stop=("\n\n", "zz")))
    ticket = AskTicket("a1", "app", req, None,                   # type: ignore[arg-type]
                       lambda ids: "".join(letters[i] for i in ids))
    for i in range(len(letters)):
        ticket.token(i)
    ticket.finish({"type": "done", "text": "ab\nc"})
    shown = [e["text"] for e in ticket.events(timeout_s=0) if e["type"] == "token"]
    assert shown == ["a", "b", "", "\nc", "", "", ""]


def test_a_streamed_answer_holds_back_text_that_may_begin_a_call_and_shows_prose_whole():
    """Prose that may begin a call is held back, then shown whole; a call is named as soon as
    its arguments begin and its arguments come as written (OpenAI's chunks: the first names
    the call, the next add to its arguments); one cut off before it is named is text, one cut
    off in its arguments stays a call, finish length."""
    from types import SimpleNamespace

    pytest.importorskip("fastapi")
    from sparkv.asks.answertext import AnswerText
    from sparkv.asks.completion import Completion, _choice_chunks
    from sparkv.runtime.toolform import Tool, ToolSet, call_text

    ask = SimpleNamespace(options=SimpleNamespace(max_new_tokens=64, stop=()), logprobs=None)
    asks = SimpleNamespace(lm=None, eos={0})
    c = Completion("m", asks, ask, ToolSet([Tool("note")], "auto"))
    text = [AnswerText(c)]

    def stream(pieces: list[str]) -> list[dict]:
        text[0] = AnswerText(c)
        out = []
        for p in pieces:
            out += _choice_chunks(c, {"type": "token", "text": p, "token": 1}, [0], text[0])
        done = {"type": "done", "text": "".join(pieces), "tokens": [1] * len(pieces)}
        return out + _choice_chunks(c, done, [0], text[0])

    def calls(chunks: list[dict]) -> list[tuple]:
        items = [t for ch in chunks for t in ch["choices"][0]["delta"].get("tool_calls", [])]
        return [(t["index"], t.get("id"), t["function"].get("name"),
                 t["function"]["arguments"]) for t in items]

    prose = stream([" <", "b> is", " bold"])
    assert [ch["choices"][0]["delta"].get("content") for ch in prose] == [" <b> is", " bold",
                                                                          None]
    assert prose[-1]["choices"][0]["finish_reason"] == "stop"
    call = call_text("note", '{"a": 1}')
    called = stream([call[:5], call[5:12], call[12:44], call[44:47], call[47:]])
    assert [ch["choices"][0]["finish_reason"] for ch in called] == [None] * 3 + ["tool_calls"]
    first, *more = calls(called)                 # as the three token pieces wrote them
    assert first[:3:2] == (0, "note") and first[1].startswith("call_") and len(more) == 2
    assert all(m[:3] == (0, None, None) for m in more)
    assert [a for *_, a in calls(called)] == ['{"', 'a":', ' 1}']
    cut = stream([call[:20]])                    # cut off before it is named: its text, as is
    assert cut[0]["choices"][0]["delta"]["content"] == call[:20]
    cut = stream([call[:44], call[44:46]])       # cut off in its arguments: a call, length
    assert [a for *_, a in calls(cut)] == ['{"', 'a"']
    assert cut[-1]["choices"][0]["finish_reason"] == "length"
    c.logprobs, c.lm = True, SimpleNamespace(decode_tokens=lambda ids: "t")
    text[0] = AnswerText(c)
    out = []
    for p in (" <", "b>"):                       # the held token's logprob comes with the next
        out += _choice_chunks(c, {"type": "token", "text": p, "token": 1, "logprob": -0.5,
                                  "top_logprobs": []}, [0], text[0])
    assert len(out) == 1 and len(out[0]["choices"][0]["logprobs"]["content"]) == 2


def test_an_asks_numbers_are_json_numbers():
    """The fuzzer found it: ``logit_bias: {"0": false}`` was read as a bias of 0 (pydantic's lax
    floats take booleans and numeric strings). Every float an ask takes is a JSON number: an int
    or a float, nothing else."""
    from pydantic import ValidationError

    from sparkv.asks.schemas import AskBody

    ask = AskBody(context_id="a" * 32, question="q", bandwidth_mbps=5, ask_deadline_s=1.5,
                  ram_budget=0.25, temperature=1, logit_bias={"7": -3})
    assert ask.bandwidth_mbps == 5.0 and ask.logit_bias == {"7": -3.0}
    for bad in ({"bandwidth_mbps": True}, {"ask_deadline_s": "2"}, {"ram_budget": False},
                {"temperature": True}, {"top_p": "1"}, {"logit_bias": {"7": False}}):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            AskBody(context_id="a" * 32, question="q", **bad)
