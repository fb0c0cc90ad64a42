"""Presses (sparkv/presses/, docs/presses.md): budgets, Ada-KV's guarantees, real savings in the
KV memory, and attention over what is kept."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sparkv.cache import ragged_attention, to_bytes
from sparkv.presses import (PRESSES, AdaKVPress, Budget, DynamicKVPress, PressError,
                            PyramidKVPress, SnapKVPress, adaptive_head_budgets, compress,
                            make_press, parse_press, prefill, question_window, round_to_total,
                            score_layers, split_spec, to_memory)
from sparkv.runtime.generate import greedy_generate, sample_context_ids


def _attention(layers: int, heads: int, n: int, seed: int) -> list[torch.Tensor]:
    """Random attention rows: each head its own concentration (temperature)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        temp = torch.rand(heads, 1, generator=g) * 4 + 0.2
        out.append(torch.softmax(torch.randn(heads, n, generator=g) * temp, -1))
    return out


# ---- budgets ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PRESSES))
@pytest.mark.parametrize("budget", [Budget(ratio=0.1), Budget(ratio=0.2), Budget(ratio=0.4),
                                    Budget(tokens=37), Budget(ratio=1.0)])
@pytest.mark.parametrize("forced", [0, 16])
def test_budgets_sum_to_the_budget(name, budget, forced):
    n, L, H = 300, 8, 3
    press = make_press(name)
    scores = [press.score(l, a[:, :n - forced])
              for l, a in enumerate(_attention(L, H, n, seed=L + forced))]
    plan = press.plan(scores, n, budget, forced)
    per_head = budget.per_head(n)
    assert plan.kept_entries == per_head * L * H
    for l in range(L):
        if name in ("snapkv", "adakv", "random", "streamingllm"):   # uniform layer budgets
            assert sum(plan.budgets[l]) == per_head * H
        if name in ("snapkv", "pyramidkv", "dynamickv", "random", "streamingllm"):
            assert len(set(plan.budgets[l])) == 1                   # same count for every head
        for h in range(H):
            keep = plan.keep[l][h]
            assert keep.numel() == plan.budgets[l][h]
            assert bool((keep[1:] > keep[:-1]).all()), "ascending, unique"
            assert keep.numel() == 0 or (int(keep.min()) >= 0 and int(keep.max()) < n)
            if forced:  # the window is kept by every head
                assert set(range(n - forced, n)) <= set(keep.tolist())


def test_uniform_pyramid_and_dynamic_shapes():
    n, L, H = 400, 12, 3
    att = _attention(L, H, n, seed=1)
    b = 40
    assert SnapKVPress().layer_budgets(att, b, n) == [b] * L
    pyr = PyramidKVPress().layer_budgets(att, b, n)
    assert sum(pyr) == b * L and pyr[0] > pyr[-1] and pyr == sorted(pyr, reverse=True)
    # DynamicKV: layers whose attention holds more of the global top-k get more, within the
    # r_max buffer; concentrate the signal in layers 3 and 7
    att = [a.clone() for a in att]
    for l in (3, 7):
        att[l] = torch.full((H, n), 0.25)      # flat and high: every entry is a top score
    dyn = DynamicKVPress(r_max=3).layer_budgets(att, b, n)
    assert sum(dyn) == b * L
    assert max(dyn) <= 3 * b
    assert dyn[3] == max(dyn) or dyn[7] == max(dyn)
    assert dyn != [b] * L


def test_round_to_total():
    assert round_to_total([1, 1, 1], 10, 100) == [4, 3, 3] or sum(
        round_to_total([1, 1, 1], 10, 100)) == 10
    assert round_to_total([10, 1, 1], 12, [5, 10, 10]) == [5, 4, 3] or \
        sum(round_to_total([10, 1, 1], 12, [5, 10, 10])) == 12
    assert round_to_total([10, 1, 1], 12, [5, 10, 10])[0] == 5
    with pytest.raises(PressError):
        round_to_total([1, 1], 30, 10)


