"""The service's journal: what it takes, with the flash tier, to reopen every context after a crash.

One small JSON record per context, ``<swap_dir>/journal/<id>.json``, replaced atomically (the
flash backend's :func:`~sparkv.fileio.atomic_write`: temp file + ``fsync`` + ``rename`` +
directory ``fsync``) when the context is made and when each call returns (after its
ahead-of-time swap-out), and removed when the context is deleted::

    {"format": "sparkv-device-journal/1", "id": ..., "tokens": [...], "pending": [...],
     "system_prompt": ..., "chunk_tokens": 16, "levels": ["int8", "int4", ...],
     "mass": [...], "rows": [...], "calls": 3, "last_used": 17, "created_unix": ...,
     "model": <fingerprint>, "compute": "float32"}

``tokens`` are the ids whose KV the context holds (the resident text LLMS keeps for
recomputation); ``pending`` the ids decoded but not yet run through the model (the last answer
token); ``levels`` the level of each token chunk; ``mass``/``rows`` the per-token attention
statistics its density comes from. A record is the state as of the last *returned* call: a crash
during a call leaves the previous record, and the token chunk records that call wrote are either
ignored (past the record's tokens) or full chunks whose content the record's tokens determine.

:func:`reopen` makes the contexts of a restarted service from its records: each record of this
model and chunk size becomes a context, and the service's keeper gives it its memory
(:meth:`~sparkv.device.keeper.Keeper.reopen`: its full token chunks are its records on flash, in
segments or chunk files, the newest of each chunk, attached as clean flash copies by
:meth:`~sparkv.device.swap.SwapStore.attach`; a missing or damaged record is recomputed when the
context is called; its partial last chunk absent). Records of another model
or chunk size are left alone (not this service's to reopen). ``compute`` names the compute
configuration the context's KV was made in (``--dtype``, :mod:`sparkv.runtime.compute`; a record
without it was made in ``float32``): a record of another configuration is reopened with its KV
dropped (its flash copies deleted, every chunk recomputed in this configuration at its next
call) and a warning naming both, since KV of one configuration means something else in another
(docs/dtypes.md); its record then names this configuration. A context that cannot be reopened is
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
import logging
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparkv.device.density import LEVEL_STEP
from sparkv.device.errors import DeviceError, FlashFull
from sparkv.device.flashio import FlashHealth, writing
from sparkv.device.inputs import check_token_ids, vocab_size
from sparkv.device.private import FILE_MODE, private_dir, tighten
from sparkv.device.registry import CONTEXT_ID, ContextRegistry, DamagedContext, DeviceContext
from sparkv.device.swap import SwapStore
from sparkv.fileio import atomic_write, delete

if TYPE_CHECKING:
    from sparkv.device.keeper import Keeper
    from sparkv.runtime.model import LoadedModel

log = logging.getLogger("sparkv.device")

FORMAT = "sparkv-device-journal/1"
#: the compute configuration of a record that names none (journals written before records
#: named theirs: the service computed in float32)
UNNAMED_COMPUTE = "float32"
#: the largest record read back (a context of 32K tokens writes about 2 MB)
MAX_RECORD_BYTES = 64 << 20


class Journal:
    """Per-context records under ``root`` (module docstring)."""

    def __init__(self, root: str | os.PathLike[str], compute: str) -> None:
        self.root = private_dir(root)
        self.compute = compute                      # the configuration every record names
        self.writes = 0
        self.damaged: list[DamagedContext] = []    # what :func:`reopen` could not reopen

    def path(self, ctx_id: str) -> Path:
        return self.root / f"{ctx_id}.json"

    def write(self, ctx_id: str, record: dict[str, Any]) -> None:
        """Replaces ``ctx_id``'s record atomically; :class:`~sparkv.device.errors.FlashFull`
        (the old record left as it was) if the flash has no room."""
        doc = {"format": FORMAT, "id": ctx_id, **record, "compute": self.compute}
        with writing(self.root, f"context {ctx_id}'s journal record was not written"):
            atomic_write(self.path(ctx_id), json.dumps(doc, separators=(",", ":")).encode(),
                         mode=FILE_MODE)
        self.writes += 1

    def read(self, ctx_id: str) -> dict[str, Any]:
        """``ctx_id``'s record; :class:`DeviceError` if it cannot be read (not a regular file,
        larger than :data:`MAX_RECORD_BYTES`, not JSON) or is not a record of this format and
        id."""
        p = self.path(ctx_id)
        tighten(p)               # a record an older version wrote 0644
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_RECORD_BYTES:
                    raise DeviceError(f"its journal record is not a regular file of at most "
                                      f"{MAX_RECORD_BYTES} bytes")
                doc = json.loads(f.read())
        except (OSError, ValueError) as e:
            raise DeviceError(f"its journal record cannot be read ({type(e).__name__}: {e})"
                              ) from e
        if isinstance(doc, dict) and doc.get("format") == FORMAT and doc.get("id") == ctx_id:
            return doc
        raise DeviceError(f"its journal record is not a {FORMAT} record of this id")

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
            try:
                out.append(self.read(p.stem))
            except DeviceError as e:
                self.damaged.append(DamagedContext(p.stem, str(e)))
        return out


def reopen(journal: Journal, lm: LoadedModel, chunk_tokens: int, swap: SwapStore,
           keeper: "Keeper") -> list[DeviceContext]:
    """The contexts journaled for model ``lm`` with chunks of ``chunk_tokens`` (module
    docstring), their memories given by ``keeper`` (their records on flash); what cannot be
    reopened goes to ``journal.damaged``."""
    out = []
    vocab = vocab_size(lm)
    for doc in journal.records():
        if doc.get("model") != lm.fingerprint or doc.get("chunk_tokens") not in (
                None, 0, chunk_tokens):
            continue                # another model's or chunk size's: not ours to reopen
        try:
            ctx = context_of(doc, vocab, swap)
            keeper.reopen(ctx, [str(lv) for lv in doc.get("levels") or []])
            made_in = str(doc.get("compute") or UNNAMED_COMPUTE)
            if made_in != journal.compute:
                _recompute(ctx, made_in, journal, keeper, lm.fingerprint)
            out.append(ctx)
        except Exception as e:  # noqa: BLE001 - any record that makes no context is damaged
            journal.damaged.append(DamagedContext(
                doc["id"], f"its journal record does not make a context ({type(e).__name__}: "
                f"{e})"))
    recorded = journal.ids()
    journal.damaged += [DamagedContext(cid, "flash files without a journal record (the service "
                                            "stopped while the context was being made)")
                        for cid in swap.context_ids() if cid not in recorded]
    return out


def _recompute(ctx: DeviceContext, made_in: str, journal: Journal, keeper: "Keeper",
               fingerprint: str) -> None:
    """Drops the KV of ``ctx``, made in configuration ``made_in`` (not the journal's): every
    chunk absent, recomputed at its next call; its record then names the journal's."""
    keeper.drop_flash(ctx)
    journal.write(ctx.id, ctx.record(fingerprint))
    log.warning("context %s: its KV was made in compute configuration %s, this service computes "
                "in %s (--dtype): its flash copies are dropped and its %d tokens recomputed at "
                "its next call", ctx.id, made_in, journal.compute, len(ctx.tokens))


def commit(ctx: DeviceContext, keeper: "Keeper", journal: Journal | None, health: FlashHealth,
           fingerprint: str) -> int:
    """Makes a returned call (or a new context) durable: its modified token chunks written
    ahead of time (one grouped write), then its record; returns the bytes written ahead.
    :class:`~sparkv.device.errors.FlashFull` if the flash had no room (``health`` marked
    degraded; the old record, and every record on flash it names, left as they were). Without a
    journal nothing is durable anyway: chunks the flash had no room for stay modified (written
    at reclaim, or dropped and recomputed) and the call stands."""
    try:
        written = keeper.write_ahead(ctx)
        if journal is not None:
            journal.write(ctx.id, ctx.record(fingerprint))
    except FlashFull as e:
        health.failed(e)
        if journal is None:
            return 0
        raise
    health.ok()
    return written


def revert(ctx: DeviceContext, journal: Journal, registry: ContextRegistry, keeper: "Keeper",
           swap: SwapStore, vocab: int) -> None:
    """Puts ``ctx`` (locked, registered) back as its journal record has it, after a call whose
    changes could not be kept (the flash was full): what a crash would have left, reopened the
    same way (its memory from its records on flash, a fresh tier counting them). If the record
    cannot be read back, ``ctx`` becomes a damaged context."""
    keeper.discard(ctx)
    try:
        ctx.tier = swap.tier(ctx.id)
        doc = journal.read(ctx.id)
        check_record(doc, vocab)
        ctx.restore(doc)
        keeper.reopen(ctx, [str(lv) for lv in doc.get("levels") or []])
    except Exception as e:  # noqa: BLE001 - a record that makes no context: damaged
        registry.remove(ctx.id)
        registry.add_damaged([DamagedContext(
            ctx.id, "a call could not be kept and its journal record could not be read back "
            f"({type(e).__name__}: {e})")])


def context_of(doc: dict[str, Any], vocab: int, swap: SwapStore) -> DeviceContext:
    """The context of one record of this model, without its memory (:func:`reopen`); raises if
    the record does not make one."""
    check_record(doc, vocab)
    return DeviceContext.from_record(doc, swap.tier(doc["id"]))


def check_record(doc: dict[str, Any], vocab: int) -> None:
    """Raises :class:`DeviceError` if record ``doc`` does not make a context: no tokens, token
    ids outside the vocabulary, unknown levels."""
    if not check_token_ids(doc.get("tokens") or [], vocab, "tokens"):
        raise DeviceError("it holds no tokens")
    check_token_ids(doc.get("pending") or [], vocab, "pending")
    unknown = sorted({str(lv) for lv in doc.get("levels") or []} - set(LEVEL_STEP))
    if unknown:
        raise DeviceError(f"unknown levels {unknown}")
