"""A clustered decode policy over a whole model: :class:`ClusteredKV`.

Built once after the prompt's prefill from every layer's entries (and the queries of the prompt's
last tokens, for the co-retrieval placement), it keeps per layer: the always-resident window
(sinks and recent tokens), a :class:`~sparkv.decode.store.ClusterStore` (or ``TokenStore``) file
on flash and one index per KV head; across layers: the cluster cache, the prefetcher and the
counters. At each decoding step, layer by layer (:meth:`LayerState.attend`):

1. the prefetched clusters of this layer are collected (read on a thread while the previous layer
   computed);
2. each KV head selects its clusters (query-centroid scores of every head in one batched matmul
   over the layer's :class:`~sparkv.decode.index.CentroidTable`, within the entry budget);
3. clusters not in the cache nor prefetched are read (one pass: runs of pages, merged);
4. the next layer's predicted clusters (those it used last step, plus the best-scored ones just
   below its last cut-off within ``prefetch_margin`` entries per head) are handed to the
   prefetcher;
5. attention runs over the selected clusters' entries + buffered entries + every write-buffer
   tail (RAM; ``attend_tails``) + the window, with
   explicit positions (:func:`sparkv.cache.ragged_attention`; cluster order is irrelevant);
6. the clusters read are offered to the cache; the new entries join their clusters (splits,
   buffers); delayed splits and the B_max overflow run.

The cache is warmed at prefill (``warm``): the clusters the prompt's last queries retrieve most
often, by one rule for every policy (:meth:`ClusteredKV._warm`).

A :class:`LayerState` builds its clusters, selects (step 2) and runs the step's upkeep; it owns
three parts: its :class:`~sparkv.decode.window.RecentWindow`, its
:class:`~sparkv.decode.residency.ClusterResidency` (where its clusters are in RAM: steps 1 and 3,
the prefetcher's plan of step 4, the cache's side of step 6) and its
:class:`~sparkv.decode.attend.LayerAttention` (step 5, and the recall probe).
"""

from __future__ import annotations

import math
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from sparkv.cache.hostmem import host_addressable
from sparkv.cache.layer import HeadEntries
from sparkv.decode.cache import ClusterCache, data_bytes
from sparkv.decode.attend import LayerAttention
from sparkv.decode.config import DecodeConfig
from sparkv.decode.index import CentroidTable, ClusterIndex, TokenIndex, partition
from sparkv.decode.kmeans import kmeans, stats
from sparkv.decode.residency import ClusterResidency
from sparkv.decode.rows import RowArena, Rows
from sparkv.decode.select import select_heads
from sparkv.decode.stats import Counters
from sparkv.decode.store import ClusterStore, FlushedData, IOStats, TokenStore
from sparkv.decode.upkeep import Upkeep
from sparkv.decode.window import RecentWindow
from sparkv.runtime.heap import trim_heap


def prefill_frequency(means: np.ndarray, sizes: np.ndarray, qg: np.ndarray | None,
                      budget: int) -> tuple[np.ndarray, np.ndarray]:
    """How often the prompt's last queries (``qg [r, D]``) retrieve each cluster within
    ``budget`` entries (best score first, taken whole while the running total fits): the
    retrieval frequency ``[C]`` and the pairwise co-retrieval counts ``[C, C]`` (zero diagonal)."""
    c = means.shape[0]
    f = np.zeros((c, c))
    freq = np.zeros(c)
    if qg is not None and len(qg):
        sc = qg @ means.T                                     # [r, C]
        order = np.argsort(-sc, axis=1)
        for row in order:
            take = int(np.searchsorted(np.cumsum(sizes[row]), budget, side="right"))
            s = row[:max(1, take)]
            freq[s] += 1
            f[np.ix_(s, s)] += 1
        np.fill_diagonal(f, 0)
    return freq, f


