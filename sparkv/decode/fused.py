"""One fused gather-attend per layer over the clusters a step selected: :func:`fused_attention`.

A clustered layer attends, per KV head, its window (the same positions in every head) and a
list of **runs** of the row arena (:mod:`sparkv.decode.rows`): the selected clusters' flushed
entries, their write-buffer tails, the RAM-only entries. One numba call (serial: a layer's
rows are about a thousand per head, and a parallel region's wake-ups cost more than that on a
loaded 2-core machine) reads the runs where they lie, scores every row, and accumulates the softmax-weighted values:
nothing is gathered, concatenated or padded first. It equals
:func:`sparkv.decode.gather.padded_attention` over the same entries (tested at float32
rounding):

* a row at a window position (``pos < sinks`` or ``pos >= recent_start``) is skipped (the window
  holds it), so each position is attended once;
* a row is visible to query ``i`` if ``pos <= q_pos[i]``; a query that sees nothing gets zeros.

Runs are ``runs [N, 4]`` int64 rows ``(head, first row, rows, selected)`` sorted by head;
``selected`` marks the runs counted as retrieved (the returned ``kept [H, 2]``: rows attended
beyond the window, and those of them in selected runs).
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np
import torch

_FAST = {"nsz", "arcp", "contract", "afn", "reassoc"}


@nb.njit(fastmath=_FAST, error_model="numpy", nogil=True, cache=True, boundscheck=False)
def _fused(q: np.ndarray, mpos: np.ndarray, scale: float, K: np.ndarray, V: np.ndarray,
           P: np.ndarray, runs: np.ndarray, hfirst: np.ndarray, wk: np.ndarray, wv: np.ndarray,
           wpos: np.ndarray, s_end: int, w0: int, out: np.ndarray,
           kept: np.ndarray) -> None:  # pragma: no cover - numba
    H, M, D = q.shape
    W = wk.shape[1]
    for h in range(H):
        a, b = hfirst[h], hfirst[h + 1]
        tot = W
        for r in range(a, b):
            tot += runs[r, 2]
        s = np.empty((M, tot), dtype=np.float32)
        src = np.empty(tot, dtype=np.int64)        # arena row, or -1 - window index
        nk = 0
        nsel = 0
        c = 0
        for j in range(W):
            src[c] = -1 - j
            for m in range(M):
                if wpos[j] <= mpos[m]:
                    acc = np.float32(0.0)
                    for i in range(D):
                        acc += q[h, m, i] * wk[h, j, i]
                    s[m, c] = acc * scale
                else:
                    s[m, c] = -np.inf
            c += 1
        for r in range(a, b):
            first, n, sel = runs[r, 1], runs[r, 2], runs[r, 3]
            for x in range(first, first + n):
                p = P[x]
                if p < s_end or p >= w0:
                    continue
                nk += 1
                if sel:
                    nsel += 1
                src[c] = x
                for m in range(M):
                    if p <= mpos[m]:
                        acc = np.float32(0.0)
                        for i in range(D):
                            acc += q[h, m, i] * K[x, i]
                        s[m, c] = acc * scale
                    else:
                        s[m, c] = -np.inf
                c += 1
        kept[h, 0] = nk
        kept[h, 1] = nsel
        for m in range(M):
            mx = -np.inf
            for j in range(c):
                mx = max(mx, s[m, j])
            o = out[h, m]
            for i in range(D):
                o[i] = 0.0
            if mx == -np.inf:
                continue
            tot_w = np.float32(0.0)
            for j in range(c):
                if s[m, j] == -np.inf:
                    continue
                w = np.exp(s[m, j] - mx)
                tot_w += w
                x = src[j]
                if x >= 0:
                    for i in range(D):
                        o[i] += w * V[x, i]
                else:
                    wj = -1 - x
                    for i in range(D):
                        o[i] += w * wv[h, wj, i]
            for i in range(D):
                o[i] /= tot_w


def fused_attention(q: torch.Tensor, q_pos: torch.Tensor, scale: float | None,
                    arena_k: torch.Tensor, arena_v: torch.Tensor, arena_pos: np.ndarray,
                    runs: np.ndarray, window: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                    window_span: tuple[int, int]) -> tuple[torch.Tensor, np.ndarray]:
    """``q [1, Hq, nq, D]`` over the window ``(k, v [H, W, D], pos [W])`` and the arena runs
    ``runs [N, 4]`` (module docstring), the window span ``(sinks, recent_start)``; returns
    ``([1, Hq, nq, D]`` in ``q``'s dtype, ``kept [H, 2])``. float32 arena only."""
    _, hq, nq, d = q.shape
    wk, wv, wpos = window
    h = int(wk.shape[0])
    group = hq // h
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qn = q[0].detach().float().reshape(h, group * nq, d).contiguous().numpy()
    qp = q_pos.to(torch.int64).numpy()
    mpos = np.ascontiguousarray(np.tile(qp, group))
    runs = np.ascontiguousarray(runs, dtype=np.int64).reshape(-1, 4)
    hfirst = np.searchsorted(runs[:, 0], np.arange(h + 1), side="left").astype(np.int64)
    out = np.empty(qn.shape, np.float32)
    kept = np.zeros((h, 2), np.int64)
    _fused(qn, mpos, np.float32(scale), arena_k.numpy(), arena_v.numpy(), arena_pos, runs,
           hfirst, wk.float().contiguous().numpy(), wv.float().contiguous().numpy(),
           wpos.to(torch.int64).numpy(), int(window_span[0]), int(window_span[1]), out, kept)
    res = torch.from_numpy(out).view(1, hq, nq, d)
    return (res if q.dtype == torch.float32 else res.to(q.dtype)), kept


def warm_up() -> None:
    """Compiles (or loads from numba's cache) the kernel: one small call, with the argument
    types every clustered layer passes (a float32 arena, int64 positions and runs)."""
    h, w, d = 2, 4, 16
    gen = torch.Generator().manual_seed(0)
    arena_k, arena_v = torch.randn(8, d, generator=gen), torch.randn(8, d, generator=gen)
    runs = np.array([[0, 0, 4, 1], [1, 4, 4, 0]], np.int64)
    window = (torch.randn(h, w, d, generator=gen), torch.randn(h, w, d, generator=gen),
              torch.tensor([0, 1, 14, 15]))
    fused_attention(torch.randn(1, 2 * h, 1, d, generator=gen), torch.tensor([15]), None,
                    arena_k, arena_v, np.arange(2, 10, dtype=np.int64), runs, window, (2, 14))
