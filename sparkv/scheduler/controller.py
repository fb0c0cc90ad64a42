"""The runtime controller (paper IV-D, design notes): executes a plan and rebalances it online.

One :class:`Controller` object sits between a plan and the two workers of the device: the compute
thread (one layer step at a time) and the link (fetches KV chunks). The workers ask it what to do
next and tell it what happened; the simulator and the real edge engine drive it through the same
calls:

* queries: :meth:`Controller.next_step` (compute thread is free: which step now? ``None`` = wait for
  the next event), :meth:`Controller.next_fetch` (the link can take a request: which chunk, at which
  level? ``None`` = nothing to fetch now), :meth:`Controller.take_cancellations` (in-flight fetches to
  abort);
* events: :meth:`Controller.rate_sample` (bytes received over some seconds), :meth:`chunk_received`
  (a transfer completed, decoding starts), :meth:`chunk_arrived` (decoded: the KV is in place),
  :meth:`step_done` (a layer step finished, with its measured time).

Every method takes ``now`` in seconds on the caller's clock (monotonic; the origin is :meth:`start`).

Adaptation (``ControllerConfig.adapt``), re-evaluated after every event:

* Estimates: link throughput as the slower of a sliding window of rate samples (0.5 s) and the
  last ``fast_window_s`` (0.15 s): a fade shows within a sample or two, a recovery once the window
  sees it (:meth:`Controller.link_estimate`); compute speed as the mean ratio measured/predicted
  over the last steps.
* Remaining work: ``link_rem`` = bytes still to fetch / throughput; ``comp_rem`` = predicted seconds
  of queued steps x the compute ratio.
* **Link behind** (``link_rem > comp_rem + margin``): a step all of whose chunks are still planned for
  streaming, and whose inputs are available or already on the compute path, moves to the compute
  queue (after its dependencies); its queued fetches are dropped and an in-flight one is cancelled if
  waiting for it (its bytes and every in-flight byte ahead of it) would take more than twice as
  long as computing the step. Candidates are taken from the TAIL of the link queue, then of the
  in-flight fetches (what the link would reach last); inputs "on the compute path" let it reach compute-ready chunks of later stages
  (the paper's "advance to the next stage"). When every candidate is *locked* (the layer below
  it was streamed, so its hidden state was never computed), ``recompute`` is on (off by default)
  and the compute path is idle, the cheapest column is recomputed instead: the streamed steps
  below the candidate, down to the last one on the compute path, are computed again for their
  hidden states (their KV is in place already).
* **Compute behind** (``comp_rem > link_rem + margin``): the link never waits for a stage boundary
  (the plan's later chunks are fetched as soon as the link is free: the paper's speculative
  prefetch), and when the link's remaining work is smaller than compute's, steps migrate from the
  TAIL of the compute order to streaming: the last queued step that nothing queued depends on
  (with the layer below it when it is the cheap last-layer projection), if that shortens
  ``max(comp_rem, link_rem)``.
* **Dependency prefetch**: when one of the first queued steps waits for a chunk still in the link
  queue, that chunk is fetched next.
* Just in time: work moves to a path only when that path's remaining work is under
  ``horizon_s`` (two stages by default), as in the paper (the GPU is given link work when it would
  otherwise idle, the link is given compute work when its queue would run dry). A deep but
  transient fade then does not commit the compute thread to work it cannot finish before the link
  recovers.
* A cap of ``max_migrations_per_stage`` migrations per stage (stage clock: the plan's ``Delta_t``)
  and a hysteresis margin prevent oscillation.
* Optional CacheGen-style level adaptation: each fetched chunk gets the best allowed level whose
  expected completion, with the rest at the cheapest level, meets ``slo_s``.

* Probe and hand-back (:mod:`sparkv.scheduler.probe`): an idle link gets one bounded probe
  at a time (:class:`~sparkv.scheduler.probe.LinkProbe`); a compute path behind hands the link
  whole queued columns from the tail; while the link has nothing but a probe to do,
  :meth:`Controller.next_steps` commits a token chunk's next layers to the compute thread as
  one run (the engine's all-local fast path).

``ControllerConfig.static()`` follows the plan exactly (strict order on both paths, no adaptation):
the reference executor for "the same plan without a controller".
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace
from typing import Iterable, Iterator, NamedTuple

from sparkv.layout import KVChunkId, StepId
from sparkv.scheduler.graph import DepState
from sparkv.scheduler.instance import Instance
from sparkv.scheduler.plan import Plan
from sparkv.scheduler.probe import LinkProbe


class Fetch(NamedTuple):
    """A request for the link: chunk ``cid`` at codec level ``level``."""

    cid: KVChunkId
    level: str


@dataclass
class Migration:
    """One decision of the controller, for the timeline and logs."""

    time_s: float
    direction: str  # "to_compute" | "to_stream"
    steps: list[StepId]
    cancelled: list[KVChunkId]
    link_remaining_s: float
    compute_remaining_s: float

    def to_dict(self) -> dict:
        return {"time_s": self.time_s, "direction": self.direction,
                "steps": [list(s) for s in self.steps],
                "cancelled": [list(c) for c in self.cancelled],
                "link_remaining_s": self.link_remaining_s,
                "compute_remaining_s": self.compute_remaining_s}


@dataclass
class ControllerConfig:
    """Knobs of the runtime controller (see the module docstring)."""

    adapt: bool = True
    work_conserving: bool = True       # run the first *ready* queued step, not only the head
    migrate_to_compute: bool = True    # link behind
    migrate_to_stream: bool = True     # compute behind
    prefetch: bool = True
    cancel_inflight: bool = True
    adapt_levels: bool = False         # CacheGen-style SLO level choice per fetch
    slo_s: float = 2.0
    max_migrations_per_stage: int = 8
    stage_s: float | None = None       # None: plan.stage_budget_s, else estimated TTFT / 10
    horizon_s: float | None = None     # migrate to a path only when its work left is below this
                                       # (None: 2 stages)
    window_s: float = 0.5              # link throughput window
    fast_window_s: float = 0.15        # recent throughput: an in-flight fetch is judged by the
                                       # slower of this and the window (a fade shows at once)
    compute_window: int = 8            # steps in the compute-speed window
    margin_frac: float = 0.05
    margin_s: float = 0.02
    tail_window: int = 16              # tail candidates examined per compute->stream migration
    prefetch_lookahead: int = 2        # queued steps whose missing chunks are fetched first
    bulk_ratio: float = 1.5            # one path this many times behind: migrate without the
                                       # per-stage cap, until balanced (a link that recovered or
                                       # collapsed is not handed work a few steps per stage)
    probe: bool = True                 # an idle link fetches the compute order's last step
                                       # (its cheapest level): the link keeps being measured
    probe_rate_Bps: float = 1_000_000.0   # the probe's bound (sparkv.scheduler.probe): bytes
    probe_burst_bytes: float = 512_000.0  # per second of the load, and at once; one in flight
    hand_back_columns: bool = True     # compute behind: hand the link the tail's whole
                                       # token-chunk column when it shortens the load
    column_steps: bool = True          # the link has nothing but a probe to do: the compute
                                       # thread gets the next step's column, back to back
    column_max_s: float | None = None  # predicted seconds of one such run (None: 2 stages)
    recompute: bool = False            # a step locked by streamed layers below it may move
                                       # to compute with them (they are computed again), when
                                       # the compute path is idle (docs/scheduler.md: off by
                                       # default until measured on the adversarial traces)

    @property
    def may_stream(self) -> bool:
        """Whether this controller may hand the link work the plan did not (a migration to the
        link, or a probe): a plan that streams nothing still needs a running link then."""
        return self.adapt and (self.migrate_to_stream or self.probe)

    def without_link(self) -> "ControllerConfig":
        """The same controller for an engine with no link: it never hands the link anything."""
        return replace(self, migrate_to_stream=False, probe=False)

    @property
    def commits_columns(self) -> bool:
        """Whether :meth:`Controller.next_steps` may hand out more than one step."""
        return self.adapt and self.column_steps

    @classmethod
    def static(cls) -> "ControllerConfig":
        """Follow the plan exactly: strict order on both paths, no adaptation."""
        return cls(adapt=False, work_conserving=False, migrate_to_compute=False,
                   migrate_to_stream=False, prefetch=False, cancel_inflight=False, probe=False)

    @classmethod
    def cachegen(cls, slo_s: float = 2.0) -> "ControllerConfig":
        """Stream-only CacheGen behaviour: no migrations, per-chunk level from throughput + SLO."""
        return cls(adapt=True, migrate_to_compute=False, migrate_to_stream=False, prefetch=False,
                   cancel_inflight=False, adapt_levels=True, slo_s=slo_s, probe=False)


@dataclass
class _Inflight:
    li: int
    nbytes: int
    received: float = 0.0
    requested_s: float = 0.0


class _LinkScan(NamedTuple):
    """One look at the link for a migration to compute: the throughput (bytes/s) and compute
    ratio it is judged with, the scheduling frontier (:meth:`Controller._sched_frontier`), the
    queued chunks, and per in-flight chunk the bytes the link delivers until it is complete (its
    own and every in-flight byte ahead of it)."""

    bw: float
    ratio: float
    frontier: list[int]
    queued: set[int]
    done_after: dict[int, float]


class Controller:
    """Executes ``plan`` on ``inst`` and adapts it at run time (module docstring)."""

    def __init__(self, plan: Plan, inst: Instance, config: ControllerConfig | None = None,
                 done_steps: Iterable[StepId] = ()):
        """``done_steps``: layer steps already computed before loading began (the engine's
        prelude computed them while the manifest and the plan were on their way): they leave
        both queues and their KV chunks count as in place."""
        self.plan, self.inst = plan, inst
        self.cfg = config if config is not None else ControllerConfig()
        n_s, n_c = inst.num_steps, inst.num_chunks
        self._L, self._G = inst.L, inst.G
        self._t_comp = inst.step_t_comp.tolist()
        self._bytes = inst.chunk_bytes
        self._cheap = inst.cheapest_level.tolist()
        self._level_names = [lv.name for lv in inst.levels]
        self._li: list[int] = list(self._cheap)
        for cid, name in plan.levels.items():
            self._li[inst.chunk_index(cid)] = inst.level_index(name)
        self.cq: list[int] = [inst.step_index(s) for s in plan.compute_order]
        self.lq: list[int] = [inst.chunk_index(c) for c in plan.stream_order]
        self.on_compute = [False] * n_s      # queued, running or done on the compute path
        for s in self.cq:
            self.on_compute[s] = True
        self.on_link = [False] * n_c         # queued, in flight, received or arrived by the link
        for c in self.lq:
            self.on_link[c] = True
        self.dep = DepState.for_instance(inst)
        self._available = 0
        done = {inst.step_index(sid) for sid in done_steps}
        if done:
            G = inst.G
            self.cq = [s for s in self.cq if s not in done]
            self.lq = [c for c in self.lq if c // G not in done]
            for s in sorted(done):
                self.on_compute[s] = True
                before = sum(self.dep.chunk_avail[s * G + g] for g in range(G))
                self.dep.mark_computed(s)
                self._available += G - before
                for g in range(G):
                    self.on_link[s * G + g] = False
        self.running: int | None = None
        self.running_since = 0.0
        self._committed: list[int] = []     # steps handed out after ``running``, in order
        self._committed_pred = 0.0
        self.probe = LinkProbe(self.cfg.probe_rate_Bps, self.cfg.probe_burst_bytes)
        self.inflight: dict[int, _Inflight] = {}
        self.received: set[int] = set()
        self._cq_pred = float(sum(self._t_comp[s] for s in self.cq))
        self._lq_bytes = float(sum(int(self._bytes[c, self._li[c]]) for c in self.lq))
        self._lq_min_bytes = float(sum(int(self._bytes[c, self._cheap[c]]) for c in self.lq))
        self._bw: deque[tuple[float, float, float]] = deque()
        self._bw_total = [0.0, 0.0]          # bytes, seconds of every rate sample of the run
        self._ratios: deque[float] = deque(maxlen=max(1, self.cfg.compute_window))
        self._cancel: list[KVChunkId] = []
        self.migrations: list[Migration] = []
        self.revision = 0   # bumped whenever the controller changes the plan (for its drivers)
        self.t0 = 0.0
        self._stage = -1
        self._stage_count = 0
        self._next_scan_s = -math.inf
        stage = self.cfg.stage_s or plan.stage_budget_s
        if not stage:
            est = plan.estimated_ttft_s or (inst.step_t_comp.sum() + inst.min_stream_time.sum()) / 2
            stage = max(est / 10.0, 0.05)
        self.stage_s = float(stage)
        self.horizon_s = float(self.cfg.horizon_s if self.cfg.horizon_s is not None
                               else 2.0 * self.stage_s)

    # ------------------------------------------------------------------ lifecycle
    def start(self, now: float) -> None:
        """Call once when loading begins."""
        self.t0 = now

    @property
    def done(self) -> bool:
        """Every KV chunk is in place."""
        return self._available == self.inst.num_chunks

    # ------------------------------------------------------------------ queries
    def next_step(self, now: float) -> StepId | None:
        """The compute thread is free: the step to run now, or ``None`` (wait for an event).
        The first of :meth:`next_steps`; after it handed out several, the next of them (a
        driver that runs one step at a time, the simulator, runs a column this way)."""
        if self.running is None and self._committed:
            s = self._committed.pop(0)
            self._committed_pred -= self._t_comp[s]
            self.running, self.running_since = s, now
            return self.inst.step_id(s)
        steps = self.next_steps(now)
        return steps[0] if steps else None

    def next_steps(self, now: float, column: bool = True) -> list[StepId]:
        """The compute thread is free: the steps to run now, back to back (empty: wait for an
        event). One step, or (``column`` and ``ControllerConfig.column_steps``), when the link
        has nothing but a probe to do, the next step and the layers above it of the same token
        chunk queued right after it, up to ``column_max_s`` of predicted time: the all-local
        path then runs a token chunk's layers in one call (the engine's fast path). The caller
        reports every step with :meth:`step_done`, in order; the first is running, the others
        are committed to the compute path (no migration takes them)."""
        if self.running is not None or self._committed or not self.cq:
            return []
        self._rebalance(now)
        pick = self._ready_index()
        if pick < 0:
            return []
        run = [self.cq.pop(pick)]
        if column and self.cfg.commits_columns and self._link_quiet():
            run += self._column_after(run[0], pick)
        for s in run:
            self._cq_pred -= self._t_comp[s]
        self.running, self.running_since = run[0], now
        self._committed = run[1:]
        self._committed_pred = float(sum(self._t_comp[s] for s in self._committed))
        return [self.inst.step_id(s) for s in run]

    def _ready_index(self) -> int:
        """Index in the compute queue of the step to run next (-1: none is ready)."""
        dep = self.dep
        if self.cfg.work_conserving:
            for i, s in enumerate(self.cq):
                if dep.ready(s):
                    return i
            return -1
        return 0 if dep.ready(self.cq[0]) else -1

    def _link_quiet(self) -> bool:
        """The link has nothing to do but a probe: nothing queued, nothing in flight or being
        decoded that is not a probe."""
        probes = self.probe.in_flight
        return not self.lq and all(c in probes for c in self.inflight) \
            and all(c in probes for c in self.received)

    def _column_after(self, s: int, pick: int) -> list[int]:
        """The steps queued right after ``s`` (taken out of the compute queue at ``pick``) that
        are the layers above it of its token chunk, each ready once the one below it ran, up to
        ``column_max_s`` of predicted time (``s`` included); popped from the queue."""
        L, dep = self._L, self.dep
        limit = self.cfg.column_max_s if self.cfg.column_max_s is not None else self.horizon_s
        total = self._t_comp[s]
        out: list[int] = []
        nxt = s + 1
        while pick < len(self.cq) and self.cq[pick] == nxt and nxt % L != 0 \
                and dep.token_ok(nxt) and total + self._t_comp[nxt] <= limit:
            out.append(self.cq.pop(pick))
            total += self._t_comp[nxt]
            nxt += 1
        return out

    def next_fetch(self, now: float) -> Fetch | None:
        """The link can take a request: the chunk (and level) to fetch now, or ``None``."""
        self._rebalance(now)
        if not self.lq and not self.inflight and self.cfg.adapt and self.cfg.probe \
                and self.cfg.migrate_to_stream:
            self._probe(now)
        while self.lq:
            i = self._prefetch_index() if (self.cfg.adapt and self.cfg.prefetch) else 0
            c = self.lq.pop(i)
            li = self._li[c]
            self._lq_bytes -= int(self._bytes[c, li])
            self._lq_min_bytes -= int(self._bytes[c, self._cheap[c]])
            if self.dep.chunk_avail[c]:
                self.on_link[c] = False
                self.probe.settle(c)
                continue  # became available meanwhile (computed)
            if self.cfg.adapt_levels:
                li = self._slo_level(c, now)
                self._li[c] = li
            self.inflight[c] = _Inflight(li, int(self._bytes[c, li]), 0.0, now)
            cid = self.inst.chunk_id(c)
            if cid in self._cancel:   # cancelled, then handed back to the link before the
                self._cancel.remove(cid)   # driver took the cancellation: fetch it, once
            return Fetch(cid, self._level_names[li])
        return None

    @property
    def has_cancellations(self) -> bool:
        return bool(self._cancel)

    def take_cancellations(self) -> list[KVChunkId]:
        """In-flight fetches the link should abort (their steps moved to the compute path)."""
        out, self._cancel = self._cancel, []
        return out

    # ------------------------------------------------------------------ events
    def rate_sample(self, now: float, nbytes: float, seconds: float,
                    cid: KVChunkId | None = None) -> None:
        """``nbytes`` were received over the last ``seconds`` (optionally: for chunk ``cid``).

        A driver reports silence too (``nbytes`` 0) when a request is outstanding and nothing
        arrives beyond the expected first-byte delay: the estimate then follows what the link
        delivers over time, and a link that went quiet loses its work to the compute path."""
        if seconds > 0:
            self._bw.append((now, float(nbytes), float(seconds)))
            self._bw_total[0] += float(nbytes)
            self._bw_total[1] += float(seconds)
        if cid is not None:
            f = self.inflight.get(self.inst.chunk_index(cid))
            if f is not None:
                f.received += nbytes
        self._rebalance(now)

    def chunk_received(self, cid: KVChunkId, now: float) -> None:
        """The transfer of ``cid`` completed; it is being decoded."""
        c = self.inst.chunk_index(cid)
        self.inflight.pop(c, None)
        self.received.add(c)
        self.probe.settle(c)
        self._rebalance(now)

    def chunk_arrived(self, cid: KVChunkId, now: float) -> None:
        """``cid`` is decoded and in place (available to attention)."""
        c = self.inst.chunk_index(cid)
        self.received.discard(c)
        self.inflight.pop(c, None)
        self.probe.settle(c)
        if not self.dep.chunk_avail[c]:
            self._available += 1
            self.dep.add_chunk(c)
        self._rebalance(now)

    def step_done(self, step: StepId, now: float, seconds: float) -> None:
        """Layer step ``step`` finished after ``seconds``; its KV chunks are in place."""
        s = self.inst.step_index(step)
        if self.running == s:
            self.running = None
        elif s in self._committed:     # a committed step reported before it was handed out
            self._committed.remove(s)
            self._committed_pred -= self._t_comp[s]
        for g in range(self._G):
            self.probe.settle(s * self._G + g)
        pred = self._t_comp[s]
        if pred > 0 and seconds > 0:
            self._ratios.append(seconds / pred)
        before = sum(self.dep.chunk_avail[s * self._G + g] for g in range(self._G))
        self.dep.mark_computed(s)
        self._available += self._G - before
        self._rebalance(now)

    # ------------------------------------------------------------------ estimates
    def bandwidth_estimate(self, now: float) -> float:
        """Link throughput (bytes/s) over the sliding window; the plan's estimate before samples."""
        while len(self._bw) > 1 and self._bw[0][0] < now - self.cfg.window_s:
            self._bw.popleft()
        if not self._bw:
            return self.inst.bandwidth_Bps
        b = sum(x[1] for x in self._bw)
        s = sum(x[2] for x in self._bw)
        return max(b / s, 1.0) if s > 0 else self.inst.bandwidth_Bps

    def recent_bandwidth(self, now: float) -> float:
        """Throughput (bytes/s) over the last ``fast_window_s`` of rate samples (at least the
        newest one); the window estimate when there are none or the fast window is off."""
        long = self.bandwidth_estimate(now)
        if self.cfg.fast_window_s <= 0 or not self._bw:
            return long
        b = s = 0.0
        for t, nb, sec in reversed(self._bw):
            if s > 0 and t < now - self.cfg.fast_window_s:
                break
            b, s = b + nb, s + sec
        return max(b / s, 1.0) if s > 0 else long

    def run_bandwidth(self) -> float | None:
        """Throughput (bytes/s) over every rate sample of the run (silences included), or
        ``None`` before any sample: the link's goodput, a prior for the next load."""
        b, s = self._bw_total
        return b / s if s > 0 and b > 0 else None

    @property
    def compute_samples(self) -> int:
        """Layer steps in the compute-speed window."""
        return len(self._ratios)

    def compute_ratio(self) -> float:
        """Measured / predicted step time over the window (1.0 before any step)."""
        return sum(self._ratios) / len(self._ratios) if self._ratios else 1.0

    def remaining(self, now: float) -> tuple[float, float]:
        """``(compute_remaining_s, link_remaining_s)`` from the current estimates."""
        r = self.compute_ratio()
        comp = r * (self._cq_pred + self._committed_pred)
        if self.running is not None:
            comp += max(0.0, r * self._t_comp[self.running] - (now - self.running_since))
        pending = self._lq_bytes + sum(max(0.0, f.nbytes - f.received)
                                       for f in self.inflight.values())
        return comp, pending / self.link_estimate(now)

    def link_estimate(self, now: float) -> float:
        """The throughput (bytes/s) the controller plans the link's remaining work with: the
        slower of the window's and the last ``fast_window_s``'s. A fade shows within a sample
        or two (not after a whole window of good samples), while a recovery is believed only
        once the window sees it; both directions of migration use this one estimate, so they
        never disagree about the same link (no ping-pong)."""
        return min(self.bandwidth_estimate(now), self.recent_bandwidth(now))

    # ------------------------------------------------------------------ adaptation
    def _rebalance(self, now: float) -> None:
        cfg = self.cfg
        if not cfg.adapt or not (cfg.migrate_to_compute or cfg.migrate_to_stream):
            return
        stage = int(math.floor((now - self.t0) / self.stage_s)) if self.stage_s > 0 else 0
        if stage != self._stage:
            self._stage, self._stage_count = stage, 0
        if now < self._next_scan_s:
            return
        bulk_moves = 0
        while True:
            comp, link = self.remaining(now)
            bulk = max(comp, link) > cfg.bulk_ratio * max(min(comp, link), cfg.margin_s)
            if bulk:
                if bulk_moves >= self.inst.num_steps:
                    return
            elif self._stage_count >= cfg.max_migrations_per_stage:
                return
            margin = cfg.margin_s + cfg.margin_frac * max(comp, link)
            # just in time: a path takes over work only when its own queue is about to run dry
            # (remaining work under the horizon), so a transient slump does not overcommit it
            if link > comp + margin and cfg.migrate_to_compute and comp <= self.horizon_s:
                moved = self._to_compute(now, comp, link)
            elif comp > link + margin and cfg.migrate_to_stream and link <= self.horizon_s:
                moved = self._to_stream(now, comp, link)
            else:
                return
            if not moved:
                # nothing worth moving now: look again a little later (keeps events cheap)
                self._next_scan_s = now + min(0.05, self.stage_s / 4)
                return
            if bulk:
                bulk_moves += 1
            else:
                self._stage_count += 1

    def _sched_frontier(self) -> list[int]:
        """Per layer: first token chunk whose KV is neither available nor on the compute path."""
        L, n_t, dep = self._L, self.inst.n_t, self.dep
        out = []
        for l in range(L):  # noqa: E741
            t = dep.frontier[l]
            while t < n_t and (self.on_compute[t * L + l] or dep.kv_complete(t * L + l)):
                t += 1
            out.append(t)
        return out

    def _to_compute(self, now: float, comp: float, link: float) -> bool:
        """Link behind: move a compute-ready planned-stream step to the compute queue.

        Candidates are scanned from the TAIL of the link queue (the chunks the link would reach
        last, symmetric to migrating from the tail of the compute order), then the in-flight
        fetches (cancelled if finishing them is much slower than computing); the first whose
        move shortens ``max(comp_rem, link_rem)`` is taken. When none can move because the
        layers below them were streamed (their hidden states were never computed: a *locked
        column*), with ``recompute`` on and the compute path idle, the cheapest **recompute
        column** is taken instead: the streamed steps below the candidate, down to the last one
        on the compute path, are computed again (their KV is in place already; recomputing it
        gives the hidden state the candidate needs), if that still shortens
        ``max(comp_rem, link_rem)``.
        """
        scan = self._link_scan(now)
        best, cancel, locked = self._tail_candidate(scan, comp, link)
        if not best and locked:
            best, cancel = self._recompute_column(locked, scan, comp, link)
        if not best:
            return False
        self._take_off_link(best[-1], scan.queued)
        for cc in cancel:
            self.inflight.pop(cc, None)
            self._cancel.append(self.inst.chunk_id(cc))
        for u in best:   # bottom up: each step of a recompute column after the one below it
            self._enqueue_compute(u)
        self.revision += 1
        self.migrations.append(Migration(now, "to_compute", [self.inst.step_id(u) for u in best],
                                         [self.inst.chunk_id(c) for c in cancel], link, comp))
        return True

    def _link_scan(self, now: float) -> _LinkScan:
        """The link as :meth:`_to_compute` judges it now (see :class:`_LinkScan`)."""
        # an in-flight fetch completes after every byte ahead of it on the link (the requests
        # are read in order): the last chunk of a batch a fade caught is far away even when it
        # is small, and it is the one to take back first (the tail, as for queued chunks)
        done_after: dict[int, float] = {}
        ahead = 0.0
        for c, f in self.inflight.items():
            ahead += max(0.0, f.nbytes - f.received)
            done_after[c] = ahead
        return _LinkScan(self.link_estimate(now), self.compute_ratio(), self._sched_frontier(),
                         set(self.lq), done_after)

    def _takeable(self, scan: _LinkScan, s: int) -> tuple[float, list[int]] | None:
        """``(bytes saved, in-flight chunks to cancel)`` if every chunk of step ``s`` can be
        taken off the link, else ``None``."""
        G = self._G
        saved_bytes = 0.0
        cancel: list[int] = []
        for g in range(G):
            cc = s * G + g
            if cc in scan.queued:
                saved_bytes += int(self._bytes[cc, self._li[cc]])
            elif cc in self.inflight and self.cfg.cancel_inflight:
                f = self.inflight[cc]
                # cancel only if computing it is clearly faster than waiting for the
                # transfer (its own bytes and those ahead of it)
                if scan.done_after[cc] / scan.bw < 2 * scan.ratio * self._t_comp[s] \
                        + self.cfg.margin_s:
                    return None
                saved_bytes += f.nbytes - f.received
                cancel.append(cc)
            else:
                return None  # already received / arrived / not on the link
        return saved_bytes, cancel

    def _tail_candidate(self, scan: _LinkScan, comp: float,
                        link: float) -> tuple[list[int], list[int], list[int]]:
        """The first step from the link's tail whose move to compute shortens the load:
        ``([step], chunks to cancel, [])``; else ``([], [], locked candidates)`` (those whose
        layer below was streamed, collected only for a recompute column)."""
        L, G = self._L, self._G
        # a recompute column only when the compute path is idle, from the first locked
        # candidates of the tail: the scan runs under the engine's lock at every event, and
        # scanning every locked step each time (always on) slowed both adaptive strategies 5-7%
        column_ok = self.cfg.recompute and not self.cq and self.running is None \
            and not self._committed
        locked: list[int] = []
        seen: set[int] = set()
        for c in list(reversed(self.lq)) + list(reversed(self.inflight)):
            s = c // G
            if s in seen or self.on_compute[s]:
                continue
            seen.add(s)
            t, l = divmod(s, L)
            if l < L - 1 and scan.frontier[l] < t:
                continue
            if l > 0 and not self.on_compute[s - 1]:
                if column_ok and len(locked) < self.cfg.tail_window:
                    locked.append(s)
                continue
            got = self._takeable(scan, s)
            if got is None:
                continue
            saved_bytes, cancel = got
            if max(comp + scan.ratio * self._t_comp[s], link - saved_bytes / scan.bw) \
                    >= max(comp, link) - 1e-9:
                continue
            return [s], cancel, []
        return [], [], locked

    def _take_off_link(self, s: int, queued: set[int]) -> None:
        """Step ``s``'s chunks leave the link (its queued ones leave the queue)."""
        G = self._G
        for g in range(G):
            cc = s * G + g
            if cc in queued:
                self.lq.remove(cc)
                self._lq_bytes -= int(self._bytes[cc, self._li[cc]])
                self._lq_min_bytes -= int(self._bytes[cc, self._cheap[cc]])
            self.on_link[cc] = False
            self.probe.settle(cc)

    def _enqueue_compute(self, u: int) -> None:
        """Step ``u`` joins the compute queue after the last of its dependencies still queued."""
        L = self._L
        t, l = divmod(u, L)
        deps = {u - 1} if l > 0 else set()
        if l < L - 1:
            deps.update(tp * L + l for tp in range(t))
        pos = 0
        for i, q in enumerate(self.cq):
            if q in deps:
                pos = i + 1
        self.cq.insert(pos, u)
        self.on_compute[u] = True
        self._cq_pred += self._t_comp[u]

    def _recompute_column(self, locked: list[int], scan: _LinkScan, comp: float,
                          link: float) -> tuple[list[int], list[int]]:
        """The cheapest recompute column for a locked candidate (see :meth:`_to_compute`):
        ``(steps bottom up, chunks to cancel)``, or ``([], [])`` when none shortens the load.

        A column's lower steps must have all their KV in place (nothing of them is still on the
        link) and their own inputs ready in time (``scan.frontier``)."""
        best: list[int] = []
        best_cancel: list[int] = []
        best_new = max(comp, link) - 1e-9
        for s in locked:
            column = self._column_below(s, scan.frontier)
            if column is None:
                continue
            got = self._takeable(scan, s)
            if got is None:
                continue
            saved_bytes, cancel = got
            added = scan.ratio * sum(self._t_comp[u] for u in column)
            new = max(comp + added, link - saved_bytes / scan.bw)
            if new < best_new or (best and new <= best_new + 1e-9 and len(column) < len(best)):
                best, best_cancel, best_new = column, cancel, new
        return best, best_cancel

    def _column_below(self, s: int, frontier: list[int]) -> list[int] | None:
        """The recompute column of locked step ``s``, bottom up (``s`` last): the streamed
        steps below it down to the last one on the compute path; ``None`` if one of them is not
        in place yet or its own inputs are not ready in time."""
        L, dep = self._L, self.dep
        t, l = divmod(s, L)
        column = [s]
        j = l - 1
        while j >= 0 and not self.on_compute[t * L + j]:
            u = t * L + j
            if dep.computed[u] or not dep.kv_complete(u) or (j < L - 1 and frontier[j] < t):
                return None
            column.append(u)
            j -= 1
        column.reverse()
        return column

    def _to_stream(self, now: float, comp: float, link: float) -> bool:
        """Compute behind: stream the tail of the compute order instead of computing it.

        Units examined per tail step: the step itself, with the layer below it when it is the
        cheap last-layer projection, and (``hand_back_columns``) its whole queued column (the
        step and every queued layer below it of its token chunk); the unit that shortens
        ``max(comp_rem, link_rem)`` most moves. A link that recovered under a mostly-local plan
        thus gets whole token chunks from the tail, as a Strong Hybrid split would stream them."""
        L = self._L
        bw = self.link_estimate(now)
        ratio = self.compute_ratio()
        in_cq = set(self.cq)
        for examined, (_, s) in enumerate(self._movable_tail()):
            if examined >= self.cfg.tail_window:
                break
            l = s % L  # noqa: E741
            units = [[s]]
            if l == L - 1 and (s - 1) in in_cq and l > 0:
                units.append([s, s - 1])
            column = self._queued_column(s, in_cq)
            if self.cfg.hand_back_columns and len(column) > 2:
                units.append(column)
            best_unit, best_new = None, max(comp, link) - 1e-9
            for unit in units:
                removed = ratio * sum(self._t_comp[u] for u in unit)
                new = max(comp - removed, link + self._stream_bytes(unit) / bw)
                if new < best_new:
                    best_unit, best_new = unit, new
            if best_unit is None:
                continue
            for u in best_unit:
                self.cq.remove(u)
                self._hand_to_link(u)
            self.revision += 1
            self.migrations.append(Migration(now, "to_stream",
                                             [self.inst.step_id(u) for u in best_unit], [],
                                             link, comp))
            return True
        return False

    def _queued_column(self, s: int, in_cq: set[int]) -> list[int]:
        """Step ``s`` and the layers below it of its token chunk still in the compute queue
        (contiguous), top down."""
        L = self._L
        out = [s]
        u = s - 1
        while u >= 0 and u % L != L - 1 and u in in_cq:
            out.append(u)
            u -= 1
        return out

    def _stream_bytes(self, unit: Iterable[int]) -> int:
        """Bytes the link fetches for steps ``unit`` at their cheapest levels (a recompute
        step's chunks are in place already: they cost no bytes)."""
        G = self._G
        return sum(int(self._bytes[u * G + g, self._cheap[u * G + g]])
                   for u in unit for g in range(G) if not self.dep.chunk_avail[u * G + g])

    def _probe(self, now: float) -> None:
        """The link is idle while the compute path has work: hand the link the compute order's
        last movable step (cheapest level), within the probe's bound
        (:class:`~sparkv.scheduler.probe.LinkProbe`: one in flight, a token bucket of bytes).
        If the link is fast it saves that step and its rate samples let the rebalancing hand
        over more; if it is slow, the step moves back (its fetch cancelled) when the compute
        path runs dry."""
        if len(self.cq) < 2:
            return
        comp, _ = self.remaining(now)
        if comp <= self.inst.rtt_s + self.cfg.margin_s:
            return
        for idx, s in self._movable_tail():
            nbytes = self._stream_bytes([s])
            if not self.probe.allows(now - self.t0, nbytes):
                return
            self.cq.pop(idx)
            self._hand_to_link(s)
            self.probe.record([s * self._G + g for g in range(self._G)
                               if not self.dep.chunk_avail[s * self._G + g]], nbytes)
            self.revision += 1
            self.migrations.append(Migration(now, "probe", [self.inst.step_id(s)], [],
                                             *self.remaining(now)[::-1]))
            return

    def _movable_tail(self) -> Iterator[tuple[int, int]]:
        """``(index, step)`` of the compute queue's steps from its tail, skipping those whose
        hidden state a step on the compute path needs (they cannot leave it). The caller stops
        iterating once it changed the queue."""
        L = self._L
        for idx in range(len(self.cq) - 1, -1, -1):
            s = self.cq[idx]
            if s % L < L - 1 and self.on_compute[s + 1]:
                continue  # something on the compute path needs Y[l, t]
            yield idx, s

    def _hand_to_link(self, s: int) -> None:
        """Step ``s``, just taken out of the compute queue, leaves the compute path: its chunks
        not in place yet join the link queue at their cheapest level."""
        G = self._G
        self.on_compute[s] = False
        self._cq_pred -= self._t_comp[s]
        for g in range(G):
            cc = s * G + g
            if self.dep.chunk_avail[cc]:
                continue
            self._li[cc] = self._cheap[cc]
            self.lq.append(cc)
            self.on_link[cc] = True
            b = int(self._bytes[cc, self._cheap[cc]])
            self._lq_bytes += b
            self._lq_min_bytes += b

    def _prefetch_index(self) -> int:
        """Index in the link queue of a chunk the first queued steps wait for (else 0)."""
        if not self.cq:
            return 0
        L, G, dep = self._L, self._G, self.dep
        want: list[int] = []
        for s in self.cq[: self.cfg.prefetch_lookahead]:
            t, l = divmod(s, L)
            if l == L - 1:
                continue
            for tp in range(dep.frontier[l], t):
                for g in range(G):
                    c = (tp * L + l) * G + g
                    if not dep.chunk_avail[c] and self.on_link[c] and c not in self.inflight \
                            and c not in self.received:
                        want.append(c)
            if want:
                break
        if not want:
            return 0
        wanted = set(want)
        for i, c in enumerate(self.lq):
            if c in wanted:
                return i
        return 0

    def _slo_level(self, c: int, now: float) -> int:
        """CacheGen: the best allowed level whose completion (rest at cheapest) meets the SLO."""
        bw = self.bandwidth_estimate(now)
        elapsed = now - self.t0
        rest = self._lq_min_bytes / bw
        allowed = self.inst.allowed_mask[c]
        order = sorted((i for i in range(len(self._level_names)) if allowed[i]),
                       key=lambda i: -self.inst.levels[i].rank)
        for li in order:
            if elapsed + int(self._bytes[c, li]) / bw + rest <= self.cfg.slo_s:
                return li
        return self._cheap[c]
