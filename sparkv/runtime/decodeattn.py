"""One query's attention over a dense prefix in one numba call: an answer token of a compute
configuration that takes it (``int4``: :attr:`~sparkv.runtime.compute.ComputeConfig.
one_query`; docs/runtime.md, "An answer token's attention").

SDPA on the CPU reads each KV head once per query head of its group (``enable_gqa``: SmolLM2's 3
KV heads serve 9 query heads, so K and V are read 3 times) and splits its work by query head: at
16K tokens one query's attention took ~6 ms a layer on a 2-core AVX2 EPYC. Here each KV head's
rows are read once for all the queries of its group (four rows at a time, each query's score a
vectorized dot product), with an online softmax over blocks of :data:`BLOCK` rows (``exp`` the
paged kernel's vectorizable polynomial, :func:`sparkv.cache.qattend.exp_from`), and the rows of a
head are split into units run in parallel (numba's threads, as many as torch's) whose partial
softmaxes are merged as flash decoding does (the paged kernel's :func:`~sparkv.cache.qattend.
merge_units`).

The result is SDPA's up to the order of float32 sums (~1e-7 on SmolLM2's heads, tested); a
non-finite score or value makes the call decline (``None``: the caller runs SDPA, whose result is
then the reference's, NaN included). The keys must be float32 rows on the CPU, each row
contiguous and the rows of a head evenly spaced (a dense arena's prefix, a ``DynamicCache``'s
tensors); anything else declines too.
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np
import numpy.typing as npt
import torch

from sparkv.cache.qattend import dense_scores, dense_values, exp_from, merge_units
from sparkv.kernels import use_torch_threads

#: rows of one head scored, weighted and summed together (the online softmax's block)
BLOCK = 128
#: fewest keys the kernel takes (SDPA is as fast below: the parallel call's own cost)
MIN_ROWS = 1024
#: fewest rows of a head worth a unit of their own (below, one unit per head)
MIN_UNIT_ROWS = 512
#: LLVM's fast-math flags but "no NaN" and "no infinity" (a non-finite input is detected)
_FAST = {"nsz", "arcp", "contract", "afn", "reassoc"}

_F32 = npt.NDArray[np.float32]


@nb.njit(fastmath=_FAST, error_model="numpy", boundscheck=False)
def _unit(q: _F32, k: _F32, v: _F32, a: int, b: int, scale: np.float32, mx: _F32, tot: _F32,
          acc: _F32) -> bool:  # pragma: no cover - numba
    """Rows ``[a, b)`` of one head for the queries ``q [M, D]``: the softmax's running max
    ``mx [M]``, its sum ``tot [M]`` and the weighted values ``acc [M, D]`` relative to that
    max. Returns whether every score was finite."""
    M, D = q.shape
    s = np.empty((M, BLOCK), dtype=np.float32)
    w = np.empty((M, BLOCK), dtype=np.float32)
    ti = np.empty(BLOCK, dtype=np.int32)
    mx[:] = -np.inf
    tot[:] = 0.0
    acc[:] = 0.0
    for c in range(a, b, BLOCK):
        n = min(BLOCK, b - c)
        if not np.isfinite(dense_scores(k, c, n, q, scale, s)):
            return False
        for m in range(M):
            top = mx[m]
            for r in range(n):
                top = max(top, s[m, r])
            if top > mx[m]:
                shrink = np.exp(mx[m] - top) if mx[m] > -np.inf else np.float32(0.0)
                tot[m] *= shrink
                for i in range(D):
                    acc[m, i] *= shrink
                mx[m] = top
            exp_from(s[m], top, w[m], ti, n)
            for r in range(n):
                tot[m] += w[m, r]
        dense_values(v, c, n, w, acc)
    return True


@nb.njit(parallel=True, fastmath=_FAST, error_model="numpy", boundscheck=False, nogil=True,
         cache=True)
def _attend(q: _F32, k: _F32, v: _F32, n: int, scale: np.float32, splits: int, out: _F32
            ) -> bool:  # pragma: no cover - numba
    """``q [H, M, D]`` (KV head ``h``'s ``M`` queries) over rows ``k[h, :n]``, ``v[h, :n]``
    into ``out [H, M, D]``: ``splits`` units per head in parallel, merged by their maxima.
    Returns ``False`` (``out`` undefined) when a score or an output is not finite."""
    H, M, D = q.shape
    U = H * splits
    per = (n + splits - 1) // splits
    pm = np.empty((U, M), dtype=np.float32)
    pl = np.empty((U, M), dtype=np.float32)
    pacc = np.empty((U, M, D), dtype=np.float32)
    fine = np.zeros(U, dtype=np.bool_)
    for u in nb.prange(U):
        h = u // splits
        a = (u % splits) * per
        fine[u] = _unit(q[h], k[h], v[h], a, min(n, a + per), scale, pm[u], pl[u], pacc[u])
    if not fine.all():
        return False
    merge_units(np.arange(U) // splits, pm, pl, pacc, out, np.zeros((U, M), dtype=np.float32))
    return bool(np.isfinite(out).all())


def _rows(t: torch.Tensor) -> np.ndarray | None:
    """A C-contiguous float32 array ``[H, cap, D]`` (``cap >= n``) whose first ``n`` rows of
    each head are ``t [1, H, n, D]``: ``t`` itself when contiguous, else, for a dense arena's
    prefix (rows ``D`` apart, heads a whole number of rows apart), the arena's rows read in
    place from ``t``'s storage. Built from the strides, not from ``t._base``: a view made in
    inference mode (every decode pass) records no base. ``None`` otherwise."""
    if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 4 or t.shape[0] != 1:
        return None
    if t.is_contiguous():
        return t.numpy()[0]
    h, n, d = (int(x) for x in t.shape[1:])
    s1, s2, s3 = t.stride()[1:]
    if s3 != 1 or s2 != d or s1 % d or s1 < n * d:
        return None
    cap = s1 // d
    if t.storage_offset() + h * s1 > t.untyped_storage().nbytes() // t.element_size():
        return None
    return torch.as_strided(t, (h, cap, d), (s1, d, 1)).numpy()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None
           ) -> torch.Tensor | None:
    """One query ``q [1, Hq, 1, D]`` over every row of ``k``, ``v [1, Hkv, n, D]`` (GQA:
    query head ``j`` reads KV head ``j // (Hq / Hkv)``) -> ``[1, Hq, 1, D]``, or ``None`` when
    the call is not this kernel's (module docstring): the caller runs SDPA."""
    if (q.dim() != 4 or q.shape[0] != 1 or q.shape[2] != 1 or q.dtype != torch.float32
            or q.device.type != "cpu" or q.requires_grad or k.requires_grad or v.requires_grad
            or k.shape != v.shape or k.dim() != 4 or k.shape[-1] != q.shape[-1]
            or k.shape[1] == 0 or q.shape[1] % k.shape[1]):
        return None
    _, hq, _, d = q.shape
    hkv, n = int(k.shape[1]), int(k.shape[2])
    if n < MIN_ROWS:
        return None
    kr, vr = _rows(k), _rows(v)
    if kr is None or vr is None:
        return None
    qn = q.reshape(hkv, hq // hkv, d).contiguous().numpy()
    out = np.empty(qn.shape, dtype=np.float32)
    threads = use_torch_threads()
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if not _attend(qn, kr, vr, n, np.float32(scale), _splits(hkv, n, threads), out):
        return None
    return torch.from_numpy(out).view(1, hq, 1, d)


def _splits(heads: int, n: int, threads: int) -> int:
    """Units per head: one per thread (every thread gets as many units, whatever the head count),
    none of fewer than :data:`MIN_UNIT_ROWS` rows."""
    return max(1, min(threads, n // MIN_UNIT_ROWS))


def warm_up() -> None:
    """Compiles the kernel (or loads it from numba's cache): ``sparkv warm``."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 2, 8), dtype=np.float32)
    k = rng.standard_normal((2, 9, 8), dtype=np.float32)
    _attend(q, k, k, 9, np.float32(0.35), 2, np.empty_like(q))


__all__ = ["BLOCK", "MIN_ROWS", "MIN_UNIT_ROWS", "attend", "warm_up"]
