"""The service's flash tier and this device's I/O profile.

:class:`ServiceFlash` is a :class:`~sparkv.cache.FlashTier` (the same atomic, checksummed files and
honest ``O_DIRECT`` reads) whose writes can be **grouped**: inside ``with tier.batch():`` each write
is a temp file + rename without its own ``fsync``; leaving the block makes them durable at once (the
flash backend's :func:`~sparkv.fileio.sync_files`: ``syncfs`` of the tier's file system where
Linux has it, else one ``fsync`` per file) and ``fsync``-s the directory. Measured here: a chunk
file written alone costs ~10 ms (two ``fsync``-s), a batch of 60 costs 4-12 ms in all. The
ahead-of-time swap-out writes a call's modified chunks as one batch; a file renamed before the batch
is durable is still a checksummed payload, so a crash inside a batch leaves old files, new files or
files that fail their checksum (then recomputed), never a wrong chunk.

:class:`IOProfile` is the ``T_IO`` of the IO-recompute planner: ``files * per_file_s / threads +
bytes / read_Bps``. The bandwidth is the flash profile's (``sparkv bench decode`` writes
``<cache>/predictor/flash.json``: honest reads of 1 MiB files); the per-file latency, which
dominates for chunk files of a few KB, is measured once per swap directory (the paper's
install-time one-shot profile) and kept in ``<swap_dir>/io-profile.json``.

Every file here is private to the service's user (:mod:`sparkv.device.private`): a
:class:`ServiceFlash` directory is ``0700`` and its files ``0600``, as is ``io-profile.json``.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
import xxhash

from sparkv.cache import (LEVELS, ChunkPayload, FlashRef, FlashTier, PayloadError, QuantizedTensor,
                          flash_profile_path, load_flash_profile)
from sparkv.cache.payload import contiguous_positions
from sparkv.device.private import FILE_MODE, private_dir
from sparkv.fileio import atomic_write, sync_files
from sparkv.layout import KVChunkId

DEFAULT_READ_MBPS = 500.0

# ---- one file per token chunk ----------------------------------------------------------------------
TC_MAGIC = b"SKVT"
TC_VERSION = 1
#: magic, version, level, dtype, t, first position, tokens, layers, groups, heads per group, D
_TC_HEAD = struct.Struct("<4sHBBIIIHHHH")
_DTYPE_CODE = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
_DTYPE_OF = {v: k for k, v in _DTYPE_CODE.items()}
_BITS = {"int8": 8, "int4": 4, "int2": 2}


def token_chunk_name(t: int) -> str:
    """The file holding token chunk ``t`` (every layer and group)."""
    return f"{int(t)}.skvt"


def _raw(x: torch.Tensor) -> bytes:
    x = x.detach().contiguous().cpu()
    if x.dtype in (torch.bfloat16, torch.float16):
        x = x.view(torch.int16)
    return x.numpy().tobytes()


def pack_token_chunk(payloads: Sequence[ChunkPayload]) -> bytes:
    """One token chunk's payloads (every ``(l, g)``, one level, every token kept) as one file::

        "SKVT" | version u16 | level u8 | dtype u8 | t u32 | first position u32 | tokens u32
        | layers u16 | groups u16 | heads per group u16 | D u16
        | K | V | xxh64 u64 (of everything before it)

    ``K``/``V``: the raw values ``[layers * groups, heads * tokens, D]`` (``fp``) or their codes
    ``[layers * groups, heads * tokens, bytes per row]``, then scale and zero (fp16, per row);
    ``(l, g)`` in layer-major order. Read back with :func:`unpack_token_chunk` as views of the
    one buffer: a switch pays one read and a few array operations per token chunk."""
    if not payloads:
        raise PayloadError("a token chunk file needs at least one payload")
    ps = sorted(payloads, key=lambda p: (p.cid.l, p.cid.g))
    p0 = ps[0]
    t, level, dtype = p0.cid.t, p0.level, p0.dtype
    hg = len(p0.counts)
    n = p0.counts[0]
    layers = sorted({p.cid.l for p in ps})
    groups = sorted({p.cid.g for p in ps})
    if (len(ps) != len(layers) * len(groups) or layers != list(range(len(layers)))
            or groups != list(range(len(groups)))):
        raise PayloadError(f"token chunk {t}: the payloads are not every (layer, group)")
    for p in ps:
        if p.cid.t != t or p.level != level or p.dtype != dtype or list(p.counts) != [n] * hg:
            raise PayloadError(f"token chunk {t}: payloads differ in level, dtype or kept "
                               "entries (the file holds whole chunks at one level)")
    d = p0.k.dim if isinstance(p0.k, QuantizedTensor) else int(p0.k.shape[1])
    start = int(p0.pos[0]) if p0.pos.numel() else 0
    head = _TC_HEAD.pack(TC_MAGIC, TC_VERSION, LEVELS.index(level), _DTYPE_CODE[dtype], t, start,
                         n, len(layers), len(groups), hg, d)
    parts = [head]
    for side in ("k", "v"):
        xs = [getattr(p, side) for p in ps]
        if level == "fp":
            parts.append(_raw(torch.stack(xs)))
        else:
            parts.append(_raw(torch.stack([x.codes for x in xs])))
            parts.append(_raw(torch.stack([x.scale for x in xs])))
            parts.append(_raw(torch.stack([x.zero for x in xs])))
    body = b"".join(parts)
    return body + struct.pack("<Q", xxhash.xxh64_intdigest(body))


def token_chunk_header(head: bytes) -> dict[str, int | str]:
    """The header of a token chunk file (its first bytes), checked."""
    if len(head) < _TC_HEAD.size:
        raise PayloadError("token chunk file cut short")
    magic, version, lv, dt, t, start, n, L, G, hg, d = _TC_HEAD.unpack_from(head, 0)
    if magic != TC_MAGIC or version != TC_VERSION or lv >= len(LEVELS) or dt not in _DTYPE_OF:
        raise PayloadError("not a token chunk file")
    return {"level": LEVELS[lv], "t": t, "start": start, "tokens": n, "layers": L, "groups": G,
            "heads": hg, "head_dim": d, "dtype": dt}


@dataclass
class TokenChunkFile:
    """A token chunk file read back: its payloads (layer-major, views of one buffer) and its K/V
    values stacked over every ``(l, g)``: ``[layers * groups * heads * tokens, D]`` (``fp``) or a
    :class:`~sparkv.cache.QuantizedTensor` of as many rows (one dequantization for the chunk)."""

    t: int
    level: str
    layers: int
    groups: int
    heads: int
    tokens: int
    payloads: list[ChunkPayload]
    k: "torch.Tensor | QuantizedTensor"
    v: "torch.Tensor | QuantizedTensor"


def unpack_token_chunk(data: bytes, t: int | None = None) -> list[ChunkPayload]:
    """The payloads of a token chunk file (:func:`pack_token_chunk`), checksum-checked, as views
    of ``data``'s arrays (layer-major). Raises :class:`PayloadError` on any damage."""
    return read_token_chunk_file(data, t).payloads


