"""Lower bounds on TTFT for an instance (constant bandwidth, predicted compute times, no noise).

:func:`lp_bound` is the design notes' bound: the LP relaxation without dependencies,
``min over x in [0,1] of max(sum_s (1 - x_s) stream(s), sum_s x_s t_comp(s))`` with ``x_s`` the
computed fraction of layer step ``s``; because the simulator (like the engine) decodes a chunk while
the next one transfers, the streaming side is ``max(sum of bytes / bw, sum of t_proc)`` rather than
their sum, which keeps the bound valid (each of the link, the decoder and the compute thread is a
serial resource). Bytes and ``t_proc`` are the smallest over the allowed levels. The question
prefill ``t_suffix_s`` is added (it follows everything).

:func:`lp_dep_bound` adds the layer dependency (``x[t, l] <= x[t, l-1]``: only a layer prefix of a
token chunk can be computed) and is therefore tighter, still a valid bound.
"""

from __future__ import annotations

import numpy as np

from sparkv.scheduler.instance import Instance


def _step_stream_parts(inst: Instance) -> tuple[np.ndarray, np.ndarray]:
    allowed = inst.allowed_mask
    b = np.where(allowed, inst.chunk_bytes, np.iinfo(np.int64).max).min(axis=1).astype(float)
    p = np.where(allowed, inst.t_proc, np.inf).min(axis=1)
    G = inst.G
    return (b / inst.bandwidth_Bps).reshape(-1, G).sum(axis=1), p.reshape(-1, G).sum(axis=1)


def _solve(inst: Instance, layer_deps: bool) -> float:
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix, vstack

    n = inst.num_steps
    comp = inst.step_t_comp
    xfer, proc = _step_stream_parts(inst)
    # variables: x_0..x_{n-1}, z ; minimise z
    cost = np.zeros(n + 1)
    cost[-1] = 1.0
    rows = [
        np.concatenate([comp, [-1.0]]),      #  sum x C - z <= 0
        np.concatenate([-xfer, [-1.0]]),     #  sum (1-x) X - z <= 0  ->  -sum x X - z <= -sum X
        np.concatenate([-proc, [-1.0]]),
    ]
    b = [0.0, -xfer.sum(), -proc.sum()]
    A = coo_matrix(np.array(rows))
    if layer_deps:
        L = inst.L
        r, c, v = [], [], []
        k = 0
        for s in range(n):
            if s % L:
                r += [k, k]
                c += [s, s - 1]
                v += [1.0, -1.0]        # x_s - x_{s-1} <= 0
                k += 1
        if k:
            A = vstack([A, coo_matrix((v, (r, c)), shape=(k, n + 1))])
            b += [0.0] * k
    res = linprog(cost, A_ub=A.tocsr(), b_ub=np.array(b),
                  bounds=[(0.0, 1.0)] * n + [(0.0, None)], method="highs")
    if not res.success:  # pragma: no cover - the LP is always feasible and bounded
        raise RuntimeError(f"LP bound failed: {res.message}")
    return float(res.x[-1]) + inst.t_suffix_s


def lp_bound(inst: Instance) -> float:
    """The design notes' LP lower bound on TTFT (seconds), no dependencies."""
    return _solve(inst, layer_deps=False)


def lp_dep_bound(inst: Instance) -> float:
    """A tighter LP lower bound with the layer dependency (computed steps are layer prefixes)."""
    return _solve(inst, layer_deps=True)
