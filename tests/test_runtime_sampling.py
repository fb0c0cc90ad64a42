"""How an answer's tokens are chosen (sparkv.runtime.sampling): greedy by default; sampled from
the tempered softmax, cut to the top k and the nucleus, with draws in the right proportions; a
seed repeats an answer and another seed changes it; every generation path (the edge's, a decode
policy's) takes the rule, and a thread's chosen tokens are reported whichever path chose them.

The draws are seeded, so every count below is the same on every run."""

from __future__ import annotations

import math

import pytest
import torch

from sparkv.runtime.sampling import GREEDY, Sampling, TokenChooser, reporting_to

PROBS = torch.tensor([0.5, 0.3, 0.2])
LOGITS = PROBS.log()


def _draws(sampling: Sampling, logits: torch.Tensor = LOGITS, n: int = 20000) -> torch.Tensor:
    choose = TokenChooser(sampling)
    return torch.bincount(torch.tensor([choose(logits) for _ in range(n)]),
                          minlength=logits.numel()).float() / n


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(temperature=2.5),
                                 dict(temperature=math.nan), dict(top_p=1.5), dict(top_p=-0.1),
                                 dict(top_k=-1), dict(top_k=1.5), dict(seed=1 << 64),
                                 dict(seed=True), dict(frequency_penalty=2.5),
                                 dict(presence_penalty=-3), dict(logit_bias={-1: 1.0}),
                                 dict(logit_bias={3: 101.0}), dict(logit_bias=((3, 1), (3, 2)))])
