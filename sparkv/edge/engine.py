"""The overlap engine: streams KV chunks while computing layer steps, under a runtime controller.

Orchestration only: where frames come from is a :class:`~sparkv.edge.transport.ChunkSource`
(HTTP in production, a scripted source in tests), what to do next is the
:class:`~sparkv.scheduler.controller.Controller`'s, and a layer step is the
:class:`~sparkv.runtime.stepper.LayerStepper`'s.

Threads (docs/edge.md):

* **compute thread**: asks the controller for the next layer step, runs it (PyTorch releases the
  GIL in its kernels), reports ``step_done``;
* **link thread**: an asyncio loop. It pulls fetches from the controller in small batches (about
  ``batch_seconds`` of link time each), opens each batch on the source and reads its pieces. The
  next batch is opened one RTT before the current one drains (no idle round trip between
  batches). Rate samples go to the controller every ``sample_interval_s`` while bytes flow, and
  a ticker reports *silence* (zero-byte samples) while a request is outstanding and nothing
  arrives beyond the expected first-byte delay. Cancelled chunks abort the response at once and
  the rest of the batch is requested again;
* **decode worker** (a one-thread pool): decrypts and decodes a received frame straight into the
  KV buffers (the codec checks the frame's checksum), then reports ``chunk_arrived``.

The controller is not thread-safe; every call to it holds the engine's lock.

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
* **the idle rule**: when nothing runs on either path (no step, no request, no decode, nothing
  booked) for ``stall_fallback_s`` of awake time while chunks are still missing, the schedule has
  lost them: the compute thread computes what is missing rather than wait forever.

:class:`~sparkv.edge.results.LoadResult` says what fell back and why.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable, Mapping, Sequence, TypeVar

from sparkv.edge.prelude import Prelude
from sparkv.edge.results import LoadResult, TransferLog, TransferStatus
from sparkv.edge.transport import ChunkSource, ChunkStream, FetchItem, SourceError
from sparkv.errors import SparkvError
from sparkv.layout import KVChunkId, StepId
from sparkv.runtime.stepper import LayerStepper
from sparkv.runtime.threads import use_threads
from sparkv.scheduler.controller import Controller, ControllerConfig, Fetch
from sparkv.scheduler.instance import Instance
from sparkv.scheduler.plan import Plan

T = TypeVar("T")
FrameOpener = Callable[[bytes, KVChunkId, str], bytes]
"""``(stored bytes, chunk, level) -> codec frame`` (decrypts an encrypted context's frames)."""

#: streamed bytes below which a run says nothing about the link (the next plan keeps its prior)
MIN_BYTES_FOR_ESTIMATE = 1 << 20


class EngineError(SparkvError):
    """The engine could not assemble the cache (a bug or an unrecoverable local failure)."""


@dataclass
class EngineConfig:
    """Knobs of the engine's two paths (seconds, bytes)."""

    batch_seconds: float = 0.25      # link time per request at the estimated rate
    batch_min_bytes: int = 256 << 10
    batch_max_items: int = 64
    lead_s: float = 0.02             # open the next request this long (+ RTT) before a batch drains
    sample_interval_s: float = 0.05  # rate samples (and silence ticks) to the controller
    retries: int = 2                 # failed requests retried before the link is declared dead
    retry_backoff_s: float = 0.05
    open_timeout_s: float = 10.0     # a request must start answering within this
    read_timeout_s: float = 10.0     # no byte for this long within a response: the request failed
    silence_grace_s: float = 0.25    # silence counts against the link beyond max(this, 3 RTT)
    stall_fallback_s: float = 1.5    # compute idle + this much credited silence: compute the rest
    decode_workers: int = 1


class _LinkFailure(Exception):
    """A request failed; ``unreceived`` are the fetches of it that never arrived."""

    def __init__(self, reason: str, unreceived: Sequence[Fetch], fatal: bool = False) -> None:
        super().__init__(reason)
        self.reason, self.unreceived, self.fatal = reason, list(unreceived), fatal


@dataclass
class _Request:
    batch: list[Fetch]
    task: "asyncio.Future[ChunkStream]"
    sent_s: float


async def _within(aw: Awaitable[T], seconds: float) -> T:
    """``await aw`` with a timeout (``asyncio.TimeoutError``), without a task per call on 3.11+."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(seconds):
            return await aw
    return await asyncio.wait_for(aw, seconds)  # pragma: no cover - Python 3.10


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
    """

    def __init__(self, stepper: LayerStepper, plan: Plan, inst: Instance,
                 controller: ControllerConfig | None = None, *, source: ChunkSource | None = None,
                 config: EngineConfig | None = None, open_frame: FrameOpener | None = None,
                 kept: Mapping[KVChunkId, tuple[Sequence[int], Sequence[Any]]] | None = None,
                 prelude: Prelude | None = None, prelude_done: Iterable[StepId] = ()
                 ) -> None:
        if stepper.geometry != inst.geometry:
            raise EngineError("the stepper and the instance have different geometries")
        if plan.stream_order and source is None:
            raise EngineError("the plan streams chunks but the engine has no chunk source")
        self.stepper, self.kv = stepper, stepper.kv
        self.plan, self.inst = plan, inst
        self.cfg = config or EngineConfig()
        # steps the stepper already ran, and those the prelude is finishing on ``stepper``
        # (sparkv.edge.prelude), are done for the controller; the compute thread waits for
        # the prelude before its first step, the link starts at once
        self._prelude = prelude
        controller = controller or ControllerConfig()
        if source is None:   # no link: the controller must never hand it work
            controller = controller.without_link()
        self.ctl = Controller(plan, inst, controller,
                              done_steps=set(stepper.done) | set(prelude_done))
        self.source = source
        self.open_frame = open_frame
        self.kept = dict(kept) if kept else {}
        self._cv = threading.Condition(threading.RLock())
        self._t0 = 0.0
        self._finished = threading.Event()
        self._steps: dict[StepId, tuple[float, float]] = {}
        self._transfers: dict[KVChunkId, TransferLog] = {}
        self._transfer_list: list[TransferLog] = []
        self._cancelled: set[KVChunkId] = set()
        self._failed: dict[KVChunkId, str] = {}      # chunk -> why it must be computed locally
        self._fallback_steps: list[StepId] = []
        self._link_dead: str | None = None
        self._link_errors: list[str] = []
        self._compute_busy = 0.0
        self._decode_busy = 0.0
        self._bytes_received = 0
        self._bytes_used = 0
        self._requests = 0
        self._first_byte: float | None = None
        self._last_byte = 0.0
        self._pending_decodes = 0
        self._inflight_bytes = 0
        self._outstanding = 0           # requests sent whose responses are not finished
        self._quiet_since = 0.0         # last byte, or when the link began waiting
        self._silence = 0.0             # credited silence since the last byte (seconds)
        self._silence_total = 0.0
        self._stalled = False
        self._idle_s = 0.0              # credited time with nothing scheduled on either path
        self._idle_at: float | None = None
        self._idle_fallback = False
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._link_task: "asyncio.Task[Any] | None" = None
        self._prestarted: _Request | None = None
        self._ready_s = 0.0
        self._decoder: ThreadPoolExecutor | None = None
        self._compute_threads = 1

    # ---- time and events ---------------------------------------------------------------------
    def now(self) -> float:
        return time.perf_counter() - self._t0

    def _progress(self) -> None:
        self._cv.notify_all()
        self._wake_link()

    def _wake_link(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # loop closed meanwhile
                pass

    # ---- run ---------------------------------------------------------------------------------
    def run(self) -> LoadResult:
        """Loads every chunk; returns when the KV buffers are complete."""
        import torch

        self._t0 = time.perf_counter()
        # the link runs whenever there is one: a plan that streams nothing may still have steps
        # migrated to it (a device slower than its cost model said); without a running link
        # those chunks waited for the idle rule (1.5 s lost per ask, first seen on an H200)
        streams = self.source is not None
        if self.source is not None:
            self.source.start()
        with self._cv:
            self.ctl.start(0.0)
        # OpenMP thread counts are per calling thread: the compute thread gets the caller's, the
        # decode worker one (its dequantisation must not oversubscribe the cores the layer steps
        # use: measured, 4 OpenMP threads on 2 cores made decoding 5x slower and stalled steps).
        # Each thread sets its own with use_threads (a plain set_num_threads is undone by the
        # thread's lazy initialisation, which reads whatever another thread set last:
        # sparkv.runtime.threads), and the decode workers start before the compute thread
        self._compute_threads = torch.get_num_threads()
        decoder = ThreadPoolExecutor(max_workers=self.cfg.decode_workers,
                                     thread_name_prefix="sparkv-decode",
                                     initializer=use_threads, initargs=(1,))
        self._decoder = decoder
        if streams:
            for f in [decoder.submit(int) for _ in range(self.cfg.decode_workers)]:
                f.result()
        compute = threading.Thread(target=self._compute_main, name="sparkv-compute", daemon=True)
        link = threading.Thread(target=self._link_thread, name="sparkv-link", daemon=True)
        compute.start()
        if streams:
            link.start()
        try:
            compute.join()
        finally:
            self._finished.set()
            self._stop_link()
            if streams:
                link.join(timeout=10.0)
            decoder.shutdown(wait=True, cancel_futures=True)
        if self._error is not None:
            raise EngineError(f"loading failed: {type(self._error).__name__}: "
                              f"{self._error}") from self._error
        return self._result()

    def _result(self) -> LoadResult:
        counts: dict[str, int] = {}
        for src in self.kv.sources().values():
            counts[src] = counts.get(src, 0) + 1
        fallback: dict[str, Any] = {}
        if self._failed:
            reasons: dict[str, int] = {}
            for why in self._failed.values():
                reasons[why] = reasons.get(why, 0) + 1
            fallback["chunks"] = reasons
        if self._link_dead:
            fallback["link"] = self._link_dead
        if self._idle_fallback:
            fallback["stalled"] = (f"nothing scheduled for {self.cfg.stall_fallback_s:g} s while "
                                   "chunks were missing")
        elif self._stalled:
            fallback["stalled"] = f"link silent for {self.cfg.stall_fallback_s:g} s"
        if self._fallback_steps:
            fallback["steps_computed"] = len(self._fallback_steps)
        link_active = (self._last_byte - self._first_byte) if self._first_byte is not None else 0.0
        with self._cv:
            estimate = (self.ctl.run_bandwidth()
                        if self._bytes_received >= MIN_BYTES_FOR_ESTIMATE else None)
            ratio, samples = self.ctl.compute_ratio(), self.ctl.compute_samples
        return LoadResult(
            ready_s=self._ready_s, steps=dict(self._steps), transfers=list(self._transfer_list),
            compute_busy_s=self._compute_busy, decode_busy_s=self._decode_busy,
            link_active_s=link_active, bytes_streamed=self._bytes_used,
            bytes_received=self._bytes_received, requests=self._requests,
            migrations=list(self.ctl.migrations), sources=counts, fallback=fallback,
            link_errors=list(self._link_errors), kv=self.kv, link_estimate_Bps=estimate,
            compute_ratio=ratio, compute_samples=samples, silence_s=self._silence_total)

    # ---- compute path ------------------------------------------------------------------------
    def _compute_main(self) -> None:
        try:
            use_threads(self._compute_threads)
            if self._prelude is not None:
                res = self._prelude.join()
                if not res.ok:
                    with self._cv:
                        # a step it promised failed: its chunks are missing although the
                        # controller counts them; compute whatever is missing (the link goes on)
                        self._stalled = True
                        self._link_errors.append(f"prelude failed ({type(res.error).__name__}):"
                                                 " computing what is missing")
                        self._progress()
            while True:
                with self._cv:
                    step = self._pick_step()
                    if step is None:
                        self._ready_s = self.now()
                        return
                start = self.now()
                res = self.stepper.run_step(step)
                end = self.now()
                with self._cv:
                    self._steps[step] = (start, end)
                    self._compute_busy += res.seconds
                    self.ctl.step_done(step, end, res.seconds)
                    self._progress()
        except BaseException as e:  # noqa: BLE001 - reported by run()
            with self._cv:
                self._error = e
                self._ready_s = self.now()
                self._cv.notify_all()

    def _pick_step(self) -> StepId | None:
        """Under the lock: the next step to run, waiting for events; ``None`` when complete."""
        while True:
            if self.kv.is_complete():
                return None
            step = self.ctl.next_step(self.now())
            while step is not None and step in self.stepper.done:  # ran as a fallback already
                self.ctl.step_done(step, self.now(), 0.0)
                step = self.ctl.next_step(self.now())
            if step is not None:
                if not self.stepper.ready(step):
                    raise EngineError(f"the controller chose {step} but the stepper is missing "
                                      f"{self.stepper.missing_dependencies(step)[:3]}")
                return step
            step = self._fallback_step()
            if step is not None:
                self._fallback_steps.append(step)
                return step
            if (not self._stalled and self._link_dead is None and self._pending_decodes == 0
                    and self._silence > self.cfg.stall_fallback_s):
                # nothing to compute, nothing to decode, and the link, watched by an awake
                # loop, delivered nothing for a while (a link that collapsed with data stuck in
                # its queues, a hung server): compute what is missing; the link keeps going
                self._stalled = True
                continue
            if not self._stalled and self._scheduler_idle():
                # nothing runs anywhere - no step, no request, no decode - yet chunks are
                # missing: the schedule lost them (a bug, never a reason to hang); after
                # stall_fallback_s of such awake idleness, compute what is missing
                self._stalled = self._idle_fallback = True
                self._link_errors.append("scheduler idle with chunks missing: computed locally")
                continue
            self._cv.wait(0.05)

    def _scheduler_idle(self) -> bool:
        """Under the lock, from :meth:`_pick_step`'s wait loop: whether neither path has had
        anything to do for ``stall_fallback_s`` (credited like silence: at most two wait
        intervals per check, so a starved process does not count its own slowness)."""
        now = self.now()
        busy = self._outstanding or self._pending_decodes or self._prestarted is not None
        if busy:
            self._idle_s, self._idle_at = 0.0, None
            return False
        if self._idle_at is not None:
            self._idle_s += min(now - self._idle_at, 0.1)
        self._idle_at = now
        return self._idle_s > self.cfg.stall_fallback_s

    def _fallback_step(self) -> StepId | None:
        """A ready step that recomputes chunks the link failed to deliver (or everything missing
        once the link is dead or stalled)."""
        if self._link_dead is not None or self._stalled:
            candidates = self.stepper.steps_needed()
        elif self._failed:
            done = self.stepper.done
            candidates = []
            for cid in list(self._failed):
                if self.kv.has(cid):
                    continue
                candidates.extend(StepId(cid.t, l) for l in range(cid.l + 1)  # noqa: E741
                                  if StepId(cid.t, l) not in done)
            candidates.sort(key=lambda s: (s.l, s.t))
        else:
            return None
        for s in candidates:
            if self.stepper.ready(s):
                return s
        return None

    # ---- link path: the loop -----------------------------------------------------------------
    def _link_thread(self) -> None:
        try:
            asyncio.run(self._link_main())
        except BaseException as e:  # noqa: BLE001 - any link bug falls back to local compute
            with self._cv:
                if self._link_dead is None:
                    self._link_dead = f"link error: {type(e).__name__}: {e}"
                self._link_errors.append(self._link_dead)
                self._cv.notify_all()

    def _stop_link(self) -> None:
        loop, task = self._loop, self._link_task
        if loop is not None and task is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:
                pass

    async def _link_main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._link_task = asyncio.current_task()
        if self._finished.is_set():
            return
        ticker = asyncio.ensure_future(self._ticker())
        try:
            await self._link_loop()
        except asyncio.CancelledError:
            pass
        finally:
            ticker.cancel()
            if self._prestarted is not None:
                await self._discard(self._prestarted)
            assert self.source is not None
            try:
                await self.source.aclose()
            except Exception:  # noqa: BLE001 - closing must not mask the result
                pass

    async def _ticker(self) -> None:
        """Reports silence: while a request is outstanding and no byte arrives beyond the
        expected first-byte delay, each tick credits the time the loop was awake to see it
        (at most two intervals per tick: a late tick means this process was starved, and a
        starved reader says nothing about the link) and sends a zero-byte rate sample."""
        interval = self.cfg.sample_interval_s
        loop = asyncio.get_running_loop()
        last = loop.time()
        assert self.source is not None
        while not self._finished.is_set():
            await asyncio.sleep(interval)
            t = loop.time()
            credit, last = min(t - last, 2 * interval), t
            grace = max(self.cfg.silence_grace_s, 3 * self.source.rtt_s())
            with self._cv:
                if self._outstanding and self.now() - self._quiet_since > grace:
                    self._silence += credit
                    self._silence_total += credit
                    self.ctl.rate_sample(self.now(), 0.0, credit)
                    self._cv.notify_all()

    async def _link_loop(self) -> None:
        leftover: list[Fetch] = []
        failures = 0
        while not self._finished.is_set():
            req = self._prestarted
            self._prestarted = None
            if req is None:
                with self._cv:
                    batch = [f for f in leftover if not self._done_or_cancelled(f.cid)]
                    leftover = []
                    for f in batch:
                        self._book(f)
                    if not batch:
                        batch = self._pull_batch()
                if not batch:
                    assert self._wake is not None
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), 0.05)
                    except asyncio.TimeoutError:
                        pass
                    continue
                req = self._send(batch)
            try:
                # a prestarted request is read first; fetches left over from an earlier batch
                # (after a cancellation) wait for the next request
                leftover = leftover + await self._read(req)
                failures = 0
            except _LinkFailure as e:
                failures += 1
                nxt = self._prestarted
                self._prestarted = None
                if nxt is not None:
                    await self._discard(nxt)
                lost = e.unreceived + (nxt.batch if nxt is not None else [])
                with self._cv:
                    self._link_errors.append(e.reason)
                    for f in lost:       # booked when pulled; booked again when re-sent
                        self._unbook(f)
                    leftover = leftover + lost
                    if e.fatal or failures > self.cfg.retries:
                        self._link_dead = e.reason
                        for f in leftover:
                            log = self._transfers.get(f.cid)
                            if log is not None and log.status == TransferStatus.PENDING:
                                log.status = TransferStatus.LOST
                        self._progress()
                        return
                await asyncio.sleep(self.cfg.retry_backoff_s * (2 ** (failures - 1)))

    # ---- link path: requests -----------------------------------------------------------------
    def _done_or_cancelled(self, cid: KVChunkId) -> bool:
        return cid in self._cancelled or self.kv.has(cid)

    def _book(self, f: Fetch) -> None:
        self._inflight_bytes += self.inst.bytes_of(f.cid, f.level)

    def _unbook(self, f: Fetch) -> None:
        self._inflight_bytes = max(0, self._inflight_bytes - self.inst.bytes_of(f.cid, f.level))

    def _pull_batch(self) -> list[Fetch]:
        """Under the lock: the next fetches from the controller, about ``batch_seconds`` worth."""
        now = self.now()
        bw = self.ctl.bandwidth_estimate(now)
        target = max(self.cfg.batch_min_bytes, bw * self.cfg.batch_seconds)
        out: list[Fetch] = []
        total = 0
        while len(out) < self.cfg.batch_max_items and total < target:
            f = self.ctl.next_fetch(now)
            if f is None:
                break
            # a chunk cancelled earlier and handed to the link again (the controller moved its
            # step back): this fetch supersedes the cancellation, or it would be dropped unsent
            # and the chunk waited for forever
            self._cancelled.discard(f.cid)
            out.append(f)
            total += self.inst.bytes_of(f.cid, f.level)
            self._book(f)
            log = TransferLog(f.cid, f.level, self.inst.bytes_of(f.cid, f.level), now)
            self._transfers[f.cid] = log
            self._transfer_list.append(log)
        return out

    def _send(self, batch: list[Fetch]) -> _Request:
        assert self.source is not None
        items = [FetchItem(f.cid, f.level, self.inst.bytes_of(f.cid, f.level)) for f in batch]
        with self._cv:
            self._requests += 1
            if self._outstanding == 0:
                self._quiet_since = self.now()
            self._outstanding += 1
        task = asyncio.ensure_future(_within(self.source.open(items), self.cfg.open_timeout_s))
        return _Request(batch, task, self.now())

    def _finished_request(self) -> None:
        with self._cv:
            self._outstanding = max(0, self._outstanding - 1)
            if self._outstanding == 0:
                self._silence = 0.0

    async def _discard(self, req: _Request) -> None:
        """Abandons a request that will not be read (closing its response if it started)."""
        if not req.task.done():
            req.task.cancel()
        try:
            stream = await req.task
        except BaseException:  # noqa: BLE001 - cancelled or failed: nothing to close
            pass
        else:
            await _close(stream)
        self._finished_request()

    def _take_cancellations(self) -> None:
        with self._cv:
            for cid in self.ctl.take_cancellations():
                self._cancelled.add(cid)
                log = self._transfers.get(cid)
                if log is not None and log.status == TransferStatus.PENDING:
                    log.status = TransferStatus.CANCELLED

    def _abort(self, rest: Sequence[Fetch], partial: int) -> list[Fetch]:
        """Stops a response at a cancellation: the not-cancelled rest is requested again."""
        self._count(partial, 0)
        with self._cv:
            for x in rest:
                self._unbook(x)
        return [x for x in rest if x.cid not in self._cancelled]

    async def _read(self, req: _Request) -> list[Fetch]:
        """Reads one response; returns fetches to request again (after a cancellation)."""
        batch = req.batch
        try:
            stream = await req.task
        except SourceError as e:
            self._finished_request()
            raise _LinkFailure(e.reason, batch, e.fatal) from e
        except asyncio.TimeoutError as e:
            self._finished_request()
            raise _LinkFailure(f"no response within {self.cfg.open_timeout_s:g} s", batch) from e
        pieces = stream.__aiter__()
        i, data = 0, bytearray()
        remaining = sum(self.inst.bytes_of(f.cid, f.level) for f in batch)
        sample_bytes, sample_from = 0, None
        try:
            while i < len(batch):
                if not data:
                    # at a chunk boundary: stop where the next chunk was cancelled (the rest is
                    # requested again); a cancelled chunk further on is reached first (the
                    # chunks before it keep flowing: the controller cancels from the tail)
                    self._take_cancellations()
                    if batch[i].cid in self._cancelled:
                        return self._abort(batch[i:], 0)
                try:
                    piece = await _within(pieces.__anext__(), self.cfg.read_timeout_s)
                except StopAsyncIteration as e:
                    self._count(len(data), 0)
                    raise _LinkFailure(f"the response ended before {batch[i].cid}",
                                       batch[i:]) from e
                except asyncio.TimeoutError as e:
                    self._count(len(data), 0)
                    raise _LinkFailure(f"no byte for {self.cfg.read_timeout_s:g} s in "
                                       f"{batch[i].cid}", batch[i:]) from e
                except SourceError as e:
                    self._count(len(data), 0)
                    raise _LinkFailure(f"{e.reason} (in {batch[i].cid})", batch[i:],
                                       e.fatal) from e
                if piece.index != i:
                    raise _LinkFailure(f"the source sent item {piece.index} while {i} was due",
                                       batch[i:], fatal=True)
                f = batch[i]
                log = self._transfers[f.cid]
                now = self.now()
                if piece.data:
                    with self._cv:
                        self._quiet_since = now
                        self._silence = 0.0
                    if sample_from is None:
                        sample_from = now
                    if self._first_byte is None:
                        self._first_byte = now
                    if not data:
                        log.first_byte_s = now
                    data += piece.data
                    remaining -= len(piece.data)
                    self._last_byte = now
                    sample_bytes += len(piece.data)
                    if sample_from is not None and (now - sample_from >= self.cfg.sample_interval_s
                                                    or piece.end):
                        with self._cv:
                            self.ctl.rate_sample(now, sample_bytes, max(now - sample_from, 1e-6),
                                                 f.cid)
                        sample_bytes, sample_from = 0, now
                    # cancelled chunks further on will not be read: the next request opens
                    # an RTT before the last byte that will be
                    skip = (sum(self.inst.bytes_of(x.cid, x.level) for x in batch[i + 1:]
                                if x.cid in self._cancelled) if self._cancelled else 0)
                    self._maybe_prestart(remaining - skip)
                if piece.end:
                    self._count(len(data), 0)
                    with self._cv:
                        log.end_s = self.now()
                        log.status = TransferStatus.RECEIVED
                        self._unbook(f)
                        self._pending_decodes += 1
                        self.ctl.chunk_received(f.cid, log.end_s)
                    assert self._decoder is not None
                    self._decoder.submit(self._decode, f, bytes(data), log)
                    i, data = i + 1, bytearray()
                elif self.ctl.has_cancellations:
                    self._take_cancellations()
                    if f.cid in self._cancelled:   # the chunk being received: abort it now
                        return self._abort(batch[i:], len(data))
            return []
        finally:
            await _close(stream)
            self._finished_request()

    def _count(self, received: int, used: int) -> None:
        with self._cv:
            self._bytes_received += received
            self._bytes_used += used

    def _maybe_prestart(self, remaining: int) -> None:
        """Opens the next request when the current one has about an RTT of bytes left."""
        if self._prestarted is not None:
            return
        assert self.source is not None
        with self._cv:
            bw = self.ctl.bandwidth_estimate(self.now())
            if remaining / max(bw, 1.0) > self.source.rtt_s() + self.cfg.lead_s:
                return
            batch = self._pull_batch()
        if batch:
            self._prestarted = self._send(batch)

    # ---- decode path -------------------------------------------------------------------------
    def _to_device(self) -> "_DeviceCopier | None":
        """How decoded chunks reach a GPU memory: pinned staging + an asynchronous copy on a
        copy stream (``None`` on the CPU, and on unified memory where there is nothing to copy)."""
        if not hasattr(self, "_copier"):
            from sparkv.runtime.device import unified_memory

            dev = self.kv.device
            self._copier = (_DeviceCopier(dev) if dev.type == "cuda" and not unified_memory()
                            else None)
        return self._copier

    def _decode(self, f: Fetch, data: bytes, log: TransferLog) -> None:
        from sparkv.codec import CodecError, decode, decode_into, peek_header

        start = time.perf_counter()
        why = None
        try:
            frame = self.open_frame(data, f.cid, f.level) if self.open_frame else data
            copier = None if f.cid in self.kept else self._to_device()
            if f.cid in self.kept:
                chunk = decode(frame)
                got = chunk.id
                if got == f.cid:
                    why = self._put_kept(f.cid, chunk.k, chunk.v)
            elif copier is None:
                chunk = decode(frame)
                got, k, v = chunk.id, chunk.k, chunk.v
            else:
                hdr = peek_header(frame)
                k, v = copier.buffers(tuple(hdr.shape), self.kv.dtype)
                decode_into(frame, k, v)
                got = hdr.chunk_id
            if got != f.cid:
                why = f"frame names {got}, expected {f.cid}"
            elif f.cid in self.kept:
                pass
            elif copier is None:
                self.kv.put(f.cid, k, v, source="streamed", overwrite=False)
            else:
                copier.put(self.kv, f.cid, k, v)
        except CodecError as e:
            why = f"bad frame: {e}"
        except Exception as e:  # noqa: BLE001 - decryption, layout: recompute locally
            why = f"{type(e).__name__}: {e}"
        with self._cv:
            self._decode_busy += time.perf_counter() - start
            self._pending_decodes -= 1
            log.decoded_s = self.now()
            if why is None:
                log.status = TransferStatus.ARRIVED
                self._bytes_used += len(data)
                self.ctl.chunk_arrived(f.cid, log.decoded_s)
            else:
                log.status = TransferStatus.FAILED
                self._failed[f.cid] = why.split(":")[0]
                self._link_errors.append(f"{f.cid}: {why}")
            self._progress()


    def _put_kept(self, cid: KVChunkId, k: Any, v: Any) -> str | None:
        """A compressed chunk's decoded rows into the KV memory as a payload with the manifest's
        counts and positions; returns why it cannot be used, or ``None``."""
        import torch

        from sparkv.cache import ChunkPayload

        counts, pos = self.kept[cid]
        rows = int(sum(counts))
        want = (1, max(rows, 1), self.kv.geometry.head_dim)
        if tuple(k.shape) != want:
            return f"layout: the frame holds {tuple(k.shape)} values, the manifest keeps {want}"
        if self.kv.has(cid):       # computed locally first: the whole chunk stays (pruned later)
            return None
        positions = (torch.cat([torch.as_tensor(p, dtype=torch.int32) for p in pos])
                     if pos else torch.zeros(0, dtype=torch.int32))
        dev, dt = self.kv.device, self.kv.dtype
        payload = ChunkPayload(cid, "fp", [int(c) for c in counts], positions.to(dev),
                               k[0, :rows].to(device=dev, dtype=dt).contiguous(),
                               v[0, :rows].to(device=dev, dtype=dt).contiguous(), dt)
        self.kv.put_payload(payload, source="streamed")
        return None


