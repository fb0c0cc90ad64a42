"""Small hand-made scheduler instances, for tests."""

from __future__ import annotations

import numpy as np

from sparkv.layout import ChunkGeometry
from sparkv.scheduler import Instance, StreamLevel

TWO_LEVELS = (StreamLevel("hi", 1, 8), StreamLevel("lo", 0, 4))


def tiny_instance(t_comp, *, groups: int = 1, nbytes=1000, bw: float = 1000.0,
                  rtt: float = 0.0, t_proc: float = 0.0, suffix: float = 0.0,
                  levels=(StreamLevel("q5", 0, 5),), floor: str | None = None) -> Instance:
    """``t_comp[t][l]`` seconds; every chunk ``nbytes`` bytes at every level (or an array
    ``[num_chunks, num_levels]``); bandwidth in bytes/s. 16-token chunks."""
    t_comp = np.asarray(t_comp, dtype=float)
    n_t, L = t_comp.shape
    geom = ChunkGeometry(n_t * 16, 16, L, groups, 4, 1)
    nl = len(levels)
    if np.isscalar(nbytes):
        nb = np.full((geom.num_chunks, nl), int(nbytes))
    else:
        nb = np.asarray(nbytes)
    tp = np.full((geom.num_chunks, nl), float(t_proc))
    return Instance(geom, tuple(levels), nb, tp, t_comp, bw, rtt, suffix,
                    floor if floor is not None else levels[-1].name, name="tiny")
