"""The runtime controller: its event interface, and that it helps when reality leaves the plan."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import pytest

from sparkv.layout import KVChunkId, StepId
from sparkv.scheduler import (ComputeNoise, Controller, ControllerConfig, Greedy, ProbeIdleLink,
                              Rebalance, RecomputeColumns, StreamOnly, StrongHybrid, ToCompute,
                              ToStream, Trace, simulate, synthetic_instance)
from sparkv.scheduler.instance import MBPS

#: sparkv's controller with locked columns recomputed
#: the composition before RecomputeColumns joined the default (session 70)
NO_RECOMPUTE = ControllerConfig(rebalance=Rebalance(ToCompute(), ToStream()))


@pytest.fixture(scope="module")
def inst8k():
    return synthetic_instance(8 * 1024, bandwidth_mbps=80, seed=0)


@pytest.mark.parametrize("planner", [Greedy(), StrongHybrid()], ids=["greedy", "hybrid"])
def test_controller_lowers_ttft_under_a_deep_bandwidth_drop(inst8k, planner):
    plan = planner.plan(inst8k)
    fade = Trace.sample("deep-fade")          # 80 Mbit/s, 1 Mbit/s from 1 s to 9 s
    static = simulate(plan, inst8k, fade)
    adaptive = simulate(plan, inst8k, fade, controller=ControllerConfig())
    assert adaptive.ttft_s < 0.95 * static.ttft_s, (static.ttft_s, adaptive.ttft_s)
    directions = Counter(m.direction for m in adaptive.migrations)
    assert directions["to_compute"] > 0
    assert adaptive.computed_steps > static.computed_steps


def test_controller_lowers_ttft_when_the_link_dies_for_long(inst8k):
    plan = Greedy().plan(inst8k)
    drop = Trace.from_rows([0.0, 0.5, 30.0], [80.0, 0.3, 80.0], loop=False)
    static = simulate(plan, inst8k, drop)
    adaptive = simulate(plan, inst8k, drop, controller=ControllerConfig())
    assert adaptive.ttft_s < 0.8 * static.ttft_s
    assert adaptive.bytes_wasted > 0                    # a stuck transfer was cancelled
    assert any(m.cancelled for m in adaptive.migrations)


def test_compute_contention_moves_the_tail_of_the_compute_order_to_the_link():
    inst = synthetic_instance(8 * 1024, bandwidth_mbps=25, seed=1)
    plan = Greedy().plan(inst)
    slow = ComputeNoise(slowdowns=((0.0, 1e9, 3.0),))     # another app takes the CPU
    static = simulate(plan, inst, noise=slow)
    adaptive = simulate(plan, inst, noise=slow, controller=ControllerConfig())
    assert adaptive.ttft_s < 0.9 * static.ttft_s
    first = next(m for m in adaptive.migrations if m.direction == "to_stream")
    # it comes from the tail: nothing after it in the plan's compute order depends on it
    moved = first.steps[0]
    pos = plan.compute_order.index(moved)
    assert StepId(moved.t, moved.l + 1) not in plan.compute_order[:pos]
    assert pos >= len(plan.compute_order) - 40


def test_no_adaptation_when_the_plan_holds(inst8k):
    plan = Greedy().plan(inst8k)
    static = simulate(plan, inst8k)
    adaptive = simulate(plan, inst8k, controller=ControllerConfig())
    assert adaptive.ttft_s <= static.ttft_s * 1.02
    assert len(adaptive.migrations) <= 10


def test_migration_cap_per_stage(inst8k):
    """A small imbalance moves at most the cap per stage (bulk moves, for large ones, are
    tested below; the dead-link verdict, which a deep fade reaches, is left out)."""
    plan = Greedy().plan(inst8k)
    cfg = ControllerConfig(rebalance=Rebalance(max_per_stage=1, stage_s=0.5, bulk_ratio=math.inf),
                           dead_link=None)
    tl = simulate(plan, inst8k, Trace.sample("deep-fade"), controller=cfg)
    per_stage = Counter(math.floor(m.time_s / 0.5) for m in tl.migrations)
    assert tl.migrations and max(per_stage.values()) == 1


def test_static_executor_follows_the_plan_exactly(inst8k):
    plan = Greedy().plan(inst8k)
    tl = simulate(plan, inst8k, Trace.sample("wifi"))
    assert [r.cid for r in tl.transfers] == plan.stream_order
    assert sorted(tl.steps, key=lambda s: tl.steps[s][0]) == plan.compute_order
    assert all(r.level == plan.levels[r.cid] for r in tl.transfers)


def test_cachegen_controller_lowers_levels_when_the_link_slows():
    inst = synthetic_instance(2 * 1024, bandwidth_mbps=400, seed=0)
    plan = StreamOnly(slo_s=2.0).plan(inst)
    assert Counter(plan.levels.values())["q5"] < len(plan.stream_order)   # some better levels
    slump = Trace.from_rows([0.0, 0.2], [400.0, 40.0], loop=False)
    static = simulate(plan, inst, slump)
    adaptive = simulate(plan, inst, slump, controller=ControllerConfig.cachegen(2.0))
    assert adaptive.ttft_s < static.ttft_s
    late = [r.level for r in adaptive.transfers if r.requested_s > 1.0]
    assert late and set(late) == {"q5"}                 # fell back to the cheapest allowed level
    assert not adaptive.migrations and not adaptive.steps  # stream only: never computes


def test_driving_the_controller_by_hand_like_the_engine():
    """The engine's loop in miniature: ask, do, report. Both queues drain, deps hold."""
    inst = synthetic_instance(3 * 1024, num_layers=4, bandwidth_mbps=20, seed=0)
    plan = Greedy().plan(inst)
    ctl = Controller(plan, inst, ControllerConfig())
    ctl.start(0.0)
    now, done_steps, arrived = 0.0, [], []
    for _ in range(10_000):
        if ctl.done:
            break
        step = ctl.next_step(now)
        if step is not None:
            now += inst.comp_time(step)
            ctl.step_done(step, now, inst.comp_time(step))
            done_steps.append(step)
        fetch = ctl.next_fetch(now)
        if fetch is not None:
            nbytes = inst.bytes_of(fetch.cid, fetch.level)
            now += nbytes / inst.bandwidth_Bps
            ctl.rate_sample(now, nbytes, nbytes / inst.bandwidth_Bps, fetch.cid)
            ctl.chunk_received(fetch.cid, now)
            ctl.chunk_arrived(fetch.cid, now)
            arrived.append(fetch.cid)
        for cid in ctl.take_cancellations():
            pass  # nothing in flight across iterations in this serial loop
    assert ctl.done
    covered = {KVChunkId(s.t, s.l, g) for s in done_steps for g in range(inst.G)} | set(arrived)
    assert len(covered) == inst.num_chunks
    comp, link = ctl.remaining(now)
    assert comp == pytest.approx(0, abs=1e-9) and link == pytest.approx(0, abs=1e-9)


