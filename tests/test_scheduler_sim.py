"""The discrete-event simulator against hand-computed timelines, and the bandwidth traces."""

from __future__ import annotations

import math

import pytest

from sparkv.layout import KVChunkId, StepId
from sparkv.scheduler import (ComputeNoise, Plan, SimulationError, Trace, TraceError,
                              estimate_ttft, make_sample_trace, simulate)
from sparkv.scheduler.instance import MBPS, InstanceError
from sched_helpers import tiny_instance

C, S = KVChunkId, StepId


def plan(compute, stream, level="q5"):
    stream = [C(*c) for c in stream]
    return Plan([S(*s) for s in compute], stream, {c: level for c in stream})


def test_local_only_is_the_sum_of_steps_plus_the_suffix():
    inst = tiny_instance([[1, 2], [3, 4]], suffix=0.5)
    p = plan([(0, 0), (0, 1), (1, 0), (1, 1)], [])
    tl = simulate(p, inst)
    assert tl.ttft_s == pytest.approx(10.5)
    assert tl.steps[S(1, 0)] == pytest.approx((3.0, 6.0))
    assert tl.compute_busy_s == pytest.approx(10.0) and tl.link_busy_s == 0


def test_stream_only_pays_one_rtt_and_overlaps_decode_with_the_next_transfer():
    # 4 chunks of 1000 B at 1000 B/s, RTT 0.1 s, decode 0.2 s each, suffix 0.5 s
    inst = tiny_instance([[1, 1], [1, 1]], rtt=0.1, t_proc=0.2, suffix=0.5)
    p = plan([], [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)])
    tl = simulate(p, inst)
    # transfers end at 1.1, 2.1, 3.1, 4.1; the last decode ends at 4.3
    assert [r.end_s for r in tl.transfers] == pytest.approx([1.1, 2.1, 3.1, 4.1])
    assert tl.transfers[-1].decoded_s == pytest.approx(4.3)
    assert tl.ready_s == pytest.approx(4.3)
    assert tl.ttft_s == pytest.approx(4.8)
    assert tl.link_wait_s == pytest.approx(0.1) and tl.link_busy_s == pytest.approx(4.0)
    assert tl.bytes_streamed == 4000


def test_compute_waits_for_a_streamed_chunk_it_attends_over():
    # layers 0, 1 attend; layer 2 is the projection. Chunk 1's layer 1 needs streamed KV(0, 1).
    inst = tiny_instance([[1, 1, 0.1], [2, 2, 0.1]], nbytes=3000, rtt=0.5, t_proc=0.25,
                         suffix=0.5)
    p = plan([(0, 0), (1, 0), (1, 1), (1, 2)], [(0, 1, 0), (0, 2, 0)])
    tl = simulate(p, inst)
    # link: (0,1) 0.5 -> 3.5, decoded 3.75; (0,2) 3.5 -> 6.5, decoded 6.75
    # compute: (0,0) 0-1; (1,0) 1-3; (1,1) waits for KV(0,1): 3.75-5.75; (1,2) 5.75-5.85
    assert tl.steps[S(1, 1)] == pytest.approx((3.75, 5.75))
    assert tl.steps[S(1, 2)] == pytest.approx((5.75, 5.85))
    assert tl.ready_s == pytest.approx(6.75)
    assert tl.ttft_s == pytest.approx(7.25)


def test_attention_waits_for_every_earlier_token_chunk_not_only_the_previous():
    # KV(1, 0) arrives at 1 s but KV(0, 0) only at 2 s: step (2, 0) may start at 2 s, not 1 s
    inst = tiny_instance([[1, 0.1], [1, 0.1], [1.5, 0.1]], suffix=0.25)
    p = plan([(2, 0), (2, 1)], [(1, 0, 0), (0, 0, 0), (0, 1, 0), (1, 1, 0)])
    tl = simulate(p, inst)
    assert tl.steps[S(2, 0)] == pytest.approx((2.0, 3.5))
    assert tl.steps[S(2, 1)] == pytest.approx((3.5, 3.6))
    assert tl.ready_s == pytest.approx(4.0)
    assert tl.ttft_s == pytest.approx(4.25)


def test_the_suffix_waits_for_the_compute_thread():
    inst = tiny_instance([[5, 0.5]], suffix=1.0)
    p = plan([(0, 0), (0, 1)], [])
    assert simulate(p, inst).ttft_s == pytest.approx(6.5)


