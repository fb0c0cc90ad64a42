"""Calibrating block-sparse thresholds per layer (and head) against an error bound.

For each calibration prompt the model is prefilled with the layer stepper, every layer's attention
computed densely (so each layer is judged on the inputs it really gets). At each attention call
of a long enough chunk, every candidate ``(cdf, sim)`` pair runs block-sparse on the same
``q, k, v``; its error is the relative L1 of the output against dense,
``sum |o - o_dense| / sum |o_dense|``, per query head. Per layer and self-similarity threshold,
each head takes the lowest cdf whose worst error over all calls stays within ``eps``; the layer
takes the threshold whose heads keep the fewest blocks. Per-head cdfs are kept only where they
keep fewer blocks than one cdf for the whole layer (``per_head="auto"``).

A verification pass then runs the chosen thresholds as the runtime will (the kept set of a GQA
group is the union of its heads') and raises a layer that misses the bound to the next, more
conservative candidates, up to dense (cdf 1.0). The result meets ``eps`` on the prompts it was
calibrated on, by construction; how it transfers is what the quality table checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from sparkv.runtime.attention import (AttentionStats, BlockSparseAttention, DenseAttention,
                                      SparsityConfig, check_shapes, causal_block_count)
from sparkv.runtime.model import LoadedModel
from sparkv.runtime.stepper import LayerStepper
from sparkv.runtime.thresholds import LayerThresholds, SparseThresholds

DEFAULT_CDFS = (0.6, 0.75, 0.85, 0.92, 0.96, 0.98)
DEFAULT_SIMS = (0.1, 0.2, 0.35)


def relative_l1(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per query head, ``sum |out - ref| / sum |ref|`` over batch, queries and dims (``[Hq]``)."""
    diff = (out.float() - ref.float()).abs().sum(dim=(0, 2, 3))
    return diff / ref.float().abs().sum(dim=(0, 2, 3)).clamp_min(1e-30)


@dataclass
class _Tally:
    """Per layer and candidate: worst per-head error, kept and visible block counts."""

    error: dict[tuple[float, float], torch.Tensor] = field(default_factory=dict)
    kept: dict[tuple[float, float], torch.Tensor] = field(default_factory=dict)
    visible: int = 0

    def add(self, key: tuple[float, float], err: torch.Tensor, stats: AttentionStats) -> None:
        kept = stats.active_blocks.float()
        if key in self.error:
            self.error[key] = torch.maximum(self.error[key], err)
            self.kept[key] = self.kept[key] + kept
        else:
            self.error[key], self.kept[key] = err, kept


class _Probe:
    """The calibration backend of one layer: dense output, candidates measured on the side."""

    name = "dense"

    def __init__(self, owner: "_Calibration", layer: int) -> None:
        self.owner, self.layer = owner, layer

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int,
               scale: float | None = None) -> tuple[torch.Tensor, AttentionStats]:
        out, stats = self.owner.dense.attend(q, k, v, q_offset, scale)
        self.owner.measure(self.layer, q, k, v, q_offset, scale, out)
        return out, stats


class _Calibration:
    """A backend for :class:`LayerStepper` that tallies candidates per layer (``for_layer``)."""

    name = "dense"

    def __init__(self, base: SparsityConfig, candidates: list[tuple[float, float]],
                 chosen: SparseThresholds | None = None) -> None:
        self.base, self.candidates, self.chosen = base, candidates, chosen
        self.dense = DenseAttention()
        self.tallies: dict[int, _Tally] = {}

    def for_layer(self, layer: int) -> _Probe:
        return _Probe(self, layer)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int,
               scale: float | None = None) -> tuple[torch.Tensor, AttentionStats]:
        return self.dense.attend(q, k, v, q_offset, scale)

    def measure(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                q_offset: int, scale: float | None, ref: torch.Tensor) -> None:
        check_shapes(q, k, v, q_offset)
        if q_offset + q.shape[2] <= self.base.dense_below:
            return  # the runtime computes these calls densely: nothing to calibrate
        tally = self.tallies.setdefault(layer, _Tally())
        tally.visible += causal_block_count(q.shape[2], k.shape[2], q_offset) * q.shape[0]
        if self.chosen is not None:
            backends = {(0.0, 0.0): BlockSparseAttention(self.base, thresholds=self.chosen)
                        .for_layer(layer)}
        else:
            backends = {(c, s): BlockSparseAttention(replace(self.base, cdf_threshold=c,
                                                             sim_threshold=s, topk=None))
                        for c, s in self.candidates}
        for key, backend in backends.items():
            out, stats = backend.attend(q, k, v, q_offset, scale)
            tally.add(key, relative_l1(out, ref), stats)


def _choose_layer(tally: _Tally, cdfs: Sequence[float], sims: Sequence[float], eps: float,
                  per_head: str) -> LayerThresholds:
    """The sim threshold and per-head cdfs keeping the fewest blocks within ``eps``."""
    best: LayerThresholds | None = None
    best_kept = float("inf")
    for s in sims:
        heads = next(iter(tally.error.values())).numel()
        per: list[float] = []
        kept = 0.0
        for h in range(heads):
            c = next((c for c in cdfs if float(tally.error[(c, s)][h]) <= eps), 1.0)
            per.append(c)
            kept += float(tally.kept[(c, s)][h]) if c < 1.0 else tally.visible
        uniform = max(per)
        kept_uniform = sum(float(tally.kept[(uniform, s)][h]) if uniform < 1.0
                           else tally.visible for h in range(heads))
        use_heads = per_head == "always" or (per_head == "auto" and kept < kept_uniform * 0.98)
        cdf, total = (per, kept) if use_heads else ([uniform], kept_uniform)
        if total < best_kept:
            best_kept = total
            best = LayerThresholds(cdf=cdf, sim=s, density=total / max(1, heads * tally.visible))
    assert best is not None
    return best