def test_estimates_follow_the_samples():
    inst = synthetic_instance(2 * 1024, bandwidth_mbps=50)
    ctl = Controller(Greedy().plan(inst), inst, ControllerConfig(window_s=0.5))
    assert ctl.bandwidth_estimate(0.0) == inst.bandwidth_Bps
    for i in range(10):
        ctl.rate_sample(0.1 * (i + 1), 1e5, 0.1)          # 1 MB/s
    assert ctl.bandwidth_estimate(1.0) == pytest.approx(1e6)
    ctl.rate_sample(2.0, 5e3, 0.1)                         # the window keeps only recent samples
    assert ctl.bandwidth_estimate(2.0) == pytest.approx(5e4)
    assert ctl.compute_ratio() == 1.0
    step = StepId(0, 0)
    ctl.step_done(step, 1.0, 2 * inst.comp_time(step))
    assert ctl.compute_ratio() == pytest.approx(2.0)
    assert MBPS == 125000


def test_the_runs_compute_ratio_is_the_median_of_every_step():
    """What the next plan learns is the load's median step ratio: one step that waited for a
    core (49x its prediction) moves the recent window's mean, not the run's ratio."""
    inst = synthetic_instance(2 * 1024, bandwidth_mbps=50)
    ctl = Controller(Greedy().plan(inst), inst, ControllerConfig(window_s=0.5))
    assert ctl.run_compute_ratio() == 1.0 and ctl.run_compute_samples == 0
    steps = [StepId(t, l) for t in range(inst.geometry.num_token_chunks)
             for l in range(inst.geometry.num_layers)][:12]
    for i, step in enumerate(steps):
        ctl.step_done(step, float(i), (49.0 if i == 11 else 1.2) * inst.comp_time(step))
    assert ctl.run_compute_samples == 12
    assert ctl.run_compute_ratio() == pytest.approx(1.2)
    assert ctl.compute_ratio() > 6.0          # the window's mean sees the outlier


# ---- the worst case: links that break the plan's assumptions (simulated time) -----------------
def _inst(n: int):
    from sparkv.scheduler.instance import DEFAULT_LEVELS

    levels = tuple(lv for lv in DEFAULT_LEVELS if lv.name in ("raw", "q8", "q5"))
    return synthetic_instance(n, chunk_tokens=512, bandwidth_mbps=50, levels=levels, seed=1)


def test_a_link_that_starts_in_a_fade_gets_its_work_back_when_it_recovers():
    """The first estimate sees the fade (1 Mbit/s), so the plan computes nearly everything; the
    link then recovers to 150 Mbit/s. An idle link probes, the estimate follows, and the
    imbalance is large enough to hand the link work in bulk: sparkv ends within 10% of
    stream-only, far ahead of computing everything."""
    from sparkv.scheduler.whatif import compare

    inst = _inst(4096)
    trace = Trace.from_rows([0.0, 1.5], [1.0, 150.0], [300.0, 20.0], loop=False)
    r = compare(inst, trace, manifest_bytes=60_000)
    assert r["sparkv"].prior_mbps < 2.0
    assert r["sparkv"].ttft_s <= 1.1 * r["stream"].ttft_s, {k: v.ttft_s for k, v in r.items()}
    assert r["sparkv"].ttft_s < 0.5 * r["local"].ttft_s


def test_a_slow_manifest_caps_the_link_prior_and_a_fast_one_does_not():
    from sparkv.scheduler.estimators import SLOW_START_S, start_prior

    prior = 50 * MBPS
    assert start_prior(prior, 50_000, 0.05) == prior                 # a round trip: says nothing
    assert start_prior(prior, 50_000, SLOW_START_S) == pytest.approx(50_000 / SLOW_START_S)
    assert start_prior(prior, 50_000, 1.0) == pytest.approx(50_000)
    assert start_prior(1_000.0, 50_000, 1.0) == 1_000.0             # never raised
    assert start_prior(prior, 0, 1.0) == prior                        # nothing went out