def test_a_call_s_fixed_cost_is_paid_once_per_span_and_once_per_single_step():
    """A layer's token chunks run as one span (CommitSpans) pay ``call_s`` once; the same steps
    handed out one at a time pay it each (what makes a fragmented layer slower than local's)."""
    from sparkv.scheduler import ControllerConfig

    inst = tiny_instance([[1, 2], [3, 4]], suffix=0.5).replace(call_s=0.25)
    p = plan([(0, 0), (1, 0), (0, 1), (1, 1)], [])
    spans = simulate(p, inst, controller=ControllerConfig.static().with_spans(True))
    assert spans.ttft_s == pytest.approx(10.5 + 2 * 0.25)       # one call a layer
    single = simulate(p, inst, controller=ControllerConfig.static())
    assert single.ttft_s == pytest.approx(10.5 + 4 * 0.25)      # one call a step
    free = simulate(p, inst.replace(call_s=0.0), controller=ControllerConfig.static())
    assert free.ttft_s == pytest.approx(10.5)


def test_steps_done_before_the_load_are_in_place_at_time_zero():
    """The edge's prelude: its steps are neither run again nor waited for."""
    from sparkv.scheduler import ControllerConfig

    inst = tiny_instance([[1, 2], [3, 4]], suffix=0.5)
    p = plan([(0, 0), (0, 1), (1, 0), (1, 1)], [])
    tl = simulate(p, inst, controller=ControllerConfig.static(), done_steps=[S(0, 0), S(0, 1)])
    assert set(tl.steps) == {S(1, 0), S(1, 1)}
    assert tl.ttft_s == pytest.approx(7.5)


def test_trace_drop_slows_the_transfer():
    # 1000 B/s for 1 s, 500 B/s for 1 s, then 1000 B/s: 2000 B take 2.5 s
    trace = Trace.from_rows([0, 1, 2], [1000 / MBPS, 500 / MBPS, 1000 / MBPS], loop=False)
    assert trace.transfer_end(0.0, 2000) == pytest.approx(2.5)
    inst = tiny_instance([[1]], nbytes=2000, t_proc=0.1, suffix=0.5)
    tl = simulate(plan([], [(0, 0, 0)]), inst, trace)
    assert tl.ttft_s == pytest.approx(3.1)


def test_rtt_column_of_the_trace_is_used():
    trace = Trace.from_rows([0, 10], [1000 / MBPS, 1000 / MBPS], rtt_ms=[300, 300])
    inst = tiny_instance([[1]], rtt=0.01)
    tl = simulate(plan([], [(0, 0, 0)]), inst, trace)
    assert tl.transfers[0].start_s == pytest.approx(0.3)
    assert tl.ttft_s == pytest.approx(1.3)


def test_compute_noise_slowdown_window():
    inst = tiny_instance([[1, 1]], suffix=1.0)
    p = plan([(0, 0), (0, 1)], [])
    noise = ComputeNoise(slowdowns=((0.5, 100.0, 2.0),))
    # (0,0) starts at 0 (outside the window): 1 s; (0,1) at 1 s: 2 s; suffix at 3 s: 2 s
    assert simulate(p, inst, noise=noise).ttft_s == pytest.approx(5.0)
    noisy = simulate(p, inst, noise=ComputeNoise(sigma=0.3, seed=1)).ttft_s
    assert noisy != pytest.approx(3.0) and noisy > 0


def test_estimate_matches_the_event_simulation_exactly():
    inst = tiny_instance([[1, 1, 0.1], [2, 2, 0.1]], nbytes=3000, rtt=0.5, t_proc=0.25,
                         suffix=0.5)
    p = plan([(0, 0), (1, 0), (1, 1), (1, 2)], [(0, 1, 0), (0, 2, 0)])
    assert estimate_ttft(p, inst) == pytest.approx(simulate(p, inst).ttft_s, abs=1e-12)


