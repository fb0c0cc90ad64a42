"""DynaKV's fused gather-attend (sparkv.decode.fused) over runs of the row arena
(sparkv.decode.rows): equal to the padded attention over the same entries, and the arena's runs
are exact, reused and returned."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from sparkv.decode.fused import fused_attention
from sparkv.decode.gather import pad_heads, padded_attention
from sparkv.decode.rows import ROW_QUANTUM, RowArena


@pytest.mark.parametrize("nq", [1, 4])
def test_fused_attention_equals_padded_attention_over_the_same_entries(nq):
    """Three KV heads (one with nothing beyond the window), runs of 1-40 rows, some rows at
    window positions (skipped), a query group of 3; the result and the counts of attended and
    selected rows match the padded path within float32 rounding."""
    g = torch.Generator().manual_seed(nq)
    rng = np.random.default_rng(nq)
    hkv, group, d, sinks, w0, end = 3, 3, 16, 2, 60, 64
    wpos = torch.cat([torch.arange(sinks), torch.arange(w0, end)])
    wk = torch.randn(hkv, len(wpos), d, generator=g)
    wv = torch.randn(hkv, len(wpos), d, generator=g)
    arena = RowArena(d, torch.float32, capacity=8)             # grows while filling
    runs, parts, held = [], [], []
    for h, sizes in enumerate([[5, 1, 40], [], [7, 3]]):
        ks, vs, ps, sel_rows = [], [], [], 0
        perm = rng.permutation(np.arange(0, end))               # window positions included
        at = 0
        for i, n in enumerate(sizes):
            k, v = torch.randn(n, d, generator=g), torch.randn(n, d, generator=g)
            p = perm[at:at + n]
            at += n
            r = arena.put(k, v, p)
            held.append(r)
            runs.append((h, r.start, r.n, int(i % 2 == 0)))
            ks.append(k)
            vs.append(v)
            ps.append(p)
            if i % 2 == 0:
                sel_rows += int(((p >= sinks) & (p < w0)).sum())
        pk = np.concatenate(ps) if ps else np.zeros(0, np.int64)
        keep = (pk >= sinks) & (pk < w0)
        parts.append((ks, vs, pk, keep))
    gathered = pad_heads(wk, wv, wpos, parts)
    q = torch.randn(1, hkv * group, nq, d, generator=g)
    q_pos = torch.arange(end - nq, end)
    want = padded_attention(q, gathered, q_pos, None)
    got, kept = fused_attention(q, q_pos, None, arena.k, arena.v, arena.pos,
                                np.array(runs, np.int64), (wk, wv, wpos), (sinks, w0))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)
    assert kept[:, 0].tolist() == [int(p[3].sum()) for p in parts]
    assert arena.generation > 0                                 # it grew, and runs still read right


def test_a_query_that_sees_nothing_gets_zeros():
    d = 8
    arena = RowArena(d, torch.float32)
    r = arena.put(torch.randn(4, d), torch.randn(4, d), np.array([10, 11, 12, 13]))
    window = (torch.zeros(1, 0, d), torch.zeros(1, 0, d), torch.zeros(0, dtype=torch.long))
    out, kept = fused_attention(torch.randn(1, 2, 1, d), torch.tensor([5]), None, arena.k,
                                arena.v, arena.pos, np.array([[0, r.start, r.n, 1]]), window,
                                (0, 100))
    assert torch.equal(out, torch.zeros_like(out))
    assert kept.tolist() == [[4, 4]]


def test_arena_runs_are_exact_reused_and_returned():
    d = 4
    arena = RowArena(d, torch.float32, capacity=ROW_QUANTUM)
    k, v = torch.randn(6, d), torch.randn(6, d)
    a = arena.put(k, v, np.arange(6))
    ka, va, pa = a
    assert torch.equal(ka, k) and torch.equal(va, v) and pa.tolist() == list(range(6))
    assert arena.held_rows == 8                                 # 6 rows rounded to the quantum
    start = a.start
    del a, ka, va, pa
    gc.collect()
    assert arena.held_rows == 0
    b = arena.put(k[:5], v[:5], np.arange(5))                   # the same size class: reused
    assert b.start == start and torch.equal(b[0], k[:5])
    recs = torch.cat([k, v], 1)
    c = arena.put_records(recs, torch.tensor([5, 0]), np.array([7, 9]))
    assert torch.equal(c[0], k[[5, 0]]) and torch.equal(c[1], v[[5, 0]])
    assert c[2].tolist() == [7, 9]
