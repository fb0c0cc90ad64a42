"""A discrete-event simulator of loading one context on the device: ``simulate(plan, inst, trace, noise)``.

The device model (docs/scheduler.md, "Simulator"):

* **link**: one serial transfer at a time; a transfer's bytes drain at the trace's rate. A request
  made while the link was idle waits one RTT before its first byte; a request made back-to-back
  (the previous transfer just finished) is pipelined (no extra RTT). Rate samples go to the
  controller every ``sample_interval_s`` while bytes flow (at most 200 per transfer) and at the end
  of each transfer.
* **decoder**: a received chunk is decoded (``t_proc`` of its level) by one decode worker, in
  arrival order, overlapping the next transfer; then the chunk is available.
* **compute thread**: one layer step at a time, ``t_comp x noise``; a step starts only when its
  inputs are available (the simulator checks; a controller that breaks this raises
  :class:`SimulationError`).
* **end**: when every KV chunk is available and the compute thread is free, the question is
  prefilled (``t_suffix_s x noise``): TTFT = that end. Time 0 is the start of loading (planning and
  manifest fetch are not included; the benchmark reports the planning time beside it).

Both workers are driven by a :class:`~sparkv.scheduler.controller.Controller` through its event
interface; without one, :meth:`ControllerConfig.static` follows the plan exactly.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from sparkv.errors import SparkvError
from sparkv.layout import KVChunkId, StepId
from sparkv.scheduler.controller import Controller, ControllerConfig, Migration
from sparkv.scheduler.graph import DepState
from sparkv.scheduler.instance import MBPS, Instance
from sparkv.scheduler.plan import Plan
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
        return np.exp(rng.normal(-self.sigma ** 2 / 2, self.sigma, n + 1))  # mean 1

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
_RECV_DONE, _DECODE_DONE, _STEP_DONE, _TICK = 0, 1, 2, 3


def simulate(plan: Plan, inst: Instance, trace: Trace | None = None,
             noise: ComputeNoise | None = None,
             controller: Controller | ControllerConfig | None = None, *,
             sample_interval_s: float = 0.05, max_time_s: float = 1e7) -> Timeline:
    """Runs ``plan`` on ``inst`` under ``trace`` (default: constant at the instance's bandwidth).

    ``controller``: a ready :class:`Controller`, or a :class:`ControllerConfig` to build one, or
    ``None`` for the static executor (the plan exactly as written).
    """
    if trace is None:
        trace = Trace.constant(inst.bandwidth_Bps / MBPS)
    noise = noise or ComputeNoise()
    if isinstance(controller, Controller):
        ctl = controller
    else:
        ctl = Controller(plan, inst, controller or ControllerConfig.static())
    factors = noise.step_factors(inst.num_steps)
    G = inst.G
    t_comp = inst.step_t_comp
    n_chunks = inst.num_chunks
    dep = DepState.for_instance(inst)
    avail_at: dict[int, float] = {}

    heap: list[tuple[float, int, int, int]] = []
    seq = 0

    def push(t: float, kind: int, a: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, kind, seq, a))

    # link state
    link_busy = False
    link_free_since = 0.0
    link_first = True
    cur: dict[str, Any] | None = None
    transfers: list[TransferRecord] = []
    link_busy_s = link_wait_s = 0.0
    bytes_streamed = bytes_wasted = 0
    # decoder
    decode_q: list[tuple[int, int, TransferRecord]] = []
    decoding = False
    decode_busy_s = 0.0
    # compute
    running: int | None = None
    compute_busy_s = 0.0
    steps: dict[StepId, tuple[float, float]] = {}
    n_avail = 0
    ready_s = math.nan
    finished = False
    ttft = math.nan
    suffix_start = math.nan

    def make_available(c: int, now: float) -> None:
        nonlocal n_avail
        if c not in avail_at:
            avail_at[c] = now
            n_avail += 1

    def start_decode(now: float) -> bool:
        nonlocal decoding, decode_busy_s
        if decoding or not decode_q:
            return False
        c, li, rec = decode_q.pop(0)
        d = float(inst.t_proc[c, li])
        decoding = True
        decode_busy_s += d
        push(now + d, _DECODE_DONE, c)
        rec.decoded_s = now + d
        return True

    def start_compute(now: float) -> bool:
        nonlocal running, compute_busy_s
        if running is not None or finished:
            return False
        step = ctl.next_step(now)
        if step is None:
            return False
        s = inst.step_index(step)
        if not dep.ready(s):
            missing = dep.missing_for(s) if not dep.computed[s] else ["it is already computed"]
            raise SimulationError(f"controller started {step} at t={now:.4f}s but it lacks: "
                                  + ", ".join(missing[:5]))
        dur = float(t_comp[s]) * float(factors[s]) * noise.slowdown(now)
        running = s
        compute_busy_s += dur
        steps[step] = (now, now + dur)
        push(now + dur, _STEP_DONE, s)
        return True

    def start_link(now: float) -> bool:
        nonlocal link_busy, cur, link_first, link_wait_s
        if link_busy or finished:
            return False
        f = ctl.next_fetch(now)
        if f is None:
            return False
        c = inst.chunk_index(f.cid)
        li = inst.level_index(f.level)
        nbytes = int(inst.chunk_bytes[c, li])
        idle_gap = link_first or now > link_free_since + 1e-12
        rtt = trace.rtt_s(now, inst.rtt_s) if idle_gap else 0.0
        link_first = False
        start = now + rtt
        end = trace.transfer_end(start, nbytes)
        link_wait_s += rtt
        rec = TransferRecord(f.cid, f.level, nbytes, now, start, end)
        transfers.append(rec)
        tid = len(transfers) - 1
        cur = {"tid": tid, "c": c, "li": li, "start": start, "end": end, "last": start}
        link_busy = True
        push(end, _RECV_DONE, tid)
        if math.isfinite(sample_interval_s) and sample_interval_s > 0:
            step = max(sample_interval_s, (end - start) / _MAX_SAMPLES)
            k = 1
            while start + k * step < end:
                push(start + k * step, _TICK, tid)
                k += 1
        return True

    def process_cancellations(now: float) -> None:
        nonlocal link_busy, cur, link_free_since, link_busy_s, bytes_wasted
        for cid in ctl.take_cancellations():
            if cur is not None and inst.chunk_index(cid) == cur["c"]:
                rec = transfers[cur["tid"]]
                got = trace.bytes_between(cur["start"], now) if now > cur["start"] else 0.0
                bytes_wasted += int(got)
                link_busy_s += max(0.0, now - cur["start"])
                rec.end_s, rec.cancelled = now, True
                cur = None
                link_busy = False
                link_free_since = now

    def pump(now: float) -> None:
        # a query can change the controller's mind about the other path (a migration inside
        # next_fetch can give the idle compute thread work): repeat until nothing more starts
        for _ in range(1000):
            rev = ctl.revision
            process_cancellations(now)
            started = start_compute(now)
            started = start_link(now) or started
            started = start_decode(now) or started
            if not started and not ctl.has_cancellations and ctl.revision == rev:
                break

    def check_done(now: float) -> None:
        nonlocal finished, ready_s, ttft, suffix_start
        if finished or n_avail < n_chunks:
            return
        if math.isnan(ready_s):
            ready_s = now
        if running is not None:
            return  # the suffix waits for the compute thread
        finished = True
        suffix_start = now
        ttft = now + inst.t_suffix_s * float(factors[-1]) * noise.slowdown(now)

    ctl.start(0.0)
    pump(0.0)
    check_done(0.0)
    now = 0.0
    while heap and not finished:
        now, kind, _, a = heapq.heappop(heap)
        if now > max_time_s:
            raise SimulationError(f"simulation passed {max_time_s} s without finishing")
        if kind == _TICK:
            if cur is not None and cur["tid"] == a:
                got = trace.bytes_between(cur["last"], now)
                ctl.rate_sample(now, got, now - cur["last"], transfers[a].cid)
                cur["last"] = now
        elif kind == _RECV_DONE:
            if cur is None or cur["tid"] != a:
                continue  # cancelled
            rec = transfers[a]
            got = trace.bytes_between(cur["last"], now)
            ctl.rate_sample(now, got, now - cur["last"], rec.cid)
            link_busy_s += now - cur["start"]
            bytes_streamed += rec.nbytes
            decode_q.append((cur["c"], cur["li"], rec))
            cur = None
            link_busy = False
            link_free_since = now
            ctl.chunk_received(rec.cid, now)
        elif kind == _DECODE_DONE:
            decoding = False
            c = a
            if not dep.chunk_avail[c]:
                dep.add_chunk(c)
            make_available(c, now)
            ctl.chunk_arrived(inst.chunk_id(c), now)
        elif kind == _STEP_DONE:
            s = a
            running = None
            dep.mark_computed(s)
            for g in range(G):
                make_available(s * G + g, now)
            step = inst.step_id(s)
            ctl.step_done(step, now, steps[step][1] - steps[step][0])
        check_done(now)
        if not finished:
            pump(now)
            check_done(now)
    if not finished:
        blocked = []
        for s in ctl.cq[:3]:
            blocked.append(f"{inst.step_id(s)} waits for " + ", ".join(dep.missing_for(s)[:4]))
        raise SimulationError(
            f"deadlock at t={now:.4f}s: {n_avail}/{n_chunks} chunks available, link queue "
            f"{len(ctl.lq)} chunks, compute queue {len(ctl.cq)} steps"
            + (": " + "; ".join(blocked) if blocked else ""))
    return Timeline(
        ttft_s=ttft, ready_s=ready_s, suffix_start_s=suffix_start, steps=steps,
        transfers=transfers, available_s={inst.chunk_id(c): t for c, t in avail_at.items()},
        link_busy_s=link_busy_s, link_wait_s=link_wait_s, compute_busy_s=compute_busy_s,
        decode_busy_s=decode_busy_s, bytes_streamed=bytes_streamed, bytes_wasted=bytes_wasted,
        migrations=list(ctl.migrations))


def estimate_ttft(plan: Plan, inst: Instance) -> float:
    """TTFT of ``plan`` executed as written at the instance's constant bandwidth, no noise.

    The planners' shared objective, so that every planner is judged by the same yardstick. It is
    the closed form of :func:`simulate` with the static executor, a constant trace and no noise
    (the tests check that the two agree): the link transfers back to back after one RTT, the
    decoder follows in arrival order, and the compute thread runs the compute order strictly,
    each step starting when the previous one ended and its inputs are available. O(steps x
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
    the level index of each streamed chunk (parallel to ``stream``)."""
    L, G = inst.L, inst.G
    rate = (inst.bandwidth_Bps / MBPS) * MBPS  # the same float the trace yields
    nbytes, tproc, tcomp = inst.chunk_bytes, inst.t_proc, inst.step_t_comp
    avail = [math.inf] * inst.num_chunks
    t = inst.rtt_s
    dec = 0.0
    for c, li in zip(stream, levels):
        t = t + int(nbytes[c, li]) / rate
        dec = (t if t > dec else dec) + float(tproc[c, li])
        avail[c] = dec
    comp_end = 0.0
    step_end = [math.inf] * inst.num_steps
    for s in compute:
        tt, l = divmod(s, L)
        r = comp_end
        if l > 0:
            r = max(r, step_end[s - 1])
        if l < L - 1:
            for tp in range(tt):
                base = (tp * L + l) * G
                for g in range(G):
                    a = avail[base + g]
                    if a > r:
                        r = a
        if r == math.inf:
            raise SimulationError(f"{StepId(tt, l)} waits for an input that never comes")
        comp_end = r + float(tcomp[s])
        step_end[s] = comp_end
        for g in range(G):
            if comp_end < avail[s * G + g]:
                avail[s * G + g] = comp_end
    ready = max(avail) if avail else 0.0
    if ready == math.inf:
        raise SimulationError("some chunk is neither streamed nor computed")
    return max(ready, comp_end) + inst.t_suffix_s