def test_each_chunk_decoded_while_a_step_runs_lengthens_it_by_the_stream_tax():
    # step (0, 0) takes 2.5 s; chunks stream back to back at 1 s each, decoded 0.2 s later (1.2,
    # 2.2, 3.2); a tax of 0.5 s: the decodes at 1.2 and 2.2 push its end to 3.5, which takes in
    # the one at 3.2: it ends at 4.0
    inst = tiny_instance([[2.5, 1], [1, 1]], t_proc=0.2, suffix=0.5).replace(stream_tax_s=0.5)
    p = plan([(0, 0)], [(0, 1, 0), (1, 0, 0), (1, 1, 0)])
    tl = simulate(p, inst)
    assert tl.steps[S(0, 0)] == pytest.approx((0.0, 4.0))
    assert tl.compute_busy_s == pytest.approx(4.0)
    assert tl.ttft_s == pytest.approx(4.5)
    assert estimate_ttft(p, inst) == pytest.approx(tl.ttft_s, abs=1e-12)
    untaxed = inst.replace(stream_tax_s=0.0)
    assert simulate(p, untaxed).ttft_s == pytest.approx(3.7)   # the last decode, 3.2, + 0.5


def test_a_step_runs_slower_while_the_link_receives_by_the_receive_tax():
    # step (0, 0): 2.5 s of work; chunks stream back to back at 1 s each from 0 to 3, decoded
    # 0.2 s later. A receive tax of 0.5: the step does 2 s of work by 3 (1.5x slower), its last
    # 0.5 s after: it ends at 3.5, TTFT 4.0. With a stream tax of 0.5 too, after its work: the
    # decodes at 1.2 and 2.2 push its end to 4.5, which takes in the one at 3.2: 5.0
    inst = tiny_instance([[2.5, 1], [1, 1]], t_proc=0.2, suffix=0.5).replace(receive_tax=0.5)
    p = plan([(0, 0)], [(0, 1, 0), (1, 0, 0), (1, 1, 0)])
    tl = simulate(p, inst)
    assert tl.steps[S(0, 0)] == pytest.approx((0.0, 3.5))
    assert tl.compute_busy_s == pytest.approx(3.5)
    assert tl.ttft_s == pytest.approx(4.0)
    assert estimate_ttft(p, inst) == pytest.approx(tl.ttft_s, abs=1e-12)
    both = inst.replace(stream_tax_s=0.5)
    assert simulate(p, both).steps[S(0, 0)] == pytest.approx((0.0, 5.0))
    assert estimate_ttft(p, both) == pytest.approx(simulate(p, both).ttft_s, abs=1e-12)
    # the round trip before the first byte is no receiving: a step that ends in it is not slowed
    late = tiny_instance([[0.4, 1], [1, 1]], rtt=0.5, t_proc=0.2).replace(receive_tax=0.5)
    tl = simulate(p, late)
    assert tl.steps[S(0, 0)] == pytest.approx((0.0, 0.4))
    assert estimate_ttft(p, late) == pytest.approx(tl.ttft_s, abs=1e-12)
    with pytest.raises(InstanceError, match="receive_tax"):
        inst.replace(receive_tax=-0.1)


def test_an_unexecutable_plan_is_reported_not_hung():
    inst = tiny_instance([[1, 1], [1, 1]])
    # (1, 0) needs KV(0, 0), which nobody provides
    p = plan([(1, 0), (1, 1)], [(0, 1, 0)])
    with pytest.raises(SimulationError, match=r"deadlock.*step\(t=1, l=0\) waits for "
                                              r"chunk\(t=0, l=0, g=0\)"):
        simulate(p, inst)
    with pytest.raises(SimulationError):
        estimate_ttft(p, inst)


# --------------------------------------------------------------------------- traces
def test_trace_csv_roundtrip_and_loop():
    tr = Trace.parse("time_s,mbps,rtt_ms\n0,8,10\n1,16,20\n", name="x")
    assert tr.period_s == 2.0 and tr.loop
    assert tr.rate_Bps(0.5) == 1e6 and tr.rate_Bps(1.5) == 2e6
    assert tr.rate_Bps(2.5) == 1e6          # second period
    assert tr.rtt_s(1.2, 0.0) == pytest.approx(0.02)
    assert Trace.parse(tr.to_csv()).mbps == tr.mbps
    held = Trace.parse("time_s,mbps\n0,8\n1,16\n", loop=False)
    assert held.rate_Bps(50) == 2e6


