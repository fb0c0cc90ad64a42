"""The service's journal: what it takes, with the flash tier, to reopen every context after a crash.

One small JSON record per context, ``<swap_dir>/journal/<id>.json``, replaced atomically (the
flash backend's :func:`~sparkv.fileio.atomic_write`: temp file + ``fsync`` + ``rename`` +
directory ``fsync``) when the context is made and when each call returns (after its
ahead-of-time swap-out), and removed when the context is deleted::

    {"format": "sparkv-device-journal/1", "id": ..., "tokens": [...], "pending": [...],
     "system_prompt": ..., "chunk_tokens": 16, "levels": ["int8", "int4", ...],
     "mass": [...], "rows": [...], "calls": 3, "last_used": 17, "created_unix": ...,
     "model": <fingerprint>}

``tokens`` are the ids whose KV the context holds (the resident text LLMS keeps for
recomputation); ``pending`` the ids decoded but not yet run through the model (the last answer
token); ``levels`` the level of each token chunk; ``mass``/``rows`` the per-token attention
statistics its density comes from. A record is the state as of the last *returned* call: a crash
during a call leaves the previous record, and the chunk files that call wrote are either ignored
(past the record's tokens) or full chunks whose content the record's tokens determine.

:func:`reopen` makes the contexts of a restarted service from its records: each record of this
model and chunk size becomes a context whose full token chunks are its chunk files, attached as
clean flash copies (:meth:`~sparkv.device.swap.SwapStore.attach`: a missing or damaged file is
recomputed when the context is called), its partial last chunk absent. Records that cannot be read
are skipped and listed in :attr:`Journal.damaged`.

State: the records on disk, ``writes``, ``damaged``. Locks: none; each record is written by the
holder of its context's lock (or before the context is registered), and :func:`reopen` runs before
the service takes calls.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from sparkv.cache import ContextKV
from sparkv.device.levels import LevelPolicy
from sparkv.device.registry import DeviceContext
from sparkv.device.swap import SwapStore
from sparkv.fileio import atomic_write, delete
from sparkv.layout import ChunkGeometry

FORMAT = "sparkv-device-journal/1"


class Journal:
    """Per-context records under ``root`` (module docstring)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.writes = 0
        self.damaged: list[Path] = []    # records :meth:`records` could not read

    def path(self, ctx_id: str) -> Path:
        return self.root / f"{ctx_id}.json"

    def write(self, ctx_id: str, record: dict[str, Any]) -> None:
        doc = {"format": FORMAT, "id": ctx_id, **record}
        atomic_write(self.path(ctx_id), json.dumps(doc, separators=(",", ":")).encode())
        self.writes += 1

    def remove(self, ctx_id: str) -> None:
        delete(self.path(ctx_id), sync_dir=True)

    def records(self) -> list[dict[str, Any]]:
        """Every readable record (temp files are skipped, damaged records listed in
        :attr:`damaged`)."""
        out = []
        self.damaged = []
        for p in sorted(self.root.glob("*.json")):
            try:
                doc = json.loads(p.read_text())
            except (OSError, ValueError):
                self.damaged.append(p)
                continue
            if doc.get("format") == FORMAT and doc.get("id") == p.stem:
                out.append(doc)
            else:
                self.damaged.append(p)
        return out


def reopen(journal: Journal, lm: Any, chunk_tokens: int, swap: SwapStore,
           levels: LevelPolicy) -> list[DeviceContext]:
    """The contexts journaled for model ``lm`` with chunks of ``chunk_tokens`` (module
    docstring), their memories holding their chunk files."""
    out = []
    for doc in journal.records():
        if doc.get("model") != lm.fingerprint or not doc.get("tokens"):
            continue
        if int(doc.get("chunk_tokens") or chunk_tokens) != chunk_tokens:
            continue
        ctx = DeviceContext.from_record(doc, swap.tier(doc["id"]))
        g = ChunkGeometry.from_config(lm.config, len(ctx.tokens), chunk_tokens)
        if len(ctx.levels) < g.num_token_chunks:
            ctx.levels = levels.assign(ctx, g)
        C = ContextKV(g, lm.dtype, lm.device, segmented=True)
        swap.attach(ctx, C)
        ctx.memory = C
        out.append(ctx)
    return out
