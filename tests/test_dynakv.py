"""DynaKV (sparkv.decode): long decoding with clustered KV on flash, and its baselines.

Synthetic layers drive :class:`ClusteredKV` directly (keys that drift away from the prompt's
clusters, so clusters split, buffer and overflow); the tiny random Llama checks that a budget
holding everything decodes exactly like full KV.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from sparkv.cache import FlashError, ragged_attention
from sparkv.cache.layer import HeadEntries
from sparkv.decode import (POLICIES, ClusterCache, ClusteredKV, DecodeConfig, DecodeSession,
                           coretrieval_order, generate, policy_config)
from sparkv.decode.index import ClusterIndex
from sparkv.decode.kmeans import kmeans, stats, two_means
from sparkv.decode.store import PAGE, ClusterStore, IOStats, PageFile, runs_of
from sparkv.runtime import greedy_generate, reference_prefill

L, H, G, D = 2, 2, 2, 16


def _key(rng: torch.Generator, center: torch.Tensor, scale: float = 0.3) -> torch.Tensor:
    return center + scale * torch.randn(center.shape, generator=rng)


class Synthetic:
    """A prompt of ``n`` entries around 6 centres per head, then new keys around a centre that
    drifts away (the KV distribution shift), random queries."""

    def __init__(self, n: int = 160, seed: int = 0, d: int = D) -> None:
        self.rng = torch.Generator().manual_seed(seed)
        self.d = d
        self.centers = torch.randn(L, H, 6, d, generator=self.rng) * 2
        self.direction = torch.randn(L, H, d, generator=self.rng)
        self.direction /= self.direction.norm(dim=-1, keepdim=True)
        self.keys: list[list[list[torch.Tensor]]] = [[[] for _ in range(H)] for _ in range(L)]
        self.entries = []
        for l in range(L):  # noqa: E741
            heads = []
            for h in range(H):
                pick = torch.randint(0, 6, (n,), generator=self.rng)
                k = _key(self.rng, self.centers[l, h, pick])
                v = torch.randn(n, d, generator=self.rng)
                self.keys[l][h] = list(k)
                heads.append(HeadEntries(k, v, torch.arange(n)))
            self.entries.append(heads)
        self.n = n

    def new(self, l: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: E741
        ks = []
        for h in range(H):
            if t % 3 == 0:          # some new entries still look like the prompt's
                c = self.centers[l, h, t % 6]
            else:
                c = self.centers[l, h, 0] + self.direction[l, h] * (0.08 * t)
            k = _key(self.rng, c, 0.4)
            self.keys[l][h].append(k)
            ks.append(k)
        k = torch.stack(ks)[:, None]
        return k, torch.randn(H, 1, self.d, generator=self.rng)

    def query(self) -> torch.Tensor:
        return torch.randn(1, H * G, 1, self.d, generator=self.rng)


def _run(tmp_path, policy: str, steps: int = 60, check_every: int = 1, d: int = D, **kw
         ) -> tuple[ClusteredKV, Synthetic, list[dict]]:
    syn = Synthetic(d=d)
    base = dict(budget=24, ram_budget=60_000, sinks=2, recent=8, avg_cluster=8, max_cluster=24,
                buffer_max=6, write_buffer=8, local_every=8, local_cluster=4)
    base.update(kw)
    cfg = policy_config(policy, **base)
    kv = ClusteredKV(syn.entries, None, H * G, cfg, final_tokens=syn.n + steps,
                     max_positions=syn.n + steps + 16, flash_dir=tmp_path)
    trace = []
    try:
        for t in range(steps):
            for l, layer in enumerate(kv.layers):  # noqa: E741
                k, v = syn.new(l, t)
                pos = layer.update(k, v)
                layer.attend(syn.query(), None, pos)
            kv.end_step(1)
            kv.settle()                  # the last layers' upkeep may still be running
            if t % check_every == 0:
                kv.check()
            trace.append({"buffered": sum(i.buffered for lay in kv.layers for i in lay.indexes),
                          "flagged": sum(int(i.flag[:i.size].sum()) for lay in kv.layers
                                         for i in lay.indexes if isinstance(i, ClusterIndex))})
        kv.check()
        kv.flush()
    except BaseException:
        kv.close()
        raise
    return kv, syn, trace



class _SplitSpy:
    """Records, during a run, every write (store, head, unit, reason, positions) and checks each
    split: its staying part keeps its flushed entries where they were, and the split writes only
    the moving entries, each once (test_a_split_writes_no_byte_twice)."""

    def __init__(self) -> None:
        self.writes: list = []
        self.kept_splits = self.kept_entries = 0
        self.violations: list[str] = []

    def install(self, mp: pytest.MonkeyPatch) -> None:
        orig_write, orig_split = ClusterStore._write, ClusterIndex._split
        spy = self

        def write(store, u, k, v, pos, reason, pages=None):
            orig_write(store, u, k, v, pos, reason, pages)
            spy.writes.append(((id(store), u.head), u.uid, reason, np.asarray(pos).tolist()))

        def split(idx, j, ctx, extra=None, kind="inline"):
            u = idx.store.units[int(idx.uid[j])]
            old = dict(zip(u.pos.tolist(), u.addr.tolist()))      # flushed before the split
            n0 = len(spy.writes)
            orig_split(idx, j, ctx, extra, kind)
            stayed = [p for p in u.pos.tolist() if p in old]
            if not all(u.addr[u.pos == p][0] == old[p] for p in stayed):
                spy.violations.append("the staying part moved")
            moved = [p for w, _, _, pos in spy.writes[n0:] if w == (id(idx.store), idx.head)
                     for p in pos if p in old]
            if set(moved) & set(stayed):
                spy.violations.append("a split rewrote a staying entry")
            if len(moved) != len(set(moved)):
                spy.violations.append("a split wrote a moving entry twice")
            if stayed:
                spy.kept_splits += 1
                spy.kept_entries += len(stayed)

        mp.setattr(ClusterStore, "_write", write)
        mp.setattr(ClusterIndex, "_split", split)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(policy)``: one shared synthetic run per policy (kv.check() after every step),
    made on first use; tests only read them. The ``dynakv`` run carries a :class:`_SplitSpy`."""
    made: dict = {}

    def get(policy: str):
        if policy not in made:
            path = tmp_path_factory.mktemp(policy)
            extra = {"ram_budget": 120_000} if policy == "nocluster" else {}
            if policy == "dynakv":
                spy = _SplitSpy()
                with pytest.MonkeyPatch.context() as mp:
                    spy.install(mp)
                    kv, syn, trace = _run(path, policy)
                made[policy] = (kv, syn, trace, spy)
            else:
                kv, syn, trace = _run(path, policy, **extra)
                made[policy] = (kv, syn, trace, None)
        return made[policy]

    yield get
    for kv, *_ in made.values():
        kv.close()

