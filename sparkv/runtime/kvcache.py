"""KV storage for one context: per-layer buffers, chunk slicing, and DynamicCache conversion.

Layout: per layer ``l`` one K and one V tensor of shape ``[1, kv_heads, N, head_dim]`` (after RoPE,
the model's dtype) - exactly what a transformers ``DynamicCache`` holds. A chunk ``(t, l, g)`` is the
view ``K[l][0, g*Hg:(g+1)*Hg, t*T:(t+1)*T]`` (shape ``[Hg, n_t, head_dim]``), so injecting a streamed
chunk, computing one locally and handing the whole cache to generation never copy more than once.
"""

from __future__ import annotations

import threading
from typing import Iterable, Mapping

import torch

from sparkv.errors import SparkvError
from sparkv.layout import ChunkGeometry, KVChunkId

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer ``(K, V)``, each ``[1, kv_heads, N, head_dim]`` after RoPE."""


class KVLayoutError(SparkvError):
    """A chunk's shape, dtype or coordinates do not match the context's geometry."""


class KVBuffers:
    """The K/V of one context under assembly, with per-chunk availability (thread-safe marks).

    Chunks may arrive in any order, from any thread (the stream path) while the compute path reads
    earlier chunks of the same layer: writes and reads touch disjoint token ranges, and the
    availability set is guarded by a lock.
    """

    def __init__(self, geometry: ChunkGeometry, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        self.geometry = geometry
        shape = (1, geometry.num_kv_heads, geometry.num_tokens, geometry.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(geometry.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(geometry.num_layers)]
        self._available: set[KVChunkId] = set()
        self._sources: dict[KVChunkId, str] = {}
        self._lock = threading.Lock()

    # ---- views -------------------------------------------------------------------------------
    def chunk_view(self, cid: KVChunkId) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``(K, V)`` of shape ``[Hg, n_t, head_dim]`` into the buffers (writable)."""
        self.geometry.check(cid)
        t0, t1 = self.geometry.token_range(cid.t)
        h0, h1 = self.geometry.head_range(cid.g)
        return self.k[cid.l][0, h0:h1, t0:t1], self.v[cid.l][0, h0:h1, t0:t1]

    # ---- writes ------------------------------------------------------------------------------
    def put(self, cid: KVChunkId, k: torch.Tensor, v: torch.Tensor, source: str = "injected",
            overwrite: bool = True) -> bool:
        """Writes one chunk (``[Hg, n_t, D]``, or with a leading batch dim of 1). Returns whether
        it was written (``overwrite=False`` keeps a chunk already present)."""
        kv_view, vv_view = self.chunk_view(cid)
        if k.dim() == 4 and k.shape[0] == 1:
            k, v = k[0], v[0]
        if tuple(k.shape) != tuple(kv_view.shape) or tuple(v.shape) != tuple(vv_view.shape):
            raise KVLayoutError(f"{cid}: expected K/V of shape {tuple(kv_view.shape)}, got "
                                f"{tuple(k.shape)} and {tuple(v.shape)}")
        with self._lock:
            if not overwrite and cid in self._available:
                return False
        kv_view.copy_(k)
        vv_view.copy_(v)
        with self._lock:
            self._available.add(cid)
            self._sources[cid] = source
        return True

    def put_step_output(self, t: int, l: int, k: torch.Tensor, v: torch.Tensor,  # noqa: E741
                        source: str = "computed") -> None:
        """Writes all groups of step ``(t, l)`` from ``[1, kv_heads, n_t, D]`` tensors, keeping
        chunks that are already present (a streamed chunk is not overwritten)."""
        for g in range(self.geometry.num_groups):
            h0, h1 = self.geometry.head_range(g)
            self.put(KVChunkId(t, l, g), k[0, h0:h1], v[0, h0:h1], source, overwrite=False)

    # ---- availability ------------------------------------------------------------------------
    def has(self, cid: KVChunkId) -> bool:
        with self._lock:
            return cid in self._available

    def missing(self, cids: Iterable[KVChunkId]) -> list[KVChunkId]:
        with self._lock:
            return [c for c in cids if c not in self._available]

    def source(self, cid: KVChunkId) -> str | None:
        with self._lock:
            return self._sources.get(cid)

    def sources(self) -> dict[KVChunkId, str]:
        with self._lock:
            return dict(self._sources)

    def is_complete(self) -> bool:
        with self._lock:
            return len(self._available) == self.geometry.num_chunks

    def layer_kv(self) -> LayerKV:
        """The per-layer ``(K, V)`` buffers (no copy). Raise if any chunk is missing."""
        missing = self.missing(self.geometry.chunk_ids())
        if missing:
            raise KVLayoutError(f"{len(missing)} chunks are still missing, first {missing[0]}")
        return list(zip(self.k, self.v))


def split_chunks(layers: LayerKV, geometry: ChunkGeometry
                 ) -> dict[KVChunkId, tuple[torch.Tensor, torch.Tensor]]:
    """Cuts per-layer K/V into chunks ``(t, l, g) -> (K, V)``, each ``[Hg, n_t, D]`` (views)."""
    if len(layers) != geometry.num_layers:
        raise KVLayoutError(f"expected {geometry.num_layers} layers, got {len(layers)}")
    out: dict[KVChunkId, tuple[torch.Tensor, torch.Tensor]] = {}
    for cid in geometry.chunk_ids():
        k, v = layers[cid.l]
        t0, t1 = geometry.token_range(cid.t)
        h0, h1 = geometry.head_range(cid.g)
        out[cid] = (k[0, h0:h1, t0:t1], v[0, h0:h1, t0:t1])
    return out


def assemble_layers(chunks: Mapping[KVChunkId, tuple[torch.Tensor, torch.Tensor]],
                    geometry: ChunkGeometry, dtype: torch.dtype = torch.float32) -> LayerKV:
    """Joins a complete set of chunks back into per-layer K/V."""
    buf = KVBuffers(geometry, dtype)
    for cid, (k, v) in chunks.items():
        buf.put(cid, k, v)
    return buf.layer_kv()


def to_dynamic_cache(layers: LayerKV):  # -> transformers.DynamicCache
    """A transformers ``DynamicCache`` holding these K/V (generation appends; inputs stay intact)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, (k, v) in enumerate(layers):
        cache.update(k, v, i)
    return cache


def from_dynamic_cache(cache) -> LayerKV:
    """Per-layer ``(K, V)`` from a transformers cache (transformers 4.x and 5.x layouts)."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))  # transformers < 4.56
