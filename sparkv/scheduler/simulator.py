"""A discrete-event simulator of loading one context on the device: ``simulate(plan, inst, trace, noise)``.

The device model (docs/scheduler.md, "Simulator"):

* **link**: one serial transfer at a time; a transfer's bytes drain at the trace's rate. A request
  made while the link was idle waits one RTT before its first byte; a request made back-to-back
  (the previous transfer just finished) is pipelined (no extra RTT). Rate samples go to the
  controller every ``sample_interval_s`` while bytes flow (at most 200 per transfer) and at the end
  of each transfer.
* **decoder**: a received chunk is decoded (``t_proc`` of its level) by one decode worker, in
  arrival order, overlapping the next transfer; then the chunk is available. With the
  instance's ``decode_in_turn`` the compute thread is the decoder: it decodes every received
  chunk before its next step, and a step never runs while it decodes.
* **compute thread**: one layer step at a time, ``t_comp x noise``, and the instance's
  ``call_s`` once per call (a span of a layer's token chunks handed out together pays it once;
  each step of a column pays it: every layer is its own kernels); a step starts only when its
  inputs are available (the simulator checks; a controller that breaks this raises
  :class:`SimulationError`). Each chunk decoded while a step runs lengthens that step by the
  instance's ``stream_tax_s`` (receiving and decoding take the cores the step uses), and a step
  runs ``1 + receive_tax`` times slower while a transfer's bytes arrive (first to last byte).
* **end**: when every KV chunk is available and the compute thread is free, the question is
  prefilled (``t_suffix_s x noise``): TTFT = that end. Time 0 is the start of loading (planning and
  manifest fetch are not included; the benchmark reports the planning time beside it).

Both workers are driven by a :class:`~sparkv.scheduler.controller.Controller` through its event
interface; without one, :meth:`ControllerConfig.static` follows the plan exactly. :func:`simulate`
builds a :class:`Simulation` (one run's state, one method per event kind) and runs it.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from sparkv.errors import SparkvError
from sparkv.layout import KVChunkId, StepId
from sparkv.scheduler.controller import Controller, ControllerConfig
from sparkv.scheduler.graph import DepState
from sparkv.scheduler.instance import MBPS, Instance, portable_exp
from sparkv.scheduler.plan import Plan
from sparkv.scheduler.state import Migration
from sparkv.scheduler.trace import Trace


class SimulationError(SparkvError):
    """The execution got stuck (deadlock) or a controller broke a dependency."""


@dataclass(frozen=True)
class ComputeNoise:
    """Compute-time noise: a log-normal factor per step (``sigma``) and contention windows.

    ``slowdowns``: ``(start_s, end_s, factor)``: a step or the suffix *starting* in the window
    takes ``factor`` times longer (another app on the GPU/CPU).
    """

    sigma: float = 0.0
    seed: int = 0
    slowdowns: tuple[tuple[float, float, float], ...] = ()

    def step_factors(self, n: int) -> np.ndarray:
        if self.sigma <= 0:
            return np.ones(n + 1)
        rng = np.random.default_rng(self.seed)
        return portable_exp(rng.normal(-self.sigma ** 2 / 2, self.sigma, n + 1))  # mean 1

    def slowdown(self, t: float) -> float:
        f = 1.0
        for a, b, k in self.slowdowns:
            if a <= t < b:
                f *= k
        return f


@dataclass
class TransferRecord:
    cid: KVChunkId
    level: str
    nbytes: int
    requested_s: float
    start_s: float          # first byte (after RTT if the link was idle)
    end_s: float            # last byte received (or cancel time)
    decoded_s: float = math.nan
    cancelled: bool = False


@dataclass
class Timeline:
    """What happened: TTFT and a per-chunk timeline of both paths. Times in seconds from start."""

    ttft_s: float
    ready_s: float                                  # every KV chunk available
    suffix_start_s: float
    steps: dict[StepId, tuple[float, float]]        # computed step -> (start, end)
    transfers: list[TransferRecord]
    available_s: dict[KVChunkId, float]             # chunk -> when it became available
    link_busy_s: float                              # seconds with bytes flowing
    link_wait_s: float                              # seconds waiting for first bytes (RTT)
    compute_busy_s: float
    decode_busy_s: float
    bytes_streamed: int
    bytes_wasted: int                               # cancelled transfers
    migrations: list[Migration] = field(default_factory=list)

    @property
    def computed_steps(self) -> int:
        return len(self.steps)

    @property
    def streamed_chunks(self) -> int:
        return sum(1 for r in self.transfers if not r.cancelled)

    def summary(self) -> dict[str, Any]:
        return {
            "ttft_s": self.ttft_s, "ready_s": self.ready_s,
            "computed_steps": self.computed_steps, "streamed_chunks": self.streamed_chunks,
            "link_busy_s": self.link_busy_s, "compute_busy_s": self.compute_busy_s,
            "decode_busy_s": self.decode_busy_s, "bytes_streamed": self.bytes_streamed,
            "bytes_wasted": self.bytes_wasted, "migrations": len(self.migrations),
        }

    def to_dict(self) -> dict[str, Any]:
        d = self.summary()
        d["steps"] = [[s.t, s.l, a, b] for s, (a, b) in self.steps.items()]
        d["transfers"] = [[r.cid.t, r.cid.l, r.cid.g, r.level, r.nbytes, r.requested_s, r.start_s,
                           r.end_s, r.decoded_s, r.cancelled] for r in self.transfers]
        d["migration_log"] = [m.to_dict() for m in self.migrations]
        return d


_MAX_SAMPLES = 200  # rate samples per transfer at most (long transfers sample more coarsely)

# event kinds, in the order simultaneous events are processed
_RECV_DONE, _DECODE_DONE, _STEP_DONE, _TICK, _FIRST_BYTE, _HANDOVER = 0, 1, 2, 3, 4, 5


def simulate(plan: Plan, inst: Instance, trace: Trace | None = None,
             noise: ComputeNoise | None = None,
             controller: Controller | ControllerConfig | None = None, *,
             done_steps: Sequence[StepId] = (), handover: tuple[float, Plan] | None = None,
             sample_interval_s: float = 0.05, max_time_s: float = 1e7) -> Timeline:
    """Runs ``plan`` on ``inst`` under ``trace`` (default: constant at the instance's bandwidth).

    ``controller``: a ready :class:`Controller`, or a :class:`ControllerConfig` to build one, or
    ``None`` for the static executor (the plan exactly as written). ``done_steps``: layer steps
    computed before loading began (the edge's prelude): in place at time 0, their chunks
    available (a ready controller must have been built with the same ones). ``handover``:
    ``(at_s, new_plan)``, the load goes on by ``new_plan`` from ``at_s``
    (:meth:`Controller.adopt`: the edge's plan handover).
    """
    if trace is None:
        trace = Trace.constant(inst.bandwidth_Bps / MBPS)
    if not isinstance(controller, Controller):
        controller = Controller(plan, inst, controller or ControllerConfig.static(),
                                done_steps=done_steps)
    sim = Simulation(inst, trace, noise or ComputeNoise(), controller,
                     sample_interval_s=sample_interval_s, max_time_s=max_time_s)
    sim.start_with(done_steps)
    if handover is not None:
        sim.hand_over_at(*handover)
    return sim.run()


@dataclass
class _Transfer:
    """The transfer the link is busy with: its record's index, dense chunk and level ids, first
    byte and end times, and the time of its last rate sample."""

    tid: int
    c: int
    li: int
    start: float
    end: float
    last: float


class Simulation:
    """One run of the device model (module docstring), driven by ``ctl``: :meth:`run` once.

    State: the event heap ``(time, kind, seq, arg)`` (simultaneous events in kind order, then in
    push order); the link (``_transfer`` in flight or ``None``, when it went idle); the decoder's
    queue; the compute thread (``_running`` step or ``None``); the dependency state of what is in
    place (``dep``: the simulator checks the controller against it) and the totals the
    :class:`Timeline` reports. Single-threaded; not reusable.
    """

    def __init__(self, inst: Instance, trace: Trace, noise: ComputeNoise, ctl: Controller, *,
                 sample_interval_s: float = 0.05, max_time_s: float = 1e7):
        self.inst, self.trace, self.noise, self.ctl = inst, trace, noise, ctl
        self.sample_interval_s, self.max_time_s = sample_interval_s, max_time_s
        self._factors = noise.step_factors(inst.num_steps)
        self._t_comp = inst.step_t_comp
        self.dep = DepState.for_instance(inst)
        self._heap: list[tuple[float, int, int, int]] = []
        self._seq = 0
        self._handlers = {_RECV_DONE: self._on_received, _DECODE_DONE: self._on_decoded,
                          _STEP_DONE: self._on_step_done, _TICK: self._on_tick,
                          _FIRST_BYTE: self._on_first_byte, _HANDOVER: self._on_handover}
        self._handovers: list[Plan] = []
        # link
        self._transfer: _Transfer | None = None
        self._link_free_since = 0.0
        self._link_first = True
        self.transfers: list[TransferRecord] = []
        self.link_busy_s = self.link_wait_s = 0.0
        self.bytes_streamed = self.bytes_wasted = 0
        # decoder
        self._decode_q: list[tuple[int, int, TransferRecord]] = []
        self._decoding = False
        self.decode_busy_s = 0.0
        # compute thread
        self._running: int | None = None
        self._running_end = math.nan
        self._run_slow = 1.0        # the running step's wall seconds per second of its work
        self._run_tax = 0.0         # the stream tax added to its end (not stretched)
        self._last_layer = -1       # the layer of the step that ran last (a span continues it)
        self.compute_busy_s = 0.0
        self.steps: dict[StepId, tuple[float, float]] = {}
        # outcome
        self.avail_at: dict[int, float] = {}     # dense chunk id -> when it became available
        self.ready_s = math.nan
        self.finished = False
        self.ttft_s = math.nan
        self.suffix_start_s = math.nan

    def start_with(self, done_steps: Sequence[StepId]) -> None:
        """Steps computed before loading began: in place, their chunks available at time 0
        (not in :attr:`steps`: this run did not compute them). Call before :meth:`run`."""
        for step in done_steps:
            s = self.inst.step_index(step)
            self.dep.mark_computed(s)
            for g in range(self.inst.G):
                self._make_available(s * self.inst.G + g, 0.0)

    def hand_over_at(self, at_s: float, plan: Plan) -> None:
        """From ``at_s`` on the load goes by ``plan`` (:meth:`Controller.adopt`). Call before
        :meth:`run`."""
        self._handovers.append(plan)
        self._push(at_s, _HANDOVER, len(self._handovers) - 1)

    # ------------------------------------------------------------------ the loop
    def run(self) -> Timeline:
        """Runs to the question's prefill; raises :class:`SimulationError` on a deadlock, a
        controller that starts a step before its inputs, or ``max_time_s`` passed."""
        self.ctl.start(0.0)
        self._pump(0.0)
        self._check_done(0.0)
        now = 0.0
        while self._heap and not self.finished:
            now, kind, _, a = heapq.heappop(self._heap)
            if now > self.max_time_s:
                raise SimulationError(f"simulation passed {self.max_time_s} s without finishing")
            if not self._handlers[kind](now, a):
                continue  # the event of a cancelled transfer
            self._check_done(now)
            if not self.finished:
                self._pump(now)
                self._check_done(now)
        if not self.finished:
            raise self._deadlock(now)
        return self._timeline()

    def _push(self, t: float, kind: int, a: int) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, kind, self._seq, a))

    def _pump(self, now: float) -> None:
        """Starts whatever the controller hands the idle workers. A query can change the
        controller's mind about the other path (a migration inside ``next_fetch`` can give the
        idle compute thread work): repeat until nothing more starts."""
        ctl, in_turn = self.ctl, self.inst.decode_in_turn
        for _ in range(1000):
            rev = ctl.revision
            self._process_cancellations(now)
            # decoding in turn: the compute thread decodes what was received before a step
            started = self._start_decode(now) if in_turn else False
            started = self._start_compute(now) or started
            started = self._start_link(now) or started
            if not in_turn:
                started = self._start_decode(now) or started
            if not started and not ctl.has_cancellations and ctl.revision == rev:
                break

    def _check_done(self, now: float) -> None:
        """Every chunk available and the compute thread free: the question's prefill runs."""
        if self.finished or len(self.avail_at) < self.inst.num_chunks:
            return
        if math.isnan(self.ready_s):
            self.ready_s = now
        if self._running is not None:
            return  # the suffix waits for the compute thread
        self.finished = True
        self.suffix_start_s = now
        self.ttft_s = now + self.inst.t_suffix_s * float(self._factors[-1]) \
            * self.noise.slowdown(now)

    # ------------------------------------------------------------------ events
    def _on_tick(self, now: float, tid: int) -> bool:
        """A rate sample of transfer ``tid`` while its bytes flow."""
        cur = self._transfer
        if cur is not None and cur.tid == tid:
            got = self.trace.bytes_between(cur.last, now)
            self.ctl.rate_sample(now, got, now - cur.last, self.transfers[tid].cid)
            cur.last = now
        return True

    def _on_handover(self, now: float, i: int) -> bool:
        self.ctl.adopt(self._handovers[i], now)
        return True

    def _on_first_byte(self, now: float, tid: int) -> bool:
        """Transfer ``tid``'s bytes start to arrive: the running step slows down. Internal to
        the device model: the controller hears nothing (``False``)."""
        self._retime_running_step(now)
        return False

    def _on_received(self, now: float, tid: int) -> bool:
        """Transfer ``tid``'s last byte: to the decoder; ``False`` if it was cancelled."""
        cur = self._transfer
        if cur is None or cur.tid != tid:
            return False
        rec = self.transfers[tid]
        got = self.trace.bytes_between(cur.last, now)
        self.ctl.rate_sample(now, got, now - cur.last, rec.cid)
        self.link_busy_s += now - cur.start
        self.bytes_streamed += rec.nbytes
        self._decode_q.append((cur.c, cur.li, rec))
        self._link_idle(now)
        self._retime_running_step(now)
        self.ctl.chunk_received(rec.cid, now)
        return True

    def _on_decoded(self, now: float, c: int) -> bool:
        """Chunk ``c`` is decoded: available."""
        self._decoding = False
        self._tax_running_step(now)
        if not self.dep.chunk_avail[c]:
            self.dep.add_chunk(c)
        self._make_available(c, now)
        self.ctl.chunk_arrived(self.inst.chunk_id(c), now)
        return True

    def _tax_running_step(self, now: float) -> None:
        """A chunk was decoded while a step runs: the step ends ``stream_tax_s`` later."""
        tax = self.inst.stream_tax_s
        if tax <= 0 or self._running is None or not now < self._running_end:
            return
        self._run_tax += tax
        self._move_running_end(self._running_end + tax)

    def _slowness(self, now: float) -> float:
        """Wall seconds per second of a step's work at ``now``: ``1 + receive_tax`` while a
        transfer's bytes arrive."""
        cur = self._transfer
        return 1.0 + self.inst.receive_tax if cur is not None and now >= cur.start else 1.0

    def _retime_running_step(self, now: float) -> None:
        """The running step's end after the link started or stopped receiving: the work it has
        left runs at the new pace, its stream tax after it (as :func:`ttft_of` counts them)."""
        slow, was = self._slowness(now), self._run_slow
        if self._running is None or slow == was:
            return
        self._run_slow = slow
        work_end = self._running_end - self._run_tax
        if now < work_end:
            self._move_running_end(now + (work_end - now) * slow / was + self._run_tax)

    def _move_running_end(self, end: float) -> None:
        """The running step ends at ``end`` (its earlier end event is stale)."""
        s = self._running
        assert s is not None
        self.compute_busy_s += end - self._running_end
        self._running_end = end
        step = self.inst.step_id(s)
        self.steps[step] = (self.steps[step][0], end)
        self._push(end, _STEP_DONE, s)

    def _on_step_done(self, now: float, s: int) -> bool:
        """Step ``s`` is computed: its chunks are available; ``False`` for the stale end of a
        step a decode lengthened."""
        if self._running != s or now != self._running_end:
            return False
        self._running = None
        self.dep.mark_computed(s)
        G = self.inst.G
        for g in range(G):
            self._make_available(s * G + g, now)
        step = self.inst.step_id(s)
        start, end = self.steps[step]
        self.ctl.step_done(step, now, end - start)
        return True

    def _make_available(self, c: int, now: float) -> None:
        if c not in self.avail_at:
            self.avail_at[c] = now

    def _link_idle(self, now: float) -> None:
        self._transfer = None
        self._link_free_since = now

    # ------------------------------------------------------------------ workers
    def _start_decode(self, now: float) -> bool:
        """The decoder takes the oldest received chunk, if it is free (decoding in turn: and
        the compute thread runs no step)."""
        if self._decoding or not self._decode_q:
            return False
        if self.inst.decode_in_turn and self._running is not None:
            return False
        c, li, rec = self._decode_q.pop(0)
        d = float(self.inst.t_proc[c, li])
        self._decoding = True
        self.decode_busy_s += d
        self._push(now + d, _DECODE_DONE, c)
        rec.decoded_s = now + d
        return True

    def _start_compute(self, now: float) -> bool:
        """The free compute thread runs the controller's next step (its inputs checked)."""
        if self._running is not None or self.finished:
            return False
        if self.inst.decode_in_turn and (self._decoding or self._decode_q):
            return False    # it decodes first
        continuing = self.ctl.continuing
        step = self.ctl.next_step(now)
        if step is None:
            return False
        s = self.inst.step_index(step)
        if not self.dep.ready(s):
            missing = (self.dep.missing_for(s) if not self.dep.computed[s]
                       else ["it is already computed"])
            raise SimulationError(f"controller started {step} at t={now:.4f}s but it lacks: "
                                  + ", ".join(missing[:5]))
        # a call's fixed cost, once per call: a span's later token chunks do not pay it
        call = 0.0 if continuing and step.l == self._last_layer else self.inst.call_s
        self._last_layer = step.l
        dur = ((float(self._t_comp[s]) + call) * float(self._factors[s])
               * self.noise.slowdown(now))
        self._running = s
        self._run_slow, self._run_tax = self._slowness(now), 0.0
        dur *= self._run_slow
        self._running_end = now + dur
        self.compute_busy_s += dur
        self.steps[step] = (now, self._running_end)
        self._push(self._running_end, _STEP_DONE, s)
        return True

    def _start_link(self, now: float) -> bool:
        """The idle link requests the controller's next fetch: one RTT first unless it follows
        the previous transfer back to back."""
        if self._transfer is not None or self.finished:
            return False
        f = self.ctl.next_fetch(now)
        if f is None:
            return False
        inst = self.inst
        c = inst.chunk_index(f.cid)
        li = inst.level_index(f.level)
        nbytes = int(inst.chunk_bytes[c, li])
        idle_gap = self._link_first or now > self._link_free_since + 1e-12
        rtt = self.trace.rtt_s(now, inst.rtt_s) if idle_gap else 0.0
        self._link_first = False
        start = now + rtt
        end = self.trace.transfer_end(start, nbytes)
        self.link_wait_s += rtt
        self.transfers.append(TransferRecord(f.cid, f.level, nbytes, now, start, end))
        tid = len(self.transfers) - 1
        self._transfer = _Transfer(tid, c, li, start, end, start)
        if start > now and self.inst.receive_tax > 0:
            self._push(start, _FIRST_BYTE, tid)
        self._retime_running_step(now)
        self._push(end, _RECV_DONE, tid)
        self._schedule_ticks(tid, start, end)
        return True

    def _schedule_ticks(self, tid: int, start: float, end: float) -> None:
        """Rate samples every ``sample_interval_s`` while bytes flow (``_MAX_SAMPLES`` at most)."""
        interval = self.sample_interval_s
        if not (math.isfinite(interval) and interval > 0):
            return
        step = max(interval, (end - start) / _MAX_SAMPLES)
        k = 1
        while start + k * step < end:
            self._push(start + k * step, _TICK, tid)
            k += 1

    def _process_cancellations(self, now: float) -> None:
        """Aborts the in-flight transfer if the controller cancelled it (its bytes are wasted)."""
        for cid in self.ctl.take_cancellations():
            cur = self._transfer
            if cur is not None and self.inst.chunk_index(cid) == cur.c:
                rec = self.transfers[cur.tid]
                got = self.trace.bytes_between(cur.start, now) if now > cur.start else 0.0
                self.bytes_wasted += int(got)
                self.link_busy_s += max(0.0, now - cur.start)
                rec.end_s, rec.cancelled = now, True
                self._link_idle(now)
                self._retime_running_step(now)

    # ------------------------------------------------------------------ outcome
    def _deadlock(self, now: float) -> SimulationError:
        inst, st = self.inst, self.ctl.state
        cq, lq = st.compute.order, st.link.order
        blocked = [f"{inst.step_id(s)} waits for " + ", ".join(self.dep.missing_for(s)[:4])
                   for s in cq[:3]]
        return SimulationError(
            f"deadlock at t={now:.4f}s: {len(self.avail_at)}/{inst.num_chunks} chunks available, "
            f"link queue {len(lq)} chunks, compute queue {len(cq)} steps"
            + (": " + "; ".join(blocked) if blocked else ""))

    def _timeline(self) -> Timeline:
        return Timeline(
            ttft_s=self.ttft_s, ready_s=self.ready_s, suffix_start_s=self.suffix_start_s,
            steps=self.steps, transfers=self.transfers,
            available_s={self.inst.chunk_id(c): t for c, t in self.avail_at.items()},
            link_busy_s=self.link_busy_s, link_wait_s=self.link_wait_s,
            compute_busy_s=self.compute_busy_s, decode_busy_s=self.decode_busy_s,
            bytes_streamed=self.bytes_streamed, bytes_wasted=self.bytes_wasted,
            migrations=list(self.ctl.migrations))


def estimate_ttft(plan: Plan, inst: Instance) -> float:
    """TTFT of ``plan`` executed as written at the instance's constant bandwidth, no noise.

    The planners' shared objective, so that every planner is judged by the same yardstick. It is
    the closed form of :func:`simulate` with the static executor, a constant trace and no noise
    (the tests check that the two agree): the link transfers back to back after one RTT, the
    decoder follows in arrival order, and the compute thread runs the compute order strictly,
    each step starting when the previous one ended and its inputs are available, stretched by
    ``1 + receive_tax`` while the link transfers, and lengthened by ``stream_tax_s`` for each
    decode that ends while it runs. O(steps x
    token chunks); raises :class:`SimulationError` if a step waits for an input no path provides.
    """
    L, G = inst.L, inst.G
    names = {lv.name: i for i, lv in enumerate(inst.levels)}
    compute = [s[0] * L + s[1] for s in plan.compute_order]
    stream = [(c[0] * L + c[1]) * G + c[2] for c in plan.stream_order]
    levels = [names[plan.levels[c]] for c in plan.stream_order]
    return ttft_of(inst, compute, stream, levels)


def ttft_of(inst: Instance, compute: Sequence[int], stream: Sequence[int],
            levels: Sequence[int]) -> float:
    """:func:`estimate_ttft` on dense ids: step ids in compute order, chunk ids in stream order and
    the level index of each streamed chunk (parallel to ``stream``). The planners call it tens
    of times a plan (on the plan's critical path: the link starts once the plan is made), so it
    reads the instance's arrays as cached lists (:meth:`Instance.as_lists`) and takes each
    step's token dependency as one strided slice per KV group."""
    if inst.decode_in_turn:
        return _ttft_in_turn(inst, compute, stream, levels)
    L, G = inst.L, inst.G
    rate = (inst.bandwidth_Bps / MBPS) * MBPS  # the same float the trace yields
    nbytes, tproc, tcomp = inst.as_lists()
    avail = [math.inf] * inst.num_chunks
    t = inst.rtt_s
    dec = 0.0
    for c, li in zip(stream, levels):
        t = t + nbytes[c][li] / rate
        dec = (t if t > dec else dec) + tproc[c][li]
        avail[c] = dec
    # bytes arrive from one RTT in to the last byte; the steps run `slow` times slower then
    busy = (inst.rtt_s, t) if stream else (0.0, 0.0)
    slow = 1.0 + inst.receive_tax
    stretch = slow > 1.0
    tax = inst.stream_tax_s
    decoded = sorted(avail[c] for c in stream) if tax > 0 else []
    comp_end = 0.0
    step_end = [math.inf] * inst.num_steps
    row = L * G                                  # one token chunk's chunks
    for s in compute:
        tt, l = divmod(s, L)
        r = comp_end
        if l > 0 and step_end[s - 1] > r:
            r = step_end[s - 1]
        if l < L - 1 and tt:
            # the chunks (t' < tt, l, g): every row-th entry from (0, l, g)
            for g in range(l * G, l * G + G):
                a = max(avail[g:tt * row:row])
                if a > r:
                    r = a
        if r == math.inf:
            raise SimulationError(f"{StepId(tt, l)} waits for an input that never comes")
        comp_end = r + tcomp[s]
        if stretch and r < busy[1]:
            comp_end = _stretched_end(r, tcomp[s], busy, slow)
        if decoded:
            comp_end = _taxed_end(decoded, r, comp_end, tax)
        step_end[s] = comp_end
        for c in range(s * G, s * G + G):
            if comp_end < avail[c]:
                avail[c] = comp_end
    ready = max(avail) if avail else 0.0
    if ready == math.inf:
        raise SimulationError("some chunk is neither streamed nor computed")
    return max(ready, comp_end) + inst.t_suffix_s


def _ttft_in_turn(inst: Instance, compute: Sequence[int], stream: Sequence[int],
                  levels: Sequence[int]) -> float:
    """:func:`ttft_of` where the compute thread decodes in turn (``Instance.decode_in_turn``):
    before each step it decodes every chunk received by then, in arrival order; a step whose
    streamed input has not been received waits for the next chunk to arrive and decodes it;
    the chunks received after the last step are decoded after it."""
    L, G = inst.L, inst.G
    rate = (inst.bandwidth_Bps / MBPS) * MBPS
    nbytes, tproc, tcomp = inst.as_lists()
    avail = [math.inf] * inst.num_chunks
    arrive: list[float] = []
    cost: list[float] = []
    t = inst.rtt_s
    for c, li in zip(stream, levels):
        t = t + nbytes[c][li] / rate
        arrive.append(t)
        cost.append(tproc[c][li])
    busy, slow = ((inst.rtt_s, t) if stream else (0.0, 0.0)), 1.0 + inst.receive_tax
    free, k, n = 0.0, 0, len(arrive)
    step_end = [math.inf] * inst.num_steps
    row = L * G
    for s in compute:
        tt, l = divmod(s, L)
        while True:
            while k < n and arrive[k] <= free:      # decode what was received
                free += cost[k]
                if free < avail[stream[k]]:
                    avail[stream[k]] = free
                k += 1
            r = step_end[s - 1] if l > 0 else 0.0
            if l < L - 1 and tt:
                for g in range(l * G, l * G + G):
                    a = max(avail[g:tt * row:row])
                    if a > r:
                        r = a
            if r <= free:
                break
            if k == n:
                raise SimulationError(f"{StepId(tt, l)} waits for an input that never comes")
            free = arrive[k] if arrive[k] > free else free   # wait for the next chunk
        end = free + tcomp[s]
        if slow > 1.0 and free < busy[1]:
            end = _stretched_end(free, tcomp[s], busy, slow)
        step_end[s] = free = end
        for c in range(s * G, s * G + G):
            if end < avail[c]:
                avail[c] = end
    for j in range(k, n):                            # the chunks received after the last step
        free = (arrive[j] if arrive[j] > free else free) + cost[j]
        if free < avail[stream[j]]:
            avail[stream[j]] = free
    ready = max(avail) if avail else 0.0
    if ready == math.inf:
        raise SimulationError("some chunk is neither streamed nor computed")
    return max(ready, free) + inst.t_suffix_s


def _stretched_end(start: float, work: float, busy: tuple[float, float], slow: float) -> float:
    """The end of ``work`` seconds of compute begun at ``start`` that runs ``slow`` times slower
    inside ``busy`` (the link's first and last byte)."""
    since, until = busy
    if start < since:
        if start + work <= since:
            return start + work
        work -= since - start
        start = since
    if start + work * slow <= until:
        return start + work * slow
    return until + work - (until - start) / slow


def _taxed_end(decoded: Sequence[float], start: float, end: float, tax: float) -> float:
    """The end of a step from ``start`` to ``end`` lengthened by ``tax`` for each decode (sorted
    ``decoded`` end times) that ends strictly inside it, each lengthening taking in the decodes
    it reaches (the simulator's rule)."""
    i = bisect_right(decoded, start)
    while i < len(decoded) and decoded[i] < end:
        end += tax
        i += 1
    return end