def test_the_link_window_keeps_running_sums_equal_to_its_samples():
    """The sliding window's throughput is read at every piece the link thread reads, so it keeps
    running sums: after any mix of samples (silences included) and window moves it equals the
    rate summed afresh over the samples in the window."""
    import random

    from sparkv.scheduler.estimators import LinkEstimator

    rng = random.Random(3)
    est = LinkEstimator(prior_Bps=5e6, window_s=0.5)
    assert est.window(0.0) == 5e6
    kept: list[tuple[float, float, float]] = []
    now = 0.0
    for _ in range(2000):
        now += rng.choice([0.001, 0.01, 0.05, 0.3, 0.7])
        nbytes, seconds = rng.choice([0.0, rng.uniform(1, 2e5)]), rng.uniform(1e-4, 0.05)
        est.add(now, nbytes, seconds)
        kept.append((now, nbytes, seconds))
        while len(kept) > 1 and kept[0][0] < now - 0.5:
            kept.pop(0)
        b, s = sum(x[1] for x in kept), sum(x[2] for x in kept)
        assert est.window(now) == pytest.approx(max(b / s, 1.0), rel=1e-9)


def test_the_prelude_and_a_capped_prior_keep_a_fading_start_near_local():
    """The link is in a fade when the question is asked and stays there for seconds: the
    manifest takes ~0.9 s, the prelude computes local prefill's first layers meanwhile, and the
    plan (its prior capped by that slow manifest) computes the rest instead of handing it to a
    silent link. On the current CPU profile (a call's fixed cost, spans) sparkv then ends
    within 5% of local prefill; without the prelude it pays the manifest's time on top."""
    from sparkv.scheduler.instance import DEFAULT_LEVELS, SMOLLM2_135M_CPU_SPANS
    from sparkv.scheduler.whatif import what_if

    levels = tuple(lv for lv in DEFAULT_LEVELS if lv.name in ("raw", "q8", "q5"))
    inst = synthetic_instance(2048, chunk_tokens=512, bandwidth_mbps=50, levels=levels, seed=1,
                              profile=SMOLLM2_135M_CPU_SPANS)
    trace = Trace.from_rows([0.0, 3.0], [0.5, 50.0], [20.0, 20.0], loop=False)
    local = what_if("local", inst, trace, manifest_bytes=55_000)
    sparkv = what_if("sparkv", inst, trace, manifest_bytes=55_000)
    assert sparkv.manifest_s > 0.8 and sparkv.prelude_steps >= inst.num_steps // 2
    assert sparkv.prior_mbps < 1.0 and sparkv.bytes_streamed == 0
    assert sparkv.ttft_s <= 1.05 * local.ttft_s, (sparkv.ttft_s, local.ttft_s)
    bare = what_if("sparkv", inst, trace, manifest_bytes=55_000, with_prelude=False)
    assert bare.prelude_steps == 0 and bare.ttft_s > sparkv.ttft_s + 0.5


def test_an_idle_link_probes_and_bulk_moves_skip_the_stage_cap():
    from sparkv.scheduler.planners import LocalOnly

    # a prior so low that no chunk is worth streaming: the link has nothing to do
    inst = _inst(4096).with_bandwidth(0.01 * MBPS)
    plan = LocalOnly().plan(inst)
    cfg = ControllerConfig(rebalance=Rebalance(max_per_stage=2))
    fast = Trace.constant(200.0)
    adaptive = simulate(plan, inst, fast, controller=cfg)
    kinds = Counter(m.direction for m in adaptive.migrations)
    assert kinds["probe"] >= 1 and kinds["to_stream"] > 2 * cfg.rebalance.max_per_stage
    first_stage = [m for m in adaptive.migrations if m.direction == "to_stream"
                   and m.time_s < adaptive.migrations[0].time_s + 1e-3 + 0.5]
    assert len(first_stage) > cfg.rebalance.max_per_stage   # in bulk, not a few per stage
    static = simulate(plan, inst, fast)
    assert adaptive.ttft_s < 0.5 * static.ttft_s
    no_probe = simulate(plan, inst, fast, controller=ControllerConfig(probe=None))
    assert no_probe.ttft_s == pytest.approx(static.ttft_s, rel=0.02)   # nothing measured it


def test_adversarial_traces_are_seeded_and_adversarial():
    from sparkv.scheduler.trace import adversarial_trace, adversarial_traces

    a, b = adversarial_trace(3), adversarial_trace(3)
    assert a == b and a != adversarial_trace(4)
    traces = adversarial_traces(40)
    starts_in_fade = sum(t.mbps[0] <= 3.0 for t in traces)
    assert 8 <= starts_in_fade <= 28                      # 40% by design
    for t in traces:
        assert 0.5 <= min(t.mbps) and max(t.mbps) <= 900.0
        fades = [m for m in t.mbps if m <= 3.0]
        assert fades, "every trace has deep fades"
        assert t.mean_mbps(60.0) > 5.0                    # it recovers


def test_trace_after_is_the_same_link_later():
    from sparkv.scheduler.trace import adversarial_trace

    t = adversarial_trace(1)
    later = t.after(2.37)
    for x in (0.0, 0.5, 3.0, 20.0):
        assert later.rate_Bps(x) == t.rate_Bps(2.37 + x)
    assert later.transfer_end(0.0, 5e6) == pytest.approx(t.transfer_end(2.37, 5e6) - 2.37)
    wifi = Trace.sample("wifi")
    assert wifi.after(250.0).rate_Bps(1.0) == wifi.rate_Bps(251.0)


