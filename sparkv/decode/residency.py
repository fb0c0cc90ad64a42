"""Where one clustered layer's clusters are in RAM: :class:`ClusterResidency`.

During a step a cluster's flushed entries are in RAM in one of three places: the step's data
(what this step read or found, :attr:`ClusterResidency.step_data`), the prefetch staging (read
on the I/O thread while the previous layer computed, :attr:`ClusterResidency.staged`) or the
cluster cache shared by every layer (keyed ``(layer, uid)``). :class:`ClusterResidency` keeps
the first two, fills the step's data at selection (:meth:`ClusterResidency.read_selected`),
keeps all three in step when a cluster changes (it is its indexes'
:class:`~sparkv.decode.index.StepContext` and its store's ``ram_lookup`` / ``on_flushed``) and
says what the prefetcher should read for the next step (:meth:`ClusterResidency.predicted`,
:meth:`ClusterResidency.near_cutoff`).
"""

from __future__ import annotations

from typing import Protocol, Sequence

from sparkv.decode.cache import ClusterCache, data_bytes
from sparkv.decode.index import ClusterIndex, TokenIndex
from sparkv.decode.stats import Counters
from sparkv.decode.store import ClusterStore, FlushedData, TokenStore


class ClusteredMemory(Protocol):
    """What a layer's residency uses of its model's clustered memory
    (:class:`~sparkv.decode.policy.ClusteredKV`)."""

    cache: ClusterCache
    counters: Counters

    def held(self, data: FlushedData) -> FlushedData: ...


