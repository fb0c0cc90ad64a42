"""The stream response (``POST /v1/contexts/{id}/stream``): length-prefixed frames, read from the
store in batches and sent in order.

Memory is bounded in bytes whatever the client does: the response holds the batch being sent and
reads the next one ahead only while both fit in ``2 x stream_batch_bytes`` (a frame larger than
that is held alone: frames are at most ``max_frame_bytes``); ``sparkv_stream_buffered_bytes``
counts what is held. The batch is handed to the HTTP server in pieces of at most
:data:`SEND_PIECE_BYTES`, and sending waits while the socket is paused, so the server's own
write buffer holds at most one piece over its high-water mark (64 KiB). A client that does not
read stalls its stream, not the event loop. A client that disconnects ends its stream at once:
its tenant's stream slot is released and the stream counted in ``sparkv_streams_aborted_total``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Iterator, Mapping

from sparkv.extras import SERVER_MODULES, require_all

require_all(SERVER_MODULES, feature="the REST server (sparkv.server.streaming)")

import anyio
from anyio import to_thread
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from sparkv.protocol.stream import STREAM_MEDIA_TYPE, record_header
from sparkv.server.errors import StoreError
from sparkv.server.frames import MISSING, FrameCorrupt, read_frames
from sparkv.server.state import ServerState, StreamSlot
from sparkv.server.stream_request import Batch, StreamPlan

log = logging.getLogger("sparkv.server.stream")

SEND_PIECE_BYTES = 64 * 1024
"""The largest body message handed to the HTTP server (small records are joined up to it, a
larger frame is sent in slices)."""


class StreamBroken(RuntimeError):
    """A frame named by the manifest is missing from the store or has the wrong size."""


def batch_bytes(batch: Batch) -> int:
    """The frame bytes of a batch."""
    return sum(size for _, size in batch)


def broken_frame(batch: Batch, frames: list[bytes | None]) -> FrameCorrupt | None:
    """The first frame of ``batch`` that is missing or whose size is not the manifest's."""
    for (key, size), data in zip(batch, frames):
        if data is None:
            return FrameCorrupt(key, MISSING, missing=True)
        if len(data) != size:
            return FrameCorrupt(key, f"{len(data)} bytes stored, the manifest says {size}")
    return None


def record_pieces(batch: Batch, frames: list[bytes]) -> Iterator[bytes]:
    """The records of a batch (``u32`` length | frame, each) as body pieces of at most
    :data:`SEND_PIECE_BYTES`: small records joined, a large frame sliced (one copy per byte)."""
    parts: list[bytes | memoryview] = []
    n = 0
    for (_, size), data in zip(batch, frames):
        parts.append(record_header(size))
        n += len(parts[-1])
        view = memoryview(data)
        pos = 0
        while True:
            if n >= SEND_PIECE_BYTES:
                yield b"".join(parts)
                parts, n = [], 0
            if pos >= size:
                break
            take = min(SEND_PIECE_BYTES - n, size - pos)
            parts.append(view[pos:pos + take])
            n += take
            pos += take
    if parts:
        yield b"".join(parts)


