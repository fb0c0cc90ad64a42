"""The one flash backend: the file I/O every flash user shares.

Its users: the flash tier's chunk files (:class:`~sparkv.cache.flash.FlashTier`), the device
service's token chunk files and journal (``sparkv.device.flashio``, ``sparkv.device.journal``),
DynaKV's page files (``sparkv.decode.store.PageFile``), the server's file store, the predictor's
saved models and quality tables, and the device service's kept responses and conversations
(``sparkv.asks.respfiles``, ``sparkv.asks.convfiles``). It sits in the vocabulary layer (beside
:mod:`sparkv.layout` and :mod:`sparkv.errors`) and imports nothing heavier than the standard
library, ``xxhash`` and :mod:`sparkv.errors`, so any layer may import it at module level (importing
``sparkv.cache`` would load transformers). What it guarantees:

* **Atomic writes** (:func:`atomic_write`, :func:`atomic_write_parts` for a file written part
  by part): a temp file beside the target
  (``.<name>.<pid>.<random>.tmp``, created exclusively; readers skip dot-files), written whole,
  ``fsync``-ed, renamed over the target, then the directory ``fsync``-ed. A failure at any step
  removes the temp file and raises: the target holds its old bytes or the new ones, never part of
  them. Writes made without ``fsync`` (grouped) are made durable together by :func:`sync_files`.
* **Honest reads** (:class:`FlashIO`, :class:`FlashFile`): ``O_DIRECT`` where the file system
  allows it (the aligned span around the bytes asked for, into an aligned buffer), else
  ``posix_fadvise(DONTNEED)`` before and after a buffered read. Either way the page cache does not
  answer, so flash does not look like RAM. A whole file (:meth:`FlashIO.read_file`) or a range
  of one (:meth:`FlashIO.read_range`: one request, however many records it holds).
* **Honest positioned writes** (:meth:`FlashFile.pwrite`): ``O_DIRECT`` when offset and length
  are aligned, else buffered, ``fdatasync``-ed and dropped from the page cache.
* **Checksums** (:func:`checksum`, :func:`verify`): XXH64; a mismatch raises
  :class:`ChecksumError` naming what failed.
* **Deletes** (:func:`delete`): a missing file is no error; the removal can be made durable.

Sizes are read at run time, never assumed (:func:`io_alignment`): the page size is
``os.sysconf("SC_PAGE_SIZE")`` (4 KiB on x86_64, 16 KiB on many aarch64 phones and some Jetson
kernels), the file system's block size ``statvfs().f_bsize`` of the directory, and the ``O_DIRECT``
alignment of offsets, lengths and buffers the larger of the two, unless given (``align=``) or set
for the whole process (``$SPARKV_IO_ALIGN``, bytes, a power of two from 512 B to 1 MiB: how the tests
force 16 KiB on a 4 KiB machine). A wrong alignment costs only the direct path: the first refused
direct read or write turns ``O_DIRECT`` off for that :class:`FlashIO`, and I/O goes through the
page cache with ``DONTNEED`` from then on.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import secrets
import threading
from pathlib import Path
from typing import Callable, Iterable, Iterator, TypeVar

_T = TypeVar("_T")

import xxhash

from sparkv.errors import SparkvError

O_DIRECT = getattr(os, "O_DIRECT", 0)
#: errors with which a file system refuses ``O_DIRECT`` (at open, or for an unaligned request)
_REFUSED = (errno.EINVAL, errno.EOPNOTSUPP)
#: aligned buffers up to this size are kept for the next request (larger ones are unmapped
#: after use, so a big read does not pin its memory): a loader's runs of records (4 MiB,
#: ``sparkv.device.flashio.RUN_BYTES``) fit
_KEEP_BUFFER = 5 << 20
#: at most this many buffers are kept (one per reader of a switch's fill)
_KEEP_COUNT = 4
#: ``$SPARKV_IO_ALIGN``: the ``O_DIRECT`` alignment of every :class:`FlashIO` made without
#: ``align=`` (bytes; unset: read per file system, :func:`io_alignment`)
ALIGN_ENV = "SPARKV_IO_ALIGN"
#: the largest alignment :class:`FlashIO` takes (bytes)
MAX_ALIGN = 1 << 20
_kept: list[mmap.mmap] = []                 # buffers of _KEEP_BUFFER + MAX_ALIGN, free
_kept_lock = threading.Lock()


def _release(view: memoryview) -> bool:
    """Releases ``view``; False when something still holds a buffer of it."""
    try:
        view.release()
        return True
    except BufferError:
        return False


def _take_kept() -> mmap.mmap:
    """A kept read buffer (a new one when none is free)."""
    with _kept_lock:
        if _kept:
            return _kept.pop()
    return mmap.mmap(-1, _KEEP_BUFFER + MAX_ALIGN)


def _give_kept(buf: mmap.mmap) -> None:
    """Returns a read buffer to the kept ones (unmapped when :data:`_KEEP_COUNT` are)."""
    with _kept_lock:
        if len(_kept) < _KEEP_COUNT:
            _kept.append(buf)
            return
    buf.close()


class FlashError(SparkvError):
    """The flash tier cannot read or write a file."""


class ChecksumError(FlashError):
    """Bytes read back from flash differ from the bytes written (damaged on flash)."""


# ---- sizes ---------------------------------------------------------------------------------------
def page_size() -> int:
    """This machine's memory page size in bytes (``SC_PAGE_SIZE``)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return mmap.PAGESIZE


