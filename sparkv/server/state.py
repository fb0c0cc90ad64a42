"""What one app instance holds: :class:`ServerState` (settings, store, models, jobs, metrics), the
cache of parsed manifests (:class:`ParsedManifest`) and the per-tenant stream slots
(:class:`StreamSlots`).

Everything here is used from the event loop only (the manifest cache and the slot counters need
no lock); blocking store calls go to the thread pool.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

from anyio import to_thread

from sparkv.layout import ChunkGeometry
from sparkv.protocol import Manifest
from sparkv.protocol.digests import checksum, etag_of
from sparkv.server.config import Settings
from sparkv.server.errors import ApiError
from sparkv.server.jobs import JobManager
from sparkv.server.metrics import ServerMetrics
from sparkv.server.models import ModelRegistry
from sparkv.server.stores import Store, open_store

IMMUTABLE = "max-age=31536000, immutable"
MANIFEST_CACHE_ENTRIES = 256
STREAM_RETRY_AFTER_S = 1
"""``Retry-After`` of a 429 ``too_many_streams``: a stream usually ends within a second."""


class FrameEntry(NamedTuple):
    """What the manifest says of one stored frame."""

    size: int
    """Bytes of the stored (served) frame."""
    etag: str
    """Its strong ETag (``"<xxh3_128 hex>"``)."""
    checksum: str
    """``xxh3_128:<hex>`` of the stored bytes."""


@dataclass
class ParsedManifest:
    """A stored manifest, validated (:class:`~sparkv.protocol.Manifest`), with its frame index
    ``(t, l, g, level) -> FrameEntry``."""

    raw: bytes
    etag: str
    manifest: Manifest
    index: dict[tuple[int, int, int, str], FrameEntry]

    @property
    def geometry(self) -> ChunkGeometry:
        return self.manifest.chunk_geometry

    @property
    def levels(self) -> tuple[str, ...]:
        return tuple(self.manifest.levels)

    @property
    def encrypted(self) -> bool:
        return self.manifest.encrypted

    @property
    def num_tokens(self) -> int:
        return self.manifest.num_tokens

    @property
    def tokens_sha256(self) -> str:
        """SHA-256 (hex) of the token ids as little-endian ``u32`` values: the tokens' ETag."""
        return self.manifest.tokens_sha256

    @classmethod
    def parse(cls, raw: bytes) -> "ParsedManifest":
        """Validates a stored manifest and indexes its frames (CPU work: call it off the loop)."""
        m = Manifest.parse(raw)
        index = {k: FrameEntry(e.bytes, etag_of(e.checksum), e.checksum)
                 for k, e in m.index.items()}
        return cls(raw, etag_of(checksum(raw)), m, index)

    def cache_control(self) -> str:
        """``Cache-Control`` of this context's frames: ciphertext may sit in shared caches,
        plaintext only in the client's own."""
        return ("public, " if self.encrypted else "private, ") + IMMUTABLE


class StreamSlot:
    """One tenant's claim on a concurrent stream; :meth:`release` is idempotent."""

    def __init__(self, owner: "StreamSlots", tenant: str) -> None:
        self._owner = owner
        self.tenant = tenant
        self._held = True

    def release(self) -> None:
        """Gives the slot back (once; later calls do nothing)."""
        if self._held:
            self._held = False
            self._owner._release(self.tenant)


class StreamSlots:
    """Counts each tenant's stream responses in progress and refuses one over ``limit``."""

    def __init__(self, limit: int, metrics: ServerMetrics) -> None:
        self.limit = limit
        self.metrics = metrics
        self._active: dict[str, int] = {}

    def active(self, tenant: str | None = None) -> int:
        """Streams in progress: the tenant's, or everyone's."""
        if tenant is not None:
            return self._active.get(tenant, 0)
        return sum(self._active.values())

    def acquire(self, tenant: str) -> StreamSlot:
        """A slot for one more stream of ``tenant``, or ``ApiError(429, "too_many_streams")``."""
        n = self._active.get(tenant, 0)
        if n >= self.limit:
            self.metrics.streams_refused.labels("too_many_streams").inc()
            raise ApiError(429, "too_many_streams",
                           f"this tenant already has {n} streams in progress; at most "
                           f"{self.limit} at once (retry when one ends)",
                           headers={"Retry-After": str(STREAM_RETRY_AFTER_S)}, limit=self.limit)
        self._active[tenant] = n + 1
        self.metrics.streams_active.inc()
        return StreamSlot(self, tenant)

    def _release(self, tenant: str) -> None:
        n = self._active.get(tenant, 0) - 1
        if n > 0:
            self._active[tenant] = n
        else:
            self._active.pop(tenant, None)
        self.metrics.streams_active.dec()


@dataclass
class ServerState:
    """What the routes need; one per app (``app.state.sparkv``)."""

    settings: Settings
    store: Store
    registry: ModelRegistry
    jobs: JobManager
    metrics: ServerMetrics
    streams: StreamSlots
    manifests: "OrderedDict[tuple[str, str], tuple[float, ParsedManifest]]" = field(
        default_factory=OrderedDict)

    @classmethod
    def build(cls, settings: Settings, store: Store | None = None,
              registry: ModelRegistry | None = None) -> "ServerState":
        """Opens the store (unless given), builds the model registry and the job manager."""
        metrics = ServerMetrics()
        store = store or open_store(settings.store)
        registry = registry or ModelRegistry(settings.models, settings.max_context_tokens,
                                           settings.device, settings.dtype)
        if settings.job_queue == "local":
            jobs = JobManager(store, registry, settings, metrics)
        else:  # a cluster: jobs go to the shared queue, run by `sparkv worker` (docs/cluster.md)
            from sparkv.server.queued_jobs import QueuedJobManager

            jobs = QueuedJobManager(store, registry, settings, metrics)  # type: ignore[assignment]
        return cls(settings, store, registry, jobs, metrics,
                   StreamSlots(settings.max_streams_per_tenant, metrics))

    async def manifest(self, tenant: str, context_id: str) -> ParsedManifest | None:
        """The context's parsed manifest (cached ``manifest_cache_s`` seconds), or ``None``.
        Once the cache entry is older, the stored bytes are read again (a DELETE shows within
        that time) but parsed again only if they changed: validating a 2K-token context's
        manifest took 20-30 ms of the server's CPU, paid by every ask more than
        ``manifest_cache_s`` after the last parse (a device asking every few seconds: every
        other ask)."""
        key = (tenant, context_id)
        hit = self.manifests.get(key)
        now = time.monotonic()
        if hit is not None and hit[0] > now:
            return hit[1]
        raw = await to_thread.run_sync(self.store.manifests.get, tenant, context_id)
        if raw is None:
            self.manifests.pop(key, None)
            return None
        if hit is not None and hit[1].raw == raw:
            parsed = hit[1]
        else:
            parsed = await to_thread.run_sync(ParsedManifest.parse, raw)
        if self.settings.manifest_cache_s > 0:
            self.manifests[key] = (now + self.settings.manifest_cache_s, parsed)
            self.manifests.move_to_end(key)
            while len(self.manifests) > MANIFEST_CACHE_ENTRIES:
                self.manifests.popitem(last=False)
        return parsed

    def forget(self, tenant: str, context_id: str) -> None:
        """Drops a cached manifest (after a DELETE, or when its frames vanished)."""
        self.manifests.pop((tenant, context_id), None)
