"""SparKV's potential-aware greedy heuristic (paper IV-B), with the stage budget ``Delta_t``.

Two queues: ``Q_c``, the compute-ready steps (inputs available or computed earlier), and ``Q_s``, the
chunks not yet loaded. Each stage:

1. **compute phase**: repeatedly take the step with the highest ``w_c`` from ``Q_c``, charge its
   ``t_comp`` to a budget of ``compute_share * Delta_t``, and re-sort ``Q_c`` (computing a step can
   make others ready);
2. **stream phase**: take the chunk with the highest ``w_s`` from ``Q_s`` against a budget of
   ``stream_share * Delta_t``; chunks streamed in stage ``k`` count as available from stage ``k+1``.

until every chunk is covered. Priorities (paper, equal weights by default):

* ``w_c(s) = w_compute / t_comp(s) + w_potential * sum_{s' in A_c(s)} 1 / t_comp(s')``
* ``w_s(c) = w_stream / t_stream(c) + w_potential * sum_{s' in A_s(c)} 1 / t_comp(s')
  + w_tail * tail(c) / mean(t_stream)``

``A_c`` / ``A_s`` are the steps that become compute-ready when ``s`` is computed / ``c`` arrives
(with the corrected dependency: a step needs *every* earlier token chunk of its layer). The ``w_tail``
term is ours (0 gives the paper's priorities): ``tail(c)`` in [0, 1] is the position of ``c``'s step in
the order the compute phase alone would take (a compute-only dry run of the same ``w_c``), so the
link takes chunks from the far end of the compute path's future, as the paper's controller migrates
from the tail of the compute order. Streaming a chunk in the middle of a token chunk's layers
forfeits computing every layer above it (a streamed chunk carries no hidden state), and the attention
cost grows with ``t``: without this term the link takes cheap-to-compute chunks the compute path
needed (measured in docs/scheduler.md).

Knobs: ``compute_share`` > 1 prefers local compute (privacy: less of the context is fetched from
the cloud), ``stream_share`` > 1 prefers streaming (energy: the radio costs less than the
processor); see :meth:`Greedy.privacy` / :meth:`Greedy.energy`.

After the stage loop, a local search (``polish``) moves single steps across the meeting point of the
two paths while the estimated TTFT improves: the stage loop balances the paths only to within about
one step.

Stage budget: ``stage_budget_s`` fixed, or ``None``: try ``Delta_t = T0 / K`` for each ``K`` in
``stage_counts`` (``T0`` = the perfectly balanced time) and keep the plan with the best estimated TTFT
(the shared estimator, :func:`~sparkv.scheduler.simulator.estimate_ttft`).

Joint path + bitrate (``joint_bitrate``): the paths are planned at the cheapest allowed level; then,
for each better level ``v`` (best first), the whole plan is redone with ``v`` as the target level and
kept if its estimated TTFT stays within ``quality_slack`` of the cheapest plan; finally single chunks
are upgraded one level at a time (earliest layers first) while the estimate stays within the slack.
With ``quality_slack = 0`` this only spends link time that would otherwise be idle.
"""

from __future__ import annotations

import heapq
import math
from typing import Any, Sequence

import numpy as np

from sparkv.layout import KVChunkId
from sparkv.scheduler.graph import DepState
from sparkv.scheduler.instance import Instance
from sparkv.scheduler.plan import Plan
from sparkv.scheduler.planners.base import Planner, make_plan, stream_order_for_compute
from sparkv.scheduler.simulator import estimate_ttft, ttft_of


def _stale(pots: list[tuple[float, int] | None], l: int, L: int) -> None:  # noqa: E741, N803
    """Layer ``l``'s state changed: its cached frontier candidate and that of the layer above
    (whose steps wait for ``l``'s outputs) are stale."""
    pots[l] = None
    if l + 1 < L:
        pots[l + 1] = None