async def _close(stream: ChunkStream) -> None:
    try:
        await stream.aclose()
    except Exception:  # noqa: BLE001 - the response is abandoned either way
        pass


class _DeviceCopier:
    """Decoded chunks into GPU memory: the decode worker decodes into pinned host buffers and
    copies them with one asynchronous copy on its own CUDA stream, which it waits for before the
    chunk is reported (the compute thread's kernels keep running meanwhile)."""

    def __init__(self, device: Any) -> None:
        import torch

        self.torch = torch
        self.stream = torch.cuda.Stream(device=device)
        self._pool: dict[tuple[tuple[int, ...], Any], tuple[Any, Any]] = {}

    def buffers(self, shape: tuple[int, ...], dtype: Any) -> tuple[Any, Any]:
        key = (shape, dtype)
        if key not in self._pool:
            mk = self.torch.empty
            self._pool[key] = (mk(shape, dtype=dtype, pin_memory=True),
                               mk(shape, dtype=dtype, pin_memory=True))
        return self._pool[key]

    def put(self, kv: Any, cid: KVChunkId, k: Any, v: Any) -> None:
        with self.torch.cuda.stream(self.stream):
            kv.put(cid, k, v, source="streamed", overwrite=False, non_blocking=True)
        self.stream.synchronize()       # the pinned buffers are reused by the next chunk
