"""The paged attention (sparkv/cache/qattend.py: one numba call per layer over fp, int8, int4 and
int2 pages) equals dequantize-then-attend within float32 rounding, with ragged and partly filled
pages, empty heads, mixed levels, masks and a fp tail; the torch path (a GPU's) too; SparkvCache
decodes a quantized memory with it; the memory stays within its bound. The dense prefix's kernel
(a fork's attention) equals a plain softmax, its column sums included."""

from __future__ import annotations

import pytest
import torch

from sparkv.cache import ContextKV, ragged_attention
from sparkv.cache.payload import ChunkPayload
from sparkv.cache.qattend import TorchPagedAttention, attend_entries, attend_stacked
from sparkv.layout import ChunkGeometry, KVChunkId

D = 64
T = 400


def _payloads(levels: list[str], counts: list[list[int]], seed: int) -> list[ChunkPayload]:
    """Token chunks of one layer, one group of 2 heads each keeping ``counts[t][h]`` random
    positions of its 400, at ``levels[t]``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t, (level, cs) in enumerate(zip(levels, counts)):
        pos = torch.cat([torch.sort(torch.randperm(T, generator=g)[:n]).values + t * T
                         for n in cs]).to(torch.int32)
        n = sum(cs)
        k, v = torch.randn(n, D, generator=g) * 2, torch.randn(n, D, generator=g)
        p = ChunkPayload(KVChunkId(t, 0, 0), "fp", list(cs), pos, k, v)
        out.append(p.at_level(level))
    return out


def _memory(payloads: list[ChunkPayload]) -> ContextKV:
    mem = ContextKV(ChunkGeometry(T * len(payloads), T, 1, 2, D), paged=True)
    mem.put_payloads(payloads)
    return mem


def _reference(q, payloads, q_pos, tail=None):
    """Dequantize everything, then the ragged (per head) SDPA path."""
    heads = [[], []]
    for p in payloads:
        k, v = p.fp()
        for i, sl in enumerate(p.head_slices()):
            heads[i].append((k[sl], v[sl], p.pos[sl].long()))
    if tail is not None:
        for i in range(2):
            heads[i].append(tail[i])
    cat = [(torch.cat([x[0] for x in hs]), torch.cat([x[1] for x in hs]),
            torch.cat([x[2] for x in hs])) for hs in heads]
    return ragged_attention(q, cat, q_pos, None)


def _torch_path(mem: ContextKV) -> TorchPagedAttention:
    return TorchPagedAttention(lambda: [(e.k, e.v, e.pos) for e in mem.layer_entries(0)])


@pytest.mark.parametrize("levels", [["int8"] * 3, ["int4"] * 3, ["int2"] * 3, ["fp"] * 3,
                                    ["k8v4"] * 3, ["int8", "int4", "fp"], ["int2", "fp", "int8"],
                                    ["k8v4", "int4", "int8"]])
def test_paged_equals_dequantize_then_attend(levels):
    # ragged heads: partly filled pages, an empty head, a head of 300 (19 pages, two units)
    payloads = _payloads(levels, [[30, 17], [0, 40], [300, 5]], seed=1)
    mem = _memory(payloads)
    q = torch.randn(1, 6, 1, D)
    q_pos = torch.tensor([1200])
    want = _reference(q, payloads, q_pos)
    for att in (mem.resident_attention(0), _torch_path(mem)):
        torch.testing.assert_close(att.attend(q, q_pos, None), want, atol=2e-5, rtol=1e-4)


def test_masked_queries_and_fp_tail():
    payloads = _payloads(["int8", "int4"], [[30, 17], [12, 40]], seed=2)
    mem = _memory(payloads)
    q = torch.randn(1, 6, 3, D)
    q_pos = torch.tensor([200, 600, 801])    # the first sees part of chunk 0 only
    tail = [(torch.randn(3, D), torch.randn(3, D), torch.tensor([799, 800, 801])) for _ in range(2)]
    stacked = attend_stacked(q, torch.stack([t[0] for t in tail]),
                             torch.stack([t[1] for t in tail]), tail[0][2], q_pos, None)
    torch.testing.assert_close(stacked.out, attend_entries(q, tail, q_pos, None).out)
    stacked_tail = (torch.stack([t[0] for t in tail]), torch.stack([t[1] for t in tail]),
                    tail[0][2])
    want = _reference(q, payloads, q_pos, tail)
    for att in (mem.resident_attention(0), _torch_path(mem)):
        torch.testing.assert_close(att.attend(q, q_pos, None, stacked_tail), want, atol=2e-5,
                                   rtol=1e-4)


def test_query_seeing_nothing_gets_zeros():
    mem = _memory(_payloads(["int4"], [[10, 10]], seed=3))
    out = mem.resident_attention(0).attend(torch.randn(1, 2, 1, D), torch.tensor([-1]), None)
    assert torch.all(out == 0)


@pytest.fixture(scope="module")
def tiny_memory():
    geo = ChunkGeometry(300, 64, 2, 2, D, 1)
    g = torch.Generator().manual_seed(0)
    layers = [(torch.randn(1, 2, 300, D, generator=g), torch.randn(1, 2, 300, D, generator=g))
              for _ in range(2)]
    return geo, layers


@pytest.mark.parametrize("level,bound", [("int8", 0.30), ("int4", 0.18)])
def test_cache_decodes_quantized_memory_within_bound(tiny_memory, level, bound):
    from sparkv.cache import SparkvCache
    from sparkv.runtime.kvcache import memory_from_layers

    geo, layers = tiny_memory
    mem = memory_from_layers(layers, geo)
    full = mem.nbytes
    for cid in geo.chunk_ids():
        mem.set_level(cid, level)
    ref = [mem.layer_entries(l) for l in range(2)]
    cache = SparkvCache(mem)
    q = torch.randn(1, 6, 1, D)
    for step in range(3):
        k, v = torch.randn(1, 2, 1, D), torch.randn(1, 2, 1, D)
        view, _ = cache.layers[0].update(k, v)
        got = view.attend(q, None)
        tail = cache.layers[0].tail.kv()
        heads = [(torch.cat([e.k, tail[0][h, :step + 1]]), torch.cat([e.v, tail[1][h, :step + 1]]),
                  torch.cat([e.pos, torch.arange(300, 301 + step)])) for h, e in enumerate(ref[0])]
        want = ragged_attention(q, heads, torch.tensor([300 + step]), None)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
        # the memory holds the codes once (the cache references them); the only extra is the
        # fp tail of new tokens
        assert mem.nbytes == mem.recount() <= bound * full
        assert cache.extra_nbytes() == sum(x.tail_nbytes() for x in cache.layers)


def test_cache_rebuilds_after_a_level_change(tiny_memory):
    from sparkv.cache import SparkvCache
    from sparkv.runtime.kvcache import memory_from_layers

    geo, layers = tiny_memory
    mem = memory_from_layers(layers, geo)
    for cid in geo.chunk_ids():
        mem.set_level(cid, "int8")
    cache = SparkvCache(mem)
    q = torch.randn(1, 6, 1, D)
    k, v = torch.randn(1, 2, 1, D), torch.randn(1, 2, 1, D)
    cache.layers[1].update(k, v)
    mem.set_level(KVChunkId(2, 1, 0), "int4")
    mem.set_level(KVChunkId(3, 1, 0), "fp")           # a mixed layer: fp chunks go through torch
    view, _ = cache.layers[1].update(k, v)
    ref = mem.layer_entries(1)
    heads = [(torch.cat([e.k, k[0, h], k[0, h]]), torch.cat([e.v, v[0, h], v[0, h]]),
              torch.cat([e.pos, torch.arange(300, 302)])) for h, e in enumerate(ref)]
    want = ragged_attention(q, heads, torch.tensor([301]), None)
    torch.testing.assert_close(view.attend(q, None), want, atol=2e-5, rtol=1e-4)


def _explicit(q, k, v, q_pos, tail, scale):
    """A dense prefix and a causal tail by hand: ``(out [1, Hq, nq, D], weights' column sums)``."""
    _, hq, nq, d = q.shape
    hkv = k.shape[0]
    tk, tv, tpos = tail
    kk, vv = torch.cat([k, tk], dim=1), torch.cat([v, tv], dim=1)
    pos = torch.cat([torch.arange(k.shape[1]), tpos])
    qs = q[0].reshape(hkv, hq // hkv * nq, d)
    s = (qs @ kk.transpose(1, 2)) * scale
    rows = q_pos.repeat(hq // hkv).view(1, -1, 1)
    w = torch.softmax(s.masked_fill(pos.view(1, 1, -1) > rows, float("-inf")), dim=-1)
    return (w @ vv).reshape(1, hq, nq, d), w.sum(dim=(0, 1))


@pytest.mark.parametrize("prefix,nq,tail,dtype", [
    (1678, 1, 1, torch.float32), (600, 1, 0, torch.float32), (513, 2, 20, torch.float32),
    (3, 2, 5, torch.float32), (256, 1, 300, torch.float32), (700, 1, 9, torch.bfloat16)])
def test_dense_prefix_kernel_equals_explicit_softmax(prefix, nq, tail, dtype):
    """The numba kernel over a dense arena's prefix (a fork's attention: ``PrefixAttention``),
    float32 or bfloat16, gives a plain softmax's output and column sums (over the prefix
    widened to float32), the prefix read in place from the arena."""
    from sparkv.cache import colmass
    from sparkv.cache.qattend import PrefixAttention, _rows_array

    g = torch.Generator().manual_seed(prefix + nq)
    arena_k, arena_v = (torch.randn(1, 3, 2048, D, generator=g).to(dtype) for _ in range(2))
    k, v = arena_k[0, :, :prefix], arena_v[0, :, :prefix]
    t = (torch.randn(3, tail, D, generator=g), torch.randn(3, tail, D, generator=g),
         torch.arange(prefix, prefix + tail))
    q = torch.randn(1, 9, nq, D, generator=g)
    q_pos = torch.arange(prefix + tail - nq, prefix + tail).clamp_min(prefix)
    att = PrefixAttention(k, v)
    assert att._kernel_takes(q)
    assert _rows_array(k).ctypes.data == arena_k.data_ptr()        # no copy of the arena
    offered = []
    previous = colmass.set_sink(lambda sums, rows: offered.append((sums, rows)))
    try:
        out = att.attend(q, q_pos, 0.125, t)
    finally:
        colmass.set_sink(previous)
    want, sums = _explicit(q, k.float(), v.float(), q_pos, t, 0.125)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
    (got, rows), = offered
    assert rows == 9 * nq and got.shape == (prefix + tail,)
    torch.testing.assert_close(got, sums, atol=2e-5, rtol=1e-4)
    assert att.attend(q, q_pos, 0.125, t).equal(out)                # no sink: the same output
    assert att.attend(q.to(dtype), q_pos, 0.125, t).dtype == dtype


def test_dense_prefix_takes_torch_beyond_the_kernel(monkeypatch):
    """Many queries, or a dtype other than float32 and bfloat16, take the torch ops (same
    contract)."""
    from sparkv.cache import qattend
    from sparkv.cache.qattend import PrefixAttention

    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(3, 100, D, generator=g), torch.randn(3, 100, D, generator=g)
    t = (torch.randn(3, 8, D, generator=g), torch.randn(3, 8, D, generator=g),
         torch.arange(100, 108))
    monkeypatch.setattr(qattend, "_attend_dense", None)              # a call would fail
    q = torch.randn(1, 9, 8, D, generator=g)
    q_pos = torch.arange(100, 108)
    torch.testing.assert_close(PrefixAttention(k, v).attend(q, q_pos, None, t),
                               _explicit(q, k, v, q_pos, t, D ** -0.5)[0], atol=2e-5, rtol=1e-4)
    half = PrefixAttention(k.half(), v.half())
    assert not half._kernel_takes(q[:, :, :1].half())
    assert half.attend(q[:, :, :1].half(), q_pos[:1], None, None).dtype == torch.float16
