"""k-means on keys: batched over the KV heads of a layer (prefill), and 2-means (splits).

Deterministic for a given seed: k-means++ seeding, Lloyd iterations, empty clusters re-seeded
with the point farthest from its centroid. Distances are squared Euclidean (the variance the
policy bounds is the mean squared distance to the centroid).
"""

from __future__ import annotations

from collections import OrderedDict

import numba as nb
import numpy as np
import torch

from sparkv.fileio import checksum
from sparkv.kernels import use_torch_threads


def _sqdist(x: torch.Tensor, c: torch.Tensor, xx: torch.Tensor | None = None) -> torch.Tensor:
    """``x [B, N, D]``, ``c [B, K, D]`` -> ``[B, N, K]`` squared distances (clamped at 0);
    ``xx``: ``(x * x).sum(-1, keepdim=True)`` when already known."""
    if xx is None:
        xx = (x * x).sum(-1, keepdim=True)
    d = xx - 2 * x @ c.transpose(1, 2) + (c * c).sum(-1).unsqueeze(1)
    return d.clamp_min_(0)


@nb.njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _seed_kpp(x: np.ndarray, u: np.ndarray) -> np.ndarray:  # pragma: no cover - numba
    """k-means++ seeding of each point set ``x [B, N, D]`` (float32) with the uniform draws
    ``u [B, K]``: the first centre is point ``floor(u[b, 0] N)``, centre ``j`` the point where
    the running sum of the squared distances to the nearest centre so far first exceeds
    ``u[b, j]`` times their total. Returns ``[B, K, D]``."""
    B, N, D = x.shape
    K = u.shape[1]
    cent = np.empty((B, K, D), dtype=np.float32)
    for b in nb.prange(B):
        best = np.empty(N, dtype=np.float64)
        i0 = min(N - 1, int(u[b, 0] * N))
        for i in range(D):
            cent[b, 0, i] = x[b, i0, i]
        for p in range(N):
            acc = 0.0
            for i in range(D):
                t = x[b, p, i] - cent[b, 0, i]
                acc += t * t
            best[p] = acc
        for j in range(1, K):
            tot = 0.0
            for p in range(N):
                tot += best[p] + 1e-12
            r = u[b, j] * tot
            pick = N - 1
            run = 0.0
            for p in range(N):
                run += best[p] + 1e-12
                if run > r:
                    pick = p
                    break
            for i in range(D):
                cent[b, j, i] = x[b, pick, i]
            for p in range(N):
                acc = 0.0
                for i in range(D):
                    t = x[b, p, i] - cent[b, j, i]
                    acc += t * t
                if acc < best[p]:
                    best[p] = acc
    return cent


@nb.njit(parallel=True, cache=True, nogil=True)
def _centroids(x: np.ndarray, labels: np.ndarray, k: int
               ) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover - numba
    """Per point set ``b``: the sums ``[B, K, D]`` (float64) of the points of each label, and
    the counts ``[B, K]``."""
    B, N, D = x.shape
    sums = np.zeros((B, k, D), dtype=np.float64)
    counts = np.zeros((B, k), dtype=np.int64)
    for b in nb.prange(B):
        for p in range(N):
            c = labels[b, p]
            counts[b, c] += 1
            for i in range(D):
                sums[b, c, i] += x[b, p, i]
    return sums, counts


#: labels of the last prefill clusterings (point sets of at least ``_MEMO_POINTS``), by (XXH64
#: of the points, shape, k, iters, seed): a process that builds several policies over the same
#: prompt (a benchmark) clusters it once
_MEMO: OrderedDict[tuple, torch.Tensor] = OrderedDict()
_MEMO_ITEMS = 64
_MEMO_POINTS = 1024


