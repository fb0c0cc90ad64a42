"""The service's flash tier and this device's I/O profile.

A token chunk (16 tokens, every layer and KV group, at one level) is one **record**
(:func:`pack_token_chunk`, self-checksummed). Records live in one of two layouts:

* **segments** (``seg-<seq>.skvs``, LLMS): a batch of one context's token chunks written together
  (a call's ahead-of-time write, a reclaim) is one file, its records back to back in ascending
  token-chunk order, each starting at a multiple of the tier's ``O_DIRECT`` alignment (zero
  padding between); a chunk's :class:`~sparkv.cache.FlashRef` is ``(segment, offset, bytes)``.
  Records adjacent in a segment are read with one request (:func:`plan_runs`), so a switch reads
  at the flash's bandwidth rather than paying a per-file cost per chunk;
* **chunk files** (``<t>.skvt``, the chunk-swapping baselines: vLLM swaps block by block): one
  file per token chunk, a whole-file ref.

:class:`ServiceFlash` is a :class:`~sparkv.cache.FlashTier` (the same atomic, checksummed files and
honest ``O_DIRECT`` reads) whose writes can be **grouped**: inside ``with tier.batch():`` each write
is a temp file + rename without its own ``fsync``; leaving the block makes them durable at once (the
flash backend's :func:`~sparkv.fileio.sync_files`: ``syncfs`` of the tier's file system where
Linux has it, else one ``fsync`` per file) and ``fsync``-s the directory. Measured here: a chunk
file written alone costs ~10 ms (two ``fsync``-s), a batch of 60 costs 4-12 ms in all. The
ahead-of-time swap-out writes a call's modified chunks as one batch; a file renamed before the batch
is durable is still made of checksummed records, so a crash inside a batch leaves old files, new
files or records that fail their checksum (then recomputed), never a wrong chunk.

**Segment lifetime.** The tier counts each segment's live records (``_live``: path -> offsets).
A record dies when its chunk's flash copy is deleted (:meth:`ServiceFlash.delete` of its ref: the
chunk re-written elsewhere, forgotten, or reset by a grown context); a segment with no live record
left is deleted (inside a batch, once the batch is durable, so a crash never loses the old copy
before the new one is on flash). A reopened context adopts the records it attaches
(:meth:`ServiceFlash.records` walks every segment by its records' headers;
:meth:`ServiceFlash.keep`), then :meth:`ServiceFlash.prune` deletes the segments none of whose
records was attached.

:class:`IOProfile` is the ``T_IO`` of the IO-recompute planner: ``reads * per_file_s / threads +
bytes / read_Bps``, where a read is one request: a chunk file, or a run of adjacent records of a
segment (:func:`run_starts`). The bandwidth is the flash profile's (``sparkv bench decode`` writes
``<cache>/predictor/flash.json``: honest reads of 1 MiB files); the per-read latency, which
dominates for chunk files of a few KB, is measured once per swap directory (the paper's
install-time one-shot profile) and kept in ``<swap_dir>/io-profile.json``.

Every file here is private to the service's user (:mod:`sparkv.device.private`): a
:class:`ServiceFlash` directory is ``0700`` and its files ``0600``, as is ``io-profile.json``.

**A full disk.** A write that finds no space (``ENOSPC``, ``EDQUOT``) raises
:class:`~sparkv.device.errors.FlashFull`, naming the file system and its free bytes
(:func:`writing`); the service keeps the flash's state in a :class:`FlashHealth`.

**What a reopen trusts.** Before a file is read as records, it must be a regular file (``lstat``:
not a symlink, a FIFO, a device) whose size its records can have: a chunk file exactly its one
record's bytes, a segment at most ``max_segment_bytes`` (every token chunk of the longest context
at fp). Anything else is skipped with a logged reason (a FIFO would block the reopen for ever, a
20 GB sparse file would be walked 4 KiB at a time) and pruned like a dead segment.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import stat
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np
import torch
import xxhash

from sparkv.cache import (LEVELS, ChunkPayload, FlashRef, FlashTier, PayloadError, QuantizedTensor,
                          flash_profile_path, load_flash_profile)
from sparkv.cache.ids import ChunkIds
from sparkv.cache.levels import SIDE_BITS
from sparkv.cache.payload import ChunkRun
from sparkv.device.errors import FlashFull
from sparkv.device.hosttier import HostTier
from sparkv.device.private import FILE_MODE, private_dir, tighten
from sparkv.fileio import FlashError, atomic_write, sync_files
from sparkv.fileio import delete as delete_file
from sparkv.layout import KVChunkId

DEFAULT_READ_MBPS = 500.0
log = logging.getLogger("sparkv.device")
#: the errors of a file system with no room left
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


# ---- a full disk ---------------------------------------------------------------------------------
def no_space(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an error it was raised from) is a file system out of room."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in NO_SPACE:
            return True
        exc = exc.__cause__
    return False


def disk_of(path: str | os.PathLike[str]) -> dict[str, int | str]:
    """The file system holding ``path``: its mount point, free and total bytes."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    mount = p
    with contextlib.suppress(OSError):
        dev = os.stat(p).st_dev
        while mount != mount.parent and os.stat(mount.parent).st_dev == dev:
            mount = mount.parent
    try:
        fs = os.statvfs(p)
        free, total = fs.f_bavail * fs.f_frsize, fs.f_blocks * fs.f_frsize
    except OSError:
        free = total = -1
    return {"mount": str(mount), "free_bytes": free, "total_bytes": total}


