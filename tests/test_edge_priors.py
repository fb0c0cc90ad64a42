"""sparkv.edge.session.Priors: what one load teaches the next plan about the device's speed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sparkv.edge.session import COMPUTE_SAMPLES_HALF, MAX_COMPUTE_STEP, MIN_COMPUTE_SAMPLES, Priors


def _load(ratio: float, samples: int = 50) -> SimpleNamespace:
    return SimpleNamespace(link_estimate_Bps=None, compute_ratio=ratio, compute_samples=samples)


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
