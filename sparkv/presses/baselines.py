"""Sanity baselines: :class:`RandomPress` (random entries) and :class:`StreamingLLMPress` (attention
sinks plus the most recent tokens). Neither reads attention; both keep the budget exactly, with
uniform budgets, so a scoring press that does not beat them has a bug."""

from __future__ import annotations

from typing import ClassVar

import torch

from sparkv.presses.base import Press, PressError


class RandomPress(Press):
    """Keeps random entries (each head its own, seeded per layer)."""

    name: ClassVar[str] = "random"

    def __init__(self, window: int = 32, seed: int = 0, compression_ratio: float | None = None
                 ) -> None:
        super().__init__(window, 1, "max", compression_ratio)
        self.seed = int(seed)

    @property
    def needs_attention(self) -> bool:
        return False

    def score(self, layer: int, attention: torch.Tensor) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 100003 + layer)
        return torch.rand(attention.shape, generator=g)


class StreamingLLMPress(Press):
    """Keeps the first ``sinks`` tokens and the most recent ones (StreamingLLM's attention
    sinks and sliding window)."""

    name: ClassVar[str] = "streamingllm"

    def __init__(self, window: int = 32, sinks: int = 4, compression_ratio: float | None = None
                 ) -> None:
        super().__init__(window, 1, "max", compression_ratio)
        if sinks < 0:
            raise PressError(f"sinks must be >= 0, got {sinks}")
        self.sinks = int(sinks)

    @property
    def needs_attention(self) -> bool:
        return False

    def score(self, layer: int, attention: torch.Tensor) -> torch.Tensor:
        h, n = attention.shape
        s = torch.arange(n, dtype=torch.float32) / max(1, n)     # recency
        s[:self.sinks] = 2.0                                      # sinks first
        return s.expand(h, n).clone()
