"""Attention that reads a layer's pages where they lie, at every level (docs/kv-memory.md).

:class:`PagedAttention` attends over a paged layer - its pages (:mod:`sparkv.cache.pages`) at
every level: fp, int8, int4, int2 and k8v4 (K and V of their own widths), listed per KV head by
the block table - and an optional fp tail
(the decode's new tokens), for every head, in **one numba call per layer** (``parallel=True``).
Work is split into units of at most :data:`UNIT_PAGES` pages of one head at one level (and one
unit per head for the tail); each unit returns a partial softmax (max, sum, weighted values); the
same call merges them per head. Quantized rows are never expanded to a float tensor; per row the
kernel uses the row's float16 scale and zero directly::

    q . k^ = scale_k (q . c_k) + zero_k sum(q)
    sum_r w_r v^_r = sum_r (w_r scale_v) c_v + sum_r w_r zero_v

**Packed codes without unpacking** (int4, int2). A byte ``c`` holds ``per = 8 / bits`` codes
``x_0 .. x_{per-1}`` (``x_j`` at bits ``j*bits``). With the prefix masks
``y_j = c & (2^(bits (j+1)) - 1)`` (``y_{per-1} = c``), ``x_j = (y_j - y_{j-1}) / 2^(bits j)``,
so a dot product is ``q . x = sum_j y_j a_j`` with ``a_j = q_j / 2^(bits j) - q_{j+1} /
2^(bits (j+1))`` computed once per call, and the V side accumulates ``Y_j = sum_r w_r y_j`` and
recovers the values at the end. Per value that is a mask, a conversion and a multiply-add - what
int8 costs - instead of a shift, a mask, a conversion and a multiply-add. Rows go four at a time
(four independent sums), and ``exp`` is a vectorizable polynomial (Cephes' ``expf``, within
2 ulp), since numba has no vector ``exp`` here.

**Error.** The result equals dequantize-then-attend (``ragged_attention`` over
``ContextKV.layer_entries``) up to float32 rounding (tested at ``atol 2e-5, rtol 1e-4`` for
every level, ragged and partly filled pages, masks, mixed layers and a tail); the level's own
error (``levels.error_bound``) is the only quantization error.

**Elsewhere** (tensors on a GPU, or a model dtype other than float32): :class:`TorchPagedAttention`
dequantizes the layer's pages with torch at each call and attends (nothing is cached, so the
memory stays quantized between calls).

Shapes: ``q [1, Hq, nq, D]``, ``q_pos [nq]``; a :class:`Partial` is ``out [Hq, nq, D]``
(float32, normalized) and ``lse [Hq, nq]`` (``-inf`` for a query that sees no entry).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numba as nb
from numba.extending import overload
import numpy as np
import numpy.typing as npt
import torch

from sparkv.cache.colmass import offer_sums, offer_weights, wants_sums
from sparkv.cache.levels import LEVELS
from sparkv.cache.pages import PAGE_TOKENS, PagePools
from sparkv.kernels import use_torch_threads

#: most pages of one head in one parallel work unit
UNIT_PAGES = 16
P = PAGE_TOKENS
_LOG2E = np.float32(1.4426950408889634)
#: LLVM's fast-math flags but "no NaN" and "no infinity": the kernel masks with -inf
_FAST = {"nsz", "arcp", "contract", "afn", "reassoc"}

#: the kernels' array types (numba ignores annotations: they are for the type checker)
_F32 = npt.NDArray[np.float32]
_I32 = npt.NDArray[np.int32]
_I64 = npt.NDArray[np.int64]
#: an fp pool as the kernel takes it (:func:`_pool_arrays`): k, v, pos, fill
_FpPool = tuple[_F32, _F32, _I32, _I32]
#: a quantized pool: k codes, k scales, k zeros (float16 bits), the same for v, pos, fill
_QPool = tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint16], npt.NDArray[np.uint16],
               npt.NDArray[np.uint8], npt.NDArray[np.uint16], npt.NDArray[np.uint16], _I32, _I32]


@dataclass
class Partial:
    """Attention over part of the entries: ``out [Hq, nq, D]`` normalized, ``lse [Hq, nq]``."""

    out: torch.Tensor
    lse: torch.Tensor


# ---- numba building blocks -----------------------------------------------------------------------
@nb.njit(fastmath=_FAST, error_model="numpy", boundscheck=False)
def exp_from(s: _F32, mx: float, w: _F32, ti: _I32, n: int
             ) -> None:  # pragma: no cover - numba
    """``w[j] = exp(s[j] - mx)`` (0 where ``s[j]`` is ``-inf``), vectorizable; ``mx`` finite."""
    for j in range(n):
        x = max(s[j] - mx, np.float32(-87.0))
        t = np.floor(x * _LOG2E + np.float32(0.5))
        y = x - t * np.float32(0.693359375) + t * np.float32(2.12194440e-4)
        p = ((((np.float32(1.9875691500e-4) * y + np.float32(1.3981999507e-3)) * y
               + np.float32(8.3334519073e-3)) * y + np.float32(4.1665795894e-2)) * y
             + np.float32(1.6666665459e-1)) * y + np.float32(5.0000001201e-1)
        w[j] = p * (y * y) + y + np.float32(1.0)
        ti[j] = (np.int32(t) + np.int32(127)) << np.int32(23)
    f = ti.view(np.float32)
    for j in range(n):
        w[j] = w[j] * f[j] if s[j] - mx > np.float32(-87.0) else np.float32(0.0)


@nb.njit(boundscheck=False, error_model="numpy")
def _halfs(h: npt.NDArray[np.uint16], out: _F32, ti: _I32) -> None:  # pragma: no cover - numba
    """float16 bits ``h`` (uint16 ``[16]``) -> float32 ``out`` (finite values: scales, zeros)."""
    for r in range(h.shape[0]):
        b = np.int32(h[r])
        ti[r] = ((b >> 15) << 31) | ((((b >> 10) & 31) + 112) << 23) | ((b & 1023) << 13)
    f = ti.view(np.float32)
    for r in range(h.shape[0]):
        b = np.int32(h[r])
        sub = np.float32(b & 1023) * np.float32(5.960464477539063e-08)
        out[r] = f[r] if (b >> 10) & 31 else (-sub if b >> 15 else sub)


@nb.njit(fastmath=_FAST, error_model="numpy", boundscheck=False)
def _softmax(s: _F32, w: _F32, ti: _I32, R: int, u: int, pm: _F32, pl: _F32
             ) -> None:  # pragma: no cover - numba
    """Per query row ``m``: ``pm[u, m]`` the max of ``s[m, :R]``, ``w[m]`` the weights, ``pl``
    their sum (a row that sees nothing: ``-inf``, zeros)."""
    for m in range(s.shape[0]):
        mx = np.float32(-np.inf)
        for j in range(R):
            mx = max(mx, s[m, j])
        pm[u, m] = mx
        tot = np.float32(0.0)
        if mx == -np.inf:
            for j in range(R):
                w[m, j] = 0.0
        else:
            exp_from(s[m], mx, w[m], ti, R)
            for j in range(R):
                tot += w[m, j]
        pl[u, m] = tot


@nb.njit(fastmath=_FAST, error_model="numpy", boundscheck=False)
def _mask_scores(s: _F32, off: int, sk: _F32, zk: _F32, qs: _F32, pos: _I32, n: int,
                 mpos: _I64, scale: np.float32) -> None:  # pragma: no cover - numba
    """A page's raw dot products ``s[:, off:off+16]`` -> scaled scores, ``-inf`` for rows past
    ``n`` or after the query (branch-free)."""
    for m in range(s.shape[0]):
        for r in range(P):
            val = scale * (sk[r] * s[m, off + r] + zk[r] * qs[m])
            s[m, off + r] = val if (r < n) & (pos[r] <= mpos[m]) else np.float32(-np.inf)


@nb.njit(fastmath=_FAST, error_model="numpy", boundscheck=False)
def _value_weights(w: _F32, off: int, sv: _F32, zv: _F32, n: int, ws: _F32, wz: _F32
                   ) -> None:  # pragma: no cover - numba
    """A page's softmax weights times the rows' V scales (``ws [M, 16]``, 0 past ``n``), and
    ``wz[m] += sum_r w zero_v``."""
    for m in range(ws.shape[0]):
        z = np.float32(0.0)
        for r in range(P):
            x = w[m, off + r] if r < n else np.float32(0.0)
            ws[m, r] = x * sv[r] if r < n else np.float32(0.0)
            z += x * zv[r] if r < n else np.float32(0.0)
        wz[m] += z


def _make_quantized_unit(kbits: int, vbits: int) -> Any:
    """The unit function of one quantized level (its bits of K and of V, and their plane
    counts, are constants)."""
    per, vper = 8 // kbits, 8 // vbits

    @nb.njit(fastmath=_FAST, error_model="numpy", boundscheck=False)
    def unit(pool: _QPool, upages: _I32, a: int, npg: int, qc: _F32, qs: _F32, mpos: _I64,
             scale: np.float32, D: int, u: int, pm: _F32, pl: _F32, pacc: _F32
             ) -> None:  # pragma: no cover - numba
        kc, ks, kz, vc, vs, vz, pos, fill = pool
        M, W = qc.shape[0], kc.shape[2]
        R = npg * P
        s = np.empty((M, R), dtype=np.float32)
        w = np.empty((M, R), dtype=np.float32)
        ti = np.empty(R, dtype=np.int32)
        f1 = np.empty(P, dtype=np.float32)
        f2 = np.empty(P, dtype=np.float32)
        for pi in range(npg):
            p = upages[a + pi]
            pg = kc[p]
            for r in range(0, P, 4):
                for m in range(M):
                    a0 = a1 = a2 = a3 = np.float32(0.0)
                    for b in range(W):
                        c0, c1 = np.int32(pg[r, b]), np.int32(pg[r + 1, b])
                        c2, c3 = np.int32(pg[r + 2, b]), np.int32(pg[r + 3, b])
                        for j in range(per):
                            mk = np.int32((1 << (kbits * (j + 1))) - 1)
                            qv = qc[m, j, b]
                            a0 += qv * np.float32(c0 & mk)
                            a1 += qv * np.float32(c1 & mk)
                            a2 += qv * np.float32(c2 & mk)
                            a3 += qv * np.float32(c3 & mk)
                    j0 = pi * P + r
                    s[m, j0], s[m, j0 + 1], s[m, j0 + 2], s[m, j0 + 3] = a0, a1, a2, a3
            _halfs(ks[p], f1, ti)
            _halfs(kz[p], f2, ti)
            _mask_scores(s, pi * P, f1, f2, qs, pos[p], fill[p], mpos, scale)
        _softmax(s, w, ti, R, u, pm, pl)
        W = vc.shape[2]
        acc = np.zeros((M, vper, W), dtype=np.float32)
        wz = np.zeros(M, dtype=np.float32)
        ws = np.empty((M, P), dtype=np.float32)
        for pi in range(npg):
            p = upages[a + pi]
            pg = vc[p]
            _halfs(vs[p], f1, ti)
            _halfs(vz[p], f2, ti)
            _value_weights(w, pi * P, f1, f2, fill[p], ws, wz)
            # every row of the page: the unused ones weigh 0 (and hold finite codes)
            for r in range(0, P, 4):
                for m in range(M):
                    w0, w1, w2, w3 = ws[m, r], ws[m, r + 1], ws[m, r + 2], ws[m, r + 3]
                    for j in range(vper):
                        mk = np.int32((1 << (vbits * (j + 1))) - 1)
                        am = acc[m, j]
                        for b in range(W):
                            am[b] += ((w0 * np.float32(np.int32(pg[r, b]) & mk)
                                       + w1 * np.float32(np.int32(pg[r + 1, b]) & mk))
                                      + (w2 * np.float32(np.int32(pg[r + 2, b]) & mk)
                                         + w3 * np.float32(np.int32(pg[r + 3, b]) & mk)))
        for m in range(M):
            for b in range(W):
                prev = np.float32(0.0)
                for j in range(vper):
                    d = b * vper + j
                    if d < D:
                        pacc[u, m, d] = (acc[m, j, b] - prev) / np.float32(1 << (vbits * j)) \
                            + wz[m]
                    prev = acc[m, j, b]

    return unit


_unit8 = _make_quantized_unit(8, 8)
_unit4 = _make_quantized_unit(4, 4)
_unit2 = _make_quantized_unit(2, 2)
_unit84 = _make_quantized_unit(8, 4)


@nb.njit(fastmath=_FAST, error_model="numpy", boundscheck=False)
def _fp_scores(kr: _F32, pr: npt.NDArray[np.signedinteger], n: int, off: int, qh: _F32,
               mpos: _I64, scale: np.float32, s: _F32) -> None:  # pragma: no cover - numba
    """Scores of fp rows ``kr [>= n rounded up to 4, D]`` (positions ``pr``) into ``s[:, off:]``."""
    M, D = qh.shape
    for r in range(0, n, 4):
        r1, r2, r3 = min(r + 1, n - 1), min(r + 2, n - 1), min(r + 3, n - 1)
        for m in range(M):
            a0 = a1 = a2 = a3 = np.float32(0.0)
            for i in range(D):
                qv = qh[m, i]
                a0 += qv * kr[r, i]
                a1 += qv * kr[r1, i]
                a2 += qv * kr[r2, i]
                a3 += qv * kr[r3, i]
            for x, val in enumerate((a0, a1, a2, a3)):
                if r + x < n:
                    s[m, off + r + x] = scale * val if pr[r + x] <= mpos[m] else -np.inf


@nb.njit(fastmath=_FAST, error_model="numpy", boundscheck=False)
def _fp_values(vr: _F32, n: int, off: int, w: _F32, acc: _F32
               ) -> None:  # pragma: no cover - numba
    """``acc[m] += sum_r w[m, off + r] vr[r]`` over fp rows ``vr [n, D]``."""
    M, D = acc.shape
    for r in range(n):
        for m in range(M):
            ww = w[m, off + r]
            am = acc[m]
            for i in range(D):
                am[i] += ww * vr[r, i]


@nb.njit(boundscheck=False, error_model="numpy")
def _store(pacc: _F32, u: int, acc: _F32) -> None:  # pragma: no cover - numba
    """``pacc[u] = acc`` element by element (a slice assignment would compile numba's
    shape-mismatch error path, seconds of compile for a check that cannot fail here)."""
    for m in range(acc.shape[0]):
        for i in range(acc.shape[1]):
            pacc[u, m, i] = acc[m, i]


@nb.njit(fastmath=_FAST, error_model="numpy", boundscheck=False)
def _fp_unit(pool: _FpPool, upages: _I32, a: int, npg: int, qh: _F32, mpos: _I64,
             scale: np.float32, u: int, pm: _F32, pl: _F32, pacc: _F32
             ) -> None:  # pragma: no cover - numba
    k, v, pos, fill = pool
    M, D = qh.shape
    R = npg * P
    s = np.full((M, R), -np.inf, dtype=np.float32)
    w = np.empty((M, R), dtype=np.float32)
    ti = np.empty(R, dtype=np.int32)
    for pi in range(npg):
        p = upages[a + pi]
        _fp_scores(k[p], pos[p], fill[p], pi * P, qh, mpos, scale, s)
    _softmax(s, w, ti, R, u, pm, pl)
    acc = np.zeros((M, D), dtype=np.float32)
    for pi in range(npg):
        p = upages[a + pi]
        _fp_values(v[p], fill[p], pi * P, w, acc)
    _store(pacc, u, acc)


@nb.njit(boundscheck=False, error_model="numpy")
def _coefficients(q: _F32, bits: int) -> _F32:  # pragma: no cover - numba
    """``a [Hkv, M, per, W]``: the prefix-plane coefficients of ``q [Hkv, M, D]`` (module doc)."""
    H, M, D = q.shape
    per = 8 // bits
    W = (D + per - 1) // per
    out = np.zeros((H, M, per, W), dtype=np.float32)
    for h in range(H):
        for m in range(M):
            for b in range(W):
                for j in range(per):
                    d = b * per + j
                    qj = q[h, m, d] if d < D else np.float32(0.0)
                    qn = q[h, m, d + 1] if j + 1 < per and d + 1 < D else np.float32(0.0)
                    out[h, m, j, b] = qj / np.float32(1 << (bits * j)) \
                        - qn / np.float32(1 << (bits * (j + 1)))
    return out


@nb.njit(parallel=True, fastmath=_FAST, error_model="numpy", nogil=True, cache=True,
         boundscheck=False)
def _attend(q: _F32, qpos: _I64, scale: np.float32, pf: _FpPool, p8: _QPool, p4: _QPool,
            p2: _QPool, p84: _QPool, units: _I32, upages: _I32, tk: _F32, tv: _F32, tpos: _I64,
            ntail: int, out: _F32) -> None:  # pragma: no cover - numba
    """Every unit (``units [U, 4]``: level index, head, first of ``upages``, pages), then each
    head's tail rows, then the merge per head into ``out [Hkv, M, D]`` (see the module doc).
    Query row ``m`` of a head is at position ``qpos[m % nq]``."""
    H, M, D = q.shape
    mpos = np.empty(M, dtype=np.int64)
    for m in range(M):
        mpos[m] = qpos[m % qpos.shape[0]]
    a8, a4, a2 = _coefficients(q, 8), _coefficients(q, 4), _coefficients(q, 2)
    qs = np.zeros((H, M), dtype=np.float32)
    for h in range(H):
        for m in range(M):
            for i in range(D):
                qs[h, m] += q[h, m, i]
    U = units.shape[0]
    T = H if ntail > 0 else 0
    if T:
        assert tk.shape[0] == H and tk.shape[2] == D
    pm = np.empty((U + T, M), dtype=np.float32)
    pl = np.empty((U + T, M), dtype=np.float32)
    pacc = np.zeros((U + T, M, D), dtype=np.float32)
    nowl = np.empty((M, 0), dtype=np.float32)
    for pu in nb.prange(U + T):
        u = np.int64(pu)     # prange's index is unsigned inside the parallel loop: one type
        if u >= U:           # for both, so the units compile once, not twice
            h = u - U
            _tail_unit(tk[h], tv[h], tpos, ntail, 0, q[h], mpos, scale, u, pm, pl, pacc,
                       nowl)
            continue
        lv, h, a, npg = units[u, 0], units[u, 1], units[u, 2], units[u, 3]
        if lv == 1:
            _unit8(p8, upages, a, npg, a8[h], qs[h], mpos, scale, D, u, pm, pl, pacc)
        elif lv == 2:
            _unit4(p4, upages, a, npg, a4[h], qs[h], mpos, scale, D, u, pm, pl, pacc)
        elif lv == 3:
            _unit2(p2, upages, a, npg, a2[h], qs[h], mpos, scale, D, u, pm, pl, pacc)
        elif lv == 4:
            _unit84(p84, upages, a, npg, a8[h], qs[h], mpos, scale, D, u, pm, pl, pacc)
        else:
            _fp_unit(pf, upages, a, npg, q[h], mpos, scale, u, pm, pl, pacc)
    uh = np.empty(U + T, dtype=np.int64)
    for u in range(U + T):
        uh[u] = units[u, 1] if u < U else u - U
    merge_units(uh, pm, pl, pacc, out, np.zeros((U + T, M), dtype=np.float32))


@nb.njit(fastmath=_FAST, error_model="numpy", boundscheck=False)
def merge_units(uh: _I64, pm: _F32, pl: _F32, pacc: _F32, out: _F32, f: _F32
                ) -> None:  # pragma: no cover - numba
    """Per head ``h`` and query row ``m``, the partials of the units of ``h`` (``uh[u] == h``)
    merged by their maxima into ``out[h, m]`` (zeros where none sees an entry); ``f[u, m]``:
    the share of its softmax each unit's weights had (``exp(pm - max) / total``)."""
    H, M, D = out.shape
    for h in range(H):
        for m in range(M):
            mx = np.float32(-np.inf)
            for u in range(uh.shape[0]):
                if uh[u] == h:
                    mx = max(mx, pm[u, m])
            for i in range(D):
                out[h, m, i] = 0.0
            if mx == -np.inf:
                continue
            tot = np.float32(0.0)
            for u in range(uh.shape[0]):
                if uh[u] == h and pm[u, m] > -np.inf:
                    f[u, m] = np.exp(pm[u, m] - mx)
                    tot += f[u, m] * pl[u, m]
                    for i in range(D):
                        out[h, m, i] += f[u, m] * pacc[u, m, i]
            for i in range(D):
                out[h, m, i] /= tot
            for u in range(uh.shape[0]):
                if uh[u] == h:
                    f[u, m] /= tot


