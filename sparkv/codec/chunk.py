"""``KVChunk``: the K and V of one chunk ``(t, l, g)``, what the codec encodes and decodes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparkv.layout import KVChunkId


@dataclass
class KVChunk:
    """K and V of token chunk ``id.t``, layer ``id.l``, KV-head group ``id.g`` (after RoPE).

    Attributes:
        id: the chunk's coordinates.
        token_start: absolute position of the chunk's first token in the context.
        k: ``[heads, tokens, head_dim]`` keys (CPU; float32, float16 or bfloat16).
        v: ``[heads, tokens, head_dim]`` values, same shape and dtype as ``k``.
        num_layers: decoder layers of the model (the layer-wise bit allocation of the quantized
            levels depends on it; 0 = unknown, enough for ``raw`` only).
    """

    id: KVChunkId
    token_start: int
    k: torch.Tensor
    v: torch.Tensor
    num_layers: int = 0

    @property
    def num_heads(self) -> int:
        return int(self.k.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.k.shape[1])

    @property
    def head_dim(self) -> int:
        return int(self.k.shape[2])

    @property
    def token_range(self) -> tuple[int, int]:
        """``[start, end)`` absolute token positions."""
        return self.token_start, self.token_start + self.num_tokens

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def num_values(self) -> int:
        """Scalars in K and V together."""
        return 2 * self.k.numel()
