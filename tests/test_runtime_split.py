"""The GPU-edge building blocks that also run on the CPU: the prefix + own-keys split merged by
LSE, fused layer spans in the stepper, random-weight shapes, the prefill bench's variants."""

from __future__ import annotations

import pytest
import torch

from sparkv.layout import StepId
from sparkv.runtime import DenseAttention, LayerStepper, get_backend, reference_prefill
from sparkv.runtime.attention import _block_mean, _pool
from sparkv.runtime.split import _cpu, _self_check, split_attention


@pytest.mark.parametrize("hq,hkv,off,n", [(6, 2, 300, 77), (4, 4, 128, 128), (9, 3, 1000, 256)])
def test_split_equals_masked_dense(hq, hkv, off, n):
    torch.manual_seed(off)
    q = torch.randn(1, n, hq, 32).transpose(1, 2)       # as attention modules hand it over
    k = torch.randn(1, hkv, off + n + 50, 32)           # an arena longer than the keys seen
    v = torch.randn_like(k)
    got = split_attention(q, k, v, off)
    want, _ = DenseAttention(split=False).attend(q, k, v, off)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_split_self_check_rejects_a_wrong_kernel():
    assert _self_check(_cpu, torch.device("cpu"), torch.float32)

    def no_lse(q, k, v, causal, scale):                 # an LSE of zeros: merges wrongly
        o, lse = _cpu(q, k, v, causal, scale)
        return o, torch.zeros_like(lse)

    assert not _self_check(no_lse, torch.device("cpu"), torch.float32)


def test_pool_matches_block_mean():
    x = torch.randn(1, 3, 1000, 16)
    for block in (8, 32, 128):
        torch.testing.assert_close(_pool(x, block), _block_mean(x, block)[0])


def _err(kv, ref) -> float:
    return max(max(float((k - rk).abs().max()), float((v - rv).abs().max()))
               for (k, v), (rk, rv) in zip(kv, ref))