# ---- a dense prefix (slot = position) ---------------------------------------------------------
#: rows of one head in one work unit of the dense kernel
DENSE_ROWS = 256


@nb.njit(fastmath=_FAST, error_model="numpy", boundscheck=False)
def dense_scores(kh: _F32, a: int, n: int, qh: _F32, scale: np.float32, s: _F32
                 ) -> np.float32:  # pragma: no cover - numba
    """Scaled scores of rows ``kh[a:a+n]`` (every one visible) into ``s[:, :n]``, four rows a
    pass; returns the sum of the unscaled scores (not finite when one is not)."""
    M, D = qh.shape
    chk = np.float32(0.0)
    for r in range(0, n, 4):
        r1, r2, r3 = a + min(r + 1, n - 1), a + min(r + 2, n - 1), a + min(r + 3, n - 1)
        for m in range(M):
            a0 = a1 = a2 = a3 = np.float32(0.0)
            for i in range(D):
                qv = qh[m, i]
                a0 += qv * kh[a + r, i]
                a1 += qv * kh[r1, i]
                a2 += qv * kh[r2, i]
                a3 += qv * kh[r3, i]
            for x, val in enumerate((a0, a1, a2, a3)):
                if r + x < n:
                    s[m, r + x] = scale * val
                    chk += val
    return chk


