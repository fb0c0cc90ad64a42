"""The store, split by what it stores: frames and token ids (:class:`ChunkStore`), manifests
(:class:`ManifestStore`) and job records (:class:`JobStore`), per tenant; :class:`Store` is the
three over one backend (a directory, a Redis database), with the one operation that spans them
(:meth:`Store.delete_context`). The contracts (docs/server.md, "The store") are tested against
every implementation by tests/test_server_store.py (token ids: tests/test_server_tokens.py).

What every part promises:

* Tenants are separate namespaces: nothing of tenant A is reachable through tenant B's name, and
  names that could escape their namespace are refused (:func:`check_names`, a
  :class:`~sparkv.server.errors.StoreError`).
* Every write is atomic: a reader sees the whole value or nothing, never a prefix.
* Values are opaque bytes; a part neither parses nor checks them (the server checks frames
  against their manifest, :mod:`sparkv.server.frames`).
* Implementations are synchronous and thread-safe; the app calls them from a thread pool. A
  backend that cannot be reached raises :class:`~sparkv.server.errors.StoreError` (a 503).

The order that makes a context visible only when it is whole: every frame and the token ids are
written (and durable) before the manifest, so a half-encoded context is never listed or served;
a delete hides the manifest first, then removes the rest.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from typing import Iterable, NamedTuple

from sparkv.server.errors import StoreError

CONTEXT_ID = re.compile(r"^[0-9a-f]{32}$")
JOB_ID = re.compile(r"^[0-9a-f]{32}$")
TENANT = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
LEVEL = re.compile(r"^[a-z0-9]{1,8}$")


class ChunkKey(NamedTuple):
    """One stored frame: chunk ``(t, l, g)`` at ``level``."""

    t: int
    l: int  # noqa: E741
    g: int
    level: str

    def name(self) -> str:
        """``"t.l.g.level"``: the key's name inside a context (file name, Redis key suffix)."""
        return f"{self.t}.{self.l}.{self.g}.{self.level}"

    @classmethod
    def parse(cls, name: str) -> "ChunkKey":
        t, l, g, level = name.split(".")  # noqa: E741
        return cls(int(t), int(l), int(g), level)


class ValueTooLarge(Exception):
    """A stored frame is larger than the reader allowed (``max_bytes``): it was not read."""

    def __init__(self, key: ChunkKey, size: int, max_bytes: int) -> None:
        super().__init__(f"frame {key.name()}: {size} bytes stored, at most {max_bytes} allowed")
        self.key = key
        self.size = size
        self.max_bytes = max_bytes


def check_names(tenant: str, context_id: str | None = None, key: ChunkKey | None = None,
                job_id: str | None = None) -> None:
    """Rejects names that could escape their namespace (defence in depth: the app validates too)."""
    if not TENANT.match(tenant):
        raise StoreError(f"invalid tenant name {tenant!r}")
    if context_id is not None and not CONTEXT_ID.match(context_id):
        raise StoreError(f"invalid context id {context_id!r}")
    if job_id is not None and not JOB_ID.match(job_id):
        raise StoreError(f"invalid job id {job_id!r}")
    if key is not None:
        if min(key.t, key.l, key.g) < 0 or not LEVEL.match(key.level):
            raise StoreError(f"invalid chunk key {key!r}")


