"""``file:///path``: frames and manifests as files, written atomically.

Layout under the root::

    tenants/<tenant>/contexts/<context_id>/chunks/<t>.<l>.<g>.<level>   one frame per file
    tenants/<tenant>/contexts/<context_id>/tokens.u32                    token ids (u32 LE)
    tenants/<tenant>/contexts/<context_id>/manifest.json                 written last
    tenants/<tenant>/jobs/<job_id>.json                                  job records

Every write goes to a temporary file in the target directory (``.<name>.<pid>.<random>.tmp``: the
flash backend's :func:`~sparkv.fileio.atomic_write`), is flushed and ``fsync``-ed, then
renamed over the target (``os.replace``, atomic on POSIX). The token ids sit beside ``chunks/``
(never inside it, so ``list_chunks`` does not see them); ``put_tokens`` syncs the context directory
after its rename, so they are durable before the manifest. ``put_manifest`` first syncs the chunk
directory (so the renames of every chunk are durable), then writes the manifest the same way and
syncs the context directory. A crash at any point leaves either no manifest (the context is
invisible; a resumed job or a delete cleans the chunks up) or a manifest whose chunks are all on
disk.

``delete`` unlinks the manifest (and syncs), renames the context directory to a hidden
``.deleted-*`` name (atomic), then removes it.
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path
from typing import Iterable

from sparkv.fileio import atomic_write as write_atomically
from sparkv.fileio import fsync_dir
from sparkv.server.errors import StoreError
from sparkv.server.stores.base import ChunkKey, ChunkStore, check_names

MANIFEST = "manifest.json"
TOKENS = "tokens.u32"


def _fsync_dir(path: Path) -> None:
    """Makes a directory's entries durable (a failure raises; a missing directory is skipped)."""
    fsync_dir(path, strict=True)


