"""A whole question, simulated: manifest download over the link, the planner, the load under the
controller, the question's prefill. The fast way to ask "what would each strategy do on this
trace?" before measuring it for real (``sparkv bench ttft --traces adversarial:N``).

The edge's pipeline (docs/edge.md) in the simulator's terms:

1. every strategy but ``local`` (which holds the token ids) first downloads the manifest and the
   token ids (``manifest_bytes``) over the trace, one RTT plus the bytes; the first plan's link
   prior is the instance's bandwidth (a fresh session's default), capped at that download's
   rate when it was slow, as the edge plans (:func:`~sparkv.scheduler.estimators.start_prior`).
   Meanwhile the prelude of ``sparkv`` (sparkv.edge.prelude) computes the context's first
   layers in local prefill's order, one span a layer over a block of token chunks
   (:data:`PRELUDE_SPAN_TOKENS`); the plan stops it after its span in progress, and the load
   starts then;
2. the strategy's planner runs on the instance at that prior, the prelude's steps priced free;
3. the simulator executes the plan under the strategy's controller on the rest of the trace (the
   prelude's steps in place), then the question's prefill.

Every controller commits spans (:class:`~sparkv.scheduler.rules.CommitSpans`) as the edge's
engine does on every device (sparkv.runtime.device.fused_spans); an instance's ``call_s`` (a
call's fixed cost) is what fragments of a layer pay more than its span.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from sparkv.layout import StepId
from sparkv.scheduler.controller import ControllerConfig
from sparkv.scheduler.estimators import start_prior
from sparkv.scheduler.instance import MBPS, Instance
from sparkv.scheduler.planners import get_planner
from sparkv.scheduler.simulator import simulate
from sparkv.scheduler.trace import Trace

#: the edge's strategies: strategy -> (planner, controller factory) (mirrors sparkv.edge.planning)
STRATEGIES: dict[str, tuple[str, Callable[[], ControllerConfig]]] = {
    "sparkv": ("sparkv", ControllerConfig),
    "local": ("local", ControllerConfig.static),
    "stream": ("stream", ControllerConfig.cachegen),
    "hybrid": ("hybrid", ControllerConfig),
}

#: the strategies that run the prelude (mirrors sparkv.edge.planning.PRELUDE_STRATEGIES)
PRELUDE_STRATEGIES = frozenset({"sparkv"})

#: the prelude's span bound (sparkv.edge.prelude.SPAN_TOKENS) and a prelude step's price in the
#: plan (sparkv.edge.results.PRELUDE_STEP_S)
PRELUDE_SPAN_TOKENS = 4096
PRELUDE_STEP_S = 1e-6


@dataclass
class WhatIf:
    """One simulated question."""

    strategy: str
    ttft_s: float
    manifest_s: float
    prior_mbps: float
    load_s: float
    migrations: int
    bytes_streamed: int
    prelude_steps: int = 0


def manifest_time(trace: Trace, nbytes: int, rtt_s: float) -> tuple[float, float]:
    """``(seconds, measured Bps)`` of downloading ``nbytes`` from time 0 on ``trace``."""
    rtt = trace.rtt_s(0.0, rtt_s)
    end = trace.transfer_end(rtt, nbytes)
    return end, nbytes / max(end - rtt, 1e-6)


def prelude(inst: Instance, seconds: float) -> tuple[list[StepId], float]:
    """The steps the edge's prelude computes while the manifest and the plan take ``seconds``
    (local prefill's spans, each ``call_s`` plus its steps' ``t_comp``; the one in progress at
    ``seconds`` finished), and when the last of them ends (the load starts then)."""
    done: list[StepId] = []
    t = 0.0
    for unit in inst.geometry.layer_spans(PRELUDE_SPAN_TOKENS):
        if t >= seconds:
            break
        t += inst.call_s + sum(inst.comp_time(s) for s in unit)
        done.extend(unit)
    return done, max(t, seconds)


def what_if(strategy: str, inst: Instance, trace: Trace, *, manifest_bytes: int,
            controller: ControllerConfig | None = None, planner: Any = None,
            with_prelude: bool = True, manifest_prior: bool = False) -> WhatIf:
    """The simulated TTFT of ``strategy`` on ``inst`` under ``trace`` (module docstring).
    ``with_prelude``: the prelude runs while the manifest is on its way (the edge's default).
    ``manifest_prior``: the plan's link prior is the manifest download's rate; else the
    edge's: the instance's bandwidth (a fresh session's default), capped by a slow manifest
    (:func:`~sparkv.scheduler.estimators.start_prior`)."""
    planner_name, ctl_factory = STRATEGIES[strategy]
    done: list[StepId] = []
    if strategy == "local":
        offset, prior = 0.0, inst.bandwidth_Bps
    else:
        offset, prior = manifest_time(trace, manifest_bytes, inst.rtt_s)
        prior = (prior if manifest_prior
                 else start_prior(inst.bandwidth_Bps, manifest_bytes, offset))
        if with_prelude and strategy in PRELUDE_STRATEGIES:
            done, offset = prelude(inst, offset)
    run_inst = inst.with_bandwidth(prior)
    if done:
        t_comp = run_inst.t_comp.copy()
        for s in done:
            t_comp[s.t, s.l] = PRELUDE_STEP_S
        run_inst = run_inst.replace(t_comp=t_comp)
    plan = (planner or get_planner(planner_name)).plan(run_inst)
    cfg = (controller or ctl_factory()).with_spans(True)
    sim = simulate(plan, run_inst, trace.after(offset), controller=cfg, done_steps=done)
    return WhatIf(strategy, offset + sim.ttft_s, offset, prior / MBPS, sim.ready_s,
                  len(sim.migrations), sim.bytes_streamed, len(done))


def compare(inst: Instance, trace: Trace, *, manifest_bytes: int,
            strategies: Sequence[str] = ("local", "stream", "hybrid", "sparkv"),
            controllers: dict[str, ControllerConfig] | None = None,
            **options: bool) -> dict[str, WhatIf]:
    """Every strategy on one trace (``options``: :func:`what_if`'s)."""
    controllers = controllers or {}
    return {s: what_if(s, inst, trace, manifest_bytes=manifest_bytes,
                       controller=controllers.get(s), **options) for s in strategies}