@nb.njit(fastmath=_FAST, error_model="numpy", boundscheck=False)
def dense_values(vh: _F32, a: int, n: int, w: _F32, acc: _F32
                 ) -> None:  # pragma: no cover - numba
    """``acc[m] += sum_r w[m, r] vh[a + r]`` over ``n`` rows, four rows per pass over ``acc``."""
    M, D = acc.shape
    for r in range(0, n, 4):
        r1, r2, r3 = a + min(r + 1, n - 1), a + min(r + 2, n - 1), a + min(r + 3, n - 1)
        for m in range(M):
            w0 = w[m, r]
            w1 = w[m, r + 1] if r + 1 < n else np.float32(0.0)
            w2 = w[m, r + 2] if r + 2 < n else np.float32(0.0)
            w3 = w[m, r + 3] if r + 3 < n else np.float32(0.0)
            am = acc[m]
            for i in range(D):
                am[i] += (w0 * vh[a + r, i] + w1 * vh[r1, i]) + (w2 * vh[r2, i] + w3 * vh[r3, i])


def _widened(rows: Any, a: int, n: int, buf: _F32) -> tuple[_F32, int]:
    """Rows ``[a, a+n)`` of ``rows`` as float32: ``(rows, a)`` itself when it is float32,
    else (bfloat16 bits, uint16) ``(buf, 0)`` with them widened into ``buf`` (numba picks the
    overload below by the array's type; never called from Python)."""
    raise NotImplementedError("numba only")


