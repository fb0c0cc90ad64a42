"""kvpress-shaped presses (sparkv/presses/hooks.py, docs/presses.md "kvpress's way"): the
``XxxPress`` names, ``compression_ratio`` (the fraction removed), ``with press(model):`` on a plain
transformers prefill, and the ``score_entries`` hook. The central guarantee: a press through the
hook keeps exactly the entries (per layer and head) that :func:`compress` keeps."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import sparkv.presses as presses
from sparkv.presses import (PRESSES, AdaKVPress, Budget, KnormPress, Press, PressError,
                            PyramidKVPress, ScoreInputs, SnapKVPress, compress, make_press,
                            parse_press, prefill, to_memory)
from sparkv.runtime.generate import greedy_generate, sample_context_ids


@pytest.fixture(scope="module")
def smol(smollm2):
    ids = sample_context_ids(smollm2, 160)
    question = smollm2.encode_text("\n\nWhat is it about?")
    layers, window, _ = prefill(smollm2, ids, window=32)
    return smollm2, ids, question, layers, window


def _hooked(lm, ids, press):
    cache = DynamicCache()
    with torch.inference_mode(), press(lm.model) as hooks:
        lm.model(input_ids=torch.tensor([ids]), cache=cache)
    return hooks, cache


def _same_plan(a, b) -> bool:
    return a.budgets == b.budgets and a.forced == b.forced and all(
        torch.equal(x, y) for ra, rb in zip(a.keep, b.keep) for x, y in zip(ra, rb))


class ExpectedAttention(Press):
    """An expected-attention-like scorer written on ScoreInputs: the window's queries as a
    Gaussian (mean ``mu``, per-channel variance ``s2``) per query group; a key's score is
    ``exp(mu k / sqrt(D) + k^2 s2 / (2 D))`` averaged over the group, times its value's norm."""

    name = "expected-attention-test"

    @property
    def needs_attention(self) -> bool:
        return False

    def score_entries(self, inputs: ScoreInputs) -> torch.Tensor:
        assert inputs.queries is not None and inputs.hidden_states is not None
        h, n, d = inputs.keys.shape
        q = inputs.queries.reshape(h, -1, d)                       # [H, g*w, D]
        mu, s2 = q.mean(1, keepdim=True), q.var(1, keepdim=True)    # [H, 1, D]
        logits = (inputs.keys * mu).sum(-1) / d ** 0.5 + (inputs.keys ** 2 * s2).sum(-1) / (2 * d)
        return torch.softmax(logits, -1) * inputs.values.norm(dim=-1)


# ---- the same kept entries through the hook as through compress() -----------------------------
@pytest.mark.parametrize("name", sorted(PRESSES))
def test_hook_keeps_what_compress_keeps(smol, name):
    lm, ids, _, layers, window = smol
    press = make_press(name, compression_ratio=0.6)
    mem = to_memory(lm, layers)
    ref = compress(mem, press, None, window).plan
    hooks, cache = _hooked(lm, ids, press)
    assert _same_plan(hooks.plan, ref), name
    assert hooks.plan.kept_entries == ref.kept_entries
    # and the cache holds exactly the kept keys and values
    for l in (0, len(layers) - 1):  # noqa: E741
        layer = cache.layers[l]
        if isinstance(layer.keys, torch.Tensor) and layer.keys.dim() == 4:
            keys, values = layer.keys[0], layer.values[0]                    # gathered
            assert keys.shape[1] == ref.budgets[l][0]
            assert all(torch.equal(keys[h], layers[l][0][0, h, ref.keep[l][h]])
                       for h in range(keys.shape[0]))
            assert all(torch.equal(values[h], layers[l][1][0, h, ref.keep[l][h]])
                       for h in range(values.shape[0]))
        else:                                                                # ragged
            for h, e in enumerate(layer.memory.layer_entries(l)):
                assert torch.equal(e.pos, ref.keep[l][h])
                assert torch.equal(e.k, layers[l][0][0, h, ref.keep[l][h]])


def test_an_expected_attention_scorer_through_both_paths(smol):
    """score_entries sees keys, values, the window's queries and hidden states: a scorer that
    reads them plans the same through compress() and the hook."""
    lm, ids, _, layers, window = smol
    press = ExpectedAttention(compression_ratio=0.5)
    ref = compress(to_memory(lm, layers), press, None, window).plan
    hooks, _ = _hooked(lm, ids, press)
    assert _same_plan(hooks.plan, ref)
    assert ref.forced == 32 and ref.kept_fraction == pytest.approx(0.5, abs=0.01)


