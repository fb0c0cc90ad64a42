"""The knobs of a decode-time KV policy, and the named policies built from them.

One :class:`DecodeConfig` drives every clustered policy; a policy name
(:data:`POLICIES`) is a preset of its fields:

==================  ============================================================================
``full``            every entry in RAM (the KV memory as it is; :class:`~sparkv.cache.SparkvCache`)
``dynakv``          DynaKV: variance-bounded clusters, delayed split, dual-head pools, the
                    cluster-aware replacement (small and recently updated clusters kept)
``dynakv-eager``    DynaKV without delayed split: a cluster over its threshold is read now and
                    split (the ablation of migration-free adaptation)
``dynakv-packed``   DynaKV without dual-head pools: clusters packed back to back, so a cluster
                    that grows is relocated whole (read if not in RAM, rewritten at the end)
``dynakv-lru``      DynaKV with plain LRU replacement (no size preference, no reservation)
``static``          PQCache-style static update: a new entry joins its nearest cluster, always
``local``           ClusterKV-style local update: every ``local_every`` new entries are
                    clustered on their own into new clusters
``nocluster``       no clustering: the exact top entries by ``q . k`` (keys kept in RAM as the
                    index), fetched page by page from a token-ordered file
``stream``          no retrieval: every entry on flash, each layer read whole at every step (the
                    baseline of a context whose full KV does not fit the RAM budget)
==================  ============================================================================

The baselines share DynaKV's flash store, cache machinery and prefetcher; they use LRU
replacement (the standard policy) unless told otherwise, so what differs between ``dynakv``,
``static`` and ``local`` is the cluster update policy, and each ``dynakv-*`` ablation changes one
mechanism.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

#: policy name -> field overrides of DecodeConfig
POLICIES: dict[str, dict[str, Any]] = {
    "full": {"update": "full"},
    "dynakv": {},
    "dynakv-eager": {"delayed_split": False},
    "dynakv-packed": {"dual_head": False},
    "dynakv-lru": {"replacement": "lru"},
    "static": {"update": "static", "replacement": "lru"},
    "local": {"update": "local", "replacement": "lru"},
    "nocluster": {"update": "nocluster", "replacement": "lru"},
    "stream": {"update": "stream"},
}


@dataclass(frozen=True)
class DecodeConfig:
    """Knobs of a clustered decode policy (docs/dynakv.md, "The policy knobs").

    Attributes:
        update: ``dynakv`` | ``static`` | ``local`` | ``nocluster`` | ``full``.
        budget: entries retrieved per KV head per decoding step (clusters are taken whole, best
            score first, while they fit); a float in (0, 1] is a fraction of the entries the head
            holds at that step.
        ram_budget: bytes of KV entries the policy may hold in RAM (window, delayed-split buffers,
            write buffers, prefetch staging and the cluster cache); a float in (0, 1] is a fraction
            of the final KV (every layer, every head, every position up to the end of decoding).
            ``None``: unbounded cache.
        sinks, recent: the always-resident window: the first ``sinks`` positions and the last
            ``recent`` ones (the current forward's tokens are always visible too).
        avg_cluster: prefill k-means makes ``ceil(n / avg_cluster)`` clusters per (layer, head).
        max_cluster: no cluster holds more entries (prefill splits bigger ones; DynaKV treats
            reaching it like exceeding the variance threshold). Pools are ``2 * max_cluster``.
        kmeans_iters: Lloyd iterations (prefill and splits).
        tau_quantile: the per-head variance threshold is this quantile of the prefill clusters'
            variances (mean squared distance to the centroid), over clusters of at least 4.
        buffer_max: B_max, delayed-split entries buffered per (layer, head) before the cluster
            with the largest buffer is loaded and split.
        delayed_split: split a flagged cluster when next retrieved (True) or read it and split
            at once (False).
        dual_head: two clusters per pool growing toward each other (True), or clusters packed
            back to back (False: growth relocates the cluster).
        write_buffer: pending (unflushed) entries per (layer, head) in page-aligned write buffers;
            past it, the least recently appended cluster's partial page is written padded.
        replacement: ``dynakv`` (size- and frequency-aware GreedyDual, GDSF, with reserved
            updated clusters) | ``lru``.
        reserve_frac: share of the cache reserved for just-updated clusters (``dynakv``).
        prefetch: read the next layer's predicted clusters on a thread while this layer computes.
        prefetch_margin: entries per KV head the prefetcher may also read beyond the clusters a
            layer used at the previous step: the best-scored clusters just below that step's
            selection cut-off (most likely to enter the next selection), taken whole, best first,
            while they fit. Its RAM is part of the fixed staging (0: off).
        pack_tails: past the write-buffer cap, pack the fullest tails into one full shared page
            (dual-head layout; no padding) instead of writing the fullest tail as a padded page.
        attend_tails: attend every cluster's write-buffer tail (its newest entries, in RAM) each
            step, selected or not (like the delayed-split buffers and ``local``'s waiting
            entries); False: a tail is attended only with its selected cluster.
        budget_outside_window: a selected cluster costs the entry budget only its entries outside
            the always-resident window (which is attended anyway), and a cluster wholly inside
            the window is not retrieved; False: its whole size.
        warm: fill the cluster cache at prefill with the clusters the prompt's last queries
            retrieve most often (the same rule for every policy; see ``ClusteredKV._warm``).
        local_every: ``local`` update: cluster the new entries every this many of them.
        local_cluster: ``local`` update: target entries per new cluster.
        merge_gap: pages of gap a read may span to join two runs into one operation.
        direct: ``O_DIRECT`` reads and writes (falls back to ``posix_fadvise`` where refused).
        op_cost_s, byte_cost_s: the flash cost model of the replacement policy (per read operation
            and per byte; this disk: ~80 us per 4-16 KiB read, ~0.55 ns/B at 1 MiB).
        seed: k-means seeding.
        full_steps: the first decoding steps (forwards after the question) attend the full KV,
            which is in RAM until the clusters are built anyway, while the clusters are built on
            a thread: the build is off the first token's path. The step after them waits for the
            build (if it is still running) and switches to the policy; a fixed count, so the
            tokens do not depend on how fast the build ran. 0: every step is the policy's (the
            first waits for the build). Clustered policies only (not ``stream``).
        background_upkeep: a step's cluster upkeep (new entries joining their clusters, splits,
            the cache's offers and reservations) runs on a worker thread, off the token's path,
            settled before the layer is used again (a lag of at most one step per layer; the
            entries not yet clustered are in the window: :mod:`sparkv.decode.upkeep`). False:
            inline, at the end of each layer's step.
    """

    update: str = "dynakv"
    budget: float = 0.1
    ram_budget: float | None = None
    sinks: int = 4
    recent: int = 32
    avg_cluster: int = 16
    max_cluster: int = 64
    kmeans_iters: int = 12
    tau_quantile: float = 0.9
    buffer_max: int = 16
    delayed_split: bool = True
    dual_head: bool = True
    write_buffer: int = 32
    replacement: str = "dynakv"
    reserve_frac: float = 0.05
    prefetch: bool = True
    prefetch_margin: int = 32
    pack_tails: bool = True
    warm: bool = True
    attend_tails: bool = True
    budget_outside_window: bool = False
    local_every: int = 32
    local_cluster: int = 8
    merge_gap: int = 1
    direct: bool = True
    op_cost_s: float = 80e-6
    byte_cost_s: float = 0.55e-9
    seed: int = 0
    full_steps: int = 16
    background_upkeep: bool = True

    def __post_init__(self) -> None:
        if self.update not in ("dynakv", "static", "local", "nocluster", "full", "stream"):
            raise ValueError(f"unknown update policy {self.update!r}")
        if self.replacement not in ("dynakv", "lru"):
            raise ValueError(f"unknown replacement {self.replacement!r}; known: dynakv, lru")
        if self.budget <= 0:
            raise ValueError("budget must be positive")
        if self.avg_cluster < 1 or self.max_cluster < max(2, self.avg_cluster):
            raise ValueError("need 1 <= avg_cluster <= max_cluster (>= 2)")
        if self.sinks < 0 or self.recent < 1:
            raise ValueError("sinks >= 0 and recent >= 1")
        if self.prefetch_margin < 0:
            raise ValueError("prefetch_margin must be >= 0")
        if not 0.0 < self.tau_quantile <= 1.0:
            raise ValueError("tau_quantile must be in (0, 1]")
        if self.full_steps < 0:
            raise ValueError("full_steps must be >= 0")

    def with_(self, **kw: Any) -> "DecodeConfig":
        return replace(self, **kw)


def policy_config(kv_policy: str, config: DecodeConfig | None = None, **overrides: Any
                  ) -> DecodeConfig:
    """The :class:`DecodeConfig` of a named policy: ``config`` (or the defaults) with the
    policy's preset, then ``overrides`` (any field) applied."""
    if kv_policy not in POLICIES:
        raise ValueError(f"unknown kv_policy {kv_policy!r}; known: {', '.join(POLICIES)}")
    known = {f.name for f in fields(DecodeConfig)}
    bad = sorted(set(overrides) - known)
    if bad:
        raise TypeError(f"unknown DecodeConfig fields {bad}")
    base = config or DecodeConfig()
    return replace(base, **POLICIES[kv_policy], **overrides)