def _first_cancel_after_fade(fast_window_s: float) -> float:
    """Everything planned for the link, the first fetches in flight, 1 s of a good link, then a
    fade (nothing in flight completes): when (after the fade began) the first in-flight fetch
    is cancelled."""
    inst = synthetic_instance(2048, chunk_tokens=512, num_layers=4, bandwidth_mbps=400, seed=0)
    cfg = ControllerConfig(window_s=0.5, fast_window_s=fast_window_s, probe=None,
                           rebalance=Rebalance(to_stream=None))
    ctl = Controller(StreamOnly().plan(inst), inst, cfg)
    ctl.start(0.0)
    inflight = []
    while len(inflight) < 4 and (f := ctl.next_fetch(0.0)) is not None:
        inflight.append(f.cid)
    for i in range(20):                                   # 1 s at 400 Mbit/s
        ctl.rate_sample(0.05 * (i + 1), 400 * MBPS * 0.05, 0.05)
    assert not ctl.has_cancellations
    for i in range(40):                                   # then 0.2 Mbit/s
        now = 1.0 + 0.05 * (i + 1)
        ctl.rate_sample(now, 0.2 * MBPS * 0.05, 0.05)
        while (s := ctl.next_step(now)) is not None:       # the compute thread keeps up
            ctl.step_done(s, now, 1e-3)
        cancelled = set(ctl.take_cancellations())
        if cancelled:
            assert cancelled <= set(inflight)
            return now - 1.0
    return math.inf


def test_a_fade_cancels_stalled_transfers_without_waiting_for_the_window():
    """The compute thread must not idle waiting for transfers a fade has stalled: in-flight
    fetches are judged by the last 0.15 s, so the first is cancelled (its step computed) within
    a few samples of the fade, long before the 0.5 s window forgets the good samples."""
    fast = _first_cancel_after_fade(0.15)
    slow = _first_cancel_after_fade(0.0)
    assert fast <= 0.2
    assert slow > fast + 0.1


def test_a_slowed_batch_gives_its_tail_back_to_compute():
    """Twelve chunks in flight in one batch, then the link slows to 24 Mbit/s: each chunk alone
    would still arrive sooner than it can be computed twice over, but the ones at the end of the
    batch wait for every byte ahead of them. The controller takes the batch's tail back (its
    steps are computed, its fetches cancelled) and leaves the head, which arrives soon."""
    inst = synthetic_instance(2048, chunk_tokens=512, num_layers=4, bandwidth_mbps=100, seed=0)
    ctl = Controller(StrongHybrid().plan(inst), inst,
                     ControllerConfig(probe=None, rebalance=Rebalance(to_stream=None)))
    ctl.start(0.0)
    inflight = []
    while (f := ctl.next_fetch(0.0)) is not None:
        inflight.append(f.cid)
    assert len(inflight) == 12 and not ctl.state.link.order
    own = max(inst.bytes_of(c, inst.levels[inst.cheapest_level[inst.chunk_index(c)]].name)
              for c in inflight) / (24 * MBPS)
    assert own < 2 * min(inst.comp_time(StepId(c.t, c.l)) for c in inflight if c.l < inst.L - 1)
    now, cancelled = 0.0, []
    for _ in range(10):
        now += 0.05
        ctl.rate_sample(now, 24 * MBPS * 0.05, 0.05)
        while (s := ctl.next_step(now)) is not None:
            ctl.step_done(s, now, inst.comp_time(s))
        cancelled += ctl.take_cancellations()
    assert cancelled, "the batch's tail waited for the link"
    head, tail = inflight[:4], inflight[-4:]
    assert set(tail) <= set(cancelled) and not set(head) & set(cancelled)


def test_locked_columns_are_recomputed():
    """A plan that streams layer by layer locks every column once the bottom layers arrived: no
    step can be computed without the hidden state below it. When the link collapses, the
    default controller recomputes columns (the streamed steps below a locked one run again)
    instead of leaving the compute thread idle; with :class:`ToCompute` alone it can move
    almost nothing."""
    from sparkv.scheduler.planners.base import make_plan

    assert isinstance(ControllerConfig().rebalance.to_compute, RecomputeColumns)
    inst = synthetic_instance(4096, chunk_tokens=512, num_layers=8, bandwidth_mbps=100, seed=0)
    order = sorted(range(inst.num_chunks), key=lambda c: (inst.chunk_id(c).l, inst.chunk_id(c).t))
    plan = make_plan(inst, [], order)
    collapse = Trace.from_rows([0.0, 0.3], [100.0, 2.0], loop=False)
    locked = simulate(plan, inst, collapse, controller=NO_RECOMPUTE)
    free = simulate(plan, inst, collapse, controller=ControllerConfig())
    columns = [m for m in free.migrations if m.direction == "to_compute" and len(m.steps) > 1]
    assert columns and not any(len(m.steps) > 1 for m in locked.migrations)
    for m in columns:   # bottom up, one token chunk, consecutive layers
        assert len({s.t for s in m.steps}) == 1
        assert [s.l for s in m.steps] == list(range(m.steps[0].l, m.steps[-1].l + 1))
    assert free.ttft_s < 0.6 * locked.ttft_s, (locked.ttft_s, free.ttft_s)


# ---- probe and hand-back (sparkv.scheduler.probe, docs/scheduler.md) -----------------------------
def _dead_then(mbps: float, dead_s: float) -> Trace:
    """A link that delivers almost nothing (0.01 Mbit/s) for ``dead_s``, then ``mbps``."""
    return Trace.from_rows([0.0, dead_s], [0.01, mbps], [300.0, 20.0], loop=False)