def test_a_rule_out_of_range_is_refused_with_its_name(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        Sampling(**bad)


def test_a_bias_and_penalties_adjust_the_logits_before_the_choice():
    logits = torch.tensor([1.0, 0.5, 0.0, -1.2])

    def answer(n: int = 6, **kw) -> list[int]:
        choose = TokenChooser(Sampling(**kw))
        return [choose(logits) for _ in range(n)]

    assert answer() == [0] * 6
    assert answer(logit_bias={3: 100.0}) == [3] * 6 and answer(logit_bias=((0, -100),)) == [1] * 6
    assert answer(presence_penalty=2.0) == [0, 1, 2, 0, 0, 0]     # once each: then as before
    assert answer(frequency_penalty=2.0) == [0, 1, 2, 0, 3, 1]    # per time held
    drawn = answer(200, temperature=1.0, seed=3, logit_bias={0: -100})
    assert 0 not in drawn and set(drawn) == {1, 2, 3}
    with pytest.raises(ValueError, match="logit_bias names token 9"):
        answer(logit_bias={9: 1.0})
    assert Sampling(logit_bias={2: 1.0}).logit_bias == ((2, 1.0),)


def test_the_default_is_greedy_and_draws_no_seed():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    choose = TokenChooser()
    assert choose.seed is None and GREEDY.greedy
    assert choose(logits) == int(logits.argmax())
    assert TokenChooser(Sampling(temperature=0, seed=5)).seed == 5      # kept, unused


def test_sampling_draws_in_the_softmax_proportions_of_the_tempered_logits():
    got = _draws(Sampling(temperature=1.0, seed=1))
    assert torch.allclose(got, PROBS, atol=0.02)          # ~6 standard deviations
    hot = _draws(Sampling(temperature=2.0, seed=2))
    assert torch.allclose(hot, torch.softmax(LOGITS / 2, 0), atol=0.02)
    assert hot[0] < got[0] - 0.05                          # flatter


def test_top_k_and_top_p_keep_only_the_most_likely_tokens():
    k2 = _draws(Sampling(temperature=1.0, top_k=2, seed=3))
    assert k2[2] == 0 and torch.allclose(k2[:2], torch.tensor([0.625, 0.375]), atol=0.02)
    # nucleus 0.6: token 0 (0.5) does not reach it, tokens 0 and 1 (0.8) do
    p6 = _draws(Sampling(temperature=1.0, top_p=0.6, seed=4))
    assert p6[2] == 0 and torch.allclose(p6[:2], torch.tensor([0.625, 0.375]), atol=0.02)
    p5 = _draws(Sampling(temperature=1.0, top_p=0.45, seed=4), n=2000)   # reached by one
    assert p5[0] == 1
    for one in (Sampling(temperature=1.5, top_k=1, seed=5), Sampling(temperature=1.5, top_p=0,
                                                                     seed=5)):
        assert _draws(one, n=500)[0] == 1                  # the argmax only


def test_a_nucleus_beyond_the_first_candidates_is_found_in_a_larger_set():
    """A flat tail: the nucleus of 0.9 holds ~900 of 1,000 tokens, past the first 64 looked
    at; the draws spread over it and never reach the least likely tenth."""
    x = -torch.arange(1000, dtype=torch.float32) * 1e-4           # nearly flat, ordered
    got = _draws(Sampling(temperature=1.0, top_p=0.9, seed=9), x, n=20000)
    kept = int((got > 0).sum())
    assert 850 <= kept <= 905 and got[905:].sum() == 0
    k = _draws(Sampling(temperature=1.0, top_k=100, top_p=0.5, seed=9), x, n=5000)
    assert int((k > 0).sum()) <= 51 and k[51:].sum() == 0         # top_k first, then top_p


def test_a_seed_repeats_the_draws_and_none_draws_one_that_does():
    flat = torch.zeros(1000)

    def draws(choose: TokenChooser) -> list[int]:
        return [choose(flat) for _ in range(50)]

    first = draws(TokenChooser(Sampling(temperature=1.0, seed=7)))
    assert draws(TokenChooser(Sampling(temperature=1.0, seed=7))) == first
    assert draws(TokenChooser(Sampling(temperature=1.0, seed=8))) != first
    drawn = TokenChooser(Sampling(temperature=1.0))
    assert drawn.seed is not None and drawn.seed != TokenChooser(Sampling(temperature=1.0)).seed
    assert draws(TokenChooser(Sampling(temperature=1.0, seed=drawn.seed))) == draws(drawn)


def test_a_threads_chosen_tokens_are_reported_for_the_block_only():
    seen: list[int] = []
    outer: list[int] = []
    choose = TokenChooser()
    with reporting_to(lambda t, lp: outer.append(t)):
        with reporting_to(lambda t, lp: seen.append(t)):
            choose(torch.tensor([0.0, 2.0, 1.0]))
        choose(torch.tensor([3.0, 2.0, 1.0]))
    choose(torch.tensor([0.0, 0.0, 1.0]))
    assert seen == [1] and outer == [0]


def test_asked_for_each_token_is_reported_with_its_log_probability_and_the_likeliest():
    logits = torch.tensor([2.0, 0.5, 1.0, -1.0])
    got: list = []
    with reporting_to(lambda t, lp: got.append((t, lp)), logprobs=2):
        TokenChooser()(logits)
        TokenChooser(Sampling(temperature=2.0, seed=1))(logits)
    with reporting_to(lambda t, lp: got.append((t, lp))):
        TokenChooser()(logits)
    want = torch.log_softmax(logits, 0)
    (t0, lp0), (t1, lp1), (t2, lp2) = got
    assert t0 == 0 and lp0.logprob == pytest.approx(float(want[0]))
    assert [i for i, _ in lp0.top] == [0, 2]
    assert [v for _, v in lp0.top] == pytest.approx([float(want[0]), float(want[2])])
    assert lp1.logprob == pytest.approx(float(want[t1]))      # the model's, not the tempered
    assert lp2 is None
    with pytest.raises(ValueError, match="logprobs"):
        with reporting_to(lambda t, lp: None, logprobs=21):
            pass


# ---- through the generation paths ----------------------------------------------------------------
@pytest.fixture(scope="module")
def context(tiny_llama):
    from sparkv.runtime import reference_prefill

    torch.manual_seed(1)
    ids = torch.randint(0, 128, (80,)).tolist()
    with torch.inference_mode():
        return reference_prefill(tiny_llama, ids)


def test_greedy_generate_samples_as_told_and_repeats_with_its_seed(tiny_llama, context):
    from sparkv.runtime import greedy_generate

    def run(**kw):
        seen: list[int] = []
        with reporting_to(lambda t, lp: seen.append(t)):
            res = greedy_generate(tiny_llama, context, 80, [3, 9, 27], max_new_tokens=24,
                                  stop_at_eos=False, sampling=Sampling(**kw) if kw else None)
        assert seen == res.tokens                  # every token reported as it was chosen
        return res

    greedy = run()
    assert greedy.seed is None and "seed" not in greedy.stats
    assert run(temperature=1.5, top_k=1, seed=3).tokens == greedy.tokens
    a, b, c = (run(temperature=1.5, seed=s) for s in (3, 3, 4))
    assert a.tokens == b.tokens and a.seed == 3 and a.stats["seed"] == 3
    assert c.tokens != a.tokens and a.tokens != greedy.tokens
    d = run(temperature=1.5)
    assert d.seed is not None and run(temperature=1.5, seed=d.seed).tokens == d.tokens


def test_a_decode_policy_samples_as_full_kv_does_with_the_same_seed(tiny_llama, context,
                                                                      tmp_path):
    """DynaKV with a budget holding everything attends exactly as full KV, so with the same
    seed it draws the same tokens."""
    from sparkv.decode import generate
    from sparkv.runtime import greedy_generate

    rule = Sampling(temperature=1.2, top_p=0.95, seed=11)
    want = greedy_generate(tiny_llama, context, 80, [3, 9, 27], max_new_tokens=20,
                           stop_at_eos=False, sampling=rule)
    seen: list[int] = []
    with reporting_to(lambda t, lp: seen.append(t)):
        got, _ = generate(tiny_llama, context, 80, [3, 9, 27], 20, kv_policy="dynakv",
                          budget=1.0, ram_budget=None, stop_at_eos=False, flash_dir=tmp_path,
                          avg_cluster=8, max_cluster=16, recent=8, sampling=rule)
    assert got.tokens == want.tokens and seen == got.tokens and got.seed == 11