def read_token_chunk_file(data: bytes, t: int | None = None) -> TokenChunkFile:
    """A token chunk file's payloads and stacked values (:class:`TokenChunkFile`),
    checksum-checked. Raises :class:`PayloadError` on any damage."""
    buf = memoryview(data)
    if len(buf) < _TC_HEAD.size + 8:
        raise PayloadError("token chunk file cut short")
    body = buf[:-8]
    if xxhash.xxh64_intdigest(body) != struct.unpack("<Q", buf[-8:])[0]:
        raise PayloadError("token chunk file checksum mismatch (damaged, cut short or grown)")
    h = token_chunk_header(bytes(body[:_TC_HEAD.size]))
    if t is not None and h["t"] != t:
        raise PayloadError(f"the file holds token chunk {h['t']}, expected {t}")
    level, dtype = str(h["level"]), _DTYPE_OF[int(h["dtype"])]
    m = int(h["layers"]) * int(h["groups"])
    rows = int(h["heads"]) * int(h["tokens"])
    d = int(h["head_dim"])
    arr = np.frombuffer(body, dtype=np.uint8, offset=_TC_HEAD.size).copy()
    flat = torch.from_numpy(arr)
    pos = 0

    def take(nbytes: int, tdtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        nonlocal pos
        if pos + nbytes > flat.numel():
            raise PayloadError("token chunk file cut short")
        x = flat[pos:pos + nbytes]
        pos += nbytes
        if tdtype in (torch.float16, torch.bfloat16):
            return x.view(torch.int16).view(tdtype).view(shape)
        return x.view(tdtype).view(shape)

    sides = []
    for _ in ("k", "v"):
        if level == "fp":
            el = torch.tensor([], dtype=dtype).element_size()
            sides.append((take(m * rows * d * el, dtype, (m, rows, d)), None, None))
        else:
            width = (d * _BITS[level] + 7) // 8
            sides.append((take(m * rows * width, torch.uint8, (m, rows, width)),
                          take(m * rows * 2, torch.float16, (m, rows)),
                          take(m * rows * 2, torch.float16, (m, rows))))
    if pos != flat.numel():
        raise PayloadError("token chunk file has trailing bytes")
    counts = [int(h["tokens"])] * int(h["heads"])
    positions = contiguous_positions(counts, int(h["start"]))
    out = []
    G = int(h["groups"])
    for i in range(m):
        vals = []
        for codes, scale, zero in sides:
            vals.append(codes[i] if scale is None else
                        QuantizedTensor(codes[i], scale[i], zero[i], _BITS[level], d))
        out.append(ChunkPayload(KVChunkId(int(h["t"]), i // G, i % G), level, list(counts),
                                positions, vals[0], vals[1], dtype))
    stacked = []
    for codes, scale, zero in sides:
        stacked.append(codes.reshape(m * rows, d) if scale is None else
                       QuantizedTensor(codes.reshape(m * rows, -1), scale.reshape(-1),
                                       zero.reshape(-1), _BITS[level], d))
    return TokenChunkFile(int(h["t"]), level, int(h["layers"]), G, int(h["heads"]),
                          int(h["tokens"]), out, stacked[0], stacked[1])


class ServiceFlash(FlashTier):
    """A flash tier with grouped writes (module docstring).

    Its directory is ``0700`` and its files ``0600`` (:mod:`sparkv.device.private`).

    State: ``_batch``, the files written since the outermost open :meth:`batch` (None outside
    one), and ``syncs``. A batch belongs to the thread that opened it: the service writes a
    context's files from one thread at a time (no lock).
    """

    file_mode = FILE_MODE

    def __init__(self, root: str | os.PathLike[str], direct: bool = True,
                 align: int | None = None) -> None:
        super().__init__(private_dir(root), direct, align)
        self._batch: list[Path] | None = None
        self.syncs = 0

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Writes inside the block are made durable together when it ends
        (:func:`~sparkv.fileio.sync_files`)."""
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
                sync_files(self.root, written)
                self.syncs += 1
                self.write_s += time.perf_counter() - t0

    def write(self, name: str, data: bytes, *, durable: bool = True) -> FlashRef:
        """:meth:`FlashTier.write`; inside a batch, made durable when the batch ends."""
        if self._batch is None:
            return super().write(name, data, durable=durable)
        ref = super().write(name, data, durable=False)
        self._batch.append(Path(ref.path))
        return ref

    def write_token_chunk(self, payloads: Sequence[ChunkPayload]) -> FlashRef:
        """Writes one token chunk's payloads as one file (:func:`pack_token_chunk`)."""
        return self.write(token_chunk_name(payloads[0].cid.t), pack_token_chunk(payloads))

    def read_token_chunk(self, ref: FlashRef, t: int | None = None
                         ) -> tuple[list[ChunkPayload], int]:
        """One honest read of a token chunk file; its payloads and the bytes read."""
        data = self.read(ref)
        return unpack_token_chunk(data, t), len(data)


@dataclass
class IOProfile:
    """``T_IO(files, bytes) = files * per_file_s / threads + bytes / read_Bps``."""

    read_Bps: float = DEFAULT_READ_MBPS * 1e6
    per_file_s: float = 2e-4
    threads: int = 4
    source: str = "default"

    def seconds(self, files: int, nbytes: int) -> float:
        if files <= 0:
            return 0.0
        return files * self.per_file_s / max(1, self.threads) + nbytes / self.read_Bps

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
        per_file = measure_per_file(tier, threads=threads)
        atomic_write(path, json.dumps({"per_file_s": per_file, "threads": threads,
                                       "measured_unix": time.time()}).encode(), mode=FILE_MODE)
    return IOProfile(read_Bps, per_file if per_file is not None else 2e-4, threads,
                     source + (" + measured per-file latency" if per_file is not None else ""))
