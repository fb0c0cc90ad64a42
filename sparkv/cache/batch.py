"""Several contexts' caches as one transformers ``Cache`` of batch size K: :class:`BatchCache`.

One answer token of each of K asks, each over its own KV memory (a
:class:`~sparkv.cache.hf.SparkvCache`), goes through the model as one forward pass of K rows:
the embedding, the norms, the projections, the MLP and the head read the weights once for all
of them (on a CPU a decode pass is bound by reading the weights: about 80-100 ms for
SmolLM2-135M's 540 MB of float32 here, whatever the rows). Each layer's attention is each row's
alone: :class:`BatchLayer` appends row ``i``'s new K/V to memory ``i`` (as that memory's own
layer does) and hands attention a :class:`~sparkv.cache.attention.BatchView`, which attends row ``i`` over memory ``i``
(:meth:`AttentionView.attend <sparkv.cache.attention.AttentionView.attend>`). The contexts may
differ in length, form (dense, ragged, paged) and position: each row carries its own position
(``position_ids``); the mask transformers builds is not used.

Only one new token per row (decoding); a prefill of several tokens runs per context.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from transformers.cache_utils import Cache

from sparkv.cache.attention import AttentionView, BatchView
from sparkv.cache.fork import ForkCache
from sparkv.cache.layerbase import PositionsLayer
from sparkv.cache.hf import SparkvCache

__all__ = ["BatchCache", "BatchLayer"]


class BatchLayer(PositionsLayer):
    """Layer ``l`` of K caches: row ``i``'s new K/V go to cache ``i``'s layer."""

    cache_name = "BatchCache"

    def __init__(self, layers: Sequence[Any]) -> None:
        super().__init__()
        self.layers = list(layers)
        self.is_initialized = True
        self.keys = torch.zeros(0)
        self.values = torch.zeros(0)

    def get_seq_length(self) -> int:
        return max(layer.get_seq_length() for layer in self.layers)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[Any, Any]:
        if key_states.shape[0] != len(self.layers) or key_states.shape[2] != 1:
            raise ValueError(f"a batch of {len(self.layers)} contexts decodes one token each, "
                             f"not {tuple(key_states.shape[:3])}")
        views = []
        for i, layer in enumerate(self.layers):
            pos = layer.get_seq_length()
            k, v = layer.update(key_states[i:i + 1], value_states[i:i + 1])
            if not isinstance(k, AttentionView):     # a dense arena: its slots, slot = position
                k = AttentionView(torch.tensor([pos]), k=k, v=v, q_offset=pos)
            views.append(k)
        view = BatchView(views)
        return view, view


class BatchCache(Cache):
    """K :class:`SparkvCache` s as one cache of batch size K (module docstring); each row's
    new token goes into its own memory, exactly as that cache alone would take it."""

    def __init__(self, caches: Sequence[SparkvCache | ForkCache]) -> None:
        if not caches:
            raise ValueError("a batch needs at least one cache")
        num_layers = {len(c.layers) for c in caches}
        if len(num_layers) != 1:
            raise ValueError("the caches of one batch come from one model (same layers)")
        self.caches = list(caches)
        super().__init__(layers=[BatchLayer([c.layers[l] for c in caches])
                                 for l in range(num_layers.pop())])
