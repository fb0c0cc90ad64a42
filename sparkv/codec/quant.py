"""Uniform b-bit asymmetric quantization of one K or V tensor ``[heads, tokens, head_dim]``.

A *group* of values shares one ``(min, step)`` pair:

* ``AXIS_TOKEN`` (per token): one group per ``(head, token)``, i.e. the ``head_dim`` channels of
  one token; ``heads * tokens`` groups.
* ``AXIS_CHANNEL`` (per channel): one group per ``(head, channel)``, i.e. one channel over all the
  chunk's tokens; ``heads * head_dim`` groups. This isolates K's outlier channels.

Symbols: ``q = clip(round((x - min) / step), 0, 2**b - 1)``; value back: ``min + q * step``.
``min`` is the group minimum rounded *down* to the parameter dtype and ``step`` is
``(max - min) / (2**b - 1)`` rounded *up*, so the group's range is covered and every element is
within ``step / 2`` of its reconstruction (plus float32 rounding of ``min + q * step``).

Prediction (lossless, on the symbols): with the *channel predictor* each ``(head, channel)``
column of symbols along the tokens is coded as residuals ``r[n] = (q[n] - p[n]) mod 2**b`` with
``p[0] = c`` and ``p[n] = (a * q[n-1] + (4 - a) * c + 2) >> 2`` for ``n >= 1``: ``c`` is the
column's centre (its rounded mean symbol) and ``a / 4`` in ``{0, 1/4, 1/2, 3/4, 1}`` its
correlation with the previous token, both chosen by the encoder per column
(:func:`choose_prediction`) and stored in the frame. ``a = 0`` only centres the column (the
columns' histograms line up, which alone lowers the pooled entropy); ``a = 4`` is a plain delta
from the previous token.

Packing: for ``b <= 4`` several values share one byte symbol before entropy coding, so that the
Huffman code works on a larger alphabet (less integer-length waste): ``p = 8 // b`` values per
symbol (b=2: 4, b=3: 2, b=4: 2), first value in the most significant bits; the last symbol is
padded with zero values. See :func:`values_per_symbol`.
"""

from __future__ import annotations

import numba as nb
import numpy as np
import numpy.typing as npt

#: the kernels' array types (numba ignores annotations: they are for the type checker)
_U8 = npt.NDArray[np.uint8]
_F32 = npt.NDArray[np.float32]

AXIS_TOKEN = 1
AXIS_CHANNEL = 2
AXIS_NAMES = {AXIS_TOKEN: "token", AXIS_CHANNEL: "channel"}

PARAM_FP16 = 1
PARAM_FP32 = 2
PARAM_DTYPES: dict[int, np.dtype] = {PARAM_FP16: np.dtype("<f2"), PARAM_FP32: np.dtype("<f4")}

MIN_BITS = 2
MAX_BITS = 8


def values_per_symbol(bits: int) -> int:
    """How many b-bit values one coded symbol packs: ``8 // b`` for ``b <= 4``, else 1."""
    return 8 // bits if bits <= 4 else 1


def num_groups(shape: tuple[int, int, int], axis: int) -> int:
    h, n, d = shape
    return h * n if axis == AXIS_TOKEN else h * d


