"""Cluster selection over every KV head of a layer at once: :func:`select_heads`.

The rule is the per-head one of :meth:`sparkv.decode.index.ClusterIndex.select_scored` (kept as
the reference; tested equal): clusters are taken whole, best score first (ties: the lower slot
first); one that does not fit what is left of the entry budget is skipped, and the next ones may
still fill it. Dead slots (score ``-inf``) are never taken. With ``inwin`` a cluster costs only
its entries outside the always-resident window, and one wholly inside it is not taken.

The sort, the running totals and the cut-off of the prefix that fits run on ``[H, S]`` arrays in
one call each; only the greedy fill after the cut-off (clusters that fit what is left, usually a
handful) and the prefetch candidates are per head.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

#: prefetch candidates kept per head (the best-scored clusters the selection left out)
NEXT_UP = 16


class Selection(NamedTuple):
    """Per KV head: the selected slots (best first, then the fill) and the best-scored slots left
    out (prefetch candidates, best first)."""

    picked: list[np.ndarray]
    next_up: list[np.ndarray]


def select_heads(scores: np.ndarray, sizes: np.ndarray, budget: int,
                 inwin: np.ndarray | None = None) -> Selection:
    """``scores [H, S]`` (float, dead slots ``-inf``), ``sizes [H, S]`` (entries per slot),
    ``budget`` entries per head, ``inwin [H, S]`` (entries inside the window) or None ->
    :class:`Selection` of slot indices per head."""
    sc = np.asarray(scores, dtype=np.float64)
    sz = np.asarray(sizes, dtype=np.int64)
    if inwin is not None:
        sz = sz - inwin
        sc = np.where(sz > 0, sc, -np.inf)
    order = np.argsort(-sc, axis=1, kind="stable")                       # [H, S]
    valid = np.isfinite(np.take_along_axis(sc, order, 1))
    nvalid = valid.sum(1)
    osz = np.where(valid, np.take_along_axis(sz, order, 1), 0)
    cum = np.cumsum(osz, axis=1)
    take = np.minimum((cum <= budget).sum(1), nvalid)                    # the prefix that fits
    used = np.where(take > 0, np.take_along_axis(cum, np.maximum(take - 1, 0)[:, None], 1)[:, 0], 0)
    left = budget - used
    picked, next_up = [], []
    for h in range(sc.shape[0]):
        t, n = int(take[h]), int(nvalid[h])
        row, rsz = order[h, :n], osz[h, :n]
        extra = _fill(row[t:], rsz[t:], int(left[h])) if t < n and left[h] > 0 else []
        picked.append(np.concatenate([row[:t], np.asarray(extra, np.int64)]) if extra
                      else row[:t])
        rest = row[t:t + NEXT_UP + len(extra)]
        if extra:
            rest = rest[~np.isin(rest, extra)]
        next_up.append(rest[:NEXT_UP])
    return Selection(picked, next_up)


def _fill(rest: np.ndarray, sizes: np.ndarray, left: int) -> list[int]:
    """The greedy fill: slots of ``rest`` (score order) taken while each still fits ``left``."""
    small = sizes <= left
    out = []
    for j, n in zip(rest[small].tolist(), sizes[small].tolist()):
        if n <= left:
            out.append(j)
            left -= n
            if left <= 0:
                break
    return out
