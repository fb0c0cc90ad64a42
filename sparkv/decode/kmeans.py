"""k-means on keys: batched over the KV heads of a layer (prefill), and 2-means (splits).

Deterministic for a given seed: k-means++ seeding, Lloyd iterations, empty clusters re-seeded
with the point farthest from its centroid. Distances are squared Euclidean (the variance the
policy bounds is the mean squared distance to the centroid).
"""

from __future__ import annotations

import numpy as np
import torch


def _sqdist(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``x [B, N, D]``, ``c [B, K, D]`` -> ``[B, N, K]`` squared distances (clamped at 0)."""
    d = (x * x).sum(-1, keepdim=True) - 2 * x @ c.transpose(1, 2) + (c * c).sum(-1).unsqueeze(1)
    return d.clamp_min_(0)


def kmeans(x: torch.Tensor, k: int, iters: int = 12, seed: int = 0) -> torch.Tensor:
    """Labels ``[B, N]`` (int64) of ``k`` clusters for each of ``B`` point sets ``x [B, N, D]``."""
    b, n, d = x.shape
    k = max(1, min(k, n))
    x = x.to(torch.float32)
    g = torch.Generator().manual_seed(seed)
    # k-means++ seeding, batched over B
    cent = torch.empty(b, k, d)
    first = torch.randint(0, n, (b,), generator=g)
    cent[:, 0] = x[torch.arange(b), first]
    best = _sqdist(x, cent[:, :1]).squeeze(-1)                      # [B, N]
    for j in range(1, k):
        w = best + 1e-12
        pick = torch.multinomial(w / w.sum(-1, keepdim=True), 1, generator=g).squeeze(-1)
        cent[:, j] = x[torch.arange(b), pick]
        best = torch.minimum(best, _sqdist(x, cent[:, j:j + 1]).squeeze(-1))
    labels = torch.zeros(b, n, dtype=torch.long)
    for _ in range(max(1, iters)):
        dist = _sqdist(x, cent)
        labels = dist.argmin(-1)
        onehot = torch.zeros(b, n, k).scatter_(2, labels.unsqueeze(-1), 1.0)
        counts = onehot.sum(1)                                      # [B, K]
        sums = onehot.transpose(1, 2) @ x                           # [B, K, D]
        new = sums / counts.clamp_min(1).unsqueeze(-1)
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
    return _sqdist(x, cent).argmin(-1)


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