@pytest.mark.parametrize("name", ["snapkv", "pyramidkv", "adakv", "knorm"])
def test_decoding_after_the_hook_matches_greedy_generate(smol, name):
    """Gathered (uniform) and ragged (per-layer / per-head counts) caches decode exactly like
    greedy_generate over the memory compress() pruned."""
    lm, ids, question, layers, window = smol
    n = len(ids)
    press = make_press(name, compression_ratio=0.5)
    mem = to_memory(lm, layers)
    compress(mem, press, None, window)
    ref = greedy_generate(lm, mem, n, question, max_new_tokens=3, stop_at_eos=False)
    _, cache = _hooked(lm, ids, press)
    tokens = []
    with torch.inference_mode():
        nxt, pos = list(question), n
        for _ in range(3):
            p = torch.arange(pos, pos + len(nxt))[None]
            out = lm.model(input_ids=torch.tensor([nxt]), cache=cache, position_ids=p,
                           logits_to_keep=1)
            if not tokens:
                assert torch.allclose(out.logits[0, -1], ref.first_logits, atol=1e-4)
            pos += len(nxt)
            nxt = [int(out.logits[0, -1].argmax())]
            tokens.append(nxt[0])
    assert tokens == ref.tokens


# ---- kvpress's README example, as written (but the imports and the checkpoint) -----------------
def test_kvpress_readme_example(tiny_llama):
    model = tiny_llama.model                       # a plain LlamaForCausalLM (SDPA)
    press = KnormPress(compression_ratio=0.4)
    inputs = model.dummy_inputs["input_ids"]       # [3, 5]
    with torch.no_grad():
        full = model(inputs).cache.layers[0].keys
    with torch.no_grad(), press(model):
        pressed = model(inputs).cache.layers[0].keys
    assert full.shape[0] == 3 and full.shape[2] == 5
    assert pressed.shape == (full.shape[0], full.shape[1], 3, full.shape[3])
    # the kept ones are the lowest-norm keys, in order, per sequence and head
    keep = (-full.norm(dim=-1)).topk(3, dim=-1).indices.sort(-1).values
    assert torch.equal(pressed, full.gather(2, keep[..., None].expand(-1, -1, -1, full.shape[3])))
    # the hooks are gone after the block
    with torch.no_grad():
        assert model(inputs).cache.layers[0].keys.shape == full.shape


def test_hook_leaves_decoding_and_exit_alone(tiny_llama):
    model = tiny_llama.model
    ids = torch.arange(1, 41)[None]
    press = SnapKVPress(window=8, compression_ratio=0.5)
    cache = DynamicCache()
    # the session's model may carry other parts' hooks (the device service's density hook stays
    # installed by design): the press's own must be gone after the block, the others untouched
    before = {name: list(m._forward_hooks) for name, m in model.named_modules()}
    with torch.no_grad(), press(model) as hooks:
        model(input_ids=ids, cache=cache)
        assert cache.get_seq_length() == 20
        model(input_ids=torch.tensor([[7]]), cache=cache, position_ids=torch.tensor([[40]]))
        assert cache.get_seq_length() == 21                 # a decode step is not compressed
    assert hooks.plan.kept_entries == 20 * 3 * 2
    assert {name: list(m._forward_hooks) for name, m in model.named_modules()} == before


# ---- compression_ratio: kvpress's meaning beside our kept-fraction specs -----------------------
@pytest.mark.parametrize("spec,cr", [("adakv:0.2", 0.8), ("snapkv:20%", 0.8), ("knorm:0.5", 0.5),
                                     ("pyramidkv:1", 0.0)])
def test_compression_ratio_is_the_removed_fraction(spec, cr):
    press, budget = parse_press(spec)
    assert budget.compression_ratio == pytest.approx(cr)
    assert Budget.from_compression_ratio(cr) == budget
    own = make_press(spec.split(":")[0], compression_ratio=cr)
    assert own.budget == budget and own.compression_ratio == pytest.approx(cr)
    assert Budget(tokens=64).compression_ratio is None


def test_adakv_takes_the_wrapped_press_ratio():
    assert AdaKVPress(SnapKVPress(compression_ratio=0.75)).budget == Budget(ratio=0.25)
    assert AdaKVPress(SnapKVPress(compression_ratio=0.75), compression_ratio=0.5).budget == \
        Budget(ratio=0.5)
    assert AdaKVPress(KnormPress()).window == 0 and not AdaKVPress(KnormPress()).needs_attention


