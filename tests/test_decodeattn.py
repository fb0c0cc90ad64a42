"""The one-query attention kernel (sparkv/runtime/decodeattn.py): SDPA's result up to the order
of sums, what it declines, non-finite input, and where the model calls it (``int4``)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from sparkv.runtime import decodeattn
from sparkv.kernels import use_torch_threads

N = decodeattn.MIN_ROWS


def _qkv(hq: int, hkv: int, n: int, d: int, seed: int, cap: int | None = None, spread: float = 1.0
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    cap = n if cap is None else cap
    k = torch.randn(1, hkv, cap, d, generator=g) * spread
    v = torch.randn(1, hkv, cap, d, generator=g)
    return torch.randn(1, hq, 1, d, generator=g), k[:, :, :n], v[:, :, :n]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
          ) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


@pytest.mark.parametrize("hq,hkv,n,d", [(9, 3, N, 64), (9, 3, N + 77, 64), (4, 4, N + 3, 32),
                                        (8, 2, 3 * N + 129, 16), (6, 1, N + 1, 64)])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_is_sdpa_up_to_the_order_of_sums(hq, hkv, n, d, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        use_torch_threads()
        q, k, v = _qkv(hq, hkv, n, d, seed=n + d)
        out = decodeattn.attend(q, k, v, None)
        assert out is not None and out.shape == q.shape and out.dtype == torch.float32
        torch.testing.assert_close(out, _sdpa(q, k, v), atol=2e-6, rtol=1e-5)
    finally:
        torch.set_num_threads(before)
        use_torch_threads()


def test_a_dense_arenas_prefix_is_read_in_place_and_a_given_scale_is_used():
    q, k, v = _qkv(9, 3, N + 5, 64, seed=1, cap=N + 300)        # views of a longer buffer
    assert not k.is_contiguous() and k._base is not None
    out = decodeattn.attend(q, k, v, 0.05)
    assert out is not None
    torch.testing.assert_close(out, _sdpa(q, k, v, 0.05), atol=2e-6, rtol=1e-5)
    # the rows past the prefix are not read: changing them changes nothing
    k._base[:, :, N + 5:] = float("nan")
    again = decodeattn.attend(q, k, v, 0.05)
    assert again is not None and torch.equal(again, out)


def test_a_prefix_made_in_inference_mode_is_read_in_place_too():
    """A decode pass's views of the arena are made in inference mode and record no base: the
    rows are found from the strides."""
    with torch.inference_mode():
        q, k, v = _qkv(9, 3, N + 5, 64, seed=7, cap=N + 300)
        assert not k.is_contiguous() and k._base is None
        out = decodeattn.attend(q, k, v, None)
        assert out is not None
        torch.testing.assert_close(out, _sdpa(q, k, v), atol=2e-6, rtol=1e-5)
        whole = torch.randn(1, 3, N + 300, 64)
        assert decodeattn.attend(q, whole[:, :2, :N], whole[:, :2, :N], None) is None  # 9 / 2
        assert decodeattn.attend(q[:, :6], whole[:, 1:, :N], whole[:, 1:, :N], None) is not None


def test_sharp_scores_stay_exact_across_blocks_and_units():
    # one key far above the others in a late block and unit: the online softmax rescales
    q, k, v = _qkv(9, 3, 2 * N, 64, seed=2, spread=4.0)
    k[0, :, 2 * N - 7] = q[0, ::3, 0] * 30
    out = decodeattn.attend(q, k, v, None)
    assert out is not None and torch.isfinite(out).all()
    torch.testing.assert_close(out, _sdpa(q, k, v), atol=2e-6, rtol=1e-5)


def _declines(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    return decodeattn.attend(q, k, v, None) is None


def test_what_the_kernel_declines():
    q, k, v = _qkv(9, 3, N, 64, seed=3)
    assert _declines(q, k[:, :, :N - 1], v[:, :, :N - 1])            # too few keys: SDPA's
    assert _declines(torch.cat([q, q], dim=2), k, v)                   # two queries
    assert _declines(q.bfloat16(), k.bfloat16(), v.bfloat16())         # not float32
    assert _declines(q, k.transpose(2, 3).contiguous().transpose(2, 3), v)   # rows not rows
    assert _declines(q, k[..., :32], v[..., :32])                      # a head-dim slice
    assert _declines(q[:, :8], k, v)                                   # 8 heads over 3
    assert _declines(q.clone().requires_grad_(), k, v)                 # autograd follows
    wide = torch.randn(1, 3, N, 128)
    assert _declines(q, wide[..., :64], wide[..., 64:])                # rows 128 apart


@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_key_or_value_declines_so_the_caller_runs_sdpa(where, bad):
    q, k, v = _qkv(9, 3, N + 40, 64, seed=4)
    (k if where == "k" else v)[0, 1, N + 17, 5] = bad
    assert decodeattn.attend(q, k, v, None) is None


def _tiny_lm(one_query: bool):
    from helpers import tiny_llama_model

    from sparkv.cache.attention import ONE_QUERY, use_sparkv_attention

    lm = tiny_llama_model(2, "tiny-one-query")
    use_sparkv_attention(lm.model)
    if one_query:
        for layer in lm.decoder.layers:
            setattr(layer.self_attn, ONE_QUERY, decodeattn.attend)
    return lm


def test_an_answer_token_over_the_kv_memory_takes_the_kernel_and_matches_sdpa(monkeypatch):
    from sparkv.cache import SparkvCache
    from sparkv.runtime.batchdecode import DecodeItem, decode_together
    from sparkv.runtime.generate import context_memory, reference_prefill

    monkeypatch.setattr(decodeattn, "MIN_ROWS", 64)
    calls: list[int] = []
    real = decodeattn.attend

    def taken(q, k, v, s):                  # the keys of each call the kernel computed
        out = real(q, k, v, s)
        if out is not None:
            calls.append(k.shape[2])
        return out

    monkeypatch.setattr(decodeattn, "attend", taken)
    logits = {}
    for one_query in (False, True):
        lm = _tiny_lm(one_query)
        ids = torch.randint(1, 128, (200,), generator=torch.Generator().manual_seed(5)).tolist()
        kv = reference_prefill(lm, ids)
        memories = [context_memory(lm, kv, 200), context_memory(lm, kv, 200)]
        first = SparkvCache(memories[0])
        one = decode_together(lm, [DecodeItem(first, 7, 200)])
        memories[0].truncate()
        two = decode_together(lm, [DecodeItem(first, 7, 200),
                                   DecodeItem(SparkvCache(memories[1]), 9, 200)])
        logits[one_query] = (one, two)
    # 2 layers: one row, then a batch of two; computed by the kernel, not declined (the arena's
    # prefix is a view made in inference mode: no ``_base`` to read the rows from)
    assert calls == [201, 201] + [201] * 4
    for a, b in zip(logits[False], logits[True]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_plain_cache_takes_the_kernel_for_one_query_only(monkeypatch):
    from transformers import DynamicCache

    monkeypatch.setattr(decodeattn, "MIN_ROWS", 64)
    seen: list[tuple[int, int]] = []
    real = decodeattn.attend
    monkeypatch.setattr(decodeattn, "attend", lambda q, k, v, s: seen.append(
        (q.shape[2], k.shape[2])) or real(q, k, v, s))
    outs = {}
    for one_query in (False, True):
        lm = _tiny_lm(one_query)
        ids = torch.randint(1, 128, (1, 100), generator=torch.Generator().manual_seed(6))
        cache = DynamicCache()
        with torch.no_grad():
            lm.model(input_ids=ids, cache=cache, use_cache=True)
            step = lm.model(input_ids=torch.tensor([[11]]), cache=cache, use_cache=True)
        outs[one_query] = step.logits
    assert seen == [(1, 101), (1, 101)]               # the 100-token prefill never asked
    torch.testing.assert_close(outs[True], outs[False], atol=1e-5, rtol=1e-5)


def test_int4_gives_every_layer_the_kernel_on_the_cpu(tiny_llama):
    from sparkv.cache.attention import ONE_QUERY
    from sparkv.runtime import LoadedModel
    from sparkv.runtime.compute import apply_compute

    lm = LoadedModel.from_model(copy.deepcopy(tiny_llama.model), None, "tiny")
    info = apply_compute(lm, "int4")
    assert info["one_query"].startswith("numba kernel")
    assert all(getattr(layer.self_attn, ONE_QUERY) is decodeattn.attend
               for layer in lm.decoder.layers)
    plain = LoadedModel.from_model(copy.deepcopy(tiny_llama.model), None, "tiny")
    assert "one_query" not in apply_compute(plain, "int8")
    assert not any(hasattr(layer.self_attn, ONE_QUERY) for layer in plain.decoder.layers)


def test_every_attention_view_takes_the_one_query_kernel():
    import importlib
    import inspect

    from sparkv.cache.attention import AttentionView, BatchView

    for module in ("sparkv.runtime.stepper", "sparkv.decode.session", "sparkv.decode.hf"):
        importlib.import_module(module)                # their views subclass AttentionView
    views, todo = [BatchView], [AttentionView]
    while todo:
        cls = todo.pop()
        views.append(cls)
        todo.extend(cls.__subclasses__())
    assert len(views) >= 5
    for cls in views:
        assert "one_query" in inspect.signature(cls.attend).parameters, cls
