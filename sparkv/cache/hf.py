"""A transformers ``Cache`` over the KV memory: :class:`SparkvCache`.

Built on transformers' own per-layer API (``Cache(layers=[...])`` of ``CacheLayerMixin``), so
``model.generate(..., cache=SparkvCache(memory))`` (``past_key_values=`` on an older
transformers: :func:`sparkv.runtime.hfcache.model_call` picks the keyword) and a plain forward
both decode over a :class:`~sparkv.cache.memory.ContextKV`:

* a **dense arena** layer appends the new token's K/V in place (preallocated as gpt-fast does; a
  full arena grows by an eighth, at least 64 slots) and hands attention a view of its slots: no per-token copy of the layer, and
  exactly the tensors (and transformers' own mask and SDPA) a ``DynamicCache`` would give;
* a **ragged** layer (pruned per head) appends in place too, and hands attention an
  :class:`~sparkv.cache.attention.AttentionView` (one SDPA per KV head over what it keeps);
* a **paged** layer (chunks in pages, at any levels) is attended as held: the paged kernel of
  :mod:`sparkv.cache.qattend` reads the pages in place, one call per layer (nothing is expanded to
  floats; the layer's :class:`~sparkv.cache.qattend.PagedAttention` is built once and rebuilt
  only when the memory's :meth:`~sparkv.cache.memory.ContextKV.layer_version` changes); its new
  tokens wait in a small fp tail, attended in the same call, until :meth:`SparkvCache.commit`.

The model must use the ``"sparkv"`` attention implementation
(:func:`~sparkv.cache.attention.use_sparkv_attention`; :func:`sparkv.runtime.load_model` sets it):
it is SDPA for every other cache. Positions continue from the context's token count whatever a
layer keeps, so a pruned cache still gives new tokens their true positions.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache

from sparkv.cache.attention import AttentionView
from sparkv.cache.chunks import ARENA
from sparkv.cache.layerbase import FpTail, PositionsLayer
from sparkv.cache.memory import ContextKV


class SparkvLayer(PositionsLayer):
    """Layer ``layer`` of a :class:`ContextKV` as a transformers cache layer."""

    cache_name = "SparkvCache"

    def __init__(self, memory: ContextKV, layer: int) -> None:
        super().__init__()
        self.memory, self.layer = memory, layer
        self.is_initialized = True
        self.dtype, self.device = memory.dtype, memory.device
        self.tail = self._new_tail()                # paged layers only
        self._resident: Any = None                  # (layer version, PagedAttention)
        self.keys = torch.zeros(0, dtype=memory.dtype)
        self.values = torch.zeros(0, dtype=memory.dtype)

    # ---- positions -------------------------------------------------------------------------------
    def get_seq_length(self) -> int:
        return self.memory.positions[self.layer] + self.tail.count

    # ---- update ----------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[Any, Any]:
        if key_states.shape[0] != 1:
            raise ValueError("the KV memory holds one sequence (batch size 1)")
        mem, l = self.memory, self.layer  # noqa: E741
        k, v = key_states[0], value_states[0]
        if mem.mode[l] == ARENA:
            positions = mem.append(l, k, v)
            store = mem.layers[l]
            assert store is not None
            if not store.ragged:
                keys, values = store.prefix(int(positions[-1]) + 1)
                self.keys, self.values = keys, values
                return keys, values
            view = AttentionView(positions, heads=[(e.k, e.v, e.pos)
                                                   for e in mem.layer_entries(l)])
            return view, view
        # paged: attended as held, new tokens in the tail
        start = mem.positions[l] + self.tail.count
        q = int(k.shape[1])
        self.tail.append(k, v)
        tail_pos = torch.arange(mem.positions[l], start + q, device=mem.device)
        view = AttentionView(torch.arange(start, start + q, device=mem.device),
                             resident=self._resident_attention(),
                             tail=(*self.tail.kv(), tail_pos))
        return view, view

    def _resident_attention(self) -> Any:
        """The paged layer's attention, rebuilt when the memory changed it."""
        version = self.memory.layer_version(self.layer)
        if self._resident is None or self._resident[0] != version:
            self._resident = (version, self.memory.resident_attention(self.layer))
        return self._resident[1]

    def _new_tail(self) -> FpTail:
        g, mem = self.memory.geometry, self.memory
        return FpTail(g.num_kv_heads, g.head_dim, mem.dtype, mem.device)

    def tail_nbytes(self) -> int:
        return self.tail.nbytes()

    def commit(self) -> None:
        """Moves the tail of a paged layer into the memory."""
        if self.tail.count:
            self.memory.append(self.layer, *self.tail.kv())
        self.tail = self._new_tail()
        self._resident = None


class SparkvCache(Cache):
    """transformers' ``cache`` (``past_key_values``) over a :class:`ContextKV` (module doc)."""

    def __init__(self, memory: ContextKV) -> None:
        self.memory = memory
        super().__init__(layers=[SparkvLayer(memory, l)
                                 for l in range(memory.geometry.num_layers)])

    def commit(self) -> int:
        """After generation: every layer's new tokens are part of the context's memory (the
        geometry grows); returns the context's new token count."""
        for layer in self.layers:
            layer.commit()  # type: ignore[union-attr]  # SparkvLayers, as built in __init__
        return self.memory.commit_appended()

    def extra_nbytes(self) -> int:
        """Bytes held outside the memory's account (the paged layers' tails)."""
        return sum(layer.tail_nbytes()  # type: ignore[union-attr]  # SparkvLayers
                   for layer in self.layers)