@contextlib.contextmanager
def writing(root: str | os.PathLike[str], what: str) -> Iterator[None]:
    """Raises :class:`FlashFull` for a write in the block that found no space on ``root``'s
    file system, naming it, its free bytes and ``what`` was not kept."""
    try:
        yield
    except (OSError, FlashError) as e:
        if not no_space(e):
            raise
        d = disk_of(root)
        raise FlashFull(f"the flash is full: no space left on the file system at {d['mount']} "
                        f"(holding {root}; {d['free_bytes']} of {d['total_bytes']} bytes free): "
                        f"{what}; free space on it, or delete contexts") from e


class FlashHealth:
    """Whether the flash took the service's last write: ``ok``, or ``degraded`` since a write
    found it full (until one succeeds again). State: ``reason``, under ``_lock``."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.reason: str | None = None
        self._lock = threading.Lock()

    def failed(self, exc: BaseException) -> None:
        with self._lock:
            self.reason = str(exc)

    def ok(self) -> None:
        with self._lock:
            self.reason = None

    def to_dict(self) -> dict[str, int | str | None]:
        """``{state: ok | degraded, path, mount, free_bytes, total_bytes, reason}``."""
        with self._lock:
            reason = self.reason
        return {"state": "ok" if reason is None else "degraded", "path": str(self.root),
                **disk_of(self.root), "reason": reason}

# ---- token chunk records (a chunk file, or one record of a segment) ------------------------------
TC_MAGIC = b"SKVT"
TC_VERSION = 1
#: magic, version, level, dtype, t, first position, tokens, layers, groups, heads per group, D
_TC_HEAD = struct.Struct("<4sHBBIIIHHHH")
_DTYPE_CODE = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
_DTYPE_OF = {v: k for k, v in _DTYPE_CODE.items()}


#: a segment file: ``seg-<seq>.skvs``, ``seq`` growing with each segment a context writes
SEGMENT_SUFFIX = ".skvs"
_SEGMENT = re.compile(r"seg-(\d{1,12})\.skvs")
_CHUNK_FILE = re.compile(r"(\d{1,9})\.skvt")
#: the most bytes one read of adjacent records takes: big enough for the flash's bandwidth (1 MiB
#: reads run at ~2x 64 KiB ones here) and for a run's fixed work (its check, its page writes, its
#: fills: ~1-2 ms a run beside 4 readers, docs/device-service.md), small enough that a load's first
#: chunks arrive before its last are read and that the reader threads share a context's reads (a
#: 4K context's 50 MB is 13 runs)
RUN_BYTES = 4 << 20


def token_chunk_name(t: int) -> str:
    """The file holding token chunk ``t`` (every layer and group) in the chunk-file layout."""
    return f"{int(t)}.skvt"


def segment_name(seq: int) -> str:
    """The name of a context's ``seq``-th segment file."""
    return f"seg-{int(seq):08d}{SEGMENT_SUFFIX}"


def segment_seq(name: str) -> int | None:
    """The sequence number of a segment file's name (None for any other name)."""
    m = _SEGMENT.fullmatch(name)
    return int(m.group(1)) if m else None


def is_segment(path: str | os.PathLike[str]) -> bool:
    return segment_seq(Path(path).name) is not None


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _raw(x: torch.Tensor) -> bytes:
    x = x.detach().contiguous().cpu()
    if x.dtype in (torch.bfloat16, torch.float16):
        x = x.view(torch.int16)
    return x.numpy().tobytes()


def pack_token_chunk(payloads: Sequence[ChunkPayload]) -> bytes:
    """One token chunk's payloads (every ``(l, g)``, one level, every token kept; any order) as
    one record (:func:`pack_token_chunk_run`)."""
    if not payloads:
        raise PayloadError("a token chunk record needs at least one payload")
    ps = sorted(payloads, key=lambda p: (p.cid.l, p.cid.g))
    try:
        run = ChunkRun.join(ps)
    except PayloadError:
        raise PayloadError(f"token chunk {ps[0].cid.t}: payloads differ in level, dtype or "
                           "kept entries (the file holds whole chunks at one level)") from None
    if any(p.dtype != ps[0].dtype for p in ps):
        raise PayloadError(f"token chunk {ps[0].cid.t}: payloads differ in dtype")
    return pack_token_chunk_run(run)