def test_trace_outage_and_errors():
    tr = Trace.from_rows([0, 1, 2], [8e-3, 0.0, 8e-3], loop=False)  # 1000 B/s, outage, 1000 B/s
    assert tr.transfer_end(0.5, 1000) == pytest.approx(2.5)
    assert tr.bytes_between(0, 3) == pytest.approx(2000)
    with pytest.raises(TraceError, match="header"):
        Trace.parse("t,rate\n0,1\n")
    with pytest.raises(TraceError, match="increasing"):
        Trace.parse("time_s,mbps\n0,1\n0,2\n")
    with pytest.raises(TraceError, match="starts at time 0"):
        Trace.parse("time_s,mbps\n1,1\n")
    with pytest.raises(TraceError, match="no positive rate"):
        Trace.parse("time_s,mbps\n0,0\n")
    with pytest.raises(TraceError, match="never completes"):
        Trace.from_rows([0, 1], [8, 0], loop=False).transfer_end(0, 1e9)


@pytest.mark.parametrize("name", ["wifi", "lte", "deep-fade"])
def test_sample_traces_ship_and_match_their_generator(name):
    tr = Trace.sample(name)
    assert tr.times_s[0] == 0 and len(tr.times_s) > 100
    assert tr.mbps == make_sample_trace(name).mbps
    if name == "deep-fade":
        assert tr.rate_Bps(5.0) == 1.0 * MBPS and tr.rate_Bps(0.5) > 70 * MBPS
    assert math.isfinite(tr.mean_mbps())


def test_decoding_in_turn_runs_every_decode_on_the_compute_thread_between_steps():
    # step (0, 0) takes 2.5 s; chunks arrive at 1, 2 and 3 s and take 0.2 s to decode. In
    # turn, the compute thread decodes the two received during the step after it (2.5-2.9),
    # then runs nothing (the plan computes no more) and decodes the third at 3.0-3.2
    inst = tiny_instance([[2.5, 1], [1, 1]], t_proc=0.2, suffix=0.5).replace(decode_in_turn=True)
    p = plan([(0, 0)], [(0, 1, 0), (1, 0, 0), (1, 1, 0)])
    tl = simulate(p, inst)
    assert [r.decoded_s for r in tl.transfers] == pytest.approx([2.7, 2.9, 3.2])
    assert tl.ttft_s == pytest.approx(3.7)
    assert estimate_ttft(p, inst) == pytest.approx(tl.ttft_s, abs=1e-12)
    # a step that needs a streamed chunk waits for it and its decode: (1, 1) attends over
    # KV(0, 1), received at 1.0 while (0, 0) runs, decoded after it
    p = plan([(0, 0), (1, 0), (1, 1)], [(0, 1, 0)])
    tl = simulate(p, inst)
    assert tl.steps[S(1, 0)] == pytest.approx((2.7, 3.7))
    assert tl.steps[S(1, 1)] == pytest.approx((3.7, 4.7))
    assert estimate_ttft(p, inst) == pytest.approx(tl.ttft_s, abs=1e-12)


def test_decoding_in_turn_never_overlaps_a_step_and_agrees_with_the_estimate():
    import numpy as np

    rng = np.random.default_rng(7)
    for _ in range(20):
        t_comp = rng.uniform(0.05, 0.4, size=(4, 5))
        inst = tiny_instance(t_comp, nbytes=int(rng.integers(200, 900)), bw=1000.0, rtt=0.03,
                             t_proc=float(rng.uniform(0.01, 0.08)),
                             suffix=0.1).replace(decode_in_turn=True)
        m = int(rng.integers(1, 4))
        compute = [(t, l) for t in range(m) for l in range(5)]  # noqa: E741
        stream = [(t, l, 0) for t in range(3, m - 1, -1) for l in range(4, -1, -1)  # noqa: E741
                  if t >= m]
        p = plan(compute, stream)
        tl = simulate(p, inst)
        decodes = [(r.decoded_s - 0.0, r) for r in tl.transfers]
        for (a, b) in tl.steps.values():
            for end, r in decodes:
                start = end - float(inst.t_proc[0, 0])
                assert end <= a + 1e-9 or start >= b - 1e-9, (a, b, start, end)
        assert estimate_ttft(p, inst) == pytest.approx(tl.ttft_s, rel=1e-9)
        # decoding costs the compute thread time: never sooner than a decoder of its own
        assert tl.ttft_s >= simulate(p, inst.replace(decode_in_turn=False)).ttft_s - 1e-9
