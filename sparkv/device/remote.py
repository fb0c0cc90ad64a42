"""The server's copy of a context as a restore source: LLMS's loading with a third source.

A context SparKV loaded from a server (``EdgeSession.ask(keep=True)``) is a service context whose
KV the server also holds, encoded per server chunk ``(t, l, g)`` at the manifest's levels. When
the device has swapped that context out, or lost its chunks altogether (evicted without a flash
copy, flash files gone), a call can restore each missing 16-token chunk from **flash**, from
**the server** or by **local recompute**, whichever the restore plan
(:func:`sparkv.device.restore.restore_plan`: SparKV's own scheduler, with flash as one more link
of measured bandwidth) finds cheapest::

    remote = ServerStream(edge_client, context_id, levels=["raw"])
    svc.call(kept_id, prompt_ids=question, max_new_tokens=32, grow=False, remote=remote)

Layering: the device service sits below the edge (``tests/test_layers.py``), so this module does
not import :mod:`sparkv.edge`. :class:`ServerStream` takes any :class:`ServerClient` (what it
uses of the public :class:`~sparkv.edge.client.EdgeClient`: ``manifest(id)``, ``tokens(id)``,
``frame(id, t, l, g, level)``, ``last_download``, ``last_first_byte_s``) and decodes frames with
:mod:`sparkv.codec`; the caller above (the edge, a benchmark, a test) passes the client in.

The link estimate (bytes/s) is the caller's (``link_Bps``), else the client's last shaped
download, else 50 Mbit/s; the round trip is the client's last time to first byte.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, Protocol, Sequence, runtime_checkable

import torch

from sparkv.device.errors import DeviceError
from sparkv.layout import ChunkGeometry, KVChunkId

if TYPE_CHECKING:
    from sparkv.protocol import Manifest

DEFAULT_LINK_MBPS = 50.0


@runtime_checkable
class RemoteSource(Protocol):
    """A copy of a service context elsewhere, fetched per remote chunk (see the module docstring).

    Attributes:
        geometry: the remote chunking (tokens, layers, KV-head groups of the remote chunks).
        token_ids: the context's tokens as the remote holds them.
        sizes: per remote chunk, bytes per level that may be fetched.
        link_Bps: the expected bandwidth (bytes/s); ``rtt_s``: the round trip of a request.
    """

    @property
    def geometry(self) -> ChunkGeometry: ...

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def sizes(self) -> dict[KVChunkId, dict[str, int]]: ...

    @property
    def link_Bps(self) -> float: ...

    @property
    def rtt_s(self) -> float: ...

    def fetch(self, chunks: Sequence[tuple[KVChunkId, str]]
              ) -> Iterator[tuple[KVChunkId, int, torch.Tensor, torch.Tensor]]:
        """Yields ``(cid, token_start, k, v)`` (``[heads of the group, tokens, D]``, fp) for each
        remote chunk, in the order given; raises :class:`DeviceError` when it cannot."""
        ...


class Download(Protocol):
    """What :class:`ServerStream` reads of a shaped download (the edge's ``Fetched``): the
    link's rate while it came (``None``: too short to tell)."""

    def rate_Bps(self) -> float | None: ...  # noqa: N802


class ServerClient(Protocol):
    """What :class:`ServerStream` uses of the edge's ``EdgeClient`` (this layer does not import
    the edge): a context's manifest, token ids and frames, and the last download's timings."""

    @property
    def last_download(self) -> Download | None: ...

    @property
    def last_first_byte_s(self) -> float: ...

    def manifest(self, context_id: str) -> Manifest: ...

    def tokens(self, context_id: str) -> list[int]: ...

    def frame(self, context_id: str, t: int, l: int, g: int, level: str) -> bytes:  # noqa: E741
        ...


@dataclass
class FetchStats:
    """What a remote source did (bytes on the wire, frames, seconds)."""

    frames: int = 0
    bytes: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)


