"""The service's swap space: every context's flash files, ``<swap_dir>/contexts/<id>/``, one
:class:`~sparkv.device.flashio.ServiceFlash` tier per context.

* token chunk records (LLMS and the chunked baselines): one record per token chunk holding every
  layer and KV group at the chunk's level (:mod:`sparkv.device.flashio`), written ahead of time
  when a call returns (:meth:`SwapStore.write_ahead`, one grouped durable write) or at reclaim
  (:meth:`SwapStore.put_away`), attached back as clean flash copies when a journaled context is
  reopened (:meth:`SwapStore.attach`); the loader reads them when a context is switched in. With
  ``contiguous`` (LLMS) the chunks one write takes are one **segment** file (their records back to
  back at aligned offsets: a switch reads runs of them with one request each); without it (the
  chunk-swapping baselines, as vLLM swaps block by block) one file per token chunk. A chunk
  written again, or forgotten, kills its old record (its segment is deleted with its last one);
* whole-context files (the whole-swap baseline): one file per context holding every layer's
  K and V (:meth:`SwapStore.write_whole`, :meth:`SwapStore.read_whole`).

Every directory is ``0700`` and every file ``0600`` (:mod:`sparkv.device.private`).

State: the root, ``contiguous`` (the layout, fixed), and ``whole`` (context id -> its
whole-context file); everything else lives in the contexts (their tier with its segments' live
records, their memory's flash references). It reads a context's ``modified`` chunks and changes
none of its fields: which chunks are modified is the keeper's (:mod:`~sparkv.device.keeper`).
Locks: none of its own; a caller holds the context's lock, or the registry's lock during a
reclaim.
"""

from __future__ import annotations

import shutil
import struct
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from sparkv.cache import LEVELS, ContextKV, FlashRef, PayloadError
from sparkv.cache.ids import chunk_array
from sparkv.cache.payload import ChunkRun
from sparkv.cache.table import RESIDENT, TokenRows
from sparkv.device.errors import BudgetTooSmall, FlashFull
from sparkv.device.flashio import (FlashHealth, ServiceFlash, is_segment, max_segment_bytes,
                                   writing)
from sparkv.device.hosttier import HostTier
from sparkv.device.loader import LoadStats, token_chunk_ids
from sparkv.device.private import private_dir
from sparkv.device.registry import CONTEXT_ID, DeviceContext

#: the magic of a whole-context file: "SKVW" | tokens u32 | layers u32 | per layer K, V (fp32)
WHOLE_MAGIC = b"SKVW"
WHOLE_NAME = "context.kv"


