"""The shared vocabulary of sparkv: chunk ids, layer-step ids and the chunk geometry.

Everything here is plain Python (no torch), so that the scheduler, the codec's frame headers, the
server's manifests and the edge engine can all speak about chunks without loading a model.

Conventions (used everywhere in the code base):

* ``t`` - token chunk index, 0-based: tokens ``[t*T, min((t+1)*T, N))`` of the context.
* ``l`` - decoder layer index, 0-based (``0 .. L-1``). ``Y[l, t]`` is the hidden state *after*
  layer ``l`` for the tokens of chunk ``t``; the input of layer 0 is the token embeddings.
  (The design notes count layers from 1; code counts from 0.)
* ``g`` - KV-head group index, 0-based: KV heads ``[g*H_g, (g+1)*H_g)`` of the layer. By default one
  group holds every KV head of the layer (``G = 1``).

A KV chunk ``(t, l, g)`` is the K and V (after RoPE) of those tokens, that layer, those heads: the unit
of streaming, coding, storage and caching. A layer step ``(t, l)`` runs layer ``l`` for the queries of
chunk ``t`` and produces ``KV(t, l, *)`` and, for ``l < L-1``, ``Y[l, t]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple

DEFAULT_CHUNK_TOKENS = 1024
MIN_CHUNK_TOKENS = 16


class KVChunkId(NamedTuple):
    """Identifies the K/V of token chunk ``t``, layer ``l``, KV-head group ``g`` (all 0-based)."""

    t: int
    l: int  # noqa: E741 - the paper's name
    g: int = 0

    def __str__(self) -> str:
        return f"chunk(t={self.t}, l={self.l}, g={self.g})"


class StepId(NamedTuple):
    """Identifies the layer step that runs layer ``l`` for the queries of token chunk ``t``."""

    t: int
    l: int  # noqa: E741

    def __str__(self) -> str:
        return f"step(t={self.t}, l={self.l})"


@dataclass(frozen=True)
class ChunkGeometry:
    """How a context's KV cache is cut into chunks.

    Attributes:
        num_tokens: N, tokens in the context.
        chunk_tokens: T, tokens per token chunk (the last chunk may be shorter).
        num_layers: L, decoder layers.
        num_kv_heads: KV heads per layer.
        head_dim: channels per head.
        heads_per_group: KV heads per group (must divide ``num_kv_heads``); default all of them.
    """

    num_tokens: int
    chunk_tokens: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    heads_per_group: int = 0  # 0 means "all heads in one group"

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError(f"a context needs at least one token, got {self.num_tokens}")
        if self.chunk_tokens < MIN_CHUNK_TOKENS:
            raise ValueError(f"chunk_tokens must be >= {MIN_CHUNK_TOKENS}, got {self.chunk_tokens}")
        if self.num_layers < 1 or self.num_kv_heads < 1 or self.head_dim < 1:
            raise ValueError("num_layers, num_kv_heads and head_dim must be positive")
        hpg = self.heads_per_group or self.num_kv_heads
        if hpg < 1 or self.num_kv_heads % hpg:
            raise ValueError(
                f"heads_per_group={self.heads_per_group} must divide num_kv_heads={self.num_kv_heads}"
            )
        object.__setattr__(self, "heads_per_group", hpg)

    @classmethod
    def from_config(
        cls, config: Any, num_tokens: int, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        heads_per_group: int = 0,
    ) -> "ChunkGeometry":
        """Derives the geometry from a Hugging Face model config (Llama/Qwen2/Qwen3/Mistral)."""
        n_heads = int(getattr(config, "num_attention_heads"))
        n_kv = int(getattr(config, "num_key_value_heads", None) or n_heads)
        head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // n_heads
        return cls(num_tokens, chunk_tokens, int(config.num_hidden_layers), n_kv, int(head_dim),
                   heads_per_group)

    # --- counts -------------------------------------------------------------------------------
    @property
    def num_token_chunks(self) -> int:
        return math.ceil(self.num_tokens / self.chunk_tokens)

    @property
    def num_groups(self) -> int:
        return self.num_kv_heads // self.heads_per_group

    @property
    def num_chunks(self) -> int:
        return self.num_token_chunks * self.num_layers * self.num_groups

    # --- ranges -------------------------------------------------------------------------------
    def token_range(self, t: int) -> tuple[int, int]:
        """``[start, end)`` token positions of token chunk ``t``."""
        self._check_t(t)
        start = t * self.chunk_tokens
        return start, min(start + self.chunk_tokens, self.num_tokens)

    def chunk_len(self, t: int) -> int:
        start, end = self.token_range(t)
        return end - start

    def head_range(self, g: int) -> tuple[int, int]:
        """``[start, end)`` KV-head indices of group ``g``."""
        if not 0 <= g < self.num_groups:
            raise IndexError(f"group {g} out of range [0, {self.num_groups})")
        return g * self.heads_per_group, (g + 1) * self.heads_per_group

    def chunk_shape(self, cid: KVChunkId) -> tuple[int, int, int]:
        """Shape ``(heads, tokens, head_dim)`` of the K (and of the V) of one chunk."""
        self.check(cid)
        return self.heads_per_group, self.chunk_len(cid.t), self.head_dim

    def chunk_values(self, cid: KVChunkId) -> int:
        """Number of scalar values in K and V together."""
        h, n, d = self.chunk_shape(cid)
        return 2 * h * n * d

    # --- iteration ----------------------------------------------------------------------------
    def chunk_ids(self) -> Iterator[KVChunkId]:
        for t in range(self.num_token_chunks):
            for l in range(self.num_layers):  # noqa: E741
                for g in range(self.num_groups):
                    yield KVChunkId(t, l, g)

    def step_ids(self) -> Iterator[StepId]:
        for t in range(self.num_token_chunks):
            for l in range(self.num_layers):  # noqa: E741
                yield StepId(t, l)

    def chunks_of_step(self, step: StepId) -> list[KVChunkId]:
        return [KVChunkId(step.t, step.l, g) for g in range(self.num_groups)]

    def layer_spans(self, span_tokens: int) -> list[tuple[StepId, ...]]:
        """A layer-by-layer prefill's calls in order: the token chunks cut into blocks of at
        most ``span_tokens`` tokens (one chunk at least), each block layer by layer, one span
        (one call over the block's token chunks) a layer."""
        blocks: list[list[int]] = []
        size = 0
        for t in range(self.num_token_chunks):
            a, b = self.token_range(t)
            if not blocks or size + (b - a) > span_tokens:
                blocks.append([])
                size = 0
            blocks[-1].append(t)
            size += b - a
        return [tuple(StepId(t, l) for t in block)  # noqa: E741
                for block in blocks for l in range(self.num_layers)]

    # --- validation ---------------------------------------------------------------------------
    def _check_t(self, t: int) -> None:
        if not 0 <= t < self.num_token_chunks:
            raise IndexError(f"token chunk {t} out of range [0, {self.num_token_chunks})")

    def check(self, cid: KVChunkId) -> None:
        """Raises IndexError naming the coordinate that is out of range."""
        self._check_t(cid.t)
        if not 0 <= cid.l < self.num_layers:
            raise IndexError(f"layer {cid.l} out of range [0, {self.num_layers})")
        if not 0 <= cid.g < self.num_groups:
            raise IndexError(f"group {cid.g} out of range [0, {self.num_groups})")

    def to_dict(self) -> dict[str, int]:
        return {
            "num_tokens": self.num_tokens,
            "chunk_tokens": self.chunk_tokens,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "heads_per_group": self.heads_per_group,
        }

    @classmethod
    def from_dict(cls, d: dict[str, int]) -> "ChunkGeometry":
        return cls(**{k: int(d[k]) for k in (
            "num_tokens", "chunk_tokens", "num_layers", "num_kv_heads", "head_dim",
            "heads_per_group")})
