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
during a call leaves the previous record, and the token chunk records that call wrote are either
ignored (past the record's tokens) or full chunks whose content the record's tokens determine.

:func:`reopen` makes the contexts of a restarted service from its records: each record of this
model and chunk size becomes a context whose full token chunks are its records on flash (in
segments or chunk files, the newest of each chunk), attached as clean flash copies
(:meth:`~sparkv.device.swap.SwapStore.attach`: a missing or damaged record is recomputed when the
context is called), its partial last chunk absent. Records of another model
or chunk size are left alone (not this service's to reopen). A context that cannot be reopened is
never dropped silently: a record that cannot be read (cut short, not JSON, another format or id)
or that does not make a context (token ids outside the model's vocabulary, unknown levels, no
tokens), and a context directory with no record at all (the service stopped while the context
was being made), are each a :class:`DamagedContext` in :attr:`Journal.damaged`, which the service
lists and deletes on request.

The records are ``0600`` in a ``0700`` directory (:mod:`sparkv.device.private`): they hold the
conversations' token ids.

State: the records on disk, ``writes``, ``damaged``. Locks: none; each record is written by the
holder of its context's lock (or before the context is registered), and :func:`reopen` runs before
the service takes calls.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkv.cache import ContextKV
from sparkv.device.density import LEVEL_STEP
from sparkv.device.errors import DeviceError
from sparkv.device.inputs import check_token_ids, vocab_size
from sparkv.device.levels import LevelPolicy
from sparkv.device.private import FILE_MODE, private_dir, tighten
from sparkv.device.registry import CONTEXT_ID, DeviceContext
from sparkv.device.swap import SwapStore
from sparkv.fileio import atomic_write, delete
from sparkv.layout import ChunkGeometry

FORMAT = "sparkv-device-journal/1"


@dataclass(frozen=True)
class DamagedContext:
    """A context the service could not reopen, and why."""

    id: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"id": self.id, "state": "damaged", "reason": self.reason}


class Journal:
    """Per-context records under ``root`` (module docstring)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = private_dir(root)
        self.writes = 0
        self.damaged: list[DamagedContext] = []    # what :func:`reopen` could not reopen

    def path(self, ctx_id: str) -> Path:
        return self.root / f"{ctx_id}.json"

    def write(self, ctx_id: str, record: dict[str, Any]) -> None:
        doc = {"format": FORMAT, "id": ctx_id, **record}
        atomic_write(self.path(ctx_id), json.dumps(doc, separators=(",", ":")).encode(),
                     mode=FILE_MODE)
        self.writes += 1

    def remove(self, ctx_id: str) -> None:
        delete(self.path(ctx_id), sync_dir=True)

    def ids(self) -> set[str]:
        """The context ids that have a record (readable or not)."""
        return {p.stem for p in self.root.glob("*.json") if CONTEXT_ID.fullmatch(p.stem)}

    def records(self) -> list[dict[str, Any]]:
        """Every readable record (temp files and names that are not context ids are skipped);
        the others are listed in :attr:`damaged`."""
        out = []
        self.damaged = []
        for p in sorted(self.root.glob("*.json")):
            if not CONTEXT_ID.fullmatch(p.stem):
                continue
            tighten(p)               # a record an older version wrote 0644
            try:
                doc = json.loads(p.read_text())
            except (OSError, ValueError) as e:
                self.damaged.append(DamagedContext(
                    p.stem, f"its journal record cannot be read ({type(e).__name__}: {e})"))
                continue
            if isinstance(doc, dict) and doc.get("format") == FORMAT and doc.get("id") == p.stem:
                out.append(doc)
            else:
                self.damaged.append(DamagedContext(
                    p.stem, f"its journal record is not a {FORMAT} record of this id"))
        return out


def reopen(journal: Journal, lm: Any, chunk_tokens: int, swap: SwapStore,
           levels: LevelPolicy) -> list[DeviceContext]:
    """The contexts journaled for model ``lm`` with chunks of ``chunk_tokens`` (module
    docstring), their memories holding their records on flash; what cannot be reopened goes to
    ``journal.damaged``."""
    out = []
    vocab = vocab_size(lm)
    for doc in journal.records():
        if doc.get("model") != lm.fingerprint or doc.get("chunk_tokens") not in (
                None, 0, chunk_tokens):
            continue                # another model's or chunk size's: not ours to reopen
        try:
            out.append(_reopen_one(doc, lm, chunk_tokens, swap, levels, vocab))
        except Exception as e:  # noqa: BLE001 - any record that makes no context is damaged
            journal.damaged.append(DamagedContext(
                doc["id"], f"its journal record does not make a context ({type(e).__name__}: "
                f"{e})"))
    recorded = journal.ids()
    journal.damaged += [DamagedContext(cid, "flash files without a journal record (the service "
                                            "stopped while the context was being made)")
                        for cid in swap.context_ids() if cid not in recorded]
    return out


def _reopen_one(doc: dict[str, Any], lm: Any, chunk_tokens: int, swap: SwapStore,
                levels: LevelPolicy, vocab: int) -> DeviceContext:
    """The context of one record of this model (:func:`reopen`); raises if the record does not
    make one."""
    if not check_token_ids(doc.get("tokens") or [], vocab, "tokens"):
        raise DeviceError("it holds no tokens")
    check_token_ids(doc.get("pending") or [], vocab, "pending")
    unknown = sorted({str(lv) for lv in doc.get("levels") or []} - set(LEVEL_STEP))
    if unknown:
        raise DeviceError(f"unknown levels {unknown}")
    ctx = DeviceContext.from_record(doc, swap.tier(doc["id"]))
    g = ChunkGeometry.from_config(lm.config, len(ctx.tokens), chunk_tokens)
    if len(ctx.levels) < g.num_token_chunks:
        ctx.levels = levels.assign(ctx, g)
    C = ContextKV(g, lm.dtype, lm.device, segmented=True)
    swap.attach(ctx, C)
    ctx.memory = C
    return ctx