def kmeans(x: torch.Tensor, k: int, iters: int = 12, seed: int = 0) -> torch.Tensor:
    """Labels ``[B, N]`` (int64) of ``k`` clusters for each of ``B`` point sets ``x [B, N, D]``.

    k-means++ seeding (one numba call, the point sets in parallel), then Lloyd iterations
    (batched: distances by one matmul, centroids by one numba pass). Deterministic, so the
    labels of the same (large) point sets are remembered (the last :data:`_MEMO_ITEMS`)."""
    b, n, d = x.shape
    k = max(1, min(k, n))
    x = x.to(torch.float32).contiguous()
    if n < _MEMO_POINTS:
        return _kmeans(x, k, iters, seed)
    key = (checksum(x.numpy().tobytes()), b, n, d, k, iters, seed)
    hit = _MEMO.get(key)
    if hit is not None:
        _MEMO.move_to_end(key)
        return hit.long()
    labels = _kmeans(x, k, iters, seed)
    _MEMO[key] = labels.to(torch.int32)
    while len(_MEMO) > _MEMO_ITEMS:
        _MEMO.popitem(last=False)
    return labels


def _kmeans(x: torch.Tensor, k: int, iters: int, seed: int) -> torch.Tensor:
    b, n, d = x.shape
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(b, k, generator=g, dtype=torch.float64).numpy()
    use_torch_threads()
    cent = torch.from_numpy(_seed_kpp(x.numpy(), u))
    xx = (x * x).sum(-1, keepdim=True)
    xn = x.numpy()
    for _ in range(max(1, iters)):
        dist = _sqdist(x, cent, xx)
        labels = dist.argmin(-1)
        sums_np, counts_np = _centroids(xn, labels.numpy(), k)
        counts = torch.from_numpy(counts_np)
        new = (torch.from_numpy(sums_np) / counts.clamp_min(1).unsqueeze(-1)).to(torch.float32)
        empty = counts == 0
        if bool(empty.any()):
            # re-seed each empty cluster with the point farthest from its own centroid
            far = dist.gather(2, labels.unsqueeze(-1)).squeeze(-1)  # [B, N]
            for bi, kj in empty.nonzero().tolist():
                i = int(far[bi].argmax())
                new[bi, kj] = x[bi, i]
                far[bi, i] = -1.0
        if torch.equal(new, cent):
            break
        cent = new
    return _sqdist(x, cent, xx).argmin(-1)


def two_means(x: np.ndarray, iters: int = 12) -> np.ndarray:
    """A split of ``x [m, D]`` (m >= 2) into two non-empty groups: bool ``[m]`` (True: the second
    group). Seeded deterministically with the point farthest from the mean and the point farthest
    from that one."""
    m = x.shape[0]
    if m < 2:
        raise ValueError("two_means needs at least two points")
    x = np.asarray(x, dtype=np.float64)
    mu = x.mean(0)
    a = x[int(((x - mu) ** 2).sum(1).argmax())]
    b = x[int(((x - a) ** 2).sum(1).argmax())]
    lab = np.zeros(m, dtype=bool)
    for _ in range(max(1, iters)):
        new = ((x - b) ** 2).sum(1) < ((x - a) ** 2).sum(1)
        if new.all() or not new.any():
            break
        if np.array_equal(new, lab):
            break
        lab = new
        a, b = x[~lab].mean(0), x[lab].mean(0)
    if lab.all() or not lab.any():
        # identical points (or a degenerate case): split along the principal direction, or halve
        c = x - mu
        if float((c ** 2).sum()) > 0:
            _, _, vt = np.linalg.svd(c, full_matrices=False)
            proj = c @ vt[0]
            lab = proj > np.median(proj)
        if lab.all() or not lab.any():
            lab = np.zeros(m, dtype=bool)
            lab[m // 2:] = True
    return lab


def stats(x: np.ndarray) -> tuple[int, np.ndarray, float]:
    """Batch statistics of a cluster: ``(n, centroid, M2)`` with ``M2 = sum ||x - mean||^2``
    (the variance the policy bounds is ``M2 / n``)."""
    x = np.asarray(x, dtype=np.float64)
    n = int(x.shape[0])
    if n == 0:
        return 0, np.zeros(x.shape[1]), 0.0
    mu = x.mean(0)
    return n, mu, float(((x - mu) ** 2).sum())


def warm_up() -> None:
    """Compiles (or loads from numba's cache) the seeding and centroid kernels: one small
    clustering (below the memo's size, so nothing is remembered)."""
    _kmeans(torch.randn(2, 32, 8, generator=torch.Generator().manual_seed(0)), 4, 2, 0)
