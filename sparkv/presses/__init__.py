"""KV-compression presses on the device's KV memory (docs/presses.md).

A press is one small class (kvpress's shape): it scores a context's entries from an observation
window and gives budgets per layer and per KV head, from a kept ratio or a fixed token budget;
applying it frees the pruned entries in the :class:`~sparkv.cache.ContextKV` (ragged per layer
and head: real memory, not masks).

    press, budget = parse_press("adakv:0.2")
    layers, window, _ = prefill(lm, context_ids)            # question-agnostic window
    memory = to_memory(lm, layers)
    compress(memory, press, budget, window)                 # or question_window(...) (aware)

Presses: ``snapkv`` (uniform), ``pyramidkv``, ``dynamickv`` (layer-adaptive), ``adakv``
(head-adaptive around any press; Ada-SnapKV), ``adapyramid``, ``ada-dynamickv``, and the
``random`` and ``streamingllm`` baselines.
"""

from sparkv.presses.adakv import AdaKV, AdaPyramid, adaptive_head_budgets
from sparkv.presses.apply import (CompressResult, apply_plan, compress, last, prefill,
                                  question_window, score_layers, to_memory)
from sparkv.presses.base import Budget, PressPlan, Press, PressError, round_to_total
from sparkv.presses.baselines import RandomPress, StreamingLLM
from sparkv.presses.dynamickv import DynamicKV
from sparkv.presses.registry import (PRESSES, PROBES, WINDOWS, canonical_spec, make_press,
                                     parse_press, split_spec)
from sparkv.presses.scoring import Window, WindowCapture, pool, window_attention
from sparkv.presses.snapkv import PyramidKV, SnapKV

__all__ = [
    "AdaKV", "AdaPyramid", "adaptive_head_budgets", "CompressResult", "apply_plan", "compress",
    "last", "prefill", "question_window", "score_layers", "to_memory", "Budget", "PressPlan", "Press",
    "PressError", "round_to_total", "canonical_spec", "split_spec", "PROBES", "WINDOWS", "RandomPress", "StreamingLLM", "DynamicKV", "PRESSES",
    "make_press", "parse_press", "Window", "WindowCapture", "pool", "window_attention", "PyramidKV",
    "SnapKV",
]