# ------------------------------------------------------------------------------------------------
# Parameters
# ------------------------------------------------------------------------------------------------
def _round_down(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    y = x.astype(dtype)
    low = y.astype(np.float64) > x
    y[low] = np.nextafter(y[low], dtype.type(-np.inf))
    return y


def _round_up(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    y = x.astype(dtype)
    high = y.astype(np.float64) < x
    y[high] = np.nextafter(y[high], dtype.type(np.inf))
    return y


def quant_params(x: np.ndarray, bits: int, axis: int, param_dtype: int = PARAM_FP16
                 ) -> tuple[np.ndarray, np.ndarray, int]:
    """Per-group ``(mins, steps)`` for ``x`` (float32 ``[H, N, D]``, finite).

    Returns:
        ``(mins, steps, param_dtype)``: arrays of the parameter dtype, shaped ``[H, N]``
        (per token) or ``[H, D]`` (per channel). ``param_dtype`` is upgraded from fp16 to fp32
        when a parameter does not fit fp16.
    """
    reduce_axis = 2 if axis == AXIS_TOKEN else 1
    lo = x.min(axis=reduce_axis).astype(np.float64)
    hi = x.max(axis=reduce_axis).astype(np.float64)
    levels = (1 << bits) - 1
    for code in ((param_dtype, PARAM_FP32) if param_dtype == PARAM_FP16 else (PARAM_FP32,)):
        dt = PARAM_DTYPES[code]
        with np.errstate(over="ignore", invalid="ignore"):
            mins = _round_down(lo, dt)
            steps = _round_up((hi - mins.astype(np.float64)) / levels, dt)
        if np.isfinite(mins).all() and np.isfinite(steps).all():
            return mins, steps, code
    raise ValueError("quantization parameters overflow float32")


@nb.njit(nogil=True, cache=True, boundscheck=False)
def params_valid(mins: _F32, steps: _F32) -> bool:  # pragma: no cover - numba
    """All parameters finite and every step non-negative (flat float32 arrays)."""
    for i in range(mins.size):
        if not (np.isfinite(mins[i]) and np.isfinite(steps[i]) and steps[i] >= 0):
            return False
    return True


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------
@nb.njit(nogil=True, cache=True, boundscheck=False)
def _quantize(x: _F32, mins: _F32, steps: _F32, levels: int, per_token: bool, out: _U8
              ) -> None:  # pragma: no cover - numba
    h_, n_, d_ = x.shape
    for h in range(h_):
        for n in range(n_):
            for d in range(d_):
                if per_token:
                    mn = np.float64(mins[h, n])
                    st = np.float64(steps[h, n])
                else:
                    mn = np.float64(mins[h, d])
                    st = np.float64(steps[h, d])
                q = 0.0
                if st > 0.0:
                    q = np.rint((np.float64(x[h, n, d]) - mn) / st)
                    q = min(max(q, 0.0), np.float64(levels))
                out[h, n, d] = np.uint8(q)


def quantize(x: np.ndarray, mins: np.ndarray, steps: np.ndarray, bits: int, axis: int
             ) -> np.ndarray:
    """``uint8 [H, N, D]`` symbols in ``[0, 2**bits)`` for float32 ``x``."""
    out = np.empty(x.shape, dtype=np.uint8)
    _quantize(x, mins.astype(np.float32), steps.astype(np.float32), (1 << bits) - 1,
              axis == AXIS_TOKEN, out)
    return out


@nb.njit(nogil=True, cache=True, boundscheck=False)
def _reconstruct(syms: _U8, bits: int, per: int, predict: bool, alpha: _U8, center: _U8,
                 mins: _F32, steps: _F32, per_token: bool, limit: np.float32,
                 out: _F32) -> None:  # pragma: no cover - numba
    """Unpacks, undoes the channel prediction and dequantizes, one ``[D]`` row at a time, each
    value clamped to ``[-limit, limit]``.

    ``syms``: packed symbols of the flat values in C order of ``out``'s shape ``[H, M, D]``.
    """
    h_, m_, d_ = out.shape
    mask = np.uint8((1 << bits) - 1)
    shift = np.uint8(bits)
    row = np.empty(d_, dtype=np.uint8)
    prev = np.zeros(d_, dtype=np.int32)
    aligned = d_ % per == 0
    for h in range(h_):
        for n in range(m_):
            base = (h * m_ + n) * d_
            if per == 1:
                for d in range(d_):
                    row[d] = syms[base + d]
            elif aligned and per == 2:
                s0 = base // 2
                for j in range(d_ // 2):
                    s = syms[s0 + j]
                    row[2 * j] = s >> shift
                    row[2 * j + 1] = s & mask
            elif aligned and per == 4:
                s0 = base // 4
                for j in range(d_ // 4):
                    s = syms[s0 + j]
                    row[4 * j] = s >> np.uint8(6)
                    row[4 * j + 1] = (s >> np.uint8(4)) & mask
                    row[4 * j + 2] = (s >> np.uint8(2)) & mask
                    row[4 * j + 3] = s & mask
            else:
                for d in range(d_):
                    i = base + d
                    row[d] = (syms[i // per] >> np.uint8(bits * (per - 1 - i % per))) & mask
            if predict:
                if n == 0:
                    for d in range(d_):
                        q = (np.int32(row[d]) + np.int32(center[h, d])) & np.int32(mask)
                        prev[d] = q
                        row[d] = np.uint8(q)
                else:
                    for d in range(d_):
                        a = np.int32(alpha[h, d])
                        p = (a * prev[d] + (4 - a) * np.int32(center[h, d]) + 2) >> 2
                        q = (np.int32(row[d]) + p) & np.int32(mask)
                        prev[d] = q
                        row[d] = np.uint8(q)
            if per_token:
                mn = mins[h, n]
                st = steps[h, n]
                for d in range(d_):
                    out[h, n, d] = min(max(mn + np.float32(row[d]) * st, -limit), limit)
            else:
                for d in range(d_):
                    out[h, n, d] = min(max(mins[h, d] + np.float32(row[d]) * steps[h, d],
                                           -limit), limit)


FLOAT32_MAX = float(np.finfo(np.float32).max)
"""Largest finite float32: the default clamp of :func:`reconstruct`."""

_NO_PRED = np.zeros((1, 1), dtype=np.uint8)


def reconstruct(syms: np.ndarray, bits: int, mins: np.ndarray, steps: np.ndarray, axis: int,
                out: np.ndarray, alpha: np.ndarray | None = None,
                center: np.ndarray | None = None, limit: float = FLOAT32_MAX) -> None:
    """Packed symbols -> float32 values in ``out`` (``[H, M, D]``, any strides): unpack
    (``values_per_symbol(bits)`` per symbol), undo the channel prediction when ``alpha`` and
    ``center`` (``uint8 [H, D]``) are given, then ``min + q * step`` with the group's
    parameters, clamped to ``[-limit, limit]`` (``limit``: the largest finite value of the
    chunk's dtype, so that no finite frame decodes to an infinity)."""
    if (alpha is None) != (center is None):
        raise ValueError("the channel prediction needs both alpha and center")
    predict = alpha is not None and center is not None
    _reconstruct(syms, bits, values_per_symbol(bits), predict,
                 alpha if alpha is not None else _NO_PRED,
                 center if center is not None else _NO_PRED,
                 np.ascontiguousarray(mins, dtype=np.float32),
                 np.ascontiguousarray(steps, dtype=np.float32), axis == AXIS_TOKEN,
                 np.float32(limit), out)


@nb.njit(nogil=True, cache=True, boundscheck=False)
def _pack(q: _U8, bits: int, per: int, out: _U8) -> None:  # pragma: no cover - numba
    n = q.size
    for s in range(out.size):
        v = np.uint32(0)
        for j in range(per):
            i = s * per + j
            v = v << np.uint32(bits)
            if i < n:
                v |= np.uint32(q[i])
        out[s] = np.uint8(v)


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Packs flat b-bit values into byte symbols (``values_per_symbol(bits)`` per symbol)."""
    per = values_per_symbol(bits)
    q = np.ascontiguousarray(q, dtype=np.uint8).reshape(-1)
    if per == 1:
        return q
    out = np.empty(-(-q.size // per), dtype=np.uint8)
    _pack(q, bits, per, out)
    return out


@nb.njit(nogil=True, cache=True, boundscheck=False)
def _unpack(syms: _U8, bits: int, per: int, out: _U8) -> None:  # pragma: no cover - numba
    n = out.size
    mask = np.uint8((1 << bits) - 1)
    full = n // per
    for s in range(full):
        v = syms[s]
        for j in range(per):
            out[s * per + j] = (v >> np.uint8(bits * (per - 1 - j))) & mask
    for i in range(full * per, n):
        j = i - full * per
        out[i] = (syms[full] >> np.uint8(bits * (per - 1 - j))) & mask


def unpack(syms: np.ndarray, bits: int, n: int) -> np.ndarray:
    """The ``n`` flat b-bit values packed in ``syms``."""
    per = values_per_symbol(bits)
    if per == 1:
        return syms[:n]
    out = np.empty(n, dtype=np.uint8)
    _unpack(syms, bits, per, out)
    return out


# ------------------------------------------------------------------------------------------------
# Channel prediction (lossless, on the symbols)
# ------------------------------------------------------------------------------------------------
@nb.njit(nogil=True, cache=True, boundscheck=False)
def _choose_prediction(q: _U8, bits: int, alpha: _U8, center: _U8
                       ) -> None:  # pragma: no cover - numba
    """Per (head, channel): centre = rounded mean symbol, and the ``a`` in 0..4 whose residuals
    have the lowest empirical entropy (ties: the smaller ``a``).

    The entropy of ``m`` residuals with bin counts ``k`` is ``m log2 m - sum k log2 k``, so the
    lowest is the largest ``sum k log2 k``, read from a table of ``k log2 k`` (no logarithm per
    bin: at 8 bits the 5 x 256 bins' logarithms cost more than the histograms)."""
    h_, m_, d_ = q.shape
    size = 1 << bits
    mask = size - 1
    hist = np.zeros((5, size), dtype=np.int64)
    xlogx = np.zeros(m_ + 1)
    for k in range(2, m_ + 1):
        xlogx[k] = k * np.log2(k)
    for h in range(h_):
        for d in range(d_):
            total = 0
            for n in range(m_):
                total += np.int64(q[h, n, d])
            c = (total + m_ // 2) // m_
            hist[:, :] = 0
            for a in range(5):
                hist[a, (np.int64(q[h, 0, d]) - c) & mask] += 1
            for n in range(1, m_):
                prev = np.int64(q[h, n - 1, d])
                cur = np.int64(q[h, n, d])
                for a in range(5):
                    p = (a * prev + (4 - a) * c + 2) >> 2
                    hist[a, (cur - p) & mask] += 1
            best_a = 0
            best = -1.0
            for a in range(5):
                klogk = 0.0
                for s in range(size):
                    klogk += xlogx[hist[a, s]]
                if klogk > best + 1e-9:
                    best = klogk
                    best_a = a
            alpha[h, d] = best_a
            center[h, d] = c


def choose_prediction(q: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """``(alpha, center)``, ``uint8 [H, D]`` each, for symbols ``q`` (``uint8 [H, M, D]``)."""
    h, _, d = q.shape
    alpha = np.zeros((h, d), dtype=np.uint8)
    center = np.zeros((h, d), dtype=np.uint8)
    _choose_prediction(np.ascontiguousarray(q), bits, alpha, center)
    return alpha, center


@nb.njit(nogil=True, cache=True, boundscheck=False)
def _predict_walk(src: _U8, dst: _U8, bits: int, alpha: _U8, center: _U8, restore: bool
                  ) -> None:  # pragma: no cover - numba
    """``dst = (src -/+ p) mod 2**bits`` per symbol, ``p`` the channel prediction from ``src``'s
    previous token (the centre for the first). ``restore`` false: the residuals of ``src`` into
    ``dst``; true, with ``dst is src``: in place, each token restored before it predicts the
    next. (A branch, not a sign factor: LLVM hoists it out of the loop.)"""
    h_, m_, d_ = src.shape
    mask = np.int32((1 << bits) - 1)
    for h in range(h_):
        for n in range(m_):
            for d in range(d_):
                c = np.int32(center[h, d])
                if n == 0:
                    p = c
                else:
                    a = np.int32(alpha[h, d])
                    p = (a * np.int32(src[h, n - 1, d]) + (4 - a) * c + 2) >> 2
                if restore:
                    dst[h, n, d] = np.uint8((np.int32(src[h, n, d]) + p) & mask)
                else:
                    dst[h, n, d] = np.uint8((np.int32(src[h, n, d]) - p) & mask)


def apply_prediction(q: np.ndarray, bits: int, alpha: np.ndarray, center: np.ndarray
                     ) -> np.ndarray:
    """Residual symbols (``uint8 [H, M, D]``) of ``q`` under the channel predictor."""
    q = np.ascontiguousarray(q)
    out = np.empty_like(q)
    _predict_walk(q, out, bits, alpha, center, False)
    return out


def undo_prediction(values: np.ndarray, bits: int, alpha: np.ndarray, center: np.ndarray
                    ) -> None:
    """Inverts :func:`apply_prediction` in place (``uint8 [H, M, D]``)."""
    _predict_walk(values, values, bits, alpha, center, True)