# ---- the partition, the statistics, the thresholds --------------------------------------------------
@pytest.mark.parametrize("policy", ["dynakv", "dynakv-eager", "dynakv-packed", "dynakv-lru",
                                    "static", "local"])
def test_clusters_and_buffers_partition_every_entry_at_every_step(runs, policy):
    kv, _, trace, _ = runs(policy)               # kv.check() ran after every step
    kv.check()
    if policy == "dynakv":
        splits = [i.splits for lay in kv.layers for i in lay.indexes]
        assert sum(s.delayed for s in splits) > 0, "the run should exercise delayed splits"
        assert sum(s.overflow for s in splits) > 0, "... and B_max overflows"
        assert max(t["flagged"] for t in trace) > 0
        assert max(t["buffered"] for t in trace) > 0


def test_incremental_statistics_equal_batch_recomputation(runs):
    kv, syn, _, _ = runs("dynakv")
    checked = 0
    for l, layer in enumerate(kv.layers):  # noqa: E741
        for idx in layer.indexes:
            keys = torch.stack(syn.keys[l][idx.head]).double().numpy()
            for uid, members in idx.members().items():
                s = idx.slot_of[uid]
                n, mu, m2 = stats(keys[members])
                assert idx.n[s] == n
                np.testing.assert_allclose(idx.mean[s], mu, rtol=1e-9, atol=1e-9)
                np.testing.assert_allclose(idx.m2[s], m2, rtol=1e-7, atol=1e-7)
                checked += 1
    assert checked > 50


