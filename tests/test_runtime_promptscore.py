"""A prompt's own log-probabilities (sparkv.runtime.promptscore): scored beside the pass that
runs the prompt over a context's KV, they equal a dense forward's over the context and the
prompt; the first token is scored only when its position before ran in the same pass; a pass
that does not run the prompt is left alone, and a thread without a scorer is untouched."""

from __future__ import annotations

import pytest
import torch

from sparkv.runtime import promptscore
from sparkv.runtime.generate import greedy_generate
from sparkv.runtime.kvcache import from_dynamic_cache
from sparkv.runtime.promptscore import PromptScorer, scoring


def _context_kv(lm, ids):
    from sparkv.runtime.hfcache import output_cache

    with torch.inference_mode():
        out = lm.model(input_ids=torch.tensor([ids]), use_cache=True)
    return from_dynamic_cache(output_cache(out))


def _dense(lm, ids):
    """log_softmax of a dense forward over ``ids``: row j scores token j + 1."""
    with torch.inference_mode():
        return torch.log_softmax(lm.model(input_ids=torch.tensor([ids])).logits[0].float(), -1)


@pytest.mark.parametrize("top", [0, 3])
def test_scores_over_a_context_kv_equal_a_dense_forward(tiny_llama, top, monkeypatch):
    monkeypatch.setattr(promptscore, "ROWS", 4)          # slices of the prompt: 3 here
    lm = tiny_llama
    promptscore.install(lm.model)
    g = torch.Generator().manual_seed(1)
    context = torch.randint(1, 128, (40,), generator=g).tolist()
    prompt = torch.randint(1, 128, (11,), generator=g).tolist()
    scorer = PromptScorer(tuple(prompt), top)
    with scoring(scorer):
        res = greedy_generate(lm, _context_kv(lm, context), len(context), prompt,
                              max_new_tokens=3)
    dense = _dense(lm, context + prompt)
    assert scorer.scores is not None and len(scorer.scores) == len(prompt)
    assert scorer.scores[0] is None          # its position (the context's last) ran before
    for k in range(1, len(prompt)):
        row = dense[len(context) + k - 1]
        got = scorer.scores[k]
        assert got.logprob == pytest.approx(float(row[prompt[k]]), abs=1e-4)
        assert len(got.top) == top
        if top:
            assert got.top[0][0] == int(row.argmax())
            assert [v for _, v in got.top] == pytest.approx(
                torch.topk(row, top).values.tolist(), abs=1e-4)
    # the answer is the one a thread without a scorer gets
    plain = greedy_generate(lm, _context_kv(lm, context), len(context), prompt, max_new_tokens=3)
    assert res.tokens == plain.tokens


def test_the_first_token_is_scored_when_the_pass_ran_a_token_before_it(tiny_llama):
    lm = tiny_llama
    promptscore.install(lm.model)
    context, pending, prompt = list(range(5, 30)), [77, 78], [9, 10, 11, 12]
    scorer = PromptScorer(tuple(prompt))
    with scoring(scorer):
        greedy_generate(lm, _context_kv(lm, context), len(context), pending + prompt,
                        max_new_tokens=1)
    dense = _dense(lm, context + pending + prompt)
    at = len(context) + len(pending)
    assert [s.logprob for s in scorer.scores] == pytest.approx(
        [float(dense[at + k - 1, prompt[k]]) for k in range(len(prompt))], abs=1e-4)


def test_a_pass_that_does_not_end_with_the_prompt_is_left_alone(tiny_llama):
    lm = tiny_llama
    promptscore.install(lm.model)
    context = list(range(3, 20))
    scorer = PromptScorer((50, 51, 52))
    with scoring(scorer):
        greedy_generate(lm, _context_kv(lm, context), len(context), [50, 51, 53],
                        max_new_tokens=2)
        assert scorer.scores is None and promptscore.active() is scorer
        greedy_generate(lm, _context_kv(lm, context), len(context), [50, 51, 52],
                        max_new_tokens=2)
        assert scorer.scores is not None and promptscore.active() is None   # filled: once
    assert promptscore.active() is None


def test_a_scorer_is_checked():
    with pytest.raises(ValueError, match="at least one token"):
        PromptScorer(())
    with pytest.raises(ValueError, match="alternatives"):
        PromptScorer((1,), top=21)


def test_smollm2_scores_a_sentence_after_its_context(smollm2):
    """The real model: a natural continuation scores higher than the same tokens shuffled."""
    lm = smollm2
    promptscore.install(lm.model)
    context = lm.encode_text("The capital of France is Paris. The capital of Italy is")
    good = lm.encode_text(" Rome, and the capital of Spain is Madrid.")
    bad = list(reversed(good))

    def total(prompt):
        scorer = PromptScorer(tuple(prompt), 1)
        with scoring(scorer):
            greedy_generate(lm, _context_kv(lm, context), len(context), prompt,
                            max_new_tokens=1)
        return sum(s.logprob for s in scorer.scores[1:])

    assert total(good) > total(bad) + 10
