"""Reading stored frames for the chunk routes, and the answer when one cannot be served.

The store treats values as opaque bytes, so a frame damaged at rest (a flipped bit on disk, a
truncated file, a bad restore) would otherwise be served under the manifest's ETag and cached as
immutable. :func:`read_verified_frame` reads the whole frame and checks its size and its
``xxh3_128`` checksum before anything is sent (also for a range: a slice of a damaged frame is
never served). One xxh3 pass costs far less than reading the bytes.

A damaged store path is a damaged frame too: a frame the manifest names that is missing, that
cannot be read at all (a directory, a FIFO or a symlink where its file should be, an I/O error),
or whose stored size exceeds the manifest's (not read: a 3 GB file in a frame's place costs
nothing) is :class:`FrameCorrupt`, never an ``OSError`` reaching the app (a 500), a hung request
or a cut connection.
:func:`corrupt_frame_error` turns it into the answer: 404 when the context was deleted meanwhile
(its manifest, read afresh, is gone too), else 503 ``frame_corrupt``.
"""

from __future__ import annotations

import logging
from typing import Sequence

from sparkv.protocol.digests import verify
from sparkv.server.deps import require_manifest
from sparkv.server.errors import ApiError
from sparkv.server.state import FrameEntry, ServerState
from sparkv.server.stores import ChunkKey, ChunkStore, ValueTooLarge

log = logging.getLogger("sparkv.server")

MISSING = "it is missing from the store"


class FrameCorrupt(Exception):
    """A stored frame that is missing, unreadable, or whose size or checksum does not match its
    manifest entry."""

    def __init__(self, key: ChunkKey, reason: str, missing: bool = False) -> None:
        super().__init__(f"frame {key.name()}: {reason}")
        self.key = key
        self.reason = reason
        self.missing = missing
        """The store has no such frame (the context may have been deleted meanwhile)."""


def _unreadable(key: ChunkKey, exc: OSError) -> FrameCorrupt:
    return FrameCorrupt(key, f"it cannot be read from the store ({type(exc).__name__})")


def _too_large(exc: ValueTooLarge) -> FrameCorrupt:
    return FrameCorrupt(exc.key, f"{exc.size} bytes stored, the manifest says at most "
                                 f"{exc.max_bytes}")


def read_frames(chunks: ChunkStore, tenant: str, context_id: str,
                keys: Sequence[ChunkKey], max_bytes: int) -> list[bytes | None]:
    """Several stored frames in one store call (``None`` where one is absent; runs in a worker
    thread), none read if larger than ``max_bytes``. Raises :class:`FrameCorrupt` naming the
    first frame that is larger or cannot be read (an ``OSError`` of the store: a damaged path,
    a symlink, a FIFO), never the ``OSError`` itself."""
    try:
        return chunks.get_many(tenant, context_id, keys, max_bytes)
    except ValueTooLarge as exc:
        raise _too_large(exc) from None
    except OSError:
        pass
    out: list[bytes | None] = []
    for key in keys:  # one at a time, to name the frame that cannot be read
        try:
            out.append(chunks.get(tenant, context_id, key, max_bytes))
        except ValueTooLarge as exc:
            raise _too_large(exc) from None
        except OSError as exc:
            raise _unreadable(key, exc) from None
    return out


def read_verified_frame(chunks: ChunkStore, tenant: str, context_id: str, key: ChunkKey,
                        entry: FrameEntry) -> bytes:
    """The stored frame, checked against ``entry`` (runs in a worker thread); a stored file
    larger than the manifest's size is never read.

    Raises :class:`FrameCorrupt` when it is absent (``missing``), cannot be read (not a regular
    file inside the store), or its size or checksum differs from the manifest's.
    """
    try:
        data = chunks.get(tenant, context_id, key, entry.size)
    except ValueTooLarge as exc:
        raise _too_large(exc) from None
    except OSError as exc:
        raise _unreadable(key, exc) from None
    if data is None:
        raise FrameCorrupt(key, MISSING, missing=True)
    if len(data) != entry.size:
        raise FrameCorrupt(key, f"{len(data)} bytes stored, the manifest says {entry.size}")
    if not verify(data, entry.checksum):
        raise FrameCorrupt(key, "its checksum does not match the manifest's "
                                f"{entry.checksum}")
    return data


def frame_corrupt_error(context_id: str, exc: FrameCorrupt) -> ApiError:
    """503 ``frame_corrupt`` for a damaged frame (no ``Retry-After``: the damage stays until the
    context is encoded again)."""
    k = exc.key
    return ApiError(503, "frame_corrupt",
                    f"the stored frame (t={k.t}, l={k.l}, g={k.g}, level={k.level}) of context "
                    f"{context_id} is damaged (missing, unreadable, or its size or checksum does "
                    "not match the manifest) and is not served; fetch it from another replica, "
                    "or delete the context and encode it again", t=k.t, l=k.l, g=k.g,
                    level=k.level)


async def corrupt_frame_error(state: ServerState, endpoint: str, tenant: str, context_id: str,
                              exc: FrameCorrupt) -> ApiError:
    """The answer to a request that met ``exc`` before its response started.

    A missing frame first reads the manifest afresh: when it is gone as well (a DELETE raced the
    request) the 404 of :func:`~sparkv.server.deps.require_manifest` is raised. Otherwise the
    damage is logged and counted (``sparkv_frames_corrupt_total{endpoint}``) and the 503
    ``frame_corrupt`` returned.
    """
    if exc.missing:
        state.forget(tenant, context_id)
        await require_manifest(state, tenant, context_id)
    state.metrics.frames_corrupt.labels(endpoint).inc()
    log.error("context %s (tenant %s): stored %s; answered 503 frame_corrupt", context_id,
              tenant, exc)
    return frame_corrupt_error(context_id, exc)
