"""The re-plan at the link's measured rate (sparkv.scheduler.rules.Replan, Controller's
``planner``): once, when the link delivers far below the plan's rate, the load goes on by a
plan for the measured rate; never otherwise. Driven by the simulator (it checks every step's
inputs and raises on a deadlock), so every time here is simulated."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sparkv.scheduler.controller import Controller, ControllerConfig
from sparkv.scheduler.estimators import LinkEstimator
from sparkv.scheduler.instance import synthetic_instance
from sparkv.scheduler.planners import get_planner
from sparkv.scheduler.rules import Replan
from sparkv.scheduler.simulator import simulate
from sparkv.scheduler.trace import Trace, adversarial_traces, fade_start_trace

MBIT = 1e6 / 8


class Counting:
    """A planner that counts its calls and the link rates it was asked to plan for."""

    def __init__(self, strategy: str = "hybrid", fail: bool = False) -> None:
        planner = get_planner(strategy)
        self._plan = getattr(planner, "first", None) or planner.plan
        self.rates: list[float] = []
        self.fail = fail

    def __call__(self, inst):
        self.rates.append(inst.bandwidth_Bps)
        if self.fail:
            raise RuntimeError("no plan today")
        return self._plan(inst)


@pytest.fixture(scope="module")
def inst():
    """4K tokens in 512-token chunks on this CPU's costs, planned for the 50 Mbit/s prior."""
    return synthetic_instance(4096, chunk_tokens=512, bandwidth_mbps=50.0)


def _run(inst, planner, trace, config=None):
    plan = Counting()._plan(inst)
    ctl = Controller(plan, inst, config or ControllerConfig(), planner=planner)
    return simulate(plan, inst, trace, controller=ctl), ctl


def test_the_rule_judges_once_the_samples_cover_its_span():
    rule, est = Replan(below=1.5, sampled_s=0.3), LinkEstimator(50 * MBIT)
    est.add(0.1, 125_000, 0.1)
    assert rule.measured(est, 0.1) is None                  # 0.1 s sampled: not yet
    est.add(0.3, 0.0, 0.2)                                  # a silence counts as time
    assert rule.measured(est, 0.3) == pytest.approx(125_000 / 0.3)
    est.add(0.4, 600_000, 0.1)                              # ramping up: judged by now's rate
    assert est.run_rate() == pytest.approx(725_000 / 0.4)
    assert rule.measured(est, 0.4) == pytest.approx(600_000 / 0.3) == est.recent(0.4)
    assert rule.wants(10 * MBIT, 50 * MBIT) and not rule.wants(40 * MBIT, 50 * MBIT)
    silent = LinkEstimator(50 * MBIT)
    silent.add(0.5, 0.0, 0.5)
    assert rule.measured(silent, 0.5) is None                    # no byte yet: the dead link's case


def test_a_link_far_below_the_plan_re_plans_once_at_its_rate(inst):
    """10 Mbit/s against a plan for 50: one re-plan, at the measured rate, as soon as the
    samples cover the rule's span; the load then reaches the first token as soon as a plan
    made for 10 Mbit/s would (the controller alone gets back only part of the way)."""
    planner = Counting()
    tl, ctl = _run(inst, planner, Trace.constant(10.0))
    without, _ = _run(inst, None, Trace.constant(10.0))
    known_inst = inst.replace(bandwidth_Bps=10 * MBIT)
    known = simulate(Counting()._plan(known_inst), known_inst, Trace.constant(10.0),
                     controller=ControllerConfig())
    assert planner.rates == [pytest.approx(10 * MBIT, rel=0.02)]
    assert ctl.replanned is not None and ctl.replanned["taken"] and "kept" not in ctl.replanned
    assert 0.3 <= ctl.replanned["time_s"] < 0.5
    assert [m.direction for m in ctl.migrations].count("replan") == 1
    assert ctl.plan.info["replan"]["measured_mbps"] == pytest.approx(10.0, rel=0.02)
    assert tl.ttft_s < 0.95 * without.ttft_s
    assert tl.ttft_s <= 1.02 * known.ttft_s


@pytest.mark.parametrize("mbps", [40.0, 50.0, 200.0])
def test_a_link_that_meets_the_plan_is_judged_and_left_alone(inst, mbps):
    """Within the rule's factor of the plan's rate (or above it) the verdict is no: the
    planner is never called and the load is the one without a planner, event for event."""
    planner = Counting()
    tl, ctl = _run(inst, planner, Trace.constant(mbps))
    without, _ = _run(inst, None, Trace.constant(mbps))
    assert planner.rates == []
    assert ctl.replanned is not None and not ctl.replanned["taken"]
    assert ctl.replanned["kept"] == "link not slower"
    assert tl.ttft_s == without.ttft_s and tl.steps == without.steps


