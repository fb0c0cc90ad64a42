"""How an answer's next token is chosen from the model's logits: greedily, or sampled.

* :class:`Sampling`: the rule (OpenAI's ``temperature`` and ``top_p``, vLLM's ``top_k``, a
  ``seed``); ``temperature`` 0, the default, is greedy (the argmax), what the quality tables
  measure;
* :class:`TokenChooser`: one answer's chooser (its random generator, seeded once), called with
  each position's logits;
* :func:`reporting_to`: a thread's chosen tokens also go to a callback for a block (an ask's
  token events, :mod:`sparkv.asks.forward`), whichever generation path chose them, each with
  its :class:`TokenLogprobs` when asked for (OpenAI's ``logprobs``).

The logits are adjusted first when the rule says so (OpenAI's ``logit_bias`` added, its
``frequency_penalty`` taken off once per time the answer so far holds a token and its
``presence_penalty`` once it holds it), greedy or not. Sampling draws from
``softmax(logits / temperature)`` restricted to the ``top_k`` most likely
tokens (0: all) and then to the smallest set of most likely tokens whose probability reaches
``top_p`` (the most likely token always stays). A seed makes an answer repeatable: the same
seed over the same logits draws the same tokens. Without one, a chooser draws its seed from the
OS (:attr:`TokenChooser.seed` tells which).

The rule imports nothing heavy (request schemas hold one); torch loads with the first token
chosen.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import secrets
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

from sparkv.runtime.jsonform import JsonForm

if TYPE_CHECKING:
    import torch

    from sparkv.runtime.guided import FormGuide, TokenBytes
    from sparkv.runtime.model import LoadedModel

__all__ = ["Sampling", "TokenChooser", "TokenLogprobs", "Reporter", "reporting_to", "GREEDY",
           "MAX_TEMPERATURE", "SEED_RANGE", "MAX_TOP_LOGPROBS", "MAX_PENALTY", "MAX_BIAS"]

#: the highest temperature taken (OpenAI's)
MAX_TEMPERATURE = 2.0
#: the seeds taken (torch's generator's range; a negative one wraps to 2^64 + seed)
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)
#: the most alternatives a token's log-probabilities list (OpenAI's ``top_logprobs``)
MAX_TOP_LOGPROBS = 20
#: the largest frequency or presence penalty (OpenAI's), and logit bias
MAX_PENALTY = 2.0
MAX_BIAS = 100.0

_observer = threading.local()


@dataclass(frozen=True)
class Sampling:
    """How each next token is chosen (checked when made: ``ValueError``)."""

    temperature: float = 0.0
    """0: greedy (the argmax); else the logits are divided by it, at most
    :data:`MAX_TEMPERATURE`."""
    top_p: float = 1.0
    """Nucleus sampling: draw from the most likely tokens whose probability reaches it
    (0..1; 1: all)."""
    top_k: int = 0
    """Draw from the ``top_k`` most likely tokens (0: all)."""
    seed: int | None = None
    """The random generator's seed (:data:`SEED_RANGE`); ``None``: one from the OS per answer."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once for every time the answer holds it (-2..2)."""
    presence_penalty: float = 0.0
    """Subtracted from a token's logit once the answer holds it (-2..2)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """``(token id, bias)``: added to those tokens' logits (-100..100; -100 bans one)."""
    form: JsonForm | None = None
    """The JSON the answer must be (OpenAI's ``response_format``: :mod:`sparkv.runtime.jsonform`);
    ``None``: any text."""

    def __post_init__(self) -> None:
        _number("temperature", self.temperature, 0, MAX_TEMPERATURE)
        _number("top_p", self.top_p, 0, 1)
        _number("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        _number("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        if not (_whole(self.top_k) and self.top_k >= 0):
            raise ValueError(f"top_k must be a whole number >= 0, not {self.top_k!r}")
        s = self.seed
        if s is not None and not (_whole(s) and SEED_RANGE[0] <= s <= SEED_RANGE[1]):
            raise ValueError(f"seed must be a whole number in [-2^63, 2^64 - 1], not {s!r}")
        bias = tuple(self.logit_bias.items() if isinstance(self.logit_bias, dict)
                     else self.logit_bias)
        for pair in bias:
            if not (len(pair) == 2 and _whole(pair[0]) and pair[0] >= 0):
                raise ValueError(f"logit_bias maps token ids >= 0 to numbers, not {pair!r}")
            _number("a logit_bias", pair[1], -MAX_BIAS, MAX_BIAS)
        if len({t for t, _ in bias}) != len(bias):
            raise ValueError("logit_bias names a token twice")
        object.__setattr__(self, "logit_bias", bias)

    @property
    def greedy(self) -> bool:
        """Whether every token is the argmax (temperature 0) of the adjusted logits."""
        return self.temperature == 0

    @property
    def adjusts(self) -> bool:
        """Whether the logits are adjusted first (a penalty or a bias)."""
        return bool(self.frequency_penalty or self.presence_penalty or self.logit_bias)

    def with_seed(self) -> "Sampling":
        """This rule with a seed: its own, else one drawn from the OS (greedy: unchanged)."""
        if self.greedy or self.seed is not None:
            return self
        return dataclasses.replace(self, seed=secrets.randbits(63))


def _whole(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(name: str, v: object, lo: float, hi: float) -> None:
    if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            and lo <= v <= hi):
        raise ValueError(f"{name} must be a number in [{lo:g}, {hi:g}], not {v!r}")


#: the default rule: every token the argmax
GREEDY = Sampling()


class TokenChooser:
    """Chooses one answer's tokens, each from its position's logits ``[vocab]``, and reports
    each to the thread's callback (:func:`reporting_to`)."""

    def __init__(self, sampling: Sampling | None = None, vocab: TokenBytes | None = None
                 ) -> None:
        self.sampling = (sampling or GREEDY).with_seed()
        self._gen: torch.Generator | None = None
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None
        self._counts: torch.Tensor | None = None    # how often each token was chosen
        self._guide: FormGuide | None = None
        #: whether the answer's form ended it (its value whole, or no token could go on): the
        #: generation stops, whatever the model's end-of-sequence ids
        self.finished = False
        if self.sampling.form is not None:
            from sparkv.runtime.guided import FormGuide

            if vocab is None:
                raise ValueError("an answer's JSON form needs the vocabulary's token texts")
            self._guide = FormGuide(self.sampling.form, vocab)

    @classmethod
    def of_model(cls, lm: LoadedModel, sampling: Sampling | None = None) -> "TokenChooser":
        """A chooser for ``lm``'s answers (with its vocabulary when the rule has a form)."""
        if sampling is not None and sampling.form is not None:
            from sparkv.runtime.guided import vocabulary

            return cls(sampling, vocabulary(lm))
        return cls(sampling)

    @property
    def seed(self) -> int | None:
        """The seed of the draws (``None``: greedy)."""
        return self.sampling.seed

    def __call__(self, logits: torch.Tensor) -> int:
        flat = logits.reshape(-1)
        token = self._choose(flat)
        watch: tuple[Reporter, int | None] | None = getattr(_observer, "now", None)
        if watch is not None:
            report, top = watch
            report(token, None if top is None else TokenLogprobs.of(flat, token, top))
        return token

    def _choose(self, logits: torch.Tensor) -> int:
        if self.sampling.adjusts:
            logits = self._adjusted(logits.float())
        guide = self._guide
        if guide is None:
            token = self._pick(logits)
        else:
            token = guide.vocab.eos[0] if guide.whole else self._fitting(guide, logits)
            guide.advance(token)
            self.finished = token in guide.vocab.eos
        if self._counts is not None:
            self._counts[token] += 1
        return token

    def _pick(self, logits: torch.Tensor) -> int:
        """The argmax (greedy), else a draw by the rule."""
        import torch

        s = self.sampling
        if s.greedy:
            return int(torch.argmax(logits))
        probs, ids = _candidates(logits.float() / s.temperature, s.top_k, s.top_p)
        cum = torch.cumsum(probs, 0)
        u = torch.rand(1, generator=self._generator(cum.device), device=cum.device) * cum[-1]
        j = min(int(torch.searchsorted(cum, u, right=True)), probs.numel() - 1)
        return j if ids is None else int(ids[j])

    def _fitting(self, guide: FormGuide, logits: torch.Tensor) -> int:
        """The token the rule chooses among those whose whole text fits the form: chosen from
        the tokens whose first byte fits, each that does not fit whole ruled out in turn (after
        :data:`_TRIES`, every candidate is tried at once); end-of-sequence if none fits."""
        import torch

        x = guide.mask(logits.float())
        for _ in range(_TRIES):
            token = self._pick(x)
            if not math.isfinite(float(x[token])):
                return guide.vocab.eos[0]          # no token can go on: the form's dead end
            if guide.fits(token):
                return token
            x[token] = float("-inf")
        fit = [t for t in guide.fitting() if t < x.numel()]
        if not fit:
            return guide.vocab.eos[0]
        keep = torch.full_like(x, float("-inf"))
        keep[fit] = 0.0
        return self._pick(x + keep)

    def _adjusted(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with the bias added and the penalties of the tokens chosen so far taken off."""
        import torch

        s = self.sampling
        if self._bias is None:
            ids = [t for t, _ in s.logit_bias]
            if ids and max(ids) >= x.numel():
                raise ValueError(f"logit_bias names token {max(ids)}; the vocabulary has "
                                 f"{x.numel()}")
            self._bias = (torch.tensor(ids, dtype=torch.long, device=x.device),
                          torch.tensor([b for _, b in s.logit_bias], dtype=x.dtype,
                                       device=x.device))
            if s.frequency_penalty or s.presence_penalty:
                self._counts = torch.zeros_like(x)
        x = x.index_add(0, *self._bias) if self._bias[0].numel() else x
        if self._counts is not None:
            x = (x - s.frequency_penalty * self._counts
                 - s.presence_penalty * (self._counts > 0).to(x.dtype))
        return x

    def _generator(self, device: torch.device) -> torch.Generator:
        import torch

        if self._gen is None:
            seed = self.sampling.seed
            assert seed is not None
            self._gen = torch.Generator(device=device).manual_seed(seed)
        return self._gen


#: how many chosen tokens may fail a form before every candidate is tried
_TRIES = 8

#: the first candidate set a nucleus is looked for in (grown 8x while it is not reached)
_FIRST_CANDIDATES = 64


def _candidates(x: torch.Tensor, top_k: int, top_p: float
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The probabilities to draw from (unnormalized) and their token ids (``None``: all the
    vocabulary, in order). ``top_k`` and ``top_p`` cut to the most likely tokens without
    sorting the vocabulary where they can: a nucleus is looked for among the top 64 tokens,
    then 512, ..., until they hold it (with a peaked answer, at once)."""
    import torch

    vocab = x.numel()
    if 0 < top_k < vocab:
        vals, ids = torch.topk(x, top_k)                 # sorted, most likely first
        probs = torch.softmax(vals, 0)
    elif top_p < 1:
        norm, kk = torch.logsumexp(x, 0), min(vocab, _FIRST_CANDIDATES)
        while True:
            vals, ids = torch.topk(x, kk)
            probs = torch.exp(vals - norm)
            if kk == vocab or float(probs.sum()) >= top_p:
                break
            kk = min(vocab, kk * 8)
    else:
        return torch.softmax(x, 0), None
    if top_p < 1:
        before = torch.cumsum(probs, 0) - probs          # the mass more likely than each
        probs = probs.masked_fill(before >= top_p, 0.0)
        probs[0] = probs[0].clamp_min(torch.finfo(probs.dtype).tiny)   # the first always stays
    return probs, ids


@dataclass(frozen=True)
class TokenLogprobs:
    """A chosen token's log-probability under the model (the log-softmax of its raw logits,
    before temperature and cuts, as OpenAI reports it) and the ``top`` most likely tokens'
    ``(id, logprob)``, most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    @classmethod
    def of(cls, logits: torch.Tensor, token: int, top: int) -> "TokenLogprobs":
        import torch

        lp = torch.log_softmax(logits.float(), 0)
        vals, ids = torch.topk(lp, min(top, lp.numel()))
        return cls(float(lp[token]), tuple(zip(ids.tolist(), vals.tolist())))


#: a thread's reporter: each chosen token, with its log-probabilities when they were asked for
Reporter = Callable[[int, "TokenLogprobs | None"], None]


@contextlib.contextmanager
def reporting_to(fn: Reporter | None, logprobs: int | None = None) -> Iterator[None]:
    """Every token a chooser chooses on this thread goes to ``fn`` too, for the block: the
    token and, with ``logprobs`` (0..:data:`MAX_TOP_LOGPROBS` alternatives), its
    :class:`TokenLogprobs` (else ``None``)."""
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(f"logprobs lists 0..{MAX_TOP_LOGPROBS} alternatives, not {logprobs}")
    before = getattr(_observer, "now", None)
    _observer.now = None if fn is None else (fn, logprobs)
    try:
        yield
    finally:
        _observer.now = before