def atomic_write(path: Path, data: bytes, fsync: bool = True) -> None:
    """Writes ``data`` to ``path`` through a temporary file and a rename (the flash backend's
    :func:`~sparkv.fileio.atomic_write`; the directory is not synced here: the callers sync
    the directories where the order matters)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, data, fsync=fsync, sync_dir=False, mode=0o640)


def _read(path: Path) -> bytes | None:
    try:
        with open(path, "rb", buffering=0) as f:
            return f.readall()
    except (FileNotFoundError, NotADirectoryError):
        return None


class FileStore(ChunkStore):
    """A :class:`ChunkStore` on a local (or mounted) file system. See the module docstring.

    Args:
        root: the store's directory (created if missing).
        fsync: sync files and directories (disable only for throwaway benchmarks).
    """

    def __init__(self, root: str | os.PathLike[str], fsync: bool = True,
                 url: str | None = None) -> None:
        self.root = Path(root).expanduser().resolve()
        self.fsync = fsync
        self.url = url or f"file://{self.root}"
        try:
            (self.root / "tenants").mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create the store directory {self.root}: {exc}") from exc
        if not os.access(self.root, os.W_OK):
            raise StoreError(f"the store directory {self.root} is not writable")

    # --- paths --------------------------------------------------------------------------------
    def _tenant_dir(self, tenant: str) -> Path:
        return self.root / "tenants" / tenant

    def _context_dir(self, tenant: str, context_id: str) -> Path:
        return self._tenant_dir(tenant) / "contexts" / context_id

    def _chunk_path(self, tenant: str, context_id: str, key: ChunkKey) -> Path:
        return self._context_dir(tenant, context_id) / "chunks" / key.name()

    # --- chunks -------------------------------------------------------------------------------
    def put_chunk(self, tenant: str, context_id: str, key: ChunkKey, data: bytes) -> None:
        check_names(tenant, context_id, key)
        try:
            atomic_write(self._chunk_path(tenant, context_id, key), data, self.fsync)
        except OSError as exc:
            raise StoreError(f"cannot write chunk {key.name()} of {context_id}: {exc}") from exc

    def get_chunk(self, tenant: str, context_id: str, key: ChunkKey) -> bytes | None:
        check_names(tenant, context_id, key)
        return _read(self._chunk_path(tenant, context_id, key))

    def get_chunks(self, tenant: str, context_id: str, keys: Iterable[ChunkKey]
                   ) -> list[bytes | None]:
        check_names(tenant, context_id)
        base = self._context_dir(tenant, context_id) / "chunks"
        out = []
        for key in keys:
            check_names(tenant, None, key)
            out.append(_read(base / key.name()))
        return out

    def get_chunk_range(self, tenant: str, context_id: str, key: ChunkKey, start: int,
                        end: int) -> bytes | None:
        check_names(tenant, context_id, key)
        try:
            with open(self._chunk_path(tenant, context_id, key), "rb", buffering=0) as f:
                f.seek(max(0, start))
                return f.read(max(0, end - start))
        except (FileNotFoundError, NotADirectoryError):
            return None

    def list_chunks(self, tenant: str, context_id: str) -> set[ChunkKey]:
        check_names(tenant, context_id)
        try:
            names = os.listdir(self._context_dir(tenant, context_id) / "chunks")
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

    # --- token ids ----------------------------------------------------------------------------
    def put_tokens(self, tenant: str, context_id: str, data: bytes) -> None:
        check_names(tenant, context_id)
        cdir = self._context_dir(tenant, context_id)
        try:
            atomic_write(cdir / TOKENS, data, self.fsync)
            if self.fsync:
                _fsync_dir(cdir)  # the rename is durable before the manifest is written
        except OSError as exc:
            raise StoreError(f"cannot write the token ids of {context_id}: {exc}") from exc

    def get_tokens(self, tenant: str, context_id: str) -> bytes | None:
        check_names(tenant, context_id)
        return _read(self._context_dir(tenant, context_id) / TOKENS)

    def has_tokens(self, tenant: str, context_id: str) -> bool:
        check_names(tenant, context_id)
        return (self._context_dir(tenant, context_id) / TOKENS).is_file()

    # --- manifests ----------------------------------------------------------------------------
    def put_manifest(self, tenant: str, context_id: str, data: bytes) -> None:
        check_names(tenant, context_id)
        cdir = self._context_dir(tenant, context_id)
        try:
            if self.fsync:
                _fsync_dir(cdir / "chunks")  # every chunk's rename is durable before the manifest
            atomic_write(cdir / MANIFEST, data, self.fsync)
            if self.fsync:
                _fsync_dir(cdir)
        except OSError as exc:
            raise StoreError(f"cannot write the manifest of {context_id}: {exc}") from exc

    def get_manifest(self, tenant: str, context_id: str) -> bytes | None:
        check_names(tenant, context_id)
        return _read(self._context_dir(tenant, context_id) / MANIFEST)

    def list_contexts(self, tenant: str) -> list[str]:
        check_names(tenant)
        base = self._tenant_dir(tenant) / "contexts"
        try:
            names = os.listdir(base)
        except FileNotFoundError:
            return []
        return sorted(n for n in names if not n.startswith(".") and (base / n / MANIFEST).is_file())

    def delete(self, tenant: str, context_id: str) -> bool:
        check_names(tenant, context_id)
        cdir = self._context_dir(tenant, context_id)
        if not cdir.exists():
            return False
        try:
            (cdir / MANIFEST).unlink(missing_ok=True)  # invisible first
            if self.fsync:
                _fsync_dir(cdir)
            trash = cdir.parent / f".deleted-{context_id}-{secrets.token_hex(4)}"
            os.replace(cdir, trash)
            shutil.rmtree(trash, ignore_errors=True)
        except FileNotFoundError:
            return True  # a concurrent delete won
        except OSError as exc:
            raise StoreError(f"cannot delete {context_id}: {exc}") from exc
        return True

    # --- jobs ---------------------------------------------------------------------------------
    def put_job(self, tenant: str, job_id: str, data: bytes) -> None:
        check_names(tenant, job_id=job_id)
        try:
            atomic_write(self._tenant_dir(tenant) / "jobs" / f"{job_id}.json", data, self.fsync)
        except OSError as exc:
            raise StoreError(f"cannot write job {job_id}: {exc}") from exc

    def get_job(self, tenant: str, job_id: str) -> bytes | None:
        check_names(tenant, job_id=job_id)
        return _read(self._tenant_dir(tenant) / "jobs" / f"{job_id}.json")

    def list_jobs(self) -> list[tuple[str, str]]:
        out = []
        base = self.root / "tenants"
        for tenant in sorted(os.listdir(base)):
            jdir = base / tenant / "jobs"
            if not jdir.is_dir():
                continue
            for name in sorted(os.listdir(jdir)):
                if name.endswith(".json") and not name.startswith("."):
                    out.append((tenant, name[:-5]))
        return out

    def delete_job(self, tenant: str, job_id: str) -> None:
        check_names(tenant, job_id=job_id)
        (self._tenant_dir(tenant) / "jobs" / f"{job_id}.json").unlink(missing_ok=True)

    def ping(self) -> None:
        if not os.access(self.root, os.W_OK):
            raise StoreError(f"the store directory {self.root} is not writable")
