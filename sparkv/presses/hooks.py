"""``with press(model):`` - a press applied during a plain transformers prefill, as kvpress does.

    press = SnapKVPress(compression_ratio=0.8)            # removes 80%: keeps adakv:0.2's share
    cache = DynamicCache()
    with press(model) as hooks:                           # model: a Llama-family causal LM
        model(input_ids, cache=cache)                     # past_key_values= before 5.x
    hooks.plan                                            # the PressPlan it applied

While active, every decoder layer's attention module carries a forward hook. After a layer's
attention has run on a *prefill* (the cache layer holds exactly the tokens of this forward), the
hook reads that layer's keys and values from the cache, recomputes the window's queries from the
module's input (as :class:`~sparkv.presses.scoring.WindowCapture` does) and asks the press for the
layer's scores through the same :func:`~sparkv.presses.scoring.layer_inputs` as
:func:`~sparkv.presses.compress`. A *layerwise* press (uniform budgets, so that a layer's plan
depends on its own scores alone: SnapKV, Knorm, the baselines) plans and cuts that layer right
there, as kvpress does; the others plan over all layers after the last one (the same
:meth:`Press.plan <sparkv.presses.base.Press.plan>`; layer-adaptive presses need every layer's
scores). The cache is cut to the kept entries:

* when every layer and head keeps the same count (SnapKV, Knorm, the baselines), each cache
  layer's tensors are gathered to ``[B, H, kept, D]``, exactly as kvpress's hooks leave them (any
  attention implementation decodes over it; as with kvpress, a continuation must pass its true
  ``position_ids``, since the cache is shorter than the text);
* when layers or heads keep different counts (PyramidKV and DynamicKV's layer budgets, Ada-KV's
  head budgets; one sequence only: transformers' masks assume one length for all layers), the
  cache's layers
  become :class:`~sparkv.cache.SparkvLayer` s over a pruned :class:`~sparkv.cache.ContextKV`
  (ragged: real memory, not kvpress's masks) and the model switches to the ``"sparkv"`` attention
  implementation (SDPA for every other cache); positions then continue from the context's length.

A forward that continues a cache (decoding, a question after the context) is left alone.
"""

from __future__ import annotations

from typing import Any

import torch

from sparkv.cache import ContextKV, SparkvLayer
from sparkv.cache.attention import use_sparkv_attention
from sparkv.layout import ChunkGeometry
from sparkv.presses.errors import PressError
from sparkv.presses.scoring import (Window, attention_inputs, layer_inputs, project_window)
from sparkv.runtime.hfcache import hook_cache
from sparkv.runtime.kvcache import memory_from_layers


def decoder_layers(model: Any) -> list[Any]:
    """The decoder layers of a causal LM, its base model or a multimodal wrapper's language
    model."""
    inner = getattr(model, "model", model)
    inner = getattr(inner, "language_model", inner)
    layers = getattr(inner, "layers", None)
    if layers is None or not len(layers) or not hasattr(layers[0], "self_attn"):
        raise PressError(f"{type(model).__name__} has no decoder layers with self_attn (a "
                         "Llama-family transformers model is needed)")
    return list(layers)