def pack_token_chunk_run(run: ChunkRun) -> bytes:
    """One token chunk's chunks as one record, from a run of them in layer-major order (every
    ``(l, g)`` once, one level, every token kept: the run's rows are the record's)::

        "SKVT" | version u16 | level u8 | dtype u8 | t u32 | first position u32 | tokens u32
        | layers u16 | groups u16 | heads per group u16 | D u16
        | K | V | xxh64 u64 (of everything before it)

    ``K``/``V``: the raw values ``[layers * groups, heads * tokens, D]`` (``fp``) or their codes
    ``[layers * groups, heads * tokens, bytes per row]``, then scale and zero (fp16, per row);
    ``(l, g)`` in layer-major order. Read back with :func:`read_token_chunk_record` as views of
    the one buffer (:meth:`TokenChunkRecord.run`): a switch pays one read and a few array
    operations per run of records."""
    if not run.cids:
        raise PayloadError("a token chunk record needs at least one chunk")
    t = run.cids[0].t
    groups = max(c.g for c in run.cids) + 1
    layers = len(run.cids) // groups
    want = [KVChunkId(t, i // groups, i % groups) for i in range(layers * groups)]
    if list(run.cids) != want:
        raise PayloadError(f"token chunk {t}: the chunks are not every (layer, group), "
                           "layer-major")
    counts = np.asarray(run.counts)
    n = int(counts.flat[0]) if counts.size else 0
    if counts.size == 0 or (counts != n).any():
        raise PayloadError(f"token chunk {t}: payloads differ in level, dtype or kept "
                           "entries (the file holds whole chunks at one level)")
    hg = counts.shape[1]
    d = run.k.dim if isinstance(run.k, QuantizedTensor) else int(run.k.shape[1])
    start = int(run.pos[0]) if run.pos.numel() else 0
    head = _TC_HEAD.pack(TC_MAGIC, TC_VERSION, LEVELS.index(run.level), _DTYPE_CODE[run.dtype],
                         t, start, n, layers, groups, hg, d)
    parts = [head]
    for x in (run.k, run.v):
        if isinstance(x, QuantizedTensor):
            parts += [_raw(x.codes), _raw(x.scale), _raw(x.zero)]
        else:
            parts.append(_raw(x.to(run.dtype)))
    body = b"".join(parts)
    return body + struct.pack("<Q", xxhash.xxh64_intdigest(body))


def token_chunk_header(head: bytes) -> dict[str, int | str]:
    """The header of a token chunk record (its first bytes), checked."""
    if len(head) < _TC_HEAD.size:
        raise PayloadError("token chunk record cut short")
    magic, version, lv, dt, t, start, n, L, G, hg, d = _TC_HEAD.unpack_from(head, 0)
    if magic != TC_MAGIC or version != TC_VERSION or lv >= len(LEVELS) or dt not in _DTYPE_OF:
        raise PayloadError("not a token chunk record")
    return {"level": LEVELS[lv], "t": t, "start": start, "tokens": n, "layers": L, "groups": G,
            "heads": hg, "head_dim": d, "dtype": dt}


def token_chunk_record_bytes(h: Mapping[str, int | str]) -> int:
    """The bytes of the record whose header is ``h`` (:func:`token_chunk_header`): header, K, V
    and checksum (what :func:`pack_token_chunk` writes)."""
    rows = int(h["layers"]) * int(h["groups"]) * int(h["heads"]) * int(h["tokens"])
    d = int(h["head_dim"])
    if h["level"] == "fp":
        sides = 2 * rows * d * torch.tensor([], dtype=_DTYPE_OF[int(h["dtype"])]).element_size()
    else:
        sides = sum(rows * ((d * b + 7) // 8 + 4) for b in SIDE_BITS[str(h["level"])])
    return _TC_HEAD.size + sides + 8


def max_segment_bytes(layers: int, groups: int, heads: int, head_dim: int, chunk_tokens: int,
                      dtype: torch.dtype, max_tokens: int, align: int) -> int:
    """The largest segment a context of at most ``max_tokens`` tokens writes: a record of every
    token chunk, each at fp (the largest level), padded to ``align``."""
    rec = token_chunk_record_bytes({"layers": layers, "groups": groups, "heads": heads,
                                    "tokens": chunk_tokens, "head_dim": head_dim, "level": "fp",
                                    "dtype": _DTYPE_CODE.get(dtype, 1)})
    return -(-max_tokens // chunk_tokens) * round_up(rec, align)


def walk_segment(path: str | os.PathLike[str], align: int
                 ) -> Iterator[tuple[FlashRef, dict[str, int | str]]]:
    """The records of a segment file, in file order, by their headers (not checksum-checked:
    that is done when they are read): a record starts at a multiple of ``align``; a damaged
    header, or one whose record would run past the file's end (a torn tail), is skipped and
    the walk goes on at the next aligned offset."""
    with open(path, "rb", opener=_no_follow) as f:
        fd = f.fileno()
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return
        size = st.st_size
        off = 0
        while off + _TC_HEAD.size <= size:
            try:
                h = token_chunk_header(os.pread(fd, _TC_HEAD.size, off))
                n = token_chunk_record_bytes(h)
            except (PayloadError, KeyError):
                off += align
                continue
            if off + n > size:
                off += align
                continue
            yield FlashRef(str(path), n, off), h
            off += round_up(n, align)


@dataclass(frozen=True)
class ReadRun:
    """Records adjacent in one file, read with one request: ``nbytes`` from ``offset``;
    ``records`` ``(t, ref)`` in file order."""

    path: str
    offset: int
    nbytes: int
    records: tuple[tuple[int, FlashRef], ...]


def _adjacent(a: FlashRef, b: FlashRef, align: int) -> bool:
    """Whether record ``b`` starts where ``a``'s padded bytes end (nothing between them)."""
    return a.path == b.path and b.offset == round_up(a.end, align)


def plan_runs(refs: Mapping[int, FlashRef], align: int, cap: int = RUN_BYTES) -> list[ReadRun]:
    """The reads of token chunks ``refs``: per file, records adjacent in it (the padding between
    them aside) coalesced into runs of at most ``cap`` bytes (a larger record is a run of its
    own), ordered by their first token chunk. Chunk files are a run each."""
    by_path: dict[str, list[tuple[int, FlashRef]]] = {}
    for t, ref in refs.items():
        by_path.setdefault(ref.path, []).append((t, ref))
    runs: list[ReadRun] = []
    for path, items in by_path.items():
        items.sort(key=lambda x: x[1].offset)
        cur = [items[0]]
        for t, ref in items[1:]:
            if _adjacent(cur[-1][1], ref, align) and ref.end - cur[0][1].offset <= cap:
                cur.append((t, ref))
            else:
                runs.append(_run(path, cur))
                cur = [(t, ref)]
        runs.append(_run(path, cur))
    runs.sort(key=lambda r: min(t for t, _ in r.records))
    return runs


def _run(path: str, items: list[tuple[int, FlashRef]]) -> ReadRun:
    start = items[0][1].offset
    return ReadRun(path, start, items[-1][1].end - start, tuple(items))


def run_starts(refs: Sequence[FlashRef | None], align: int, cap: int = RUN_BYTES) -> list[int]:
    """For records read in this order (``None``: a chunk not read, which breaks a run): 1 where
    a record starts a new read, 0 where it extends the read of the one before it (as
    :func:`plan_runs` would coalesce them). What the planner counts reads by."""
    out: list[int] = []
    prev: FlashRef | None = None
    start = 0
    for ref in refs:
        if ref is None:
            out.append(0)
        elif prev is not None and _adjacent(prev, ref, align) and ref.end - start <= cap:
            out.append(0)
        else:
            out.append(1)
            start = ref.offset
        prev = ref
    return out


@dataclass
class TokenChunkRecord:
    """A token chunk record read back: its K/V values stacked over every ``(l, g)`` (layer-major),
    ``[layers * groups * heads * tokens, D]`` (``fp``) or a
    :class:`~sparkv.cache.QuantizedTensor` of as many rows: views of one buffer, the row order
    of a :class:`~sparkv.cache.payload.ChunkRun` of the token chunk's chunks (:meth:`run`, no
    object per chunk)."""

    t: int
    level: str
    layers: int
    groups: int
    heads: int
    tokens: int
    start: int
    dtype: torch.dtype
    k: "torch.Tensor | QuantizedTensor"
    v: "torch.Tensor | QuantizedTensor"

    def cids(self) -> list[KVChunkId]:
        """Its chunks, layer-major (the rows' order)."""
        return [KVChunkId(self.t, i // self.groups, i % self.groups)
                for i in range(self.layers * self.groups)]

    def run(self) -> ChunkRun:
        """The record as a run of its chunks (views of its values)."""
        m = self.layers * self.groups
        pos = torch.arange(self.start, self.start + self.tokens, dtype=torch.int32)
        return ChunkRun(self.cids(), self.level,
                        np.full((m, self.heads), self.tokens, dtype=np.int64),
                        pos.repeat(m * self.heads), self.k, self.v, self.dtype)

    @property
    def payloads(self) -> list[ChunkPayload]:
        """One payload per ``(l, g)``, layer-major (views of the values)."""
        return self.run().payloads()


class RecordHead(NamedTuple):
    """A token chunk record's header, checked with its checksum (:func:`check_records`), and
    where it lies in the buffer read."""

    t: int
    level: str
    start: int
    tokens: int
    layers: int
    groups: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    offset: int


def check_records(data: bytes | bytearray | memoryview, spans: Sequence[tuple[int, int, int]]
                  ) -> tuple[list[RecordHead], list[int]]:
    """The records of a run read into ``data``, each ``(t, offset, nbytes)`` of ``spans``
    checked as :func:`read_token_chunk_record` checks it (cut short, checksum, header, token
    chunk, length) without unpacking its values: the heads of the good ones and the token
    chunks of the others (a span past the end of ``data`` fails)."""
    buf = memoryview(data)
    good: list[RecordHead] = []
    bad: list[int] = []
    size: dict[tuple[int, ...], int] = {}
    for t, a, n in spans:
        if n < _TC_HEAD.size + 8 or a + n > len(buf) or xxhash.xxh64_intdigest(
                buf[a:a + n - 8]) != struct.unpack_from("<Q", buf, a + n - 8)[0]:
            bad.append(t)
            continue
        magic, version, lv, dt, rt, start, tok, L, G, hg, d = _TC_HEAD.unpack_from(buf, a)
        key = (lv, dt, tok, L, G, hg, d)
        if magic != TC_MAGIC or version != TC_VERSION or lv >= len(LEVELS) \
                or dt not in _DTYPE_OF or rt != t:
            bad.append(t)
            continue
        if key not in size:
            size[key] = token_chunk_record_bytes({"level": LEVELS[lv], "tokens": tok, "layers": L,
                                                  "groups": G, "heads": hg, "head_dim": d,
                                                  "dtype": dt})
        if size[key] != n:
            bad.append(t)
            continue
        good.append(RecordHead(t, LEVELS[lv], start, tok, L, G, hg, d, _DTYPE_OF[dt], a))
    return good, bad


def join_records(data: bytes | bytearray | memoryview, heads: Sequence[RecordHead]) -> ChunkRun:
    """The checked records ``heads`` of ``data`` (one level, geometry and dtype:
    :func:`check_records`) as one run of their chunks, record after record (each layer-major):
    bit for bit ``ChunkRun.cat`` of the records' own runs (:meth:`TokenChunkRecord.run`), made
    with one gather of the buffer's bytes per tensor (copies: ``data`` may be read-only) and no
    object per record."""
    shape = record_run(heads)
    k, v = (_empty_rows(shape.level, shape.rows, heads[0], side) for side in range(2))
    records_into(data, heads, k, v)
    return ChunkRun(shape.cids, shape.level, shape.counts, shape.pos, k, v, heads[0].dtype)


class RunShape(NamedTuple):
    """What a run of records holds, without its values (:func:`record_run`)."""

    cids: ChunkIds
    level: str
    counts: np.ndarray
    pos: torch.Tensor
    rows: int


def record_run(heads: Sequence[RecordHead]) -> RunShape:
    """The chunks, per-head counts, positions and rows of the run of the checked records
    ``heads`` (one level, geometry and dtype; raises :class:`PayloadError` otherwise): what
    :func:`join_records` makes, less the values (:func:`records_into` writes those)."""
    h0 = heads[0]
    if any((h.level, h.layers, h.groups, h.heads, h.head_dim, h.dtype) != (
            h0.level, h0.layers, h0.groups, h0.heads, h0.head_dim, h0.dtype) for h in heads):
        raise PayloadError("a run holds chunks of one level, geometry and dtype")
    m, hg = h0.layers * h0.groups, h0.heads
    cids = ChunkIds.grid(np.array([h.t for h in heads]), h0.layers, h0.groups)
    tokens = np.array([h.tokens for h in heads], dtype=np.int64)
    counts = np.repeat(tokens, m)[:, None].repeat(hg, axis=1)
    return RunShape(cids, h0.level, counts, _positions(heads, m * hg), int(counts.sum()))


def _empty_rows(level: str, rows: int, h: RecordHead, side: int
                ) -> torch.Tensor | QuantizedTensor:
    """New rows of one side (0: K, 1: V) of a run at ``level``."""
    if level == "fp":
        return torch.empty((rows, h.head_dim), dtype=h.dtype)
    bits = SIDE_BITS[level][side]
    w = (h.head_dim * bits + 7) // 8
    return QuantizedTensor(torch.empty((rows, w), dtype=torch.uint8),
                           torch.empty(rows, dtype=torch.float16),
                           torch.empty(rows, dtype=torch.float16), bits, h.head_dim)


def records_into(data: bytes | bytearray | memoryview, heads: Sequence[RecordHead],
                 k: torch.Tensor | QuantizedTensor, v: torch.Tensor | QuantizedTensor) -> None:
    """Writes the values of the checked records ``heads`` of ``data`` (one level, geometry and
    dtype) into ``k`` and ``v``: rows ``[R, D]`` (fp) or quantized rows (codes, scales, zeros) of
    the run :func:`record_run` describes, contiguous tensors (views of page pool rows, or new
    ones): one copy of the buffer's bytes per (record, tensor), no temporary."""
    h0 = heads[0]
    buf = np.frombuffer(data, dtype=np.uint8)
    rows = [h0.layers * h0.groups * h0.heads * h.tokens for h in heads]
    at = [h.offset + _TC_HEAD.size for h in heads]
    for x in (k, v):
        parts = [x] if isinstance(x, torch.Tensor) else [x.codes, x.scale, x.zero]
        for dst in parts:                   # values (or codes) [R, width], then per-row fields
            if not dst.is_contiguous() or dst.shape[0] != sum(rows):
                raise PayloadError("records are written into contiguous rows of the run's size")
            out = dst.view(torch.uint8).numpy().reshape(sum(rows), -1)
            width = out.shape[1]
            r0 = 0
            for i, r in enumerate(rows):
                out[r0:r0 + r] = buf[at[i]:at[i] + r * width].reshape(r, width)
                at[i] += r * width
                r0 += r


def _positions(heads: Sequence[Any], per: int) -> torch.Tensor:
    """Positions of records' rows: each record's tokens from its start, ``per`` times."""
    tokens = np.array([h.tokens for h in heads], dtype=np.int64)
    starts = np.array([h.start for h in heads], dtype=np.int64)
    if (tokens == tokens[0]).all():
        n = int(tokens[0])
        pos = np.broadcast_to((starts[:, None] + np.arange(n))[:, None, :], (len(heads), per, n))
        return torch.from_numpy(pos.astype(np.int32).reshape(-1))
    return torch.cat([torch.arange(h.start, h.start + h.tokens, dtype=torch.int32).repeat(per)
                      for h in heads])


def unpack_token_chunk(data: bytes | memoryview, t: int | None = None) -> list[ChunkPayload]:
    """The payloads of a token chunk record (:func:`pack_token_chunk`), checksum-checked, as views
    of ``data``'s arrays (layer-major). Raises :class:`PayloadError` on any damage."""
    return read_token_chunk_record(data, t).payloads


def read_token_chunk_record(data: bytes | memoryview | bytearray, t: int | None = None
                            ) -> TokenChunkRecord:
    """A token chunk record's stacked values (:class:`TokenChunkRecord`), checksum-checked
    (``data``: exactly the record, a chunk file or a slice of a segment). The values are views
    of ``data`` when it is writable (a ``bytearray`` or a view of one), else of a copy.
    Raises :class:`PayloadError` on any damage."""
    buf = memoryview(data)
    if len(buf) < _TC_HEAD.size + 8:
        raise PayloadError("token chunk record cut short")
    body = buf[:-8]
    if xxhash.xxh64_intdigest(body) != struct.unpack("<Q", buf[-8:])[0]:
        raise PayloadError("token chunk record checksum mismatch (damaged, cut short or grown)")
    h = token_chunk_header(bytes(body[:_TC_HEAD.size]))
    if t is not None and h["t"] != t:
        raise PayloadError(f"the file holds token chunk {h['t']}, expected {t}")
    if token_chunk_record_bytes(h) != len(buf):
        raise PayloadError("token chunk record has trailing bytes or is cut short")
    level, dtype = str(h["level"]), _DTYPE_OF[int(h["dtype"])]
    m = int(h["layers"]) * int(h["groups"])
    rows = m * int(h["heads"]) * int(h["tokens"])
    d = int(h["head_dim"])
    arr = np.frombuffer(body, dtype=np.uint8, offset=_TC_HEAD.size)
    flat = torch.from_numpy(arr if not buf.readonly else arr.copy())
    pos = 0

    def take(nbytes: int, tdtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        nonlocal pos
        x = flat[pos:pos + nbytes]
        pos += nbytes
        if tdtype in (torch.float16, torch.bfloat16):
            return x.view(torch.int16).view(tdtype).view(shape)
        return x.view(tdtype).view(shape)

    sides: list[torch.Tensor | QuantizedTensor] = []
    for side in range(2):
        if level == "fp":
            el = torch.tensor([], dtype=dtype).element_size()
            sides.append(take(rows * d * el, dtype, (rows, d)))
        else:
            bits = SIDE_BITS[level][side]
            width = (d * bits + 7) // 8
            sides.append(QuantizedTensor(take(rows * width, torch.uint8, (rows, width)),
                                         take(rows * 2, torch.float16, (rows,)),
                                         take(rows * 2, torch.float16, (rows,)), bits, d))
    return TokenChunkRecord(int(h["t"]), level, int(h["layers"]), int(h["groups"]),
                            int(h["heads"]), int(h["tokens"]), int(h["start"]), dtype,
                            sides[0], sides[1])


class ServiceFlash(FlashTier):
    """A context's flash tier: grouped writes, token chunk records in segments or chunk files,
    and the segments' live records (module docstring).

    Its directory is ``0700`` and its files ``0600`` (:mod:`sparkv.device.private`).

    State: ``_batch``, the files written since the outermost open :meth:`batch` (None outside
    one), and ``syncs``; ``_live`` (segment path -> offsets of its live records), ``_doomed``
    (segments wholly dead inside the open batch, deleted when it is durable) and ``_seq`` (the
    last segment number used; read from the directory on first use). A batch belongs to the
    thread that opened it: the service writes a context's files, and kills its records, from
    one thread at a time (the holder of the context's lock, or a reclaim of a context nobody
    holds, under the registry's lock). ``_lock`` guards ``_live``, ``_doomed`` and ``_seq`` all
    the same, so that a record released from another thread cannot lose a count; the loader's
    reader threads only read files and touch none of this.
    """

    file_mode = FILE_MODE

    def __init__(self, root: str | os.PathLike[str], direct: bool = True,
                 align: int | None = None, host: HostTier | None = None) -> None:
        super().__init__(private_dir(root), direct, align)
        self.host = host
        self._batch: list[Path] | None = None
        self.syncs = 0
        self._live: dict[str, set[int]] = {}
        self._doomed: list[str] = []
        self._seq: int | None = None
        self._lock = threading.Lock()

    @property
    def align(self) -> int:
        """Records start at multiples of this (the tier's ``O_DIRECT`` alignment)."""
        return self.io.align

    # ---- grouped writes --------------------------------------------------------------------------
    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Writes inside the block are made durable together when it ends
        (:func:`~sparkv.fileio.sync_files`); segments that died inside it are deleted then."""
        if self._batch is not None:     # nested: the outer block syncs
            yield
            return
        self._batch = []
        try:
            yield
        finally:
            written, self._batch = self._batch, None
            if written:
                t0 = time.perf_counter()
                with writing(self.root, "the grouped write was not made durable"):
                    sync_files(self.root, written)
                self.syncs += 1
                self.write_s += time.perf_counter() - t0
            with self._lock:
                doomed, self._doomed = self._doomed, []
            for path in doomed:
                delete_file(path)

    def write_parts(self, name: str, parts: Iterable[bytes], *, durable: bool = True) -> int:
        """:meth:`FlashTier.write_parts`; inside a batch, made durable when the batch ends.
        :class:`FlashFull` if the file system has no room (nothing is replaced)."""
        with writing(self.root, f"{self.root.name}/{name} was not written"):
            if self._batch is None:
                return super().write_parts(name, parts, durable=durable)
            n = super().write_parts(name, parts, durable=False)
        self._batch.append(self.path_for(name))
        return n

    # ---- token chunk records ---------------------------------------------------------------------
    def write_token_chunk(self, run: ChunkRun) -> FlashRef:
        """Writes one token chunk (a run of its chunks, layer-major) as one file
        (:func:`pack_token_chunk_run`); the host tier's copy of that file is replaced."""
        rec = pack_token_chunk_run(run)
        ref = self.write(token_chunk_name(run.cids[0].t), rec)
        if self.host is not None:
            self.host.put(ref.path, ref.offset, rec)
        return ref

    def write_segment(self, chunks: Sequence[ChunkRun]) -> dict[int, FlashRef]:
        """Writes token chunks (each a run of its chunks, every ``(l, g)`` layer-major) as one
        segment file: their records in ascending token-chunk order, each at an aligned offset,
        packed one at a time as the file is written. A chunk that cannot be packed is left out.
        Returns each written chunk's ref (its records are live)."""
        name = self._next_segment()
        path = str(self.path_for(name))
        refs: dict[int, FlashRef] = {}
        align = self.align
        held: list[tuple[int, bytes]] = []      # for the host tier, once the file is written

        def records() -> Iterator[bytes]:
            off = 0
            for run in sorted(chunks, key=lambda r: r.cids[0].t):
                try:
                    rec = pack_token_chunk_run(run)
                except PayloadError:
                    continue
                refs[run.cids[0].t] = FlashRef(path, len(rec), off)
                if self.host is not None:
                    held.append((off, rec))
                pad = -len(rec) % align
                yield rec
                if pad:
                    yield bytes(pad)
                off += len(rec) + pad

        self.write_parts(name, records())
        with self._lock:
            if refs:
                self._live[path] = {r.offset for r in refs.values()}
        if not refs:
            delete_file(path)
        for off, rec in held:
            self.host.put(path, off, rec)  # type: ignore[union-attr]
        return refs

    # ---- the host tier (sparkv.device.hosttier) --------------------------------------------------
    def from_host(self, refs: Sequence[FlashRef]) -> list[bytes] | None:
        """The host tier's copies of records ``refs`` (one run's), all of them, else ``None``
        (:meth:`~sparkv.device.hosttier.HostTier.get_run`)."""
        if self.host is None:
            return None
        return self.host.get_run([(ref.path, ref.offset, ref.nbytes) for ref in refs])

    def to_host(self, ref: FlashRef, data: bytes | memoryview) -> None:
        """Keeps a copy of record ``ref`` read back from flash (checked) in the host tier."""
        if self.host is not None:
            self.host.put(ref.path, ref.offset, bytes(data))

    def _next_segment(self) -> str:
        with self._lock:
            if self._seq is None:
                self._seq = max((segment_seq(p.name) or 0 for p in self.root.iterdir()),
                                default=0)
            self._seq += 1
            return segment_name(self._seq)

    def read(self, ref: FlashRef | str | os.PathLike[str]) -> bytes:
        """:meth:`FlashTier.read`; a segment record (any offset) is read as its range."""
        if isinstance(ref, FlashRef) and is_segment(ref.path):
            return self.read_range(ref.path, ref.offset, ref.nbytes)
        return super().read(ref)

    def read_token_chunk(self, ref: FlashRef, t: int | None = None
                         ) -> tuple[list[ChunkPayload], int]:
        """One honest read of a token chunk record; its payloads and the bytes read."""
        data = self.read(ref)
        return unpack_token_chunk(data, t), len(data)

    # ---- lifetime --------------------------------------------------------------------------------
    def delete(self, ref: FlashRef | str | os.PathLike[str]) -> None:
        """A chunk's flash copy is no longer wanted: a segment record dies (its segment is
        deleted with its last live record); a chunk file is deleted. Deleting a dead record
        again, or a record of a segment this tier does not count, does nothing."""
        path = ref.path if isinstance(ref, FlashRef) else str(ref)
        if self.host is not None:
            self.host.drop(path, ref.offset if isinstance(ref, FlashRef) and is_segment(path)
                           else None)
        if not is_segment(path):
            super().delete(ref)
            return
        with self._lock:
            live = self._live.get(path)
            if live is None:            # dead already (or not this tier's: left to prune)
                return
            if isinstance(ref, FlashRef):
                live.discard(ref.offset)
            else:                       # a segment named by its path: every record dies
                live.clear()
            if live:
                return
            del self._live[path]
            if self._batch is not None:
                self._doomed.append(path)
                return
        delete_file(path)

    def keep(self, ref: FlashRef) -> None:
        """Counts a segment record attached on reopen as live."""
        if is_segment(ref.path):
            with self._lock:
                self._live.setdefault(ref.path, set()).add(ref.offset)

    def prune(self) -> int:
        """Deletes the segments with no live record (after a reopen attached what it could);
        returns how many."""
        with self._lock:
            dead = [p for p in self.segments() if str(p) not in self._live]
        for p in dead:
            if self.host is not None:
                self.host.drop(str(p))
            delete_file(p)
        return len(dead)

    def live_records(self) -> dict[str, int]:
        """Segment name -> its live records."""
        with self._lock:
            return {Path(p).name: len(v) for p, v in self._live.items()}

    def segments(self) -> list[Path]:
        """The segment files, oldest first."""
        found = [(segment_seq(p.name), p) for p in self.root.iterdir()]
        numbered = [(seq, p) for seq, p in found if seq is not None]
        return [p for _, p in sorted(numbered, key=lambda x: x[0])]

    def records(self, max_segment_bytes: int | None = None
                ) -> Iterator[tuple[FlashRef, dict[str, int | str]]]:
        """Every token chunk record on flash with its header, oldest first: the chunk files
        (in the order of their token chunk), then each segment's records (oldest segment
        first), so that a later record of a token chunk supersedes an earlier one. A chunk file
        whose header is damaged, names another token chunk or whose size is not its record's
        is skipped; a file that is not a regular file, or a segment over ``max_segment_bytes``,
        is skipped with a logged reason (module docstring); files are narrowed to ``0600`` (an
        older version wrote ``0644``)."""
        files = sorted((int(m.group(1)), p) for p in self.root.iterdir()
                       if (m := _CHUNK_FILE.fullmatch(p.name)))
        for t, path in files:
            st = _regular(path, None)
            if st is None:
                continue
            try:
                with open(path, "rb", opener=_no_follow) as f:
                    head = token_chunk_header(f.read(_TC_HEAD.size))
                size = token_chunk_record_bytes(head)
            except (OSError, PayloadError, KeyError):
                continue
            tighten(path, st)
            if head["t"] == t and size == st.st_size:
                yield FlashRef(str(path), st.st_size), head
        for path in self.segments():
            if _regular(path, max_segment_bytes) is None:
                continue
            tighten(path)
            try:
                yield from walk_segment(path, self.align)
            except OSError:
                continue


def _no_follow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)


def _regular(path: Path, max_bytes: int | None) -> os.stat_result | None:
    """``path``'s ``lstat`` if it is a regular file of at most ``max_bytes`` (when given); else
    ``None``, with the reason logged."""
    try:
        st = os.lstat(path)
    except OSError as e:
        log.warning("skipping %s: %s", path, e)
        return None
    if not stat.S_ISREG(st.st_mode):
        log.warning("skipping %s: not a regular file (mode %o)", path, st.st_mode)
        return None
    if max_bytes is not None and st.st_size > max_bytes:
        log.warning("skipping %s: %d bytes, more than the records of the longest context "
                    "(%d)", path, st.st_size, max_bytes)
        return None
    return st


@dataclass
class IOProfile:
    """``T_IO(reads, bytes) = reads * per_file_s / threads + bytes / read_Bps``: ``reads`` are
    requests (a chunk file, or a run of adjacent segment records: :func:`run_starts`);
    ``per_file_s`` is the fixed cost of one (measured on small files)."""

    read_Bps: float = DEFAULT_READ_MBPS * 1e6
    per_file_s: float = 2e-4
    threads: int = 4
    source: str = "default"

    def seconds(self, reads: float, nbytes: float) -> float:
        if reads <= 0:
            return 0.0
        return reads * self.per_file_s / max(1, self.threads) + nbytes / self.read_Bps

    def to_dict(self) -> dict[str, float | int | str]:
        return asdict(self)


def measure_per_file(tier: FlashTier, file_bytes: int = 8192, files: int = 48,
                     threads: int = 4) -> float:
    """Seconds per honest read of a small file (``threads`` readers): the fixed cost a chunk
    file pays on top of its bytes."""
    blob = os.urandom(file_bytes)
    refs = [tier.write(f"io-probe-{os.getpid()}-{i}", blob) for i in range(files)]
    try:
        with ThreadPoolExecutor(max(1, threads)) as ex:
            list(ex.map(tier.read, refs[:4]))          # warm the code path
            t0 = time.perf_counter()
            list(ex.map(tier.read, refs))
            dt = time.perf_counter() - t0
    finally:
        for r in refs:
            tier.delete(r)
    return dt * max(1, threads) / files


def load_io_profile(swap_dir: str | os.PathLike[str], tier: FlashTier, threads: int = 4,
                    cache_dir: str | os.PathLike[str] | None = None,
                    measure: bool = True) -> IOProfile:
    """This device's ``T_IO``: bandwidth from the flash profile (else 500 MB/s), per-file latency
    from ``<swap_dir>/io-profile.json`` (else measured now and saved there)."""
    read_Bps = DEFAULT_READ_MBPS * 1e6
    source = "default bandwidth"
    if cache_dir is None:
        try:
            from sparkv.runtime.model import cache_dir as _cache_dir
            cache_dir = _cache_dir()
        except Exception:  # pragma: no cover - no runtime
            cache_dir = None
    if cache_dir is not None:
        prof = load_flash_profile(flash_profile_path(cache_dir))
        if prof and float(prof.get("read_MBps", 0)) > 0:
            read_Bps = float(prof["read_MBps"]) * 1e6
            source = "flash.json"
    path = Path(swap_dir) / "io-profile.json"
    per_file = None
    try:
        doc = json.loads(path.read_text())
        per_file = float(doc["per_file_s"])
    except (OSError, ValueError, KeyError):
        pass
    if per_file is None and measure:
        try:
            per_file = measure_per_file(tier, threads=threads)
            atomic_write(path, json.dumps({"per_file_s": per_file, "threads": threads,
                                           "measured_unix": time.time()}).encode(),
                         mode=FILE_MODE)
        except (OSError, FlashError) as e:       # a full flash: the default latency for now
            log.warning("cannot measure the flash's per-file latency (%s): using the default", e)
    return IOProfile(read_Bps, per_file if per_file is not None else 2e-4, threads,
                     source + (" + measured per-file latency" if per_file is not None else ""))
