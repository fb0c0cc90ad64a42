"""Ada-KV: head-wise adaptive budgets inside each layer (shared/papers/adakv.md, Algorithm 1 and
the safeguard of its code).

Within a layer of ``H`` KV heads and a layer budget of ``B = H * b`` entries, every head first
keeps its own top ``floor(alpha * b)`` entries (the safeguard, ``alpha = 0.2``); the rest of ``B``
goes to the best remaining scores of *all* heads together (a global top-k), so a head whose
attention is concentrated gives entries to one whose attention is spread. With ``alpha = 0`` this is
Algorithm 1 (the budgets that minimise the L1 loss bound ``2C sum_h (1 - F_h)``, Theorem 3.3);
with ``alpha = 1`` every head keeps ``b``: the wrapped press unchanged.

:class:`AdaKVPress` wraps any scorer press (its scores and its layer budgets; only the split
between heads changes): ``AdaKVPress(SnapKVPress())`` is Ada-SnapKV, :class:`AdaPyramidPress` is
``AdaKVPress(PyramidKVPress())``, ``AdaKVPress(DynamicKVPress())`` combines both axes. As in
kvpress, the wrapped press's ``compression_ratio`` is the wrapper's unless one is given. Scores are compared across heads as they are, so the
wrapped press must give comparable scales (attention weights averaged over the window and the GQA
group are: each head's sum to 1 before pooling).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from sparkv.presses.base import Press, PressError
from sparkv.presses.scoring import ScoreInputs
from sparkv.presses.snapkv import PyramidKVPress, SnapKVPress


def adaptive_head_budgets(scores: torch.Tensor, per_head: int, alpha: float = 0.2) -> list[int]:
    """Ada-KV's head budgets for one layer: ``scores [H, n]``, ``per_head`` the uniform budget;
    returns ``H`` counts summing to ``H * per_head``, each ``>= floor(alpha * per_head)``."""
    if not 0.0 <= alpha <= 1.0:
        raise PressError(f"alpha must be in [0, 1], got {alpha}")
    heads, n = int(scores.shape[0]), int(scores.shape[1])
    if per_head > n:
        raise PressError(f"a head cannot keep {per_head} of {n} entries")
    if per_head == 0:
        return [0] * heads
    safe = int(alpha * per_head + 1e-9)
    s = scores.float().clone()
    if safe:
        top = torch.topk(s, safe, dim=-1, sorted=False).indices
        s.scatter_(-1, top, float("inf"))
    picked = torch.topk(s.flatten(), heads * per_head, sorted=False).indices
    return [int(x) for x in torch.bincount(picked // n, minlength=heads)]


class AdaKVPress(Press):
    """Head-wise adaptive budgets around another press (module docstring)."""

    name: ClassVar[str] = "adakv"

    def __init__(self, inner: Press | None = None, alpha: float = 0.2,
                 compression_ratio: float | None = None) -> None:
        inner = SnapKVPress() if inner is None else inner
        if not isinstance(inner, Press):
            raise PressError(f"AdaKVPress wraps a press, got {type(inner).__name__}")
        self.inner = inner
        if compression_ratio is None:
            compression_ratio = inner.compression_ratio
        super().__init__(inner.window, inner.kernel, inner.pooling, compression_ratio)
        if not 0.0 <= alpha <= 1.0:
            raise PressError(f"alpha must be in [0, 1], got {alpha}")
        self.alpha = float(alpha)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r}, alpha={self.alpha})"

    @property
    def needs_attention(self) -> bool:
        return self.inner.needs_attention

    def score_entries(self, inputs: ScoreInputs) -> torch.Tensor:
        return self.inner.score_entries(inputs)

    def score(self, layer: int, attention: torch.Tensor) -> torch.Tensor:
        return self.inner.score(layer, attention)

    def layer_budgets(self, scores: list[torch.Tensor], per_head: int, candidates: int
                      ) -> list[int]:
        return self.inner.layer_budgets(scores, per_head, candidates)

    def head_budgets(self, layer: int, scores: torch.Tensor, per_head: int) -> list[int]:
        return adaptive_head_budgets(scores, per_head, self.alpha)


class AdaPyramidPress(AdaKVPress):
    """Ada-Pyramid: PyramidKV's layer budgets, Ada-KV's head split."""

    name: ClassVar[str] = "adapyramid"

    def __init__(self, inner: Press | None = None, alpha: float = 0.2,
                 compression_ratio: float | None = None) -> None:
        super().__init__(PyramidKVPress() if inner is None else inner, alpha, compression_ratio)
