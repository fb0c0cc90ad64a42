"""Attention over the KV memory with explicit key positions, and its hook into transformers.

A cache layer's ``update`` returns either plain tensors (a dense arena: slot = position, so
transformers' own SDPA and its causal mask apply unchanged, bit for bit) or an
:class:`AttentionView`: per KV head the entries one query may see, with their positions, plus the
queries' positions. The attention implementation registered here as ``"sparkv"``
(:func:`register`) routes an ``AttentionView`` to :meth:`AttentionView.attend` and everything else
to transformers' SDPA. Query ``i`` (at position ``q_pos[i]``) sees exactly the keys whose position
is ``<= q_pos[i]``: a pruned, ragged or partly quantized cache is attended correctly, and a layer
whose heads keep different numbers of entries runs one SDPA per KV head (its GQA query group),
over only what that head holds: no padding.

A view may instead carry a ``resident`` attention (a paged layer's pages as held, read in place at
every level: :class:`~sparkv.cache.qattend.PagedAttention`) and an fp ``tail``
``(k [Hkv, n, D], v, pos [n])``; it is called as ``resident.attend(q, q_pos, scale, tail)``.

A view may also carry a ``backend`` (the layer stepper's dense or block-sparse attention) for
dense arenas, called as ``backend.attend(q, k, v, q_offset, scale)``.

An attention module may carry a one-query kernel (:data:`ONE_QUERY`: a compute configuration's,
``int4``'s :mod:`sparkv.runtime.decodeattn`): a pass of one query that sees every key (plain
tensors without a mask, or a dense view without a backend) goes to it first; where it declines
(``None``), SDPA runs. Such a module's answer tokens are SDPA's up to the order of float32 sums,
not bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

IMPLEMENTATION = "sparkv"
#: an attention module's attribute naming the dtype its prefill passes attend in (a compute
#: configuration's, :func:`sparkv.runtime.compute.apply_compute`); absent: the activations'
PRODUCTS_DTYPE = "sparkv_attention_dtype"
#: an attention module's attribute: a callable ``(q, k, v, scale) -> out | None`` that attends
#: one query over every key of dense ``k``, ``v`` (a compute configuration's kernel,
#: :mod:`sparkv.runtime.decodeattn`), ``None`` when it declines; absent: SDPA
ONE_QUERY = "sparkv_one_query_attention"

#: what :data:`ONE_QUERY` holds
OneQuery = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "float | None"],
                    "torch.Tensor | None"]


@dataclass
class AttentionView:
    """What one attention call of one layer may see.

    Attributes:
        q_pos: ``[q]`` positions of the queries (int64).
        heads: per KV head ``(k [n_h, D], v [n_h, D], pos [n_h])`` (ragged form), or ``None``.
        k, v: ``[1, H, n, D]`` with slot = position (dense form), or ``None``.
        backend: attention backend for the dense form (``None``: SDPA).
        stats: filled by the backend (the stepper reads it).
        q_offset: the first query's position as an int, when the caller knows it (dense form):
            reading it from ``q_pos`` on a GPU would wait for every kernel queued before it.
        resident: a paged layer's attention (resident form), or ``None``.
        tail: with ``resident``, fp entries ``(k [Hkv, n, D], v, pos [n])`` not in the memory
            yet (the decode tail), or ``None``.
    """

    q_pos: torch.Tensor
    heads: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    backend: Any = None
    stats: Any = field(default=None)
    q_offset: int | None = None
    resident: Any = None
    tail: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def attend(self, q: torch.Tensor, scale: float | None, one_query: OneQuery | None = None
               ) -> torch.Tensor:
        """``q [B, Hq, nq, D]`` -> ``[B, Hq, nq, D]``; ``one_query``: the module's kernel for
        one query over the dense form without a backend (:data:`ONE_QUERY`)."""
        if self.resident is not None:
            return self.resident.attend(q, self.q_pos, scale, self.tail)
        if self.heads is None:
            assert self.k is not None and self.v is not None
            offset = self.q_offset if self.q_offset is not None else int(self.q_pos[0])
            k, v = self.k, self.v
            if k.dtype != q.dtype:   # the products in another dtype: the visible keys cast
                n = offset + q.shape[2]
                k, v = k[:, :, :n].to(q.dtype), v[:, :, :n].to(q.dtype)
            if self.backend is not None:
                out, self.stats = self.backend.attend(q, k, v, offset, scale)
                return out
            if one_query is not None and q.shape[2] == 1:
                out = one_query(q, k[:, :, :offset + 1], v[:, :, :offset + 1], scale)
                if out is not None:
                    return out
            return causal_sdpa(q, k, v, offset, scale)
        return ragged_attention(q, self.heads, self.q_pos, scale)


class BatchView:
    """Per row of a batch of contexts (:class:`~sparkv.cache.batch.BatchCache`), what that
    row's attention sees: an :class:`AttentionView` each."""

    def __init__(self, views: list[AttentionView]) -> None:
        self.views = views

    def attend(self, q: torch.Tensor, scale: float | None, one_query: OneQuery | None = None
               ) -> torch.Tensor:
        """``q [K, Hq, nq, D]`` -> ``[K, Hq, nq, D]``: row ``i`` over view ``i``."""
        if q.shape[0] != len(self.views):
            raise ValueError(f"{q.shape[0]} query rows for {len(self.views)} contexts")
        return torch.cat([v.attend(q[i:i + 1], scale, one_query)
                          for i, v in enumerate(self.views)])


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int,
                scale: float | None) -> torch.Tensor:
    """Dense attention with slot = position: query ``i`` sees keys ``0 .. q_offset + i``.

    A pass from position 0 (a whole prompt's prefill) takes the kernel's own causal form, which
    skips the key blocks no query of a block sees: on the CPU 1.9x faster at 1,678 tokens
    (SmolLM2's heads) and bit for bit the mask's result (the skipped blocks only ever added
    zeros; ``tests/test_cache_attention.py``). After a prefix the mask is explicit (PyTorch's
    causal form aligns the first query with the first key, not with ``q_offset``); the
    runtime's dense backend splits such a pass instead (:mod:`sparkv.runtime.split`)."""
    nq = q.shape[2]
    k, v = k[:, :, :q_offset + nq], v[:, :, :q_offset + nq]
    gqa = q.shape[1] != k.shape[1]
    if nq == 1:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
    if q_offset == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=gqa)
    qpos = torch.arange(nq, device=q.device).unsqueeze(1) + q_offset
    mask = torch.arange(k.shape[2], device=q.device).unsqueeze(0) <= qpos
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def ragged_attention(q: torch.Tensor, heads: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                     q_pos: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Per KV head, its query group over its own entries, masked by position."""
    b, hq, nq, d = q.shape
    hkv = len(heads)
    group = hq // hkv
    out = torch.empty_like(q)
    qp = q_pos.to(torch.long).view(-1, 1)
    for h, (k, v, pos) in enumerate(heads):
        qs = q[:, h * group:(h + 1) * group]
        if k.shape[0] == 0:
            out[:, h * group:(h + 1) * group] = 0
            continue
        kk = k.to(q.dtype).unsqueeze(0).unsqueeze(0).expand(b, 1, -1, -1)
        vv = v.to(q.dtype).unsqueeze(0).unsqueeze(0).expand(b, 1, -1, -1)
        visible = pos.to(torch.long).view(1, -1) <= qp                 # [nq, n_h]
        if bool(visible.all()):
            o = F.scaled_dot_product_attention(qs, kk, vv, scale=scale, enable_gqa=group > 1)
        else:
            o = F.scaled_dot_product_attention(qs, kk, vv, attn_mask=visible, scale=scale,
                                               enable_gqa=group > 1)
            # a query that sees no key at all (cannot happen in a causal context) gets zeros
            o = torch.where(visible.any(-1).view(1, 1, nq, 1), o, torch.zeros_like(o))
        out[:, h * group:(h + 1) * group] = o
    return out


def sparkv_attention(module: torch.nn.Module, query: torch.Tensor, key: Any, value: Any,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0,
                     scaling: float | None = None, **kwargs: Any
                     ) -> tuple[torch.Tensor, None]:
    """The ``"sparkv"`` attention implementation (see the module docstring). A module with
    :data:`PRODUCTS_DTYPE` set attends a prefill pass (more than one query) over a dense arena
    or plain tensors in that dtype: Q, K and V cast, the output cast back."""
    dtype = _products_dtype(module, query, key)
    if dtype is not None:
        if isinstance(key, torch.Tensor):
            key, value = key.to(dtype), value.to(dtype)
        if attention_mask is not None and attention_mask.is_floating_point():
            attention_mask = attention_mask.to(dtype)
        out, weights = _attend(module, query.to(dtype), key, value, attention_mask, dropout,
                               scaling, **kwargs)
        return out.to(query.dtype), weights
    return _attend(module, query, key, value, attention_mask, dropout, scaling, **kwargs)


def _products_dtype(module: torch.nn.Module, query: torch.Tensor, key: Any
                    ) -> torch.dtype | None:
    """The dtype :func:`sparkv_attention` casts to, or ``None``: the module's
    :data:`PRODUCTS_DTYPE` for a pass of several queries over plain tensors or a dense arena
    (one query, a decode step, reads the keys once: casting them would cost more than it saves;
    the ragged and resident forms keep their own kernels)."""
    dtype = getattr(module, PRODUCTS_DTYPE, None)
    if dtype is None or dtype == query.dtype or query.shape[2] < 2:
        return None
    dense_view = isinstance(key, AttentionView) and key.heads is None and key.resident is None
    return dtype if dense_view or isinstance(key, torch.Tensor) else None


def _attend(module: torch.nn.Module, query: torch.Tensor, key: Any, value: Any,
            attention_mask: torch.Tensor | None, dropout: float, scaling: float | None,
            **kwargs: Any) -> tuple[torch.Tensor, None]:
    one_query = getattr(module, ONE_QUERY, None)
    if isinstance(key, (AttentionView, BatchView)):
        out = key.attend(query, scaling, one_query)
        return out.transpose(1, 2).contiguous(), None
    if one_query is not None and _plain_one_query(query, key, attention_mask, dropout, kwargs):
        out = one_query(query, key, value, scaling)
        if out is not None:
            return out.transpose(1, 2).contiguous(), None
    if _masked_gqa_on_cpu(query, key, value, attention_mask, dropout, kwargs):
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                             scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, **kwargs)


def _plain_one_query(query: torch.Tensor, key: Any, attention_mask: torch.Tensor | None,
                     dropout: float, kwargs: dict[str, Any]) -> bool:
    """Whether a call over plain tensors is one query that sees every key (no mask: a decode
    step over a ``DynamicCache`` or a dense arena), with nothing transformers' path handles
    specially (dropout, a position bias, a softcap, the weights asked for)."""
    return (query.shape[2] == 1 and attention_mask is None and isinstance(key, torch.Tensor)
            and _nothing_special(dropout, kwargs))


def _nothing_special(dropout: float, kwargs: dict[str, Any]) -> bool:
    """No dropout, position bias, softcap or weights asked for: what transformers' SDPA path
    handles specially."""
    return (not dropout and kwargs.get("position_bias") is None
            and kwargs.get("softcap") is None and not kwargs.get("output_attentions", False))


def _masked_gqa_on_cpu(query: torch.Tensor, key: Any, value: Any,
                       attention_mask: torch.Tensor | None, dropout: float,
                       kwargs: dict[str, Any]) -> bool:
    """Whether a masked multi-query call (a question's prefill over a dense arena) can run SDPA
    with ``enable_gqa`` on the CPU instead of transformers' path, which copies K and V once per
    query head group (``repeat_kv``) whenever a mask is given: 43-48% of a 4K question's prefill
    was those copies. The CPU kernel takes the mask with ``enable_gqa`` (same values, bit for
    bit); on CUDA a mask with ``enable_gqa`` falls back to the math kernel, so CUDA keeps
    transformers' path, as does anything that path handles specially (dropout, a position bias,
    a softcap, one query)."""
    return (attention_mask is not None and isinstance(key, torch.Tensor)
            and isinstance(value, torch.Tensor) and query.device.type == "cpu"
            and query.shape[2] > 1 and query.shape[1] != key.shape[1]
            and query.shape[1] % key.shape[1] == 0 and key.shape[-1] == value.shape[-1]
            and _nothing_special(dropout, kwargs))


_REGISTERED = False


def register() -> str:
    """Registers the ``"sparkv"`` attention implementation (and SDPA's mask for it) with
    transformers, once; returns its name."""
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

        AttentionInterface.register(IMPLEMENTATION, sparkv_attention)
        AttentionMaskInterface.register(IMPLEMENTATION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
        _REGISTERED = True
    return IMPLEMENTATION


def use_sparkv_attention(model: Any) -> None:
    """Switches ``model`` to the ``"sparkv"`` implementation (identical to SDPA for every cache
    but the KV memory's)."""
    register()
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "_attn_implementation", None) == IMPLEMENTATION:
        return
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(IMPLEMENTATION)
    elif config is not None:  # pragma: no cover - older transformers
        config._attn_implementation = IMPLEMENTATION
