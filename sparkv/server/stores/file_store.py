"""``file:///path``: frames, token ids, manifests and job records as files, written atomically.

Layout under the root (:class:`FileLayout`), one part of the store per kind of file::

    tenants/<tenant>/contexts/<context_id>/chunks/<t>.<l>.<g>.<level>   FileChunks: a frame each
    tenants/<tenant>/contexts/<context_id>/tokens.u32                    FileChunks: token ids
    tenants/<tenant>/contexts/<context_id>/manifest.json                 FileManifests: last
    tenants/<tenant>/jobs/<job_id>.json                                  FileJobs

Every write goes to a temporary file in the target directory (``.<name>.<pid>.<random>.tmp``: the
flash backend's :func:`~sparkv.fileio.atomic_write`), is flushed and ``fsync``-ed, then
renamed over the target (``os.replace``, atomic on POSIX). The token ids sit beside ``chunks/``
(never inside it, so ``keys`` does not see them); ``put_tokens`` syncs the context directory
after its rename, so they are durable before the manifest. The manifest's ``put`` first syncs the
chunk directory (so the renames of every chunk are durable), then writes the manifest the same
way and syncs the context directory. A crash at any point leaves either no manifest (the context
is invisible; a resumed job or a delete cleans the chunks up) or a manifest whose chunks are all
on disk.

Deleting a context unlinks the manifest (and syncs), then renames the context directory to a
hidden ``.deleted-*`` name (atomic) and removes it.

**Reads never leave the store and never wait** (:func:`read_file`): each path component below the
root is opened with ``O_NOFOLLOW`` relative to its parent (a symlink anywhere, to ``/dev/zero``
or out of the store, is an ``OSError``, never followed), the file with ``O_NONBLOCK`` (a FIFO
does not block the open) and checked with ``fstat`` before a byte is read: anything but a regular
file is refused, and a file larger than the reader's ``max_bytes`` is :class:`ValueTooLarge`,
unread.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import stat
import threading
from pathlib import Path
from typing import Iterable, Sequence

from sparkv.fileio import atomic_write as write_atomically
from sparkv.fileio import fsync_dir, sync_files
from sparkv.server.errors import StoreError
from sparkv.server.stores.base import (ChunkKey, ChunkStore, JobStore, ManifestStore, Store,
                                       ValueTooLarge, check_names)

MANIFEST = "manifest.json"
TOKENS = "tokens.u32"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class NotARegularFile(OSError):
    """A directory, FIFO, socket or device where the store expects a file."""


class TooLarge(Exception):
    """A file over the reader's ``max_bytes`` (its size), not read."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


def _fsync_dir(path: Path) -> None:
    """Makes a directory's entries durable (a failure raises; a missing directory is skipped)."""
    fsync_dir(path, strict=True)


def atomic_write(path: Path, data: bytes, fsync: bool = True) -> None:
    """Writes ``data`` to ``path`` through a temporary file and a rename (the flash backend's
    :func:`~sparkv.fileio.atomic_write`; the directory is not synced here: the callers sync
    the directories where the order matters)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, data, fsync=fsync, sync_dir=False, mode=0o640)


def _open_dir(name: str, parent: int) -> int:
    """``name`` in the directory ``parent``, opened as a directory without following a symlink
    (a symlink is ``ELOOP``; a missing name or a file is ``FileNotFoundError`` /
    ``NotADirectoryError``)."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent)
    except NotADirectoryError:
        if stat.S_ISLNK(os.lstat(name, dir_fd=parent).st_mode):
            raise OSError(errno.ELOOP, "a symlink in the store's path", name) from None
        raise


def _open_beneath(root: Path, parts: Sequence[str]) -> int | None:
    """A descriptor of ``root/parts...`` opened for reading without following any symlink below
    ``root`` and without blocking on a FIFO; ``None`` when a component is missing."""
    fd = os.open(root, _DIR_FLAGS)
    try:
        for part in parts[:-1]:
            parent, fd = fd, -1
            try:
                fd = _open_dir(part, parent)
            finally:
                os.close(parent)
        return os.open(parts[-1], _FILE_FLAGS, dir_fd=fd)
    except (FileNotFoundError, NotADirectoryError):
        return None
    finally:
        if fd >= 0:
            os.close(fd)


def read_file(root: Path, parts: Sequence[str], max_bytes: int | None = None,
              start: int = 0, length: int | None = None) -> bytes | None:
    """The bytes of the regular file ``root/parts...`` (``length`` bytes from ``start``), or
    ``None`` when it is absent. A symlink below ``root`` (``ELOOP``) or anything but a regular
    file (:class:`NotARegularFile`) is an ``OSError``; a file over ``max_bytes`` raises
    :class:`TooLarge` before anything is read."""
    fd = _open_beneath(root, parts)
    if fd is None:
        return None
    with open(fd, "rb", buffering=0, closefd=True) as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotARegularFile(errno.EINVAL, "not a regular file", "/".join(parts))
        if max_bytes is not None and st.st_size > max_bytes:
            raise TooLarge(st.st_size)
        if length is not None:
            f.seek(start)
            return f.read(length)
        if max_bytes is None:
            return f.readall()
        data = f.read(max_bytes + 1)  # one more: a file that grew since fstat
        if len(data) > max_bytes:
            raise TooLarge(len(data))
        return data


