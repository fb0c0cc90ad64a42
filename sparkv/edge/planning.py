"""From a manifest and this device's costs to the scheduler's :class:`Instance`, and the
strategies the edge offers (planner + controller per name).

=========  ===============================  ======================================================
name       planner                          controller
=========  ===============================  ======================================================
sparkv     ``Portfolio``: the load starts   adaptive (migrations both ways, prefetch, cancellation)
           by its best structured plan;
           the greedy's plan (dependency-
           and potential-aware) is handed
           over when it wins under the
           controller (``hands_over``)
local      ``LocalOnly``                    static; no network at all when the tokens are known
stream     ``StreamOnly`` (CacheGen)        per-chunk level from the measured rate and the SLO
hybrid     ``StrongHybrid`` (Cake)          adaptive (the meeting point moves)
=========  ===============================  ======================================================
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from sparkv.errors import SparkvError
from sparkv.layout import ChunkGeometry, KVChunkId
from sparkv.protocol import Manifest
from sparkv.scheduler.controller import ControllerConfig
from sparkv.scheduler.instance import DEFAULT_LEVELS, MBPS, Instance
from sparkv.scheduler.plan import Plan
from sparkv.scheduler.rules import CommitSpans

if TYPE_CHECKING:
    import torch

    from sparkv.predictor.cost import StepCostModel
    from sparkv.runtime.compute import ComputeConfig
    from sparkv.runtime.model import LoadedModel

#: strategy -> (planner registry name, controller configuration factory)
STRATEGIES: dict[str, tuple[str, Callable[[], ControllerConfig]]] = {
    "sparkv": ("sparkv", ControllerConfig),
    "local": ("local", ControllerConfig.static),
    "stream": ("stream", ControllerConfig.cachegen),
    "hybrid": ("hybrid", ControllerConfig),
}

#: strategies whose ask computes the first layer steps while the manifest and the plan are on
#: their way (:mod:`sparkv.edge.prelude`): sparkv's start-up overlap. The baselines wait for the
#: manifest as published (Cake plans its split from the context's metadata; CacheGen streams)
PRELUDE_STRATEGIES: frozenset[str] = frozenset({"sparkv"})

#: decode throughput (million values/s, one core, this machine: bench/results/codec.json)
DECODE_MVPS: dict[str, float] = {"raw": 1100.0, "q8": 200.0, "q6": 250.0, "q5": 300.0,
                                 "q4": 300.0, "q3": 350.0, "q2": 480.0}
#: the floor without a measured quality table (docs/quality.md)
DEFAULT_FLOOR = "q5"
#: ``quality_floor="auto"`` (what ``ask`` does with no flags): the floor of the model's measured
#: quality table (:mod:`sparkv.predictor.quality`), :data:`DEFAULT_FLOOR` when there is none
AUTO_FLOOR = "auto"
DEFAULT_PRIOR_MBPS = 50.0


class AskError(SparkvError):
    """The question cannot be answered as asked (an unknown strategy or level, the server
    unreachable while the context is not on this device, ...)."""


class FloorNotEncoded(AskError):
    """No level at or above the quality floor was encoded for the context."""


def default_quality_floor(model_fingerprint: str, path: Any = None) -> str:
    """The default policy's quality floor for this model: the lowest level its measured quality
    table allows under the policy's thresholds (``POLICY_THRESHOLDS``: pass-key parity, QA
    teacher-forced agreement >= 0.99; with the decision rule's verdicts, a version 2 table: the
    cheapest level whose verdict passes, every better level passing too; ``raw`` when no lossy
    level passes), else :data:`DEFAULT_FLOOR`. A missing table falls back silently, an unreadable one or one of
    another codec with a warning: answering never depends on it (docs/quality.md)."""
    from sparkv.predictor.quality import POLICY_THRESHOLDS, quality_floor_for

    return quality_floor_for(model_fingerprint, fallback=DEFAULT_FLOOR, path=path,
                             **POLICY_THRESHOLDS)


def default_backend(model_fingerprint: str, path: Any = None,
                    compute: ComputeConfig | None = None) -> str:
    """The default policy's attention backend (``backend="auto"``): what ``auto`` resolves to on
    this machine when the model's quality table lets it, else ``dense`` (exact, the reference's
    attention). With the decision rule's verdict for that backend (a version 2 table), only
    ``pass`` lets it (``fail`` and ``undecided`` give ``dense``); without one, the policy's
    thresholds as before: ``dense`` when the backend misses them while ``dense`` meets them.
    ``auto`` without a table (or without that backend in it).

    ``compute`` (the model's :class:`~sparkv.runtime.compute.ComputeConfig`): one whose attention
    products run in bf16 (``mixed-attn``) gets ``dense`` where ``auto`` is block-sparse: with
    the products that cheap the block-sparse backend's own work (the prediction, the key
    gathers, the merge) costs more than it saves (measured on an AMX CPU: 1.06x dense at 4K,
    1.16x at 8K; float32 0.94x and 0.88x; docs/dtypes.md), and dense is what its verdict
    measured."""
    from sparkv.predictor.quality import (POLICY_THRESHOLDS, PASS, allowed_backends_for,
                                          verdict_for)
    from sparkv.runtime.attention import get_backend

    auto = get_backend("auto").name
    if auto == "dense":
        return "auto"
    if auto == "block_sparse" and compute is not None and compute.attention is not None:
        return "dense"
    verdict = verdict_for(model_fingerprint, "backends", auto, path)
    if verdict is not None:
        return "auto" if verdict == PASS else "dense"
    allowed = allowed_backends_for(model_fingerprint, path, **POLICY_THRESHOLDS)
    if allowed is None:
        return "auto"
    return "dense" if auto not in allowed and "dense" in allowed else "auto"


def effective_floor(present: Any, quality_floor: str | None) -> str | None:
    """The floor to plan with: the lowest of the ``present`` levels whose quality rank is at or
    above ``quality_floor``'s (the floor itself when it was encoded). ``None``: no floor. Raises
    :class:`FloorNotEncoded` when no present level meets it, :class:`AskError` for an unknown
    floor."""
    if quality_floor is None:
        return None
    rank = {lv.name: lv.rank for lv in DEFAULT_LEVELS}
    if quality_floor not in rank:
        raise AskError(f"unknown quality floor {quality_floor!r}; levels are {list(rank)}")
    ok = [lv for lv in present if rank.get(lv, -1) >= rank[quality_floor]]
    if not ok:
        raise FloorNotEncoded(f"no level at or above the quality floor {quality_floor!r} was "
                              f"encoded for this context (it has {sorted(present)})")
    return min(ok, key=lambda lv: rank[lv])


_COST_MODELS: dict[tuple[str, str, str, int], StepCostModel] = {}


def device_cost_model(lm: LoadedModel) -> StepCostModel:
    """The step-cost model for this device: the profiled :class:`LatencyModel` when
    ``sparkv profile`` has been run here, else a :class:`Roofline` from measured peaks. Made once
    per model and thread count in a process (measuring peaks takes a moment)."""
    import torch

    from sparkv.predictor.device import compute_name

    key = (lm.fingerprint, str(lm.device), compute_name(lm), torch.get_num_threads())
    if key not in _COST_MODELS:
        _COST_MODELS[key] = _load_cost_model(lm)
    return _COST_MODELS[key]


def _load_cost_model(lm: LoadedModel) -> StepCostModel:
    """This device's latency profile for ``lm``'s configuration and thread count when one
    matches; otherwise the model's own steps measured now (:class:`~sparkv.predictor.measured.
    MeasuredSteps`: a Roofline from a synthetic matmul's peak predicted SmolLM2's local
    prefill 2.8-3.1x too slow, docs/predictor.md); on a device whose engine runs spans
    (a GPU) each step pays its share of the span's fixed cost."""
    from sparkv.predictor.commands import default_model_path
    from sparkv.predictor.device import compute_name
    from sparkv.predictor.measured import MeasuredSteps
    from sparkv.predictor.model import LatencyModel, load_predictor
    from sparkv.runtime.device import fused_spans

    path = default_model_path(lm.base_fingerprint, lm.device, compute_name(lm))
    if path.is_file():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = load_predictor(path, lm=lm)
            if isinstance(model, LatencyModel):
                return model
        except SparkvError:
            pass
    spans = CommitSpans().max_tokens if fused_spans(lm.device) else None
    return MeasuredSteps.measure(lm).with_spans(spans)


def decode_seconds(geometry: ChunkGeometry, cid: KVChunkId, level: str) -> float:
    """Predicted decode time of one frame on the decode worker."""
    return _decode_seconds(geometry.chunk_values(cid), level)


def _decode_seconds(values: int, level: str) -> float:
    return 2e-4 + values / (DECODE_MVPS.get(level, 250.0) * 1e6)


def recent_floor_above(present: Any, floor: str | None, steps: int = 1) -> str | None:
    """The floor of the chunk next to the question under the recent-chunk rule: the ``steps``-th
    present level above ``floor`` in quality rank (the best present level when there are fewer
    above it); ``None`` when nothing present is above ``floor`` (or no floor / ``steps`` <= 0:
    the rule is off)."""
    if floor is None or steps <= 0:
        return None
    rank = {lv.name: lv.rank for lv in DEFAULT_LEVELS}
    above = sorted((lv for lv in present if rank.get(lv, -1) > rank.get(floor, 1 << 30)),
                   key=lambda lv: rank[lv])
    return above[min(steps, len(above)) - 1] if above else None


def replanner(strategy: str) -> Callable[[Instance], Plan]:
    """``strategy``'s planner as the controller's re-plan at the measured link rate calls it
    (:class:`~sparkv.scheduler.rules.Replan`): its first plan where it makes one (about a
    millisecond: the call runs on the link's thread, under the engine's lock), else its plan."""
    from sparkv.scheduler.planners import get_planner

    planner = get_planner(STRATEGIES[strategy][0])
    first = getattr(planner, "first", None)
    return first if first is not None else planner.plan


def build_instance(manifest: Manifest, t_comp: np.ndarray, bandwidth_Bps: float, *,
                   levels: Sequence[str] | None = None, quality_floor: str | None = DEFAULT_FLOOR,
                   rtt_s: float = 0.0, t_suffix_s: float = 0.0,
                   recent_boost: int = 0, stream_tax_s: float = 0.0,
                   receive_tax: float = 0.0, decode_scale: float = 1.0) -> Instance:
    """The scheduler's instance for a manifest: exact frame sizes, predicted compute times.

    ``recent_boost`` > 0 turns on the recent-chunk rule (docs/quality.md): the last token chunk,
    next to the question, may only be streamed ``recent_boost`` encoded levels above the floor
    (:func:`recent_floor_above`; it may still be computed). Off by default; ignored with an
    explicit level list. ``stream_tax_s`` and ``receive_tax``: :attr:`Instance.stream_tax_s`
    and :attr:`Instance.receive_tax` (what the session learned); ``decode_scale``: the
    session's measured over nominal decode time, applied to every ``t_proc``."""
    g = manifest.chunk_geometry
    allowed = set(levels) if levels else set(manifest.levels)
    sizes = {cid: {lv: b for lv, b in s.items() if lv in allowed}
             for cid, s in manifest.sizes.items()}
    if not any(sizes.values()):
        raise AskError(f"none of the levels {sorted(allowed)} was encoded for this context "
                       f"(it has {list(manifest.levels)})")
    known = {lv.name for lv in DEFAULT_LEVELS}
    present = {lv for s in sizes.values() for lv in s}
    if present - known:
        raise AskError(f"unknown levels {sorted(present - known)}")
    # an explicit level list is its own floor
    floor = None if levels else effective_floor(present, quality_floor)
    if recent_boost < 0:
        raise AskError(f"recent_boost must be >= 0, got {recent_boost}")
    last = {lv for cid, s in sizes.items() if cid.t == g.num_token_chunks - 1 for lv in s}
    recent = recent_floor_above(last, floor, recent_boost)
    t_proc = {cid: {lv: _decode_seconds(n, lv) * decode_scale for lv in s}
              for cid, s in sizes.items() for n in (g.chunk_values(cid),)}
    step_t = {s: float(t_comp[s.t, s.l]) for s in g.step_ids()}
    inst = Instance.from_mappings(g, sizes, step_t, bandwidth_Bps, t_proc=t_proc, rtt_s=rtt_s,
                                  t_suffix_s=t_suffix_s, quality_floor=floor,
                                  name=f"{manifest.context_id[:8]}-{g.num_tokens}tok")
    return inst.replace(recent_floor=recent, stream_tax_s=stream_tax_s, receive_tax=receive_tax)


def local_instance(geometry: ChunkGeometry, t_comp: np.ndarray, t_suffix: float) -> Instance:
    """An instance with nothing to stream (the server is out of reach)."""
    sizes = {cid: {"raw": 1} for cid in geometry.chunk_ids()}
    step_t = {s: float(t_comp[s.t, s.l]) for s in geometry.step_ids()}
    return Instance.from_mappings(geometry, sizes, step_t, 1.0 * MBPS, t_suffix_s=t_suffix,
                                  name="local")


def suffix_estimate(t_comp: np.ndarray, geometry: ChunkGeometry, n: int) -> float:
    """Question prefill ~ a layer step of ``n`` query tokens at the context's end, every layer."""
    last = t_comp[-1, :-1].sum() if t_comp.shape[1] > 1 else t_comp[-1].sum()
    return float(last) * max(n, 1) / max(geometry.chunk_len(geometry.num_token_chunks - 1), 1) \
        + 0.01
