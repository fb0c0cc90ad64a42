"""Running a press on a context's KV memory.

    layers, window, t = prefill(lm, context_ids, window=32)          # question-agnostic window
    memory = to_memory(lm, layers)                                    # a ContextKV (a copy)
    qwin = question_window(lm, memory, question_ids)                  # question-aware window
    result = compress(memory, press, Budget(ratio=0.2), window)       # frees the pruned entries
    greedy_generate(lm, memory, len(context_ids), question_ids)       # attends over what is kept

:func:`compress` scores every layer (:func:`sparkv.presses.scoring.window_attention`), asks the
press for a :class:`~sparkv.presses.base.PressPlan` and applies it with
:meth:`ContextKV.prune_layer <sparkv.cache.ContextKV.prune_layer>`: each layer becomes a ragged
arena holding, per KV head, only what it keeps (the memory's byte account shrinks accordingly).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch

from sparkv.cache import ContextKV, SparkvCache
from sparkv.layout import ChunkGeometry
from sparkv.presses.base import Budget, PressPlan, Press, PressError
from sparkv.presses.scoring import Window, WindowCapture, layer_inputs, layer_kv
from sparkv.runtime.hfcache import model_call, output_cache
from sparkv.runtime.kvcache import LayerKV, from_dynamic_cache, memory_from_layers

if TYPE_CHECKING:
    from sparkv.runtime.model import LoadedModel


@dataclass
class CompressResult:
    """What :func:`compress` did: the plan, the memory's bytes before and after, and seconds
    spent scoring (attention of the window + the press's budgets) and pruning."""

    plan: PressPlan
    bytes_before: int
    bytes_after: int
    score_s: float
    prune_s: float
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.score_s + self.prune_s


@torch.inference_mode()
def prefill(lm: LoadedModel, context_ids: Sequence[int], window: int = 32
            ) -> tuple[LayerKV, Window, float]:
    """The model's full prefill of the context: per-layer ``(K, V)`` ``[1, H, N, D]`` (after
    RoPE), the question-agnostic window (the last ``window`` tokens' queries and keys, per layer)
    and the seconds it took."""
    ids = list(context_ids)
    if not ids:
        raise PressError("the context is empty")
    t0 = time.perf_counter()
    with WindowCapture(lm.model, min(window, len(ids)), 0, inside=True) as cap:
        out = lm.model(input_ids=torch.tensor([ids], device=lm.device), use_cache=True,
                       logits_to_keep=1)
    layers = [(k.contiguous(), v.contiguous()) for k, v in from_dynamic_cache(output_cache(out))]
    return layers, cap.window, time.perf_counter() - t0


def to_memory(lm: LoadedModel, layers: LayerKV, chunk_tokens: int = 256, spare_tokens: int = 0
              ) -> ContextKV:
    """A :class:`ContextKV` holding a copy of ``layers`` (dense arenas)."""
    n = int(layers[0][0].shape[2])
    geometry = ChunkGeometry.from_config(lm.config, n, max(16, min(chunk_tokens, n)))
    return memory_from_layers(layers, geometry, spare_tokens=spare_tokens)


@torch.inference_mode()
def question_window(lm: LoadedModel, memory: ContextKV, question_ids: Sequence[int]) -> Window:
    """The question-aware window: the question's queries and keys per layer, run over the full
    memory (which is left as it was)."""
    ids = list(question_ids)
    if not ids:
        raise PressError("the question is empty")
    n = memory.geometry.num_tokens
    pos = torch.arange(n, n + len(ids), device=lm.device)
    try:
        with WindowCapture(lm.model, None, n, inside=False) as cap:
            model_call(lm.model, input_ids=torch.tensor([ids], device=lm.device),
                       cache=SparkvCache(memory), position_ids=pos[None],
                     cache_position=pos, use_cache=True, logits_to_keep=1)
    finally:
        memory.truncate()
    return cap.window


def last(window: Window, size: int) -> Window:
    """The last ``size`` tokens of a window."""
    if window.pos is None or size >= window.size:
        return window
    return Window([q[:, -size:] for q in window.q], [k[:, -size:] for k in window.k],
                  window.pos[-size:], window.inside, window.scale,
                  [h[-size:] for h in window.hidden])


def press_window(window: Window, press: Press) -> tuple[Window | None, int]:
    """The window a press scores from (the last ``press.window`` tokens of a question-agnostic
    window; a question-aware window whole; ``None`` for a press without a window) and how many
    of the context's last positions it forces (the question-agnostic window's size)."""
    if not window.inside:
        return window, 0
    if press.window == 0:
        return None, 0
    win = last(window, press.window)
    return win, win.size


@torch.inference_mode()
def score_layers(memory: ContextKV, press: Press, window: Window) -> tuple[list[torch.Tensor], int]:
    """Per layer, the press's ``[H, N - forced]`` scores (its ``score_entries`` hook on
    :class:`~sparkv.presses.scoring.ScoreInputs`); and ``forced``, the tail of the context every
    head keeps (the question-agnostic window; 0 for a question-aware one)."""
    g = memory.geometry
    n = g.num_tokens
    win, forced = press_window(window, press)
    if forced > n:
        raise PressError(f"the window ({forced}) is longer than the context ({n})")
    scores = []
    for l in range(g.num_layers):  # noqa: E741
        k, v = layer_kv(memory, l, n)
        inputs = layer_inputs(l, k, v, win, n - forced, press.needs_attention)
        scores.append(press.score_entries(inputs))
    return scores, forced


def apply_plan(memory: ContextKV, plan: PressPlan) -> None:
    """Frees every entry the plan does not keep (each layer becomes a ragged arena)."""
    if len(plan.keep) != memory.geometry.num_layers:
        raise PressError(f"the plan has {len(plan.keep)} layers, the memory "
                         f"{memory.geometry.num_layers}")
    if plan.num_tokens != memory.geometry.num_tokens:
        raise PressError(f"the plan is for {plan.num_tokens} tokens, the memory holds "
                         f"{memory.geometry.num_tokens}")
    for l, keep in enumerate(plan.keep):  # noqa: E741
        memory.prune_layer(l, keep)


def compress(memory: ContextKV, press: Press, budget: Budget | None, window: Window
             ) -> CompressResult:
    """Scores, plans and prunes ``memory`` in place (module docstring). ``budget`` ``None``: the
    press's own (its ``compression_ratio``)."""
    budget = press.resolve_budget(budget)
    before = memory.nbytes
    t0 = time.perf_counter()
    scores, forced = score_layers(memory, press, window)
    plan = press.plan(scores, memory.geometry.num_tokens, budget, forced)
    t1 = time.perf_counter()
    apply_plan(memory, plan)
    t2 = time.perf_counter()
    return CompressResult(plan, before, memory.nbytes, t1 - t0, t2 - t1,
                          {"mode": "agnostic" if window.inside else "aware"})