class PressHooks:
    """The context manager ``press(model)`` returns (module docstring). After the prefill,
    :attr:`plans` holds one :class:`~sparkv.presses.PressPlan` per sequence of the batch and
    :attr:`plan` the first."""

    def __init__(self, press: Any, model: Any, budget: Any) -> None:
        self.press, self.model, self.budget = press, model, budget
        self.layers = decoder_layers(model)
        self.plans: list[Any] = []
        self._scores: list[list[torch.Tensor]] = []
        self._layer_plans: list[list[Any]] = []
        self._forced = 0
        self._handles: list[Any] = []

    @property
    def plan(self) -> Any:
        if not self.plans:
            raise PressError("no prefill was compressed inside `with press(model):`")
        return self.plans[0]

    def __enter__(self) -> "PressHooks":
        for i, layer in enumerate(self.layers):
            self._handles.append(layer.self_attn.register_forward_hook(
                self._hook(i), with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ---- per layer ------------------------------------------------------------------------------
    def _hook(self, i: int) -> Any:
        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            cache = hook_cache(kwargs)
            if cache is None:
                return
            hidden, cos, sin = attention_inputs(args, kwargs)
            index = getattr(module, "layer_idx", i)
            if _seq_length(cache, index) != int(hidden.shape[1]):
                return                                  # not a prefill: leave the cache alone
            keys, values = _layer_tensors(cache, index)
            n = int(keys.shape[2])
            with torch.inference_mode():
                if i == 0:
                    self._scores = [[] for _ in range(int(keys.shape[0]))]
                    self._layer_plans = [[] for _ in range(int(keys.shape[0]))]
                self._score(i, module, hidden, cos, sin, keys, values)
                if self.press.layerwise:
                    self._cut_layer(cache, i, n)
                if i == len(self.layers) - 1:
                    self._apply(cache, n)
        return hook

    def _score(self, layer: int, module: Any, hidden: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        n = int(keys.shape[2])
        w = min(self.press.window, n)
        self._forced = w
        for b in range(int(keys.shape[0])):
            window = None
            if w:
                r = b if int(cos.shape[0]) > 1 else 0          # RoPE may be shared by the batch
                q, k = project_window(module, hidden[b:b + 1], cos[r:r + 1], sin[r:r + 1], w)
                window = Window(q=[torch.empty(0)] * layer + [q], k=[torch.empty(0)] * layer + [k],
                                pos=torch.arange(n - w, n), inside=True,
                                scale=float(module.scaling),
                                hidden=[torch.empty(0)] * layer + [hidden[b, n - w:].float()])
            inputs = layer_inputs(layer, keys[b], values[b], window, n - w,
                                  self.press.needs_attention)
            self._scores[b].append(self.press.score_entries(inputs))

    def _cut_layer(self, cache: Any, layer: int, n: int) -> None:
        """A layerwise press: this layer's plan (its scores alone decide it) and its cut, right
        after its attention."""
        plans = [self.press.plan([s[layer]], n, self.budget, self._forced) for s in self._scores]
        for b, p in enumerate(plans):
            self._layer_plans[b].append(p)
            self._scores[b][layer] = torch.empty(0)        # no longer needed
        _gather_layer(cache.layers[layer], [p.keep[0] for p in plans])

    # ---- after the last layer -------------------------------------------------------------------
    def _apply(self, cache: Any, n: int) -> None:
        if self.press.layerwise:
            self.plans = [_joined(rows) for rows in self._layer_plans]
            self._scores, self._layer_plans = [], []
            return
        self.plans = [self.press.plan(s, n, self.budget, self._forced) for s in self._scores]
        self._scores = []
        counts = {b for p in self.plans for row in p.budgets for b in row}
        if len(counts) == 1:
            self._gather(cache)
        elif len(self.plans) == 1:
            self._to_ragged(cache, n)
        else:
            raise PressError(f"{self.press.name}: layers or heads keep different counts; with "
                             "press(model) then compresses one sequence at a time (batch size 1)")

    def _gather(self, cache: Any) -> None:
        for l in range(len(self.layers)):  # noqa: E741
            _gather_layer(cache.layers[l], [p.keep[l] for p in self.plans])

    def _to_ragged(self, cache: Any, n: int) -> None:
        tensors = [_layer_tensors(cache, l) for l in range(len(self.layers))]  # noqa: E741
        geometry = ChunkGeometry.from_config(_config(self.model), n, max(16, min(256, n)))
        memory: ContextKV = memory_from_layers(tensors, geometry)
        for l, keep in enumerate(self.plans[0].keep):  # noqa: E741
            memory.prune_layer(l, keep)
        cache.layers[:] = [SparkvLayer(memory, l) for l in range(len(self.layers))]  # noqa: E741
        use_sparkv_attention(self.model)


def _gather_layer(layer: Any, keep: list[list[torch.Tensor]]) -> None:
    """Cuts a cache layer's ``[B, H, N, D]`` tensors to the kept positions ``keep[b][h]`` (the
    same count everywhere)."""
    idx = torch.stack([torch.stack(row) for row in keep])                     # [B, H, kept]
    idx = idx.to(layer.keys.device)[..., None].expand(-1, -1, -1, layer.keys.shape[-1])
    layer.keys = layer.keys.gather(2, idx).contiguous()
    layer.values = layer.values.gather(2, idx).contiguous()


def _joined(plans: list[Any]) -> Any:
    """One plan from one-layer plans (layer after layer)."""
    first = plans[0]
    info = dict(first.info, layer_budgets=[p.info["layer_budgets"][0] for p in plans])
    return type(first)([p.keep[0] for p in plans], [p.budgets[0] for p in plans],
                       first.num_tokens, first.forced, info)


def _seq_length(cache: Any, layer: int) -> int:
    layers = getattr(cache, "layers", None)
    if layers is None or layer >= len(layers):
        raise PressError("with press(model) compresses a transformers DynamicCache")
    return int(layers[layer].get_seq_length())


def _layer_tensors(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    layers = getattr(cache, "layers", None)
    if layers is None or layer >= len(layers):
        raise PressError("with press(model) compresses a transformers DynamicCache")
    k, v = getattr(layers[layer], "keys", None), getattr(layers[layer], "values", None)
    if not isinstance(k, torch.Tensor) or k.dim() != 4 or not isinstance(v, torch.Tensor):
        raise PressError(f"with press(model) compresses a DynamicCache; layer {layer} of a "
                         f"{type(cache).__name__} holds no [B, H, N, D] keys")
    return k, v


def _config(model: Any) -> Any:
    config = getattr(model, "config", None)
    return getattr(config, "text_config", None) or config