def test_no_cluster_without_a_flag_exceeds_its_threshold(runs):
    kv, _, _, _ = runs("dynakv")
    for layer in kv.layers:
        for idx in layer.indexes:
            var = idx.variance()
            alive = idx.alive[:idx.size]
            over = alive & ((var > idx.tau) | (idx.n[:idx.size] > 24))
            assert not (over & ~idx.flag[:idx.size]).any()
    # static update has no threshold: its clusters do exceed the same taus
    st, _, _, _ = runs("static")
    worse = sum(int(((i.variance() > i.tau) & i.alive[:i.size]).sum())
                for lay in st.layers for i in lay.indexes)
    assert worse > 0


def test_splits_cause_no_reads_beyond_buffer_overflows(runs):
    kv, _, _, _ = runs("dynakv")
    io = kv.io.snapshot()
    # no read is made for an inline or a delayed split (the cluster is in RAM then) ...
    assert set(io["read_calls"]) <= {"retrieve", "prefetch", "overflow"}
    splits = [i.splits for lay in kv.layers for i in lay.indexes]
    assert sum(s.delayed for s in splits) > 0 and sum(s.inline for s in splits) > 0
    events = sum(s.overflow_events for s in splits)
    loads = sum(s.overflow_loads for s in splits)
    assert loads > 0
    # ... and a B_max overflow reads one cluster once (its pages, in as many operations as
    # the cluster has runs on flash: contiguity is the layout's business, measured apart)
    assert io["read_calls"]["overflow"] == loads <= events
    assert loads <= io["read_ops"]["overflow"] <= io["read_bytes"]["overflow"] // PAGE
    delayed_split_bytes = io["read_bytes"].get("overflow", 0)
    eager, _, _, _ = runs("dynakv-eager")
    io = eager.io.snapshot()
    assert io["read_ops"].get("split", 0) > 0
    assert "overflow" not in io["read_ops"]
    assert delayed_split_bytes < io["read_bytes"]["split"]


@pytest.mark.parametrize("policy", ["dynakv", "dynakv-packed", "local", "static", "nocluster"])
def test_pools_never_rewrite_written_bytes(runs, policy):
    # (nocluster stages whole pages of its top entries, up to one page per entry: its fixed RAM
    # is larger than the clustered policies' 60 KB here, so its shared run has 120 KB)
    kv, _, _, _ = runs(policy)
    io = kv.io.snapshot()
    for layer in kv.layers:
        f = layer.store.file
        # every page write is recorded once; a second write to any of them is refused
        assert f.pages_written == len(f.hashes)
        page = next(iter(f.hashes))
        with pytest.raises(FlashError, match="never rewritten"):
            f.write(page, bytes(PAGE), "append")
    assert sum(io["write_bytes"].values()) == sum(len(x.store.file.hashes)
                                                  for x in kv.layers) * PAGE


def _grow(tmp_path, dual: bool) -> tuple[ClusterStore, IOStats]:
    """Four prefill clusters of 16 entries (SmolLM2's geometry: 64-dim fp32, 8 entries a page),
    then 32 new entries each, interleaved one at a time (hot clusters: their write buffers fill
    whole pages)."""
    io = IOStats()
    st = ClusterStore(tmp_path / f"grow{int(dual)}.pages", 1, 64, torch.float32, io,
                      max_cluster=64, dual_head=dual, write_buffer=64)
    g = torch.Generator().manual_seed(5)
    groups = [(torch.randn(16, 64, generator=g), torch.randn(16, 64, generator=g),
               np.arange(16 * c, 16 * c + 16)) for c in range(4)]
    uids = st.place(0, groups)
    p = 64
    for _ in range(32):
        for uid in uids:
            st.add(st.units[uid], torch.randn(1, 64, generator=g), torch.randn(1, 64, generator=g),
                   np.array([p]))
            p += 1
    st.file.flush()
    return st, io


def test_dual_head_pools_let_clusters_grow_without_moving_written_bytes(tmp_path):
    wa = {}
    for dual in (True, False):
        st, io = _grow(tmp_path, dual)
        try:
            snap = io.snapshot()
            phys = sum(v for k, v in snap["write_bytes"].items() if k != "prefill")
            wa[dual] = phys / sum(snap["logical_bytes"].values())
            if dual:
                # growth goes to each cluster's own head: whole pages, nothing moved or read,
                # and every cluster is still one contiguous run
                assert set(snap["write_bytes"]) == {"prefill", "append"}
                assert not snap["read_ops"]
                assert all(len(runs_of(u.pages)) == 1 for u in st.units.values())
            else:
                # packed: a growing cluster is read back and rewritten at the end
                assert snap["write_bytes"]["relocate"] > 0 and snap["read_ops"]["relocate"] > 0
            # the entries read back are the ones written, in either layout
            got = st.fetch(list(st.units), "retrieve")
            assert sum(len(x[2]) for x in got.values()) == 4 * 48
        finally:
            st.close()
    assert wa[True] == 1.0
    assert wa[False] > 2.0


