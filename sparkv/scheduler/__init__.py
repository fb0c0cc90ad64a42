"""The KV chunk scheduler: decide per chunk whether to stream it or compute it, then keep the decision
right while loading (docs/scheduler.md).

Pure Python + numpy (PuLP/CBC for the MILP oracle, SciPy for the LP bound); no torch.

Typical use on the device::

    inst = Instance.from_mappings(geometry, sizes_from_manifest, t_comp_from_predictor, bw_Bps, ...)
    plan = Greedy().plan(inst)            # or get_planner("greedy")
    validate_plan(plan, inst)             # raises PlanError naming the problem
    ctl = Controller(plan, inst)          # the engine drives it: next_step / next_fetch / events
    timeline = simulate(plan, inst, Trace.sample("lte"), controller=ControllerConfig())
"""

from sparkv.scheduler.bounds import lp_bound, lp_dep_bound
from sparkv.scheduler.controller import Controller, ControllerConfig, Fetch
from sparkv.scheduler.estimators import ComputeEstimator, LinkEstimator
from sparkv.scheduler.graph import (DepState, PlanError, layer_dependency, plan_problems,
                                    token_dependencies, validate_plan)
from sparkv.scheduler.instance import (DEFAULT_LEVELS, MBPS, SMOLLM2_135M_CPU, CostProfile, Instance,
                                       InstanceError, StreamLevel, synthetic_instance)
from sparkv.scheduler.plan import Plan
from sparkv.scheduler.planners import (PLANNERS, Greedy, LocalOnly, Milp, Planner, PlannerError,
                                       StreamOnly, StrongHybrid, get_planner)
from sparkv.scheduler.rules import (CommitColumns, CommitSpans, DeadLink, LayerFirst, PlanOrder,
                                    Prefetch, ProbeIdleLink, ReadyFirst, Rebalance,
                                    RecomputeColumns, SloLevels, ToCompute, ToStream)
from sparkv.scheduler.simulator import (ComputeNoise, SimulationError, Timeline, TransferRecord,
                                        estimate_ttft, simulate)
from sparkv.scheduler.state import LoadState, Migration
from sparkv.scheduler.trace import SAMPLE_TRACES, Trace, TraceError, make_sample_trace

__all__ = [
    "DEFAULT_LEVELS", "MBPS", "PLANNERS", "SAMPLE_TRACES", "SMOLLM2_135M_CPU", "CommitColumns",
    "CommitSpans", "ComputeEstimator", "ComputeNoise", "Controller", "ControllerConfig", "CostProfile", "DeadLink",
    "DepState", "Fetch", "Greedy", "Instance", "InstanceError", "LinkEstimator", "LoadState",
    "LayerFirst", "LocalOnly", "Migration", "Milp", "Plan", "PlanError", "PlanOrder", "Planner", "PlannerError", "Prefetch",
    "ProbeIdleLink", "ReadyFirst", "Rebalance", "RecomputeColumns", "SimulationError", "SloLevels",
    "StreamLevel", "StreamOnly", "StrongHybrid", "Timeline", "ToCompute", "ToStream", "Trace",
    "TraceError", "TransferRecord", "estimate_ttft", "get_planner", "layer_dependency",
    "lp_bound", "lp_dep_bound", "make_sample_trace", "plan_problems", "simulate",
    "synthetic_instance", "token_dependencies", "validate_plan",
]
