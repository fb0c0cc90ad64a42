"""The runtime controller's rules: one small policy object per decision, composed into a
:class:`~sparkv.scheduler.controller.ControllerConfig` the way KV presses compose (kvpress's
``AdaKVPress(SnapKVPress())``; here ``Rebalance(RecomputeColumns(ToCompute()), ToStream())``).

A rule holds its parameters only (frozen: one configuration serves any number of loads); what it
reads and changes is the load's :class:`~sparkv.scheduler.state.LoadState`:

* :class:`ReadyFirst` / :class:`LayerFirst` / :class:`PlanOrder`: which queued step the free
  compute thread runs;
* :class:`CommitColumns`: a quiet link gives the compute thread a token chunk's layers as one run;
* :class:`CommitSpans`: on a launch-bound device, the step handed out brings the next token
  chunks of its layer (one fused call: fewer, larger kernels);
* :class:`Prefetch`: the link fetches first a chunk the next queued steps wait for;
* :class:`SloLevels`: CacheGen's per-fetch level choice against an SLO;
* :class:`Rebalance`: after every event, whichever path is behind gives work to the other,
  through its two directions :class:`ToCompute` (link behind; :class:`RecomputeColumns` wraps it
  to also take columns locked by streamed layers) and :class:`ToStream` (compute behind);
* :class:`ProbeIdleLink`: an idle link is handed one bounded probe (:mod:`sparkv.scheduler.probe`);
* :class:`DeadLink`: a link that delivers far below the plan's estimate, for long enough that
  computing what it still holds is sooner, is declared dead and everything goes to compute;
* :class:`Replan`: a load whose link delivers far below the rate it was planned for is planned
  again, once, at the measured rate (by the planner the driver hands the controller).

docs/scheduler.md, "Runtime controller", says what each does and why, with the measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from sparkv.scheduler.estimators import LinkEstimator
from sparkv.scheduler.graph import DepState
from sparkv.scheduler.queues import ComputeQueue
from sparkv.scheduler.state import LoadState, Migration

#: steps examined from a tail per migration to the link, and locked candidates per recompute
TAIL_WINDOW = 16
#: hysteresis: a path is behind when its work left exceeds the other's by this much (seconds,
#: plus a fraction of the larger)
MARGIN_S = 0.02
MARGIN_FRAC = 0.05


# ---- the compute thread ------------------------------------------------------------------------
@dataclass(frozen=True)
class ReadyFirst:
    """Work-conserving: the first queued step whose inputs are available runs next."""

    def pick(self, queue: ComputeQueue, dep: DepState) -> int:
        """Index in ``queue.order`` of the step to run (-1: none is ready)."""
        for i, s in enumerate(queue.order):
            if dep.ready(s):
                return i
        return -1


@dataclass(frozen=True)
class LayerFirst:
    """Work-conserving, lowest layer first: of the queued steps whose inputs are available, the
    one of the lowest layer runs next (ties: the first queued). With :class:`CommitSpans` it
    keeps a layer's computed token chunks together: a token-major queue whose head chunk is a
    few layers ahead (the prelude ran its first steps, a migration took some) would otherwise
    run that chunk's column step by step, since the next chunk's layer below is not done when
    the head's step is handed out, and no span forms (SmolLM2 2K on the CPU, session 64: the
    first token chunk's 28 steps ran alone at 22-36 ms each, the spans after them 13-24 ms a
    chunk)."""

    def pick(self, queue: ComputeQueue, dep: DepState) -> int:
        """Index in ``queue.order`` of the step to run (-1: none is ready)."""
        best, best_layer = -1, -1
        L = dep.L
        for i, s in enumerate(queue.order):
            layer = s % L
            if (best < 0 or layer < best_layer) and dep.ready(s):
                best, best_layer = i, layer
                if layer == 0:
                    break
        return best


@dataclass(frozen=True)
class PlanOrder:
    """The plan's order exactly: the queue's head runs once it is ready, nothing else."""

    def pick(self, queue: ComputeQueue, dep: DepState) -> int:
        return 0 if dep.ready(queue.order[0]) else -1


@dataclass(frozen=True)
class CommitColumns:
    """While the link has nothing but a probe to do, the step handed out brings the layers above
    it of its token chunk queued right after it, up to the horizon (two stages) of predicted
    time: the all-local path runs a token chunk's layers in one call (the engine's fast path)."""

    def extend(self, st: LoadState, s: int, pick: int) -> list[int]:
        """The steps after ``s`` (taken out of the compute queue at ``pick``) committed with it,
        popped from the queue (empty while the link is busy)."""
        if not st.link_quiet():
            return []
        L, dep, cq = st.L, st.dep, st.compute
        t_comp = cq.t_comp
        total = t_comp[s]
        out: list[int] = []
        nxt = s + 1
        while pick < len(cq.order) and cq.order[pick] == nxt and nxt % L != 0 \
                and dep.token_ok(nxt) and total + t_comp[nxt] <= st.horizon_s:
            out.append(cq.order.pop(pick))
            total += t_comp[nxt]
            nxt += 1
        return out


@dataclass(frozen=True)
class CommitSpans:
    """On a device whose layer steps are bound by kernel launches (a GPU at T=1024: 59 launches
    a step, docs/gpu.md), the step ``(t, l)`` handed out brings the steps ``(t+1, l), (t+2, l),
    ...`` still queued on the compute path whose hidden input exists (step ``(t+k, l-1)``
    computed), up to :attr:`max_tokens` tokens in all: the compute thread runs them as one span,
    one set of GEMMs and one attention call (:meth:`LayerStepper.run_span
    <sparkv.runtime.stepper.LayerStepper.run_span>`). Each later step's KV dependency at layer
    ``l`` is the span's own. In a token-major order the first pick at layer 0 takes the row as
    far as the bound allows, and every later pick the row above it: a local prefill runs layer
    by layer, as ``complete(fused=True)`` does.

    The bound is in tokens, not in predicted time: a launch-bound step's predicted time is
    mostly its fixed cost, which a span pays once. At 4,096 tokens a step was no longer
    launch-bound on an H200 (the stepper at T=4096: 1.02-1.04x the full forward; layer by layer
    over the whole context 0.95-0.97x); twice that leaves the fixed cost a few percent, and one
    layer of 8K tokens is milliseconds there: the controller's adaptivity loses nothing.
    Unlike columns it does not wait for a quiet link."""

    max_tokens: int = 8192

    def extend(self, st: LoadState, s: int) -> list[int]:
        """The steps after ``s`` committed with it, taken out of the compute queue."""
        L, dep, cq, geo = st.L, st.dep, st.compute, st.inst.geometry
        queued = set(cq.order)
        t, _ = divmod(s, L)
        tokens = geo.token_range(t)[1] - geo.token_range(t)[0]
        out: list[int] = []
        nxt = s + L
        while nxt in queued and dep.layer_ok(nxt):
            a, b = geo.token_range(nxt // L)
            if tokens + (b - a) > self.max_tokens:
                break
            out.append(nxt)
            tokens += b - a
            nxt += L
        if out:
            taken = set(out)
            cq.order[:] = [q for q in cq.order if q not in taken]
        return out


# ---- the link ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prefetch:
    """Dependency prefetch: when one of the first :attr:`LOOKAHEAD` queued steps waits for a
    chunk still in the link queue, that chunk is fetched next."""

    LOOKAHEAD = 2

    def index(self, st: LoadState) -> int:
        """Index in the link queue of the chunk to fetch next (0: the queue's head)."""
        cq = st.compute.order
        if not cq:
            return 0
        L, G, dep, link = st.L, st.G, st.dep, st.link
        want: list[int] = []
        for s in cq[: self.LOOKAHEAD]:
            t, l = divmod(s, L)
            if l == L - 1:
                continue
            for tp in range(dep.frontier[l], t):
                for g in range(G):
                    c = (tp * L + l) * G + g
                    if not dep.chunk_avail[c] and link.on[c] and c not in link.inflight \
                            and c not in link.received:
                        want.append(c)
            if want:
                break
        if not want:
            return 0
        wanted = set(want)
        for i, c in enumerate(link.order):
            if c in wanted:
                return i
        return 0


@dataclass(frozen=True)
class SloLevels:
    """CacheGen's adaptation: each fetched chunk gets the best allowed level whose expected
    completion, with the rest of the queue at the cheapest level, meets ``slo_s`` (seconds
    from the load's start)."""

    slo_s: float = 2.0

    def level(self, st: LoadState, c: int, now: float) -> int:
        """The level index to fetch chunk ``c`` at (the cheapest when none meets the SLO)."""
        inst, link = st.inst, st.link
        bw = st.link_estimator.window(now)
        elapsed = now - st.t0
        rest = link.queued_min_bytes / bw
        allowed = inst.allowed_mask[c]
        order = sorted((i for i in range(len(inst.levels)) if allowed[i]),
                       key=lambda i: -inst.levels[i].rank)
        for li in order:
            if elapsed + link.bytes_at(c, li) / bw + rest <= self.slo_s:
                return li
        return link.cheapest[c]


@dataclass(frozen=True)
class ProbeIdleLink:
    """The idle link is handed the compute order's last movable step at its cheapest level,
    within :class:`~sparkv.scheduler.probe.LinkProbe`'s bound (one in flight, a token bucket of
    ``burst_bytes`` + ``rate_Bps`` per second of the load): a link that a plan left idle keeps
    being measured. A fast link saves the step and its samples let :class:`Rebalance` hand over
    more; on a slow one the step moves back when the compute path runs dry."""

    rate_Bps: float = 1_000_000.0
    burst_bytes: float = 512_000.0

    def offer(self, st: LoadState, now: float) -> None:
        """Called while the link has nothing queued or in flight."""
        cq, G = st.compute, st.G
        if len(cq.order) < 2:
            return
        comp, _ = st.remaining(now)
        if comp <= st.inst.rtt_s + MARGIN_S:
            return
        for idx, s in st.movable_tail():
            nbytes = st.stream_bytes([s])
            if not st.probe.allows(now - st.t0, nbytes):
                return
            cq.order.pop(idx)
            st.hand_to_link(s)
            st.probe.record([s * G + g for g in range(G) if not st.dep.chunk_avail[s * G + g]],
                            nbytes)
            st.record(Migration(now, "probe", [st.inst.step_id(s)], [],
                                *st.remaining(now)[::-1]))
            return


# ---- rebalancing: link behind ------------------------------------------------------------------
class LinkScan(NamedTuple):
    """One look at the link for a migration to compute: the throughput (bytes/s) and compute
    factor it is judged with, the scheduling frontier (:meth:`LoadState.frontier`), the queued
    chunks, and per in-flight chunk the bytes delivered until it is complete
    (:meth:`~sparkv.scheduler.queues.LinkQueue.done_after`)."""

    bw: float
    ratio: float
    frontier: list[int]
    queued: set[int]
    done_after: dict[int, float]

    @classmethod
    def of(cls, st: LoadState, now: float) -> "LinkScan":
        return cls(st.link_estimator.estimate(now), st.compute_estimator.factor(),
                   st.frontier(), set(st.link.order), st.link.done_after())


class Move(NamedTuple):
    """A move to compute: the steps (bottom up) and the in-flight chunks to cancel."""

    steps: list[int]
    cancel: list[int]


@dataclass(frozen=True)
class ToCompute:
    """Link behind: a step whose chunks are all still on the link, and whose inputs are
    available or on the compute path, moves to the compute queue (after its dependencies).

    Candidates come from the TAIL of the link queue, then of the in-flight fetches (what the link
    would reach last); the first whose move shortens ``max(comp_rem, link_rem)`` is taken. An
    in-flight chunk is cancelled only if waiting for it (its bytes and every in-flight byte
    ahead of it) would take more than twice as long as computing its step. A step whose layer
    below was streamed is *locked* (its hidden state input was never computed): it cannot move
    (:class:`RecomputeColumns` can)."""

    def move(self, st: LoadState, now: float, comp: float, link: float) -> bool:
        """Moves the first candidate; whether one moved."""
        return _move_to_compute(self, st, now, comp, link)

    def choose(self, st: LoadState, scan: LinkScan, comp: float, link: float) -> Move | None:
        best, _ = self.candidate(st, scan, comp, link, 0)
        return best

    def candidate(self, st: LoadState, scan: LinkScan, comp: float, link: float,
                  locked_limit: int) -> tuple[Move | None, list[int]]:
        """The first step from the link's tail whose move shortens the load, and (up to
        ``locked_limit``) the locked candidates met on the way."""
        L, G, on = st.L, st.G, st.compute.on
        t_comp = st.compute.t_comp
        locked: list[int] = []
        seen: set[int] = set()
        for c in list(reversed(st.link.order)) + list(reversed(st.link.inflight)):
            s = c // G
            if s in seen or on[s]:
                continue
            seen.add(s)
            t, l = divmod(s, L)
            if l < L - 1 and scan.frontier[l] < t:
                continue
            if l > 0 and not on[s - 1]:
                if len(locked) < locked_limit:
                    locked.append(s)
                continue
            got = takeable(st, scan, s)
            if got is None:
                continue
            saved_bytes, cancel = got
            if max(comp + scan.ratio * t_comp[s], link - saved_bytes / scan.bw) \
                    >= max(comp, link) - 1e-9:
                continue
            return Move([s], cancel), []
        return None, locked


def _move_to_compute(rule: "ToCompute | RecomputeColumns", st: LoadState, now: float,
                     comp: float, link: float) -> bool:
    scan = LinkScan.of(st, now)
    best = rule.choose(st, scan, comp, link)
    if best is None:
        return False
    st.move_to_compute(now, best.steps, best.cancel, scan.queued, link, comp)
    return True


def takeable(st: LoadState, scan: LinkScan, s: int) -> tuple[float, list[int]] | None:
    """``(bytes saved, in-flight chunks to cancel)`` if every chunk of step ``s`` can be taken
    off the link, else ``None``."""
    G, link = st.G, st.link
    saved_bytes = 0.0
    cancel: list[int] = []
    for g in range(G):
        cc = s * G + g
        if cc in scan.queued:
            saved_bytes += link.bytes_at(cc, link.level[cc])
        elif cc in link.inflight:
            f = link.inflight[cc]
            # cancel only if computing it is clearly faster than waiting for the transfer (its
            # own bytes and those ahead of it)
            if scan.done_after[cc] / scan.bw < 2 * scan.ratio * st.compute.t_comp[s] + MARGIN_S:
                return None
            saved_bytes += f.nbytes - f.received
            cancel.append(cc)
        else:
            return None  # already received / arrived / not on the link
    return saved_bytes, cancel


@dataclass(frozen=True)
class RecomputeColumns:
    """Wraps a :class:`ToCompute`: when its every candidate is locked (the layer below was
    streamed) and the compute path is idle, the cheapest *recompute column* moves instead: the
    locked candidate and the streamed steps below it, down to the last one on the compute path,
    computed again bottom up for their hidden states (their KV, in place already, is
    overwritten by the same values), if that still shortens ``max(comp_rem, link_rem)``. Only
    the first :data:`TAIL_WINDOW` locked candidates are examined, and only while the compute
    path is idle: the scan runs under the engine's lock at every event. :class:`Rebalance`'s
    default (session 70: a greedy plan that streamed a token chunk's layer 15 first, and its
    layers 16-29 after, left the compute path idle 0.55 s at 20 Mbit/s; docs/scheduler.md)."""

    inner: ToCompute = ToCompute()

    def move(self, st: LoadState, now: float, comp: float, link: float) -> bool:
        """Moves the inner rule's candidate, else the cheapest column; whether one moved."""
        return _move_to_compute(self, st, now, comp, link)

    def choose(self, st: LoadState, scan: LinkScan, comp: float, link: float) -> Move | None:
        limit = TAIL_WINDOW if st.compute.idle else 0
        best, locked = self.inner.candidate(st, scan, comp, link, limit)
        if best is None and locked:
            best = _cheapest_column(st, locked, scan, comp, link)
        return best


def _cheapest_column(st: LoadState, locked: list[int], scan: LinkScan, comp: float,
                     link: float) -> Move | None:
    """The recompute column, among those of ``locked``, that shortens the load most (the
    shorter column on a tie); ``None`` when none shortens it. A column's lower steps must have
    all their KV in place and their own inputs ready in time (``scan.frontier``)."""
    t_comp = st.compute.t_comp
    best: Move | None = None
    best_new = max(comp, link) - 1e-9
    for s in locked:
        column = _column_below(st, s, scan.frontier)
        if column is None:
            continue
        got = takeable(st, scan, s)
        if got is None:
            continue
        saved_bytes, cancel = got
        added = scan.ratio * sum(t_comp[u] for u in column)
        new = max(comp + added, link - saved_bytes / scan.bw)
        if new < best_new or (best is not None and new <= best_new + 1e-9
                              and len(column) < len(best.steps)):
            best, best_new = Move(column, cancel), new
    return best


def _column_below(st: LoadState, s: int, frontier: list[int]) -> list[int] | None:
    """The recompute column of locked step ``s``, bottom up (``s`` last): the streamed steps
    below it down to the last one on the compute path; ``None`` if one of them is not in place
    yet or its own inputs are not ready in time."""
    L, dep, on = st.L, st.dep, st.compute.on
    t, l = divmod(s, L)
    column = [s]
    j = l - 1
    while j >= 0 and not on[t * L + j]:
        u = t * L + j
        if dep.computed[u] or not dep.kv_complete(u) or (j < L - 1 and frontier[j] < t):
            return None
        column.append(u)
        j -= 1
    column.reverse()
    return column


# ---- rebalancing: compute behind ---------------------------------------------------------------
@dataclass(frozen=True)
class ToStream:
    """Compute behind: the tail of the compute order is streamed instead of computed.

    Units examined per tail step (the last :data:`TAIL_WINDOW` movable ones): the step itself,
    with the layer below it when it is the cheap last-layer projection, and its whole queued
    column (the step and every queued layer below it of its token chunk); the unit that shortens
    ``max(comp_rem, link_rem)`` most moves, its compute saving net of the stream tax its chunks
    cost the steps they are decoded beside (:func:`_tax`). A link that recovered under a
    mostly-local plan thus gets whole token chunks from the tail, as a Strong Hybrid split would
    stream them.

    A move must shorten the load by at least :attr:`min_gain_s` (0: any gain). 3 ms, a compute
    call's fixed cost on the 2-core CPU, gained ~1% paired at 2K (session 71,
    ``bench/results/to_stream_min_gain_ab_s71.json``) but is off: a threshold in seconds is
    of the device's scale, and on the engine tests' tiny model (2 ms steps) it kept the tail's
    single steps from ever moving (``test_an_all_local_plan_hands_work_back_to_a_link_that_recovers``)."""

    min_gain_s: float = 0.0

    def move(self, st: LoadState, now: float, comp: float, link: float) -> bool:
        cq = st.compute
        bw = st.link_estimator.estimate(now)
        ratio = st.compute_estimator.factor()
        in_cq = set(cq.order)
        for examined, (_, s) in enumerate(st.movable_tail()):
            if examined >= TAIL_WINDOW:
                break
            unit = self._best_unit(st, s, in_cq, bw, ratio, comp, link)
            if unit is None:
                continue
            for u in unit:
                cq.order.remove(u)
                st.hand_to_link(u)
            st.record(Migration(now, "to_stream", [st.inst.step_id(u) for u in unit], [],
                                link, comp))
            return True
        return False

    def _best_unit(self, st: LoadState, s: int, in_cq: set[int], bw: float, ratio: float,
                   comp: float, link: float) -> list[int] | None:
        L, t_comp = st.L, st.compute.t_comp
        l = s % L  # noqa: E741
        units = [[s]]
        if l == L - 1 and (s - 1) in in_cq and l > 0:
            units.append([s, s - 1])
        column = _queued_column(L, s, in_cq)
        if len(column) > 2:
            units.append(column)
        best_unit, best_new = None, max(comp, link) - max(self.min_gain_s, 1e-9)
        for unit in units:
            removed = ratio * sum(t_comp[u] for u in unit) - _tax(st, unit, bw)
            new = max(comp - removed, link + st.stream_bytes(unit) / bw)
            if new < best_new:
                best_unit, best_new = unit, new
        return best_unit


def _tax(st: LoadState, unit: list[int], bw: float) -> float:
    """The compute time the chunks of steps ``unit`` not in place yet cost the compute path
    when streamed at ``bw`` bytes/s: :attr:`Instance.stream_tax_s <sparkv.scheduler.instance.
    Instance.stream_tax_s>` each, and the steps' slowdown while they are on the link
    (:attr:`~sparkv.scheduler.instance.Instance.receive_tax`), charged in full to a migration
    to the link: it is made only while the compute path is behind, so the chunks are received
    and decoded while steps still run. A migration to compute takes chunks from the tail of a
    link that is behind, which would have been received after the last step: it saves no tax.
    Where the compute thread decodes in turn (:attr:`Instance.decode_in_turn
    <sparkv.scheduler.instance.Instance.decode_in_turn>`), each chunk's decoding at its
    cheapest level is charged too."""
    inst = st.inst
    if inst.stream_tax_s <= 0 and inst.receive_tax <= 0 and not inst.decode_in_turn:
        return 0.0
    G, avail = st.G, st.dep.chunk_avail
    todo = [u * G + g for u in unit for g in range(G) if not avail[u * G + g]]
    tax = inst.stream_tax_s * len(todo) + inst.receive_share * st.stream_bytes(unit) / bw
    if inst.decode_in_turn:
        cheap = st.link.cheapest
        tax += sum(float(inst.t_proc[c, cheap[c]]) for c in todo)
    return tax


def _queued_column(L: int, s: int, in_cq: set[int]) -> list[int]:
    """Step ``s`` and the layers below it of its token chunk still in the compute queue
    (contiguous), top down."""
    out = [s]
    u = s - 1
    while u >= 0 and u % L != L - 1 and u in in_cq:
        out.append(u)
        u -= 1
    return out


# ---- rebalancing: the loop ---------------------------------------------------------------------
@dataclass
class Pace:
    """:class:`Rebalance`'s state in one load: the stage, the migrations made in it, and when
    to look again after finding nothing worth moving."""

    stage: int = -1
    count: int = 0
    next_scan_s: float = -math.inf


@dataclass(frozen=True)
class Rebalance:
    """Re-evaluated after every event: the path whose remaining work exceeds the other's (by a
    hysteresis margin) gives work to the other, through ``to_compute`` (link behind) or
    ``to_stream`` (compute behind); ``None`` turns a direction off.

    * Just in time: a path takes over work only when its own remaining work is under the
      horizon (two stages), so a deep but transient fade does not commit the compute thread
      to work it cannot finish before the link recovers.
    * At most ``max_per_stage`` migrations per stage (``stage_s``; ``None``: the plan's
      ``Delta_t``, else the estimated TTFT / 10), unless one path is ``bulk_ratio`` times
      behind: then moves repeat until the paths balance.
    """

    to_compute: ToCompute | RecomputeColumns | None = RecomputeColumns(ToCompute())
    to_stream: ToStream | None = ToStream()
    max_per_stage: int = 8
    stage_s: float | None = None
    bulk_ratio: float = 1.5

    def run(self, st: LoadState, pace: Pace, now: float) -> None:
        if self.to_compute is None and self.to_stream is None:
            return
        stage = int(math.floor((now - st.t0) / st.stage_s)) if st.stage_s > 0 else 0
        if stage != pace.stage:
            pace.stage, pace.count = stage, 0
        if now < pace.next_scan_s:
            return
        bulk_moves = 0
        while True:
            comp, link = st.remaining(now)
            bulk = max(comp, link) > self.bulk_ratio * max(min(comp, link), MARGIN_S)
            if bulk:
                if bulk_moves >= st.inst.num_steps:
                    return
            elif pace.count >= self.max_per_stage:
                return
            margin = MARGIN_S + MARGIN_FRAC * max(comp, link)
            # just in time: a path takes over work only when its own queue is about to run dry
            if link > comp + margin and self.to_compute is not None and comp <= st.horizon_s:
                moved = self.to_compute.move(st, now, comp, link)
            elif comp > link + margin and self.to_stream is not None and link <= st.horizon_s:
                moved = self.to_stream.move(st, now, comp, link)
            else:
                return
            if not moved:
                # nothing worth moving now: look again a little later (keeps events cheap)
                pace.next_scan_s = now + min(0.05, st.stage_s / 4)
                return
            if bulk:
                bulk_moves += 1
            else:
                pace.count += 1


# ---- a dead link -------------------------------------------------------------------------------
@dataclass
class Watch:
    """:class:`DeadLink`'s state in one load: since when the link has been slow (``None``: it
    is not)."""

    slow_since: float | None = None


@dataclass(frozen=True)
class DeadLink:
    """A link that delivers far below the rate the plan was made with is declared dead, and
    everything it still holds goes to the compute path (docs/scheduler.md, "A dead link").

    The link is *dead* when, at an event, (1) its windowed throughput has stayed below
    ``fraction`` of the plan's estimate for ``after_s`` seconds, (2) it holds work that is not
    a probe (queued or in flight), and (3) computing all of that work, on top of the compute
    path's own, would end ``ratio`` times sooner than the link at its measured rate. Then every
    step the link still holds, with the streamed steps below it in its token chunk (recomputed
    for their hidden states), joins the compute queue bottom up, and in-flight fetches are
    cancelled: one ``dead_link`` migration. The rules that hand work to the link (a probe,
    :class:`ToStream`) may give it work again later; the verdict is judged afresh each time.

    The defaults (1/20, 4 s, 4x) were chosen on the seeded simulator cases of
    ``tests/ctl_digest.py``: a 1/10, 2 s, 1x verdict also fired in the fades a link recovers
    from (fade-start, adversarial) and lost up to 2.3x there with no way back for the
    stream-only baseline; these fire on collapsed links and long fades (docs/scheduler.md).
    """

    fraction: float = 0.05
    after_s: float = 4.0
    ratio: float = 4.0

    def check(self, st: LoadState, watch: Watch, now: float) -> None:
        """Judges the link at ``now`` (every event); hands everything over when it is dead."""
        if st.link_estimator.window(now) >= self.fraction * st.link_estimator.prior_Bps:
            watch.slow_since = None
            return
        if watch.slow_since is None:
            watch.slow_since = now
        if now - watch.slow_since < self.after_s or not _holds_work(st):
            return
        steps = _steps_to_compute(st)
        comp, link = st.remaining(now)
        added = st.compute_estimator.factor() * sum(st.compute.t_comp[s] for s in steps)
        if not steps or self.ratio * (comp + added) >= link:
            return
        st.give_up_link(now, steps, f"{st.link_estimator.window(now) * 8 / 1e6:.3g} Mbit/s for "
                        f"{now - watch.slow_since:.3g} s against the plan's "
                        f"{st.link_estimator.prior_Bps * 8 / 1e6:.3g} Mbit/s", link, comp)


def _holds_work(st: LoadState) -> bool:
    probes, link = st.probe.in_flight, st.link
    return any(c not in probes for c in link.order) or \
        any(c not in probes for c in link.inflight)


def _steps_to_compute(st: LoadState) -> list[int]:
    """Token-major, bottom up: per token chunk, every step up to the deepest one with a chunk
    still queued or in flight on the link, that is not on the compute path already."""
    L, G, n_t = st.L, st.G, st.inst.n_t
    deepest = [-1] * n_t
    for c in list(st.link.order) + list(st.link.inflight):
        t, l = divmod(c // G, L)
        deepest[t] = max(deepest[t], l)
    on = st.compute.on
    return [t * L + l for t in range(n_t) for l in range(deepest[t] + 1)  # noqa: E741
            if not on[t * L + l]]


@dataclass(frozen=True)
class Replan:
    """A load planned for a link much faster than the one it meets is planned again, once, at
    the measured rate (docs/scheduler.md, "A re-plan at the measured rate").

    The first time the link's rate samples cover ``sampled_s`` seconds (silences included), its
    rate (:meth:`measured`) is compared with the rate the plan was made with. Below it by more
    than ``below`` times, the driver's planner plans the instance at the measured rate and the
    load hands over to that plan (:mod:`sparkv.scheduler.handover`: the work under way stays).
    The verdict is given once per load, either way: the rebalancing rules follow the link from
    then on.

    It answers what :class:`Rebalance` cannot: a first ask with no measured link plans with the
    session's default prior (50 Mbit/s), and over a 10 Mbit/s link its plan streams several
    times too many chunks; the rebalancing rules move that work back just in time (within a
    horizon of two stages), 1.0-1.2 s into a 3 s load, where a plan for the real link starts
    the compute path on it at once. Paired at 5-10 Mbit/s: sparkv 0.91-0.97 of the load without
    it, Strong Hybrid 0.53-0.69 (docs/scheduler.md).
    """

    below: float = 1.5
    sampled_s: float = 0.3

    def measured(self, est: LinkEstimator, now: float) -> float | None:
        """The link's rate (bytes/s) once its samples cover ``sampled_s`` and hold a byte, else
        ``None`` (not yet judged; a link that stays silent is :class:`DeadLink`'s): the
        faster of its goodput so far and its recent rate (:meth:`LinkEstimator.recent
        <sparkv.scheduler.estimators.LinkEstimator.recent>`), so a link still ramping up (a
        TCP slow start, the end of a fade) is judged by what it delivers now."""
        if est.sampled_s < self.sampled_s:
            return None
        run = est.run_rate()
        return None if run is None else max(run, est.recent(now))

    def wants(self, rate_Bps: float, planned_Bps: float) -> bool:
        """Whether a link measured at ``rate_Bps`` calls for a plan other than one made for
        ``planned_Bps``."""
        return rate_Bps * self.below < planned_Bps