def test_adakv_alpha_one_equals_uniform_snapkv():
    n, L, H = 256, 6, 3
    att = _attention(L, H, n, seed=3)
    for budget in (Budget(ratio=0.1), Budget(ratio=0.25), Budget(tokens=50)):
        for forced in (0, 32):
            s = [a[:, :n - forced] for a in att]
            snap = SnapKVPress().plan([SnapKVPress().score(l, x) for l, x in enumerate(s)], n,
                                      budget, forced)
            ada = AdaKVPress(SnapKVPress(), alpha=1.0)
            plan = ada.plan([ada.score(l, x) for l, x in enumerate(s)], n, budget, forced)
            assert plan.budgets == snap.budgets
            for l in range(L):
                for h in range(H):
                    assert torch.equal(plan.keep[l][h], snap.keep[l][h])
            # and alpha = 0.2 does move budgets between heads
            ada2 = AdaKVPress(SnapKVPress(), alpha=0.2)
            p2 = ada2.plan([ada2.score(l, x) for l, x in enumerate(s)], n, budget, forced)
            assert p2.kept_entries == snap.kept_entries
            if snap.info["layer_budgets"][0] > 4:   # room beyond the window
                assert p2.budgets != snap.budgets


# ---- Ada-KV's guarantees -----------------------------------------------------------------------
def _mass(att: torch.Tensor, budgets: list[int]) -> float:
    return sum(float(torch.topk(att[h], b).values.sum()) for h, b in enumerate(budgets))


@pytest.mark.parametrize("seed", range(40))
def test_adaptive_retains_at_least_uniform_mass(seed):
    g = torch.Generator().manual_seed(seed)
    heads = int(torch.randint(2, 9, (1,), generator=g))
    n = int(torch.randint(16, 400, (1,), generator=g))
    att = _attention(1, heads, n, seed)[0]
    b = int(torch.randint(1, n + 1, (1,), generator=g))
    uniform = _mass(att, [b] * heads)
    for alpha in (0.0, 0.2, 0.5, 1.0):
        budgets = adaptive_head_budgets(att, b, alpha)
        assert sum(budgets) == heads * b
        assert min(budgets) >= int(alpha * b)
        assert _mass(att, budgets) >= uniform - 1e-5
    # alpha = 0 is the global optimum: the top heads*b weights of the whole layer
    best = float(torch.topk(att.flatten(), heads * b).values.sum())
    assert _mass(att, adaptive_head_budgets(att, b, 0.0)) == pytest.approx(best, rel=1e-5)