class Greedy(Planner):
    """Potential-aware greedy with a stage budget (module docstring)."""

    name = "greedy"

    def __init__(self, stage_budget_s: float | None = None,
                 stage_counts: Sequence[int] = (8, 16, 32, 64), w_compute: float = 1.0,
                 w_stream: float = 1.0, w_potential: float = 1.0, w_tail: float = 16.0,
                 compute_share: float = 1.0, stream_share: float = 1.0,
                 joint_bitrate: bool = True, quality_slack: float = 0.0, polish: bool = True,
                 max_polish_moves: int = 16):
        self.stage_budget_s = stage_budget_s
        self.stage_counts = tuple(stage_counts)
        self.w_compute = w_compute
        self.w_stream = w_stream
        self.w_potential = w_potential
        self.w_tail = w_tail
        self.compute_share = compute_share
        self.stream_share = stream_share
        self.joint_bitrate = joint_bitrate
        self.quality_slack = quality_slack
        self.polish = polish
        self.max_polish_moves = max_polish_moves

    @classmethod
    def privacy(cls, strength: float = 2.0, **kw: Any) -> "Greedy":
        """Prefers local compute: the compute path gets ``strength`` x the stage budget."""
        return cls(compute_share=strength, **kw)

    @classmethod
    def energy(cls, strength: float = 2.0, **kw: Any) -> "Greedy":
        """Prefers streaming: the link gets ``strength`` x the stage budget."""
        return cls(stream_share=strength, **kw)

    # ------------------------------------------------------------------ planning
    def _plan(self, inst: Instance) -> Plan:
        cheap = inst.cheapest_level
        best = self._plan_at_levels(inst, cheap)
        info = {"target_level": None}
        if self.joint_bitrate:
            best, info = self._joint_bitrate(inst, best)
        best.info.update(info)
        return best

    def _plan_at_levels(self, inst: Instance, level_idx: np.ndarray) -> Plan:
        n = inst.num_chunks
        cost = inst.stream_times[np.arange(n), level_idx]
        tail = self._tail(inst) if self.w_tail else None
        if self.stage_budget_s:
            deltas = [self.stage_budget_s]
        else:
            c_tot = float(inst.step_t_comp.sum())
            s_tot = float(cost.sum())
            balanced = c_tot * s_tot / (c_tot + s_tot)
            deltas = [balanced / k for k in self.stage_counts]
        best, best_ttft = None, math.inf
        for delta in deltas:
            compute, stream, stages = self._run(inst, delta, cost, tail)
            stream = stream_order_for_compute(inst, compute, stream)
            ttft = ttft_of(inst, compute, stream, [int(level_idx[c]) for c in stream])
            if ttft < best_ttft - 1e-12:
                best, best_ttft = (compute, stream, stages, delta), ttft
        assert best is not None
        compute, stream, stages, delta = best
        moves = 0
        if self.polish:
            compute, stream, best_ttft, moves = self._polish(inst, compute, stream, level_idx,
                                                             best_ttft)
        plan = make_plan(inst, compute, stream, level_idx, stage_budget_s=delta,
                         info={"stages": stages, "polish_moves": moves})
        plan.estimated_ttft_s = best_ttft
        return plan

    # ------------------------------------------------------------------ polish
    def _polish(self, inst: Instance, compute: list[int], stream: list[int],
                level_idx: np.ndarray, ttft: float) -> tuple[list[int], list[int], float, int]:
        """Local search at the meeting point of the two paths, judged by the estimator.

        The stage loop balances the paths only to within about one step (the last stage's
        granularity). Moves, the best improving one first, until none improves:
        the last step of the compute order that nothing computed needs (with the layer below it
        when it is the last-layer projection) goes to the link; or the next layer of a partly
        computed token chunk (or the first untouched token chunk's layer 0) goes to compute, after
        its inputs and before the computed steps that attend over it. Both keep the plan valid: a
        removed step is a top (its ``Y`` is not used), an added step's inputs are computed earlier
        or streamed.
        """
        L, G, n_t = inst.L, inst.G, inst.n_t
        lv = [int(x) for x in level_idx]
        moves = 0
        for _ in range(self.max_polish_moves):
            comp_set = set(compute)
            cands: list[tuple[list[int], list[int]]] = []   # (steps out of compute, steps in)
            found = 0
            for s in reversed(compute):
                t, l = divmod(s, L)  # noqa: E741
                if l < L - 1 and (s + 1) in comp_set:
                    continue
                cands.append(([s], []))
                if l == L - 1 and l > 0 and (s - 1) in comp_set:
                    cands.append(([s, s - 1], []))
                found += 1
                if found >= 2:
                    break
            height = [0] * n_t
            for s in comp_set:
                t, l = divmod(s, L)  # noqa: E741
                height[t] = max(height[t], l + 1)
            first_empty = True
            for t in range(n_t):
                h = height[t]
                if h >= L:
                    continue
                if h == 0:
                    if not first_empty:
                        continue
                    first_empty = False
                cands.append(([], [t * L + h]))
            best = None
            pos = {s: i for i, s in enumerate(compute)}
            for out, into in cands:
                out_set = set(out)
                c2 = [s for s in compute if s not in out_set]
                if into:
                    # after its inputs, before the computed steps that attend over its KV
                    s_in = into[0]
                    t, l = divmod(s_in, L)  # noqa: E741
                    after = pos.get(s_in - 1, -1) if l > 0 else -1
                    before = len(compute)
                    if l < L - 1:
                        for tp in range(n_t):
                            p_ = pos.get(tp * L + l)
                            if p_ is None:
                                continue
                            if tp < t:
                                after = max(after, p_)
                            elif tp > t:
                                before = min(before, p_)
                    if after >= before:
                        continue
                    c2 = compute[:before] + [s_in] + compute[before:]
                into_chunks = {s * G + g for s in into for g in range(G)}
                s2 = [c for c in stream if c not in into_chunks]
                s2 += [s * G + g for s in reversed(out) for g in range(G)]
                s2 = stream_order_for_compute(inst, c2, s2)
                v = ttft_of(inst, c2, s2, [lv[c] for c in s2])
                if v < ttft - 1e-9 and (best is None or v < best[0]):
                    best = (v, c2, s2)
            if best is None:
                break
            ttft, compute, stream = best
            moves += 1
        return compute, stream, ttft, moves

    # ------------------------------------------------------------------ priorities
    def _wc(self, s: int, dep: DepState, covered: list[bool], inv: list[float]) -> float:
        """``w_c``: own compute rate + rates of the steps computing ``s`` makes ready."""
        L, n_t = dep.L, dep.n_t
        t, l = divmod(s, L)
        w = self.w_compute * inv[s]
        if not self.w_potential:
            return w
        pot = 0.0
        if l + 1 < L and not covered[s + 1] and (l + 1 == L - 1 or dep.frontier[l + 1] >= t):
            pot += inv[s + 1]
        if l < L - 1 and dep.frontier[l] == t:
            t2 = t + 1
            kv = dep.kv_count
            while t2 < n_t and kv[t2 * L + l] == dep.G:
                t2 += 1
            for tt in range(t + 1, min(t2, n_t - 1) + 1):
                s2 = tt * L + l
                if not covered[s2] and (l == 0 or dep.computed[s2 - 1]):
                    pot += inv[s2]
        return w + self.w_potential * pot

    def _ws_potential(self, c: int, fut: DepState, covered: list[bool], inv: list[float]) -> float:
        """Rates of the steps that become ready when chunk ``c`` arrives."""
        L, G, n_t = fut.L, fut.G, fut.n_t
        s = c // G
        t, l = divmod(s, L)
        if l == L - 1 or fut.frontier[l] != t or fut.kv_count[s] != G - 1:
            return 0.0
        t2 = t + 1
        while t2 < n_t and fut.kv_count[t2 * L + l] == G:
            t2 += 1
        pot = 0.0
        for tt in range(t + 1, min(t2, n_t - 1) + 1):
            s2 = tt * L + l
            if not covered[s2] and (l == 0 or fut.computed[s2 - 1]):
                pot += inv[s2]
        return pot

    def _frontier_best(self, fut: DepState, streamed: list[bool], covered: list[bool],
                       inv: list[float], base: list[float], top: int, best_c: int,
                       best_w: float, pots: list[tuple[float, int] | None]) -> tuple[int, float]:
        """The best stream candidate among the frontier chunks (they carry potential) against
        ``(best_c, best_w)``, the heap's top (whose value there is its value here: ``top``
        needs no exclusion). ``pots[l]`` caches layer ``l``'s best frontier candidate
        ``(w, c)`` (``c`` -1: none; ``None``: stale, :meth:`_run` clears a layer whenever its
        state changes): a stream pick reads the layers' cached bests, not every chunk."""
        for l in range(fut.L - 1):  # noqa: E741 - frontier chunks carry potential
            e = pots[l]
            if e is None:
                e = pots[l] = self._layer_best(l, fut, streamed, covered, inv, base)
            w, c = e
            if c >= 0 and (w > best_w or (w == best_w and c < best_c)):
                best_c, best_w = c, w
        return best_c, best_w

    def _layer_best(self, l: int, fut: DepState, streamed: list[bool],  # noqa: E741
                    covered: list[bool], inv: list[float],
                    base: list[float]) -> tuple[float, int]:
        """Layer ``l``'s best frontier chunk ``(w, c)``: its base weight, plus its potential when
        its step misses only it (``kv_count == G - 1``); ``(-inf, -1)`` when none is left."""
        L, G = fut.L, fut.G
        t = fut.frontier[l]
        best_w, best_c = -math.inf, -1
        if t >= fut.n_t:
            return best_w, best_c
        s = t * L + l
        has_potential = fut.kv_count[s] == G - 1
        pot: float | None = None
        avail = fut.chunk_avail
        for c in range(s * G, s * G + G):
            if streamed[c] or avail[c]:
                continue
            w = base[c]
            if has_potential:
                if pot is None:
                    pot = self._ws_potential(c, fut, covered, inv)
                w += self.w_potential * pot
            if w > best_w or (w == best_w and c < best_c):
                best_c, best_w = c, w
        return best_w, best_c

    def _tail(self, inst: Instance) -> np.ndarray:
        """Per chunk: position in [0, 1] of its step in a compute-only dry run of ``w_c``."""
        L, G, n_t = inst.L, inst.G, inst.n_t
        inv = [1.0 / x for x in inst.step_t_comp.tolist()]
        dep = DepState(n_t, L, G)
        covered = [False] * inst.num_steps
        ready = {s for s in range(inst.num_steps) if dep.ready(s)}
        rank = np.zeros(inst.num_steps)
        k = 0
        while ready:
            s = max(ready, key=lambda x: (self._wc(x, dep, covered, inv), -x))
            ready.discard(s)
            covered[s] = True
            rank[s] = k
            k += 1
            for s2 in dep.mark_computed(s):
                if not covered[s2] and dep.ready(s2):
                    ready.add(s2)
        rank /= max(1, inst.num_steps - 1)
        return np.repeat(rank, G)

    # ------------------------------------------------------------------ the stage loop
    def _run(self, inst: Instance, delta: float, cost: np.ndarray,
             tail: np.ndarray | None) -> tuple[list[int], list[int], int]:
        L, G, n_t = inst.L, inst.G, inst.n_t
        n_s, n_c = inst.num_steps, inst.num_chunks
        tc = inst.step_t_comp.tolist()
        inv = [1.0 / x for x in tc]
        ts = cost.tolist()
        dep = DepState(n_t, L, G)      # what the compute phase may use (streams of past stages)
        fut = DepState(n_t, L, G)      # including this stage's streams (for A_s)
        covered = [False] * n_s        # computed, or some chunk of it streamed
        streamed = [False] * n_c
        uncovered = n_c
        ready = {s for s in range(n_s) if dep.ready(s)}
        mean_ts = sum(ts) / n_c
        base = [self.w_stream / ts[c] for c in range(n_c)]
        if tail is not None:
            k = self.w_tail / mean_ts
            base = [b + k * float(x) for b, x in zip(base, tail)]
        heap = [(-base[c], c) for c in range(n_c)]
        heapq.heapify(heap)
        pots: list[tuple[float, int] | None] = [None] * L   # per layer: its best frontier chunk
        compute: list[int] = []
        stream: list[int] = []
        stages = 0
        c_budget = delta * self.compute_share
        s_budget = delta * self.stream_share
        c_used = s_used = 0.0
        tax = inst.stream_tax_s
        lost = inst.receive_share
        while uncovered:
            stages += 1
            if not (ready and c_used < stages * c_budget) and not s_used < stages * s_budget:
                stages = _next_active_stage(stages, ready, c_used, c_budget, s_used, s_budget)
            # --- compute phase (budgets are cumulative: stage k ends at k * Delta_t on both
            # paths, so a step that overran the last stage is charged to this one)
            while c_used < stages * c_budget and ready:
                s = max(ready, key=lambda x: (self._wc(x, dep, covered, inv), -x))
                ready.discard(s)
                covered[s] = True
                compute.append(s)
                c_used += tc[s]
                uncovered -= G
                for s2 in dep.mark_computed(s):
                    if not covered[s2] and dep.ready(s2):
                        ready.add(s2)
                fut.mark_computed(s)
                _stale(pots, s % L, L)          # its layer, and the layer above reads it
            # --- stream phase
            pending: list[int] = []
            while s_used < stages * s_budget and uncovered:
                while streamed[heap[0][1]] or fut.chunk_avail[heap[0][1]]:
                    heapq.heappop(heap)
                top = heap[0][1]
                best_c = top
                best_w = base[top] + self.w_potential * self._ws_potential(top, fut, covered, inv)
                if self.w_potential:
                    best_c, best_w = self._frontier_best(fut, streamed, covered, inv, base,
                                                         top, best_c, best_w, pots)
                c = best_c
                streamed[c] = True
                uncovered -= 1
                s = c // G
                if not covered[s]:
                    covered[s] = True
                    ready.discard(s)
                stream.append(c)
                pending.append(c)
                s_used += ts[c]
                c_used += tax + lost * ts[c]    # receiving and decoding it take the cores
                fut.add_chunk(c)
                _stale(pots, s % L, L)
            for c in pending:
                for s2 in dep.add_chunk(c):
                    if not covered[s2] and dep.ready(s2):
                        ready.add(s2)
        return compute, stream, stages

    # ------------------------------------------------------------------ joint bitrate
    def _joint_bitrate(self, inst: Instance, base_plan: Plan) -> tuple[Plan, dict]:
        base_ttft = float(base_plan.estimated_ttft_s or math.inf)
        limit = base_ttft * (1.0 + self.quality_slack) + 1e-9
        allowed = inst.allowed_mask
        ranks = np.array([lv.rank for lv in inst.levels])
        cheap = inst.cheapest_level
        best, target = base_plan, None
        if self.quality_slack > 0:
            # whole-plan target levels, best first: re-plan the path split at that level
            for li in np.argsort(-ranks, kind="stable"):
                if ranks[li] <= ranks[cheap].min():
                    break
                lv = np.where(allowed[:, li], li, cheap)
                plan = self._plan_at_levels(inst, lv)
                if (plan.estimated_ttft_s or math.inf) <= limit:
                    best, target = plan, inst.levels[li].name
                    break
        best = self._upgrade_chunks(inst, best, limit)
        upgraded = sum(1 for c, name in best.levels.items()
                       if name != inst.levels[cheap[inst.chunk_index(c)]].name)
        return best, {"target_level": target, "upgraded_chunks": upgraded,
                      "ttft_before_upgrade_s": base_ttft}

    def _upgrade_chunks(self, inst: Instance, plan: Plan, limit: float) -> Plan:
        """Raises single streamed chunks one level at a time while the estimate stays <= limit."""
        if not plan.stream_order:
            return plan
        names = [lv.name for lv in inst.levels]
        ranks = [lv.rank for lv in inst.levels]
        allowed = inst.allowed_mask
        cur = {c: names.index(plan.levels[c]) for c in plan.stream_order}
        # candidate single-level upgrades: round r raises every chunk by one more level;
        # within a round, earlier layers first (they matter most for quality), then smaller growth
        cands: list[tuple[int, int, int, KVChunkId, int]] = []
        level = dict(cur)
        for rnd in range(len(names)):
            for cid in plan.stream_order:
                c = inst.chunk_index(cid)
                li = level[cid]
                better = [j for j in range(len(names)) if allowed[c, j] and ranks[j] > ranks[li]]
                if not better:
                    continue
                nxt = min(better, key=lambda j: ranks[j])
                grow = int(inst.chunk_bytes[c, nxt] - inst.chunk_bytes[c, li])
                cands.append((rnd, cid.l, grow, cid, nxt))
                level[cid] = nxt
        if not cands:
            return plan
        cands.sort(key=lambda x: x[:3])

        def with_first(k: int) -> Plan:
            lv = dict(cur)
            for _, _, _, cid, nxt in cands[:k]:
                lv[cid] = nxt
            return Plan(plan.compute_order, plan.stream_order,
                        {cid: names[j] for cid, j in lv.items()}, plan.planner,
                        plan.stage_budget_s, None, 0.0, dict(plan.info))

        # quick exit: is the link idle at the end at all?
        lo, hi = 0, len(cands)
        best, best_ttft = plan, float(plan.estimated_ttft_s or math.inf)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            p = with_first(mid)
            ttft = estimate_ttft(p, inst)
            if ttft <= limit:
                lo, best, best_ttft = mid, p, ttft
            else:
                hi = mid - 1
        best.estimated_ttft_s = best_ttft
        return best


def _next_active_stage(stage: int, ready: set[int], c_used: float, c_budget: float,
                       s_used: float, s_budget: float) -> int:
    """The first stage from ``stage`` on where a path has budget left (the compute path only
    with a ready step): the stages before it change nothing, and skipping them gives the same
    plan. Where the steps cost next to nothing (a prelude computed them) and the link is slow,
    the stage length (the balanced split's) is tiny against a chunk's transfer, and the loop
    ran a million empty stages: 10 s to plan at 0.35 Mbit/s (session 71)."""
    nxt = []
    if ready and c_budget > 0:
        nxt.append(math.floor(c_used / c_budget) + 1)
    if s_budget > 0:
        nxt.append(math.floor(s_used / s_budget) + 1)
    return max(stage, min(nxt)) if nxt else stage