class ServerStream:
    """A sparkv server's encoding of one context, reached through an ``EdgeClient``.

    Args:
        client: an :class:`~sparkv.edge.client.EdgeClient` (any :class:`ServerClient`).
        context_id: the server's id of the context.
        levels: the codec levels that may be fetched (default: every encoded level; ``["raw"]``
            restores exactly what the server computed).
        link_Bps: the link estimate (bytes/s); default: the client's last download's rate, else
            50 Mbit/s.
        open_frame: decrypts a stored frame (``(data, cid, level) -> frame``) for an encrypted
            context.
    """

    def __init__(self, client: ServerClient, context_id: str, *,
                 levels: Sequence[str] | None = None, link_Bps: float | None = None,
                 open_frame: Callable[[bytes, KVChunkId, str], bytes] | None = None) -> None:
        self.client = client
        self.context_id = context_id
        manifest = client.manifest(context_id)
        if manifest.compressed:
            raise DeviceError(f"context {context_id} is stored compressed (pruned entries): it "
                              "cannot restore whole chunks")
        if manifest.encrypted and open_frame is None:
            raise DeviceError(f"context {context_id} is encrypted: pass open_frame")
        self.manifest = manifest
        self.geometry: ChunkGeometry = manifest.chunk_geometry
        self.token_ids = [int(x) for x in client.tokens(context_id)]
        allowed = set(levels) if levels is not None else None
        self.sizes: dict[KVChunkId, dict[str, int]] = {
            cid: {lv: b for lv, b in per.items() if allowed is None or lv in allowed}
            for cid, per in manifest.sizes.items()}
        if allowed is not None and not any(self.sizes.values()):
            raise DeviceError(f"context {context_id} has none of the levels {sorted(allowed)} "
                              f"(it has {list(manifest.levels)})")
        self.link_Bps = float(link_Bps) if link_Bps else self._link_estimate()
        self.rtt_s = float(client.last_first_byte_s or 0.0)
        self.open_frame = open_frame
        self.stats = FetchStats()

    def _link_estimate(self) -> float:
        d = self.client.last_download
        rate = d.rate_Bps() if d is not None else None
        return rate if rate else DEFAULT_LINK_MBPS * 1e6 / 8

    def fetch(self, chunks: Sequence[tuple[KVChunkId, str]]
              ) -> Iterator[tuple[KVChunkId, int, torch.Tensor, torch.Tensor]]:
        """Downloads and decodes the frames (:class:`RemoteSource`)."""
        from sparkv.codec import CodecError, decode

        for cid, level in chunks:
            t0 = time.perf_counter()
            try:
                data = self.client.frame(self.context_id, cid.t, cid.l, cid.g, level)
                frame = self.open_frame(data, cid, level) if self.open_frame else data
                chunk = decode(frame, finite=True)
            except (CodecError, OSError, ValueError) as e:
                raise DeviceError(f"server chunk {cid} at {level}: {e}") from e
            except Exception as e:  # noqa: BLE001 - the client's ApiError / ServerUnavailable
                raise DeviceError(f"server chunk {cid} at {level}: {type(e).__name__}: {e}") \
                    from e
            if chunk.id != cid:
                raise DeviceError(f"the server sent {chunk.id} for {cid}")
            self.stats.frames += 1
            self.stats.bytes += len(data)
            self.stats.seconds += time.perf_counter() - t0
            yield cid, int(chunk.token_start), chunk.k, chunk.v


class LazyRemote:
    """A :class:`RemoteSource` made on first use: nothing is fetched (no manifest, no tokens)
    unless a call finds chunks missing and asks for the remote's tokens.

    When the source cannot be made (the server is down, the context is compressed or encrypted,
    the id is unknown) it holds no tokens, so :meth:`ContextService.call` restores from flash or
    recomputes instead; :attr:`error` keeps the reason.
    """

    def __init__(self, make: Callable[[], ServerStream]) -> None:
        self._make = make
        self._remote: ServerStream | None = None
        self.error: Exception | None = None

    def _get(self) -> ServerStream | None:
        if self._remote is None and self.error is None:
            try:
                self._remote = self._make()
            except Exception as e:  # noqa: BLE001 - any failure means "no server copy"
                self.error = e
        return self._remote

    def _made(self) -> ServerStream:
        remote = self._get()
        if remote is None:
            raise DeviceError(f"no server copy: {self.error}")
        return remote

    @property
    def token_ids(self) -> Sequence[int]:
        remote = self._get()
        return remote.token_ids if remote is not None else ()

    @property
    def stats(self) -> FetchStats:
        """What the stream fetched (nothing when it was never made)."""
        return self._remote.stats if self._remote is not None else FetchStats()

    @property
    def geometry(self) -> ChunkGeometry:
        return self._made().geometry

    @property
    def sizes(self) -> dict[KVChunkId, dict[str, int]]:
        return self._made().sizes

    @property
    def link_Bps(self) -> float:
        return self._made().link_Bps

    @property
    def rtt_s(self) -> float:
        return self._made().rtt_s

    def fetch(self, chunks: Sequence[tuple[KVChunkId, str]]
              ) -> Iterator[tuple[KVChunkId, int, torch.Tensor, torch.Tensor]]:
        return self._made().fetch(chunks)


def server_stream(client: ServerClient, context_id: str, *, levels: Sequence[str] | None = None,
                  link_Bps: float | None = None,
                  open_frame: Callable[[bytes, KVChunkId, str], bytes] | None = None
                  ) -> LazyRemote:
    """A lazily made :class:`ServerStream` of ``context_id`` (see :class:`LazyRemote`)."""
    return LazyRemote(lambda: ServerStream(client, context_id, levels=levels, link_Bps=link_Bps,
                                           open_frame=open_frame))