@overload(_widened)
def _widened_overload(rows: Any, a: Any, n: Any, buf: Any) -> Any:  # pragma: no cover - numba
    # numba wants the implementations' parameters annotated as the overload's
    if rows.dtype == nb.types.float32:
        def same(rows: Any, a: Any, n: Any, buf: Any) -> Any:
            return rows, a
        return same

    def widen(rows: Any, a: Any, n: Any, buf: Any) -> Any:
        bits = buf.view(np.uint32)
        for r in range(n):
            for i in range(rows.shape[1]):
                bits[r, i] = np.uint32(rows[a + r, i]) << np.uint32(16)
        return buf, 0

    return widen


@nb.njit(fastmath=_FAST, error_model="numpy", boundscheck=False)
def _dense_unit(kh: Any, vh: Any, a: int, n: int, qh: _F32, scale: np.float32, u: int,
                pm: _F32, pl: _F32, pacc: _F32, wl: _F32) -> None:  # pragma: no cover - numba
    """One unit of prefix rows ``[a, a+n)`` of a head (float32, or bfloat16 bits widened a
    unit at a time): partial softmax into ``pm``, ``pl``, ``pacc[u]``; its weights into
    ``wl[:, a:a+n]`` when ``wl`` has columns."""
    M, D = qh.shape
    s = np.empty((M, n), dtype=np.float32)
    w = np.empty((M, n), dtype=np.float32)
    ti = np.empty(n, dtype=np.int32)
    buf = np.empty((DENSE_ROWS, D), dtype=np.float32)
    kr, ka = _widened(kh, a, n, buf)
    dense_scores(kr, ka, n, qh, scale, s)
    _softmax(s, w, ti, n, u, pm, pl)
    acc = np.zeros((M, D), dtype=np.float32)
    vr, va = _widened(vh, a, n, buf)
    dense_values(vr, va, n, w, acc)
    _keep_unit(u, acc, pacc, w, n, a, wl)


