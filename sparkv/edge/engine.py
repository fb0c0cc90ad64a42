"""The overlap engine: streams KV chunks while computing layer steps, under a runtime controller.

Coordination only: where frames come from is a :class:`~sparkv.edge.transport.ChunkSource`
(HTTP in production, a scripted source in tests), what to do next is the
:class:`~sparkv.scheduler.controller.Controller`'s, and a layer step is the
:class:`~sparkv.runtime.stepper.LayerStepper`'s. :class:`Engine` builds the parts of one load,
starts and stops their threads, and owns no state of its own (docs/edge.md):

* :class:`~sparkv.edge.hub.Hub`: the controller behind the engine's one lock, the clock, the
  progress signal (and :class:`EngineConfig`, :class:`EngineError`);
* :class:`~sparkv.edge.compute.ComputeWorker` (the compute thread): asks the controller for the
  next layer step, runs it, reports ``step_done``; computes what the link failed to deliver;
  the stall rule and the idle rule;
* :class:`~sparkv.edge.link.Link` (the link thread, an asyncio loop): batches of fetches, one
  request each through the source, frames read piece by piece, rate samples and silence,
  cancellations, retries; started whenever there is a source;
* :class:`~sparkv.edge.frames.FrameDecoder` (the decode workers): decrypts and decodes a
  received frame straight into the KV buffers, then reports ``chunk_arrived``;
* :class:`~sparkv.edge.stats.EngineStats`: the record every part writes, and the
  :class:`~sparkv.edge.results.LoadResult` made of it.

Faults never lose the answer:

* a frame that fails its checksum, decryption or layout check is recomputed locally;
* a request that fails (refused, reset or cut, a 5xx, no response within ``open_timeout_s``, no
  byte within ``read_timeout_s``) is retried ``retries`` times; then the link is declared dead and
  the compute thread computes everything still missing;
* **the stall rule**: when the compute thread has nothing to do, no frame is being decoded, and
  the link has been *silent* for ``stall_fallback_s`` (silence credited by the link loop's ticker
  only while that loop was awake to see it: a starved process does not mistake its own slowness
  for a dead link), the compute thread computes what is missing while the link goes on; whichever
  path delivers a chunk first wins;
* **the idle rule**: when nothing runs on either path (no step, no request, no decode) for
  ``stall_fallback_s`` of awake time while chunks are still missing, the schedule has lost them:
  the compute thread computes what is missing rather than wait forever;
* **the ask's time limit** (``deadline_s``): once it passed, the link is stopped and the compute
  thread computes everything missing, however the link is doing;
* **a dead link** (the controller's verdict, :class:`~sparkv.scheduler.rules.DeadLink`): a link
  far below the plan's estimate gives all its work to the compute path.

:class:`~sparkv.edge.results.LoadResult` says what fell back and why.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Sequence

from sparkv.edge.compute import ComputeWorker
from sparkv.edge.frames import FrameDecoder, FrameOpener, decodes_in_turn
from sparkv.edge.hub import EngineConfig, EngineError, Hub
from sparkv.edge.lane import Lane
from sparkv.edge.link import Link
from sparkv.edge.prelude import Prelude
from sparkv.edge.results import LoadResult
from sparkv.edge.stats import EngineStats
from sparkv.edge.transport import ChunkSource
from sparkv.layout import KVChunkId, StepId
from sparkv.runtime.device import fused_spans
from sparkv.runtime.stepper import LayerStepper
from sparkv.scheduler.controller import Controller, ControllerConfig
from sparkv.scheduler.instance import Instance
from sparkv.scheduler.plan import Plan

__all__ = ["Engine", "EngineConfig", "EngineError", "FrameOpener"]

#: how long a stopped link may take to close its requests and its source
LINK_CLOSE_S = 10.0


class Engine:
    """Loads one context's KV cache by ``plan`` (see the module docstring).

    Args:
        stepper: the layer stepper over the context's tokens (its buffers receive everything).
        plan, inst: what to do, and the cost model it was made with.
        controller: the controller's configuration (``ControllerConfig.static()``: the plan as is).
        source: where streamed frames come from (unused, and may be ``None``, for a local plan).
        open_frame: decrypts a stored frame (encrypted contexts).
        kept: a compressed context's kept entries per chunk, ``cid -> (counts, absolute
            positions per head)`` (:attr:`Manifest.kept_positions
            <sparkv.protocol.Manifest.kept_positions>`): a streamed frame then holds only those
            rows (``[1, sum(counts), D]``) and becomes a :class:`~sparkv.cache.ChunkPayload`
            with them; locally computed chunks stay whole (the caller prunes every layer to
            the same positions once loading completes).
        prelude, prelude_done: steps the stepper already ran, and those the prelude is finishing
            on ``stepper`` (sparkv.edge.prelude), are done for the controller; the compute
            thread waits for the prelude before its first step, the link starts at once.
        deadline_s: the ask's time limit, seconds from the start of :meth:`run` (``None``:
            none); past it the link is stopped and everything missing computed
            (``LoadResult.fallback["deadline"]``).
        lane: the ask's share of a device serving several asks (:mod:`sparkv.edge.lane`): the
            controller plans remaining compute with its load and the link's remaining time
            with the others' bytes ahead, the link sends a request only on the ask's turn, and
            a cancelled ask ends the load at the compute thread's next look (``None``: alone).
        planner: plans ``inst`` at another link rate: the controller's re-plan at the measured
            rate, once, when the link is far slower than ``inst`` says
            (:class:`~sparkv.scheduler.rules.Replan`; ``None``: no re-plan).
    """

    def __init__(self, stepper: LayerStepper, plan: Plan, inst: Instance,
                 controller: ControllerConfig | None = None, *, source: ChunkSource | None = None,
                 config: EngineConfig | None = None, open_frame: FrameOpener | None = None,
                 kept: Mapping[KVChunkId, tuple[Sequence[int], Sequence[Any]]] | None = None,
                 prelude: Prelude | None = None, prelude_done: Iterable[StepId] = (),
                 deadline_s: float | None = None, lane: Lane | None = None,
                 planner: Callable[[Instance], Plan] | None = None) -> None:
        if stepper.geometry != inst.geometry:
            raise EngineError("the stepper and the instance have different geometries")
        if plan.stream_order and source is None:
            raise EngineError("the plan streams chunks but the engine has no chunk source")
        self.stepper, self.kv = stepper, stepper.kv
        self.inst = inst
        self.cfg = cfg = config or EngineConfig()
        controller = controller or ControllerConfig().with_spans(fused_spans(stepper.lm.device))
        if source is None:   # no link: the controller must never hand it work
            controller = controller.without_link()
        self.ctl = Controller(plan, inst, controller,
                              done_steps=set(stepper.done) | set(prelude_done), planner=planner)
        self._hub = Hub(self.ctl)
        self._stats = EngineStats()
        self._decoder = FrameDecoder(self._hub, self.kv, self._stats, cfg.decode_workers,
                                     open_frame, kept)
        # the link runs whenever there is a source: a plan that streams nothing may still have
        # steps migrated to it (a device slower than its cost model said); without a running
        # link those chunks waited for the idle rule (1.5 s lost per ask, first seen on an H200)
        self._link = (Link(self._hub, source, inst, self.kv, self._stats, self._decoder, cfg,
                           lane)
                      if source is not None else None)
        self._compute = ComputeWorker(self._hub, stepper, self._stats, self._link, self._decoder,
                                      prelude, cfg.stall_fallback_s, deadline_s, lane)
        self._threads: int | None = None    # the compute path's OpenMP threads, once started
        self._closed = False                # guarded by the hub's lock

    def start(self) -> None:
        """Starts the load's clock, its link and its decoder, the compute path not yet: a
        caller whose thread is still finishing the prelude's span starts the link from another
        thread as soon as the plan is made (sparkv.edge.session); :meth:`run` then computes.
        Called again (by :meth:`run`), it does nothing."""
        import torch

        if self._threads is not None:
            return
        hub, link = self._hub, self._link
        hub.start_clock()
        if link is not None:
            link.connect()
        with hub.cv:
            self.ctl.start(0.0)
        # OpenMP thread counts are per calling thread: the compute loop runs on the caller's
        # (ComputeWorker.run), the decode worker gets one (its dequantisation must not
        # oversubscribe the cores the layer steps use: measured, 4 OpenMP threads on 2 cores
        # made decoding 5x slower and stalled steps). Each thread sets its own with use_threads
        # (a plain set_num_threads is undone by the thread's lazy initialisation, which reads
        # whatever another thread set last: sparkv.runtime.threads); the count is read here,
        # before a decode worker starts
        self._threads = threads = torch.get_num_threads()
        in_turn = decodes_in_turn(self.cfg, self.kv.device, threads)
        self._decoder.start(warm=link is not None, in_turn=in_turn)
        if link is not None:
            try:
                link.start()
            except BaseException:
                self._decoder.shutdown()
                raise

    def run(self) -> LoadResult:
        """Loads every chunk (:meth:`start` first, unless it was called); returns when the KV
        buffers are complete."""
        self.start()
        assert self._threads is not None
        try:
            self._compute.run(self._threads)       # on this thread (ComputeWorker.run)
        finally:
            self._close()
        error = self._compute.error
        if error is not None:
            raise EngineError(f"loading failed: {type(error).__name__}: {error}") from error
        with self._hub.cv:
            return self._stats.result(self.kv, self.ctl)

    def adopt(self, plan: Plan) -> bool:
        """The load goes on by ``plan``, made for the same instance while it ran (the plan's
        handover, docs/edge.md): the work under way stays, the rest is ``plan``'s
        (:meth:`Controller.adopt <sparkv.scheduler.controller.Controller.adopt>`), and the
        idle workers are woken. Callable from any thread once :meth:`start` ran; a load that
        is complete or closed ignores it, and so does one that re-planned at the link's measured
        rate (``plan`` was made for the rate the link did not deliver). Returns whether the
        load took ``plan``."""
        hub = self._hub
        with hub.cv:
            if self._closed or self.ctl.done or not self.ctl.adopt(plan, hub.now()):
                return False
            hub.progress()
            return True

    @property
    def plan(self) -> Plan:
        """The plan the load goes by: the one it started with, or the one it took since (a
        handover, or a re-plan at the measured link rate)."""
        return self.ctl.plan

    def abort(self) -> None:
        """Stops a started load that will not be run: the link's requests closed, the decoder
        shut down (nothing is computed)."""
        if self._threads is not None:
            self._close()

    def _close(self) -> None:
        with self._hub.cv:
            self._closed = True
        link = self._link
        if link is not None:
            link.stop()
            link.join(LINK_CLOSE_S)
        self._decoder.shutdown()
