"""The context service's per-switch work (issue 13, follow-up): the cached payload sizes keep the
KV memory's account exact; the batched fill writes interleaved resident chunks straight into the
arena, equal to the memory's own dequantization; eviction is chunk-granular (a context is left
partially resident, its least tolerable / least recently used chunks gone first)."""

from __future__ import annotations

import pytest
import torch

from sparkv.cache import ContextKV, dequantize
from sparkv.device import ContextService
from sparkv.device.loader import fill_layers, token_chunk_ids
from sparkv.runtime.generate import sample_context_ids
from helpers import flash_profile

FAST_FLASH = flash_profile(fast=True)


@pytest.fixture(scope="module")
def lm(smollm2):
    return smollm2


@pytest.fixture(scope="module")
def doc(lm):
    return sample_context_ids(lm, 200)


def test_cached_payload_bytes_keep_the_account_exact(lm, doc, tmp_path):
    svc = ContextService(lm, 256 << 20, tmp_path / "s", io_profile=FAST_FLASH, ratio=0.5,
                         journal=False)
    cid = svc.new_context(system_ids=doc[:90])
    C = svc.contexts[cid].memory
    assert C.nbytes == C.recount()
    per_t = C.resident_bytes_by_token()
    assert sum(per_t.values()) == C.nbytes - sum(
        x.nbytes for x in C.layers if x is not None)
    g = C.geometry
    freed = sum(C.drop(c) for t in (1, 3) for c in token_chunk_ids(g, t))
    assert freed == per_t[1] + per_t[3]
    assert C.nbytes == C.recount()
    assert set(C.resident_bytes_by_token()) == set(per_t) - {1, 3}


def test_fill_of_interleaved_resident_chunks_equals_dequantization(lm, doc, tmp_path):
    svc = ContextService(lm, 256 << 20, tmp_path / "s", io_profile=FAST_FLASH, ratio=0.5,
                         journal=False)
    cid = svc.new_context(system_ids=doc[:100])       # 7 token chunks, the last partial
    C = svc.contexts[cid].memory
    g = C.geometry
    for t in (2, 5):                                   # interleaved holes
        for c in token_chunk_ids(g, t):
            C.drop(c)
    W = ContextKV(g, lm.dtype, spare_tokens=5)
    L = g.num_layers
    assert fill_layers(C, W, range(L), skip={0}) == (g.num_token_chunks - 3) * L * g.num_groups
    for l in range(L):  # noqa: E741
        store = W.layers[l]
        for t in range(g.num_token_chunks):
            a, b = g.token_range(t)
            for gg in range(g.num_groups):
                h0, h1 = g.head_range(gg)
                got_k = store.k[0, h0:h1, a:b]
                if t in (0, 2, 5):
                    assert not got_k.any()                 # not written
                    continue
                p = C.state(token_chunk_ids(g, t)[l * g.num_groups + gg]).payload
                k = p.k if p.level == "fp" else dequantize(p.k, torch.float32)
                v = p.v if p.level == "fp" else dequantize(p.v, torch.float32)
                assert torch.equal(got_k, k.reshape(h1 - h0, b - a, -1))
                assert torch.equal(store.v[0, h0:h1, a:b], v.reshape(h1 - h0, b - a, -1))


def test_eviction_is_chunk_granular(lm, doc, tmp_path):
    """Reclaiming half a context's bytes leaves it partially resident (not evicted whole), its
    first (least recently used, then lowest t) token chunks gone; the next call on it reads only
    its missing token chunks."""
    # ratio 1.0: every chunk but the sink's at int8, so LCTRU's order is the chunks' (with
    # k8v4 chunks beside them the int8 ones go first, whatever their place)
    svc = ContextService(lm, 256 << 20, tmp_path / "s", io_profile=FAST_FLASH, journal=False,
                         keep_working=False, hot_margin_tokens=0, ratio=1.0)
    a = svc.new_context(system_ids=doc[:96])
    b = svc.new_context(system_ids=doc[100:196])
    Ca = svc.contexts[a].memory
    nt = Ca.geometry.num_token_chunks
    svc.budget = svc.used_bytes() - Ca.nbytes // 2      # half of a must go
    svc.account.reserve(0, svc.contexts[b])
    assert svc.used_bytes() <= svc.budget
    res = sorted(Ca.resident_bytes_by_token())
    assert 0 < len(res) < nt, "a evicted whole or not at all"
    assert res == list(range(nt - len(res), nt))        # the first chunks went first
    assert len(svc.contexts[b].memory.resident_bytes_by_token()) \
        == svc.contexts[b].memory.geometry.num_token_chunks  # b (the caller) untouched
    svc.budget = 256 << 20
    r = svc.call(a, "Say OK.", max_new_tokens=2)
    assert r.load.read_chunks + r.load.recomputed_chunks == nt - len(res)
    assert svc.stats()["budget_violations"] == 0
