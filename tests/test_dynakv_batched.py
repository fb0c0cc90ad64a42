"""DynaKV's layer-batched step (sparkv.decode.select, sparkv.decode.gather): every KV head of a
layer selected and attended in batched calls, equal to the per-head path kept as the reference
(:meth:`ClusterIndex.select_scored`, :func:`sparkv.cache.ragged_attention`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_dynakv import G, H, Synthetic

from sparkv.cache import ragged_attention
from sparkv.decode import ClusteredKV, policy_config
from sparkv.decode.gather import pad_heads, padded_attention
from sparkv.decode.index import ClusterIndex
from sparkv.decode.select import select_heads


class _Idx(ClusterIndex):
    """Only what the per-head reference (``select_scored``) reads."""

    def __init__(self, sizes: np.ndarray) -> None:
        self.n = sizes.astype(np.int64)
        self.uid = np.arange(len(sizes), dtype=np.int64)
        self.next_up: list[int] = []


def _case(rng: np.random.Generator, heads: int, slots: int, max_size: int):
    sc = rng.standard_normal((heads, slots))
    sc[rng.random(sc.shape) < 0.1] = -np.inf                 # dead / unused slots
    sc[rng.random(sc.shape) < 0.1] = 0.5                     # ties
    sizes = rng.integers(1, max_size + 1, (heads, slots))
    inwin = np.minimum(rng.integers(0, 4, sizes.shape) * (rng.random(sizes.shape) < 0.3), sizes)
    return sc, sizes, inwin


def _check(sc: np.ndarray, sizes: np.ndarray, budget: int, inwin: np.ndarray | None) -> None:
    got = select_heads(sc, sizes, budget, inwin)
    for h in range(sc.shape[0]):
        ref = _Idx(sizes[h])
        want = ref.select_scored(sc[h], budget, None if inwin is None else inwin[h])
        assert got.picked[h].tolist() == want
        assert got.next_up[h].tolist() == ref.next_up


@pytest.mark.parametrize("seed", range(12))
def test_batched_selection_equals_per_head_selection_on_random_shapes(seed):
    rng = np.random.default_rng(seed)
    heads, slots = int(rng.integers(1, 6)), int(rng.integers(1, 80))
    sc, sizes, inwin = _case(rng, heads, slots, 30)
    budget = int(rng.integers(1, 300))
    _check(sc, sizes, budget, None)
    _check(sc, sizes, budget, inwin)


@pytest.mark.parametrize("prompt", [1024, 4096, 8192])
def test_batched_selection_equals_per_head_selection_on_real_shapes(prompt):
    """SmolLM2's shape: 3 KV heads, ``prompt / 16`` clusters of 1-64 entries (plus splits),
    a 10% budget."""
    rng = np.random.default_rng(prompt)
    slots = prompt // 16 + 40
    sc, sizes, inwin = _case(rng, 3, slots, 64)
    sc[:, -20:] = -np.inf                                    # heads using fewer slots
    budget = int(np.ceil(0.1 * prompt))
    _check(sc, sizes, budget, None)
    _check(sc, sizes, budget, inwin)


def test_the_layer_selects_what_each_index_selects_alone(tmp_path):
    """Inside a decode (clusters split and grow), a layer's batched selection equals each head's
    per-head ``select`` on the same query."""
    syn = Synthetic(seed=5)
    cfg = policy_config("dynakv", budget=24, ram_budget=None, sinks=2, recent=8, avg_cluster=8,
                        max_cluster=24, buffer_max=6, write_buffer=8)
    kv = ClusteredKV(syn.entries, None, H * G, cfg, final_tokens=260, max_positions=260,
                     flash_dir=tmp_path)
    try:
        for t in range(40):
            for layer in kv.layers:
                k, v = syn.new(layer.l, t)
                pos = layer.update(k, v)
                q = syn.query()
                batched = layer._select(q)
                qn = q[0].float().numpy()
                for h, idx in enumerate(layer.indexes):
                    qg = qn[h * G:(h + 1) * G].reshape(-1, syn.d)
                    assert batched[h] == idx.select(qg, kv.budget_for(layer.end))
                layer.attend(q, None, pos)
            kv.end_step(1)
    finally:
        kv.close()


@pytest.mark.parametrize("nq", [1, 3])
def test_padded_attention_equals_ragged_attention(nq):
    g = torch.Generator().manual_seed(nq)
    hkv, group, d, w = 3, 3, 16, 5
    lens = [7, 0, 12]
    wk, wv = torch.randn(hkv, w, d, generator=g), torch.randn(hkv, w, d, generator=g)
    wpos = torch.tensor([0, 1, 40, 41, 42])
    ks, vs, ps = [], [], []
    for n in lens:
        ks.append(torch.randn(n, d, generator=g))
        vs.append(torch.randn(n, d, generator=g))
        ps.append(np.random.default_rng(n).permutation(np.arange(2, 40))[:n])
    parts = [([ks[h]], [vs[h]], ps[h], None) for h in range(hkv)]
    drop = np.ones(lens[2], bool)
    drop[3] = False                                           # a position the window holds
    parts[2] = ([ks[2][:5], ks[2][5:]], [vs[2][:5], vs[2][5:]], ps[2], drop)
    gathered = pad_heads(wk, wv, wpos, parts)
    ks[2], vs[2], ps[2] = ks[2][torch.from_numpy(drop)], vs[2][torch.from_numpy(drop)], ps[2][drop]
    q = torch.randn(1, hkv * group, nq, d, generator=g)
    q_pos = torch.arange(42 - nq + 1, 43) if nq > 1 else torch.tensor([42])
    per_head = [(torch.cat([wk[h], ks[h]]), torch.cat([wv[h], vs[h]]),
                 torch.cat([wpos, torch.from_numpy(ps[h])])) for h in range(hkv)]
    torch.testing.assert_close(padded_attention(q, gathered, q_pos, None),
                               ragged_attention(q, per_head, q_pos, None), rtol=1e-5, atol=1e-6)
    for (k, v, p), (rk, rv, rp) in zip(gathered.heads(), per_head):
        assert torch.equal(k, rk) and torch.equal(v, rv) and torch.equal(p, rp)
