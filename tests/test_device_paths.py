"""This wave's compute paths on every device this machine has (the CPU always, CUDA when there is
one): the self-similarity filter and flex block-sparse attention, quantized resident decode, and
(CUDA only) bfloat16 layer steps against a bfloat16 full forward. On a CPU-only machine the CUDA
cases skip; ``bench/gpu_check.sh`` runs them on a GPU."""

from __future__ import annotations

import pytest
import torch
from test_runtime_device import _token_mask
from test_runtime_sparsecal import structured_qkv

from sparkv.runtime import BlockSparseAttention, SparsityConfig, flex_available
from sparkv.runtime.selfsim import not_self_similar

CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device on this machine")
needs_flex = pytest.mark.skipif(not flex_available(), reason="no flex_attention in this PyTorch")


def _on(device: str, *xs: torch.Tensor) -> list[torch.Tensor]:
    return [x.to(device) for x in xs]


def _cfg(sim: float) -> SparsityConfig:
    return SparsityConfig(cdf_threshold=0.3, sim_threshold=sim, min_keys=0, dense_below=0)


@pytest.mark.parametrize("device", DEVICES)
def test_the_filter_and_the_mask_are_the_same_on_every_device(device):
    q, k, _ = structured_qkv(512, 1536)
    must_cpu = not_self_similar(q, k, 0.2, 128, 64, 32, 8)
    qd, kd = _on(device, q, k)
    must = not_self_similar(qd, kd, 0.2, 128, 64, 32, 8)
    assert torch.equal(must.cpu(), must_cpu)
    be = BlockSparseAttention(_cfg(0.2))
    mask = be.predict_mask(qd, kd, 1024, 0.2).cpu()
    want = be.predict_mask(q, k, 1024, 0.2)
    _, _, _, visible, _ = be._geometry(512, 1536, 1024, torch.device("cpu"))
    assert bool((mask | ~(must_cpu & visible)).all())      # never skips a flagged block
    # the estimate's float sums may order near-equal blocks differently on another device
    assert float((mask ^ want).float().mean()) <= 0.02


@needs_flex
@pytest.mark.parametrize("device", DEVICES)
def test_flex_sparse_with_the_filter_equals_masked_dense(device):
    from sparkv.runtime.flex import FlexAttention

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = _on(device, *structured_qkv(384, 1024 + 384, dtype=dtype))
    off = 1024
    flex = FlexAttention(sparse=True, config=_cfg(0.2))
    mask = flex._predictor.predict_mask(q, k, off, 0.2)
    _, _, _, visible, _ = flex._predictor._geometry(384, 1408, off, q.device)
    assert 0 < float((mask & visible).sum()) < float(visible.sum()) * mask.shape[1]
    got, stats = flex.attend(q, k, v, off, 0.2, mask=mask)
    tok = _token_mask(mask.cpu(), 384, 1408, off).to(device)
    group = q.shape[1] // k.shape[1]
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1),
        attn_mask=tok, scale=0.2)
    atol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=atol)
    assert int(stats.active_blocks.sum()) == int((mask & visible).sum())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("level", ["int8", "int4"])
def test_quantized_resident_decode_on_every_device(device, level):
    """A SparkvCache over a memory whose chunks are held quantized, on ``device``: decode
    attention equals attention over the dequantized entries (the CPU reads the codes with the
    fused kernel, a GPU dequantizes per call)."""
    from sparkv.cache import SparkvCache, ragged_attention
    from sparkv.layout import ChunkGeometry
    from sparkv.runtime.kvcache import memory_from_layers

    d = 64
    geo = ChunkGeometry(300, 64, 2, 2, d, 1)
    g = torch.Generator().manual_seed(0)
    layers = [tuple(torch.randn(1, 2, 300, d, generator=g).to(device) for _ in range(2))
              for _ in range(2)]
    mem = memory_from_layers(layers, geo)
    for cid in geo.chunk_ids():
        mem.set_level(cid, level)
    ref = mem.layer_entries(0)
    cache = SparkvCache(mem)
    q = torch.randn(1, 6, 1, d, generator=g).to(device)
    for step in range(2):
        kn, vn = (torch.randn(1, 2, 1, d, generator=g).to(device) for _ in range(2))
        view, _ = cache.layers[0].update(kn, vn)
        got = view.attend(q, None)
        tk, tv = cache.layers[0].tail.kv()
        heads = [(torch.cat([e.k, tk[h, :step + 1]]), torch.cat([e.v, tv[h, :step + 1]]),
                  torch.cat([e.pos.to(device), torch.arange(300, 301 + step, device=device)]))
                 for h, e in enumerate(ref)]
        want = ragged_attention(q, heads, torch.tensor([300 + step], device=device), None)
        assert got.device.type == device
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@needs_cuda
def test_cuda_bf16_steps_equal_bf16_full_prefill_and_greedy_tokens_match():
    """The SmolLM2 shape (random weights, seeded) in bfloat16 on the GPU: the layer steps' K/V
    equal the full forward's within bf16 tolerance, and greedy decoding over either gives the
    same tokens, except where the reference's top two logits are a near tie (< 0.25 apart)."""
    from sparkv.runtime import LayerStepper, greedy_generate, load_model
    from sparkv.runtime.hfcache import output_cache
    from sparkv.runtime.kvcache import from_dynamic_cache

    lm = load_model("random:smollm2-135m", device="cuda", dtype="bfloat16", progress=False)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(100, 20000, (1100,), generator=g).tolist()
    stepper = LayerStepper(lm, ids, chunk_tokens=256)        # 5 chunks: the split path runs
    stepper.complete()
    steps = stepper.kv.layer_kv()
    with torch.inference_mode():
        out = lm.model(input_ids=torch.tensor([ids], device="cuda"), use_cache=True,
                       logits_to_keep=1)
    full = from_dynamic_cache(output_cache(out))
    for (ks, vs), (kf, vf) in zip(steps, full):
        assert ks.dtype == torch.bfloat16 and ks.is_cuda
        for a, b in ((ks, kf), (vs, vf)):
            tol = 0.05 * float(b.float().abs().max()) + 0.05
            assert float((a.float() - b.float()).abs().max()) <= tol
    question = torch.randint(100, 20000, (12,), generator=g).tolist()
    a = greedy_generate(lm, steps, len(ids), question, 8, stop_at_eos=False).tokens
    b = greedy_generate(lm, full, len(ids), question, 8, stop_at_eos=False).tokens
    if a != b:
        i = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
        with torch.inference_mode():
            logits = lm.model(input_ids=torch.tensor([ids + question + b[:i]], device="cuda"),
                              logits_to_keep=1).logits[0, -1].float()
        top = torch.topk(logits, 2).values
        assert float(top[0] - top[1]) < 0.25, (a, b, i)


@needs_cuda
def test_cuda_auto_dtype_is_half_precision_without_a_verdict():
    """``auto`` on a GPU, for a model the quality table has no verdict on (the random shapes):
    half precision. (A failed verdict means float32: tests/test_dtypes.py.)"""
    from sparkv.predictor.dtypes import choose_dtype

    choice = choose_dtype("auto", torch.device("cuda"), "no-such-model")
    assert choice.dtype in (torch.bfloat16, torch.float16), choice.reason