def coretrieval_order(means: np.ndarray, sizes: np.ndarray, qg: np.ndarray | None,
                      budget: int) -> list[int]:
    """An order of clusters that puts clusters retrieved together next to each other.

    For every query vector of the prompt's last tokens (``qg [r, D]``), the clusters it would
    retrieve within ``budget`` entries are counted as co-retrieved pairwise (the frequency matrix
    ``f``, :func:`prefill_frequency`). The chain starts at the most retrieved cluster and
    repeatedly appends the unplaced cluster most often co-retrieved with the last one (ties: the
    nearest centroid by cosine). Without queries the chain follows centroid similarity alone."""
    c = means.shape[0]
    if c <= 2:
        return list(range(c))
    norm = means / np.maximum(np.linalg.norm(means, axis=1, keepdims=True), 1e-12)
    sim = norm @ norm.T
    freq, f = prefill_frequency(means, sizes, qg, budget)
    start = int(np.lexsort((sizes, freq))[-1])
    placed = np.zeros(c, bool)
    chain = [start]
    placed[start] = True
    for _ in range(c - 1):
        last = chain[-1]
        key = f[last] * 10.0 + sim[last]                      # co-retrieval first, then similarity
        key[placed] = -np.inf
        nxt = int(key.argmax())
        chain.append(nxt)
        placed[nxt] = True
    return chain


def prefill_clusters(x: np.ndarray, labels: np.ndarray, c: int,
                     cfg: DecodeConfig) -> tuple[list[np.ndarray], float, int]:
    """One head's prompt clusters from its k-means ``labels [n]`` (``c`` clusters) of its keys
    ``x [n, D]``: the variance threshold ``tau`` (the ``tau_quantile`` of the clusters' mean
    variances, those of 4 entries or more), each cluster over ``tau`` or ``max_cluster`` split
    (:func:`~sparkv.decode.index.partition`). Returns the clusters' rows, ``tau`` and the splits
    made."""
    groups = [np.nonzero(labels == j)[0] for j in range(c)]
    groups = [g for g in groups if len(g)]
    var = np.array([stats(x[g])[2] / len(g) for g in groups if len(g) >= 4])
    tau = float(np.quantile(var, cfg.tau_quantile)) if len(var) else \
        float(max(stats(x[g])[2] / len(g) for g in groups))
    final: list[np.ndarray] = []
    splits = 0
    for g in groups:
        if stats(x[g])[2] / len(g) > tau or len(g) > cfg.max_cluster:
            parts = partition(x[g], tau, cfg.max_cluster, cfg.kmeans_iters)
            final.extend(g[p] for p in parts)
            splits += len(parts) - 1
        else:
            final.append(g)
    return final, tau, splits


class BuildStopped(Exception):
    """A clustered memory's build was stopped (:meth:`ClusteredKV.build`'s ``stop``)."""


def drain(futures: dict[int, Future], pool: ThreadPoolExecutor) -> None:
    """Waits for every read still in flight (its error ignored: the files are being removed),
    forgets them and shuts the I/O pool down."""
    for fut in futures.values():
        try:
            fut.result()
        except Exception:  # noqa: BLE001 - the files are being removed anyway
            pass
    futures.clear()
    pool.shutdown(wait=True)


