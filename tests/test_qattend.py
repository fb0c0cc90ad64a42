"""The fused quantized attention (sparkv/cache/qattend.py) equals dequantize-then-attend within
float32 rounding, at every level, with ragged heads, masks and a fp tail; SparkvCache decodes a
quantized memory with it; the memory stays within its bound."""

from __future__ import annotations

import pytest
import torch

from sparkv.cache import ragged_attention
from sparkv.cache.levels import quantize
from sparkv.cache.payload import ChunkPayload
from sparkv.cache.qattend import (DequantizedRows, QuantizedRows, attend_entries,
                                  attend_stacked, merge_partials)
from sparkv.layout import ChunkGeometry, KVChunkId

D = 64


def _payloads(level: str, counts: list[list[int]], seed: int) -> tuple[list, list]:
    """Chunks of one group of 2 heads each, quantized, with their fp (dequantized) entries."""
    g = torch.Generator().manual_seed(seed)
    bits = {"int8": 8, "int4": 4, "int2": 2}[level]
    out, start = [], 0
    for t, cs in enumerate(counts):
        pos = torch.cat([torch.sort(torch.randperm(400, generator=g)[:n]).values + start
                         for n in cs]).to(torch.int32)
        n = sum(cs)
        k, v = torch.randn(n, D, generator=g) * 2, torch.randn(n, D, generator=g)
        out.append(ChunkPayload(KVChunkId(t, 0, 0), level, list(cs), pos, quantize(k, bits),
                                quantize(v, bits)))
        start += 400
    return out, [0] * len(out)


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
    return ragged_attention(q, cat, q_pos, None)[0]


@pytest.mark.parametrize("rows_class", [QuantizedRows, DequantizedRows])
@pytest.mark.parametrize("level", ["int8", "int4", "int2"])
def test_fused_equals_dequantize_then_attend(level, rows_class):
    payloads, h0 = _payloads(level, [[30, 17], [0, 40], [300, 5]], seed=1)
    rows = rows_class(payloads, h0, num_kv_heads=2)
    q = torch.randn(1, 6, 1, D)
    q_pos = torch.tensor([1000])
    got = rows.attend(q, q_pos, None).out
    torch.testing.assert_close(got, _reference(q, payloads, q_pos), atol=2e-5, rtol=1e-4)


def test_masked_queries_and_fp_tail():
    payloads, h0 = _payloads("int8", [[30, 17], [12, 40]], seed=2)
    rows = QuantizedRows(payloads, h0, num_kv_heads=2)
    q = torch.randn(1, 6, 3, D)
    q_pos = torch.tensor([200, 600, 801])    # the first sees part of chunk 0 only
    tail = [(torch.randn(3, D), torch.randn(3, D), torch.tensor([799, 800, 801])) for _ in range(2)]
    got = merge_partials([rows.attend(q, q_pos, None),
                          attend_entries(q, tail, q_pos, None)]).out
    stacked = attend_stacked(q, torch.stack([t[0] for t in tail]),
                             torch.stack([t[1] for t in tail]), tail[0][2], q_pos, None)
    torch.testing.assert_close(stacked.out, attend_entries(q, tail, q_pos, None).out)
    stacked_tail = (torch.stack([t[0] for t in tail]), torch.stack([t[1] for t in tail]),
                    tail[0][2])
    for fused in (rows.attend(q, q_pos, None, stacked_tail),
                  DequantizedRows(payloads, h0, 2).attend(q, q_pos, None, stacked_tail)):
        torch.testing.assert_close(fused.out, got, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got, _reference(q, payloads, q_pos, tail), atol=2e-5, rtol=1e-4)


def test_query_seeing_nothing_gets_zeros():
    payloads, h0 = _payloads("int4", [[10, 10]], seed=3)
    part = QuantizedRows([p for p in payloads], h0, 2).attend(torch.randn(1, 2, 1, D),
                                                              torch.tensor([-1]), None)
    assert torch.all(part.out == 0) and torch.all(torch.isinf(part.lse))


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
        tail = cache.layers[0]._tail_k, cache.layers[0]._tail_v
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