class ChunkStore(ABC):
    """A context's frames (one per :class:`ChunkKey`) and its token ids (one blob, little-endian
    ``u32`` each), with or without a manifest.

    * ``put`` and ``put_tokens`` are atomic and replace; both are durable before they return
      (the manifest is written after them), except a ``put(..., later=True)``: that frame is
      durable once the context's ``put_tokens`` returns (an encode's frames made durable
      together: one file-system sync instead of one per frame).
    * A read with ``max_bytes`` never reads more: a larger frame raises :class:`ValueTooLarge`
      (a reader that knows a frame's size from its manifest cannot be made to hold gigabytes by
      what is in the store). A file store reads only regular files inside its root: a symlink,
      a directory or a FIFO where a value should be is an ``OSError``, never followed, never
      waited on.
    * The token ids are kept beside the frames, never among them: :meth:`keys` does not see them.
    * :meth:`delete` removes every frame and the token ids of a context; call it once the
      manifest is gone (:meth:`Store.delete_context` orders the two).
    """

    @abstractmethod
    def put(self, tenant: str, context_id: str, key: ChunkKey, data: bytes, *,
            later: bool = False) -> None:
        """Stores one frame atomically (replacing an existing one); ``later``: durable once
        the context's :meth:`put_tokens` returns, not before this returns."""

    @abstractmethod
    def get(self, tenant: str, context_id: str, key: ChunkKey,
            max_bytes: int | None = None) -> bytes | None:
        """The frame, or ``None`` when absent (:class:`ValueTooLarge` over ``max_bytes``)."""

    def get_many(self, tenant: str, context_id: str, keys: Iterable[ChunkKey],
                 max_bytes: int | None = None) -> list[bytes | None]:
        """Several frames in one call (one round trip where the backend allows), each at most
        ``max_bytes``."""
        return [self.get(tenant, context_id, k, max_bytes) for k in keys]

    def get_range(self, tenant: str, context_id: str, key: ChunkKey, start: int,
                  end: int) -> bytes | None:
        """Bytes ``[start, end)`` of a frame (clipped to its length), ``None`` when absent."""
        data = self.get(tenant, context_id, key)
        return None if data is None else data[start:end]

    @abstractmethod
    def keys(self, tenant: str, context_id: str) -> set[ChunkKey]:
        """Every stored frame of a context."""

    @abstractmethod
    def put_tokens(self, tenant: str, context_id: str, data: bytes) -> None:
        """Stores the context's token ids atomically, replacing them, durable on return, and
        the frames put ``later`` before them."""

    @abstractmethod
    def get_tokens(self, tenant: str, context_id: str) -> bytes | None:
        """The token ids as stored, or ``None`` (a context encoded before they were stored, or
        no such context: the caller checks the manifest)."""

    def has_tokens(self, tenant: str, context_id: str) -> bool:
        """Whether the context's token ids are stored (without reading them where possible)."""
        return self.get_tokens(tenant, context_id) is not None

    @abstractmethod
    def delete(self, tenant: str, context_id: str) -> bool:
        """Removes every frame and the token ids of a context. ``True`` if any existed."""


class ManifestStore(ABC):
    """One manifest per context: its presence is what makes the context visible.

    * ``put`` is called last, after every frame and the token ids it names are durable; it is
      atomic, and durable on return.
    * :meth:`contexts` names exactly the contexts that have a manifest.
    * :meth:`delete` hides the context (durably) before anything else of it is removed.
    """

    @abstractmethod
    def put(self, tenant: str, context_id: str, data: bytes) -> None:
        """Makes the context visible (its frames and token ids must already be stored)."""

    @abstractmethod
    def get(self, tenant: str, context_id: str) -> bytes | None:
        """The manifest, or ``None`` when the context is not (or not yet) visible."""

    @abstractmethod
    def contexts(self, tenant: str) -> list[str]:
        """Context ids of the tenant that have a manifest, sorted."""

    @abstractmethod
    def delete(self, tenant: str, context_id: str) -> bool:
        """Removes the manifest (the context is invisible on return). ``True`` if it existed."""


class JobStore(ABC):
    """Encode job records (JSON bytes the job managers write), per tenant: what any replica
    answers ``GET /v1/jobs/{id}`` with.

    * ``put`` is atomic and replaces.
    * :meth:`ids` spans every tenant (resuming jobs at startup).
    """

    @abstractmethod
    def put(self, tenant: str, job_id: str, data: bytes) -> None:
        """Stores (replaces) a job record atomically."""

    @abstractmethod
    def get(self, tenant: str, job_id: str) -> bytes | None:
        """A job record or ``None``."""

    @abstractmethod
    def ids(self) -> list[tuple[str, str]]:
        """``(tenant, job_id)`` of every stored job record, every tenant."""

    @abstractmethod
    def delete(self, tenant: str, job_id: str) -> None:
        """Removes a job record (absent is fine)."""


class Store:
    """The three parts over one backend, named by ``url`` (what :func:`open_store` opened; no
    credentials), and the operation that spans parts: :meth:`delete_context`."""

    def __init__(self, chunks: ChunkStore, manifests: ManifestStore, jobs: JobStore,
                 url: str) -> None:
        self.chunks = chunks
        self.manifests = manifests
        self.jobs = jobs
        self.url = url

    def delete_context(self, tenant: str, context_id: str) -> bool:
        """Hides the context (its manifest goes first), then removes its frames and token ids.
        ``True`` if anything of it existed."""
        hidden = self.manifests.delete(tenant, context_id)
        removed = self.chunks.delete(tenant, context_id)
        return hidden or removed

    def ping(self) -> None:
        """Raises :class:`StoreError` when the backend cannot be reached."""

    def close(self) -> None:
        """Releases connections and files."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
