"""The flash tier: chunk files with honest I/O.

* **Writes are atomic**: a temp file in the same directory, written, ``fsync``-ed, renamed over
  the final name, and the directory ``fsync``-ed. A crash leaves the old file or the new one,
  never half of one; a reader never sees a temp file (they are named ``.*.tmp`` and ignored).
* **Reads are honest**: with ``O_DIRECT`` (aligned buffers, whole 4 KiB blocks) where the file
  system allows it, else ``posix_fadvise(DONTNEED)`` before and after the read, so the page cache
  does not make flash look like RAM. After a write the file's pages are dropped too.
* Every file is a :mod:`~sparkv.cache.payload` (checksummed): a file cut short or flipped is a
  clear :class:`~sparkv.cache.payload.PayloadError` on read.
* :meth:`FlashTier.measure` records this device's read and write bandwidth (MB/s, with and without
  the page cache) in a JSON file beside the predictor's profile.
"""

from __future__ import annotations

import json
import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkv.errors import SparkvError

BLOCK = 4096


class FlashError(SparkvError):
    """The flash tier cannot read or write a file."""


@dataclass(frozen=True)
class FlashRef:
    """Where a chunk's payload is: a file of ``nbytes`` bytes."""

    path: str
    nbytes: int


def _o_direct() -> int:
    return getattr(os, "O_DIRECT", 0)


def _drop_cache(fd: int) -> None:
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Makes a directory's entries (a rename, a new file) durable; best effort."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class FlashTier:
    """Chunk files under ``root`` (created if needed).

    Args:
        root: the directory (on the device's flash; here, the work disk).
        direct: try ``O_DIRECT`` reads (falls back to ``posix_fadvise`` where refused).
    """

    def __init__(self, root: str | os.PathLike[str], direct: bool = True) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.direct = bool(direct and _o_direct())
        self.bytes_read = 0
        self.bytes_written = 0
        self.reads = 0
        self.writes = 0
        self.read_s = 0.0
        self.write_s = 0.0

    # ---- files -----------------------------------------------------------------------------------
    def path_for(self, name: str) -> Path:
        if not name or "/" in name or name.startswith("."):
            raise FlashError(f"bad file name {name!r}")
        return self.root / name

    def write(self, name: str, data: bytes) -> FlashRef:
        """Writes ``data`` as file ``name`` atomically (temp + fsync + rename + dir fsync)."""
        return self._write(name, data, durable=True)

    def _write(self, name: str, data: bytes, durable: bool) -> FlashRef:
        """Temp file + rename; ``durable``: fsynced (and dropped from the page cache) before the
        rename and the directory fsynced after it (a subclass that groups writes syncs later)."""
        path = self.path_for(name)
        tmp = self.root / f".{name}.{os.getpid()}.tmp"
        t0 = time.perf_counter()
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                view = memoryview(data)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
                if durable:
                    os.fsync(fd)
                    _drop_cache(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            if durable:
                self._fsync_dir()
        except OSError as e:
            try:
                tmp.unlink()
            except OSError:
                pass
            raise FlashError(f"cannot write {path}: {e}") from e
        self.write_s += time.perf_counter() - t0
        self.bytes_written += len(data)
        self.writes += 1
        return FlashRef(str(path), len(data))

    def _fsync_dir(self) -> None:
        fsync_dir(self.root)

    def read(self, ref: FlashRef | str | os.PathLike[str]) -> bytes:
        """The file's bytes, read past the page cache (``O_DIRECT`` or ``DONTNEED``)."""
        path = Path(ref.path if isinstance(ref, FlashRef) else ref)
        t0 = time.perf_counter()
        try:
            data = self._read_direct(path) if self.direct else None
            if data is None:
                data = self._read_uncached(path)
        except FileNotFoundError as e:
            raise FlashError(f"chunk file {path} is missing") from e
        except OSError as e:
            raise FlashError(f"cannot read {path}: {e}") from e
        self.read_s += time.perf_counter() - t0
        self.bytes_read += len(data)
        self.reads += 1
        return data

    def _read_direct(self, path: Path) -> bytes | None:
        try:
            fd = os.open(path, os.O_RDONLY | _o_direct())
        except OSError as e:
            if e.errno in (22, 95):  # EINVAL / EOPNOTSUPP: this file system refuses O_DIRECT
                self.direct = False
                return None
            raise
        try:
            size = os.fstat(fd).st_size
            span = max(BLOCK, -(-size // BLOCK) * BLOCK)
            buf = mmap.mmap(-1, span)          # page-aligned, as O_DIRECT requires
            try:
                got = 0
                view = memoryview(buf)
                while got < size:
                    n = os.readv(fd, [view[got:span]])
                    if n <= 0:
                        break
                    got += n
                view.release()
                return bytes(buf[:min(got, size)])
            finally:
                buf.close()
        except OSError as e:
            if e.errno == 22:
                self.direct = False
                return None
            raise
        finally:
            os.close(fd)

    def _read_uncached(self, path: Path) -> bytes:
        fd = os.open(path, os.O_RDONLY)
        try:
            _drop_cache(fd)
            size = os.fstat(fd).st_size
            parts = []
            got = 0
            while got < size:
                b = os.read(fd, min(1 << 20, size - got))
                if not b:
                    break
                parts.append(b)
                got += len(b)
            _drop_cache(fd)
            return b"".join(parts)
        finally:
            os.close(fd)

    def delete(self, ref: FlashRef | str | os.PathLike[str]) -> None:
        path = Path(ref.path if isinstance(ref, FlashRef) else ref)
        try:
            path.unlink()
        except FileNotFoundError:
            pass

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
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)
    return path


def load_flash_profile(path: str | os.PathLike[str]) -> dict[str, float] | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
