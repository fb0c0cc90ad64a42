"""The RAM index of one (layer, KV head): cluster statistics, retrieval, and the update policies.

:class:`ClusterIndex` keeps, per cluster, its size ``n``, centroid and ``M2`` (sum of squared
distances to the centroid; the variance is ``M2 / n``), updated incrementally (Welford) as entries
join, and recomputed in batch only when a cluster is split. Retrieval scores every centroid with
the query group (``max`` over the KV head's query heads of ``q . c``) and takes clusters whole,
best first, while they fit the step's entry budget.

Update policies (``DecodeConfig.update``):

* ``dynakv`` (Algorithm 1 of the paper): a new entry goes to its nearest cluster (L2) if the
  cluster's variance with it stays ``<= tau`` (and its size ``<= max_cluster``); otherwise the
  cluster is split now if it is in RAM, else the entry waits in the cluster's buffer and the
  cluster is flagged. A flagged cluster is split when it is next retrieved; when the buffers hold
  ``buffer_max`` entries the cluster with the largest buffer is read and split (the only reads a
  split ever causes). ``delayed_split=False`` reads the cluster at once instead.
* ``static``: the nearest cluster, always.
* ``local``: new entries wait (in RAM) until ``local_every`` of them are clustered on their own.

:class:`TokenIndex` is ``nocluster``: the keys themselves are the index (in RAM), and the top
entries by ``q . k`` are retrieved page by page.

Buffered and waiting entries are in RAM and always attended (like the window).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np
import torch

from sparkv.decode.config import DecodeConfig
from sparkv.decode.kmeans import kmeans, stats, two_means
from sparkv.decode.store import ClusterStore, FlushedData, TokenStore
from sparkv.decode.units import Unit


class StepContext(Protocol):
    """What an index may ask of its layer during one step (sparkv.decode.policy)."""

    def ram(self, uid: int) -> FlushedData | None: ...
    def load(self, uid: int, reason: str) -> FlushedData: ...
    def updated(self, uid: int) -> None: ...
    def adopt(self, uid: int, data: FlushedData) -> None: ...
    def refresh(self, uid: int, data: FlushedData) -> None: ...
    def forget(self, uid: int) -> None: ...


@dataclass
class Resident:
    """RAM-only entries of a head that are always attended (buffers, waiting entries)."""

    k: list[torch.Tensor] = field(default_factory=list)
    v: list[torch.Tensor] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.pos)

    def add(self, k: torch.Tensor, v: torch.Tensor, pos: int) -> None:
        self.k.append(k)
        self.v.append(v)
        self.pos.append(pos)

    def tensors(self, d: int, dtype: torch.dtype) -> FlushedData:
        if not self.pos:
            z = torch.zeros(0, d, dtype=dtype)
            return z, z, np.zeros(0, np.int64)
        return torch.stack(self.k), torch.stack(self.v), np.asarray(self.pos, dtype=np.int64)

    def clear(self) -> None:
        self.k.clear()
        self.v.clear()
        self.pos.clear()


@dataclass
class SplitCounts:
    inline: int = 0        # the nearest cluster was in RAM: split at once
    delayed: int = 0       # a flagged cluster split when it was retrieved
    overflow: int = 0      # B_max reached: the largest buffer's cluster read and split
    overflow_loads: int = 0  # B_max overflows that had to read their cluster (the only split reads)
    overflow_events: int = 0  # B_max overflows (the cluster may have been in RAM already)
    eager: int = 0         # delayed_split=False: read and split at once
    prefill: int = 0       # prefill clusters over the threshold or max_cluster
    local_batches: int = 0

    @property
    def total(self) -> int:
        return self.inline + self.delayed + self.overflow + self.eager


def partition(x: np.ndarray, tau: float, max_size: int, iters: int) -> list[np.ndarray]:
    """Recursive 2-means of ``x [m, D]`` until every group has variance ``<= tau`` and at most
    ``max_size`` entries (or one entry). Returns index arrays (largest first)."""
    out = []
    stack = [np.arange(x.shape[0])]
    while stack:
        idx = stack.pop()
        n, _, m2 = stats(x[idx])
        if n <= 1 or (m2 / n <= tau and n <= max_size):
            out.append(idx)
            continue
        lab = two_means(x[idx], iters)
        stack.append(idx[~lab])
        stack.append(idx[lab])
    out.sort(key=lambda a: -len(a))
    return out


class CentroidTable:
    """The float32 centroids, sizes and liveness of every KV head of a layer, padded to one
    capacity: ``data [H, cap, D]``, ``n [H, cap]``, ``alive [H, cap]``. Each head's
    :class:`ClusterIndex` keeps its ``mean32``, ``n`` and ``alive`` as row views, so a decoding
    step scores and selects every head's clusters with batched calls
    (:func:`sparkv.decode.select.select_heads`)."""

    def __init__(self, indexes: list[ClusterIndex]) -> None:
        self.indexes = indexes
        cap = max(i.mean32.shape[0] for i in indexes)
        h = len(indexes)
        self.data = np.zeros((h, cap, indexes[0].d), np.float32)
        self.n = np.zeros((h, cap), np.int64)
        self.alive = np.zeros((h, cap), bool)
        for r, i in enumerate(indexes):
            m = i.mean32.shape[0]
            self.data[r, :m], self.n[r, :m], self.alive[r, :m] = i.mean32, i.n, i.alive
        self._point()
        for i in indexes:
            i.table = self

    def _point(self) -> None:
        for h, i in enumerate(self.indexes):
            i.mean32, i.n, i.alive = self.data[h], self.n[h], self.alive[h]

    def ensure(self, cap: int) -> None:
        """Room for ``cap`` slots in every head (rows copied)."""
        old = self.data.shape[1]
        if cap <= old:
            return
        h = self.data.shape[0]
        data = np.zeros((h, cap, self.data.shape[2]), np.float32)
        n = np.zeros((h, cap), np.int64)
        alive = np.zeros((h, cap), bool)
        data[:, :old], n[:, :old], alive[:, :old] = self.data, self.n, self.alive
        self.data, self.n, self.alive = data, n, alive
        self._point()

    @property
    def used(self) -> int:
        """``S``: the most slots any head uses."""
        return max(i.size for i in self.indexes)

    def scores(self, qg: np.ndarray) -> np.ndarray:
        """``qg [H, r, D]`` -> raw ``[H, S]`` scores (``max`` over each head's query rows) of the
        first ``S = max size`` slots."""
        s = self.used
        return np.matmul(qg, self.data[:, :s].transpose(0, 2, 1)).max(1)

    def masked_scores(self, qg: np.ndarray) -> np.ndarray:
        """:meth:`scores` as float64 with dead and unused slots at ``-inf`` (``[H, S]``)."""
        sc = self.scores(qg).astype(np.float64)
        sc[~self.alive[:, :sc.shape[1]]] = -np.inf
        return sc


class ClusterIndex:
    """Clusters of one (layer, KV head) (module docstring)."""

    def __init__(self, layer: int, head: int, store: ClusterStore, cfg: DecodeConfig,
                 tau: float) -> None:
        self.layer, self.head = layer, head
        self.store = store
        self.cfg = cfg
        self.tau = float(tau)
        d = store.d
        self.d = d
        cap = 64
        self.mean = np.zeros((cap, d))
        self.mean32 = np.zeros((cap, d), np.float32)
        self.m2 = np.zeros(cap)
        self.n = np.zeros(cap, np.int64)          # entries of the cluster (flushed + tail)
        self.alive = np.zeros(cap, bool)
        self.flag = np.zeros(cap, bool)
        self.uid = np.full(cap, -1, np.int64)
        self.slot_of: dict[int, int] = {}
        self.size = 0                             # slots used
        self.buffers: dict[int, Resident] = {}    # slot -> delayed-split buffer
        self.buffered = 0
        self.buffer_peak = 0
        self.waiting = Resident()                 # local update: not yet clustered
        self.splits = SplitCounts()
        #: the layer's padded centroid table [H, cap, D] (float32) this index's ``mean32`` is a
        #: row of, so a layer scores every head in one batched matmul (set by ``share_table``)
        self.table: CentroidTable | None = None
        #: the always-resident window ``(sinks, start)`` as last set by the layer, and
        #: position -> slot for the positions of clusters that are (or may still be) in it, so
        #: the entry budget counts only what a cluster adds beyond the window
        self.win = (0, 0)
        self.where: dict[int, int] = {}
        #: the best-scored clusters the last selection left out, best first (prefetch candidates)
        self.next_up: list[int] = []

    # ---- slots -------------------------------------------------------------------------------------
    def _grow(self) -> None:
        cap = self.mean.shape[0] * 2
        if self.table is not None:
            self.table.ensure(cap)                # re-points every head's mean32 (copied)
        for name in ("mean", "mean32", "m2", "n", "alive", "flag", "uid"):
            if name in ("mean32", "n", "alive") and self.table is not None:
                continue
            old = getattr(self, name)
            new = np.zeros((cap, *old.shape[1:]), old.dtype)
            if name == "uid":
                new[:] = -1
            new[:old.shape[0]] = old
            setattr(self, name, new)

    def _new_slot(self, uid: int, x: np.ndarray) -> int:
        if self.size == self.mean.shape[0]:
            self._grow()
        s = self.size
        self.size += 1
        self.uid[s] = uid
        self.slot_of[uid] = s
        self.alive[s] = True
        self._set_stats(s, x)
        return s

    def _mark(self, slot: int, positions: np.ndarray) -> None:
        """Positions now held by ``slot`` (only those the window may hold are remembered)."""
        s_end, w0 = self.win
        for p in np.asarray(positions).tolist():
            if p < s_end or p >= w0:
                self.where[p] = slot

    def window_counts(self, s_end: int, w0: int) -> np.ndarray:
        """Per slot, its entries inside the window ``[0, s_end) + [w0, ...)`` (which the layer
        attends anyway); sets the window and forgets positions that left it."""
        self.win = (s_end, w0)
        gone = [p for p in self.where if s_end <= p < w0]
        for p in gone:
            del self.where[p]
        if not self.where:
            return np.zeros(self.size, np.int64)
        return np.bincount(np.fromiter(self.where.values(), np.int64, len(self.where)),
                           minlength=self.size)[:self.size]

    def _set_stats(self, s: int, x: np.ndarray) -> None:
        n, mu, m2 = stats(x)
        self.n[s], self.mean[s], self.m2[s] = n, mu, m2
        self.mean32[s] = mu

    @property
    def clusters(self) -> int:
        return int(self.alive[:self.size].sum())

    def variance(self) -> np.ndarray:
        s = self.size
        return self.m2[:s] / np.maximum(self.n[:s], 1)

    # ---- prefill -----------------------------------------------------------------------------------
    def build(self, groups: Sequence[FlushedData]) -> list[int]:
        """Places prefill clusters (already in co-retrieval order) on flash and indexes them;
        returns their units' ids."""
        uids = self.store.place(self.head, groups)
        for uid, (k, _, pos) in zip(uids, groups):
            self._mark(self._new_slot(uid, k.double().numpy()), pos)
        return uids

    # ---- retrieval ---------------------------------------------------------------------------------
    def scores(self, qg: np.ndarray) -> np.ndarray:
        """``qg [r, D]`` (the head's query group) -> score per slot (dead slots -inf)."""
        s = self.size
        return self.mask_scores((qg @ self.mean32[:s].T).max(0))

    def mask_scores(self, sc: np.ndarray) -> np.ndarray:
        """Raw scores of the first ``size`` slots -> float64 with dead slots at -inf."""
        sc = sc[:self.size].astype(np.float64)
        sc[~self.alive[:self.size]] = -np.inf
        return sc

    def select(self, qg: np.ndarray, budget: int) -> list[int]:
        """Units of the best clusters, taken whole, best score first: a cluster that does not
        fit what is left of ``budget`` entries is skipped and the next ones still may fit."""
        return self.select_scored(self.scores(qg), budget)

    def select_scored(self, sc: np.ndarray, budget: int, inwin: np.ndarray | None = None
                      ) -> list[int]:
        """:meth:`select` from scores already computed (:meth:`mask_scores`). With ``inwin``
        (:meth:`window_counts`) a cluster costs only its entries outside the window, and a
        cluster wholly inside it is not retrieved (the window holds it already)."""
        order = np.argsort(-sc, kind="stable")
        order = order[np.isfinite(sc[order])]
        sizes = self.n[order]
        if inwin is not None:
            sizes = sizes - inwin[order]
            live = sizes > 0
            order, sizes = order[live], sizes[live]
        cum = np.cumsum(sizes)
        take = int(np.searchsorted(cum, budget, side="right"))
        picked = order[:take]
        left = budget - (int(cum[take - 1]) if take else 0)
        if take < len(order) and left > 0:
            # the greedy fill, vectorised: clusters that fit what is left, in score order, each
            # taken while the running total still fits
            rest, rsz = order[take:], sizes[take:]
            small = rsz <= left
            rest, rsz = rest[small], rsz[small]
            extra = []
            for j, n in zip(rest.tolist(), rsz.tolist()):
                if n <= left:
                    extra.append(j)
                    left -= n
                    if left <= 0:
                        break
            if extra:
                picked = np.concatenate([picked, np.asarray(extra, dtype=picked.dtype)])
        # the best-scored clusters left out (most likely to enter the next step's selection):
        # the prefetcher's candidates beyond what was selected
        rest = order[take:take + 16 + (len(picked) - take)]
        if len(picked) > take:
            rest = rest[~np.isin(rest, picked[take:])]
        self.next_up = self.uid[rest[:16]].tolist()
        return self.uid[picked].tolist()

    def resident(self) -> FlushedData:
        """Buffered (delayed split) and waiting (local) entries: RAM-only, always attended."""
        parts = [b.tensors(self.d, self.store.dtype) for b in self.buffers.values() if len(b)]
        if len(self.waiting):
            parts.append(self.waiting.tensors(self.d, self.store.dtype))
        if not parts:
            z = torch.zeros(0, self.d, dtype=self.store.dtype)
            return z, z, np.zeros(0, np.int64)
        if len(parts) == 1:
            return parts[0]
        return (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
                np.concatenate([p[2] for p in parts]))

    @property
    def resident_entries(self) -> int:
        return self.buffered + len(self.waiting)

    # ---- updates -----------------------------------------------------------------------------------
    def observe(self, k: torch.Tensor, v: torch.Tensor, pos: int, ctx: StepContext) -> None:
        """A new entry (``k``, ``v`` ``[D]``) at ``pos``."""
        mode = self.cfg.update
        if mode == "local":
            self.waiting.add(k.clone(), v.clone(), pos)
            if len(self.waiting) >= self.cfg.local_every:
                self._cluster_waiting(ctx)
            return
        x = k.double().numpy()
        s = self.size
        d2 = ((self.mean[:s] - x) ** 2).sum(1)
        d2[~self.alive[:s]] = np.inf
        j = int(d2.argmin())
        n1 = int(self.n[j]) + 1
        delta = x - self.mean[j]
        mu1 = self.mean[j] + delta / n1
        m21 = float(self.m2[j] + delta @ (x - mu1))
        if mode == "static" or (m21 / n1 <= self.tau and n1 <= self.cfg.max_cluster):
            self.n[j], self.mean[j], self.m2[j] = n1, mu1, m21
            self.mean32[j] = mu1
            if pos < self.win[0] or pos >= self.win[1]:
                self.where[pos] = j
            uid = int(self.uid[j])
            self.store.add(self.store.units[uid], k[None], v[None], np.array([pos]))
            ctx.updated(uid)
            return
        uid = int(self.uid[j])
        if ctx.ram(uid) is not None or not self.store.units[uid].flushed:
            self._split(j, ctx, extra=(k, v, pos), kind="inline")
        elif not self.cfg.delayed_split:
            ctx.load(uid, "split")
            self._split(j, ctx, extra=(k, v, pos), kind="eager")
        else:
            self.buffers.setdefault(j, Resident()).add(k.clone(), v.clone(), pos)
            self.flag[j] = True
            self.buffered += 1
            self.buffer_peak = max(self.buffer_peak, self.buffered)

    def finish_step(self, selected: list[int], ctx: StepContext) -> None:
        """After a step's new entries: delayed splits of retrieved flagged clusters, then the
        B_max overflow."""
        for uid in selected:
            j = self.slot_of.get(uid)
            if j is not None and self.alive[j] and self.flag[j]:
                if ctx.ram(uid) is None and self.store.units[uid].flushed:
                    # selected while it had no flushed entries, flushed since (a tail write):
                    # not in RAM, so it waits for its next retrieval (a split never reads here)
                    continue
                self._split(j, ctx, kind="delayed")
        while self.buffered >= self.cfg.buffer_max:
            j = max(self.buffers, key=lambda s: len(self.buffers[s]))
            uid = int(self.uid[j])
            self.splits.overflow_events += 1
            if ctx.ram(uid) is None and self.store.units[uid].flushed:
                ctx.load(uid, "overflow")
                self.splits.overflow_loads += 1
            self._split(j, ctx, kind="overflow")

    def _split(self, j: int, ctx: StepContext, extra: tuple[torch.Tensor, torch.Tensor, int]
               | None = None, kind: str = "inline") -> None:
        """Splits cluster ``j`` (in RAM) with its buffer (and ``extra``) until every part is under
        the threshold; the part holding most flushed entries stays in the unit, on its pages
        (never rewritten); only the other parts are written, to new heads."""
        uid = int(self.uid[j])
        u = self.store.units[uid]
        data = ctx.ram(uid) if u.flushed else None
        if u.flushed and data is None:
            raise AssertionError("split of a cluster that is not in RAM")
        ks, vs, ps, src = [], [], [], []
        if data is not None:
            ks.append(data[0])
            vs.append(data[1])
            ps.append(data[2])
            src.append(np.zeros(len(data[2]), np.int8))           # 0: flushed
        if u.tail:
            assert u.tail_k is not None and u.tail_v is not None
            ks.append(u.tail_k)
            vs.append(u.tail_v)
            ps.append(u.tail_pos)
            src.append(np.ones(u.tail, np.int8))                  # 1: write buffer
        buf = self.buffers.pop(j, None)
        if buf is not None and len(buf):
            bk, bv, bp = buf.tensors(self.d, self.store.dtype)
            ks.append(bk)
            vs.append(bv)
            ps.append(bp)
            src.append(np.full(len(bp), 2, np.int8))              # 2: not in the cluster yet
            self.buffered -= len(bp)
        if extra is not None:
            ks.append(extra[0].to(self.store.dtype)[None])
            vs.append(extra[1].to(self.store.dtype)[None])
            ps.append(np.array([extra[2]], np.int64))
            src.append(np.full(1, 2, np.int8))
        self.flag[j] = False
        k_all, v_all = torch.cat(ks), torch.cat(vs)
        p_all, s_all = np.concatenate(ps), np.concatenate(src)
        x = k_all.double().numpy()
        groups = partition(x, self.tau, self.cfg.max_cluster, self.cfg.kmeans_iters)
        if len(groups) > 1:
            setattr(self.splits, kind, getattr(self.splits, kind) + 1)
        stay = max(range(len(groups)), key=lambda g: (int((s_all[groups[g]] == 0).sum()),
                                                      len(groups[g])))
        keep = groups[stay]
        keep_mask = np.zeros(len(p_all), bool)
        keep_mask[keep] = True
        # the staying part: moved-out entries become dead slots / leave the write buffer, and
        # its RAM copies are made current before anything is written for it
        self.store.remove(u, p_all[~keep_mask & (s_all != 2)])
        if u.flushed:
            ctx.refresh(uid, self._flushed_data(u, k_all, v_all, p_all))
        else:
            ctx.forget(uid)
        new_in = keep[s_all[keep] == 2]
        if len(new_in):
            ti = torch.from_numpy(new_in)
            self.store.add(u, k_all[ti], v_all[ti], p_all[new_in], "append")
        self._set_stats(j, x[keep])
        self._mark(j, p_all[keep])
        if u.flushed:
            flushed_now = self._flushed_data(u, k_all, v_all, p_all)
            # dual-head pools: the staying part keeps its pages as they are (its moved-out
            # entries are dead slots); nothing it holds is written again. Only the packed
            # layout (the ablation) rewrites it, as one exact extent.
            if not self.store.dual_head and self.store.needs_compaction(u):
                self.store.compact(u, flushed_now)
            ctx.refresh(uid, flushed_now)
        ctx.updated(uid)
        # the other parts: new units (whole pages written now, the rest in their write buffers)
        for g, idx in enumerate(groups):
            if g == stay:
                continue
            ti = torch.from_numpy(idx)
            reason = "migrate"
            nu = self.store.create(self.head, k_all[ti], v_all[ti], p_all[idx], reason)
            self._mark(self._new_slot(nu.uid, x[idx]), p_all[idx])
            if nu.flushed:
                ctx.adopt(nu.uid, self._flushed_data(nu, k_all, v_all, p_all))
            ctx.updated(nu.uid)

    def _flushed_data(self, u: Unit, k_all: torch.Tensor, v_all: torch.Tensor, p_all: np.ndarray
                      ) -> FlushedData:
        """``u``'s flushed entries, in its address order, from RAM copies."""
        order = {int(p): i for i, p in enumerate(p_all)}
        idx = torch.tensor([order[int(p)] for p in u.pos], dtype=torch.long)
        return k_all[idx], v_all[idx], u.pos.copy()

    def _cluster_waiting(self, ctx: StepContext) -> None:
        """``local``: the waiting entries become clusters of their own."""
        k, v, p = self.waiting.tensors(self.d, self.store.dtype)
        self.waiting.clear()
        m = len(p)
        c = max(1, math.ceil(m / max(1, self.cfg.local_cluster)))
        labels = kmeans(k.float()[None], c, self.cfg.kmeans_iters, self.cfg.seed)[0].numpy()
        x = k.double().numpy()
        for lab in np.unique(labels):
            idx = np.nonzero(labels == lab)[0]
            ti = torch.from_numpy(idx)
            nu = self.store.create(self.head, k[ti], v[ti], p[idx], "append")
            self._mark(self._new_slot(nu.uid, x[idx]), p[idx])
            ctx.updated(nu.uid)
        self.splits.local_batches += 1

    # ---- checks (tests) ----------------------------------------------------------------------------
    def members(self) -> dict[int, np.ndarray]:
        """uid -> positions of every live cluster (flushed and write buffer)."""
        out = {}
        for s in range(self.size):
            if self.alive[s]:
                u = self.store.units[int(self.uid[s])]
                out[u.uid] = np.concatenate([u.pos, u.tail_pos])
        return out

    def buffered_positions(self) -> np.ndarray:
        parts = [np.asarray(b.pos, np.int64) for b in self.buffers.values()]
        parts.append(np.asarray(self.waiting.pos, np.int64))
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)