def test_dual_head_pools_never_relocate_under_drift(runs):
    assert "relocate" not in runs("dynakv")[0].io.snapshot()["write_bytes"]
    assert "relocate" in runs("dynakv-packed")[0].io.snapshot()["write_bytes"]


def test_a_split_writes_no_byte_twice(runs):
    """Dual-head pools: the staying part of a split keeps its flushed entries where they are
    (its moved-out entries become dead slots); a split writes only the moving parts (each
    moving entry once, to its new cluster's head), and no cluster ever writes an entry twice
    (the checks of each split: :class:`_SplitSpy`)."""
    kv, _, _, spy = runs("dynakv")
    assert not spy.violations, spy.violations[:3]
    assert spy.kept_splits > 10 and spy.kept_entries > 100, "splits with a staying part on flash"
    io = kv.io.snapshot()
    assert "compact" not in io["write_bytes"] and "relocate" not in io["write_bytes"]
    once: dict = {}                                     # a cluster writes an entry once
    for where, uid, _, pos in spy.writes:
        for p in pos:
            once[(where, uid, p)] = once.get((where, uid, p), 0) + 1
    assert max(once.values()) == 1
    # physical bytes beyond the logical ones are only the padding of partial pages
    logical = sum(io["logical_bytes"].values())
    physical = sum(v for k, v in io["write_bytes"].items() if k != "prefill")
    assert physical - logical <= io["write_bytes"].get("cold", 0)


# ---- attention --------------------------------------------------------------------------------------
def test_attention_in_cluster_order_equals_token_order():
    torch.manual_seed(0)
    q = torch.randn(1, 4, 3, D)
    heads_sorted, heads_perm = [], []
    for n in (37, 50):
        k, v = torch.randn(n, D), torch.randn(n, D)
        pos = torch.randperm(200)[:n].sort().values
        heads_sorted.append((k, v, pos))
        perm = torch.randperm(n)
        heads_perm.append((k[perm], v[perm], pos[perm]))
    q_pos = torch.tensor([150, 180, 199])
    a = ragged_attention(q, heads_sorted, q_pos, None)
    b = ragged_attention(q, heads_perm, q_pos, None)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_layer_attends_exactly_what_it_retrieved(tmp_path):
    """The layer's output equals attention over the same entries gathered in token order."""
    syn = Synthetic(seed=3)
    cfg = policy_config("dynakv", budget=30, ram_budget=None, sinks=2, recent=8, avg_cluster=8,
                        max_cluster=24)
    kv = ClusteredKV(syn.entries, None, H * G, cfg, final_tokens=200, max_positions=200,
                     flash_dir=tmp_path)
    try:
        layer = kv.layers[0]
        assert kv.arena is not None                  # float32: the fused gather-attend
        captured = {}
        orig = layer.attention.fused

        def spy(selected, step_data, *args):
            # the same entries, gathered per head (the padded path) before the fused call
            captured["heads"] = layer.attention.gather(selected, step_data).heads()
            return orig(selected, step_data, *args)

        layer.attention.fused = spy
        k, v = syn.new(0, 1)
        pos = layer.update(k, v)
        q = syn.query()
        out = layer.attend(q, None, pos)
        heads = captured["heads"]
        sorted_heads = []
        for hk, hv, hp in heads:
            assert len(set(hp.tolist())) == len(hp), "each position once"
            o = hp.argsort()
            sorted_heads.append((hk[o], hv[o], hp[o]))
        torch.testing.assert_close(out, ragged_attention(q, sorted_heads, pos, None),
                                   rtol=1e-5, atol=1e-6)
    finally:
        kv.close()


