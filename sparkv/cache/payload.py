"""A chunk's entries on their own: :class:`ChunkPayload`, and its byte form for the flash tier.

A payload holds, for one KV chunk ``(t, l, g)``, the kept entries of each head of the group
(``counts[h]`` of them, positions ascending), packed head after head: ``pos`` int32
``[sum(counts)]`` and ``k``, ``v`` ``[sum(counts), D]``, either in the model's dtype (level ``fp``)
or quantized (:class:`~sparkv.cache.levels.QuantizedTensor`).

Byte form (little-endian; every file of the flash tier is one)::

    "SKVC" | version u16 | level u8 | dtype u8 | t u32 | l u32 | g u32 | heads u16 | D u16
    | counts u32 x heads | pos int32 x n | K | V | xxh64 u64 (of everything before it)

with ``K``/``V`` the raw values (``fp``) or ``codes | scale fp16 x n | zero fp16 x n``. A file cut
short, grown or with any flipped byte fails :func:`from_bytes` with a clear
:class:`PayloadError`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np
import torch
import xxhash

from sparkv.cache.ids import concat
from sparkv.cache.levels import (LEVELS, SIDE_BITS, QuantizedTensor, dequantize, quantize,
                                 requantize)
from sparkv.errors import SparkvError
from sparkv.layout import KVChunkId

MAGIC = b"SKVC"
VERSION = 1
_HEAD = struct.Struct("<4sHBBIIIHH")
_DTYPES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
_DTYPE_OF = {v: k for k, v in _DTYPES.items()}
_LEVEL_CODE = {name: i for i, name in enumerate(LEVELS)}


class PayloadError(SparkvError):
    """Bytes that are not a valid chunk payload (cut short, corrupted, inconsistent)."""


Values = "torch.Tensor | QuantizedTensor"


@dataclass
class ChunkPayload:
    """One chunk's kept entries (see the module docstring)."""

    cid: KVChunkId
    level: str
    counts: list[int]
    pos: torch.Tensor
    k: "torch.Tensor | QuantizedTensor"
    v: "torch.Tensor | QuantizedTensor"
    dtype: torch.dtype = torch.float32

    @property
    def entries(self) -> int:
        return int(sum(self.counts))

    def tensors(self) -> list[torch.Tensor]:
        out = [self.pos]
        for x in (self.k, self.v):
            out.extend(x.tensors() if isinstance(x, QuantizedTensor) else [x])
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def head_slices(self) -> list[slice]:
        out, a = [], 0
        for n in self.counts:
            out.append(slice(a, a + n))
            a += n
        return out

    # ---- levels ----------------------------------------------------------------------------------
    def fp(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``k``, ``v`` ``[n, D]`` in the payload's dtype (dequantized when quantized)."""
        if self.level == "fp":
            assert isinstance(self.k, torch.Tensor) and isinstance(self.v, torch.Tensor)
            return self.k, self.v
        assert isinstance(self.k, QuantizedTensor) and isinstance(self.v, QuantizedTensor)
        return dequantize(self.k, self.dtype), dequantize(self.v, self.dtype)

    def at_level(self, level: str) -> "ChunkPayload":
        """The same entries at ``level``: quantized from fp, or pushed down from an int8 base;
        ``fp`` dequantizes (the error of the quantized level stays)."""
        if level == self.level:
            return self
        k, v = values_at_level(self.k, self.v, self.level, level, self.dtype)
        return ChunkPayload(self.cid, level, list(self.counts), self.pos, k, v, self.dtype)


def values_at_level(k: "torch.Tensor | QuantizedTensor", v: "torch.Tensor | QuantizedTensor",
                    src: str, level: str, dtype: torch.dtype
                    ) -> tuple["torch.Tensor | QuantizedTensor", "torch.Tensor | QuantizedTensor"]:
    """Rows ``k``, ``v`` held at ``src``, at ``level`` (row by row, so a run converts as its
    chunks would one by one); raises :class:`PayloadError` for a conversion levels cannot make."""
    if level == src:
        return k, v
    if level == "fp":
        if src == "fp":
            return k, v
        return dequantize(k, dtype), dequantize(v, dtype)  # type: ignore[arg-type]
    if level not in SIDE_BITS:
        raise PayloadError(f"unknown level {level!r}")
    kb, vb = SIDE_BITS[level]
    return _side_at(k, src, kb, level), _side_at(v, src, vb, level)


def _side_at(x: "torch.Tensor | QuantizedTensor", src: str, bits: int, level: str
             ) -> QuantizedTensor:
    """One side's rows at ``bits``: kept when they are at ``bits`` already, else made from fp
    or the int8 base."""
    if isinstance(x, torch.Tensor):
        return requantize(quantize(x, 8), bits)
    if x.bits == bits:
        return x
    if x.bits != 8:
        raise PayloadError(f"cannot go from {src} to {level}: lower levels come from fp or the "
                           "int8 base")
    return requantize(x, bits)


def _rows(x: "torch.Tensor | QuantizedTensor", a: int, b: int) -> "torch.Tensor | QuantizedTensor":
    return x.sliced(a, b) if isinstance(x, QuantizedTensor) else x[a:b]


def joined_rows(x: "torch.Tensor | QuantizedTensor", spans: Sequence[tuple[int, int]]
                ) -> "torch.Tensor | QuantizedTensor":
    """Rows ``a..b`` of ``x`` for each span, one after another: a view for one span."""
    if len(spans) == 1:
        return _rows(x, *spans[0])
    return _cat([_rows(x, a, b) for a, b in spans])


def _cat(parts: Sequence["torch.Tensor | QuantizedTensor"]) -> "torch.Tensor | QuantizedTensor":
    q = parts[0]
    if isinstance(q, QuantizedTensor):
        return QuantizedTensor(torch.cat([p.codes for p in parts]),  # type: ignore[union-attr]
                               torch.cat([p.scale for p in parts]),  # type: ignore[union-attr]
                               torch.cat([p.zero for p in parts]),  # type: ignore[union-attr]
                               q.bits, q.dim)
    return torch.cat(list(parts))  # type: ignore[arg-type]


@dataclass
class ChunkRun:
    """Several chunks' entries at one level, one after the other in payload order: chunk after
    chunk, each chunk's heads in order (``counts [m, Hg]``), so rows ``[R, D]`` with
    ``R = counts.sum()``. What bulk operations of the memory take and give (one array operation
    per run and level); :meth:`payloads` splits it into :class:`ChunkPayload` views."""

    cids: Sequence[KVChunkId]
    level: str
    counts: np.ndarray
    pos: torch.Tensor
    k: "torch.Tensor | QuantizedTensor"
    v: "torch.Tensor | QuantizedTensor"
    dtype: torch.dtype = torch.float32

    @classmethod
    def join(cls, payloads: Sequence[ChunkPayload]) -> "ChunkRun":
        """The run of ``payloads`` (all at one level, the same number of heads)."""
        p0 = payloads[0]
        if any(p.level != p0.level for p in payloads):
            raise PayloadError("a run holds chunks of one level")
        return cls([p.cid for p in payloads], p0.level,
                   np.array([p.counts for p in payloads], dtype=np.int64).reshape(
                       len(payloads), len(p0.counts)),
                   torch.cat([p.pos.to(torch.int32) for p in payloads]),
                   _cat([p.k for p in payloads]), _cat([p.v for p in payloads]), p0.dtype)

    @classmethod
    def cat(cls, runs: Sequence["ChunkRun"]) -> "ChunkRun":
        """One run of ``runs`` (all at one level), one after the other."""
        r0 = runs[0]
        if len(runs) == 1:
            return r0
        if any(r.level != r0.level for r in runs):
            raise PayloadError("a run holds chunks of one level")
        return cls(concat([r.cids for r in runs]), r0.level,
                   np.concatenate([r.counts for r in runs]), torch.cat([r.pos for r in runs]),
                   _cat([r.k for r in runs]), _cat([r.v for r in runs]), r0.dtype)

    @property
    def rows(self) -> int:
        return int(self.counts.sum())

    def to(self, device: torch.device) -> "ChunkRun":
        """The same run with its tensors on ``device`` (itself when they are there already):
        a run read from flash, for a memory on a GPU."""
        if self.k.device == device and self.pos.device == device:
            return self
        return ChunkRun(self.cids, self.level, self.counts, self.pos.to(device),
                        self.k.to(device), self.v.to(device), self.dtype)

    def at_level(self, level: str) -> "ChunkRun":
        """The same entries at ``level`` (:func:`values_at_level`, one conversion for the run)."""
        k, v = values_at_level(self.k, self.v, self.level, level, self.dtype)
        return ChunkRun(self.cids, level, self.counts, self.pos, k, v, self.dtype)

    @cached_property
    def starts(self) -> np.ndarray:
        """``[m + 1]``: the row each chunk begins at, then the rows (computed once: cutting a
        run of ``m`` chunks into pieces took ``m`` cumulative sums of ``m``)."""
        return np.concatenate([[0], np.cumsum(self.counts.sum(axis=1))])

    def piece(self, i: int, j: int) -> "ChunkRun":
        """Chunks ``i .. j - 1`` of the run (views of its tensors)."""
        a, b = int(self.starts[i]), int(self.starts[j])
        return ChunkRun(self.cids[i:j], self.level, self.counts[i:j], self.pos[a:b],
                        _rows(self.k, a, b), _rows(self.v, a, b), self.dtype)

    def payloads(self) -> list[ChunkPayload]:
        """One payload per chunk (views of the run's tensors)."""
        out, a = [], 0
        for cid, counts in zip(self.cids, self.counts.tolist()):
            b = a + int(sum(counts))
            out.append(ChunkPayload(cid, self.level, [int(c) for c in counts], self.pos[a:b],
                                    _rows(self.k, a, b), _rows(self.v, a, b), self.dtype))
            a = b
        return out


def contiguous_positions(counts: Sequence[int], start: int) -> torch.Tensor:
    """``pos`` of a chunk whose every head holds ``start .. start + n``."""
    return torch.cat([torch.arange(start, start + n, dtype=torch.int32) for n in counts]) \
        if counts else torch.zeros(0, dtype=torch.int32)


# ---- bytes -----------------------------------------------------------------------------------------
def _values_bytes(x: "torch.Tensor | QuantizedTensor") -> bytes:
    if isinstance(x, QuantizedTensor):
        return (x.codes.contiguous().cpu().numpy().tobytes()
                + x.scale.contiguous().view(torch.int16).cpu().numpy().tobytes()
                + x.zero.contiguous().view(torch.int16).cpu().numpy().tobytes())
    t = x.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().tobytes()
    return t.numpy().tobytes()


def to_bytes(p: ChunkPayload) -> bytes:
    """The payload's byte form (module docstring)."""
    d = (p.k.dim if isinstance(p.k, QuantizedTensor) else int(p.k.shape[1])) if p.entries else 0
    if not p.entries:
        d = 0
    head = _HEAD.pack(MAGIC, VERSION, _LEVEL_CODE[p.level], _DTYPES[p.dtype], p.cid.t, p.cid.l,
                      p.cid.g, len(p.counts), d)
    body = (head + struct.pack(f"<{len(p.counts)}I", *p.counts)
            + p.pos.to(torch.int32).contiguous().cpu().numpy().tobytes()
            + _values_bytes(p.k) + _values_bytes(p.v))
    return body + struct.pack("<Q", xxhash.xxh64_intdigest(body))


def _take(buf: memoryview, pos: int, n: int, what: str) -> tuple[memoryview, int]:
    if pos + n > len(buf):
        raise PayloadError(f"chunk payload cut short in {what} ({len(buf)} bytes)")
    return buf[pos:pos + n], pos + n


def _read_values(buf: memoryview, pos: int, level: str, dtype: torch.dtype, n: int, d: int,
                 what: str) -> tuple["torch.Tensor | QuantizedTensor", int]:
    """One side's values (``what``: ``K`` or ``V``) at ``level`` from ``buf[pos:]``."""
    if level == "fp":
        size = torch.tensor([], dtype=dtype).element_size()
        raw, pos = _take(buf, pos, n * d * size, what)
        if dtype == torch.bfloat16:
            t = torch.from_numpy(np.frombuffer(raw, dtype=np.int16).copy()).view(torch.bfloat16)
        else:
            npd = {torch.float32: np.float32, torch.float16: np.float16}[dtype]
            t = torch.from_numpy(np.frombuffer(raw, dtype=npd).copy())
        return t.view(n, d), pos
    bits = SIDE_BITS[level][what == "V"]
    width = (d * bits + 7) // 8
    codes, pos = _take(buf, pos, n * width, what)
    scale, pos = _take(buf, pos, 2 * n, what)
    zero, pos = _take(buf, pos, 2 * n, what)
    q = QuantizedTensor(torch.from_numpy(np.frombuffer(codes, dtype=np.uint8).copy()).view(n, width),
                        torch.from_numpy(np.frombuffer(scale, dtype=np.int16).copy())
                        .view(torch.float16),
                        torch.from_numpy(np.frombuffer(zero, dtype=np.int16).copy())
                        .view(torch.float16), bits, d)
    return q, pos


def from_bytes(data: bytes | bytearray | memoryview, expect: KVChunkId | None = None
               ) -> ChunkPayload:
    """Parses and checks a payload; raises :class:`PayloadError` on any damage."""
    buf = memoryview(data)
    if len(buf) < _HEAD.size + 8:
        raise PayloadError(f"chunk payload cut short ({len(buf)} bytes)")
    body, stored = buf[:-8], struct.unpack("<Q", buf[-8:])[0]
    if xxhash.xxh64_intdigest(body) != stored:
        raise PayloadError("chunk payload checksum mismatch (damaged, cut short or grown)")
    magic, version, level_code, dtype_code, t, l, g, heads, d = _HEAD.unpack_from(body, 0)  # noqa: E741
    if magic != MAGIC or version != VERSION:
        raise PayloadError(f"not a chunk payload (magic {bytes(magic)!r}, version {version})")
    if level_code >= len(LEVELS) or dtype_code not in _DTYPE_OF:
        raise PayloadError("chunk payload names an unknown level or dtype")
    level, dtype = LEVELS[level_code], _DTYPE_OF[dtype_code]
    cid = KVChunkId(t, l, g)
    if expect is not None and cid != expect:
        raise PayloadError(f"the payload holds {cid}, expected {expect}")
    pos = _HEAD.size
    raw, pos = _take(body, pos, 4 * heads, "counts")
    counts = list(struct.unpack(f"<{heads}I", raw))
    n = sum(counts)
    raw, pos = _take(body, pos, 4 * n, "positions")
    positions = torch.from_numpy(np.frombuffer(raw, dtype=np.int32).copy())
    k, pos = _read_values(body, pos, level, dtype, n, d, "K")
    v, pos = _read_values(body, pos, level, dtype, n, d, "V")
    if pos != len(body):
        raise PayloadError(f"chunk payload has {len(body) - pos} trailing bytes")
    return ChunkPayload(cid, level, counts, positions, k, v, dtype)