class ClusterResidency:
    """Layer ``l``'s clusters in RAM (module docstring).

    Args:
        eng: the model's clustered memory (its cache, counters and ``held``).
        l: the layer.
        store: the layer's flash file.
        indexes: the layer's index per KV head (the list it fills).
        heads: KV heads.
    """

    def __init__(self, eng: ClusteredMemory, l: int, store: ClusterStore | TokenStore,  # noqa: E741
                 indexes: Sequence[ClusterIndex | TokenIndex], heads: int) -> None:
        self.eng, self.l = eng, l
        self.store, self.indexes = store, indexes
        #: uid -> flushed entries this step read or found (the upkeep's, until it ends)
        self.step_data: dict[int, FlushedData] = {}
        #: uid -> flushed entries the prefetcher read for this step
        self.staged: dict[int, FlushedData] = {}
        #: per KV head, the clusters the last step selected
        self.last_selected: list[list[int]] = [[] for _ in range(heads)]

    # ---- the step context (sparkv.decode.index.StepContext) ---------------------------------------
    def ram(self, uid: int) -> FlushedData | None:
        d = self.step_data.get(uid)
        if d is None:
            d = self.eng.cache.peek((self.l, uid))
        if d is None:
            d = self.staged.get(uid)
        return d

    def load(self, uid: int, reason: str) -> FlushedData:
        data = self.store.fetch([uid], reason)[uid]
        self.step_data[uid] = data
        self.eng.cache.put((self.l, uid), data)
        return data

    def updated(self, uid: int) -> None:
        self.eng.cache.reserve((self.l, uid))

    def adopt(self, uid: int, data: FlushedData) -> None:
        data = self.eng.held(data)
        self.step_data[uid] = data
        self.eng.cache.put((self.l, uid), data)

    def refresh(self, uid: int, data: FlushedData) -> None:
        key = (self.l, uid)
        if uid in self.step_data or uid in self.staged or key in self.eng.cache:
            data = self.eng.held(data)
        if uid in self.step_data:
            self.step_data[uid] = data
        if uid in self.staged:
            self.staged[uid] = data
        self.eng.cache.update((self.l, uid), data)

    def forget(self, uid: int) -> None:
        self.step_data.pop(uid, None)
        self.staged.pop(uid, None)
        self.eng.cache.remove((self.l, uid))

    def on_flushed(self, uid: int, data: FlushedData | None) -> None:
        """The store's callback: cluster ``uid``'s flushed entries are now ``data`` (None: it
        is gone)."""
        if data is None:
            self.forget(uid)
        else:
            self.refresh(uid, data)

    # ---- the prefetcher's plan ---------------------------------------------------------------------
    def predicted(self) -> list[int]:
        """What the next step will probably read here: the clusters it used this step."""
        out = []
        for sel in self.last_selected:
            for uid in sel:
                if self._flushed(uid):
                    out.append(uid)
        return out

    def near_cutoff(self, margin: int) -> list[int]:
        """The prefetch margin: per KV head, the best-scored clusters the last selection left out
        (best first), taken whole while their flushed entries fit ``margin`` entries; clusters
        with nothing on flash or already cached are skipped (tested: within the margin)."""
        if margin <= 0 or isinstance(self.store, TokenStore):
            return []
        out = []
        units = self.store.units
        cache, layer = self.eng.cache, self.l
        for idx in self.indexes:
            left = margin
            for uid in getattr(idx, "next_up", ()):
                u = units.get(uid)
                if u is None or not u.flushed or (layer, uid) in cache:
                    continue
                if u.flushed <= left:
                    out.append(uid)
                    left -= u.flushed
                    if not left:
                        break
        return out

    def _flushed(self, uid: int) -> bool:
        if isinstance(self.store, TokenStore):
            return True
        u = self.store.units.get(uid)
        return u is not None and u.flushed > 0

    # ---- a step ------------------------------------------------------------------------------------
    def stage(self, staged: dict[int, FlushedData]) -> None:
        """The prefetcher's reads for this step."""
        self.staged = staged

    def read_selected(self, selected: list[list[int]]) -> list[int]:
        """Fills :attr:`step_data` with the selected clusters' flushed entries, from the cache,
        the prefetch staging or flash (one read for every miss), counting each source. Returns
        the clusters read (misses) and then those taken from the staging: the cache's new
        candidates."""
        cnt = self.eng.counters
        self.step_data = step_data = {}
        misses = []
        used_staged = []
        cache, staged, layer = self.eng.cache, self.staged, self.l
        units = None if isinstance(self.store, TokenStore) else self.store.units
        ever = cache.ever
        for sel in selected:
            for uid in sel:
                if uid in step_data:
                    continue
                if units is not None:
                    u = units.get(uid)
                    if u is None or not u.addr.shape[0]:
                        continue
                key = (layer, uid)
                hit = cache.get_sized(key)
                if hit is not None:
                    cnt.hits += 1
                    cnt.hit_bytes += hit[1]
                    step_data[uid] = hit[0]
                    continue
                if key not in ever:
                    cnt.first_uses += 1
                data = staged.get(uid)
                if data is not None:
                    cnt.prefetch_hits += 1
                    cnt.prefetch_hit_bytes += data_bytes(data)
                    step_data[uid] = data
                    used_staged.append(uid)
                    continue
                misses.append(uid)
        if misses:
            got = self.store.fetch(misses, "retrieve")
            for uid, data in got.items():
                cnt.misses += 1
                cnt.miss_bytes += data_bytes(data)
                step_data[uid] = data
        cnt.staging_peak = max(cnt.staging_peak, sum(data_bytes(x) for x in self.staged.values()))
        cnt.prefetched_unused_bytes += sum(data_bytes(x) for u, x in self.staged.items()
                                           if u not in self.step_data)
        return misses + used_staged

    def offer(self, read: list[int]) -> None:
        """Offers the clusters ``read`` this step to the cache (the upkeep's first part)."""
        for uid in read:
            if uid in self.step_data:
                self.eng.cache.put((self.l, uid), self.step_data[uid])

    def end_step(self, selected: list[list[int]]) -> None:
        """The upkeep's last part: remembers the selection and drops the step's data."""
        self.last_selected = selected
        self.staged = {}
        self.step_data = {}
