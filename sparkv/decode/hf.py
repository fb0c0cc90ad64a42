"""A transformers ``Cache`` over a clustered decode policy: :class:`DynaKVCache`.

Built like :class:`sparkv.cache.SparkvCache`: one ``CacheLayerMixin`` per layer. ``update`` hands
the new K/V to the layer's state and returns a :class:`DynaKVView` - an
:class:`~sparkv.cache.AttentionView` whose ``attend`` receives the layer's (post-RoPE) queries,
so retrieval happens inside the model's own attention module with the real query: the ``"sparkv"``
attention implementation (:func:`sparkv.cache.use_sparkv_attention`, set by
:func:`sparkv.runtime.load_model`) calls it. Attention then runs over the retrieved entries with
their explicit positions (:func:`sparkv.cache.ragged_attention`).

**Where it lives.** A clustered memory is host RAM and flash whatever the model's device (the
paper's device keeps it in DRAM, its clusters on flash): on a GPU the layer's new K/V come down
in ``update`` and the step's queries in ``attend``, which attends there (the fused kernel in
float32, :mod:`sparkv.decode.fused`) and returns the output to the queries' device; the full KV
before the switch and the model stay on the GPU. On the CPU these copies are no-ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache

from sparkv.cache import AttentionView
from sparkv.cache.attention import OneQuery
from sparkv.cache.layerbase import PositionsLayer
from sparkv.decode.policy import ClusteredKV, LayerState

if TYPE_CHECKING:
    from sparkv.decode.stream import StreamedKV


@dataclass
class DynaKVView(AttentionView):
    """An attention view that retrieves from the layer's clusters with the query it is given."""

    state: Any = None

    def attend(self, q: torch.Tensor, scale: float | None, one_query: OneQuery | None = None
               ) -> torch.Tensor:
        """The clusters' retrieval (``one_query`` is not used: the view is not dense)."""
        if q.shape[0] != 1:
            raise ValueError("a clustered cache holds one sequence (batch size 1)")
        # the memory is in host RAM (module docstring): on a GPU the queries come down once and
        # the output goes back up once per layer and step; on the CPU both are no-ops
        return self.state.attend(q.cpu(), scale, self.q_pos).to(q.device)


class DynaKVLayer(PositionsLayer):
    """Layer ``l`` of a :class:`ClusteredKV` as a transformers cache layer."""

    cache_name = "DynaKVCache"

    def __init__(self, state: LayerState) -> None:
        super().__init__()
        self.state = state
        self.is_initialized = True
        self.keys = torch.zeros(0, dtype=state.eng.dtype)
        self.values = torch.zeros(0, dtype=state.eng.dtype)

    def get_seq_length(self) -> int:
        return self.state.end

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[Any, Any]:
        if key_states.shape[0] != 1:
            raise ValueError("a clustered cache holds one sequence (batch size 1)")
        pos = self.state.update(key_states[0].cpu(), value_states[0].cpu())
        view = DynaKVView(pos, state=self.state)
        return view, view


class DynaKVCache(Cache):
    """``past_key_values`` for transformers over a :class:`ClusteredKV`."""

    def __init__(self, kv: "ClusteredKV | StreamedKV") -> None:
        self.kv = kv
        super().__init__(layers=[DynaKVLayer(s) for s in kv.layers])  # type: ignore[arg-type]