class FrameStream(Response):
    """Length-prefixed frames (``u32`` little-endian length | frame, per item, in order) with an
    exact ``Content-Length``.

    Frames are read in batches of about ``stream_batch_bytes``; the next batch is read while
    this one is sent when both fit in ``2 x stream_batch_bytes`` (the byte bound of the module
    docstring). The first batch is read and checked before the response starts
    (:meth:`prefetch`). Each later record's size is checked against the manifest (a frame
    missing, unreadable or of the wrong size cuts the stream: the connection closes before
    ``Content-Length`` bytes, so the client notices); checksums are the client's to verify (the
    edge checks every frame and recomputes a damaged chunk). The tenant's
    :class:`~sparkv.server.state.StreamSlot` is released when the response ends, however it
    ends.

    State: used by one request on the event loop (the store reads run in worker threads and
    only return their frames); ``_held`` counts the frame bytes held, mirrored in the gauge.
    """

    def __init__(self, state: ServerState, tenant: str, context_id: str, plan: StreamPlan,
                 headers: Mapping[str, str], slot: StreamSlot) -> None:
        super().__init__(None, status_code=200, media_type=STREAM_MEDIA_TYPE,
                         headers={**headers, "Content-Length": str(plan.total_bytes)})
        self.state = state
        self.tenant = tenant
        self.context_id = context_id
        self.plan = plan
        self.slot = slot
        self.completed = False
        self.buffer_bytes = 2 * state.settings.stream_batch_bytes
        self._batches = plan.batches
        self._first: list[bytes | None] | None = None
        self._held = 0

    # --- reading ------------------------------------------------------------------------------
    def _read(self, batch: Batch) -> list[bytes | None]:
        return read_frames(self.state.store.chunks, self.tenant, self.context_id,
                           [k for k, _ in batch], max(size for _, size in batch))

    def _hold(self, frames: list[bytes | None]) -> list[bytes | None]:
        n = sum(len(f) for f in frames if f is not None)
        self._held += n
        self.state.metrics.stream_buffered_bytes.inc(n)
        return frames

    def _drop(self, n: int) -> None:
        self._held -= n
        self.state.metrics.stream_buffered_bytes.dec(n)

    async def _read_batch(self, batch: Batch) -> list[bytes | None]:
        return self._hold(await to_thread.run_sync(self._read, batch))

    async def prefetch(self) -> None:
        """Reads and checks the first batch before the response starts, so that a store outage
        answers 503 ``store_unavailable`` (a retryable status) and a missing, unreadable or
        wrong-size first frame raises :class:`~sparkv.server.frames.FrameCorrupt` (the route
        answers 503 ``frame_corrupt``, or 404 when the context is gone) instead of a cut
        stream."""
        self._first = await self._read_batch(self._batches[0])
        bad = broken_frame(self._batches[0], self._first)
        if bad is not None:
            raise bad

    def discard(self) -> None:
        """Releases what an unsent response holds (its slot, a prefetched batch)."""
        self._first = None
        self._drop(self._held)
        self.slot.release()

    # --- sending ------------------------------------------------------------------------------
    async def _send_batch(self, send: Send, batch: Batch, frames: list[bytes | None]) -> None:
        """Sends one batch's records in pieces, then lets its frames go."""
        bad = broken_frame(batch, frames)
        if bad is not None:
            raise StreamBroken(f"{bad} (context {self.context_id})")
        for piece in record_pieces(batch, [f for f in frames if f is not None]):  # all, checked
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        self._drop(sum(len(f) for f in frames if f is not None))
        metrics = self.state.metrics
        per_level: dict[str, int] = {}
        for key, _ in batch:
            per_level[key.level] = per_level.get(key.level, 0) + 1
        for lv, n in per_level.items():
            metrics.frames_served.labels("stream", lv).inc(n)
        metrics.frame_bytes.labels("stream").inc(batch_bytes(batch))

    async def _send_records(self, send: Send) -> None:
        todo = self._batches
        ahead: asyncio.Future[list[bytes | None]] | None = None
        try:
            for i, batch in enumerate(todo):
                if i == 0 and self._first is not None:
                    frames, self._first = self._first, None
                elif ahead is not None:
                    frames, ahead = await ahead, None
                else:
                    frames = await self._read_batch(batch)
                if i + 1 < len(todo) and \
                        self._held + batch_bytes(todo[i + 1]) <= self.buffer_bytes:
                    ahead = asyncio.ensure_future(self._read_batch(todo[i + 1]))
                await self._send_batch(send, batch, frames)
                del frames
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            self.completed = True
        finally:
            if ahead is not None and not ahead.done():
                ahead.cancel()
                with anyio.CancelScope(shield=True):
                    try:
                        await ahead  # the read finishes in its thread; its bytes are dropped
                    except BaseException:  # noqa: BLE001 - cancelled or failed: nothing to keep
                        pass

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        cut: Exception | None = None
        error: Exception | None = None
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            async with anyio.create_task_group() as tg:

                async def watch_disconnect() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(watch_disconnect)
                try:
                    await self._send_records(send)
                except (StreamBroken, FrameCorrupt, StoreError) as exc:
                    cut = exc
                except Exception as exc:  # noqa: BLE001 - re-raised below, outside the group
                    error = exc
                tg.cancel_scope.cancel()
        finally:
            self.slot.release()
            self._drop(self._held)
            if not self.completed:
                self.state.metrics.streams_aborted.inc()
        if cut is not None:
            # Returning without finishing the body makes the HTTP server close the connection
            # before Content-Length bytes: the client sees a cut stream.
            self.state.metrics.stream_errors.inc()
            if isinstance(cut, StoreError):
                self.state.metrics.store_errors.inc()
            log.error("stream of context %s cut: %s", self.context_id, cut)
        if error is not None:
            raise error
