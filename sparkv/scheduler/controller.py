"""The runtime controller (paper IV-D, design notes): executes a plan and rebalances it online.

One :class:`Controller` sits between a plan and the two workers of the device: the compute thread
(one layer step at a time) and the link (fetches KV chunks). The workers ask it what to do next
and tell it what happened; the simulator and the real edge engine drive it through the same
calls:

* queries: :meth:`Controller.next_step` / :meth:`Controller.next_steps` (the compute thread is
  free: which step(s) now? none = wait for the next event), :meth:`Controller.next_fetch` (the
  link can take a request: which chunk, at which level? ``None`` = nothing now),
  :meth:`Controller.take_cancellations` (in-flight fetches to abort);
* events: :meth:`Controller.rate_sample` (bytes received over some seconds),
  :meth:`Controller.chunk_received` (a transfer completed, decoding starts),
  :meth:`Controller.chunk_arrived` (decoded: the KV is in place), :meth:`Controller.step_done`
  (a layer step finished, with its measured time).

Every method takes ``now`` in seconds on the caller's clock (monotonic; the origin is
:meth:`Controller.start`).

What the controller believes is two estimators (:mod:`sparkv.scheduler.estimators`: the link's
throughput, the compute path's speed, which also takes an external load factor); what it does is
the rules its :class:`ControllerConfig` composes (:mod:`sparkv.scheduler.rules`): the order the
compute thread takes steps in, committed columns, the dependency prefetch, CacheGen's level
choice, the rebalancing of work between the paths in both directions (with recompute columns),
and the link probe. The load's state they share is a :class:`~sparkv.scheduler.state.LoadState`.
A driver that hands the controller its planner (``planner``) lets it plan the load again, once,
at the link's measured rate (:class:`~sparkv.scheduler.rules.Replan`).

``ControllerConfig()`` is sparkv's controller; ``ControllerConfig.static()`` follows the plan
exactly (the reference executor for "the same plan without a controller");
``ControllerConfig.cachegen()`` is the CacheGen-style baseline (no migrations, per-fetch levels).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterable, NamedTuple

from sparkv.layout import KVChunkId, StepId
from sparkv.scheduler.instance import Instance
from sparkv.scheduler.plan import Plan
from sparkv.scheduler.probe import LinkProbe
from sparkv.scheduler.queues import Inflight
from sparkv.scheduler.rules import (CommitColumns, CommitSpans, DeadLink, LayerFirst, Pace,
                                    PlanOrder, Prefetch, ProbeIdleLink, ReadyFirst, Rebalance,
                                    Replan, SloLevels, Watch)
from sparkv.scheduler.state import LoadState, Migration, stage_length


class Fetch(NamedTuple):
    """A request for the link: chunk ``cid`` at codec level ``level``."""

    cid: KVChunkId
    level: str


@dataclass(frozen=True)
class ControllerConfig:
    """The rules of a runtime controller, composed (docs/scheduler.md, "Runtime controller").

    Each slot holds one rule (:mod:`sparkv.scheduler.rules`) or ``None`` (off); the defaults are
    sparkv's controller. Examples::

        ControllerConfig(rebalance=Rebalance(ToCompute(), ToStream()))   # no recompute columns
        ControllerConfig(probe=ProbeIdleLink(rate_Bps=50_000.0, burst_bytes=100_000.0))
        ControllerConfig(rebalance=Rebalance(to_stream=None), probe=None)

    Attributes:
        order: which queued step the free compute thread runs.
        rebalance: migrations between the paths, both directions.
        prefetch: the dependency prefetch of the link queue.
        probe: the bounded probe of an idle link.
        levels: the level of each fetch (``None``: the plan's).
        columns: committed columns while the link is quiet.
        spans: committed spans of a layer's next token chunks (a launch-bound device; tried
            before ``columns``; ``None``: off, the default on a CPU).
        dead_link: the verdict on a link far below the plan's estimate (all work to compute).
        replan: a plan at the link's measured rate, once, when it is far below the plan's (acts
            only when the driver hands the controller a planner).
        window_s, fast_window_s: the link estimator's windows (s).
    """

    order: ReadyFirst | LayerFirst | PlanOrder = ReadyFirst()
    rebalance: Rebalance | None = Rebalance()
    prefetch: Prefetch | None = Prefetch()
    probe: ProbeIdleLink | None = ProbeIdleLink()
    levels: SloLevels | None = None
    columns: CommitColumns | None = CommitColumns()
    spans: CommitSpans | None = None
    dead_link: DeadLink | None = DeadLink()
    replan: Replan | None = Replan()
    window_s: float = 0.5
    fast_window_s: float = 0.15

    @property
    def may_stream(self) -> bool:
        """Whether this controller may hand the link work the plan did not (a migration to the
        link, or a probe): a plan that streams nothing still needs a running link then."""
        return self.probe is not None or (self.rebalance is not None
                                          and self.rebalance.to_stream is not None)

    def without_link(self) -> "ControllerConfig":
        """The same controller for an engine with no link: it never hands the link anything."""
        rebalance = (replace(self.rebalance, to_stream=None) if self.rebalance is not None
                     else None)
        return replace(self, rebalance=rebalance, probe=None)

    def with_spans(self, on: bool) -> "ControllerConfig":
        """The same controller, committing spans (:class:`CommitSpans`) when ``on``
        (``sparkv.runtime.device.fused_spans``), its work-conserving order lowest layer first
        (:class:`LayerFirst`: a layer's ready token chunks then run together); unchanged
        otherwise. A strict order (:class:`PlanOrder`) stays the plan's."""
        if not on or self.spans is not None:
            return self
        order = LayerFirst() if isinstance(self.order, ReadyFirst) else self.order
        return replace(self, spans=CommitSpans(), order=order)

    @classmethod
    def static(cls) -> "ControllerConfig":
        """Follow the plan exactly: strict order on both paths, no adaptation."""
        return cls(order=PlanOrder(), rebalance=None, prefetch=None, probe=None, columns=None,
                   dead_link=None, replan=None)

    @classmethod
    def cachegen(cls, slo_s: float = 2.0) -> "ControllerConfig":
        """Stream-only CacheGen behaviour: no migrations, per-chunk level from throughput + SLO
        (a dead link still gives its work to the compute path: :class:`DeadLink`)."""
        return cls(rebalance=None, prefetch=None, probe=None, levels=SloLevels(slo_s),
                   replan=None)


class Controller:
    """Executes ``plan`` on ``inst`` and adapts it at run time (module docstring).

    Attributes:
        state: the load's :class:`~sparkv.scheduler.state.LoadState` (queues, estimators).
    """

    def __init__(self, plan: Plan, inst: Instance, config: ControllerConfig | None = None,
                 done_steps: Iterable[StepId] = (),
                 planner: Callable[[Instance], Plan] | None = None) -> None:
        """``done_steps``: layer steps already computed before loading began (the engine's
        prelude computed them while the manifest and the plan were on their way): they leave
        both queues and their KV chunks count as in place. ``planner``: plans the instance at
        another link rate, for the :class:`~sparkv.scheduler.rules.Replan` rule (called at
        most once, from a rate sample; ``None``: no re-plan)."""
        self.plan, self.inst = plan, inst
        self.cfg = cfg = config if config is not None else ControllerConfig()
        probe = (LinkProbe(cfg.probe.rate_Bps, cfg.probe.burst_bytes) if cfg.probe is not None
                 else LinkProbe())
        stage = stage_length(plan, inst, cfg.rebalance.stage_s if cfg.rebalance else None)
        self.state = LoadState(plan, inst, {inst.step_index(s) for s in done_steps},
                               stage_s=stage, window_s=cfg.window_s,
                               fast_window_s=cfg.fast_window_s, probe=probe)
        self._pace = Pace()
        self._watch = Watch()
        self._level_names = [lv.name for lv in inst.levels]
        self._planner = planner if cfg.replan is not None else None
        #: the re-plan's verdict (``None``: not yet, or never asked; :meth:`_replan`):
        #: ``time_s``, ``measured_mbps``, ``planned_mbps``, ``taken``, and when not taken
        #: ``kept`` (why the plan was kept) or ``error`` (the planner's)
        self.replanned: dict[str, float | bool | str] | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self, now: float) -> None:
        """Call once when loading begins."""
        self.state.t0 = now

    @property
    def done(self) -> bool:
        """Every KV chunk is in place."""
        return self.state.available == self.inst.num_chunks

    @property
    def migrations(self) -> list[Migration]:
        """The decisions so far, in order."""
        return self.state.migrations

    @property
    def link_dead(self) -> str | None:
        """Why the controller declared the link dead and gave its work to the compute path
        (:class:`~sparkv.scheduler.rules.DeadLink`), or ``None``."""
        return self.state.link_dead

    @property
    def revision(self) -> int:
        """Increases whenever the controller changes the plan (drivers re-ask idle workers)."""
        return self.state.revision

    @property
    def continuing(self) -> bool:
        """The compute thread's next step is one handed out with the last (a span or a
        column): :meth:`next_step` returns it without choosing."""
        return bool(self.state.compute.committed)

    # ------------------------------------------------------------------ queries
    def next_step(self, now: float) -> StepId | None:
        """The compute thread is free: the step to run now, or ``None`` (wait for an event).
        The first of :meth:`next_steps`; after it handed out several, the next of them (a
        driver that runs one step at a time, the simulator, runs a column this way)."""
        cq = self.state.compute
        if cq.running is None and cq.committed:
            return self.inst.step_id(cq.next_committed(now))
        steps = self.next_steps(now)
        return steps[0] if steps else None

    def next_steps(self, now: float, column: bool = True) -> list[StepId]:
        """The compute thread is free: the steps to run now, back to back (empty: wait for an
        event). One step, or (``column``, and the :class:`~sparkv.scheduler.rules.CommitColumns`
        rule) when the link has nothing but a probe to do, the next step and the layers above
        it of its token chunk queued right after it: the all-local path then runs a token
        chunk's layers in one call (the engine's fast path); or (the
        :class:`~sparkv.scheduler.rules.CommitSpans` rule, a launch-bound device) the next
        token chunks of its layer, run as one span. The caller reports every step
        with :meth:`step_done`, in order; the first is running, the others are committed to
        the compute path (no migration takes them)."""
        cq = self.state.compute
        if cq.running is not None or cq.committed or not cq.order:
            return []
        self._adapt(now)
        pick = self.cfg.order.pick(cq, self.state.dep)
        if pick < 0:
            return []
        run = [cq.order.pop(pick)]
        if column and self.cfg.spans is not None:
            run += self.cfg.spans.extend(self.state, run[0])
        if column and len(run) == 1 and self.cfg.columns is not None:
            run += self.cfg.columns.extend(self.state, run[0], pick)
        cq.start(run, now)
        cq.run_quiet = self.state.link_quiet()
        return [self.inst.step_id(s) for s in run]

    def next_fetch(self, now: float) -> Fetch | None:
        """The link can take a request: the chunk (and level) to fetch now, or ``None``."""
        st, cfg = self.state, self.cfg
        link = st.link
        self._adapt(now)
        if not link.order and not link.inflight and cfg.probe is not None:
            cfg.probe.offer(st, now)
        while link.order:
            c = link.pop(cfg.prefetch.index(st) if cfg.prefetch is not None else 0)
            if st.dep.chunk_avail[c]:
                link.on[c] = False
                st.probe.settle(c)
                continue  # became available meanwhile (computed)
            li = link.level[c]
            if cfg.levels is not None:
                li = link.level[c] = cfg.levels.level(st, c, now)
            link.inflight[c] = Inflight(li, link.bytes_at(c, li), 0.0, now)
            cid = self.inst.chunk_id(c)
            if cid in link.cancels:   # cancelled, then handed back to the link before the
                link.cancels.remove(cid)   # driver took the cancellation: fetch it, once
            return Fetch(cid, self._level_names[li])
        return None

    @property
    def has_cancellations(self) -> bool:
        return bool(self.state.link.cancels)

    def take_cancellations(self) -> list[KVChunkId]:
        """In-flight fetches the link should abort (their steps moved to the compute path)."""
        link = self.state.link
        out, link.cancels = link.cancels, []
        return out

    # ------------------------------------------------------------------ events
    def rate_sample(self, now: float, nbytes: float, seconds: float,
                    cid: KVChunkId | None = None, received: float | None = None) -> None:
        """``nbytes`` were received over the last ``seconds`` (optionally: for chunk ``cid``,
        which has ``received`` more bytes in, default ``nbytes``; ``seconds`` 0: no rate, only
        ``cid``'s progress).

        A driver reports silence too (``nbytes`` 0) when a request is outstanding and nothing
        arrives beyond the expected first-byte delay: the estimate then follows what the link
        delivers over time, and a link that went quiet loses its work to the compute path."""
        st = self.state
        st.link_estimator.add(now, nbytes, seconds)
        if self._planner is not None and seconds > 0:
            self._replan(now)
        if cid is not None:
            f = st.link.inflight.get(self.inst.chunk_index(cid))
            if f is not None:
                f.received += nbytes if received is None else received
        self._adapt(now)

    def chunk_received(self, cid: KVChunkId, now: float) -> None:
        """The transfer of ``cid`` completed; it is being decoded."""
        c = self.inst.chunk_index(cid)
        link = self.state.link
        link.inflight.pop(c, None)
        link.received.add(c)
        self.state.probe.settle(c)
        self._adapt(now)

    def chunk_arrived(self, cid: KVChunkId, now: float) -> None:
        """``cid`` is decoded and in place (available to attention)."""
        c = self.inst.chunk_index(cid)
        st = self.state
        st.link.received.discard(c)
        st.link.inflight.pop(c, None)
        st.probe.settle(c)
        if not st.dep.chunk_avail[c]:
            st.available += 1
            st.dep.add_chunk(c)
        self._adapt(now)

    def step_done(self, step: StepId, now: float, seconds: float) -> None:
        """Layer step ``step`` finished after ``seconds``; its KV chunks are in place."""
        s = self.inst.step_index(step)
        st = self.state
        st.compute.finished(s)
        G = st.G
        for g in range(G):
            st.probe.settle(s * G + g)
        st.compute.run_quiet = st.compute.run_quiet and st.link_quiet()
        # the projection-only last layer is not a sample of the device's speed: its prediction
        # (a share of a step's matmuls) missed its norm, RoPE and cache write 3-5x (session 64),
        # and under spans a streaming load's only quiet steps were often that layer's
        quiet = st.compute.run_quiet and s % st.L != st.L - 1
        st.compute_estimator.add(st.compute.t_comp[s], seconds, quiet=quiet)
        st.mark_computed(s)
        self._adapt(now)

    def adopt(self, plan: Plan, now: float) -> bool:
        """The load goes on by ``plan`` (a better plan made while it ran, for the same
        instance): the work under way stays, the rest is ``plan``'s
        (:mod:`sparkv.scheduler.handover`); the stage clock becomes ``plan``'s. Recorded as a
        ``handover`` :class:`~sparkv.scheduler.state.Migration`; drivers re-ask idle workers
        and take the cancellations. Ignored after a re-plan at the measured rate (``plan`` was
        made for the rate the link did not deliver). Returns whether the load took ``plan``."""
        if self.replanned is not None and self.replanned["taken"]:
            return False
        self._go_on_by(plan, now, "handover")
        return True

    def _go_on_by(self, plan: Plan, now: float, why: str) -> None:
        st = self.state
        comp_s, link_s = st.remaining(now)
        self.plan = plan
        st.stage_s = stage_length(plan, self.inst,
                                  self.cfg.rebalance.stage_s if self.cfg.rebalance else None)
        st.horizon_s = 2.0 * st.stage_s
        st.adopt(now, plan, link_s, comp_s, why)
        self._adapt(now)

    def _replan(self, now: float) -> None:
        """The :class:`~sparkv.scheduler.rules.Replan` rule at a rate sample: once the link has
        been measured, its verdict (recorded in :attr:`replanned`, and in the new plan's
        ``info["replan"]``); a planner that fails leaves the load to its plan."""
        rule, est = self.cfg.replan, self.state.link_estimator
        assert rule is not None and self._planner is not None
        rate = rule.measured(est, now)
        if rate is None:
            return
        planner, self._planner = self._planner, None
        planned = self.inst.bandwidth_Bps
        self.replanned = {"time_s": now - self.state.t0, "measured_mbps": rate * 8e-6,
                          "planned_mbps": planned * 8e-6, "taken": False}
        kept = self._kept_plan(rule.wants(rate, planned))
        if kept is not None:
            self.replanned["kept"] = kept
            return
        try:
            plan = planner(self.inst.replace(bandwidth_Bps=rate))
        except Exception as e:  # noqa: BLE001 - the load goes on by the plan it has
            self.replanned["error"] = f"{type(e).__name__}: {e}"
            return
        self.replanned["taken"] = True
        plan.info["replan"] = dict(self.replanned)
        est.prior_Bps = rate    # the rate the plan is made with (DeadLink's reference)
        self._go_on_by(plan, now, "replan")

    def _kept_plan(self, slower: bool) -> str | None:
        """Why the re-plan's verdict keeps the plan (``None``: it re-plans)."""
        if not slower:
            return "link not slower"
        if self.state.link_dead is not None:
            return "link dead"
        if self.state.link_estimator.ahead_bytes > 0:
            return "others' bytes ahead"
        return "load done" if self.done else None

    # ------------------------------------------------------------------ estimates
    def bandwidth_estimate(self, now: float) -> float:
        """Link throughput (bytes/s) over the sliding window; the plan's estimate before samples
        (:meth:`LinkEstimator.window <sparkv.scheduler.estimators.LinkEstimator.window>`)."""
        return self.state.link_estimator.window(now)

    def link_estimate(self, now: float) -> float:
        """The throughput (bytes/s) the rules plan the link's remaining work with
        (:meth:`LinkEstimator.estimate <sparkv.scheduler.estimators.LinkEstimator.estimate>`)."""
        return self.state.link_estimator.estimate(now)

    def run_bandwidth(self) -> float | None:
        """Throughput (bytes/s) over every rate sample of the run (silences included), or
        ``None`` before any sample: the link's goodput, a prior for the next load."""
        return self.state.link_estimator.run_rate()

    @property
    def compute_samples(self) -> int:
        """Layer steps in the compute-speed window."""
        return self.state.compute_estimator.samples

    def compute_ratio(self) -> float:
        """Measured / predicted step time over the window (1.0 before any step)."""
        return self.state.compute_estimator.ratio()

    @property
    def run_compute_samples(self) -> int:
        """Layer steps timed over the whole run."""
        return self.state.compute_estimator.run_samples

    def run_compute_ratio(self) -> float:
        """The median measured / predicted step time over the run's steps (1.0 before any):
        the load's own speed against the cost model."""
        return self.state.compute_estimator.run_ratio()

    @property
    def quiet_compute_samples(self) -> int:
        """Layer steps of the run timed while the link was quiet."""
        return self.state.compute_estimator.quiet_samples

    def quiet_compute_ratio(self) -> float:
        """:meth:`run_compute_ratio` over the steps that ran while the link was quiet (1.0
        before any): the device's own speed against the cost model, the next plan's prior
        (:meth:`ComputeEstimator.quiet_ratio <sparkv.scheduler.estimators.ComputeEstimator.
        quiet_ratio>`)."""
        return self.state.compute_estimator.quiet_ratio()

    def remaining(self, now: float) -> tuple[float, float]:
        """``(compute_remaining_s, link_remaining_s)`` from the current estimates."""
        return self.state.remaining(now)

    # ------------------------------------------------------------------ adaptation
    def _adapt(self, now: float) -> None:
        """After every event and query: the dead-link verdict, then the rebalancing."""
        cfg = self.cfg
        if cfg.dead_link is not None:
            cfg.dead_link.check(self.state, self._watch, now)
        if cfg.rebalance is not None:
            cfg.rebalance.run(self.state, self._pace, now)
