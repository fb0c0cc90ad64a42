"""sparkv.cache.attention: a masked multi-query call with GQA on the CPU runs SDPA's own GQA (no
copy of K and V per query head) and gives transformers' values bit for bit."""

from __future__ import annotations

import pytest
import torch

import sparkv.cache.attention as attention
from sparkv.cache.attention import sparkv_attention


class _Layer(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True


def _inputs(dtype: torch.dtype, bool_mask: bool) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(1)
    n, nq = 300, 17
    q = torch.randn(1, 9, nq, 64, dtype=dtype)
    # a dense arena's slice: slot = position, spare room past the question (not contiguous)
    k = torch.randn(1, 3, n + nq + 40, 64, dtype=dtype)[:, :, :n + nq]
    v = torch.randn(1, 3, n + nq + 40, 64, dtype=dtype)[:, :, :n + nq]
    visible = (torch.arange(n + nq).view(1, -1) <= (torch.arange(nq) + n).view(-1, 1))
    mask = visible.view(1, 1, nq, n + nq)
    if not bool_mask:
        mask = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)
    return q, k, v, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bool_mask", [True, False])
def test_masked_gqa_equals_transformers_without_copying_kv(monkeypatch, dtype, bool_mask):
    from transformers.integrations import sdpa_attention
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v, mask = _inputs(dtype, bool_mask)
    expected, _ = sdpa_attention_forward(_Layer(), q, k, v, mask, scaling=0.125)

    def no_copy(*a, **kw):
        raise AssertionError("K and V were copied per query head (repeat_kv)")

    monkeypatch.setattr(sdpa_attention, "repeat_kv", no_copy)
    got, _ = sparkv_attention(_Layer(), q, k, v, mask, scaling=0.125)
    assert got.shape == expected.shape and torch.equal(got, expected)


def test_calls_the_fast_path_does_not_take_go_to_transformers():
    q, k, v, mask = _inputs(torch.float32, True)
    take = attention._masked_gqa_on_cpu
    assert take(q, k, v, mask, 0.0, {})
    assert not take(q, k, v, None, 0.0, {})                       # transformers' GQA already
    assert not take(q[:, :, :1], k, v, mask[:, :, :1], 0.0, {})   # one query: pack_gqa
    assert not take(q[:, :3], k[:, :3], v[:, :3], mask, 0.0, {})  # no GQA
    assert not take(q, k, v, mask, 0.1, {})                       # dropout
    assert not take(q, k, v, mask, 0.0, {"position_bias": torch.zeros(1)})
    assert not take(q, k, v, mask, 0.0, {"softcap": 30.0})


def test_a_question_over_the_kv_memory_is_unchanged_by_the_fast_path(tiny_llama, monkeypatch):
    """A real model's question prefill and answer over a context's memory: the same logits and
    tokens with and without the fast path."""
    from sparkv.runtime.generate import greedy_generate, reference_prefill

    gen = torch.Generator().manual_seed(3)
    context = [int(x) for x in torch.randint(1, 120, (200,), generator=gen)]
    question = [5, 6, 7, 8, 9, 10, 11]
    calls = []
    real = attention._masked_gqa_on_cpu

    def spy(*a, **kw):
        calls.append(real(*a, **kw))
        return calls[-1]

    monkeypatch.setattr(attention, "_masked_gqa_on_cpu", spy)
    fast = greedy_generate(tiny_llama, reference_prefill(tiny_llama, context), len(context),
                           question, 4, stop_at_eos=False)
    assert any(calls)
    monkeypatch.setattr(attention, "_masked_gqa_on_cpu", lambda *a, **kw: False)
    slow = greedy_generate(tiny_llama, reference_prefill(tiny_llama, context), len(context),
                           question, 4, stop_at_eos=False)
    assert fast.tokens == slow.tokens
    assert torch.equal(fast.first_logits, slow.first_logits)


def test_a_module_with_a_products_dtype_attends_a_prefill_in_it_and_a_decode_step_not():
    """``mixed-attn``: a pass of several queries runs with Q, K and V in bf16 (plain tensors and
    a dense arena's view alike: the same values), its output cast back to float32; one query (a
    decode step) and a module without the attribute attend in float32."""
    from sparkv.cache.attention import PRODUCTS_DTYPE, AttentionView

    q, k, v, mask = _inputs(torch.float32, True)
    plain = _Layer()
    layer = _Layer()
    setattr(layer, PRODUCTS_DTYPE, torch.bfloat16)
    bf = torch.bfloat16
    want, _ = sparkv_attention(plain, q.to(bf), k.to(bf), v.to(bf), mask, scaling=0.125)
    got, _ = sparkv_attention(layer, q, k, v, mask, scaling=0.125)
    assert got.dtype == torch.float32 and torch.equal(got, want.float())
    n = k.shape[2] - q.shape[2]
    view = AttentionView(q_pos=torch.arange(n, n + q.shape[2]), k=k, v=v, q_offset=n)
    got_view, _ = sparkv_attention(layer, q, view, view, None, scaling=0.125)
    assert got_view.dtype == torch.float32
    assert (got_view - want.float()).abs().max() < 0.02          # another SDPA call, bf16 inputs
    fp32_view, _ = sparkv_attention(plain, q, view, view, None, scaling=0.125)
    assert not torch.equal(got_view, fp32_view)
    one, _ = sparkv_attention(layer, q[:, :, -1:], k, v, None, scaling=0.125)
    ref, _ = sparkv_attention(plain, q[:, :, -1:], k, v, None, scaling=0.125)
    assert torch.equal(one, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [2, 37, 300, 1030])
def test_a_prefill_from_position_0_is_the_masked_result_bit_for_bit(n, dtype):
    """causal_sdpa takes the kernel's own causal form for a pass from position 0 (it skips the
    key blocks no query sees): the same values as the explicit mask, spare slots past the pass
    left out; a pass after an offset keeps the mask and is still causal from its offset."""
    torch.manual_seed(n)
    q = torch.randn(1, 9, n, 64, dtype=dtype)
    k = torch.randn(1, 3, n + 40, 64, dtype=dtype)       # spare room past the pass
    v = torch.randn(1, 3, n + 40, 64, dtype=dtype)
    visible = torch.arange(n).view(1, -1) <= torch.arange(n).view(-1, 1)
    masked = torch.nn.functional.scaled_dot_product_attention(
        q, k[:, :, :n], v[:, :, :n], attn_mask=visible, scale=0.125, enable_gqa=True)
    assert torch.equal(attention.causal_sdpa(q, k, v, 0, 0.125), masked)
    if n > 2:    # the pass's second half after its first: the same rows as the whole pass's
        half = n // 2
        later = attention.causal_sdpa(q[:, :, half:], k, v, half, 0.125)
        torch.testing.assert_close(later, masked[:, :, half:], atol=2e-2 if dtype ==
                                   torch.bfloat16 else 1e-5, rtol=0)


def test_a_prefill_from_position_0_takes_the_causal_form_and_a_later_pass_the_mask(monkeypatch):
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((bool(kwargs.get("is_causal")), kwargs.get("attn_mask") is not None))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    q, k, v = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 20, 16), torch.randn(1, 2, 20, 16)
    attention.causal_sdpa(q, k, v, 0, None)
    attention.causal_sdpa(q, k, v, 5, None)
    assert calls == [(True, False), (False, True)]
