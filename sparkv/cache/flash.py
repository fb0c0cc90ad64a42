"""The flash tier: chunk files on the one flash backend (:mod:`sparkv.fileio`).

A chunk's flash copy is a :class:`FlashRef`: ``nbytes`` bytes of a file from ``offset``. A
whole-file copy (this tier's chunk files) has offset 0 and the file's length; the device
service's segment files (``sparkv.device.flashio``) hold many records, each a ref at its own
aligned offset (its tier reads a segment record as a range, whatever its offset).

* **Writes are atomic** (:func:`~sparkv.fileio.atomic_write`): a temp file in the same
  directory, written, ``fsync``-ed, its pages dropped from the page cache, renamed over the final
  name, and the directory ``fsync``-ed. A crash leaves the old file or the new one, never half of
  one; a reader never sees a temp file (they are named ``.*.tmp`` and ignored).
* **Reads are honest** (:class:`~sparkv.fileio.FlashIO`): with ``O_DIRECT`` (aligned
  buffers, whole blocks of the file system's alignment, read at run time) where the file system
  allows it, else ``posix_fadvise(DONTNEED)`` before and after the read, so the page cache does
  not make flash look like RAM. :meth:`FlashTier.read` reads a ref's bytes,
  :meth:`FlashTier.read_range` any range (several adjacent records with one request); each
  counts one read.
* Every file is a :mod:`~sparkv.cache.payload` (checksummed): a file cut short or flipped is a
  clear :class:`~sparkv.cache.payload.PayloadError` on read.
* :meth:`FlashTier.measure` records this device's read and write bandwidth (MB/s, with and without
  the page cache) in a JSON file beside the predictor's profile.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TypeVar

from sparkv.fileio import FlashError, FlashIO, atomic_write, atomic_write_parts
from sparkv.fileio import delete as delete_file

#: what a read gives (bytes, or a view of its own buffer)
_Data = TypeVar("_Data", bytes, memoryview)


@dataclass(frozen=True)
class FlashRef:
    """Where a chunk's payload is: ``nbytes`` bytes of file ``path`` from ``offset`` (0, with
    the file's length: a whole file; a record of a segment file otherwise, or at offset 0 of
    one)."""

    path: str
    nbytes: int
    offset: int = 0

    @property
    def end(self) -> int:
        """The offset just past its bytes."""
        return self.offset + self.nbytes


class FlashTier:
    """Chunk files under ``root`` (created if needed).

    Args:
        root: the directory (on the device's flash; here, the work disk).
        direct: try ``O_DIRECT`` reads (falls back to ``posix_fadvise`` where refused).
        align: the ``O_DIRECT`` alignment in bytes; ``None`` reads the file system's.

    ``file_mode``: the permissions of the files it writes (a subclass may narrow them).

    State: the counters (``reads``, ``bytes_read``, ``read_s``, ``writes``, ...) are plain
    attributes updated without a lock: threads reading at once (the loader's, the per-file probe's)
    may lose an increment of these statistics, nothing else. The files need no lock: a write
    replaces a whole file atomically.
    """

    file_mode = 0o644

    def __init__(self, root: str | os.PathLike[str], direct: bool = True,
                 align: int | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.io = FlashIO(self.root, direct, align)
        self.bytes_read = self.bytes_written = self.reads = self.writes = 0
        self.read_s = self.write_s = 0.0

    @property
    def direct(self) -> bool:
        """Whether reads use ``O_DIRECT`` (False once the file system refused it)."""
        return self.io.direct

    # ---- files -----------------------------------------------------------------------------------
    def path_for(self, name: str) -> Path:
        if not name or "/" in name or name.startswith("."):
            raise FlashError(f"bad file name {name!r}")
        return self.root / name

    def write(self, name: str, data: bytes, *, durable: bool = True) -> FlashRef:
        """Writes ``data`` as file ``name`` atomically. ``durable``: ``fsync``-ed (and dropped
        from the page cache) before the rename and the directory ``fsync``-ed after it; without
        it, temp file + rename only, made durable later (a caller that groups writes)."""
        return FlashRef(str(self.path_for(name)), self.write_parts(name, (data,),
                                                                   durable=durable))

    def write_parts(self, name: str, parts: Iterable[bytes], *, durable: bool = True) -> int:
        """Writes the concatenation of ``parts`` (made one at a time: a lazy iterable never
        holds the whole file) as file ``name`` atomically, as :meth:`write` does; returns its
        bytes."""
        path = self.path_for(name)
        t0 = time.perf_counter()
        try:
            n = atomic_write_parts(path, parts, fsync=durable, drop=durable, mode=self.file_mode)
        except OSError as e:
            raise FlashError(f"cannot write {path}: {e}") from e
        self.write_s += time.perf_counter() - t0
        self.bytes_written += n
        self.writes += 1
        return n

    def read(self, ref: FlashRef | str | os.PathLike[str]) -> bytes:
        """A chunk's bytes, read past the page cache (``O_DIRECT`` or ``DONTNEED``) with one
        read: the whole file of a ref at offset 0 or given by path (all of it, so that a file
        grown past what was written fails its checksum), else ``offset .. offset + nbytes``."""
        if isinstance(ref, FlashRef) and ref.offset:
            return self.read_range(ref.path, ref.offset, ref.nbytes)
        path = Path(ref.path if isinstance(ref, FlashRef) else ref)
        return self._timed(path, lambda: self.io.read_file(path))

    def read_range(self, path: str | os.PathLike[str], offset: int, nbytes: int) -> bytes:
        """Up to ``nbytes`` of file ``path`` from ``offset`` (fewer past its end) with one
        honest read (:meth:`~sparkv.fileio.FlashIO.read_range`)."""
        return self._timed(Path(path), lambda: self.io.read_range(path, offset, nbytes))

    @contextlib.contextmanager
    def read_view(self, path: str | os.PathLike[str], offset: int, nbytes: int
                  ) -> Iterator[memoryview]:
        """:meth:`read_range` as a read-only view valid inside the block, without a copy
        (:meth:`~sparkv.fileio.FlashIO.read_view`: a run of records read at once, checked and
        written into pages straight from the read's buffer)."""
        with contextlib.ExitStack() as stack:
            yield self._timed(Path(path), lambda: stack.enter_context(
                self.io.read_view(path, offset, nbytes)))

    def _timed(self, path: Path, read: Callable[[], _Data]) -> _Data:
        """``read()``, counted (one read) and timed; an ``OSError`` becomes a
        :class:`FlashError`."""
        t0 = time.perf_counter()
        try:
            data = read()
        except FileNotFoundError as e:
            raise FlashError(f"chunk file {path} is missing") from e
        except (OSError, ValueError) as e:
            raise FlashError(f"cannot read {path}: {e}") from e
        self.read_s += time.perf_counter() - t0
        self.bytes_read += len(data)
        self.reads += 1
        return data

    def delete(self, ref: FlashRef | str | os.PathLike[str]) -> None:
        delete_file(ref.path if isinstance(ref, FlashRef) else ref)

    def files(self) -> list[Path]:
        """Chunk files (temp files excluded)."""
        return sorted(p for p in self.root.iterdir() if p.is_file() and not p.name.startswith("."))

    def stats(self) -> dict[str, Any]:
        return {"bytes_read": self.bytes_read, "bytes_written": self.bytes_written,
                "reads": self.reads, "writes": self.writes, "read_s": self.read_s,
                "write_s": self.write_s, "direct_io": self.direct}

    # ---- bandwidth -------------------------------------------------------------------------------
    def measure(self, total_bytes: int = 64 << 20, file_bytes: int = 1 << 20
                ) -> dict[str, float]:
        """Read and write bandwidth of this tier (MB/s): honest reads (as :meth:`read` does),
        and, for comparison, reads the page cache answers. Files are removed afterwards."""
        n = max(1, total_bytes // file_bytes)
        blob = os.urandom(file_bytes)
        names = [f"bw-{os.getpid()}-{i}" for i in range(n)]
        t0 = time.perf_counter()
        refs = [self.write(name, blob) for name in names]
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for r in refs:
            self.read(r)
        read_s = time.perf_counter() - t0
        for r in refs:                       # warm the page cache, then read through it
            Path(r.path).read_bytes()
        t0 = time.perf_counter()
        for r in refs:
            Path(r.path).read_bytes()
        cached_s = time.perf_counter() - t0
        for r in refs:
            self.delete(r)
        mb = n * file_bytes / 1e6
        return {"write_MBps": mb / write_s, "read_MBps": mb / read_s,
                "read_page_cache_MBps": mb / cached_s, "file_bytes": float(file_bytes),
                "files": float(n), "direct_io": float(self.direct)}


def flash_profile_path(cache_dir: str | os.PathLike[str]) -> Path:
    """Where the flash tier's measured bandwidth is kept (beside the predictor's profiles)."""
    return Path(cache_dir) / "predictor" / "flash.json"


def save_flash_profile(path: str | os.PathLike[str], figures: dict[str, float],
                       root: str | os.PathLike[str]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"root": str(root), "measured_unix": time.time(), **figures}
    atomic_write(path, json.dumps(doc, indent=1).encode())
    return path


def load_flash_profile(path: str | os.PathLike[str]) -> dict[str, float] | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
