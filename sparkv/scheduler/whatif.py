"""A whole question, simulated: manifest download over the link, the planner, the load under the
controller, the question's prefill. The fast way to ask "what would each strategy do on this
trace?" before measuring it for real (``sparkv bench ttft --traces adversarial:N``).

The edge's pipeline (docs/edge.md) in the simulator's terms:

1. every strategy but ``local`` (which holds the token ids) first downloads the manifest and the
   token ids (``manifest_bytes``) over the trace, one RTT plus the bytes; the first plan's link
   prior is that download's rate, as the edge measures it;
2. the strategy's planner runs on the instance at that prior;
3. the simulator executes the plan under the strategy's controller on the rest of the trace,
   then the question's prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from sparkv.scheduler.controller import ControllerConfig
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


def manifest_time(trace: Trace, nbytes: int, rtt_s: float) -> tuple[float, float]:
    """``(seconds, measured Bps)`` of downloading ``nbytes`` from time 0 on ``trace``."""
    rtt = trace.rtt_s(0.0, rtt_s)
    end = trace.transfer_end(rtt, nbytes)
    return end, nbytes / max(end - rtt, 1e-6)


def what_if(strategy: str, inst: Instance, trace: Trace, *, manifest_bytes: int,
            controller: ControllerConfig | None = None, planner: Any = None) -> WhatIf:
    """The simulated TTFT of ``strategy`` on ``inst`` under ``trace`` (module docstring)."""
    planner_name, ctl_factory = STRATEGIES[strategy]
    if strategy == "local":
        offset, prior = 0.0, inst.bandwidth_Bps
    else:
        offset, prior = manifest_time(trace, manifest_bytes, inst.rtt_s)
    run_inst = inst.with_bandwidth(prior)
    plan = (planner or get_planner(planner_name)).plan(run_inst)
    sim = simulate(plan, run_inst, trace.after(offset), controller=controller or ctl_factory())
    return WhatIf(strategy, offset + sim.ttft_s, offset, prior / MBPS, sim.ready_s,
                  len(sim.migrations), sim.bytes_streamed)


def compare(inst: Instance, trace: Trace, *, manifest_bytes: int,
            strategies: Sequence[str] = ("local", "stream", "hybrid", "sparkv"),
            controllers: dict[str, ControllerConfig] | None = None) -> dict[str, WhatIf]:
    """Every strategy on one trace."""
    controllers = controllers or {}
    return {s: what_if(s, inst, trace, manifest_bytes=manifest_bytes,
                       controller=controllers.get(s)) for s in strategies}
