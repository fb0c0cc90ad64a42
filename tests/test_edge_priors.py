"""sparkv.edge.session.Priors: what one load teaches the next plan about the device's speed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sparkv.edge.results import MIN_COMPUTE_SAMPLES
from sparkv.edge.session import COMPUTE_SAMPLES_HALF, MAX_COMPUTE_STEP, Priors


def _load(ratio: float, samples: int = 50, tax: float = 0.0, tax_chunks: int = 0,
          recv: float = 0.0, recv_steps: int = 0, decode: float = 1.0,
          frames: int = 0) -> SimpleNamespace:
    return SimpleNamespace(link_estimate_Bps=None, compute_ratio=ratio, compute_samples=samples,
                           stream_tax_s=tax, stream_tax_samples=tax_chunks,
                           receive_tax=recv, receive_tax_samples=recv_steps,
                           decode_ratio=decode, decode_samples=frames)


def test_one_load_moves_the_compute_prior_by_a_bounded_factor():
    p = Priors()
    p.learn(_load(49.0))                      # a load that ran beside a burst of other work
    assert p.compute_scale == pytest.approx(MAX_COMPUTE_STEP)
    p.learn(_load(0.01))
    assert p.compute_scale == pytest.approx(1.0)
    for _ in range(3):                        # a lasting change is followed within a few loads
        p.learn(_load(3.0))
    assert p.compute_scale == pytest.approx(8.0)
    p.learn(_load(0.5))                       # within the bound: its share of 50 steps
    assert p.compute_scale == pytest.approx(8.0 * 0.5 ** (50 / (50 + COMPUTE_SAMPLES_HALF)))


def test_too_few_steps_or_a_bad_ratio_teach_nothing():
    p = Priors()
    p.learn(_load(3.0, samples=MIN_COMPUTE_SAMPLES - 1))
    p.learn(_load(float("nan")))
    p.learn(_load(0.0))
    assert p.compute_scale == 1.0


def test_a_load_of_few_quiet_steps_moves_the_prior_less_than_one_of_many():
    few, many = Priors(), Priors()
    few.learn(_load(1.4, samples=MIN_COMPUTE_SAMPLES))    # a deep fade's handful of steps
    many.learn(_load(1.4, samples=60))                    # a local load's
    assert 1.0 < few.compute_scale < 1.1 < many.compute_scale < 1.4
    half = Priors()
    half.learn(_load(1.44, samples=COMPUTE_SAMPLES_HALF))
    assert half.compute_scale == pytest.approx(1.2)       # half way, in log terms


def test_the_stream_tax_is_learned_by_the_share_of_its_chunks_and_bounded():
    from sparkv.edge.session import MAX_STREAM_TAX_S

    p = Priors()
    p.learn(_load(1.0, samples=0, tax=0.004, tax_chunks=MIN_COMPUTE_SAMPLES - 1))
    assert p.stream_tax_s == 0.0                          # too few chunks: nothing
    p.learn(_load(1.0, samples=0, tax=0.004, tax_chunks=COMPUTE_SAMPLES_HALF))
    assert p.stream_tax_s == pytest.approx(0.002)         # half way
    for _ in range(40):
        p.learn(_load(1.0, samples=0, tax=0.004, tax_chunks=200))
    assert p.stream_tax_s == pytest.approx(0.004, rel=1e-3)
    p.learn(_load(1.0, samples=0, tax=5.0, tax_chunks=10_000))  # another process held the cores
    assert p.stream_tax_s == MAX_STREAM_TAX_S
    p.learn(_load(1.0, samples=0, tax=float("nan"), tax_chunks=100))
    assert p.stream_tax_s == MAX_STREAM_TAX_S


def test_a_load_reports_its_stream_tax_unless_other_asks_shared_the_cores():
    """EngineStats.result: every step below the last layer ran 1 ms over its prediction, and
    the one with a chunk decoded inside it 3 ms: the tax is 2 ms a chunk; a load whose lane
    had other asks says nothing."""
    from sparkv.edge.stats import EngineStats
    from sparkv.layout import StepId
    from sparkv.scheduler import Controller, ControllerConfig, Fetch
    from sparkv.scheduler.instance import synthetic_instance
    from sparkv.scheduler.planners import LocalOnly

    inst = synthetic_instance(2048, chunk_tokens=512, bandwidth_mbps=50)

    def load(peak: float):
        ctl = Controller(LocalOnly().plan(inst), inst, ControllerConfig.static())
        ctl.state.compute_estimator.load = peak
        ctl.state.compute_estimator.load = 1.0
        stats = EngineStats()
        now = 0.0
        for t in range(inst.n_t):
            for l in range(inst.L):  # noqa: E741
                step = StepId(t, l)
                took = inst.comp_time(step) + (0.003 if l == inst.L - 2 else 0.001)
                cid = next(iter(inst.geometry.chunks_of_step(StepId(t, 0))))
                if l == inst.L - 2:   # one chunk streamed from the start, decoded in this step
                    stats.requested(Fetch(cid, "q5"), 1000, 0.0)
                    stats.bytes_flowing(cid, 0.0, chunk_start=True)
                    log = stats.received(cid, now + took / 4)
                    stats.decoded(log, now + took / 2, 0.001, 1000, None)
                stats.step_ran(step, now, now + took, took)
                now += took
        return stats.result(SimpleNamespace(sources=dict), ctl)

    alone = load(1.0)
    assert alone.stream_tax_samples == inst.n_t
    assert alone.stream_tax_s == pytest.approx(0.002, rel=1e-6)
    # its decode ratio: the decoders' 1 ms a frame over the instance's t_proc of those frames
    q5 = inst.level_index("q5")
    nominal = sum(float(inst.t_proc[inst.chunk_index(next(iter(
        inst.geometry.chunks_of_step(StepId(t, 0))))), q5]) for t in range(inst.n_t))
    assert alone.decode_samples == inst.n_t
    assert alone.decode_ratio == pytest.approx(inst.n_t * 0.001 / nominal, rel=1e-6)
    shared = load(2.0)
    assert (shared.stream_tax_s, shared.stream_tax_samples) == (0.0, 0)
    assert (shared.decode_ratio, shared.decode_samples) == (1.0, 0)


def test_the_decode_scale_is_learned_by_the_share_of_its_frames_and_bounded():
    """Priors.decode_scale moves toward each load's decode ratio like the stream tax, within
    its bounds; the plan's decode times are the codec's nominal ones times it."""
    import numpy as np
    from test_quality_recent_floor import _manifest

    from sparkv.edge.planning import build_instance
    from sparkv.edge.session import MAX_DECODE_SCALE, MIN_DECODE_SCALE

    p = Priors()
    p.learn(_load(1.0, samples=0, decode=3.0, frames=MIN_COMPUTE_SAMPLES - 1))
    assert p.decode_scale == 1.0                            # too few frames: nothing
    p.learn(_load(1.0, samples=0, decode=3.0, frames=COMPUTE_SAMPLES_HALF))
    assert p.decode_scale == pytest.approx(2.0)             # half way
    p.learn(_load(1.0, samples=0, decode=1e6, frames=10_000))
    assert p.decode_scale == MAX_DECODE_SCALE
    p.learn(_load(1.0, samples=0, decode=1e-9, frames=10_000))
    assert p.decode_scale == MIN_DECODE_SCALE
    manifest = _manifest(["raw", "q8", "q5"])
    g = manifest.chunk_geometry
    t_comp = np.full((g.num_token_chunks, g.num_layers), 0.5)
    plain = build_instance(manifest, t_comp, 1e5, quality_floor="q5")
    scaled = build_instance(manifest, t_comp, 1e5, quality_floor="q5", decode_scale=1.9)
    assert np.allclose(scaled.t_proc, plain.t_proc * 1.9)


def test_the_receive_tax_is_learned_like_the_stream_tax_and_bounded():
    from sparkv.edge.session import MAX_RECEIVE_TAX, RECEIVE_SAMPLES_HALF

    p = Priors()
    p.learn(_load(1.0, samples=0, recv=0.2, recv_steps=MIN_COMPUTE_SAMPLES - 1))
    assert p.receive_tax == 0.0                           # too few steps: nothing
    p.learn(_load(1.0, samples=0, recv=0.2, recv_steps=RECEIVE_SAMPLES_HALF))
    assert p.receive_tax == pytest.approx(0.1)            # half way
    p.learn(_load(1.0, samples=0, recv=9.0, recv_steps=10_000))
    assert p.receive_tax == MAX_RECEIVE_TAX
    assert p.stream_tax_s == 0.0                          # the two are learned apart


def test_receive_time_costs_the_compute_path_per_second_on_the_link():
    """A step that ran beside a transfer for all of its 20 ms and took 4 ms over its 16 ms
    prediction lost a fifth of its time to the link: it ran 1.25 times slower there (a receive
    tax of 0.25); steps with a decode inside (the stream tax's) and steps mostly away from the
    link say nothing, and so do too few."""
    from sparkv.scheduler.estimators import MIN_BASE_STEPS, receive_tax_estimate

    steps = [(0.02 * i, 0.02 * (i + 1), 0.016) for i in range(10)]
    receiving = [(0.0, 0.075), (0.075, 0.145)]      # back to back, then the link is quiet
    decoded = [0.031, 0.111]                         # inside steps 1 and 5
    alpha, n = receive_tax_estimate(steps, decoded, receiving)
    assert n == 7 - 2 and alpha == pytest.approx(0.25)  # steps 0-6 beside it (7: a quarter)
    assert receive_tax_estimate(steps, decoded, receiving, ref=1.25) == (pytest.approx(0.0), n)
    few = receiving[:1]                              # steps 0, 2 and 3: fewer than the minimum
    assert receive_tax_estimate(steps, decoded, few) == (0.0, 0)
    assert MIN_BASE_STEPS == 4


def test_a_plan_is_built_with_the_receive_tax_the_session_learned():
    """:func:`build_instance` hands the session's receive tax to the instance, where the
    simulator and the planners charge it; a bad one is refused."""
    import numpy as np
    from test_quality_recent_floor import _manifest

    from sparkv.edge.planning import build_instance
    from sparkv.scheduler.instance import InstanceError

    manifest = _manifest(["raw", "q8", "q5"])
    g = manifest.chunk_geometry
    t_comp = np.full((g.num_token_chunks, g.num_layers), 0.5)
    inst = build_instance(manifest, t_comp, 1e5, quality_floor="q5", stream_tax_s=0.003,
                          receive_tax=0.2)
    assert (inst.stream_tax_s, inst.receive_tax) == (0.003, 0.2)
    assert build_instance(manifest, t_comp, 1e5, quality_floor="q5").receive_tax == 0.0
    with pytest.raises(InstanceError, match="receive_tax"):
        inst.replace(receive_tax=float("nan"))
