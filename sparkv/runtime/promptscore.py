"""A prompt's own log-probabilities, scored in the forward pass that runs it (OpenAI's legacy
``echo`` with ``logprobs``: what lm-evaluation-harness's loglikelihood tasks read).

An answer's question pass keeps only its last position's logits (``logits_to_keep=1``), and the
pass runs on whichever path answers (the edge's generation, the context service's turn, a decode
policy's prefill). So the score is taken beside the pass, not through it: :func:`install` puts
hooks on the model, and a thread that is :func:`scoring` a :class:`PromptScorer` has the first
whole-model pass whose input ends with the prompt's ids scored: the final norm's hidden states
of those positions go through the output head in slices of :data:`ROWS` positions (a slice's
logits, not the prompt's, are held at once), each position giving the next token's
:class:`~sparkv.runtime.sampling.TokenLogprobs`.

The prompt's first token is scored only when the same pass ran a token before it (a context's
pending tokens); after a context whose last position did not run here, it has none (``None``,
as OpenAI gives the first token of a prompt). A pass whose input does not end with the prompt
(another ask's decode step, a pass that reused some of the prompt's KV) is left alone: callers
that may reuse a prompt's KV look at :func:`active` and run the whole prompt instead.

State: the scorer, per thread (``threading.local``); the hooks are installed once per model.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from sparkv.runtime.sampling import MAX_TOP_LOGPROBS, TokenLogprobs

__all__ = ["PromptScorer", "scoring", "active", "install", "score_rows", "ROWS"]

#: positions scored at once (their logits: ROWS x vocab floats)
ROWS = 256
_MARK = "_sparkv_prompt_score_hooks"
_local = threading.local()


@dataclass
class PromptScorer:
    """One prompt to score: its token ids (the last tokens of the pass that runs it) and how
    many most likely alternatives each token lists; :attr:`scores` once scored, one per
    prompt token (``None``: the first, without a position before it in the pass)."""

    prompt: tuple[int, ...]
    top: int = 0
    scores: list[TokenLogprobs | None] | None = field(default=None)

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("a prompt to score needs at least one token")
        if not 0 <= self.top <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top lists 0..{MAX_TOP_LOGPROBS} alternatives, not {self.top}")

    def matches(self, ids: Sequence[int]) -> bool:
        """Whether a pass over ``ids`` runs this prompt (its ids end with the prompt's)."""
        p = len(self.prompt)
        return len(ids) >= p and tuple(ids[-p:]) == self.prompt


@contextlib.contextmanager
def scoring(scorer: PromptScorer | None) -> Iterator[None]:
    """This thread's first model pass that runs ``scorer``'s prompt scores it, for the block
    (``None``: nothing is scored)."""
    before = getattr(_local, "scorer", None)
    _local.scorer = scorer
    try:
        yield
    finally:
        _local.scorer, _local.ids = before, None


def active() -> PromptScorer | None:
    """The scorer this thread's next pass over its prompt fills (``None``: none, or filled)."""
    scorer: PromptScorer | None = getattr(_local, "scorer", None)
    return scorer if scorer is not None and scorer.scores is None else None


def install(model: Any) -> None:
    """Puts the scoring hooks on ``model`` (a transformers causal LM with a final ``norm``;
    once). Without a scorer on the thread a pass pays one attribute look-up."""
    if getattr(model, _MARK, False):
        return
    norm = getattr(model.get_decoder(), "norm", None)
    if norm is None:
        raise TypeError(f"{type(model).__name__} has no final norm to score prompts at")
    model.register_forward_pre_hook(_before, with_kwargs=True)
    model.register_forward_hook(_after, with_kwargs=True, always_call=True)
    norm.register_forward_hook(_normed)
    setattr(model, _MARK, True)


def _before(module: Any, args: Any, kwargs: Any) -> None:
    scorer = active()
    ids = kwargs.get("input_ids", args[0] if args else None)
    if scorer is None or ids is None or ids.dim() != 2 or ids.shape[0] != 1:
        return
    row = ids[0].tolist()
    if scorer.matches(row):
        _local.ids, _local.head = row, module.get_output_embeddings()


def _after(module: Any, args: Any, kwargs: Any, output: Any) -> None:
    _local.ids = None


def _normed(module: Any, args: Any, output: torch.Tensor) -> None:
    ids = getattr(_local, "ids", None)
    scorer = active()
    if ids is None or scorer is None:
        return
    _local.ids = None
    p = len(scorer.prompt)
    first = len(ids) - p                      # the prompt's first position in the pass
    start = max(first - 1, 0)                 # the position before it predicts it, if it ran
    scored = score_rows(_local.head, output[0, start:len(ids) - 1], ids[start + 1:], scorer.top)
    scorer.scores = [None] * (p - len(scored)) + list(scored)


def score_rows(head: Any, hidden: torch.Tensor, nexts: Sequence[int], top: int
               ) -> list[TokenLogprobs]:
    """Each position's next token's :class:`TokenLogprobs` (and ``top`` alternatives):
    ``hidden`` ``[positions, d]`` (after the final norm) through the output ``head``,
    :data:`ROWS` positions at a time."""
    out: list[TokenLogprobs] = []
    with torch.inference_mode():
        for lo in range(0, hidden.shape[0], ROWS):
            lp = torch.log_softmax(head(hidden[lo:lo + ROWS]).float(), -1)
            chosen = torch.tensor(nexts[lo:lo + ROWS], dtype=torch.long, device=lp.device)
            mine = lp.gather(1, chosen[:, None])[:, 0].tolist()
            vals, alts = torch.topk(lp, min(top, lp.shape[1]), dim=1)
            for j, v in enumerate(mine):
                out.append(TokenLogprobs(v, tuple(zip(alts[j].tolist(), vals[j].tolist()))))
    return out
