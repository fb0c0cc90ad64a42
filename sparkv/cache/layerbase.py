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

__all__ = ["PositionsLayer", "FpTail"]


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


class FpTail:
    """A layer's new tokens kept beside its memory in fp: ``[Hkv, n, D]`` K and V buffers that
    grow by doubling (at least 16 tokens, or ``reserve`` at once), allocated at the first
    append. What a paged :class:`~sparkv.cache.hf.SparkvLayer` holds until its commit and what a
    :class:`~sparkv.cache.fork.ForkLayer` holds for its whole life."""

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, reserve: int = 0) -> None:
        self.shape, self.dtype, self.device = (num_kv_heads, head_dim), dtype, device
        self.reserve = reserve
        self.count = 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Appends ``[Hkv, q, D]`` entries (cast to the tail's dtype)."""
        q = int(k.shape[1])
        self._grow(self.count + q)
        assert self._k is not None and self._v is not None
        self._k[:, self.count:self.count + q] = k
        self._v[:, self.count:self.count + q] = v
        self.count += q

    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The entries ``(k, v)`` ``[Hkv, n, D]`` (views)."""
        if self._k is None or self._v is None:
            self._grow(1)
        assert self._k is not None and self._v is not None
        return self._k[:, :self.count], self._v[:, :self.count]

    def nbytes(self) -> int:
        return 0 if self._k is None else 2 * self._k.numel() * self._k.element_size()

    def _grow(self, need: int) -> None:
        cap = 0 if self._k is None else int(self._k.shape[1])
        if need <= cap:
            return
        h, d = self.shape
        k = torch.zeros((h, max(need, 2 * cap, 16, self.reserve), d), dtype=self.dtype,
                        device=self.device)
        v = torch.zeros_like(k)
        if self._k is not None and self._v is not None:
            k[:, :self.count] = self._k[:, :self.count]
            v[:, :self.count] = self._v[:, :self.count]
        self._k, self._v = k, v
