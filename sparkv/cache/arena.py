"""Moving a layer between its two forms: an fp arena (:class:`~sparkv.cache.layer.LayerStore`)
and runs of chunks (:class:`~sparkv.cache.payload.ChunkRun`, what pages hold).

* :func:`arena_run`: the resident chunks of an arena layer as one fp run (a gather per tensor,
  however many chunks: the way into pages);
* :func:`arena_from_runs`: a new arena holding a layer's runs (dequantized once per run; dense
  when every head keeps every token, ragged otherwise: the way out of pages);
* :func:`layer_heads`, :func:`arena_entries`: a layer's runs, or an arena, as per-head entries
  in position order (what attention over fp entries takes).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from sparkv.cache.layer import HeadEntries, LayerStore
from sparkv.cache.payload import ChunkRun
from sparkv.layout import ChunkGeometry, KVChunkId


def _gather_index(starts: np.ndarray, counts: np.ndarray) -> torch.Tensor:
    """Concatenated ranges ``starts[i] .. starts[i] + counts[i]`` (int64)."""
    counts = np.asarray(counts, dtype=np.int64).reshape(-1)
    starts = np.asarray(starts, dtype=np.int64).reshape(-1)
    total = int(counts.sum())
    off = np.repeat(starts - (np.cumsum(counts) - counts), counts)
    return torch.from_numpy(off + np.arange(total))


def arena_run(store: LayerStore, geometry: ChunkGeometry, l: int,  # noqa: E741
              chunks: Sequence[tuple[int, int]]) -> ChunkRun:
    """The entries of chunks ``(t, g)`` of arena layer ``l`` as one fp run (copies)."""
    g = geometry
    hg = g.heads_per_group
    t = np.array([c[0] for c in chunks], dtype=np.int64)
    grp = np.array([c[1] for c in chunks], dtype=np.int64)
    heads = (grp[:, None] * hg + np.arange(hg)[None, :]).reshape(-1)
    t0 = np.repeat(t * g.chunk_tokens, hg)
    t1 = np.minimum(t0 + g.chunk_tokens, g.num_tokens)
    if not store.ragged:
        assert store.k is not None and store.v is not None
        cap = int(store.k.shape[2])
        idx = _gather_index(heads * cap + t0, t1 - t0)
        k = store.k[0].reshape(-1, g.head_dim).index_select(0, idx.to(store.device))
        v = store.v[0].reshape(-1, g.head_dim).index_select(0, idx.to(store.device))
        pos = (idx % cap).to(torch.int32)
        counts = (t1 - t0).reshape(-1, hg)
    else:
        used = [store.head(h) for h in range(g.num_kv_heads)]
        base = np.cumsum([0] + [int(e.pos.numel()) for e in used])[:-1]
        a = np.empty(heads.size, np.int64)
        b = np.empty(heads.size, np.int64)
        for h in np.unique(heads):
            sel = heads == h
            p = used[h].pos.cpu().numpy()
            a[sel] = np.searchsorted(p, t0[sel])
            b[sel] = np.searchsorted(p, t1[sel])
        idx = _gather_index(base[heads] + a, b - a).to(store.device)
        k = torch.cat([e.k for e in used]).index_select(0, idx)
        v = torch.cat([e.v for e in used]).index_select(0, idx)
        pos = torch.cat([e.pos for e in used]).index_select(0, idx).to(torch.int32)
        counts = (b - a).reshape(-1, hg)
    cids = [KVChunkId(int(x), l, int(y)) for x, y in zip(t, grp)]
    return ChunkRun(cids, "fp", counts, pos, k, v, store.dtype)


def arena_entries(store: LayerStore, stop: int) -> list[HeadEntries]:
    """Per KV head, an arena's entries with positions below ``stop`` (views)."""
    if store.ragged:
        out = []
        for h in range(store.num_heads):
            e = store.head(h)
            n = int(torch.searchsorted(e.pos, torch.tensor(stop, device=e.pos.device)))
            out.append(HeadEntries(e.k[:n], e.v[:n], e.pos[:n]))
        return out
    k, v = store.prefix(stop)
    pos = torch.arange(stop, device=store.device)
    return [HeadEntries(k[0, h], v[0, h], pos) for h in range(store.num_heads)]