def test_a_load_with_other_asks_bytes_ahead_on_its_link_is_left_to_its_plan(inst):
    """A device service's ask far back on the shared link (``ahead_bytes``: the link plan's
    bytes of the asks before it) measures the others' share, not the link: its verdict is no,
    and the planner is never called; the same ask alone on the link re-plans."""
    planner = Counting()
    plan = Counting()._plan(inst)
    ctl = Controller(plan, inst, ControllerConfig(), planner=planner)
    ctl.state.link_estimator.ahead_bytes = 4e6
    simulate(plan, inst, Trace.constant(10.0), controller=ctl)
    assert planner.rates == [] and ctl.replanned is not None and not ctl.replanned["taken"]
    assert ctl.replanned["kept"] == "others' bytes ahead"
    alone, ctl_alone = _run(inst, Counting(), Trace.constant(10.0))
    assert ctl_alone.replanned["taken"]


def test_the_breakdown_says_a_re_plan_and_a_refused_one_but_not_a_link_that_kept_up():
    """The ask's table names the verdict when it matters: a re-plan taken, or one a slow link
    called for and the load refused (why); a link that met its plan adds no row."""
    from sparkv.edge.answer import Breakdown

    verdict = {"time_s": 0.32, "measured_mbps": 9.8, "planned_mbps": 50.0}
    taken = Breakdown("sparkv", 1.0, replan={**verdict, "taken": True}).table()
    assert "re-planned" in taken and "not re-planned" not in taken and "9.8 Mbit/s" in taken
    ahead = Breakdown("sparkv", 1.0, replan={**verdict, "taken": False,
                                              "kept": "others' bytes ahead"}).table()
    assert "not re-planned" in ahead and "others' bytes ahead" in ahead
    kept_up = Breakdown("sparkv", 1.0, replan={**verdict, "measured_mbps": 45.0, "taken": False,
                                                "kept": "link not slower"}).table()
    assert "re-planned" not in kept_up


def test_a_planner_that_fails_leaves_the_load_to_its_plan(inst):
    planner = Counting(fail=True)
    tl, ctl = _run(inst, planner, Trace.constant(10.0))
    without, _ = _run(inst, None, Trace.constant(10.0))
    assert len(planner.rates) == 1 and "no plan today" in ctl.replanned["error"]
    assert not ctl.replanned["taken"] and tl.ttft_s == without.ttft_s


@pytest.mark.parametrize("config", [ControllerConfig.static(), ControllerConfig.cachegen(),
                                    replace(ControllerConfig(), replan=None)],
                         ids=["static", "cachegen", "off"])
def test_controllers_without_the_rule_never_call_the_planner(inst, config):
    planner = Counting()
    _, ctl = _run(inst, planner, Trace.constant(5.0), config)
    assert planner.rates == [] and ctl.replanned is None


def test_a_handover_after_a_re_plan_is_ignored(inst):
    """The full plan the edge hands over was made for the prior's rate: once the load re-planned
    at the measured one, it keeps that plan."""
    planner = Counting()
    ctl = Controller(Counting()._plan(inst), inst, ControllerConfig(), planner=planner)
    full = get_planner("sparkv").plan(inst)
    tl = simulate(ctl.plan, inst, Trace.constant(10.0), controller=ctl, handover=(1.0, full))
    assert ctl.replanned["taken"] and ctl.plan is not full
    assert "handover" not in [m.direction for m in ctl.migrations]
    assert tl.ttft_s > 0
    assert ctl.adopt(full, 2.0) is False and ctl.plan is not full   # the caller is told so


@pytest.mark.parametrize("strategy", ["sparkv", "hybrid"])
def test_re_plans_complete_under_every_adversarial_trace(strategy):
    """Whatever the link does after the verdict (fades, recoveries, a dead link), the load that
    re-planned completes (the simulator raises on a broken dependency or a deadlock), and the
    planner is asked at most once."""
    inst = synthetic_instance(2048, chunk_tokens=512, bandwidth_mbps=50.0, seed=3)
    traces = adversarial_traces(4) + [fade_start_trace(seed) for seed in range(4)]
    for name, trace in enumerate(traces):
        planner = Counting(strategy)
        tl, ctl = _run(inst, planner, trace)
        assert len(planner.rates) <= 1, name
        assert tl.ttft_s > 0 and len(tl.available_s) == inst.num_chunks, name


def test_the_bench_simulates_a_re_planned_load_from_the_plan_it_started_by(inst):
    """``sparkv bench ttft``'s ``sim_ttft_s``: a load that re-planned is simulated from the plan
    it started by, with the same planner (the simulated link re-plans it again); any other
    from the plan it ended with."""
    from types import SimpleNamespace

    from sparkv.bench.ttft import simulated_load_s

    first = Counting()._plan(inst)
    ran, _ = _run(inst, Counting(), Trace.constant(10.0))
    ended = Counting()._plan(inst.replace(bandwidth_Bps=10 * MBIT))
    res = SimpleNamespace(plan=ended, started_by=first,
                          breakdown=SimpleNamespace(replan={"taken": True}))
    assert simulated_load_s(res, "hybrid", ControllerConfig(), Trace.constant(10.0),
                            inst) == ran.ttft_s
    res.breakdown.replan = None
    assert simulated_load_s(res, "hybrid", ControllerConfig(), Trace.constant(10.0),
                            inst) == simulate(ended, inst, Trace.constant(10.0),
                                              controller=ControllerConfig()).ttft_s
