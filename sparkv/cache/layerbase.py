"""What every transformers cache layer of sparkv shares: :class:`PositionsLayer`.

A sparkv layer counts its positions itself (``get_seq_length``: the positions seen, not the
entries held) and hands attention its own views from ``update``
(:class:`~sparkv.cache.attention.AttentionView`); transformers' mask is sized from the positions,
a layer has no maximum length, and none can be reset or cropped (generation never asks: a cache
lives for one generation, assisted decoding is not used).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

__all__ = ["PositionsLayer"]


class PositionsLayer(CacheLayerMixin):
    """The shared part of a sparkv cache layer (module docstring); ``cache_name`` names the
    cache in the errors of what it cannot do."""

    is_sliding = False
    is_compileable = False
    cache_name = "sparkv cache"

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:  # pragma: no cover - generation never resets a given cache
        raise NotImplementedError(f"a {self.cache_name} cannot be reset; make a new one")

    def crop(self, max_length: int) -> None:  # pragma: no cover - assisted decoding only
        raise NotImplementedError(f"a {self.cache_name} cannot be cropped")