def test_an_all_local_plan_hands_whole_columns_back_to_a_link_that_recovers():
    from sparkv.scheduler.planners import LocalOnly

    inst = _inst(2048).with_bandwidth(0.01 * MBPS)
    plan = LocalOnly().plan(inst)
    assert not plan.stream_order
    sim = simulate(plan, inst, _dead_then(80.0, 1.5), controller=ControllerConfig())
    static = simulate(plan, inst, _dead_then(80.0, 1.5))
    back = [m for m in sim.migrations if m.direction == "to_stream"]
    assert back and all(m.time_s >= 1.5 for m in back)       # only once the link recovered
    columns = [m for m in back if len(m.steps) > 2]
    assert columns and all(len({s.t for s in m.steps}) == 1 for m in columns)
    assert columns[0].steps[0].t == inst.n_t - 1             # the tail's token chunk first
    assert sim.streamed_chunks > inst.L and sim.ttft_s < 0.8 * static.ttft_s


def _an_all_local_load_hands_nothing_over(mbps: float, **tax: float) -> None:
    """An all-local plan at ``mbps``: without ``tax`` the controller hands the link the compute
    order's tail; with it, nothing moves and the load is the static one's."""
    from sparkv.scheduler.planners import LocalOnly

    inst = _inst(2048).with_bandwidth(mbps * MBPS)
    plan = LocalOnly().plan(inst)
    heavy = inst.replace(**tax)
    free = simulate(plan, inst, controller=ControllerConfig(probe=None))
    taxed = simulate(plan, heavy, controller=ControllerConfig(probe=None))
    assert any(m.direction == "to_stream" for m in free.migrations)
    assert not taxed.migrations and taxed.streamed_chunks == 0
    assert taxed.ttft_s == pytest.approx(simulate(plan, heavy).ttft_s)


def test_a_move_to_the_link_must_gain_at_least_a_calls_fixed_cost():
    """``ToStream`` hands the link work only if that shortens the load by ``min_gain_s`` (a
    compute call's fixed cost, which a step pays alone if the link gives it back): with the
    compute path 2 ms behind the link nothing moves, with no minimum the tail moves, and 7 ms
    behind it moves either way."""
    from sched_helpers import tiny_instance

    from sparkv.scheduler.planners import LocalOnly

    inst = tiny_instance([[0.05, 0.05, 0.05], [0.05, 0.05, 0.002]], nbytes=10, bw=1e9)
    for comp, gain, moves in ((0.003, 0.003, False), (0.003, 0.0, True), (0.008, 0.003, True)):
        ctl = Controller(LocalOnly().plan(inst), inst)
        st = ctl.state
        tail = st.compute.order[-1]
        assert tail == inst.step_index(StepId(1, 2))
        moved = ToStream(min_gain_s=gain).move(st, 0.0, comp, 0.001)
        assert moved == moves and (tail not in st.compute.order) == moves, (comp, gain)


def test_migrations_to_the_link_pay_the_stream_tax():
    """An all-local plan on a link that can take work: the controller hands the link the
    compute order's tail, but a streamed chunk also costs the compute path its stream tax
    while steps run; a tax above what computing the step costs hands over nothing, and the
    load takes no longer than computing everything."""
    longest = float(_inst(2048).t_comp.max())
    _an_all_local_load_hands_nothing_over(80, stream_tax_s=2 * longest)


def test_migrations_to_the_link_pay_the_receive_tax():
    """The same with steps that run slower while the link receives (``receive_tax``): at 10
    Mbit/s a step's chunks take about twice as long on the link as the step takes to compute,
    so a compute path three times as slow while they arrive loses more than it hands over:
    nothing moves, and the load takes no longer than computing everything."""
    _an_all_local_load_hands_nothing_over(10, receive_tax=2.0)


def test_the_probe_stays_within_its_bound_while_the_link_is_dead():
    """Ten seconds of a dead link under a plan that computes everything: one probe in flight at
    a time, and the probes' bytes within the token bucket (burst + rate x time)."""
    from sparkv.scheduler.planners import LocalOnly

    inst = _inst(4096).with_bandwidth(0.01 * MBPS)
    plan = LocalOnly().plan(inst)
    probe = ProbeIdleLink(rate_Bps=50_000.0, burst_bytes=100_000.0)
    cfg = ControllerConfig(probe=probe)
    dead = Trace.from_rows([0.0], [0.01], [300.0], loop=False)
    sim = simulate(plan, inst, dead, controller=cfg)
    probes = [r for r in sim.transfers]
    assert probes, "the idle link was never probed"
    first_chunk = probes[0].nbytes
    for r in probes:
        assert (sum(x.nbytes for x in probes if x.requested_s <= r.requested_s)
                <= max(first_chunk, probe.burst_bytes + probe.rate_Bps * r.requested_s))
    spans = sorted((r.requested_s, r.end_s) for r in probes)
    assert all(b[0] >= a[1] - 1e-9 for a, b in zip(spans, spans[1:]))   # one at a time
    assert sim.ttft_s < 1.05 * simulate(plan, inst, dead).ttft_s