class TokenIndex:
    """``nocluster``: the exact top entries by ``q . k``; the keys are the index (in RAM)."""

    def __init__(self, layer: int, head: int, store: TokenStore, keys: torch.Tensor) -> None:
        self.layer, self.head = layer, head
        self.store = store
        n, d = keys.shape
        self.keys = np.zeros((max(64, 2 * n), d), np.float32)
        self.keys[:n] = keys.float().numpy()
        self.count = n
        self.splits = SplitCounts()
        self.buffered = 0
        self.buffer_peak = 0
        self.size = 0
        self.resident_entries = 0
        self.last_keep: dict[int, np.ndarray] = {}

    @property
    def clusters(self) -> int:
        return 0

    def index_bytes(self) -> int:
        return self.count * self.keys.shape[1] * 4

    def select(self, qg: np.ndarray, budget: int, window: tuple[int, int]) -> list[int]:
        """Pages holding the ``budget`` best entries outside the window ``(sinks, start)``;
        ``last_keep`` says which positions of each page to attend."""
        s_end, w0 = window
        lo, hi = s_end, min(w0, self.store.flushed(self.head))
        self.last_keep = {}
        if hi <= lo or budget <= 0:
            return []
        sc = (qg @ self.keys[lo:hi].T).max(0)
        b = min(budget, hi - lo)
        top = np.argpartition(-sc, b - 1)[:b] + lo if b < hi - lo else np.arange(lo, hi)
        pp = self.store.rec.per_page
        uids = (self.head * self.store.region + top // pp)
        for uid in np.unique(uids):
            self.last_keep[int(uid)] = np.sort(top[uids == uid])
        return list(self.last_keep)

    def observe(self, k: torch.Tensor, v: torch.Tensor, pos: int, ctx: StepContext) -> None:
        if self.count == self.keys.shape[0]:
            new = np.zeros((2 * self.count, self.keys.shape[1]), np.float32)
            new[:self.count] = self.keys[:self.count]
            self.keys = new
        self.keys[self.count] = k.float().numpy()
        self.count += 1
        self.store.add(self.head, k[None], v[None])

    def finish_step(self, selected: list[int], ctx: StepContext) -> None:
        pass

    def resident(self) -> FlushedData:
        """The head's partial last page (its write buffer, in RAM): always attended, so a window
        shorter than a page loses nothing (the layer drops what the window already holds)."""
        k, v = self.store.tail_k[self.head], self.store.tail_v[self.head]
        p0 = self.store.flushed(self.head)
        return k, v, np.arange(p0, p0 + int(k.shape[0]), dtype=np.int64)
