"""The engine's link path: an asyncio loop on its own thread that pulls fetches from the controller
in small batches, opens each batch on a :class:`~sparkv.edge.transport.ChunkSource`, reads its
frames piece by piece and hands each whole frame to the decode workers.

* a batch is about ``batch_seconds`` of link time at the controller's estimated rate; the next
  one is opened one RTT before the current one drains (no idle round trip between batches);
* rate samples go to the controller every ``sample_interval_s`` while bytes flow, and a ticker
  reports *silence* (zero-byte samples) while a request is outstanding and nothing arrives
  beyond the expected first-byte delay;
* a cancelled chunk aborts the response at once and the rest of the batch is requested again;
* a failed request (refused, reset or cut, a 5xx, no response within ``open_timeout_s``, no
  byte within ``read_timeout_s``) is retried ``retries`` times; then the link is declared dead;
* under a device service, a request is sent only on the ask's turn
  (:meth:`Lane.link_turn <sparkv.edge.lane.Lane.link_turn>`, the service's link plan); while it
  waits for its turn with work queued the link counts as busy (not idle, not silent).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Sequence

from sparkv.cache import ContextKV
from sparkv.edge.frames import FrameDecoder
from sparkv.edge.hub import EngineConfig, Hub
from sparkv.edge.lane import Lane
from sparkv.edge.stats import EngineStats
from sparkv.edge.transport import ChunkSource, ChunkStream, FetchItem, SourceError
from sparkv.edge.wire import within
from sparkv.layout import KVChunkId
from sparkv.protocol.stream import RecordPiece
from sparkv.scheduler.controller import Fetch
from sparkv.scheduler.instance import Instance

WAIT_S = 0.05
"""How long the link loop waits for work (or a wake-up) before it asks the controller again."""


class _LinkFailure(Exception):
    """A request failed; ``unreceived`` are the fetches of it that never arrived; ``refused``:
    the source refused this client's credentials (:class:`SourceError`)."""

    def __init__(self, reason: str, unreceived: Sequence[Fetch], fatal: bool = False,
                 refused: Exception | None = None) -> None:
        super().__init__(reason)
        self.reason, self.unreceived, self.fatal = reason, list(unreceived), fatal
        self.refused = refused


@dataclass
class _Request:
    batch: list[Fetch]
    task: "asyncio.Future[ChunkStream]"
    idle: bool = False                # sent while no other request was outstanding


class _Reading:
    """Where the reading of one response stands (the link thread's own)."""

    def __init__(self, batch: list[Fetch], nbytes: int, idle: bool) -> None:
        self.batch, self.idle = batch, idle
        self.i = 0                    # the chunk being received
        self.parts: list[bytes] = []  # what has arrived of it (joined once, at its end)
        self.got = 0                  # its bytes so far
        self.remaining = nbytes       # bytes of the batch not yet read
        self.sample_bytes = 0         # bytes since the last rate sample
        self.sample_from: float | None = None
        self.unreported = 0           # bytes of the chunk being received not yet reported

    @property
    def fetch(self) -> Fetch:
        return self.batch[self.i]

    @property
    def rest(self) -> list[Fetch]:
        return self.batch[self.i:]

    @property
    def done(self) -> bool:
        return self.i >= len(self.batch)


async def _close(stream: ChunkStream) -> None:
    try:
        await stream.aclose()
    except Exception:  # noqa: BLE001 - the response is abandoned either way
        pass


