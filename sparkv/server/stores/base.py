"""The chunk store interface: encoded frames, token ids, manifests and job records, per tenant.

A store holds, for each tenant and context id, one frame per ``(t, l, g, level)``, the context's
token ids (one blob, little-endian ``u32`` each) and one manifest. The contract (tested against
every implementation by tests/test_server_store.py, and for token ids tests/test_server_tokens.py):

* ``put_chunk`` is atomic: a reader sees the whole frame or nothing, never a prefix.
* ``put_manifest`` is called last, after every chunk and the token ids of the context are
  durable; a context is *visible* (listed, servable) only once its manifest exists, so a
  half-encoded context never is.
* The token ids are kept beside the chunks, never among them: ``list_chunks`` does not see them
  (so resuming a job or checking a manifest against its chunks is unaffected).
* ``delete`` hides the context first (the manifest goes before the chunks), then removes the rest,
  token ids included.
* Tenants are separate namespaces: nothing of tenant A is reachable through tenant B's name.
* Values are opaque bytes; the store neither parses nor checks them.

Implementations are synchronous and thread-safe; the app calls them from a thread pool.
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
    """Frames, manifests and job records of every tenant. See the module docstring."""

    url: str

    # --- chunks -------------------------------------------------------------------------------
    @abstractmethod
    def put_chunk(self, tenant: str, context_id: str, key: ChunkKey, data: bytes) -> None:
        """Stores one frame atomically (replacing an existing one)."""

    @abstractmethod
    def get_chunk(self, tenant: str, context_id: str, key: ChunkKey) -> bytes | None:
        """The frame, or ``None`` when absent."""

    def get_chunks(self, tenant: str, context_id: str, keys: Iterable[ChunkKey]
                   ) -> list[bytes | None]:
        """Several frames in one call (one round trip where the backend allows)."""
        return [self.get_chunk(tenant, context_id, k) for k in keys]

    def get_chunk_range(self, tenant: str, context_id: str, key: ChunkKey, start: int,
                        end: int) -> bytes | None:
        """Bytes ``[start, end)`` of a frame (clipped to its length), ``None`` when absent."""
        data = self.get_chunk(tenant, context_id, key)
        return None if data is None else data[start:end]

    @abstractmethod
    def list_chunks(self, tenant: str, context_id: str) -> set[ChunkKey]:
        """Every stored frame of a context, with or without a manifest."""

    # --- token ids ----------------------------------------------------------------------------
    @abstractmethod
    def put_tokens(self, tenant: str, context_id: str, data: bytes) -> None:
        """Stores the context's token ids (little-endian ``u32`` each) atomically, replacing
        them. Call it before ``put_manifest``: implementations make them durable before it."""

    @abstractmethod
    def get_tokens(self, tenant: str, context_id: str) -> bytes | None:
        """The token ids as stored, or ``None`` (a context encoded before they were stored, or
        no such context: the caller checks the manifest)."""

    def has_tokens(self, tenant: str, context_id: str) -> bool:
        """Whether the context's token ids are stored (without reading them where possible)."""
        return self.get_tokens(tenant, context_id) is not None

    # --- manifests ----------------------------------------------------------------------------
    @abstractmethod
    def put_manifest(self, tenant: str, context_id: str, data: bytes) -> None:
        """Makes the context visible. Call it last: every chunk it names (and the token ids) must
        already be stored; implementations make them durable before the manifest."""

    @abstractmethod
    def get_manifest(self, tenant: str, context_id: str) -> bytes | None:
        """The manifest, or ``None`` when the context is not (or not yet) visible."""

    @abstractmethod
    def list_contexts(self, tenant: str) -> list[str]:
        """Context ids of the tenant that have a manifest, sorted."""

    @abstractmethod
    def delete(self, tenant: str, context_id: str) -> bool:
        """Removes the manifest first, then every chunk and the token ids. ``True`` if anything
        existed."""

    # --- jobs ---------------------------------------------------------------------------------
    @abstractmethod
    def put_job(self, tenant: str, job_id: str, data: bytes) -> None:
        """Stores (replaces) a job record atomically."""

    @abstractmethod
    def get_job(self, tenant: str, job_id: str) -> bytes | None:
        """A job record or ``None``."""

    @abstractmethod
    def list_jobs(self) -> list[tuple[str, str]]:
        """``(tenant, job_id)`` of every stored job record, every tenant."""

    @abstractmethod
    def delete_job(self, tenant: str, job_id: str) -> None:
        """Removes a job record (absent is fine)."""

    # --- lifecycle ----------------------------------------------------------------------------
    def ping(self) -> None:
        """Raises :class:`StoreError` when the store cannot be reached."""

    def close(self) -> None:
        """Releases connections and files."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