class FileLayout:
    """Where each value lives under the root (module docstring), shared by the three parts.

    Args:
        root: the store's directory (created if missing).
        fsync: sync files and directories (disable only for throwaway benchmarks).
    """

    def __init__(self, root: str | os.PathLike[str], fsync: bool = True) -> None:
        self.root = Path(root).expanduser().resolve()
        self.fsync = fsync
        try:
            (self.root / "tenants").mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create the store directory {self.root}: {exc}") from exc
        self.check_writable()

    def check_writable(self) -> None:
        if not os.access(self.root, os.W_OK):
            raise StoreError(f"the store directory {self.root} is not writable")

    def tenant_parts(self, tenant: str) -> list[str]:
        return ["tenants", tenant]

    def context_parts(self, tenant: str, context_id: str) -> list[str]:
        return ["tenants", tenant, "contexts", context_id]

    def path(self, parts: Sequence[str]) -> Path:
        return self.root.joinpath(*parts)

    def read(self, parts: Sequence[str], what: str) -> bytes | None:
        """A manifest, token ids or a job record; what cannot be read (a symlink, a FIFO, an
        I/O error) is a :class:`StoreError` naming ``what``."""
        try:
            return read_file(self.root, parts)
        except OSError as exc:
            raise StoreError(f"cannot read {what}: {exc}") from exc

    def sync(self, parts: Sequence[str]) -> None:
        if self.fsync:
            _fsync_dir(self.path(parts))


class FileChunks(ChunkStore):
    """Frames and token ids as files (module docstring). Frames put ``later`` are written
    without ``fsync``; the context's ``put_tokens`` makes them durable together
    (:func:`~sparkv.fileio.sync_files`: one ``syncfs``, then the frames' directory)."""

    def __init__(self, layout: FileLayout) -> None:
        self.layout = layout
        self._later: dict[tuple[str, str], set[Path]] = {}
        self._lock = threading.Lock()

    def _frame(self, tenant: str, context_id: str, key: ChunkKey) -> list[str]:
        return self.layout.context_parts(tenant, context_id) + ["chunks", key.name()]

    def put(self, tenant: str, context_id: str, key: ChunkKey, data: bytes, *,
            later: bool = False) -> None:
        check_names(tenant, context_id, key)
        path = self.layout.path(self._frame(tenant, context_id, key))
        later = later and self.layout.fsync
        try:
            atomic_write(path, data, self.layout.fsync and not later)
        except OSError as exc:
            raise StoreError(f"cannot write chunk {key.name()} of {context_id}: {exc}") from exc
        if later:
            with self._lock:
                self._later.setdefault((tenant, context_id), set()).add(path)

    def _sync_later(self, tenant: str, context_id: str) -> None:
        """Makes the frames put ``later`` durable (their directory's entries too)."""
        with self._lock:
            paths = self._later.pop((tenant, context_id), set())
        if paths:
            sync_files(next(iter(paths)).parent, paths)

    def get(self, tenant: str, context_id: str, key: ChunkKey,
            max_bytes: int | None = None) -> bytes | None:
        check_names(tenant, context_id, key)
        try:
            return read_file(self.layout.root, self._frame(tenant, context_id, key), max_bytes)
        except TooLarge as exc:
            raise ValueTooLarge(key, exc.size, max_bytes or 0) from None

    def get_many(self, tenant: str, context_id: str, keys: Iterable[ChunkKey],
                 max_bytes: int | None = None) -> list[bytes | None]:
        return [self.get(tenant, context_id, key, max_bytes) for key in keys]

    def get_range(self, tenant: str, context_id: str, key: ChunkKey, start: int,
                  end: int) -> bytes | None:
        check_names(tenant, context_id, key)
        return read_file(self.layout.root, self._frame(tenant, context_id, key),
                         start=max(0, start), length=max(0, end - max(0, start)))

    def keys(self, tenant: str, context_id: str) -> set[ChunkKey]:
        check_names(tenant, context_id)
        try:
            names = os.listdir(self.layout.path(self.layout.context_parts(tenant, context_id)
                                                + ["chunks"]))
        except (FileNotFoundError, NotADirectoryError):
            return set()
        out = set()
        for name in names:
            if name.startswith("."):
                continue
            try:
                out.add(ChunkKey.parse(name))
            except ValueError:
                continue
        return out

    def put_tokens(self, tenant: str, context_id: str, data: bytes) -> None:
        check_names(tenant, context_id)
        cdir = self.layout.context_parts(tenant, context_id)
        try:
            self._sync_later(tenant, context_id)
            atomic_write(self.layout.path(cdir + [TOKENS]), data, self.layout.fsync)
            self.layout.sync(cdir)  # the rename is durable before the manifest is written
        except OSError as exc:
            raise StoreError(f"cannot write the token ids of {context_id}: {exc}") from exc

    def get_tokens(self, tenant: str, context_id: str) -> bytes | None:
        check_names(tenant, context_id)
        return self.layout.read(self.layout.context_parts(tenant, context_id) + [TOKENS],
                                f"the token ids of {context_id}")

    def has_tokens(self, tenant: str, context_id: str) -> bool:
        check_names(tenant, context_id)
        return self.layout.path(self.layout.context_parts(tenant, context_id)
                                + [TOKENS]).is_file()

    def delete(self, tenant: str, context_id: str) -> bool:
        check_names(tenant, context_id)
        with self._lock:
            self._later.pop((tenant, context_id), None)
        cdir = self.layout.path(self.layout.context_parts(tenant, context_id))
        trash = cdir.parent / f".deleted-{context_id}-{secrets.token_hex(4)}"
        try:
            os.replace(cdir, trash)
        except FileNotFoundError:
            return False  # never stored, or a concurrent delete won
        except OSError as exc:
            raise StoreError(f"cannot delete {context_id}: {exc}") from exc
        shutil.rmtree(trash, ignore_errors=True)
        return True