# ---- the cache --------------------------------------------------------------------------------------
def _item(n: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    return torch.zeros(n, D), torch.zeros(n, D), np.arange(n)


def test_reserved_clusters_are_never_evicted():
    cache = ClusterCache(20_000, "dynakv", reserve_frac=0.5)
    for i in range(3):
        assert cache.put(("r", i), _item(8))
        cache.reserve(("r", i))
    for i in range(200):                             # far more than fits
        cache.put(("x", i), _item(8 + i % 30))
        assert all(("r", j) in cache for j in range(3))
    assert cache.evicted_reserved == 0 and cache.evictions > 100
    assert cache.bytes <= 20_000


def test_the_reserved_space_is_bounded_and_oldest_reservations_end():
    cache = ClusterCache(20_000, "dynakv", reserve_frac=0.25)
    for i in range(10):
        cache.put(("r", i), _item(16))              # 2,176 bytes each
        cache.reserve(("r", i))
    assert cache.reserved_bytes <= 5_000
    assert cache.is_reserved(("r", 9)) and not cache.is_reserved(("r", 0))


def test_replacement_keeps_small_clusters_longer_than_lru():
    small, big = _item(4), _item(64)
    gds, lru = ClusterCache(40_000, "dynakv"), ClusterCache(40_000, "lru")
    for c in (gds, lru):
        for i in range(4):
            c.put(("s", i), small)
        for i in range(20):
            c.put(("b", i), big)
    assert sum(("s", i) in gds for i in range(4)) == 4
    assert sum(("s", i) in lru for i in range(4)) == 0



def test_replacement_keeps_often_retrieved_clusters_where_lru_thrashes():
    """Same sizes: a cluster retrieved again and again outlives clusters used once (GDSF's
    frequency), where LRU evicts it first; and on a loop a little larger than the cache (one
    step's clusters over all layers) LRU hits nothing while GDSF keeps the small clusters."""
    one = 8 * 8 + 2 * 8 * D * 4                      # an _item(8): k, v and positions
    gds, lru = ClusterCache(4 * one, "dynakv"), ClusterCache(4 * one, "lru")
    for cache in (gds, lru):
        cache.put(("a", 0), _item(8))
        for _ in range(5):
            assert cache.get(("a", 0)) is not None
        for i in range(4):
            cache.put(("b", i), _item(8))
    assert ("a", 0) in gds and ("a", 0) not in lru
    hits = {}
    sizes = [4, 32, 4, 32, 4, 32]                    # a loop of 144 entries, room for 96
    for name in ("dynakv", "lru"):
        cache = ClusterCache(12 * one, name)
        hits[name] = 0
        for _ in range(20):
            for i, n in enumerate(sizes):
                if cache.get(("loop", i)) is not None:
                    hits[name] += 1
                else:
                    cache.put(("loop", i), _item(n))
    assert hits["lru"] == 0 and hits["dynakv"] >= 3 * 19

# ---- the pieces --------------------------------------------------------------------------------------
@pytest.mark.parametrize("direct", [True, False])
def test_page_file_checksums_and_direct_io(tmp_path, direct):
    f = PageFile(tmp_path / "f", IOStats(), direct=direct)
    data = os.urandom(2 * PAGE)
    f.write(3, data, "append")
    assert f.read(3, 2) == data
    fd = os.open(tmp_path / "f", os.O_WRONLY)       # flash flips a bit under the open file
    try:
        os.pwrite(fd, bytes([data[PAGE + 100] ^ 0xFF]), 4 * PAGE + 100)
        os.fsync(fd)
    finally:
        os.close(fd)
    assert f.read(3, 1) == data[:PAGE]               # the other page is intact
    with pytest.raises(FlashError, match="f: page 4 fails its checksum"):
        f.read(3, 2)
    assert f.read(0, 2) == bytes(2 * PAGE)           # never written: zeros, unchecked
    f.close()
    assert list(tmp_path.iterdir()) == []


def test_kmeans_and_two_means_are_sane():
    torch.manual_seed(0)
    centers = torch.tensor([[0.0] * D, [10.0] * D, [-10.0] * D])
    x = centers[torch.arange(90) % 3] + 0.1 * torch.randn(90, D)
    labels = kmeans(x[None], 3, seed=1)[0]
    for c in range(3):
        assert len(set(labels[torch.arange(90) % 3 == c].tolist())) == 1
    lab = two_means(np.concatenate([np.zeros((5, 3)), np.ones((7, 3)) * 5]))
    assert lab.sum() in (5, 7) and lab[:5].all() != lab[5:].all()
    assert two_means(np.zeros((4, 3))).sum() == 2          # identical points still split


def test_coretrieval_order_puts_co_retrieved_clusters_side_by_side():
    rng = np.random.default_rng(0)
    means = rng.normal(size=(8, D))
    sizes = np.full(8, 10)
    # queries that always retrieve clusters 1 and 6 together, and 2 and 5 together
    qg = np.concatenate([np.tile(means[1] + means[6], (5, 1)), np.tile(means[2] + means[5], (5, 1))])
    order = coretrieval_order(means, sizes, qg * 10, budget=20)
    pos = {c: i for i, c in enumerate(order)}
    assert sorted(order) == list(range(8))
    assert abs(pos[1] - pos[6]) == 1 and abs(pos[2] - pos[5]) == 1


def test_policy_names_and_knobs():
    assert set(POLICIES) == {"full", "dynakv", "dynakv-eager", "dynakv-packed", "dynakv-lru",
                             "static", "local", "nocluster", "stream"}
    assert policy_config("dynakv-eager").delayed_split is False
    assert policy_config("static", budget=7).budget == 7
    with pytest.raises(ValueError):
        policy_config("nope")
    with pytest.raises(TypeError):
        policy_config("dynakv", nope=1)
    with pytest.raises(ValueError):
        DecodeConfig(replacement="fifo")


def test_a_budget_below_the_fixed_parts_is_refused(tmp_path):
    syn = Synthetic()
    with pytest.raises(ValueError, match="ram_budget"):
        ClusteredKV(syn.entries, None, H * G, policy_config("dynakv", ram_budget=1000),
                    final_tokens=200, max_positions=200, flash_dir=tmp_path)
    assert list(tmp_path.iterdir()) == [] or all(not any(p.iterdir()) for p in tmp_path.iterdir())


# ---- through a model ----------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["dynakv", "dynakv-eager", "dynakv-packed", "dynakv-lru",
                                    "static", "local", "nocluster"])