class Link:
    """The link thread (``sparkv-link``) of one load: an asyncio loop over ``source``.

    State and lock discipline:

    * ``_outstanding`` (requests sent whose responses are not finished), ``_quiet_since`` (the
      last byte, or when the link began waiting) and ``_silence`` (credited silence since the
      last byte, seconds): written by the link thread (its reader and its ticker) under the
      engine's lock; the compute worker reads the first and the last under the lock
      (:meth:`busy`, :attr:`silence_s`);
    * ``_prestarted`` (the request opened before the current one drains): the link thread's;
      the compute worker only reads whether it is set (:meth:`busy`, under the lock);
    * ``_cancelled`` (chunks the controller took back), the loop, its wake event and its task,
      and every :class:`_Reading`: the link thread's own;
    * every call to the controller, every write to :class:`EngineStats`, and
      :meth:`FrameDecoder.submit` hold the engine's lock.

    Waits: on its wake event (at most :data:`WAIT_S`) when there is nothing to fetch; the
    event is set by :meth:`Hub.progress <sparkv.edge.hub.Hub.progress>` (registered with
    :meth:`Hub.on_progress`). Notifies: the ticker ``notify_all``\\ s the engine's lock on every
    credited silence (the compute worker's stall rule may fire), and a dead link calls
    :meth:`Hub.progress`.
    """

    def __init__(self, hub: Hub, source: ChunkSource, inst: Instance, kv: ContextKV,
                 stats: EngineStats, decoder: FrameDecoder, cfg: EngineConfig,
                 lane: Lane | None = None) -> None:
        self._hub, self._source, self._inst, self._kv = hub, source, inst, kv
        self._stats, self._decoder, self._cfg = stats, decoder, cfg
        self._lane = lane
        self._awaiting_turn = False   # work queued, waiting for the ask's turn on the link
        self._outstanding = 0
        self._quiet_since = 0.0
        self._silence = 0.0
        self._silent_until = 0.0      # the end of the last silence the ticker reported
        self._cancelled: set[KVChunkId] = set()
        self._prestarted: _Request | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._task: "asyncio.Task[Any] | None" = None
        self._closing = False         # the loop is releasing its requests and connections
        self._finished = threading.Event()
        self._thread = threading.Thread(target=self._main, name="sparkv-link", daemon=True)
        hub.on_progress(self.wake)

    # ---- the coordinator's side --------------------------------------------------------------
    def connect(self) -> None:
        """Starts the source (its clock, e.g. a shaped link's trace, starts with the load)."""
        self._source.start()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ends the loop (whatever it is doing, unless it is already closing: a close runs to
        its end, or a connection it was releasing would be left open); :meth:`join` waits for
        it."""
        self._finished.set()
        self._in_loop(self._cancel_unless_closing)

    def _cancel_unless_closing(self) -> None:
        """On the loop: cancels its task, unless the task is in its close."""
        task = self._task
        if task is not None and not self._closing:
            task.cancel()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout=timeout)

    def wake(self) -> None:
        """From any thread, holding the engine's lock (:meth:`Hub.progress
        <sparkv.edge.hub.Hub.progress>`, after every compute call): the loop looks for work
        now, when the controller queued some for the link (or, under a device service, the
        ask's turn may have come). An idle link otherwise looks every :data:`WAIT_S` (where
        the controller may offer it a probe): a wake-up of the link thread per compute call,
        each a call into the controller under the lock, preempted one of the steps' OpenMP
        team every time (docs/edge.md, "The receive path")."""
        wake = self._wake
        if wake is not None and (self._lane is not None or self._hub.ctl.state.link.order):
            self._in_loop(wake.set)

    def _in_loop(self, fn: Callable[[], object]) -> None:
        """From any thread: ``fn()`` on the loop, if it still runs."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn)
            except RuntimeError:  # loop closed meanwhile
                pass

    # ---- the compute worker's side (under the engine's lock) ---------------------------------
    @property
    def silence_s(self) -> float:
        """Credited silence since the last byte (seconds)."""
        return self._silence

    def busy(self) -> bool:
        """Whether a request is outstanding (or opened ahead), or work waits for the ask's
        turn on the link."""
        return bool(self._outstanding) or self._prestarted is not None or self._awaiting_turn

    # ---- the loop ----------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as e:  # noqa: BLE001 - any link bug falls back to local compute
            if isinstance(e, asyncio.CancelledError) and self._finished.is_set():
                return   # a stop that reached the loop while it closed: the ask ended, no error
            stats = self._stats
            with self._hub.cv:
                if stats.link_dead is None:
                    stats.link_dead = f"link error: {type(e).__name__}: {e}"
                stats.link_errors.append(stats.link_dead)
                self._hub.cv.notify_all()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._task = asyncio.current_task()
        if self._finished.is_set():
            return
        ticker = asyncio.ensure_future(self._ticker())
        try:
            await self._request_batches()
        except asyncio.CancelledError:
            pass
        finally:
            self._closing = True
            ticker.cancel()
            if self._prestarted is not None:
                await self._discard(self._prestarted)
            try:
                await self._source.aclose()
            except Exception:  # noqa: BLE001 - closing must not mask the result
                pass

    async def _ticker(self) -> None:
        """Reports silence: while a request is outstanding and no byte arrives beyond the
        expected first-byte delay, each tick credits the time the loop was awake to see it
        (at most two intervals per tick: a late tick means this process was starved, and a
        starved reader says nothing about the link) and sends a zero-byte rate sample."""
        interval = self._cfg.sample_interval_s
        loop = asyncio.get_running_loop()
        hub = self._hub
        last = loop.time()
        while not self._finished.is_set():
            await asyncio.sleep(interval)
            t = loop.time()
            credit, last = min(t - last, 2 * interval), t
            grace = max(self._cfg.silence_grace_s, 3 * self._source.rtt_s())
            with hub.cv:
                if self._outstanding and hub.now() - self._quiet_since > grace:
                    self._silence += credit
                    self._stats.silence_s += credit
                    self._silent_until = hub.now()
                    hub.ctl.rate_sample(self._silent_until, 0.0, credit)
                    hub.cv.notify_all()

    async def _request_batches(self) -> None:
        """Requests and reads batches until stopped, or until the link is dead."""
        leftover: list[Fetch] = []
        failures = 0
        while not self._finished.is_set():
            req, leftover = self._next_request(leftover)
            if req is None:
                await self._wait_for_work()
                continue
            try:
                leftover = leftover + await self._read(req)
                failures = 0
            except _LinkFailure as e:
                failures += 1
                leftover = await self._after_failure(e, leftover)
                if e.fatal or failures > self._cfg.retries:
                    self._die(e.reason, leftover, e.refused)
                    return
                await asyncio.sleep(self._cfg.retry_backoff_s * (2 ** (failures - 1)))

    def _next_request(self, leftover: list[Fetch]) -> tuple[_Request | None, list[Fetch]]:
        """The request to read next, and the fetches still left over: a prestarted request is
        read first (``leftover``, fetches left from an earlier batch after a cancellation, wait
        for the next request); else a request for ``leftover`` still wanted, or for the next
        batch (``None`` when there is nothing to fetch)."""
        req, self._prestarted = self._prestarted, None
        if req is not None:
            return req, leftover
        with self._hub.cv:
            batch = [f for f in leftover if not self._done_or_cancelled(f.cid)]
            if not self._my_turn(bool(batch)):
                return None, batch
            if not batch:
                batch = self._pull_batch()
        return (self._send(batch) if batch else None), []

    def _my_turn(self, leftover: bool) -> bool:
        """Under the lock: whether the ask may send a request now (always, alone). Waiting for
        its turn with work queued marks the link busy, so the idle rule does not fire."""
        if self._lane is None:
            return True
        link = self._hub.ctl.state.link
        pending = 0.0 if self._stats.link_given_up else link.pending_bytes()
        go = self._lane.link_turn(pending).go
        self._awaiting_turn = not go and (leftover or bool(link.order))
        return go

    async def _wait_for_work(self) -> None:
        assert self._wake is not None
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), WAIT_S)
        except asyncio.TimeoutError:
            pass

    async def _after_failure(self, e: _LinkFailure, leftover: list[Fetch]) -> list[Fetch]:
        """After a failed request: drops the prestarted one too; returns the fetches to request
        again."""
        nxt, self._prestarted = self._prestarted, None
        if nxt is not None:
            await self._discard(nxt)
        with self._hub.cv:
            self._stats.link_errors.append(e.reason)
        return leftover + e.unreceived + (nxt.batch if nxt is not None else [])

    def _die(self, reason: str, leftover: list[Fetch], refused: Exception | None = None) -> None:
        """Declares the link dead: the compute worker computes everything missing, or, when the
        source ``refused`` this client's credentials, ends the load with that error."""
        with self._hub.cv:
            self._stats.link_dead = reason
            self._stats.refused = refused
            self._stats.lost(leftover)
            self._hub.progress()

    # ---- requests ----------------------------------------------------------------------------
    def _bytes_of(self, f: Fetch) -> int:
        return self._inst.bytes_of(f.cid, f.level)

    def _done_or_cancelled(self, cid: KVChunkId) -> bool:
        return cid in self._cancelled or self._kv.has(cid)

    def _pull_batch(self) -> list[Fetch]:
        """Under the lock: the next fetches from the controller, about ``batch_seconds`` worth."""
        ctl, cfg = self._hub.ctl, self._cfg
        now = self._hub.now()
        target = max(cfg.batch_min_bytes, ctl.bandwidth_estimate(now) * cfg.batch_seconds)
        out: list[Fetch] = []
        total = 0
        while len(out) < cfg.batch_max_items and total < target:
            f = ctl.next_fetch(now)
            if f is None:
                break
            # a chunk cancelled earlier and handed to the link again (the controller moved its
            # step back): this fetch supersedes the cancellation, or it would be dropped unsent
            # and the chunk waited for forever
            self._cancelled.discard(f.cid)
            out.append(f)
            total += self._bytes_of(f)
            self._stats.requested(f, self._bytes_of(f), now)
        return out

    def _send(self, batch: list[Fetch]) -> _Request:
        items = [FetchItem(f.cid, f.level, self._bytes_of(f)) for f in batch]
        hub = self._hub
        with hub.cv:
            self._stats.requests += 1
            idle = self._outstanding == 0
            if idle:
                self._quiet_since = hub.now()
            self._outstanding += 1
        task = asyncio.ensure_future(within(self._source.open(items), self._cfg.open_timeout_s))
        return _Request(batch, task, idle)

    def _finished_request(self) -> None:
        with self._hub.cv:
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

    def _maybe_prestart(self, remaining: int) -> None:
        """Opens the next request when the current one has about an RTT of bytes left."""
        if self._prestarted is not None:
            return
        hub = self._hub
        with hub.cv:
            bw = hub.ctl.bandwidth_estimate(hub.now())
            if remaining / max(bw, 1.0) > self._source.rtt_s() + self._cfg.lead_s:
                return
            if not self._my_turn(False):
                return
            batch = self._pull_batch()
        if batch:
            self._prestarted = self._send(batch)

    # ---- cancellations -----------------------------------------------------------------------
    def _take_cancellations(self) -> None:
        with self._hub.cv:
            for cid in self._hub.ctl.take_cancellations():
                self._cancelled.add(cid)
                self._stats.cancelled(cid)

    def _abort(self, r: _Reading) -> list[Fetch]:
        """Stops a response at a cancellation (what arrived of the chunk being received is
        wasted): the not-cancelled rest is requested again."""
        self._count(r.got, 0)
        return [x for x in r.rest if x.cid not in self._cancelled]

    # ---- reading a response ------------------------------------------------------------------
    async def _read(self, req: _Request) -> list[Fetch]:
        """Reads one response; returns fetches to request again (after a cancellation)."""
        stream = await self._response(req)
        pieces = stream.__aiter__()
        r = _Reading(req.batch, sum(self._bytes_of(f) for f in req.batch), req.idle)
        try:
            while not r.done:
                if not r.got:
                    # at a chunk boundary: stop where the next chunk was cancelled (the rest is
                    # requested again); a cancelled chunk further on is reached first (the
                    # chunks before it keep flowing: the controller cancels from the tail)
                    self._take_cancellations()
                    if r.fetch.cid in self._cancelled:
                        return self._abort(r)
                piece = await self._next_piece(pieces, r)
                if piece.data:
                    self._took(r, piece)
                if piece.end:
                    self._chunk_read(r)
                elif self._hub.ctl.has_cancellations:   # a peek; the take holds the lock
                    self._take_cancellations()
                    if r.fetch.cid in self._cancelled:   # the chunk being received: abort it
                        return self._abort(r)
            return []
        finally:
            await _close(stream)
            self._finished_request()

    async def _response(self, req: _Request) -> ChunkStream:
        """The opened response of ``req`` (a request that failed to open is finished here)."""
        try:
            return await req.task
        except SourceError as e:
            self._finished_request()
            raise _LinkFailure(e.reason, req.batch, e.fatal, e.refused) from e
        except asyncio.TimeoutError as e:
            self._finished_request()
            raise _LinkFailure(f"no response within {self._cfg.open_timeout_s:g} s",
                               req.batch) from e

    async def _next_piece(self, pieces: AsyncIterator[RecordPiece], r: _Reading) -> RecordPiece:
        """The response's next piece, which must belong to the chunk being received; a failure
        counts the bytes that arrived of that chunk as received (wasted)."""
        cid = r.fetch.cid
        try:
            piece = await within(pieces.__anext__(), self._cfg.read_timeout_s)
        except StopAsyncIteration as e:
            self._count(r.got, 0)
            raise _LinkFailure(f"the response ended before {cid}", r.rest) from e
        except asyncio.TimeoutError as e:
            self._count(r.got, 0)
            raise _LinkFailure(f"no byte for {self._cfg.read_timeout_s:g} s in {cid}",
                               r.rest) from e
        except SourceError as e:
            self._count(r.got, 0)
            raise _LinkFailure(f"{e.reason} (in {cid})", r.rest, e.fatal, e.refused) from e
        if piece.index != r.i:
            raise _LinkFailure(f"the source sent item {piece.index} while {r.i} was due",
                               r.rest, fatal=True)
        return piece

    def _took(self, r: _Reading, piece: RecordPiece) -> None:
        """Bytes of the chunk being received: the silence ends, the controller hears of them
        (:meth:`_report`), and the next request may open."""
        hub, f = self._hub, r.fetch
        now = hub.now()
        with hub.cv:
            if r.sample_from is None:
                r.sample_from = self._first_byte_due(r, now)
            self._quiet_since, self._silence = now, 0.0
            self._stats.bytes_flowing(f.cid, now, chunk_start=not r.got)
        r.parts.append(piece.data)
        r.got += len(piece.data)
        r.remaining -= len(piece.data)
        self._report(r, now, piece)
        # cancelled chunks further on will not be read: the next request opens an RTT before
        # the last byte that will be
        skip = (sum(self._bytes_of(x) for x in r.batch[r.i + 1:] if x.cid in self._cancelled)
                if self._cancelled else 0)
        self._maybe_prestart(r.remaining - skip)

    def _first_byte_due(self, r: _Reading, now: float) -> float:
        """Under the lock, at a response's first piece: the earliest its bytes could have begun
        to arrive, where its first rate sample starts: one RTT after a request sent on an idle
        link, else the last byte of the response before it, and not before the last silence
        the ticker reported (that time was counted already)."""
        due = self._quiet_since + (self._source.rtt_s() if r.idle else 0.0)
        return min(now, max(due, self._silent_until))

    def _report(self, r: _Reading, now: float, piece: RecordPiece) -> None:
        """Tells the controller of ``piece``, more of the chunk being received: its progress at
        the chunk's end and with each rate sample, and a rate sample every ``sample_interval_s``
        while bytes flow and at a chunk's end.

        A response's first sample starts when its bytes could first arrive
        (:meth:`_first_byte_due`); it started at its first piece, whose bytes it counted over no
        time (floored at a microsecond): a probe's one-piece chunk measured the link at 80
        Gbit/s, and the rules moved three token chunks of layers to a 20 Mbit/s link at once
        (session 68). No sample ends at a piece that came in one read with the one before it
        (``together``: it spans no time of its own); its bytes go into the next sample."""
        assert r.sample_from is not None
        r.unreported += len(piece.data)
        r.sample_bytes += len(piece.data)
        elapsed = now - r.sample_from
        rate = (elapsed > 0 and not piece.together
                and (elapsed >= self._cfg.sample_interval_s or piece.end))
        if not (rate or piece.end):
            return
        hub = self._hub
        with hub.cv:
            revision = hub.ctl.revision
            hub.ctl.rate_sample(now, r.sample_bytes if rate else 0,
                                elapsed if rate else 0.0, r.fetch.cid, r.unreported)
            if hub.ctl.revision != revision:   # a re-plan (or a migration): wake idle parts
                hub.progress()
        r.unreported = 0
        if rate:
            r.sample_bytes, r.sample_from = 0, now

    def _chunk_read(self, r: _Reading) -> None:
        """The chunk being received is complete: to a decode worker; the next one is due."""
        f, parts = r.fetch, r.parts
        data = bytes(parts[0]) if len(parts) == 1 else b"".join(parts)
        self._count(len(data), 0)
        hub = self._hub
        with hub.cv:
            log = self._stats.received(f.cid, hub.now())
            hub.ctl.chunk_received(f.cid, log.end_s)
            self._decoder.submit(f, data, log)
        r.i, r.parts, r.got = r.i + 1, [], 0

    def _count(self, received: int, used: int) -> None:
        with self._hub.cv:
            self._stats.count(received, used)
