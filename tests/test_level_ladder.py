"""The density planner's level ladder (int8, k8v4, int4, int2): exact against a brute force,
nothing below k8v4 while int8 and k8v4 meet the ratio, the densest keep the most bits."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from sparkv.cache.levels import QUALITY_ORDER
from sparkv.device.density import LADDER, LEVEL_ERROR, LEVEL_RATIO, OLD_LADDER, plan_levels


def _brute(d: np.ndarray, ratio: float, ladder: tuple[str, ...]) -> float:
    """The least density-weighted error of any assignment of ``ladder``'s levels within
    ``ratio`` (nominal bytes relative to int8)."""
    best = np.inf
    for combo in itertools.product(ladder, repeat=len(d)):
        if sum(LEVEL_RATIO[lv] for lv in combo) <= ratio * len(d) + 1e-9:
            best = min(best, float(sum(x * LEVEL_ERROR[lv] for x, lv in zip(d, combo))))
    return best


@pytest.mark.parametrize("seed", range(4))
def test_the_mix_is_the_least_error_a_brute_force_finds(seed):
    rng = np.random.default_rng(seed)
    d = rng.random(6) ** 3                       # skewed, as measured densities are
    for ratio in (0.3, 0.45, 0.6, 0.7):          # below k8v4's: the whole ladder
        m = plan_levels(d, ratio)
        assert m.ratio <= ratio + 1e-9
        assert m.error == pytest.approx(_brute(d, ratio, LADDER), rel=1e-9, abs=1e-15)
    for ratio in (0.75, 0.8, 0.9, 0.97):         # int8 and k8v4 meet it: nothing lower
        m = plan_levels(d, ratio)
        assert set(m.levels) <= {"int8", "k8v4"} and m.ratio <= ratio + 1e-9
        assert m.error == pytest.approx(_brute(d, ratio, LADDER[:2]), rel=1e-9, abs=1e-15)
    for ratio in (0.4, 0.75, 0.9):               # the ladder before k8v4, as it was
        m = plan_levels(d, ratio, ladder=OLD_LADDER)
        assert "k8v4" not in m.levels
        assert m.error == pytest.approx(_brute(d, ratio, OLD_LADDER), rel=1e-9, abs=1e-15)


def test_a_denser_chunk_never_has_fewer_bits():
    rng = np.random.default_rng(7)
    d = rng.random(40) ** 4
    for ratio in np.linspace(0.25, 1.0, 16):
        m = plan_levels(d, float(ratio), protect=[0], fp_ratio=3.7)
        order = np.argsort(-d[1:], kind="stable") + 1
        ranks = [QUALITY_ORDER.index(m.levels[i]) for i in order]
        assert ranks == sorted(ranks), (ratio, m.levels)


def test_k8v4_takes_the_sparsest_chunks_first():
    d = [0.9, 0.1, 0.5, 0.05, 0.8, 0.3, 0.2, 0.6, 0.02, 0.4]
    m = plan_levels(d, 0.9)
    # 10 chunks in 9 units: 6 at int8 and 4 at k8v4 (9.0), the four sparsest at k8v4
    assert m.counts() == {"fp": 0, "int8": 6, "k8v4": 4, "int4": 0, "int2": 0}
    assert {i for i, lv in enumerate(m.levels) if lv == "k8v4"} == {1, 3, 6, 8}
    assert set(plan_levels(d, 0.75).levels) == {"k8v4"}