class Prefetcher:
    """Reads the next layer's predicted clusters on the I/O thread (``os.preadv`` releases the
    GIL, so the read overlaps this layer's compute). The same thread writes pages, in order."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.io = ThreadPoolExecutor(1, thread_name_prefix="dynakv-io")
        self.pool = self.io if enabled else None
        self.futures: dict[int, Future] = {}
        self.wait_s = 0.0
        self.margin_units = 0

    def submit(self, layer: "LayerState") -> None:
        if self.pool is None or layer.l in self.futures:
            return
        cache = layer.eng.cache
        plan = layer.residency
        uids = [u for u in plan.predicted() if (layer.l, u) not in cache]
        uids += [u for u in plan.near_cutoff(layer.eng.cfg.prefetch_margin)
                 if (layer.l, u) not in cache]
        uids = list(dict.fromkeys(uids))
        if not uids:
            return
        self.margin_units += len(uids)
        runs = layer.store.plan(uids)
        self.futures[layer.l] = self.pool.submit(layer.store.read_runs, uids, runs, "prefetch")

    def take(self, l: int) -> dict[int, FlushedData]:  # noqa: E741
        fut = self.futures.pop(l, None)
        if fut is None:
            return {}
        t0 = time.perf_counter()
        out = fut.result()
        self.wait_s += time.perf_counter() - t0
        return out

    def close(self) -> None:
        drain(self.futures, self.io)


class LayerState:
    """One layer of a :class:`ClusteredKV` (module docstring)."""

    def __init__(self, eng: "ClusteredKV", l: int, heads: Sequence[HeadEntries],  # noqa: E741
                 queries: torch.Tensor | None) -> None:
        self.eng, self.l = eng, l
        cfg = eng.cfg
        k_all = torch.stack([e.k for e in heads]).to(eng.dtype)          # [H, n, D]
        v_all = torch.stack([e.v for e in heads]).to(eng.dtype)
        self.end = int(k_all.shape[1])
        self.window = RecentWindow(k_all, v_all, cfg.sinks, cfg.recent)
        self.new: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        path = eng.dir / f"layer{l:03d}.pages"
        self.indexes: list[ClusterIndex | TokenIndex] = []
        self.table: CentroidTable | None = None
        #: uid -> how often the prompt's last queries retrieved the cluster (prefill clusters)
        self.prefill_freq: dict[int, float] = {}
        #: uid -> its entries as placed (RAM at prefill; the cache's warm-up, then dropped)
        self.warm_data: dict[int, FlushedData] = {}
        if cfg.update == "nocluster":
            self.store: ClusterStore | TokenStore = self._token_store(path, k_all, v_all)
        else:
            self.store = ClusterStore(path, eng.H, eng.D, eng.dtype, eng.io,
                                      max_cluster=cfg.max_cluster, dual_head=cfg.dual_head,
                                      write_buffer=cfg.write_buffer, merge_gap=cfg.merge_gap,
                                      direct=cfg.direct, executor=eng.prefetcher.io,
                                      pack_tails=cfg.pack_tails)
            self._build_clusters(k_all, v_all, queries)
            self.table = CentroidTable(self.indexes)  # type: ignore[arg-type]
        self.residency = ClusterResidency(eng, l, self.store, self.indexes, eng.H)
        if isinstance(self.store, ClusterStore):
            self.store.ram_lookup = self.residency.ram
            self.store.arena = eng.arena
            self.store.on_flushed = self.residency.on_flushed
        self.attention = LayerAttention(
            self.store, self.indexes, self.window, eng.arena, eng.counters, group=eng.group,
            attend_tails=cfg.attend_tails, probe_capacity=eng.max_positions if eng.probe else None)
        if eng.probe:
            self.attention.record(k_all, v_all, 0)

    # ---- prefill clustering ------------------------------------------------------------------------
    def _token_store(self, path: Path, k_all: torch.Tensor, v_all: torch.Tensor) -> TokenStore:
        """``nocluster``: every head's entries on flash in position order, one token index each."""
        eng, cfg = self.eng, self.eng.cfg
        store = TokenStore(path, eng.H, eng.D, eng.dtype, eng.io, max_positions=eng.max_positions,
                           merge_gap=cfg.merge_gap, direct=cfg.direct, executor=eng.prefetcher.io)
        for h in range(eng.H):
            store.add(h, k_all[h], v_all[h], reason="prefill")
            self.indexes.append(TokenIndex(self.l, h, store, k_all[h]))
        return store

    def _build_clusters(self, k_all: torch.Tensor, v_all: torch.Tensor,
                        queries: torch.Tensor | None) -> None:
        eng, cfg = self.eng, self.eng.cfg
        n = int(k_all.shape[1])
        c = max(1, math.ceil(n / cfg.avg_cluster))
        labels = kmeans(k_all.float(), c, cfg.kmeans_iters, cfg.seed + self.l).numpy()
        pos = np.arange(n)
        budget = eng.budget_for(n)
        for h in range(eng.H):
            x = k_all[h].double().numpy()
            final, tau, splits = prefill_clusters(x, labels[h], c, cfg)
            eng.prefill_splits += splits
            means = np.stack([x[g].mean(0) for g in final])
            sizes = np.array([len(g) for g in final])
            qg = None
            if queries is not None:
                qg = queries[h * eng.group:(h + 1) * eng.group].reshape(-1, eng.D).double().numpy()
            order = coretrieval_order(means, sizes, qg, budget)
            freq = prefill_frequency(means, sizes, qg, budget)[0]
            ordered = []
            for i in order:
                rows = torch.from_numpy(final[i])
                ordered.append((k_all[h][rows], v_all[h][rows], pos[final[i]]))
            idx = ClusterIndex(self.l, h, self.store, cfg, tau)  # type: ignore[arg-type]
            idx.win = self.window.bounds()
            uids = idx.build(ordered)
            for uid, i, data in zip(uids, order, ordered):
                self.prefill_freq[uid] = float(freq[i])
                self.warm_data[uid] = data
            self.indexes.append(idx)

    # ---- a step ------------------------------------------------------------------------------------
    def update(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """New entries ``[H, q, D]`` at the next positions; returns the positions."""
        q = int(k.shape[1])
        pos = torch.arange(self.end, self.end + q)
        k, v = k.to(self.eng.dtype), v.to(self.eng.dtype)
        self.new = (k, v, pos)
        self.window.append(k, v)
        if self.eng.probe:
            self.attention.record(k, v, self.end)
        self.end += q
        return pos

    def attend(self, q: torch.Tensor, scale: float | None, q_pos: torch.Tensor) -> torch.Tensor:
        """``q [1, Hq, nq, D]`` over this layer's memory (module docstring); ``[1, Hq, nq, D]``.

        The steps of the module docstring, each timed into its counter: collect the prefetched
        clusters (``io_s``), select (``select_s``), read what is missing (``io_s``), hand the
        next layer to the prefetcher and attend (``attend_s``), probe (``probe_s``), hand the
        upkeep to its thread (``update_s``, with the waits for this layer's and the next one's
        last upkeep, :mod:`sparkv.decode.upkeep`)."""
        eng, cnt = self.eng, self.eng.counters
        assert self.new is not None, "update() first"
        nxt = eng.layers[(self.l + 1) % len(eng.layers)] if eng.layers else None
        t0 = time.perf_counter()
        # the last step's upkeep of this layer (settled already, as a rule) and of the next one,
        # whose reads the prefetcher plans below on its clusters
        eng.upkeep.settle(self.l)
        if nxt is not None:
            eng.upkeep.settle(nxt.l)
        tw = time.perf_counter()
        cnt.update_s += tw - t0
        t0 = tw
        self.residency.stage(eng.prefetcher.take(self.l))
        t1 = time.perf_counter()
        cnt.io_s += t1 - t0
        selected = self._select(q)
        t2 = time.perf_counter()
        cnt.select_s += t2 - t1
        read = self.residency.read_selected(selected)
        t3 = time.perf_counter()
        cnt.io_s += t3 - t2
        # the next layer's reads go on while this one computes
        if nxt is not None and nxt is not self:
            eng.prefetcher.submit(nxt)
        out, heads = self.attention.attend(q, q_pos, scale, selected, self.residency.step_data)
        t4 = time.perf_counter()
        cnt.attend_s += t4 - t3
        if eng.probe and q.shape[2] == 1:
            self.attention.probe(q, out, heads, scale, self.end)
            t5 = time.perf_counter()
            cnt.probe_s += t5 - t4
            t4 = t5
        new, self.new = self.new, None
        self.window.slide()
        eng.upkeep.submit(self.l, self._end_step, selected, read, new)
        cnt.update_s += time.perf_counter() - t4
        return out

    def _select(self, q: torch.Tensor) -> list[list[int]]:
        """Per KV head, the clusters (or tokens) it selects within this step's entry budget."""
        eng, cfg = self.eng, self.eng.cfg
        qn = q[0].detach().float().numpy()                              # [Hq, nq, D]
        g, d = eng.group, eng.D
        budget = eng.budget_for(self.end)
        window = self.window.bounds()
        selected: list[list[int]] = []
        if self.table is not None:
            # every head's centroids scored in one batched matmul ([H, G*nq, D] x [H, D, S]) and
            # selected in one batched sort / running total (sparkv.decode.select)
            table = self.table
            sc = table.masked_scores(qn.reshape(eng.H, -1, d))
            s = sc.shape[1]
            inwin = None
            if cfg.budget_outside_window:
                inwin = np.zeros((eng.H, s), np.int64)
                for h, idx in enumerate(self.indexes):
                    c = idx.window_counts(*window)  # type: ignore[union-attr]
                    inwin[h, :len(c)] = c
            sel = select_heads(sc, table.n[:, :s], budget, inwin)
            for h, idx in enumerate(self.indexes):
                uid = idx.uid  # type: ignore[union-attr]
                idx.next_up = uid[sel.next_up[h]].tolist()  # type: ignore[union-attr]
                selected.append(uid[sel.picked[h]].tolist())
            return selected
        for h, idx in enumerate(self.indexes):
            qg = qn[h * g:(h + 1) * g].reshape(-1, d)
            selected.append(idx.select(qg, budget, window))  # type: ignore[call-arg]
        return selected

    def absorb(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Entries ``[H, q, D]`` at the next positions that were attended elsewhere (the full KV's
        steps while the clusters were built) join their clusters as a step's new entries do,
        with no attention and nothing selected (so no delayed split; a B_max overflow may read)."""
        self.eng.upkeep.settle(self.l)
        self.update(k, v)
        new, self.new = self.new, None
        assert new is not None      # update() just made it
        self._end_step([[] for _ in self.indexes], [], new)
        self.window.slide()

    def _end_step(self, selected: list[list[int]], read: list[int],
                  new: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """The step's upkeep (on the upkeep thread, :mod:`sparkv.decode.upkeep`): offers the
        clusters ``read`` to the cache and lets the ``new`` entries join their clusters (splits,
        buffers; :meth:`ClusterIndex.observe`, ``finish_step``)."""
        ctx = self.residency
        ctx.offer(read)
        k_new, v_new, pos_new = new
        for j in range(int(pos_new.shape[0])):
            p = int(pos_new[j])
            for h, idx in enumerate(self.indexes):
                idx.observe(k_new[h, j], v_new[h, j], p, ctx)
        for h, idx in enumerate(self.indexes):
            idx.finish_step(selected[h], ctx)
        ctx.end_step(selected)

    # ---- accounting --------------------------------------------------------------------------------
    def ram_bytes(self) -> dict[str, int]:
        eb = self.store.rec.entry_bytes
        window = self.window.entries() * self.eng.H * eb
        buffers = sum(i.resident_entries for i in self.indexes) * eb
        return {"window": window, "buffers": buffers, "write_buffers": self.store.tail_entries * eb}

    def index_bytes(self) -> int:
        total = 0
        for i in self.indexes:
            if isinstance(i, TokenIndex):
                total += i.index_bytes()
            else:
                total += i.clusters * (i.d * 4 + 8 + 8)   # float32 centroid, n, M2
        return total

    def close(self) -> None:
        self.store.close(remove=True)


class ClusteredKV:
    """Every layer's clustered memory, the cache, the prefetcher and the counters.

    Args:
        entries: per layer, per KV head, every entry of the prompt (positions ``0 .. n-1``).
        queries: per layer ``[Hq, r, D]`` queries of the prompt's last tokens (co-retrieval), or
            None.
        num_query_heads: the model's attention heads.
        cfg: the knobs.
        final_tokens: positions expected at the end (sizes a fractional ``ram_budget``).
        max_positions: the model's window (sizes ``nocluster``'s regions and the probe).
        flash_dir: where the layer files go (a temporary directory under it is made and removed).
        probe: measure attention-mass recall and output error against full attention.
        deferred: only check the arguments (a ``ram_budget`` below the fixed parts is refused
            here) and set up; the clusters are built by :meth:`build` (on a thread: the
            session's background build, :mod:`sparkv.decode.background`).
    """

    def __init__(self, entries: Sequence[Sequence[HeadEntries]],
                 queries: Sequence[torch.Tensor | None] | None, num_query_heads: int,
                 cfg: DecodeConfig, *, final_tokens: int, max_positions: int,
                 flash_dir: str | Path | None = None, probe: bool = False,
                 deferred: bool = False) -> None:
        if cfg.update == "full":
            raise ValueError("the full policy needs no clustered memory")
        self.cfg = cfg
        first = entries[0][0]
        self.L, self.H = len(entries), len(entries[0])
        self.D = int(first.k.shape[1])
        self.dtype = first.k.dtype
        self.Hq = num_query_heads
        self.group = num_query_heads // self.H
        n = int(first.pos.shape[0])
        for layer in entries:
            for e in layer:
                if int(e.pos.shape[0]) != n or not torch.equal(e.pos.long(), torch.arange(n)):
                    raise ValueError("a clustered policy starts from every position of the prompt "
                                     "in every head (a full memory)")
        self.n0 = n
        self.final_tokens = max(final_tokens, n)
        self.max_positions = max(max_positions, self.final_tokens)
        self.probe = probe
        base = Path(flash_dir) if flash_dir is not None else Path(tempfile.gettempdir())
        base.mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix="dynakv-", dir=base))
        self.io = IOStats()
        self.counters = Counters()
        self.prefill_splits = 0
        eb = 2 * self.D * torch.empty(0, dtype=self.dtype).element_size()
        self.entry_bytes = eb
        self.final_kv_bytes = self.final_tokens * self.L * self.H * eb
        self.ram_budget = self._budget_bytes(cfg.ram_budget)
        cap = None if self.ram_budget is None else self.ram_budget - self.fixed_ram_bytes()
        if cap is not None and cap < 0:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise ValueError(f"ram_budget {self.ram_budget} B is below what the window, buffers and "
                             f"write buffers take ({self.fixed_ram_bytes()} B)")
        self.cache_capacity = cap
        self.cache = ClusterCache(None, cfg.replacement, op_cost_s=cfg.op_cost_s,
                                  byte_cost_s=cfg.byte_cost_s)
        #: every clustered entry held in RAM, as runs of rows (float32 on the CPU: the fused
        #: gather-attend reads them where they lie); None: per-cluster tensors, padded attention
        self.arena: RowArena | None = None
        if cfg.update != "nocluster" and self.dtype == torch.float32 and host_addressable(first.k):
            rows = n * self.H * self.L // 4 if self.ram_budget is None else \
                self.ram_budget // (eb + 8)
            self.arena = RowArena(self.D, self.dtype, capacity=max(4096, int(rows)))
        self.prefetcher = Prefetcher(cfg.prefetch)
        self.upkeep = Upkeep(cfg.background_upkeep)
        self.layers: list[LayerState] = []
        self.build_s = 0.0
        self.warmed = 0
        if not deferred:
            self.build(entries, queries)

    def build(self, entries: Sequence[Sequence[HeadEntries]],
              queries: Sequence[torch.Tensor | None] | None,
              stop: threading.Event | None = None) -> None:
        """Clusters every layer's entries and places them on flash, then warms the cache (the
        constructor's arguments). ``stop`` set: raises :class:`BuildStopped` at the next layer.
        On an error the memory is closed (its files removed)."""
        t0 = time.perf_counter()
        try:
            for l, heads in enumerate(entries):  # noqa: E741
                if stop is not None and stop.is_set():
                    raise BuildStopped(f"the build stopped before layer {l}")
                self.layers.append(LayerState(self, l, heads,
                                              None if queries is None else queries[l]))
                # a layer's clustering frees its k-means distances; on the build's thread glibc
                # kept what was freed in the thread's arena while the next layer's grew it again
                # (measured: +55 MB per layer, a SmolLM2-shape build at 4K held 4.5x its KV):
                # hand it back before the next layer
                trim_heap()
            cfg = self.cfg
            self.cache = ClusterCache(self.cache_capacity, cfg.replacement,
                                      op_cost_s=cfg.op_cost_s, byte_cost_s=cfg.byte_cost_s,
                                      reserve_frac=cfg.reserve_frac)
            self.warmed = self._warm() if cfg.warm else 0
        except BaseException:
            self.close()
            raise
        for state in self.layers:
            state.warm_data = {}
        self.build_s = time.perf_counter() - t0

    def _warm(self) -> int:
        """Fills the cache at prefill (the entries are in RAM then, so it costs no read), by one
        rule for every policy: the clusters the prompt's last queries retrieve most often
        (:func:`prefill_frequency`; ties: smaller first), as long as they fit, inserted least
        frequent first (so an LRU cache sees the most frequent as the most recent). The
        ``dynakv`` replacement also starts each cluster's retrieval count at that frequency
        (its GDSF priority). Returns the clusters cached."""
        cands = []
        for layer in self.layers:
            for uid, f in layer.prefill_freq.items():
                if f > 0:
                    cands.append((-f, data_bytes(layer.warm_data[uid]), layer.l, uid))
        cands.sort()
        cap = self.cache.capacity
        room = None if cap is None else cap
        chosen = []
        for negf, nbytes, l, uid in cands:  # noqa: E741
            if room is not None:
                if nbytes > room:
                    continue
                room -= nbytes
            chosen.append((negf, l, uid))
        if self.cfg.replacement == "dynakv":
            for layer in self.layers:
                for uid, f in layer.prefill_freq.items():
                    if f > 0:
                        self.cache.freq[(layer.l, uid)] = 1 + int(f)
        for negf, l, uid in reversed(chosen):  # noqa: E741
            self.cache.put((l, uid), self.held(self.layers[l].warm_data[uid]))
        return len(chosen)

    def held(self, data: FlushedData) -> FlushedData:
        """``data`` as it is held in RAM: a run of the row arena when there is one."""
        if self.arena is None or (isinstance(data, Rows) and data.arena is self.arena):
            return data
        return self.arena.put(*data)

    def _budget_bytes(self, b: float | None) -> int | None:
        if b is None:
            return None
        if isinstance(b, float) and b <= 1.0:
            return int(b * self.final_kv_bytes)
        return int(b)

    def budget_for(self, held: int) -> int:
        b = self.cfg.budget
        if isinstance(b, float) and b <= 1.0:
            return max(1, int(math.ceil(b * held)))
        return int(b)

    def fixed_ram_bytes(self) -> int:
        """What the cache cannot use: the window, B_max buffers, write buffers, local waiting
        entries and one layer of prefetch staging, at their caps."""
        cfg, eb, per = self.cfg, self.entry_bytes, self.L * self.H
        per_page = max(1, 4096 // eb)
        total = (cfg.sinks + cfg.recent) * eb * per
        if cfg.update == "dynakv":
            total += cfg.buffer_max * eb * per
        if cfg.update == "local":
            total += cfg.local_every * eb * per
        if cfg.update != "nocluster":
            total += cfg.write_buffer * eb * per
        else:
            total += per_page * eb * per                 # each head's partial page
        if cfg.prefetch:                                 # one layer's staging
            staged = self.budget_for(self.final_tokens)
            if cfg.update == "nocluster":                # whole pages
                staged = min(staged * per_page, self.final_tokens)
            else:
                staged += cfg.prefetch_margin            # the margin below the cut-off
            total += staged * eb * self.H
        return total

    # ---- per step ----------------------------------------------------------------------------------
    def settle(self) -> None:
        """Waits for every layer's pending upkeep (:mod:`sparkv.decode.upkeep`; raises its
        error): the clusters, buffers, store and cache are then as the steps so far left them."""
        self.upkeep.settle_all()

    def end_step(self, tokens: int) -> None:
        cnt = self.counters
        cnt.steps += 1
        cnt.tokens += tokens
        # the upkeep may be running: its parts are counters read as they are (a step's new
        # entries are in the window until settled, so they are counted there meanwhile)
        cnt.ram_peak = max(cnt.ram_peak, self._ram_bytes()["total"])

    def ram_bytes(self) -> dict[str, int]:
        """RAM by part, every layer's upkeep settled."""
        self.settle()
        return self._ram_bytes()

    def _ram_bytes(self) -> dict[str, int]:
        out = {"cache": self.cache.bytes, "window": 0, "buffers": 0, "write_buffers": 0,
               "staging": self.counters.staging_peak}
        for layer in self.layers:
            for k, v in layer.ram_bytes().items():
                out[k] += v
        out["total"] = sum(out.values())
        return out

    def index_bytes(self) -> int:
        return sum(layer.index_bytes() for layer in self.layers)

    def check(self) -> None:
        """Invariants (tests): per head, clusters, buffers and waiting entries partition every
        position; dynakv clusters without a flag are under their threshold; the cache never
        evicted a reserved cluster."""
        self.settle()
        for layer in self.layers:
            for idx in layer.indexes:
                if isinstance(idx, TokenIndex):
                    continue
                parts = list(idx.members().values()) + [idx.buffered_positions()]
                allp = np.sort(np.concatenate(parts))
                if not np.array_equal(allp, np.arange(layer.end)):
                    raise AssertionError(f"layer {layer.l} head {idx.head}: clusters and buffers "
                                         "do not partition the entries")
                if self.cfg.update == "dynakv":
                    var = idx.variance()
                    bad = idx.alive[:idx.size] & ~idx.flag[:idx.size] & (
                        (var > idx.tau * (1 + 1e-9) + 1e-12)
                        | (idx.n[:idx.size] > self.cfg.max_cluster))
                    if bad.any():
                        raise AssertionError(f"layer {layer.l} head {idx.head}: an unflagged "
                                             "cluster is over its threshold")
        if self.cache.evicted_reserved:
            raise AssertionError("a reserved cluster was evicted")

    def flush(self) -> None:
        """Waits for every layer's upkeep, then for every pending page write."""
        self.settle()
        for layer in self.layers:
            layer.store.file.flush()

    def close(self) -> None:
        self.upkeep.close()
        self.prefetcher.close()
        for layer in self.layers:
            layer.close()
        shutil.rmtree(self.dir, ignore_errors=True)
