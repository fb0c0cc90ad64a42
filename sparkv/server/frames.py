"""Reading one stored frame for ``GET .../chunks/{t}/{l}/{g}``, checked against the manifest.

The store treats values as opaque bytes, so a frame damaged at rest (a flipped bit on disk, a
truncated file, a bad restore) would otherwise be served under the manifest's ETag and cached as
immutable. :func:`read_verified_frame` reads the whole frame and checks its size and its
``xxh3_128`` checksum before anything is sent (also for a range: a slice of a damaged frame is
never served). One xxh3 pass costs far less than reading the bytes.
"""

from __future__ import annotations

from sparkv.protocol.digests import verify
from sparkv.server.errors import ApiError
from sparkv.server.state import FrameEntry
from sparkv.server.stores import ChunkKey, ChunkStore


class FrameCorrupt(Exception):
    """A stored frame whose size or checksum does not match its manifest entry."""

    def __init__(self, key: ChunkKey, reason: str) -> None:
        super().__init__(f"frame {key.name()}: {reason}")
        self.key = key
        self.reason = reason


def read_verified_frame(store: ChunkStore, tenant: str, context_id: str, key: ChunkKey,
                        entry: FrameEntry) -> bytes | None:
    """The stored frame, checked against ``entry`` (runs in a worker thread).

    Returns ``None`` when the frame is absent (the context was deleted meanwhile). Raises
    :class:`FrameCorrupt` when its size or checksum differs from the manifest's.
    """
    data = store.get_chunk(tenant, context_id, key)
    if data is None:
        return None
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
                    f"{context_id} is damaged (its size or checksum does not match the "
                    "manifest) and is not served; fetch it from another replica, or delete the "
                    "context and encode it again", t=k.t, l=k.l, g=k.g, level=k.level)
