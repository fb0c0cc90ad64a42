"""The baselines the paper compares against, as planners.

* :class:`LocalOnly`: local prefill, every step computed (chunked prefill, column by column).
* :class:`StreamOnly`: CacheGen-like: every chunk streamed; each chunk's level is the best one whose
  expected completion, with the remaining chunks at the cheapest allowed level, meets the SLO
  (2 s, as in the paper) at the estimated bandwidth. At run time
  :meth:`ControllerConfig.cachegen` re-chooses levels from the measured throughput.
* :class:`StrongHybrid`: Cake: compute token chunks forward from ``t = 0`` (all layers of each),
  stream whole token chunks backward from the last one; the split is where the two paths' finish
  times cross (found with the shared estimator). At run time the generic controller moves the
  meeting point (link behind: the boundary chunk's steps become compute-ready first). Each
  streamed token chunk's layers go bottom up, as Cake loads them; ``top_down=True`` (SparKV's
  candidate, :class:`~sparkv.scheduler.planners.portfolio.Portfolio`) streams them top down, so
  that what the link still holds when it falls behind is the boundary chunk's lowest layers,
  which the controller can move to compute one by one (bottom up, a step whose layer below was
  streamed cannot move: its hidden input was never computed).
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from sparkv.scheduler.instance import Instance
from sparkv.scheduler.plan import Plan
from sparkv.scheduler.planners.base import Planner, make_plan
from sparkv.scheduler.simulator import estimate_ttft


class LocalOnly(Planner):
    """Every layer step computed on the device, token chunk by token chunk."""

    name = "local"

    def _plan(self, inst: Instance) -> Plan:
        plan = make_plan(inst, list(range(inst.num_steps)), [])
        plan.estimated_ttft_s = estimate_ttft(plan, inst)
        return plan


class StreamOnly(Planner):
    """Every chunk streamed, per-chunk level under an SLO (CacheGen)."""

    name = "stream"

    def __init__(self, slo_s: float = 2.0):
        self.slo_s = slo_s

    def _plan(self, inst: Instance) -> Plan:
        n = inst.num_chunks
        order = list(range(n))  # token chunk by token chunk, layers in order
        xfer = inst.transfer_times
        cheap = inst.cheapest_level
        cheap_t = xfer[np.arange(n), cheap]
        rest = float(cheap_t.sum())
        ranks = np.array([lv.rank for lv in inst.levels])
        by_quality = np.argsort(-ranks, kind="stable")
        levels = cheap.copy()
        elapsed = inst.rtt_s
        for c in order:
            rest -= cheap_t[c]
            for li in by_quality:
                if inst.allowed_mask[c, li] and elapsed + xfer[c, li] + rest <= self.slo_s:
                    levels[c] = li
                    break
            elapsed += xfer[c, levels[c]]
        plan = make_plan(inst, [], order, levels, info={"slo_s": self.slo_s})
        plan.estimated_ttft_s = estimate_ttft(plan, inst)
        return plan


class StrongHybrid(Planner):
    """Cake: compute token chunks from the front, stream from the back, meet where rates cross."""

    name = "hybrid"

    def __init__(self, top_down: bool = False) -> None:
        self.top_down = top_down

    def _plan(self, inst: Instance) -> Plan:
        n_t = inst.n_t
        comp_col = inst.t_comp.sum(axis=1)
        stream_col = inst.min_stream_time.reshape(n_t, -1).sum(axis=1)
        # analytic first guess of the split m (columns < m computed), then the estimator around it
        best_m, best_v = 0, float("inf")
        for m in range(n_t + 1):
            v = max(comp_col[:m].sum(), stream_col[m:].sum())
            if v < best_v:
                best_m, best_v = m, v
        best_plan, best_ttft = None, float("inf")
        for m in sorted({max(0, best_m - 1), best_m, min(n_t, best_m + 1)}):
            plan = self._split(inst, m, self.top_down)
            ttft = estimate_ttft(plan, inst)
            if ttft < best_ttft:
                best_plan, best_ttft = plan, ttft
        assert best_plan is not None
        best_plan.estimated_ttft_s = best_ttft
        return best_plan

    @staticmethod
    def _split(inst: Instance, m: int, top_down: bool) -> Plan:
        L, n_t = inst.L, inst.n_t
        compute = [t * L + l for t in range(m) for l in range(L)]  # noqa: E741
        stream = token_chunks_streamed(inst, range(n_t - 1, m - 1, -1), top_down)
        return make_plan(inst, compute, stream, info={"computed_token_chunks": m})


def token_chunks_streamed(inst: Instance, token_chunks: Iterable[int],
                          top_down: bool = False) -> list[int]:
    """The dense chunk indices of whole token chunks, in the order given, each token chunk's
    layers bottom up (``top_down``: top down), its KV groups in order."""
    L, G = inst.L, inst.G
    layers = range(L - 1, -1, -1) if top_down else range(L)
    return [(t * L + l) * G + g for t in token_chunks for l in layers  # noqa: E741
            for g in range(G)]