def _raise(lt: LayerThresholds, cdfs: Sequence[float], sims: Sequence[float]) -> LayerThresholds:
    """The next more conservative settings of a layer that missed the bound."""
    up = [next((c for c in cdfs if c > x), 1.0) for x in lt.cdf]
    sim = next((s for s in sims if s > lt.sim), lt.sim)
    return LayerThresholds(cdf=up, sim=sim)


def _run(lm: LoadedModel, prompts: Sequence[Sequence[int]], chunk_tokens: int,
         backend: _Calibration) -> dict[int, _Tally]:
    with torch.inference_mode():
        for ids in prompts:
            LayerStepper(lm, ids, chunk_tokens, backend).complete()
    return backend.tallies


def measure_errors(lm: LoadedModel, prompts: Sequence[Sequence[int]],
                   thresholds: SparseThresholds, chunk_tokens: int = 1024,
                   config: SparsityConfig | None = None) -> dict[int, tuple[float, float]]:
    """Per layer, ``(worst relative L1 error of any call, density)`` of ``thresholds`` as the
    runtime runs them, on dense inputs (each layer judged alone)."""
    probe = _Calibration(config or SparsityConfig(), [], chosen=thresholds)
    out: dict[int, tuple[float, float]] = {}
    for layer, tally in _run(lm, prompts, chunk_tokens, probe).items():
        err, kept = tally.error[(0.0, 0.0)], tally.kept[(0.0, 0.0)]
        heads = kept.numel()
        # a layer's error: the heads' errors weighted by their output mass is at most the worst
        out[layer] = (float(err.max()), float(kept.sum()) / max(1, heads * tally.visible))
    return out


def calibrate_thresholds(lm: LoadedModel, prompts: Sequence[Sequence[int]], eps: float = 0.05,
                         chunk_tokens: int = 1024, cdfs: Sequence[float] = DEFAULT_CDFS,
                         sims: Sequence[float] = DEFAULT_SIMS, per_head: str = "auto",
                         config: SparsityConfig | None = None, rounds: int = 3,
                         ) -> SparseThresholds:
    """Thresholds for ``lm`` meeting ``eps`` (relative L1 per call and head) on ``prompts``.

    Args:
        prompts: token ids of each calibration prompt (long enough to exceed ``dense_below``).
        eps: the error bound.
        cdfs, sims: candidate cdf and self-similarity thresholds (ascending).
        per_head: ``auto`` (per-head cdfs where they keep fewer blocks), ``always`` or ``never``.
        config: the base settings (estimator, block rules); default ``SparsityConfig()``.
        rounds: verification rounds before a failing layer falls back to dense.
    """
    if not prompts:
        raise ValueError("calibration needs at least one prompt")
    if per_head not in ("auto", "always", "never"):
        raise ValueError(f"per_head must be auto, always or never, not {per_head!r}")
    base = config or SparsityConfig()
    cdfs, sims = sorted(cdfs), sorted(sims)
    tallies = _run(lm, prompts, chunk_tokens,
                   _Calibration(base, [(c, s) for c in cdfs for s in sims]))
    layers = [_choose_layer(tallies[i], cdfs, sims, eps, per_head) if i in tallies
              else LayerThresholds(cdf=[1.0], sim=max(sims))
              for i in range(int(lm.config.num_hidden_layers))]
    th = SparseThresholds(str(lm.fingerprint), eps, layers,
                          {"estimator": base.estimator, "prompts": [len(p) for p in prompts],
                           "chunk_tokens": chunk_tokens, "dtype": str(lm.dtype),
                           "cdfs": list(cdfs), "sims": list(sims), "per_head": per_head})
    return _verify(lm, prompts, th, chunk_tokens, base, cdfs, sims, rounds)


def _verify(lm: LoadedModel, prompts: Sequence[Sequence[int]], th: SparseThresholds,
            chunk_tokens: int, base: SparsityConfig, cdfs: Sequence[float],
            sims: Sequence[float], rounds: int) -> SparseThresholds:
    """Measures ``th`` as the runtime runs it; raises failing layers (dense after ``rounds``)."""
    for attempt in range(rounds + 1):
        measured = measure_errors(lm, prompts, th, chunk_tokens, base)
        failing = [i for i, (err, _) in measured.items() if err > th.eps]
        for i, (err, density) in measured.items():
            th.layers[i].error, th.layers[i].density = err, density
        if not failing:
            break
        for i in failing:
            lt = th.layers[i]
            th.layers[i] = (_raise(lt, cdfs, sims) if attempt < rounds  # dense: exact
                            else LayerThresholds(cdf=[1.0], sim=lt.sim, error=0.0, density=1.0))
        if attempt == rounds:
            break
    th.meta["verified"] = True
    return th


def summary(th: SparseThresholds) -> list[dict[str, Any]]:
    """One row per layer: cdf (min/max over heads), sim, error, density."""
    return [{"layer": i, "cdf_min": min(lt.cdf), "cdf_max": max(lt.cdf),
             "per_head": len(lt.cdf) > 1, "sim": lt.sim, "error": lt.error,
             "density": lt.density} for i, lt in enumerate(th.layers)]