class FileManifests(ManifestStore):
    """Manifests as files, the last file a context gets (module docstring)."""

    def __init__(self, layout: FileLayout) -> None:
        self.layout = layout

    def put(self, tenant: str, context_id: str, data: bytes) -> None:
        check_names(tenant, context_id)
        cdir = self.layout.context_parts(tenant, context_id)
        try:
            self.layout.sync(cdir + ["chunks"])  # every chunk's rename is durable before it
            atomic_write(self.layout.path(cdir + [MANIFEST]), data, self.layout.fsync)
            self.layout.sync(cdir)
        except OSError as exc:
            raise StoreError(f"cannot write the manifest of {context_id}: {exc}") from exc

    def get(self, tenant: str, context_id: str) -> bytes | None:
        check_names(tenant, context_id)
        return self.layout.read(self.layout.context_parts(tenant, context_id) + [MANIFEST],
                                f"the manifest of {context_id}")

    def contexts(self, tenant: str) -> list[str]:
        check_names(tenant)
        base = self.layout.path(self.layout.tenant_parts(tenant) + ["contexts"])
        try:
            names = os.listdir(base)
        except FileNotFoundError:
            return []
        return sorted(n for n in names if not n.startswith(".") and (base / n / MANIFEST).is_file())

    def delete(self, tenant: str, context_id: str) -> bool:
        check_names(tenant, context_id)
        cdir = self.layout.context_parts(tenant, context_id)
        try:
            self.layout.path(cdir + [MANIFEST]).unlink()
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as exc:
            raise StoreError(f"cannot delete the manifest of {context_id}: {exc}") from exc
        try:
            self.layout.sync(cdir)  # invisible, durably, before anything else goes
        except OSError as exc:
            raise StoreError(f"cannot delete the manifest of {context_id}: {exc}") from exc
        return True


class FileJobs(JobStore):
    """Job records as files (module docstring)."""

    def __init__(self, layout: FileLayout) -> None:
        self.layout = layout

    def _record(self, tenant: str, job_id: str) -> list[str]:
        return self.layout.tenant_parts(tenant) + ["jobs", f"{job_id}.json"]

    def put(self, tenant: str, job_id: str, data: bytes) -> None:
        check_names(tenant, job_id=job_id)
        try:
            atomic_write(self.layout.path(self._record(tenant, job_id)), data, self.layout.fsync)
        except OSError as exc:
            raise StoreError(f"cannot write job {job_id}: {exc}") from exc

    def get(self, tenant: str, job_id: str) -> bytes | None:
        check_names(tenant, job_id=job_id)
        return self.layout.read(self._record(tenant, job_id), f"job {job_id}")

    def ids(self) -> list[tuple[str, str]]:
        out = []
        base = self.layout.root / "tenants"
        for tenant in sorted(os.listdir(base)):
            jdir = base / tenant / "jobs"
            if not jdir.is_dir():
                continue
            for name in sorted(os.listdir(jdir)):
                if name.endswith(".json") and not name.startswith("."):
                    out.append((tenant, name[:-5]))
        return out

    def delete(self, tenant: str, job_id: str) -> None:
        check_names(tenant, job_id=job_id)
        self.layout.path(self._record(tenant, job_id)).unlink(missing_ok=True)


class FileStore(Store):
    """A :class:`~sparkv.server.stores.base.Store` on a local (or mounted) file system: its
    three parts over one :class:`FileLayout`. See the module docstring.

    Args:
        root: the store's directory (created if missing).
        fsync: sync files and directories (disable only for throwaway benchmarks).
    """

    def __init__(self, root: str | os.PathLike[str], fsync: bool = True,
                 url: str | None = None) -> None:
        self.layout = FileLayout(root, fsync)
        super().__init__(FileChunks(self.layout), FileManifests(self.layout),
                         FileJobs(self.layout), url or f"file://{self.layout.root}")

    @property
    def root(self) -> Path:
        return self.layout.root

    def ping(self) -> None:
        self.layout.check_writable()