def test_a_budget_holding_everything_decodes_exactly_like_full_kv(tiny_llama, tmp_path, policy):
    torch.manual_seed(1)
    n = 80
    ids = torch.randint(0, 128, (n,)).tolist()
    with torch.inference_mode():
        layers = reference_prefill(tiny_llama, ids)
    question = [3, 9, 27]
    want = greedy_generate(tiny_llama, layers, n, question, max_new_tokens=28, stop_at_eos=False)
    # a short window: the new entries are attended through their clusters
    got, st = generate(tiny_llama, layers, n, question, 28, kv_policy=policy, budget=1.0,
                       ram_budget=None, stop_at_eos=False, flash_dir=tmp_path, probe=True,
                       avg_cluster=8, max_cluster=16, recent=8)
    assert got.tokens == want.tokens
    assert st.recall == pytest.approx(1.0, abs=1e-6)
    assert st.output_error < 1e-4
    assert st.tokens == 27 and st.evicted_reserved == 0
    assert list(tmp_path.iterdir()) == []             # the flash files are gone


def test_full_policy_is_greedy_generate(tiny_llama):
    torch.manual_seed(2)
    n = 64
    ids = torch.randint(0, 128, (n,)).tolist()
    with torch.inference_mode():
        layers = reference_prefill(tiny_llama, ids)
    want = greedy_generate(tiny_llama, layers, n, [1, 2], max_new_tokens=12, stop_at_eos=False)
    got, st = generate(tiny_llama, layers, n, [1, 2], 12, kv_policy="full", stop_at_eos=False)
    assert got.tokens == want.tokens
    assert st.policy == "full" and st.flash_read_bytes == 0 and st.hit_rate == 1.0


def test_a_session_decodes_under_a_tight_budget_and_reports(tiny_llama, tmp_path):
    torch.manual_seed(4)
    n = 128
    ids = torch.randint(0, 128, (n,)).tolist()
    with torch.inference_mode():
        layers = reference_prefill(tiny_llama, ids)
    with DecodeSession(tiny_llama, layers, n, "dynakv", final_tokens=n + 70,
                       flash_dir=tmp_path, probe=True, budget=0.2, ram_budget=0.6,
                       avg_cluster=8, max_cluster=16, recent=32, write_buffer=8) as s:
        tok = int(s.prefill([5, 6]).argmax())
        for _ in range(30):
            tok = int(s.feed([tok]).argmax())
            s.check()
        s.feed([7, 8, 9])                            # a new turn: several tokens at once
        s.check()
        st = s.stats()
    assert st.tokens == 33 and st.steps == 31
    assert 0.0 < st.recall < 1.0
    assert st.flash_read_ops > 0 and st.retrieved_entries > 0
    assert st.ram_peak_bytes <= st.ram_budget
    assert st.hits + st.prefetch_hits + st.misses > 0


