"""DynaKV's per-step machinery (sparkv.decode): the batched centroid scoring, the vectorised
selection, the write-buffer tails, the budget outside the window and the cache warm-up at prefill.

Synthetic layers (tests/test_dynakv.py's drifting keys) drive :class:`ClusteredKV` directly; the
tiny random Llama checks that the new budget accounting still decodes exactly like full KV when
the budget holds everything.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_dynakv import D, G, H, L, Synthetic

from sparkv.decode import ClusteredKV, generate, policy_config
from sparkv.decode.index import CentroidTable, ClusterIndex
from sparkv.runtime import greedy_generate, reference_prefill

BASE = {"budget": 24, "ram_budget": 60_000, "sinks": 2, "recent": 8, "avg_cluster": 8,
        "max_cluster": 24, "buffer_max": 6, "write_buffer": 8, "local_every": 8,
        "local_cluster": 4}


def _queries(syn: Synthetic, r: int = 6, seed: int = 7) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(H * G, r, syn.d, generator=g) for _ in range(L)]


def _drive(kv: ClusteredKV, syn: Synthetic, steps: int, each=None) -> None:
    """``steps`` decoding steps of one token; ``each(kv, t)`` after every step."""
    for t in range(steps):
        for l, layer in enumerate(kv.layers):
            k, v = syn.new(l, t)
            pos = layer.update(k, v)
            layer.attend(syn.query(), None, pos)
        kv.end_step(1)
        if each is not None:
            kv.settle()                  # the last layers' upkeep may still be running
            each(kv, t)


def _make(tmp_path, policy: str = "dynakv", steps: int = 40, queries=None, **kw):
    syn = Synthetic()
    cfg = policy_config(policy, **{**BASE, **kw})
    kv = ClusteredKV(syn.entries, queries, H * G, cfg, final_tokens=syn.n + steps,
                     max_positions=syn.n + steps + 16, flash_dir=tmp_path)
    return kv, syn


def _reference_select(sc: np.ndarray, sizes: np.ndarray, budget: int) -> list[int]:
    """The selection rule, plainly: clusters in score order (ties: lower slot first), each taken
    whole if it fits what is left of the budget."""
    order = sorted((j for j in range(len(sc)) if np.isfinite(sc[j]) and sizes[j] > 0),
                   key=lambda j: (-sc[j], j))
    left, out = budget, []
    for j in order:
        if sizes[j] <= left:
            out.append(j)
            left -= int(sizes[j])
            if left <= 0:
                break
    return out


# ---- scoring and selection ----------------------------------------------------------------------------
def test_batched_centroid_scores_equal_per_head_scores(tmp_path):
    kv, syn = _make(tmp_path)
    try:
        _drive(kv, syn, 30)
        rng = np.random.default_rng(0)
        for layer in kv.layers:
            q = rng.standard_normal((H, G * 2, D)).astype(np.float32)
            raw = layer.table.scores(q)
            for h, idx in enumerate(layer.indexes):
                np.testing.assert_allclose(idx.mask_scores(raw[h]), idx.scores(q[h]),
                                           rtol=1e-5, atol=1e-5)
    finally:
        kv.close()


def test_the_centroid_table_grows_with_any_head_and_keeps_every_row(tmp_path):
    kv, syn = _make(tmp_path)
    try:
        layer = kv.layers[0]
        table = layer.table
        assert isinstance(table, CentroidTable)
        idx = layer.indexes[1]
        cap = idx.mean.shape[0]
        idx._grow()                                   # one head outgrows the table
        assert idx.mean.shape[0] == 2 * cap and table.data.shape[1] >= 2 * cap
        for i in layer.indexes:
            assert np.shares_memory(i.mean32, table.data)
            np.testing.assert_array_equal(i.mean32[:i.size], i.mean[:i.size].astype(np.float32))
        _drive(kv, syn, 10)                           # and decoding goes on over the grown table
        kv.check()
        for i in layer.indexes:
            np.testing.assert_allclose(i.mean32[:i.size], i.mean[:i.size], rtol=1e-5, atol=1e-6)
    finally:
        kv.close()


@pytest.mark.parametrize("seed", range(20))
def test_vectorised_selection_equals_the_plain_rule(seed):
    rng = np.random.default_rng(seed)
    c = int(rng.integers(1, 60))
    sc = rng.standard_normal(c)
    sc[rng.random(c) < 0.1] = -np.inf                 # dead slots
    sc[rng.random(c) < 0.2] = 0.5                     # ties
    sizes = rng.integers(1, 30, c)
    inwin = np.minimum(rng.integers(0, 4, c) * (rng.random(c) < 0.3), sizes)
    budget = int(rng.integers(1, 200))

    class _Idx(ClusterIndex):
        def __init__(self) -> None:                   # only what select_scored reads
            self.n = sizes.astype(np.int64)
            self.uid = np.arange(c, dtype=np.int64) + 1000

    idx = _Idx()
    assert idx.select_scored(sc, budget) == [j + 1000 for j in _reference_select(sc, sizes, budget)]
    assert idx.select_scored(sc, budget, inwin) == \
        [j + 1000 for j in _reference_select(sc, sizes - inwin, budget)]


# ---- the write-buffer tails ---------------------------------------------------------------------------
def test_the_store_tracks_every_unit_holding_a_tail(tmp_path):
    kv, syn = _make(tmp_path)

    def check(kv, t):
        for layer in kv.layers:
            want = {u.uid for u in layer.store.units.values() if u.alive and u.tail}
            assert {u.uid for u in layer.store.tails()} == want
            assert sum(u.tail for u in layer.store.tails()) == layer.store.tail_entries

    try:
        _drive(kv, syn, 40, check)
    finally:
        kv.close()


@pytest.mark.parametrize("policy", ["dynakv", "static", "local"])
def test_every_write_buffer_tail_is_attended(tmp_path, policy):
    kv, syn = _make(tmp_path, policy)
    seen = {"checked": 0}
    try:
        layer = kv.layers[1]
        assert kv.arena is not None                  # float32: the fused gather-attend's runs
        orig = layer.attention.runs

        def spy(selected, step_data):
            runs, scratch = orig(selected, step_data)
            heads = layer.attention.attended_positions(runs)
            for u in layer.store.tails():
                attended = set(heads[u.head].tolist())
                assert set(u.tail_pos.tolist()) <= attended
                seen["checked"] += 1
            for hp in heads:
                assert len(set(hp.tolist())) == len(hp), "each position once"
            return runs, scratch

        layer.attention.runs = spy
        _drive(kv, syn, 30, lambda kv, t: kv.check())
        assert seen["checked"] > 0
    finally:
        kv.close()


# ---- the budget outside the window --------------------------------------------------------------------
def test_window_counts_equal_a_recount_and_the_budget_holds(tmp_path):
    import sparkv.decode.policy as policy_mod

    kv, syn = _make(tmp_path, budget_outside_window=True)
    spent = []
    try:
        layer = kv.layers[0]
        orig = policy_mod.select_heads

        def select(sc, sizes, budget, inwin=None):
            sel = orig(sc, sizes, budget, inwin)
            if sc.shape[0] == len(layer.indexes) and sizes.base is layer.table.n:
                assert inwin is not None
                s_end, w0 = layer.window.bounds()
                for h, idx in enumerate(layer.indexes):
                    # the counts equal a recount of the live clusters' members
                    for uid, pos in idx.members().items():
                        j = idx.slot_of[uid]
                        assert inwin[h, j] == int(((pos < s_end) | (pos >= w0)).sum())
                    out = sel.picked[h]
                    cost = int((idx.n[out] - inwin[h, out]).sum())
                    assert (idx.n[out] > inwin[h, out]).all()
                    spent.append((cost, budget))
            return sel

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(policy_mod, "select_heads", select)
            _drive(kv, syn, 40, lambda kv, t: kv.check())
        assert spent and all(c <= b for c, b in spent)
        assert max(c for c, _ in spent) > 0
    finally:
        kv.close()


@pytest.mark.parametrize("policy", ["dynakv", "local"])
def test_budget_outside_window_holding_everything_decodes_like_full_kv(tiny_llama, tmp_path,
                                                                       policy):
    torch.manual_seed(1)
    n = 80
    ids = torch.randint(0, 128, (n,)).tolist()
    with torch.inference_mode():
        layers = reference_prefill(tiny_llama, ids)
    question = [3, 9, 27]
    want = greedy_generate(tiny_llama, layers, n, question, max_new_tokens=20, stop_at_eos=False)
    got, st = generate(tiny_llama, layers, n, question, 20, kv_policy=policy, budget=1.0,
                       ram_budget=None, stop_at_eos=False, flash_dir=tmp_path, probe=True,
                       avg_cluster=8, max_cluster=16, recent=8, budget_outside_window=True)
    assert got.tokens == want.tokens
    assert st.recall == pytest.approx(1.0, abs=1e-6)


# ---- the cache warm-up at prefill ---------------------------------------------------------------------
def test_the_warm_up_is_one_rule_for_every_replacement(tmp_path):
    keys, freq = {}, {}
    for policy in ("dynakv", "dynakv-lru", "static"):
        kv, _ = _make(tmp_path / policy, policy, queries=_queries(Synthetic()))
        try:
            cache = kv.cache
            keys[policy] = set(cache.items)
            assert kv.warmed == len(cache.items) > 0
            assert cache.bytes <= kv.cache_capacity
            freq[policy] = {(lay.l, u): f for lay in kv.layers for u, f in lay.prefill_freq.items()}
            # the most often retrieved cluster of the prompt's last queries is cached
            top = max(freq[policy], key=freq[policy].get)
            assert top in cache.items
            assert all(freq[policy][k] > 0 for k in cache.items)
            if policy == "dynakv":                    # GDSF starts from the prefill frequency
                assert cache.freq[top] == 1 + int(freq[policy][top])
            assert all(not lay.warm_data for lay in kv.layers)   # the prefill copies are dropped
        finally:
            kv.close()
    # dynakv and its LRU ablation share the prefill clustering, hence the same warm set
    assert keys["dynakv"] == keys["dynakv-lru"]


def test_a_warm_cache_hits_from_the_first_step_and_warm_false_starts_empty(tmp_path):
    hits = {}
    for warm in (True, False):
        kv, syn = _make(tmp_path / str(warm), "dynakv", queries=_queries(Synthetic()), warm=warm)
        try:
            if not warm:
                assert len(kv.cache) == 0 and kv.warmed == 0
            _drive(kv, syn, 1)
            hits[warm] = kv.counters.hits
            kv.check()
        finally:
            kv.close()
    assert hits[False] == 0 and hits[True] > 0