def test_columns_run_back_to_back_when_the_link_is_quiet():
    """The compute thread gets a token chunk's layers as one run (the engine's fast path) when
    the link has nothing but a probe to do, and one step at a time otherwise."""
    from sparkv.scheduler.planners import LocalOnly

    inst = _inst(2048).with_bandwidth(0.01 * MBPS)     # nothing worth moving to the link
    ctl = Controller(LocalOnly().plan(inst), inst, ControllerConfig(probe=None))
    ctl.start(0.0)
    steps = ctl.next_steps(0.0)
    assert len(steps) > 1 and [s.l for s in steps] == list(range(len(steps)))
    assert {s.t for s in steps} == {0}
    assert ctl.next_steps(0.0) == []                            # committed until reported
    for s in steps:
        ctl.step_done(s, 0.1, inst.comp_time(s))
    assert ctl.next_steps(0.1)
    inst = _inst(2048)
    busy = Controller(StrongHybrid().plan(inst), inst, ControllerConfig())
    busy.start(0.0)
    assert busy.next_fetch(0.0) is not None
    assert len(busy.next_steps(0.0)) == 1


def test_a_load_factor_on_the_compute_path_hands_work_to_the_link():
    """Another ask sharing the compute path (the compute estimator's ``load``: this load gets
    half of it) makes the same plan's compute path the slower one: the controller hands the
    link work it gives nobody alone. The device's own measured speed (``compute_ratio``, what
    the session learns) does not include the load."""
    inst = synthetic_instance(8 * 1024, bandwidth_mbps=25, seed=1)
    plan = Greedy().plan(inst)
    alone = Controller(plan, inst, ControllerConfig())
    shared = Controller(plan, inst, ControllerConfig())
    shared.state.compute_estimator.load = 2.0
    a, s = simulate(plan, inst, controller=alone), simulate(plan, inst, controller=shared)
    assert not a.migrations
    assert any(m.direction == "to_stream" for m in s.migrations)
    assert shared.compute_ratio() == pytest.approx(1.0) == alone.compute_ratio()
    assert shared.state.compute_estimator.factor() == pytest.approx(2.0)


def test_a_link_far_below_its_estimate_is_dead_and_its_work_computed():
    """A stream-only plan made at 100 Mbit/s on a link that collapses to 0.2 Mbit/s at 0.5 s:
    CacheGen's controller alone waits for the link (204 s); with the dead-link verdict (4 s
    under 1/20 of the estimate, computing 4x sooner) everything the link holds goes to the
    compute path in one migration, the streamed layers below recomputed, and the load ends in
    seconds. A link as slow as the plan's estimate is never dead."""
    from dataclasses import replace

    inst = synthetic_instance(4096, chunk_tokens=512, num_layers=8, bandwidth_mbps=100, seed=0)
    plan = StreamOnly().plan(inst)
    collapse = Trace.from_rows([0.0, 0.5], [100.0, 0.2], loop=False)
    waits = simulate(plan, inst, collapse,
                     controller=replace(ControllerConfig.cachegen(), dead_link=None))
    ctl = Controller(plan, inst, ControllerConfig.cachegen())
    dead = simulate(plan, inst, collapse, controller=ctl)
    [m] = [m for m in dead.migrations if m.direction == "dead_link"]
    assert m.time_s >= 0.5 + 4.0 and m.cancelled
    assert ctl.link_dead is not None and "against the plan's 100 Mbit/s" in ctl.link_dead
    assert dead.ttft_s < 0.1 * waits.ttft_s
    assert dead.computed_steps >= len(m.steps)
    slow = inst.with_bandwidth(0.2 * MBPS)
    honest = Controller(StreamOnly().plan(slow), slow, ControllerConfig.cachegen())
    simulate(honest.plan, slow, Trace.constant(0.2), controller=honest)
    assert honest.link_dead is None and not honest.migrations


def test_bytes_of_other_asks_ahead_on_the_link_hand_work_to_the_compute_path():
    """Other asks' bytes the link carries first (the link estimator's ``ahead_bytes``: a device
    service's link plan) make the same plan's link the slower path: the controller computes work
    it streams alone. Nothing ahead: no migration, the plan as alone."""
    inst = synthetic_instance(8 * 1024, bandwidth_mbps=25, seed=1)
    plan = Greedy().plan(inst)
    alone = Controller(plan, inst, ControllerConfig())
    behind = Controller(plan, inst, ControllerConfig())
    ahead = 2.0 * sum(inst.bytes_of(c, plan.levels.get(c, inst.levels[0].name))
                      for c in plan.stream_order)
    behind.state.link_estimator.ahead_bytes = ahead
    a, b = simulate(plan, inst, controller=alone), simulate(plan, inst, controller=behind)
    assert not a.migrations
    assert any(m.direction == "to_compute" for m in b.migrations)
    assert b.computed_steps > a.computed_steps and b.bytes_streamed < a.bytes_streamed
    _, link = behind.remaining(b.ready_s)      # the load's own link work is done
    assert link == pytest.approx(ahead / behind.link_estimate(b.ready_s))


def test_spans_take_a_layers_next_token_chunks_up_to_their_token_bound():
    """A launch-bound device's controller (CommitSpans) hands out a layer's consecutive token
    chunks still queued on the compute path, whose lower layer is computed, at most
    ``max_tokens`` tokens; a local load then runs layer by layer, every step once."""
    from sparkv.scheduler import CommitSpans
    from sparkv.scheduler.planners import LocalOnly

    inst = _inst(4096)                                  # 8 token chunks of 512
    cfg = replace(ControllerConfig.static(), spans=CommitSpans(max_tokens=2048))
    ctl = Controller(LocalOnly().plan(inst), inst, cfg)
    ctl.start(0.0)
    ran: list[StepId] = []
    now = 0.0
    while not ctl.done:
        steps = ctl.next_steps(now)
        assert steps, "the local load stalled"
        assert len({s.l for s in steps}) == 1 and len(steps) <= 4
        assert [s.t for s in steps] == list(range(steps[0].t, steps[0].t + len(steps)))
        for s in steps:
            assert s.l == 0 or StepId(s.t, s.l - 1) in ran
            now += inst.comp_time(s)
            ctl.step_done(s, now, inst.comp_time(s))
            ran.append(s)
    assert sorted(ran) == sorted(inst.geometry.step_ids())
    assert ran[:4] == [StepId(t, 0) for t in range(4)]          # a row, not a column