@pytest.mark.parametrize("seed", range(25))
def test_l1_eviction_loss_within_the_bound(seed):
    """Single query, h heads: ||y - y^||_1 <= 2C sum_i (1 - F_i) (Ada-KV, Theorem 3.1), with the
    evicted attention computed by sparkv's ragged attention over the entries kept."""
    g = torch.Generator().manual_seed(100 + seed)
    h, n, d, dm = 4, 96, 16, 32
    q = torch.randn(1, h, 1, d, generator=g) * (1 + 2 * torch.rand(1, h, 1, 1, generator=g))
    k = torch.randn(h, n, d, generator=g)
    v = torch.randn(h, n, d, generator=g)
    wo = torch.randn(h, d, dm, generator=g) / d ** 0.5
    pos = torch.arange(n)
    qpos = torch.tensor([n])
    att = torch.softmax((q[0, :, 0, None, :] * k).sum(-1) * d ** -0.5, -1)   # [h, n]
    full = ragged_attention(q, [(k[i], v[i], pos) for i in range(h)], qpos, None)

    def out(o: torch.Tensor) -> torch.Tensor:               # sum_i o_i W_i^O -> [dm]
        return torch.einsum("hd,hdm->m", o[0, :, 0], wo)

    y = out(full)
    c = max(float((v[i] @ wo[i]).abs().sum(-1).max()) for i in range(h))
    b = int(torch.randint(1, n // 2, (1,), generator=g))
    bounds = {}
    for label, budgets in (("uniform", [b] * h), ("ada", adaptive_head_budgets(att, b, 0.0)),
                           ("ada0.2", adaptive_head_budgets(att, b, 0.2))):
        heads, kept_mass = [], []
        for i, bi in enumerate(budgets):
            keep = torch.topk(att[i], bi).indices.sort().values
            heads.append((k[i, keep], v[i, keep], keep))
            kept_mass.append(float(att[i, keep].sum()))
        y_hat = out(ragged_attention(q, heads, qpos, None))
        loss = float((y - y_hat).abs().sum())
        bound = 2 * c * sum(1 - f for f in kept_mass)
        assert loss <= bound + 1e-4, (label, loss, bound)
        bounds[label] = bound
    assert bounds["ada"] <= bounds["uniform"] + 1e-6       # Theorem 3.3
    assert bounds["ada0.2"] <= bounds["uniform"] + 1e-6


# ---- ragged attention == gathered attention ------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_ragged_attention_equals_padded_masked_attention(seed):
    g = torch.Generator().manual_seed(seed)
    hkv, group, n, d, nq = 3, 3, 120, 16, 5
    q = torch.randn(1, hkv * group, nq, d, generator=g)
    k = torch.randn(hkv, n, d, generator=g)
    v = torch.randn(hkv, n, d, generator=g)
    qpos = torch.arange(n - 3, n - 3 + nq)        # the last queries see a few new keys causally
    heads, mask = [], torch.zeros(hkv, n, dtype=torch.bool)
    for h in range(hkv):
        m = int(torch.randint(1, n, (1,), generator=g))
        keep = torch.randperm(n, generator=g)[:m].sort().values
        keep = torch.unique(torch.cat([keep, torch.tensor([0])]))
        heads.append((k[h, keep], v[h, keep], keep))
        mask[h, keep] = True
    ragged = ragged_attention(q, heads, qpos, None)
    # padded-masked: every head over all n slots, evicted and future ones masked out
    causal = torch.arange(n).view(1, n) <= qpos.view(nq, 1)                 # [nq, n]
    full_mask = (mask.view(hkv, 1, n) & causal.view(1, nq, n)).repeat_interleave(group, 0)
    kk = k.repeat_interleave(group, 0).unsqueeze(0)
    vv = v.repeat_interleave(group, 0).unsqueeze(0)
    dense = F.scaled_dot_product_attention(q, kk, vv, attn_mask=full_mask.unsqueeze(0))
    assert torch.allclose(ragged, dense, atol=1e-5)


# ---- on a real model ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol_context(smollm2):
    ids = sample_context_ids(smollm2, 192)
    question = smollm2.encode_text("\n\nWhat is it about?")
    layers, window, _ = prefill(smollm2, ids, window=32)
    return smollm2, ids, question, layers, window


def test_window_capture_matches_the_cache(smol_context):
    """The hooked window keys are the model's own cached keys (after RoPE), and its
    question-aware window sits after the context."""
    lm, ids, question, layers, window = smol_context
    n = len(ids)
    assert window.inside and window.size == 32 and int(window.pos[-1]) == n - 1
    for l in (0, len(layers) // 2, len(layers) - 1):
        assert torch.allclose(window.k[l], layers[l][0][0, :, -32:].float(), atol=1e-4)
    mem = to_memory(lm, layers)
    qwin = question_window(lm, mem, question)
    assert not qwin.inside and int(qwin.pos[0]) == n and qwin.size == len(question)
    assert mem.positions == [n] * len(layers)                  # the question was not kept


@pytest.mark.parametrize("mode", ["agnostic", "aware"])
def test_real_savings_and_attention_over_pruned_memory(smol_context, mode):
    lm, ids, question, layers, window = smol_context
    n = len(ids)
    full = to_memory(lm, layers)
    win = window if mode == "agnostic" else question_window(lm, full, question)
    full_payload = sum(len(to_bytes(full.read(c))) for c in full.chunk_ids())
    for name, ratio in (("adakv", 0.4), ("dynamickv", 0.5)):
        press, budget = parse_press(f"{name}:{ratio}")
        mem = to_memory(lm, layers)
        res = compress(mem, press, budget, win)
        kept = res.plan.kept_fraction
        assert kept == pytest.approx(ratio, abs=1 / n)
        # the memory's own account, and the tensors it lists, shrink by the kept fraction
        assert mem.nbytes == mem.recount() == res.bytes_after
        assert res.bytes_after / res.bytes_before == pytest.approx(kept, rel=0.05)
        # so do the chunks' serialised payloads (the position lists included)
        payload = sum(len(to_bytes(mem.read(c))) for c in mem.chunk_ids())
        assert payload / full_payload == pytest.approx(kept, rel=0.05)
        for l in range(len(layers)):
            store = mem.layers[l]
            assert store.ragged
            assert [store.length[h] for h in range(store.num_heads)] == res.plan.budgets[l]
        out = greedy_generate(lm, mem, n, question, max_new_tokens=2)
        assert len(out.tokens) >= 1 and torch.isfinite(out.first_logits).all()


def test_keeping_everything_is_exact(smol_context):
    """A press that keeps every entry leaves ragged layers that attend exactly like the dense
    memory (ragged attention == dense attention through the whole model)."""
    lm, ids, question, layers, window = smol_context
    n = len(ids)
    ref = greedy_generate(lm, to_memory(lm, layers), n, question, max_new_tokens=2)
    mem = to_memory(lm, layers)
    compress(mem, AdaKVPress(), Budget(ratio=1.0), window)
    assert all(mem.layers[l].ragged for l in range(len(layers)))
    out = greedy_generate(lm, mem, n, question, max_new_tokens=2)
    assert torch.allclose(out.first_logits, ref.first_logits, atol=1e-3)
    assert out.tokens == ref.tokens


def test_adakv_alpha_one_equals_snapkv_on_the_model(smol_context):
    lm, ids, question, layers, window = smol_context
    a, b = to_memory(lm, layers), to_memory(lm, layers)
    pa = compress(a, AdaKVPress(SnapKVPress(), alpha=1.0), Budget(ratio=0.2), window).plan
    pb = compress(b, SnapKVPress(), Budget(ratio=0.2), window).plan
    assert pa.budgets == pb.budgets
    assert all(torch.equal(x, y) for ra, rb in zip(pa.keep, pb.keep) for x, y in zip(ra, rb))
    # and the scores are GQA group means: one row per KV head
    scores, forced = score_layers(to_memory(lm, layers), SnapKVPress(), window)
    assert forced == 32 and scores[0].shape == (lm.config.num_key_value_heads, len(ids) - 32)


def test_tiny_gqa_model(tiny_llama):
    ids = list(range(1, 100))
    layers, window, _ = prefill(tiny_llama, ids, window=8)
    mem = to_memory(tiny_llama, layers, chunk_tokens=32)
    res = compress(mem, make_press("adapyramid", ), Budget(tokens=30), window)
    assert res.plan.kept_entries == 30 * 3 * 2
    out = greedy_generate(tiny_llama, mem, len(ids), [5, 6, 7], max_new_tokens=3,
                          stop_at_eos=False)
    assert len(out.tokens) == 3


# ---- bad input ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [dict(ratio=0), dict(ratio=1.5), dict(ratio=float("nan")),
                                 dict(tokens=0), dict(tokens=2.5), dict(), dict(ratio=0.1,
                                                                               tokens=3)])
def test_bad_budgets(bad):
    with pytest.raises(PressError):
        Budget(**bad)


@pytest.mark.parametrize("spec", ["adakv", "nope:0.2", "adakv:abc", "adakv:0", "snapkv:-3t",
                                  "snapkv:120%"])
def test_bad_press_specs(spec):
    with pytest.raises(PressError):
        parse_press(spec)


def test_parse_press_specs():
    p, b = parse_press("AdaKV:20%")
    assert isinstance(p, AdaKVPress) and b.ratio == pytest.approx(0.2)
    p, b = parse_press("dynamickv:256t")
    assert isinstance(p, DynamicKVPress) and b.tokens == 256
    # every spec the server and `sparkv ask --press` take, the window included (and checked)
    p, b = parse_press("adakv:0.5@repeat")
    assert isinstance(p, AdaKVPress) and b.ratio == pytest.approx(0.5)
    assert split_spec("adakv:0.5@Repeat")[2] == "repeat"
    with pytest.raises(PressError, match="window"):
        parse_press("adakv:0.5@nope")
    with pytest.raises(PressError):
        make_press("snapkv", bogus=1)
    with pytest.raises(PressError):
        SnapKVPress(kernel=4)
    with pytest.raises(PressError):
        adaptive_head_budgets(torch.rand(2, 10), 5, alpha=2.0)
    with pytest.raises(PressError):
        SnapKVPress().plan([torch.rand(2, 10)], 12, Budget(ratio=0.5), forced=0)   # wrong shape