@nb.njit(fastmath=_FAST, error_model="numpy", boundscheck=False)
def _tail_unit(tk: _F32, tv: _F32, tpos: _I64, n: int, off: int, qh: _F32, mpos: _I64,
               scale: np.float32, u: int, pm: _F32, pl: _F32, pacc: _F32, wl: _F32
               ) -> None:  # pragma: no cover - numba
    """The tail's rows of a head (``tpos`` masked against ``mpos``): partial softmax into
    ``pm``, ``pl``, ``pacc[u]``; its weights into ``wl[:, off:off+n]`` when ``wl`` has columns."""
    M, D = qh.shape
    s = np.full((M, n), -np.inf, dtype=np.float32)
    w = np.empty((M, n), dtype=np.float32)
    ti = np.empty(n, dtype=np.int32)
    _fp_scores(tk, tpos, n, 0, qh, mpos, scale, s)
    _softmax(s, w, ti, n, u, pm, pl)
    acc = np.zeros((M, D), dtype=np.float32)
    _fp_values(tv, n, 0, w, acc)
    _keep_unit(u, acc, pacc, w, n, off, wl)


@nb.njit(boundscheck=False, error_model="numpy")
def _keep_unit(u: int, acc: _F32, pacc: _F32, w: _F32, n: int, off: int, wl: _F32
               ) -> None:  # pragma: no cover - numba
    """A unit's weighted values into ``pacc[u]``; its weights ``w [M, n]`` into ``wl[:,
    off:off+n]`` when ``wl`` has columns (the column sums are wanted)."""
    _store(pacc, u, acc)
    if wl.shape[1]:
        for m in range(w.shape[0]):
            for j in range(n):
                wl[m, off + j] = w[m, j]


@nb.njit(fastmath=_FAST, error_model="numpy", boundscheck=False)
def _unit_span(u: int, U: int, per: int, n: int, ntail: int) -> tuple[int, int, int]:
    """Unit ``u``'s head, first column and column count (prefix units, then one per head)."""
    if u >= U:
        return u - U, n, ntail
    a = (u % per) * DENSE_ROWS
    return u // per, a, min(DENSE_ROWS, n - a)