def test_spans_never_take_a_step_the_plan_streams():
    from sparkv.scheduler import CommitSpans

    inst = _inst(4096)
    plan = StrongHybrid().plan(inst)
    ctl = Controller(plan, inst, ControllerConfig(spans=CommitSpans()))
    ctl.start(0.0)
    steps = ctl.next_steps(0.0)
    assert steps and all(s in plan.compute_order for s in steps)
    assert ctl.next_steps(0.0) == []                            # committed until reported


def test_the_next_plans_compute_ratio_counts_only_steps_run_while_the_link_was_quiet():
    """A step that ran beside streaming and decoding (the same cores, on a small device)
    measures that load's contention, not the device's speed: the run's ratio sees it, the
    quiet ratio (what the session learns) only steps handed out and finished with the link
    idle, the projection-only last layer's left out (its prediction is the least certain)."""
    inst = synthetic_instance(2 * 1024, bandwidth_mbps=50)
    plan = Greedy().plan(inst)
    assert plan.stream_order and plan.compute_order
    ctl = Controller(plan, inst, ControllerConfig(rebalance=None, probe=None, columns=None))
    ctl.start(0.0)
    now = 0.0
    busy = ctl.next_steps(now)                          # the link has the plan's work
    for step in busy:
        ctl.step_done(step, now, 3.0 * inst.comp_time(step))
    assert ctl.run_compute_samples == len(busy) and ctl.quiet_compute_samples == 0
    assert ctl.quiet_compute_ratio() == 1.0
    while (f := ctl.next_fetch(now)) is not None:       # the link's work arrives
        ctl.chunk_received(f.cid, now)
        ctl.chunk_arrived(f.cid, now)
    quiet = last = 0
    L = inst.geometry.num_layers
    while (steps := ctl.next_steps(now)):
        for step in steps:
            now += inst.comp_time(step)
            slow = step.l == L - 1                      # the projection-only layer never counts
            ctl.step_done(step, now, (9.0 if slow else 1.1) * inst.comp_time(step))
            quiet, last = quiet + (not slow), last + slow
    assert ctl.done and ctl.quiet_compute_samples == quiet > 0
    assert ctl.quiet_compute_ratio() == pytest.approx(1.1)
    assert ctl.run_compute_samples == quiet + last + len(busy)
    # an all-local load: every step quiet but the last layer's
    from sparkv.scheduler.planners import LocalOnly

    local = Controller(LocalOnly().plan(inst), inst, ControllerConfig.static())
    for step in inst.geometry.step_ids():
        slow = step.l == L - 1
        local.step_done(step, 0.0, (9.0 if slow else 1.1) * inst.comp_time(step))
    assert local.quiet_compute_samples == inst.num_steps - inst.n_t
    assert local.quiet_compute_ratio() == pytest.approx(1.1)


def _spans_of(ctl: Controller, inst) -> list[list[StepId]]:
    """Runs an all-local load; returns the runs the compute thread was handed, in order."""
    runs: list[list[StepId]] = []
    now = 0.0
    while True:
        steps = ctl.next_steps(now)
        if not steps:
            break
        runs.append(steps)
        for s in steps:
            now += inst.comp_time(s)
            ctl.step_done(s, now, inst.comp_time(s))
    return runs


def test_with_spans_a_head_start_on_the_first_token_chunk_still_runs_layers_as_spans():
    """The prelude computed the first token chunk's lowest layers before the load (sparkv's
    start-up overlap): with spans the work-conserving order becomes lowest layer first
    (LayerFirst), so every later layer runs its computed token chunks as one span; the plain
    work-conserving order ran that chunk's layers on their own (step by step while the link is
    busy, here as a column): no span can form while the next chunk's layer below is not done."""
    from sparkv.scheduler import LayerFirst, ReadyFirst
    from sparkv.scheduler.planners import LocalOnly

    inst = _inst(2048)                                  # 4 token chunks of 512
    L = inst.geometry.num_layers
    head = [StepId(0, 0), StepId(0, 1)]
    cfg = ControllerConfig(rebalance=None, probe=None).with_spans(True)
    assert isinstance(cfg.order, LayerFirst)
    assert ControllerConfig.static().with_spans(True).order == ControllerConfig.static().order
    runs = _spans_of(Controller(LocalOnly().plan(inst), inst, cfg, done_steps=head), inst)
    assert sorted(s for r in runs for s in r) == sorted(set(inst.geometry.step_ids()) - set(head))
    assert len(runs) == L                               # one span a layer, none alone
    assert [[s.t for s in r] for r in runs[:3]] == [[1, 2, 3], [1, 2, 3], [0, 1, 2, 3]]
    plain = replace(cfg, order=ReadyFirst())
    runs = _spans_of(Controller(LocalOnly().plan(inst), inst, plain, done_steps=head), inst)
    head_chunk = [r for r in runs if StepId(0, L - 1) in r][0]
    assert {s.t for s in head_chunk} == {0}                 # its column, no span of the layers