def _power_of_two(n: int, low: int, high: int) -> bool:
    return low <= n <= high and n & (n - 1) == 0


def fs_block_size(path: str | os.PathLike[str]) -> int | None:
    """The block size (bytes) of the file system holding ``path`` (``statvfs().f_bsize``), or
    None when it cannot be read or is no power of two from 512 B to 64 KiB."""
    try:
        bsize = int(os.statvfs(path).f_bsize)
    except (AttributeError, OSError):
        return None
    return bsize if _power_of_two(bsize, 512, 1 << 16) else None


def io_alignment(path: str | os.PathLike[str]) -> int:
    """The ``O_DIRECT`` alignment (bytes) of offsets, lengths and buffers for files under
    ``path``: ``$SPARKV_IO_ALIGN`` when set, else the larger of the page size and the file
    system's block size (the page size alone where the block size cannot be read).

    Raises:
        ValueError: ``$SPARKV_IO_ALIGN`` is not a power of two from 512 B to 1 MiB.
    """
    forced = os.environ.get(ALIGN_ENV, "").strip()
    if forced:
        try:
            n = int(forced)
        except ValueError:
            n = -1
        if not _power_of_two(n, 512, MAX_ALIGN):
            raise ValueError(f"${ALIGN_ENV} must be a power of two from 512 to {MAX_ALIGN} "
                             f"bytes, got {forced!r}")
        return n
    return max(page_size(), fs_block_size(path) or 0)


def _address(buf: mmap.mmap) -> int:
    """The address of a mapping's first byte."""
    probe = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(probe)
    finally:
        del probe


# ---- checksums -----------------------------------------------------------------------------------
def checksum(data: bytes | bytearray | memoryview) -> int:
    """XXH64 of ``data``: what a flash user records when it writes and checks when it reads."""
    return xxhash.xxh64_intdigest(data)


def verify(data: bytes | bytearray | memoryview, expected: int, what: str) -> None:
    """Raises :class:`ChecksumError` (``"<what> fails its checksum ..."``) unless ``data`` has
    the XXH64 ``expected``."""
    if checksum(data) != expected:
        raise ChecksumError(f"{what} fails its checksum (damaged on flash)")


# ---- whole files: atomic writes, durability, deletes ---------------------------------------------
def drop_cache(fd: int) -> None:
    """Drops the file's pages from the page cache (best effort; a no-op without
    ``posix_fadvise``)."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


def fsync_dir(path: str | os.PathLike[str], strict: bool = False) -> None:
    """Makes a directory's entries (a rename, a new or removed file) durable. A missing directory
    is skipped; other failures are ignored unless ``strict``."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except FileNotFoundError:
        return
    except OSError:
        if strict:
            raise
        return
    try:
        os.fsync(fd)
    except OSError:
        if strict:
            raise
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def atomic_write(path: str | os.PathLike[str], data: bytes | bytearray | memoryview, *,
                 fsync: bool = True, sync_dir: bool = True, drop: bool = False,
                 mode: int = 0o644) -> None:
    """Writes ``data`` as ``path`` atomically (module docstring; :func:`atomic_write_parts`
    with one part)."""
    atomic_write_parts(path, (data,), fsync=fsync, sync_dir=sync_dir, drop=drop, mode=mode)


