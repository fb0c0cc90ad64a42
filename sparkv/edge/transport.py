"""Where streamed KV chunks come from: the :class:`ChunkSource` protocol.

The engine asks a source for a batch of frames and reads them back as
:class:`~sparkv.protocol.stream.RecordPiece` objects (the bytes of item ``index``'s frame, in the
requested order, ``end`` on its last piece, ``together`` when it came in one read with the piece
before it: the link times its rate samples by the pieces). It never sees URLs, sockets or record
prefixes: the HTTP implementation (:class:`~sparkv.edge.http_source.HttpChunkSource`) parses the
server's ``u32 | frame`` records and emulates the link; a scripted source (tests) produces pieces
itself.

Failures are :class:`SourceError`. ``fatal`` says that asking again cannot help (a 4xx, a record
that contradicts the manifest); anything else (a refused or cut connection, a 5xx, a timeout) may
succeed on a retry. ``refused`` (a 401 or 403: the server refuses this client's key) is a
configuration error, not a link fault: the load ends with it instead of falling back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator, Protocol, Sequence, runtime_checkable

from sparkv.layout import KVChunkId
from sparkv.protocol.stream import RecordPiece

__all__ = ["FetchItem", "SourceError", "ChunkStream", "ChunkSource", "RecordPiece"]


@dataclass(frozen=True)
class FetchItem:
    """One frame to fetch: chunk ``cid`` at ``level``, ``nbytes`` long (from the manifest)."""

    cid: KVChunkId
    level: str
    nbytes: int


class SourceError(Exception):
    """A request to a source failed; ``fatal``: retrying cannot help; ``refused``: the error
    that refused this client's credentials (the load ends with it), else ``None``."""

    def __init__(self, reason: str, fatal: bool = False,
                 refused: Exception | None = None) -> None:
        super().__init__(reason)
        self.reason, self.fatal, self.refused = reason, fatal or refused is not None, refused


@runtime_checkable
class ChunkStream(Protocol):
    """The response to one :meth:`ChunkSource.open`: the items' frame bytes, in order."""

    def __aiter__(self) -> AsyncIterator[RecordPiece]: ...

    async def aclose(self) -> None:
        """Stops reading (the rest of the response is abandoned)."""
        ...


@runtime_checkable
class ChunkSource(Protocol):
    """Anything that delivers frames of one context's chunks (see the module docstring)."""

    def start(self) -> None:
        """Loading begins now (a link emulation starts its trace clock)."""
        ...

    def rtt_s(self) -> float:
        """The round trip a new request pays before its first byte (an estimate, seconds)."""
        ...

    async def open(self, items: Sequence[FetchItem]) -> ChunkStream:
        """Requests ``items``; returns when the response starts (raises :class:`SourceError`)."""
        ...

    async def aclose(self) -> None:
        """Releases connections (called once, on the loop that used the source)."""
        ...
