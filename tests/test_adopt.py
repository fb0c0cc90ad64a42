"""A context adopted by the service (``import_context``: an ask's loaded cache, a benchmark's
prefill) is converted a layer at a time (sparkv.device.keeper.adopted_chunks): every chunk's
payloads are those of converting that chunk alone, bit for bit, at every level, a last chunk
shorter than the others included, and each payload holds its own storage (a chunk evicted later
frees its bytes); a context imported inside inference mode (an ask keeping its cache at its
first answer token) holds no inference tensor."""

from __future__ import annotations

import pytest
import torch

from sparkv.cache.levels import QuantizedTensor
from sparkv.cache.payload import ChunkPayload, contiguous_positions
from sparkv.device.keeper import adopted_chunks, adopted_pages
from sparkv.layout import ChunkGeometry, KVChunkId


class _Config:
    num_hidden_layers, num_attention_heads, num_key_value_heads = 3, 6, 2
    hidden_size, head_dim = 6 * 16, 16


def _alone(layers, g: ChunkGeometry, t: int, level: str, dtype) -> list[ChunkPayload]:
    """Chunk ``t`` converted alone (the reference)."""
    t0, t1 = g.token_range(t)
    hh, out = g.num_kv_heads, []
    for l, (k, v) in enumerate(layers):  # noqa: E741
        p = ChunkPayload(KVChunkId(t, l, 0), "fp", [t1 - t0] * hh,
                         contiguous_positions([t1 - t0] * hh, t0),
                         k[0, :, t0:t1].reshape(-1, g.head_dim).to(dtype).clone(),
                         v[0, :, t0:t1].reshape(-1, g.head_dim).to(dtype).clone(), dtype)
        out.append(p.at_level(level))
    return out


def _random_layers(g: ChunkGeometry, seed: int) -> list:
    """Per layer ``(K, V)`` ``[1, H, N, D]`` of ``g``, random (a KV made elsewhere)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (1, g.num_kv_heads, g.num_tokens, g.head_dim)
    return [(torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen))
            for _ in range(g.num_layers)]


def _tensors(x):
    return [x.codes, x.scale, x.zero] if isinstance(x, QuantizedTensor) else [x]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [16 * 5 + 3, 16 * 4, 7])   # the last chunk of 3; whole; short
@pytest.mark.parametrize("owned", [True, False])
def test_a_layer_at_a_time_gives_each_chunks_own_payloads(dtype, tokens, owned):
    g = ChunkGeometry.from_config(_Config(), tokens, 16)
    gen = torch.Generator().manual_seed(0)
    layers = [(torch.randn(1, 2, g.num_tokens, 16, generator=gen) * 3,
               torch.randn(1, 2, g.num_tokens, 16, generator=gen)) for _ in range(3)]
    levels = ["fp", "int8", "int4", "int2", "int8", "int4"][:g.num_token_chunks]
    got = adopted_chunks(layers, g, levels, dtype, owned=owned)
    assert len(got) == -(-tokens // 16) and all(len(c) == 3 for c in got)
    assert adopted_pages(g, levels) == {lv: 3 * 2 * levels.count(lv) for lv in set(levels)}
    for t, chunk in enumerate(got):
        for p, q in zip(chunk, _alone(layers, g, t, levels[t], dtype)):
            assert (p.cid, p.level, p.counts) == (q.cid, q.level, q.counts)
            assert torch.equal(p.pos, q.pos)
            for a, b in zip(_tensors(p.k) + _tensors(p.v), _tensors(q.k) + _tensors(q.v)):
                assert a.dtype == b.dtype and torch.equal(a, b)
                # owned: its own storage, nothing of the layer's converted rows is held
                own = a.untyped_storage().nbytes() == a.numel() * a.element_size()
                assert own if owned else not any(a.untyped_storage().data_ptr() ==
                                                 x.untyped_storage().data_ptr()
                                                 for kv in layers for x in kv)


@pytest.mark.parametrize("put_away", ["chunks", "kill"])
def test_a_context_imported_in_inference_mode_holds_no_inference_tensor(tiny_llama, tmp_path,
                                                                         put_away):
    """An ask keeps its cache at its first answer token, inside its generation's inference
    mode: what the service holds of it is still written in place later, outside it."""
    from sparkv.device import ContextService

    lm = tiny_llama
    n = 40
    g = ChunkGeometry.from_config(lm.config, n, 16)
    with torch.inference_mode():
        layers = [(torch.randn(1, g.num_kv_heads, n, g.head_dim),
                   torch.randn(1, g.num_kv_heads, n, g.head_dim)) for _ in range(g.num_layers)]
        kw = ({} if put_away == "chunks"
              else dict(eviction="whole", compression="fp", journal=False))
        svc = ContextService(lm, 64 << 20, tmp_path / "svc", put_away=put_away, **kw)
        cid = svc.import_context(list(range(5, 5 + n)), layers)
    C = svc.registry.get(cid).memory
    held = [t for s in C.layers if s is not None for t in (s.k, s.v) if t is not None]
    held += [t for pool in C.paged.pools.pools.values() for t in pool.tensors()]
    assert held and not any(t.is_inference() for t in held)
    assert svc.call(cid, prompt_ids=[7, 8, 9], max_new_tokens=2).context_tokens == n + 4
    svc.close()


@pytest.mark.parametrize("levels", [["int8"] * 6, ["fp", "int8", "int4", "int2", "int8", "int4"],
                                    ["int4", "int4", "fp", "fp", "int4", "int8"]])
def test_a_layers_runs_hold_what_its_chunks_put_one_by_one_hold(levels):
    """``adopt`` holds a layer's runs, one per level (its chunks consecutive or not): the
    memory then holds every chunk at its level, bit for bit as putting each chunk's payloads."""
    from sparkv.cache import ContextKV
    from sparkv.cache.chunks import Source
    from sparkv.device.keeper import adopted_runs

    tokens = 16 * 5 + 3
    g = ChunkGeometry.from_config(_Config(), tokens, 16)
    gen = torch.Generator().manual_seed(1)
    layers = [(torch.randn(1, 2, tokens, 16, generator=gen),
               torch.randn(1, 2, tokens, 16, generator=gen)) for _ in range(3)]
    by_runs, by_chunks = (ContextKV(g, torch.float32, "cpu", paged=True) for _ in range(2))
    runs = list(adopted_runs(layers, g, levels, torch.float32))
    assert [len(r) for r in runs] == [len(set(levels))] * 3          # a run per level a layer
    for r in runs:
        by_runs.hold(r, Source.INJECTED)
    for payloads in adopted_chunks(layers, g, levels, torch.float32):
        by_chunks.put_payloads(payloads, Source.INJECTED)
    for t in range(g.num_token_chunks):
        for l in range(3):  # noqa: E741
            a, b = by_runs.read(KVChunkId(t, l, 0)), by_chunks.read(KVChunkId(t, l, 0))
            assert (a.level, a.counts) == (b.level, b.counts) == (levels[t], a.counts)
            assert torch.equal(a.pos, b.pos)
            for x, y in zip(_tensors(a.k) + _tensors(a.v), _tensors(b.k) + _tensors(b.v)):
                assert torch.equal(x, y)


