"""The overlap engine: streams KV chunks while computing layer steps, under a runtime controller.

Threads (docs/edge.md):

* **compute thread**: asks the :class:`~sparkv.scheduler.controller.Controller` for the next layer
  step, runs it with :class:`~sparkv.runtime.stepper.LayerStepper` (PyTorch releases the GIL in its
  kernels), reports ``step_done``;
* **link thread**: an asyncio loop with one aiohttp keep-alive session. It pulls fetches from the
  controller in small batches (about ``batch_seconds`` of link time each) and reads each batch as
  one ``POST /v1/contexts/{id}/stream`` response, frame by frame, through the
  :class:`~sparkv.edge.shaper.LinkShaper`. The next batch's request is sent one RTT before the
  current one drains (no idle round trip between batches). Rate samples go to the controller every
  ``sample_interval_s`` while bytes flow; cancelled chunks abort the response at once and the rest
  of the batch is requested again;
* **decode worker** (a one-thread pool): checksums, decrypts and decodes a received frame straight
  into the KV buffers, then reports ``chunk_arrived``. Decoding never runs on the compute thread.

The controller is not thread-safe; every call to it holds the engine's lock.

Faults never lose the answer: a frame that fails its checksum (or does not decode) is recomputed
locally; a request that fails (connection refused or reset, 5xx, a cut stream, a stall) is retried
``retries`` times, then the link is declared dead and the compute thread computes everything still
missing (:meth:`LayerStepper.steps_needed`). A safety net does the same when neither path has made
progress for ``stall_fallback_s``. :class:`LoadResult.fallback` says what fell back and why.
"""

from __future__ import annotations

import asyncio
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from sparkv.errors import SparkvError
from sparkv.layout import KVChunkId, StepId
from sparkv.runtime.kvcache import KVBuffers
from sparkv.runtime.stepper import LayerStepper
from sparkv.scheduler.controller import Controller, ControllerConfig, Fetch
from sparkv.scheduler.instance import Instance
from sparkv.scheduler.plan import Plan

_U32 = struct.Struct("<I")


class EngineError(SparkvError):
    """The engine could not assemble the cache (a bug or an unrecoverable local failure)."""


@dataclass
class EngineConfig:
    """Knobs of the engine's two paths."""

    batch_seconds: float = 0.25      # link time per stream request at the estimated rate
    batch_min_bytes: int = 256 << 10
    batch_max_items: int = 64
    lead_s: float = 0.02             # send the next request this long (+ RTT) before a batch drains
    read_bytes: int = 64 << 10       # socket read size (and shaping granularity)
    sample_interval_s: float = 0.05  # rate samples to the controller while bytes flow
    retries: int = 2                 # failed requests retried before the link is declared dead
    retry_backoff_s: float = 0.05
    connect_timeout_s: float = 3.0
    stall_timeout_s: float = 10.0    # no byte for this long: the request failed
    stall_fallback_s: float = 1.0    # compute idle and no byte for this long: compute the rest
    decode_workers: int = 1


@dataclass
class TransferLog:
    """One streamed chunk (times in seconds from the start of loading)."""

    cid: KVChunkId
    level: str
    nbytes: int
    requested_s: float
    first_byte_s: float = float("nan")
    end_s: float = float("nan")
    decoded_s: float = float("nan")
    status: str = "pending"   # pending | received | arrived | cancelled | failed | lost

    def to_list(self) -> list[Any]:
        return [self.cid.t, self.cid.l, self.cid.g, self.level, self.nbytes, self.requested_s,
                self.first_byte_s, self.end_s, self.decoded_s, self.status]


@dataclass
class LoadResult:
    """What loading one context did. Times in seconds from the start of loading."""

    ready_s: float
    steps: dict[StepId, tuple[float, float]]
    transfers: list[TransferLog]
    compute_busy_s: float
    decode_busy_s: float
    link_active_s: float          # first response byte to last byte (0 when nothing streamed)
    bytes_streamed: int           # bytes of chunks that arrived (were used)
    bytes_received: int           # every body byte read, including wasted ones
    requests: int
    migrations: list[Any]
    sources: dict[str, int]       # "streamed" / "computed" -> chunks
    fallback: dict[str, Any]      # reason -> details (empty when nothing fell back)
    link_errors: list[str]
    kv: KVBuffers = field(repr=False)

    @property
    def bytes_wasted(self) -> int:
        return max(0, self.bytes_received - self.bytes_streamed)

    @property
    def measured_Bps(self) -> float | None:  # noqa: N802
        return self.bytes_received / self.link_active_s if self.link_active_s > 0 else None

    def timeline(self) -> dict[str, Any]:
        """JSON form (steps as ``[t, l, start, end]``, transfers as lists; see TransferLog)."""
        return {"ready_s": self.ready_s,
                "steps": [[s.t, s.l, a, b] for s, (a, b) in sorted(self.steps.items(),
                                                                   key=lambda x: x[1][0])],
                "transfers": [x.to_list() for x in self.transfers],
                "migrations": [m.to_dict() for m in self.migrations]}


