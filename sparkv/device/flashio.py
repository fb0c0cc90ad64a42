"""The service's flash tier and this device's I/O profile.

:class:`ServiceFlash` is a :class:`~sparkv.cache.FlashTier` (the same atomic, checksummed files
and honest ``O_DIRECT`` reads) whose writes can be **grouped**: inside ``with tier.batch():`` each
write is a temp file + rename without its own ``fsync``; leaving the block makes them durable at
once (``syncfs`` of the tier's file system where Linux has it, else one ``fsync`` per file) and
``fsync``-s the directory. Measured here: a chunk file written alone costs ~10 ms (two
``fsync``-s), a batch of 60 costs 4-12 ms in all. The ahead-of-time swap-out writes a call's
modified chunks as one batch; a file renamed before the batch is durable is still a checksummed
payload, so a crash inside a batch leaves old files, new files or files that fail their checksum
(then recomputed), never a wrong chunk.

:class:`IOProfile` is the ``T_IO`` of the IO-recompute planner: ``files * per_file_s / threads +
bytes / read_Bps``. The bandwidth is the flash profile's (``sparkv bench decode`` writes
``<cache>/predictor/flash.json``: honest reads of 1 MiB files); the per-file latency, which
dominates for chunk files of a few KB, is measured once per swap directory (the paper's
install-time one-shot profile) and kept in ``<swap_dir>/io-profile.json``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

from sparkv.cache import FlashRef, FlashTier, flash_profile_path, load_flash_profile

DEFAULT_READ_MBPS = 500.0


def _syncfs(path: Path) -> bool:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        return int(libc.syncfs(fd)) == 0
    except AttributeError:
        return False
    finally:
        os.close(fd)


class ServiceFlash(FlashTier):
    """A flash tier with grouped writes (module docstring)."""

    def __init__(self, root: str | os.PathLike[str], direct: bool = True) -> None:
        super().__init__(root, direct)
        self._batch: list[Path] | None = None
        self.syncs = 0

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Writes inside the block are made durable together when it ends."""
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
                if not _syncfs(self.root):
                    for p in written:
                        try:
                            fd = os.open(p, os.O_RDONLY)
                        except OSError:
                            continue
                        try:
                            os.fsync(fd)
                        finally:
                            os.close(fd)
                self._fsync_dir()
                self.syncs += 1
                self.write_s += time.perf_counter() - t0

    def write(self, name: str, data: bytes) -> FlashRef:
        if self._batch is None:
            return super().write(name, data)
        ref = self._write(name, data, durable=False)    # made durable when the batch ends
        self._batch.append(Path(ref.path))
        return ref


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
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"per_file_s": per_file, "threads": threads,
                                   "measured_unix": time.time()}))
        os.replace(tmp, path)
    return IOProfile(read_Bps, per_file if per_file is not None else 2e-4, threads,
                     source + (" + measured per-file latency" if per_file is not None else ""))