@nb.njit(fastmath=_FAST, error_model="numpy", nogil=True, cache=True, boundscheck=False)
def _attend_dense(q: _F32, qpos: _I64, scale: np.float32, k: Any, v: Any, n: int, tk: _F32,
                  tv: _F32, tpos: _I64, ntail: int, out: _F32, cols: _F32
                  ) -> None:  # pragma: no cover - numba
    """``q [H, M, D]`` over each head's rows ``k[h, :n]``, ``v`` (all visible; float32, or
    bfloat16 as uint16 bits) and its tail rows
    (``tpos`` masked against ``qpos[m % nq]``) into ``out [H, M, D]``; with ``cols [H, n +
    ntail]`` (not ``[H, 0]``) the column sums of each head's softmax weights over its rows.
    One thread (the caller's): a parallel loop's barrier waits for a thread the OS has not
    scheduled, and beside two busy processes on two cores a call took 24 ms instead of 0.3."""
    H, M, D = q.shape
    mpos = np.empty(M, dtype=np.int64)
    for m in range(M):
        mpos[m] = qpos[m % qpos.shape[0]]
    per = (n + DENSE_ROWS - 1) // DENSE_ROWS
    U = H * per
    T = H if ntail > 0 else 0
    keep = cols.shape[1] > 0
    wl = np.empty((H, M, n + ntail if keep else 0), dtype=np.float32)
    pm = np.empty((U + T, M), dtype=np.float32)
    pl = np.empty((U + T, M), dtype=np.float32)
    pacc = np.zeros((U + T, M, D), dtype=np.float32)
    for u in range(U + T):
        h, a, cnt = _unit_span(u, U, per, n, ntail)
        if u >= U:
            _tail_unit(tk[h], tv[h], tpos, ntail, n, q[h], mpos, scale, u, pm, pl, pacc, wl[h])
        else:
            _dense_unit(k[h], v[h], a, cnt, q[h], scale, u, pm, pl, pacc, wl[h])
    f = np.zeros((U + T, M), dtype=np.float32)
    uh = np.empty(U + T, dtype=np.int64)
    for u in range(U + T):
        uh[u] = _unit_span(u, U, per, n, ntail)[0]
    merge_units(uh, pm, pl, pacc, out, f)
    if keep:
        for u in range(U + T):
            h, a, cnt = _unit_span(u, U, per, n, ntail)
            for j in range(a, a + cnt):
                c = np.float32(0.0)
                for m in range(M):
                    c += wl[h, m, j] * f[u, m]
                cols[h, j] = c


# ---- the layer's attention -----------------------------------------------------------------------
def _np(t: torch.Tensor) -> np.ndarray:
    a = t.detach().numpy()
    return a.view(np.uint16) if a.dtype == np.float16 else a


def _f16(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16)


def _pool_arrays(pools: PagePools) -> tuple[Any, ...]:
    """The pools' arrays as the kernel takes them: one tuple per level, in LEVELS' order (the
    kernel's level codes)."""
    out: list[Any] = []
    for level in LEVELS:
        pool = pools[level]
        a = pool.array
        if level == "fp":
            out.append((_np(a("k")), _np(a("v")), _np(a("pos")), _np(a("fill"))))
        else:
            out.append((_np(a("k")), _f16(a("k_scale")), _f16(a("k_zero")), _np(a("v")),
                        _f16(a("v_scale")), _f16(a("v_zero")), _np(a("pos")), _np(a("fill"))))
    return tuple(out)


