"""The service's swap space: every context's flash files, ``<swap_dir>/contexts/<id>/``, one
:class:`~sparkv.device.flashio.ServiceFlash` tier per context.

* token chunk files (LLMS and the chunked baselines): one file per token chunk holding every layer
  and KV group at the chunk's level (:mod:`sparkv.device.flashio`), written ahead of time when a
  call returns (:meth:`SwapStore.write_ahead`, one grouped durable write) or at reclaim
  (:meth:`SwapStore.put_away`), attached back as clean flash copies when a journaled context is
  reopened (:meth:`SwapStore.attach`); the loader reads them when a context is switched in;
* whole-context files (the whole-swap baseline): one file per context holding every layer's
  K and V (:meth:`SwapStore.write_whole`, :meth:`SwapStore.read_whole`).

Every directory is ``0700`` and every file ``0600`` (:mod:`sparkv.device.private`).

State: the root, and ``whole`` (context id -> its whole-context file); everything else lives in
the contexts (their tier, their memory's flash references, their ``modified`` chunks). Locks: none
of its own; a caller holds the context's lock, or the registry's lock during a reclaim.
"""

from __future__ import annotations

import shutil
import struct
import time
from pathlib import Path
from typing import Callable

import torch

from sparkv.cache import ContextKV, FlashRef, PayloadError, Residency
from sparkv.device.errors import BudgetTooSmall
from sparkv.device.flashio import ServiceFlash, token_chunk_header, token_chunk_name
from sparkv.device.loader import LoadStats, token_chunk_ids
from sparkv.device.private import private_dir, tighten
from sparkv.device.registry import CONTEXT_ID, DeviceContext

#: the magic of a whole-context file: "SKVW" | tokens u32 | layers u32 | per layer K, V (fp32)
WHOLE_MAGIC = b"SKVW"
WHOLE_NAME = "context.kv"


