"""One load's state as the runtime controller's rules see it: :class:`LoadState`.

The :class:`~sparkv.scheduler.controller.Controller` keeps it up to date from the drivers'
events; the rules (:mod:`sparkv.scheduler.rules`, :mod:`sparkv.scheduler.probe`) read it and
change the plan only through its moves (:meth:`LoadState.move_to_compute`,
:meth:`LoadState.hand_to_link`), each recorded as a :class:`Migration`.

Parts, one owner each: the dependency state (:class:`~sparkv.scheduler.graph.DepState`), the two
queues (:mod:`sparkv.scheduler.queues`), the two estimators (:mod:`sparkv.scheduler.estimators`)
and the probe's bucket (:class:`~sparkv.scheduler.probe.LinkProbe`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

from sparkv.layout import KVChunkId, StepId
from sparkv.scheduler.estimators import ComputeEstimator, LinkEstimator
from sparkv.scheduler.graph import DepState
from sparkv.scheduler.handover import handover
from sparkv.scheduler.instance import Instance
from sparkv.scheduler.plan import Plan
from sparkv.scheduler.probe import LinkProbe
from sparkv.scheduler.queues import ComputeQueue, LinkQueue


@dataclass
class Migration:
    """One decision of the controller, for the timeline and logs."""

    time_s: float
    direction: str  # "to_compute" | "to_stream" | "probe" | "dead_link" | "handover" | "replan"
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


def stage_length(plan: Plan, inst: Instance, stage_s: float | None) -> float:
    """The stage clock (s): ``stage_s``, else the plan's ``Delta_t``, else a tenth of the
    estimated TTFT (at least 50 ms)."""
    stage = stage_s or plan.stage_budget_s
    if not stage:
        est = plan.estimated_ttft_s or (inst.step_t_comp.sum() + inst.min_stream_time.sum()) / 2
        stage = max(est / 10.0, 0.05)
    return float(stage)


class LoadState:
    """The state of one load (module docstring).

    Attributes:
        inst, L, G: the instance, its layers and KV groups.
        dep: which chunks are in place, which steps computed.
        compute, link: the two queues.
        link_estimator, compute_estimator: what the rules plan with.
        probe: the link probe's bucket and its probes in flight.
        migrations, revision: the decisions so far; ``revision`` increases at each.
        link_dead: why the link was first declared dead
            (:class:`~sparkv.scheduler.rules.DeadLink`), or ``None``.
        available: chunks in place.
        t0, stage_s, horizon_s: the load's start, its stage clock, and two stages.
    """

    def __init__(self, plan: Plan, inst: Instance, done: set[int], *, stage_s: float,
                 window_s: float, fast_window_s: float, probe: LinkProbe) -> None:
        self.inst, self.L, self.G = inst, inst.L, inst.G
        G = self.G
        cheap = inst.cheapest_level.tolist()
        level = list(cheap)
        for cid, name in plan.levels.items():
            level[inst.chunk_index(cid)] = inst.level_index(name)
        order = [inst.step_index(s) for s in plan.compute_order]
        stream = [inst.chunk_index(c) for c in plan.stream_order]
        self.compute = ComputeQueue(inst.step_t_comp.tolist(),
                                    [s for s in order if s not in done], inst.num_steps, done)
        self.link = LinkQueue(inst.chunk_bytes, cheap, level,
                              [c for c in stream if c // G not in done], inst.t_proc)
        self.dep = DepState.for_instance(inst)
        self.available = 0
        for s in sorted(done):
            self.mark_computed(s)
        self.link_estimator = LinkEstimator(inst.bandwidth_Bps, window_s, fast_window_s)
        self.compute_estimator = ComputeEstimator()
        self.probe = probe
        self.migrations: list[Migration] = []
        self.revision = 0
        self.link_dead: str | None = None
        self.t0 = 0.0
        self.stage_s = stage_s
        self.horizon_s = float(2.0 * stage_s)

    # ---- estimates -----------------------------------------------------------------------
    def remaining(self, now: float) -> tuple[float, float]:
        """``(compute_remaining_s, link_remaining_s)`` from the current estimates; the compute
        path's includes the decoding of every frame still to come where the compute thread
        decodes them (:attr:`Instance.decode_in_turn
        <sparkv.scheduler.instance.Instance.decode_in_turn>`), the link's the other loads'
        bytes it carries first
        (:attr:`LinkEstimator.ahead_bytes <sparkv.scheduler.estimators.LinkEstimator.ahead_bytes>`)."""
        comp = self.compute.remaining(self.compute_estimator.factor(), now)
        if self.inst.decode_in_turn:
            comp += self.link.pending_proc()    # every frame still to come is decoded there
        est = self.link_estimator
        pending = self.link.pending_bytes()
        if est.ahead_bytes > 0:
            pending += est.ahead_bytes
        return comp, pending / est.estimate(now)

    # ---- events --------------------------------------------------------------------------
    def mark_computed(self, s: int) -> None:
        """Step ``s``'s KV chunks are in place (computed)."""
        G = self.G
        before = sum(self.dep.chunk_avail[s * G + g] for g in range(G))
        self.dep.mark_computed(s)
        self.available += G - before

    # ---- queries -------------------------------------------------------------------------
    def link_quiet(self) -> bool:
        """The link has nothing to do but a probe: nothing queued, nothing in flight or being
        decoded that is not a probe."""
        probes, link = self.probe.in_flight, self.link
        return not link.order and all(c in probes for c in link.inflight) \
            and all(c in probes for c in link.received)

    def frontier(self) -> list[int]:
        """Per layer: the first token chunk whose KV is neither available nor on the compute
        path (the scheduling frontier)."""
        L, n_t, dep, on = self.L, self.inst.n_t, self.dep, self.compute.on
        out = []
        for l in range(L):  # noqa: E741
            t = dep.frontier[l]
            while t < n_t and (on[t * L + l] or dep.kv_complete(t * L + l)):
                t += 1
            out.append(t)
        return out

    def movable_tail(self) -> Iterator[tuple[int, int]]:
        """``(index, step)`` of the compute queue's steps from its tail, skipping those whose
        hidden state a step on the compute path needs (they cannot leave it). The caller stops
        iterating once it changed the queue."""
        L, cq = self.L, self.compute
        for idx in range(len(cq.order) - 1, -1, -1):
            s = cq.order[idx]
            if s % L < L - 1 and cq.on[s + 1]:
                continue  # something on the compute path needs Y[l, t]
            yield idx, s

    def stream_bytes(self, unit: Iterable[int]) -> int:
        """Bytes the link fetches for steps ``unit`` at their cheapest levels (a step's chunks
        already in place cost no bytes)."""
        G, link = self.G, self.link
        return sum(link.cheapest_bytes(u * G + g)
                   for u in unit for g in range(G) if not self.dep.chunk_avail[u * G + g])

    # ---- moves ---------------------------------------------------------------------------
    def move_to_compute(self, now: float, steps: list[int], cancel: list[int],
                        queued: set[int], link_s: float, comp_s: float) -> None:
        """Steps ``steps`` (bottom up; the last one's chunks on the link, the others' in place)
        join the compute queue, each after its dependencies; the last one's chunks leave the
        link (``queued``: those in its queue), in-flight ``cancel`` are cancelled."""
        self._take_off_link(steps[-1], queued)
        for cc in cancel:
            self.link.inflight.pop(cc, None)
            self.link.cancels.append(self.inst.chunk_id(cc))
        for u in steps:   # bottom up: each step of a recompute column after the one below it
            self._enqueue_compute(u)
        self.record(Migration(now, "to_compute", [self.inst.step_id(u) for u in steps],
                              [self.inst.chunk_id(c) for c in cancel], link_s, comp_s))

    def give_up_link(self, now: float, steps: list[int], why: str, link_s: float,
                     comp_s: float) -> None:
        """The link is dead (:attr:`link_dead` says why): ``steps`` (token-major, bottom up)
        join the compute queue, their queued chunks leave the link and their in-flight ones
        are cancelled."""
        G, link = self.G, self.link
        cancel: list[int] = []
        for s in steps:
            for g in range(G):
                cc = s * G + g
                if cc in link.inflight:
                    link.inflight.pop(cc)
                    link.cancels.append(self.inst.chunk_id(cc))
                    cancel.append(cc)
                elif cc in link.order:
                    link.remove(cc)
                link.on[cc] = False
                self.probe.settle(cc)
            self._enqueue_compute(s)
        if self.link_dead is None:
            self.link_dead = why
        self.record(Migration(now, "dead_link", [self.inst.step_id(u) for u in steps],
                              [self.inst.chunk_id(c) for c in cancel], link_s, comp_s))

    def hand_to_link(self, s: int) -> None:
        """Step ``s``, just taken out of the compute queue, leaves the compute path: its chunks
        not in place yet join the link queue at their cheapest level."""
        G = self.G
        self.compute.leave(s)
        for g in range(G):
            cc = s * G + g
            if self.dep.chunk_avail[cc]:
                continue
            self.link.append_cheapest(cc)

    def adopt(self, now: float, plan: Plan, link_s: float, comp_s: float,
              why: str = "handover") -> None:
        """The load goes on by ``plan`` (:mod:`sparkv.scheduler.handover`): the work under way
        stays, both queues are rebuilt from what ``plan`` leaves, fetches of steps it now
        computes are cancelled; recorded as a ``why`` migration (``handover`` or ``replan``)."""
        inst, cq, link = self.inst, self.compute, self.link
        queued = set(cq.order)
        settled = {s for s in range(inst.num_steps) if cq.on[s] and s not in queued}
        started = link.received | {c for c, f in link.inflight.items() if f.received > 0}
        rest = handover(inst, plan, settled_steps=settled, requested=set(link.inflight),
                        started=started, available=self.dep.chunk_avail)
        for c in rest.cancel:
            link.inflight.pop(c)
            link.cancels.append(inst.chunk_id(c))
            self.probe.settle(c)
        cq.order = list(rest.compute)
        cq.on = [s in settled for s in range(inst.num_steps)]
        for s in cq.order:
            cq.on[s] = True
        cq.queued_s = float(sum(cq.t_comp[s] for s in cq.order))
        for c in link.order:
            link.on[c] = False
        link.order = []
        link.queued_bytes = link.queued_min_bytes = link.queued_proc = 0.0
        for c in rest.stream:
            link.level[c] = rest.levels[c]
            link.order.append(c)
            link.on[c] = True
            link.enqueued(c)
        for c in rest.cancel:
            link.on[c] = False
        moved = [inst.step_id(s) for s in cq.order if s not in queued]
        self.record(Migration(now, why, moved, [inst.chunk_id(c) for c in rest.cancel],
                              link_s, comp_s))

    def record(self, m: Migration) -> None:
        """A decision changed the plan (drivers re-ask their idle workers at a new revision)."""
        self.revision += 1
        self.migrations.append(m)

    def _take_off_link(self, s: int, queued: set[int]) -> None:
        G = self.G
        for g in range(G):
            cc = s * G + g
            if cc in queued:
                self.link.remove(cc)
            self.link.on[cc] = False
            self.probe.settle(cc)

    def _enqueue_compute(self, u: int) -> None:
        L = self.L
        t, l = divmod(u, L)
        deps = {u - 1} if l > 0 else set()
        if l < L - 1:
            deps.update(tp * L + l for tp in range(t))
        self.compute.insert_after(u, deps)