class _LinkFailure(Exception):
    """A request failed; ``unreceived`` are the fetches of it that never arrived."""

    def __init__(self, reason: str, unreceived: Sequence[Fetch], fatal: bool = False) -> None:
        super().__init__(reason)
        self.reason, self.unreceived, self.fatal = reason, list(unreceived), fatal


@dataclass
class _Request:
    batch: list[Fetch]
    task: "asyncio.Task[Any]"
    sent_s: float


class Engine:
    """Loads one context's KV cache by ``plan`` (see the module docstring).

    Args:
        stepper: the layer stepper over the context's tokens (its buffers receive everything).
        plan, inst: what to do, and the cost model it was made with.
        controller: the controller's configuration (``ControllerConfig.static()``: the plan as is).
        server_url, headers, context_id: where the chunks come from (unused for a local plan).
        shaper: the link emulation every body byte passes through.
        open_frame: decrypts a stored frame (encrypted contexts): ``(data, cid, level) -> frame``.
    """

    def __init__(self, stepper: LayerStepper, plan: Plan, inst: Instance,
                 controller: ControllerConfig | None = None, *, server_url: str = "",
                 headers: dict[str, str] | None = None, context_id: str = "",
                 shaper: Any = None, config: EngineConfig | None = None,
                 open_frame: Callable[[bytes, KVChunkId, str], bytes] | None = None) -> None:
        from sparkv.edge.shaper import LinkShaper
        if stepper.geometry != inst.geometry:
            raise EngineError("the stepper and the instance have different geometries")
        self.stepper, self.kv = stepper, stepper.kv
        self.plan, self.inst = plan, inst
        self.cfg = config or EngineConfig()
        self.ctl = Controller(plan, inst, controller or ControllerConfig())
        self.server_url = server_url.rstrip("/")
        self.headers = dict(headers or {})
        self.context_id = context_id
        self.shaper = shaper or LinkShaper.unlimited()
        self.open_frame = open_frame
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
        self._last_progress = 0.0
        self._stalled = False
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._link_task: asyncio.Task[Any] | None = None
        self._prestarted: _Request | None = None
        self._ready_s = 0.0
        self._decoder: ThreadPoolExecutor | None = None
        self._compute_threads = 1

    # ---- time and events ---------------------------------------------------------------------
    def now(self) -> float:
        return time.perf_counter() - self._t0

    def _progress(self) -> None:
        self._last_progress = self.now()
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
        self._t0 = time.perf_counter()
        self.shaper.start()
        with self._cv:
            self.ctl.start(0.0)
        streams = bool(self.plan.stream_order)
        import torch

        threads = torch.get_num_threads()
        # OpenMP thread counts are per calling thread: the compute thread gets the caller's, the
        # decode worker one (its dequantisation must not oversubscribe the cores the layer steps
        # use: measured, 4 OpenMP threads on 2 cores made decoding 5x slower and stalled steps)
        self._compute_threads = threads
        decoder = ThreadPoolExecutor(max_workers=self.cfg.decode_workers,
                                     thread_name_prefix="sparkv-decode",
                                     initializer=torch.set_num_threads, initargs=(1,))
        self._decoder = decoder
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
        return self._result(self._ready_s)

    def _result(self, ready: float) -> LoadResult:
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
        if self._stalled:
            fallback["stalled"] = True
        if self._fallback_steps:
            fallback["steps_computed"] = len(self._fallback_steps)
        link_active = (self._last_byte - self._first_byte) if self._first_byte is not None else 0.0
        return LoadResult(
            ready_s=ready, steps=dict(self._steps), transfers=list(self._transfer_list),
            compute_busy_s=self._compute_busy, decode_busy_s=self._decode_busy,
            link_active_s=link_active, bytes_streamed=self._bytes_used,
            bytes_received=self._bytes_received, requests=self._requests,
            migrations=list(self.ctl.migrations), sources=counts, fallback=fallback,
            link_errors=list(self._link_errors), kv=self.kv)

    # ---- compute path ------------------------------------------------------------------------
    def _compute_main(self) -> None:
        try:
            import torch

            torch.set_num_threads(self._compute_threads)
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
                    and self.now() - max(self._last_progress, self._last_byte)
                    > self.cfg.stall_fallback_s):
                # the compute thread has nothing to do and not one byte has arrived for a while
                # (a link that collapsed with data stuck in its queues, a hung server): compute
                # what is missing; the link keeps going and whichever path is first wins
                self._stalled = True
                continue
            self._cv.wait(0.05)

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

    # ---- link path ---------------------------------------------------------------------------
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
        import aiohttp

        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._link_task = asyncio.current_task()
        if self._finished.is_set():
            return
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout_s,
                                        sock_read=self.cfg.stall_timeout_s)
        headers = {**self.headers, "Accept-Encoding": "identity"}
        connector = aiohttp.TCPConnector(limit=4, force_close=False)
        try:
            async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector,
                                             auto_decompress=False) as session:
                await self._link_loop(session)
        except asyncio.CancelledError:
            pass
        finally:
            if self._prestarted is not None:
                self._prestarted.task.cancel()

    async def _link_loop(self, session: Any) -> None:
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
                    self._wake.clear()  # type: ignore[union-attr]
                    try:
                        await asyncio.wait_for(self._wake.wait(), 0.05)  # type: ignore[union-attr]
                    except asyncio.TimeoutError:
                        pass
                    continue
                req = self._send(session, batch)
            try:
                # a prestarted request is read first; fetches left over from an earlier batch
                # (after a cancellation) wait for the next request
                leftover = leftover + await self._read(session, req)
                failures = 0
            except _LinkFailure as e:
                failures += 1
                nxt = self._prestarted
                self._prestarted = None
                if nxt is not None:
                    nxt.task.cancel()
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
                            if log is not None and log.status == "pending":
                                log.status = "lost"
                        self._progress()
                        return
                await asyncio.sleep(self.cfg.retry_backoff_s * (2 ** (failures - 1)))

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
            out.append(f)
            total += self.inst.bytes_of(f.cid, f.level)
            self._book(f)
            log = TransferLog(f.cid, f.level, self.inst.bytes_of(f.cid, f.level), now)
            self._transfers[f.cid] = log
            self._transfer_list.append(log)
        return out

    def _send(self, session: Any, batch: list[Fetch]) -> _Request:
        body = {"chunks": [{"t": f.cid.t, "l": f.cid.l, "g": f.cid.g, "level": f.level}
                           for f in batch]}
        url = f"{self.server_url}/v1/contexts/{self.context_id}/stream"
        not_before = self.shaper.request_started()
        self._requests += 1

        async def go() -> tuple[Any, float]:
            resp = await session.post(url, json=body)
            return resp, not_before

        return _Request(batch, asyncio.ensure_future(go()), self.now())

    def _take_cancellations(self) -> None:
        with self._cv:
            for cid in self.ctl.take_cancellations():
                self._cancelled.add(cid)
                log = self._transfers.get(cid)
                if log is not None and log.status == "pending":
                    log.status = "cancelled"

    async def _read(self, session: Any, req: _Request) -> list[Fetch]:
        """Reads one stream response; returns fetches to request again (after a cancellation)."""
        import aiohttp

        batch = req.batch
        try:
            resp, not_before = await req.task
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
            raise _LinkFailure(f"request failed: {type(e).__name__}: {e}", batch) from e
        try:
            if resp.status != 200:
                try:
                    body = await resp.read()
                except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                    body = b""
                from sparkv.edge.client import error_from_response
                err = error_from_response(resp.status, body)
                raise _LinkFailure(str(err), batch, fatal=resp.status < 500)
            remaining = sum(self.inst.bytes_of(f.cid, f.level) for f in batch)
            sample_bytes, sample_from = 0, None
            for i, f in enumerate(batch):
                self._take_cancellations()
                if any(x.cid in self._cancelled for x in batch[i:]):
                    resp.close()
                    with self._cv:
                        for x in batch[i:]:
                            self._unbook(x)
                    return [x for x in batch[i:] if x.cid not in self._cancelled]
                size = self.inst.bytes_of(f.cid, f.level)
                try:
                    head = await resp.content.readexactly(4)
                except (asyncio.IncompleteReadError, aiohttp.ClientError, OSError,
                        asyncio.TimeoutError) as e:
                    raise _LinkFailure(f"stream cut before {f.cid} ({type(e).__name__})",
                                       batch[i:]) from e
                await self.shaper.atake(4, not_before)
                (n,) = _U32.unpack(head)
                if n != size:
                    raise _LinkFailure(f"stream record for {f.cid} has {n} bytes, the manifest "
                                       f"says {size}", batch[i:], fatal=True)
                log = self._transfers[f.cid]
                data = bytearray()
                while len(data) < n:
                    try:
                        piece = await resp.content.read(min(self.cfg.read_bytes, n - len(data)))
                    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
                        self._count(len(data), 0)
                        raise _LinkFailure(f"stream failed in {f.cid}: {type(e).__name__}: {e}",
                                           batch[i:]) from e
                    if not piece:
                        self._count(len(data), 0)
                        raise _LinkFailure(f"stream cut in {f.cid} (server closed the "
                                           f"connection)", batch[i:])
                    await self.shaper.atake(len(piece), not_before)
                    now = self.now()
                    if sample_from is None:
                        sample_from = now
                        if self._first_byte is None:
                            self._first_byte = now
                    if not data:
                        log.first_byte_s = now
                    data += piece
                    remaining -= len(piece)
                    self._last_byte = now
                    sample_bytes += len(piece)
                    if now - sample_from >= self.cfg.sample_interval_s or len(data) == n:
                        with self._cv:
                            self.ctl.rate_sample(now, sample_bytes, now - sample_from, f.cid)
                        sample_bytes, sample_from = 0, now
                    self._maybe_prestart(session, remaining)
                    if len(data) < n and self.ctl.has_cancellations:
                        self._take_cancellations()
                        if f.cid in self._cancelled:   # the chunk being received: abort it now
                            resp.close()
                            self._count(len(data), 0)
                            with self._cv:
                                for x in batch[i:]:
                                    self._unbook(x)
                            return [x for x in batch[i + 1:] if x.cid not in self._cancelled]
                self._count(n, 0)
                with self._cv:
                    log.end_s = self.now()
                    log.status = "received"
                    self._unbook(f)
                    self._pending_decodes += 1
                    self.ctl.chunk_received(f.cid, log.end_s)
                assert self._decoder is not None
                self._decoder.submit(self._decode, f, bytes(data), log)
            return []
        finally:
            resp.release()

    def _count(self, received: int, used: int) -> None:
        with self._cv:
            self._bytes_received += received
            self._bytes_used += used

    def _maybe_prestart(self, session: Any, remaining: int) -> None:
        """Sends the next request when the current one has about an RTT of bytes left."""
        if self._prestarted is not None:
            return
        with self._cv:
            bw = self.ctl.bandwidth_estimate(self.now())
            if remaining / max(bw, 1.0) > self.shaper.rtt() + self.cfg.lead_s:
                return
            batch = self._pull_batch()
        if batch:
            self._prestarted = self._send(session, batch)

    # ---- decode path -------------------------------------------------------------------------
    def _decode(self, f: Fetch, data: bytes, log: TransferLog) -> None:
        from sparkv.codec import CodecError, decode

        start = time.perf_counter()
        why = None
        try:
            frame = self.open_frame(data, f.cid, f.level) if self.open_frame else data
            chunk = decode(frame)
            if chunk.id != f.cid:
                why = f"frame names {chunk.id}, expected {f.cid}"
            else:
                self.kv.put(f.cid, chunk.k, chunk.v, source="streamed", overwrite=False)
        except CodecError as e:
            why = f"bad frame: {e}"
        except Exception as e:  # noqa: BLE001 - decryption, layout: recompute locally
            why = f"{type(e).__name__}: {e}"
        with self._cv:
            self._decode_busy += time.perf_counter() - start
            self._pending_decodes -= 1
            log.decoded_s = self.now()
            if why is None:
                log.status = "arrived"
                self._bytes_used += len(data)
                self.ctl.chunk_arrived(f.cid, log.decoded_s)
            else:
                log.status = "failed"
                self._failed[f.cid] = why.split(":")[0]
                self._link_errors.append(f"{f.cid}: {why}")
            self._progress()
