"""The exact MILP of paper IV-B (eqs. 1-5) with the corrected token dependency, solved by CBC.

Stages ``k = 0..K-1``. Binary ``xc[s, k]``: layer step ``s`` computed in stage ``k``; binary
``xs[c, k]``: chunk ``c`` streamed in stage ``k``. Continuous ``D_k``: the stage's duration.

* objective (1): ``min sum_k D_k`` with ``D_k >= sum_c t_stream(c) xs[c, k]`` and
  ``D_k >= sum_s t_comp(s) xc[s, k]`` (plus the constant question prefill);
* coverage (2): every chunk exactly once: ``sum_k xs[c, k] + sum_k xc[step(c), k] = 1``;
* readiness (3)-(5), corrected:

  - layer: ``xc[(t,l), k] <= sum_{k' <= k} xc[(t,l-1), k']`` (``l > 0``): the hidden state comes only
    from a computed step; a stage's computation runs serially, so the same stage is fine;
  - token, for ``l < L-1``: ``xc[(t,l), k] <= A[(t',l,g), k]`` for **every** ``t' < t`` and ``g``,
    ``A = sum_{k' <= k} xc[(t',l), k'] + sum_{k' < k} xs[(t',l,g), k']``: a chunk streamed in stage
    ``k`` is only known to be there from stage ``k+1`` (the paper's ``r_tok`` checks only ``t-1`` and
    counts same-stage streams). The "every ``t'``" is linear in the number of token chunks through
    prefix variables ``P[t,l,k] <= P[t-1,l,k]``, ``P[t,l,k] <= A[(t,l,g),k]``,
    ``xc[(t,l),k] <= P[t-1,l,k]``.

``t_stream(c)`` is at the cheapest allowed level (the TTFT-optimal level; quality upgrades are the
greedy's separate, TTFT-neutral pass). The plan computes stage by stage (within a stage, token
chunk then layer, a valid order) and streams stage by stage, the chunks computed steps need first.
Reported in ``plan.info``: CBC's status, objective, best bound and relative gap (from CBC's log), the
solve time, the model size.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from sparkv.scheduler.instance import Instance
from sparkv.scheduler.plan import Plan
from sparkv.scheduler.planners.base import Planner, PlannerError, make_plan, \
    stream_order_for_compute
from sparkv.scheduler.simulator import estimate_ttft


class Milp(Planner):
    """The exact stage MILP (module docstring), for small instances: an oracle, not for the device.

    Args:
        stages: ``K``, the number of decision stages.
        time_limit_s: CBC's wall-clock limit; at the limit the best solution found is returned and
            ``info["status"]`` says so, with the gap.
        gap_rel: relative gap at which CBC may stop (0: prove optimality).
        threads: CBC threads.
        warm_start: ``"none"`` or ``"stream"`` (start from "stream everything in stage 0", which
            guarantees a solution at the time limit).
    """

    name = "milp"

    def __init__(self, stages: int = 3, time_limit_s: float = 120.0, gap_rel: float = 0.0,
                 threads: int = 1, warm_start: str = "stream"):
        if stages < 1:
            raise ValueError("stages must be >= 1")
        self.stages = stages
        self.time_limit_s = time_limit_s
        self.gap_rel = gap_rel
        self.threads = threads
        self.warm_start = warm_start

    def _plan(self, inst: Instance) -> Plan:
        model = _StageModel(inst, self.stages)
        if self.warm_start == "stream":
            model.warm_start_streaming()
        n_vars = model.prob.numVariables()
        n_cons = model.prob.numConstraints()
        solve_time, log = self._solve(model)
        info = self._solution_info(model, log)
        compute, stream = model.orders()
        plan = make_plan(inst, compute, stream, info={
            **info, "solve_time_s": solve_time, "stages": self.stages, "variables": n_vars,
            "constraints": n_cons})
        plan.estimated_ttft_s = estimate_ttft(plan, inst)
        return plan

    def _solve(self, model: _StageModel) -> tuple[float, str]:
        """Runs CBC on ``model``: ``(solve seconds, CBC's log)``; raises :class:`PlannerError`
        when CBC itself fails."""
        from sparkv.extras import require

        pulp = require("pulp", feature="the MILP planner")

        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
            # PuLP 3.3 deprecates PULP_CBC_CMD (the bundled CBC) in favour of a separately
            # installed one; the bundled binary is what pyproject's "pulp" provides
            warnings.simplefilter("ignore", DeprecationWarning)
            log_path = os.path.join(tmp, "cbc.log")
            solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=self.time_limit_s,
                                       gapRel=self.gap_rel, threads=self.threads,
                                       warmStart=self.warm_start != "none", logPath=log_path)
            t0 = time.perf_counter()
            try:
                model.prob.solve(solver)
            except pulp.PulpSolverError as e:   # CBC exited with an error (seen on a loaded
                raise PlannerError(                # machine at its time limit)
                    f"MILP found no solution within {self.time_limit_s} s (CBC failed: "
                    f"{str(e).split('/')[0].strip()})") from e
            solve_time = time.perf_counter() - t0
            log = Path(log_path).read_text() if os.path.exists(log_path) else ""
        return solve_time, log

    def _solution_info(self, model: _StageModel, log: str) -> dict[str, object]:
        """CBC's status, objective, bound and gap for ``plan.info`` (the TTFTs include the
        question prefill); raises :class:`PlannerError` without a solution."""
        from sparkv.extras import require

        pulp = require("pulp", feature="the MILP planner")

        prob = model.prob
        status = pulp.LpStatus[prob.status]
        sol_status = pulp.LpSolution.get(prob.sol_status, str(prob.sol_status))
        if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
            raise PlannerError(f"MILP found no solution within {self.time_limit_s} s "
                               f"(status {status}: {sol_status})")
        objective = float(pulp.value(prob.objective))
        bound, gap = _parse_cbc_log(log, objective)
        optimal = prob.sol_status == pulp.LpSolutionOptimal and "Stopped" not in log
        if optimal:
            bound, gap = objective, 0.0 if self.gap_rel == 0 else gap
        suffix = model.inst.t_suffix_s
        return {
            "status": "optimal" if optimal else ("time_limit" if "Stopped" in log else status),
            "solution": sol_status,
            "objective_s": objective + suffix,
            "bound_s": None if bound is None else bound + suffix,
            "gap": gap,
        }


class _StageModel:
    """The stage MILP of one instance (module docstring) as a PuLP problem: ``prob``, the
    binaries ``xc[s, k]`` and ``xs[c, k]`` and the stage durations ``D[k]``. Variables and
    constraints are added in a fixed order with fixed names (CBC's answer depends on both)."""

    def __init__(self, inst: Instance, stages: int):
        from sparkv.extras import require

        pulp = require("pulp", feature="the MILP planner")

        self.inst, self.K = inst, stages
        self.prob = pulp.LpProblem("sparkv_schedule", pulp.LpMinimize)
        if hasattr(self.prob, "add_variable"):     # PuLP >= 3.3
            self._var = self.prob.add_variable
        else:                                      # pragma: no cover - older PuLP
            self._var = pulp.LpVariable
        K, var = stages, self._var
        self.xc = {(s, k): var(f"xc_{s}_{k}", cat="Binary")
                   for s in range(inst.num_steps) for k in range(K)}
        self.xs = {(c, k): var(f"xs_{c}_{k}", cat="Binary")
                   for c in range(inst.num_chunks) for k in range(K)}
        self.D = [var(f"D_{k}", lowBound=0) for k in range(K)]
        self.prob += pulp.lpSum(self.D)
        self._add_stage_durations()
        self._add_coverage()
        self._add_layer_dependency()
        self._add_token_dependency()

    def _add_stage_durations(self) -> None:
        """(1): ``D_k`` covers the stage's streaming and its computation."""
        from pulp import lpSum

        inst, xc, xs = self.inst, self.xc, self.xs
        tc, ts = inst.step_t_comp, inst.min_stream_time
        for k in range(self.K):
            self.prob += self.D[k] >= lpSum(float(ts[c]) * xs[c, k]
                                            for c in range(inst.num_chunks)), f"stream_{k}"
            self.prob += self.D[k] >= lpSum(float(tc[s]) * xc[s, k]
                                            for s in range(inst.num_steps)), f"comp_{k}"

    def _add_coverage(self) -> None:
        """(2): every chunk exactly once, streamed or produced by its computed step."""
        from pulp import lpSum

        K, G = self.K, self.inst.G
        for c in range(self.inst.num_chunks):
            s = c // G
            self.prob += (lpSum(self.xs[c, k] for k in range(K))
                          + lpSum(self.xc[s, k] for k in range(K)) == 1), f"cover_{c}"

    def _add_layer_dependency(self) -> None:
        """A step's hidden state input is computed in its stage or earlier."""
        from pulp import lpSum

        K, L, xc = self.K, self.inst.L, self.xc
        for s in range(self.inst.num_steps):
            if s % L > 0:
                for k in range(K):
                    self.prob += xc[s, k] <= lpSum(xc[s - 1, kk] for kk in range(k + 1)), \
                        f"layer_{s}_{k}"

    def _add_token_dependency(self) -> None:
        """Every earlier token chunk available (computed by stage ``k``, or streamed before it),
        through the prefix variables ``P[t, l, k]``."""
        from pulp import lpSum

        inst, K, xc, xs = self.inst, self.K, self.xc, self.xs
        L, G, n_t = inst.L, inst.G, inst.n_t
        for l in range(L - 1):  # noqa: E741
            for k in range(K):
                prev = None
                for t in range(n_t - 1):  # P for t = n_t-1 is never used
                    s = t * L + l
                    p = self._var(f"P_{t}_{l}_{k}", lowBound=0, upBound=1)
                    comp_by_k = lpSum(xc[s, kk] for kk in range(k + 1))
                    for g in range(G):
                        c = s * G + g
                        self.prob += p <= comp_by_k + lpSum(xs[c, kk] for kk in range(k)), \
                            f"avail_{t}_{l}_{g}_{k}"
                    if prev is not None:
                        self.prob += p <= prev, f"prefix_{t}_{l}_{k}"
                    self.prob += xc[(t + 1) * L + l, k] <= p, f"token_{t + 1}_{l}_{k}"
                    prev = p

    def warm_start_streaming(self) -> None:
        """CBC's starting point: everything streamed in stage 0 (always feasible)."""
        for (c, k), v in self.xs.items():
            v.setInitialValue(1 if k == 0 else 0)
        for v in self.xc.values():
            v.setInitialValue(0)
        self.D[0].setInitialValue(float(self.inst.min_stream_time.sum()))
        for k in range(1, self.K):
            self.D[k].setInitialValue(0.0)

    def orders(self) -> tuple[list[int], list[int]]:
        """The solved plan as ``(compute order, stream order)`` of dense ids: stage by stage
        (within a stage, token chunk then layer); the stream order puts the chunks computed
        steps need first."""
        inst = self.inst
        L, G, n_s, n_c = inst.L, inst.G, inst.num_steps, inst.num_chunks
        stage_c = np.full(n_s, -1)
        stage_s = np.full(n_c, -1)
        for (s, k), v in self.xc.items():
            if (v.value() or 0) > 0.5:
                stage_c[s] = k
        for (c, k), v in self.xs.items():
            if (v.value() or 0) > 0.5:
                stage_s[c] = k
        compute = sorted((s for s in range(n_s) if stage_c[s] >= 0),
                         key=lambda s: (stage_c[s], s // L, s % L))
        # a chunk is streamed iff its step is not computed (coverage), whatever rounding says
        computed = set(compute)
        stream_ids = [c for c in range(n_c) if (c // G) not in computed]
        stream = sorted(stream_ids, key=lambda c: (max(stage_s[c], 0), c))
        return compute, stream_order_for_compute(inst, compute, stream)


def _parse_cbc_log(log: str, objective: float) -> tuple[float | None, float | None]:
    """Best bound and relative gap ``(objective - bound) / objective`` from CBC's final report
    (``None`` if it does not say). Both exclude the question prefill."""
    bound = None
    m = re.search(r"Lower bound:\s*([-\d.eE+]+)", log)
    if m:
        bound = float(m.group(1))
    if bound is not None and objective > 0 and math.isfinite(bound):
        # CBC prints the gap rounded to two decimals: recompute it
        return bound, max(0.0, (objective - bound) / objective)
    m = re.search(r"Gap:\s*([-\d.eE+]+)", log)
    return bound, (float(m.group(1)) if m else None)