@pytest.mark.parametrize("backend", ["dense", "block_sparse"])
def test_fused_complete_equals_the_full_forward(tiny_llama, backend):
    ids = torch.randint(0, 128, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        ref = reference_prefill(tiny_llama, ids)
    st = LayerStepper(tiny_llama, ids, 64, backend=get_backend(backend))
    results = st.complete(fused=True)
    assert len(results) == st.geometry.num_token_chunks * st.geometry.num_layers
    assert _err(st.kv.layer_kv(), ref) < 2e-4


def test_spans_mix_with_single_steps_and_check_dependencies(tiny_llama):
    ids = torch.randint(0, 128, (300,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.inference_mode():
        ref = reference_prefill(tiny_llama, ids)
    st = LayerStepper(tiny_llama, ids, 64)
    st.run_step(StepId(0, 0))
    st.run_span(1, 5, 0)
    st.run_span(0, 2, 1)
    with pytest.raises(Exception, match="already ran"):
        st.run_span(1, 3, 1)
    st.run_span(2, 5, 1)
    st.run_span(0, 5, 2)
    assert _err(st.kv.layer_kv(), ref) < 2e-4
    fresh = LayerStepper(tiny_llama, ids, 64)
    with pytest.raises(Exception, match=r"Y\[l=0, t=1\]"):
        fresh.run_span(0, 2, 1)
    with pytest.raises(Exception, match="outside the context"):
        fresh.run_span(3, 9, 0)


def test_a_call_names_what_it_misses_past_its_first_step(tiny_llama):
    """``call_missing``: a span whose first step is ready but whose later token chunks' hidden
    inputs are missing (a failed prelude span the controller counts as done: the edge engine
    then falls back instead of failing the load, session 73) is not runnable; a column the same;
    what can run names nothing."""
    ids = torch.randint(0, 128, (300,), generator=torch.Generator().manual_seed(2)).tolist()
    st = LayerStepper(tiny_llama, ids, 64)
    st.run_step(StepId(0, 0))
    span = [StepId(t, 1) for t in range(3)]
    assert st.ready(span[0])
    assert st.call_missing(span) == ["Y[l=0, t=1] from step(t=1, l=0)",
                                     "Y[l=0, t=2] from step(t=2, l=0)"]
    assert st.call_missing(span[:1]) == []
    assert st.call_missing([StepId(1, 0), StepId(1, 1)])   # needs (0, 1)'s KV at layer 1
    st.run_span(1, 3, 0)
    assert st.call_missing(span) == []
    st.run_span(0, 3, 1)
    assert st.call_missing([StepId(1, 2), StepId(1, 3)])    # (0, 2) not run: its KV missing
    assert "already ran" in " ".join(st.call_missing([StepId(0, 1), StepId(1, 1)]))


def test_fused_complete_keeps_streamed_chunks(tiny_llama):
    ids = torch.randint(0, 128, (256,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.inference_mode():
        ref = reference_prefill(tiny_llama, ids)
    st = LayerStepper(tiny_llama, ids, 64)
    for cid in st.geometry.chunk_ids():
        if cid.t == 1 or cid.l == 2:              # "streamed": the reference's own values
            t0, t1 = st.geometry.token_range(cid.t)
            h0, h1 = st.geometry.head_range(cid.g)
            k, v = ref[cid.l]
            st.inject(cid, k[0, h0:h1, t0:t1], v[0, h0:h1, t0:t1])
    st.complete(fused=True)
    assert _err(st.kv.layer_kv(), ref) < 2e-4


def test_random_shapes_build_seeded_and_reject_unknown_names():
    from sparkv.runtime import ModelNotFoundError, load_model, sample_context_ids
    from sparkv.runtime.shapes import SHAPES, parse_random_spec

    assert parse_random_spec("random:llama-3.2-3b:7") == ("llama-3.2-3b", 7)
    with pytest.raises(ModelNotFoundError, match="unknown random model shape"):
        load_model("random:gpt-9")
    with pytest.raises(ModelNotFoundError, match="seed must be an integer"):
        load_model("random:smollm2-135m:x")
    a = load_model("random:smollm2-135m", progress=False)
    b = load_model("random:smollm2-135m", progress=False)
    assert a.name == "random:smollm2-135m" and a.fingerprint == b.fingerprint
    assert a.config.num_hidden_layers == SHAPES["smollm2-135m"]["num_hidden_layers"]
    pa, pb = next(a.model.parameters()), next(b.model.parameters())
    assert torch.equal(pa, pb)
    other = load_model("random:smollm2-135m:1", progress=False)
    assert not torch.equal(pa, next(other.model.parameters()))
    a.tokenizer = None                                  # no tokenizer: seeded random ids
    ids = sample_context_ids(a, 100)
    assert len(ids) == 100 and ids == sample_context_ids(a, 100)
    assert max(ids) < a.config.vocab_size


def test_prefill_variants_parse():
    from sparkv.bench.prefill import parse_variants

    vs = parse_variants("full, dense+fused,auto")
    assert [(v.backend, v.fused) for v in vs] == [("full", False), ("dense", True),
                                                  ("auto", False)]
    with pytest.raises(SystemExit, match="unknown variant"):
        parse_variants("dense+turbo")


def test_prefill_engine_variants_parse_and_fill_the_stepper(tiny_llama):
    """``+engine`` runs the edge engine's local load with this device's controller, ``+spans``
    and ``+steps`` force its spans on or off; each fills the stepper's cache with the
    reference prefill (and ``full`` takes no flag)."""
    from sparkv.bench.prefill import _engine_load, parse_variants

    vs = parse_variants("dense+engine,dense+spans,block_sparse+steps")
    assert [(v.backend, v.by_engine, v.engine) for v in vs] == [
        ("dense", True, None), ("dense", True, True), ("block_sparse", True, False)]
    with pytest.raises(SystemExit, match="unknown variant"):
        parse_variants("full+engine")
    ids = list(range(1, 97))
    ref = reference_prefill(tiny_llama, ids)
    for spans in (None, True, False):
        stepper = LayerStepper(tiny_llama, ids, 16, get_backend("dense"))
        assert _engine_load(stepper, spans) == []
        for (k, v), (rk, rv) in zip(stepper.kv.layer_kv(), ref):
            torch.testing.assert_close(k, rk, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v, rv, atol=1e-5, rtol=1e-5)
