"""What every press shares: the budget, the scores it works on, the plan it makes, and the
:class:`Press` base class (docs/presses.md).

A press decides, per layer ``l`` and KV head ``h`` of a context of ``N`` tokens, which positions to
keep. It works in three small steps, each a method a subclass may replace:

1. :meth:`Press.score_entries` - ``[H, N]`` scores per layer (higher: keep), from what it sees of
   the layer (:class:`~sparkv.presses.scoring.ScoreInputs`: keys, values, the window's queries and
   hidden states, the window's attention); by default :meth:`Press.score` of the attention;
2. :meth:`Press.layer_budgets` - entries per head of each layer (uniform, pyramid, DynamicKV's
   progressive top-k), summing to ``L x`` the average;
3. :meth:`Press.head_budgets` - entries per head inside a layer (uniform, or Ada-KV's global top-B),
   summing to ``H x`` the layer's.

Then each head keeps its top-``b_lh`` positions plus the *forced* tail (the context's own
observation window in question-agnostic mode). :meth:`Press.plan` returns a :class:`PressPlan`;
:func:`sparkv.presses.apply.apply_plan` frees the rest in the KV memory (ragged layers: real
memory, not masks).

A press is also kvpress-shaped: ``compression_ratio`` (the fraction *removed*) in its constructor
is its own budget, and ``with press(model):`` compresses a plain transformers prefill
(:mod:`sparkv.presses.hooks`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

import torch

from sparkv.presses.errors import PressError
from sparkv.presses.hooks import PressHooks
from sparkv.presses.scoring import ScoreInputs, pool

__all__ = ["Budget", "PressPlan", "Press", "PressError", "round_to_total"]


@dataclass(frozen=True)
class Budget:
    """How much of a context to keep: a ``ratio`` of its tokens (``0 < ratio <= 1``) or a fixed
    number of ``tokens`` per KV head and layer on average. Exactly one is given.

    Either way the press keeps ``per_head(N) * L * H`` entries in all (window included).
    """

    ratio: float | None = None
    tokens: int | None = None

    def __post_init__(self) -> None:
        if (self.ratio is None) == (self.tokens is None):
            raise PressError("a budget is a ratio or a token count, exactly one of them")
        if self.ratio is not None:
            if not isinstance(self.ratio, (int, float)) or not math.isfinite(self.ratio) \
                    or not 0 < float(self.ratio) <= 1:
                raise PressError(f"the kept ratio must be in (0, 1], got {self.ratio!r}")
        if self.tokens is not None:
            if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) \
                    or self.tokens < 1:
                raise PressError(f"the token budget must be a positive integer, got "
                                 f"{self.tokens!r}")

    def per_head(self, num_tokens: int) -> int:
        """Entries kept per KV head and layer, on average, of a ``num_tokens`` context (>= 1)."""
        if num_tokens < 1:
            raise PressError(f"a context has at least one token, got {num_tokens}")
        if self.ratio is not None:
            return max(1, min(num_tokens, int(round(float(self.ratio) * num_tokens))))
        assert self.tokens is not None
        return min(num_tokens, self.tokens)

    def __str__(self) -> str:
        return f"{self.ratio:g}" if self.ratio is not None else f"{self.tokens}t"

    @property
    def compression_ratio(self) -> float | None:
        """kvpress's ``compression_ratio``: the fraction removed, ``1 - ratio`` (``None`` for a
        token budget)."""
        return None if self.ratio is None else round(1.0 - float(self.ratio), 12)

    @classmethod
    def from_compression_ratio(cls, compression_ratio: float) -> "Budget":
        """The budget that removes ``compression_ratio`` of the entries (kvpress's meaning,
        ``0 <= compression_ratio < 1``): ``Budget(ratio=1 - compression_ratio)``."""
        c = compression_ratio
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) \
                or not 0 <= float(c) < 1:
            raise PressError(f"compression_ratio (the fraction removed) must be in [0, 1), got "
                             f"{c!r}")
        return cls(ratio=round(1.0 - float(c), 12))

    @classmethod
    def parse(cls, text: str) -> "Budget":
        """``"0.2"`` (a ratio), ``"20%"``, or ``"512t"`` (tokens per head)."""
        s = str(text).strip().lower()
        try:
            if s.endswith("t"):
                return cls(tokens=int(s[:-1]))
            if s.endswith("%"):
                return cls(ratio=float(s[:-1]) / 100)
            return cls(ratio=float(s))
        except ValueError as e:
            if isinstance(e, PressError):
                raise
            raise PressError(f"bad budget {text!r}: use a ratio (0.2), a percentage (20%) or "
                             "tokens per head (512t)") from None


@dataclass
class PressPlan:
    """What a press keeps.

    Attributes:
        keep: per layer, per KV head, the positions kept (int64, ascending).
        budgets: per layer, per head, how many (``len(keep[l][h])``).
        num_tokens: N, the context's tokens.
        forced: how many tail positions every head keeps regardless of scores (the window).
    """

    keep: list[list[torch.Tensor]]
    budgets: list[list[int]]
    num_tokens: int
    forced: int = 0
    info: dict[str, object] = field(default_factory=dict)

    @property
    def kept_entries(self) -> int:
        return sum(sum(b) for b in self.budgets)

    @property
    def kept_fraction(self) -> float:
        heads = sum(len(b) for b in self.budgets)
        return self.kept_entries / max(1, heads * self.num_tokens)


def round_to_total(weights: Sequence[float], total: int, cap: Sequence[int] | int,
                   floor: int = 0) -> list[int]:
    """Integers proportional to ``weights``, each in ``[floor, cap_i]``, summing to ``total``
    (largest remainders; what a cap refuses goes to the others, in proportion). Raises when
    ``total`` does not fit in the caps."""
    n = len(weights)
    caps = [int(cap)] * n if isinstance(cap, int) else [int(c) for c in cap]
    if n == 0:
        if total:
            raise PressError(f"no slot for a total of {total}")
        return []
    if total > sum(caps) or total < floor * n:
        raise PressError(f"cannot place {total} entries in {n} slots of [{floor}, {caps}]")
    out = [min(floor, c) for c in caps]
    left = total - sum(out)
    free = [i for i in range(n) if out[i] < caps[i]]
    while left > 0 and free:
        w = [max(0.0, float(weights[i])) for i in free]
        s = sum(w)
        if s <= 0:
            w, s = [1.0] * len(free), float(len(free))
        share = [left * x / s for x in w]
        add = [min(int(math.floor(x)), caps[i] - out[i]) for x, i in zip(share, free)]
        # largest remainders get one more, as room allows
        rem = left - sum(add)
        order = sorted(range(len(free)), key=lambda j: -(share[j] - math.floor(share[j])))
        for j in order:
            if rem <= 0:
                break
            if out[free[j]] + add[j] < caps[free[j]]:
                add[j] += 1
                rem -= 1
        for j, i in enumerate(free):
            out[i] += add[j]
        left = total - sum(out)
        free = [i for i in range(n) if out[i] < caps[i]]
    assert sum(out) == total
    return out


class Press:
    """A KV-compression policy (module docstring). Subclasses set ``name`` and replace the steps
    they change; the defaults are SnapKV's: window attention scores, uniform budgets.

    Args:
        window: question-agnostic observation window (the context's last tokens; they are kept);
            0 (no window) only for a press that does not read attention.
        kernel: pooling kernel over positions (1: none).
        pooling: ``"max"`` or ``"avg"``.
        compression_ratio: kvpress's meaning, the fraction of entries *removed* (``[0, 1)``);
            gives the press its own :attr:`budget` (``Budget(ratio=1 - compression_ratio)``),
            which :func:`~sparkv.presses.compress` and ``with press(model):`` use when no budget
            is given. ``None``: the budget comes with each call (``adakv:0.2`` specs).
    """

    name: ClassVar[str] = "press"

    def __init__(self, window: int = 32, kernel: int = 7, pooling: str = "max",
                 compression_ratio: float | None = None) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 0 \
                or (window == 0 and self.needs_attention):
            raise PressError(f"window must be an integer >= 1 (>= 0 for a press that does not "
                             f"read attention), got {window!r}")
        if kernel < 1 or kernel % 2 == 0:
            raise PressError(f"kernel must be a positive odd number, got {kernel}")
        if pooling not in ("max", "avg"):
            raise PressError(f"pooling is 'max' or 'avg', got {pooling!r}")
        self.window, self.kernel, self.pooling = window, kernel, pooling
        self.budget: Budget | None = None if compression_ratio is None else \
            Budget.from_compression_ratio(compression_ratio)

    @property
    def compression_ratio(self) -> float | None:
        """The fraction of entries this press removes (kvpress's meaning), ``None`` without an
        own budget."""
        return None if self.budget is None else self.budget.compression_ratio

    def __repr__(self) -> str:
        cr = "" if self.budget is None else f", compression_ratio={self.compression_ratio:g}"
        return f"{type(self).__name__}(window={self.window}, kernel={self.kernel}, " \
               f"pooling={self.pooling!r}{cr})"

    def __call__(self, model: Any, budget: "Budget | None" = None) -> PressHooks:
        """``with press(model):`` - while active, a prefill of ``model`` (a transformers
        Llama-family causal LM or its base model) into a ``DynamicCache`` is compressed by this
        press, as kvpress's presses do (:mod:`sparkv.presses.hooks`). ``budget`` defaults to
        the press's own (``compression_ratio``)."""
        budget = self.budget if budget is None else budget
        if budget is None:
            raise PressError(f"{type(self).__name__} has no budget: give it a compression_ratio "
                             "(the fraction removed) or call press(model, budget=Budget(...))")
        return PressHooks(self, model, budget)

    def resolve_budget(self, budget: "Budget | None") -> "Budget":
        """``budget``, or the press's own when it is ``None``."""
        out = self.budget if budget is None else budget
        if out is None:
            raise PressError(f"no budget: give one, or a compression_ratio to "
                             f"{type(self).__name__}")
        return out

    # ---- 1. scores -------------------------------------------------------------------------------
    def score_entries(self, inputs: ScoreInputs) -> torch.Tensor:
        """``[H, n]`` scores of one layer's ``n`` candidate positions (higher: keep), from what
        the press sees of the layer: keys, values, the window's queries and hidden states, and
        the window's attention when :attr:`needs_attention`. By default :meth:`score` of the
        attention (zeros for a press that does not read it)."""
        att = inputs.attention
        if att is None:
            att = torch.zeros(int(inputs.keys.shape[0]), inputs.num_candidates)
        return self.score(inputs.layer, att)

    def score(self, layer: int, attention: torch.Tensor) -> torch.Tensor:
        """``[H, n]`` scores of the candidate positions of one layer, from the window's attention
        ``[H, n]`` (mean over the window's queries and each KV head's query group)."""
        return pool(attention, self.kernel, self.pooling)

    @property
    def needs_attention(self) -> bool:
        """Whether :meth:`score` reads the window's attention (the baselines do not)."""
        return True

    @property
    def layerwise(self) -> bool:
        """Whether a layer's plan depends on its own scores alone (the default uniform layer and
        head budgets): ``with press(model):`` then cuts each layer right after its attention."""
        cls = type(self)
        return cls.layer_budgets is Press.layer_budgets and cls.head_budgets is Press.head_budgets

    # ---- 2. layer budgets ------------------------------------------------------------------------
    def layer_budgets(self, scores: list[torch.Tensor], per_head: int, candidates: int
                      ) -> list[int]:
        """Entries per head of each layer (among ``candidates`` positions), summing to
        ``len(scores) * per_head``. Uniform here."""
        return [per_head] * len(scores)

    # ---- 3. head budgets -------------------------------------------------------------------------
    def head_budgets(self, layer: int, scores: torch.Tensor, per_head: int) -> list[int]:
        """Entries per head of one layer (``scores [H, n]``), summing to ``H * per_head``.
        Uniform here."""
        return [per_head] * int(scores.shape[0])

    # ---- the plan --------------------------------------------------------------------------------
    def plan(self, scores: list[torch.Tensor], num_tokens: int, budget: Budget, forced: int = 0
             ) -> PressPlan:
        """Per layer and head, the positions to keep of a ``num_tokens`` context.

        ``scores[l]`` is ``[H, num_tokens - forced]``: the candidates are positions
        ``0 .. N - forced``; the last ``forced`` positions (the window) are always kept, and
        count in the budget.
        """
        if not scores:
            raise PressError("no layers to compress")
        n_cand = num_tokens - forced
        if n_cand < 0:
            raise PressError(f"the window ({forced}) is longer than the context ({num_tokens})")
        for l, s in enumerate(scores):
            if s.dim() != 2 or int(s.shape[1]) != n_cand:
                raise PressError(f"layer {l}: scores of shape {tuple(s.shape)}, expected "
                                 f"[H, {n_cand}]")
        per_head = budget.per_head(num_tokens)
        forced_kept = min(forced, per_head)
        cand_budget = min(n_cand, per_head - forced_kept)
        layer_b = self.layer_budgets(scores, cand_budget, n_cand) if n_cand else [0] * len(scores)
        if sum(layer_b) != cand_budget * len(scores) or any(b < 0 or b > n_cand for b in layer_b):
            raise PressError(f"{self.name}: layer budgets {layer_b} do not sum to "
                             f"{cand_budget * len(scores)} within [0, {n_cand}]")
        tail = torch.arange(num_tokens - forced_kept, num_tokens, dtype=torch.long)
        keep: list[list[torch.Tensor]] = []
        budgets: list[list[int]] = []
        for l, (s, b) in enumerate(zip(scores, layer_b)):
            heads = self.head_budgets(l, s, b) if n_cand else [0] * int(s.shape[0])
            if sum(heads) != b * int(s.shape[0]) or any(x < 0 or x > n_cand for x in heads):
                raise PressError(f"{self.name}: head budgets {heads} of layer {l} do not sum to "
                                 f"{b * int(s.shape[0])}")
            row = []
            for h, bh in enumerate(heads):
                top = torch.topk(s[h].float(), bh, sorted=False).indices if bh else \
                    torch.zeros(0, dtype=torch.long)
                row.append(torch.cat([top.sort().values.long(), tail]))
            keep.append(row)
            budgets.append([int(x) + forced_kept for x in heads])
        return PressPlan(keep, budgets, num_tokens, forced_kept,
                    {"press": self.name, "budget": str(budget), "layer_budgets": layer_b})
