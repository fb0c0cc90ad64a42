"""KV-compression presses on the device's KV memory (docs/presses.md).

A press is one small class (kvpress's shape): it scores a context's entries from an observation
window and gives budgets per layer and per KV head, from a kept ratio or a fixed token budget;
applying it frees the pruned entries in the :class:`~sparkv.cache.ContextKV` (ragged per layer
and head: real memory, not masks).

    press, budget = parse_press("adakv:0.2")
    layers, window, _ = prefill(lm, context_ids)            # question-agnostic window
    memory = to_memory(lm, layers)
    compress(memory, press, budget, window)                 # or question_window(...) (aware)

Presses (kvpress's class names; registry names in brackets): :class:`SnapKVPress` (``snapkv``,
uniform), :class:`PyramidKVPress` (``pyramidkv``), :class:`DynamicKVPress` (``dynamickv``,
layer-adaptive), :class:`AdaKVPress` (``adakv``, head-adaptive around any press; Ada-SnapKV),
:class:`AdaPyramidPress` (``adapyramid``), ``ada-dynamickv``, :class:`KnormPress` (``knorm``, key
norms) and the :class:`RandomPress` (``random``) and :class:`StreamingLLMPress`
(``streamingllm``) baselines. kvpress's way works too (docs/presses.md):

    press = AdaKVPress(SnapKVPress(compression_ratio=0.8))   # removes 80% = adakv:0.2
    with press(model):                                       # a plain transformers prefill
        model(input_ids, cache=DynamicCache())              # past_key_values= before 5.x
"""

from sparkv.presses.adakv import AdaKVPress, AdaPyramidPress, adaptive_head_budgets
from sparkv.presses.apply import (CompressResult, apply_plan, compress, last, prefill,
                                  question_window, score_layers, to_memory)
from sparkv.presses.base import Budget, PressPlan, Press, PressError, round_to_total
from sparkv.presses.baselines import RandomPress, StreamingLLMPress
from sparkv.presses.dynamickv import DynamicKVPress
from sparkv.presses.hooks import PressHooks
from sparkv.presses.knorm import KnormPress
from sparkv.presses.registry import (PRESSES, PROBES, WINDOWS, canonical_spec, make_press,
                                     parse_press, split_spec)
from sparkv.presses.scoring import ScoreInputs, Window, WindowCapture, pool, window_attention
from sparkv.presses.snapkv import PyramidKVPress, SnapKVPress

__all__ = [
    "AdaKVPress", "AdaPyramidPress", "DynamicKVPress", "KnormPress", "PyramidKVPress",
    "RandomPress", "SnapKVPress", "StreamingLLMPress",
    "adaptive_head_budgets", "CompressResult", "apply_plan", "compress", "last", "prefill",
    "question_window", "score_layers", "to_memory", "Budget", "PressPlan", "Press", "PressError",
    "PressHooks", "round_to_total", "canonical_spec", "split_spec", "PROBES", "WINDOWS",
    "PRESSES", "make_press", "parse_press", "ScoreInputs", "Window", "WindowCapture", "pool",
    "window_attention",
]