class SwapStore:
    """The flash files of every context under ``swap_dir/contexts`` (module docstring)."""

    def __init__(self, swap_dir: str | Path) -> None:
        self.root = private_dir(Path(swap_dir) / "contexts")
        self.whole: dict[str, FlashRef] = {}

    def tier(self, ctx_id: str) -> ServiceFlash:
        """The flash tier of context ``ctx_id`` (its directory is made)."""
        return ServiceFlash(self.root / ctx_id)

    def remove(self, ctx: DeviceContext) -> None:
        """Removes every file of a context (deleted, or never made)."""
        self.remove_id(ctx.id)

    def remove_id(self, ctx_id: str) -> None:
        """Removes every file of context ``ctx_id`` (also one the service could not reopen)."""
        if not CONTEXT_ID.fullmatch(ctx_id):
            raise ValueError(f"not a context id: {ctx_id!r}")
        self.whole.pop(ctx_id, None)
        shutil.rmtree(self.root / ctx_id, ignore_errors=True)

    def context_ids(self) -> list[str]:
        """The ids of every context directory on flash (the names :data:`CONTEXT_ID` allows)."""
        return sorted(p.name for p in self.root.iterdir()
                      if p.is_dir() and CONTEXT_ID.fullmatch(p.name))

    # ---- token chunk files -----------------------------------------------------------------------
    def write_token_chunk(self, ctx: DeviceContext, t: int) -> int:
        """Writes token chunk ``t`` (every layer and group) as one file of the context's tier,
        unless its flash copy is up to date; returns the bytes written. A chunk not wholly
        resident, or not at one level, is not written (it stays modified: dropped, it is
        recomputed)."""
        C = ctx.memory
        assert C is not None
        cids = token_chunk_ids(C.geometry, t)
        states = [C.state(cid) for cid in cids]
        if all(st.flash is not None and not st.dirty for st in states):
            return 0
        if any(st.residency != Residency.RESIDENT or st.payload is None for st in states):
            return 0
        try:
            ref = ctx.tier.write_token_chunk([st.payload for st in states])
        except PayloadError:
            return 0
        for cid, st in zip(cids, states):
            C.attach_flash(cid, ref, st.level)
        return ref.nbytes

    def write_ahead(self, ctx: DeviceContext) -> int:
        """Ahead-of-time swap-out: writes every modified token chunk of ``ctx`` (one grouped,
        durable write), so that a later reclaim of it writes nothing; returns the bytes
        written."""
        C = ctx.memory
        if C is None or not ctx.modified:
            return 0
        written = 0
        with ctx.tier.batch():
            for t in sorted(ctx.modified):
                if t < C.geometry.num_token_chunks:
                    written += self.write_token_chunk(ctx, t)
        ctx.modified.clear()
        return written

    def put_away(self, ctx: DeviceContext, ts: list[int] | range) -> tuple[int, int]:
        """Reclaims token chunks ``ts`` of ``ctx``: a clean chunk (its flash copy up to date) is
        just dropped; a modified one is written first (one grouped write). Returns the bytes
        freed and the bytes written."""
        C = ctx.memory
        assert C is not None
        g = C.geometry
        freed = written = 0
        with ctx.tier.batch():
            for t in ts:
                written += self.write_token_chunk(ctx, t)
                for cid in token_chunk_ids(g, t):
                    freed += C.drop(cid)
        return freed, written

    def forget(self, ctx: DeviceContext) -> None:
        """Drops every chunk of ``ctx`` from RAM and forgets its flash copies (every chunk
        absent, modified)."""
        C = ctx.memory
        if C is None:
            return
        g = C.geometry
        for t in range(g.num_token_chunks):
            for cid in token_chunk_ids(g, t):
                C.drop(cid)
                C.forget_flash(cid, ctx.tier)
            ctx.modified.add(t)

    def attach(self, ctx: DeviceContext, C: ContextKV) -> int:
        """Attaches the token chunk files of ``ctx``'s full chunks to ``C`` (empty, segmented) as
        clean flash copies, at the level their headers give; a missing, damaged or mismatched
        file is skipped (its chunk is recomputed when called). Returns the files attached."""
        g = C.geometry
        n = 0
        for t in range(min(g.num_tokens // g.chunk_tokens, g.num_token_chunks)):
            path = ctx.tier.root / token_chunk_name(t)
            try:
                with open(path, "rb") as f:
                    head = token_chunk_header(f.read(64))
                st = path.stat()
            except (OSError, PayloadError):
                continue
            tighten(path, st)            # a file an older version wrote 0644
            size = st.st_size
            if (head["t"] != t or head["layers"] != g.num_layers
                    or head["groups"] != g.num_groups or head["tokens"] != g.chunk_len(t)):
                continue
            ref = FlashRef(str(path), size)
            for cid in token_chunk_ids(g, t):
                C.attach_flash(cid, ref, str(head["level"]))
            n += 1
        return n

    # ---- whole-context files ---------------------------------------------------------------------
    def write_whole(self, ctx: DeviceContext, mem: ContextKV) -> int:
        """Writes a context's whole arena (its tokens' K and V, every layer, fp32) as one durable
        file, replacing its previous one; returns the bytes written."""
        n = len(ctx.tokens)
        parts = [WHOLE_MAGIC, struct.pack("<II", n, mem.geometry.num_layers)]
        for l in range(mem.geometry.num_layers):  # noqa: E741
            st = mem.layers[l]
            assert st is not None and st.k is not None and st.v is not None
            parts.append(st.k[0, :, :n].contiguous().numpy().tobytes())
            parts.append(st.v[0, :, :n].contiguous().numpy().tobytes())
        blob = b"".join(parts)
        old = self.whole.pop(ctx.id, None)
        if old is not None:
            ctx.tier.delete(old)
        self.whole[ctx.id] = ctx.tier.write(WHOLE_NAME, blob)
        return len(blob)

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
        return LoadStats(read_chunks=g.num_token_chunks, files_read=1, bytes_read=len(data),
                         io_s=read_s, pipelined=False)