def test_the_stream_tax_a_load_measures_is_the_one_the_simulator_charged():
    """The simulator lengthens a step by ``stream_tax_s`` for each chunk decoded while it runs;
    :func:`stream_tax_estimate` over that load's timeline gives the tax back, and nothing where
    no chunk was decoded beside a step."""
    from sparkv.scheduler import simulate
    from sparkv.scheduler.estimators import stream_tax_estimate

    inst = synthetic_instance(2 * 1024, chunk_tokens=512, bandwidth_mbps=50).replace(
        stream_tax_s=0.004)
    plan = Greedy().plan(inst)
    tl = simulate(plan, inst, controller=ControllerConfig.static())
    steps = [(a, b, inst.comp_time(s)) for s, (a, b) in tl.steps.items()]
    decoded = [r.decoded_s for r in tl.transfers]
    window = (min(r.start_s for r in tl.transfers), max(decoded))
    tax, chunks = stream_tax_estimate(steps, decoded, window)
    assert chunks > 4 and tax == pytest.approx(0.004)
    def timeline(planned, run):
        tl = simulate(Greedy().plan(planned), run, controller=ControllerConfig.static())
        decoded = [r.decoded_s for r in tl.transfers]
        return ([(a, b, planned.comp_time(s)) for s, (a, b) in tl.steps.items()], decoded,
                (min(r.start_s for r in tl.transfers), max(decoded)))

    # every step 10% slower on its own: the reference (the load's quiet ratio) takes that out
    slow = timeline(inst, inst.replace(t_comp=inst.t_comp * 1.1))
    assert stream_tax_estimate(*slow, ref=1.1)[0] == pytest.approx(0.004)
    # a slow link (few decodes) and every step 2 ms over its prediction whatever ran beside it
    # (a speed error the load's quiet steps did not show): the steps without a decode inside
    # take it out instead of charging it to the few decodes
    thin = inst.replace(bandwidth_Bps=inst.bandwidth_Bps / 10)
    late = timeline(thin, thin.replace(t_comp=thin.t_comp + 0.002))
    tax, chunks = stream_tax_estimate(*late)
    assert chunks >= 4 and tax == pytest.approx(0.004)
    assert stream_tax_estimate(steps, [], window) == (0.0, 0)
    assert stream_tax_estimate(steps, decoded, (1e9, 2e9)) == (0.0, 0)


def test_the_receive_tax_a_load_measures_is_the_one_the_simulator_charged():
    """The simulator runs a step ``1 + receive_tax`` times slower while a transfer's bytes
    arrive; :func:`receive_tax_estimate` over that load's timeline gives the tax back, and says
    nothing of a load that streamed nothing beside its steps."""
    from sparkv.scheduler import simulate
    from sparkv.scheduler.estimators import receive_tax_estimate

    inst = synthetic_instance(2 * 1024, chunk_tokens=512, bandwidth_mbps=10).replace(
        receive_tax=0.3)
    tl = simulate(Greedy().plan(inst), inst, controller=ControllerConfig.static())
    steps = [(a, b, inst.comp_time(s)) for s, (a, b) in tl.steps.items()]
    decoded = [r.decoded_s for r in tl.transfers]
    receiving = [(r.start_s, r.end_s) for r in tl.transfers]
    tax, n = receive_tax_estimate(steps, decoded, receiving)
    assert n >= 4 and tax == pytest.approx(0.3)
    assert receive_tax_estimate(steps, decoded, [(1e9, 2e9)]) == (0.0, 0)
    # steps 10% slower on their own: the reference (the load's quiet ratio) takes that out
    slow = simulate(Greedy().plan(inst), inst.replace(t_comp=inst.t_comp * 1.1),
                    controller=ControllerConfig.static())
    steps = [(a, b, inst.comp_time(s)) for s, (a, b) in slow.steps.items()]
    assert receive_tax_estimate(steps, [r.decoded_s for r in slow.transfers],
                                [(r.start_s, r.end_s) for r in slow.transfers],
                                ref=1.1)[0] == pytest.approx(0.3)


def test_decoding_in_turn_counts_every_frame_still_to_come_in_the_compute_paths_work():
    from sparkv.scheduler import Plan
    from sched_helpers import tiny_instance

    C, S = KVChunkId, StepId
    inst = tiny_instance([[1, 1], [1, 1], [1, 1]], t_proc=0.25)
    p = Plan([S(0, 0), S(0, 1)], [C(1, 0, 0), C(1, 1, 0), C(2, 0, 0), C(2, 1, 0)],
             {c: "q5" for c in (C(1, 0, 0), C(1, 1, 0), C(2, 0, 0), C(2, 1, 0))})
    apart = Controller(p, inst, ControllerConfig.static())
    in_turn = Controller(p, inst.replace(decode_in_turn=True), ControllerConfig.static())
    (comp, link), (comp_t, link_t) = apart.remaining(0.0), in_turn.remaining(0.0)
    assert link_t == pytest.approx(link) and comp_t == pytest.approx(comp + 4 * 0.25)
    # a request, its frame received, then decoded: each stays counted until it is in place
    f = in_turn.next_fetch(0.0)
    assert in_turn.remaining(0.0)[0] == pytest.approx(comp + 4 * 0.25)
    in_turn.chunk_received(f.cid, 1.0)
    assert in_turn.remaining(1.0)[0] == pytest.approx(comp + 4 * 0.25)
    in_turn.chunk_arrived(f.cid, 1.25)
    assert in_turn.remaining(1.25)[0] == pytest.approx(comp + 3 * 0.25)
