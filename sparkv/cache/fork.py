"""A transformers ``Cache`` that reads a KV memory and never writes it: :class:`ForkCache`.

Every layer attends the memory as it was when the fork was made (its first ``N`` positions) and
keeps its own new tokens in a small fp tail: a question's prefill and its answer. The memory is
not touched, so several forks of one memory run at once, each over the same context and its own
turn: the context service's calls that leave their context as it was share one working memory
(docs/device-service.md, "Calls at once"), and their answer tokens ride one forward pass
(:func:`~sparkv.runtime.batchdecode.decode_together`).

Per layer the memory's form decides the attention (each one a resident attention with a tail,
:class:`~sparkv.cache.attention.AttentionView`):

* a dense arena: :class:`~sparkv.cache.qattend.PrefixAttention` over views of its first ``N``
  slots (no copy), merged with the tail by log-sum-exp;
* a ragged arena: its entries below ``N`` (:class:`~sparkv.cache.qattend.TorchPagedAttention`);
* a paged layer: its pages as held (:meth:`ContextKV.resident_attention
  <sparkv.cache.memory.ContextKV.resident_attention>`), the tail in the same kernel call.

The density hook of the context service (:mod:`sparkv.device.density`) takes a dense layer's
attention weights (handed to its thread's :mod:`~sparkv.cache.colmass` sink), else reads its
keys (:meth:`ForkLayer.key_parts`: views of the prefix and the tail); other forms record
nothing, as a :class:`~sparkv.cache.hf.SparkvCache` over them does.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from transformers.cache_utils import Cache

from sparkv.cache.attention import AttentionView
from sparkv.cache.chunks import ARENA
from sparkv.cache.layerbase import FpTail, PositionsLayer
from sparkv.cache.memory import ContextKV

__all__ = ["ForkCache", "ForkLayer"]


class ForkLayer(PositionsLayer):
    """Layer ``layer`` of a :class:`ForkCache`: the memory's first ``base`` positions, read,
    and the fork's own tail."""

    cache_name = "ForkCache"

    def __init__(self, memory: ContextKV, layer: int, reserve: int = 0) -> None:
        super().__init__()
        self.memory, self.layer = memory, layer
        self.is_initialized = True
        self.base = int(memory.positions[layer])
        g = memory.geometry
        self.own = FpTail(g.num_kv_heads, g.head_dim, memory.dtype, memory.device, reserve)
        self._frozen: Any = None

    def get_seq_length(self) -> int:
        return self.base + self.own.count

    # ---- what attention sees ------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[Any, Any]:
        if key_states.shape[0] != 1:
            raise ValueError("a fork holds one sequence (batch size 1)")
        start = self.get_seq_length()
        q = int(key_states.shape[2])
        self.own.append(key_states[0], value_states[0])
        view = AttentionView(torch.arange(start, start + q, device=self.memory.device),
                             resident=self.frozen(), tail=self.tail())
        return view, view

    def frozen(self) -> Any:
        """The attention over the memory's first :attr:`base` positions (made once)."""
        if self._frozen is None:
            self._frozen = frozen_attention(self.memory, self.layer, self.base)
        return self._frozen

    def tail(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tail as ``(k [Hkv, n, D], v, pos [n])`` (views)."""
        pos = torch.arange(self.base, self.base + self.own.count, device=self.memory.device)
        return (*self.own.kv(), pos)

    def key_parts(self) -> list[torch.Tensor] | None:
        """The dense keys as views ``[Hkv, s_i, D]``, the prefix's then the tail's, that make
        :attr:`keys` when joined (what the density hook reads, no copy), else ``None``."""
        mem, l = self.memory, self.layer  # noqa: E741
        if not self.own.count or not mem.is_dense(l):
            return None
        store = mem.layers[l]
        assert store is not None
        prefix, _ = store.prefix(self.base)
        return [prefix[0], self.own.kv()[0]]

    def key_count(self) -> int | None:
        """How many keys :meth:`key_parts` gives, without making them (``None`` where it gives
        none): the density hook's count for a decoded token."""
        if not self.own.count or not self.memory.is_dense(self.layer):
            return None
        return self.base + self.own.count

    @property   # made from the prefix when read
    def keys(self) -> torch.Tensor | None:
        """The dense keys ``[1, Hkv, base + n, D]`` (slot = position) over a dense arena, else
        ``None`` (:meth:`key_parts` joined)."""
        parts = self.key_parts()
        if parts is None:
            return None
        return torch.cat([parts[0], parts[1].to(parts[0].dtype)], dim=1)[None]

    @keys.setter
    def keys(self, value: Any) -> None:   # the mixin's constructor sets it; a fork makes it
        pass

def frozen_attention(memory: ContextKV, layer: int, stop: int) -> Any:
    """Attention over ``memory``'s layer ``layer`` below position ``stop``, with a tail (module
    docstring)."""
    from sparkv.cache.qattend import PrefixAttention, TorchPagedAttention

    if memory.mode[layer] != ARENA:
        return memory.resident_attention(layer)
    store = memory.layers[layer]
    assert store is not None
    if not store.ragged:
        k, v = store.prefix(stop)
        return PrefixAttention(k[0], v[0])
    heads = [(e.k, e.v, e.pos) for e in memory.layer_entries(layer, stop)]
    return TorchPagedAttention(lambda: heads)


class ForkCache(Cache):
    """transformers' ``cache`` over a :class:`ContextKV` it only reads (module docstring)."""

    def __init__(self, memory: ContextKV, reserve: int = 0) -> None:
        """A fork of ``memory``; each layer's tail makes room for ``reserve`` tokens at its first
        (then it doubles as needed)."""
        self.memory = memory
        super().__init__(layers=[ForkLayer(memory, l, reserve)
                                 for l in range(memory.geometry.num_layers)])

    def _forks(self) -> list[ForkLayer]:
        return self.layers   # type: ignore[return-value]   # ForkLayers, as built in __init__

    def append_rows(self, rows: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Appends known rows (per layer ``(K, V)`` ``[Hkv, n, D]``, on any device) to every
        layer's tail; returns ``n``."""
        if len(rows) != len(self.layers):
            raise ValueError(f"rows of {len(rows)} layers for a fork of {len(self.layers)}")
        for layer, (k, v) in zip(self._forks(), rows):
            layer.own.append(k.to(self.memory.device), v.to(self.memory.device))
        return int(rows[0][0].shape[1]) if rows else 0

    def rows(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of every layer's tail on the CPU: ``(K, V)`` ``[Hkv, n, D]``."""
        out = []
        for layer in self._forks():
            k, v, _ = layer.tail()
            out.append((k.cpu().clone(), v.cpu().clone()))
        return out

    def extra_nbytes(self) -> int:
        """Bytes the tails hold (outside the memory's account)."""
        return sum(layer.own.nbytes() for layer in self._forks())
