"""SnapKV (uniform budgets) and PyramidKV (pyramid layer budgets): the two layer-budget shapes
the adaptive presses are measured against."""

from __future__ import annotations

from typing import ClassVar

import torch

from sparkv.presses.base import Press, PressError, round_to_total


class SnapKVPress(Press):
    """Window attention scores, max-pooled (kernel 7); every layer and head keeps the same
    number of entries (plus the window)."""

    name: ClassVar[str] = "snapkv"


class PyramidKVPress(SnapKVPress):
    """SnapKV's scores with pyramid layer budgets: linear from ``2b - b/beta`` entries per head at
    layer 0 down to ``b/beta`` at the last layer (``b`` the average, ``beta = 20``), as PyramidKV
    and Ada-Pyramid do; the same count for every head of a layer."""

    name: ClassVar[str] = "pyramidkv"

    def __init__(self, window: int = 32, kernel: int = 7, pooling: str = "max",
                 beta: float = 20.0, compression_ratio: float | None = None) -> None:
        super().__init__(window, kernel, pooling, compression_ratio)
        if beta < 1:
            raise PressError(f"beta must be >= 1, got {beta}")
        self.beta = float(beta)

    def layer_budgets(self, scores: list[torch.Tensor], per_head: int, candidates: int
                      ) -> list[int]:
        n = len(scores)
        lo = per_head / self.beta
        hi = 2 * per_head - lo
        weights = [hi - (hi - lo) * l / max(1, n - 1) for l in range(n)]  # noqa: E741
        return round_to_total(weights, per_head * n, candidates)
