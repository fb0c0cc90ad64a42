"""The stream record: how ``POST /v1/contexts/{id}/stream`` carries many frames in one body.

The body is the requested frames, in the requested order, each as one record::

    u32 little-endian length | frame (length bytes)

and nothing else: no header, no trailer, no padding. ``Content-Length`` is exact (the sum of
``4 + length``), so a cut stream is detected by its reader. The server writes records with
:func:`record_header` / :func:`encode_records`; the edge reads them incrementally with
:class:`RecordReader`, which checks every length against the size the manifest gives for that
item before a byte of its frame is accepted.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Iterable, Sequence

from sparkv.protocol.errors import RecordError

FRAME_MEDIA_TYPE = "application/vnd.sparkv.frame"
STREAM_MEDIA_TYPE = "application/vnd.sparkv.frames"
RECORD_HEADER = struct.Struct("<I")
HEADER_BYTES = RECORD_HEADER.size
MAX_RECORD_BYTES = 2**32 - 1


def record_header(size: int) -> bytes:
    """The 4-byte length prefix of a record of ``size`` frame bytes."""
    if not 0 <= size <= MAX_RECORD_BYTES:
        raise RecordError(f"a record holds 0..{MAX_RECORD_BYTES} bytes, not {size}")
    return RECORD_HEADER.pack(size)


def encode_records(frames: Iterable[bytes]) -> bytes:
    """A whole stream body of ``frames``."""
    out = bytearray()
    for f in frames:
        out += record_header(len(f))
        out += f
    return bytes(out)


def stream_length(sizes: Iterable[int]) -> int:
    """The exact body length (``Content-Length``) of records with these frame sizes."""
    return sum(HEADER_BYTES + int(s) for s in sizes)


def split_records(body: bytes, expected: Sequence[int] | None = None) -> list[bytes]:
    """The frames of a whole stream body; raises :class:`RecordError` when it is malformed."""
    reader = RecordReader(expected)
    frames: list[bytearray] = []
    for piece in reader.feed(body):
        if piece.index == len(frames):
            frames.append(bytearray())
        frames[piece.index] += piece.data
    reader.finish()
    return [bytes(f) for f in frames]


@dataclass
class RecordPiece:
    """Bytes of record ``index``'s frame; ``end`` when they complete it; ``together``: they came
    in the same read as the piece before them (:meth:`RecordReader.feed` returned both), so they
    arrived at the same time (a rate sample must not end at them: it would span no time)."""

    index: int
    data: bytes
    end: bool
    together: bool = False


class RecordReader:
    """An incremental parser of a stream body.

    Feed it the body's bytes as they arrive (any split); it returns the frames' bytes as
    :class:`RecordPiece` objects, in order. With ``expected`` (the frame size of each requested
    item, from the manifest) a record whose length differs, or a record past the last expected
    one, raises :class:`RecordError` at once; :meth:`finish` raises when the body ended inside a
    record or before every expected record.
    """

    def __init__(self, expected: Sequence[int] | None = None) -> None:
        self.expected = list(expected) if expected is not None else None
        self.index = 0               # the record being read
        self._header = bytearray()   # partial length prefix
        self._left: int | None = None  # frame bytes still to come in the current record
        self.bytes_fed = 0

    @property
    def records_done(self) -> int:
        return self.index

    def due(self) -> int:
        """Bytes still to come before this reader can hand on the current record's last piece:
        the rest of its frame; between records, the rest of the next length prefix and, with
        ``expected``, the next frame's size (at least 1)."""
        if self._left is not None:
            return max(1, self._left)
        head = HEADER_BYTES - len(self._header)
        if self.expected is not None and self.index < len(self.expected):
            return head + self.expected[self.index]
        return head

    def _start(self, size: int) -> None:
        if self.expected is not None:
            if self.index >= len(self.expected):
                raise RecordError(f"the stream has more than the {len(self.expected)} records "
                                  "requested")
            if size != self.expected[self.index]:
                raise RecordError(f"record {self.index} has {size} bytes; the manifest says "
                                  f"{self.expected[self.index]}")
        self._left = size

    def feed(self, data: bytes | bytearray | memoryview) -> list[RecordPiece]:
        out: list[RecordPiece] = []
        view = memoryview(data)
        self.bytes_fed += len(view)
        pos = 0
        while pos < len(view):
            if self._left is None:
                take = min(HEADER_BYTES - len(self._header), len(view) - pos)
                self._header += view[pos:pos + take]
                pos += take
                if len(self._header) < HEADER_BYTES:
                    break
                (size,) = RECORD_HEADER.unpack(bytes(self._header))
                self._header.clear()
                self._start(size)
                if size == 0:
                    out.append(RecordPiece(self.index, b"", True, bool(out)))
                    self._left = None
                    self.index += 1
                continue
            take = min(self._left, len(view) - pos)
            self._left -= take
            end = self._left == 0
            out.append(RecordPiece(self.index, bytes(view[pos:pos + take]), end, bool(out)))
            pos += take
            if end:
                self._left = None
                self.index += 1
        return out

    def finish(self) -> None:
        """The body ended: raises :class:`RecordError` unless it ended between records (and, with
        ``expected``, after the last one)."""
        if self._left is not None or self._header:
            raise RecordError(f"the stream ended inside record {self.index}")
        if self.expected is not None and self.index < len(self.expected):
            raise RecordError(f"the stream ended after {self.index} of {len(self.expected)} "
                              "records")