def test_the_edge_breakdown_shows_the_decode_stats():
    from sparkv.decode import DecodeStats
    from sparkv.edge.session import Breakdown

    st = DecodeStats("dynakv", tokens=10, tokens_per_s=3.5, flash_read_bytes_per_token=2048.0,
                     flash_read_ops_per_token=4.0, hit_rate=0.8, ram_peak_bytes=5_000_000)
    b = Breakdown("sparkv", 1.0, decode=st.to_dict())
    assert "decode (dynakv)" in b.table() and "hit rate 0.80" in b.table()
    assert b.to_dict()["decode"]["policy"] == "dynakv"
    assert "decode (" not in Breakdown("sparkv", 1.0).table()


# ---- regressions ------------------------------------------------------------------------------------
class _Ctx:
    """A layer's step context over a plain dict of what is in RAM (no cache, no prefetch)."""

    def __init__(self, store: ClusterStore) -> None:
        self.store = store
        self.data: dict = {}

    def ram(self, uid):
        return self.data.get(uid)

    def load(self, uid, reason):
        self.data[uid] = self.store.fetch([uid], reason)[uid]
        return self.data[uid]

    def updated(self, uid):
        pass

    def adopt(self, uid, data):
        self.data[uid] = data

    def refresh(self, uid, data):
        if uid in self.data:
            self.data[uid] = data

    def forget(self, uid):
        self.data.pop(uid, None)


def test_a_cluster_selected_before_its_first_flush_waits_to_split_until_next_retrieval(tmp_path):
    """Regression ("split of a cluster that is not in RAM"): a cluster selected while it had no
    flushed entries, flushed later in the step (a tail write), then flagged, is not split by
    that step's delayed splits (it is not in RAM and a split never reads); it splits at its next
    retrieval, once it is in RAM."""
    io = IOStats()
    store = ClusterStore(tmp_path / "r.pages", 1, D, torch.float32, io, max_cluster=24,
                         write_buffer=64)
    cfg = policy_config("dynakv", buffer_max=16, max_cluster=24)
    idx = ClusterIndex(0, 0, store, cfg, tau=1.0)
    g = torch.Generator().manual_seed(1)
    a, b = torch.full((D,), -3.0), torch.full((D,), 3.0)
    idx.build([(a + 0.1 * torch.randn(8, D, generator=g), torch.randn(8, D, generator=g),
                np.arange(8))])
    # a cluster made by a split: 3 entries, all in its write buffer (nothing on flash yet)
    kb = b + 0.1 * torch.randn(3, D, generator=g)
    nu = store.create(0, kb, torch.randn(3, D, generator=g), np.arange(8, 11))
    idx._new_slot(nu.uid, kb.double().numpy())
    assert nu.flushed == 0 and nu.tail == 3
    ctx = _Ctx(store)
    selected = [nu.uid]                       # retrieved now: nothing of it to read
    store.flush_tail(nu)                      # ... its tail is written later in the step
    assert nu.flushed == 3 and ctx.ram(nu.uid) is None
    far = b + 4.0                             # nearest to it, but over its threshold
    idx.observe(far, torch.randn(D, generator=g), 11, ctx)
    j = idx.slot_of[nu.uid]
    assert idx.flag[j] and idx.buffered == 1
    idx.finish_step(selected, ctx)            # used to raise AssertionError
    assert idx.flag[j] and idx.buffered == 1, "it waits for its next retrieval"
    assert not io.snapshot()["read_ops"], "a delayed split never reads"
    # next retrieval: the step reads it (a retrieve read), then the delayed split runs
    ctx.load(nu.uid, "retrieve")
    idx.finish_step([nu.uid], ctx)
    assert not idx.flag[j] and idx.buffered == 0 and idx.splits.delayed == 1
    assert set(io.snapshot()["read_ops"]) == {"retrieve"}
    members = np.sort(np.concatenate(list(idx.members().values())))
    assert members.tolist() == list(range(12))
    store.close()