def _head_of_rows(run: ChunkRun, hg: int) -> torch.Tensor:
    g = np.array([c.g for c in run.cids], dtype=np.int64)
    heads = (g[:, None] * hg + np.arange(hg)[None, :]).reshape(-1)
    return torch.from_numpy(np.repeat(heads, run.counts.reshape(-1)))


def layer_heads(runs: Sequence[ChunkRun], geometry: ChunkGeometry, dtype: torch.dtype,
                device: torch.device, stop: int | None = None) -> list[HeadEntries]:
    """Per KV head, the runs' entries (dequantized to ``dtype``) in position order, positions
    below ``stop`` (int64 positions)."""
    g = geometry
    ks: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    ps, hs = [], []
    for run in runs:
        fp = run.at_level("fp")
        assert isinstance(fp.k, torch.Tensor) and isinstance(fp.v, torch.Tensor)
        ks.append(fp.k.to(dtype))
        vs.append(fp.v.to(dtype))
        ps.append(run.pos.to(torch.long))
        hs.append(_head_of_rows(run, g.heads_per_group).to(run.pos.device))
    if not ks:
        z = torch.zeros(0, g.head_dim, dtype=dtype, device=device)
        return [HeadEntries(z, z.clone(), torch.zeros(0, dtype=torch.long, device=device))
                for _ in range(g.num_kv_heads)]
    k, v, pos, head = torch.cat(ks), torch.cat(vs), torch.cat(ps), torch.cat(hs)
    keep = pos < stop if stop is not None else torch.ones_like(pos, dtype=torch.bool)
    key = head * (int(pos.max()) + 1 if pos.numel() else 1) + pos
    key = torch.where(keep, key, torch.full_like(key, -1))
    order = torch.argsort(key)
    order = order[keep[order]]
    k, v, pos, head = k[order], v[order], pos[order], head[order]
    bounds = torch.searchsorted(head, torch.arange(g.num_kv_heads + 1, device=head.device))
    return [HeadEntries(k[a:b], v[a:b], pos[a:b])
            for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())]


def arena_from_runs(runs: Sequence[ChunkRun], geometry: ChunkGeometry, dtype: torch.dtype,
                    device: torch.device, spare_tokens: int = 0) -> LayerStore:
    """A new fp arena holding a layer's ``runs``: dense (capacity ``N + spare_tokens``) when
    every chunk keeps every token, else ragged (per head, what it keeps)."""
    g = geometry
    dense = all(int(c) == g.chunk_len(cid.t) for run in runs
                for cid, cs in zip(run.cids, run.counts) for c in cs)
    cap = g.num_tokens + max(0, spare_tokens)
    store = LayerStore(g.num_kv_heads, g.head_dim, cap if dense else 0, dtype, device)
    if dense:
        assert store.k is not None and store.v is not None
        for run in runs:
            fp = run.at_level("fp")
            idx = (_head_of_rows(run, g.heads_per_group) * cap + run.pos.long().cpu()).to(device)
            store.k[0].reshape(-1, g.head_dim).index_copy_(0, idx, fp.k.to(dtype))  # type: ignore
            store.v[0].reshape(-1, g.head_dim).index_copy_(0, idx, fp.v.to(dtype))  # type: ignore
        store.end = g.num_tokens
        return store
    heads = layer_heads(runs, g, dtype, device)
    store.to_ragged([torch.zeros(0, dtype=torch.long)] * g.num_kv_heads)
    for h, e in enumerate(heads):
        store.insert(h, e)
    return store
