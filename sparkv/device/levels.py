"""The level of every token chunk of a context (the service's ``compression`` policy), and the bytes
its chunks cost at those levels.

``tolerance`` (LLMS): ``fp_protect`` first chunks (the attention sinks) at fp outside the global
``ratio``, the densest ``fp_fraction`` at fp inside it, the rest int8 / k8v4 / int4 / int2 by
their measured information density (:func:`sparkv.device.density.plan_levels`); ``int8`` /
``fp``: every chunk at that level. A chunk's level is chosen when it is folded into the context
and never goes up (its flash copy stays valid).

No state beyond the policy's fields; no locks.
"""

from __future__ import annotations

import math
from typing import Protocol, Sequence

import numpy as np
import torch

from sparkv.device.density import chunk_densities, plan_levels
from sparkv.device.loader import paged_nbytes, payload_nbytes
from sparkv.layout import ChunkGeometry


class LevelInputs(Protocol):
    """What a context's levels come from (a :class:`~sparkv.device.registry.DeviceContext`'s
    fields): its measured densities (``mass``, ``rows``: per token, float64) and the levels its
    token chunks already have."""

    @property
    def mass(self) -> torch.Tensor: ...

    @property
    def rows(self) -> torch.Tensor: ...

    @property
    def levels(self) -> list[str]: ...


class LevelPolicy:
    """The levels of ``compression`` (``tolerance`` | ``int8`` | ``fp``) for a model's ``dtype``
    (module docstring)."""

    def __init__(self, compression: str, ratio: float, fp_fraction: float, fp_protect: int,
                 dtype: torch.dtype) -> None:
        self.compression = compression
        self.ratio = ratio
        self.fp_fraction = fp_fraction
        self.fp_protect = fp_protect
        self.dtype = dtype

    def assign(self, ctx: LevelInputs, g: ChunkGeometry) -> list[str]:
        """The level of every token chunk of geometry ``g``: the full chunks already assigned
        keep theirs, the others by the policy."""
        nt = g.num_token_chunks
        if self.compression != "tolerance":
            return [self.compression] * nt
        dens = chunk_densities(ctx.mass, ctx.rows, g.chunk_tokens, g.num_tokens) \
            if ctx.mass.numel() >= g.num_tokens else None
        if dens is None or not dens.any():
            dens = np.ones(nt)      # no measured densities yet: equal densities, the mix decides
        mix = plan_levels(dens, self.ratio, fp_fraction=self.fp_fraction,
                          protect=range(min(self.fp_protect, nt)), fp_ratio=self.fp_ratio(g))
        keep = ctx.levels
        full = g.num_tokens // g.chunk_tokens
        return [keep[t] if t < len(keep) and t < full else mix.levels[t] for t in range(nt)]

    def fp_ratio(self, g: ChunkGeometry) -> float:
        """An fp chunk's bytes relative to an int8 one (what it costs in the global ratio)."""
        rows = g.heads_per_group * g.chunk_tokens
        return (payload_nbytes("fp", rows, g.head_dim, self.dtype)
                / payload_nbytes("int8", rows, g.head_dim, self.dtype))

    def chunks_nbytes(self, g: ChunkGeometry, levels: Sequence[str]) -> int:
        """The bytes of every token chunk of ``g`` (all layers) at ``levels``, as the memory
        account counts them (whole pages: :func:`~sparkv.device.loader.paged_nbytes`)."""
        return sum(paged_nbytes(levels[t], g.chunk_len(t), g.num_kv_heads, g.head_dim,
                                self.dtype) * g.num_layers
                   for t in range(g.num_token_chunks))

    def new_chunk_bytes(self, g: ChunkGeometry, spare: int) -> int:
        """An upper bound of the bytes the chunks of ``spare`` new tokens take when folded into a
        context of geometry ``g`` (fp whenever the policy may put one at fp, else int8)."""
        fp = self.compression == "fp" or (self.compression == "tolerance" and (
            self.fp_fraction > 0 or self.ratio > 1.0
            or g.num_tokens + spare > self.fp_protect * g.chunk_tokens > g.num_tokens))
        lv = "fp" if fp else "int8"
        chunks = math.ceil(spare / g.chunk_tokens) + 1
        return chunks * g.num_layers * paged_nbytes(lv, g.chunk_tokens, g.num_kv_heads,
                                                    g.head_dim, self.dtype)
