"""The stream response (``POST /v1/contexts/{id}/stream``): length-prefixed frames, read from the
store in batches and sent in order.

Memory is bounded whatever the client does: the response holds the batch being handed to the HTTP
server and at most one batch read ahead (``sparkv_stream_buffered_bytes`` counts both); the HTTP
server's own write buffer holds at most about one more, because sending waits while the socket is
paused (a client that does not read stalls its stream, not the event loop). A client that
disconnects ends its stream at once: its tenant's stream slot is released and the stream counted
in ``sparkv_streams_aborted_total``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Mapping

import anyio
from anyio import to_thread
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from sparkv.protocol.stream import STREAM_MEDIA_TYPE, record_header
from sparkv.server.errors import StoreError
from sparkv.server.state import ServerState, StreamSlot
from sparkv.server.stream_request import Batch, StreamPlan

log = logging.getLogger("sparkv.server.stream")


class StreamBroken(RuntimeError):
    """A frame named by the manifest is missing from the store or has the wrong size."""


class FrameStream(Response):
    """Length-prefixed frames (``u32`` little-endian length | frame, per item, in order) with an
    exact ``Content-Length``.

    Frames are read in batches of about ``stream_batch_bytes``, the next batch while this one is
    sent. Each record's size is checked against the manifest (a frame missing or of the wrong size
    cuts the stream: the connection closes before ``Content-Length`` bytes, so the client notices);
    checksums are the client's to verify (the edge checks every frame and recomputes a damaged
    chunk). The tenant's :class:`~sparkv.server.state.StreamSlot` is released when the response
    ends, however it ends.
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
        self._batches = plan.batches
        self._first: list[bytes | None] | None = None
        self._held = 0

    # --- reading ------------------------------------------------------------------------------
    def _read(self, batch: Batch) -> list[bytes | None]:
        return self.state.store.get_chunks(self.tenant, self.context_id, [k for k, _ in batch])

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
        """Reads the first batch before the response starts, so that a store outage answers
        503 ``store_unavailable`` (a retryable status) instead of a cut stream."""
        self._first = await self._read_batch(self._batches[0])

    def discard(self) -> None:
        """Releases what an unsent response holds (its slot, a prefetched batch)."""
        self._first = None
        self._drop(self._held)
        self.slot.release()

    # --- sending ------------------------------------------------------------------------------
    async def _send_records(self, send: Send) -> None:
        metrics = self.state.metrics
        todo = self._batches
        if self._first is not None:
            pending: asyncio.Future[list[bytes | None]] = \
                asyncio.get_running_loop().create_future()
            pending.set_result(self._first)
            self._first = None
        else:
            pending = asyncio.ensure_future(self._read_batch(todo[0]))
        try:
            for i, batch in enumerate(todo):
                frames = await pending
                if i + 1 < len(todo):  # read ahead: one batch
                    pending = asyncio.ensure_future(self._read_batch(todo[i + 1]))
                parts: list[bytes] = []
                per_level: dict[str, int] = {}
                nbytes = 0
                for (key, size), data in zip(batch, frames):
                    if data is None or len(data) != size:
                        metrics.stream_errors.inc()
                        raise StreamBroken(f"frame {key.name()} of context {self.context_id} "
                                           "is missing or has the wrong size in the store")
                    parts.append(record_header(size))
                    parts.append(data)
                    per_level[key.level] = per_level.get(key.level, 0) + 1
                    nbytes += size
                held = sum(len(f) for f in frames if f is not None)
                del frames
                body = b"".join(parts)
                del parts
                try:
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                finally:
                    self._drop(held)
                for lv, n in per_level.items():
                    metrics.frames_served.labels("stream", lv).inc(n)
                metrics.frame_bytes.labels("stream").inc(nbytes)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            self.completed = True
        finally:
            if not pending.done():
                pending.cancel()
                with anyio.CancelScope(shield=True):
                    try:
                        await pending  # the read finishes in its thread; its bytes are dropped
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
                except (StreamBroken, StoreError) as exc:
                    cut = exc
                except Exception as exc:  # noqa: BLE001 - re-raised below, outside the group
                    error = exc
                tg.cancel_scope.cancel()
        finally:
            self.slot.release()
            self._drop(self._held)
            if not self.completed:
                self.state.metrics.streams_aborted.inc()
        if isinstance(cut, StoreError):
            self.state.metrics.stream_errors.inc()
            self.state.metrics.store_errors.inc()
        if cut is not None:
            # Returning without finishing the body makes the HTTP server close the connection
            # before Content-Length bytes: the client sees a cut stream.
            log.error("stream of context %s cut: %s", self.context_id, cut)
        if error is not None:
            raise error