def test_a_context_imported_without_writing_ahead_is_written_only_when_reclaimed(tiny_llama,
                                                                                  tmp_path):
    """``import_context(ahead=False)`` (a request's choices' copy, deleted within seconds):
    nothing is written to flash after the import or its calls; a reclaim still writes what it
    frees, and the context then answers as before."""
    from sparkv.device import ContextService

    lm, n = tiny_llama, 64
    g = ChunkGeometry.from_config(lm.config, n, 16)
    layers = _random_layers(g, seed=3)
    ids = list(range(5, 5 + n))
    svc = ContextService(lm, 64 << 20, tmp_path / "svc", keep_working=False)
    try:
        copy = svc.import_context(ids, layers, ahead=False)
        want = svc.call(copy, prompt_ids=[7, 8, 9], max_new_tokens=3, grow=False).tokens
        assert svc.counters.aot_written_bytes == 0
        kept = svc.import_context(ids, layers)                  # the default: written ahead
        assert svc.counters.aot_written_bytes > 0
        C = svc.contexts[copy].memory
        svc.budget = svc.used_bytes() - C.nbytes // 2           # half of the copy must go
        svc.account.reserve(0, svc.contexts[kept])
        assert svc.counters.reclaim_written_bytes > 0           # written as it was reclaimed
        svc.budget = 64 << 20
        assert svc.call(copy, prompt_ids=[7, 8, 9], max_new_tokens=3, grow=False).tokens == want
    finally:
        svc.close()


def test_an_import_keeps_a_working_memory_that_answers_as_a_load(tiny_llama, tmp_path):
    """An imported context's working memory is filled from its chunks (at their levels) and
    kept when it fits the budget as it is: its first call switches in without a load and
    answers as a load would; one that does not fit reclaims nothing, nor does a copy
    imported without writing ahead."""
    from collections import Counter

    from sparkv.device import ContextService
    from sparkv.device.loader import working_nbytes

    lm, n = tiny_llama, 70
    g = ChunkGeometry.from_config(lm.config, n, 16)
    layers = _random_layers(g, seed=4)
    ids, q = list(range(5, 5 + n)), [7, 8, 9]
    svc = ContextService(lm, 64 << 20, tmp_path / "svc", ratio=0.6, journal=False)
    try:
        a = svc.import_context(ids, layers)
        assert svc.contexts[a].hot is not None and {"k8v4", "int4"} & set(svc.contexts[a].levels)
        hot = svc.call(a, prompt_ids=q, max_new_tokens=4, grow=False)
        assert hot.load.sources == {"working memory": g.num_token_chunks}
        with svc.registry.lock:                 # its chunks stay: a load fills from them
            svc.keeper.drop_hot(svc.contexts[a])
        assert svc.contexts[a].hot is None
        b = svc.import_context(ids, layers, ahead=False)       # a copy: keeps none
        assert svc.contexts[b].hot is None
        loaded = svc.call(a, prompt_ids=q, max_new_tokens=4, grow=False)
        assert loaded.load.sources == dict(Counter(svc.contexts[a].levels))
        assert loaded.tokens == hot.tokens
        # no room for a working memory beside what is held: nothing is reclaimed for one
        svc.budget = svc.used_bytes() + svc.levels.chunks_nbytes(g, svc.contexts[a].levels) \
            + working_nbytes(g, 0, lm.dtype) // 2
        evicted = svc.counters.evicted_bytes
        c = svc.import_context(ids, layers)
        assert svc.contexts[c].hot is None and svc.counters.evicted_bytes == evicted
    finally:
        svc.close()
