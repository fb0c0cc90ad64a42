"""Conversions between the KV memory and plain per-layer tensors.

The KV memory itself is :class:`sparkv.cache.ContextKV` (chunks, positions, residency, levels).
This module keeps the helpers that move K/V between it and the plain per-layer layout
``[1, kv_heads, N, head_dim]`` of a transformers ``DynamicCache``: cutting per-layer K/V into
chunks, joining chunks back, and the DynamicCache conversions used by the reference paths.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import torch

from sparkv.cache import ContextKV, KVMemoryError, LayerKV, Source
from sparkv.layout import ChunkGeometry, KVChunkId

if TYPE_CHECKING:
    from transformers import DynamicCache

__all__ = ["LayerKV", "split_chunks", "assemble_layers", "memory_from_layers",
           "to_dynamic_cache", "from_dynamic_cache"]


def split_chunks(layers: LayerKV, geometry: ChunkGeometry
                 ) -> dict[KVChunkId, tuple[torch.Tensor, torch.Tensor]]:
    """Cuts per-layer K/V into chunks ``(t, l, g) -> (K, V)``, each ``[Hg, n_t, D]`` (views)."""
    if len(layers) != geometry.num_layers:
        raise KVMemoryError(f"expected {geometry.num_layers} layers, got {len(layers)}")
    out: dict[KVChunkId, tuple[torch.Tensor, torch.Tensor]] = {}
    for cid in geometry.chunk_ids():
        k, v = layers[cid.l]
        t0, t1 = geometry.token_range(cid.t)
        h0, h1 = geometry.head_range(cid.g)
        out[cid] = (k[0, h0:h1, t0:t1], v[0, h0:h1, t0:t1])
    return out


def memory_from_layers(layers: LayerKV, geometry: ChunkGeometry,
                       source: Source | str = Source.INJECTED, spare_tokens: int = 0
                       ) -> ContextKV:
    """A :class:`ContextKV` holding these per-layer K/V (copied)."""
    dtype = layers[0][0].dtype if layers else torch.float32
    device = layers[0][0].device if layers else "cpu"
    mem = ContextKV(geometry, dtype, device, spare_tokens=spare_tokens)
    for cid, (k, v) in split_chunks(layers, geometry).items():
        mem.put(cid, k, v, source)
    return mem


def assemble_layers(chunks: Mapping[KVChunkId, tuple[torch.Tensor, torch.Tensor]],
                    geometry: ChunkGeometry, dtype: torch.dtype = torch.float32) -> LayerKV:
    """Joins a complete set of chunks back into per-layer K/V."""
    mem = ContextKV(geometry, dtype)
    for cid, (k, v) in chunks.items():
        mem.put(cid, k, v)
    return mem.layer_kv()


def to_dynamic_cache(layers: LayerKV) -> DynamicCache:
    """A transformers ``DynamicCache`` holding these K/V (generation appends; inputs stay intact)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, (k, v) in enumerate(layers):
        cache.update(k, v, i)
    return cache


def from_dynamic_cache(cache: Any) -> LayerKV:  # any transformers version's cache (duck-typed)
    """Per-layer ``(K, V)`` from a transformers cache (transformers 4.x and 5.x layouts)."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))  # transformers < 4.56