def plan_units(heads: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """``(units [U, 4], pages)`` of a layer whose head ``h`` has pages ``heads[h] = (ids,
    levels)`` in position order: runs of at most :data:`UNIT_PAGES` pages of one level."""
    units, pages, start = [], [], 0
    for h, (ids, lv) in enumerate(heads):
        if ids.size == 0:
            continue
        cut = np.flatnonzero(np.diff(lv)) + 1
        bounds = np.concatenate([[0], cut, [ids.size]])
        for a, b in zip(bounds[:-1], bounds[1:]):
            for x in range(int(a), int(b), UNIT_PAGES):
                n = min(UNIT_PAGES, int(b) - x)
                units.append((int(lv[x]), h, start + x, n))
        pages.append(ids)
        start += ids.size
    u = np.array(units, dtype=np.int32).reshape(-1, 4)
    return u, (np.concatenate(pages).astype(np.int32) if pages else np.zeros(0, np.int32))


class PagedAttention:
    """Attention over one paged layer as held (module docstring): built from the layer's pages
    per head (:meth:`BlockTable.layer_pages <sparkv.cache.blocks.BlockTable.layer_pages>`); it
    references the pools' tensors (no copy) and is stale once the memory's
    :meth:`~sparkv.cache.memory.ContextKV.layer_version` changes.

    Args:
        pools: the page pools (float32 fp pages, on the CPU).
        heads: per KV head, ``(page ids, their levels)`` in position order.
        head_dim: D.
    """

    def __init__(self, pools: PagePools, heads: Sequence[tuple[np.ndarray, np.ndarray]],
                 head_dim: int) -> None:
        self.num_kv_heads, self.head_dim = len(heads), head_dim
        self.units, self.pages = plan_units(heads)
        self._pools = _pool_arrays(pools)

    def attend(self, q: torch.Tensor, q_pos: torch.Tensor, scale: float | None,
               tail: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
               ) -> torch.Tensor:
        """``q [1, Hq, nq, D]`` -> ``[1, Hq, nq, D]`` in ``q``'s dtype; query ``i`` sees the
        positions ``<= q_pos[i]``; ``tail``: fp entries ``(k [Hkv, n, D], v, pos [n])`` every
        head holds (the decode tail), or ``None``."""
        _, hq, nq, d = q.shape
        hkv = self.num_kv_heads
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        qn = _f32(q[0].reshape(hkv, hq // hkv * nq, d))
        tk, tv, tpos, n = _tail_arrays(tail, hkv, d)
        out = np.empty(qn.shape, dtype=np.float32)
        use_torch_threads()
        _attend(qn, q_pos.to(torch.int64).numpy(), np.float32(scale), *self._pools,  # type: ignore
                self.units, self.pages, tk, tv, tpos, n, out)
        res = torch.from_numpy(out).view(1, hq, nq, d)
        return res if q.dtype == torch.float32 else res.to(q.dtype)


def _f32(t: torch.Tensor) -> np.ndarray:
    """A float32 C-contiguous array of ``t`` (a view when it already is one)."""
    if t.dtype != torch.float32:
        t = t.float()
    return t.contiguous().numpy()


def _tail_arrays(tail: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, hkv: int, d: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The tail's K and V as float32 ``[Hkv, n, D]`` arrays, its positions and ``n``."""
    if tail is None or tail[0].shape[1] == 0:
        return _NO_TAIL[0], _NO_TAIL[0], _NO_TAIL[1], 0
    k, v, pos = tail
    return _f32(k), _f32(v), pos.to(torch.int64).numpy(), int(k.shape[1])


_NO_TAIL = (np.zeros((0, 0, 0), dtype=np.float32), np.zeros(0, dtype=np.int64))


class TorchPagedAttention:
    """:class:`PagedAttention`'s contract with torch, for pages on a GPU (or fp pages not in
    float32): each call dequantizes the layer's entries (``entries()``: per KV head ``(k, v,
    pos)``, :meth:`ContextKV.layer_entries <sparkv.cache.memory.ContextKV.layer_entries>`) on
    their device and attends; nothing is cached."""

    def __init__(self, entries: Callable[[], Sequence[tuple[torch.Tensor, torch.Tensor,
                                                             torch.Tensor]]]) -> None:
        self.entries = entries

    def attend(self, q: torch.Tensor, q_pos: torch.Tensor, scale: float | None,
               tail: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
               ) -> torch.Tensor:
        parts = [attend_entries(q, self.entries(), q_pos, scale)]
        if tail is not None and tail[0].shape[1]:
            parts.append(attend_stacked(q, *tail, q_pos, scale))
        return merge_partials(parts).out.unsqueeze(0).to(q.dtype)


class PrefixAttention:
    """:class:`PagedAttention`'s contract over a dense prefix (slot = position): ``k``, ``v``
    ``[Hkv, P, D]`` (views, not copied), every query at a position past them, and a tail. What
    a fork of a dense arena attends (:class:`~sparkv.cache.fork.ForkCache`): the arena as it
    was, the fork's own tokens in its tail. One softmax over the prefix's scores and the
    tail's (causal within the tail); its weights' column sums go to the thread's column sink
    (:mod:`~sparkv.cache.colmass`: the density recording's).

    A few queries (at most :data:`KERNEL_QUERIES` rows per KV head: a decoded token; two on
    SmolLM2)
    over float32 or bfloat16 on the CPU take one numba call (:func:`_attend_dense`: units of
    :data:`DENSE_ROWS` rows of a head, K and V read once for all the head's queries, the
    column sums made in the same call); more queries, or another dtype or device, take a few
    batched torch ops (the matrix products' own kernels)."""

    #: most query rows per KV head (``G * nq``) the numba kernel takes
    KERNEL_QUERIES = 6

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v
        self._arrays: tuple[np.ndarray, np.ndarray] | None = None

    def attend(self, q: torch.Tensor, q_pos: torch.Tensor, scale: float | None,
               tail: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
               ) -> torch.Tensor:
        _, hq, nq, d = q.shape
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        if self._kernel_takes(q):
            return self._attend_kernel(q, q_pos, scale, tail)
        return self._attend_torch(q, q_pos, scale, tail)

    def _kernel_takes(self, q: torch.Tensor) -> bool:
        _, hq, nq, _ = q.shape
        return (hq // int(self.k.shape[0]) * nq <= self.KERNEL_QUERIES
                and self.k.device.type == "cpu" and self.k.dtype in _DENSE_DTYPES
                and self.v.dtype == self.k.dtype and q.device.type == "cpu")

    def _attend_kernel(self, q: torch.Tensor, q_pos: torch.Tensor, scale: float,
                       tail: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
                       ) -> torch.Tensor:
        _, hq, nq, d = q.shape
        hkv, p = int(self.k.shape[0]), int(self.k.shape[1])
        if self._arrays is None:
            self._arrays = (_rows_array(self.k), _rows_array(self.v))
        qn = _f32(q[0].reshape(hkv, hq // hkv * nq, d))
        tk, tv, tpos, n = _tail_arrays(tail, hkv, d)
        sums = wants_sums()
        cols = np.empty((hkv, p + n if sums else 0), dtype=np.float32)
        out = np.empty(qn.shape, dtype=np.float32)
        _attend_dense(qn, q_pos.to(torch.int64).numpy(), np.float32(scale), *self._arrays, p,
                      tk, tv, tpos, n, out, cols)
        if sums:
            offer_sums(torch.from_numpy(cols.sum(axis=0)), hq * nq)
        return torch.from_numpy(out).view(1, hq, nq, d).to(q.dtype)

    def _attend_torch(self, q: torch.Tensor, q_pos: torch.Tensor, scale: float,
                      tail: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
                      ) -> torch.Tensor:
        _, hq, nq, d = q.shape
        hkv, p = int(self.k.shape[0]), int(self.k.shape[1])
        group = hq // hkv
        qs = q[0].float().reshape(hkv, group * nq, d) * scale
        scores = [torch.bmm(qs, self.k.float().transpose(1, 2))]          # [Hkv, G*nq, P]
        if tail is not None and tail[0].shape[1]:
            tk, tv, tpos = tail
            st = torch.bmm(qs, tk.float().transpose(1, 2))
            rows = q_pos.to(torch.long).repeat(group).view(1, -1, 1)
            scores.append(st.masked_fill(tpos.to(torch.long).view(1, 1, -1) > rows,
                                         float("-inf")))
        w = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
        offer_weights(w)                                                    # [Hkv, G*nq, P+T]
        out = torch.bmm(w[..., :p], self.v.float())
        if len(scores) > 1:
            out += torch.bmm(w[..., p:], tail[1].float())                # type: ignore[index]
        return out.view(1, hq, nq, d).to(q.dtype)


#: the prefix dtypes the dense kernel reads
_DENSE_DTYPES = (torch.float32, torch.bfloat16)


def _rows_array(t: torch.Tensor) -> np.ndarray:
    """``t [H, P, D]`` (float32, or bfloat16 as uint16 bits; CPU) as a C-contiguous array
    ``[H, R >= P, D]``: without a copy where ``t`` is a view of the first ``P`` rows of a larger
    ``[H, R, D]`` tensor (an arena's prefix), else a contiguous copy."""
    h, p, d = t.shape
    rows = t.stride(0) // max(d, 1)
    end = t.storage_offset() + h * t.stride(0)
    if (t.stride(2) == 1 and t.stride(1) == d and t.stride(0) == rows * d and rows >= p
            and end * t.element_size() <= t.untyped_storage().nbytes()):
        t = t.as_strided((h, rows, d), (rows * d, d, 1))
    t = t.contiguous()
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


# ---- torch partials ------------------------------------------------------------------------------
def attend_entries(q: torch.Tensor, heads: Sequence[tuple[torch.Tensor, torch.Tensor,
                                                            torch.Tensor]],
                   q_pos: torch.Tensor, scale: float | None) -> Partial:
    """``q [1, Hq, nq, D]`` over fp entries given per KV head as ``(k [n_h, D], v, pos [n_h])``."""
    _, hq, nq, d = q.shape
    group = hq // len(heads)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(hq, nq, d, device=q.device)
    lse = torch.full((hq, nq), float("-inf"), device=q.device)
    qp = q_pos.to(device=q.device, dtype=torch.long).view(1, -1, 1)
    for h, (k, v, pos) in enumerate(heads):
        if k.shape[0] == 0:
            continue
        qs = q[0, h * group:(h + 1) * group].float()                        # [G, nq, D]
        s = (qs @ k.float().T) * scale                                     # [G, nq, n]
        s = s.masked_fill(pos.to(q.device, torch.long).view(1, 1, -1) > qp, float("-inf"))
        lo = torch.logsumexp(s, dim=-1)                                    # [G, nq]
        w = torch.exp(s - torch.where(torch.isinf(lo), torch.zeros_like(lo), lo).unsqueeze(-1))
        out[h * group:(h + 1) * group] = w @ v.float()
        lse[h * group:(h + 1) * group] = lo
    return Partial(out, lse)


def attend_stacked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                   q_pos: torch.Tensor, scale: float | None) -> Partial:
    """``q [1, Hq, nq, D]`` over fp entries every KV head holds at the same positions:
    ``k``, ``v`` ``[Hkv, n, D]``, ``pos [n]`` (the decode tail: a few batched torch ops)."""
    _, hq, nq, d = q.shape
    hkv = int(k.shape[0])
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qs = q[0].float().reshape(hkv, group * nq, d)
    s = torch.bmm(qs, k.float().transpose(1, 2)) * scale                   # [Hkv, G*nq, n]
    hidden = pos.to(torch.long).view(1, 1, -1) > q_pos.to(torch.long).repeat(group).view(1, -1, 1)
    if bool(hidden.any()):
        s = s.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                       # [Hkv, G*nq]
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    out = torch.bmm(torch.exp(s - safe.unsqueeze(-1)), v.float())
    return Partial(out.view(hq, nq, d), lse.view(hq, nq))


def merge_partials(parts: Sequence[Partial]) -> Partial:
    """Attention over the union of the parts' entries (log-sum-exp weights)."""
    if len(parts) == 1:
        return parts[0]
    lse = torch.stack([p.lse for p in parts])                              # [P, Hq, nq]
    top = lse.max(dim=0).values
    safe = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    w = torch.exp(lse - safe)                                              # [P, Hq, nq]
    tot = w.sum(dim=0)
    out = sum(p.out * w[i].unsqueeze(-1) for i, p in enumerate(parts))
    assert isinstance(out, torch.Tensor)
    out = torch.where(tot.unsqueeze(-1) > 0, out / tot.clamp_min(1e-30).unsqueeze(-1),
                      torch.zeros_like(out))
    return Partial(out, safe + torch.log(tot))


def warm_up() -> None:
    """Compiles (or loads from numba's cache) the kernels (paged, dense prefix): a benchmark
    calls it before timing."""
    from sparkv.cache.paged import PagedChunks
    from sparkv.cache.payload import ChunkRun
    from sparkv.layout import ChunkGeometry, KVChunkId

    n = 16 * len(LEVELS)                    # a 16-token chunk per level
    paged = PagedChunks(ChunkGeometry(n, 16, 1, 1, 64))
    for t, level in enumerate(LEVELS):
        run = ChunkRun([KVChunkId(t, 0, 0)], "fp", np.array([[16]]),
                       torch.arange(16 * t, 16 * t + 16, dtype=torch.int32), torch.randn(16, 64),
                       torch.randn(16, 64))
        paged.write(np.array([t]), np.array([0]), np.array([0]), run.at_level(level))
    tail = (torch.randn(1, 2, 64), torch.randn(1, 2, 64), torch.tensor([n, n + 1]))
    att = PagedAttention(paged.pools, paged.layer_pages(0), 64)
    att.attend(torch.randn(1, 1, 1, 64), torch.tensor([n + 1]), None, tail)
    PrefixAttention(torch.randn(1, n, 64), torch.randn(1, n, 64)).attend(
        torch.randn(1, 1, 1, 64), torch.tensor([n + 1]), None, tail)
