"""Restoring a service context that SparKV loaded: flash, the server, or local recompute, planned
by SparKV's own scheduler with flash as one more link.

The edge (:meth:`sparkv.edge.session.EdgeSession.ask` with a service) keeps a loaded cache as a
service context. Asked again, the context may be resident (nothing to restore), swapped out
(chunks on flash), or evicted without a flash copy (absent). Every missing chunk can come from:

* **flash**: the service's own copy (its level), at this device's measured read speed;
* **the server**: the context's frames, at the link's bandwidth (the manifest's sizes per level);
* **local recompute**: a layer step, at the predictor's cost.

:func:`restore_plan` builds the scheduler's :class:`~sparkv.scheduler.instance.Instance` in the
server's geometry (its chunks, usually 1024 tokens) and runs the same planner the first ``ask``
used, with **flash as one more codec level** of each server chunk: its size is the time the
service would spend reading the chunk's missing 16-token sub-chunks from flash
(:class:`~sparkv.device.flashio.IOProfile`: reads x per-read latency + bytes / read bandwidth,
records adjacent in a segment counting one read),
expressed in link bytes (``seconds x link bandwidth``), so that the planner's ``bytes / bw`` is
the flash time; resident sub-chunks cost nothing. The planner then picks per chunk the cheapest
way in, exactly as it picks between codec levels and local steps. Modelling flash as a level of
the one link is conservative: the planner serialises flash reads with server transfers, where
the device could run both at once.

The plan is carried out with the service: server chunks are fetched and decoded by the edge and
handed to the call (``provided``); token chunks with a computed step are recomputed whole (every
layer: the service recomputes 16-token chunks through all layers); the rest is read from flash.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sparkv.cache import ContextKV, FlashRef, Residency
from sparkv.device.flashio import IOProfile, run_starts
from sparkv.layout import ChunkGeometry, KVChunkId
from sparkv.scheduler.instance import DEFAULT_LEVELS, Instance, StreamLevel

FLASH = "flash"
#: the restore instance counts sizes in 1/UNIT bytes (and the link in UNIT x bytes/s)
UNIT = 1024
#: flash copies rank above every codec level (they are the service's own, int8-based, copies)
FLASH_LEVEL = StreamLevel(FLASH, 100, 8.0)


@dataclass
class RestorePlan:
    """What to do for one restore."""

    server: list[tuple[KVChunkId, str]] = field(default_factory=list)  # server chunks to fetch
    stream: list[int] = field(default_factory=list)      # service token chunks they restore
    read: list[int] = field(default_factory=list)        # service token chunks to read
    recompute: list[int] = field(default_factory=list)   # service token chunks to recompute
    missing: int = 0                                     # service token chunks not resident
    instance: Instance | None = None
    plan: Any = None
    estimate_s: float = 0.0

    @property
    def nothing_to_do(self) -> bool:
        return self.missing == 0

    def counts(self) -> dict[str, int]:
        return {"server_chunks": len(self.server), "stream": len(self.stream),
                "read": len(self.read), "recompute": len(self.recompute),
                "missing": self.missing}


def _sub_chunks(gs: ChunkGeometry, gd: ChunkGeometry, t_s: int) -> range:
    a, b = gs.token_range(t_s)
    return range(a // gd.chunk_tokens, -(-b // gd.chunk_tokens))


def restore_plan(memory: ContextKV, io: IOProfile, server_geometry: ChunkGeometry,
                 sizes: dict[KVChunkId, dict[str, int]], t_comp: np.ndarray, link_Bps: float, *,
                 rtt_s: float = 0.0, quality_floor: str | None = None,
                 t_proc: dict[KVChunkId, dict[str, float]] | None = None,
                 planner: str = "sparkv", align: int = 4096) -> RestorePlan:
    """The restore of a service context whose KV memory is ``memory`` (module docstring).

    Args:
        memory: the context's memory (its chunks' residency and flash copies); hold the
            context's lock while planning.
        io: this device's flash read profile.
        server_geometry: the server's chunking of the context (the manifest's).
        sizes: per server chunk, bytes per codec level (the manifest's; empty when the server is
            out of reach: then flash and recompute only).
        t_comp: predicted seconds of each server layer step ``[n_t, L]``.
        link_Bps: the link's expected bandwidth.
        align: the alignment of the records in the context's segment files (its tier's: which
            records are adjacent, read with one request).
    """
    from sparkv.scheduler.planners import get_planner

    gd: ChunkGeometry = memory.geometry
    gs = server_geometry
    if gs.num_tokens != gd.num_tokens or gs.num_layers != gd.num_layers:
        raise ValueError("the server's context and the service's do not have the same tokens "
                         "and layers")
    out = RestorePlan()
    missing_t = {t for t in range(gd.num_token_chunks)
                 if any(memory.residency(KVChunkId(t, l, 0)) != Residency.RESIDENT
                        for l in range(gd.num_layers))}  # noqa: E741
    out.missing = len(missing_t)
    if not missing_t:
        return out
    # the planner's sizes are whole numbers: count in 1/UNIT bytes (the link's rate scaled
    # alike), so that a flash read of microseconds is not rounded to a byte of a slow link
    link_u = link_Bps * UNIT
    chunk_bytes, procs = _chunk_costs(memory, io, gs, sizes, t_proc or {}, link_u, align)
    levels = tuple([FLASH_LEVEL] + [lv for lv in DEFAULT_LEVELS])
    present = {lv for e in chunk_bytes.values() for lv in e}
    floor = quality_floor if quality_floor in present else None
    inst = Instance.from_mappings(
        gs, chunk_bytes, {s: float(t_comp[s.t, s.l]) for s in gs.step_ids()}, link_u,
        t_proc=procs, rtt_s=rtt_s, levels=levels, quality_floor=floor, name="restore")
    plan = get_planner(planner).plan(inst)
    out.instance, out.plan = inst, plan
    _assign(out, plan, gs, gd, missing_t)
    try:
        from sparkv.scheduler.simulator import estimate_ttft
        out.estimate_s = float(estimate_ttft(plan, inst))
    except Exception:  # noqa: BLE001 - an estimate only
        out.estimate_s = float("nan")
    return out


def _chunk_costs(C: ContextKV, io: IOProfile, gs: ChunkGeometry,
                 sizes: dict[KVChunkId, dict[str, int]],
                 t_proc: dict[KVChunkId, dict[str, float]], link_u: float, align: int
                 ) -> tuple[dict[KVChunkId, dict[str, int]], dict[KVChunkId, dict[str, float]]]:
    """Per server chunk, its size (in 1/UNIT bytes) and processing seconds per level, flash
    included (as the link bytes its read time is worth) where every missing sub-chunk of it has
    a clean flash copy."""
    flash_ok = gs.num_groups == 1
    chunk_bytes: dict[KVChunkId, dict[str, int]] = {}
    procs: dict[KVChunkId, dict[str, float]] = {}
    for cid in gs.chunk_ids():
        entry = {lv: int(b) * UNIT for lv, b in sizes.get(cid, {}).items()}
        proc = dict(t_proc.get(cid, {lv: 0.0 for lv in entry}))
        cost = _flash_seconds(C, io, gs, cid, align) if flash_ok else None
        if cost is not None:
            entry[FLASH] = max(1, int(round(cost * link_u)))
            proc[FLASH] = 0.0
        if not entry:          # nothing but recompute: an unreachable level the planner skips
            entry = {"raw": 1 << 62}
            proc = {"raw": 0.0}
        chunk_bytes[cid] = entry
        procs[cid] = proc
    return chunk_bytes, procs


def _flash_seconds(C: ContextKV, io: IOProfile, gs: ChunkGeometry, cid: KVChunkId,
                   align: int) -> float | None:
    """The flash read time of server chunk ``cid``'s missing sub-chunks (None unless each has
    a clean flash copy): a token chunk's record holds every layer, so a layer's share is 1/L
    of its reads and bytes."""
    gd = C.geometry
    refs: list[FlashRef | None] = []
    for t in _sub_chunks(gs, gd, cid.t):
        st = C.state(KVChunkId(t, cid.l, 0))
        if st.residency == Residency.RESIDENT:
            refs.append(None)
        elif st.residency == Residency.FLASH and st.flash is not None and not st.dirty:
            refs.append(st.flash)
        else:
            return None
    reads = sum(run_starts(refs, align)) / gd.num_layers
    nbytes = sum(r.nbytes for r in refs if r is not None) / gd.num_layers
    return io.seconds(reads, nbytes)


def _assign(out: RestorePlan, plan: Any, gs: ChunkGeometry, gd: ChunkGeometry,
            missing_t: set[int]) -> None:
    """Per server token chunk, one way in for its missing sub-chunks (the service restores
    whole 16-token chunks through every layer): recomputed if the plan computes any of its
    steps; else read if the plan reads any of its layers from flash; else fetched from the
    server, every (layer, group) at the level the plan chose for it."""
    computed_t = {s.t for s in plan.compute_order}
    by_t: dict[int, list[KVChunkId]] = {}
    for cid in plan.stream_order:
        by_t.setdefault(cid.t, []).append(cid)
    recompute: set[int] = set()
    read: set[int] = set()
    stream: set[int] = set()
    for t_s in range(gs.num_token_chunks):
        subs = [t for t in _sub_chunks(gs, gd, t_s) if t in missing_t]
        if not subs:
            continue
        cids = by_t.get(t_s, [])
        if t_s in computed_t or not cids:
            recompute.update(subs)
        elif any(plan.levels[c] == FLASH for c in cids):
            read.update(subs)
        else:
            stream.update(subs)
            out.server.extend((c, plan.levels[c]) for c in
                              sorted(cids, key=lambda c: (c.l, c.g)))
    out.recompute = sorted(recompute)
    out.read = sorted(read)
    out.stream = sorted(stream)