@pytest.mark.parametrize("bad", [1.0, -0.1, float("nan"), "0.5", True])
def test_bad_compression_ratios(bad):
    with pytest.raises(PressError, match="compression_ratio"):
        SnapKVPress(compression_ratio=bad)


def test_presses_carry_kvpress_names_and_no_other():
    for old in ("SnapKV", "PyramidKV", "DynamicKV", "AdaKV", "AdaPyramid", "StreamingLLM"):
        assert not hasattr(presses, old), old
    assert {type(make_press(n)).__name__ for n in PRESSES} >= {
        "SnapKVPress", "PyramidKVPress", "DynamicKVPress", "AdaKVPress", "AdaPyramidPress",
        "RandomPress", "StreamingLLMPress", "KnormPress"}
    assert PyramidKVPress.name == "pyramidkv" and KnormPress.name == "knorm"


# ---- clear errors ----------------------------------------------------------------------------
def test_hook_errors(tiny_llama):
    model = tiny_llama.model
    with pytest.raises(PressError, match="budget"):
        SnapKVPress()(model)
    with pytest.raises(PressError, match="decoder layers"):
        SnapKVPress(compression_ratio=0.5)(torch.nn.Linear(2, 2))
    with pytest.raises(PressError, match="window"):
        SnapKVPress(window=0)
    ids = torch.arange(1, 41).repeat(2, 1)
    with pytest.raises(PressError, match="batch size 1"), torch.no_grad():
        with PyramidKVPress(window=8, compression_ratio=0.5)(model):     # layers differ
            model(input_ids=ids)
    with pytest.raises(PressError, match="no budget"):
        compress(None, SnapKVPress(), None, None)  # type: ignore[arg-type]


def test_a_batch_is_planned_per_sequence(tiny_llama):
    """Each sequence of a batch gets its own plan, the one it gets alone."""
    model = tiny_llama.model
    ids = torch.stack([torch.arange(1, 41), torch.arange(41, 1, -1)])
    press = SnapKVPress(window=8, compression_ratio=0.5)
    with torch.no_grad(), press(model) as both:
        cache = model(input_ids=ids).cache
    assert tuple(cache.layers[0].keys.shape[:3]) == (2, 2, 20) and len(both.plans) == 2
    for b in range(2):
        with torch.no_grad(), press(model) as alone:
            model(input_ids=ids[b:b + 1])
        assert _same_plan(alone.plan, both.plans[b])


@pytest.mark.parametrize("name", ["snapkv", "adakv"])
def test_generate_inside_the_block(smol, name):
    """model.generate (so a transformers pipeline) under the press: the prompt is compressed at
    its prefill, the decode steps are not, and the answer is the one of a hooked prefill followed
    by greedy steps at the true positions."""
    lm, ids, _, _, _ = smol
    press = make_press(name, compression_ratio=0.5)
    with torch.no_grad(), press(lm.model) as hooks:
        out = lm.model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)
    assert hooks.plan.kept_fraction == pytest.approx(0.5, abs=0.01)
    n, cache = len(ids), DynamicCache()
    with torch.no_grad():
        with press(lm.model):
            step = lm.model(input_ids=torch.tensor([ids]), cache=cache).logits[0, -1]
        tokens = [int(step.argmax())]
        for i in range(3):
            step = lm.model(input_ids=torch.tensor([[tokens[-1]]]), cache=cache,
                            position_ids=torch.tensor([[n + i]])).logits[0, -1]
            tokens.append(int(step.argmax()))
    assert out[0, n:].tolist() == tokens


def test_a_layerwise_press_cuts_each_layer_after_its_attention(tiny_llama):
    """Uniform presses cut a layer before the next layer runs (as kvpress does); layer-adaptive
    ones after the last layer (they need every layer's scores)."""
    model = tiny_llama.model
    ids = torch.arange(1, 41)[None]
    seen = {}

    def before_layer_1(module, args, kwargs):
        seen["len"] = kwargs["cache"].layers[0].get_seq_length()

    handle = model.model.layers[1].self_attn.register_forward_pre_hook(before_layer_1,
                                                                        with_kwargs=True)
    try:
        for press, expected in [(SnapKVPress(window=8, compression_ratio=0.5), 20),
                                (PyramidKVPress(window=8, compression_ratio=0.5), 40)]:
            assert press.layerwise == (expected == 20)
            with torch.no_grad(), press(model):
                model(input_ids=ids, cache=DynamicCache())
            assert seen["len"] == expected
    finally:
        handle.remove()