def atomic_write_parts(path: str | os.PathLike[str],
                       parts: Iterable[bytes | bytearray | memoryview], *,
                       fsync: bool = True, sync_dir: bool = True, drop: bool = False,
                       mode: int = 0o644) -> int:
    """Writes the concatenation of ``parts`` as ``path`` atomically (module docstring), one part
    at a time: a caller that makes its parts lazily (a segment of many records) never holds the
    whole file in memory. Returns the bytes written.

    Args:
        fsync: ``fsync`` the file before the rename and (``sync_dir``) its directory after it;
            without it the caller makes the write durable later (:func:`sync_files`).
        sync_dir: with ``fsync``, ``fsync`` the directory (off where a caller orders its own
            directory syncs).
        drop: drop the file's pages from the page cache once written.
        mode: the new file's permissions.

    Raises:
        OSError: nothing was replaced and no temp file is left.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    total = 0
    try:
        try:
            for part in parts:
                _write_all(fd, part)
                total += memoryview(part).nbytes
            if fsync:
                os.fsync(fd)
            if drop:
                drop_cache(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if fsync and sync_dir:
        fsync_dir(path.parent)
    return total


def _syncfs(path: str | os.PathLike[str]) -> bool:
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


def sync_files(directory: str | os.PathLike[str],
               paths: Iterable[str | os.PathLike[str]]) -> None:
    """Makes files written into ``directory`` without ``fsync`` durable together, then the
    directory: one ``syncfs`` of the file system where Linux has it, else one ``fsync`` per file
    (a file gone meanwhile is skipped)."""
    if not _syncfs(directory):
        for p in paths:
            try:
                fd = os.open(p, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_dir(directory)


def oldest_first(folder: str | os.PathLike[str], pattern: str) -> list[Path]:
    """The files of ``folder`` matching ``pattern``, least recently modified first, after
    removing the temp files of atomic writes a crash cut short (``.*.tmp``)."""
    folder = Path(folder)
    for tmp in folder.glob(".*.tmp"):
        with contextlib.suppress(OSError):
            tmp.unlink()
    return sorted(folder.glob(pattern), key=_mtime)


def read_back(folder: str | os.PathLike[str], pattern: str,
              read: Callable[[Path], _T | None]) -> Iterator[_T]:
    """What ``read`` makes of each file of ``folder`` matching ``pattern``, least recently
    modified first (:func:`oldest_first`); a file it cannot read (``None``) is removed."""
    for path in oldest_first(folder, pattern):
        got = read(path)
        if got is None:
            with contextlib.suppress(OSError):
                path.unlink()
        else:
            yield got


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def delete(path: str | os.PathLike[str], sync_dir: bool = False) -> bool:
    """Removes a file; False when it was not there. ``sync_dir``: the removal is made durable."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    if sync_dir:
        fsync_dir(Path(path).parent)
    return True


