"""The overlap engine against a scripted ChunkSource (no server, no sockets): a cut at byte k,
a 503 and a 4xx, a cancellation mid-chunk, a slow-then-fast link, a link that never answers,
a silent link, and a starved reader that must not be mistaken for one. A tiny random Llama keeps
each test to seconds; every load must assemble exactly the reference KV cache."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import pytest
import torch

from helpers import AloneLane, raw_world

from sparkv.edge.engine import Engine, EngineConfig
from sparkv.edge.results import TransferStatus
from sparkv.edge.transport import ChunkSource, FetchItem, SourceError
from sparkv.layout import ChunkGeometry, StepId
from sparkv.protocol.stream import RecordPiece
from sparkv.runtime.attention import get_backend
from sparkv.runtime.stepper import LayerStepper
from sparkv.scheduler.controller import ControllerConfig
from sparkv.scheduler.instance import MBPS, Instance
from sparkv.scheduler.planners import get_planner

N_TOKENS, T = 96, 16


@dataclass
class Behaviour:
    """What one opened request does (see ScriptedSource)."""

    fail_open: SourceError | None = None     # raise at open (a 503, a 4xx, refused)
    hang_open: bool = False                  # never answer
    cut_at: int | None = None                # raise after this many body bytes
    hang_at: int | None = None               # stop sending (but keep the response open) here
    pace: Callable[[int], Any] | None = None  # called before each piece with bytes sent so far
    piece: int = 512


class ScriptedSource:
    """A ChunkSource from a dict of frames and a script: ``script(n)`` is the Behaviour of the
    n-th opened request (default: serve everything at once)."""

    def __init__(self, frames: dict, script: Callable[[int], Behaviour] | None = None) -> None:
        self.frames = frames
        self.script = script or (lambda n: Behaviour())
        self.opened: list[list[FetchItem]] = []
        self.closed_streams = 0
        self.closed = False
        self.sent_total = 0          # body bytes sent over every request

    def start(self) -> None:
        pass

    def rtt_s(self) -> float:
        return 0.0

    async def open(self, items: Sequence[FetchItem]) -> "ScriptedStream":
        b = self.script(len(self.opened))
        self.opened.append(list(items))
        if b.fail_open is not None:
            raise b.fail_open
        if b.hang_open:
            await asyncio.Event().wait()
        return ScriptedStream(self, list(items), b)

    async def aclose(self) -> None:
        self.closed = True


class ScriptedStream:
    def __init__(self, src: ScriptedSource, items: list[FetchItem], b: Behaviour) -> None:
        self.src, self.items, self.b = src, items, b

    async def __aiter__(self):
        sent = 0
        for idx, it in enumerate(self.items):
            data = self.src.frames[(it.cid, it.level)]
            assert len(data) == it.nbytes
            for pos in range(0, len(data), self.b.piece):
                part = data[pos:pos + self.b.piece]
                if self.b.cut_at is not None and sent + len(part) > self.b.cut_at:
                    raise SourceError(f"stream cut after {sent} bytes")
                if self.b.hang_at is not None and sent + len(part) > self.b.hang_at:
                    await asyncio.Event().wait()
                if self.b.pace is not None:
                    r = self.b.pace(sent)
                    if asyncio.iscoroutine(r):
                        await r
                sent += len(part)
                self.src.sent_total += len(part)
                yield RecordPiece(idx, part, pos + len(part) == len(data))

    async def aclose(self) -> None:
        self.src.closed_streams += 1


@pytest.fixture(scope="module")
def world(tiny_llama):
    """The tiny model's context, its reference KV and every chunk's raw frame."""
    return raw_world(tiny_llama, N_TOKENS, T, seed=1)


def _instance(world, mbps: float = 1000.0, step_s: float = 0.002) -> Instance:
    geo = world["geo"]
    sizes = {cid: {"raw": len(world["frames"][(cid, "raw")])} for cid in geo.chunk_ids()}
    return Instance.from_mappings(geo, sizes, {s: step_s for s in geo.step_ids()}, mbps * MBPS,
                                  t_proc=1e-4, name="tiny")


class SlowStepper(LayerStepper):
    """A slow device: every layer step takes at least ``step_s`` (the tiny model's steps take
    about a millisecond, faster than any link this test scripts)."""

    step_s = 0.03

    def run_step(self, step):
        t0 = time.perf_counter()
        res = super().run_step(step)
        time.sleep(max(0.0, self.step_s - (time.perf_counter() - t0)))
        res.seconds = max(res.seconds, self.step_s)
        return res


def _run_exact(engine: Engine, world):
    """Runs ``engine``; the assembled cache must be complete and equal the reference."""
    load = engine.run()
    assert load.kv.is_complete()
    for (k, v), (rk, rv) in zip(load.kv.layer_kv(), world["ref"]):
        torch.testing.assert_close(k, rk, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, rv, atol=1e-5, rtol=1e-5)
    return load


def _load(world, source: ChunkSource, *, planner: str = "stream", controller=None,
          config: EngineConfig | None = None, inst: Instance | None = None,
          stepper_class=LayerStepper):
    inst = inst or _instance(world)
    plan = get_planner(planner).plan(inst)
    stepper = stepper_class(world["lm"], world["tokens"], T, backend=get_backend("dense"))
    cfg = config or EngineConfig(retry_backoff_s=0.01)
    engine = Engine(stepper, plan, inst, controller or ControllerConfig.static(), source=source,
                    config=cfg)
    return _run_exact(engine, world)


def _statuses(load) -> dict:
    out: dict = {}
    for x in load.transfers:
        out[x.status] = out.get(x.status, 0) + 1
    return out


def test_everything_streamed_in_order(world):
    src = ScriptedSource(world["frames"])
    load = _load(world, src)
    geo = world["geo"]
    assert load.sources == {"streamed": geo.num_chunks} and not load.fallback
    assert _statuses(load) == {TransferStatus.ARRIVED: geo.num_chunks}
    assert load.bytes_streamed == load.bytes_received == sum(len(f) for f in src.frames.values())
    assert src.closed and src.closed_streams == len(src.opened)


def test_cut_at_byte_k_is_retried_from_the_cut_chunk(world):
    k = 6000   # inside the second frame
    src = ScriptedSource(world["frames"],
                         lambda n: Behaviour(cut_at=k) if n == 0 else Behaviour())
    load = _load(world, src)
    assert not load.fallback and load.sources == {"streamed": world["geo"].num_chunks}
    assert len(src.opened) >= 2 and any("cut" in e for e in load.link_errors)
    first, second = src.opened[0], src.opened[1]
    size0 = first[0].nbytes
    assert size0 < k < size0 + first[1].nbytes
    # the chunk cut mid-way is asked for again (first in the retry), the delivered one is not
    assert second[0].cid == first[1].cid and first[0].cid not in [x.cid for x in second]
    assert 0 < load.bytes_wasted <= k - size0   # the part of the cut frame that did arrive


def test_a_503_is_retried(world):
    src = ScriptedSource(world["frames"], lambda n: Behaviour(
        fail_open=SourceError("server error 503 store_unavailable: down")) if n == 0
        else Behaviour())
    load = _load(world, src)
    assert not load.fallback and any("503" in e for e in load.link_errors)
    assert load.sources == {"streamed": world["geo"].num_chunks}


def test_retries_exhausted_then_everything_is_computed(world):
    src = ScriptedSource(world["frames"], lambda n: Behaviour(
        fail_open=SourceError("server error 503 store_unavailable: down")))
    load = _load(world, src, config=EngineConfig(retries=2, retry_backoff_s=0.01))
    assert len(src.opened) == 3 and "503" in load.fallback["link"]
    assert load.sources == {"computed": world["geo"].num_chunks}
    assert _statuses(load) == {TransferStatus.LOST: len(src.opened[0])}


def test_a_4xx_kills_the_link_at_once(world):
    src = ScriptedSource(world["frames"], lambda n: Behaviour(
        fail_open=SourceError("server error 404 context_not_found: gone", fatal=True)))
    load = _load(world, src)
    assert len(src.opened) == 1 and "404" in load.fallback["link"]
    assert load.sources.get("computed") == world["geo"].num_chunks


def test_a_link_that_never_answers(world):
    src = ScriptedSource(world["frames"], lambda n: Behaviour(hang_open=True))
    cfg = EngineConfig(open_timeout_s=0.2, retries=1, retry_backoff_s=0.01,
                       stall_fallback_s=60.0)
    load = _load(world, src, config=cfg)
    assert len(src.opened) == 2 and "no response" in load.fallback["link"]
    assert load.sources == {"computed": world["geo"].num_chunks}


def test_a_response_that_stops_mid_chunk(world):
    src = ScriptedSource(world["frames"], lambda n: Behaviour(hang_at=3000) if n == 0
                         else Behaviour())
    cfg = EngineConfig(read_timeout_s=0.2, retry_backoff_s=0.01, stall_fallback_s=60.0)
    load = _load(world, src, config=cfg)
    assert any("no byte" in e for e in load.link_errors) and not load.fallback
    assert load.sources == {"streamed": world["geo"].num_chunks}


def test_silent_link_trips_the_stall_rule(world):
    """Nothing arrives while the loop is awake to see it: the compute thread, idle, computes
    what is missing (the link keeps going; whichever is first wins)."""
    async def pace(sent: int) -> None:
        if sent >= 2000:
            await asyncio.sleep(0.4)      # a trickle: the link is there but nearly silent
    src = ScriptedSource(world["frames"], lambda n: Behaviour(pace=pace))
    cfg = EngineConfig(stall_fallback_s=0.3, silence_grace_s=0.05, read_timeout_s=30.0)
    load = _load(world, src, config=cfg)
    assert "stalled" in load.fallback and load.silence_s >= 0.3
    assert load.sources.get("computed", 0) > 0


def test_a_starved_reader_is_not_a_silent_link(world):
    """The loop itself cannot run (this process is starved: here a blocking sleep in the link
    thread): that is no evidence against the link, so the stall rule must not fire."""
    def pace(sent: int) -> None:
        if sent and sent % 4096 == 0:
            time.sleep(0.5)               # blocks the event loop
    src = ScriptedSource(world["frames"], lambda n: Behaviour(pace=pace))
    cfg = EngineConfig(stall_fallback_s=0.3, silence_grace_s=0.05, read_timeout_s=30.0)
    load = _load(world, src, config=cfg)
    assert not load.fallback, load.fallback
    assert load.sources == {"streamed": world["geo"].num_chunks}


def test_slow_link_cancels_mid_chunk_and_migrates(world):
    """The plan streams everything; the link turns out far slower than planned, so the adaptive
    controller moves steps to the compute path, cancelling a chunk in the middle of its
    transfer; the cancelled remainder of the batch is requested again or computed."""
    async def pace(sent: int) -> None:
        await asyncio.sleep(0.02)         # 512 B / 20 ms: ~25 KB/s against 1 Gbit/s planned
    src = ScriptedSource(world["frames"], lambda n: Behaviour(pace=pace, piece=512))
    inst = _instance(world, mbps=1000.0, step_s=0.002)
    load = _load(world, src, planner="stream", controller=ControllerConfig(), inst=inst,
                 config=EngineConfig(retry_backoff_s=0.01, stall_fallback_s=60.0))
    st = _statuses(load)
    assert load.migrations and st.get(TransferStatus.CANCELLED, 0) >= 1
    mid = [x for x in load.transfers if x.status == TransferStatus.CANCELLED
           and x.first_byte_s == x.first_byte_s]   # cancelled after its first byte
    assert mid, [(x.cid, x.status, x.first_byte_s) for x in load.transfers]
    assert load.sources.get("computed", 0) > 0 and not load.fallback


def test_slow_then_fast_link_uses_both_paths(world):
    """Slow at first (the controller gives the compute thread work), fast later (the link takes
    the rest): both paths contribute, nothing falls back. The device is slow (30 ms a step) so
    that computing everything (0.54 s) is not faster than a link that recovers."""
    async def pace(sent: int) -> None:
        if sent < 4 << 10:
            await asyncio.sleep(0.05)       # the first 4 KiB at ~20 KB/s
    src = ScriptedSource(world["frames"], lambda n: Behaviour(pace=pace, piece=1024))
    inst = _instance(world, mbps=50.0, step_s=0.03)
    load = _load(world, src, planner="sparkv", controller=ControllerConfig(), inst=inst,
                 config=EngineConfig(retry_backoff_s=0.01, stall_fallback_s=60.0),
                 stepper_class=SlowStepper)
    assert not load.fallback
    assert load.sources.get("streamed", 0) > 0 and load.sources.get("computed", 0) > 0
    # what the session learns counts only steps run with the link quiet (none, or the few
    # after the link's last chunk, here)
    assert load.compute_samples <= load.sources["computed"] and load.compute_ratio > 0


def _poisoned(world, where: dict) -> dict:
    """``world``'s frames with valid raw frames of non-finite KV for the chunks in ``where``
    (chunk id -> (tensor, value)): the checksum is right, the values are not."""
    from sparkv.codec import decode, encode

    frames = dict(world["frames"])
    for cid, (tensor, value) in where.items():
        chunk = decode(frames[(cid, "raw")])
        getattr(chunk, tensor)[0, 3, 1] = value
        frames[(cid, "raw")] = encode(chunk, "raw")
        assert len(frames[(cid, "raw")]) == len(world["frames"][(cid, "raw")])
    return frames


@pytest.mark.parametrize("planner", ["stream", "sparkv"])
def test_non_finite_frames_anywhere_are_recomputed(world, planner):
    """A frame whose values hold a NaN or an infinity (first, middle and last chunk of the
    stream; K or V) is a damaged frame: rejected, its chunk computed, the cache exact."""
    ids = list(world["geo"].chunk_ids())
    where = {ids[0]: ("k", float("nan")), ids[len(ids) // 2]: ("v", float("inf")),
             ids[-1]: ("k", -float("inf"))}
    src = ScriptedSource(_poisoned(world, where))
    load = _load(world, src, planner=planner,
                 controller=ControllerConfig() if planner == "sparkv" else None)
    status = {x.cid: x.status for x in load.transfers}
    streamed = sorted(c for c, s in status.items() if s == TransferStatus.FAILED)
    # every poisoned frame the link delivered failed; sparkv's controller may also compute a
    # poisoned chunk's step before its frame is read (cancelled: on a loaded machine, early)
    assert streamed == sorted(c for c in where
                              if status.get(c) not in (None, TransferStatus.CANCELLED))
    assert not any(status.get(c) == TransferStatus.ARRIVED for c in where)
    assert streamed or planner == "sparkv"
    if streamed:
        assert load.fallback["chunks"] == {"bad frame": len(streamed)}
    for cid in streamed:
        assert load.kv.source(cid) == "computed"
        assert any("non-finite" in e for e in load.link_errors if str(cid) in e)


@pytest.mark.parametrize("in_turn", [True, False])
def test_frames_decoded_in_turn_or_aside_fill_the_reference_cache(world, in_turn, monkeypatch):
    """Where no core is spare the compute thread decodes the received frames between its calls
    (``decode_in_turn``), else a decode worker does beside it: either way every frame lands,
    a poisoned one is rejected and its chunk computed, and the cache is the reference one."""
    import threading

    from sparkv.edge.frames import FrameDecoder

    decoded_on: set[str] = set()
    decode = FrameDecoder._decode

    def spy(self, f, data, log):
        decoded_on.add(threading.current_thread().name)
        return decode(self, f, data, log)

    monkeypatch.setattr(FrameDecoder, "_decode", spy)
    ids = list(world["geo"].chunk_ids())
    src = ScriptedSource(_poisoned(world, {ids[1]: ("v", float("nan"))}))
    load = _load(world, src, config=EngineConfig(retry_backoff_s=0.01, decode_in_turn=in_turn))
    status = {x.cid: x.status for x in load.transfers}
    assert status[ids[1]] == TransferStatus.FAILED and load.kv.source(ids[1]) == "computed"
    assert sum(s == TransferStatus.ARRIVED for s in status.values()) == len(ids) - 1
    caller = threading.current_thread().name
    assert decoded_on == ({caller} if in_turn else {"sparkv-decode_0"}), decoded_on


def test_frames_are_decoded_in_turn_only_on_a_cpu_without_a_spare_core(monkeypatch):
    import os

    from sparkv.edge.frames import decode_in_turn

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert decode_in_turn(torch.device("cpu"), 2) and decode_in_turn(torch.device("cpu"), 4)
    assert not decode_in_turn(torch.device("cpu"), 1)          # a core is spare
    assert not decode_in_turn(torch.device("cuda"), 2)         # the GPU computes


def test_a_progress_wakes_the_link_loop_only_when_the_link_has_work():
    """After every compute call the engine signals progress; the link's loop is woken (a
    wake-up of the link thread beside the steps) only when the controller queued chunks for
    the link, or under a device service (its turn may have come); else it looks every WAIT_S
    on its own."""
    import asyncio
    import types

    from sparkv.edge.link import Link

    order: list[int] = []
    link = Link.__new__(Link)
    link._hub = types.SimpleNamespace(ctl=types.SimpleNamespace(
        state=types.SimpleNamespace(link=types.SimpleNamespace(order=order))))
    link._lane = None

    async def woken() -> bool:
        link._loop, link._wake = asyncio.get_running_loop(), asyncio.Event()
        link.wake()
        await asyncio.sleep(0.01)
        return link._wake.is_set()

    assert not asyncio.run(woken())            # nothing queued: no wake-up
    order.append(3)
    assert asyncio.run(woken())                # work for the link: woken
    order.clear()
    link._lane = object()
    assert asyncio.run(woken())                # a device service's ask: woken


def test_a_chunk_the_schedule_loses_is_computed_not_waited_for(world):
    """The controller hands the link a chunk that is never requested (a scheduling bug): nothing
    runs on either path while it is missing. The idle rule computes it instead of hanging."""
    inst = _instance(world)
    plan = get_planner("stream").plan(inst)
    stepper = LayerStepper(world["lm"], world["tokens"], T, backend=get_backend("dense"))
    engine = Engine(stepper, plan, inst, ControllerConfig.static(),
                    source=ScriptedSource(world["frames"]),
                    config=EngineConfig(retry_backoff_s=0.01, stall_fallback_s=0.3))
    lost = []
    real = engine.ctl.next_fetch

    def losing_next_fetch(now):
        f = real(now)
        if f is not None and not lost:
            lost.append(f.cid)            # taken from the controller, never sent
            f = real(now)
        return f

    engine.ctl.next_fetch = losing_next_fetch
    load = engine.run()
    assert lost and load.kv.is_complete()
    assert "nothing scheduled" in load.fallback.get("stalled", ""), load.fallback
    assert load.sources.get("computed", 0) >= 1
    for (k, v), (rk, rv) in zip(load.kv.layer_kv(), world["ref"]):
        torch.testing.assert_close(k, rk, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, rv, atol=1e-5, rtol=1e-5)


class CountingStepper(LayerStepper):
    """Counts runs per step (a span or a column counts each of its steps; ``run_step`` is a span
    of one);
    a span holding ``fail`` (a step) raises once, after ``gate`` is set."""

    fail = None
    gate: Any = None

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.runs: dict = {}

    def run_span(self, t0, t1, l):  # noqa: E741
        steps = [StepId(t, l) for t in range(t0, t1)]
        if self.fail in steps:
            self.fail = None
            self.gate.wait(30)
            raise RuntimeError("injected prelude failure")
        for step in steps:
            self.runs[step] = self.runs.get(step, 0) + 1
        return super().run_span(t0, t1, l)

    def run_column(self, t, l0, l1):  # noqa: E741
        for l in range(l0, l1):  # noqa: E741
            self.runs[StepId(t, l)] = self.runs.get(StepId(t, l), 0) + 1
        return super().run_column(t, l0, l1)


def _prelude_load(world, stepper, pre, promised, planner="sparkv"):
    inst = _instance(world, mbps=50.0)
    plan = get_planner(planner).plan(inst)
    engine = Engine(stepper, plan, inst, ControllerConfig(), source=ScriptedSource(world["frames"]),
                    config=EngineConfig(retry_backoff_s=0.01), prelude=pre,
                    prelude_done=promised)
    return _run_exact(engine, world)


def _wait(cond, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.002)
    assert cond()


@pytest.mark.parametrize("planner", ["sparkv", "stream", "hybrid"])
def test_prelude_steps_are_never_run_again(world, planner):
    """Steps done by the prelude (and the one it is finishing) leave both paths: whatever the
    plan, no step runs twice and nothing they made is fetched."""
    from sparkv.edge.prelude import Prelude

    stepper = CountingStepper(world["lm"], world["tokens"], T, backend=get_backend("dense"))
    pre = Prelude(lambda: stepper, stepper.geometry, world["tokens"]).start()
    _wait(lambda: len(stepper.done) >= 3)
    promised = pre.request_stop()
    load = _prelude_load(world, stepper, pre, promised, planner)
    assert all(n == 1 for n in stepper.runs.values()), stepper.runs
    assert not {s for s in promised} & set(load.steps)
    fetched = {(x.cid.t, x.cid.l) for x in load.transfers}
    assert not fetched & {(s.t, s.l) for s in promised}


def test_a_prelude_step_that_fails_is_computed_by_the_engine(world):
    """The prelude promised a step (it was running when the plan was made) and then failed it:
    the engine notices when it joins the prelude and computes what is missing."""
    import threading

    from sparkv.edge.prelude import Prelude

    stepper = CountingStepper(world["lm"], world["tokens"], T, backend=get_backend("dense"))
    stepper.fail, stepper.gate = StepId(0, 1), threading.Event()
    pre = Prelude(lambda: stepper, stepper.geometry, world["tokens"]).start()
    _wait(lambda: StepId(0, 1) in pre._running)
    promised = pre.request_stop()
    assert StepId(0, 1) in promised
    stepper.gate.set()
    load = _prelude_load(world, stepper, pre, promised)
    assert any("prelude failed" in e for e in load.link_errors)


class ThreadCountStepper(LayerStepper):
    """Records the intra-op thread count of every step; the prelude's steps wait (``hold``)
    until a streamed chunk is in place, so the decode worker has started before the engine's
    compute thread runs its first kernel."""

    hold = True

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.counts: dict = {}

    def run_span(self, t0, t1, l):  # noqa: E741
        import threading

        if threading.current_thread().name == "sparkv-prelude" and self.hold:
            self.hold = False
            _wait(lambda: any(s == "streamed" for s in self.kv.sources().values()))
        for t in range(t0, t1):
            self.counts[StepId(t, l)] = torch.get_num_threads()
        return super().run_span(t0, t1, l)


def test_compute_steps_keep_the_callers_thread_count(world):
    """The decode worker (one thread) starts while the compute thread waits for the prelude: the
    compute thread's steps still run with the caller's thread count (they ran a whole load on one
    thread before: sparkv.runtime.threads). The load has its decode worker whatever the CPU (in
    turn, the compute thread, waiting for the prelude, would decode nothing and the prelude's
    hold would wait out its 60 s)."""
    from sparkv.edge.prelude import Prelude

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        stepper = ThreadCountStepper(world["lm"], world["tokens"], T, backend=get_backend("dense"))
        pre = Prelude(lambda: stepper, stepper.geometry, world["tokens"]).start()
        _wait(lambda: bool(pre._running))
        promised = pre.request_stop()
        inst = _instance(world, mbps=50.0)
        plan = get_planner("hybrid").plan(inst)
        assert plan.stream_order and plan.compute_order
        engine = Engine(stepper, plan, inst, ControllerConfig.static(),
                        source=ScriptedSource(world["frames"]),
                        config=EngineConfig(retry_backoff_s=0.01, decode_in_turn=False),
                        prelude=pre, prelude_done=promised)
        load = _run_exact(engine, world)
    finally:
        torch.set_num_threads(before)
    assert pre.join().ok, "the prelude's hold timed out"
    assert load.steps, "the engine computed nothing"
    assert {stepper.counts[s] for s in load.steps} == {2}, stepper.counts


def test_a_cancelled_chunk_later_in_a_batch_does_not_stop_the_chunks_before_it(world):
    """The controller cancels the tail of a slow batch: the response goes on delivering the
    chunks ahead of the cancelled one (no new request for them), stops at it, and only the
    chunk after it is requested again. The cancelled chunk never arrives by the link; the
    load still completes exactly (here the step is computed by the idle rule, since this test
    cancels behind the static controller's back)."""
    src_holder: dict = {}
    injected: list = []

    def pace(sent):
        src = src_holder["src"]
        first = src.opened[0]
        if not injected and 0 < sent < first[0].nbytes:
            injected.append(first[2].cid)       # while chunk 0 flows: cancel the batch's third
            src_holder["engine"].ctl.state.link.cancels.append(first[2].cid)
        return asyncio.sleep(0.002)

    src = ScriptedSource(world["frames"], lambda n: Behaviour(pace=pace) if n == 0
                         else Behaviour())
    src_holder["src"] = src
    inst = _instance(world)
    plan = get_planner("stream").plan(inst)
    stepper = LayerStepper(world["lm"], world["tokens"], T, backend=get_backend("dense"))
    engine = Engine(stepper, plan, inst, ControllerConfig.static(), source=src,
                    config=EngineConfig(retry_backoff_s=0.01, batch_max_items=4,
                                        stall_fallback_s=0.3))
    src_holder["engine"] = engine
    load = _run_exact(engine, world)
    first = [x.cid for x in src.opened[0]]
    assert injected == [first[2]]
    arrived = {x.cid for x in load.transfers if x.status == TransferStatus.ARRIVED}
    assert {first[0], first[1]} <= arrived and first[2] not in arrived
    later = [x.cid for req in src.opened[1:] for x in req]
    assert first[0] not in later and first[1] not in later and first[2] not in later
    assert first[3] in later                   # the one after the cancelled chunk, again
    assert load.sources.get("computed", 0) >= 1


@pytest.mark.parametrize("promise", [True, False])
def test_a_prelude_stopped_while_building_promises_its_first_step(world, promise):
    """The plan is made while the prelude's stepper is still being built: the prelude promises
    (and then runs) exactly its first span; a discarded one runs nothing."""
    import threading

    from sparkv.edge.prelude import Prelude, prelude_units

    gate = threading.Event()

    def make():
        gate.wait(30)
        return CountingStepper(world["lm"], world["tokens"], T, backend=get_backend("dense"))

    geo = ChunkGeometry.from_config(world["lm"].config, N_TOKENS, T)
    pre = Prelude(make, geo, world["tokens"]).start()
    promised = pre.request_stop(promise_first=promise)
    gate.set()
    res = pre.join()
    assert res.ok
    first = set(prelude_units(geo)[0])
    assert len(first) > 1 and all(s.l == 0 for s in first)
    assert promised == (first if promise else set())
    assert res.steps == sorted(promised)
    if promise:
        load = _prelude_load(world, pre.stepper, None, promised)
        assert not first & set(load.steps)
        assert all(pre.stepper.runs[s] == 1 for s in first)


def test_a_column_locked_by_streamed_layers_is_recomputed(world):
    """The plan streams everything layer by layer; the bottom two layers arrive at once, then the
    link crawls. No queued step can move to compute the ordinary way (the hidden states below
    it were never computed: its layer below was streamed), so the default controller recomputes
    a column: the streamed steps below a locked one are computed again. The cache is exact, the
    compute path did the work, and nothing waited for the idle rule."""
    from sparkv.scheduler.planners.base import make_plan

    geo = world["geo"]
    inst = _instance(world, mbps=1000.0, step_s=0.002)
    order = sorted(range(inst.num_chunks),
                   key=lambda c: (inst.chunk_id(c).l, inst.chunk_id(c).t))
    fast = sum(inst.bytes_of(inst.chunk_id(c), "raw") for c in order
               if inst.chunk_id(c).l < 2)
    plan = make_plan(inst, [], order)

    async def pace(sent: int) -> None:
        # 512 B / 50 ms after the first two layers, counted over every request (the link may
        # open another: it must not start fast again; a loaded run failed so)
        if src.sent_total >= fast:
            await asyncio.sleep(0.05)

    src = ScriptedSource(world["frames"], lambda n: Behaviour(pace=pace, piece=512))
    stepper = LayerStepper(world["lm"], world["tokens"], T, backend=get_backend("dense"))
    engine = Engine(stepper, plan, inst, ControllerConfig(), source=src,   # recomputes columns
                    config=EngineConfig(retry_backoff_s=0.01, stall_fallback_s=600.0))
    load = _run_exact(engine, world)
    columns = [m for m in load.migrations if m.direction == "to_compute" and len(m.steps) > 1]
    assert columns, [(m.direction, m.steps) for m in load.migrations]
    assert any(StepId(s.t, s.l).l < 2 for m in columns for s in m.steps[:-1])
    assert load.sources.get("computed", 0) > 0 and not load.fallback
    assert geo.num_layers > 2


def test_a_plan_that_streams_nothing_still_has_a_link_for_migrations(world):
    """The cost model says compute is fast (2 ms a step) so the plan computes everything; the
    device is slower (30 ms). The controller moves steps to the link, which must be running
    (it was not started for such a plan: the moved chunks waited for the idle rule, seen on an
    H200 and reproduced on the CPU)."""
    src = ScriptedSource(world["frames"])
    inst = _instance(world, mbps=1000.0, step_s=0.002)
    load = _load(world, src, planner="local", controller=ControllerConfig(), inst=inst,
                 config=EngineConfig(retry_backoff_s=0.01, stall_fallback_s=60.0),
                 stepper_class=SlowStepper)
    assert not load.fallback
    assert load.migrations and load.sources.get("streamed", 0) > 0


def test_an_engine_without_a_link_never_migrates_to_it(world):
    inst = _instance(world, mbps=1000.0, step_s=0.002)
    plan = get_planner("local").plan(inst)
    stepper = SlowStepper(world["lm"], world["tokens"], T, backend=get_backend("dense"))
    engine = Engine(stepper, plan, inst, ControllerConfig(), source=None,
                    config=EngineConfig(stall_fallback_s=0.3))
    load = _run_exact(engine, world)
    assert not load.fallback and load.sources == {"computed": len(list(world["geo"].chunk_ids()))}
    assert all(m.direction != "to_stream" and m.direction != "probe" for m in load.migrations)


class TurnLane(AloneLane):
    """A lane (sparkv.edge.lane.Lane) whose link turn stays refused until :attr:`go` is set:
    what a device service's link plan says to an ask far back on the link. It counts the turns
    asked for and the requests the source had opened when the turn came."""

    def __init__(self, src: ScriptedSource, refusals: int) -> None:
        import threading

        self.src, self.refusals = src, refusals
        self.asked = 0
        self.pending: list[float] = []
        self.opened_while_refused: int | None = None
        self._lock = threading.Lock()

    def link_turn(self, pending_bytes: float):
        from sparkv.edge.lane import LinkTurn

        with self._lock:
            self.asked += 1
            self.pending.append(pending_bytes)
            if self.asked <= self.refusals:
                return LinkTurn(1e6, False)
            if self.opened_while_refused is None:
                self.opened_while_refused = len(self.src.opened)
            return LinkTurn(0.0, True)


def test_a_link_waiting_for_its_turn_sends_nothing_and_is_not_idle(world):
    """Under a device's link plan the link sends a request only on the ask's turn. While it
    waits with work queued it is busy, not idle: the idle rule (here 0.2 s of nothing scheduled)
    does not compute what the link will deliver. Refused far longer than that rule's threshold
    (the compute thread and the link loop each ask every 50 ms at most: 60 refusals are more
    than 1.5 s of looking), the load then streams everything."""
    src = ScriptedSource(world["frames"])
    lane = TurnLane(src, refusals=60)
    inst = _instance(world)
    plan = get_planner("stream").plan(inst)
    stepper = LayerStepper(world["lm"], world["tokens"], T, backend=get_backend("dense"))
    engine = Engine(stepper, plan, inst, ControllerConfig.static(), source=src,
                    config=EngineConfig(stall_fallback_s=0.2, retry_backoff_s=0.01), lane=lane)
    load = _run_exact(engine, world)
    assert lane.opened_while_refused == 0
    assert load.sources == {"streamed": world["geo"].num_chunks} and not load.fallback


def test_a_dead_link_stops_counting_its_bytes_against_the_other_asks(world):
    """An ask whose link died computes everything missing: it reports nothing left to stream
    from then on, so the asks behind it on the device's link plan do not wait for it."""
    src = ScriptedSource(world["frames"], lambda n: Behaviour(
        fail_open=SourceError("server error 404 context_not_found: gone", fatal=True)))
    lane = TurnLane(src, refusals=0)
    inst = _instance(world)
    plan = get_planner("stream").plan(inst)
    stepper = SlowStepper(world["lm"], world["tokens"], T, backend=get_backend("dense"))
    engine = Engine(stepper, plan, inst, ControllerConfig.static(), source=src,
                    config=EngineConfig(retry_backoff_s=0.01), lane=lane)
    load = _run_exact(engine, world)
    assert "404" in load.fallback["link"]
    assert lane.pending[0] > 0 and lane.pending[-1] == 0.0


def test_a_stop_that_cancels_the_link_while_it_closes_is_not_a_link_error():
    """A cancellation that escapes the link's loop after the ask asked it to stop is the stop,
    not a dead link (seen: a Strong Hybrid ask reported ``link error: CancelledError`` as a
    fallback at its end); one before the stop still is."""
    import asyncio
    import threading
    from types import SimpleNamespace

    from sparkv.edge.link import Link

    def outcome(finished: bool) -> object:
        link = Link.__new__(Link)
        link._finished = threading.Event()
        if finished:
            link._finished.set()
        link._stats = SimpleNamespace(link_dead=None, link_errors=[])
        link._hub = SimpleNamespace(cv=threading.Condition())

        async def serve() -> None:
            raise asyncio.CancelledError()

        link._serve = serve        # type: ignore[method-assign]
        link._main()
        return link._stats.link_dead

    assert outcome(finished=True) is None
    assert "CancelledError" in str(outcome(finished=False))


def test_a_stop_that_lands_while_the_link_closes_lets_the_close_finish():
    """A stop arriving while the loop releases its connections (the load had ended the loop,
    the engine's close came after) must not cancel that release: it was seen as an unclosed
    socket's ResourceWarning in a fresh-clone run."""
    import asyncio
    import threading
    from types import SimpleNamespace

    from sparkv.edge.link import Link

    entered, released = threading.Event(), threading.Event()

    class SlowClose:
        def start(self) -> None:
            pass

        async def aclose(self) -> None:
            entered.set()
            await asyncio.sleep(0.3)
            released.set()

    hub = SimpleNamespace(cv=threading.Condition(), on_progress=lambda fn: None)
    cfg = SimpleNamespace(sample_interval_s=0.05)
    link = Link(hub, SlowClose(), None, None, SimpleNamespace(link_dead=None, link_errors=[]),
                None, cfg)

    async def ends_at_once() -> None:
        return None

    link._request_batches = ends_at_once   # type: ignore[method-assign]
    link.start()
    assert entered.wait(30)
    link.stop()
    link.join(30)
    assert released.is_set()
    assert link._stats.link_dead is None


class SpanStepper(LayerStepper):
    """Records the spans the engine runs: ``(t0, t1, l)`` of each :meth:`run_span` call."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.spans: list[tuple[int, int, int]] = []

    def run_span(self, t0, t1, l):  # noqa: E741
        self.spans.append((t0, t1, l))
        return super().run_span(t0, t1, l)


@pytest.mark.parametrize("planner,mbps", [("local", 50.0), ("sparkv", 20.0)])
def test_spans_of_a_layers_token_chunks_fill_the_reference_cache(world, planner, mbps):
    """A launch-bound device's controller (CommitSpans) hands the compute thread a layer's
    consecutive token chunks; it runs each run of them as one span. The cache is the reference
    one, streamed chunks inside a span kept, and every step runs exactly once."""
    inst = _instance(world, mbps=mbps)
    plan = get_planner(planner).plan(inst)
    stepper = SpanStepper(world["lm"], world["tokens"], T, backend=get_backend("dense"))
    src = ScriptedSource(world["frames"]) if plan.stream_order else None
    engine = Engine(stepper, plan, inst, ControllerConfig.static().with_spans(True),
                    source=src, config=EngineConfig(retry_backoff_s=0.01))
    load = _run_exact(engine, world)
    assert any(t1 - t0 > 1 for t0, t1, _ in stepper.spans), stepper.spans
    ran = [(t, l) for t0, t1, l in stepper.spans for t in range(t0, t1)]
    assert len(ran) == len(set(ran)) == len(plan.compute_order)
    assert load.sources.get("computed", 0) > 0


def test_the_engine_commits_spans_unless_they_are_turned_off(world, monkeypatch):
    """No controller given: spans on every device (``fused_spans``), one step or a column at a
    time with ``SPARKV_FUSED_SPANS=0``."""
    from sparkv.runtime.device import fused_spans

    monkeypatch.delenv("SPARKV_FUSED_SPANS", raising=False)
    assert fused_spans(torch.device("cuda")) and fused_spans(torch.device("cpu"))
    inst = _instance(world)
    plan = get_planner("local").plan(inst)
    for env, spans in (("1", True), ("0", False)):
        monkeypatch.setenv("SPARKV_FUSED_SPANS", env)
        assert fused_spans(torch.device("cpu")) is spans
        stepper = SpanStepper(world["lm"], world["tokens"], T, backend=get_backend("dense"))
        engine = Engine(stepper, plan, inst, source=None)
        _run_exact(engine, world)
        assert any(t1 - t0 > 1 for t0, t1, _ in stepper.spans) is spans


@pytest.mark.parametrize("planner,mbps,spans", [("sparkv", 20.0, False), ("sparkv", 20.0, True),
                                                 ("local", 50.0, False)])
def test_the_engine_with_graphed_steps_fills_the_reference_cache(world, planner, mbps, spans):
    """A GPU's steps replay CUDA graphs (sparkv/runtime/graphs.py; emulated here): through the
    engine's compute thread, with streamed chunks between computed ones and with spans, the
    cache is the reference one."""
    from sparkv.runtime.graphs import LayerGraphs

    inst = _instance(world, mbps=mbps)
    plan = get_planner(planner).plan(inst)
    graphs = LayerGraphs(world["lm"], emulate=True)
    stepper = LayerStepper(world["lm"], world["tokens"], T, backend=get_backend("dense"),
                           graphs=graphs)
    src = ScriptedSource(world["frames"]) if plan.stream_order else None
    engine = Engine(stepper, plan, inst, ControllerConfig.static().with_spans(spans),
                    source=src, config=EngineConfig(retry_backoff_s=0.01))
    load = _run_exact(engine, world)
    assert load.sources.get("computed", 0) > 0 and graphs.failure is None
    # step by step a layer's shape repeats from its second step on; spans of this plan have
    # lengths of their own (each one-off, so eager)
    if not spans:
        assert graphs.replays > 0


class EvenSpanStepper(SpanStepper):
    """A span's steps report one time each, shared evenly (as the stepper shares it)."""

    def run_span(self, t0, t1, l):  # noqa: E741
        results = super().run_span(t0, t1, l)
        for r in results:
            r.seconds = 0.02 / len(results)
        return results


def test_a_spans_time_is_shared_by_its_steps_predictions(world):
    """Each step of a span is reported with the span's time in proportion to its prediction, so
    every step of a span reads the same speed. Shared evenly, the last token chunk of a few
    tokens (here predicted at a fiftieth of the others) was charged a whole chunk's time and the
    controller's compute speed, a mean over its last steps, read the path as many times slower
    than it was (session 68: it moved most of a context to the link at once)."""
    geo = world["geo"]
    last = geo.num_token_chunks - 1
    t_comp = {s: (0.0002 if s.t == last else 0.01) for s in geo.step_ids()}
    sizes = {cid: {"raw": len(world["frames"][(cid, "raw")])} for cid in geo.chunk_ids()}
    inst = Instance.from_mappings(geo, sizes, t_comp, 1000 * MBPS, t_proc=1e-4, name="tiny")
    stepper = EvenSpanStepper(world["lm"], world["tokens"], T, backend=get_backend("dense"))
    engine = Engine(stepper, get_planner("local").plan(inst), inst,
                    ControllerConfig.static().with_spans(True), source=None)
    load = _run_exact(engine, world)
    spans = [(t0, t1, l) for t0, t1, l in stepper.spans if t1 - t0 > 1 and t1 - 1 == last]
    assert spans, stepper.spans
    for t0, t1, l in spans:  # noqa: E741
        took = {t: load.steps[StepId(t, l)][1] - load.steps[StepId(t, l)][0]
                for t in range(t0, t1)}
        ratios = [took[t] / t_comp[StepId(t, l)] for t in range(t0, t1)]
        assert max(ratios) <= 1.01 * min(ratios), (l, took)


def test_rate_samples_never_read_faster_than_the_link_delivers(world, monkeypatch):
    """A response's first piece only starts the rate samples' clock. Counted over no time (the
    sample's length floored at a microsecond) a probe's one-piece chunk measured the link at 80
    Gbit/s, and the rules moved three token chunks of layers to a 20 Mbit/s link at once
    (session 68: 8 s to the first token where local took 2)."""
    from sparkv.scheduler import estimators

    samples: list[tuple[float, float]] = []
    add = estimators.LinkEstimator.add

    def record(self, now, nbytes, seconds):
        samples.append((nbytes, seconds))
        add(self, now, nbytes, seconds)

    monkeypatch.setattr(estimators.LinkEstimator, "add", record)
    gap = 0.004                          # each chunk arrives whole, one every 4 ms

    async def pace(sent: int) -> None:
        await asyncio.sleep(gap)
    src = ScriptedSource(world["frames"], lambda n: Behaviour(pace=pace, piece=1 << 20))
    load = _load(world, src)
    rates = [b / s for b, s in samples if b > 0]
    assert rates and load.bytes_received > 0
    assert max(rates) <= 1.5 * max(len(f) for f in world["frames"].values()) / gap, max(rates)


def test_a_plan_handed_over_mid_load_is_followed_and_fills_the_reference_cache(world):
    """The load starts by a plan that streams everything over a slow link; another thread hands
    it a plan that computes everything (the session's plan thread does this with the greedy's
    plan): the fetch in flight is cancelled, the rest is computed, nothing is fetched after the
    handover, and the cache is the reference's. A handover after the load completed is
    ignored."""
    import threading

    async def pace(sent: int) -> None:
        await asyncio.sleep(0.01)
    src = ScriptedSource(world["frames"], lambda n: Behaviour(pace=pace, piece=256))
    inst = _instance(world, mbps=1000.0)
    first, local = get_planner("stream").plan(inst), get_planner("local").plan(inst)
    stepper = LayerStepper(world["lm"], world["tokens"], T, backend=get_backend("dense"))
    engine = Engine(stepper, first, inst, ControllerConfig.static(), source=src,
                    config=EngineConfig(retry_backoff_s=0.01, stall_fallback_s=60.0))
    engine.start()
    _wait(lambda: src.sent_total > 0)
    took: list[bool] = []
    handed = threading.Thread(target=lambda: took.append(engine.adopt(local)))
    handed.start()
    handed.join()
    load = _run_exact(engine, world)
    assert took == [True]
    hand = [m for m in load.migrations if m.direction == "handover"]
    assert len(hand) == 1 and engine.plan is local
    assert load.sources.get("computed", 0) > 0
    assert all(x.requested_s <= hand[0].time_s for x in load.transfers)
    assert engine.adopt(first) is False       # too late: the load is complete
    assert [m.direction for m in engine.ctl.migrations].count("handover") == 1
