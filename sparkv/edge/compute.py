"""The engine's compute path: one thread that asks the controller for the next layer step, runs
it on the :class:`~sparkv.runtime.stepper.LayerStepper` (PyTorch releases the GIL in its
kernels) and reports ``step_done``; when the controller has nothing for it, it computes what the
link failed to deliver, and applies the stall and idle rules and the ask's time limit
(docs/edge.md).
"""

from __future__ import annotations

import dataclasses

import torch

from sparkv.edge.frames import FrameDecoder
from sparkv.edge.hub import EngineError, Hub
from sparkv.edge.lane import Lane
from sparkv.edge.link import Link
from sparkv.edge.prelude import Prelude
from sparkv.edge.stats import EngineStats
from sparkv.layout import StepId
from sparkv.runtime.stepper import LayerStepper, StepResult
from sparkv.runtime.threads import use_threads

WAIT_S = 0.05
"""How long the compute worker waits on the engine's lock before it looks again."""


class ComputeWorker:
    """The compute path of one load, run on the asking thread (:meth:`run`; "the compute
    thread" below).

    State and lock discipline:

    * ``_idle_s``, ``_idle_at`` (the idle rule's credited idle time): the compute thread's own,
      touched only while it holds the engine's lock;
    * ``error``: written by the compute thread under the lock; :class:`Engine
      <sparkv.edge.engine.Engine>` reads it after :meth:`run`;
    * it writes its steps, the stall and ``ready_s`` into :class:`EngineStats`, and reads the
      link's silence and activity (:class:`Link`), the decoder's (:class:`FrameDecoder`) and the
      faults recorded in :class:`EngineStats`, all under the engine's lock, in the critical section
      that picks a step.

    Waits: on the engine's lock's condition, at most :data:`WAIT_S` at a time, whenever it has no
    step to run. Notifies: :meth:`Hub.progress <sparkv.edge.hub.Hub.progress>` after every step
    (the link may have work: a dependency prefetch, a migration) and on a failed prelude;
    ``notify_all`` when it ends with an error.

    Args:
        link: the engine's link, or ``None`` when it has none (never silent, never busy).
        prelude: the prelude still finishing steps on ``stepper``; its steps are joined before
            the first step here.
        stall_fallback_s: the stall and the idle rules' threshold (seconds of credited time).
        deadline_s: the ask's time limit on the load's clock (``None``: none): once it passed,
            the link is stopped and everything missing is computed.
        lane: the ask's lane (:mod:`sparkv.edge.lane`): at every look for a step, its load is
            the controller's compute load, its link turn's bytes ahead the controller's
            :attr:`~sparkv.scheduler.estimators.LinkEstimator.ahead_bytes`, and a cancelled ask raises
            :class:`~sparkv.edge.lane.AskCancelled` (the load ends with it).
    """

    def __init__(self, hub: Hub, stepper: LayerStepper, stats: EngineStats, link: Link | None,
                 decoder: FrameDecoder, prelude: Prelude | None, stall_fallback_s: float,
                 deadline_s: float | None = None, lane: Lane | None = None) -> None:
        self._hub, self._stepper, self._kv = hub, stepper, stepper.kv
        self._stats, self._link, self._decoder = stats, link, decoder
        self._prelude = prelude
        self._prelude_failed = False    # a promised step is missing: fallbacks fill it first
        self._stall_fallback_s = stall_fallback_s
        self._deadline_s = deadline_s
        self._lane = lane
        self._idle_s = 0.0              # credited time with nothing scheduled on either path
        self._idle_at: float | None = None
        self._threads = 1
        self.error: BaseException | None = None

    def run(self, threads: int) -> None:
        """Computes on the calling thread until every chunk is in place (or the worker failed:
        :attr:`error`); its kernels use ``threads`` OpenMP threads (sparkv.runtime.threads). The
        caller's thread, not one of its own: an OpenMP team led by a thread other than the
        process's initial one ran the same layer calls 1.2-1.3x slower on a 2-core CPU, and a
        load on a thread of its own 1.2x slower (session 69, docs/benchmarks.md)."""
        self._threads = threads
        self._main()
        if isinstance(self.error, (KeyboardInterrupt, SystemExit)):
            raise self.error

    # ---- the loop ----------------------------------------------------------------------------
    def _main(self) -> None:
        hub = self._hub
        try:
            use_threads(self._threads)
            self._join_prelude()
            while True:
                self._decoder.decode_queued()     # frames decoded in turn, before a call
                with hub.cv:
                    steps = self._pick_steps()
                    if steps is None:
                        continue                  # frames arrived: decode them first
                    if not steps:
                        self._stats.ready_s = hub.now()
                        return
                self._run(steps)
        except BaseException as e:  # noqa: BLE001 - reported by Engine.run
            with hub.cv:
                self.error = e
                self._stats.ready_s = hub.now()
                hub.cv.notify_all()

    def _join_prelude(self) -> None:
        """Waits for the prelude's last step; a step it promised and failed leaves its chunks
        missing although the controller counts them: compute whatever is missing (the link goes
        on; reported as the stall rule's fallback)."""
        if self._prelude is None:
            return
        res = self._prelude.join()
        if not res.ok:
            self._prelude_failed = True
            with self._hub.cv:
                self._stats.stall = self._silent_link()
                self._stats.link_errors.append(f"prelude failed ({type(res.error).__name__}):"
                                               " computing what is missing")
                self._hub.progress()

    def _run(self, steps: list[StepId]) -> None:
        """Runs one step, a column of one token chunk's consecutive layers as one call (the
        all-local fast path), or a span of one layer's token chunks (a launch-bound device:
        :meth:`Controller.next_steps <sparkv.scheduler.controller.Controller.next_steps>`), and
        reports each step."""
        hub = self._hub
        start = hub.now()
        if len(steps) == 1:
            results = [self._stepper.run_step(steps[0])]
        elif steps[1].l == steps[0].l:
            results = self._run_spans(steps)
        else:
            results = self._stepper.run_column(steps[0].t, steps[0].l, steps[-1].l + 1)
        waited = self._wait_device()
        end = hub.now()
        scale = (end - start) / max(sum(r.seconds for r in results), 1e-9)
        with hub.cv:
            t = start
            for res in results:
                t_end = min(end, t + res.seconds * scale)
                seconds = t_end - t if waited else res.seconds
                self._stats.step_ran(res.step, t, t_end, seconds)
                hub.ctl.step_done(res.step, t_end, seconds)
                t = t_end
            hub.progress()

    def _wait_device(self) -> bool:
        """On a GPU, waits for the unit's kernels (one synchronisation per unit: a span, a
        column or a step, not per kernel): the steps' times are then the GPU's, not the host's
        dispatch time, which is all the stepper's clock sees of asynchronous kernels (the
        controller's compute speed would learn the dispatch rate). Returns whether it waited."""
        device = self._kv.device
        if device.type != "cuda":
            return False
        torch.cuda.synchronize(device)
        return True

    def _run_spans(self, steps: list[StepId]) -> list[StepResult]:
        """Steps of one layer in token order, each run of consecutive token chunks as one span
        (a step a fallback ran meanwhile left the list and splits the run)."""
        out: list[StepResult] = []
        l, first = steps[0].l, 0  # noqa: E741
        for i in range(1, len(steps) + 1):
            if i == len(steps) or steps[i].t != steps[i - 1].t + 1:
                out.extend(self._by_prediction(
                    self._stepper.run_span(steps[first].t, steps[i - 1].t + 1, l)))
                first = i
        return out

    def _by_prediction(self, results: list[StepResult]) -> list[StepResult]:
        """One call's steps with its time shared in proportion to their predicted times (the
        stepper shares it evenly). Evenly, a span's last token chunk of a few tokens was charged
        a whole chunk's time, 30-50x its prediction, and the controller's compute speed, a mean
        over the last eight steps, read the compute path as 6-19x slower than it was (session
        68), where the compute-behind rule moves steps to the link in bulk."""
        if len(results) < 2:
            return results
        inst = self._hub.ctl.inst          # immutable: no lock needed
        predicted = [float(inst.step_t_comp[inst.step_index(r.step)]) for r in results]
        total_predicted = sum(predicted)
        if total_predicted <= 0:
            return results
        total = sum(r.seconds for r in results)
        return [dataclasses.replace(r, seconds=total * p / total_predicted)
                for r, p in zip(results, predicted)]

    # ---- choosing a step (under the lock) ----------------------------------------------------
    def _pick_steps(self) -> list[StepId] | None:
        """The next steps to run (one, or a column), waiting for events; empty when the cache
        is complete; ``None`` when, with nothing to run, frames wait to be decoded in turn."""
        while True:
            if self._stats.refused is not None:   # a configuration error: never a fallback
                raise self._stats.refused
            if self._kv.is_complete():
                return []
            self._share()
            self._past_deadline()
            steps = self._planned_steps()
            if steps:
                return steps
            step = self._fallback_step()
            if step is not None:
                self._stats.fallback_steps += 1
                return [step]
            if self._decoder.queued:
                return None
            if not self._stall():
                self._hub.cv.wait(WAIT_S)

    def _planned_steps(self) -> list[StepId]:
        """The controller's next steps, skipping those that already ran as a fallback."""
        ctl, now = self._hub.ctl, self._hub.now
        done = self._stepper.done
        while True:
            steps = ctl.next_steps(now())
            ran = [s for s in steps if s in done]
            for step in ran:
                ctl.step_done(step, now(), 0.0)
            # a fallback runs layers bottom up: what ran of a column is its beginning
            steps = [s for s in steps if s not in done]
            if steps or not ran:
                break
        if steps and self._prelude_failed and self._stepper.call_missing(steps):
            # the controller counts a failed prelude span's steps as done, and a call may need
            # them past its first step (a span's later token chunks' hidden inputs): the
            # fallback computes what is missing, bottom up
            return []
        if steps and not self._stepper.ready(steps[0]):
            raise EngineError(f"the controller chose {steps[0]} but the stepper is missing "
                              f"{self._stepper.missing_dependencies(steps[0])[:3]}")
        return steps

    def _fallback_step(self) -> StepId | None:
        """A ready step that recomputes chunks the link failed to deliver (or everything missing
        once the link is dead or stalled)."""
        stats, stepper = self._stats, self._stepper
        if stats.link_dead is not None or stats.stall is not None or stats.deadline is not None:
            candidates = stepper.steps_needed()
        elif stats.failed:
            done = stepper.done
            candidates = []
            for cid in list(stats.failed):
                if self._kv.has(cid):
                    continue
                candidates.extend(StepId(cid.t, l) for l in range(cid.l + 1)  # noqa: E741
                                  if StepId(cid.t, l) not in done)
            candidates.sort(key=lambda s: (s.l, s.t))
        else:
            return None
        for s in candidates:
            if stepper.ready(s):
                return s
        return None

    def _share(self) -> None:
        """The lane's news: cancelled (raises), the other asks' load on the compute path, and
        the bytes of theirs the link carries before this ask's (the device's link plan)."""
        if self._lane is not None:
            self._lane.check()
            st = self._hub.ctl.state
            st.compute_estimator.load = max(1.0, float(self._lane.load()))
            turn = self._lane.link_turn(self._link_pending())
            st.link_estimator.ahead_bytes = max(0.0, float(turn.ahead_bytes))

    def _link_pending(self) -> float:
        """The bytes this ask still wants from the link: none once the link is stopped, dead or
        given up (what it still holds is computed: the other asks must not wait for it)."""
        if self._link is None or self._stats.link_given_up:
            return 0.0
        return float(self._hub.ctl.state.link.pending_bytes())

    def _past_deadline(self) -> None:
        """The ask's time limit: once it passed (and the link is still wanted), the link is
        stopped and everything missing is computed, whatever the link would still deliver."""
        stats = self._stats
        if (self._deadline_s is None or self._link is None or stats.deadline is not None
                or stats.link_dead is not None or self._hub.now() < self._deadline_s):
            return
        stats.deadline = (f"the ask's time limit passed {self._deadline_s:.3g} s into loading: "
                          "the link was stopped and every missing chunk computed locally")
        stats.link_errors.append(stats.deadline)
        self._link.stop()
        self._hub.progress()

    def _stall(self) -> bool:
        """The stall and the idle rules: whether everything missing is to be computed from now
        on (the link keeps going; whichever path delivers a chunk first wins)."""
        stats = self._stats
        if stats.stall is not None:
            return False
        silence = self._link.silence_s if self._link is not None else 0.0
        if (stats.link_dead is None and not self._decoder.busy()
                and silence > self._stall_fallback_s):
            # nothing to compute, nothing to decode, and the link, watched by an awake loop,
            # delivered nothing for a while (a link that collapsed with data stuck in its
            # queues, a hung server)
            stats.stall = self._silent_link()
            return True
        if self._scheduler_idle():
            # nothing runs anywhere - no step, no request, no decode - yet chunks are missing:
            # the schedule lost them (a bug, never a reason to hang)
            stats.stall = (f"nothing scheduled for {self._stall_fallback_s:g} s while chunks "
                           "were missing")
            stats.link_errors.append("scheduler idle with chunks missing: computed locally")
            return True
        return False

    def _silent_link(self) -> str:
        return f"link silent for {self._stall_fallback_s:g} s"

    def _scheduler_idle(self) -> bool:
        """Whether neither path has had anything to do for ``stall_fallback_s`` (credited like
        silence: at most two wait intervals per check, so a starved process does not count its
        own slowness)."""
        now = self._hub.now()
        if (self._link is not None and self._link.busy()) or self._decoder.busy():
            self._idle_s, self._idle_at = 0.0, None
            return False
        if self._idle_at is not None:
            self._idle_s += min(now - self._idle_at, 2 * WAIT_S)
        self._idle_at = now
        return self._idle_s > self._stall_fallback_s