# ---- honest reads and positioned writes ----------------------------------------------------------
class FlashIO:
    """Honest I/O on one file system (module docstring).

    Args:
        where: a path on that file system (its alignment is read there).
        direct: try ``O_DIRECT``.
        align: the ``O_DIRECT`` alignment in bytes (a power of two); ``None`` reads it
            (:func:`direct_alignment`).

    State: ``direct`` (as asked and possible, then False for good once the file system refuses
    ``O_DIRECT``) and ``align`` (fixed). No lock: the aligned buffers are per thread,
    and ``direct`` only ever goes from True to False (a request racing with the switch that still
    tries ``O_DIRECT`` is refused and falls back by itself).
    """

    def __init__(self, where: str | os.PathLike[str], direct: bool = True,
                 align: int | None = None) -> None:
        self.align = int(align) if align else io_alignment(where)
        if not _power_of_two(self.align, 1, MAX_ALIGN):
            raise ValueError(f"the O_DIRECT alignment must be a power of two up to {MAX_ALIGN} "
                             f"bytes, got {self.align}")
        self.direct = bool(direct and O_DIRECT)

    def aligned(self, offset: int, nbytes: int) -> bool:
        """Whether a request may go to ``O_DIRECT`` as it is."""
        return offset % self.align == 0 and nbytes % self.align == 0

    def span(self, offset: int, nbytes: int) -> tuple[int, int]:
        """``(start, length)``: the aligned span holding bytes ``offset .. offset + nbytes``."""
        start = offset - offset % self.align
        end = -(-(offset + nbytes) // self.align) * self.align
        return start, max(end - start, self.align)

    @contextlib.contextmanager
    def buffer(self, nbytes: int) -> Iterator[memoryview]:
        """A writable view of ``nbytes`` whose address is a multiple of :attr:`align`
        (``O_DIRECT`` needs one): in a kept buffer when it fits (5 MiB plus the largest
        alignment; up to four are kept, so reads reuse pages already faulted in: a new 2 MiB
        mapping cost ~3 ms of the kernel's time per read), else in a mapping of its own,
        unmapped after use. The view is released when the block ends: nothing may keep a view
        of it past the block. A block left by an exception (whose frames may still hold views)
        does not give its buffer back: it is unmapped with its last view."""
        need = nbytes + self.align
        own = need > _KEEP_BUFFER + MAX_ALIGN
        buf = mmap.mmap(-1, need) if own else _take_kept()
        skip = -_address(buf) % self.align
        whole = memoryview(buf)
        view = whole[skip:skip + nbytes]
        done = False
        try:
            yield view
            done = True
        finally:
            done = _release(view) and _release(whole) and done
            if done and not own:
                _give_kept(buf)
            elif done:
                buf.close()

    def open(self, path: str | os.PathLike[str], create: bool = False) -> "FlashFile":
        """``path`` opened for honest I/O (``create``: read-write, created or truncated)."""
        return FlashFile(self, path, create)

    def read_file(self, path: str | os.PathLike[str]) -> bytes:
        """The whole file, read past the page cache. Raises ``OSError`` (``FileNotFoundError``
        when it is missing)."""
        with self.open(path) as f:
            return f.pread(0, f.size())

    def read_range(self, path: str | os.PathLike[str], offset: int, nbytes: int) -> bytes:
        """Up to ``nbytes`` of the file from ``offset`` (fewer at its end), read past the page
        cache with one request (``O_DIRECT`` of the aligned span around it, else ``DONTNEED``).
        Raises ``OSError`` (``FileNotFoundError`` when it is missing)."""
        if offset < 0 or nbytes < 0:
            raise ValueError(f"bad range: offset {offset}, {nbytes} bytes")
        with self.open(path) as f:
            return f.pread(offset, nbytes)

    @contextlib.contextmanager
    def read_view(self, path: str | os.PathLike[str], offset: int, nbytes: int
                  ) -> Iterator[memoryview]:
        """:meth:`read_range` as a read-only view valid inside the block, without a copy
        (:meth:`FlashFile.pread_view`)."""
        if offset < 0 or nbytes < 0:
            raise ValueError(f"bad range: offset {offset}, {nbytes} bytes")
        with self.open(path) as f, f.pread_view(offset, nbytes) as view:
            yield view


class FlashFile:
    """One file open for honest positioned I/O (:meth:`FlashIO.open`).

    State: ``dfd``, the ``O_DIRECT`` descriptor (-1 without one), opened first; ``fd``, the
    buffered one, opened when first needed (a refused or unaligned request) under ``_lock``.
    Requests are positioned (no shared offset), so threads may read and write different ranges
    at once; :meth:`close` must not race them (the owner's business).
    """

    def __init__(self, io: FlashIO, path: str | os.PathLike[str], create: bool = False) -> None:
        self.io = io
        self.path = Path(path)
        self._flags = os.O_RDWR if create else os.O_RDONLY
        self._lock = threading.Lock()
        self.fd = self.dfd = -1
        new = os.O_CREAT | os.O_TRUNC if create else 0
        if io.direct:
            try:
                self.dfd = os.open(self.path, self._flags | new | O_DIRECT, 0o644)
            except OSError as e:
                if e.errno not in _REFUSED:
                    raise
                io.direct = False
        if self.dfd < 0:
            self.fd = os.open(self.path, self._flags | new, 0o644)

    @property
    def closed(self) -> bool:
        return self.fd < 0 and self.dfd < 0

    def _buffered(self) -> int:
        with self._lock:
            if self.fd < 0:
                self.fd = os.open(self.path, self._flags)
            return self.fd

    def size(self) -> int:
        return os.fstat(self.dfd if self.dfd >= 0 else self._buffered()).st_size

    def pread(self, offset: int, nbytes: int) -> bytes:
        """Up to ``nbytes`` from ``offset`` (fewer at the end of the file), read past the page
        cache."""
        if nbytes <= 0:
            return b""
        if self.dfd >= 0 and self.io.direct:
            data = self._pread_direct(offset, nbytes)
            if data is not None:
                return data
        fd = self._buffered()
        drop_cache(fd)
        parts, got = [], 0
        while got < nbytes:
            b = os.pread(fd, min(1 << 20, nbytes - got), offset + got)
            if not b:
                break
            parts.append(b)
            got += len(b)
        drop_cache(fd)
        return b"".join(parts)

    @contextlib.contextmanager
    def pread_view(self, offset: int, nbytes: int) -> Iterator[memoryview]:
        """:meth:`pread` as a read-only view valid inside the block: with ``O_DIRECT``, of the
        aligned buffer read into (:meth:`FlashIO.buffer`: no copy out of it, which held the
        interpreter's lock ~0.5 ms per 2 MiB); else of :meth:`pread`'s bytes."""
        if nbytes > 0 and self.dfd >= 0 and self.io.direct:
            start, span = self.io.span(offset, nbytes)
            with self.io.buffer(span) as view:
                got = self._direct_into(view, start, span)
                if got is not None:
                    skip = offset - start
                    out = view[skip:max(skip, min(got, skip + nbytes))].toreadonly()
                    try:
                        yield out
                    finally:
                        _release(out)
                    return
        yield memoryview(self.pread(offset, nbytes))

    def _pread_direct(self, offset: int, nbytes: int) -> bytes | None:
        """The aligned span around the request, read with ``O_DIRECT``; None when refused."""
        start, span = self.io.span(offset, nbytes)
        skip = offset - start
        with self.io.buffer(span) as view:
            got = self._direct_into(view, start, span)
            if got is None:
                return None
            return bytes(view[skip:max(skip, min(got, skip + nbytes))])

    def _direct_into(self, view: memoryview, start: int, span: int) -> int | None:
        """Reads the aligned ``span`` from ``start`` into the aligned ``view`` with ``O_DIRECT``:
        the bytes read (fewer at the end of the file), or None when refused."""
        got = 0
        try:
            while got < span:
                n = os.preadv(self.dfd, [view[got:span]], start + got)
                got += n
                if n <= 0 or got % self.io.align:     # the end of the file
                    break
        except OSError as e:
            if e.errno not in _REFUSED:
                raise
            self.io.direct = False
            return None
        return got

    def pwrite(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        """Writes all of ``data`` at ``offset`` past the page cache: ``O_DIRECT`` when offset and
        length are aligned, else buffered, ``fdatasync``-ed and dropped."""
        n = len(data)
        if self.dfd >= 0 and self.io.direct and self.io.aligned(offset, n):
            with self.io.buffer(n) as view:
                view[:n] = data
                try:
                    got = os.pwritev(self.dfd, [view[:n]], offset)
                except OSError as e:
                    if e.errno not in _REFUSED:
                        raise
                    self.io.direct = False
                    got = -1
            if got == n:
                return
            if got >= 0:
                raise OSError(errno.EIO, f"short write: {got} of {n} bytes")
        fd = self._buffered()
        view = memoryview(data)
        done = 0
        while done < n:
            done += os.pwrite(fd, view[done:], offset + done)
        os.fdatasync(fd)
        drop_cache(fd)

    def close(self) -> None:
        for fd in (self.dfd, self.fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.dfd = -1

    def __enter__(self) -> "FlashFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