class SwapStore:
    """The flash files of every context under ``swap_dir/contexts`` (module docstring)."""

    def __init__(self, swap_dir: str | Path, contiguous: bool = True,
                 host: HostTier | None = None) -> None:
        self.root = private_dir(Path(swap_dir) / "contexts")
        self.contiguous = contiguous
        self.host = host
        self.whole: dict[str, FlashRef] = {}
        self.health = FlashHealth(swap_dir)

    def tier(self, ctx_id: str) -> ServiceFlash:
        """The flash tier of context ``ctx_id`` (its directory is made;
        :class:`~sparkv.device.errors.FlashFull` if the flash has no room for it)."""
        with writing(self.root, f"context {ctx_id}'s directory was not made"):
            return ServiceFlash(self.root / ctx_id, host=self.host)

    def remove(self, ctx: DeviceContext) -> None:
        """Removes every file of a context (deleted, or never made)."""
        self.remove_id(ctx.id)

    def remove_id(self, ctx_id: str) -> None:
        """Removes every file of context ``ctx_id`` (also one the service could not reopen)."""
        if not CONTEXT_ID.fullmatch(ctx_id):
            raise ValueError(f"not a context id: {ctx_id!r}")
        self.whole.pop(ctx_id, None)
        if self.host is not None:
            self.host.drop_under(self.root / ctx_id)
        shutil.rmtree(self.root / ctx_id, ignore_errors=True)

    def context_ids(self) -> list[str]:
        """The ids of every context directory on flash (the names :data:`CONTEXT_ID` allows)."""
        return sorted(p.name for p in self.root.iterdir()
                      if p.is_dir() and CONTEXT_ID.fullmatch(p.name))

    # ---- token chunk records ---------------------------------------------------------------------
    def write_token_chunks(self, ctx: DeviceContext, ts: Iterable[int]) -> int:
        """Writes the token chunks ``ts`` of ``ctx`` (every layer and group each) whose flash copy
        is stale or missing: one segment file (``contiguous``) or one file per chunk. A chunk not
        wholly resident, or not at one level, is not written (it stays modified: dropped, it is
        recomputed). The chunks are read from their pages at once (one gather per level) and
        each record packed from its rows; the chunk table is updated once per record. The old
        flash copy of each chunk written is deleted (its record dies). Returns the bytes
        written."""
        C = ctx.memory
        assert C is not None
        rows = C.by_token()
        todo = writable_token_chunks(rows, ts)
        if not todo:
            return 0
        before = ctx.tier.bytes_written
        refs = self._write(ctx.tier, token_chunk_runs(C, todo))
        g = C.geometry
        cids, crefs, levels, olds = [], [], [], set()
        for t in todo:
            ref = refs.get(t)
            if ref is None:
                continue
            ids = token_chunk_ids(g, t)
            cids += ids
            crefs += [ref] * len(ids)
            levels += [LEVELS[int(rows.level[t, 0])]] * len(ids)
            olds |= {old for j in range(len(ids)) if (old := rows.ref(t, j)) is not None
                     and (old.path, old.offset) != (ref.path, ref.offset)}
        if cids:
            C.attach_flash_many(cids, crefs, levels)
        for old in olds:
            ctx.tier.delete(old)
        return ctx.tier.bytes_written - before

    def _write(self, tier: ServiceFlash, chunks: list[ChunkRun]) -> dict[int, FlashRef]:
        """Token chunks (a run each) written in this store's layout; each written chunk's
        ref."""
        if self.contiguous:
            return tier.write_segment(chunks)
        refs = {}
        for run in chunks:
            try:
                refs[run.cids[0].t] = tier.write_token_chunk(run)
            except PayloadError:
                continue
        return refs

    def write_ahead(self, ctx: DeviceContext) -> int:
        """Ahead-of-time swap-out: writes every modified token chunk of ``ctx`` (one grouped,
        durable write; one segment), so that a later reclaim of it writes nothing; returns the
        bytes written."""
        if ctx.memory is None or not ctx.modified:
            return 0
        with ctx.tier.batch():
            return self.write_token_chunks(ctx, ctx.modified)

    def put_away(self, ctx: DeviceContext, ts: list[int] | range) -> tuple[int, int]:
        """Reclaims token chunks ``ts`` of ``ctx``: a clean chunk (its flash copy up to date) is
        just dropped; the modified ones are written first (one grouped write; one segment). On
        a full flash they are dropped unwritten (absent: recomputed from the tokens when called)
        and the flash marked degraded. Returns the bytes freed and the bytes written."""
        C = ctx.memory
        assert C is not None
        written = 0
        try:
            with ctx.tier.batch():
                written = self.write_token_chunks(ctx, ts)
        except FlashFull as e:
            self.health.failed(e)
        cids = [cid for t in ts for cid in token_chunk_ids(C.geometry, t)]
        freed = C.drop_many(cids) if cids else 0
        return freed, written

    def forget(self, ctx: DeviceContext) -> None:
        """Drops every chunk of ``ctx`` from RAM and forgets its flash copies (every chunk
        absent)."""
        C = ctx.memory
        if C is None:
            return
        g = C.geometry
        C.drop_many(list(g.chunk_ids()))
        self.forget_flash(ctx, range(g.num_token_chunks))

    def forget_flash(self, ctx: DeviceContext, ts: Iterable[int]) -> None:
        """Deletes the flash copies of token chunks ``ts`` of ``ctx`` (their records die)."""
        C = ctx.memory
        if C is None:
            return
        for t in ts:
            for cid in token_chunk_ids(C.geometry, t):
                C.forget_flash(cid, ctx.tier)

    def attach(self, ctx: DeviceContext, C: ContextKV, max_tokens: int | None = None) -> int:
        """Attaches the token chunk records on flash of ``ctx``'s full chunks to ``C`` (empty,
        paged) as clean flash copies, at the level their headers give: per token chunk the
        latest record whose header fits the geometry (chunk files, then segments oldest first:
        :meth:`~sparkv.device.flashio.ServiceFlash.records`). A missing, damaged or mismatched
        record is skipped (its chunk is recomputed when called; a damaged body fails its
        checksum when read, and is recomputed then). The attached segment records are live;
        segments with none are deleted, and chunk files a segment record superseded too.
        A file that is not a regular one, or a segment larger than the records of a
        ``max_tokens``-token context (when given), is skipped
        (:meth:`~sparkv.device.flashio.ServiceFlash.records`) and pruned. Returns the token
        chunks attached."""
        g = C.geometry
        full = min(g.num_tokens // g.chunk_tokens, g.num_token_chunks)
        found: dict[int, tuple[FlashRef, str]] = {}
        stale: list[FlashRef] = []
        limit = None if max_tokens is None else max_segment_bytes(
            g.num_layers, g.num_groups, g.heads_per_group, g.head_dim, g.chunk_tokens, C.dtype,
            max_tokens, ctx.tier.align)
        for ref, head in ctx.tier.records(limit):
            t = int(head["t"])
            if (t >= full or head["layers"] != g.num_layers or head["groups"] != g.num_groups
                    or head["tokens"] != g.chunk_len(t)):
                continue
            if t in found:
                stale.append(found[t][0])
            found[t] = (ref, str(head["level"]))
        cids, refs, levels = [], [], []
        for t, (ref, level) in found.items():
            ctx.tier.keep(ref)
            ids = token_chunk_ids(g, t)
            cids += ids
            refs += [ref] * len(ids)
            levels += [level] * len(ids)
        if cids:
            C.attach_flash_many(cids, refs, levels)
        for ref in stale:
            if not is_segment(ref.path):
                ctx.tier.delete(ref)
        ctx.tier.prune()
        return len(found)

    # ---- whole-context files ---------------------------------------------------------------------
    def write_whole(self, ctx: DeviceContext, mem: ContextKV) -> int:
        """Writes a context's whole arena (its tokens' K and V, every layer, fp32) as one durable
        file, replacing its previous one; returns the bytes written."""
        n = len(ctx.tokens)
        parts = [WHOLE_MAGIC, struct.pack("<II", n, mem.geometry.num_layers)]
        for l in range(mem.geometry.num_layers):  # noqa: E741
            st = mem.layers[l]
            assert st is not None and st.k is not None and st.v is not None
            parts.append(st.k[0, :, :n].contiguous().cpu().numpy().tobytes())
            parts.append(st.v[0, :, :n].contiguous().cpu().numpy().tobytes())
        blob = b"".join(parts)
        old = self.whole.pop(ctx.id, None)
        if old is not None:
            ctx.tier.delete(old)
        self.whole[ctx.id] = ctx.tier.write(WHOLE_NAME, blob)
        return len(blob)

    def forget_whole(self, ctx: DeviceContext) -> None:
        """Deletes a context's whole-context file, if it has one."""
        ref = self.whole.pop(ctx.id, None)
        if ref is not None:
            ctx.tier.delete(ref)

    def read_whole(self, ctx: DeviceContext, W: ContextKV,
                   on_layer: Callable[[], object]) -> LoadStats | None:
        """Reads a context's whole-context file into arena ``W`` (``on_layer`` after each layer);
        ``None`` if it has none."""
        ref = self.whole.get(ctx.id)
        if ref is None:
            return None
        t0 = time.perf_counter()
        data = ctx.tier.read(ref)
        read_s = time.perf_counter() - t0
        n, L = struct.unpack_from("<II", data, 4)
        if data[:4] != WHOLE_MAGIC or n != len(ctx.tokens):
            raise BudgetTooSmall("the swapped context file does not match the context")
        g = W.geometry
        per = g.num_kv_heads * n * g.head_dim
        arr = torch.frombuffer(bytearray(data), dtype=torch.float32, offset=12)  # one copy
        for l in range(L):  # noqa: E741
            st = W.layers[l]
            assert st is not None and st.k is not None and st.v is not None
            k = arr[2 * l * per:(2 * l + 1) * per]
            v = arr[(2 * l + 1) * per:(2 * l + 2) * per]
            st.k[0, :, :n] = k.view(g.num_kv_heads, n, g.head_dim)
            st.v[0, :, :n] = v.view(g.num_kv_heads, n, g.head_dim)
            st.end = n
            on_layer()
        return LoadStats(read_chunks=g.num_token_chunks, files_read=1, reads=1,
                         bytes_read=len(data), io_s=read_s, read_s=read_s,
                         pipelined=False)


def writable_token_chunks(rows: TokenRows, ts: Iterable[int]) -> list[int]:
    """Of token chunks ``ts`` (sorted, within the table), those to write: a flash copy stale or
    missing, every chunk resident at one level."""
    n = rows.residency.shape[0]
    want = np.array(sorted({t for t in ts if 0 <= t < n}), dtype=np.int64)
    if not want.size:
        return []
    clean = ((rows.flash[want] >= 0) & ~rows.dirty[want]).all(axis=1)
    whole = (rows.residency[want] == RESIDENT).all(axis=1)
    one = (rows.level[want] == rows.level[want, :1]).all(axis=1)
    return want[~clean & whole & one].tolist()


def token_chunk_runs(C: ContextKV, ts: Sequence[int]) -> list[ChunkRun]:
    """Token chunks ``ts`` of ``C`` (wholly resident, one level each), each as a run of its
    chunks in layer-major order: read with one gather per level (:meth:`ContextKV.read_runs`),
    cut into token chunks."""
    g = C.geometry
    pieces: dict[int, list[ChunkRun]] = {}
    for run in C.read_runs([cid for t in ts for cid in token_chunk_ids(g, t)]):
        tt = chunk_array(run.cids)[:, 0]
        cuts = np.flatnonzero(np.diff(tt)) + 1
        for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), len(tt)]):
            pieces.setdefault(int(tt[a]), []).append(run.piece(a, b))
    out = []
    for t in sorted(pieces):
        ps = pieces[t]
        if len(ps) > 1:              # arena layers: read layer by layer, joined in layer order
            ps = [ChunkRun.join(sorted((p for r in ps for p in r.payloads()),
                                       key=lambda p: (p.cid.l, p.cid.g)))]
        out.append(ps[0])
    return out
